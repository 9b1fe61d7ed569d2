#!/usr/bin/env bash
# What PostgreSQL's logical decoder (the walsender, pgoutput) costs per event
# for each way the outbox could hand it an event, in one run beside today's
# (the payload and headers as jsonb): events/s of pg_recvlogical reading the
# slot to its end, and the walsender's CPU-seconds per million events.
#   jsonb         the outbox row as stored today
#   json          payload and headers as json
#   text          payload and headers as text
#   bytea         payload and headers as bytea (UTF-8 of the JSON)
#   jsonb-binary  today's row, read with pgoutput's binary 'true'
#   message       no row: the whole event in a transactional logical
#                 decoding message (pg_logical_emit_message), read with
#                 pgoutput's messages 'true'
# Every row has the outbox's columns and key; payloads are about 200 bytes of
# JSON with a traceparent header, in transactions of 100. Each
# representation gets a slot of its own made just before its events are
# written, so it decodes only its own WAL. The runs go in rounds, each round
# running every representation once (in another order each round), and the
# ratios to jsonb are taken within a round; the summary gives medians.
#   bench/decode_cost.sh [EVENTS_PER_RUN] [ROUNDS]
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
EVENTS=${1:-200000}
ROUNDS=${2:-3}
. "$ROOT/bench/harness.sh"
DB=bench_decode
KINDS="jsonb json text bytea jsonb-binary message"

bench_database $DB
psql_admin -d postgres -c "CREATE DATABASE $DB" >/dev/null
psql_admin -d $DB >/dev/null <<'SQL'
CREATE FUNCTION event_json(i bigint) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT format('{"order_id": %s, "customer": %s, "items": [{"sku": "SKU-%s", "qty": 2, "price": 19.99}, {"sku": "SKU-%s", "qty": 1, "price": 5.5}], "total": 45.48, "currency": "EUR", "placed_at": "2026-12-07T10:00:00Z"}',
                  i, i % 977, i % 131, i % 71)
$$;
CREATE FUNCTION headers_json(i bigint) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT format('{"traceparent": "00-%s-%s-01"}', md5(i::text), left(md5((i + 1)::text), 16))
$$;
DO $$
DECLARE kind text;
BEGIN
    FOREACH kind IN ARRAY ARRAY['jsonb', 'json', 'text', 'bytea'] LOOP
        EXECUTE format($t$
            CREATE TABLE events_%1$s (
                event_id uuid NOT NULL, aggregate_type text COLLATE "C" NOT NULL,
                aggregate_id text COLLATE "C" NOT NULL, aggregate_seq bigint NOT NULL,
                event_type text NOT NULL, schema_version integer NOT NULL DEFAULT 1,
                payload %1$s NOT NULL, headers %1$s, topic text,
                occurred_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
                UNIQUE (aggregate_type, aggregate_id, aggregate_seq))$t$, kind);
        EXECUTE format('CREATE PUBLICATION pub_%1$s FOR TABLE events_%1$s', kind);
    END LOOP;
END
$$;
-- The events of one run, in transactions of 100.
CREATE PROCEDURE fill(kind text, events bigint) LANGUAGE plpgsql AS $$
DECLARE
    first bigint;
    as_value text := CASE kind WHEN 'bytea' THEN 'convert_to(%s, ''UTF8'')' WHEN 'text' THEN '%s' ELSE '%s::' || kind END;
BEGIN
    FOR b IN 0 .. events / 100 - 1 LOOP
        first := b * 100;
        IF kind = 'message' THEN
            PERFORM pg_logical_emit_message(true, 'pg_outbox',
                        json_build_object('event_id', gen_random_uuid(), 'aggregate_type', 'order',
                                          'aggregate_id', 'o-' || (i % 1000), 'aggregate_seq', i,
                                          'event_type', 'OrderPlaced', 'schema_version', 1,
                                          'payload', event_json(i)::json, 'headers', headers_json(i)::json,
                                          'occurred_at', clock_timestamp())::text)
              FROM generate_series(first, first + 99) i;
        ELSE
            EXECUTE format('INSERT INTO events_%s (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, headers)
                            SELECT gen_random_uuid(), ''order'', ''o-'' || (i %% 1000), i, ''OrderPlaced'', %s, %s
                              FROM generate_series($1, $1 + 99) i',
                           kind, format(as_value, 'event_json(i)'), format(as_value, 'headers_json(i)'))
                USING first;
        END IF;
        COMMIT;
    END LOOP;
END
$$;
SQL

# Decodes one run of KIND; prints "events/s walsender-CPU-s-per-1M".
#   run KIND
run() {
    local kind=$1 table=${1%-binary} slot=bench_decode options=() end cpu started ended watcher
    case $kind in
        message) options=(-o messages=true -o publication_names=pub_jsonb) ;;
        jsonb-binary) options=(-o binary=true -o publication_names=pub_jsonb) ;;
        *) options=(-o publication_names=pub_$table) ;;
    esac
    psql_admin -d $DB -c "SELECT pg_create_logical_replication_slot('$slot', 'pgoutput')" >/dev/null
    psql_admin -d $DB -c "CALL fill('$table', $EVENTS)"
    end=$(psql_admin -d $DB -c "SELECT pg_current_wal_lsn()")
    cpu=$(mktemp)
    walsender_ticks $DB $slot "$cpu" &
    watcher=$!
    sleep 0.5
    started=$(date +%s.%N)
    PGPASSWORD=$PG_SUPERUSER_PASSWORD PGSSLMODE=disable "$recvlogical" -h 127.0.0.1 -p "$PG_PORT" -U postgres \
        -d $DB --slot $slot --start --no-loop -E "$end" -o proto_version=1 "${options[@]}" -f /dev/null
    ended=$(date +%s.%N)
    wait $watcher
    [ -s "$cpu" ] || die "the walsender of $slot was never seen"
    psql_admin -d $DB -c "SELECT pg_drop_replication_slot('$slot')" \
        -c "TRUNCATE events_jsonb, events_json, events_text, events_bytea" >/dev/null
    awk -v n="$EVENTS" -v s="$started" -v e="$ended" -v cpu="$(cat "$cpu")" -v hz="$CLK_TCK" \
        'BEGIN { printf "%.0f %.2f\n", n / (e - s), cpu / hz / n * 1000000 }'
    rm -f "$cpu"
}

declare -A rate cpu
results=$(mktemp)
say "decoding $EVENTS events per run, $ROUNDS rounds, PostgreSQL $PG_VERSION"
for round in $(seq 1 "$ROUNDS"); do
    for kind in $(in_round_order "$round" "$KINDS"); do
        read -r r c < <(run "$kind")
        rate[$kind]=$r cpu[$kind]=$c
        printf '  round %s  %-13s %7s events/s  %6s walsender CPU-s per 1M events\n' "$round" "$kind" "$r" "$c"
    done
    for kind in $KINDS; do
        rounds_line "$kind" "${rate[$kind]}" "${cpu[$kind]}" "${rate[jsonb]}" "${cpu[jsonb]}" >>"$results"
    done
done

echo
echo "medians over $ROUNDS rounds ($EVENTS events a run; ratios to jsonb within each round)"
median_table "$results" "$KINDS" representation jsonb
rm -f "$results"
bench_database $DB
