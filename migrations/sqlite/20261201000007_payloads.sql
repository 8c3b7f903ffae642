-- Payloads stored once (SQLite). laneway's own enqueue stores a payload of
-- at least `queue.shared_payload_bytes` here, by its SHA-256, and the op
-- row points at it (`payload_ref`, with `payload` the JSON `null`): a
-- fan-out of one activity to 10,000 inboxes stores it once. The pruner
-- frees a payload with the last op that points at it. Plain-SQL producers
-- go on writing `payload` itself; both kinds of row read back the same.
CREATE TABLE payloads (
    hash TEXT PRIMARY KEY,
    body TEXT NOT NULL CHECK (json_valid(body))
) WITHOUT ROWID;

ALTER TABLE ops ADD COLUMN payload_ref TEXT REFERENCES payloads (hash);
CREATE INDEX ops_payload_ref ON ops (payload_ref) WHERE payload_ref IS NOT NULL;

CREATE TRIGGER ops_payload_ref_immutable BEFORE UPDATE OF payload_ref ON ops
WHEN NEW.payload_ref IS NOT OLD.payload_ref
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s payload is immutable');
END;
