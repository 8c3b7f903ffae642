-- Depth by status, priority and kind at any table size: terminal ops are
-- counted from this narrow index alone (no row is read), open ops through
-- the open-ops index. One index entry per op, written when it finishes
-- (the predicate holds for no open op), so the drain pays it once per op.
CREATE INDEX ops_done ON ops (status, priority, kind) WHERE status IN ('confirmed', 'failed', 'cancelled');
