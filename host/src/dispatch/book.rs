//! One drain's book: what it knows of its outbox's non-terminal ops between
//! rounds, so a round reads only what changed instead of the whole window.
//!
//! Pure bookkeeping, no I/O. The drain fills the book from a full read (the
//! first `capacity` ops in dispatch order, the lanes held by dead letters and
//! the ops occupying those lanes elsewhere), adds ops enqueued since (a read
//! of ids above the high-water mark), and applies its own claims and settles
//! as it makes them. What the drain cannot see (an operator's cancel or
//! force-retry, a lease recovered by the poll, a lane freed in another
//! outbox) waits for the next full read, which the drain makes at least every
//! `poll_ms`. In between, the book errs on the side of holding: an op whose
//! claim was refused or whose settle found the row moved on stays in the
//! book, parked (it blocks its strict lanes), until that read replaces it.
//!
//! **Architecture Invariant:** the book never lets an op start that a fresh
//! read would hold: every change it cannot explain parks the op, and the
//! claim re-checks the lane rule in the database anyway.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};

use crate::op::{OpId, Priority};
use crate::queue::{BookRow, Finish, Occupant};

/// One op as the book keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The op, as last read or as this drain changed it.
    pub row: BookRow,
    /// Something the book cannot see changed it (a refused claim, a stale
    /// settle): it waits, holding its strict lanes, until the next full read.
    pub parked: bool,
}

/// The book of one outbox's drain.
#[derive(Debug, Clone)]
pub(crate) struct Book {
    entries: BTreeMap<(Priority, OpId), Entry>,
    priority_of: HashMap<OpId, Priority>,
    high_water: OpId,
    capacity: usize,
    truncated: bool,
    halted_lanes: Vec<String>,
    elsewhere: Vec<Occupant>,
}

