-- pg_outbox: the whole schema of the current version, in one file.
--
-- A fresh `CREATE EXTENSION pg_outbox` runs this file (after pgrx declares
-- the Rust function outbox.uuid_v7()); a database on an older version gets
-- the same schema from the released upgrade scripts pg_outbox--A--B.sql,
-- which are never edited. A test compares the two catalogs.
--
-- The SQL edition (sql/pg_outbox_sql.sql, for managed PostgreSQL) is
-- assembled from this file by scripts/sql-edition: each block between
-- `--@c-function NAME` and `--@end` declares a function written in C (Rust)
-- here, and is replaced there by the PL/pgSQL block of the same name in
-- sql_edition.sql. Everything else is the same text in both editions.
--
-- A change to this file is a new version: it comes with a new upgrade
-- script that brings the previous version to the same catalog.

-- Roles. PostgreSQL's roles belong to the whole cluster, but privileges are
-- granted in one database, so each database with the outbox has roles of
-- its own, and a member of one database's roles reaches no other
-- database's outbox:
--   <prefix>_writer        emit_event, emit_events, current_seq (applications)
--   <prefix>_relay         what the forwarder and polling relays read and call
--   <prefix>_consumer      the inbox
--   <prefix>_schema_admin  event contracts
-- The prefix is the setting pg_outbox.role_prefix when the outbox is
-- installed, else the database's name followed by _outbox (database app:
-- app_outbox_writer, ...). outbox.roles names them; the install grants them
-- CONNECT on the database, so that an operator may revoke it from PUBLIC,
-- and gives them to the database owner to hand out (with ADMIN, on 16+ with
-- neither INHERIT nor SET).
CREATE TABLE outbox.roles (
    purpose text    PRIMARY KEY CHECK (purpose IN ('writer', 'relay', 'consumer', 'schema_admin')),
    role    regrole NOT NULL UNIQUE
);
COMMENT ON TABLE outbox.roles IS 'The roles of this database''s outbox, by purpose: grant them to the application, forwarder and consumer logins of this database.';
REVOKE ALL ON outbox.roles FROM PUBLIC;

DO $roles$
DECLARE
    database name := pg_catalog.current_database();
    database_oid oid := (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database());
    owner name := (SELECT datdba::regrole::name FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database());
    prefix text := coalesce(nullif(pg_catalog.current_setting('pg_outbox.role_prefix', true), ''), database || '_outbox');
    purpose text;
    role_name text;
    existing record;
