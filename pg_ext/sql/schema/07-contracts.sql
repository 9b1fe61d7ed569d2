------------------------------------------------------------------------------
-- Event contracts: a JSON Schema per (aggregate type, event type, schema
-- version), registered by the owner or a member of the schema_admin role and
-- immutable once registered (a change is a new version). emit_event and
-- emit_events check each payload against the schema of its event type and
-- version. What a mismatch does is set per aggregate type in
-- outbox.schema_checks: 'enforce' (the default: refused with PO020; a
-- version without a schema, where the event type has others, with PO021),
-- 'warn' (a WARNING, and the event is stored) or 'off'. An event type
-- without any schema is not checked.

CREATE TABLE outbox.event_schemas (
    aggregate_type text        COLLATE "C" NOT NULL,
    event_type     text        NOT NULL,
    schema_version integer     NOT NULL CHECK (schema_version >= 1),
    schema         jsonb       NOT NULL,
    registered_at  timestamptz NOT NULL DEFAULT pg_catalog.now(),
    registered_by  name        NOT NULL DEFAULT pg_catalog."session_user"(),
    PRIMARY KEY (aggregate_type, event_type, schema_version)
);
COMMENT ON TABLE outbox.event_schemas IS 'JSON Schemas of event payloads, by aggregate type, event type and schema version; immutable (outbox.register_schema).';

CREATE TABLE outbox.schema_checks (
    aggregate_type text        COLLATE "C" PRIMARY KEY,
    mode           text        NOT NULL CHECK (mode IN ('off', 'warn', 'enforce')),
    set_at         timestamptz NOT NULL DEFAULT pg_catalog.now(),
    set_by         name        NOT NULL DEFAULT pg_catalog."session_user"()
);
COMMENT ON TABLE outbox.schema_checks IS 'What a payload that breaks its schema does, per aggregate type (outbox.set_schema_check); enforce without a row.';

CREATE FUNCTION outbox.refuse_schema_change() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'registered schemas are immutable'
        USING ERRCODE = 'PO023', HINT = 'Register the change as a new schema_version with outbox.register_schema.';
END
$$;
CREATE TRIGGER event_schemas_immutable BEFORE UPDATE OR DELETE ON outbox.event_schemas
    FOR EACH ROW EXECUTE FUNCTION outbox.refuse_schema_change();
CREATE TRIGGER event_schemas_kept BEFORE TRUNCATE ON outbox.event_schemas
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.refuse_schema_change();

-- Tells every backend, at commit, to read both tables again (the extension
-- keeps them, compiled, for the life of a backend).
--@c-function schemas_changed
CREATE FUNCTION outbox.schemas_changed() RETURNS trigger
LANGUAGE c
AS 'MODULE_PATHNAME', 'schemas_changed';
--@end
CREATE TRIGGER event_schemas_changed AFTER INSERT ON outbox.event_schemas
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.schemas_changed();
CREATE TRIGGER schema_checks_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.schema_checks
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.schemas_changed();

-- Why the validator cannot use a schema, or NULL.
--@c-function schema_problem
CREATE FUNCTION outbox.schema_problem(schema jsonb) RETURNS text
LANGUAGE c STRICT IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'schema_problem';
--@end

-- The check emit_event makes, on its own: nothing when the payload matches
-- (or has no schema, or its aggregate type is not checked), a WARNING in
-- 'warn' mode, PO020 or PO021 in 'enforce' mode.
--@c-function check_payload
CREATE FUNCTION outbox.check_payload(aggregate_type text, event_type text, schema_version integer, payload jsonb)
RETURNS void
LANGUAGE c STRICT STABLE PARALLEL RESTRICTED SECURITY DEFINER
AS 'MODULE_PATHNAME', 'check_payload';
--@end
COMMENT ON FUNCTION outbox.check_payload(text, text, integer, jsonb) IS
    'Checks a payload against the registered schema of its event type and version, as emit_event does.';

CREATE FUNCTION outbox.register_schema(aggregate_type text, event_type text, schema_version integer, schema jsonb)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    problem text;
    registered jsonb;
