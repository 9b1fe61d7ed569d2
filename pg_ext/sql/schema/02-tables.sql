------------------------------------------------------------------------------
-- Tables. Identifier columns use the "C" collation: only their equality
-- matters, and their index probes then compare bytes.

CREATE TABLE outbox.events (
    event_id       uuid        NOT NULL,
    aggregate_type text        COLLATE "C" NOT NULL,
    aggregate_id   text        COLLATE "C" NOT NULL,
    aggregate_seq  bigint      NOT NULL,
    event_type     text        NOT NULL,
    schema_version integer     NOT NULL DEFAULT 1,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    topic          text,
    occurred_at    timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    txid           xid8        NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    aggregate_hash integer,
    -- The key of an event, and the index its aggregate's newest sequence is
    -- read from. Event ids are unique by construction (version 7 UUIDs).
    CONSTRAINT events_aggregate_seq_key UNIQUE (aggregate_type, aggregate_id, aggregate_seq)
);
ALTER TABLE outbox.events REPLICA IDENTITY USING INDEX events_aggregate_seq_key;
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
COMMENT ON COLUMN outbox.events.aggregate_hash IS 'outbox.aggregate_hash of the aggregate, set at emit: a sharded forwarder''s shard is aggregate_hash % shards (NULL for events stored before 0.8.0).';

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

-- Aggregates whose every event a 0.2.0 prune deleted: their numbering goes
-- on from here. Filled only by the upgrade to 0.3.0; later prunes never
-- empty an aggregate.
CREATE TABLE outbox.sequence_floors (
    aggregate_type text   COLLATE "C" NOT NULL,
    aggregate_id   text   COLLATE "C" NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE outbox.sequence_floors IS 'Last sequence of aggregates that have no stored event left (pruned before 0.3.0).';

CREATE TABLE outbox.idempotency_keys (
    aggregate_type  text        COLLATE "C" NOT NULL,
    idempotency_key text        COLLATE "C" NOT NULL,
    event_id        uuid        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- A replayed key answers from its own row.
    aggregate_id    text        COLLATE "C",
    aggregate_seq   bigint,
    PRIMARY KEY (aggregate_type, idempotency_key)
);
COMMENT ON TABLE outbox.idempotency_keys IS 'First event emitted under each idempotency key, per aggregate type.';

-- What each forwarder (one per slot) has recorded: when its first-start
-- catch-up finished, the last position it confirmed, and the snapshot marks
-- that tell retention and status which committed transactions it delivered.
-- Written by the forwarder through outbox.record_relay_progress.
CREATE TABLE outbox.relay_progress (
    slot_name      name        NOT NULL PRIMARY KEY,
    caught_up_at   timestamptz,
    caught_up_lsn  pg_lsn,
    confirmed_lsn  pg_lsn,
    updated_at     timestamptz NOT NULL DEFAULT pg_catalog.now(),
    mark_snapshot  pg_snapshot,
    mark_lsn       pg_lsn,
    safe_snapshot  pg_snapshot,
    safe_at        timestamptz
);
COMMENT ON TABLE outbox.relay_progress IS 'Per slot: first-start catch-up done and last confirmed position, recorded by outbox-forwarder.';

-- The shard of each sharded forwarder's slot, recorded when it starts: its
-- publication carries the events whose aggregate_hash % shards = shard.
-- Kept while the slot is recreated; dropped with the slot.
CREATE TABLE outbox.relay_shards (
    slot_name name    NOT NULL PRIMARY KEY,
    shard     integer NOT NULL,
    shards    integer NOT NULL,
    CHECK (shard >= 0 AND shard < shards)
);
COMMENT ON TABLE outbox.relay_shards IS 'Per sharded forwarder slot: which shard of how many it carries, recorded by outbox-forwarder.';

CREATE TABLE outbox.inbox_consumers (
    consumer   text        COLLATE "C" NOT NULL PRIMARY KEY,
    owner      name        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE outbox.inbox_consumers IS 'Inbox consumers and the role whose members may use each.';

CREATE TABLE outbox.inbox (
    consumer       text        COLLATE "C" NOT NULL,
    event_id       uuid        NOT NULL,
    aggregate_type text        COLLATE "C",
    aggregate_id   text        COLLATE "C",
    aggregate_seq  bigint,
    received_at    timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (consumer, event_id)
);
COMMENT ON TABLE outbox.inbox IS 'Events each consumer has processed, recorded in the consumer''s own transaction.';

CREATE TABLE outbox.inbox_positions (
    consumer       text   COLLATE "C" NOT NULL,
    aggregate_type text   COLLATE "C" NOT NULL,
    aggregate_id   text   COLLATE "C" NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
) WITH (fillfactor = 50);
COMMENT ON TABLE outbox.inbox_positions IS 'Highest sequence each consumer has processed per aggregate.';

REVOKE ALL ON outbox.events, outbox.sequence_floors, outbox.idempotency_keys, outbox.relay_progress,
              outbox.relay_shards, outbox.inbox_consumers, outbox.inbox, outbox.inbox_positions FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.refuse_event_change() FROM PUBLIC;
-- The forwarder reads events for its first-start catch-up, and its progress.
CALL outbox.grant_to('relay', 'SELECT ON outbox.events, outbox.relay_progress, outbox.relay_shards');

