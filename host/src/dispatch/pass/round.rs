//! A round: settle what finished and claim what may start, in one
//! transaction on its way to the database; land it (start what it claimed,
//! only once it committed); and decide what becomes of finished attempts.

use super::*;

impl Pass {
    /// Whether to send a round now. With none on its way, always (a round
    /// with nothing to do costs no transaction). With some on their way (up
    /// to [`rounds_in_flight`]), only one that carries a batch: half the
    /// drain's share of permits finished or free. Small rounds otherwise
    /// wait for those in flight and grow meanwhile, so the transactions per
    /// op fall as load rises (group commit), and no commit waits on a drain
    /// that is idle.
    pub(super) fn worth_sending(&self, config: &Config) -> bool {
        match self.commits.len() {
            0 => true,
            n if n >= rounds_in_flight(config) => false,
            _ => {
                let share = self
                    .inner
                    .share()
                    .fair(self.inner.permit_total)
                    .min(config.dispatch.outbox_max_in_flight);
                let busy = self.busy();
                let free = share.saturating_sub(busy).min(self.inner.permits.available_permits());
                let batch = (share / 2).max(1);
                self.finished.len() >= batch || free >= batch
            }
        }
    }

    /// Sends one round: schedule from the book, then settle what finished
    /// and claim what may start, in one transaction on its way to the
    /// database ([`Pass::land`] starts what it claimed once it committed).
    /// Returns when the earliest waiting op becomes due.
    ///
    /// Ops that finished are still in flight for this round's schedule: the
    /// lanes they hold are free only once their settle has committed, so a
    /// crash between the two can never let a later op of a lane overtake one
    /// whose outcome was not recorded.
    pub(super) async fn issue(
        &mut self,
        lease_for: Duration,
        stopping: bool,
    ) -> Result<Option<Instant>, DispatchError> {
        let config = self.inner.config.load_full();
        let now = self.inner.clock.now();
        let rules = config.lane_rules();
        let finished = std::mem::take(&mut self.finished);
        // Health first, and the decisions read it: an attempt planned on a
        // view older than the record (another host's write, or this host's
        // own not yet read back) never spends its op's last attempt against
        // a host the record holds. A crash before the settle commits counts
        // these failures once more than the attempts recorded; never an
        // outcome.
        self.record_health(health_signals(&finished), &config, now).await;
        let (completions, notes) = self.decide(finished, &config, now);
        // Ops this round confirms or dead-letters leave their lanes when the
        // round commits; the round may start the next op of such a lane,
        // on condition that the settle applies (`follows`).
        // Not where another outbox here waits on the lane: it gets its turn
        // when this settle wakes it, instead of this outbox taking the lane
        // back in the same transaction every time.
        let leaving: HashSet<OpId> = {
            let handover = self.inner.handover();
            completions
                .iter()
                .zip(&notes)
                .filter(|(c, _)| {
                    matches!(
                        c.finish,
                        Finish::Confirm { .. } | Finish::Fail { halt_lanes: false, .. }
                    )
                })
                .filter(|(_, (claimed, _))| {
                    !claimed
                        .op
                        .lanes
                        .iter()
                        .any(|l| handover.others_wait(&self.slot.outbox, l))
                })
                .map(|(c, _)| c.lease.op_id)
                .collect()
        };
        let (start, due_next) = if stopping {
            self.starved = false;
            self.held_by_destinations = false;
            (Vec::new(), None)
        } else {
            self.schedule(&config, &rules, now, &leaving)
        };
        let follows = self.follows(&start, &leaving);
        let (chosen, permits, trials, bids) = self.choose(start, now).await?;
        let due_next = match self.held_wake.take() {
            Some(at) => Some(due_next.map_or(at, |d: DateTime<Utc>| d.min(at))),
            None => due_next,
        };
        let due_at = |at: DateTime<Utc>| Instant::now() + (at - now).to_std().unwrap_or_default();
        if completions.is_empty() && chosen.is_empty() {
            return Ok(due_next.map(due_at));
        }
        if !completions.is_empty() {
            crate::failpoint::hit(crate::failpoint::SETTLING, &self.slot.outbox).await;
        }
        let spec = LeaseSpec {
            owner: self.inner.owner.clone(),
            duration: lease_for,
        };
        // Until the claim lands, the chosen ops count as in flight: no later
        // round picks them, and they hold their lanes and the permits taken.
        for id in &chosen {
            self.book.claiming(*id);
            self.claiming.insert(*id);
        }
        let queue = self.inner.queue.clone();
        let issued = Issued {
            completions,
            notes,
            chosen,
            permits,
            trials,
            bids,
            now,
        };
        self.commits.spawn(async move {
            let result = queue
                .settle_then_claim(&issued.completions, &issued.chosen, &follows, &spec, &rules)
                .await;
            (issued, result)
        });
        Ok(due_next.map(due_at))
    }

