-- Dispatch: the drain's book, the lane guard, claims under a lease, lease
-- compare-and-sets, settles, lease expiry, drain slots and host shares.
-- Every statement that changes an op's status binds the expected and the
-- new status from the state machine (`Transition`); status literals appear
-- only in reads, where they must match a partial index's predicate.

-- name: book_columns
id, kind, priority, lanes, status, receipt IS NOT NULL AS in_doubt, next_attempt_at,
attempts - attempt_floor AS budget_attempts, fee_bumps, created_at,
(subject IS NOT NULL AND EXISTS (SELECT 1 FROM laneway_halted_subjects h WHERE h.subject = ops.subject)) AS subject_halted

-- name: occupant_columns
id, outbox, kind, priority, lanes, status, receipt IS NOT NULL AS in_doubt

-- Ops that occupy their lanes: the ops_occupying partial index's predicate.
-- name: occupying
(status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL))

-- none: ops_horizon: the one writer commits ids in order

-- The tiers of a scan, one index range each; the store fills in {rank} and
-- {after} (the parameter or 0) for each tier it reads. $4: the outbox's
-- horizon (ops_horizon), the first id not to read yet.
-- name: scan_tier
SELECT * FROM (SELECT {{book_columns}} FROM laneway_ops AS ops WHERE outbox = $1 AND status IN ('pending', 'submitted')
    AND priority = {rank} AND id > {after} AND id < $4 ORDER BY id LIMIT $3) AS tier{rank}

-- Past a prefix crowded by a few lane sets: the first $4 ops of each lane
-- set after a position ($2 rank, $3 id) and below the horizon ($6), in
-- dispatch order, at most $5. The
-- database ranks the rows within their sets, so a read past a deep backlog
-- decodes a few rows per set, not every row of the outbox.
-- name: scan_beyond
SELECT {{book_columns}} FROM laneway_ops AS ops WHERE id IN (
    SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY lanes ORDER BY priority, id) AS n
        FROM laneway_ops AS ops WHERE outbox = $1 AND status IN ('pending', 'submitted') AND (priority, id) > ($2, $3) AND id < $6) AS ranked
    WHERE n <= $4)
ORDER BY priority, id LIMIT $5

-- The occupying ops are few (the index); SQLite matches their lanes in C,
-- so only the ones that matter are decoded. INDEXED BY: without statistics
-- SQLite may answer the `pending AND receipt` branch from the status index.
-- name: occupants
SELECT {{occupant_columns}} FROM laneway_ops AS ops INDEXED BY ops_occupying WHERE {{occupying}}
    AND EXISTS (SELECT 1 FROM json_each(ops.lanes) AS l WHERE l.value IN (SELECT value FROM json_each($1)))

-- name: pick_claimable
SELECT {{occupant_columns}} FROM laneway_ops AS ops
WHERE id IN (SELECT value FROM json_each($1)) AND status = $2 AND next_attempt_at <= $3

-- none: contended_lanes: one writer (BEGIN IMMEDIATE) serialises every claim, so no lane is ever being claimed by another transaction

-- name: claim
UPDATE laneway_ops AS ops SET status = $1, attempts = attempts + 1, lease_owner = $2, lease_token = $3, lease_until = $4,
    updated_at = $5
WHERE ops.id IN (SELECT value FROM json_each($6)) AND ops.status = $7 RETURNING {{returned_op_columns}}

-- One JSON array of settles; each row is still a compare-and-set on its
-- expected status, attempt and lease token.
-- name: settle
UPDATE laneway_ops AS ops SET status = i.to_status,
    receipt = CASE WHEN i.clear THEN NULL ELSE COALESCE(i.receipt, ops.receipt) END,
    last_error = COALESCE(i.error, ops.last_error),
    next_attempt_at = COALESCE(i.next_at, ops.next_attempt_at), fee_bumps = ops.fee_bumps + i.bump,
    lease_owner = NULL, lease_token = NULL, lease_until = NULL, updated_at = $2, finished_at = i.finished_at
FROM (SELECT value ->> '$.id' AS id, value ->> '$.attempt' AS attempt, value ->> '$.token' AS token,
        value ->> '$.from' AS from_status, value ->> '$.to' AS to_status, value ->> '$.clear' AS clear,
        value ->> '$.receipt' AS receipt, value ->> '$.error' AS error, value ->> '$.next_at' AS next_at,
        value ->> '$.bump' AS bump, value ->> '$.finished_at' AS finished_at
      FROM json_each($1)) AS i
WHERE ops.id = i.id AND ops.status = i.from_status AND ops.attempts = i.attempt AND ops.lease_token = i.token
RETURNING laneway_ops.id

-- name: record_attempts
INSERT INTO laneway_attempts AS attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error)
SELECT value ->> '$.op_id', value ->> '$.attempt', value ->> '$.started_at', value ->> '$.finished_at',
    value ->> '$.outcome', value ->> '$.detail', value ->> '$.fee', value ->> '$.error'
FROM json_each($1)

-- name: insert_attempt
INSERT INTO laneway_attempts AS attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)

-- A dead letter's hold on its strict lanes; a lane held already stays held.
-- name: hold_lanes
INSERT INTO laneway_lane_halts AS lane_halts (outbox, lane, op_id, halted_at)
SELECT o.outbox, l.lane, o.id, $1 FROM laneway_ops o JOIN laneway_op_lanes l ON l.op_id = o.id WHERE o.id = $2
ON CONFLICT DO NOTHING

