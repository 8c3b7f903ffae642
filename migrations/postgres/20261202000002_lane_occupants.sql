-- The lane guard asks "which ops occupy any of these lanes?" at every claim
-- and at every full read of a drain's book. Answered from the occupying
-- ops' id index with `lanes && $1`, it compared every op in flight (a
-- host's whole in-flight cap, plus the dead versions vacuum had not yet
-- reclaimed) against every lane asked about: 3 ms a claim and 330 ms a full
-- read under a 20k-op drain, the largest statement time the PostgreSQL
-- drain had (pg_stat_statements, BENCHMARKS.md). A GIN index over the same
-- ops is no cure: on a young table, or a small one, the planner prefers a
-- sequential scan, costing the array overlap as one comparison per row.
--
-- So the occupying ops' lanes are kept in a table of their own, one row per
-- (lane, op) while the op occupies the lane, written by triggers in the
-- transaction that changes the op (every writer: claims, settles, lease
-- expiry, operators), and the guard joins the lanes asked about to it: a
-- cost in the lanes asked about and their occupants, never in the ops in
-- flight elsewhere, whatever the plan.
CREATE TABLE lane_occupants (
    lane  TEXT   NOT NULL,
    op_id BIGINT NOT NULL,
    PRIMARY KEY (lane, op_id)
);

-- Statement triggers over the transition tables: one call per statement,
-- set-based. A row trigger cost ~95 us per op against ~18 us (a claim or a
-- settle of 20 ops, measured on this 2-core VM), and the drain's statements
-- carry batches. The predicate is `occupying` in dispatch.sql.
CREATE FUNCTION laneway_lane_occupants_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lane_occupants lo USING old_rows o
        WHERE (o.status = 'submitted' OR (o.status = 'pending' AND o.receipt IS NOT NULL))
          AND lo.op_id = o.id AND lo.lane = ANY(o.lanes)
          AND NOT EXISTS (SELECT 1 FROM new_rows n WHERE n.id = o.id
                          AND (n.status = 'submitted' OR (n.status = 'pending' AND n.receipt IS NOT NULL)));
    INSERT INTO lane_occupants (lane, op_id)
        SELECT DISTINCT l, n.id FROM new_rows n, unnest(n.lanes) AS l
        WHERE (n.status = 'submitted' OR (n.status = 'pending' AND n.receipt IS NOT NULL))
          AND NOT EXISTS (SELECT 1 FROM old_rows o WHERE o.id = n.id
                          AND (o.status = 'submitted' OR (o.status = 'pending' AND o.receipt IS NOT NULL)))
        ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER ops_lane_occupants AFTER UPDATE ON ops
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION laneway_lane_occupants_changed();

CREATE FUNCTION laneway_lane_occupants_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lane_occupants lo USING old_rows o WHERE lo.op_id = o.id AND lo.lane = ANY(o.lanes);
    RETURN NULL;
END
$$;
CREATE TRIGGER ops_lane_occupants_deleted AFTER DELETE ON ops
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION laneway_lane_occupants_deleted();

-- An op inserted already occupying (a plain-SQL producer can write any
-- valid row) gets its rows from the insert trigger that already runs per op.
CREATE OR REPLACE FUNCTION laneway_ops_after_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO op_lanes (lane, op_id)
        SELECT DISTINCT l, NEW.id FROM unnest(NEW.lanes) AS l
        ON CONFLICT DO NOTHING;
    IF NEW.status = 'submitted' OR (NEW.status = 'pending' AND NEW.receipt IS NOT NULL) THEN
        INSERT INTO lane_occupants (lane, op_id)
            SELECT DISTINCT l, NEW.id FROM unnest(NEW.lanes) AS l
            ON CONFLICT DO NOTHING;
    END IF;
    PERFORM pg_notify('laneway_ops', NEW.outbox);
    RETURN NULL;
END
$$;

INSERT INTO lane_occupants (lane, op_id)
    SELECT DISTINCT l, id FROM ops, unnest(lanes) AS l
    WHERE status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL)
    ON CONFLICT DO NOTHING;

-- The guard no longer reads the occupying ops through their id index.
DROP INDEX ops_occupying;
