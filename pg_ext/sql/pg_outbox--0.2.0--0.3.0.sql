-- pg_outbox 0.2.0 -> 0.3.0: a cheaper emit_event.
--
-- Sequence numbers no longer come from a counter row per aggregate: the
-- writer takes a transaction-scoped advisory lock on the aggregate and reads
-- the newest sequence from the events' unique key (aggregate_type,
-- aggregate_id, aggregate_seq). That saves the counter row's heap update and
-- WAL, and the separate event_id index, on every emit. emit_event itself is
-- a C function (src/emit.rs); validation errors are still worded by
-- PL/pgSQL (check_emit), with the same SQLSTATEs and hints.
-- Retention now keeps each aggregate's newest event, so that its number is
-- never reused.

------------------------------------------------------------------------------
-- Tables

-- Aggregates whose every event a 0.2.0 prune deleted: their numbering goes
-- on from here. Filled once by this upgrade; 0.3.0 prunes never empty an
-- aggregate.
CREATE TABLE outbox.sequence_floors (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE outbox.sequence_floors IS 'Last sequence of aggregates that have no stored event left (pruned before 0.3.0).';
INSERT INTO outbox.sequence_floors (aggregate_type, aggregate_id, last_seq)
SELECT a.aggregate_type, a.aggregate_id, a.last_seq
  FROM outbox.aggregates a
 WHERE a.last_seq > coalesce((SELECT max(e.aggregate_seq) FROM outbox.events e
                               WHERE e.aggregate_type = a.aggregate_type
                                 AND e.aggregate_id = a.aggregate_id), 0);
DROP TABLE outbox.aggregates;
REVOKE ALL ON outbox.sequence_floors FROM PUBLIC;

-- One index per event instead of two: the key of an event is now its
-- (aggregate_type, aggregate_id, aggregate_seq), unique and NOT NULL, which
-- also serves the newest-sequence lookup. Event ids stay unique by
-- construction (version 7 UUIDs: a millisecond clock and 74 random bits).
-- Dropping the constraint rebuilds nothing, so the upgrade is quick.
ALTER TABLE outbox.events DROP CONSTRAINT events_pkey;
ALTER TABLE outbox.events REPLICA IDENTITY USING INDEX events_aggregate_seq_key;

-- A replayed idempotency key answers from its own row.
ALTER TABLE outbox.idempotency_keys
    ADD COLUMN aggregate_id  text,
    ADD COLUMN aggregate_seq bigint;
UPDATE outbox.idempotency_keys k
   SET aggregate_id = e.aggregate_id, aggregate_seq = e.aggregate_seq
  FROM outbox.events e
 WHERE e.event_id = k.event_id;

------------------------------------------------------------------------------
-- Validation for the C function

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
-- The sequence primitive and emit_event, in C

CREATE FUNCTION outbox.lock_aggregate(aggregate_type text, aggregate_id text) RETURNS bigint
LANGUAGE c STRICT VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'lock_aggregate';
COMMENT ON FUNCTION outbox.lock_aggregate(text, text) IS
    'Internal: locks the aggregate until the end of the transaction and returns its newest sequence.';

DROP FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text);
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
SET search_path = pg_catalog, pg_temp
AS 'MODULE_PATHNAME', 'emit_event';
COMMENT ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text) IS
    'Stores an event in the caller''s transaction with its aggregate''s next sequence number; replays the first event for a repeated idempotency key.';

------------------------------------------------------------------------------
-- Batch emit and current_seq on the same primitive

CREATE OR REPLACE FUNCTION outbox.emit_events(events jsonb)
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
                                   schema_version, payload, headers, topic)
        SELECT s.id, s.v->>'aggregate_type', s.v->>'aggregate_id', s.seq, s.v->>'event_type',
               coalesce((s.v->>'schema_version')::integer, 1), s.v->'payload',
               nullif(s.v->'headers', 'null'::jsonb), s.v->>'topic'
          FROM src s ORDER BY s.ord
        RETURNING 1
    )
    SELECT s.ord, s.id, s.seq FROM src s ORDER BY s.ord;
END
$$;

CREATE OR REPLACE FUNCTION outbox.current_seq(aggregate_type text, aggregate_id text) RETURNS bigint
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

------------------------------------------------------------------------------
-- Retention keeps each aggregate's newest event

CREATE OR REPLACE FUNCTION outbox.prune(older_than interval DEFAULT '7 days', max_rows integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    deleted bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' OR max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION 'older_than must be a positive interval and max_rows at least 1'
            USING ERRCODE = 'PO007', HINT = 'For example outbox.prune(''7 days'', 10000); call it again while it returns max_rows.';
    END IF;
    -- Only what every forwarder has confirmed: without a forwarder, or while
    -- one has not finished its catch-up, nothing is safe.
    IF NOT EXISTS (SELECT 1 FROM outbox.relay_progress)
       OR EXISTS (SELECT 1 FROM outbox.relay_progress WHERE caught_up_at IS NULL OR safe_snapshot IS NULL) THEN
        RETURN 0;
    END IF;
    DELETE FROM outbox.events e
     WHERE e.ctid = ANY (ARRAY(
        SELECT c.ctid FROM outbox.events c
         WHERE c.occurred_at < now() - older_than
           AND NOT EXISTS (SELECT 1 FROM outbox.relay_progress r
                            WHERE NOT pg_visible_in_snapshot(c.txid, r.safe_snapshot))
           -- The newest event of an aggregate carries its numbering.
           AND EXISTS (SELECT 1 FROM outbox.events newer
                        WHERE newer.aggregate_type = c.aggregate_type
                          AND newer.aggregate_id = c.aggregate_id
                          AND newer.aggregate_seq > c.aggregate_seq)
         LIMIT max_rows));
    GET DIAGNOSTICS deleted = ROW_COUNT;
    DELETE FROM outbox.idempotency_keys k
     WHERE k.ctid = ANY (ARRAY(
        SELECT c.ctid FROM outbox.idempotency_keys c WHERE c.created_at < now() - older_than LIMIT max_rows));
    RETURN deleted;
END
$$;
COMMENT ON FUNCTION outbox.prune(interval, integer) IS
    'Deletes up to max_rows events older than older_than that every forwarder has confirmed, keeping each aggregate''s newest; call from cron until it returns less than max_rows.';

------------------------------------------------------------------------------
-- Privileges

REVOKE ALL ON FUNCTION outbox.check_emit(text, text, text, jsonb, jsonb, integer, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.lock_aggregate(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text) TO outbox_writer;
