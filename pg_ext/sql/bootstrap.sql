-- pg_outbox: tables and roles. Loaded first (see src/lib.rs).

-- Roles are cluster-wide: create them once, keep them across databases.
DO $roles$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_writer') THEN
        CREATE ROLE outbox_writer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay NOLOGIN;
    END IF;
END
$roles$;

CREATE TABLE outbox.events (
    event_id       uuid        NOT NULL PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    aggregate_seq  bigint      NOT NULL,
    event_type     text        NOT NULL,
    schema_version integer     NOT NULL DEFAULT 1,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    topic          text,
    occurred_at    timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    txid           xid8        NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    CONSTRAINT events_aggregate_seq_key UNIQUE (aggregate_type, aggregate_id, aggregate_seq)
);
COMMENT ON TABLE outbox.events IS 'Immutable outbox events, written only by outbox.emit_event and streamed to Kafka by outbox-forwarder.';
COMMENT ON COLUMN outbox.events.event_id IS 'Time-ordered UUID (version 7); the Kafka header event_id.';
COMMENT ON COLUMN outbox.events.aggregate_type IS 'Kind of aggregate; picks the topic through the forwarder''s template.';
COMMENT ON COLUMN outbox.events.aggregate_id IS 'Aggregate identity; the Kafka record key.';
COMMENT ON COLUMN outbox.events.aggregate_seq IS 'Position of the event in its aggregate: 1, 2, 3, ... without gaps, in commit order.';
COMMENT ON COLUMN outbox.events.event_type IS 'Name of the event; the Kafka header event_type.';
COMMENT ON COLUMN outbox.events.schema_version IS 'Version of the payload''s schema for this event type.';
COMMENT ON COLUMN outbox.events.payload IS 'The Kafka record value.';
COMMENT ON COLUMN outbox.events.headers IS 'Extra Kafka headers: a JSON object of strings.';
COMMENT ON COLUMN outbox.events.topic IS 'Topic that overrides the forwarder''s template for this event.';
COMMENT ON COLUMN outbox.events.occurred_at IS 'When emit_event ran.';
COMMENT ON COLUMN outbox.events.txid IS 'The writing transaction.';

-- One row per aggregate holding its last sequence number. Its row lock,
-- taken by emit_event and held until commit, is what makes sequences
-- gap-free and commit-ordered. Half-empty pages leave room for HOT updates.
CREATE TABLE outbox.aggregates (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 50);
COMMENT ON TABLE outbox.aggregates IS 'Last sequence number per aggregate; written only by emit_event.';

-- What each forwarder (one per slot) has recorded: when its first-start
-- catch-up finished, and the last position it confirmed. Written by the
-- forwarder through outbox.record_relay_progress; read by retention and status.
CREATE TABLE outbox.relay_progress (
    slot_name      name        NOT NULL PRIMARY KEY,
    caught_up_at   timestamptz,
    caught_up_lsn  pg_lsn,
    confirmed_lsn  pg_lsn,
    updated_at     timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE outbox.relay_progress IS 'Per slot: first-start catch-up done and last confirmed position, recorded by outbox-forwarder.';

CREATE FUNCTION outbox.refuse_event_change() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'outbox events are immutable'
        USING ERRCODE = 'PO010',
              HINT = 'Emit a new event with outbox.emit_event instead of changing a stored one.';
END
$$;
CREATE TRIGGER events_immutable BEFORE UPDATE ON outbox.events
    FOR EACH ROW EXECUTE FUNCTION outbox.refuse_event_change();

REVOKE ALL ON outbox.events, outbox.aggregates, outbox.relay_progress FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.refuse_event_change() FROM PUBLIC;
GRANT USAGE ON SCHEMA outbox TO outbox_writer, outbox_relay;
-- The forwarder reads events for its first-start catch-up.
GRANT SELECT ON outbox.events TO outbox_relay;
