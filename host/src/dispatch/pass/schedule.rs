//! Which of the book's ops may start now, through the lane scheduler, and
//! why the others wait (a pause, a halted subject, a breaker, a
//! destination's cap, a stall in this pass).

use super::*;

impl Pass {
    /// Which ops of the book may start now, and when the earliest waiting
    /// one becomes due.
    pub(super) fn schedule(
        &mut self,
        config: &Config,
        rules: &LaneRules,
        now: DateTime<Utc>,
        leaving: &HashSet<OpId>,
    ) -> (Vec<OpId>, Option<DateTime<Utc>>) {
        let mut due_next: Option<DateTime<Utc>> = None;
        let halted = self.book.halted_lanes();
        let mut input: Vec<Candidate> = Vec::with_capacity(self.book.len() + halted.len());
        // Host permits: what is free and not left to a starved outbox, and
        // no more than this outbox's fair share while others want them too.
        let starts = {
            let share = self.inner.share();
            let free = self.inner.permits.available_permits();
            let free = if self.favoured { free } else { share.takeable(free) };
            free.min(share.fair(self.inner.permit_total).saturating_sub(self.busy()))
        };
        let clock = std::time::Instant::now();
        let mut load = self
            .inner
            .destination_load
            .snapshot(clock, SlowStart::of(&config.destinations));
        let mut caps = Caps {
            // The slow attempts the book counts in flight are outside the cap.
            global: Some(config.dispatch.outbox_max_in_flight.saturating_add(self.slow_in_book())),
            starts: Some(starts),
            per_destination: Some(config.destinations.max_in_flight),
            destination_load: std::mem::take(&mut load.counts),
            per_unanswered_destination: Some(config.destinations.max_in_flight_unanswered),
            answered: load.answered.clone(),
            earned: std::mem::take(&mut load.earned),
            ..Caps::default()
        };
        for (name, kind) in &config.kinds {
            if let Some(cap) = kind.max_in_flight {
                caps.per_kind.insert(name.clone(), cap);
            }
        }
        {
            let breakers = self.inner.breakers();
            let mut behind = lanes::Behind::with_capacity(self.book.len());
            // The book's rows are mostly of one kind: its rule once.
            let mut rule: Option<(&str, bool)> = None;
            for entry in self.book.entries().filter(|e| !leaving.contains(&e.row.id)) {
                let row = &entry.row;
                let strict = match rule {
                    Some((kind, strict)) if kind == row.kind => strict,
                    _ => {
                        let strict = rules.of(&row.kind).mode == LaneMode::Strict;
                        rule = Some((&row.kind, strict));
                        strict
                    }
                };
                if behind.hides(&row.lanes, strict, row.in_flight || row.in_doubt) {
                    continue;
                }
                let state = if entry.parked || !self.book.in_reach(row) {
                    OpState::Waiting
                } else {
                    self.state_of(row, config.kinds.contains_key(&row.kind), now, &breakers, &mut due_next)
                };
                input.push(Candidate {
                    id: row.id,
                    priority: row.priority,
                    seq: row.id,
                    kind: row.kind.clone(),
                    lanes: rules.lanes(&row.kind, &row.lanes, &mut caps),
                    state,
                    in_doubt: row.in_doubt,
                });
            }
        }
        // Ops that occupy lanes elsewhere (other outboxes, or this one's
        // beyond the book): they never start here, but nothing of their
        // lanes may run beside them where the mode forbids it.
        let elsewhere: Vec<Candidate> = self
            .book
            .elsewhere()
            .iter()
            .filter(|o| self.book.get(o.id).is_none())
            .map(|o| o.candidate(rules, &mut Caps::default()))
            .collect();
        // A lane held by a dead letter (poison = halt) is blocked as if an op
        // waited at its head.
        for (i, lane) in halted.iter().enumerate() {
            input.push(Candidate {
                id: -1 - i as OpId,
                priority: crate::op::Priority::Critical,
                seq: i64::MIN,
                kind: String::new(),
                lanes: vec![Lane {
                    name: lane.clone(),
                    mode: LaneMode::Strict,
                }],
                state: OpState::Waiting,
                in_doubt: false,
            });
        }
        // With no permit to take nothing starts; when nothing runs either,
        // would anything start with one? Then the pass ends starved, and the
        // outbox is woken when permits free.
        let start = if starts == 0 {
            Vec::new()
        } else {
            lanes::schedule(&input, &elsewhere, &caps)
        };
        self.book.permits_idle(start.len() < starts);
        // Permits left idle while ops wait for a destination whose
        // patience runs: the pass is due again when it earns its next
        // request, whoever holds it.
        if start.len() < starts && !load.earns_next.is_empty() {
            let started: HashSet<OpId> = start.iter().copied().collect();
            let waiting = input
                .iter()
                .filter(|c| c.state == OpState::Ready && !started.contains(&c.id))
                .filter_map(lanes::destination);
            if let Some(at) = load.next_earned(waiting) {
                let at = now + chrono_duration(at.saturating_duration_since(clock));
                due_next = Some(due_next.map_or(at, |d| d.min(at)));
            }
        }
        self.starved = starts == 0
            && self.running.is_empty()
            && self.claiming.is_empty()
            && !lanes::schedule(
                &input,
                &elsewhere,
                &Caps {
                    starts: Some(1),
                    ..caps.clone()
                },
            )
            .is_empty();
        // Held only by destinations' counts, with nothing of its own
        // running: the ops in flight there are other outboxes', whose ends
        // wake no one here (no lane is shared, no permit was wanted), so
        // the pass must look again by itself.
        self.held_by_destinations = start.is_empty()
            && starts > 0
            && self.running.is_empty()
            && self.claiming.is_empty()
            && !caps.destination_load.is_empty()
            && !lanes::schedule(
                &input,
                &elsewhere,
                &Caps {
                    starts: Some(1),
                    per_destination: None,
                    ..caps.clone()
                },
            )
            .is_empty();
        debug!(outbox = %self.slot.outbox, candidates = self.book.len(), start = ?start, "Scheduled.");
        (start, due_next)
    }

