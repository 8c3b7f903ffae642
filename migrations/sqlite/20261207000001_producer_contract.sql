-- The producer contract, version 1 (docs/producers.md): what a row written
-- into `ops` by anyone (laneway, a client library, a producer's own SQL)
-- must be, checked at insert, so that no row laneway cannot read or run
-- ever reaches its drain.
--
-- Two parts:
-- * the shape of every column a producer writes, always: types (SQLite
--   stores whatever it is given: a Python `bytes` is a BLOB, a date string
--   in an INTEGER column stays text), non-empty names of at most 2048 bytes
--   without NUL, lanes a JSON array of at most 64 such strings,
--   `next_attempt_at` in Unix milliseconds, and nothing of laneway's own
--   columns (status, attempts, lease, receipt);
-- * the kind's rules, once a host has registered its config here
--   (`laneway migrate`, `laneway run` and every reload do): the kind is
--   known, lanes as the kind requires, the payload within
--   `queue.max_payload_bytes`, and an idempotency key reused only for the
--   same op.
--
-- Every refusal is `laneway: CODE: what to change`, CODE being the API's
-- error code for the same refusal (SQLite's RAISE takes a literal only, so
-- the message names the field, not the value).

-- The kind registry: each kind's lane rule beside its default priority.
ALTER TABLE kind_defaults ADD COLUMN lanes TEXT NOT NULL DEFAULT 'optional'
    CHECK (lanes IN ('required', 'optional', 'plugin'));

-- One row: the contract's version, and the limits the hosts registered
-- (NULL until a host with a config has: a database migrated without one
-- checks shapes only).
CREATE TABLE laneway_contract (
    id                INTEGER PRIMARY KEY CHECK (id = 1),
    version           INTEGER NOT NULL,
    max_payload_bytes INTEGER,
    registered_at     INTEGER
);
INSERT INTO laneway_contract (id, version) VALUES (1, 1);

CREATE TRIGGER ops_contract BEFORE INSERT ON ops
BEGIN
    SELECT RAISE(ABORT, 'laneway: invalid_op: outbox must be text (not a blob or number) of 1 to 2048 bytes, not blank, without NUL')
    WHERE typeof(NEW.outbox) <> 'text' OR trim(NEW.outbox, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(NEW.outbox AS BLOB)) > 2048 OR instr(CAST(NEW.outbox AS BLOB), x'00') > 0;
    SELECT RAISE(ABORT, 'laneway: invalid_op: kind must be text of 1 to 2048 bytes, not blank, without NUL')
    WHERE typeof(NEW.kind) <> 'text' OR trim(NEW.kind, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(NEW.kind AS BLOB)) > 2048 OR instr(CAST(NEW.kind AS BLOB), x'00') > 0;
    SELECT RAISE(ABORT, 'laneway: invalid_op: idempotency_key must be NULL or text (not a blob) of 1 to 2048 bytes, not blank, without NUL')
    WHERE NEW.idempotency_key IS NOT NULL AND (typeof(NEW.idempotency_key) <> 'text'
        OR trim(NEW.idempotency_key, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(NEW.idempotency_key AS BLOB)) > 2048 OR instr(CAST(NEW.idempotency_key AS BLOB), x'00') > 0);
    SELECT RAISE(ABORT, 'laneway: invalid_op: coalesce_key must be NULL or text (not a blob) of 1 to 2048 bytes, not blank, without NUL')
    WHERE NEW.coalesce_key IS NOT NULL AND (typeof(NEW.coalesce_key) <> 'text'
        OR trim(NEW.coalesce_key, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(NEW.coalesce_key AS BLOB)) > 2048 OR instr(CAST(NEW.coalesce_key AS BLOB), x'00') > 0);
    SELECT RAISE(ABORT, 'laneway: invalid_op: subject must be NULL or text (not a blob) of 1 to 2048 bytes, not blank, without NUL')
    WHERE NEW.subject IS NOT NULL AND (typeof(NEW.subject) <> 'text'
        OR trim(NEW.subject, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(NEW.subject AS BLOB)) > 2048 OR instr(CAST(NEW.subject AS BLOB), x'00') > 0);
    SELECT RAISE(ABORT, 'laneway: invalid_op: correlation_id must be NULL or text (not a blob) of 1 to 2048 bytes, not blank, without NUL')
    WHERE NEW.correlation_id IS NOT NULL AND (typeof(NEW.correlation_id) <> 'text'
        OR trim(NEW.correlation_id, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(NEW.correlation_id AS BLOB)) > 2048 OR instr(CAST(NEW.correlation_id AS BLOB), x'00') > 0);
    SELECT RAISE(ABORT, 'laneway: invalid_op: lanes must be a JSON array (text) of at most 64 lane names')
    WHERE typeof(NEW.lanes) <> 'text' OR NOT json_valid(NEW.lanes) OR json_type(NEW.lanes) <> 'array'
        OR json_array_length(NEW.lanes) > 64;
    SELECT RAISE(ABORT, 'laneway: invalid_op: every lane must be a JSON string of 1 to 2048 bytes, not blank, without NUL')
    WHERE EXISTS (SELECT 1 FROM json_each(NEW.lanes) l WHERE l.type <> 'text'
        OR trim(l.value, ' ' || char(9, 10, 11, 12, 13)) = ''
        OR length(CAST(l.value AS BLOB)) > 2048 OR instr(CAST(l.value AS BLOB), x'00') > 0);
    SELECT RAISE(ABORT, 'laneway: invalid_op: payload must be JSON text (not a blob)')
    WHERE typeof(NEW.payload) <> 'text' OR NOT json_valid(NEW.payload);
    SELECT RAISE(ABORT, 'laneway: invalid_op: next_attempt_at is Unix milliseconds as an INTEGER (a value under 100000000000 is seconds or a mistake; leave it out for now)')
    WHERE typeof(NEW.next_attempt_at) <> 'integer' OR NEW.next_attempt_at < 100000000000
        OR NEW.next_attempt_at >= 253402300800000;
    SELECT RAISE(ABORT, 'laneway: invalid_op: created_at and updated_at are laneway''s (Unix milliseconds); leave them out')
    WHERE typeof(NEW.created_at) <> 'integer' OR typeof(NEW.updated_at) <> 'integer'
        OR NEW.created_at < 100000000000 OR NEW.updated_at < 100000000000
        OR NEW.created_at >= 253402300800000 OR NEW.updated_at >= 253402300800000;
    SELECT RAISE(ABORT, 'laneway: invalid_op: a new op is pending with no attempts, lease, receipt or error; leave status, attempts, attempt_floor, fee_bumps, lease_*, receipt, last_error and finished_at out')
    WHERE NEW.status IS NOT 'pending' OR NEW.attempts IS NOT 0 OR NEW.attempt_floor IS NOT 0
        OR NEW.fee_bumps IS NOT 0 OR NEW.lease_owner IS NOT NULL OR NEW.lease_token IS NOT NULL
        OR NEW.lease_until IS NOT NULL OR NEW.receipt IS NOT NULL OR NEW.last_error IS NOT NULL
        OR NEW.finished_at IS NOT NULL;
    -- laneway's own kinds, only in their own outboxes (before their rules:
    -- a host registers them like any kind).
    SELECT RAISE(ABORT, 'laneway: internal_kind: this kind is laneway''s own (outcome webhooks, verified inbound activities); producers cannot enqueue it')
    WHERE (NEW.kind = 'outcome_webhook' AND NEW.outbox NOT LIKE 'outcomes:%')
        OR (NEW.kind = 'activitypub_inbound' AND NEW.outbox <> 'inbound');
    -- The kind's rules, once a host has registered them.
    SELECT RAISE(ABORT, 'laneway: unknown_kind: no laneway host has this kind configured (the registered kinds are in laneway_kind_defaults)')
    WHERE (SELECT max_payload_bytes FROM laneway_contract) IS NOT NULL
        AND NOT EXISTS (SELECT 1 FROM kind_defaults k WHERE k.kind = NEW.kind)
        AND NOT (NEW.kind = 'outcome_webhook' AND NEW.outbox LIKE 'outcomes:%')
        AND NOT (NEW.kind = 'activitypub_inbound' AND NEW.outbox = 'inbound');
    SELECT RAISE(ABORT, 'laneway: lanes_required: this kind orders its ops by lane (kinds.KIND.lanes = "required"); name at least one lane')
    WHERE json_array_length(NEW.lanes) = 0
        AND EXISTS (SELECT 1 FROM kind_defaults k WHERE k.kind = NEW.kind AND k.lanes = 'required');
    SELECT RAISE(ABORT, 'laneway: lanes_required: this kind''s plugin names its lanes (a signer account or channel), which SQL cannot ask for; enqueue it through the HTTP API or the Rust library')
    WHERE json_array_length(NEW.lanes) = 0
        AND EXISTS (SELECT 1 FROM kind_defaults k WHERE k.kind = NEW.kind AND k.lanes = 'plugin');
    SELECT RAISE(ABORT, 'laneway: payload_too_large: the payload is over queue.max_payload_bytes (see laneway_contract)')
    WHERE length(CAST(NEW.payload AS BLOB)) > (SELECT max_payload_bytes FROM laneway_contract);
    -- An idempotency key names one op: reusing it for another kind, payload
    -- or lanes is a mistake to report, not a duplicate to answer with the
    -- first op (Stripe and Svix refuse it the same way).
    SELECT RAISE(ABORT, 'laneway: idempotency_conflict: this idempotency key already names an op of this outbox with another kind, payload or lanes; use a new key')
    WHERE NEW.idempotency_key IS NOT NULL AND (
        EXISTS (SELECT 1 FROM ops o WHERE o.outbox = NEW.outbox AND o.idempotency_key = NEW.idempotency_key
            AND (o.kind <> NEW.kind OR json(o.lanes) <> json(NEW.lanes)
                 OR json(CASE WHEN o.payload_ref IS NULL THEN o.payload
                              ELSE (SELECT p.body FROM payloads p WHERE p.hash = o.payload_ref) END)
                    <> json(CASE WHEN NEW.payload_ref IS NULL THEN NEW.payload
                                 ELSE (SELECT p.body FROM payloads p WHERE p.hash = NEW.payload_ref) END)))
        OR EXISTS (SELECT 1 FROM idempotency_tombstones t WHERE t.outbox = NEW.outbox
            AND t.idempotency_key = NEW.idempotency_key AND t.kind <> NEW.kind));
