//! One drain's book: what it knows of its outbox's non-terminal ops between
//! rounds, so a round reads only what changed instead of the whole window.
//!
//! Pure bookkeeping, no I/O. The drain fills the book from a full read (see
//! [`Filling`]: the first `capacity` ops in dispatch order, and beyond them,
//! when a few lanes crowd that prefix, the ops of the other lanes), adds ops
//! enqueued since (a read of ids above the high-water mark), and applies its
//! own claims and settles as it makes them. What the drain cannot see (an
//! operator's cancel or force-retry, a lease recovered by the poll, a lane
//! freed in another outbox) waits for the next full read, which the drain
//! makes at least every `poll_ms`. In between, the book errs on the side of
//! holding: an op whose claim was refused or whose settle found the row
//! moved on stays in the book, parked (it blocks its strict lanes), until
//! that read replaces it.
//!
//! The book knows every op up to its *bound* in dispatch order, except the
//! ops of *cut* lanes from their cut on: a lane with more ops than it can
//! use (a dead inbox with a long backlog) is not read past its first few
//! beyond the prefix, so its backlog never hides the other lanes; an op of a
//! cut lane after the cut waits, because ops of that lane ahead of it were
//! not read.
//!
//! **Architecture Invariant:** the book never lets an op start that a fresh
//! read would hold: every change it cannot explain parks the op, an op
//! behind ops it has not read waits, and the claim re-checks the lane rule
//! in the database anyway.

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

/// A position in dispatch order.
pub(crate) type Key = (Priority, OpId);

fn key(row: &BookRow) -> Key {
    (row.priority, row.id)
}

/// More ops than this of one lane set in a full read, and the set is
/// crowded: the read goes on past it to find the other lanes. A strict lane
/// runs one op at a time, so a few queued ops keep it busy until the next
/// full read.
pub(crate) const CROWDED: usize = 8;

/// Ops of each lane set a read past the prefix asks for: enough for a set
/// the prefix did not see to fill up to [`CROWDED`], and one more to find
/// where it is cut.
pub(crate) const PER_SET: u32 = CROWDED as u32 + 1;

/// What a full read found: the ops to keep, and what it could not see.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filling {
    rows: Vec<BookRow>,
    capacity: usize,
    per_set: HashMap<Vec<String>, usize>,
    cut: HashMap<String, Key>,
    /// The last op read (kept or not).
    last: Option<Key>,
    /// Rows read past the prefix, kept or not.
    walked: usize,
    /// Rows kept past the prefix.
    kept_beyond: usize,
    /// The read reached the outbox's last op.
    complete: bool,
}

impl Filling {
    /// Starts from the first ops in dispatch order, read with `capacity` as
    /// the limit.
    pub fn new(prefix: Vec<BookRow>, capacity: usize) -> Self {
        let mut filling = Self {
            capacity,
            complete: prefix.len() < capacity,
            ..Self::default()
        };
        for row in prefix {
            filling.last = Some(key(&row));
            *filling.per_set.entry(row.lanes.clone()).or_default() += 1;
            filling.rows.push(row);
        }
        filling
    }

    /// Whether the read should go on past the prefix: it did not reach the
    /// end, and some lane set in it is crowded (past it, the other lanes'
    /// ops would otherwise wait until that lane's backlog drains).
    pub fn wants_more(&self) -> bool {
        !self.complete && self.kept_beyond < self.capacity && self.per_set.values().any(|n| *n > CROWDED)
    }

    /// Where the read past the prefix starts (after this key).
    pub fn next_from(&self) -> Key {
        self.last.unwrap_or((Priority::Critical, 0))
    }

