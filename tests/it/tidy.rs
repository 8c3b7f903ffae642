//! Repository rules that no compiler checks: every Rust module says what it
//! owns in a `//!` comment, only the queue issues SQL, and only the runtime
//! touches wasmtime.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

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
fn outside(allowed: &[&str], needles: &[&str]) -> anyhow::Result<Vec<String>> {
    let host_src = repo().join("host/src");
    let mut offenders = Vec::new();
    let mut files = Vec::new();
    rust_files(&host_src, &mut files)?;
    for file in files {
        let rel = file.strip_prefix(&host_src)?.to_string_lossy().replace('\\', "/");
        if allowed.iter().any(|a| rel.starts_with(a)) {
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
    // `bench/` is the `laneway bench` tool: its SQL makes and drops scratch
    // schemas, runs the plain job loops it compares laneway with, and acts
    // as a plain-SQL producer would (README's producer contract).
    let offenders = outside(&["queue/", "bench/"], &["sqlx::query", "QueryBuilder"])?;
    anyhow::ensure!(offenders.is_empty(), "SQL outside host/src/queue: {offenders:?}");
    Ok(())
}

#[test]
fn only_the_runtime_touches_wasmtime() -> anyhow::Result<()> {
    let offenders = outside(&["runtime/"], &["wasmtime"])?;
    anyhow::ensure!(offenders.is_empty(), "wasmtime outside host/src/runtime: {offenders:?}");
    Ok(())
}

/// Requirement ids the code cites (`OX-13-011`, `SYNC-15-012`, `IE-06-004`,
/// `EDF-06`) in `text`.
fn cited_ids(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for prefix in ["OX-", "SYNC-", "IE-", "EDF-"] {
        let mut rest = text;
        while let Some(at) = rest.find(prefix) {
            let before = rest[..at].chars().next_back();
            let tail = &rest[at + prefix.len()..];
            let id_len = tail
                .char_indices()
                .take_while(|(i, c)| {
                    c.is_ascii_digit() || (*c == '-' && tail[i + 1..].starts_with(|d: char| d.is_ascii_digit()))
                })
                .count();
            if id_len >= 2 && !before.is_some_and(|c| c.is_ascii_alphanumeric()) {
                found.push(format!("{prefix}{}", &tail[..id_len]));
            }
            rest = &rest[at + prefix.len()..];
        }
    }
    found
}

#[test]
fn design_doc_names_every_cited_requirement() -> anyhow::Result<()> {
    let design = std::fs::read_to_string(repo().join("docs/design.md"))?;
    let mut files = our_sources()?;
    rust_files(&repo().join("plugins"), &mut files)?;
    files.extend(["README.md", "ARCHITECTURE.md", "config/default.toml"].map(|f| repo().join(f)));
    let mut missing = Vec::new();
    let mut cited = 0;
    // This file names ids and seeds as test data.
    for file in files.into_iter().filter(|f| !f.ends_with("tidy.rs")) {
        let text = std::fs::read_to_string(&file)?;
        for id in cited_ids(&text) {
            cited += 1;
            if !design.contains(&id) {
                missing.push(format!("{}: {id}", file.display()));
            }
        }
        for seed in ["seed 001", "seed 004", "seed 005"] {
            if text.contains(seed) {
                missing.push(format!(
                    "{}: {seed} is not a seed docs/design.md states",
                    file.display()
                ));
            }
        }
    }
    anyhow::ensure!(cited > 0, "found no citation at all; is the scan right?");
    anyhow::ensure!(
        missing.is_empty(),
        "cited but not stated in docs/design.md:\n{}",
        missing.join("\n")
    );
    Ok(())
}

#[test]
fn cited_ids_are_found_as_written() {
    assert_eq!(
        cited_ids("seed 002 OX-13-006/011, (SYNC-15-012) and IE-06-004; BOX-1 no"),
        vec!["OX-13-006", "SYNC-15-012", "IE-06-004"]
    );
}

/// The `crate::MODULE` references of one top-level module of the host,
/// outside its `#[cfg(test)]` parts.
fn module_uses(module: &str) -> anyhow::Result<std::collections::BTreeSet<String>> {
    let src = repo().join("host/src");
    let mut files = Vec::new();
    let dir = src.join(module);
    if dir.is_dir() {
        rust_files(&dir, &mut files)?;
    } else {
        files.push(src.join(format!("{module}.rs")));
    }
    let mut uses = std::collections::BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file)?;
        let live = text.split("#[cfg(test)]").next().unwrap_or("");
        let mut rest = live;
        while let Some(at) = rest.find("crate::") {
            let name: String = rest[at + 7..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                uses.insert(name);
            }
            rest = &rest[at + 7..];
        }
    }
    Ok(uses)
}