BEGIN
    IF pg_catalog.octet_length(prefix) > 50 THEN
        RAISE EXCEPTION 'the outbox role prefix "%" is longer than 50 bytes', prefix
            USING ERRCODE = 'name_too_long',
                  HINT = 'Choose a shorter prefix before installing: SET pg_outbox.role_prefix = ''app_outbox''.';
    END IF;
    FOREACH purpose IN ARRAY ARRAY['writer', 'relay', 'consumer', 'schema_admin'] LOOP
        role_name := prefix || '_' || purpose;
        SELECT r.oid, r.rolcanlogin OR r.rolsuper OR r.rolreplication AS powerful,
               (SELECT d.datname
                  FROM pg_catalog.pg_shdepend s
                  JOIN pg_catalog.pg_database d
                    ON d.oid = CASE WHEN s.dbid = 0 AND s.classid = 'pg_catalog.pg_database'::regclass
                                    THEN s.objid ELSE s.dbid END
                 WHERE s.refclassid = 'pg_catalog.pg_authid'::regclass AND s.refobjid = r.oid
                   AND d.oid <> database_oid
                 LIMIT 1) AS elsewhere
          INTO existing
          FROM pg_catalog.pg_roles r WHERE r.rolname = role_name;
        IF NOT FOUND THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', role_name);
            EXECUTE pg_catalog.format('COMMENT ON ROLE %I IS %L', role_name,
                pg_catalog.format('pg_outbox: %s role of database %s', purpose, database));
        ELSIF existing.powerful THEN
            RAISE EXCEPTION 'role "%" exists and can log in, replicate or is a superuser', role_name
                USING ERRCODE = 'duplicate_object',
                      HINT = 'The outbox''s roles are groups of their own: choose another prefix with SET pg_outbox.role_prefix.';
        ELSIF existing.elsewhere IS NOT NULL THEN
            RAISE EXCEPTION 'role "%" already holds privileges in database "%"', role_name, existing.elsewhere
                USING ERRCODE = 'duplicate_object',
                      HINT = 'Each database''s outbox needs roles of its own: choose another prefix with SET pg_outbox.role_prefix.';
        END IF;
        INSERT INTO outbox.roles VALUES (purpose, role_name::regrole);
        EXECUTE pg_catalog.format('GRANT CONNECT ON DATABASE %I TO %I', database, role_name);
        -- A role made by a CREATEROLE owner on 16+ is already the owner's to
        -- give; on 15 CREATEROLE gives any role.
        IF NOT pg_catalog.pg_has_role(owner, role_name, 'MEMBER WITH ADMIN OPTION')
           AND NOT (pg_catalog.current_setting('server_version_num')::int < 160000
                    AND (SELECT rolcreaterole FROM pg_catalog.pg_roles WHERE rolname = owner)) THEN
            IF pg_catalog.current_setting('server_version_num')::int >= 160000 THEN
                EXECUTE pg_catalog.format('GRANT %I TO %I WITH ADMIN TRUE, INHERIT FALSE, SET FALSE', role_name, owner);
            ELSE
                EXECUTE pg_catalog.format('GRANT %I TO %I WITH ADMIN OPTION', role_name, owner);
            END IF;
        END IF;
    END LOOP;
END
$roles$;

