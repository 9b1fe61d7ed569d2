-- pg_outbox 0.7.0 -> 0.8.0: shards.
--
-- An outbox can be split into shards, each streamed by a forwarder of its
-- own through a slot and a publication of its own that carries the events
-- whose aggregate_hash % shards = shard, so that forwarding is no longer
-- bound to one walsender. Every emit now stores the aggregate's hash; events
-- stored before this step have none (NULL), and what reads them computes it.

ALTER TABLE outbox.events ADD COLUMN aggregate_hash integer;
COMMENT ON COLUMN outbox.events.aggregate_hash IS 'outbox.aggregate_hash of the aggregate, set at emit: a sharded forwarder''s shard is aggregate_hash % shards (NULL for events stored before 0.8.0).';

-- The shard of each sharded forwarder's slot, recorded when it starts: its
-- publication carries the events whose aggregate_hash % shards = shard.
-- Kept while the slot is recreated; dropped with the slot.
CREATE TABLE outbox.relay_shards (
    slot_name name    NOT NULL PRIMARY KEY,
    shard     integer NOT NULL,
    shards    integer NOT NULL,
    CHECK (shard >= 0 AND shard < shards)
);
COMMENT ON TABLE outbox.relay_shards IS 'Per sharded forwarder slot: which shard of how many it carries, recorded by outbox-forwarder.';

REVOKE ALL ON outbox.relay_shards FROM PUBLIC;
CALL outbox.grant_to('relay', 'SELECT ON outbox.relay_shards');

-- Where an aggregate lives when the outbox is split into shards: the first
-- 31 bits of the SHA-256 of its type and id in UTF-8, joined by a zero byte
-- (which text cannot hold). Stored with every event at emit (emit_event's C
-- code computes the same), so that a shard's publication can filter on
-- aggregate_hash % shards, and no later change of PostgreSQL's own hash
-- functions or of the number of shards moves an aggregate's stored events.
CREATE FUNCTION outbox.aggregate_hash(aggregate_type text, aggregate_id text) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN ('x' || pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
            pg_catalog.convert_to(aggregate_type, 'UTF8') || pg_catalog.decode('00', 'hex')
            || pg_catalog.convert_to(aggregate_id, 'UTF8')), 1, 4), 'hex'))::bit(32)::integer & 2147483647;
COMMENT ON FUNCTION outbox.aggregate_hash(text, text) IS
    'The aggregate''s hash that shards split on (0 to 2^31-1): stored in outbox.events.aggregate_hash by every emit.';

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
                                   schema_version, payload, headers, topic, aggregate_hash)
        SELECT s.id, s.v->>'aggregate_type', s.v->>'aggregate_id', s.seq, s.v->>'event_type',
               coalesce((s.v->>'schema_version')::integer, 1), s.v->'payload',
               nullif(s.v->'headers', 'null'::jsonb), s.v->>'topic',
               outbox.aggregate_hash(s.v->>'aggregate_type', s.v->>'aggregate_id')
          FROM src s ORDER BY s.ord
        RETURNING 1
    )
    SELECT s.ord, s.id, s.seq FROM src s ORDER BY s.ord;
END
$$;

-- The C function computes the hash itself; the SQL edition's emit_event is
-- replaced by one that stores it.
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

CREATE FUNCTION outbox.forget_relay_shard(slot_name name) RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM outbox.relay_shards WHERE relay_shards.slot_name = $1;
$$;
COMMENT ON FUNCTION outbox.forget_relay_shard(name) IS
    'Called by outbox-forwarder slot drop: the slot no longer carries a shard.';

-- status() gains the shard of each slot.
DROP FUNCTION outbox.status();
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

REVOKE ALL ON FUNCTION outbox.ensure_shard_publication(text, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.record_relay_shard(name, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_relay_shard(name) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.status() FROM PUBLIC;
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.ensure_shard_publication(text, integer, integer)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.record_relay_shard(name, integer, integer)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.forget_relay_shard(name)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.status()');