/// The host's top-level modules.
fn host_modules() -> anyhow::Result<Vec<String>> {
    let mut modules = Vec::new();
    for entry in std::fs::read_dir(repo().join("host/src"))? {
        let path = entry?.path();
        let name = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_dir() || (path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main") {
            modules.push(name);
        }
    }
    modules.sort();
    Ok(modules)
}

/// The module arrows of ARCHITECTURE: the host's top-level modules form no
/// cycle (each layer uses only those below it), and the queue uses nothing
/// of the configuration, the dispatcher, the API, the CLI or the runtime
/// (it owns its own settings).
#[test]
fn modules_depend_only_downward() -> anyhow::Result<()> {
    use std::collections::{BTreeMap, BTreeSet};
    let modules = host_modules()?;
    anyhow::ensure!(modules.len() > 20, "found only {modules:?}");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in &modules {
        let uses = module_uses(m)?.into_iter().filter(|u| modules.contains(u)).collect();
        graph.insert(m.clone(), uses);
    }
    let mut wrong: Vec<String> = graph["queue"]
        .iter()
        .filter(|u| ["config", "dispatch", "api", "cli", "runtime"].contains(&u.as_str()))
        .map(|u| format!("queue -> {u}"))
        .collect();
    // The composition root is at the top: only the commands that start a
    // host (the CLI and the demo) use it, so nothing below it can.
    for (m, uses) in &graph {
        if uses.contains("node") && !["cli", "demo"].contains(&m.as_str()) {
            wrong.push(format!("{m} -> node (only cli and demo start a host)"));
        }
    }
    // A cycle is a module that reaches itself.
    for start in &modules {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in &graph[&at] {
                if next == start {
                    wrong.push(format!("cycle: {} -> {start}", path.join(" -> ")));
                } else if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    anyhow::ensure!(
        wrong.is_empty(),
        "module arrows pointing up or round:\n{}",
        wrong.join("\n")
    );
    Ok(())
}

/// A dialect's SQL blocks by area.
pub(crate) type SqlBlocks = std::collections::BTreeMap<String, Vec<(String, Option<String>)>>;

/// The blocks of one dialect's SQL: per area file, `(name, text)` in order,
/// with `-- none: name: why` lines as `(name, None)` (a statement this
/// dialect does not need, and why).
pub(crate) fn sql_blocks(dialect: &str) -> anyhow::Result<SqlBlocks> {
    let dir = repo().join("host/src/queue/sql").join(dialect);
    let mut areas = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let area = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut blocks: Vec<(String, Option<String>)> = Vec::new();
        for line in std::fs::read_to_string(&path)?.lines() {
            if let Some(name) = line.strip_prefix("-- name:") {
                blocks.push((name.trim().to_owned(), Some(String::new())));
            } else if let Some(rest) = line.strip_prefix("-- none:") {
                let name = rest.split(':').next().unwrap_or("").trim().to_owned();
                anyhow::ensure!(
                    rest.contains(':'),
                    "{dialect}/{area}: `-- none: {name}` gives no reason"
                );
                blocks.push((name, None));
            } else if !line.trim_start().starts_with("--") {
                if let Some((_, Some(text))) = blocks.last_mut() {
                    text.push_str(line);
                    text.push('\n');
                }
            }
        }
        areas.insert(area, blocks);
    }
    anyhow::ensure!(areas.len() >= 5, "{dialect}: found only {:?}", areas.keys());
    Ok(areas)
}

/// Both dialects hold the same statements, by name, in the same order, area
/// by area, so `diff -r host/src/queue/sql/sqlite host/src/queue/sql/postgres`
/// is the whole statement-level difference; a statement one dialect does
/// without is a `-- none:` line in its place, never missing in both.
#[test]
fn the_dialects_hold_the_same_statements_in_the_same_order() -> anyhow::Result<()> {
    let sqlite = sql_blocks("sqlite")?;
    let postgres = sql_blocks("postgres")?;
    let names = |m: &SqlBlocks| -> Vec<(String, Vec<String>)> {
        m.iter()
            .map(|(a, b)| (a.clone(), b.iter().map(|(n, _)| n.clone()).collect()))
            .collect()
    };
    anyhow::ensure!(
        names(&sqlite) == names(&postgres),
        "the dialects' blocks differ:\nsqlite: {:#?}\npostgres: {:#?}",
        names(&sqlite),
        names(&postgres)
    );
    for (area, blocks) in &sqlite {
        for ((name, mine), (_, theirs)) in blocks.iter().zip(&postgres[area]) {
            anyhow::ensure!(
                mine.is_some() || theirs.is_some(),
                "{area}/{name} is `none` in both dialects: delete it"
            );
        }
    }
    Ok(())
}

/// Every statement that changes an op, records an attempt or locks rows to
/// change them binds the statuses it expects and writes (from
/// `Transition`). A read may spell a status only inside the predicate of a
/// partial index the migrations declare: a planner uses a partial index
/// only when it sees the predicate itself, never through a parameter.
#[test]
fn state_changes_bind_their_statuses() -> anyhow::Result<()> {
    let statuses = ["'pending'", "'submitted'", "'confirmed'", "'failed'", "'cancelled'"];
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut wrong = Vec::new();
    let mut writes = 0;
    for dialect in ["sqlite", "postgres"] {
        let mut predicates = Vec::new();
        for entry in std::fs::read_dir(repo().join("migrations").join(dialect))? {
            let text = std::fs::read_to_string(entry?.path())?;
            for statement in text.split(';') {
                let code: String = statement
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("--"))
                    .collect::<Vec<_>>()
                    .join(" ");
                let code = squash(&code);
                if code.to_uppercase().contains(" INDEX ") {
                    if let Some((_, predicate)) = code.split_once(" WHERE ") {
                        predicates.push(predicate.to_owned());
                    }
                }
            }
        }
        anyhow::ensure!(predicates.len() >= 5, "{dialect}: found only {predicates:?}");
        predicates.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for (area, blocks) in sql_blocks(dialect)? {
            for (name, text) in blocks {
                let Some(text) = text else { continue };
                let mut text = squash(&text);
                let upper = text.to_uppercase();
                // (SQLite's tables carry laneway's prefix.)
                if upper.contains("UPDATE OPS")
                    || upper.contains("UPDATE LANEWAY_OPS")
                    || upper.contains("INSERT INTO ATTEMPTS")
                    || upper.contains("INSERT INTO LANEWAY_ATTEMPTS")
                    || upper.contains("FOR UPDATE")
                {
                    writes += 1;
                } else {
                    // Only as a condition: a predicate's text elsewhere (a
                    // select list) is no index's business.
                    for predicate in &predicates {
                        for lead in ["WHERE ", "AND ", "("] {
                            text = text.replace(&format!("{lead}{predicate}"), lead);
                        }
                    }
                }
                if let Some(s) = statuses.iter().find(|s| text.contains(*s)) {
                    wrong.push(format!("{dialect}/{area}/{name}: {s}"));
                }
            }
        }
    }
    anyhow::ensure!(writes > 20, "found only {writes} writing statements");
    anyhow::ensure!(
        wrong.is_empty(),
        "status literals outside partial-index predicates: {wrong:#?}"
    );
    Ok(())
}

