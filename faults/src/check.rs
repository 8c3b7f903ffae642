//! The checker: what a faulted run's history proves, as counts. Pure: it
//! reads a [`History`] (what the producer was told, what the fake inboxes
//! received in arrival order, what the database holds at the end) and knows
//! nothing of processes or faults, so that fabricated bad histories can show
//! it fails where laneway would be broken.
//!
//! The promises it checks are GUARANTEES.md's for ActivityPub delivery:
//! every acknowledged op delivered (or it is lost), nothing delivered that
//! was not acknowledged, duplicates only within the crash windows (at most
//! `kills x in_flight`), per-inbox order kept within an outbox (no delivery
//! of an op after a later op of the same lane was delivered), nothing left
//! non-terminal and no row gone.

use std::collections::{BTreeMap, HashMap};

/// An op the producer was told is enqueued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acked {
    /// The op's id (enqueue order within an outbox).
    pub op: i64,
    /// The sending actor.
    pub outbox: String,
    /// The inbox URL: the op's strict lane.
    pub inbox: String,
    /// The activity's `id`.
    pub activity: String,
}

/// One request a fake inbox answered, in the order it answered them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// The full inbox URL it was sent to.
    pub inbox: String,
    /// The activity's `id`, when the body had one.
    pub activity: Option<String>,
    /// The status the fake answered.
    pub status: u16,
}

/// What the database holds for one op at the end. (Not `laneway::op::Status`:
/// the harness links nothing of laneway, and reads the column as text.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pending,
    Submitted,
    Confirmed,
    Failed,
    Cancelled,
}

impl Status {
    /// The `ops.status` column's spelling.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "pending" => Self::Pending,
            "submitted" => Self::Submitted,
            "confirmed" => Self::Confirmed,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }
}

/// An op the pruner archived before deleting it: its archive line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pruned {
    pub op: i64,
    /// Its status when it was archived.
    pub status: Status,
    /// When it finished and when it was archived (ms since the epoch;
    /// `finished_ms` is `None` for an op that never finished).
    pub finished_ms: Option<i64>,
    pub archived_ms: i64,
}

/// Everything one run left behind.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub acked: Vec<Acked>,
    pub arrivals: Vec<Arrival>,
    /// Every op row in the database at the end.
    pub rows: HashMap<i64, Status>,
    /// Crashes of a host while ops were in flight (kill -9, aborts, stalls
    /// past the lease).
    pub kills: u32,
    /// Hosts frozen past their lease and then woken: requests they had in
    /// flight may complete after the lane has moved on.
    pub stalls: u32,
    /// The most ops one host can have in flight: each crash may deliver
    /// that many again.
    pub in_flight: u32,
    /// Answers a network fault dropped after the inbox accepted the
    /// request: each may be delivered again, crash or not.
    pub lost_answers: u64,
    /// Outcome webhooks received (their `webhook-id`s), when the run's
    /// kind has one: each confirmed op must have had its outcome relayed.
    pub webhooks: Option<Vec<String>>,
    /// Ops the pruner archived (and deleted, unless a crash came between),
    /// and the retention their kind had.
    pub pruned: Vec<Pruned>,
    pub retention_ms: i64,
}

/// The op a relayed outcome's `webhook-id` (`msg_OP_CURSOR`) is about.
pub fn webhook_op(id: &str) -> Option<i64> {
    id.strip_prefix("msg_")?.split('_').next()?.parse().ok()
}

