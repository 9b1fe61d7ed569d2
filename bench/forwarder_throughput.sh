#!/usr/bin/env bash
# Forwarder throughput on a backlog, beside the raw decoding rate of the same
# kind of slot (pg_recvlogical, pgoutput, to /dev/null), in one run, for
# several transaction shapes.
#
#   bench/forwarder_throughput.sh [--shapes "EVENTSxPER_TXN ..."] [--rounds N]
#                                 [--tls] [--baseline GIT_REV]
#
# Default shapes: 1000000x100 100000x1 1000000x10000 (events x events per
# transaction); payloads of about 330 bytes. Each round writes each shape's
# backlog once, with a slot per contender created before it, then drains
# every slot in turn: time from the slot turning active to its confirmed
# position reaching the backlog's end.
# Prints per contender: events/s, ratio to pg_recvlogical, CPU seconds per
# million events of the contender, of its walsender and of the Kafka broker,
# and peak RSS; with several rounds, the median of each figure, each round's
# events/s, and each round's ratio to at-least-once with their median (the
# contenders of one round drain the same backlog minutes apart at most).
# --tls: every contender connects with sslmode=require (default: disable).
# --baseline REV: also runs the forwarder built from REV (a worktree under
# target/), so a change is measured with and without it in the same run.
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
SHAPES="1000000x100 100000x1 1000000x10000"
ROUNDS=1
SSLMODE=disable
BASELINE=
while [ $# -gt 0 ]; do
    case $1 in
        --shapes) SHAPES=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --tls) SSLMODE=require; shift ;;
        --baseline) BASELINE=$2; shift 2 ;;
        *) die "unknown argument $1 (see the header of $0)" ;;
    esac
done

cargo build -q --release -p cdc_forwarder -p pg_outbox_tests --bin outbox-forwarder --bin kafka-topics
. "$ROOT/bench/harness.sh"
forwarder_contenders "$BASELINE"
FORWARDERS=($CONTENDERS)
CONTENDERS="raw $CONTENDERS"
# The broker the stack started (scripts/stack keeps its pid).
BROKER_PID=$(cat "$STACK_DIR/kafka/broker.pid")

DB=bench_tp
fwd_url="postgres://$FORWARDER_ROLE:$FORWARDER_PASSWORD@127.0.0.1:$PG_PORT/$DB?sslmode=$SSLMODE"
run_id=$(date +%s)
now() { date +%s.%N; }
# CPU seconds of a process so far (user + system).
cpu_of() { awk -v t="$CLK_TCK" '{printf "%.3f", ($14 + $15) / t}' "/proc/$1/stat" 2>/dev/null || echo 0; }
slot_of() { echo "bench_${1//-/_}"; }
mode_of() { echo "${1#base-}"; }

# One contender's drain of its slot. Sets RATE CPU WCPU KCPU RSS.
drain() {
    local who=$1 events=$2 end_lsn=$3 slot pid wpid="" wcpu=0 t0 t1 k0
    slot=$(slot_of "$who")
    if [ "$who" = raw ]; then
        PGPASSWORD=$PG_SUPERUSER_PASSWORD PGSSLMODE=$SSLMODE /usr/bin/time -f '%U %S %M' -o /tmp/bench-raw.time \
            pg_recvlogical -h 127.0.0.1 -p "$PG_PORT" -U postgres -d $DB --slot "$slot" --start \
            -o proto_version=1 -o publication_names=pg_outbox -E "$end_lsn" -f /dev/null --no-loop &
    else
        "${BIN[$who]}" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot "$slot" \
            --delivery "$(mode_of "$who")" --topic-template "bench-$run_id-$round-$shape-$slot.{aggregate_type}" 2>/tmp/bench-$slot.log &
    fi
    pid=$!
    until wpid=$(psql_admin -d $DB -c "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '$slot'") && [ -n "$wpid" ]; do
        kill -0 $pid 2>/dev/null || die "$who exited before streaming: $(tail -3 /tmp/bench-$slot.log 2>/dev/null)"
        sleep 0.02
    done
    TLS_IN_USE=$(psql_admin -d $DB -c "SELECT coalesce(bool_or(ssl)::text, '?') FROM pg_stat_ssl WHERE pid = $wpid")
    k0=$(cpu_of "$BROKER_PID")
    t0=$(now)
    # pg_recvlogical stops by itself at the end; a forwarder when its slot
    # has confirmed the end.
    while if [ "$who" = raw ]; then kill -0 $pid 2>/dev/null
          else [ "$(psql_admin -d $DB -c "SELECT confirmed_flush_lsn < '$end_lsn' FROM pg_replication_slots WHERE slot_name = '$slot'")" = t ]; fi; do
        [ "$who" = raw ] || kill -0 $pid 2>/dev/null || die "$who exited: $(tail -3 /tmp/bench-$slot.log)"
        wcpu=$(cpu_of "$wpid")
        sleep 0.05
    done
    t1=$(now)
    KCPU=$(echo "$(cpu_of "$BROKER_PID") - $k0" | bc)
    RATE=$(echo "scale=0; $events / ($t1 - $t0)" | bc)
    WCPU=$wcpu
    if [ "$who" = raw ]; then
        wait $pid || true
        read -r u s kb < /tmp/bench-raw.time
        CPU=$(echo "$u + $s" | bc); RSS=$(( kb / 1024 ))
    else
        CPU=$(cpu_of $pid); RSS=$(awk '/VmHWM/ {print int($2/1024)}' /proc/$pid/status)
        kill -TERM $pid; wait $pid || true
    fi
}

