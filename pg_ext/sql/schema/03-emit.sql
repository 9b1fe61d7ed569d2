------------------------------------------------------------------------------
-- Validation: every check raises before anything is written.
-- SQLSTATEs (class PO, documented in docs/src/sql-api.md):
--   PO001 required argument NULL or empty   PO002 name not valid
--   PO003 value too long                    PO004 payload too large
--   PO005 topic name Kafka would refuse     PO006 headers not an object of strings
--   PO007 argument out of range             PO008 batch not valid
--   PO010 events are immutable              PO011 inbox consumer not allowed
--   PO101 sequence conflict (expected_seq)

-- Not SECURITY DEFINER and called from functions that pin search_path, so it
-- needs no SET clause of its own (which would cost a GUC save and restore on
-- every emit).
CREATE FUNCTION outbox.check_event(
    aggregate_type text, aggregate_id text, event_type text, payload jsonb,
    headers jsonb, schema_version integer, topic text
) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
DECLARE
    limit_bytes bigint := coalesce(nullif(current_setting('pg_outbox.max_payload_bytes', true), '')::bigint, 1000000);
    bad_header text;
BEGIN
    IF aggregate_type IS NULL OR aggregate_type = '' THEN
        RAISE EXCEPTION 'aggregate_type must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the kind of aggregate, for example ''order''.';
    END IF;
    IF length(aggregate_type) > 128 THEN
        RAISE EXCEPTION 'aggregate_type is % characters long; the limit is 128', length(aggregate_type)
            USING ERRCODE = 'PO003', HINT = 'Use a short name for the kind of aggregate.';
    END IF;
    IF aggregate_type !~ '^[A-Za-z0-9._-]+$' THEN
        RAISE EXCEPTION 'aggregate_type % has characters a Kafka topic name cannot hold', quote_literal(aggregate_type)
            USING ERRCODE = 'PO007', HINT = 'Use only a-z, A-Z, 0-9, ".", "_" and "-": the default topic is outbox.{aggregate_type}.';
    END IF;
    IF aggregate_id IS NULL OR aggregate_id = '' THEN
        RAISE EXCEPTION 'aggregate_id must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the identity of the aggregate, for example its primary key as text.';
    END IF;
    IF octet_length(aggregate_id) > 512 THEN
        RAISE EXCEPTION 'aggregate_id is % bytes long; the limit is 512', octet_length(aggregate_id)
            USING ERRCODE = 'PO003', HINT = 'Use the aggregate''s key, not its content.';
    END IF;
    IF event_type IS NULL OR event_type = '' THEN
        RAISE EXCEPTION 'event_type must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the name of the event, for example ''OrderPlaced''.';
    END IF;
    IF length(event_type) > 255 THEN
        RAISE EXCEPTION 'event_type is % characters long; the limit is 255', length(event_type)
            USING ERRCODE = 'PO003', HINT = 'Use a short name for the event.';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'payload must not be NULL'
            USING ERRCODE = 'PO001', HINT = 'Pass a JSON value; use ''{}''::jsonb for an event without data.';
    END IF;
    IF pg_column_size(payload) > limit_bytes THEN
        RAISE EXCEPTION 'payload is % bytes; pg_outbox.max_payload_bytes allows %', pg_column_size(payload), limit_bytes
            USING ERRCODE = 'PO004', HINT = 'Store large data elsewhere and put a reference in the event, or raise pg_outbox.max_payload_bytes (and the broker''s message.max.bytes).';
    END IF;
    IF schema_version IS NULL OR schema_version < 1 THEN
        RAISE EXCEPTION 'schema_version must be 1 or more, not %', coalesce(schema_version::text, 'NULL')
            USING ERRCODE = 'PO007', HINT = 'Number the payload''s schema versions from 1.';
    END IF;
    IF topic IS NOT NULL AND (topic !~ '^[A-Za-z0-9._-]{1,249}$' OR topic IN ('.', '..')) THEN
        RAISE EXCEPTION 'topic % is not a name Kafka accepts', quote_literal(topic)
            USING ERRCODE = 'PO005', HINT = 'Use 1 to 249 characters of a-z, A-Z, 0-9, ".", "_" and "-", or NULL for the routed topic.';
    END IF;
    IF headers IS NOT NULL THEN
        IF jsonb_typeof(headers) <> 'object' THEN
            RAISE EXCEPTION 'headers must be a JSON object, not %', jsonb_typeof(headers)
                USING ERRCODE = 'PO006', HINT = 'Pass headers as {"name": "value", ...} with string values.';
        END IF;
        SELECT h.key INTO bad_header FROM jsonb_each(headers) h
         WHERE jsonb_typeof(h.value) <> 'string' OR h.key = '' OR length(h.key) > 255
            OR h.key IN ('event_id', 'event_type', 'aggregate_type', 'aggregate_seq', 'schema_version', 'occurred_at')
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'header % is not allowed: names are 1 to 255 characters, values are strings, and the forwarder''s own names are reserved', quote_literal(bad_header)
                USING ERRCODE = 'PO006', HINT = 'Reserved: event_id, event_type, aggregate_type, aggregate_seq, schema_version, occurred_at.';
        END IF;
    END IF;
