-- Retention and the outcome feed: what the pruner may delete, tombstones of
-- idempotency keys, the deletes, and the feed of terminal transitions.
-- SQLite has one writer, so the feed's sequence is its commit order and a
-- cursor is the sequence alone.

-- none: feed_horizon: the one writer commits the feed in sequence order

-- The store binds (xid, seq, limit); SQLite's cursor has no xid.
-- name: outcomes
SELECT f.seq, 0 AS fxid, f.fstatus, f.fat, {{op_columns}} FROM laneway_ops AS ops JOIN
    (SELECT seq, op_id, status AS fstatus, at AS fat FROM laneway_outcomes AS outcomes WHERE seq > $2 ORDER BY seq LIMIT $3) f
    ON f.op_id = ops.id
ORDER BY f.seq

-- Terminal ops past retention, oldest first; a dead letter that holds a
-- strict lane is never one. $3: only this kind, or (NULL) every kind not in
-- $4; $5: keep ops with an outcome past the cursor ($6, $7) a relay still has
-- to send.
-- name: prunable
SELECT {{op_columns}} FROM laneway_ops AS ops WHERE ops.status = $1 AND ops.finished_at < $2
    AND (CASE WHEN $3 IS NULL THEN ops.kind NOT IN (SELECT value FROM json_each($4)) ELSE ops.kind = $3 END)
    AND (NOT $5 OR ops.id NOT IN (SELECT op_id FROM laneway_outcomes AS outcomes WHERE seq > $7))
    AND ops.id NOT IN (SELECT op_id FROM laneway_lane_halts AS lane_halts)
ORDER BY ops.id LIMIT $8

-- name: insert_tombstone
INSERT INTO laneway_idempotency_tombstones AS idempotency_tombstones (outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING

-- One writer: what this selects cannot change before the deletes.
-- name: doomed_ops
SELECT id FROM laneway_ops AS ops WHERE id IN (SELECT value FROM json_each($1)) AND status = $2
    AND id NOT IN (SELECT op_id FROM laneway_lane_halts AS lane_halts)
ORDER BY id

-- name: shared_payloads_of_ops
SELECT DISTINCT payload_ref FROM laneway_ops AS ops WHERE id IN (SELECT value FROM json_each($1)) AND payload_ref IS NOT NULL

-- name: delete_attempts_of_ops
DELETE FROM laneway_attempts AS attempts WHERE op_id IN (SELECT value FROM json_each($1))

-- name: delete_lanes_of_ops
DELETE FROM laneway_op_lanes AS op_lanes WHERE op_id IN (SELECT value FROM json_each($1))

-- name: delete_redeals_of_ops
DELETE FROM laneway_lane_redeals AS lane_redeals WHERE op_id IN (SELECT value FROM json_each($1))

-- name: delete_outcomes_of_ops
DELETE FROM laneway_outcomes AS outcomes WHERE op_id IN (SELECT value FROM json_each($1))

-- name: delete_ops
DELETE FROM laneway_ops AS ops WHERE id IN (SELECT value FROM json_each($1))

-- A shared payload goes with the last op that carries it.
-- name: delete_unshared_payloads
DELETE FROM laneway_payloads AS payloads WHERE hash IN (SELECT value FROM json_each($1))
    AND NOT EXISTS (SELECT 1 FROM laneway_ops AS ops WHERE ops.payload_ref = payloads.hash)

-- name: expire_tombstones
DELETE FROM laneway_idempotency_tombstones AS idempotency_tombstones WHERE (outbox, idempotency_key) IN
    (SELECT outbox, idempotency_key FROM laneway_idempotency_tombstones AS idempotency_tombstones WHERE expires_at IS NOT NULL AND expires_at < $1 LIMIT $2)

-- name: tombstone
SELECT outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at
FROM laneway_idempotency_tombstones AS idempotency_tombstones WHERE outbox = $1 AND idempotency_key = $2

-- The tables retention bounds.
-- name: table_rows
SELECT (SELECT COUNT(*) FROM laneway_ops AS ops) AS ops, (SELECT COUNT(*) FROM laneway_attempts AS attempts) AS attempts,
    (SELECT COUNT(*) FROM laneway_op_lanes AS op_lanes) AS op_lanes, (SELECT COUNT(*) FROM laneway_outcomes AS outcomes) AS outcomes,
    (SELECT COUNT(*) FROM laneway_idempotency_tombstones AS idempotency_tombstones) AS idempotency_tombstones, (SELECT COUNT(*) FROM laneway_payloads AS payloads) AS payloads
