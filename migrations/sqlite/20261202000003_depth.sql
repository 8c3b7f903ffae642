-- Depth by status, priority and kind at any table size: terminal ops are
-- counted from this narrow index alone (no row is read), open ops through
-- the open-ops index. One index entry per op, written when it finishes
-- (the predicate holds for no open op), so the drain pays it once per op.
CREATE INDEX ops_done ON ops (status, priority, kind) WHERE status IN ('confirmed', 'failed', 'cancelled');

-- The console's and the CLI's filters by correlation id and by creation
-- time, at any table size. SQLite writes an index only when its own columns
-- change, and these never do after enqueue, so each costs one entry per op.
-- (PostgreSQL writes every index on each status change of a row, so there
-- these filters scan instead: see BENCHMARKS.md.)
CREATE INDEX ops_correlation ON ops (correlation_id) WHERE correlation_id IS NOT NULL;
CREATE INDEX ops_created ON ops (created_at);
