-- Ops: enqueue, reads of single ops and listings, kind defaults.
-- Timestamps are timestamptz; lists of values travel as arrays (SQLite:
-- one JSON array parameter read with json_each).

-- name: op_columns
ops.id, ops.outbox, ops.kind, ops.priority, ops.lanes, ops.payload::text AS payload, ops.idempotency_key, ops.coalesce_key,
ops.subject, ops.correlation_id, ops.status, ops.attempts, ops.attempt_floor, ops.fee_bumps, ops.next_attempt_at,
ops.lease_owner, ops.lease_token, ops.lease_until, ops.receipt, ops.last_error, ops.created_at, ops.updated_at,
ops.finished_at, ops.payload_ref

-- The same columns in an UPDATE's RETURNING.
-- name: returned_op_columns
{{op_columns}}

-- name: insert_payload
INSERT INTO payloads (hash, body) VALUES ($1, $2::json) ON CONFLICT DO NOTHING

-- laneway's own enqueue waits this long for a lock a producer's open
-- transaction holds (an idempotency key it is inserting too), this
-- transaction only; $1 like '5000ms'.
-- name: set_lock_timeout
SELECT set_config('lock_timeout', $1, true)

-- name: insert_op
INSERT INTO ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, correlation_id,
    next_attempt_at, created_at, updated_at, payload_ref)
VALUES ($1, $2, $3, $4, $5::json, $6, $7, $8, $9, $10, $11, $11, $12) ON CONFLICT DO NOTHING RETURNING id

-- A batch as one statement: one JSON array of rows, each
-- [outbox, kind, priority, lanes (JSON text), payload, idempotency key,
-- coalesce key, subject, correlation id, due (Unix microseconds),
-- payload ref], inserted in array order, so the ids the insert trigger
-- takes ascend in it. A row that conflicts (or a tombstone skips) returns
-- no id; the store then rolls the batch back and inserts op by op, which
-- explains each conflict.
-- name: insert_ops
INSERT INTO ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, correlation_id,
    next_attempt_at, created_at, updated_at, payload_ref)
SELECT r.v ->> 0, r.v ->> 1, (r.v ->> 2)::smallint, ARRAY(SELECT l.e FROM json_array_elements_text((r.v ->> 3)::json) WITH ORDINALITY AS l(e, i)
        ORDER BY l.i),
    (r.v ->> 4)::json, r.v ->> 5, r.v ->> 6, r.v ->> 7, r.v ->> 8,
    'epoch'::timestamptz + (r.v ->> 9)::bigint * interval '1 microsecond', $2, $2, r.v ->> 10
FROM json_array_elements($1::json) WITH ORDINALITY AS r(v, n) ORDER BY r.n
ON CONFLICT DO NOTHING RETURNING id

-- name: op_by_idempotency_key
SELECT id FROM ops WHERE outbox = $1 AND idempotency_key = $2

-- name: tombstone_by_idempotency_key
SELECT op_id FROM idempotency_tombstones WHERE outbox = $1 AND idempotency_key = $2

-- The predicate is the ops_coalesce partial index's, literally: a planner
-- proves an index usable only from literals.
-- name: live_op_by_coalesce_key
SELECT id FROM ops WHERE outbox = $1 AND coalesce_key = $2 AND status IN ('pending', 'submitted')

-- name: payloads_by_hash
SELECT hash, body::text AS body FROM payloads WHERE hash = ANY($1)

-- name: op_by_id
SELECT {{op_columns}} FROM ops WHERE ops.id = $1

-- name: redealt
SELECT DISTINCT op_id FROM lane_redeals WHERE op_id = ANY($1) ORDER BY op_id

-- name: attempts_of_op
SELECT op_id, attempt, started_at, finished_at, outcome, detail, fee, error FROM attempts
WHERE op_id = $1 ORDER BY attempt

-- The store appends the listing's filters, each the same on every dialect.
-- name: list_ops
SELECT {{op_columns}} FROM ops WHERE TRUE

-- The lane filter the store appends to list_ops, its lane bound after it.
-- name: list_lane_filter
 AND id IN (SELECT op_id FROM op_lanes WHERE lane = 

-- Open ops through the open-ops index, terminal ones from ops_done alone:
-- a million finished ops cost an index scan, not a million row reads.
-- name: depth
SELECT status, priority, kind, COUNT(*) AS n FROM ops WHERE status IN ('pending', 'submitted')
GROUP BY status, priority, kind
UNION ALL
SELECT status, priority, kind, COUNT(*) AS n FROM ops WHERE status IN ('confirmed', 'failed', 'cancelled')
GROUP BY status, priority, kind
ORDER BY status, priority, kind

-- The newest outcomes only, at most $2 of them, through the primary key,
-- by minute and status: what the console's last hour shows costs the same
-- at any table size.
-- name: recent_outcomes_by_minute
SELECT date_trunc('minute', at) AS minute, status, COUNT(*) AS n, MIN(at) AS since
FROM (SELECT status, at FROM outcomes ORDER BY seq DESC LIMIT $2) recent
WHERE at >= $1 GROUP BY 1, 2 ORDER BY 1, 2

-- Attempts that failed and did not confirm, by minute: the newest ops'
-- attempts only, at most $2, through the primary key (no index on time).
-- name: recent_retries_by_minute
SELECT date_trunc('minute', finished_at) AS minute, COUNT(*) AS n, MIN(finished_at) AS since
FROM (SELECT finished_at, outcome FROM attempts ORDER BY op_id DESC, attempt DESC LIMIT $2) recent
WHERE finished_at >= $1 AND outcome IN ('retryable', 'plugin_fault', 'lease_expired') GROUP BY 1 ORDER BY 1

-- Hosts mid-rollout may disagree about a kind: one deleting the row another
-- upserts could deadlock them, so the writers take turns.
-- name: lock_kind_defaults
SELECT pg_advisory_xact_lock(hashtext('laneway.kind_defaults'))

-- name: delete_unlisted_kind_defaults
DELETE FROM kind_defaults WHERE kind <> ALL($1)

-- name: upsert_kind_default
INSERT INTO kind_defaults (kind, priority, lanes) VALUES ($1, $2, $3)
ON CONFLICT (kind) DO UPDATE SET priority = excluded.priority, lanes = excluded.lanes

-- The producer contract's limits (NULL: shapes are checked, kinds are not).
-- name: register_contract
UPDATE laneway_contract SET max_payload_bytes = $1, registered_at = $2 WHERE id = 1

-- name: release_coalesce
UPDATE ops SET coalesce_key = NULL, updated_at = $1
WHERE outbox = $2 AND coalesce_key IS NOT NULL AND status IN ($3, $4)
    AND idempotency_key = ANY($5)