/// The checker's counts. A run passes when [`Report::passed`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub acked: usize,
    pub confirmed: usize,
    /// Acknowledged and never delivered, or whose row is gone.
    pub lost: usize,
    /// Acknowledged ops whose row is no longer in the database.
    pub rows_gone: usize,
    /// Accepted deliveries of an op nobody enqueued.
    pub unexpected: usize,
    pub duplicates: usize,
    pub duplicate_bound: usize,
    /// A first delivery of an op after a later op of its outbox and
    /// inbox (a repeat that late is a `late_redelivery`).
    pub order_violations: usize,
    /// A repeat delivery of an op after a later op of its outbox and inbox
    /// was delivered: a frozen host's request completing after it woke.
    pub late_redeliveries: usize,
    /// Stalls x in-flight.
    pub late_bound: usize,
    /// Ops of any kind (webhook ops too) non-terminal at the end.
    pub stuck: usize,
    /// Confirmed ops whose outcome webhook never arrived.
    pub webhooks_missing: usize,
    /// Outcome webhooks received (repeats included), when the run had them.
    pub webhooks: Option<usize>,
    /// Dead-lettered or cancelled (none in a run whose inboxes accept).
    pub not_delivered: usize,
    /// Requests the fakes refused (bad signature, bad body).
    pub refused: usize,
    /// Ops pruned (archived, then deleted).
    pub pruned: usize,
    /// Ops archived for pruning that were not terminal, or not yet past
    /// their retention.
    pub pruned_wrongly: usize,
    /// The first few findings, for the operator to look up.
    pub examples: Vec<String>,
}

const EXAMPLES: usize = 8;

impl Report {
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.rows_gone == 0
            && self.unexpected == 0
            && self.order_violations == 0
            && self.late_redeliveries <= self.late_bound
            && self.stuck == 0
            && self.webhooks_missing == 0
            && self.not_delivered == 0
            && self.refused == 0
            && self.pruned_wrongly == 0
            && self.duplicates <= self.duplicate_bound
    }

    fn note(&mut self, finding: String) {
        if self.examples.len() < EXAMPLES {
            self.examples.push(finding);
        }
    }

    /// The rows of the printed table: (what, count, what it must be).
    pub fn rows(&self) -> Vec<(&'static str, usize, String)> {
        vec![
            ("acknowledged ops", self.acked, "-".to_owned()),
            ("confirmed", self.confirmed, format!("{}", self.acked)),
            ("lost", self.lost, "0".to_owned()),
            ("rows gone", self.rows_gone, "0".to_owned()),
            ("unexpected deliveries", self.unexpected, "0".to_owned()),
            ("duplicates", self.duplicates, format!("<= {}", self.duplicate_bound)),
            (
                "order violations (first deliveries)",
                self.order_violations,
                "0".to_owned(),
            ),
            (
                "late redeliveries (a woken host's)",
                self.late_redeliveries,
                format!("<= {}", self.late_bound),
            ),
            ("stuck non-terminal", self.stuck, "0".to_owned()),
            (
                "outcome webhooks received",
                self.webhooks.unwrap_or(0),
                match self.webhooks {
                    Some(_) => format!(">= {}", self.confirmed),
                    None => "- (no webhook)".to_owned(),
                },
            ),
            ("outcome webhooks missing", self.webhooks_missing, "0".to_owned()),
            ("dead-lettered or cancelled", self.not_delivered, "0".to_owned()),
            ("refused by the inbox", self.refused, "0".to_owned()),
            ("pruned (archived, then deleted)", self.pruned, "-".to_owned()),
            (
                "pruned while open or before retention",
                self.pruned_wrongly,
                "0".to_owned(),
            ),
        ]
    }
}

