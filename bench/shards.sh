#!/usr/bin/env bash
# What splitting the outbox into shards does, in one run, with 1 slot (the
# publication of every event, as without shards) against 2 and 4 shards (one
# row-filtered publication and one slot per shard, all read at once):
#   decoder     pg_recvlogical per slot: the walsenders' own rate and cost
#   forwarders  an exactly-once outbox-forwarder per slot, into Kafka
# Prints the total events/s (every shard's events over the wall time until
# the last slot is done) and the CPU-seconds per million events (decoder:
# the walsenders; forwarders: walsenders, forwarders and the broker
# together), with ratios to 1 slot taken within each round.
# Every shard's walsender reads all of the WAL; only its output is its own.
# The events are outbox rows (about 200 bytes of JSON payload and a
# traceparent header, 1,000 aggregates) in transactions of 100, written
# after the slots that read them were made.
#   bench/shards.sh [EVENTS_PER_RUN] [ROUNDS]
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
EVENTS=${1:-200000}
ROUNDS=${2:-3}
. "$ROOT/bench/harness.sh"
DB=bench_shards
LAYOUTS="1 2 4"
# none: one slot whose row filter passes no event, so its walsender pays
# only what every shard pays for the other shards' events (reading the WAL,
# reassembling the transactions, evaluating the filter on every row).
DECODED_LAYOUTS="$LAYOUTS none"
cargo build -q --release -p cdc_forwarder -p pg_outbox_tests --bin outbox-forwarder --bin kafka-topics
forwarder=$ROOT/target/release/outbox-forwarder
fwd_url="postgres://$FORWARDER_ROLE:$FORWARDER_PASSWORD@127.0.0.1:$PG_PORT/$DB?sslmode=disable"
BROKER_PID=$(cat "$STACK_DIR/kafka/broker.pid")
run_id=$(date +%s)

bench_database $DB --create
psql_admin -d $DB >/dev/null <<'SQL'
SELECT outbox.ensure_publication('bench_all');
CREATE PUBLICATION bench_none FOR TABLE outbox.events WHERE (aggregate_hash < 0) WITH (publish = 'insert');
SELECT outbox.ensure_shard_publication(format('bench_%s_of_%s', i, n), i, n)
  FROM unnest(ARRAY[2, 4]) n, generate_series(0, n - 1) i;
-- The events of one run, in transactions of 100, as emit stores them.
CREATE PROCEDURE fill(events bigint) LANGUAGE plpgsql AS $$
BEGIN
    FOR b IN 0 .. events / 100 - 1 LOOP
        INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                   payload, headers, aggregate_hash)
        SELECT gen_random_uuid(), 'order', 'o-' || (i % 1000), i, 'OrderPlaced',
               format('{"order_id": %s, "customer": %s, "items": [{"sku": "SKU-%s", "qty": 2, "price": 19.99}, {"sku": "SKU-%s", "qty": 1, "price": 5.5}], "total": 45.48, "currency": "EUR", "placed_at": "2026-12-07T10:00:00Z"}',
                      i, i % 977, i % 131, i % 71)::jsonb,
               format('{"traceparent": "00-%s-%s-01"}', md5(i::text), left(md5((i + 1)::text), 16))::jsonb,
               outbox.aggregate_hash('order', 'o-' || (i % 1000))
          FROM generate_series(b * 100, b * 100 + 99) i;
        COMMIT;
    END LOOP;
END
$$;
SQL