-- Grants privilege (as GRANT's text before TO) to the role of purpose.
CREATE PROCEDURE outbox.grant_to(purpose text, privilege text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    grantee regrole := (SELECT r.role FROM outbox.roles r WHERE r.purpose = grant_to.purpose);
BEGIN
    IF grantee IS NULL THEN
        RAISE EXCEPTION 'outbox.roles names no % role', purpose USING ERRCODE = 'undefined_object';
    END IF;
    EXECUTE format('GRANT %s TO %s', privilege, grantee);
END
$$;
COMMENT ON PROCEDURE outbox.grant_to(text, text) IS 'Grants a privilege to this database''s outbox role of a purpose (install and upgrade scripts).';
REVOKE ALL ON PROCEDURE outbox.grant_to(text, text) FROM PUBLIC;

CALL outbox.grant_to('writer', 'USAGE ON SCHEMA outbox');
CALL outbox.grant_to('relay', 'USAGE ON SCHEMA outbox');
CALL outbox.grant_to('consumer', 'USAGE ON SCHEMA outbox');
CALL outbox.grant_to('schema_admin', 'USAGE ON SCHEMA outbox');
-- outbox-forwarder check reads which role it needs.
CALL outbox.grant_to('relay', 'SELECT ON outbox.roles');

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
              outbox.inbox_consumers, outbox.inbox, outbox.inbox_positions FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.refuse_event_change() FROM PUBLIC;
-- The forwarder reads events for its first-start catch-up, and its progress.
CALL outbox.grant_to('relay', 'SELECT ON outbox.events, outbox.relay_progress');

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

------------------------------------------------------------------------------
-- The forwarder's functions

CREATE FUNCTION outbox.ensure_publication(name text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL OR name !~ '^[a-z0-9_]{1,63}$' THEN
        RAISE EXCEPTION 'publication name % is not valid', quote_literal(coalesce(name, 'NULL'))
            USING ERRCODE = 'PO002', HINT = 'Use 1 to 63 characters of a-z, 0-9 and _.';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = name) THEN
        EXECUTE format('CREATE PUBLICATION %I FOR TABLE outbox.events WITH (publish = %L)', name, 'insert');
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.ensure_publication(text) IS
    'Creates the insert-only publication on outbox.events that the forwarder streams, if missing.';

CREATE FUNCTION outbox.drop_publication(name text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL OR name !~ '^[a-z0-9_]{1,63}$' THEN
        RAISE EXCEPTION 'publication name % is not valid', quote_literal(coalesce(name, 'NULL'))
            USING ERRCODE = 'PO002', HINT = 'Use 1 to 63 characters of a-z, 0-9 and _.';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_publication p
                JOIN pg_catalog.pg_publication_rel r ON r.prpubid = p.oid
               WHERE p.pubname = name AND r.prrelid = 'outbox.events'::regclass) THEN
        EXECUTE format('DROP PUBLICATION %I', name);
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.drop_publication(text) IS
    'Drops a publication on outbox.events (and no other), for outbox-forwarder publication drop.';

-- Each progress report promotes the previous mark (a snapshot and the WAL
-- insert position taken after it) to "safe" once the confirmed position has
-- passed that WAL position: every transaction visible in a safe snapshot
-- committed before it and has been delivered.
CREATE FUNCTION outbox.record_relay_progress(slot_name name, confirmed_lsn pg_lsn, caught_up boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO outbox.relay_progress AS p (slot_name, caught_up_at, caught_up_lsn, confirmed_lsn, mark_snapshot, mark_lsn)
    VALUES ($1, CASE WHEN $3 THEN now() END, CASE WHEN $3 THEN $2 END, $2,
            pg_current_snapshot(), pg_current_wal_insert_lsn())
    ON CONFLICT ON CONSTRAINT relay_progress_pkey DO UPDATE
       SET confirmed_lsn = GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn),
           caught_up_at  = COALESCE(EXCLUDED.caught_up_at, p.caught_up_at),
           caught_up_lsn = COALESCE(EXCLUDED.caught_up_lsn, p.caught_up_lsn),
           -- The old mark is safe once the confirmed position passed it.
           safe_snapshot = CASE WHEN p.mark_lsn <= GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn)
                                THEN p.mark_snapshot ELSE p.safe_snapshot END,
           safe_at       = CASE WHEN p.mark_lsn <= GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn)
                                THEN now() ELSE p.safe_at END,
           mark_snapshot = CASE WHEN p.mark_lsn IS NULL OR p.mark_lsn <= GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn)
                                THEN EXCLUDED.mark_snapshot ELSE p.mark_snapshot END,
           mark_lsn      = CASE WHEN p.mark_lsn IS NULL OR p.mark_lsn <= GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn)
                                THEN EXCLUDED.mark_lsn ELSE p.mark_lsn END,
           updated_at    = now();
END
$$;
COMMENT ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean) IS
    'Called by outbox-forwarder: records a confirmed position for a slot, and that its first-start catch-up is done.';

CREATE FUNCTION outbox.forget_relay(slot_name name) RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM outbox.relay_progress WHERE relay_progress.slot_name = $1;
$$;
COMMENT ON FUNCTION outbox.forget_relay(name) IS
    'Called by outbox-forwarder when it drops or recreates a slot: its catch-up must run again.';

CREATE FUNCTION outbox.status()
RETURNS TABLE (
    slot_name              name,
    active                 boolean,
    caught_up              boolean,
    confirmed_lsn          pg_lsn,
    lag_bytes              bigint,
    retained_wal_bytes     bigint,
    wal_status             text,
    unforwarded_events     bigint,
    oldest_unforwarded_age interval,
    progress_age           interval,
    estimated_events       bigint
)
LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.slot_name, s.active, p.caught_up_at IS NOT NULL, s.confirmed_flush_lsn,
           pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
           pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint,
           s.wal_status,
           u.n, now() - u.oldest,
           now() - p.updated_at,
           (SELECT greatest(c.reltuples, 0)::bigint FROM pg_class c WHERE c.oid = 'outbox.events'::regclass)
      FROM pg_replication_slots s
      LEFT JOIN outbox.relay_progress p ON p.slot_name = s.slot_name
      LEFT JOIN LATERAL (
          -- Events not in the slot's safe snapshot: committed later, or not
          -- yet known to be confirmed (an upper bound, about a second behind).
          SELECT count(*) AS n, min(e.occurred_at) AS oldest
            FROM outbox.events e
           WHERE p.safe_snapshot IS NOT NULL
             AND e.txid >= pg_snapshot_xmin(p.safe_snapshot)
             AND NOT pg_visible_in_snapshot(e.txid, p.safe_snapshot)
      ) u ON true
     WHERE s.database = current_database() AND s.plugin = 'pgoutput';