/// Checks one history.
pub fn check(history: &History) -> Report {
    let mut report = Report {
        acked: 0,
        late_bound: history.stalls as usize * history.in_flight as usize,
        duplicate_bound: history.kills as usize * history.in_flight as usize
            + usize::try_from(history.lost_answers).unwrap_or(usize::MAX),
        ..Report::default()
    };
    // A fan-out repeated after a crash answers the same op: one per id.
    let mut ops: BTreeMap<i64, &Acked> = BTreeMap::new();
    for a in &history.acked {
        ops.entry(a.op).or_insert(a);
    }
    report.acked = ops.len();
    // A pruned op is judged by its archive line once its row is gone; the
    // last line of an id wins, as `laneway archive show` reads it.
    let mut archived: HashMap<i64, &Pruned> = HashMap::new();
    for p in &history.pruned {
        let early = p
            .finished_ms
            .is_none_or(|finished| p.archived_ms - finished < history.retention_ms);
        if matches!(p.status, Status::Pending | Status::Submitted) || early {
            report.pruned_wrongly += 1;
            report.note(format!(
                "op {} was archived for pruning as {:?}, finished {:?}, archived {}",
                p.op, p.status, p.finished_ms, p.archived_ms
            ));
        }
        archived.insert(p.op, p);
    }
    report.pruned = archived.keys().filter(|op| !history.rows.contains_key(op)).count();
    let status_of = |op: i64| {
        history
            .rows
            .get(&op)
            .copied()
            .or_else(|| archived.get(&op).map(|p| p.status))
    };
    let by_key: HashMap<(&str, &str), &Acked> = ops
        .values()
        .map(|a| ((a.inbox.as_str(), a.activity.as_str()), *a))
        .collect();

    let mut delivered: HashMap<i64, usize> = HashMap::new();
    // Per (outbox, inbox): the highest op id delivered so far.
    let mut high: HashMap<(&str, &str), i64> = HashMap::new();
    for arrival in &history.arrivals {
        if !(200..300).contains(&arrival.status) {
            report.refused += 1;
            report.note(format!(
                "{} refused {:?} with {}",
                arrival.inbox, arrival.activity, arrival.status
            ));
            continue;
        }
        let op = arrival
            .activity
            .as_deref()
            .and_then(|activity| by_key.get(&(arrival.inbox.as_str(), activity)));
        let Some(op) = op else {
            report.unexpected += 1;
            report.note(format!(
                "{} accepted {:?}, which was never enqueued for it",
                arrival.inbox, arrival.activity
            ));
            continue;
        };
        let count = delivered.entry(op.op).or_default();
        *count += 1;
        let first = *count == 1;
        let seen = high.entry((op.outbox.as_str(), op.inbox.as_str())).or_insert(op.op);
        if op.op >= *seen {
            *seen = op.op;
        } else if first {
            report.order_violations += 1;
            report.note(format!(
                "{} got op {} for the first time after op {} of the same outbox ({})",
                op.inbox, op.op, seen, op.outbox
            ));
        } else {
            report.late_redeliveries += 1;
            report.note(format!(
                "{} got op {} again after op {} of the same outbox ({})",
                op.inbox, op.op, seen, op.outbox
            ));
        }
    }
    report.duplicates = delivered.values().map(|n| n.saturating_sub(1)).sum();

    let mut open: Vec<&i64> = history
        .rows
        .iter()
        .filter(|(_, status)| matches!(status, Status::Pending | Status::Submitted))
        .map(|(id, _)| id)
        .collect();
    open.sort();
    report.stuck = open.len();
    for id in open.iter().take(3) {
        report.note(format!("op {id} is still not terminal"));
    }
    let relayed: Option<std::collections::HashSet<i64>> = history
        .webhooks
        .as_ref()
        .map(|ids| ids.iter().filter_map(|id| webhook_op(id)).collect());
    report.webhooks = history.webhooks.as_ref().map(Vec::len);
    for op in ops.values() {
        match status_of(op.op) {
            None => {
                report.rows_gone += 1;
                report.lost += 1;
                report.note(format!(
                    "op {} ({} to {}) is gone from the database",
                    op.op, op.activity, op.inbox
                ));
            }
            // Counted with every open op above.
            Some(Status::Pending | Status::Submitted) => {}
            Some(Status::Failed | Status::Cancelled) => {
                report.not_delivered += 1;
                report.note(format!("op {} was dead-lettered or cancelled", op.op));
            }
            Some(Status::Confirmed) => {
                report.confirmed += 1;
                if !delivered.contains_key(&op.op) {
                    report.lost += 1;
                    report.note(format!("op {} is confirmed but {} never got it", op.op, op.inbox));
                }
                if relayed.as_ref().is_some_and(|r| !r.contains(&op.op)) {
                    report.webhooks_missing += 1;
                    report.note(format!("op {} is confirmed but its outcome webhook never came", op.op));
                }
            }
        }
    }
    report
}

/// One Stellar op the producer was told is enqueued: its amount is unique
/// in the run, so a landed transaction names its op by its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StellarAcked {
    pub op: i64,
    pub amount: String,
}

/// A transaction the fake RPC applied successfully.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landed {
    /// The transaction's hash (for a fee bump, the inner transaction's:
    /// what the op's receipt names).
    pub hash: String,
    /// Its source account: the signer, or a channel of the pool.
    pub source: String,
    /// Who paid its fee: a fee bump's fee source, else its source.
    pub fee_source: String,
    /// Its contract call's arguments (i128 as decimal text).
    pub args: Vec<String>,
}