    /// A round committed (or failed): records its settles, starts what it
    /// claimed, and parks what it could not claim.
    ///
    /// **Architecture Invariant:** an op's side effect starts only here,
    /// after the transaction that claimed it committed; and an op that
    /// shares a strict lane with one this drain is settling is neither
    /// scheduled nor claimed until that settle committed: either in the same
    /// transaction (`follows`) or in a round sent after this one landed,
    /// because the settling op stays in flight in the book until then.
    pub(super) async fn land(&mut self, (issued, result): Landed) -> Result<(), DispatchError> {
        let Issued {
            completions,
            notes,
            chosen,
            permits,
            trials,
            bids,
            now,
        } = issued;
        for id in &chosen {
            self.claiming.remove(id);
        }
        let (settled, claimed) = result?;
        if !claimed.is_empty() {
            crate::failpoint::hit(crate::failpoint::CLAIMED, &self.slot.outbox).await;
        }
        let config = self.inner.config.load_full();
        // The pass schedules again as soon as this returns, from a book
        // that holds these settles: a retry's due time and the lanes freed
        // are seen then.
        let freed: Vec<String> = completions
            .iter()
            .zip(&notes)
            .zip(&settled)
            .filter(|(_, cas)| cas.applied())
            .flat_map(|((_, (claimed, _)), _)| claimed.op.lanes.iter().cloned())
            .collect();
        self.record_settles(&completions, notes, settled);
        let claimed_ids: HashSet<OpId> = claimed.iter().map(|c| c.op.id).collect();
        for id in &chosen {
            if claimed_ids.contains(id) {
                self.book.claimed(*id);
            } else {
                // Held by a lane elsewhere, or changed under the book: a
                // full read soon explains it, or the outbox holding the lane
                // here says when it lets go.
                self.probing.remove(id);
                self.book.refused(*id);
                if let Some(entry) = self.book.get(*id) {
                    self.inner.handover().wait(&self.slot.outbox, &entry.row.lanes);
                }
                // The holder may have let go before this drain said it
                // waits: the pass stays for the recheck's full read.
                self.refresh_at = self.refresh_at.min(Instant::now() + PARKED_RECHECK);
                let recheck = now + chrono_duration(PARKED_RECHECK);
                self.held_wake = Some(self.held_wake.map_or(recheck, |w| w.min(recheck)));
            }
        }
        if !freed.is_empty() {
            self.inner.lanes_freed(&self.slot.outbox, &freed);
        }
        // A trial op that could not be claimed must not leave its breaker
        // waiting for a result that never comes.
        {
            let mut breakers = self.inner.breakers();
            for (id, dest) in trials.iter().filter(|(id, _)| !claimed_ids.contains(id)) {
                debug!(op = id, "Breaker trial op was not claimable.");
                breakers.record(dest, None, None, now);
            }
        }
        if !claimed.is_empty() {
            self.favoured = false;
        }
        attempt::spawn(
            &self.inner,
            (&mut self.running, &mut self.flights),
            claimed,
            permits,
            &bids,
            &config,
            &self.slowed,
        );
        // Permits this round freed and left to the share of others.
        self.inner.wake_starved();
        Ok(())
    }

