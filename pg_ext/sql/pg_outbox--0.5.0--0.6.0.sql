-- pg_outbox 0.5.0 -> 0.6.0: event contracts.
--
-- JSON Schemas registered per aggregate type, event type and schema version
-- (outbox.register_schema), checked by emit_event and emit_events; what a
-- payload that breaks its schema does is set per aggregate type
-- (outbox.set_schema_check). Nothing changes for a database that registers
-- no schema.
--
-- Dead letters that keep each aggregate's order: a forwarder parks the
-- aggregate of a dead-lettered event (outbox.parked_aggregates) and holds
-- its later events back until `outbox-forwarder redrive`; prune keeps what
-- a parked aggregate holds.

------------------------------------------------------------------------------
-- Event contracts: a JSON Schema per (aggregate type, event type, schema
-- version), registered by the owner or a member of outbox_schema_admin and
-- immutable once registered (a change is a new version). emit_event and
-- emit_events check each payload against the schema of its event type and
-- version. What a mismatch does is set per aggregate type in
-- outbox.schema_checks: 'enforce' (the default: refused with PO020; a
-- version without a schema, where the event type has others, with PO021),
-- 'warn' (a WARNING, and the event is stored) or 'off'. An event type
-- without any schema is not checked.

DO $roles$
BEGIN
    -- Another database's install may create it at the same moment.
    CREATE ROLE outbox_schema_admin NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END
$roles$;
GRANT USAGE ON SCHEMA outbox TO outbox_schema_admin;

CREATE TABLE outbox.event_schemas (
    aggregate_type text        COLLATE "C" NOT NULL,
    event_type     text        NOT NULL,
    schema_version integer     NOT NULL CHECK (schema_version >= 1),
    schema         jsonb       NOT NULL,
    registered_at  timestamptz NOT NULL DEFAULT pg_catalog.now(),
    registered_by  name        NOT NULL DEFAULT pg_catalog."session_user"(),
    PRIMARY KEY (aggregate_type, event_type, schema_version)
);
COMMENT ON TABLE outbox.event_schemas IS 'JSON Schemas of event payloads, by aggregate type, event type and schema version; immutable (outbox.register_schema).';

CREATE TABLE outbox.schema_checks (
    aggregate_type text        COLLATE "C" PRIMARY KEY,
    mode           text        NOT NULL CHECK (mode IN ('off', 'warn', 'enforce')),
    set_at         timestamptz NOT NULL DEFAULT pg_catalog.now(),
    set_by         name        NOT NULL DEFAULT pg_catalog."session_user"()
);
COMMENT ON TABLE outbox.schema_checks IS 'What a payload that breaks its schema does, per aggregate type (outbox.set_schema_check); enforce without a row.';

CREATE FUNCTION outbox.refuse_schema_change() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'registered schemas are immutable'
        USING ERRCODE = 'PO023', HINT = 'Register the change as a new schema_version with outbox.register_schema.';
END
$$;
CREATE TRIGGER event_schemas_immutable BEFORE UPDATE OR DELETE ON outbox.event_schemas
    FOR EACH ROW EXECUTE FUNCTION outbox.refuse_schema_change();
CREATE TRIGGER event_schemas_kept BEFORE TRUNCATE ON outbox.event_schemas
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.refuse_schema_change();

-- Tells every backend, at commit, to read both tables again (the extension
-- keeps them, compiled, for the life of a backend).
--@c-function schemas_changed
CREATE FUNCTION outbox.schemas_changed() RETURNS trigger
LANGUAGE c
AS 'MODULE_PATHNAME', 'schemas_changed';
--@end
CREATE TRIGGER event_schemas_changed AFTER INSERT ON outbox.event_schemas
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.schemas_changed();
CREATE TRIGGER schema_checks_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.schema_checks
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.schemas_changed();

-- Why the validator cannot use a schema, or NULL.
--@c-function schema_problem
CREATE FUNCTION outbox.schema_problem(schema jsonb) RETURNS text
LANGUAGE c STRICT IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'schema_problem';
--@end

