-- A channel pool's op may be re-dealt another channel while it waits with
-- no receipt: nothing of it can be on chain, so its channel (its one lane)
-- says only which account will send it. Every other lane stays fixed from
-- enqueue on, as before.
--
-- Each move is recorded here in the transaction that makes it, and the
-- identity trigger lets an op's lanes change only when such a record names
-- the very move (op, from, to, at this update): a stray UPDATE of lanes is
-- still refused, and an operator can see why an op's channel changed.
CREATE TABLE lane_redeals (
    op_id      BIGINT      NOT NULL,
    from_lane  TEXT        NOT NULL,
    to_lane    TEXT        NOT NULL,
    redealt_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (op_id, redealt_at)
);

CREATE OR REPLACE FUNCTION laneway_ops_identity_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.outbox IS DISTINCT FROM OLD.outbox OR NEW.kind IS DISTINCT FROM OLD.kind
       OR NEW.payload::text IS DISTINCT FROM OLD.payload::text
       OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
       OR NEW.created_at IS DISTINCT FROM OLD.created_at
       OR (NEW.lanes IS DISTINCT FROM OLD.lanes AND NOT (
            OLD.status = 'pending' AND OLD.receipt IS NULL AND NEW.status = 'pending' AND NEW.receipt IS NULL
            AND cardinality(OLD.lanes) = 1 AND cardinality(NEW.lanes) = 1
            AND EXISTS (SELECT 1 FROM lane_redeals r WHERE r.op_id = NEW.id AND r.redealt_at = NEW.updated_at
                        AND r.from_lane = OLD.lanes[1] AND r.to_lane = NEW.lanes[1]))) THEN
        RAISE EXCEPTION 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable';
    END IF;
    RETURN NEW;
END
$$;
