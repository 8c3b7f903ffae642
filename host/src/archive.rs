//! The op archive. Before the pruner deletes an op of a kind with
//! `archive = "DIR"`, it appends the op (payload included) and its attempt
//! history as one JSON line to `DIR/YYYY-MM-DD.jsonl` (the day it was
//! archived) and syncs the file; `laneway archive show ID` finds it again.
//!
//! The line is written and synced before the delete commits, so a crash
//! between the two leaves the op in the database and a line in the archive
//! that the next pass writes again: an id may appear twice, never zero
//! times. A reader takes the last line for an id.

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde_json::{json, Value};

use crate::op::{Attempt, Op, OpId};

/// Why the archive could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// A file or directory could not be used.
    #[error("archive {path}: {source}")]
    Io {
        /// Which.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// An op would not serialize (it always does; reported rather than lost).
    #[error("archive: {0}")]
    Encode(#[from] serde_json::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Appends each op with its attempts to today's file in `dir` and syncs it.
///
/// # Errors
///
/// [`ArchiveError`]; then nothing may be deleted.
pub fn append(dir: &Path, records: &[(Op, Vec<Attempt>)], now: DateTime<Utc>) -> Result<(), ArchiveError> {
    if records.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(format!("{}.jsonl", now.format("%Y-%m-%d")));
    let mut text = String::new();
    for (op, attempts) in records {
        text.push_str(&serde_json::to_string(&json!({
            "archived_at": now,
            "op": op,
            "attempts": attempts,
        }))?);
        text.push('\n');
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io(&path))?;
    file.write_all(text.as_bytes()).map_err(io(&path))?;
    file.sync_all().map_err(io(&path))?;
    Ok(())
}

/// The last archived record of op `id` in `dir`, if any.
///
/// # Errors
///
/// [`ArchiveError::Io`] for a directory or file that cannot be read.
pub fn find(dir: &Path, id: OpId) -> Result<Option<Value>, ArchiveError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut found = None;
    for path in files {
        let file = std::fs::File::open(&path).map_err(io(&path))?;
        for line in std::io::BufReader::new(file).lines() {
            let line = line.map_err(io(&path))?;
            // A line torn by a crash mid-write is skipped, not fatal.
            let Ok(record) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if record["op"]["id"].as_i64() == Some(id) {
                found = Some(record);
            }
        }
    }
    Ok(found)
}
