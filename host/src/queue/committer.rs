//! The host's committer: the rounds of every drain that arrive while a
//! transaction runs are applied together in the next one, as one settle and
//! one claim, and one commit serves them all (River's batch completer, with
//! the claims of the freed lanes in the same transaction). Shared records'
//! writes (plugins' notes and claims) ride in the same commits. Compiled
//! once per dialect, as `store/` is: SQLite has one writer, so grouping is
//! how its throughput grows with the drains (and a note written in a
//! transaction of its own queued the drains' commits behind it: the slow
//! fediverse bench's 1,000 new servers, a claim and a note each); PostgreSQL
//! would otherwise run one small transaction per drain round, each paying
//! its own statements and commit.

use std::collections::HashMap;
use std::sync::Arc;

use sqlx::pool::PoolConnection;
use tokio::sync::{mpsc, oneshot};

use super::store::{begin_savepoint, end_savepoint, Store};
use super::{Conn, Conns, Db};
use crate::op::OpId;
use crate::queue::dialect::{Dialect, RecordPut, Round, RoundResult};
use crate::queue::{Cas, Claimed, Completion, QueueError};

/// Most rounds and record writes one group commit takes.
const GROUP_MAX: usize = 64;

/// What a record write came to.
type PutResult = Result<Cas, QueueError>;

/// A piece of work and where its result goes.
#[derive(Debug)]
enum Work {
    Round(Round, oneshot::Sender<RoundResult>),
    Put(RecordPut, oneshot::Sender<PutResult>),
}

/// Where drains hand their rounds (and the store its record writes) to the
/// committer.
#[derive(Debug, Clone)]
pub struct Inbox(Arc<mpsc::UnboundedSender<Work>>);

fn closed() -> QueueError {
    QueueError::Database(sqlx::Error::PoolClosed)
}

impl Inbox {
    /// Hands a round over and waits for its result.
    pub async fn submit(&self, round: Round) -> RoundResult {
        let (reply, answer) = oneshot::channel();
        self.0.send(Work::Round(round, reply)).map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }

    /// Hands a record write over and waits for its result.
    pub async fn put(&self, put: RecordPut) -> PutResult {
        let (reply, answer) = oneshot::channel();
        self.0.send(Work::Put(put, reply)).map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }
}

/// The store on `conns` with `workers` committers started on a copy of it
/// (whose own `group` stays `None`, so it applies rounds itself).
pub(super) fn open(
    conns: Conns,
    limits: crate::queue::Limits,
    clock: Arc<dyn crate::clock::Clock>,
    workers: usize,
) -> Store {
    let inbox = start(Store::new(conns.clone(), limits, clock.clone()), workers);
    Store::new(
        Conns {
            group: Some(inbox),
            ..conns
        },
        limits,
        clock,
    )
}

/// Starts `workers` committers on `queue` (whose own copy has no inbox, so
/// it applies rounds itself), taking turns at the inbox: each takes every
/// round waiting when it is free.
fn start(queue: Store, workers: usize) -> Inbox {
    let (tx, rx) = mpsc::unbounded_channel();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    for _ in 0..workers.max(1) {
        tokio::spawn(run(queue.clone(), rx.clone()));
    }
    Inbox(Arc::new(tx))
}

/// Most group commits in a row on one kept writer before it goes back to
/// its pool, where other writers queue for it in turn.
const KEEP_FOR_GROUPS: usize = 16;

async fn run(queue: Store, inbox: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Work>>>) {
    let mut waiting: Vec<Work> = Vec::with_capacity(GROUP_MAX);
    // The writer of the last group, kept while work already waits for the
    // next one: handing a connection back to its pool costs a spawned task
    // and a ping, which the next group would wait for (with the three pings
    // the pool took before: 2 ms of the 5 ms a SQLite group took in the
    // ActivityPub bench, the host's workers busy with plugins).
    let mut kept: Option<PoolConnection<Db>> = None;
    let mut streak = 0usize;
    loop {
        let taken = {
            let mut inbox = inbox.lock().await;
            let mut taken = 0;
            if kept.is_some() {
                while taken < GROUP_MAX {
                    let Ok(work) = inbox.try_recv() else { break };
                    waiting.push(work);
                    taken += 1;
                }
            }
            if taken == 0 {
                // Nothing waits: the writer goes back before this waits.
                kept = None;
                streak = 0;
                taken = inbox.recv_many(&mut waiting, GROUP_MAX).await;
            }
            taken
        };
        if taken == 0 {
            return;
        }
        let (mut rounds, mut round_replies, mut puts, mut put_replies) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for work in waiting.drain(..) {
            match work {
                Work::Round(round, reply) => {
                    rounds.push(round);
                    round_replies.push(reply);
                }
                Work::Put(put, reply) => {
                    puts.push(put);
                    put_replies.push(reply);
                }
            }
        }
        let writer = match kept.take() {
            Some(writer) => Ok(writer),
            None => queue.conns.writer().await,
        };
        let (round_results, put_results) = match writer {
            Ok(mut writer) => {
                let (results, committed) = apply_group_on(&queue, &mut writer, &rounds, &puts).await;
                // Only a writer whose transaction committed is known clean
                // (one that failed goes back to the pool, which checks it
                // before handing it out again).
                if committed && streak < KEEP_FOR_GROUPS {
                    kept = Some(writer);
                    streak += 1;
                } else {
                    streak = 0;
                }
                results
            }
            Err(e) => fail_all(&rounds, &puts, &e),
        };
        // A caller that gave up waiting has nothing left to tell.
        for (reply, result) in round_replies.into_iter().zip(round_results) {
            let _ = reply.send(result);
        }
        for (reply, result) in put_replies.into_iter().zip(put_results) {
            let _ = reply.send(result);
        }
    }
}

