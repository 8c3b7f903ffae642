//! The pass's reads of its outbox: the whole book in dispatch order when a
//! pass starts and every poll, the ops enqueued since otherwise, and walks
//! past a prefix crowded by a few lanes.

use super::*;

impl Pass {
    /// Brings the book up to date: in full when it is due (every `poll_ms`,
    /// which bounds how long a change the pass cannot see goes unnoticed) or
    /// when it overflowed and emptied; otherwise only the ops enqueued since
    /// the last trigger.
    pub(super) async fn read(&mut self, poll: Duration) -> Result<(), DispatchError> {
        let outbox = self.slot.outbox.clone();
        let window = self.inner.config.load().dispatch.window;
        // Lanes other outboxes freed for this one; a full read reads every
        // occupant anew, so it answers them too.
        let freed = self.inner.handover().take(&outbox);
        if Instant::now() >= self.refresh_at || self.book.needs_refill() {
            // A trigger pending now is answered by this read.
            self.inner.slots.take_again(&outbox);
            let mut prefix = self.inner.queue.scan(&outbox, None, window).await?;
            // Pool ops moved to other channels: read again what moved.
            if super::super::redeal::redeal(&self.inner, &outbox, &prefix).await {
                prefix = self.inner.queue.scan(&outbox, None, window).await?;
            }
            let mut filling = Filling::new(prefix, window as usize);
            if filling.wants_more() && Instant::now() >= self.walk_at {
                self.walk(&mut filling, window, poll).await?;
            }
            let halts = self.inner.queue.lane_halts(Some(&outbox)).await?;
            self.paused = Paused::new(&self.inner.queue.pauses().await?);
            self.health = (*self.inner.health_view()).clone();
            let lanes: Vec<String> = filling
                .rows()
                .iter()
                .flat_map(|r| r.lanes.iter())
                .collect::<HashSet<_>>()
                .into_iter()
                .cloned()
                .collect();
            // Waiting on every lane read before reading who occupies them,
            // then only on those another outbox occupies: a settle between
            // the two is then either in the read or reported to this drain.
            self.inner.handover().rewait(&outbox, &lanes);
            // Those the book holds itself are left out when it schedules.
            let elsewhere = self.inner.queue.occupants(&lanes).await?;
            self.inner.handover().rewait(&outbox, others_lanes(&elsewhere, &outbox));
            let config = self.inner.config.load_full();
            self.log_unrunnable_kinds(filling.rows(), &config);
            self.book
                .fill(filling, halts.into_iter().map(|h| h.lane).collect(), elsewhere);
            for id in &self.claiming {
                self.book.claiming(*id);
            }
            self.refresh_at = Instant::now() + poll;
            return Ok(());
        }
        if !freed.is_empty() {
            // Another outbox here settled ops of lanes this one waits on:
            // who occupies them now? (Waiting again first, as above.)
            self.inner.handover().wait(&outbox, &freed);
            let occupants = self.inner.queue.occupants(&freed).await?;
            self.inner.handover().wait(&outbox, others_lanes(&occupants, &outbox));
            self.book.refresh_elsewhere(&freed, occupants);
        }
        if self.inner.slots.take_again(&outbox) {
            let rows = self
                .inner
                .queue
                .scan(&outbox, Some(self.book.high_water()), window)
                .await?;
            let config = self.inner.config.load_full();
            self.log_unrunnable_kinds(&rows, &config);
            self.book.add(rows);
        }
        Ok(())
    }

    /// Reads on past a prefix crowded by a few lanes for the other lanes'
    /// ops: the first few ops of each lane set behind it, which the database
    /// picks, so a deep backlog costs it a scan of the outbox's index but
    /// costs this process only a few rows per lane set. A walk that finds
    /// nothing (every lane set behind the prefix is crowded) makes the next
    /// one wait twice as long, up to [`WALK_BACKOFF_POLLS`] polls.
    pub(super) async fn walk(
        &mut self,
        filling: &mut Filling,
        window: u32,
        poll: Duration,
    ) -> Result<(), DispatchError> {
        let rows = self
            .inner
            .queue
            .scan_beyond(&self.slot.outbox, filling.next_from(), PER_SET, window)
            .await?;
        filling.beyond(rows, window as usize);
        self.walk_every = if filling.kept_beyond() == 0 {
            (self.walk_every * 2).clamp(poll, poll * WALK_BACKOFF_POLLS)
        } else {
            Duration::ZERO
        };
        self.walk_at = Instant::now() + self.walk_every;
        debug!(outbox = %self.slot.outbox, walked = filling.walked(), kept = filling.kept_beyond(), "Read past crowded lanes.");
        Ok(())
    }

    pub(super) fn log_unrunnable_kinds(&self, rows: &[BookRow], config: &Config) {
        for row in rows {
            let kind = &row.kind;
            let why = if !config.kinds.contains_key(kind) {
                "is not configured"
            } else if self.inner.executors.get(kind).is_none() {
                "has no executor loaded"
            } else {
                continue;
            };
            // Only an unrunnable kind is marked, so one that loses its
            // executor later is still reported.
            if !self.inner.warned_kind(kind) {
                warn!(kind = %kind, outbox = %self.slot.outbox, "Kind {why}; its ops wait and block their strict lanes.");
            }
        }
    }
}
