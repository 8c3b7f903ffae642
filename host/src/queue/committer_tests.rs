//! Tests of the host's committer (`committer.rs`) on SQLite, kept out of the
//! dialect's directory: they drive its `apply_group` against a scratch
//! database file.

use std::time::Duration;

use super::committer::{apply_group_on, fail_all};
use super::*;
use crate::clock::SystemClock;
use crate::lanes::LaneRules;
use crate::op::OpId;
use crate::queue::dialect::RecordPut;
use crate::queue::dialect::RoundResult;
use crate::queue::Completion;
use crate::queue::{Cas, Expect, LeaseSpec, NewOp, OpStore, RecordStore};

/// The committer's group commit on a writer from the pool.
async fn apply_group(
    queue: &SqliteQueue,
    rounds: &[Round],
    puts: &[RecordPut],
) -> (Vec<RoundResult>, Vec<Result<Cas, QueueError>>) {
    match queue.conns.writer().await {
        Ok(mut writer) => apply_group_on(queue, &mut writer, rounds, puts).await.0,
        Err(e) => fail_all(rounds, puts, &e),
    }
}

/// Rounds alone, applied as one group commit.
async fn apply_rounds(queue: &SqliteQueue, rounds: &[Round]) -> Vec<RoundResult> {
    apply_group(queue, rounds, &[]).await.0
}

/// A queue on a scratch file, and the ids of `n` pending ops.
async fn scratch_queue(dir: &std::path::Path, n: usize) -> anyhow::Result<(SqliteQueue, Vec<OpId>)> {
    let url = format!("sqlite://{}", dir.join("q.db").display());
    let config = crate::queue::DatabaseConfig {
        url,
        max_connections: 2,
        connect_timeout_ms: 5_000,
        schema: None,
        lock_timeout_ms: 5_000,
        sqlite: crate::queue::SqliteConfig {
            synchronous: crate::queue::Synchronous::Full,
            busy_timeout_ms: 5_000,
            watch_ms: 0,
        },
    };
    let queue = SqliteQueue::open(&config, crate::queue::Limits::default(), Arc::new(SystemClock)).await?;
    queue.migrate().await?;
    let ops: Vec<NewOp> = (0..n).map(|_| NewOp::new("o", "k", "{}")).collect();
    let ids = queue.enqueue(&ops).await?.iter().map(|e| e.id()).collect();
    Ok((queue, ids))
}

/// Every later write of `op` aborts (a trigger).
async fn refuse_writes_of(queue: &SqliteQueue, op: OpId) -> anyhow::Result<()> {
    sqlx::query(&format!(
        "CREATE TRIGGER refuse BEFORE UPDATE ON laneway_ops WHEN OLD.id = {op} BEGIN SELECT RAISE(ABORT, 'refused'); END"
    ))
    .execute(queue.pool())
    .await?;
    Ok(())
}

fn round(ids: &[OpId]) -> Round {
    Round {
        completions: Vec::new(),
        ids: ids.to_vec(),
        follows: Vec::new(),
        lease: LeaseSpec {
            owner: "test".to_owned(),
            duration: Duration::from_secs(60),
        },
        rules: LaneRules::default(),
    }
}

/// Each op's status, in the order of `ops`.
async fn statuses(queue: &SqliteQueue, ops: &[OpId]) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::with_capacity(ops.len());
    for op in ops {
        out.push(
            sqlx::query_scalar("SELECT status FROM laneway_ops WHERE id = ?1")
                .bind(op)
                .fetch_one(queue.pool())
                .await?,
        );
    }
    Ok(out)
}

#[tokio::test]
async fn a_group_applied_as_one_claims_for_every_round_in_one_commit() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (queue, ids) = scratch_queue(dir.path(), 3).await?;
    let results = apply_rounds(&queue, &[round(&ids[..1]), round(&ids[1..])]).await;
    let claimed: Vec<Vec<OpId>> = results
        .into_iter()
        .map(|r| r.map(|(_, claims)| claims.iter().map(|c| c.op.id).collect()))
        .collect::<Result<_, _>>()?;
    assert_eq!(claimed, [ids[..1].to_vec(), ids[1..].to_vec()]);
    assert_eq!(statuses(&queue, &ids).await?, ["submitted"; 3]);
    Ok(())
}

