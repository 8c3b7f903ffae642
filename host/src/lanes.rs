//! The lane scheduler: given one outbox's candidate ops, which may start now.
//!
//! Pure: no I/O and no clock. The rule is the one in the lane-scheduler spec:
//!
//! 1. Walk ops in dispatch order (priority, then sequence).
//! 2. A `ready` op starts if none of its strict lanes is blocked, each of its
//!    serial lanes is under its cap, and the outbox, kind and host caps allow.
//! 3. Every op, started or not and whatever its state, blocks its strict
//!    lanes for every op after it.
//!
//! Ops already in flight occupy their lanes from the start, even for ops
//! that come before them in dispatch order, so a strict lane never has two
//! ops in flight (a critical op enqueued behind an in-flight normal op waits
//! for it). A lane is a resource, not a position in one outbox: ops of other
//! outboxes that are in flight occupy it too (`elsewhere`), although order
//! stays per outbox.
//!
//! **The receipt rule.** An op whose earlier attempt left a receipt in doubt
//! (checkpointed, not proven landed or dead) may still take effect: a
//! transaction queued in the network, a request the peer may have applied.
//! Until its executor reconciles it, it *holds* its lanes, whatever its state
//! and whichever outbox it is in: no other op of any of its lanes starts, in
//! either mode and whatever the caps, and it goes first. It is exempt from
//! the blocking of ops that come before it in dispatch order (they cannot
//! start before it anyway), so a critical op enqueued meanwhile waits for the
//! reconcile instead of deadlocking with it. When several ops hold one lane,
//! the first in dispatch order holds it and the others wait behind it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::Deserialize;

use crate::op::{OpId, Priority};

/// How a lane orders its ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LaneMode {
    /// FIFO that holds under failure: an op waits for every earlier op of
    /// the lane, including ones in backoff, halted or held (seed 000).
    Strict,
    /// Mutual exclusion with an in-flight cap; ops in backoff do not block
    /// later ones (seed 003 signer lanes).
    Serial,
}

/// Whether an op can run now, as far as everything but lanes is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpState {
    /// Claimed and executing.
    InFlight,
    /// Not startable now: backoff, halted subject, open breaker, stalled for
    /// this pass, no executor.
    Waiting,
    /// May start if the lanes and caps allow.
    Ready,
}

/// One lane an op belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Lane {
    /// The lane's name (an inbox URL, a signer account).
    pub name: String,
    /// Its mode (from the op's kind).
    pub mode: LaneMode,
}

/// One candidate op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The op.
    pub id: OpId,
    /// Its tier.
    pub priority: Priority,
    /// Its enqueue sequence.
    pub seq: i64,
    /// Its kind (for per-kind caps).
    pub kind: String,
    /// Its lanes; none means a lane of its own.
    pub lanes: Vec<Lane>,
    /// Its state.
    pub state: OpState,
    /// An earlier attempt left a receipt in doubt: the op holds its lanes
    /// until its executor settles it (the receipt rule).
    pub in_doubt: bool,
}

/// The caps that limit how much runs at once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caps {
    /// In-flight cap per serial lane; absent means 1.
    pub serial: HashMap<String, usize>,
    /// In-flight cap for the outbox, counting ops already in flight.
    pub global: Option<usize>,
    /// In-flight cap per kind, counting ops already in flight.
    pub per_kind: HashMap<String, usize>,
    /// How many more ops may start at all (free host-wide slots).
    pub starts: Option<usize>,
    /// Most ops in flight to one destination host (an op's first URL lane's
    /// authority) across the whole host, so a few slow or hung servers
    /// cannot hold every permit; absent means no cap.
    pub per_destination: Option<usize>,
    /// Ops this host has in flight (or being claimed) to each destination,
    /// this outbox's own included: the load `per_destination` caps.
    pub destination_load: HashMap<String, usize>,
    /// The smaller cap of a destination not in `answered` (first contact,
    /// or its last attempt failed), before what it earned by patience: a
    /// server that never answers holds few permits for most of its
    /// timeout; absent means `per_destination`.
    pub per_unanswered_destination: Option<usize>,
    /// Destinations that answered this host lately.
    pub answered: Arc<HashSet<String>>,
    /// Requests an unanswered destination earned on top of
    /// `per_unanswered_destination` by waiting (`dispatch::load`).
    pub earned: HashMap<String, usize>,
}

