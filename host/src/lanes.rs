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
//! Ops already in flight block their strict lanes from the start, even for
//! ops that come before them in dispatch order, so a strict lane never has
//! two ops in flight (a critical op enqueued behind an in-flight normal op
//! waits for it).

use std::collections::{HashMap, HashSet};

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
}

impl Caps {
    fn serial_cap(&self, lane: &str) -> usize {
        self.serial.get(lane).copied().unwrap_or(1)
    }
}

/// The ops to start now, in dispatch order.
pub fn schedule(candidates: &[Candidate], caps: &Caps) -> Vec<OpId> {
    let mut order: Vec<&Candidate> = candidates.iter().collect();
    order.sort_by_key(|c| (c.priority, c.seq, c.id));

    let mut blocked: HashSet<&str> = HashSet::new();
    let mut serial_load: HashMap<&str, usize> = HashMap::new();
    let mut kind_load: HashMap<&str, usize> = HashMap::new();
    let mut global_load = 0usize;
    for c in candidates.iter().filter(|c| c.state == OpState::InFlight) {
        global_load += 1;
        *kind_load.entry(c.kind.as_str()).or_default() += 1;
        for lane in &c.lanes {
            match lane.mode {
                LaneMode::Strict => {
                    blocked.insert(lane.name.as_str());
                }
                LaneMode::Serial => *serial_load.entry(lane.name.as_str()).or_default() += 1,
            }
        }
    }

    let mut started = Vec::new();
    for c in order {
        if c.state == OpState::Ready && admits(c, caps, &blocked, &serial_load, &kind_load, global_load, started.len())
        {
            started.push(c.id);
            global_load += 1;
            *kind_load.entry(c.kind.as_str()).or_default() += 1;
            for lane in c.lanes.iter().filter(|l| l.mode == LaneMode::Serial) {
                *serial_load.entry(lane.name.as_str()).or_default() += 1;
            }
        }
        for lane in c.lanes.iter().filter(|l| l.mode == LaneMode::Strict) {
            blocked.insert(lane.name.as_str());
        }
    }
    started
}

