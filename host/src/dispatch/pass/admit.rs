//! Admission: of the ops the schedule lets start, those that also get a
//! host permit, their breaker's admission or health probe, a rate-limit
//! token and a fee quote. The only part of a pass that takes them.

use super::*;

impl Pass {
    /// Takes host-wide permits and breaker admissions for the ops the
    /// scheduler started, and prices them: what goes to the claim.
    pub(super) async fn choose(&mut self, start: Vec<OpId>, now: DateTime<Utc>) -> Result<Chosen, DispatchError> {
        let start = self.probes(start, now).await?;
        let start = self.rate_limited(start, now).await?;
        let mut chosen = Vec::with_capacity(start.len());
        let mut permits: HashMap<OpId, Hold> = HashMap::with_capacity(start.len());
        let mut trials: Vec<(OpId, String)> = Vec::new();
        {
            let mut breakers = self.inner.breakers();
            for id in start {
                let Some(entry) = self.book.get(id) else { continue };
                let Ok(permit) = self.inner.permits.clone().try_acquire_owned() else {
                    // Another drain (on another worker thread) took the
                    // permits the schedule counted: if this pass then has
                    // nothing running, it is starved, and must say so to be
                    // woken when permits free, or a poll an hour away
                    // would be its only wake-up.
                    if chosen.is_empty() && self.running.is_empty() && self.claiming.is_empty() {
                        self.starved = true;
                    }
                    break;
                };
                let dest = destination(&entry.row.lanes);
                if let Some(dest) = dest {
                    match breakers.admit(dest, now) {
                        Admission::Hold => continue,
                        Admission::Trial => trials.push((id, dest.to_owned())),
                        Admission::Allow => {}
                    }
                }
                chosen.push(id);
                permits.insert(
                    id,
                    Hold {
                        permit,
                        destination: dest.map(|d| self.inner.destination_load.hold(d)),
                    },
                );
            }
        }
        let bids = self.price(&mut chosen, now).await?;
        // What pricing deferred or could not price gives its permit and its
        // place in its destination's count back now.
        permits.retain(|id, _| chosen.contains(id));
        Ok((chosen, permits, trials, bids))
    }

    /// Keeps, of the ops to unavailable destination hosts, one probe per
    /// host whose probe is due and that this host won (a compare-and-set
    /// on the shared record); the others wait for the probe's outcome.
    pub(super) async fn probes(&mut self, start: Vec<OpId>, now: DateTime<Utc>) -> Result<Vec<OpId>, DispatchError> {
        let config = self.inner.config.load().destinations.health();
        let mut decided: HashMap<String, bool> = HashMap::new();
        let mut keep = Vec::with_capacity(start.len());
        for id in start {
            let dest = self
                .book
                .get(id)
                .and_then(|e| destination(&e.row.lanes))
                .map(str::to_owned);
            let Some(dest) = dest else {
                keep.push(id);
                continue;
            };
            let Some(health) = self.health.get(&dest).cloned() else {
                keep.push(id);
                continue;
            };
            match health.admit(now) {
                Admit::Go => {
                    keep.push(id);
                    continue;
                }
                // Held, or held since this pass took the host's probe for
                // an earlier op: only the probe goes; the others look again
                // when the next probe may go.
                Admit::Hold { until } => {
                    if let Some(at) = until {
                        self.held_wake = Some(self.held_wake.map_or(at, |w| w.min(at)));
                    }
                    continue;
                }
                Admit::Probe if decided.contains_key(&dest) => {
                    self.wake_for_next_probe(now, &config);
                    continue;
                }
                Admit::Probe => {}
            }
            let won = crate::destinations::take_probe(self.inner.queue.as_ref(), &dest, now, &config).await?;
            decided.insert(dest.clone(), won);
            if let Some(next) = health.take_probe(now, &config) {
                self.health.set(&dest, next);
                self.inner.forget_health();
            }
            if won {
                info!(op = id, destination = %dest, "Probing an unavailable destination with one op.");
                self.probing.insert(id);
                keep.push(id);
            } else {
                self.wake_for_next_probe(now, &config);
            }
        }
        Ok(keep)
    }