-- name: checkpoint
UPDATE laneway_ops AS ops SET receipt = $1, updated_at = $2 WHERE id = $3 AND status = $4 AND attempts = $5 AND lease_token = $6

-- name: extend_lease
UPDATE laneway_ops AS ops SET lease_until = $1 WHERE id = $2 AND status = $3 AND attempts = $4 AND lease_token = $5

-- name: expired_leases
SELECT {{op_columns}} FROM laneway_ops AS ops WHERE status = 'submitted' AND lease_until < $1 ORDER BY lease_until LIMIT $2

-- The claimed row as it stands under its lease: when it was claimed, by whom.
-- name: expiring_lease
SELECT updated_at, lease_owner FROM laneway_ops AS ops WHERE id = $1 AND status = $2 AND attempts = $3 AND lease_token = $4

-- name: expire
UPDATE laneway_ops AS ops SET status = $1, next_attempt_at = $2, last_error = $3, lease_owner = NULL, lease_token = NULL,
    lease_until = NULL, updated_at = $4, finished_at = $5
WHERE id = $6 AND status = $7 AND attempts = $8 AND lease_token = $9

-- name: defer
UPDATE laneway_ops AS ops SET next_attempt_at = $1, updated_at = $2 WHERE id = $3 AND status = $4

-- A channel pool's op re-dealt another channel while it waits with no
-- receipt (migration 20261204000001): the row read in the one write
-- transaction, then the record the identity trigger asks for, the move,
-- and the op's lane index.
-- name: lock_redealable
SELECT id FROM laneway_ops AS ops WHERE id = $1 AND status = $2 AND receipt IS NULL
    AND json_array_length(lanes) = 1 AND json_extract(lanes, '$[0]') = $3

-- name: record_redeal
INSERT INTO laneway_lane_redeals AS lane_redeals (op_id, from_lane, to_lane, redealt_at) VALUES ($1, $2, $3, $4)

-- name: redeal
UPDATE laneway_ops AS ops SET lanes = json_array($3), updated_at = $4
WHERE id = $1 AND status = $5 AND receipt IS NULL
    AND json_array_length(lanes) = 1 AND json_extract(lanes, '$[0]') = $2

-- name: drop_op_lane
DELETE FROM laneway_op_lanes AS op_lanes WHERE op_id = $1 AND lane = $2

-- name: add_op_lane
INSERT OR IGNORE INTO laneway_op_lanes AS op_lanes (lane, op_id) VALUES ($2, $1)

-- A skip scan over the (outbox, next_attempt_at) index of pending ops: one
-- seek per outbox, and one more for whether it has a due op, rather than one
-- row per waiting op, so the poll costs the same with a million ops waiting
-- as with ten. INDEXED BY, because SQLite's planner (no statistics) took
-- ops_status and sorted every pending op once per outbox: 0.98 s a poll at
-- 86,000 waiting, 8 ms with the index (migration 20261203000001).
-- name: due_outboxes
WITH RECURSIVE o(outbox) AS (
    SELECT (SELECT outbox FROM laneway_ops AS ops INDEXED BY ops_due WHERE status = 'pending' ORDER BY outbox LIMIT 1)
    UNION ALL
    SELECT (SELECT outbox FROM laneway_ops AS ops INDEXED BY ops_due WHERE status = 'pending' AND outbox > o.outbox
            ORDER BY outbox LIMIT 1)
    FROM o WHERE o.outbox IS NOT NULL)
SELECT outbox FROM o WHERE outbox IS NOT NULL AND EXISTS
    (SELECT 1 FROM laneway_ops AS ops INDEXED BY ops_due
     WHERE status = 'pending' AND ops.outbox = o.outbox AND next_attempt_at <= $1)
LIMIT $2

-- name: acquire_slot
INSERT INTO laneway_drain_slots AS drain_slots (outbox, owner, token, lease_until) VALUES ($1, $2, $3, $4)
ON CONFLICT (outbox) DO UPDATE SET owner = excluded.owner, token = excluded.token,
    lease_until = excluded.lease_until WHERE drain_slots.lease_until < $5
RETURNING token

-- name: renew_slot
UPDATE laneway_drain_slots AS drain_slots SET lease_until = $1 WHERE outbox = $2 AND token = $3

-- name: release_slot
DELETE FROM laneway_drain_slots AS drain_slots WHERE outbox = $1 AND token = $2

-- name: announce_host
INSERT INTO laneway_hosts AS hosts (owner, seen_until) VALUES ($1, $2) ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until

-- name: forget_hosts
DELETE FROM laneway_hosts AS hosts WHERE seen_until < $1

-- name: host_share
SELECT (SELECT count(*) FROM laneway_hosts AS hosts) AS hosts,
    (SELECT count(*) FROM laneway_drain_slots AS drain_slots WHERE lease_until >= $1) AS slots,
    (SELECT count(*) FROM laneway_drain_slots AS drain_slots WHERE lease_until >= $1 AND owner = $2) AS mine

-- Savepoints: a part of a transaction that can fail alone (the committer's
-- rounds and record writes, an enqueue's batch).
-- name: savepoint
SAVEPOINT rounds

-- name: rollback_to_savepoint
ROLLBACK TO rounds

-- name: release_savepoint
RELEASE rounds
