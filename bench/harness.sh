# Sourced by the benches that need the stack: starts it (idempotently) and
# exports its settings.

eval "$("$ROOT/scripts/stack" up | sed 's/^/export /')"
CLK_TCK=$(getconf CLK_TCK)
recvlogical=$("$PG_CONFIG" --bindir)/pg_recvlogical

psql_admin() { PGPASSWORD=$PG_SUPERUSER_PASSWORD PGSSLMODE=disable psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

# Drops the benches' slots and database DB; with --create, makes DB anew with
# the extension in it.
#   bench_database DB [--create]
bench_database() {
    psql_admin -d postgres >/dev/null <<SQL
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'bench\_%';
DROP DATABASE IF EXISTS $1 WITH (FORCE);
SQL
    if [ "${2:-}" = --create ]; then
        psql_admin -d postgres -c "CREATE DATABASE $1" >/dev/null
        psql_admin -d "$1" -c "CREATE EXTENSION pg_outbox" >/dev/null
        # The database's own relay role, which the forwarder needs there.
        psql_admin -d "$1" -c "GRANT $1_outbox_relay TO $FORWARDER_ROLE" >/dev/null
    fi
}

# Deletes the Kafka topics whose names start with PREFIX (a run's own): a
# throughput run writes gigabytes that the broker would otherwise keep for
# its retention time, and a broker holding them costs later runs CPU.
# Needs target/release/kafka-topics (pg_outbox_tests).
#   bench_topics_drop PREFIX
bench_topics_drop() {
    "$ROOT/target/release/kafka-topics" "$KAFKA_BOOTSTRAP" drop "$1" >/dev/null
}

# The forwarders to measure. Sets BIN
# (contender -> binary), CONTENDERS (at-least-once exactly-once, plus
# base-at-least-once base-exactly-once with a baseline) and MEASURED (the
# commit measured). A baseline is the forwarder built from another git
# revision in a worktree under target/, so that a change is measured with
# and without it in the same run.
#   forwarder_contenders [BASELINE_REV]
declare -A BIN
forwarder_contenders() {
    local fwd=$ROOT/target/release/outbox-forwarder rev tree
    BIN=([at-least-once]=$fwd [exactly-once]=$fwd)
    CONTENDERS="at-least-once exactly-once"
    # Before the baseline's build, which takes minutes: HEAD may move meanwhile.
    MEASURED="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- cdc_forwarder || echo '+changes')"
    if [ -n "${1:-}" ]; then
        rev=$(git rev-parse --short "$1")
        tree=$ROOT/target/baseline-$rev
        if [ ! -x "$tree/target/release/outbox-forwarder" ]; then
            say "building the baseline forwarder at $rev"
            [ -d "$tree" ] || git worktree add --detach "$tree" "$rev" >/dev/null
            (cd "$tree" && cargo build -q --release -p cdc_forwarder)
        fi
        BIN[base-at-least-once]=$tree/target/release/outbox-forwarder
        BIN[base-exactly-once]=$tree/target/release/outbox-forwarder
        CONTENDERS="$CONTENDERS base-at-least-once base-exactly-once"
    fi
}

# The median of the numbers on stdin, one a line.
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# Prints the medians of a rounds file whose lines read "KEY RATE CPU
# RATE_RATIO CPU_RATIO", one row per key in KEYS, under a header naming the
# keys' column and the baseline the ratios are to.
#   median_table FILE KEYS KEY_COLUMN BASELINE
median_table() {
    local key
    printf '%-13s %10s %8s %22s %8s\n' "$3" events/s "x $4" "CPU-s per 1M events" "x $4"
    for key in $2; do
        printf '%-13s %10s %8s %22s %8s\n' "$key" \
            "$(awk -v k="$key" '$1 == k { print $2 }' "$1" | median)" \
            "$(awk -v k="$key" '$1 == k { print $4 }' "$1" | median)" \
            "$(awk -v k="$key" '$1 == k { print $3 }' "$1" | median)" \
            "$(awk -v k="$key" '$1 == k { print $5 }' "$1" | median)"
    done
}

# The CPU ticks (user and system) of process PID so far; fails once it is gone.
process_ticks() { local stat; read -r -a stat 2>/dev/null <"/proc/$1/stat" && echo $(( stat[13] + stat[14] )); }

# The pid of slot SLOT's walsender, once it has one (waiting in database DB
# for 60 s at most; nothing if none came).
#   walsender_pid DB SLOT
walsender_pid() {
    psql_admin -d "$1" <<SQL
CREATE FUNCTION pg_temp.walsender_of(slot text) RETURNS integer LANGUAGE plpgsql AS \$\$
DECLARE pid integer;
BEGIN
    FOR attempt IN 1 .. 60000 LOOP
        SELECT active_pid INTO pid FROM pg_replication_slots WHERE slot_name = slot;
        EXIT WHEN pid IS NOT NULL;
        PERFORM pg_sleep(0.001);
    END LOOP;
    RETURN pid;
END
\$\$;
SELECT pg_temp.walsender_of('$2');
SQL
}

# Writes to FILE the CPU ticks that slot SLOT's walsender spent by the time
# it exited, or nothing if it never came. Start it, in the background,
# before the slot's reader: its wait is then already polling when the
# reader connects, however short the read.
#   walsender_ticks DB SLOT FILE
walsender_ticks() {
    local pid ticks=0 now
    pid=$(walsender_pid "$1" "$2")
    [ -n "$pid" ] || { : >"$3"; return; }
    while now=$(process_ticks "$pid"); do
        ticks=$now
        sleep 0.02
    done
    echo "$ticks" >"$3"
}

# LIST (words) in the order of round ROUND: turned every other round, so
# that no contender always runs first.
#   in_round_order ROUND LIST
in_round_order() { if [ $(($1 % 2)) = 0 ]; then tr ' ' '\n' <<<"$2" | tac | tr '\n' ' '; else echo "$2"; fi; }

# A line of a rounds file for median_table: "KEY RATE CPU RATE/BASE_RATE
# CPU/BASE_CPU".
#   rounds_line KEY RATE CPU BASE_RATE BASE_CPU
rounds_line() {
    echo "$1 $2 $3 $(awk -v a="$2" -v b="$4" 'BEGIN { printf "%.2f", a / b }')" \
        "$(awk -v a="$3" -v b="$5" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "nan" }')"
}