    /// Looks again when the probe taken now (here or on another host) is
    /// followed by the next one.
    pub(super) fn wake_for_next_probe(&mut self, now: DateTime<Utc>, config: &crate::health::HealthConfig) {
        let at = now + chrono_duration(config.probe_every);
        self.held_wake = Some(self.held_wake.map_or(at, |w| w.min(at)));
    }

    /// Keeps, of the ops to each destination host, as many as its shared
    /// token bucket grants now (`destinations.rate_per_second`); the rest
    /// wait, with a wake-up when the next token is there. A token taken for
    /// an op whose claim then fails is spent: the limit errs low.
    pub(super) async fn rate_limited(
        &mut self,
        start: Vec<OpId>,
        now: DateTime<Utc>,
    ) -> Result<Vec<OpId>, DispatchError> {
        let limits = self.inner.config.load().destinations.clone();
        if limits.rate_per_second <= 0.0 || start.is_empty() {
            return Ok(start);
        }
        let mut wanted: Vec<(String, u32)> = Vec::new();
        for id in &start {
            if let Some(dest) = self.book.get(*id).and_then(|e| destination(&e.row.lanes)) {
                match wanted.iter_mut().find(|(d, _)| d == dest) {
                    Some((_, n)) => *n += 1,
                    None => wanted.push((dest.to_owned(), 1)),
                }
            }
        }
        let mut granted: HashMap<String, u32> = HashMap::new();
        for (dest, want) in wanted {
            let (got, next_in) = self
                .draw(&dest, want, limits.rate_per_second, limits.rate_burst, now)
                .await?;
            if let Some(wait) = next_in {
                let at = now + chrono_duration(wait);
                self.held_wake = Some(self.held_wake.map_or(at, |w| w.min(at)));
            }
            granted.insert(dest, got);
        }
        Ok(start
            .into_iter()
            .filter(|id| {
                let Some(dest) = self.book.get(*id).and_then(|e| destination(&e.row.lanes)) else {
                    return true;
                };
                match granted.get_mut(dest) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        true
                    }
                    _ => false,
                }
            })
            .collect())
    }

    /// Draws tokens from a destination's shared bucket by compare-and-set.
    pub(super) async fn draw(
        &self,
        dest: &str,
        want: u32,
        rate: f64,
        burst: u32,
        now: DateTime<Utc>,
    ) -> Result<(u32, Option<Duration>), DispatchError> {
        let drawn = crate::queue::update_record(
            self.inner.queue.as_ref(),
            crate::ratelimit::BUCKETS,
            dest,
            8,
            |stored| {
                let bucket = stored.and_then(|r| serde_json::from_str::<crate::ratelimit::Bucket>(&r.value).ok());
                let draw = crate::ratelimit::take(bucket, want, rate, burst, now);
                let change = if draw.granted == 0 {
                    crate::queue::Change::Keep
                } else {
                    crate::queue::Change::Put(
                        serde_json::to_string(&draw.bucket)
                            .map_err(|e| crate::queue::QueueError::InvalidOp(e.to_string()))?,
                    )
                };
                Ok((change, (draw.granted, draw.next_in)))
            },
        )
        .await?;
        // Contended by other hosts: take nothing this round.
        Ok(drawn.unwrap_or((0, Some(Duration::from_millis(20)))))
    }

    /// Stores what this round's attempts said about their destinations'
    /// health: failures always, answers only for hosts with a record (so
    /// healthy traffic writes nothing), a 410 as a gone inbox or, from a
    /// shared inbox, a suspended host.
    pub(super) async fn record_health(
        &mut self,
        signals: Vec<(String, String, Signal)>,
        config: &Config,
        now: DateTime<Utc>,
    ) {
        if signals.is_empty() {
            return;
        }
        let health_config = config.destinations.health();
        let queue = self.inner.queue.as_ref();
        let metrics = &self.inner.metrics;
        let mut by_dest: Vec<(String, Vec<Signal>)> = Vec::new();
        for (dest, inbox, signal) in signals {
            if let Signal::Gone = signal {
                match crate::destinations::inbox_gone(queue, metrics, &dest, &inbox, now, &health_config).await {
                    Ok(Some(health)) => {
                        self.inner.forget_health();
                        self.health.set(&dest, health);
                    }
                    Ok(None) => {}
                    Err(e) => warn!(inbox = %inbox, error = %e, "Could not record a gone inbox."),
                }
                continue;
            }
            match by_dest.iter_mut().find(|(d, _)| *d == dest) {
                Some((_, list)) => list.push(signal),
                None => by_dest.push((dest, vec![signal])),
            }
        }
        for (dest, list) in by_dest {
            let failed = list.iter().any(|s| matches!(s, Signal::Failed(_)));
            if !failed && self.health.get(&dest).is_none() {
                continue;
            }
            let events: Vec<Event<'_>> = list
                .iter()
                .map(|s| match s {
                    Signal::Failed(error) => Event::Failed { error },
                    Signal::Answered | Signal::Gone => Event::Answered,
                })
                .collect();
            match crate::destinations::apply(queue, metrics, &dest, &events, "delivery", now, &health_config).await {
                Ok((before, after)) => {
                    if before != after {
                        // Every drain here reads the change at its next read.
                        self.inner.forget_health();
                    }
                    self.health.set(&dest, after);
                }
                Err(e) => warn!(destination = %dest, error = %e, "Could not record destination health."),
            }
        }
    }

    /// Prices the chosen ops whose kind has a fee oracle: keeps the bids of
    /// those that may go, defers (in the database, without using an
    /// attempt) those the policy defers, and leaves out those that cannot be
    /// priced now. Returns the bids.
    pub(super) async fn price(
        &mut self,
        chosen: &mut Vec<OpId>,
        now: DateTime<Utc>,
    ) -> Result<HashMap<OpId, FeeBid>, DispatchError> {
        let mut bids = HashMap::new();
        let Some(pricer) = self.inner.pricer.load_full() else {
            return Ok(bids);
        };
        let config = self.inner.config.load_full();
        let mut views = OracleViews::default();
        let mut keep = Vec::with_capacity(chosen.len());
        for id in chosen.drain(..) {
            let Some(op) = self.book.get(id).map(|e| e.row.clone()) else {
                continue;
            };
            match pricer.price(&config, &mut views, &op, now).await {
                Ok(None) => keep.push(id),
                Ok(Some(FeeDecision::Submit { bid, .. })) => {
                    let metrics = &self.inner.metrics;
                    if bid.capped {
                        Priced::Capped {
                            op: id,
                            kind: &op.kind,
                            priority: op.priority,
                            fee: bid.base_fee,
                        }
                        .emit(metrics);
                    } else if bid.aggressive {
                        Priced::Aggressive {
                            op: id,
                            kind: &op.kind,
                            fee: bid.base_fee,
                        }
                        .emit(metrics);
                    }
                    bids.insert(id, bid);
                    keep.push(id);
                }
                Ok(Some(FeeDecision::Defer(wait))) => {
                    let until = now + chrono_duration(wait);
                    if self.inner.queue.defer(id, until).await?.applied() {
                        self.book.deferred(id, until);
                        Priced::Deferred {
                            op: id,
                            kind: &op.kind,
                            priority: op.priority,
                            until,
                        }
                        .emit(&self.inner.metrics);
                    }
                }
                Err(e @ crate::pricing::PricingError::NoSampleYet(_)) => {
                    debug!(op = id, kind = %op.kind, error = %e, "Waiting for the fee oracle's first sample.");
                }
                Err(e) => {
                    // A policy that fails (a crash, its fuel spent) would
                    // fail again on the next pass: the op waits, without
                    // using an attempt, its kind's longest backoff and
                    // longer at each failure in a row, so a broken policy
                    // behind a backlog is not run for every op all the time.
                    let backoff_max = config.kinds.get(&op.kind).map_or(1000, |k| k.backoff_max_ms);
                    let wait = pricer.failed(id, Duration::from_millis(backoff_max));
                    let until = now + chrono_duration(wait);
                    warn!(op = id, kind = %op.kind, error = %e, retry_at = %until, "Cannot price the op; it waits.");
                    if self.inner.queue.defer(id, until).await?.applied() {
                        self.book.deferred(id, until);
                    }
                }
            }
        }
        *chosen = keep;
        Ok(bids)
    }
}