END
$$;

-- Every rule of an emit_event call: the first one broken, as the error the
-- C function then raises (SQLSTATE, message, detail, hint), or NULLs. The C
-- function calls it only when its own quick check is not sure.
-- Every rule of an emit_event call: the first one broken, as the error the
-- C function then raises (SQLSTATE, message, detail, hint), or NULLs. The C
-- function calls it only when its own quick check is not sure.
CREATE FUNCTION outbox.check_emit(
    aggregate_type text, aggregate_id text, event_type text, payload jsonb, headers jsonb,
    schema_version integer, expected_seq bigint, idempotency_key text, topic text,
    OUT refused_sqlstate text, OUT refused_message text, OUT refused_detail text, OUT refused_hint text
)
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
BEGIN
    PERFORM outbox.check_event(aggregate_type, aggregate_id, event_type, payload, headers, schema_version, topic);
    IF expected_seq IS NOT NULL AND expected_seq < 0 THEN
        RAISE EXCEPTION 'expected_seq must be 0 or more, not %', expected_seq
            USING ERRCODE = 'PO007', HINT = 'Pass the sequence you last read (0 for a new aggregate), or NULL.';
    END IF;
    IF idempotency_key = '' OR length(idempotency_key) > 255 THEN
        RAISE EXCEPTION 'idempotency_key must be 1 to 255 characters'
            USING ERRCODE = 'PO003', HINT = 'Use the request''s id, or NULL for no idempotency.';
    END IF;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS refused_sqlstate = RETURNED_SQLSTATE, refused_message = MESSAGE_TEXT,
                            refused_detail = PG_EXCEPTION_DETAIL, refused_hint = PG_EXCEPTION_HINT;
END
$$;

------------------------------------------------------------------------------
-- Emitting events

--@c-function uuid_v7
-- outbox.uuid_v7() RETURNS uuid, a version 7 UUID: declared by pgrx from
-- src/lib.rs before this file runs.
--@end

-- Where an aggregate lives when the outbox is split into shards: the first
-- 31 bits of the SHA-256 of its type and id in UTF-8, joined by a zero byte
-- (which text cannot hold). Stored with every event at emit (emit_event's C
-- code computes the same), so that a shard's publication can filter on
-- aggregate_hash % shards, and no later change of PostgreSQL's own hash
-- functions or of the number of shards moves an aggregate's stored events.
CREATE FUNCTION outbox.aggregate_hash(aggregate_type text, aggregate_id text) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN ('x' || pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
            pg_catalog.convert_to(aggregate_type, 'UTF8') || pg_catalog.decode('00', 'hex')
            || pg_catalog.convert_to(aggregate_id, 'UTF8')), 1, 4), 'hex'))::bit(32)::integer & 2147483647;
COMMENT ON FUNCTION outbox.aggregate_hash(text, text) IS
    'The aggregate''s hash that shards split on (0 to 2^31-1): stored in outbox.events.aggregate_hash by every emit.';

-- The sequence primitive: a transaction-scoped advisory lock on the
-- aggregate, then its newest sequence read with the latest snapshot.
--@c-function lock_aggregate
CREATE FUNCTION outbox.lock_aggregate(aggregate_type text, aggregate_id text) RETURNS bigint
LANGUAGE c STRICT VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'lock_aggregate';
--@end
COMMENT ON FUNCTION outbox.lock_aggregate(text, text) IS
    'Internal: locks the aggregate until the end of the transaction and returns its newest sequence.';

-- The C function pins search_path in its own code, around the only
-- statements it runs; its common call resolves no name, and a SET clause
-- would cost a configuration change on every call.
--@c-function emit_event
CREATE FUNCTION outbox.emit_event(
    aggregate_type  text,
    aggregate_id    text,
    event_type      text,
    payload         jsonb,
    headers         jsonb   DEFAULT NULL,
    schema_version  integer DEFAULT 1,
    expected_seq    bigint  DEFAULT NULL,
    idempotency_key text    DEFAULT NULL,
    topic           text    DEFAULT NULL,
    OUT event_id      uuid,
    OUT aggregate_seq bigint,
    OUT replayed      boolean
)
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER
AS 'MODULE_PATHNAME', 'emit_event';
--@end
COMMENT ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text) IS
    'Stores an event in the caller''s transaction with its aggregate''s next sequence number; replays the first event for a repeated idempotency key.';

