-- Retention and the outcome feed: what the pruner may delete, tombstones of
-- idempotency keys, the deletes, and the feed of terminal transitions.
-- A cursor is "xid.seq": a row is served only once no transaction that could
-- still write an earlier one is running (see the outcomes migration).

-- The horizon: the oldest transaction still running that could write an
-- outcome, read from this statement's snapshot. A transaction of another
-- database never writes this one's rows, so it is passed over when
-- pg_stat_activity (whose database and xid columns every role may read)
-- shows it running there: an idle transaction elsewhere on the server does
-- not hold the feed back. Any other (this database's, a prepared one, one
-- that ended since the snapshot) still counts.
-- name: feed_horizon
least(pg_snapshot_xmax(pg_current_snapshot()),
    (SELECT min(x) FROM pg_snapshot_xip(pg_current_snapshot()) AS x WHERE NOT EXISTS (
        SELECT 1 FROM pg_stat_activity a
        WHERE a.backend_xid::text::bigint = x::text::bigint % 4294967296
          AND a.datid <> (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()))))

-- The store binds (xid, seq, limit).
-- name: outcomes
SELECT f.seq, f.xid::text::bigint AS fxid, f.status AS fstatus, f.at AS fat, {{op_columns}} FROM ops JOIN
    (SELECT seq, xid, op_id, status, at FROM outcomes
     WHERE xid < {{feed_horizon}} AND (xid, seq) > ($1::text::xid8, $2)
     ORDER BY xid, seq LIMIT $3) f
    ON f.op_id = ops.id
ORDER BY f.xid, f.seq

-- Terminal ops past retention, oldest first; a dead letter that holds a
-- strict lane is never one. $3: only this kind, or (NULL) every kind not in
-- $4; $5: keep ops with an outcome past the cursor ($6, $7) a relay still has
-- to send.
-- name: prunable
SELECT {{op_columns}} FROM ops WHERE ops.status = $1 AND ops.finished_at < $2
    AND (CASE WHEN $3::text IS NULL THEN NOT (ops.kind = ANY($4)) ELSE ops.kind = $3 END)
    AND (NOT $5 OR ops.id NOT IN (SELECT op_id FROM outcomes WHERE (xid, seq) > ($6::text::xid8, $7)))
    AND ops.id NOT IN (SELECT op_id FROM lane_halts)
ORDER BY ops.id LIMIT $8

-- name: insert_tombstone
INSERT INTO idempotency_tombstones (outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING

-- Locked, so an operator's retry cannot move one of them meanwhile; skipped
-- when another pruner holds it.
-- name: doomed_ops
SELECT id FROM ops WHERE id = ANY($1) AND status = $2 AND id NOT IN (SELECT op_id FROM lane_halts)
ORDER BY id FOR UPDATE SKIP LOCKED

-- name: shared_payloads_of_ops
SELECT DISTINCT payload_ref FROM ops WHERE id = ANY($1) AND payload_ref IS NOT NULL

-- name: delete_attempts_of_ops
DELETE FROM attempts WHERE op_id = ANY($1)

-- name: delete_lanes_of_ops
DELETE FROM op_lanes WHERE op_id = ANY($1)

-- name: delete_redeals_of_ops
DELETE FROM lane_redeals WHERE op_id = ANY($1)

-- name: delete_outcomes_of_ops
DELETE FROM outcomes WHERE op_id = ANY($1)

-- name: delete_ops
DELETE FROM ops WHERE id = ANY($1)

-- A shared payload goes with the last op that carries it (a concurrent
-- enqueue of the same payload finds the row it keeps or inserts it again).
-- name: delete_unshared_payloads
DELETE FROM payloads WHERE hash = ANY($1)
    AND NOT EXISTS (SELECT 1 FROM ops WHERE ops.payload_ref = payloads.hash)

-- name: expire_tombstones
DELETE FROM idempotency_tombstones WHERE (outbox, idempotency_key) IN
    (SELECT outbox, idempotency_key FROM idempotency_tombstones WHERE expires_at IS NOT NULL AND expires_at < $1 LIMIT $2)

-- name: tombstone
SELECT outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at
FROM idempotency_tombstones WHERE outbox = $1 AND idempotency_key = $2

-- The tables retention bounds.
-- name: table_rows
SELECT (SELECT COUNT(*) FROM ops) AS ops, (SELECT COUNT(*) FROM attempts) AS attempts,
    (SELECT COUNT(*) FROM op_lanes) AS op_lanes, (SELECT COUNT(*) FROM outcomes) AS outcomes,
    (SELECT COUNT(*) FROM idempotency_tombstones) AS idempotency_tombstones, (SELECT COUNT(*) FROM payloads) AS payloads