# Decodes one run through N slots at once; prints "events/s CPU-s-per-1M".
#   run N
run() {
    local n=$1 slots=$1 i slot publication end started ended readers=() watchers=() dir cpu=0
    [ "$n" != none ] || slots=1
    dir=$(mktemp -d)
    for i in $(seq 0 $((slots - 1))); do
        psql_admin -d $DB -c "SELECT pg_create_logical_replication_slot('bench_s$i', 'pgoutput')" >/dev/null
    done
    psql_admin -d $DB -c "CALL fill($EVENTS)"
    end=$(psql_admin -d $DB -c "SELECT pg_current_wal_lsn()")
    for i in $(seq 0 $((slots - 1))); do
        walsender_ticks $DB bench_s$i "$dir/cpu$i" &
        watchers+=($!)
    done
    sleep 0.5
    started=$(date +%s.%N)
    for i in $(seq 0 $((slots - 1))); do
        slot=bench_s$i
        case $n in
            1) publication=bench_all ;;
            none) publication=bench_none ;;
            *) publication=bench_${i}_of_$n ;;
        esac
        PGPASSWORD=$PG_SUPERUSER_PASSWORD PGSSLMODE=disable "$recvlogical" -h 127.0.0.1 -p "$PG_PORT" -U postgres \
            -d $DB --slot $slot --start --no-loop -E "$end" -o proto_version=1 \
            -o publication_names=$publication -f /dev/null &
        readers+=($!)
    done
    wait "${readers[@]}"
    ended=$(date +%s.%N)
    wait "${watchers[@]}"
    for i in $(seq 0 $((slots - 1))); do
        [ -s "$dir/cpu$i" ] || die "the reader of bench_s$i: its walsender was never seen"
        cpu=$(( cpu + $(cat "$dir/cpu$i") ))
        psql_admin -d $DB -c "SELECT pg_drop_replication_slot('bench_s$i')" >/dev/null
    done
    rm -rf "$dir"
    psql_admin -d $DB -c "TRUNCATE outbox.events" >/dev/null
    awk -v e="$EVENTS" -v s="$started" -v t="$ended" -v cpu="$cpu" -v hz="$CLK_TCK" \
        'BEGIN { printf "%.0f %.2f\n", e / (t - s), cpu / hz / e * 1000000 }'
}

# The forwarder of shard I of the N-shard layout (the only one when N is 1)
# into this round's topics, in the background.
#   forward_shard N I
forward_shard() {
    local shard=()
    [ "$1" = 1 ] || shard=(--shard "$2/$1")
    "$forwarder" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --delivery exactly-once \
        --slot "bench_f$1" --publication "bench_f$1" "${shard[@]}" \
        --topic-template "bench-$run_id-$round-f$1.{aggregate_type}" 2>>"$logs/f$1_$2.log" &
}
slots_of() { if [ "$1" = 1 ]; then echo bench_f1; else seq -f "bench_f$1_%g_of_$1" 0 $(($1 - 1)); fi; }

# Forwards the N-shard layout's slots to END; prints "events/s CPU-s-per-1M
# forwarders walsenders broker" (the last three CPU-s per 1M too).
#   forward N END
forward() {
    local n=$1 end=$2 i pids=() slot slots wal=() wcpu=() started ended k0 k1 fcpu=0 total=0 w
    slots=$(slots_of "$n" | tr '\n' ' ')
    for i in $(seq 0 $((n - 1))); do forward_shard "$n" "$i"; pids+=($!); done
    for slot in $slots; do wal+=("$(walsender_pid $DB "$slot")"); done
    k0=$(process_ticks "$BROKER_PID")
    started=$(date +%s.%N)
    until [ "$(psql_admin -d $DB -c "SELECT bool_and(confirmed_flush_lsn >= '$end') FROM pg_replication_slots
                                      WHERE slot_name = ANY (string_to_array(trim('$slots'), ' '))")" = t ]; do
        for i in "${!wal[@]}"; do w=$(process_ticks "${wal[$i]}") && wcpu[$i]=$w; done
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || die "a forwarder of $n shard(s) exited: $(tail -2 "$logs"/f${n}_*.log)"; done
        sleep 0.05
    done
    ended=$(date +%s.%N)
    k1=$(process_ticks "$BROKER_PID")
    for pid in "${pids[@]}"; do fcpu=$(( fcpu + $(process_ticks "$pid") )); kill -TERM "$pid"; done
    wait "${pids[@]}" || true
    for w in "${wcpu[@]}"; do total=$(( total + w )); done
    awk -v e="$EVENTS" -v s="$started" -v t="$ended" -v f="$fcpu" -v w="$total" -v k="$(( k1 - k0 ))" -v hz="$CLK_TCK" \
        'BEGIN { m = 1000000 / e / hz; printf "%.0f %.2f %.2f %.2f %.2f\n", e / (t - s), (f + w + k) * m, f * m, w * m, k * m }'
}