/// Every round and record write of a group failed with `e`.
pub(super) fn fail_all(rounds: &[Round], puts: &[RecordPut], e: &QueueError) -> (Vec<RoundResult>, Vec<PutResult>) {
    let failed = || QueueError::Database(sqlx::Error::Protocol(format!("group commit: {e}")));
    (
        rounds.iter().map(|_| Err(failed())).collect(),
        puts.iter().map(|_| Err(failed())).collect(),
    )
}

/// Applies rounds in one transaction on `writer`, and says whether it
/// committed. On SQLite, BEGIN IMMEDIATE serializes
/// every writer of the file, in this process and others, so the occupants a
/// claim reads cannot change before it commits; on PostgreSQL the claim's
/// row locks and advisory lane locks do that against other hosts.
///
/// The rounds are first applied as one: one settle statement for all their
/// completions, one claim for all their ids (one lane check over every op
/// they pick, so ops of different outboxes that exclude each other are
/// admitted in dispatch order, as the scheduler would). The statements per
/// commit are then the same for one round as for sixty, which is what a
/// single writer's throughput depends on. They are applied as one straight
/// in the transaction, with no savepoint around them: the transaction holds
/// nothing else yet, so if that fails the whole transaction is rolled back
/// and begun again, and each round is applied in a savepoint of its own, so
/// one round's failure is that round's alone. Without the savepoint the
/// usual case sends two statements fewer to the writer's thread, and under
/// load each of them waited for a core. If a savepoint itself cannot be used
/// (SQLite rolled the whole transaction back, as it does on I/O errors), no
/// later round runs and nothing is committed, so no round is reported failed
/// while its changes stand.
///
/// Record writes follow the rounds in the same transaction, together in
/// one savepoint, or each in its own if one of them fails.
pub(super) async fn apply_group_on(
    queue: &Store,
    writer: &mut Conn,
    rounds: &[Round],
    puts: &[RecordPut],
) -> ((Vec<RoundResult>, Vec<PutResult>), bool) {
    let began = std::time::Instant::now();
    let mut tx = match begin(writer).await {
        Ok(tx) => tx,
        Err(e) => return (fail_all(rounds, puts, &e), false),
    };
    let opened = began.elapsed();
    // A round alone in its group needs no savepoint: its failure is the
    // group's, and nothing else would commit.
    if let ([round], []) = (rounds, puts) {
        return match queue.apply_round(&mut tx, round).await {
            Ok(result) => match tx.commit().await {
                Ok(()) => ((vec![Ok(result)], Vec::new()), true),
                Err(e) => (fail_all(rounds, puts, &e.into()), false),
            },
            Err(e) => ((vec![Err(e)], Vec::new()), false),
        };
    }
    let mut merged = None;
    if let Some(round) = merge(rounds) {
        match queue.apply_round(&mut tx, &round).await {
            Ok((settled, claimed)) => merged = Some(split_rounds(rounds, settled, claimed)),
            Err(_) => {
                // Only the merged rounds were in it: start again, each
                // round on its own.
                if let Err(e) = tx.rollback().await {
                    return (fail_all(rounds, puts, &e.into()), false);
                }
                tx = match begin(writer).await {
                    Ok(tx) => tx,
                    Err(e) => return (fail_all(rounds, puts, &e), false),
                };
            }
        }
    }
    let results = match merged {
        Some(results) => results,
        None => {
            let mut results = Vec::with_capacity(rounds.len());
            for round in rounds {
                match apply_one(queue, &mut tx, round).await {
                    Ok(result) => results.push(result),
                    Err(e) => return (fail_all(rounds, puts, &e), false),
                }
            }
            results
        }
    };
    let written = match apply_puts(queue, &mut tx, puts).await {
        Ok(written) => written,
        Err(e) => return (fail_all(rounds, puts, &e), false),
    };
    let applied = began.elapsed();
    if let Err(e) = tx.commit().await {
        return (fail_all(rounds, puts, &e.into()), false);
    }
    tracing::debug!(
        rounds = rounds.len(),
        settles = rounds.iter().map(|r| r.completions.len()).sum::<usize>(),
        claims = rounds.iter().map(|r| r.ids.len()).sum::<usize>(),
        open_us = opened.as_micros(),
        apply_us = (applied - opened).as_micros(),
        commit_us = (began.elapsed() - applied).as_micros(),
        puts = puts.len(),
        "Group commit."
    );
    ((results, written), true)
}

