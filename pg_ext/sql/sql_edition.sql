-- pg_outbox SQL edition: the functions that the extension writes in C
-- (Rust), written in PL/pgSQL and SQL for a server that cannot load our
-- library. scripts/sql-edition puts each block below in the place of the
-- `--@c-function NAME` block of the same name in pg_outbox.sql; the
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
        -- committed before, and it reads the newest sequence itself.
        PERFORM pg_advisory_xact_lock(hashtext(emit_event.aggregate_type), hashtext(emit_event.aggregate_id));
        INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                   schema_version, payload, headers, topic)
        VALUES (outbox.uuid_v7(), emit_event.aggregate_type, emit_event.aggregate_id,
                coalesce((SELECT e.aggregate_seq FROM outbox.events e
                           WHERE e.aggregate_type = emit_event.aggregate_type AND e.aggregate_id = emit_event.aggregate_id
                           ORDER BY e.aggregate_seq DESC LIMIT 1),
                         (SELECT f.last_seq FROM outbox.sequence_floors f
                           WHERE f.aggregate_type = emit_event.aggregate_type AND f.aggregate_id = emit_event.aggregate_id),
                         0) + 1,
                emit_event.event_type, emit_event.schema_version, emit_event.payload, emit_event.headers, emit_event.topic)
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
                                       schema_version, payload, headers, topic)
            VALUES (emit_event.event_id, emit_event.aggregate_type, emit_event.aggregate_id, emit_event.aggregate_seq,
                    emit_event.event_type, emit_event.schema_version, emit_event.payload, emit_event.headers,
                    emit_event.topic);
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