BEGIN
    PERFORM outbox.check_event(aggregate_type, 'schema', event_type, '{}'::jsonb, NULL, schema_version, NULL);
    IF register_schema.schema IS NULL THEN
        RAISE EXCEPTION 'schema must not be NULL'
            USING ERRCODE = 'PO001', HINT = 'Pass a JSON Schema (draft 2020-12 unless its $schema says otherwise).';
    END IF;
    problem := outbox.schema_problem(register_schema.schema);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'schema of % event % version % is not valid: %', aggregate_type, event_type, schema_version, problem
            USING ERRCODE = 'PO022', HINT = 'Correct the schema; nothing was registered.';
    END IF;
    LOCK TABLE outbox.event_schemas IN SHARE ROW EXCLUSIVE MODE;
    SELECT s.schema INTO registered FROM outbox.event_schemas s
     WHERE s.aggregate_type = register_schema.aggregate_type AND s.event_type = register_schema.event_type
       AND s.schema_version = register_schema.schema_version;
    IF FOUND THEN
        IF registered = register_schema.schema THEN
            RETURN false;
        END IF;
        RAISE EXCEPTION 'version % of % event % is registered with another schema', schema_version, aggregate_type, event_type
            USING ERRCODE = 'PO023', HINT = 'Registered schemas are immutable: register the change as a new schema_version.';
    END IF;
    INSERT INTO outbox.event_schemas (aggregate_type, event_type, schema_version, schema)
    VALUES (aggregate_type, event_type, schema_version, register_schema.schema);
    RETURN true;
END
$$;
COMMENT ON FUNCTION outbox.register_schema(text, text, integer, jsonb) IS
    'Registers the JSON Schema of an event type''s payload under a version; true when new, false when the same schema was registered already.';

CREATE FUNCTION outbox.set_schema_check(aggregate_type text, mode text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.check_event(aggregate_type, 'schema', 'check', '{}'::jsonb, NULL, 1, NULL);
    IF mode IS NULL OR mode NOT IN ('off', 'warn', 'enforce') THEN
        RAISE EXCEPTION 'mode must be off, warn or enforce, not %', coalesce(quote_literal(mode), 'NULL')
            USING ERRCODE = 'PO007', HINT = 'enforce refuses payloads that break their schema, warn stores them with a WARNING, off does not check.';
    END IF;
    INSERT INTO outbox.schema_checks AS c (aggregate_type, mode) VALUES (set_schema_check.aggregate_type, set_schema_check.mode)
    ON CONFLICT (aggregate_type) DO UPDATE
       SET mode = excluded.mode, set_at = pg_catalog.now(), set_by = pg_catalog."session_user"();
END
$$;
COMMENT ON FUNCTION outbox.set_schema_check(text, text) IS
    'Sets what a payload that breaks its schema does for an aggregate type: enforce (the default), warn or off.';

CREATE VIEW outbox.schemas AS
SELECT s.aggregate_type, s.event_type, s.schema_version, s.schema,
       coalesce(c.mode, 'enforce') AS check_mode, s.registered_at, s.registered_by
  FROM outbox.event_schemas s
  LEFT JOIN outbox.schema_checks c ON c.aggregate_type = s.aggregate_type;
COMMENT ON VIEW outbox.schemas IS 'Registered schemas with the check mode of their aggregate type.';

REVOKE ALL ON outbox.event_schemas, outbox.schema_checks, outbox.schemas FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.refuse_schema_change() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.schemas_changed() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.schema_problem(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.check_payload(text, text, integer, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.register_schema(text, text, integer, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.set_schema_check(text, text) FROM PUBLIC;
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.register_schema(text, text, integer, jsonb)');
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.set_schema_check(text, text)');
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.schema_problem(jsonb)');
CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.check_payload(text, text, integer, jsonb)');
CALL outbox.grant_to('schema_admin', 'EXECUTE ON FUNCTION outbox.check_payload(text, text, integer, jsonb)');
CALL outbox.grant_to('schema_admin', 'SELECT ON outbox.schemas');
CALL outbox.grant_to('writer', 'SELECT ON outbox.schemas');
CALL outbox.grant_to('relay', 'SELECT ON outbox.schemas');