-- The check emit_event makes, on its own: nothing when the payload matches
-- (or has no schema, or its aggregate type is not checked), a WARNING in
-- 'warn' mode, PO020 or PO021 in 'enforce' mode.
--@c-function check_payload
CREATE FUNCTION outbox.check_payload(aggregate_type text, event_type text, schema_version integer, payload jsonb)
RETURNS void
LANGUAGE c STRICT STABLE PARALLEL RESTRICTED SECURITY DEFINER
AS 'MODULE_PATHNAME', 'check_payload';
--@end
COMMENT ON FUNCTION outbox.check_payload(text, text, integer, jsonb) IS
    'Checks a payload against the registered schema of its event type and version, as emit_event does.';

CREATE FUNCTION outbox.register_schema(aggregate_type text, event_type text, schema_version integer, schema jsonb)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    problem text;
    registered jsonb;
BEGIN
    PERFORM outbox.check_event(aggregate_type, 'schema', event_type, '{}'::jsonb, NULL, schema_version, NULL);
    IF register_schema.schema IS NULL THEN
        RAISE EXCEPTION 'schema must not be NULL'
            USING ERRCODE = 'PO001', HINT = 'Pass a JSON Schema (draft 2020-12 unless its $schema says otherwise).';
    END IF;
    problem := outbox.schema_problem(register_schema.schema);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'schema of % event % version % is not valid: %', aggregate_type, event_type, schema_version, problem
            USING ERRCODE = 'PO022', HINT = 'Correct the schema; nothing was registered.';
    END IF;
    LOCK TABLE outbox.event_schemas IN SHARE ROW EXCLUSIVE MODE;
    SELECT s.schema INTO registered FROM outbox.event_schemas s
     WHERE s.aggregate_type = register_schema.aggregate_type AND s.event_type = register_schema.event_type
       AND s.schema_version = register_schema.schema_version;
    IF FOUND THEN
        IF registered = register_schema.schema THEN
            RETURN false;
        END IF;
        RAISE EXCEPTION 'version % of % event % is registered with another schema', schema_version, aggregate_type, event_type
            USING ERRCODE = 'PO023', HINT = 'Registered schemas are immutable: register the change as a new schema_version.';
    END IF;
    INSERT INTO outbox.event_schemas (aggregate_type, event_type, schema_version, schema)
    VALUES (aggregate_type, event_type, schema_version, register_schema.schema);
    RETURN true;
END
$$;
COMMENT ON FUNCTION outbox.register_schema(text, text, integer, jsonb) IS
    'Registers the JSON Schema of an event type''s payload under a version; true when new, false when the same schema was registered already.';

