-- pg_outbox 0.6.0 -> 0.7.0: roles of this database's own.
--
-- Before 0.7.0 the outbox's privileges went to the cluster-wide roles
-- outbox_writer, outbox_relay, outbox_consumer and outbox_schema_admin, so a
-- member of outbox_writer could emit into every database of the cluster
-- that has the outbox. From 0.7.0 each database has roles of its own
-- (below). This step moves every privilege that a cluster-wide role held in
-- this database's outbox to the new role of the same purpose, then makes the
-- cluster-wide role a member of the new one, so that the logins granted it
-- keep working unchanged. Once those logins hold the new roles, the operator
-- ends the sharing, database by database:
--   REVOKE app_outbox_writer FROM outbox_writer;   (and relay, consumer, schema_admin)

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

-- outbox-forwarder check reads which role it needs.
CALL outbox.grant_to('relay', 'SELECT ON outbox.roles');

DO $move$
DECLARE
    shared record;
    held record;
BEGIN
    FOR shared IN
        SELECT r.purpose, r.role AS own, a.oid AS legacy, a.rolname AS legacy_name
          FROM outbox.roles r JOIN pg_catalog.pg_roles a ON a.rolname = 'outbox_' || r.purpose AND a.oid <> r.role
    LOOP
        FOR held IN
            SELECT 'SCHEMA' AS kind, 'outbox' AS object, x.privilege_type
              FROM pg_catalog.pg_namespace n, pg_catalog.aclexplode(n.nspacl) x
             WHERE n.nspname = 'outbox' AND x.grantee = shared.legacy
            UNION ALL
            SELECT CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, p.oid::regprocedure::text, x.privilege_type
              FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) x
             WHERE p.pronamespace = 'outbox'::regnamespace AND x.grantee = shared.legacy
            UNION ALL
            SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, c.oid::regclass::text, x.privilege_type
              FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) x
             WHERE c.relnamespace = 'outbox'::regnamespace AND x.grantee = shared.legacy
        LOOP
            EXECUTE pg_catalog.format('GRANT %s ON %s %s TO %s', held.privilege_type, held.kind, held.object, shared.own);
            EXECUTE pg_catalog.format('REVOKE %s ON %s %s FROM %I', held.privilege_type, held.kind, held.object, shared.legacy_name);
        END LOOP;
        EXECUTE pg_catalog.format('GRANT %s TO %I', shared.own, shared.legacy_name);
    END LOOP;
END
$move$;