impl Caps {
    fn serial_cap(&self, lane: &str) -> usize {
        self.serial.get(lane).copied().unwrap_or(1)
    }

    /// The most ops that may be in flight to `destination`, given `cap`
    /// (`per_destination`).
    fn destination_cap(&self, destination: &str, cap: usize) -> usize {
        match self.per_unanswered_destination {
            Some(first) if !self.answered.contains(destination) => first
                .saturating_add(self.earned.get(destination).copied().unwrap_or(0))
                .min(cap),
            _ => cap,
        }
    }
}

/// How one kind's ops use their lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneRule {
    /// The mode of every lane of the kind's ops.
    pub mode: LaneMode,
    /// Serial lanes: ops in flight per lane (a strict lane's cap is 1).
    pub cap: usize,
}

impl Default for LaneRule {
    fn default() -> Self {
        Self {
            mode: LaneMode::Strict,
            cap: 1,
        }
    }
}

/// Lane rules by kind, from the configuration; a kind not named is strict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneRules(pub HashMap<String, LaneRule>);

impl LaneRules {
    /// The rule of a kind.
    pub fn of(&self, kind: &str) -> LaneRule {
        self.0.get(kind).copied().unwrap_or_default()
    }

    /// An op's lanes with its kind's mode, recording the caps of serial
    /// ones in `caps`.
    pub fn lanes(&self, kind: &str, names: &[String], caps: &mut Caps) -> Vec<Lane> {
        let rule = self.of(kind);
        names
            .iter()
            .map(|name| {
                if rule.mode == LaneMode::Serial {
                    caps.serial.insert(name.clone(), rule.cap);
                }
                Lane {
                    name: name.clone(),
                    mode: rule.mode,
                }
            })
            .collect()
    }
}

/// The ops to start now, in dispatch order.
///
/// `candidates` are the outbox's own ops. `elsewhere` are ops of other
/// outboxes that occupy lanes (in flight, or holding a receipt in doubt):
/// they never start here and count towards no cap of this outbox, but they
/// occupy and hold their lanes like the outbox's own.
pub fn schedule(candidates: &[Candidate], elsewhere: &[Candidate], caps: &Caps) -> Vec<OpId> {
    let mut order: Vec<&Candidate> = candidates.iter().collect();
    order.sort_by_key(|c| key(c));

    // Lanes held by receipts in doubt: the first holder in dispatch order,
    // across outboxes, so that every outbox agrees on who goes first.
    let mut holders: Vec<&Candidate> = candidates.iter().chain(elsewhere).filter(|c| c.in_doubt).collect();
    holders.sort_by_key(|c| key(c));
    let mut held: HashMap<&str, OpId> = HashMap::new();
    for c in holders {
        for lane in &c.lanes {
            held.entry(lane.name.as_str()).or_insert(c.id);
        }
    }

    // Lanes occupied by ops in flight, here and elsewhere.
    let mut busy: HashSet<&str> = HashSet::new();
    let mut serial_load: HashMap<&str, usize> = HashMap::new();
    let mut kind_load: HashMap<&str, usize> = HashMap::new();
    let mut global_load = 0usize;
    for c in candidates
        .iter()
        .chain(elsewhere)
        .filter(|c| c.state == OpState::InFlight)
    {
        for lane in &c.lanes {
            busy.insert(lane.name.as_str());
            *serial_load.entry(lane.name.as_str()).or_default() += 1;
        }
    }
    for c in candidates.iter().filter(|c| c.state == OpState::InFlight) {
        global_load += 1;
        *kind_load.entry(c.kind.as_str()).or_default() += 1;
    }

    // Counted host-wide by the caller, in flight here or not.
    let mut destination_load: HashMap<&str, usize> =
        caps.destination_load.iter().map(|(d, n)| (d.as_str(), *n)).collect();

    let mut blocked: HashSet<&str> = HashSet::new();
    let mut started = Vec::new();
    for c in order {
        let lanes_free = c.lanes.iter().all(|lane| {
            let name = lane.name.as_str();
            let holder_ok = held.get(name).is_none_or(|h| *h == c.id);
            let free = match lane.mode {
                LaneMode::Strict => !busy.contains(name) && (c.in_doubt || !blocked.contains(name)),
                LaneMode::Serial => serial_load.get(name).copied().unwrap_or(0) < caps.serial_cap(name),
            };
            holder_ok && free
        });
        // Parsed only for an op that could otherwise start.
        let startable =
            c.state == OpState::Ready && lanes_free && under_caps(c, caps, &kind_load, global_load, started.len());
        let destination = caps.per_destination.filter(|_| startable).and_then(|_| destination(c));
        let destination_free = match (caps.per_destination, destination) {
            (Some(cap), Some(d)) => destination_load.get(d).copied().unwrap_or(0) < caps.destination_cap(d, cap),
            _ => true,
        };
        if startable && destination_free {
            if let Some(d) = destination {
                *destination_load.entry(d).or_default() += 1;
            }
            started.push(c.id);
            global_load += 1;
            *kind_load.entry(c.kind.as_str()).or_default() += 1;
            for lane in &c.lanes {
                busy.insert(lane.name.as_str());
                *serial_load.entry(lane.name.as_str()).or_default() += 1;
            }
        }
        for lane in c.lanes.iter().filter(|l| l.mode == LaneMode::Strict) {
            blocked.insert(lane.name.as_str());
        }
    }
    started
}

