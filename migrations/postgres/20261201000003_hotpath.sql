-- Hosts announce themselves here at every poll, so a host holding more than
-- its share of the busy outboxes' drain slots hands some back.
CREATE TABLE hosts (
    owner      TEXT        PRIMARY KEY,
    seen_until TIMESTAMPTZ NOT NULL
);
