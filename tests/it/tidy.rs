//! Repository rules that no compiler checks: every Rust module says what it
//! owns in a `//!` comment, only the queue issues SQL, and only the runtime
//! touches wasmtime.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn our_sources() -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for dir in ["host", "tests", "examples"] {
        rust_files(&repo().join(dir), &mut files)?;
    }
    anyhow::ensure!(files.len() > 10, "found only {} files; wrong root?", files.len());
    Ok(files)
}

#[test]
fn every_module_starts_with_a_doc_comment_saying_what_it_owns() -> anyhow::Result<()> {
    let mut missing = Vec::new();
    for file in our_sources()? {
        let text = std::fs::read_to_string(&file)?;
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        // build.rs files are scripts, not modules, but get the same rule.
        if !first.starts_with("//!") {
            missing.push(file.display().to_string());
        }
    }
    anyhow::ensure!(missing.is_empty(), "files without a leading //! comment: {missing:#?}");
    Ok(())
}

/// Files under `host/src` outside `allowed/` that mention any of `needles`.
fn outside(allowed: &str, needles: &[&str]) -> anyhow::Result<Vec<String>> {
    let host_src = repo().join("host/src");
    let mut offenders = Vec::new();
    let mut files = Vec::new();
    rust_files(&host_src, &mut files)?;
    for file in files {
        let rel = file.strip_prefix(&host_src)?.to_string_lossy().replace('\\', "/");
        if rel.starts_with(allowed) {
            continue;
        }
        let text = std::fs::read_to_string(&file)?;
        if needles.iter().any(|n| text.contains(n)) {
            offenders.push(rel);
        }
    }
    Ok(offenders)
}

#[test]
fn only_the_queue_issues_sql() -> anyhow::Result<()> {
    let offenders = outside("queue/", &["sqlx::query", "QueryBuilder"])?;
    anyhow::ensure!(offenders.is_empty(), "SQL outside host/src/queue: {offenders:?}");
    Ok(())
}

#[test]
fn only_the_runtime_touches_wasmtime() -> anyhow::Result<()> {
    let offenders = outside("runtime/", &["wasmtime"])?;
    anyhow::ensure!(offenders.is_empty(), "wasmtime outside host/src/runtime: {offenders:?}");
    Ok(())
}
