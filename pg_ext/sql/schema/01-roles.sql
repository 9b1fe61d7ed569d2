-- pg_outbox: the whole schema of the current version, in the files of
-- pg_ext/sql/schema/, one concern each, run in the order of their names.
--
-- A fresh `CREATE EXTENSION pg_outbox` runs them in turn (after pgrx declares
-- the Rust function outbox.uuid_v7()); a database on an older version gets
-- the same schema from the released upgrade scripts
-- pg_ext/sql/pg_outbox--A--B.sql, which are never edited. A test compares
-- the two catalogs.
--
-- The SQL edition (sql/pg_outbox_sql.sql, for managed PostgreSQL) is
-- assembled from these files by scripts/sql-edition: each block between
-- `--@c-function NAME` and `--@end` declares a function written in C (Rust)
-- here, and is replaced there by the PL/pgSQL block of the same name in
-- pg_ext/sql/sql_edition.sql. Everything else is the same text in both
-- editions.
--
-- A change to any of these files is a new version: it comes with a new
-- upgrade script that brings the previous version to the same catalog.

-- Roles. PostgreSQL's roles belong to the whole cluster, but privileges are
-- granted in one database, so each database with the outbox has roles of
-- its own, and a member of one database's roles reaches no other
-- database's outbox:
--   <prefix>_writer        emit_event, emit_events, current_seq (applications)
--   <prefix>_relay         what the forwarder and polling relays read and call
--   <prefix>_consumer      the inbox
--   <prefix>_schema_admin  event contracts
-- The prefix is the setting pg_outbox.role_prefix when the outbox is
-- installed, else the database's name followed by _outbox (database app:
-- app_outbox_writer, ...). outbox.roles names them; the install grants them
-- CONNECT on the database, so that an operator may revoke it from PUBLIC,
-- and gives them to the database owner to hand out (with ADMIN, on 16+ with
-- neither INHERIT nor SET).
CREATE TABLE outbox.roles (
    purpose text    PRIMARY KEY CHECK (purpose IN ('writer', 'relay', 'consumer', 'schema_admin')),
    role    regrole NOT NULL UNIQUE
);
COMMENT ON TABLE outbox.roles IS 'The roles of this database''s outbox, by purpose: grant them to the application, forwarder and consumer logins of this database.';
REVOKE ALL ON outbox.roles FROM PUBLIC;

DO $roles$
DECLARE
    database name := pg_catalog.current_database();
    database_oid oid := (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database());
    owner name := (SELECT datdba::regrole::name FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database());
    prefix text := coalesce(nullif(pg_catalog.current_setting('pg_outbox.role_prefix', true), ''), database || '_outbox');
    purpose text;
    role_name text;
    existing record;
BEGIN
    IF pg_catalog.octet_length(prefix) > 50 THEN
        RAISE EXCEPTION 'the outbox role prefix "%" is longer than 50 bytes', prefix
            USING ERRCODE = 'name_too_long',
                  HINT = 'Choose a shorter prefix before installing: SET pg_outbox.role_prefix = ''app_outbox''.';
    END IF;
    FOREACH purpose IN ARRAY ARRAY['writer', 'relay', 'consumer', 'schema_admin'] LOOP
        role_name := prefix || '_' || purpose;
        SELECT r.oid, r.rolcanlogin OR r.rolsuper OR r.rolreplication AS powerful,
               (SELECT d.datname
                  FROM pg_catalog.pg_shdepend s
                  JOIN pg_catalog.pg_database d
                    ON d.oid = CASE WHEN s.dbid = 0 AND s.classid = 'pg_catalog.pg_database'::regclass
                                    THEN s.objid ELSE s.dbid END
                 WHERE s.refclassid = 'pg_catalog.pg_authid'::regclass AND s.refobjid = r.oid
                   AND d.oid <> database_oid
                 LIMIT 1) AS elsewhere
          INTO existing
          FROM pg_catalog.pg_roles r WHERE r.rolname = role_name;
        IF NOT FOUND THEN
            EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', role_name);
            EXECUTE pg_catalog.format('COMMENT ON ROLE %I IS %L', role_name,
                pg_catalog.format('pg_outbox: %s role of database %s', purpose, database));
        ELSIF existing.powerful THEN
            RAISE EXCEPTION 'role "%" exists and can log in, replicate or is a superuser', role_name
                USING ERRCODE = 'duplicate_object',
                      HINT = 'The outbox''s roles are groups of their own: choose another prefix with SET pg_outbox.role_prefix.';
        ELSIF existing.elsewhere IS NOT NULL THEN
            RAISE EXCEPTION 'role "%" already holds privileges in database "%"', role_name, existing.elsewhere
                USING ERRCODE = 'duplicate_object',
                      HINT = 'Each database''s outbox needs roles of its own: choose another prefix with SET pg_outbox.role_prefix.';
        END IF;
        INSERT INTO outbox.roles VALUES (purpose, role_name::regrole);
        EXECUTE pg_catalog.format('GRANT CONNECT ON DATABASE %I TO %I', database, role_name);
        -- A role made by a CREATEROLE owner on 16+ is already the owner's to
        -- give; on 15 CREATEROLE gives any role.
        IF NOT pg_catalog.pg_has_role(owner, role_name, 'MEMBER WITH ADMIN OPTION')
           AND NOT (pg_catalog.current_setting('server_version_num')::int < 160000
                    AND (SELECT rolcreaterole FROM pg_catalog.pg_roles WHERE rolname = owner)) THEN
            IF pg_catalog.current_setting('server_version_num')::int >= 160000 THEN
                EXECUTE pg_catalog.format('GRANT %I TO %I WITH ADMIN TRUE, INHERIT FALSE, SET FALSE', role_name, owner);
            ELSE
                EXECUTE pg_catalog.format('GRANT %I TO %I WITH ADMIN OPTION', role_name, owner);
            END IF;
        END IF;
    END LOOP;
END
$roles$;

-- Grants privilege (as GRANT's text before TO) to the role of purpose.
CREATE PROCEDURE outbox.grant_to(purpose text, privilege text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    grantee regrole := (SELECT r.role FROM outbox.roles r WHERE r.purpose = grant_to.purpose);
BEGIN
    IF grantee IS NULL THEN
        RAISE EXCEPTION 'outbox.roles names no % role', purpose USING ERRCODE = 'undefined_object';
    END IF;
    EXECUTE format('GRANT %s TO %s', privilege, grantee);
END
$$;
COMMENT ON PROCEDURE outbox.grant_to(text, text) IS 'Grants a privilege to this database''s outbox role of a purpose (install and upgrade scripts).';
REVOKE ALL ON PROCEDURE outbox.grant_to(text, text) FROM PUBLIC;

CALL outbox.grant_to('writer', 'USAGE ON SCHEMA outbox');
CALL outbox.grant_to('relay', 'USAGE ON SCHEMA outbox');
CALL outbox.grant_to('consumer', 'USAGE ON SCHEMA outbox');
CALL outbox.grant_to('schema_admin', 'USAGE ON SCHEMA outbox');
-- outbox-forwarder check reads which role it needs.
CALL outbox.grant_to('relay', 'SELECT ON outbox.roles');

