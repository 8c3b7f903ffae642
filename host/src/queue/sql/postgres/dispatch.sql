-- Dispatch: the drain's book, the lane guard, claims under a lease, lease
-- compare-and-sets, settles, lease expiry, drain slots and host shares.
-- Every statement that changes an op's status binds the expected and the
-- new status from the state machine (`Transition`); status literals appear
-- only in reads, where they must match a partial index's predicate.

-- name: book_columns
id, kind, priority, lanes, status, receipt IS NOT NULL AS in_doubt, next_attempt_at,
attempts - attempt_floor AS budget_attempts, fee_bumps, created_at,
(subject IS NOT NULL AND EXISTS (SELECT 1 FROM halted_subjects h WHERE h.subject = ops.subject)) AS subject_halted

-- name: occupant_columns
id, outbox, kind, priority, lanes, status, receipt IS NOT NULL AS in_doubt

-- Ops that occupy their lanes; the lane_occupants triggers (migration
-- 20261202000002) keep the same predicate.
-- name: occupying
(status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL))

-- The first id of the outbox a read may not pass yet (migration
-- 20261208000001), asked before the read, in a statement of its own.
-- name: ops_horizon
SELECT laneway_ops_horizon($1)

-- The tiers of a scan, one index range each; the store fills in {rank} and
-- {after} (the parameter or 0) for each tier it reads. $4: the outbox's
-- horizon (ops_horizon), the first id not to read yet.
-- name: scan_tier
SELECT * FROM (SELECT {{book_columns}} FROM ops WHERE outbox = $1 AND status IN ('pending', 'submitted')
    AND priority = {rank} AND id > {after} AND id < $4 ORDER BY id LIMIT $3) AS tier{rank}

-- Past a prefix crowded by a few lane sets: the first $4 ops of each lane
-- set after a position ($2 rank, $3 id) and below the horizon ($6), in
-- dispatch order, at most $5. The
-- database ranks the rows within their sets, so a read past a deep backlog
-- decodes a few rows per set, not every row of the outbox.
-- name: scan_beyond
SELECT {{book_columns}} FROM ops WHERE id IN (
    SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY lanes ORDER BY priority, id) AS n
        FROM ops WHERE outbox = $1 AND status IN ('pending', 'submitted') AND (priority, id) > ($2, $3) AND id < $6) AS ranked
    WHERE n <= $4)
ORDER BY priority, id LIMIT $5

-- The lanes asked about, joined to their occupants (one row per lane and
-- op while the op occupies it): the cost is in those lanes, never in the
-- ops in flight on others. The triggers write the table in the transaction
-- that changes the op, so every op that occupies a lane has its row in the
-- same snapshot; the predicate again makes a row left behind harmless.
-- name: occupants
SELECT {{occupant_columns}} FROM ops WHERE {{occupying}} AND id IN
    (SELECT o.op_id FROM unnest($1::text[]) AS q(lane) JOIN lane_occupants o ON o.lane = q.lane)

-- Another claimer's rows are skipped, never waited for.
-- name: pick_claimable
SELECT {{occupant_columns}} FROM ops WHERE id = ANY($1) AND status = $2 AND next_attempt_at <= $3
FOR UPDATE SKIP LOCKED

-- Each lane's advisory lock, tried without waiting: a lane another
-- transaction is claiming on right now is left for the next round. Nothing
-- waits, so nothing can deadlock; once a lane's lock is held, the occupants
-- read next (a new snapshot) include every claim on it that committed.
-- name: contended_lanes
SELECT k FROM unnest($1::bigint[]) AS k WHERE NOT pg_try_advisory_xact_lock(k)

-- name: claim
UPDATE ops SET status = $1, attempts = attempts + 1, lease_owner = $2, lease_token = $3, lease_until = $4,
    updated_at = $5
WHERE ops.id = ANY($6) AND ops.status = $7 RETURNING {{returned_op_columns}}

-- One array per column; each row is still a compare-and-set on its expected
-- status, attempt and lease token. A settle is known by its op and token: a
-- batch may hold a stale settle of an op beside its current one. One
-- statement whatever the batch's size: the attempt rows of the settles that
-- applied are written by the same statement ($13-$18, one per completion).
-- name: settle
WITH done AS (
    UPDATE ops SET status = i.to_status,
        receipt = CASE WHEN i.clear THEN NULL ELSE COALESCE(i.receipt, ops.receipt) END,
        last_error = COALESCE(i.error, ops.last_error),
        next_attempt_at = COALESCE(i.next_at, ops.next_attempt_at), fee_bumps = ops.fee_bumps + i.bump,
        lease_owner = NULL, lease_token = NULL, lease_until = NULL, updated_at = $12, finished_at = i.finished_at
    FROM unnest($1::bigint[], $2::int[], $3::uuid[], $4::text[], $5::text[], $6::bool[], $7::text[], $8::text[],
            $9::timestamptz[], $10::int[], $11::timestamptz[])
        AS i(id, attempt, token, from_status, to_status, clear, receipt, error, next_at, bump, finished_at)
    WHERE ops.id = i.id AND ops.status = i.from_status AND ops.attempts = i.attempt AND ops.lease_token = i.token
    RETURNING i.id, i.token),
