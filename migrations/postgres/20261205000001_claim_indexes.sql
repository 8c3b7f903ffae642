-- Two indexes no statement needs any more, dropped: every claim and every
-- enqueue wrote an entry to each (PostgreSQL writes every index of a row
-- whose status changes). `ops_claim` (priority, id) served a global claim
-- order the drains gave up for per-outbox books; `ops_outbox_claim`
-- (outbox, priority, id) over pending ops is answered by
-- `ops_outbox_active`, the same columns over pending and submitted ops,
-- which the book reads anyway.
--
-- The safety-net poll skip-scanned the outboxes through `ops_outbox_claim`;
-- it gets `ops_due` led by the outbox, as SQLite has since 20261203000001:
-- one seek per outbox and one more for whether it has a due op. Same
-- predicate, so a pending op still costs one entry in it.
DROP INDEX ops_claim;
DROP INDEX ops_outbox_claim;
DROP INDEX ops_due;
CREATE INDEX ops_due ON ops (outbox, next_attempt_at) WHERE status = 'pending';