fn admits(
    c: &Candidate,
    caps: &Caps,
    blocked: &HashSet<&str>,
    serial_load: &HashMap<&str, usize>,
    kind_load: &HashMap<&str, usize>,
    global_load: usize,
    started: usize,
) -> bool {
    let lanes_free = c.lanes.iter().all(|lane| match lane.mode {
        LaneMode::Strict => !blocked.contains(lane.name.as_str()),
        LaneMode::Serial => serial_load.get(lane.name.as_str()).copied().unwrap_or(0) < caps.serial_cap(&lane.name),
    });
    lanes_free
        && caps.global.is_none_or(|cap| global_load < cap)
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
        expect_started: Vec<String>,
    }

    #[derive(Deserialize)]
    struct VectorOp {
        id: String,
        priority: Priority,
        seq: i64,
        lanes: Vec<String>,
        state: OpState,
    }

    /// The spec's worked cases, fed to the scheduler as data.
    #[test]
    fn spec_vectors() {
        let vectors: Vec<Vector> =
            serde_json::from_str(include_str!("../testdata/lane-scheduler-vectors.json")).expect("vectors parse");
        assert!(vectors.len() >= 16, "lost vectors: {}", vectors.len());
        for v in vectors {
            let ids: Vec<&str> = v.ops.iter().map(|o| o.id.as_str()).collect();
            let candidates: Vec<Candidate> = v
                .ops
                .iter()
                .enumerate()
                .map(|(i, o)| Candidate {
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
                })
                .collect();
            let caps = Caps {
                serial: v.serial_caps.clone(),
                global: v.global_cap,
                ..Caps::default()
            };
            let started: Vec<&str> = schedule(&candidates, &caps)
                .into_iter()
                .map(|i| ids[i as usize])
                .collect();
            assert_eq!(started, v.expect_started, "vector {:?}", v.name);
        }
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
        }
    }

    #[test]
    fn a_critical_op_behind_an_in_flight_op_of_its_strict_lane_waits() {
        let ops = vec![
            cand(1, Priority::Normal, vec![strict("A")], OpState::InFlight),
            cand(2, Priority::Critical, vec![strict("A")], OpState::Ready),
        ];
        assert!(schedule(&ops, &Caps::default()).is_empty());
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
        assert_eq!(schedule(&ops, &caps), vec![2, 4]);
        let caps = Caps {
            starts: Some(1),
            ..Caps::default()
        };
        assert_eq!(schedule(&ops, &caps), vec![2]);
    }

    #[test]
    fn an_op_without_lanes_is_unordered() {
        let ops = vec![
            cand(1, Priority::Normal, vec![], OpState::Waiting),
            cand(2, Priority::Normal, vec![], OpState::Ready),
        ];
        assert_eq!(schedule(&ops, &Caps::default()), vec![2]);
    }

    fn arb_candidates() -> impl Strategy<Value = (Vec<Candidate>, Caps)> {
        let lane_names = ["A", "B", "C", "D", "S1", "S2"];
        let op = (
            0..3usize,
            proptest::sample::subsequence(lane_names.to_vec(), 0..3),
            prop_oneof![Just(OpState::Ready), Just(OpState::Waiting), Just(OpState::InFlight)],
            0..2usize,
        );
        (
            proptest::collection::vec(op, 0..14),
            proptest::option::of(1..6usize),
            proptest::option::of(1..4usize),
            1..3usize,
        )
            .prop_map(|(ops, global, kind_cap, serial_cap)| {
                let candidates = ops
                    .into_iter()
                    .enumerate()
                    .map(|(i, (p, lanes, state, kind))| Candidate {
                        id: i as OpId,
                        priority: Priority::ALL[p],
                        seq: i as i64,
                        kind: format!("k{kind}"),
                        lanes: lanes
                            .into_iter()
                            .map(|n| Lane {
                                name: n.to_owned(),
                                mode: if n.starts_with('S') {
                                    LaneMode::Serial
                                } else {
                                    LaneMode::Strict
                                },
                            })
                            .collect(),
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
                };
                (candidates, caps)
            })
    }

    fn key(c: &Candidate) -> (Priority, i64) {
        (c.priority, c.seq)
    }

    proptest! {
        /// Safety: what starts is ready, keeps every strict lane to one op in
        /// flight and to dispatch order, and respects every cap.
        #[test]
        fn started_ops_respect_lanes_and_caps((ops, caps) in arb_candidates()) {
            let started: HashSet<OpId> = schedule(&ops, &caps).into_iter().collect();
            let running: Vec<&Candidate> =
                ops.iter().filter(|c| c.state == OpState::InFlight || started.contains(&c.id)).collect();
            for c in ops.iter().filter(|c| started.contains(&c.id)) {
                prop_assert_eq!(c.state, OpState::Ready);
                for lane in c.lanes.iter().filter(|l| l.mode == LaneMode::Strict) {
                    for other in ops.iter().filter(|o| o.id != c.id && o.lanes.contains(lane)) {
                        // Nothing else of the lane runs, and nothing earlier waits.
                        prop_assert!(other.state != OpState::InFlight && !started.contains(&other.id));
                        prop_assert!(key(other) > key(c), "op {} started ahead of {}", c.id, other.id);
                    }
                }
            }
            for (lane, cap) in [("S1", caps.serial_cap("S1")), ("S2", 1)] {
                let load = running.iter().filter(|c| c.lanes.iter().any(|l| l.name == lane)).count();
                let before = ops.iter().filter(|c| c.state == OpState::InFlight && c.lanes.iter().any(|l| l.name == lane)).count();
                prop_assert!(load <= cap.max(before), "serial lane {} has {} in flight", lane, load);
            }
            if let Some(cap) = caps.global {
                let before = ops.iter().filter(|c| c.state == OpState::InFlight).count();
                prop_assert!(running.len() <= cap.max(before));
            }
        }

        /// Liveness: a ready op that did not start was held back by a rule.
        #[test]
        fn every_ready_op_left_out_has_a_reason((ops, caps) in arb_candidates()) {
            let started: HashSet<OpId> = schedule(&ops, &caps).into_iter().collect();
            let running: Vec<&Candidate> =
                ops.iter().filter(|c| c.state == OpState::InFlight || started.contains(&c.id)).collect();
            for c in ops.iter().filter(|c| c.state == OpState::Ready && !started.contains(&c.id)) {
                let strict_blocked = c.lanes.iter().filter(|l| l.mode == LaneMode::Strict).any(|lane| {
                    ops.iter().any(|o| o.id != c.id && o.lanes.contains(lane) && (o.state == OpState::InFlight || key(o) < key(c)))
                });
                let serial_full = c.lanes.iter().filter(|l| l.mode == LaneMode::Serial).any(|lane| {
                    running.iter().filter(|r| r.lanes.contains(lane)).count() >= caps.serial_cap(&lane.name)
                });
                let global_full = caps.global.is_some_and(|cap| running.len() >= cap);
                let kind_full = caps.per_kind.get(&c.kind).is_some_and(|cap| running.iter().filter(|r| r.kind == c.kind).count() >= *cap);
                prop_assert!(strict_blocked || serial_full || global_full || kind_full, "op {} was ready and free but did not start", c.id);
            }
        }
    }
}