CREATE FUNCTION outbox.emit_events(events jsonb)
RETURNS TABLE (ordinal integer, event_id uuid, aggregate_seq bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    n integer;
    e record;
    agg record;
    agg_types text[] := '{}';
    agg_ids text[] := '{}';
    bases bigint[] := '{}';
BEGIN
    IF events IS NULL OR jsonb_typeof(events) <> 'array' THEN
        RAISE EXCEPTION 'events must be a JSON array of event objects'
            USING ERRCODE = 'PO008', HINT = 'Pass [{"aggregate_type": ..., "aggregate_id": ..., "event_type": ..., "payload": ...}, ...].';
    END IF;
    n := jsonb_array_length(events);
    IF n = 0 OR n > 10000 THEN
        RAISE EXCEPTION 'a batch holds 1 to 10000 events, not %', n
            USING ERRCODE = 'PO008', HINT = 'Split larger batches.';
    END IF;
    FOR e IN SELECT x.value AS v, x.ordinality AS i FROM jsonb_array_elements(events) WITH ORDINALITY x LOOP
        IF jsonb_typeof(e.v) <> 'object' OR NOT (e.v ? 'payload')
           OR (e.v ? 'schema_version' AND jsonb_typeof(e.v->'schema_version') <> 'number')
           OR EXISTS (SELECT 1 FROM unnest(ARRAY['aggregate_type', 'aggregate_id', 'event_type', 'topic']) f
                       WHERE e.v ? f AND jsonb_typeof(e.v->f) NOT IN ('string', 'null')) THEN
            RAISE EXCEPTION 'batch element % is not an event object with a payload and text fields', e.i
                USING ERRCODE = 'PO008', HINT = 'Each element needs aggregate_type, aggregate_id, event_type (strings) and payload; schema_version is a number.';
        END IF;
        PERFORM outbox.check_event(e.v->>'aggregate_type', e.v->>'aggregate_id', e.v->>'event_type',
                                   CASE WHEN jsonb_typeof(e.v->'payload') = 'null' THEN NULL ELSE e.v->'payload' END,
                                   nullif(e.v->'headers', 'null'::jsonb),
                                   coalesce((e.v->>'schema_version')::integer, 1), e.v->>'topic');
        PERFORM outbox.check_payload(e.v->>'aggregate_type', e.v->>'event_type',
                                     coalesce((e.v->>'schema_version')::integer, 1), e.v->'payload');
    END LOOP;

    -- Lock the aggregates in one sorted pass: concurrent batches take the
    -- locks in the same order and cannot deadlock.
    FOR agg IN
        SELECT x.t, x.i
          FROM (SELECT value->>'aggregate_type' AS t, value->>'aggregate_id' AS i
                  FROM jsonb_array_elements(events)) x
         GROUP BY x.t, x.i ORDER BY x.t COLLATE "C", x.i COLLATE "C"
    LOOP
        agg_types := agg_types || agg.t;
        agg_ids := agg_ids || agg.i;
        bases := bases || outbox.lock_aggregate(agg.t, agg.i);
    END LOOP;

    RETURN QUERY
    WITH src AS MATERIALIZED (
        SELECT x.ordinality::integer AS ord, outbox.uuid_v7() AS id, x.value AS v,
               b.base + row_number() OVER (PARTITION BY b.t, b.i ORDER BY x.ordinality) AS seq
          FROM jsonb_array_elements(events) WITH ORDINALITY x
          JOIN unnest(agg_types, agg_ids, bases) AS b(t, i, base)
            ON b.t = x.value->>'aggregate_type' AND b.i = x.value->>'aggregate_id'
    ), ins AS (
        INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                   schema_version, payload, headers, topic, aggregate_hash)
        SELECT s.id, s.v->>'aggregate_type', s.v->>'aggregate_id', s.seq, s.v->>'event_type',
               coalesce((s.v->>'schema_version')::integer, 1), s.v->'payload',
               nullif(s.v->'headers', 'null'::jsonb), s.v->>'topic',
               outbox.aggregate_hash(s.v->>'aggregate_type', s.v->>'aggregate_id')
          FROM src s ORDER BY s.ord
        RETURNING 1
    )
    SELECT s.ord, s.id, s.seq FROM src s ORDER BY s.ord;
END
$$;
COMMENT ON FUNCTION outbox.emit_events(jsonb) IS
    'Emits a batch of events (a JSON array) with consecutive sequences per aggregate in the given order; locks aggregates in sorted order.';

CREATE FUNCTION outbox.current_seq(aggregate_type text, aggregate_id text) RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF aggregate_type IS NULL OR aggregate_type = '' OR aggregate_id IS NULL OR aggregate_id = '' THEN
        RAISE EXCEPTION 'aggregate_type and aggregate_id must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the aggregate''s type and id as given to emit_event.';
    END IF;
    RETURN coalesce(
        (SELECT e.aggregate_seq FROM outbox.events e
          WHERE e.aggregate_type = current_seq.aggregate_type AND e.aggregate_id = current_seq.aggregate_id
          ORDER BY e.aggregate_seq DESC LIMIT 1),
        (SELECT f.last_seq FROM outbox.sequence_floors f
          WHERE f.aggregate_type = current_seq.aggregate_type AND f.aggregate_id = current_seq.aggregate_id),
        0);
END
$$;
COMMENT ON FUNCTION outbox.current_seq(text, text) IS
    'The aggregate''s last committed sequence number (0 when it has none): the expected_seq for its next event.';

