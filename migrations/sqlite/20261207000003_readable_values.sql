-- Every value laneway reads back is one it can read, whoever writes it: a
-- hand edit (an operator's UPDATE, a tool, a restore gone wrong) that puts
-- a date string, a number out of any calendar or a BLOB into an op used to
-- make every read of that op an error, its outbox's drain included. The
-- update trigger now holds every column laneway reads to its type and
-- range, as PostgreSQL's column types and ops_times_readable do.
--
-- Rows that already hold such a value are set aside first: a pending op
-- becomes a dead letter whose last_error starts `invalid:`; every op gets
-- readable values (times: now; text columns: NULL), so its outbox,
-- `ops list`, the admin API and the outcome relay go on. (The identity
-- trigger, which keeps created_at, is lifted for this one statement.)
DROP TRIGGER ops_contract_update;
DROP TRIGGER ops_identity_immutable;

UPDATE laneway_ops SET
    last_error = CASE WHEN status = 'pending'
        THEN 'invalid: a value laneway cannot read: next_attempt_at ' || quote(next_attempt_at)
             || ', created_at ' || quote(created_at) || ', updated_at ' || quote(updated_at)
             || ', lease_until ' || quote(lease_until) || ', finished_at ' || quote(finished_at)
             || ', lease_owner ' || quote(lease_owner) || ', receipt ' || quote(receipt)
        WHEN typeof(last_error) IN ('text', 'null') THEN last_error ELSE NULL END,
    finished_at = CASE
        WHEN status = 'pending' THEN CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
        WHEN finished_at IS NULL OR (typeof(finished_at) = 'integer' AND finished_at BETWEEN 0 AND 253402300799999)
            THEN finished_at
        ELSE CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) END,
    status = CASE WHEN status = 'pending' THEN 'failed' ELSE status END,
    next_attempt_at = CASE WHEN typeof(next_attempt_at) = 'integer' AND next_attempt_at BETWEEN 0 AND 253402300799999
        THEN next_attempt_at ELSE CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) END,
    created_at = CASE WHEN typeof(created_at) = 'integer' AND created_at BETWEEN 0 AND 253402300799999
        THEN created_at ELSE CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) END,
    updated_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER),
    lease_until = CASE WHEN lease_until IS NULL
            OR (typeof(lease_until) = 'integer' AND lease_until BETWEEN 0 AND 253402300799999) THEN lease_until
        ELSE CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) END,
    lease_owner = CASE WHEN typeof(lease_owner) IN ('text', 'null') THEN lease_owner ELSE NULL END,
    receipt = CASE WHEN typeof(receipt) IN ('text', 'null') THEN receipt ELSE NULL END
WHERE NOT (typeof(next_attempt_at) = 'integer' AND next_attempt_at BETWEEN 0 AND 253402300799999)
   OR NOT (typeof(created_at) = 'integer' AND created_at BETWEEN 0 AND 253402300799999)
   OR NOT (typeof(updated_at) = 'integer' AND updated_at BETWEEN 0 AND 253402300799999)
   OR NOT (lease_until IS NULL OR (typeof(lease_until) = 'integer' AND lease_until BETWEEN 0 AND 253402300799999))
   OR NOT (finished_at IS NULL OR (typeof(finished_at) = 'integer' AND finished_at BETWEEN 0 AND 253402300799999))
   OR typeof(lease_owner) NOT IN ('text', 'null') OR typeof(receipt) NOT IN ('text', 'null')
   OR typeof(last_error) NOT IN ('text', 'null');

CREATE TRIGGER ops_identity_immutable BEFORE UPDATE OF outbox, kind, lanes, payload, idempotency_key, created_at ON laneway_ops
WHEN NEW.outbox IS NOT OLD.outbox OR NEW.kind IS NOT OLD.kind
  OR NEW.payload IS NOT OLD.payload OR NEW.idempotency_key IS NOT OLD.idempotency_key
  OR NEW.created_at IS NOT OLD.created_at
  OR (NEW.lanes IS NOT OLD.lanes AND NOT (
        OLD.status = 'pending' AND OLD.receipt IS NULL AND NEW.status = 'pending' AND NEW.receipt IS NULL
        AND json_array_length(OLD.lanes) = 1 AND json_array_length(NEW.lanes) = 1
        AND EXISTS (SELECT 1 FROM laneway_lane_redeals r WHERE r.op_id = NEW.id AND r.redealt_at = NEW.updated_at
                    AND r.from_lane = json_extract(OLD.lanes, '$[0]') AND r.to_lane = json_extract(NEW.lanes, '$[0]'))))
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable');
END;

CREATE TRIGGER ops_contract_update BEFORE UPDATE ON laneway_ops
WHEN NOT (typeof(NEW.next_attempt_at) = 'integer' AND NEW.next_attempt_at BETWEEN 0 AND 253402300799999)
    OR NOT (typeof(NEW.updated_at) = 'integer' AND NEW.updated_at BETWEEN 0 AND 253402300799999)
    OR NOT (NEW.lease_until IS NULL
            OR (typeof(NEW.lease_until) = 'integer' AND NEW.lease_until BETWEEN 0 AND 253402300799999))
    OR NOT (NEW.finished_at IS NULL
            OR (typeof(NEW.finished_at) = 'integer' AND NEW.finished_at BETWEEN 0 AND 253402300799999))
    OR typeof(NEW.attempts) <> 'integer' OR typeof(NEW.attempt_floor) <> 'integer'
    OR typeof(NEW.fee_bumps) <> 'integer'
    OR typeof(NEW.subject) NOT IN ('text', 'null') OR typeof(NEW.correlation_id) NOT IN ('text', 'null')
    OR typeof(NEW.coalesce_key) NOT IN ('text', 'null') OR typeof(NEW.lease_owner) NOT IN ('text', 'null')
    OR typeof(NEW.lease_token) NOT IN ('text', 'null') OR typeof(NEW.receipt) NOT IN ('text', 'null')
    OR typeof(NEW.last_error) NOT IN ('text', 'null') OR typeof(NEW.payload_ref) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'laneway: invalid_op: every op column keeps its type: times are Unix milliseconds (INTEGER, year 1970 to 9999), counters INTEGER, names and texts TEXT or NULL');
END;