impl Book {
    /// An empty book holding at most `capacity` ops.
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: BTreeMap::new(),
            priority_of: HashMap::new(),
            high_water: 0,
            capacity: capacity.max(1),
            truncated: false,
            halted_lanes: Vec::new(),
            elsewhere: Vec::new(),
        }
    }

    /// Replaces everything with a full read: `rows` are the first ops in
    /// dispatch order (at most the capacity), `halted_lanes` the lanes dead
    /// letters hold, `elsewhere` the ops occupying the rows' lanes anywhere.
    pub fn reset(&mut self, rows: Vec<BookRow>, halted_lanes: Vec<String>, elsewhere: Vec<Occupant>) {
        self.truncated = rows.len() >= self.capacity;
        self.entries.clear();
        self.priority_of.clear();
        self.halted_lanes = halted_lanes;
        self.elsewhere = elsewhere;
        self.add(rows);
    }

    /// Adds ops read since (ids above the high-water mark); a row already in
    /// the book replaces it. The lowest in dispatch order are kept when the
    /// book overflows, and it remembers that it did.
    pub fn add(&mut self, rows: Vec<BookRow>) {
        for row in rows {
            self.high_water = self.high_water.max(row.id);
            self.remove(row.id);
            self.priority_of.insert(row.id, row.priority);
            self.entries
                .insert((row.priority, row.id), Entry { row, parked: false });
        }
        while self.entries.len() > self.capacity {
            self.truncated = true;
            if let Some(((_, id), _)) = self.entries.pop_last() {
                self.priority_of.remove(&id);
            }
        }
    }

    /// The largest id read so far: a delta read asks for ids above it.
    pub fn high_water(&self) -> OpId {
        self.high_water
    }

    /// The outbox had more ops than the book holds, and the book has since
    /// emptied below half: a full read should refill it.
    pub fn needs_refill(&self) -> bool {
        self.truncated && self.entries.len() < self.capacity / 2
    }

    /// The ops in dispatch order.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// How many ops the book holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Lanes held by dead letters.
    pub fn halted_lanes(&self) -> &[String] {
        &self.halted_lanes
    }

    /// Ops of other outboxes (or beyond the book) occupying its lanes, as of
    /// the last full read.
    pub fn elsewhere(&self) -> &[Occupant] {
        &self.elsewhere
    }

    /// One op.
    pub fn get(&self, id: OpId) -> Option<&Entry> {
        let priority = self.priority_of.get(&id)?;
        self.entries.get(&(*priority, id))
    }

    fn get_mut(&mut self, id: OpId) -> Option<&mut Entry> {
        let priority = self.priority_of.get(&id)?;
        self.entries.get_mut(&(*priority, id))
    }

    fn remove(&mut self, id: OpId) -> Option<Entry> {
        let priority = self.priority_of.remove(&id)?;
        self.entries.remove(&(priority, id))
    }

    /// This drain claimed the op.
    pub fn claimed(&mut self, id: OpId) {
        if let Some(entry) = self.get_mut(id) {
            entry.row.in_flight = true;
            entry.row.budget_attempts = entry.row.budget_attempts.saturating_add(1);
        }
    }

    /// The op could not be claimed or settled for a reason the book cannot
    /// see: it holds its lanes until the next full read.
    pub fn park(&mut self, id: OpId) {
        if let Some(entry) = self.get_mut(id) {
            entry.parked = true;
        }
    }

    /// The fee policy deferred the op until `until`.
    pub fn deferred(&mut self, id: OpId, until: DateTime<Utc>) {
        if let Some(entry) = self.get_mut(id) {
            entry.row.next_attempt_at = until;
        }
    }

    /// A settle of the op committed (`applied`) or found the row moved on.
    pub fn settled(&mut self, id: OpId, finish: &Finish, applied: bool) {
        if !applied {
            self.park(id);
            return;
        }
        match finish {
            Finish::Confirm { .. } | Finish::Fail { halt_lanes: false, .. } => {
                self.remove(id);
            }
            Finish::Fail { halt_lanes: true, .. } => {
                if let Some(entry) = self.remove(id) {
                    for lane in entry.row.lanes {
                        if !self.halted_lanes.contains(&lane) {
                            self.halted_lanes.push(lane);
                        }
                    }
                }
            }
            Finish::Retry {
                next_attempt_at,
                fee_bump,
                receipt_settled,
                ..
            } => {
                if let Some(entry) = self.get_mut(id) {
                    entry.row.in_flight = false;
                    entry.row.next_attempt_at = *next_attempt_at;
                    entry.row.fee_bumps += i32::from(*fee_bump);
                    // A receipt that is not settled stays in doubt, whether
                    // this attempt or an earlier one wrote it.
                    entry.row.in_doubt = !*receipt_settled;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: OpId, priority: Priority, lanes: &[&str]) -> BookRow {
        BookRow {
            id,
            kind: "k".into(),
            priority,
            lanes: lanes.iter().map(|l| (*l).to_owned()).collect(),
            in_flight: false,
            in_doubt: false,
            next_attempt_at: DateTime::UNIX_EPOCH,
            budget_attempts: 0,
            fee_bumps: 0,
            created_at: DateTime::UNIX_EPOCH,
            subject_halted: false,
        }
    }

    fn ids(book: &Book) -> Vec<OpId> {
        book.entries().map(|e| e.row.id).collect()
    }

    #[test]
    fn entries_stay_in_dispatch_order_as_ops_arrive() {
        let mut book = Book::new(10);
        book.reset(
            vec![row(1, Priority::Normal, &["a"]), row(2, Priority::Low, &["b"])],
            vec![],
            vec![],
        );
        book.add(vec![
            row(5, Priority::Critical, &["c"]),
            row(6, Priority::Normal, &["a"]),
        ]);
        assert_eq!(ids(&book), vec![5, 1, 6, 2]);
        assert_eq!(book.high_water(), 6);
    }

    #[test]
    fn an_overflowing_book_keeps_the_first_ops_and_asks_for_a_refill_once_half_empty() {
        let mut book = Book::new(4);
        book.reset(
            (1..=4).map(|i| row(i, Priority::Normal, &["a"])).collect(),
            vec![],
            vec![],
        );
        book.add(vec![row(9, Priority::Critical, &["z"])]);
        assert_eq!(ids(&book), vec![9, 1, 2, 3], "the last in dispatch order was dropped");
        assert!(!book.needs_refill());
        for id in [9, 1, 2] {
            book.claimed(id);
            book.settled(id, &Finish::Confirm { receipt: None }, true);
        }
        assert!(book.needs_refill(), "dropped ops must be read again");

        let mut small = Book::new(4);
        small.reset(vec![row(1, Priority::Normal, &["a"])], vec![], vec![]);
        small.settled(1, &Finish::Confirm { receipt: None }, true);
        assert!(
            !small.needs_refill(),
            "a book that never overflowed has seen everything"
        );
    }

    #[test]
    fn settles_move_ops_out_or_back_to_waiting() {
        let mut book = Book::new(10);
        book.reset(
            vec![
                row(1, Priority::Normal, &["a"]),
                row(2, Priority::Normal, &["b", "c"]),
                row(3, Priority::Normal, &["d"]),
            ],
            vec![],
            vec![],
        );
        for id in [1, 2, 3] {
            book.claimed(id);
        }
        assert!(book
            .get(1)
            .is_some_and(|e| e.row.in_flight && e.row.budget_attempts == 1));
        let at = DateTime::UNIX_EPOCH + chrono::Duration::seconds(60);
        book.settled(
            1,
            &Finish::Retry {
                next_attempt_at: at,
                error: "x".into(),
                fee_bump: true,
                receipt_settled: false,
            },
            true,
        );
        let e = book.get(1).expect("a retried op stays");
        assert!(!e.row.in_flight && e.row.in_doubt && e.row.next_attempt_at == at && e.row.fee_bumps == 1);
        book.settled(
            2,
            &Finish::Fail {
                error: "x".into(),
                halt_lanes: true,
            },
            true,
        );
        assert!(book.get(2).is_none());
        assert_eq!(book.halted_lanes(), ["b".to_owned(), "c".to_owned()]);
        book.settled(3, &Finish::Confirm { receipt: None }, false);
        assert!(
            book.get(3).is_some_and(|e| e.parked),
            "a stale settle parks the op until a full read explains it"
        );
    }

    #[test]
    fn a_full_read_replaces_parks_and_keeps_the_high_water_mark() {
        let mut book = Book::new(10);
        book.reset(vec![row(7, Priority::Normal, &["a"])], vec![], vec![]);
        book.park(7);
        book.reset(vec![row(3, Priority::Normal, &["a"])], vec!["h".into()], vec![]);
        assert_eq!(ids(&book), vec![3]);
        assert!(book.get(3).is_some_and(|e| !e.parked));
        assert_eq!(book.high_water(), 7, "ids already seen are not read again by deltas");
        assert_eq!(book.halted_lanes(), ["h".to_owned()]);
    }
}