$$;
COMMENT ON FUNCTION outbox.status() IS
    'Per forwarder slot: active, caught up, lag and retained WAL in bytes, events not yet forwarded and the age of the oldest.';

------------------------------------------------------------------------------
-- Inbox

CREATE FUNCTION outbox.register_consumer(consumer text, owner regrole) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF consumer IS NULL OR consumer = '' OR length(consumer) > 255 THEN
        RAISE EXCEPTION 'consumer name must be 1 to 255 characters'
            USING ERRCODE = 'PO002', HINT = 'Name the consumer after its service, for example ''billing''.';
    END IF;
    IF owner IS NULL THEN
        RAISE EXCEPTION 'owner must not be NULL'
            USING ERRCODE = 'PO001', HINT = 'Pass the role whose members run this consumer.';
    END IF;
    INSERT INTO outbox.inbox_consumers (consumer, owner)
    VALUES (register_consumer.consumer, register_consumer.owner::name)
    ON CONFLICT ON CONSTRAINT inbox_consumers_pkey DO UPDATE SET owner = EXCLUDED.owner;
END
$$;
COMMENT ON FUNCTION outbox.register_consumer(text, regrole) IS
    'Registers an inbox consumer; only members of owner may record events under its name.';

CREATE FUNCTION outbox.inbox_receive(
    consumer       text,
    event_id       uuid,
    aggregate_type text   DEFAULT NULL,
    aggregate_id   text   DEFAULT NULL,
    aggregate_seq  bigint DEFAULT NULL,
    OUT status       text,
    OUT expected_seq bigint
)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    owner_role name;
    previous bigint;
BEGIN
    IF inbox_receive.consumer IS NULL OR inbox_receive.event_id IS NULL THEN
        RAISE EXCEPTION 'consumer and event_id must not be NULL'
            USING ERRCODE = 'PO001', HINT = 'Pass the consumer''s registered name and the event_id header of the record.';
    END IF;
    SELECT c.owner INTO owner_role FROM outbox.inbox_consumers c WHERE c.consumer = inbox_receive.consumer;
    IF NOT FOUND OR NOT pg_has_role(session_user, owner_role, 'MEMBER') THEN
        RAISE EXCEPTION 'consumer % is not registered for role %', quote_literal(inbox_receive.consumer), session_user
            USING ERRCODE = 'PO011', HINT = 'An administrator runs outbox.register_consumer(consumer, owner_role) for a role this login belongs to.';
    END IF;
    IF inbox_receive.aggregate_seq IS NOT NULL
       AND (inbox_receive.aggregate_type IS NULL OR inbox_receive.aggregate_id IS NULL) THEN
        RAISE EXCEPTION 'aggregate_seq needs aggregate_type and aggregate_id'
            USING ERRCODE = 'PO001', HINT = 'Pass the aggregate_type header and the record key with the sequence.';
    END IF;

    INSERT INTO outbox.inbox (consumer, event_id, aggregate_type, aggregate_id, aggregate_seq)
    VALUES (inbox_receive.consumer, inbox_receive.event_id, inbox_receive.aggregate_type,
            inbox_receive.aggregate_id, inbox_receive.aggregate_seq)
    ON CONFLICT ON CONSTRAINT inbox_pkey DO NOTHING;
    IF NOT FOUND THEN
        inbox_receive.status := 'duplicate';
        RETURN;
    END IF;
    IF inbox_receive.aggregate_seq IS NULL THEN
        inbox_receive.status := 'new';
        RETURN;
    END IF;

    SELECT p.last_seq INTO previous FROM outbox.inbox_positions p
     WHERE p.consumer = inbox_receive.consumer AND p.aggregate_type = inbox_receive.aggregate_type
       AND p.aggregate_id = inbox_receive.aggregate_id
       FOR UPDATE;
    previous := coalesce(previous, 0);
    IF inbox_receive.aggregate_seq <= previous THEN
        inbox_receive.status := 'duplicate';
        RETURN;
    END IF;
    INSERT INTO outbox.inbox_positions AS p (consumer, aggregate_type, aggregate_id, last_seq)
    VALUES (inbox_receive.consumer, inbox_receive.aggregate_type, inbox_receive.aggregate_id, inbox_receive.aggregate_seq)
    ON CONFLICT ON CONSTRAINT inbox_positions_pkey DO UPDATE SET last_seq = EXCLUDED.last_seq;
    IF inbox_receive.aggregate_seq = previous + 1 THEN
        inbox_receive.status := 'new';
    ELSE
        inbox_receive.status := 'gap';
        inbox_receive.expected_seq := previous + 1;
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.inbox_receive(text, uuid, text, text, bigint) IS
    'Call in the consumer''s transaction: new, duplicate, or gap (with the first missing sequence in expected_seq).';

