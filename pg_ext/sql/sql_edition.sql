-- pg_outbox SQL edition: the functions that the extension writes in C
-- (Rust), written in PL/pgSQL and SQL for a server that cannot load our
-- library. scripts/sql-edition puts each block below in the place of the
-- `--@c-function NAME` block of the same name in schema/*.sql; the
-- signature, defaults, volatility, strictness, parallel safety, SECURITY
-- DEFINER, comment and privileges are the extension's, and a test compares
-- the two catalogs.
--
-- What differs, and why:
-- - emit_event reads the aggregate's newest sequence with an SQL statement,
--   whose snapshot under REPEATABLE READ or SERIALIZABLE is the
--   transaction's. Where the C function reads past that snapshot and
--   numbers after events committed since, this one answers with a
--   serialization failure (40001): retry the transaction.
-- - emit_event pins search_path with a SET clause (PL/pgSQL resolves names
--   as it runs); the C function pins it in its own code.
-- - uuid_v7 takes its 74 random bits from gen_random_uuid() and has no
--   sub-millisecond fraction: ids of one backend within one millisecond are
--   unordered.
-- - check_payload checks a subset of JSON Schema (listed at the function),
--   and schema_problem refuses to register a schema that uses any keyword
--   outside it, so that no schema is ever taken and left unchecked. The
--   extension checks the whole of JSON Schema (drafts 4 to 2020-12).
-- - schemas_changed does nothing: check_payload reads the tables on each
--   call, where the extension keeps compiled schemas per backend.

--@function uuid_v7
CREATE FUNCTION outbox.uuid_v7() RETURNS uuid
LANGUAGE sql STRICT VOLATILE PARALLEL SAFE
AS $$
    -- 48 bits of Unix milliseconds, then the last 10 bytes of a version 4
    -- UUID (its variant bits kept) with the version nibble turned from 4 to 7.
    SELECT pg_catalog.encode(
               pg_catalog.set_bit(pg_catalog.set_bit(
                   pg_catalog.substr(pg_catalog.int8send(pg_catalog.floor(
                       pg_catalog.date_part('epoch', pg_catalog.clock_timestamp()) * 1000)::bigint), 3)
                   || pg_catalog.substr(pg_catalog.uuid_send(pg_catalog.gen_random_uuid()), 7),
               52, 1), 53, 1),
           'hex')::uuid
$$;
--@end

--@function lock_aggregate
CREATE FUNCTION outbox.lock_aggregate(aggregate_type text, aggregate_id text) RETURNS bigint
LANGUAGE plpgsql STRICT VOLATILE PARALLEL UNSAFE
AS $$
BEGIN
    -- The same lock the C function takes. In READ COMMITTED the statement
    -- after it sees every event committed before the lock was granted.
    PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext(aggregate_type), pg_catalog.hashtext(aggregate_id));
    RETURN coalesce(
        (SELECT e.aggregate_seq FROM outbox.events e
          WHERE e.aggregate_type = lock_aggregate.aggregate_type AND e.aggregate_id = lock_aggregate.aggregate_id
          ORDER BY e.aggregate_seq DESC LIMIT 1),
        (SELECT f.last_seq FROM outbox.sequence_floors f
          WHERE f.aggregate_type = lock_aggregate.aggregate_type AND f.aggregate_id = lock_aggregate.aggregate_id),
        0);
END
$$;
--@end

--@function emit_event
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    latest bigint;
    refusal record;
BEGIN
    emit_event.replayed := false;
    IF (emit_event.idempotency_key IS NULL AND current_setting('transaction_isolation') = 'read committed'
        AND emit_event.aggregate_type ~ '^[A-Za-z0-9._-]{1,128}$'
        AND octet_length(emit_event.aggregate_id) BETWEEN 1 AND 512
        AND length(emit_event.event_type) BETWEEN 1 AND 255
        AND pg_column_size(emit_event.payload)
            <= coalesce(nullif(current_setting('pg_outbox.max_payload_bytes', true), '')::bigint, 1000000)
        AND emit_event.headers IS NULL AND emit_event.topic IS NULL
        AND emit_event.schema_version >= 1 AND coalesce(emit_event.expected_seq, 0) >= 0) IS TRUE THEN
        -- The common call, plainly valid, in two statements: each SQL
        -- statement starts an executor, which costs more than the rest of
        -- the function. The lock first: the INSERT starts once it is
        -- granted, so its snapshot holds every event of the aggregate
        -- committed before, and it reads the newest sequence itself. The
        -- INSERT checks the payload too, where its event type has a schema:
        -- a probe of outbox.event_schemas costs the statement less than a
        -- statement of its own would.
        PERFORM pg_advisory_xact_lock(hashtext(emit_event.aggregate_type), hashtext(emit_event.aggregate_id));
        INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                   schema_version, payload, headers, topic, aggregate_hash)
        VALUES (outbox.uuid_v7(), emit_event.aggregate_type, emit_event.aggregate_id,
                coalesce((SELECT e.aggregate_seq FROM outbox.events e
                           WHERE e.aggregate_type = emit_event.aggregate_type AND e.aggregate_id = emit_event.aggregate_id
                           ORDER BY e.aggregate_seq DESC LIMIT 1),
                         (SELECT f.last_seq FROM outbox.sequence_floors f
                           WHERE f.aggregate_type = emit_event.aggregate_type AND f.aggregate_id = emit_event.aggregate_id),
                         0) + 1,
                emit_event.event_type, emit_event.schema_version,
                CASE WHEN EXISTS (SELECT 1 FROM outbox.event_schemas s
                                   WHERE s.aggregate_type = emit_event.aggregate_type AND s.event_type = emit_event.event_type)
                     THEN (SELECT emit_event.payload
                             FROM outbox.check_payload(emit_event.aggregate_type, emit_event.event_type,
                                                       emit_event.schema_version, emit_event.payload))
                     ELSE emit_event.payload END,
                emit_event.headers, emit_event.topic,
                outbox.aggregate_hash(emit_event.aggregate_type, emit_event.aggregate_id))
        RETURNING events.event_id, events.aggregate_seq INTO emit_event.event_id, emit_event.aggregate_seq;
        IF emit_event.expected_seq IS NULL THEN
            RETURN;
        END IF;
        latest := emit_event.aggregate_seq - 1;
    END IF;

    IF latest IS NULL THEN
        SELECT * INTO refusal
          FROM outbox.check_emit(emit_event.aggregate_type, emit_event.aggregate_id, emit_event.event_type,
                                 emit_event.payload, emit_event.headers, emit_event.schema_version,
                                 emit_event.expected_seq, emit_event.idempotency_key, emit_event.topic);
        IF refusal.refused_sqlstate IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = refusal.refused_sqlstate, MESSAGE = refusal.refused_message,
                                  HINT = refusal.refused_hint;
        END IF;
        PERFORM outbox.check_payload(emit_event.aggregate_type, emit_event.event_type,
                                     emit_event.schema_version, emit_event.payload);

        -- Valid, with an idempotency key, a snapshot older than the
        -- statement (REPEATABLE READ, SERIALIZABLE), headers or a topic:
        -- anything the common call above does not take.
        latest := outbox.lock_aggregate(emit_event.aggregate_type, emit_event.aggregate_id);
        emit_event.event_id := outbox.uuid_v7();
        emit_event.aggregate_seq := latest + 1;
        IF emit_event.idempotency_key IS NOT NULL THEN
            -- Claimed under the number this event would get; a claim that
            -- exists already answers the call with its event. A concurrent
            -- call with the same key waits here for the first one's
            -- transaction.
            INSERT INTO outbox.idempotency_keys (aggregate_type, idempotency_key, event_id, aggregate_id, aggregate_seq)
            VALUES (emit_event.aggregate_type, emit_event.idempotency_key, emit_event.event_id,
                    emit_event.aggregate_id, emit_event.aggregate_seq)
            ON CONFLICT (aggregate_type, idempotency_key) DO NOTHING;
            IF NOT FOUND THEN
                SELECT k.event_id, k.aggregate_seq INTO emit_event.event_id, emit_event.aggregate_seq
                  FROM outbox.idempotency_keys k
                 WHERE k.aggregate_type = emit_event.aggregate_type AND k.idempotency_key = emit_event.idempotency_key;
                emit_event.replayed := true;
                RETURN;
            END IF;
        END IF;
        BEGIN
            INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                       schema_version, payload, headers, topic, aggregate_hash)
            VALUES (emit_event.event_id, emit_event.aggregate_type, emit_event.aggregate_id, emit_event.aggregate_seq,
                    emit_event.event_type, emit_event.schema_version, emit_event.payload, emit_event.headers,
                    emit_event.topic, outbox.aggregate_hash(emit_event.aggregate_type, emit_event.aggregate_id));
        EXCEPTION WHEN unique_violation THEN
            -- Under REPEATABLE READ or SERIALIZABLE the snapshot may predate
            -- an event of this aggregate that committed since: its number is
            -- taken, and the transaction must retry. (Under READ COMMITTED
            -- the lock rules this out.)
            RAISE EXCEPTION 'could not serialize access: aggregate % % has events committed after this transaction''s snapshot',
                    emit_event.aggregate_type, quote_literal(emit_event.aggregate_id)
                USING ERRCODE = 'serialization_failure',
                      HINT = 'Retry the transaction, or emit in READ COMMITTED (the C extension numbers after them).';
        END;
    END IF;

    -- Checked after the insert, which the error takes back with it.
    IF emit_event.expected_seq IS NOT NULL AND emit_event.expected_seq <> latest THEN
        RAISE EXCEPTION 'sequence conflict on % %: expected %, actual %',
                emit_event.aggregate_type, quote_literal(emit_event.aggregate_id), emit_event.expected_seq, latest
            USING ERRCODE = 'PO101',
                  DETAIL = format('expected_seq=%s actual_seq=%s', emit_event.expected_seq, latest),
                  HINT = 'Another writer changed the aggregate: reload it, decide again, and retry with the new sequence.';
    END IF;
END
$$;
--@end

--@function schemas_changed
CREATE FUNCTION outbox.schemas_changed() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    -- Nothing is kept between calls here: check_payload reads the tables.
    RETURN NULL;
END
$$;
--@end

--@function schema_problem
CREATE FUNCTION outbox.schema_problem(schema jsonb) RETURNS text
LANGUAGE plpgsql STRICT IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
-- The SQL edition checks a subset of JSON Schema (see check_payload) and
-- refuses a schema that uses anything else, rather than let it pass
-- unchecked.
DECLARE
    stack jsonb[] := ARRAY[schema];
    paths text[] := ARRAY[''];
    s jsonb;
    p text;
    k text;
    v jsonb;
BEGIN
    WHILE cardinality(stack) > 0 LOOP
        s := stack[cardinality(stack)];
        p := paths[cardinality(paths)];
        stack := stack[1:cardinality(stack) - 1];
        paths := paths[1:cardinality(paths) - 1];
        CONTINUE WHEN jsonb_typeof(s) = 'boolean';
        IF jsonb_typeof(s) <> 'object' THEN
            RETURN format('at %s: a schema is an object or a boolean, not %s', coalesce(nullif(p, ''), '/'), jsonb_typeof(s));
        END IF;
        FOR k, v IN SELECT e.key, e.value FROM jsonb_each(s) e LOOP
            CASE
            WHEN k IN ('$schema', '$id', '$comment', 'title', 'description', 'default', 'examples',
                       'format', 'deprecated', 'readOnly', 'writeOnly') THEN
                NULL;
            WHEN k = 'type' THEN
                IF EXISTS (SELECT 1 FROM jsonb_array_elements(CASE jsonb_typeof(v) WHEN 'array' THEN v ELSE jsonb_build_array(v) END) t
                            WHERE t NOT IN ('"object"', '"array"', '"string"', '"number"', '"integer"', '"boolean"', '"null"')) THEN
                    RETURN format('at %s/type: %s is not a JSON Schema type', p, v);
                END IF;
            WHEN k IN ('minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf',
                       'minLength', 'maxLength', 'minItems', 'maxItems', 'minProperties', 'maxProperties') THEN
                IF jsonb_typeof(v) <> 'number' THEN
                    RETURN format('at %s/%s: %s is not a number', p, k, v);
                END IF;
            WHEN k = 'required' THEN
                IF jsonb_typeof(v) <> 'array' OR EXISTS (SELECT 1 FROM jsonb_array_elements(v) r WHERE jsonb_typeof(r) <> 'string') THEN
                    RETURN format('at %s/required: %s is not an array of strings', p, v);
                END IF;
            WHEN k IN ('enum') THEN
                IF jsonb_typeof(v) <> 'array' THEN
                    RETURN format('at %s/enum: %s is not an array', p, v);
                END IF;
            WHEN k IN ('const', 'uniqueItems') THEN
                NULL;
            WHEN k = 'pattern' THEN
                BEGIN
                    PERFORM '' ~ (v #>> '{}');
                EXCEPTION WHEN invalid_regular_expression THEN
                    RETURN format('at %s/pattern: %s is not a regular expression', p, v);
                END;
            WHEN k = 'properties' THEN
                IF jsonb_typeof(v) <> 'object' THEN
                    RETURN format('at %s/properties: %s is not an object', p, v);
                END IF;
                stack := stack || ARRAY(SELECT e.value FROM jsonb_each(v) e ORDER BY e.key);
                paths := paths || ARRAY(SELECT p || '/properties/' || replace(replace(e.key, '~', '~0'), '/', '~1')
                                          FROM jsonb_each(v) e ORDER BY e.key);
            WHEN k IN ('items', 'additionalProperties') THEN
                stack := stack || v;
                paths := paths || (p || '/' || k);
            ELSE
                RETURN format('at %s: the SQL edition does not check the keyword %s; the extension does', coalesce(nullif(p, ''), '/'), k);
            END CASE;
        END LOOP;
    END LOOP;
    RETURN NULL;
END
$$;
--@end

--@function check_payload
CREATE FUNCTION outbox.check_payload(aggregate_type text, event_type text, schema_version integer, payload jsonb)
RETURNS void
LANGUAGE plpgsql STRICT STABLE PARALLEL RESTRICTED SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
-- A subset of JSON Schema, walked depth first: type, enum, const, the
-- numeric bounds and multipleOf, minLength, maxLength, pattern (PostgreSQL's
-- regular expressions), items, minItems, maxItems, uniqueItems, properties,
-- required, additionalProperties, minProperties, maxProperties; annotations
-- are ignored. register_schema refuses any other keyword (schema_problem).
#variable_conflict use_variable
DECLARE
    mode text;
    root jsonb;
    known text;
    stack jsonb[];
    vals jsonb[];
    ptrs text[];
    spaths text[];
    n integer;
    s jsonb;
    v jsonb;
    p text;
    sp text;
    t text;
    rule text;
    words text;
    k text;
    extra text;
    ok boolean;
    more_s jsonb[];
    more_v jsonb[];
    more_p text[];
    more_sp text[];
BEGIN
    -- One statement for the common call, whose event type has no schema.
    SELECT coalesce((SELECT c.mode FROM outbox.schema_checks c WHERE c.aggregate_type = check_payload.aggregate_type), 'enforce'),
           (array_agg(e.schema) FILTER (WHERE e.schema_version = check_payload.schema_version))[1],
           string_agg(e.schema_version::text, ', ' ORDER BY e.schema_version)
      INTO mode, root, known
      FROM outbox.event_schemas e
     WHERE e.aggregate_type = check_payload.aggregate_type AND e.event_type = check_payload.event_type;
    IF mode = 'off' OR known IS NULL THEN
        RETURN;
    END IF;
    IF root IS NULL THEN
        IF mode = 'enforce' THEN
            RAISE EXCEPTION 'no schema is registered for % event % version % (registered versions: %)',
                            aggregate_type, event_type, schema_version, known
                USING ERRCODE = 'PO021', HINT = 'Register the version with outbox.register_schema, or emit with a registered schema_version.';
        END IF;
        RAISE WARNING 'no schema is registered for % event % version % (registered versions: %)',
                      aggregate_type, event_type, schema_version, known
            USING ERRCODE = 'PO021', HINT = 'Register the version with outbox.register_schema, or emit with a registered schema_version.';
        RETURN;
    END IF;

    stack := ARRAY[root]; vals := ARRAY[payload]; ptrs := ARRAY['']; spaths := ARRAY[''];
    <<walk>>
    WHILE cardinality(stack) > 0 LOOP
        n := cardinality(stack);
        s := stack[n]; v := vals[n]; p := ptrs[n]; sp := spaths[n];
        stack := stack[1:n - 1]; vals := vals[1:n - 1]; ptrs := ptrs[1:n - 1]; spaths := spaths[1:n - 1];
        IF s = 'false'::jsonb THEN
            rule := 'false'; words := 'False schema does not allow ' || v::text;
            EXIT walk;
        END IF;
        CONTINUE walk WHEN jsonb_typeof(s) <> 'object';
        t := jsonb_typeof(v);
        -- Simple expressions where they do (no statement), a query where
        -- only one will.
        IF s ? 'type' THEN
            IF jsonb_typeof(s->'type') = 'string' THEN
                ok := s->>'type' = t
                      OR (s->>'type' = 'integer' AND CASE WHEN t = 'number' THEN (v #>> '{}')::numeric % 1 = 0 ELSE false END);
            ELSE
                ok := EXISTS (SELECT 1 FROM jsonb_array_elements_text(s->'type') want
                               WHERE want = t OR (want = 'integer' AND t = 'number' AND (v #>> '{}')::numeric % 1 = 0));
            END IF;
            IF NOT ok THEN
                rule := 'type'; sp := sp || '/type'; words := format('%s is not of type %s', v, s->'type');
                EXIT walk;
            END IF;
        END IF;
        IF s ? 'enum' THEN
            IF t IN ('object', 'array') THEN
                ok := EXISTS (SELECT 1 FROM jsonb_array_elements(s->'enum') x WHERE x = v);
            ELSE
                -- For a scalar, containment is membership.
                ok := s->'enum' @> jsonb_build_array(v);
            END IF;
            IF NOT ok THEN
                rule := 'enum'; sp := sp || '/enum'; words := format('%s is not one of %s', v, s->'enum');
                EXIT walk;
            END IF;
        END IF;
        IF s ? 'const' AND s->'const' <> v THEN
            rule := 'const'; sp := sp || '/const'; words := format('%s was expected', s->'const');
            EXIT walk;
        END IF;
        IF t = 'number' THEN
            FOR k IN SELECT x FROM unnest(ARRAY['minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf']) x LOOP
                CONTINUE WHEN NOT s ? k;
                IF (CASE k WHEN 'minimum' THEN (v #>> '{}')::numeric < (s->>k)::numeric
                          WHEN 'maximum' THEN (v #>> '{}')::numeric > (s->>k)::numeric
                          WHEN 'exclusiveMinimum' THEN (v #>> '{}')::numeric <= (s->>k)::numeric
                          WHEN 'exclusiveMaximum' THEN (v #>> '{}')::numeric >= (s->>k)::numeric
                          ELSE (v #>> '{}')::numeric % (s->>k)::numeric <> 0 END) THEN
                    rule := k; sp := sp || '/' || k; words := format('%s breaks %s %s', v, k, s->k);
                    EXIT walk;
                END IF;
            END LOOP;
        ELSIF t = 'string' THEN
            IF s ? 'minLength' AND length(v #>> '{}') < (s->>'minLength')::numeric THEN
                rule := 'minLength'; sp := sp || '/minLength'; words := format('%s is shorter than %s characters', v, s->'minLength');
                EXIT walk;
            END IF;
            IF s ? 'maxLength' AND length(v #>> '{}') > (s->>'maxLength')::numeric THEN
                rule := 'maxLength'; sp := sp || '/maxLength'; words := format('%s is longer than %s characters', v, s->'maxLength');
                EXIT walk;
            END IF;
            IF s ? 'pattern' AND (v #>> '{}') !~ (s->>'pattern') THEN
                rule := 'pattern'; sp := sp || '/pattern'; words := format('%s does not match %s', v, s->'pattern');
                EXIT walk;
            END IF;
        ELSIF t = 'array' THEN
            IF s ? 'minItems' AND jsonb_array_length(v) < (s->>'minItems')::numeric THEN
                rule := 'minItems'; sp := sp || '/minItems'; words := format('the array has fewer than %s items', s->'minItems');
                EXIT walk;
            END IF;
            IF s ? 'maxItems' AND jsonb_array_length(v) > (s->>'maxItems')::numeric THEN
                rule := 'maxItems'; sp := sp || '/maxItems'; words := format('the array has more than %s items', s->'maxItems');
                EXIT walk;
            END IF;
            IF s->'uniqueItems' = 'true'::jsonb
               AND (SELECT count(DISTINCT x) <> count(*) FROM jsonb_array_elements(v) x) THEN
                rule := 'uniqueItems'; sp := sp || '/uniqueItems'; words := format('%s has non-unique elements', v);
                EXIT walk;
            END IF;
            IF s ? 'items' THEN
                -- Pushed last first, so that the first item is checked first.
                SELECT array_agg(s->'items' ORDER BY x.i DESC), array_agg(x.e ORDER BY x.i DESC),
                       array_agg(p || '/' || (x.i - 1) ORDER BY x.i DESC), array_agg(sp || '/items' ORDER BY x.i DESC)
                  INTO more_s, more_v, more_p, more_sp
                  FROM jsonb_array_elements(v) WITH ORDINALITY x(e, i);
                stack := stack || more_s; vals := vals || more_v; ptrs := ptrs || more_p; spaths := spaths || more_sp;
            END IF;
        ELSIF t = 'object' THEN
            IF s ? 'required' THEN
                SELECT r INTO k FROM jsonb_array_elements_text(s->'required') r WHERE NOT v ? r LIMIT 1;
                IF FOUND THEN
                    rule := 'required'; sp := sp || '/required'; words := format('%s is a required property', to_jsonb(k));
                    EXIT walk;
                END IF;
            END IF;
            IF s ? 'minProperties' AND (SELECT count(*) FROM jsonb_object_keys(v)) < (s->>'minProperties')::numeric THEN
                rule := 'minProperties'; sp := sp || '/minProperties'; words := format('the object has fewer than %s properties', s->'minProperties');
                EXIT walk;
            END IF;
            IF s ? 'maxProperties' AND (SELECT count(*) FROM jsonb_object_keys(v)) > (s->>'maxProperties')::numeric THEN
                rule := 'maxProperties'; sp := sp || '/maxProperties'; words := format('the object has more than %s properties', s->'maxProperties');
                EXIT walk;
            END IF;
            IF s->'additionalProperties' = 'false'::jsonb THEN
                SELECT x INTO extra FROM jsonb_object_keys(v) x
                 WHERE NOT coalesce(s->'properties', '{}') ? x ORDER BY x LIMIT 1;
                IF FOUND THEN
                    rule := 'additionalProperties'; sp := sp || '/additionalProperties';
                    words := format('Additional properties are not allowed (%s was unexpected)', to_jsonb(extra));
                    EXIT walk;
                END IF;
            ELSIF jsonb_typeof(s->'additionalProperties') = 'object' THEN
                SELECT array_agg(s->'additionalProperties' ORDER BY e.key DESC), array_agg(e.value ORDER BY e.key DESC),
                       array_agg(p || '/' || replace(replace(e.key, '~', '~0'), '/', '~1') ORDER BY e.key DESC),
                       array_agg(sp || '/additionalProperties' ORDER BY e.key DESC)
                  INTO more_s, more_v, more_p, more_sp
                  FROM jsonb_each(v) e WHERE NOT coalesce(s->'properties', '{}') ? e.key;
                stack := stack || more_s; vals := vals || more_v; ptrs := ptrs || more_p; spaths := spaths || more_sp;
            END IF;
            IF jsonb_typeof(s->'properties') = 'object' THEN
                SELECT array_agg(d.value ORDER BY d.key DESC), array_agg(v->d.key ORDER BY d.key DESC),
                       array_agg(p || '/' || replace(replace(d.key, '~', '~0'), '/', '~1') ORDER BY d.key DESC),
                       array_agg(sp || '/properties/' || replace(replace(d.key, '~', '~0'), '/', '~1') ORDER BY d.key DESC)
                  INTO more_s, more_v, more_p, more_sp
                  FROM jsonb_each(s->'properties') d WHERE v ? d.key;
                stack := stack || more_s; vals := vals || more_v; ptrs := ptrs || more_p; spaths := spaths || more_sp;
            END IF;
        END IF;
    END LOOP;
    IF rule IS NULL THEN
        RETURN;
    END IF;
    IF mode = 'enforce' THEN
        RAISE EXCEPTION 'payload of % event % version % breaks its schema at % (rule %): %',
                        aggregate_type, event_type, schema_version,
                        CASE p WHEN '' THEN 'its root' ELSE '"' || p || '"' END, rule, words
            USING ERRCODE = 'PO020', DETAIL = format('pointer=%s rule=%s schema_path=%s', p, rule, sp),
                  HINT = 'Fix the payload, or register a new schema version and emit with schema_version => it (outbox.register_schema).';
    END IF;
    RAISE WARNING 'payload of % event % version % breaks its schema at % (rule %): %',
                  aggregate_type, event_type, schema_version,
                        CASE p WHEN '' THEN 'its root' ELSE '"' || p || '"' END, rule, words
        USING ERRCODE = 'PO020', DETAIL = format('pointer=%s rule=%s schema_path=%s', p, rule, sp),
              HINT = 'Fix the payload, or register a new schema version and emit with schema_version => it (outbox.register_schema).';
END
$$;
--@end
