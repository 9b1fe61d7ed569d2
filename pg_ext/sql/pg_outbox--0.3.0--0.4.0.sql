-- pg_outbox 0.3.0 -> 0.4.0: identifiers compare byte by byte.
--
-- Aggregate types, aggregate ids, idempotency keys and consumer names are
-- identifiers: only their equality matters, never their order in a
-- language. Keyed with the "C" collation, every probe of their indexes
-- compares bytes (memcmp) instead of calling the locale's strcoll, which
-- is most of the cost of a B-tree descent under en_US.UTF-8 and similar
-- locales. Equality is unchanged: every deterministic collation compares
-- equal exactly the byte-equal strings.
--
-- The upgrade rebuilds the indexes on these columns (the tables are not
-- rewritten) under an ACCESS EXCLUSIVE lock on each table: on a large
-- outbox, prune first and run it in a quiet moment (see sql/UPGRADING.md).

ALTER TABLE outbox.events
    ALTER COLUMN aggregate_type TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id   TYPE text COLLATE "C";

ALTER TABLE outbox.sequence_floors
    ALTER COLUMN aggregate_type TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id   TYPE text COLLATE "C";

ALTER TABLE outbox.idempotency_keys
    ALTER COLUMN aggregate_type  TYPE text COLLATE "C",
    ALTER COLUMN idempotency_key TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id    TYPE text COLLATE "C";

ALTER TABLE outbox.inbox_consumers
    ALTER COLUMN consumer TYPE text COLLATE "C";

ALTER TABLE outbox.inbox
    ALTER COLUMN consumer       TYPE text COLLATE "C",
    ALTER COLUMN aggregate_type TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id   TYPE text COLLATE "C";

ALTER TABLE outbox.inbox_positions
    ALTER COLUMN consumer       TYPE text COLLATE "C",
    ALTER COLUMN aggregate_type TYPE text COLLATE "C",
    ALTER COLUMN aggregate_id   TYPE text COLLATE "C";

-- emit_event pins search_path in its own code, around the only statements
-- it runs (idempotency keys, the wording of a refusal, an INSERT into a
-- table an operator changed); its common call resolves no name. The SET
-- clause cost a configuration change on every call. The function stays
-- SECURITY DEFINER; every other function keeps its SET clause.
ALTER FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text)
    RESET search_path;