/// Leaves out, while a drain builds its candidates, the ops that cannot
/// change what [`schedule`] starts. Offered in dispatch order, an op that
/// neither occupies nor holds a lane (not in flight, no receipt in doubt)
/// and whose lanes are all strict and all blocked by ops offered before it
/// can neither start (rule 2) nor block a lane that is not blocked already
/// (rule 3). A drain's book holds up to its window of ops, most of them
/// queued behind the head of their lane; without them a round's schedule
/// costs the lanes' heads, not the whole book (the ActivityPub bench: 50
/// lanes, 1,000 ops in the book, the schedule 15% of the host's CPU).
#[derive(Debug, Default)]
pub struct Behind<'a> {
    blocked: HashSet<&'a str>,
}

impl<'a> Behind<'a> {
    /// Room for the lanes of `ops` ops without growing.
    pub fn with_capacity(ops: usize) -> Self {
        Self {
            blocked: HashSet::with_capacity(ops),
        }
    }

    /// Offers the next op in dispatch order: `true` if it can be left out.
    /// `strict`: every lane of the op is strict (one that is not blocks
    /// nothing here, so it is kept); `occupies`: it is in flight or holds a
    /// receipt in doubt.
    pub fn hides(&mut self, lanes: &'a [String], strict: bool, occupies: bool) -> bool {
        if !strict {
            return false;
        }
        if !occupies && !lanes.is_empty() && lanes.iter().all(|l| self.blocked.contains(l.as_str())) {
            return true;
        }
        self.blocked.extend(lanes.iter().map(String::as_str));
        false
    }
}

/// The destination host an op's cap counts against: its first URL lane's
/// authority (the breaker's and destination health's key too).
pub(crate) fn destination(c: &Candidate) -> Option<&str> {
    crate::breaker::first_destination(c.lanes.iter().map(|lane| lane.name.as_str()))
}

/// Dispatch order.
fn key(c: &Candidate) -> (Priority, i64, OpId) {
    (c.priority, c.seq, c.id)
}