/// What a Stellar run left behind.
#[derive(Debug, Clone, Default)]
pub struct StellarHistory {
    pub acked: Vec<StellarAcked>,
    pub landed: Vec<Landed>,
    /// Every op row at the end: its status and receipt (the hash).
    pub rows: HashMap<i64, (Status, Option<String>)>,
    /// Sends the fake saw while the signer already had a transaction
    /// queued, and sends refused for a bad sequence (neither injected).
    pub concurrent_sends: usize,
    pub bad_seqs: usize,
    /// Transactions whose contract call lacked the signer's valid
    /// authorisation (a channel's payout with an unsigned, forged, expired
    /// or replayed address entry).
    pub auth_failures: usize,
    /// The pool's channel accounts, whose fees the signer pays
    /// (`fee_payer = "signer"`).
    pub channels: std::collections::HashSet<String>,
}

/// The Stellar promises as counts: at most once on the chain, exactly once
/// for a confirmed op, whose receipt is the transaction that landed; one
/// transaction in flight per signer; nothing lost or stuck.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StellarReport {
    pub acked: usize,
    pub confirmed: usize,
    pub landed: usize,
    /// Ops with more than one transaction on the chain.
    pub landed_twice: usize,
    /// Confirmed, yet nothing of theirs landed, or the receipt names
    /// another transaction.
    pub confirmed_not_landed: usize,
    pub receipt_mismatch: usize,
    /// Landed for an op that ended failed or cancelled (an operator would
    /// retry a payment that was made).
    pub landed_but_not_confirmed: usize,
    /// Landed for no acknowledged op.
    pub unexpected: usize,
    pub lost: usize,
    pub stuck: usize,
    pub not_delivered: usize,
    pub concurrent_sends: usize,
    pub bad_seqs: usize,
    pub auth_failures: usize,
    /// Channel transactions that landed with the channel paying the fee.
    pub paid_by_channel: usize,
    pub examples: Vec<String>,
}

impl StellarReport {
    pub fn passed(&self) -> bool {
        self.landed_twice == 0
            && self.confirmed_not_landed == 0
            && self.receipt_mismatch == 0
            && self.landed_but_not_confirmed == 0
            && self.unexpected == 0
            && self.lost == 0
            && self.stuck == 0
            && self.not_delivered == 0
            && self.concurrent_sends == 0
            && self.bad_seqs == 0
            && self.auth_failures == 0
            && self.paid_by_channel == 0
    }

    fn note(&mut self, finding: String) {
        if self.examples.len() < EXAMPLES {
            self.examples.push(finding);
        }
    }

    /// The rows of the printed table.
    pub fn table(&self, title: &str) -> String {
        let rows: Vec<(&str, usize, String)> = vec![
            ("acknowledged ops", self.acked, "-".to_owned()),
            ("confirmed", self.confirmed, format!("{}", self.acked)),
            ("transactions landed", self.landed, format!("{}", self.acked)),
            ("ops landed twice", self.landed_twice, "0".to_owned()),
            ("confirmed, nothing landed", self.confirmed_not_landed, "0".to_owned()),
            ("receipt is not the landed hash", self.receipt_mismatch, "0".to_owned()),
            (
                "landed, op not confirmed",
                self.landed_but_not_confirmed,
                "0".to_owned(),
            ),
            ("landed for no op", self.unexpected, "0".to_owned()),
            ("lost (row gone)", self.lost, "0".to_owned()),
            ("stuck non-terminal", self.stuck, "0".to_owned()),
            ("dead-lettered or cancelled", self.not_delivered, "0".to_owned()),
            (
                "concurrent sends per source account",
                self.concurrent_sends,
                "0".to_owned(),
            ),
            ("bad sequences", self.bad_seqs, "0".to_owned()),
            ("authorisations that did not hold", self.auth_failures, "0".to_owned()),
            (
                "channel fees not paid by the signer",
                self.paid_by_channel,
                "0".to_owned(),
            ),
        ];
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
        table.set_header(vec![title, "count", "must be"]);
        for (what, count, bound) in rows {
            table.add_row(vec![what.to_owned(), count.to_string(), bound]);
        }
        let mut out = table.to_string();
        out.push('\n');
        out.push_str(if self.passed() { "PASSED" } else { "FAILED" });
        for example in &self.examples {
            out.push_str("\n  ");
            out.push_str(example);
        }
        out
    }
}