END;

-- Rows written before the contract that laneway cannot read are set aside
-- here, once: each becomes a dead letter (failed, `last_error` starting
-- `invalid:` with the value found), its unreadable values replaced by
-- readable ones, so its outbox, `ops list`, the admin API and the outcome
-- relay go on. Terminal rows are only repaired. (The identity triggers are
-- lifted for this one statement and put back as they were.)
CREATE TEMP TABLE contract_set_aside AS
SELECT id,
    'invalid: written before the producer contract with values laneway cannot read:'
    || CASE WHEN typeof(outbox) <> 'text' THEN ' outbox ' || quote(outbox) ELSE '' END
    || CASE WHEN typeof(kind) <> 'text' THEN ' kind ' || quote(kind) ELSE '' END
    || CASE WHEN typeof(lanes) <> 'text' OR NOT json_valid(lanes) OR json_type(lanes) <> 'array'
            OR EXISTS (SELECT 1 FROM json_each(CASE WHEN json_valid(ops.lanes) AND json_type(ops.lanes) = 'array' THEN ops.lanes ELSE '[]' END) l WHERE l.type <> 'text')
            THEN ' lanes ' || quote(lanes) ELSE '' END
    || CASE WHEN typeof(payload) <> 'text' THEN ' payload ' || quote(payload) ELSE '' END
    || CASE WHEN typeof(next_attempt_at) <> 'integer' THEN ' next_attempt_at ' || quote(next_attempt_at) ELSE '' END
    || CASE WHEN idempotency_key IS NOT NULL AND typeof(idempotency_key) <> 'text'
            THEN ' idempotency_key ' || quote(idempotency_key) ELSE '' END
    || CASE WHEN coalesce_key IS NOT NULL AND typeof(coalesce_key) <> 'text'
            THEN ' coalesce_key ' || quote(coalesce_key) ELSE '' END
    || CASE WHEN subject IS NOT NULL AND typeof(subject) <> 'text' THEN ' subject ' || quote(subject) ELSE '' END
    || CASE WHEN correlation_id IS NOT NULL AND typeof(correlation_id) <> 'text'
            THEN ' correlation_id ' || quote(correlation_id) ELSE '' END AS why
