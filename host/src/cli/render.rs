//! How the CLI shows ops to a person (tables) and to a program (JSON).

use std::io::Write;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{ContentArrangement, Table};
use serde::Serialize;

use super::CliError;
use crate::op::{Attempt, Op};
use crate::queue::{Depth, HaltedSubject, LaneHalt};

/// Longest cell text in a table; the JSON output has everything.
const CELL: usize = 48;

fn cut(text: &str) -> String {
    if text.chars().count() <= CELL {
        text.to_owned()
    } else {
        let mut s: String = text.chars().take(CELL - 1).collect();
        s.push('…');
        s
    }
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.to_vec());
    t
}

/// Pretty JSON, one document.
pub fn json<T: Serialize + ?Sized>(out: &mut dyn Write, value: &T) -> Result<(), CliError> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(|e| CliError::Output(e.into()))?;
    writeln!(out)?;
    Ok(())
}

/// One row per op.
pub fn op_table(out: &mut dyn Write, ops: &[Op]) -> Result<(), CliError> {
    if ops.is_empty() {
        writeln!(out, "no ops match")?;
        return Ok(());
    }
    let mut t = table(&[
        "id",
        "status",
        "priority",
        "kind",
        "outbox",
        "lanes",
        "attempts",
        "next attempt",
        "last error",
    ]);
    for op in ops {
        t.add_row(vec![
            op.id.to_string(),
            op.status.to_string(),
            op.priority.to_string(),
            cut(&op.kind),
            cut(&op.outbox),
            cut(&op.lanes.join(" ")),
            op.attempts.to_string(),
            op.next_attempt_at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
            cut(op.last_error.as_deref().unwrap_or("")),
        ]);
    }
    writeln!(out, "{t}")?;
    Ok(())
}

/// Every field of one op, then its attempts.
pub fn op_detail(out: &mut dyn Write, op: &Op, attempts: &[Attempt]) -> Result<(), CliError> {
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
    let time = |v: Option<chrono::DateTime<chrono::Utc>>| v.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339());
    let fields = [
        ("id", op.id.to_string()),
        ("status", op.status.to_string()),
        ("kind", op.kind.clone()),
        ("outbox", op.outbox.clone()),
        ("priority", op.priority.to_string()),
        ("lanes", op.lanes.join(", ")),
        (
            "attempts",
            format!("{} ({} against the current budget)", op.attempts, op.budget_attempts()),
        ),
        ("fee bumps", op.fee_bumps.to_string()),
        ("next attempt", op.next_attempt_at.to_rfc3339()),
        ("idempotency key", opt(&op.idempotency_key)),
        ("coalesce key", opt(&op.coalesce_key)),
        ("subject", opt(&op.subject)),
        ("correlation id", opt(&op.correlation_id)),
        (
            "lease",
            match (&op.lease_owner, op.lease_until) {
                (Some(owner), Some(until)) => format!("{owner} until {}", until.to_rfc3339()),
                _ => "-".to_owned(),
            },
        ),
        ("receipt", opt(&op.receipt)),
        ("last error", opt(&op.last_error)),
        ("created", op.created_at.to_rfc3339()),
        ("updated", op.updated_at.to_rfc3339()),
        ("finished", time(op.finished_at)),
        ("payload", op.payload.clone()),
    ];
    for (name, value) in fields {
        writeln!(out, "{name:>16}: {value}")?;
    }
    if attempts.is_empty() {
        writeln!(out, "\nno attempts yet")?;
        return Ok(());
    }
    let mut t = table(&["attempt", "outcome", "detail", "fee", "started", "ms", "error"]);
    for a in attempts {
        let r = &a.record;
        t.add_row(vec![
            a.attempt.to_string(),
            r.class.to_string(),
            r.detail.clone().unwrap_or_default(),
            r.fee.map(|f| f.to_string()).unwrap_or_default(),
            r.started_at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
            (r.finished_at - r.started_at).num_milliseconds().to_string(),
            cut(r.error.as_deref().unwrap_or("")),
        ]);
    }
    writeln!(out, "\n{t}")?;
    Ok(())
}

/// Depth by status and priority.
pub fn depth_table(out: &mut dyn Write, depth: &[Depth]) -> Result<(), CliError> {
    if depth.is_empty() {
        writeln!(out, "the queue is empty")?;
        return Ok(());
    }
    let mut t = table(&["status", "priority", "kind", "ops"]);
    for d in depth {
        t.add_row(vec![
            d.status.to_string(),
            d.priority.to_string(),
            cut(&d.kind),
            d.count.to_string(),
        ]);
    }
    writeln!(out, "{t}")?;
    Ok(())
}

/// Lanes held by dead letters.
pub fn halts_table(out: &mut dyn Write, halts: &[LaneHalt]) -> Result<(), CliError> {
    if halts.is_empty() {
        writeln!(out, "no lane is held")?;
        return Ok(());
    }
    let mut t = table(&["outbox", "lane", "dead letter", "since"]);
    for h in halts {
        t.add_row(vec![
            cut(&h.outbox),
            cut(&h.lane),
            h.op_id.to_string(),
            h.halted_at.to_rfc3339(),
        ]);
    }
    writeln!(out, "{t}")?;
    Ok(())
}

/// Halted subjects.
pub fn subjects_table(out: &mut dyn Write, subjects: &[HaltedSubject]) -> Result<(), CliError> {
    if subjects.is_empty() {
        writeln!(out, "no subject is halted")?;
        return Ok(());
    }
    let mut t = table(&["subject", "reason", "since"]);
    for s in subjects {
        t.add_row(vec![
            cut(&s.subject),
            cut(s.reason.as_deref().unwrap_or("")),
            s.halted_at.to_rfc3339(),
        ]);
    }
    writeln!(out, "{t}")?;
    Ok(())
}

/// A command's answer: `value` as one line of JSON with `--json`, else the
/// sentence.
///
/// # Errors
///
/// An I/O error writing it.
pub fn done(out: &mut dyn Write, json: bool, value: &serde_json::Value, text: &str) -> Result<(), CliError> {
    if json {
        writeln!(out, "{value}")?;
    } else {
        writeln!(out, "{text}")?;
    }
    Ok(())
}