    /// Takes what a read past the prefix found: the first [`PER_SET`] ops
    /// of each lane set after [`Filling::next_from`], in dispatch order, at
    /// most `limit`. Keeps the ops of lane sets that are not crowded and cuts
    /// the lanes of those that are. An op the read left out has
    /// [`PER_SET`] ops of its own set ahead of it, one of them the set's cut
    /// (a set is cut once it holds [`CROWDED`] ops), so it is behind its
    /// lanes' cuts, as if it had been read and cut.
    pub fn beyond(&mut self, rows: Vec<BookRow>, limit: usize) {
        if rows.len() < limit {
            self.complete = true;
        }
        for row in rows {
            let at = key(&row);
            self.last = Some(at);
            self.walked += 1;
            let seen = self.per_set.entry(row.lanes.clone()).or_default();
            if *seen >= CROWDED {
                // Rows come in dispatch order: a lane's first cut stands.
                for lane in &row.lanes {
                    self.cut.entry(lane.clone()).or_insert(at);
                }
                continue;
            }
            *seen += 1;
            self.kept_beyond += 1;
            self.rows.push(row);
            if self.kept_beyond >= self.capacity {
                self.complete = false;
                return;
            }
        }
    }

    /// The rows to keep.
    pub fn rows(&self) -> &[BookRow] {
        &self.rows
    }

    /// Rows read past the prefix (kept or not).
    pub fn walked(&self) -> usize {
        self.walked
    }

    /// Rows kept past the prefix.
    pub fn kept_beyond(&self) -> usize {
        self.kept_beyond
    }
}

/// The book of one outbox's drain.
#[derive(Debug, Clone)]
pub(crate) struct Book {
    entries: BTreeMap<Key, Entry>,
    priority_of: HashMap<OpId, Priority>,
    high_water: OpId,
    capacity: usize,
    /// Every op up to here in dispatch order was read (`None`: every op).
    bound: Option<Key>,
    /// Lanes whose ops were not read from this key on.
    cut: HashMap<String, Key>,
    halted_lanes: Vec<String>,
    elsewhere: Vec<Occupant>,
    /// Ops the last full read kept.
    filled: usize,
    /// The last schedule left permits it could have used unused.
    idle_permits: bool,
}

