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
        match history.rows.get(&op.op) {
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
}
