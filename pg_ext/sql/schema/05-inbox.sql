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

