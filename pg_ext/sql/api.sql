-- pg_outbox: the functions applications and the forwarder call. Every one is
-- VOLATILE, PARALLEL UNSAFE and SECURITY DEFINER with a pinned search_path:
-- callers reach the tables only through them.

CREATE FUNCTION outbox.emit_event(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    OUT event_id      uuid,
    OUT aggregate_seq bigint
)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    seq bigint;
BEGIN
    IF emit_event.aggregate_type IS NULL OR emit_event.aggregate_type = '' THEN
        RAISE EXCEPTION 'aggregate_type must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the kind of aggregate, for example ''order''.';
    END IF;
    IF emit_event.aggregate_id IS NULL OR emit_event.aggregate_id = '' THEN
        RAISE EXCEPTION 'aggregate_id must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the identity of the aggregate, for example its primary key as text.';
    END IF;
    IF emit_event.event_type IS NULL OR emit_event.event_type = '' THEN
        RAISE EXCEPTION 'event_type must not be NULL or empty'
            USING ERRCODE = 'PO001', HINT = 'Pass the name of the event, for example ''OrderPlaced''.';
    END IF;
    IF emit_event.payload IS NULL THEN
        RAISE EXCEPTION 'payload must not be NULL'
            USING ERRCODE = 'PO001', HINT = 'Pass a JSON value; use ''{}''::jsonb for an event without data.';
    END IF;

    -- Update first: the common case, an aggregate that already has events.
    UPDATE outbox.aggregates AS a
       SET last_seq = a.last_seq + 1
     WHERE a.aggregate_type = emit_event.aggregate_type
       AND a.aggregate_id = emit_event.aggregate_id
    RETURNING a.last_seq INTO seq;
    IF NOT FOUND THEN
        -- A concurrent first writer wins the insert; this one then waits on
        -- its row lock and takes the next number.
        INSERT INTO outbox.aggregates AS a (aggregate_type, aggregate_id, last_seq)
        VALUES (emit_event.aggregate_type, emit_event.aggregate_id, 1)
        ON CONFLICT (aggregate_type, aggregate_id)
            DO UPDATE SET last_seq = a.last_seq + 1
        RETURNING a.last_seq INTO seq;
    END IF;

    emit_event.event_id := outbox.uuid_v7();
    emit_event.aggregate_seq := seq;
    INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload)
    VALUES (emit_event.event_id, emit_event.aggregate_type, emit_event.aggregate_id, seq,
            emit_event.event_type, emit_event.payload);
END
$$;
COMMENT ON FUNCTION outbox.emit_event(text, text, text, jsonb) IS
    'Stores an event in the caller''s transaction and returns its id and its aggregate''s next sequence number.';

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

CREATE FUNCTION outbox.record_relay_progress(slot_name name, confirmed_lsn pg_lsn, caught_up boolean DEFAULT false)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.relay_progress AS p (slot_name, caught_up_at, caught_up_lsn, confirmed_lsn)
    VALUES ($1, CASE WHEN $3 THEN now() END, CASE WHEN $3 THEN $2 END, $2)
    ON CONFLICT (slot_name) DO UPDATE
       SET confirmed_lsn = GREATEST(p.confirmed_lsn, EXCLUDED.confirmed_lsn),
           caught_up_at  = COALESCE(EXCLUDED.caught_up_at, p.caught_up_at),
           caught_up_lsn = COALESCE(EXCLUDED.caught_up_lsn, p.caught_up_lsn),
           updated_at    = now();
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

REVOKE ALL ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_relay(name) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean) TO outbox_relay;
GRANT EXECUTE ON FUNCTION outbox.forget_relay(name) TO outbox_relay;
GRANT SELECT ON outbox.relay_progress TO outbox_relay;

REVOKE ALL ON FUNCTION outbox.emit_event(text, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.ensure_publication(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.emit_event(text, text, text, jsonb) TO outbox_writer;
GRANT EXECUTE ON FUNCTION outbox.ensure_publication(text) TO outbox_relay;