FROM ops
WHERE typeof(outbox) <> 'text' OR typeof(kind) <> 'text'
    OR typeof(lanes) <> 'text' OR NOT json_valid(lanes) OR json_type(lanes) <> 'array'
    OR EXISTS (SELECT 1 FROM json_each(CASE WHEN json_valid(ops.lanes) AND json_type(ops.lanes) = 'array' THEN ops.lanes ELSE '[]' END) l WHERE l.type <> 'text')
    OR typeof(payload) <> 'text' OR typeof(next_attempt_at) <> 'integer'
    OR (idempotency_key IS NOT NULL AND typeof(idempotency_key) <> 'text')
    OR (coalesce_key IS NOT NULL AND typeof(coalesce_key) <> 'text')
    OR (subject IS NOT NULL AND typeof(subject) <> 'text')
    OR (correlation_id IS NOT NULL AND typeof(correlation_id) <> 'text');

DROP TRIGGER ops_identity_immutable;

UPDATE ops SET
    outbox = CAST(outbox AS TEXT),
    kind = CAST(kind AS TEXT),
    lanes = CASE WHEN typeof(lanes) <> 'text' OR NOT json_valid(lanes) OR json_type(lanes) <> 'array'
                   OR EXISTS (SELECT 1 FROM json_each(CASE WHEN json_valid(ops.lanes) AND json_type(ops.lanes) = 'array' THEN ops.lanes ELSE '[]' END) l WHERE l.type <> 'text')
                 THEN '[]' ELSE lanes END,
    payload = CASE WHEN typeof(payload) <> 'text' THEN 'null' ELSE payload END,
    next_attempt_at = CASE WHEN typeof(next_attempt_at) <> 'integer'
                           THEN CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) ELSE next_attempt_at END,
    idempotency_key = CASE WHEN typeof(idempotency_key) IN ('text', 'null') THEN idempotency_key ELSE NULL END,
    coalesce_key = CASE WHEN typeof(coalesce_key) IN ('text', 'null') THEN coalesce_key ELSE NULL END,
    subject = CASE WHEN typeof(subject) IN ('text', 'null') THEN subject ELSE NULL END,
    correlation_id = CASE WHEN typeof(correlation_id) IN ('text', 'null') THEN correlation_id ELSE NULL END,
    status = CASE WHEN status IN ('pending', 'submitted') THEN 'failed' ELSE status END,
    lease_owner = NULL, lease_token = NULL, lease_until = NULL,
    last_error = CASE WHEN status IN ('pending', 'submitted')
                      THEN (SELECT why FROM temp.contract_set_aside s WHERE s.id = ops.id) ELSE last_error END,
    finished_at = COALESCE(finished_at, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    updated_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
WHERE id IN (SELECT id FROM temp.contract_set_aside);

DELETE FROM op_lanes WHERE op_id IN (SELECT s.id FROM temp.contract_set_aside s JOIN ops o ON o.id = s.id
    WHERE o.lanes = '[]');
DROP TABLE temp.contract_set_aside;

CREATE TRIGGER ops_identity_immutable BEFORE UPDATE OF outbox, kind, lanes, payload, idempotency_key, created_at ON ops
WHEN NEW.outbox IS NOT OLD.outbox OR NEW.kind IS NOT OLD.kind
  OR NEW.payload IS NOT OLD.payload OR NEW.idempotency_key IS NOT OLD.idempotency_key
  OR NEW.created_at IS NOT OLD.created_at
  OR (NEW.lanes IS NOT OLD.lanes AND NOT (
        OLD.status = 'pending' AND OLD.receipt IS NULL AND NEW.status = 'pending' AND NEW.receipt IS NULL
        AND json_array_length(OLD.lanes) = 1 AND json_array_length(NEW.lanes) = 1
        AND EXISTS (SELECT 1 FROM lane_redeals r WHERE r.op_id = NEW.id AND r.redealt_at = NEW.updated_at
                    AND r.from_lane = json_extract(OLD.lanes, '$[0]') AND r.to_lane = json_extract(NEW.lanes, '$[0]'))))
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable');
END;

-- The columns a producer or an operator may still change by hand keep
-- their types: a text time or a blob subject would stop every read of the
-- op (and, before this, of its whole outbox).
CREATE TRIGGER ops_contract_update BEFORE UPDATE OF next_attempt_at, subject, correlation_id, coalesce_key ON ops
WHEN typeof(NEW.next_attempt_at) <> 'integer'
    OR (NEW.subject IS NOT NULL AND typeof(NEW.subject) <> 'text')
    OR (NEW.correlation_id IS NOT NULL AND typeof(NEW.correlation_id) <> 'text')
    OR (NEW.coalesce_key IS NOT NULL AND typeof(NEW.coalesce_key) <> 'text')
BEGIN
    SELECT RAISE(ABORT, 'laneway: invalid_op: next_attempt_at is Unix milliseconds (INTEGER); subject, correlation_id and coalesce_key are text');
END;