/// Record writes in key order (two PostgreSQL committers writing the same
/// records lock them in one order, so they queue rather than deadlock;
/// writes to one key keep their order), one result per write in the order
/// given.
async fn apply_puts(queue: &Store, tx: &mut Conn, puts: &[RecordPut]) -> Result<Vec<PutResult>, QueueError> {
    let mut sorted: Vec<(usize, &RecordPut)> = puts.iter().enumerate().collect();
    sorted.sort_by(|(_, a), (_, b)| (&a.namespace, &a.key).cmp(&(&b.namespace, &b.key)));
    let in_order: Vec<&RecordPut> = sorted.iter().map(|(_, put)| *put).collect();
    let written = apply_sorted_puts(queue, tx, &in_order).await?;
    let mut results: Vec<(usize, PutResult)> = sorted.iter().map(|(i, _)| *i).zip(written).collect();
    results.sort_by_key(|(i, _)| *i);
    Ok(results.into_iter().map(|(_, result)| result).collect())
}

/// Record writes inside one savepoint; if one fails, each again in a
/// savepoint of its own, so its failure is its own. An error of a
/// savepoint itself leaves the transaction unusable.
async fn apply_sorted_puts(queue: &Store, tx: &mut Conn, puts: &[&RecordPut]) -> Result<Vec<PutResult>, QueueError> {
    let count = puts.len();
    if count == 0 {
        return Ok(Vec::new());
    }
    begin_savepoint(tx).await?;
    let mut written = Vec::with_capacity(count);
    for put in puts {
        match queue.apply_put(&mut *tx, put).await {
            Ok(done) => written.push(Ok(done)),
            Err(_) => break,
        }
    }
    if written.len() == count {
        end_savepoint(tx, true).await?;
        return Ok(written);
    }
    end_savepoint(tx, false).await?;
    let mut written = Vec::with_capacity(count);
    for put in puts {
        begin_savepoint(tx).await?;
        let done = queue.apply_put(&mut *tx, put).await;
        end_savepoint(tx, done.is_ok()).await?;
        written.push(done);
    }
    Ok(written)
}

/// Begins a group's transaction on `writer`.
async fn begin(writer: &mut Conn) -> Result<sqlx::Transaction<'_, Db>, QueueError> {
    Ok(sqlx::Transaction::begin(&mut *writer, <Conns as Dialect>::BEGIN.map(Into::into)).await?)
}

/// The rounds as one round, or `None` when they cannot be (one round, or
/// rounds that claim under different leases or rules).
fn merge(rounds: &[Round]) -> Option<Round> {
    let first = rounds.first()?;
    if rounds.len() == 1 || rounds.iter().any(|r| r.lease != first.lease || r.rules != first.rules) {
        return None;
    }
    Some(Round {
        completions: rounds
            .iter()
            .flat_map(|r| r.completions.iter().cloned())
            .collect::<Vec<Completion>>(),
        ids: rounds.iter().flat_map(|r| r.ids.iter().copied()).collect(),
        follows: rounds.iter().flat_map(|r| r.follows.iter().copied()).collect(),
        lease: first.lease.clone(),
        rules: first.rules.clone(),
    })
}

/// One round inside its savepoint: the round's own result, or an error of
/// the savepoint itself, which leaves the transaction unusable.
async fn apply_one(queue: &Store, tx: &mut Conn, round: &Round) -> Result<RoundResult, QueueError> {
    begin_savepoint(tx).await?;
    let applied = queue.apply_round(&mut *tx, round).await;
    end_savepoint(tx, applied.is_ok()).await?;
    Ok(applied)
}

/// Hands each round its share of a merged application: its settles in
/// order, and the claims of its own ids (an op is in one round only: one
/// drain per outbox, one round in flight per drain).
fn split_rounds(rounds: &[Round], settled: Vec<crate::queue::Cas>, claimed: Vec<Claimed>) -> Vec<RoundResult> {
    let mut owner: HashMap<OpId, usize> = HashMap::new();
    for (i, round) in rounds.iter().enumerate() {
        for id in &round.ids {
            owner.insert(*id, i);
        }
    }
    let mut claims: Vec<Vec<Claimed>> = rounds.iter().map(|_| Vec::new()).collect();
    for c in claimed {
        if let Some(list) = owner.get(&c.op.id).and_then(|i| claims.get_mut(*i)) {
            list.push(c);
        }
    }
    let mut settled = settled.into_iter();
    rounds
        .iter()
        .zip(claims)
        .map(|(round, claims)| Ok((settled.by_ref().take(round.completions.len()).collect(), claims)))
        .collect()
}