    /// Which ops of `start` take a lane from an op this round settles as
    /// leaving: each such pair makes the claim depend on the settle.
    pub(super) fn follows(&self, start: &[OpId], leaving: &HashSet<OpId>) -> Vec<(OpId, OpId)> {
        if leaving.is_empty() || start.is_empty() {
            return Vec::new();
        }
        let mut by_lane: HashMap<&str, Vec<OpId>> = HashMap::new();
        for id in leaving {
            for lane in self.book.get(*id).map(|e| e.row.lanes.as_slice()).unwrap_or_default() {
                by_lane.entry(lane.as_str()).or_default().push(*id);
            }
        }
        let mut follows = Vec::new();
        for id in start {
            for lane in self.book.get(*id).map(|e| e.row.lanes.as_slice()).unwrap_or_default() {
                for before in by_lane.get(lane.as_str()).into_iter().flatten() {
                    follows.push((*id, *before));
                }
            }
        }
        follows
    }

    pub(super) fn state_of(
        &self,
        row: &BookRow,
        kind_known: bool,
        now: DateTime<Utc>,
        breakers: &breaker::Breakers,
        due_next: &mut Option<DateTime<Utc>>,
    ) -> OpState {
        if row.in_flight {
            return OpState::InFlight;
        }
        let runnable = self.inner.executors.get(&row.kind).is_some_and(|e| e.available());
        if !kind_known || !runnable || row.subject_halted {
            return OpState::Waiting;
        }
        if self.paused.holds(&self.slot.outbox, &row.kind, destination(&row.lanes)) {
            return OpState::Waiting;
        }
        if self.stalled.contains(&row.id) {
            return OpState::Waiting;
        }
        if row.next_attempt_at > now {
            *due_next = Some(due_next.map_or(row.next_attempt_at, |d| d.min(row.next_attempt_at)));
            return OpState::Waiting;
        }
        if let Some(dest) = destination(&row.lanes) {
            if let Some(Admit::Hold { until }) = self.health.get(dest).map(|h| h.admit(now)) {
                if let Some(at) = until {
                    *due_next = Some(due_next.map_or(at, |d| d.min(at)));
                }
                return OpState::Waiting;
            }
            if breakers.peek(dest, now) == Admission::Hold {
                return OpState::Waiting;
            }
        }
        OpState::Ready
    }
}