/// Checks a Stellar run.
pub fn check_stellar(history: &StellarHistory) -> StellarReport {
    let mut report = StellarReport {
        concurrent_sends: history.concurrent_sends,
        bad_seqs: history.bad_seqs,
        auth_failures: history.auth_failures,
        landed: history.landed.len(),
        ..StellarReport::default()
    };
    let mut by_amount: HashMap<&str, i64> = HashMap::new();
    for a in &history.acked {
        by_amount.insert(a.amount.as_str(), a.op);
    }
    report.acked = history
        .acked
        .iter()
        .map(|a| a.op)
        .collect::<std::collections::HashSet<_>>()
        .len();
    let mut landed: HashMap<i64, Vec<&str>> = HashMap::new();
    for tx in &history.landed {
        if history.channels.contains(&tx.fee_source) {
            report.paid_by_channel += 1;
            report.note(format!(
                "{} from channel {} paid by {}",
                tx.hash, tx.source, tx.fee_source
            ));
        }
        match tx.args.iter().find_map(|arg| by_amount.get(arg.as_str())) {
            Some(op) => landed.entry(*op).or_default().push(&tx.hash),
            None => {
                report.unexpected += 1;
                report.note(format!("{} landed for no op ({:?})", tx.hash, tx.args));
            }
        }
    }
    report.stuck = history
        .rows
        .values()
        .filter(|(s, _)| matches!(s, Status::Pending | Status::Submitted))
        .count();
    let ops: BTreeMap<i64, ()> = history.acked.iter().map(|a| (a.op, ())).collect();
    for op in ops.keys() {
        let hashes = landed.get(op).map_or(&[][..], Vec::as_slice);
        if hashes.len() > 1 {
            report.landed_twice += 1;
            report.note(format!("op {op} landed {} times: {hashes:?}", hashes.len()));
        }
        match history.rows.get(op) {
            None => {
                report.lost += 1;
                report.note(format!("op {op} is gone from the database"));
            }
            Some((Status::Confirmed, receipt)) => {
                report.confirmed += 1;
                if hashes.is_empty() {
                    report.confirmed_not_landed += 1;
                    report.note(format!("op {op} is confirmed but nothing of it landed"));
                } else if !receipt.as_deref().is_some_and(|r| hashes.contains(&r)) {
                    report.receipt_mismatch += 1;
                    report.note(format!("op {op}'s receipt {receipt:?} is not what landed ({hashes:?})"));
                }
            }
            Some((Status::Failed | Status::Cancelled, _)) => {
                report.not_delivered += 1;
                if !hashes.is_empty() {
                    report.landed_but_not_confirmed += 1;
                    report.note(format!("op {op} ended failed or cancelled, yet {hashes:?} landed"));
                }
            }
            Some((Status::Pending | Status::Submitted, _)) => {
                report.note(format!("op {op} is still not terminal"));
            }
        }
    }
    report
}

/// The report as the table `./dev test` prints.
pub fn table(title: &str, report: &Report) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    table.set_header(vec![title, "count", "must be"]);
    for (what, count, bound) in report.rows() {
        table.add_row(vec![what.to_owned(), count.to_string(), bound]);
    }
    let mut out = table.to_string();
    out.push('\n');
    out.push_str(if report.passed() { "PASSED" } else { "FAILED" });
    for example in &report.examples {
        out.push_str("\n  ");
        out.push_str(example);
    }
    out
}

#[cfg(test)]
mod tests {
    //! Fabricated histories: what each broken laneway would leave behind,
    //! and a clean one with crashes, to show the checker tells them apart.
    use super::*;

    const INBOX: &str = "http://127.0.0.1:1/users/u0/inbox";
    const OTHER: &str = "http://127.0.0.1:1/users/u1/inbox";

