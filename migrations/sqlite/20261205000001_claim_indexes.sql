-- Two indexes no statement reads any more, dropped: every claim deleted an
-- entry from each and every enqueue wrote one to each. `ops_claim`
-- (priority, id) served a global claim order the drains gave up for
-- per-outbox books; `ops_outbox_claim` (outbox, priority, id) over pending
-- ops is answered by `ops_outbox_active`, the same columns over pending and
-- submitted ops, which the book reads anyway. (The safety-net poll reads
-- `ops_due`, led by the outbox since 20261203000001.)
DROP INDEX ops_claim;
DROP INDEX ops_outbox_claim;