#[tokio::test]
async fn a_failing_round_of_a_group_fails_alone_and_the_others_commit() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (queue, ids) = scratch_queue(dir.path(), 3).await?;
    refuse_writes_of(&queue, ids[1]).await?;
    let results = apply_rounds(&queue, &[round(&ids[..1]), round(&ids[1..2]), round(&ids[2..])]).await;
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(results[1].is_err(), "the refused round fails: {:?}", results[1]);
    assert!(results[2].is_ok(), "{:?}", results[2]);
    assert_eq!(statuses(&queue, &ids).await?, ["submitted", "pending", "submitted"]);
    Ok(())
}

/// A confirmation of the attempt under `lease`.
fn confirmation(lease: crate::op::Lease) -> Completion {
    let now = chrono::Utc::now();
    Completion {
        lease,
        finish: crate::queue::Finish::Confirm { receipt: None },
        attempt: crate::op::AttemptRecord {
            started_at: now,
            finished_at: now,
            class: crate::op::AttemptClass::Confirmed,
            detail: None,
            fee: None,
            error: None,
        },
    }
}

/// Three pending ops: the first claimed, every later write of the third
/// refused.
async fn first_claimed_third_refused(
    dir: &std::path::Path,
) -> anyhow::Result<(SqliteQueue, Vec<OpId>, crate::queue::Claimed)> {
    let (queue, ids) = scratch_queue(dir, 3).await?;
    let claimed = match apply_rounds(&queue, &[round(&ids[..1])]).await.pop() {
        Some(Ok((_, mut claims))) => claims.pop().ok_or_else(|| anyhow::anyhow!("nothing claimed"))?,
        other => anyhow::bail!("the first claim failed: {other:?}"),
    };
    refuse_writes_of(&queue, ids[2]).await?;
    Ok((queue, ids, claimed))
}

/// The rounds applied as one run with no savepoint around them: when they
/// fail after a settle applied, the whole transaction is undone before each
/// round runs alone, so that settle applies once, in its own round's turn,
/// and is not reported stale.
#[tokio::test]
async fn a_failing_group_is_undone_before_its_rounds_run_alone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (queue, ids, claimed) = first_claimed_third_refused(dir.path()).await?;
    let mut settling = round(&ids[1..2]);
    settling.completions.push(confirmation(claimed.lease));
    let results = apply_rounds(&queue, &[settling, round(&ids[2..])]).await;
    match &results[0] {
        Ok((settled, claims)) => {
            assert_eq!(settled, &[Cas::Applied]);
            assert_eq!(claims.iter().map(|c| c.op.id).collect::<Vec<_>>(), [ids[1]]);
        }
        Err(e) => anyhow::bail!("the settling round failed: {e}"),
    }
    assert!(results[1].is_err(), "the refused round fails: {:?}", results[1]);
    assert_eq!(statuses(&queue, &ids).await?, ["confirmed", "submitted", "pending"]);
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM laneway_attempts WHERE op_id = ?1")
        .bind(ids[0])
        .fetch_one(queue.pool())
        .await?;
    assert_eq!(attempts, 1, "one attempt row for the one settle");
    Ok(())
}

#[tokio::test]
async fn a_lone_failing_round_changes_nothing_not_even_its_settles() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (queue, ids, claimed) = first_claimed_third_refused(dir.path()).await?;
    // The settle applies, then the claim of the refused op aborts.
    let settle = confirmation(claimed.lease);
    let mut failing = round(&ids[1..]);
    failing.completions.push(settle.clone());
    let results = apply_rounds(&queue, &[failing]).await;
    assert!(results[0].is_err(), "{:?}", results[0]);
    // The round is one transaction: its settle and its other claim are
    // undone with it.
    assert_eq!(statuses(&queue, &ids).await?, ["submitted", "pending", "pending"]);
    // The writer is usable afterwards, and the settle still applies.
    let mut retry = round(&ids[1..2]);
    retry.completions.push(settle);
    let results = apply_rounds(&queue, &[retry]).await;
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert_eq!(statuses(&queue, &ids[..2]).await?, ["confirmed", "submitted"]);
    Ok(())
}

