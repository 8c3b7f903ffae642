-- Ops: enqueue, reads of single ops and listings, kind defaults.
-- Timestamps are Unix milliseconds; lists of values travel as one JSON
-- array parameter read with json_each (PostgreSQL: arrays and ANY).

-- name: op_columns
ops.id, ops.outbox, ops.kind, ops.priority, ops.lanes, ops.payload, ops.idempotency_key, ops.coalesce_key,
ops.subject, ops.correlation_id, ops.status, ops.attempts, ops.attempt_floor, ops.fee_bumps, ops.next_attempt_at,
ops.lease_owner, ops.lease_token, ops.lease_until, ops.receipt, ops.last_error, ops.created_at, ops.updated_at,
ops.finished_at, ops.payload_ref

-- The same columns in an UPDATE's RETURNING, which names the table itself
-- (SQLite does not take the statement's alias there).
-- name: returned_op_columns
laneway_ops.id, laneway_ops.outbox, laneway_ops.kind, laneway_ops.priority, laneway_ops.lanes, laneway_ops.payload, laneway_ops.idempotency_key, laneway_ops.coalesce_key,
laneway_ops.subject, laneway_ops.correlation_id, laneway_ops.status, laneway_ops.attempts, laneway_ops.attempt_floor, laneway_ops.fee_bumps, laneway_ops.next_attempt_at,
laneway_ops.lease_owner, laneway_ops.lease_token, laneway_ops.lease_until, laneway_ops.receipt, laneway_ops.last_error, laneway_ops.created_at, laneway_ops.updated_at,
laneway_ops.finished_at, laneway_ops.payload_ref

-- name: insert_payload
INSERT INTO laneway_payloads AS payloads (hash, body) VALUES ($1, $2) ON CONFLICT DO NOTHING

-- none: set_lock_timeout: the file's one write lock waits busy_timeout_ms

-- name: insert_op
INSERT INTO laneway_ops AS ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, correlation_id,
    next_attempt_at, created_at, updated_at, payload_ref)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11, $12) ON CONFLICT DO NOTHING RETURNING id

-- A batch as one statement: one JSON array of rows, each
-- [outbox, kind, priority, lanes (JSON text), payload, idempotency key,
-- coalesce key, subject, correlation id, due (Unix microseconds),
-- payload ref], inserted in array order, so their ids ascend in it. A row
-- that conflicts (or a tombstone skips) returns no id; the store then
-- rolls the batch back and inserts op by op, which explains each conflict.
-- (The ORDER BY also settles SQLite's parse of INSERT … SELECT … ON CONFLICT.)
-- name: insert_ops
INSERT INTO laneway_ops AS ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, correlation_id,
    next_attempt_at, created_at, updated_at, payload_ref)
SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5, value ->> 6, value ->> 7,
    value ->> 8, (value ->> 9) / 1000, $2, $2, value ->> 10
FROM json_each($1) ORDER BY key
ON CONFLICT DO NOTHING RETURNING id

-- name: op_by_idempotency_key
SELECT id FROM laneway_ops AS ops WHERE outbox = $1 AND idempotency_key = $2

-- name: tombstone_by_idempotency_key
SELECT op_id FROM laneway_idempotency_tombstones AS idempotency_tombstones WHERE outbox = $1 AND idempotency_key = $2

-- The predicate is the ops_coalesce partial index's, literally: a planner
-- proves an index usable only from literals.
-- name: live_op_by_coalesce_key
SELECT id FROM laneway_ops AS ops WHERE outbox = $1 AND coalesce_key = $2 AND status IN ('pending', 'submitted')

-- name: payloads_by_hash
SELECT hash, body FROM laneway_payloads AS payloads WHERE hash IN (SELECT value FROM json_each($1))

-- name: op_by_id
SELECT {{op_columns}} FROM laneway_ops AS ops WHERE ops.id = $1

-- name: redealt
SELECT DISTINCT op_id FROM laneway_lane_redeals AS lane_redeals WHERE op_id IN (SELECT value FROM json_each($1)) ORDER BY op_id

-- name: attempts_of_op
SELECT op_id, attempt, started_at, finished_at, outcome, detail, fee, error FROM laneway_attempts AS attempts
WHERE op_id = $1 ORDER BY attempt

-- The store appends the listing's filters, each the same on every dialect.
-- name: list_ops
SELECT {{op_columns}} FROM laneway_ops AS ops WHERE TRUE

-- The lane filter the store appends to list_ops, its lane bound after it.
-- name: list_lane_filter
 AND id IN (SELECT op_id FROM laneway_op_lanes WHERE lane = 

-- Open ops through the open-ops index, terminal ones from ops_done alone:
-- a million finished ops cost an index scan, not a million row reads.
-- name: depth
SELECT status, priority, kind, COUNT(*) AS n FROM laneway_ops AS ops WHERE status IN ('pending', 'submitted')
GROUP BY status, priority, kind
UNION ALL
SELECT status, priority, kind, COUNT(*) AS n FROM laneway_ops AS ops WHERE status IN ('confirmed', 'failed', 'cancelled')
GROUP BY status, priority, kind
ORDER BY status, priority, kind

-- The newest outcomes only, at most $2 of them, through the primary key,
-- by minute and status: what the console's last hour shows costs the same
-- at any table size.
-- name: recent_outcomes_by_minute
SELECT (at / 60000) * 60000 AS minute, status, COUNT(*) AS n, MIN(at) AS since
FROM (SELECT status, at FROM laneway_outcomes AS outcomes ORDER BY seq DESC LIMIT $2) recent
WHERE at >= $1 GROUP BY 1, 2 ORDER BY 1, 2

-- Attempts that failed and did not confirm, by minute: the newest ops'
-- attempts only, at most $2, through the primary key (no index on time).
-- name: recent_retries_by_minute
SELECT (finished_at / 60000) * 60000 AS minute, COUNT(*) AS n, MIN(finished_at) AS since
FROM (SELECT finished_at, outcome FROM laneway_attempts AS attempts ORDER BY op_id DESC, attempt DESC LIMIT $2) recent
WHERE finished_at >= $1 AND outcome IN ('retryable', 'plugin_fault', 'lease_expired') GROUP BY 1 ORDER BY 1

-- The single writer already serialises these writers.
-- name: lock_kind_defaults
SELECT 1

-- name: delete_unlisted_kind_defaults
DELETE FROM laneway_kind_defaults AS kind_defaults WHERE kind NOT IN (SELECT value FROM json_each($1))

-- name: upsert_kind_default
INSERT INTO laneway_kind_defaults AS kind_defaults (kind, priority, lanes) VALUES ($1, $2, $3)
ON CONFLICT (kind) DO UPDATE SET priority = excluded.priority, lanes = excluded.lanes

-- The producer contract's limits (NULL: shapes are checked, kinds are not).
-- name: register_contract
UPDATE laneway_contract SET max_payload_bytes = $1, registered_at = $2 WHERE id = 1

-- name: release_coalesce
UPDATE laneway_ops AS ops SET coalesce_key = NULL, updated_at = $1
WHERE outbox = $2 AND coalesce_key IS NOT NULL AND status IN ($3, $4)
    AND idempotency_key IN (SELECT value FROM json_each($5))
