-- An outbox's ops become visible in id order. The drain's book reads the
-- ops enqueued since its last read as `id > high-water mark`; with many
-- writers an id taken earlier could commit later, be skipped by that read,
-- and let the next op of its strict lane start first (the fault harness
-- found it: one sender's two inbound activities, acknowledged in order,
-- handed on out of order, because another sender's op took a higher id and
-- committed first). So every insert, by laneway or a plain-SQL producer,
-- takes its outbox's transaction lock and only then its id: a later id of
-- an outbox is taken after every earlier one has committed or rolled back.
-- Enqueues to one outbox serialise from their first insert to their commit;
-- other outboxes are untouched. (The two-key form keeps these locks apart
-- from the lane guard's one-key advisory locks.) Runs after the other
-- BEFORE INSERT triggers (by name), so a skipped tombstoned insert takes
-- nothing.
CREATE FUNCTION laneway_ops_visible_in_id_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1819768953, hashtext(NEW.outbox));
    NEW.id := nextval(pg_get_serial_sequence('ops', 'id'));
    RETURN NEW;
END
$$;

CREATE TRIGGER ops_visible_in_id_order BEFORE INSERT ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_visible_in_id_order();
