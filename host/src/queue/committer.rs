//! The host's committer: the rounds of every drain that arrive while a
//! transaction runs are applied together in the next one, as one settle and
//! one claim, and one commit serves them all (River's batch completer, with
//! the claims of the freed lanes in the same transaction). Compiled once per
//! dialect, as `store/` is: SQLite has one writer, so grouping is how its
//! throughput grows with the drains; PostgreSQL would otherwise run one small
//! transaction per drain round, each paying its own statements and commit.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::store::Store;
use super::{sql, Conn, Conns};
use crate::op::OpId;
use crate::queue::dialect::{Dialect, Round, RoundResult};
use crate::queue::{Claimed, Completion, QueueError};

/// Most rounds one group commit takes.
const GROUP_MAX: usize = 64;

/// A round and where its result goes.
type Waiting = (Round, oneshot::Sender<RoundResult>);

/// Where drains hand their rounds to the committer.
#[derive(Debug, Clone)]
pub struct Inbox(Arc<mpsc::UnboundedSender<Waiting>>);

impl Inbox {
    /// Hands a round over and waits for its result.
    pub async fn submit(&self, round: Round) -> RoundResult {
        let closed = || QueueError::Database(sqlx::Error::PoolClosed);
        let (reply, answer) = oneshot::channel();
        self.0.send((round, reply)).map_err(|_| closed())?;
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

async fn run(queue: Store, inbox: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Waiting>>>) {
    let mut waiting: Vec<Waiting> = Vec::with_capacity(GROUP_MAX);
    loop {
        let taken = inbox.lock().await.recv_many(&mut waiting, GROUP_MAX).await;
        if taken == 0 {
            return;
        }
        let (rounds, replies): (Vec<Round>, Vec<_>) = waiting.drain(..).unzip();
        let results = apply_rounds(&queue, &rounds).await;
        for (reply, result) in replies.into_iter().zip(results) {
            // A drain that gave up waiting has nothing left to tell.
            let _ = reply.send(result);
        }
    }
}

/// Applies rounds in one transaction. On SQLite, BEGIN IMMEDIATE serializes
/// every writer of the file, in this process and others, so the occupants a
/// claim reads cannot change before it commits; on PostgreSQL the claim's
/// row locks and advisory lane locks do that against other hosts.
///
/// The rounds are first applied as one: one settle statement for all their
/// completions, one claim for all their ids (one lane check over every op
/// they pick, so ops of different outboxes that exclude each other are
/// admitted in dispatch order, as the scheduler would). The statements per
/// commit are then the same for one round as for sixty, which is what a
/// single writer's throughput depends on. If that fails, it is rolled back
/// and each round is applied in a savepoint of its own, so one round's
/// failure is that round's alone. If a savepoint itself cannot be used
/// (SQLite rolled the whole transaction back, as it does on I/O errors), no
/// later round runs and nothing is committed, so no round is reported failed
/// while its changes stand.
pub(super) async fn apply_rounds(queue: &Store, rounds: &[Round]) -> Vec<RoundResult> {
    let failed = |e: &QueueError| QueueError::Database(sqlx::Error::Protocol(format!("group commit: {e}")));
    let fail_all = |e: &QueueError| rounds.iter().map(|_| Err(failed(e))).collect::<Vec<_>>();
    let mut tx = match queue.conns.write().await {
        Ok(tx) => tx,
        Err(e) => return fail_all(&e),
    };
    let results = match apply_merged(queue, &mut tx, rounds).await {
        Ok(Some(results)) => results,
        Ok(None) => {
            let mut results = Vec::with_capacity(rounds.len());
            for round in rounds {
                match apply_one(queue, &mut tx, round).await {
                    Ok(result) => results.push(result),
                    Err(e) => return fail_all(&e),
                }
            }
            results
        }
        Err(e) => return fail_all(&e),
    };
    if let Err(e) = tx.commit().await {
        return fail_all(&QueueError::from(e));
    }
    results
}

/// The rounds applied as one inside a savepoint: their results, or `None`
/// when they cannot be (they claim under different leases or rules, or a
/// statement failed and was rolled back), or an error of the savepoint
/// itself, which leaves the transaction unusable.
async fn apply_merged(queue: &Store, tx: &mut Conn, rounds: &[Round]) -> Result<Option<Vec<RoundResult>>, QueueError> {
    let Some(first) = rounds.first() else {
        return Ok(Some(Vec::new()));
    };
    if rounds.len() == 1 || rounds.iter().any(|r| r.lease != first.lease || r.rules != first.rules) {
        return Ok(None);
    }
    let merged = Round {
        completions: rounds
            .iter()
            .flat_map(|r| r.completions.iter().cloned())
            .collect::<Vec<Completion>>(),
        ids: rounds.iter().flat_map(|r| r.ids.iter().copied()).collect(),
        follows: rounds.iter().flat_map(|r| r.follows.iter().copied()).collect(),
        lease: first.lease.clone(),
        rules: first.rules.clone(),
    };
    sqlx::query(sql::dispatch::SAVEPOINT).execute(&mut *tx).await?;
    let Ok((settled, claimed)) = queue.apply_round(&mut *tx, &merged).await else {
        sqlx::query(sql::dispatch::ROLLBACK_TO_SAVEPOINT)
            .execute(&mut *tx)
            .await?;
        sqlx::query(sql::dispatch::RELEASE_SAVEPOINT).execute(&mut *tx).await?;
        return Ok(None);
    };
    sqlx::query(sql::dispatch::RELEASE_SAVEPOINT).execute(&mut *tx).await?;
    Ok(Some(split_rounds(rounds, settled, claimed)))
}

/// One round inside its savepoint: the round's own result, or an error of
/// the savepoint itself, which leaves the transaction unusable.
async fn apply_one(queue: &Store, tx: &mut Conn, round: &Round) -> Result<RoundResult, QueueError> {
    sqlx::query(sql::dispatch::SAVEPOINT).execute(&mut *tx).await?;
    let applied = queue.apply_round(&mut *tx, round).await;
    if applied.is_err() {
        sqlx::query(sql::dispatch::ROLLBACK_TO_SAVEPOINT)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query(sql::dispatch::RELEASE_SAVEPOINT).execute(&mut *tx).await?;
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
