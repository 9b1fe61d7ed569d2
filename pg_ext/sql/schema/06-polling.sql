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

