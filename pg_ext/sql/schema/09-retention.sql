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