fn under_caps(
    c: &Candidate,
    caps: &Caps,
    kind_load: &HashMap<&str, usize>,
    global_load: usize,
    started: usize,
) -> bool {
    caps.global.is_none_or(|cap| global_load < cap)
        && caps
            .per_kind
            .get(&c.kind)
            .is_none_or(|cap| kind_load.get(c.kind.as_str()).copied().unwrap_or(0) < *cap)
        && caps.starts.is_none_or(|cap| started < cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Vector {
        name: String,
        ops: Vec<VectorOp>,
        #[serde(default)]
        lane_modes: HashMap<String, LaneMode>,
        #[serde(default)]
        serial_caps: HashMap<String, usize>,
        global_cap: Option<usize>,
        /// Ops of other outboxes occupying lanes (laneway's own vectors).
        #[serde(default)]
        elsewhere: Vec<VectorOp>,
        expect_started: Vec<String>,
    }

    #[derive(Deserialize)]
    struct VectorOp {
        id: String,
        priority: Priority,
        seq: i64,
        lanes: Vec<String>,
        state: OpState,
        /// The receipt rule (laneway's own vectors).
        #[serde(default)]
        in_doubt: bool,
    }

    /// Feeds every vector of a file to the scheduler.
    fn run_vectors(json: &str, at_least: usize) {
        let vectors: Vec<Vector> = serde_json::from_str(json).expect("vectors parse");
        assert!(vectors.len() >= at_least, "lost vectors: {}", vectors.len());
        for v in vectors {
            let ids: Vec<&str> = v.ops.iter().chain(&v.elsewhere).map(|o| o.id.as_str()).collect();
            let candidate = |(i, o): (usize, &VectorOp)| Candidate {
                id: i as OpId,
                priority: o.priority,
                seq: o.seq,
                kind: "k".into(),
                lanes: o
                    .lanes
                    .iter()
                    .map(|name| Lane {
                        name: name.clone(),
                        mode: v.lane_modes.get(name).copied().unwrap_or(LaneMode::Strict),
                    })
                    .collect(),
                state: o.state,
                in_doubt: o.in_doubt,
            };
            let candidates: Vec<Candidate> = v.ops.iter().enumerate().map(candidate).collect();
            let elsewhere: Vec<Candidate> = v
                .elsewhere
                .iter()
                .enumerate()
                .map(|(i, o)| candidate((i + v.ops.len(), o)))
                .collect();
            let caps = Caps {
                serial: v.serial_caps.clone(),
                global: v.global_cap,
                ..Caps::default()
            };
            let started: Vec<&str> = schedule(&candidates, &elsewhere, &caps)
                .into_iter()
                .map(|i| ids[i as usize])
                .collect();
            assert_eq!(started, v.expect_started, "vector {:?}", v.name);
        }
    }

    /// The spec's worked cases, fed to the scheduler as data.
    #[test]
    fn spec_vectors() {
        run_vectors(include_str!("../testdata/lane-scheduler-vectors.json"), 16);
    }

    /// laneway's own cases: the receipt rule and lanes shared across outboxes.
    #[test]
    fn receipt_and_shared_lane_vectors() {
        run_vectors(include_str!("../testdata/lane-scheduler-receipt-vectors.json"), 12);
    }

    fn strict(name: &str) -> Lane {
        Lane {
            name: name.into(),
            mode: LaneMode::Strict,
        }
    }

    fn cand(id: OpId, priority: Priority, lanes: Vec<Lane>, state: OpState) -> Candidate {
        Candidate {
            id,
            priority,
            seq: id,
            kind: "k".into(),
            lanes,
            state,
            in_doubt: false,
        }
    }

    #[test]
    fn a_critical_op_behind_an_in_flight_op_of_its_strict_lane_waits() {
        let ops = vec![
            cand(1, Priority::Normal, vec![strict("A")], OpState::InFlight),
            cand(2, Priority::Critical, vec![strict("A")], OpState::Ready),
        ];
        assert!(schedule(&ops, &[], &Caps::default()).is_empty());
    }

    #[test]
    fn per_kind_and_start_caps_count() {
        let mut ops: Vec<Candidate> = (1..=4)
            .map(|i| cand(i, Priority::Normal, vec![], OpState::Ready))
            .collect();
        ops[0].state = OpState::InFlight;
        ops[3].kind = "other".into();
        let caps = Caps {
            per_kind: HashMap::from([("k".to_owned(), 2)]),
            ..Caps::default()
        };
        assert_eq!(schedule(&ops, &[], &caps), vec![2, 4]);
        let caps = Caps {
            starts: Some(1),
            ..Caps::default()
        };
        assert_eq!(schedule(&ops, &[], &caps), vec![2]);
    }

    #[test]
    fn a_destination_at_its_cap_lets_the_others_through() {
        // Ops 1-6 go to a hung host (two already in flight from another
        // outbox of this host), 7-8 to a healthy one; each inbox its own
        // strict lane.
        let inbox = |host: &str, n: i64| strict(&format!("https://{host}/users/{n}/inbox"));
        let mut ops: Vec<Candidate> = (1..=6)
            .map(|i| cand(i, Priority::Normal, vec![inbox("hung.example", i)], OpState::Ready))
            .collect();
        ops.push(cand(7, Priority::Normal, vec![inbox("ok.example", 7)], OpState::Ready));
        ops.push(cand(
            8,
            Priority::Normal,
            vec![inbox("ok.example:8443", 8)],
            OpState::Ready,
        ));
        let caps = Caps {
            per_destination: Some(3),
            destination_load: HashMap::from([("hung.example".to_owned(), 2)]),
            ..Caps::default()
        };
        assert_eq!(schedule(&ops, &[], &caps), vec![1, 7, 8]);
        // Without the cap every ready op starts; at its cap nothing more
        // goes to the host at all.
        assert_eq!(schedule(&ops, &[], &Caps::default()).len(), 8);
        let full = Caps {
            destination_load: HashMap::from([("hung.example".to_owned(), 3)]),
            ..caps
        };
        assert_eq!(schedule(&ops, &[], &full), vec![7, 8]);
    }

    #[test]
    fn a_destination_that_has_not_answered_gets_one_op_until_it_does_or_earns_more() {
        let inbox = |host: &str, n: i64| strict(&format!("https://{host}/users/{n}/inbox"));
        let ops: Vec<Candidate> = (1..=4)
            .map(|i| {
                let host = if i <= 2 { "new.example" } else { "known.example" };
                cand(i, Priority::Normal, vec![inbox(host, i)], OpState::Ready)
            })
            .collect();
        let caps = Caps {
            per_destination: Some(8),
            per_unanswered_destination: Some(1),
            answered: Arc::new(HashSet::from(["known.example".to_owned()])),
            ..Caps::default()
        };
        assert_eq!(schedule(&ops, &[], &caps), vec![1, 3, 4]);
        // Its one op in flight: nothing more goes to it.
        let busy = Caps {
            destination_load: HashMap::from([("new.example".to_owned(), 1)]),
            ..caps.clone()
        };
        assert_eq!(schedule(&ops, &[], &busy), vec![3, 4]);
        // Once it answered, the full cap.
        let answered = Caps {
            answered: Arc::new(HashSet::from(["known.example".to_owned(), "new.example".to_owned()])),
            ..busy.clone()
        };
        assert_eq!(schedule(&ops, &[], &answered), vec![1, 2, 3, 4]);
        // Unanswered still, but it earned one more by waiting.
        let earned = Caps {
            earned: HashMap::from([("new.example".to_owned(), 1)]),
            ..busy
        };
        assert_eq!(schedule(&ops, &[], &earned), vec![1, 3, 4]);
    }

    #[test]
    fn an_op_without_lanes_is_unordered() {
        let ops = vec![
            cand(1, Priority::Normal, vec![], OpState::Waiting),
            cand(2, Priority::Normal, vec![], OpState::Ready),
        ];
        assert_eq!(schedule(&ops, &[], &Caps::default()), vec![2]);
    }

    fn lane(n: &str) -> Lane {
        Lane {
            name: n.to_owned(),
            mode: if n.starts_with('S') {
                LaneMode::Serial
            } else {
                LaneMode::Strict
            },
        }
    }

    /// One outbox's candidates, ops of other outboxes that occupy lanes
    /// (ids from 100), and caps. About one op in five holds a receipt in doubt.
    fn arb_candidates() -> impl Strategy<Value = (Vec<Candidate>, Vec<Candidate>, Caps)> {
        let lane_names = ["A", "B", "C", "D", "S1", "S2"];
        let op = (
            0..3usize,
            proptest::sample::subsequence(lane_names.to_vec(), 0..3),
            prop_oneof![Just(OpState::Ready), Just(OpState::Waiting), Just(OpState::InFlight)],
            0..2usize,
            proptest::bool::weighted(0.2),
        );
        let other = (
            0..3usize,
            proptest::sample::subsequence(lane_names.to_vec(), 1..3),
            prop_oneof![Just(OpState::Waiting), Just(OpState::InFlight)],
            proptest::bool::weighted(0.5),
        );
        (
            proptest::collection::vec(op, 0..14),
            proptest::collection::vec(other, 0..3),
            proptest::option::of(1..6usize),
            proptest::option::of(1..4usize),
            1..3usize,
        )
            .prop_map(|(ops, others, global, kind_cap, serial_cap)| {
                let candidates = ops
                    .into_iter()
                    .enumerate()
                    .map(|(i, (p, lanes, state, kind, in_doubt))| Candidate {
                        id: i as OpId,
                        priority: Priority::ALL[p],
                        seq: i as i64,
                        kind: format!("k{kind}"),
                        lanes: lanes.into_iter().map(lane).collect(),
                        state,
                        in_doubt,
                    })
                    .collect();
                // An op elsewhere occupies its lanes: in flight, or in doubt.
                let elsewhere = others
                    .into_iter()
                    .enumerate()
                    .map(|(i, (p, lanes, state, in_doubt))| Candidate {
                        id: 100 + i as OpId,
                        priority: Priority::ALL[p],
                        seq: 100 + i as i64,
                        kind: "k0".into(),
                        lanes: lanes.into_iter().map(lane).collect(),
                        in_doubt: in_doubt || state == OpState::Waiting,
                        state,
                    })
                    .collect();
                let caps = Caps {
                    serial: HashMap::from([("S1".to_owned(), serial_cap)]),
                    global,
                    per_kind: kind_cap
                        .map(|c| HashMap::from([("k0".to_owned(), c)]))
                        .unwrap_or_default(),
                    starts: None,
                    ..Caps::default()
                };
                (candidates, elsewhere, caps)
            })
    }

    fn key(c: &Candidate) -> (Priority, i64) {
        (c.priority, c.seq)
    }

    fn shares(a: &Candidate, b: &Candidate) -> bool {
        a.lanes.iter().any(|l| b.lanes.iter().any(|m| m.name == l.name))
    }

    /// Whether `c` may pass the holds on its lanes: every op in doubt that
    /// shares a lane with it comes after it in dispatch order, and it is in
    /// doubt itself (a holder goes first; nobody else passes a hold).
    fn passes_holds(c: &Candidate, all: &[&Candidate]) -> bool {
        all.iter()
            .filter(|o| o.id != c.id && o.in_doubt && shares(o, c))
            .all(|o| c.in_doubt && key(c) < key(o))
    }

    proptest! {
        /// Safety: what starts is ready, passes every hold, keeps every
        /// strict lane to one op in flight (across outboxes) and to dispatch
        /// order, and respects every cap.
        #[test]
        fn started_ops_respect_lanes_holds_and_caps((ops, elsewhere, caps) in arb_candidates()) {
            let started: HashSet<OpId> = schedule(&ops, &elsewhere, &caps).into_iter().collect();
            let all: Vec<&Candidate> = ops.iter().chain(&elsewhere).collect();
            let running: Vec<&Candidate> =
                all.iter().copied().filter(|c| c.state == OpState::InFlight || started.contains(&c.id)).collect();
            for c in ops.iter().filter(|c| started.contains(&c.id)) {
                prop_assert_eq!(c.state, OpState::Ready);
                prop_assert!(passes_holds(c, &all), "op {} started past a hold", c.id);
                for lane in c.lanes.iter().filter(|l| l.mode == LaneMode::Strict) {
                    for other in all.iter().filter(|o| o.id != c.id && o.lanes.iter().any(|l| l.name == lane.name)) {
                        // Nothing else of the lane runs, and nothing earlier
                        // of this outbox waits unless the op goes first as a holder.
                        prop_assert!(other.state != OpState::InFlight && !started.contains(&other.id));
                        if ops.iter().any(|o| o.id == other.id) && !c.in_doubt {
                            prop_assert!(key(other) > key(c), "op {} started ahead of {}", c.id, other.id);
                        }
                    }
                }
            }
            for (lane, cap) in [("S1", caps.serial_cap("S1")), ("S2", 1)] {
                let load = running.iter().filter(|c| c.lanes.iter().any(|l| l.name == lane)).count();
                let before = all.iter().filter(|c| c.state == OpState::InFlight && c.lanes.iter().any(|l| l.name == lane)).count();
                prop_assert!(load <= cap.max(before), "serial lane {} has {} in flight", lane, load);
            }
            if let Some(cap) = caps.global {
                let before = ops.iter().filter(|c| c.state == OpState::InFlight).count();
                let here = ops.iter().filter(|c| c.state == OpState::InFlight || started.contains(&c.id)).count();
                prop_assert!(here <= cap.max(before));
            }
        }

        /// Leaving out what [`Behind`] hides never changes what starts.
        #[test]
        fn ops_behind_their_lanes_change_nothing((ops, elsewhere, caps) in arb_candidates()) {
            let mut order: Vec<&Candidate> = ops.iter().collect();
            order.sort_by_key(|c| key(c));
            let names: Vec<Vec<String>> = order.iter().map(|c| c.lanes.iter().map(|l| l.name.clone()).collect()).collect();
            let mut behind = Behind::default();
            let kept: Vec<Candidate> = order
                .iter()
                .zip(&names)
                .filter(|(c, names)| {
                    let strict = c.lanes.iter().all(|l| l.mode == LaneMode::Strict);
                    !behind.hides(names, strict, c.state == OpState::InFlight || c.in_doubt)
                })
                .map(|(c, _)| (*c).clone())
                .collect();
            prop_assert_eq!(schedule(&kept, &elsewhere, &caps), schedule(&ops, &elsewhere, &caps));
        }

        /// Liveness: a ready op that did not start was held back by a rule.
        #[test]
        fn every_ready_op_left_out_has_a_reason((ops, elsewhere, caps) in arb_candidates()) {
            let started: HashSet<OpId> = schedule(&ops, &elsewhere, &caps).into_iter().collect();
            let all: Vec<&Candidate> = ops.iter().chain(&elsewhere).collect();
            let running: Vec<&Candidate> =
                all.iter().copied().filter(|c| c.state == OpState::InFlight || started.contains(&c.id)).collect();
            let here: Vec<&&Candidate> = running.iter().filter(|c| c.id < 100).collect();
            for c in ops.iter().filter(|c| c.state == OpState::Ready && !started.contains(&c.id)) {
                let held = !passes_holds(c, &all);
                let strict_blocked = c.lanes.iter().filter(|l| l.mode == LaneMode::Strict).any(|lane| {
                    all.iter().any(|o| o.id != c.id && o.lanes.iter().any(|l| l.name == lane.name)
                        && (o.state == OpState::InFlight || started.contains(&o.id)
                            || (o.id < 100 && key(o) < key(c) && !c.in_doubt)))
                });
                let serial_full = c.lanes.iter().filter(|l| l.mode == LaneMode::Serial).any(|lane| {
                    running.iter().filter(|r| r.lanes.iter().any(|l| l.name == lane.name)).count() >= caps.serial_cap(&lane.name)
                });
                let global_full = caps.global.is_some_and(|cap| here.len() >= cap);
                let kind_full = caps.per_kind.get(&c.kind).is_some_and(|cap| here.iter().filter(|r| r.kind == c.kind).count() >= *cap);
                prop_assert!(held || strict_blocked || serial_full || global_full || kind_full, "op {} was ready and free but did not start", c.id);
            }
        }
    }
}