CREATE FUNCTION outbox.set_schema_check(aggregate_type text, mode text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.check_event(aggregate_type, 'schema', 'check', '{}'::jsonb, NULL, 1, NULL);
    IF mode IS NULL OR mode NOT IN ('off', 'warn', 'enforce') THEN
        RAISE EXCEPTION 'mode must be off, warn or enforce, not %', coalesce(quote_literal(mode), 'NULL')
            USING ERRCODE = 'PO007', HINT = 'enforce refuses payloads that break their schema, warn stores them with a WARNING, off does not check.';
    END IF;
    INSERT INTO outbox.schema_checks AS c (aggregate_type, mode) VALUES (set_schema_check.aggregate_type, set_schema_check.mode)
    ON CONFLICT (aggregate_type) DO UPDATE
       SET mode = excluded.mode, set_at = pg_catalog.now(), set_by = pg_catalog."session_user"();
END
$$;
COMMENT ON FUNCTION outbox.set_schema_check(text, text) IS
    'Sets what a payload that breaks its schema does for an aggregate type: enforce (the default), warn or off.';

CREATE VIEW outbox.schemas AS
SELECT s.aggregate_type, s.event_type, s.schema_version, s.schema,
       coalesce(c.mode, 'enforce') AS check_mode, s.registered_at, s.registered_by
  FROM outbox.event_schemas s
  LEFT JOIN outbox.schema_checks c ON c.aggregate_type = s.aggregate_type;
COMMENT ON VIEW outbox.schemas IS 'Registered schemas with the check mode of their aggregate type.';

REVOKE ALL ON outbox.event_schemas, outbox.schema_checks, outbox.schemas FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.refuse_schema_change() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.schemas_changed() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.schema_problem(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.check_payload(text, text, integer, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.register_schema(text, text, integer, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.set_schema_check(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.register_schema(text, text, integer, jsonb) TO outbox_schema_admin;
GRANT EXECUTE ON FUNCTION outbox.set_schema_check(text, text) TO outbox_schema_admin;
GRANT EXECUTE ON FUNCTION outbox.schema_problem(jsonb) TO outbox_schema_admin;
GRANT EXECUTE ON FUNCTION outbox.check_payload(text, text, integer, jsonb) TO outbox_writer, outbox_schema_admin;
GRANT SELECT ON outbox.schemas TO outbox_schema_admin, outbox_writer, outbox_relay;


-- emit_events checks each payload as emit_event does.
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

-- The C function checks payloads itself; the SQL edition's emit_event is
-- replaced by one that calls outbox.check_payload.
--@c-function emit_event
CREATE OR REPLACE FUNCTION outbox.emit_event(
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

------------------------------------------------------------------------------
-- Dead letters that keep each aggregate's order. A forwarder that sends a
-- poison event to its dead-letter topic parks the event's aggregate here;
-- while it is parked, the aggregate's later events go to the dead-letter
-- topic too, marked as parked behind the first, so that no consumer sees an
-- aggregate's event n+1 before its event n. Other aggregates flow on.
-- `outbox-forwarder redrive`, once the cause is fixed, publishes the held
-- events again in sequence order and unparks the aggregate; prune keeps
-- them until then.

CREATE TABLE outbox.parked_aggregates (
    aggregate_type text        COLLATE "C" NOT NULL,
    aggregate_id   text        COLLATE "C" NOT NULL,
    first_seq      bigint      NOT NULL,
    first_event_id uuid        NOT NULL,
    reason         text        NOT NULL,
    held_up_to     bigint      NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE outbox.parked_aggregates IS 'Aggregates held back behind a dead-lettered event, from first_seq on, until outbox-forwarder redrive.';
REVOKE ALL ON outbox.parked_aggregates FROM PUBLIC;

-- Whether the forwarder holds the event back: with a reason, the event is
-- poison and parks its aggregate (unless it is parked already); without, it
-- is asked whether the aggregate is parked at or before the event. Returns
-- the event it is parked behind, or no row.
CREATE FUNCTION outbox.park_event(aggregate_type text, aggregate_id text, aggregate_seq bigint, event_id uuid, reason text DEFAULT NULL)
RETURNS TABLE (first_seq bigint, first_event_id uuid)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF park_event.reason IS NOT NULL THEN
        INSERT INTO outbox.parked_aggregates (aggregate_type, aggregate_id, first_seq, first_event_id, reason, held_up_to)
        VALUES (park_event.aggregate_type, park_event.aggregate_id, park_event.aggregate_seq, park_event.event_id,
                park_event.reason, park_event.aggregate_seq)
        ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING;
    END IF;
    RETURN QUERY
    UPDATE outbox.parked_aggregates p SET held_up_to = greatest(p.held_up_to, park_event.aggregate_seq)
     WHERE p.aggregate_type = park_event.aggregate_type AND p.aggregate_id = park_event.aggregate_id
       AND p.first_seq <= park_event.aggregate_seq
    RETURNING p.first_seq, p.first_event_id;
END
$$;
COMMENT ON FUNCTION outbox.park_event(text, text, bigint, uuid, text) IS
    'Internal, for the forwarder: parks an aggregate behind a poison event, or tells whether an event is held back behind one.';

-- The parked aggregates, oldest first. With lock, the caller's transaction
-- holds each row returned (redrive), so that no event is parked behind it
-- until the transaction ends.
CREATE FUNCTION outbox.parked(of_type text DEFAULT NULL, of_id text DEFAULT NULL, lock boolean DEFAULT false)
RETURNS TABLE (aggregate_type text, aggregate_id text, first_seq bigint, first_event_id uuid, reason text,
               held_up_to bigint, parked_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF lock THEN
        RETURN QUERY
        SELECT p.aggregate_type::text, p.aggregate_id::text, p.first_seq, p.first_event_id, p.reason, p.held_up_to, p.parked_at
          FROM outbox.parked_aggregates p
         WHERE (of_type IS NULL OR p.aggregate_type = of_type)
           AND (of_id IS NULL OR p.aggregate_id = of_id)
         ORDER BY p.parked_at, p.aggregate_type, p.aggregate_id
           FOR UPDATE;
    ELSE
        RETURN QUERY
        SELECT p.aggregate_type::text, p.aggregate_id::text, p.first_seq, p.first_event_id, p.reason, p.held_up_to, p.parked_at
          FROM outbox.parked_aggregates p
         WHERE (of_type IS NULL OR p.aggregate_type = of_type)
           AND (of_id IS NULL OR p.aggregate_id = of_id)
         ORDER BY p.parked_at, p.aggregate_type, p.aggregate_id;
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.parked(text, text, boolean) IS
    'Aggregates held back behind a dead-lettered event: from which event, why, up to which sequence, since when.';

-- Redrive published the aggregate's held events up to up_to_seq: the
-- aggregate flows again. False when more were held meanwhile.
CREATE FUNCTION outbox.unpark(aggregate_type text, aggregate_id text, up_to_seq bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM outbox.parked_aggregates p
     WHERE p.aggregate_type = unpark.aggregate_type AND p.aggregate_id = unpark.aggregate_id
       AND p.held_up_to <= unpark.up_to_seq;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION outbox.unpark(text, text, bigint) IS
    'Internal, for outbox-forwarder redrive: the aggregate''s held events are published again up to up_to_seq.';

REVOKE ALL ON FUNCTION outbox.park_event(text, text, bigint, uuid, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.parked(text, text, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.unpark(text, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.park_event(text, text, bigint, uuid, text) TO outbox_relay;
GRANT EXECUTE ON FUNCTION outbox.parked(text, text, boolean) TO outbox_relay;
GRANT EXECUTE ON FUNCTION outbox.unpark(text, text, bigint) TO outbox_relay;

-- Retention keeps what a parked aggregate holds.
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
    -- Only what every forwarder has confirmed and no polling relay has still
    -- to publish: with neither, or while a forwarder has not finished its
    -- catch-up, nothing is safe.
    IF (NOT EXISTS (SELECT 1 FROM outbox.relay_progress)
        AND NOT EXISTS (SELECT 1 FROM pg_trigger t
                         WHERE t.tgrelid = 'outbox.events'::regclass AND t.tgname = 'events_pending'))
       OR EXISTS (SELECT 1 FROM outbox.relay_progress WHERE caught_up_at IS NULL OR safe_snapshot IS NULL) THEN
        RETURN 0;
    END IF;
    DELETE FROM outbox.events e
     WHERE e.ctid = ANY (ARRAY(
        SELECT c.ctid FROM outbox.events c
         WHERE c.occurred_at < now() - older_than
           AND NOT EXISTS (SELECT 1 FROM outbox.relay_progress r
                            WHERE NOT pg_visible_in_snapshot(c.txid, r.safe_snapshot))
           AND NOT EXISTS (SELECT 1 FROM outbox.pending p
                            WHERE p.aggregate_type = c.aggregate_type AND p.aggregate_id = c.aggregate_id
                              AND p.aggregate_seq = c.aggregate_seq)
           -- Held back behind a dead-lettered event, for redrive.
           AND NOT EXISTS (SELECT 1 FROM outbox.parked_aggregates k
                            WHERE k.aggregate_type = c.aggregate_type AND k.aggregate_id = c.aggregate_id
                              AND k.first_seq <= c.aggregate_seq)
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
    'Deletes up to max_rows events older than older_than that every forwarder has confirmed, no polling relay has pending and no parked aggregate holds, keeping each aggregate''s newest; call from cron until it returns less than max_rows.';