declare -A rate cpu
results=$(mktemp)
say "decoding $EVENTS outbox events per run through 1, 2 and 4 shards, $ROUNDS rounds, PostgreSQL $PG_VERSION, $(nproc) cores"
for round in $(seq 1 "$ROUNDS"); do
    for n in $(in_round_order "$round" "$DECODED_LAYOUTS"); do
        read -r r c < <(run "$n")
        rate[$n]=$r cpu[$n]=$c
        printf '  round %s  %s shard(s) %8s events/s  %6s walsender CPU-s per 1M events\n' "$round" "$n" "$r" "$c"
    done
    for n in $DECODED_LAYOUTS; do rounds_line "$n" "${rate[$n]}" "${cpu[$n]}" "${rate[1]}" "${cpu[1]}" >>"$results"; done
done

echo
decoded=$results

logs=$(mktemp -d)
results=$(mktemp)
say "forwarding $EVENTS outbox events per run exactly once through 1, 2 and 4 shards, $ROUNDS rounds"
# Each layout's slots are made (and their empty catch-up done) before any
# events, so that every layout reads the same WAL from its slots.
psql_admin -d $DB -c "TRUNCATE outbox.events" >/dev/null
for n in $LAYOUTS; do
    pids=()
    for i in $(seq 0 $((n - 1))); do round=0 forward_shard "$n" "$i"; pids+=($!); done
    until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM outbox.relay_progress WHERE slot_name LIKE 'bench\_f$n%' AND caught_up_at IS NOT NULL")" = "$n" ]; do
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || die "a forwarder of $n shard(s) ended before its slot was ready: $(tail -2 "$logs"/f${n}_*.log)"; done
        sleep 0.1
    done
    kill -TERM "${pids[@]}"; wait "${pids[@]}" || true
done
for round in $(seq 1 "$ROUNDS"); do
    psql_admin -d $DB -c "CALL fill($EVENTS)"
    end=$(psql_admin -d $DB -c "SELECT pg_current_wal_lsn()")
    for n in $(in_round_order "$round" "$LAYOUTS"); do
        read -r r c f w k < <(forward "$n" "$end")
        rate[$n]=$r cpu[$n]=$c
        printf '  round %s  %s shard(s) %8s events/s  %6s CPU-s per 1M events (forwarders %s, walsenders %s, broker %s)\n' \
            "$round" "$n" "$r" "$c" "$f" "$w" "$k"
    done
    for n in $LAYOUTS; do rounds_line "$n" "${rate[$n]}" "${cpu[$n]}" "${rate[1]}" "${cpu[1]}" >>"$results"; done
    psql_admin -d $DB -c "TRUNCATE outbox.events" >/dev/null
    bench_topics_drop "bench-$run_id-$round-"
done

echo
echo "medians over $ROUNDS rounds ($EVENTS events a run; ratios to 1 slot within each round), PostgreSQL $PG_VERSION, $(nproc) cores"
echo "decoder (pg_recvlogical; CPU: the walsenders)"
median_table "$decoded" "$DECODED_LAYOUTS" shards "1"
# What a machine with a core per shard's walsender would decode: each
# walsender pays, per event in the WAL, the share f of one slot's cost that
# the none slot measured, and the rest only for its own 1/S of the events.
f=$(awk '$1 == "none" { print $5 }' "$decoded" | median)
one=$(awk '$1 == 1 { print $2 }' "$decoded" | median)
echo "  a walsender pays $f of one slot's CPU per event for the events of other shards; with a core per shard's walsender:"
for s in 4 8 16; do
    awk -v f="$f" -v r="$one" -v s="$s" 'BEGIN { printf "    %2d shards: about %.0f events/s (%.1fx one slot)\n", s, r / (f + (1 - f) / s), 1 / (f + (1 - f) / s) }'
done
echo "forwarders (exactly once into Kafka; CPU: forwarders, walsenders and the broker)"
median_table "$results" "$LAYOUTS" shards "1"
rm -rf "$decoded" "$results" "$logs"
bench_database $DB