/// The decisions are pure (the lane scheduler, the state machine, the
/// retry policy, fee maths, a finished attempt's verdict): no runtime, no
/// queue, no clock, no random numbers, no I/O, so a table test reproduces
/// any of them. Their test modules may use what they like.
#[test]
fn the_decisions_are_pure() -> anyhow::Result<()> {
    let pure = [
        "lanes.rs",
        "op/state.rs",
        "retry.rs",
        "fees.rs",
        "health.rs",
        "dispatch/verdict.rs",
    ];
    let needles = [
        "tokio",
        "crate::queue",
        "Utc::now",
        "Instant::now",
        "SystemTime",
        "rand::",
        "std::fs",
        "std::net",
        "sqlx",
        "reqwest",
        "async fn",
        ".await",
    ];
    let mut wrong = Vec::new();
    for file in pure {
        let text = std::fs::read_to_string(repo().join("host/src").join(file))?;
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for needle in needles {
            if code.contains(needle) {
                wrong.push(format!("{file}: {needle}"));
            }
        }
    }
    anyhow::ensure!(wrong.is_empty(), "{wrong:#?}");
    Ok(())
}

/// The queue stays in files a reader can hold: none over 600 lines, and
/// each dialect's own Rust under 700 in all.
#[test]
fn queue_files_stay_small() -> anyhow::Result<()> {
    let queue = repo().join("host/src/queue");
    let mut files = Vec::new();
    rust_files(&queue, &mut files)?;
    let mut wrong = Vec::new();
    let mut per_dialect = std::collections::BTreeMap::<&str, usize>::new();
    for file in files {
        let lines = std::fs::read_to_string(&file)?.lines().count();
        let rel = file.strip_prefix(&queue)?.to_string_lossy().replace('\\', "/");
        if lines > 600 {
            wrong.push(format!("{rel}: {lines} lines"));
        }
        for dialect in ["sqlite/", "postgres/"] {
            if rel.starts_with(dialect) {
                *per_dialect.entry(dialect).or_default() += lines;
            }
        }
    }
    for (dialect, lines) in per_dialect {
        if lines > 700 {
            wrong.push(format!("{dialect}: {lines} lines of dialect Rust"));
        }
    }
    anyhow::ensure!(wrong.is_empty(), "{wrong:#?}");
    Ok(())
}

