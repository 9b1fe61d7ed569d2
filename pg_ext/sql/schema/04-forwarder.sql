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

-- A shard's publication: the inserts of the events whose aggregate_hash %
-- shards = shard. One that exists with another row filter is refused, so a
-- forwarder never streams a shard it was not given.
CREATE FUNCTION outbox.ensure_shard_publication(name text, shard integer, shards integer) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    wanted text := format('((aggregate_hash %% %s) = %s)', shards, shard);
    current_filter text;
BEGIN
    IF name IS NULL OR name !~ '^[a-z0-9_]{1,63}$' THEN
        RAISE EXCEPTION 'publication name % is not valid', quote_literal(coalesce(name, 'NULL'))
            USING ERRCODE = 'PO002', HINT = 'Use 1 to 63 characters of a-z, 0-9 and _.';
    END IF;
    IF shards IS NULL OR shards < 1 OR shards > 1024 OR shard IS NULL OR shard < 0 OR shard >= shards THEN
        RAISE EXCEPTION 'shard %/% is out of range', coalesce(shard::text, 'NULL'), coalesce(shards::text, 'NULL')
            USING ERRCODE = 'PO007', HINT = 'shards is 1 to 1024, and shard 0 to shards - 1.';
    END IF;
    SELECT coalesce(pg_get_expr(r.prqual, r.prrelid), '') INTO current_filter
      FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid
     WHERE p.pubname = name AND r.prrelid = 'outbox.events'::regclass;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM pg_publication WHERE pubname = name) THEN
            RAISE EXCEPTION 'publication % exists but does not publish outbox.events', quote_ident(name)
                USING ERRCODE = 'PO013', HINT = 'Give the shard a publication name of its own.';
        END IF;
        EXECUTE format('CREATE PUBLICATION %I FOR TABLE outbox.events WHERE (aggregate_hash %% %s = %s) WITH (publish = %L)',
                       name, shards, shard, 'insert');
    ELSIF current_filter = '' THEN
        RAISE EXCEPTION 'publication % carries every event of outbox.events, not only shard %/%''s',
                quote_ident(name), shard, shards
            USING ERRCODE = 'PO013',
                  HINT = 'Give each shard a publication of its own: outbox-forwarder --shard names it after the shard.';
    ELSIF current_filter <> wanted THEN
        RAISE EXCEPTION 'publication % filters outbox.events by % instead of shard %/%''s %',
                quote_ident(name), current_filter, shard, shards, wanted
            USING ERRCODE = 'PO013',
                  HINT = 'Each shard of each layout has a publication of its own: drop this one (outbox-forwarder publication drop) or name another.';
    END IF;
END
$$;
COMMENT ON FUNCTION outbox.ensure_shard_publication(text, integer, integer) IS
    'Creates the publication of one shard (the events whose aggregate_hash % shards = shard) if missing; refuses one with another filter.';

-- Which shard a sharded forwarder's slot carries, for status().
CREATE FUNCTION outbox.record_relay_shard(slot_name name, shard integer, shards integer) RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.relay_shards AS s (slot_name, shard, shards) VALUES ($1, $2, $3)
    ON CONFLICT ON CONSTRAINT relay_shards_pkey DO UPDATE SET shard = EXCLUDED.shard, shards = EXCLUDED.shards
     WHERE (s.shard, s.shards) IS DISTINCT FROM (EXCLUDED.shard, EXCLUDED.shards);
$$;
COMMENT ON FUNCTION outbox.record_relay_shard(name, integer, integer) IS
    'Called by a sharded outbox-forwarder as it starts: the shard its slot carries.';

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

CREATE FUNCTION outbox.forget_relay_shard(slot_name name) RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM outbox.relay_shards WHERE relay_shards.slot_name = $1;
$$;
COMMENT ON FUNCTION outbox.forget_relay_shard(name) IS
    'Called by outbox-forwarder slot drop: the slot no longer carries a shard.';

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
    estimated_events       bigint,
    shard                  integer,
    shards                 integer
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
           (SELECT greatest(c.reltuples, 0)::bigint FROM pg_class c WHERE c.oid = 'outbox.events'::regclass),
           h.shard, h.shards
      FROM pg_replication_slots s
      LEFT JOIN outbox.relay_progress p ON p.slot_name = s.slot_name
      LEFT JOIN outbox.relay_shards h ON h.slot_name = s.slot_name
      LEFT JOIN LATERAL (
          -- Events not in the slot's safe snapshot: committed later, or not
          -- yet known to be confirmed (an upper bound, about a second behind);
          -- of a sharded slot, those of its shard.
          SELECT count(*) AS n, min(e.occurred_at) AS oldest
            FROM outbox.events e
           WHERE p.safe_snapshot IS NOT NULL
             AND e.txid >= pg_snapshot_xmin(p.safe_snapshot)
             AND NOT pg_visible_in_snapshot(e.txid, p.safe_snapshot)
             AND (h.shards IS NULL
                  OR coalesce(e.aggregate_hash, outbox.aggregate_hash(e.aggregate_type, e.aggregate_id)) % h.shards = h.shard)
      ) u ON true
     WHERE s.database = current_database() AND s.plugin = 'pgoutput';
$$;
COMMENT ON FUNCTION outbox.status() IS
    'Per forwarder slot: active, caught up, lag and retained WAL in bytes, events not yet forwarded and the age of the oldest, and the shard it carries.';