# Drains contender $1's slot of the current shape's backlog and records its figures.
drain_one() {
    local who=$1 key="$shape $1"
    say "$shape: $who"
    drain "$who" "$EVENTS" "$end_lsn"
    rate[$key]="${rate[$key]:-} $RATE"
    cpu[$key]="${cpu[$key]:-} $(echo "scale=2; $CPU * 1000000 / $EVENTS" | bc)"
    wcpu[$key]="${wcpu[$key]:-} $(echo "scale=2; $WCPU * 1000000 / $EVENTS" | bc)"
    kcpu[$key]="${kcpu[$key]:-} $(echo "scale=2; $KCPU * 1000000 / $EVENTS" | bc)"
    rss[$key]="${rss[$key]:-} $RSS"
    transport=$TLS_IN_USE
}

declare -A rate cpu wcpu kcpu rss
for round in $(seq 1 "$ROUNDS"); do
  for shape in $SHAPES; do
    EVENTS=${shape%x*}; PER_TXN=${shape#*x}; TXNS=$(( EVENTS / PER_TXN ))
    say "round $round, $shape: fresh database $DB, a slot per contender"
    bench_database $DB --create
    psql_admin -d $DB -c "SELECT outbox.ensure_publication('pg_outbox')" >/dev/null
    psql_admin -d $DB -c "SELECT pg_create_logical_replication_slot('$(slot_of raw)', 'pgoutput')" >/dev/null
    # The forwarders create their slots (and finish their empty catch-up) before the backlog.
    for who in $CONTENDERS; do
        [ "$who" = raw ] && continue
        slot=$(slot_of "$who")
        "${BIN[$who]}" run --postgres-url "$fwd_url" --kafka-bootstrap "$KAFKA_BOOTSTRAP" --slot "$slot" \
            --delivery "$(mode_of "$who")" --topic-template "bench-$run_id-$round-$shape-$slot.{aggregate_type}" 2>/dev/null &
        pid=$!
        until [ "$(psql_admin -d $DB -c "SELECT count(*) FROM outbox.relay_progress WHERE slot_name = '$slot' AND caught_up_at IS NOT NULL")" = 1 ]; do
            kill -0 $pid 2>/dev/null || die "the $who forwarder ended before its slot was ready (run it by hand to see why)"
            sleep 0.1
        done
        kill -TERM $pid; wait $pid || true
    done

    say "backlog: $EVENTS events in $TXNS transactions of $PER_TXN"
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
    # pg_recvlogical first, then the forwarders in an order that turns each
    # round, so none is always drained right after a backlog is written.
    drain_one raw
    for i in "${!FORWARDERS[@]}"; do
        drain_one "${FORWARDERS[$(( (i + round - 1) % ${#FORWARDERS[@]} ))]}"
    done
    bench_topics_drop "bench-$run_id-$round-$shape-"
  done
done

bench_database $DB

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
# The ratio of two contenders' rates round by round: $1 and $2 drained the
# same backlog in each round, a few seconds apart, so the VM's drift between
# rounds leaves it alone.
per_round() { paste -d' ' <(echo $1 | tr ' ' '\n') <(echo $2 | tr ' ' '\n') | awk '{printf "%.2f ", $1 / $2}'; }
printf '\nforwarder at %s; %s round(s), medians; replication over TLS: %s (sslmode=%s)\n' "$MEASURED" "$ROUNDS" "$transport" "$SSLMODE"
for shape in $SHAPES; do
    raw=$(echo "${rate[$shape raw]}" | median)
    alo=$(echo "${rate[$shape at-least-once]}" | median)
    printf '\n%-30s %10s %8s %8s %12s %12s %8s %8s  %-30s %s\n' "$shape (events x per txn)" "events/s" "/raw" "/alo" "CPU-s/M" "walsender" "broker" "RSS MB" "events/s of each round" "/alo in each round (median)"
    for who in $CONTENDERS; do
        r=$(echo "${rate[$shape $who]}" | median)
        paired=$(per_round "${rate[$shape $who]}" "${rate[$shape at-least-once]}")
        printf '%-30s %10s %8.2f %8.2f %12s %12s %8s %8s  %-30s %s (%s)\n' "$who" "$r" \
            "$(echo "scale=3; $r / $raw" | bc)" "$(echo "scale=3; $r / $alo" | bc)" \
            "$(echo "${cpu[$shape $who]}" | median)" "$(echo "${wcpu[$shape $who]}" | median)" "$(echo "${kcpu[$shape $who]}" | median)" \
            "$(echo "${rss[$shape $who]}" | median)" "$(echo ${rate[$shape $who]} | tr ' ' ',')" \
            "$(echo $paired | tr ' ' ',')" "$(echo "$paired" | median)"
    done
done