recorded AS (
    INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error)
    SELECT a.op_id, a.attempt, a.started_at, a.finished_at, a.outcome, a.detail, a.fee, a.error
    FROM unnest($1::bigint[], $2::int[], $3::uuid[], $13::timestamptz[], $14::timestamptz[], $15::text[],
            $16::text[], $17::bigint[], $18::text[])
        AS a(op_id, attempt, token, started_at, finished_at, outcome, detail, fee, error)
    JOIN done d ON d.id = a.op_id AND d.token = a.token)
SELECT id, token FROM done

-- none: record_attempts: the settle statement writes them itself (its `recorded` CTE)

-- name: insert_attempt
INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)

-- A dead letter's hold on its strict lanes; a lane held already stays held.
-- name: hold_lanes
INSERT INTO lane_halts (outbox, lane, op_id, halted_at)
SELECT o.outbox, l.lane, o.id, $1 FROM ops o JOIN op_lanes l ON l.op_id = o.id WHERE o.id = $2
ON CONFLICT DO NOTHING

-- name: checkpoint
UPDATE ops SET receipt = $1, updated_at = $2 WHERE id = $3 AND status = $4 AND attempts = $5 AND lease_token = $6

-- name: extend_lease
UPDATE ops SET lease_until = $1 WHERE id = $2 AND status = $3 AND attempts = $4 AND lease_token = $5

-- name: expired_leases
SELECT {{op_columns}} FROM ops WHERE status = 'submitted' AND lease_until < $1 ORDER BY lease_until LIMIT $2

-- The claimed row as it stands under its lease: when it was claimed, by whom.
-- name: expiring_lease
SELECT updated_at, lease_owner FROM ops WHERE id = $1 AND status = $2 AND attempts = $3 AND lease_token = $4
FOR UPDATE

-- name: expire
UPDATE ops SET status = $1, next_attempt_at = $2, last_error = $3, lease_owner = NULL, lease_token = NULL,
    lease_until = NULL, updated_at = $4, finished_at = $5
WHERE id = $6 AND status = $7 AND attempts = $8 AND lease_token = $9

-- name: defer
UPDATE ops SET next_attempt_at = $1, updated_at = $2 WHERE id = $3 AND status = $4

-- A channel pool's op re-dealt another channel while it waits with no
-- receipt (migration 20261204000001): the row locked first, skipping one a
-- claim holds right now (it is about to leave the waiting ops anyway), so
-- the record and the move see the same row; then the record the identity
-- trigger asks for, the move, and the op's lane index.
-- name: lock_redealable
SELECT id FROM ops WHERE id = $1 AND status = $2 AND receipt IS NULL AND lanes = ARRAY[$3::text]
FOR UPDATE SKIP LOCKED

-- name: record_redeal
INSERT INTO lane_redeals (op_id, from_lane, to_lane, redealt_at) VALUES ($1, $2, $3, $4)

-- name: redeal
UPDATE ops SET lanes = ARRAY[$3::text], updated_at = $4
WHERE id = $1 AND status = $5 AND receipt IS NULL AND lanes = ARRAY[$2::text]

-- name: drop_op_lane
DELETE FROM op_lanes WHERE op_id = $1 AND lane = $2

-- name: add_op_lane
INSERT INTO op_lanes (lane, op_id) VALUES ($2, $1) ON CONFLICT DO NOTHING

-- A skip scan over the (outbox, priority, id) index of pending ops: one seek
-- per outbox rather than one row per waiting op, so the poll costs the same
-- with a million ops waiting as with ten.
-- name: due_outboxes
WITH RECURSIVE o(outbox) AS (
    SELECT (SELECT outbox FROM ops WHERE status = 'pending' ORDER BY outbox LIMIT 1)
    UNION ALL
    SELECT (SELECT outbox FROM ops WHERE status = 'pending' AND outbox > o.outbox ORDER BY outbox LIMIT 1)
    FROM o WHERE o.outbox IS NOT NULL)
SELECT outbox FROM o WHERE outbox IS NOT NULL AND EXISTS
    (SELECT 1 FROM ops WHERE status = 'pending' AND ops.outbox = o.outbox AND next_attempt_at <= $1)
LIMIT $2

-- name: acquire_slot
INSERT INTO drain_slots (outbox, owner, token, lease_until) VALUES ($1, $2, $3, $4)
ON CONFLICT (outbox) DO UPDATE SET owner = excluded.owner, token = excluded.token,
    lease_until = excluded.lease_until WHERE drain_slots.lease_until < $5
RETURNING token

-- name: renew_slot
UPDATE drain_slots SET lease_until = $1 WHERE outbox = $2 AND token = $3

-- name: release_slot
DELETE FROM drain_slots WHERE outbox = $1 AND token = $2

-- name: announce_host
INSERT INTO hosts (owner, seen_until) VALUES ($1, $2) ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until

-- name: forget_hosts
DELETE FROM hosts WHERE seen_until < $1

-- name: host_share
SELECT (SELECT count(*) FROM hosts) AS hosts,
    (SELECT count(*) FROM drain_slots WHERE lease_until >= $1) AS slots,
    (SELECT count(*) FROM drain_slots WHERE lease_until >= $1 AND owner = $2) AS mine

-- Savepoints: a part of a transaction that can fail alone (the committer's
-- rounds and record writes, an enqueue's batch).
-- name: savepoint
SAVEPOINT rounds

-- name: rollback_to_savepoint
ROLLBACK TO SAVEPOINT rounds

-- name: release_savepoint
RELEASE SAVEPOINT rounds
