-- Operators: changes to one op (a compare-and-set on its status, bound from
-- the state machine), bulk retries, lane holds, halted subjects, pauses, API
-- keys, the audit log, and the counts /metrics and /stats read.

-- A cancel applies only to an op that was never sent: one carrying a
-- receipt in doubt may have been.
-- name: cancel
UPDATE ops SET status = $1, updated_at = $2, finished_at = $2 WHERE id = $3 AND status = $4 AND receipt IS NULL
RETURNING {{returned_op_columns}}

-- name: force_retry
UPDATE ops SET status = $1, attempt_floor = attempts, next_attempt_at = $2, updated_at = $2, finished_at = NULL
WHERE id = $3 AND status = $4 RETURNING {{returned_op_columns}}

-- What an operator change that matched nothing found instead.
-- name: status_of_op
SELECT status, receipt IS NOT NULL AS in_doubt FROM ops WHERE id = $1

-- A retried dead letter is its lanes' head again: its hold goes.
-- name: unhold_lanes_of_ops
DELETE FROM lane_halts WHERE op_id = ANY($1)

-- Ops with a coalesce key are left out: their retry may conflict.
-- name: retry_dead_letters
UPDATE ops SET status = $1, attempt_floor = attempts, next_attempt_at = d.at, updated_at = $2, finished_at = NULL
FROM unnest($3::bigint[], $4::timestamptz[]) AS d(id, at)
WHERE ops.id = d.id AND ops.status = $5 AND ops.coalesce_key IS NULL
RETURNING ops.id

-- name: lane_halts
SELECT outbox, lane, op_id, halted_at FROM lane_halts WHERE $1::text IS NULL OR outbox = $1 ORDER BY outbox, lane, op_id

-- A page of held lanes after a cursor (outbox, lane, op), in that order.
-- name: lane_halts_page
SELECT outbox, lane, op_id, halted_at FROM lane_halts
WHERE ($1::text IS NULL OR outbox = $1) AND (outbox, lane, op_id) > ($2, $3, $4)
ORDER BY outbox, lane, op_id LIMIT $5

-- name: skip_lane
DELETE FROM lane_halts WHERE outbox = $1 AND lane = $2

-- name: halt_subject
INSERT INTO halted_subjects (subject, reason, halted_at) VALUES ($1, $2, $3)
ON CONFLICT (subject) DO UPDATE SET reason = excluded.reason

-- name: unhalt_subject
DELETE FROM halted_subjects WHERE subject = $1

-- name: halted_subjects
SELECT subject, reason, halted_at FROM halted_subjects ORDER BY subject

-- name: insert_api_key
INSERT INTO api_keys (id, name, secret_hash, scopes, created_at) VALUES ($1, $2, $3, $4, $5)

-- name: api_keys
SELECT id, name, scopes, created_at, revoked_at FROM api_keys ORDER BY name

-- name: api_key
SELECT id, name, scopes, created_at, revoked_at, secret_hash FROM api_keys WHERE id = $1

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = $1 WHERE name = $2 AND revoked_at IS NULL

-- name: insert_audit
INSERT INTO audit_log (at, actor, action, target, before, after) VALUES ($1, $2, $3, $4, $5, $6)

-- name: audit_log
SELECT id, at, actor, action, target, before, after FROM audit_log WHERE $1::bigint IS NULL OR id < $1
ORDER BY id DESC LIMIT $2

-- name: insert_pause
INSERT INTO pauses (scope, target, reason, actor, paused_at) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (scope, target) DO NOTHING

-- name: delete_pause
DELETE FROM pauses WHERE scope = $1 AND target = $2

-- name: pauses
SELECT scope, target, reason, actor, paused_at FROM pauses ORDER BY scope, target

-- name: gauge_counts
SELECT (SELECT COUNT(*) FROM ops WHERE status = 'submitted' AND lease_until < $1) AS stuck,
    (SELECT COUNT(*) FROM lane_halts) AS held, (SELECT COUNT(*) FROM halted_subjects) AS halted

-- name: oldest_due
SELECT kind, outbox, MIN(next_attempt_at) AS due FROM ops WHERE status = 'pending' AND next_attempt_at <= $1
GROUP BY kind, outbox ORDER BY kind, outbox

-- name: recent_latencies
SELECT id, kind, priority, (EXTRACT(EPOCH FROM finished_at - created_at) * 1000)::bigint AS ms FROM ops
WHERE status = $3 AND finished_at >= $1 ORDER BY id DESC LIMIT $2

-- Dead letters by kind, by the class of their last attempt, and whether
-- their outcome is unknown (a receipt never proven): through the status
-- index and one attempt lookup per dead letter, never the other ops.
-- name: dead_letter_groups
SELECT o.kind, a.outcome AS class, o.receipt IS NOT NULL AS unknown, COUNT(*) AS n, MAX(o.id) AS newest
FROM ops o LEFT JOIN attempts a ON a.op_id = o.id AND a.attempt = o.attempts
WHERE o.status = $1
GROUP BY o.kind, a.outcome, o.receipt IS NOT NULL
ORDER BY n DESC, o.kind