------------------------------------------------------------------------------
-- Polling relays (`outbox-forwarder run --source poll`), for databases that
-- cannot give a relay a replication slot. Off until outbox.enable_polling():
-- then a trigger marks every event pending in the transaction that emits it
-- (a database that only uses a slot has no trigger and pays nothing). Relays
-- lease aggregates, publish their pending events in sequence order, and
-- remove them from outbox.pending once Kafka acknowledged them; a relay that
-- stops renewing loses its leases when they expire, and another relay takes
-- its aggregates over from their first pending event.

CREATE TABLE outbox.pending (
    aggregate_type text   COLLATE "C" NOT NULL,
    aggregate_id   text   COLLATE "C" NOT NULL,
    aggregate_seq  bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id, aggregate_seq)
);
COMMENT ON TABLE outbox.pending IS 'Events polling relays have not yet published (only while polling is enabled).';

CREATE TABLE outbox.poll_leases (
    aggregate_type text        COLLATE "C" NOT NULL,
    aggregate_id   text        COLLATE "C" NOT NULL,
    relay          text        NOT NULL,
    expires_at     timestamptz NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE outbox.poll_leases IS 'Which polling relay publishes each aggregate, until when.';

REVOKE ALL ON outbox.pending, outbox.poll_leases FROM PUBLIC;
-- A slot forwarder's first start, where relays polled before it, delivers
-- only what is still pending.
CALL outbox.grant_to('relay', 'SELECT ON outbox.pending');

-- Runs inside emit_event's INSERT, as emit_event's owner; names are
-- qualified, so it needs no SET clause (a cost on every emit).
CREATE FUNCTION outbox.mark_pending() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO outbox.pending (aggregate_type, aggregate_id, aggregate_seq)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_seq);
    RETURN NULL;
END
$$;

CREATE FUNCTION outbox.enable_polling() RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_trigger t
                WHERE t.tgrelid = 'outbox.events'::regclass AND t.tgname = 'events_pending') THEN
        RETURN false;
    END IF;
    CREATE TRIGGER events_pending AFTER INSERT ON outbox.events
        FOR EACH ROW EXECUTE FUNCTION outbox.mark_pending();
    RETURN true;
END
$$;
COMMENT ON FUNCTION outbox.enable_polling() IS
    'Events emitted from now on are pending for polling relays (outbox-forwarder run --source poll); true when it was off.';

CREATE FUNCTION outbox.disable_polling() RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    dropped bigint;
BEGIN
    DROP TRIGGER IF EXISTS events_pending ON outbox.events;
    DELETE FROM outbox.poll_leases;
    DELETE FROM outbox.pending;
    GET DIAGNOSTICS dropped = ROW_COUNT;
    RETURN dropped;
END
$$;
COMMENT ON FUNCTION outbox.disable_polling() IS
    'Stops marking events pending and forgets what was pending; returns how many events no relay had published.';

