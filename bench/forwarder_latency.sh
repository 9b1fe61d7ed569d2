#!/usr/bin/env bash
# Commit-to-Kafka latency at a fixed rate of single-event transactions, for
# each delivery mode, in one run.
#
#   bench/forwarder_latency.sh [--rate N] [--seconds S] [--baseline GIT_REV]
#
# Defaults: 1,000 transactions per second for 45 s, the first 5 s left out
# of the figures (new topic, leaders, group join). Topics use
# message.timestamp.type=LogAppendTime. Printed in milliseconds:
# - append: Kafka's append time minus the database clock in the payload
#   (in exactly-once mode this comes before the Kafka commit);
# - receive: when a live read_committed consumer got it, minus that clock
#   (what a consumer sees; in exactly-once mode it includes the commit).
# --baseline REV: also runs the forwarder built from REV (see
# bench/forwarder_throughput.sh).
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
RATE=1000
SECONDS_=45
BASELINE=
while [ $# -gt 0 ]; do
    case $1 in
        --rate) RATE=$2; shift 2 ;;
        --seconds) SECONDS_=$2; shift 2 ;;
        --baseline) BASELINE=$2; shift 2 ;;
        *) die "unknown argument $1 (see the header of $0)" ;;
    esac
done

cargo build -q --release -p cdc_forwarder -p pg_outbox_tests --bin outbox-forwarder --bin latency-probe --bin kafka-topics
PROBE=$ROOT/target/release/latency-probe
. "$ROOT/bench/harness.sh"
forwarder_contenders "$BASELINE"

DB=bench_lat
run_id=$(date +%s)
declare -A line
for who in $CONTENDERS; do
    slot=bench_${who//-/_}
    say "$who: $RATE transactions/s for $SECONDS_ s"
    bench_database $DB --create
    topic_prefix="lat-$run_id-$slot"
    "${BIN[$who]}" run --postgres-url "postgres://$FORWARDER_ROLE:$FORWARDER_PASSWORD@127.0.0.1:$PG_PORT/$DB?sslmode=disable" \
        --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot "$slot" --delivery "${who#base-}" \
        --topic-template "$topic_prefix.{aggregate_type}" 2>/tmp/bench-$slot.log &
    pid=$!
    until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$slot' AND active")" = 1 ]; do
        kill -0 $pid 2>/dev/null || die "$who exited: $(tail -3 /tmp/bench-$slot.log)"
        sleep 0.1
    done
    line[$who]=$("$PROBE" "postgres://postgres:$PG_SUPERUSER_PASSWORD@127.0.0.1:$PG_PORT/$DB?sslmode=disable" \
        "$KAFKA_BOOTSTRAP" "$topic_prefix.lat" "$RATE" "$SECONDS_")
    kill -TERM $pid; wait $pid || true
done
bench_database $DB
bench_topics_drop "lat-$run_id-"

printf '\nforwarder at %s; %s single-event transactions/s for %s s; milliseconds\n' "$MEASURED" "$RATE" "$SECONDS_"
for who in $CONTENDERS; do
    printf '%-20s %s\n' "$who" "${line[$who]}"
done
