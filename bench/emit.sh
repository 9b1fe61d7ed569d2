#!/usr/bin/env bash
# The cost of emit_event, measured with pgbench in one run beside its baseline.
# Each transaction inserts a business row and then:
#   (a) a plain outbox INSERT with no sequence (the baseline)
#   (b) outbox.emit_event
#   (c) outbox.emit_event with an idempotency key
#   (b-) outbox.emit_event with pg_outbox.direct_insert off (the same build
#        running the SQL INSERT): what the executor-free insert is worth
#   (b') outbox.emit_event of the SQL edition (PL/pgSQL), in a database of
#        its own installed from sql/pg_outbox_sql.sql
#   (v)  outbox.emit_event of a realistic order (12 properties, nested
#        items) whose event type has no schema, and (v+) the same payload
#        under an event type with a registered JSON Schema (enforced):
#        what checking it costs; (v') and (v'+) the same on the SQL edition
# at 8 clients on distinct aggregates; then (b) and (b') on one hot
# aggregate at 1 and at 8 clients. Prints TPS and the ratios. The runs go in rounds, each round
# running every script once back to back, and the ratios are taken within a
# round: this VM's speed drifts by +-20% over minutes, a round's neighbours
# much less. Short runs and many rounds, with (a) first in odd rounds and
# last in even ones so that a drift within a round does not favour either
# side. The summary gives each figure's median over the rounds.
#   bench/emit.sh [SECONDS_PER_RUN] [ROUNDS]
#   bench/emit.sh --contracts [SECONDS_PER_RUN] [ROUNDS]
#       only (v), (v+), (v') and (v'+), interleaved
#   bench/emit.sh --direct-insert [SECONDS_PER_RUN] [ROUNDS]
#       only (b) and (b-), interleaved: what the executor-free insert is
#       worth, measured apart from the other scripts' effects on the VM
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
only_direct=
only_contracts=
if [ "${1:-}" = --direct-insert ]; then only_direct=1; shift; fi
if [ "${1:-}" = --contracts ]; then only_contracts=1; shift; fi
SECONDS_PER_RUN=${1:-5}
ROUNDS=${2:-11}
eval "$("$ROOT/scripts/stack" up | sed 's/^/export /')"
DB=bench_emit
SQL_DB=bench_emit_sql
export PGPASSWORD=$PG_SUPERUSER_PASSWORD
# The stack's server offers TLS; encryption would add the same cost to every
# round trip of both sides and hide what the database does.
export PGSSLMODE=disable
psql_admin() { psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

orders='CREATE TABLE orders (id bigserial PRIMARY KEY, customer bigint NOT NULL, total numeric NOT NULL);'
psql_admin -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" \
    -c "DROP DATABASE IF EXISTS $SQL_DB WITH (FORCE)" -c "CREATE DATABASE $SQL_DB OWNER $OWNER_ROLE" >/dev/null
psql_admin -d $DB >/dev/null <<SQL
CREATE EXTENSION pg_outbox;
$orders
CREATE TABLE plain_outbox (
    id bigserial PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
SQL
psql "${OWNER_PGURL%/*}/$SQL_DB" -q -f sql/pg_outbox_sql.sql
psql_admin -d $SQL_DB -c "$orders" >/dev/null
# The schema (v+) checks payloads against, in both databases.
for db in $DB $SQL_DB; do
    psql_admin -d $db -c "SELECT outbox.register_schema('order', 'OrderChecked', 1, \$\$$(cat bench/order_placed.schema.json)\$\$)" >/dev/null
done

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
business='INSERT INTO orders (customer, total) VALUES (:aid, 10);'
cat >"$dir/plain.sql" <<SQL
\\set aid random(1, 100000)
BEGIN;
$business
INSERT INTO plain_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', :aid, 'OrderPlaced', '{"total": 10}');
END;
SQL
cat >"$dir/emit.sql" <<SQL
\\set aid random(1, 100000)
BEGIN;
$business
SELECT outbox.emit_event('order', :aid::text, 'OrderPlaced', '{"total": 10}');
END;
SQL
cat >"$dir/emit_key.sql" <<SQL
\\set aid random(1, 100000)
\\set key random(1, 1000000000000)
BEGIN;
$business
SELECT outbox.emit_event('order', :aid::text, 'OrderPlaced', '{"total": 10}', idempotency_key => :key::text);
END;
SQL
cat >"$dir/hot.sql" <<SQL
\\set aid random(1, 100000)
BEGIN;
$business
SELECT outbox.emit_event('order', 'hot', 'OrderPlaced', '{"total": 10}');
END;
SQL

order_payload=$(tr -d '\n' < bench/order_placed.json)
for checked in "order OrderPlaced" "order_checked OrderChecked"; do
    set -- $checked
    cat >"$dir/$1.sql" <<SQL
\\set aid random(1, 100000)
BEGIN;
$business
SELECT outbox.emit_event('order', :aid::text, '$2', '$order_payload');
END;
SQL
done

run() { # script clients [database] -> tps
    # No CHECKPOINT here: one right before a short run charges every first
    # touch of a random B-tree page with a full-page image, which in service
    # is spread over a whole checkpoint interval (minutes).
    pgbench -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -M prepared -T "$SECONDS_PER_RUN" -c "$2" -j 2 \
        -f "$dir/$1.sql" "${3:-$DB}" 2>/dev/null | awk '/^tps/ {printf "%d", $3}'
}
# The same emit_event with the executor-free insert turned off.
run_sql_insert() { PGOPTIONS='-c pg_outbox.direct_insert=off' run "$@"; }

say "pgbench, $SECONDS_PER_RUN s per run, $ROUNDS rounds"
ratio() { echo "scale=2; $1 / $2" | bc; }
ratio3() { echo "scale=3; $1 / $2" | bc; }
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
drop_databases() {
    psql_admin -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
        -c "DROP DATABASE IF EXISTS $SQL_DB WITH (FORCE)" >/dev/null
}

if [ -n "$only_contracts" ]; then
    declare -a v vc sv svc r_v r_sv
    printf '%-6s %8s %8s %8s %8s   %s\n' round "(v)" "(v+)" "(v')" "(v'+)" "(v+)/(v) (v'+)/(v')" >&2
    for round in $(seq 1 "$ROUNDS"); do
        if (( round % 2 )); then
            a=$(run order 8); b=$(run order_checked 8); c=$(run order 8 $SQL_DB); d=$(run order_checked 8 $SQL_DB)
        else
            d=$(run order_checked 8 $SQL_DB); c=$(run order 8 $SQL_DB); b=$(run order_checked 8); a=$(run order 8)
        fi
        v+=("$a"); vc+=("$b"); sv+=("$c"); svc+=("$d"); r_v+=("$(ratio3 "$b" "$a")"); r_sv+=("$(ratio3 "$d" "$c")")
        printf '%-6s %8s %8s %8s %8s   %s %s\n' "$round" "$a" "$b" "$c" "$d" "${r_v[-1]}" "${r_sv[-1]}" >&2
    done
    drop_databases
    printf '\n%-60s %8s %8s %s\n' "emit_event of an order, 8 clients (median of $ROUNDS)" "tps" "ratio" "target"
    printf '%-60s %8s %8s\n' "(v) no schema registered for its event type" "$(median "${v[@]}")" "1.000"
    printf '%-60s %8s %8s %s\n' "(v+) checked against a registered schema" "$(median "${vc[@]}")" "$(median "${r_v[@]}")" ">= 0.8 of (v)"
    printf '%-60s %8s %8s\n' "(v') SQL edition, no schema" "$(median "${sv[@]}")" "1.000"
    printf '%-60s %8s %8s\n' "(v'+) SQL edition, checked" "$(median "${svc[@]}")" "$(median "${r_sv[@]}")"
    exit 0
fi
if [ -n "$only_direct" ]; then
    declare -a with without r_direct
    printf '%-6s %8s %8s   %s\n' round "(b)" "(b-)" "(b)/(b-)" >&2
    for round in $(seq 1 "$ROUNDS"); do
        if (( round % 2 )); then e=$(run emit 8); n=$(run_sql_insert emit 8); else n=$(run_sql_insert emit 8); e=$(run emit 8); fi
        with+=("$e"); without+=("$n"); r_direct+=("$(ratio3 "$e" "$n")")
        printf '%-6s %8s %8s   %s\n' "$round" "$e" "$n" "${r_direct[-1]}" >&2
    done
    drop_databases
    printf '\n%-60s %8s %8s %s\n' "emit_event, 8 clients (median of $ROUNDS)" "tps" "ratio" "keep it if"
    printf '%-60s %8s %8s\n' "(b-) without the executor-free insert" "$(median "${without[@]}")" "1.000"
    printf '%-60s %8s %8s %s\n' "(b) with it (the default)" "$(median "${with[@]}")" "$(median "${r_direct[@]}")" ">= 1.03"
    exit 0
fi
declare -a plain emit emit_key emit_sql_insert edition hot1 hot8 shot1 shot8
declare -a r_emit r_key r_direct r_edition r_hot r_shot
printf '%-6s %7s %7s %7s %7s %7s %7s %7s %7s %7s   %s\n' round plain emit emit+key "emit-" "emit'" \
    hot@1 hot@8 "hot'@1" "hot'@8" "ratios (b)/(a) (c)/(a) (b)/(b-) (b')/(a) hot8/hot1 hot'8/hot'1" >&2
for round in $(seq 1 "$ROUNDS"); do
    if (( round % 2 )); then
        p=$(run plain 8); e=$(run emit 8); n=$(run_sql_insert emit 8); s=$(run emit 8 $SQL_DB); k=$(run emit_key 8)
    else
        k=$(run emit_key 8); s=$(run emit 8 $SQL_DB); n=$(run_sql_insert emit 8); e=$(run emit 8); p=$(run plain 8)
    fi
    h1=$(run hot 1); h8=$(run hot 8); s1=$(run hot 1 $SQL_DB); s8=$(run hot 8 $SQL_DB)
    plain+=("$p"); emit+=("$e"); emit_key+=("$k"); emit_sql_insert+=("$n"); edition+=("$s")
    hot1+=("$h1"); hot8+=("$h8"); shot1+=("$s1"); shot8+=("$s8")
    r_emit+=("$(ratio "$e" "$p")"); r_key+=("$(ratio "$k" "$p")"); r_direct+=("$(ratio3 "$e" "$n")")
    r_edition+=("$(ratio "$s" "$p")"); r_hot+=("$(ratio "$h8" "$h1")"); r_shot+=("$(ratio "$s8" "$s1")")
    printf '%-6s %7s %7s %7s %7s %7s %7s %7s %7s %7s   %s %s %s %s %s %s\n' "$round" "$p" "$e" "$k" "$n" "$s" \
        "$h1" "$h8" "$s1" "$s8" "${r_emit[-1]}" "${r_key[-1]}" "${r_direct[-1]}" "${r_edition[-1]}" \
        "${r_hot[-1]}" "${r_shot[-1]}" >&2
done
drop_databases

printf '\n%-60s %8s %8s %s\n' "transaction: business INSERT plus (median of $ROUNDS)" "tps" "ratio" "target"
printf '%-60s %8s %8s\n' "(a) plain outbox INSERT, no sequence, 8 clients" "$(median "${plain[@]}")" "1.00"
printf '%-60s %8s %8s %s\n' "(b) emit_event, 8 clients" "$(median "${emit[@]}")" "$(median "${r_emit[@]}")" ">= 0.85 of (a)"
printf '%-60s %8s %8s\n' "(c) emit_event with idempotency key, 8 clients" "$(median "${emit_key[@]}")" "$(median "${r_key[@]}")"
printf '%-60s %8s %8s %s\n' "(b-) emit_event without the executor-free insert, 8 clients" "$(median "${emit_sql_insert[@]}")" \
    "$(median "${r_direct[@]}")" "(b)/(b-): keep it if >= 1.03"
printf '%-60s %8s %8s %s\n' "(b') SQL edition emit_event, 8 clients" "$(median "${edition[@]}")" "$(median "${r_edition[@]}")" ">= 0.75 of (a)"
printf '%-60s %8s %8s\n' "hot aggregate, emit_event, 1 client" "$(median "${hot1[@]}")" "1.00"
printf '%-60s %8s %8s %s\n' "hot aggregate, emit_event, 8 clients" "$(median "${hot8[@]}")" "$(median "${r_hot[@]}")" ">= 0.9 of 1 client"
printf '%-60s %8s %8s\n' "hot aggregate, SQL edition, 1 client" "$(median "${shot1[@]}")" "1.00"
printf '%-60s %8s %8s %s\n' "hot aggregate, SQL edition, 8 clients" "$(median "${shot8[@]}")" "$(median "${r_shot[@]}")" ">= 0.9 of 1 client"