CREATE FUNCTION outbox.check_relay_name(relay text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF relay IS NULL OR relay = '' OR length(relay) > 255 THEN
        RAISE EXCEPTION 'relay name must be 1 to 255 characters'
            USING ERRCODE = 'PO002', HINT = 'outbox-forwarder names itself after its host and process; pass --relay-name to choose.';
    END IF;
END
$$;

-- Renews the relay's leases, gives back those with nothing pending, and
-- leases more aggregates with pending events (free ones, or ones whose lease
-- expired): at most max_new in one call, so that relays asking at the same
-- time share them, and max_aggregates in all. It walks the pending
-- aggregates in key order from after (resume_type, resume_id) and round
-- again from the start. Returns every aggregate the relay holds; taken_over
-- is true for an expired lease of another relay that it took.
CREATE FUNCTION outbox.poll_lease(
    relay text, lease interval, max_aggregates integer, max_new integer,
    resume_type text DEFAULT NULL, resume_id text DEFAULT NULL
)
RETURNS TABLE (aggregate_type text, aggregate_id text, taken_over boolean)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    held integer;
    claimed integer;
    wanted integer;
    from_type text := coalesce(resume_type, '');
    from_id text := coalesce(resume_id, '');
    pass integer;
BEGIN
    PERFORM outbox.check_relay_name(relay);
    IF lease IS NULL OR lease <= interval '0' OR max_aggregates IS NULL OR max_aggregates < 1
       OR max_new IS NULL OR max_new < 1 THEN
        RAISE EXCEPTION 'lease must be a positive interval, max_aggregates and max_new at least 1'
            USING ERRCODE = 'PO007', HINT = 'For example outbox.poll_lease(''relay-1'', ''5 seconds'', 1000, 100).';
    END IF;
    DELETE FROM outbox.poll_leases l
     WHERE l.relay = poll_lease.relay
       AND NOT EXISTS (SELECT 1 FROM outbox.pending p
                        WHERE p.aggregate_type = l.aggregate_type AND p.aggregate_id = l.aggregate_id);
    -- Renewed once a third of their time is gone: a relay that calls at
    -- least that often always holds two thirds of a lease.
    UPDATE outbox.poll_leases l SET expires_at = clock_timestamp() + lease
     WHERE l.relay = poll_lease.relay AND l.expires_at < clock_timestamp() + lease * 2 / 3;
    RETURN QUERY
    SELECT l.aggregate_type::text, l.aggregate_id::text, false
      FROM outbox.poll_leases l WHERE l.relay = poll_lease.relay;
    GET DIAGNOSTICS held = ROW_COUNT;
    wanted := least(max_aggregates - held, max_new);
    FOR pass IN 1..2 LOOP
        EXIT WHEN wanted <= 0;
        RETURN QUERY
        WITH RECURSIVE walk AS (
            (SELECT p.aggregate_type, p.aggregate_id FROM outbox.pending p
              WHERE (p.aggregate_type, p.aggregate_id) > (from_type, from_id)
              ORDER BY p.aggregate_type, p.aggregate_id LIMIT 1)
            UNION ALL
            SELECT n.aggregate_type, n.aggregate_id
              FROM walk w
             CROSS JOIN LATERAL (
                SELECT p.aggregate_type, p.aggregate_id FROM outbox.pending p
                 WHERE (p.aggregate_type, p.aggregate_id) > (w.aggregate_type, w.aggregate_id)
                 ORDER BY p.aggregate_type, p.aggregate_id LIMIT 1) n
        ), free AS (
            SELECT w.aggregate_type, w.aggregate_id FROM walk w
             WHERE NOT EXISTS (SELECT 1 FROM outbox.poll_leases l
                                WHERE l.aggregate_type = w.aggregate_type AND l.aggregate_id = w.aggregate_id
                                  AND l.expires_at > clock_timestamp())
             LIMIT wanted
        )
        INSERT INTO outbox.poll_leases AS l (aggregate_type, aggregate_id, relay, expires_at)
        SELECT f.aggregate_type, f.aggregate_id, poll_lease.relay, clock_timestamp() + lease FROM free f
        ON CONFLICT ON CONSTRAINT poll_leases_pkey DO UPDATE
           SET relay = EXCLUDED.relay, expires_at = EXCLUDED.expires_at
         WHERE l.expires_at <= clock_timestamp()
        RETURNING l.aggregate_type::text, l.aggregate_id::text, l.xmax <> '0'::xid;
        GET DIAGNOSTICS claimed = ROW_COUNT;
        wanted := wanted - claimed;
        EXIT WHEN from_type = '';
        from_type := '';
        from_id := '';
    END LOOP;
END
$$;
COMMENT ON FUNCTION outbox.poll_lease(text, interval, integer, integer, text, text) IS
    'Called by polling relays: renews their leases, gives back aggregates with nothing pending, leases more.';

-- The next pending events of the relay's aggregates, in sequence order per
-- aggregate, taking turns between aggregates (each gives at most twice its
-- share of max_events). in_hand maps 'aggregate_type/aggregate_id' (a type
-- has no '/') to the last sequence the relay already has in hand.
CREATE FUNCTION outbox.poll_fetch(relay text, max_events integer, in_hand jsonb DEFAULT '{}')
RETURNS SETOF outbox.events
LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH picked AS MATERIALIZED (
        SELECT l.aggregate_type, l.aggregate_id, p.aggregate_seq, p.turn
          FROM outbox.poll_leases l
         CROSS JOIN LATERAL (
            SELECT q.aggregate_seq, row_number() OVER (ORDER BY q.aggregate_seq) AS turn
              FROM outbox.pending q
             WHERE q.aggregate_type = l.aggregate_type AND q.aggregate_id = l.aggregate_id
               AND q.aggregate_seq > coalesce((in_hand ->> (l.aggregate_type || '/' || l.aggregate_id))::bigint, 0)
             ORDER BY q.aggregate_seq
             LIMIT greatest(1, 2 * max_events / greatest(1, (SELECT count(*) FROM outbox.poll_leases h
                                                              WHERE h.relay = poll_fetch.relay)))) p
         WHERE l.relay = poll_fetch.relay
         ORDER BY p.turn, l.aggregate_type, l.aggregate_id
         LIMIT max_events
    )
    -- One probe of the events' key per picked event, whatever the
    -- statistics say.
    SELECT e.*
      FROM picked k
     CROSS JOIN LATERAL (
        SELECT * FROM outbox.events v
         WHERE v.aggregate_type = k.aggregate_type AND v.aggregate_id = k.aggregate_id
           AND v.aggregate_seq = k.aggregate_seq) e
     ORDER BY k.turn, k.aggregate_type, k.aggregate_id;
$$;
COMMENT ON FUNCTION outbox.poll_fetch(text, integer, jsonb) IS
    'Called by polling relays: the next pending events of the aggregates they lease.';

CREATE FUNCTION outbox.poll_done(aggregate_types text[], aggregate_ids text[], up_to_seqs bigint[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    deleted bigint;
BEGIN
    DELETE FROM outbox.pending p
     USING unnest(aggregate_types, aggregate_ids, up_to_seqs) AS d(aggregate_type, aggregate_id, up_to)
     WHERE p.aggregate_type = d.aggregate_type AND p.aggregate_id = d.aggregate_id
       AND p.aggregate_seq <= d.up_to;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;
COMMENT ON FUNCTION outbox.poll_done(text[], text[], bigint[]) IS
    'Called by polling relays once Kafka acknowledged: each aggregate''s events up to the sequence are no longer pending.';

CREATE FUNCTION outbox.poll_release(relay text) RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    released bigint;
BEGIN
    DELETE FROM outbox.poll_leases l WHERE l.relay = poll_release.relay;
    GET DIAGNOSTICS released = ROW_COUNT;
    RETURN released;
END
$$;
COMMENT ON FUNCTION outbox.poll_release(text) IS
    'Called by a polling relay that stops: its aggregates are free at once instead of when the leases expire.';

CREATE FUNCTION outbox.poll_status(
    OUT enabled boolean, OUT pending_events bigint, OUT oldest_pending_age interval,
    OUT leases_held bigint, OUT leases_expired bigint, OUT relays bigint
)
LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = 'outbox.events'::regclass AND t.tgname = 'events_pending'),
           p.n, now() - p.oldest, l.held, l.expired, l.relays
      FROM (SELECT count(*) AS n, min(e.occurred_at) AS oldest
              FROM outbox.pending q
              JOIN outbox.events e ON e.aggregate_type = q.aggregate_type AND e.aggregate_id = q.aggregate_id
                                  AND e.aggregate_seq = q.aggregate_seq) p,
           (SELECT count(*) FILTER (WHERE expires_at > clock_timestamp()) AS held,
                   count(*) FILTER (WHERE expires_at <= clock_timestamp()) AS expired,
                   count(DISTINCT relay) FILTER (WHERE expires_at > clock_timestamp()) AS relays
              FROM outbox.poll_leases) l;
$$;
COMMENT ON FUNCTION outbox.poll_status() IS
    'Polling: whether it is on, pending events and the age of the oldest, live and expired leases, relays holding leases.';

REVOKE ALL ON FUNCTION outbox.mark_pending() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.enable_polling() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.disable_polling() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.check_relay_name(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.poll_lease(text, interval, integer, integer, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.poll_fetch(text, integer, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.poll_done(text[], text[], bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.poll_release(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.poll_status() FROM PUBLIC;
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.poll_lease(text, interval, integer, integer, text, text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.poll_fetch(text, integer, jsonb)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.poll_done(text[], text[], bigint[])');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.poll_release(text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.poll_status()');

------------------------------------------------------------------------------
-- Event contracts: a JSON Schema per (aggregate type, event type, schema
-- version), registered by the owner or a member of the schema_admin role and
-- immutable once registered (a change is a new version). emit_event and
-- emit_events check each payload against the schema of its event type and
-- version. What a mismatch does is set per aggregate type in
-- outbox.schema_checks: 'enforce' (the default: refused with PO020; a
-- version without a schema, where the event type has others, with PO021),
-- 'warn' (a WARNING, and the event is stored) or 'off'. An event type
-- without any schema is not checked.

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
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.register_schema(text, text, integer, jsonb)');
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.set_schema_check(text, text)');
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.schema_problem(jsonb)');
CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.check_payload(text, text, integer, jsonb)');
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.check_payload(text, text, integer, jsonb)');
CALL outbox.grant_to('schema_admin', 'SELECT ON outbox.schemas');
CALL outbox.grant_to('writer', 'SELECT ON outbox.schemas');
CALL outbox.grant_to('relay', 'SELECT ON outbox.schemas');

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
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.park_event(text, text, bigint, uuid, text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.parked(text, text, boolean)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.unpark(text, text, bigint)');

------------------------------------------------------------------------------
-- Retention keeps each aggregate's newest event, whose number the next emit
-- continues from.

CREATE FUNCTION outbox.prune(older_than interval DEFAULT '7 days', max_rows integer DEFAULT 10000)
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

------------------------------------------------------------------------------
-- Privileges: applications reach the tables only through these functions.

REVOKE ALL ON FUNCTION outbox.check_event(text, text, text, jsonb, jsonb, integer, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.check_emit(text, text, text, jsonb, jsonb, integer, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.lock_aggregate(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.emit_events(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.current_seq(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.ensure_publication(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.drop_publication(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_relay(name) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.status() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.register_consumer(text, regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_receive(text, uuid, text, text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.prune(interval, integer) FROM PUBLIC;

CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text)');
CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.emit_events(jsonb)');
CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.current_seq(text, text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.ensure_publication(text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.drop_publication(text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.forget_relay(name)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.status()');
CALL outbox.grant_to('consumer', 'EXECUTE ON FUNCTION outbox.inbox_receive(text, uuid, text, text, bigint)');