#[tokio::test]
async fn a_writer_left_inside_a_transaction_is_replaced_not_reused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (queue, ids) = scratch_queue(dir.path(), 1).await?;
    // SQLite ends the transaction (as it does itself on an I/O error or
    // a full disk), so the ROLLBACK sqlx sends when it is dropped fails
    // and sqlx still counts it open.
    let mut tx = queue.conns.write().await?;
    sqlx::query("ROLLBACK").execute(&mut *tx).await?;
    drop(tx);
    let results = apply_rounds(&queue, &[round(&ids)]).await;
    assert!(results[0].is_ok(), "the next write works: {:?}", results[0]);
    assert_eq!(statuses(&queue, &ids).await?, ["submitted"]);
    Ok(())
}

fn put(key: &str, expect: Expect) -> RecordPut {
    RecordPut {
        namespace: "note:ap".to_owned(),
        key: key.to_owned(),
        value: format!("\"{key}\""),
        expect,
    }
}

#[tokio::test]
async fn record_writes_ride_in_a_group_commit_and_a_failing_one_fails_alone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (queue, ids) = scratch_queue(dir.path(), 2).await?;
    queue.put_record("note:ap", "taken", "1", Expect::Any).await?;
    sqlx::query("CREATE TRIGGER refuse_note BEFORE INSERT ON laneway_records WHEN NEW.key = 'bad' BEGIN SELECT RAISE(ABORT, 'refused'); END")
        .execute(queue.pool())
        .await?;
    let puts = [
        put("a", Expect::Absent),
        put("bad", Expect::Any),
        put("taken", Expect::Absent),
        put("b", Expect::Any),
    ];
    let (rounds, written) = apply_group(&queue, &[round(&ids)], &puts).await;
    assert!(rounds[0].is_ok(), "{:?}", rounds[0]);
    assert!(matches!(written[0], Ok(Cas::Applied)), "{:?}", written[0]);
    assert!(written[1].is_err(), "the refused write fails: {:?}", written[1]);
    assert!(
        matches!(written[2], Ok(Cas::Stale)),
        "a lost compare-and-set is not an error: {:?}",
        written[2]
    );
    assert!(matches!(written[3], Ok(Cas::Applied)), "{:?}", written[3]);
    assert_eq!(statuses(&queue, &ids).await?, ["submitted"; 2]);
    for (key, value) in [
        ("a", Some("\"a\"")),
        ("bad", None),
        ("taken", Some("1")),
        ("b", Some("\"b\"")),
    ] {
        let stored = queue.record("note:ap", key).await?.map(|r| r.value);
        assert_eq!(stored.as_deref(), value, "{key}");
    }
    Ok(())
}

#[tokio::test]
async fn the_committer_gives_its_writer_back_when_nothing_waits() -> anyhow::Result<()> {
    use anyhow::Context as _;
    let dir = tempfile::tempdir()?;
    let (queue, ids) = scratch_queue(dir.path(), 40).await?;
    let inbox = queue.conns.group.clone().context("the queue has a committer")?;
    // Rounds that arrive together: the committer keeps its writer from one
    // group to the next while they wait.
    let sent: Vec<_> = ids
        .iter()
        .map(|id| {
            let (inbox, round) = (inbox.clone(), round(&[*id]));
            tokio::spawn(async move { inbox.submit(round).await })
        })
        .collect();
    for round in sent {
        let (_, claimed) = round.await??;
        assert_eq!(claimed.len(), 1);
    }
    assert_eq!(statuses(&queue, &ids).await?, vec!["submitted"; ids.len()]);
    // Idle: the writer is back in its pool for every other writer.
    let writer = tokio::time::timeout(Duration::from_secs(2), queue.conns.writer()).await;
    assert!(matches!(writer, Ok(Ok(_))), "the idle committer still holds the writer");
    Ok(())
}
