#!/usr/bin/env bash
# Polling relays beside the slot, in one run:
#   1. throughput: a backlog of EVENTS events (transactions of 10 over 1,000
#      aggregates) drained by the slot forwarder (at-least-once), by one
#      polling relay and by two; the same pending set is put back before
#      each polling drain. Time: from the slot turning active, or from the
#      first lease, until the slot confirmed the backlog's end, or nothing
#      is pending. CPU seconds per million events of the relays.
#   2. latency at a fixed rate of single-event transactions (latency-probe:
#      Kafka append time and a live consumer's receive time minus the
#      commit-time clock in the payload), slot, one polling relay and two,
#      with the default poll interval.
#   3. what the pending bookkeeping costs emit_event: pgbench, a business
#      INSERT plus emit_event at 8 clients, polling off and on in
#      alternating order over rounds; the ratio is taken within a round.
#
#   bench/polling.sh [--events N] [--rate N] [--seconds S] [--rounds N]
#
# Defaults: 200,000 events; 1,000 transactions/s for 30 s (the first 5 s
# left out); 7 rounds of 5 s per emit run.
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
EVENTS=200000
RATE=1000
SECONDS_=30
ROUNDS=7
while [ $# -gt 0 ]; do
    case $1 in
        --events) EVENTS=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --seconds) SECONDS_=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        *) die "unknown argument $1 (see the header of $0)" ;;
    esac
done

cargo build -q --release -p cdc_forwarder -p pg_outbox_tests --bin outbox-forwarder --bin latency-probe --bin kafka-topics
FWD=$ROOT/target/release/outbox-forwarder
PROBE=$ROOT/target/release/latency-probe
. "$ROOT/bench/harness.sh"
MEASURED="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- cdc_forwarder pg_ext || echo '+changes')"

DB=bench_poll
SLOT=bench_poll_slot
fwd_url="postgres://$FORWARDER_ROLE:$FORWARDER_PASSWORD@127.0.0.1:$PG_PORT/$DB?sslmode=disable"
run_id=$(date +%s)
now() { date +%s.%N; }
cpu_of() { awk -v t="$CLK_TCK" '{printf "%.3f", ($14 + $15) / t}' "/proc/$1/stat" 2>/dev/null || echo 0; }
pending() { psql_admin -d $DB -c "SELECT pending_events FROM outbox.poll_status()"; }

# --- 1. throughput -----------------------------------------------------------
say "throughput: fresh database $DB with polling on, the slot made before the backlog"
bench_database $DB --create
psql_admin -d $DB -c "SELECT outbox.enable_polling()" >/dev/null
"$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot $SLOT \
    --topic-template "pollbench-$run_id-slot.{aggregate_type}" 2>/dev/null &
pid=$!
until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM outbox.relay_progress WHERE slot_name = '$SLOT' AND caught_up_at IS NOT NULL")" = 1 ]; do sleep 0.1; done
kill -TERM $pid; wait $pid || true

TXNS=$(( EVENTS / 10 ))
say "backlog: $EVENTS events in $TXNS transactions of 10"
psql_admin -d $DB >/dev/null <<SQL
DO \$\$
BEGIN
    FOR t IN 1..$TXNS LOOP
        PERFORM outbox.emit_event('bench', 'agg-' || ((t * 10 + g) % 1000), 'Measured',
                jsonb_build_object('n', g, 'pad', repeat('x', 280)))
          FROM generate_series(1, 10) g;
        COMMIT;
    END LOOP;
END
\$\$;
CREATE TABLE public.pending_copy AS SELECT * FROM outbox.pending;
ANALYZE outbox.events;
SQL
end_lsn=$(psql_admin -d $DB -c "SELECT pg_current_wal_lsn()")

declare -A rate cpu rss
say "drain: slot (at-least-once)"
"$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot $SLOT \
    --topic-template "pollbench-$run_id-slot.{aggregate_type}" 2>/tmp/bench-poll-slot.log &
pid=$!
until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$SLOT' AND active")" = 1 ]; do sleep 0.02; done
t0=$(now)
while [ "$(psql_admin -d $DB -c "SELECT confirmed_flush_lsn < '$end_lsn' FROM pg_replication_slots WHERE slot_name = '$SLOT'")" = t ]; do
    kill -0 $pid 2>/dev/null || die "the slot forwarder exited: $(tail -3 /tmp/bench-poll-slot.log)"
    sleep 0.05
done
t1=$(now)
rate[slot]=$(echo "scale=0; $EVENTS / ($t1 - $t0)" | bc)
cpu[slot]=$(echo "scale=2; $(cpu_of $pid) * 1000000 / $EVENTS" | bc)
rss[slot]=$(awk '/VmHWM/ {print int($2/1024)}' /proc/$pid/status)
kill -TERM $pid; wait $pid || true
psql_admin -d $DB -c "SELECT pg_drop_replication_slot('$SLOT')" >/dev/null