    fn op(op: i64, inbox: &str) -> Acked {
        Acked {
            op,
            outbox: "https://faults.example/actors/0".to_owned(),
            inbox: inbox.to_owned(),
            activity: format!("https://faults.example/a/{op}"),
        }
    }

    fn arrival(op: i64, inbox: &str) -> Arrival {
        Arrival {
            inbox: inbox.to_owned(),
            activity: Some(format!("https://faults.example/a/{op}")),
            status: 202,
        }
    }

    /// Four ops on two inboxes, each delivered once, all confirmed.
    fn clean() -> History {
        let acked = vec![op(1, INBOX), op(2, OTHER), op(3, INBOX), op(4, OTHER)];
        History {
            arrivals: acked.iter().map(|a| arrival(a.op, &a.inbox)).collect(),
            rows: acked.iter().map(|a| (a.op, Status::Confirmed)).collect(),
            acked,
            kills: 0,
            stalls: 0,
            in_flight: 8,
            lost_answers: 0,
            webhooks: None,
            pruned: Vec::new(),
            retention_ms: 3000,
        }
    }

    fn pruned(op: i64, status: Status, finished_ms: Option<i64>, archived_ms: i64) -> Pruned {
        Pruned {
            op,
            status,
            finished_ms,
            archived_ms,
        }
    }

    #[test]
    fn a_clean_history_passes() {
        let report = check(&clean());
        assert!(report.passed(), "{report:?}");
        assert_eq!((report.acked, report.confirmed, report.duplicates), (4, 4, 0));
    }

    #[test]
    fn a_crash_redelivering_its_in_flight_ops_passes_within_the_bound() {
        let mut history = clean();
        // Op 1 delivered, the host killed before its settle, delivered again
        // after the lease; only then does its lane's next op go.
        history.arrivals.insert(1, arrival(1, INBOX));
        history.kills = 1;
        history.in_flight = 1;
        let report = check(&history);
        assert!(report.passed(), "{report:?}");
        assert_eq!(report.duplicates, 1);
    }

    #[test]
    fn an_answer_lost_on_the_way_back_may_deliver_again() {
        let mut history = clean();
        history.arrivals.insert(1, arrival(1, INBOX));
        assert!(!check(&history).passed());
        history.lost_answers = 1;
        assert!(check(&history).passed());
    }

