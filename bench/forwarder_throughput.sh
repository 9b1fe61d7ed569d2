#!/usr/bin/env bash
# Forwarder throughput on a backlog, beside the raw decoding rate of the same
# kind of slot (pg_recvlogical, pgoutput, to /dev/null), in one run.
#   bench/forwarder_throughput.sh [EVENTS] [EVENTS_PER_TXN]
# Defaults: 1,000,000 events in transactions of 100, payloads of about 330 bytes.
# Prints events/s of each, the ratios to the raw rate, and the forwarder's peak RSS.
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
EVENTS=${1:-1000000}
PER_TXN=${2:-100}
TXNS=$(( EVENTS / PER_TXN ))

eval "$("$ROOT/scripts/stack" up | sed 's/^/export /')"
cargo build -q --release -p cdc_forwarder
FWD=$ROOT/target/release/outbox-forwarder
DB=bench_tp
psql_admin() { PGPASSWORD=$PG_SUPERUSER_PASSWORD psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }
fwd_url="postgres://$FORWARDER_ROLE:$FORWARDER_PASSWORD@127.0.0.1:$PG_PORT/$DB"
run_id=$(date +%s)

say "fresh database $DB"
psql_admin -d postgres >/dev/null <<SQL
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'bench\_%';
DROP DATABASE IF EXISTS $DB WITH (FORCE);
CREATE DATABASE $DB;
SQL
psql_admin -d $DB -c "CREATE EXTENSION pg_outbox" >/dev/null
psql_admin -d $DB -c "SELECT outbox.ensure_publication('pg_outbox')" >/dev/null
psql_admin -d $DB -c "SELECT pg_create_logical_replication_slot('bench_raw', 'pgoutput')" >/dev/null

# The forwarder creates its slots (and finishes its empty catch-up) before the backlog.
for mode in at-least-once exactly-once; do
    slot=bench_${mode//-/_}
    "$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot "$slot" \
        --delivery "$mode" --topic-template "bench-$run_id-$slot.{aggregate_type}" 2>/dev/null &
    pid=$!
    until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM outbox.relay_progress WHERE slot_name = '$slot' AND caught_up_at IS NOT NULL")" = 1 ]; do sleep 0.1; done
    kill -TERM $pid; wait $pid || true
done

say "backlog: $EVENTS events in $TXNS transactions of $PER_TXN"
started=$(date +%s.%N)
psql_admin -d $DB >/dev/null <<SQL
DO \$\$
BEGIN
    FOR t IN 1..$TXNS LOOP
        PERFORM outbox.emit_event('bench', 'agg-' || ((t * $PER_TXN + g) % 1000), 'Measured',
                jsonb_build_object('n', g, 'pad', repeat('x', 280)))
          FROM generate_series(1, $PER_TXN) g;
        COMMIT;
    END LOOP;
END
\$\$;
SQL
end_lsn=$(psql_admin -d $DB -c "SELECT pg_current_wal_lsn()")
say "backlog written in $(printf '%.0f' "$(echo "$(date +%s.%N) - $started" | bc)") s, ends at $end_lsn"

now() { date +%s.%N; }
rate() { echo "scale=0; $EVENTS / ($2 - $1)" | bc; }

say "raw decode: pg_recvlogical"
t0=$(now)
PGPASSWORD=$PG_SUPERUSER_PASSWORD pg_recvlogical -h 127.0.0.1 -p "$PG_PORT" -U postgres -d $DB --slot bench_raw --start \
    -o proto_version=1 -o publication_names=pg_outbox -E "$end_lsn" -f /dev/null --no-loop
t1=$(now)
raw=$(rate "$t0" "$t1")

declare -A fwd_rate fwd_rss
for mode in at-least-once exactly-once; do
    slot=bench_${mode//-/_}
    say "forwarder, $mode"
    t0=$(now)
    "$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot "$slot" \
        --delivery "$mode" --topic-template "bench-$run_id-$slot.{aggregate_type}" 2>/tmp/bench-$slot.log &
    pid=$!
    until [ "$(psql_admin -d $DB -c "SELECT confirmed_flush_lsn >= '$end_lsn' FROM pg_replication_slots WHERE slot_name = '$slot'")" = t ]; do
        kill -0 $pid 2>/dev/null || { tail -5 /tmp/bench-$slot.log; die "forwarder exited"; }
        sleep 0.05
    done
    t1=$(now)
    fwd_rss[$mode]=$(awk '/VmHWM/ {print int($2/1024)}' /proc/$pid/status)
    kill -TERM $pid; wait $pid || true
    fwd_rate[$mode]=$(rate "$t0" "$t1")
done

psql_admin -d postgres >/dev/null <<SQL
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'bench\_%';
DROP DATABASE IF EXISTS $DB WITH (FORCE);
SQL

printf '\n%-34s %12s %8s %12s\n' "$EVENTS events, $PER_TXN per transaction" "events/s" "ratio" "peak RSS"
printf '%-34s %12s %8s %12s\n' "pg_recvlogical (raw decode)" "$raw" "1.00" "-"
for mode in at-least-once exactly-once; do
    printf '%-34s %12s %8s %9s MB\n' "outbox-forwarder $mode" "${fwd_rate[$mode]}" \
        "$(echo "scale=2; ${fwd_rate[$mode]} / $raw" | bc)" "${fwd_rss[$mode]}"
done