for relays in 1 2; do
    who="poll x$relays"
    say "drain: $relays polling relay(s)"
    psql_admin -d $DB -c "TRUNCATE outbox.pending, outbox.poll_leases" -c "INSERT INTO outbox.pending SELECT * FROM public.pending_copy" -c "VACUUM ANALYZE outbox.pending" >/dev/null
    pids=()
    for r in $(seq 1 $relays); do
        "$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --source poll \
            --relay-name "bench-$r" --topic-template "pollbench-$run_id-poll$relays.{aggregate_type}" \
            2>/tmp/bench-poll-$r.log &
        pids+=($!)
    done
    until [ "$(psql_admin -d $DB -c "SELECT count(*) > 0 FROM outbox.poll_leases")" = t ]; do sleep 0.02; done
    t0=$(now)
    while [ "$(pending)" != 0 ]; do
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || die "a relay exited: $(tail -3 /tmp/bench-poll-1.log)"; done
        sleep 0.05
    done
    t1=$(now)
    rate[$who]=$(echo "scale=0; $EVENTS / ($t1 - $t0)" | bc)
    c=0; m=0
    for p in "${pids[@]}"; do
        c=$(echo "$c + $(cpu_of "$p")" | bc)
        m=$(( $(awk '/VmHWM/ {print int($2/1024)}' /proc/$p/status) > m ? $(awk '/VmHWM/ {print int($2/1024)}' /proc/$p/status) : m ))
    done
    cpu[$who]=$(echo "scale=2; $c * 1000000 / $EVENTS" | bc)
    rss[$who]=$m
    for p in "${pids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
done

# --- 2. latency ----------------------------------------------------------------
declare -A lat
for who in slot "poll x1" "poll x2"; do
    say "latency: $who, $RATE transactions/s for $SECONDS_ s"
    bench_database $DB --create
    psql_admin -d $DB -c "SELECT outbox.enable_polling()" >/dev/null
    prefix="pollbench-lat-$run_id-${who// /}"
    pids=()
    if [ "$who" = slot ]; then
        "$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot $SLOT \
            --topic-template "$prefix.{aggregate_type}" 2>/tmp/bench-poll-lat.log &
        pids+=($!)
        until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$SLOT' AND active")" = 1 ]; do sleep 0.1; done
    else
        for r in $(seq 1 "${who#poll x}"); do
            "$FWD" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --source poll \
                --relay-name "lat-$r" --topic-template "$prefix.{aggregate_type}" 2>/tmp/bench-poll-lat-$r.log &
            pids+=($!)
        done
        sleep 1
    fi
    lat[$who]=$("$PROBE" "postgres://postgres:$PG_SUPERUSER_PASSWORD@127.0.0.1:$PG_PORT/$DB?sslmode=disable" \
        "$KAFKA_BOOTSTRAP" "$prefix.lat" "$RATE" "$SECONDS_")
    for p in "${pids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
done
bench_database $DB

# --- 3. emit_event with and without pending bookkeeping ------------------------
say "emit_event, polling off and on: pgbench, 5 s per run, $ROUNDS rounds"
bench_database $DB --create
psql_admin -d $DB -c "CREATE TABLE orders (id bigserial PRIMARY KEY, customer bigint NOT NULL, total numeric NOT NULL)" >/dev/null
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/emit.sql" <<SQL
\\set aid random(1, 100000)
BEGIN;
INSERT INTO orders (customer, total) VALUES (:aid, 10);
SELECT outbox.emit_event('order', :aid::text, 'OrderPlaced', '{"total": 10}');
END;
SQL
tps() {
    PGPASSWORD=$PG_SUPERUSER_PASSWORD PGSSLMODE=disable pgbench -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -M prepared \
        -T 5 -c 8 -j 2 -f "$dir/emit.sql" $DB 2>/dev/null | awk '/^tps/ {printf "%d", $3}'
}
polling() { psql_admin -d $DB -c "SET client_min_messages = warning" -c "SELECT outbox.$1_polling()" >/dev/null; }
off_runs=(); on_runs=(); ratios=()
for round in $(seq 1 "$ROUNDS"); do
    if (( round % 2 )); then
        polling disable; off=$(tps); polling enable; on=$(tps)
    else
        polling enable; on=$(tps); polling disable; off=$(tps)
    fi
    off_runs+=("$off"); on_runs+=("$on"); ratios+=("$(echo "scale=3; $on / $off" | bc)")
    printf 'round %s: off %s tps, on %s tps, %s\n' "$round" "$off" "$on" "${ratios[-1]}" >&2
done
bench_database $DB
bench_topics_drop "pollbench-$run_id-"
bench_topics_drop "pollbench-lat-$run_id-"
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

printf '\npg_outbox at %s; polling relays beside the slot\n' "$MEASURED"
printf '\n%-34s %10s %8s %10s %8s\n' "$EVENTS events backlog (10 per txn)" "events/s" "/slot" "CPU-s/M" "RSS MB"
for who in slot "poll x1" "poll x2"; do
    printf '%-34s %10s %8.2f %10s %8s\n' "$who" "${rate[$who]}" "$(echo "scale=3; ${rate[$who]} / ${rate[slot]}" | bc)" "${cpu[$who]}" "${rss[$who]}"
done
printf '\nlatency, %s single-event transactions/s for %s s, milliseconds (default poll interval)\n' "$RATE" "$SECONDS_"
for who in slot "poll x1" "poll x2"; do printf '%-10s %s\n' "$who" "${lat[$who]}"; done
printf '\nemit_event + business INSERT, 8 clients, median of %s rounds\n' "$ROUNDS"
printf '%-34s %10s %8s\n' "polling off (slot only)" "$(median "${off_runs[@]}")" "1.00"
printf '%-34s %10s %8s\n' "polling on (pending row by trigger)" "$(median "${on_runs[@]}")" "$(median "${ratios[@]}")"