    /// Decides what becomes of each finished attempt (the retry policy over
    /// its classified outcome): the settles to write and what to log once
    /// they are written.
    pub(super) fn decide(
        &mut self,
        batch: Vec<Finished>,
        config: &Config,
        now: DateTime<Utc>,
    ) -> (Vec<Completion>, Vec<Note>) {
        let in_pass_cap = config.dispatch.in_pass_attempts;
        let mut completions = Vec::with_capacity(batch.len());
        let mut notes = Vec::with_capacity(batch.len());
        for f in batch {
            let op = &f.claimed.op;
            let kind: Option<&KindConfig> = config.kinds.get(&op.kind);
            let history = retry::History {
                attempts: u32::try_from(op.budget_attempts()).unwrap_or(u32::MAX),
                fee_bumps: u32::try_from(op.fee_bumps).unwrap_or(u32::MAX),
                checkpointed: f.checkpointed,
            };
            let rules = verdict::Rules {
                policy: kind.map_or_else(RetryPolicy::default, KindConfig::retry_policy),
                probe_every: config.destinations.health().probe_every,
                in_pass_cap,
            };
            let tries = self.in_pass.entry(op.id).or_default();
            *tries += 1;
            // The health record is written before deciding, so "held" does
            // not depend on how fresh the view was when the attempt was
            // planned.
            let marks = verdict::Marks {
                probing: self.probing.remove(&op.id),
                held: f
                    .destination
                    .as_deref()
                    .and_then(|d| self.health.get(d))
                    .is_some_and(crate::health::Health::held),
                tries: *tries,
            };
            let verdict::Verdict { decision, stall } =
                verdict::verdict(&f.outcome, history, &rules, marks, now, rand::random::<f64>());
            if stall {
                self.stalled.insert(op.id);
            }
            if let Some(dest) = &f.destination {
                let error = f.outcome.error();
                self.inner
                    .breakers()
                    .record(dest, f.outcome.destination_failed(), error.as_deref(), now);
            }
            crate::events::PluginCalled {
                kind: &op.kind,
                plugin: kind.and_then(|k| k.plugin.as_deref()),
                outcome: &f.outcome,
                seconds: (f.finished_at - f.started_at)
                    .to_std()
                    .unwrap_or_default()
                    .as_secs_f64(),
            }
            .emit(&self.inner.metrics);
            let finish = match &decision {
                Decision::Confirm { receipt } => Finish::Confirm {
                    receipt: receipt.clone(),
                },
                Decision::Retry { at, error, fee_bump } => Finish::Retry {
                    next_attempt_at: *at,
                    error: error.clone(),
                    fee_bump: *fee_bump,
                    receipt_settled: !f.checkpointed,
                },
                Decision::DeadLetter { error } => Finish::Fail {
                    error: error.clone(),
                    halt_lanes: kind.is_some_and(KindConfig::halts_lanes),
                },
            };
            completions.push(Completion {
                lease: f.claimed.lease,
                finish,
                attempt: AttemptRecord {
                    started_at: f.started_at,
                    finished_at: f.finished_at,
                    class: f.outcome.class(),
                    detail: f.outcome.detail().map(str::to_owned),
                    fee: f.fee.and_then(|fee| i64::try_from(fee).ok()),
                    error: f.outcome.error(),
                },
            });
            notes.push((f.claimed, decision));
        }
        (completions, notes)
    }

    /// Applies written settles to the book and logs them.
    pub(super) fn record_settles(&mut self, completions: &[Completion], notes: Vec<Note>, results: Vec<Cas>) {
        for ((completion, (claimed, decision)), result) in completions.iter().zip(notes).zip(results) {
            let op = &claimed.op;
            self.book.settled(op.id, &completion.finish, result.applied());
            if !result.applied() {
                self.refresh_at = self.refresh_at.min(Instant::now() + PARKED_RECHECK);
                LeaseLost {
                    op: op.id,
                    attempt: claimed.lease.attempt,
                }
                .emit(&self.inner.metrics);
                continue;
            }
            let decision = match &decision {
                Decision::Confirm { .. } => Settled::Confirmed {
                    latency_seconds: (completion.attempt.finished_at - op.created_at)
                        .to_std()
                        .unwrap_or_default()
                        .as_secs_f64(),
                },
                Decision::Retry { at, error, fee_bump } => Settled::Retry {
                    at: *at,
                    error,
                    fee_bump: *fee_bump,
                },
                Decision::DeadLetter { error } => Settled::DeadLetter {
                    error,
                    class: completion.attempt.class.as_str(),
                    lanes: &op.lanes,
                    correlation_id: op.correlation_id.as_deref(),
                },
            };
            OpSettled {
                op: op.id,
                kind: &op.kind,
                outbox: &op.outbox,
                priority: op.priority,
                attempt: claimed.lease.attempt,
                decision,
            }
            .emit(&self.inner.metrics);
        }
    }
}
