-- A producer that inserts with plain SQL and leaves `priority` out gets its
-- kind's configured default priority (a withdrawal is critical), not normal
-- for every kind. laneway writes each kind's default into kind_defaults at
-- `laneway migrate`, at start and at every reload; a kind it does not know
-- is normal.
CREATE TABLE kind_defaults (
    kind     TEXT     PRIMARY KEY,
    priority SMALLINT NOT NULL CHECK (priority IN (0, 1, 2))
);

-- The column stays NOT NULL: PostgreSQL checks it after BEFORE triggers, so
-- the trigger below fills in what the producer left out.
ALTER TABLE ops ALTER COLUMN priority DROP DEFAULT;

CREATE FUNCTION laneway_ops_default_priority() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.priority IS NULL THEN
        NEW.priority := COALESCE((SELECT priority FROM kind_defaults WHERE kind = NEW.kind), 1);
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER ops_default_priority BEFORE INSERT ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_default_priority();
