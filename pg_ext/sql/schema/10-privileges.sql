------------------------------------------------------------------------------
-- Privileges: applications reach the tables only through these functions.

REVOKE ALL ON FUNCTION outbox.check_event(text, text, text, jsonb, jsonb, integer, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.check_emit(text, text, text, jsonb, jsonb, integer, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.lock_aggregate(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.emit_events(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.current_seq(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.ensure_publication(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.drop_publication(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.ensure_shard_publication(text, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.record_relay_shard(name, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_relay_shard(name) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_relay(name) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.status() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.register_consumer(text, regrole) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.inbox_receive(text, uuid, text, text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.prune(interval, integer) FROM PUBLIC;

CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.emit_event(text, text, text, jsonb, jsonb, integer, bigint, text, text)');
CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.emit_events(jsonb)');
CALL outbox.grant_to('writer', 'EXECUTE ON FUNCTION outbox.current_seq(text, text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.ensure_publication(text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.drop_publication(text)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.ensure_shard_publication(text, integer, integer)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.record_relay_shard(name, integer, integer)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.forget_relay_shard(name)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.record_relay_progress(name, pg_lsn, boolean)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.forget_relay(name)');
CALL outbox.grant_to('relay', 'EXECUTE ON FUNCTION outbox.status()');
CALL outbox.grant_to('consumer', 'EXECUTE ON FUNCTION outbox.inbox_receive(text, uuid, text, text, bigint)');