/// The drain's parts stay in files a reader can hold (issue 65 moves the
/// rest of `dispatch/` under the same bound): none over 600 lines.
#[test]
fn the_drains_parts_stay_small() -> anyhow::Result<()> {
    let dispatch = repo().join("host/src/dispatch");
    let mut files = vec![dispatch.join("attempt.rs"), dispatch.join("verdict.rs")];
    rust_files(&dispatch.join("pass"), &mut files)?;
    anyhow::ensure!(files.len() >= 6, "{files:?}");
    let mut wrong = Vec::new();
    for file in files {
        let lines = std::fs::read_to_string(&file)?.lines().count();
        if lines > 600 {
            wrong.push(format!("{}: {lines} lines", file.display()));
        }
    }
    anyhow::ensure!(wrong.is_empty(), "{wrong:#?}");
    Ok(())
}

/// Each migration has a version of its own per dialect: two files with one
/// version both run, and the second fails on the history table's key (as
/// happened once, caught only by the PostgreSQL tests).
#[test]
fn migration_versions_are_unique_per_dialect() -> anyhow::Result<()> {
    for dialect in ["sqlite", "postgres"] {
        let mut versions = std::collections::BTreeMap::<String, String>::new();
        for entry in std::fs::read_dir(repo().join("migrations").join(dialect))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let version = name.split('_').next().unwrap_or_default().to_owned();
            if let Some(other) = versions.insert(version.clone(), name.clone()) {
                anyhow::bail!("{dialect}: {name} and {other} share version {version}");
            }
        }
    }
    Ok(())
}

/// The README's route table names every route the API serves, each by its
/// whole method and path (a route missing from it was found from outside).
#[test]
fn the_readme_names_every_route() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(repo().join("README.md"))?;
    let document = laneway::api::openapi_document();
    let paths = document["paths"].as_object().context("paths")?;
    let mut missing = Vec::new();
    for (path, item) in paths {
        for method in item.as_object().context("path item")?.keys() {
            let route = format!("{} {path}", method.to_ascii_uppercase());
            let listed = readme.contains(&format!("`{route}`"))
                || (["get", "post"].contains(&method.as_str()) && readme.contains(&format!("`GET/POST {path}`")));
            if !listed {
                missing.push(route);
            }
        }
    }
    anyhow::ensure!(missing.is_empty(), "README's route table lacks: {missing:?}");
    Ok(())
}
