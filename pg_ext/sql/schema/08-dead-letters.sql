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

