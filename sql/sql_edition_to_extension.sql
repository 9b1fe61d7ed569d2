-- Moves a database from the pg_outbox SQL edition to the pg_outbox
-- extension of the same version, in place and in one transaction, keeping
-- every event, sequence, idempotency key, inbox row and forwarder's
-- progress. Run it as a superuser (CREATE EXTENSION needs one), after
-- installing the extension's build on the server:
--
--   psql "postgres://postgres@host/app" -f sql/sql_edition_to_extension.sql
--
-- Writers wait while it runs (it locks the outbox tables). A running
-- forwarder may stay up: its publications are moved to the new table, and
-- the copied rows are not published again (they are inserted while the new
-- table is in no publication).

\set ON_ERROR_STOP on
BEGIN;

DO $move$
DECLARE
    installed text := pg_catalog.obj_description(pg_catalog.to_regnamespace('outbox'), 'pg_namespace');
    extension_version text;
BEGIN
    IF installed IS NULL OR installed !~ '^pg_outbox SQL edition ' THEN
        RAISE EXCEPTION 'schema outbox is not a pg_outbox SQL edition'
            USING ERRCODE = 'PO012', HINT = 'Nothing to move: this database has no SQL edition installed.';
    END IF;
    SELECT default_version INTO extension_version FROM pg_catalog.pg_available_extensions WHERE name = 'pg_outbox';
    IF extension_version IS NULL THEN
        RAISE EXCEPTION 'the pg_outbox extension is not installed on this server'
            USING ERRCODE = 'PO012', HINT = 'Install its build (scripts/setup or cargo pgrx install) first.';
    END IF;
    IF installed <> 'pg_outbox SQL edition ' || extension_version THEN
        RAISE EXCEPTION '% is installed, the extension on this server is %', installed, extension_version
            USING ERRCODE = 'PO012', HINT = 'Bring the SQL edition to the extension''s version first (run its pg_outbox_sql.sql).';
    END IF;
END
$move$;

LOCK TABLE outbox.events, outbox.sequence_floors, outbox.idempotency_keys, outbox.relay_progress,
           outbox.inbox_consumers, outbox.inbox, outbox.inbox_positions IN ACCESS EXCLUSIVE MODE;
ALTER SCHEMA outbox RENAME TO outbox_sql_edition;
CREATE EXTENSION pg_outbox;

-- The tables of both editions have the same columns in the same order.
INSERT INTO outbox.events SELECT * FROM outbox_sql_edition.events;
INSERT INTO outbox.sequence_floors SELECT * FROM outbox_sql_edition.sequence_floors;
INSERT INTO outbox.idempotency_keys SELECT * FROM outbox_sql_edition.idempotency_keys;
INSERT INTO outbox.relay_progress SELECT * FROM outbox_sql_edition.relay_progress;
INSERT INTO outbox.inbox_consumers SELECT * FROM outbox_sql_edition.inbox_consumers;
INSERT INTO outbox.inbox SELECT * FROM outbox_sql_edition.inbox;
INSERT INTO outbox.inbox_positions SELECT * FROM outbox_sql_edition.inbox_positions;

-- Publications of the old table publish the new one from here on.
DO $publications$
DECLARE
    publication name;
BEGIN
    FOR publication IN
        SELECT p.pubname FROM pg_catalog.pg_publication p
          JOIN pg_catalog.pg_publication_rel r ON r.prpubid = p.oid
         WHERE r.prrelid = 'outbox_sql_edition.events'::regclass
    LOOP
        EXECUTE pg_catalog.format('ALTER PUBLICATION %I ADD TABLE outbox.events', publication);
    END LOOP;
END
$publications$;

DROP SCHEMA outbox_sql_edition CASCADE;
COMMIT;
