-- Payloads stored once (PostgreSQL). laneway's own enqueue stores a payload
-- of at least `queue.shared_payload_bytes` here, by its SHA-256, and the op
-- row points at it (`payload_ref`, with `payload` the JSON `null`): a
-- fan-out of one activity to 10,000 inboxes stores it once. The pruner
-- frees a payload with the last op that points at it. Plain-SQL producers
-- go on writing `payload` itself; both kinds of row read back the same.
CREATE TABLE payloads (
    hash TEXT PRIMARY KEY,
    body JSON NOT NULL
);

ALTER TABLE ops ADD COLUMN payload_ref TEXT REFERENCES payloads (hash);
CREATE INDEX ops_payload_ref ON ops (payload_ref) WHERE payload_ref IS NOT NULL;

CREATE FUNCTION laneway_ops_payload_ref_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.payload_ref IS DISTINCT FROM OLD.payload_ref THEN
        RAISE EXCEPTION 'laneway: an op''s payload is immutable';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER ops_payload_ref_immutable BEFORE UPDATE OF payload_ref ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_payload_ref_immutable();