impl Book {
    /// An empty book whose full reads take `capacity` ops in dispatch order
    /// (and as many again past crowded lanes).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: BTreeMap::new(),
            priority_of: HashMap::new(),
            high_water: 0,
            capacity: capacity.max(1),
            bound: None,
            cut: HashMap::new(),
            halted_lanes: Vec::new(),
            elsewhere: Vec::new(),
            filled: 0,
            idle_permits: false,
        }
    }

    /// Replaces everything with a full read: what `filling` found, the
    /// lanes dead letters hold, and the ops occupying the rows' lanes
    /// anywhere.
    pub fn fill(&mut self, filling: Filling, halted_lanes: Vec<String>, elsewhere: Vec<Occupant>) {
        self.entries.clear();
        self.priority_of.clear();
        self.bound = if filling.complete { None } else { filling.last };
        self.cut = filling.cut;
        self.halted_lanes = halted_lanes;
        self.elsewhere = elsewhere;
        self.add(filling.rows);
        self.filled = self.entries.len();
        self.idle_permits = false;
    }

    /// Whether the last schedule left permits unused that it could have
    /// taken (it started fewer ops than it was allowed).
    pub fn permits_idle(&mut self, idle: bool) {
        self.idle_permits = idle;
    }

    /// Replaces everything with a plain read of the first ops in dispatch
    /// order (at most the capacity).
    #[cfg(test)]
    pub fn reset(&mut self, rows: Vec<BookRow>, halted_lanes: Vec<String>, elsewhere: Vec<Occupant>) {
        let filling = Filling::new(rows, self.capacity);
        self.fill(filling, halted_lanes, elsewhere);
    }

    /// Adds ops read since (ids above the high-water mark); a row already in
    /// the book replaces it. An op past the bound is left out: ops ahead of
    /// it there were not read (the next full read finds it). When the book
    /// overflows (twice the capacity) it keeps the lowest in dispatch order
    /// and moves the bound back.
    pub fn add(&mut self, rows: Vec<BookRow>) {
        for row in rows {
            self.high_water = self.high_water.max(row.id);
            if self.bound.is_some_and(|b| key(&row) > b) {
                continue;
            }
            self.remove(row.id);
            self.priority_of.insert(row.id, row.priority);
            self.entries.insert(key(&row), Entry { row, parked: false });
        }
        let most = self.capacity.saturating_mul(2);
        if self.entries.len() > most {
            while self.entries.len() > most {
                if let Some(((_, id), _)) = self.entries.pop_last() {
                    self.priority_of.remove(&id);
                }
            }
            self.bound = self.entries.last_key_value().map(|(k, _)| *k);
        }
    }

    /// Whether the op's place was read in full: no lane of it was cut ahead
    /// of it. One that was not must wait (it still blocks its strict lanes).
    pub fn in_reach(&self, row: &BookRow) -> bool {
        if self.cut.is_empty() {
            return true;
        }
        let at = key(row);
        row.lanes
            .iter()
            .all(|lane| self.cut.get(lane).is_none_or(|cut| at < *cut))
    }

    /// The largest id read so far: a delta read asks for ids above it.
    pub fn high_water(&self) -> OpId {
        self.high_water
    }

    /// The outbox had more ops than the book read, and the book has since
    /// emptied below half its capacity, or lost an eighth of what the read
    /// kept while permits go unused (ops to destinations that have not
    /// answered yet wait behind their first request, so a book of new servers
    /// holds too few that may start): a full read should refill it. The
    /// eighth bounds the reads to one per that many ops gone.
    pub fn needs_refill(&self) -> bool {
        let gone = self.filled.saturating_sub(self.entries.len());
        self.bound.is_some()
            && (self.entries.len() < self.capacity / 2 || (self.idle_permits && gone >= (self.capacity / 8).max(1)))
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

    /// Another outbox's drain freed `lanes`: their occupants elsewhere are
    /// now `occupants` (read since), and ops of these lanes parked by a
    /// refused claim may be tried again (the claim re-checks them).
    pub fn refresh_elsewhere(&mut self, lanes: &[String], occupants: Vec<Occupant>) {
        let touches = |own: &[String]| own.iter().any(|l| lanes.contains(l));
        self.elsewhere.retain(|o| !touches(&o.lanes));
        let known: std::collections::HashSet<OpId> = self.elsewhere.iter().map(|o| o.id).collect();
        self.elsewhere
            .extend(occupants.into_iter().filter(|o| !known.contains(&o.id)));
        for entry in self.entries.values_mut() {
            if entry.parked && touches(&entry.row.lanes) {
                entry.parked = false;
            }
        }
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

    /// The drain sent a claim of the op that has not committed yet: it
    /// counts as in flight (it holds its lanes and caps, and no later round
    /// picks it again) until the claim lands as [`Book::claimed`] or
    /// [`Book::refused`]. A full read meanwhile sees it pending; the drain
    /// marks it again.
    pub fn claiming(&mut self, id: OpId) {
        if let Some(entry) = self.get_mut(id) {
            entry.row.in_flight = true;
        }
    }

    /// A claim sent with [`Book::claiming`] did not take the op: it waits,
    /// parked, until the next full read says why.
    pub fn refused(&mut self, id: OpId) {
        if let Some(entry) = self.get_mut(id) {
            entry.row.in_flight = false;
            entry.parked = true;
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
        if !matches!(finish, Finish::Retry { .. }) {
            // A full read taken while the op ran may have listed it among
            // its lanes' occupants; done, it occupies nothing.
            self.elsewhere.retain(|o| o.id != id);
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
    fn a_truncated_book_leaves_out_new_ops_past_its_bound_and_asks_for_a_refill_once_half_empty() {
        let mut book = Book::new(4);
        book.reset(
            (1..=4).map(|i| row(i, Priority::Normal, &["a"])).collect(),
            vec![],
            vec![],
        );
        book.add(vec![
            row(9, Priority::Critical, &["z"]),
            row(10, Priority::Normal, &["y"]),
        ]);
        assert_eq!(
            ids(&book),
            vec![9, 1, 2, 3, 4],
            "a normal op after the bound may have unread ops of its lanes ahead of it"
        );
        assert_eq!(
            book.high_water(),
            10,
            "it is not read again by deltas: the refill finds it"
        );
        assert!(!book.needs_refill());
        for id in [9, 1, 2, 3] {
            book.claimed(id);
            book.settled(id, &Finish::Confirm { receipt: None }, true);
        }
        assert!(book.needs_refill(), "ops past the bound must be read");

        let mut small = Book::new(4);
        small.reset(vec![row(1, Priority::Normal, &["a"])], vec![], vec![]);
        small.add(vec![row(2, Priority::Low, &["b"])]);
        assert_eq!(
            ids(&small),
            vec![1, 2],
            "a book that read everything takes every new op"
        );
        small.settled(1, &Finish::Confirm { receipt: None }, true);
        assert!(
            !small.needs_refill(),
            "a book that never overflowed has seen everything"
        );
    }

    #[test]
    fn a_truncated_book_with_idle_permits_asks_for_a_refill_after_an_eighth_left() {
        let mut book = Book::new(16);
        book.reset(
            (1..=16)
                .map(|i| row(i, Priority::Normal, &[&format!("l{i}")]))
                .collect(),
            vec![],
            vec![],
        );
        book.permits_idle(true);
        assert!(!book.needs_refill(), "nothing left: a read would find the same ops");
        book.claimed(1);
        book.settled(1, &Finish::Confirm { receipt: None }, true);
        assert!(!book.needs_refill(), "one op gone is not an eighth");
        book.claimed(2);
        book.settled(2, &Finish::Confirm { receipt: None }, true);
        assert!(book.needs_refill(), "an eighth gone while permits idle");
        book.permits_idle(false);
        assert!(!book.needs_refill(), "every permit used: the book is enough");
    }

    #[test]
    fn an_overflowing_book_keeps_the_first_ops_and_moves_its_bound_back() {
        let mut book = Book::new(2);
        book.reset(vec![row(1, Priority::Normal, &["a"])], vec![], vec![]);
        book.add((2..=6).map(|i| row(i, Priority::Normal, &["a"])).collect());
        assert_eq!(
            ids(&book),
            vec![1, 2, 3, 4],
            "twice the capacity, lowest in dispatch order"
        );
        book.add(vec![row(7, Priority::Normal, &["b"])]);
        assert_eq!(ids(&book), vec![1, 2, 3, 4], "past the new bound");
    }

    #[test]
    fn a_crowded_prefix_is_read_past_and_the_crowding_lane_is_cut() {
        let dead = |id| row(id, Priority::Normal, &["dead"]);
        let mut filling = Filling::new((1..=10).map(dead).collect(), 10);
        assert!(filling.wants_more(), "one lane fills the prefix");
        assert_eq!(filling.next_from(), (Priority::Normal, 10));
        let page = vec![
            dead(11),
            row(12, Priority::Normal, &["a"]),
            dead(13),
            row(14, Priority::Normal, &["dead", "x"]),
            row(15, Priority::Low, &["x"]),
        ];
        filling.beyond(page, 10);
        assert_eq!(filling.walked(), 5);
        assert_eq!(filling.kept_beyond(), 3);
        let mut book = Book::new(10);
        book.fill(filling, vec![], vec![]);
        assert_eq!(ids(&book), (1..=10).chain([12, 14, 15]).collect::<Vec<_>>());
        let reach = |book: &Book, id| book.get(id).is_some_and(|e| book.in_reach(&e.row));
        assert!(reach(&book, 10), "the prefix was read in full");
        assert!(reach(&book, 12), "another lane's op behind the crowd");
        assert!(!reach(&book, 14), "ops of `dead` ahead of it were not read");
        assert!(
            reach(&book, 15),
            "x's only op ahead of it is in the book, where it blocks"
        );
        book.add(vec![
            row(16, Priority::Normal, &["dead"]),
            row(17, Priority::Normal, &["b"]),
        ]);
        assert!(
            !reach(&book, 16) && reach(&book, 17),
            "the read was complete: new ops come in, cut lanes wait"
        );
    }

    #[test]
    fn a_read_past_the_prefix_that_fills_its_limit_or_the_book_bounds_what_it_read() {
        let crowd = || Filling::new((1..=10).map(|i| row(i, Priority::Normal, &["d"])).collect(), 10);
        let mut filling = crowd();
        let page: Vec<BookRow> = (11..=20).map(|i| row(i, Priority::Normal, &["d"])).collect();
        filling.beyond(page, 10);
        let mut book = Book::new(10);
        book.fill(filling, vec![], vec![]);
        book.add(vec![row(21, Priority::Normal, &["e"])]);
        assert!(book.get(21).is_none(), "past what the read reached");

        let mut filling = crowd();
        let page: Vec<BookRow> = (11..=30)
            .map(|i| row(i, Priority::Normal, &[&format!("l{i}")]))
            .collect();
        filling.beyond(page, 20);
        assert_eq!(filling.kept_beyond(), 10, "the book is full");
        let mut book = Book::new(10);
        book.fill(filling, vec![], vec![]);
        assert_eq!(book.len(), 20);
        book.add(vec![row(31, Priority::Normal, &["e"])]);
        assert!(book.get(31).is_none(), "bounded at the last row kept");

        let plain = Filling::new(
            (1..=10)
                .map(|i| row(i, Priority::Normal, &[&format!("l{i}")]))
                .collect(),
            10,
        );
        assert!(!plain.wants_more(), "a prefix of many lanes needs no read past it");
    }

    #[test]
    fn ops_a_read_past_the_prefix_leaves_out_are_behind_their_lanes_cut() {
        // The store returns the first PER_SET ops of each lane set: of d's
        // long backlog (11..=50) only 11..=19, then the others' first ops.
        let mut filling = Filling::new((1..=10).map(|i| row(i, Priority::Normal, &["d"])).collect(), 10);
        let mut page: Vec<BookRow> = (11..11 + i64::from(PER_SET))
            .map(|i| row(i, Priority::Normal, &["d"]))
            .collect();
        page.push(row(51, Priority::Normal, &["d", "y"]));
        page.push(row(52, Priority::Normal, &["z"]));
        filling.beyond(page, 10);
        let mut book = Book::new(10);
        book.fill(filling, vec![], vec![]);
        let reach = |book: &Book, id| book.get(id).is_some_and(|e| book.in_reach(&e.row));
        assert!(
            book.get(51).is_some() && !reach(&book, 51),
            "d's unread ops 20..=50 are ahead of it: it waits"
        );
        assert!(reach(&book, 52), "a lane behind the crowd is found");
        book.add(vec![row(53, Priority::Normal, &["y"])]);
        assert!(!reach(&book, 53), "y's op 51 is ahead of it, in the book");
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
    fn freed_lanes_replace_their_occupants_and_unpark_their_ops() {
        let occupant = |id: OpId, lane: &str| Occupant {
            id,
            outbox: "other".into(),
            kind: "k".into(),
            priority: Priority::Normal,
            lanes: vec![lane.to_owned()],
            in_flight: true,
            in_doubt: false,
        };
        let mut book = Book::new(10);
        book.reset(
            vec![row(1, Priority::Normal, &["s"]), row(2, Priority::Normal, &["t"])],
            vec![],
            vec![occupant(50, "s"), occupant(51, "t")],
        );
        book.park(1);
        book.park(2);
        book.refresh_elsewhere(&["s".to_owned()], vec![occupant(52, "s")]);
        let ids: Vec<OpId> = book.elsewhere().iter().map(|o| o.id).collect();
        assert_eq!(ids, vec![51, 52], "s's occupant replaced, t's kept");
        assert!(
            book.get(1).is_some_and(|e| !e.parked),
            "an op of the freed lane is tried again"
        );
        assert!(book.get(2).is_some_and(|e| e.parked));
        // The book's own op, listed as an occupant by a read while it ran,
        // occupies nothing once it is settled.
        book.refresh_elsewhere(&["s".to_owned()], vec![occupant(1, "s")]);
        book.claimed(1);
        book.settled(1, &Finish::Confirm { receipt: None }, true);
        assert!(book.elsewhere().iter().all(|o| o.id != 1));
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