    #[test]
    fn duplicates_past_kills_times_in_flight_fail() {
        // A completer that drops a batch: its ops run again and again.
        let mut history = clean();
        for _ in 0..3 {
            history.arrivals.insert(1, arrival(1, INBOX));
        }
        history.kills = 1;
        history.in_flight = 2;
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.duplicates, report.duplicate_bound), (3, 2));
    }

    #[test]
    fn settling_before_the_side_effect_loses_the_op_a_crash_caught() {
        // Confirmed in the database, never received.
        let mut history = clean();
        history
            .arrivals
            .retain(|a| a.activity.as_deref() != Some("https://faults.example/a/3"));
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.lost, report.confirmed), (1, 4));
    }

    #[test]
    fn a_scheduler_without_the_strict_lane_rule_reorders_an_inbox() {
        let mut history = clean();
        // Op 3 overtook op 1 at their inbox (op 1 in backoff, say).
        history.arrivals = vec![
            arrival(3, INBOX),
            arrival(2, OTHER),
            arrival(1, INBOX),
            arrival(4, OTHER),
        ];
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!(report.order_violations, 1);
    }

    #[test]
    fn a_redelivery_after_the_lanes_next_op_is_an_order_violation() {
        // A stale host's late retry of op 1 after op 3 went: the lane was
        // freed before op 1's settle was durable.
        let mut history = clean();
        history.arrivals.push(arrival(1, INBOX));
        history.kills = 1;
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.late_redeliveries, report.duplicates), (1, 1));
    }

    #[test]
    fn a_woken_hosts_late_request_is_bounded_by_the_stalls() {
        // A host frozen with op 1's request unsent sends it after it wakes,
        // when another host has delivered op 1 and then op 3.
        let mut history = clean();
        history.arrivals.push(arrival(1, INBOX));
        history.kills = 1;
        history.in_flight = 1;
        let report = check(&history);
        assert_eq!((report.late_redeliveries, report.order_violations), (1, 0));
        assert!(!report.passed(), "no stall, so no late request is excused");
        history.stalls = 1;
        assert!(check(&history).passed());
        // A first delivery out of order is never excused.
        history.arrivals = vec![
            arrival(3, INBOX),
            arrival(1, INBOX),
            arrival(2, OTHER),
            arrival(4, OTHER),
        ];
        assert_eq!(check(&history).order_violations, 1);
        assert!(!check(&history).passed());
    }

    #[test]
    fn order_is_per_outbox_so_two_actors_may_interleave_at_one_inbox() {
        let mut history = clean();
        let mut other = op(5, INBOX);
        other.outbox = "https://faults.example/actors/1".to_owned();
        history.acked.push(other);
        history.rows.insert(5, Status::Confirmed);
        history.arrivals.insert(0, arrival(5, INBOX));
        let report = check(&history);
        assert!(report.passed(), "{report:?}");
    }

    #[test]
    fn a_pruner_deleting_a_pending_op_loses_it() {
        let mut history = clean();
        history.rows.remove(&4);
        history.arrivals.pop();
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.rows_gone, report.lost), (1, 1));
    }

    #[test]
    fn an_op_pruned_past_its_retention_is_judged_by_its_archive_line() {
        let mut history = clean();
        history.rows.remove(&4);
        history.pruned.push(pruned(4, Status::Confirmed, Some(1_000), 4_000));
        let report = check(&history);
        assert!(report.passed(), "{report:?}");
        assert_eq!((report.pruned, report.confirmed, report.rows_gone), (1, 4, 0));
    }

    #[test]
    fn a_pruner_archiving_an_open_op_or_one_inside_its_retention_fails() {
        // A pruner that ignores status: the pending op's archive line says so.
        let mut history = clean();
        history.rows.remove(&4);
        history.pruned.push(pruned(4, Status::Pending, None, 4_000));
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!(report.pruned_wrongly, 1);
        // A pruner that ignores the retention: archived 1 s after it finished.
        let mut history = clean();
        history.rows.remove(&4);
        history.pruned.push(pruned(4, Status::Confirmed, Some(3_000), 4_000));
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.pruned_wrongly, report.rows_gone), (1, 0));
    }

    #[test]
    fn a_completer_that_drops_a_batch_leaves_ops_stuck() {
        let mut history = clean();
        history.rows.insert(2, Status::Submitted);
        history.rows.insert(4, Status::Pending);
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!(report.stuck, 2);
    }

    #[test]
    fn a_delivery_nobody_enqueued_is_unexpected() {
        let mut history = clean();
        history.arrivals.push(arrival(9, INBOX));
        // The same activity at the wrong inbox is not its op either.
        history.arrivals.push(arrival(2, INBOX));
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!(report.unexpected, 2);
    }

    #[test]
    fn dead_letters_and_refusals_fail_a_run_whose_inboxes_accept() {
        let mut history = clean();
        history.rows.insert(1, Status::Failed);
        history.arrivals[0].status = 401;
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.not_delivered, report.refused), (1, 1));
    }

    #[test]
    fn an_outcome_webhook_lost_by_the_relay_fails_and_repeats_do_not() {
        let mut history = clean();
        // A relay that stored its cursor before its enqueue committed, and
        // crashed between: op 3's outcome is never sent.
        history.webhooks = Some(vec![
            "msg_1_10".to_owned(),
            "msg_2_11".to_owned(),
            "msg_2_11".to_owned(),
            "msg_4_13".to_owned(),
        ]);
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!((report.webhooks_missing, report.webhooks), (1, Some(4)));
        history
            .webhooks
            .get_or_insert_with(Vec::new)
            .push("msg_3_12".to_owned());
        assert!(check(&history).passed());
    }

    #[test]
    fn an_open_webhook_op_is_stuck_too() {
        let mut history = clean();
        history.rows.insert(99, Status::Submitted);
        let report = check(&history);
        assert!(!report.passed());
        assert_eq!(report.stuck, 1);
    }

    #[test]
    fn the_table_says_failed_and_names_the_findings() {
        let mut history = clean();
        history.rows.remove(&4);
        let text = table("sqlite", &check(&history));
        assert!(text.contains("FAILED"), "{text}");
        assert!(text.contains("op 4"), "{text}");
        assert!(table("sqlite", &check(&clean())).contains("PASSED"));
    }

    fn stellar_clean() -> StellarHistory {
        let acked: Vec<StellarAcked> = (1..=3)
            .map(|op| StellarAcked {
                op,
                amount: format!("{}", 1_000_000 + op),
            })
            .collect();
        StellarHistory {
            landed: acked
                .iter()
                .map(|a| Landed {
                    hash: format!("h{}", a.op),
                    source: "GSIGNER".to_owned(),
                    fee_source: "GSIGNER".to_owned(),
                    args: vec!["ScVal::Address(..)".to_owned(), a.amount.clone()],
                })
                .collect(),
            rows: acked
                .iter()
                .map(|a| (a.op, (Status::Confirmed, Some(format!("h{}", a.op)))))
                .collect(),
            acked,
            concurrent_sends: 0,
            bad_seqs: 0,
            auth_failures: 0,
            channels: std::collections::HashSet::from(["GCHANNEL".to_owned()]),
        }
    }

    #[test]
    fn a_clean_stellar_history_passes() {
        let report = check_stellar(&stellar_clean());
        assert!(report.passed(), "{report:?}");
        assert_eq!((report.acked, report.confirmed, report.landed), (3, 3, 3));
    }

    #[test]
    fn a_payment_signed_again_after_a_crash_lands_twice_and_fails() {
        // A host that re-signs with a new sequence instead of reconciling
        // the checkpointed hash.
        let mut history = stellar_clean();
        let mut again = history.landed[1].clone();
        again.hash = "h2-again".to_owned();
        history.landed.push(again);
        let report = check_stellar(&history);
        assert!(!report.passed());
        assert_eq!(report.landed_twice, 1);
    }

    #[test]
    fn a_payment_dead_lettered_after_it_landed_fails() {
        // A reconcile that gave up on NOT_FOUND while the transaction was
        // still within its bounds.
        let mut history = stellar_clean();
        history.rows.insert(3, (Status::Failed, None));
        let report = check_stellar(&history);
        assert!(!report.passed());
        assert_eq!((report.landed_but_not_confirmed, report.not_delivered), (1, 1));
    }

    #[test]
    fn a_confirmed_payment_that_never_landed_or_names_another_hash_fails() {
        let mut history = stellar_clean();
        history.landed.remove(0);
        history.rows.insert(2, (Status::Confirmed, Some("h9".to_owned())));
        let report = check_stellar(&history);
        assert!(!report.passed());
        assert_eq!((report.confirmed_not_landed, report.receipt_mismatch), (1, 1));
    }

    #[test]
    fn two_transactions_of_one_signer_in_flight_fail_even_when_each_landed_once() {
        let mut history = stellar_clean();
        history.concurrent_sends = 1;
        assert!(!check_stellar(&history).passed());
        let mut history = stellar_clean();
        history.rows.insert(2, (Status::Submitted, Some("h2".to_owned())));
        let report = check_stellar(&history);
        assert_eq!(report.stuck, 1);
        assert!(!report.passed());
    }

    #[test]
    fn a_channel_payout_without_the_signers_valid_authorisation_fails() {
        // A plugin that sent a channel's transaction with the address
        // entry unsigned, or replayed an old one.
        let mut history = stellar_clean();
        history.auth_failures = 1;
        let report = check_stellar(&history);
        assert!(!report.passed());
        assert_eq!(report.auth_failures, 1);
    }

    #[test]
    fn a_channel_paying_its_own_fee_fails_a_pool_whose_signer_pays() {
        // The vault sent a channel's transaction bare (not in the signer's
        // fee bump): the channel, holding only its reserve, paid.
        let mut history = stellar_clean();
        history.landed[0].source = "GCHANNEL".to_owned();
        assert!(check_stellar(&history).passed(), "the signer paid: {history:?}");
        history.landed[0].fee_source = "GCHANNEL".to_owned();
        let report = check_stellar(&history);
        assert!(!report.passed());
        assert_eq!(report.paid_by_channel, 1);
    }
}
