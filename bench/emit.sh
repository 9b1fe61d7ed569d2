#!/usr/bin/env bash
# The cost of emit_event, measured with pgbench in one run beside its baseline.
# Each transaction inserts a business row and then:
#   (a) a plain outbox INSERT with no sequence (the baseline)
#   (b) outbox.emit_event
#   (c) outbox.emit_event with an idempotency key
# at 8 clients on distinct aggregates; then (b) on one hot aggregate at 1 and
# at 8 clients. Prints TPS and the ratios.
#   bench/emit.sh [SECONDS_PER_RUN]
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
cd "$ROOT"
SECONDS_PER_RUN=${1:-20}
eval "$("$ROOT/scripts/stack" up | sed 's/^/export /')"
DB=bench_emit
export PGPASSWORD=$PG_SUPERUSER_PASSWORD
psql_admin() { psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

psql_admin -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
psql_admin -d $DB >/dev/null <<'SQL'
CREATE EXTENSION pg_outbox;
CREATE TABLE orders (id bigserial PRIMARY KEY, customer bigint NOT NULL, total numeric NOT NULL);
CREATE TABLE plain_outbox (
    id bigserial PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
SQL

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

run() { # script clients -> tps
    psql_admin -d $DB -c "CHECKPOINT" >/dev/null
    pgbench -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -M prepared -T "$SECONDS_PER_RUN" -c "$2" -j 2 \
        -f "$dir/$1.sql" $DB 2>/dev/null | awk '/^tps/ {printf "%d", $3}'
}

say "pgbench, $SECONDS_PER_RUN s per run"
plain=$(run plain 8); say "plain INSERT, 8 clients: $plain tps"
emit=$(run emit 8); say "emit_event, 8 clients: $emit tps"
emit_key=$(run emit_key 8); say "emit_event + key, 8 clients: $emit_key tps"
hot1=$(run hot 1); say "hot aggregate, 1 client: $hot1 tps"
hot8=$(run hot 8); say "hot aggregate, 8 clients: $hot8 tps"
psql_admin -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null

ratio() { echo "scale=2; $1 / $2" | bc; }
printf '\n%-52s %8s %8s %s\n' "transaction: business INSERT plus" "tps" "ratio" "target"
printf '%-52s %8s %8s\n' "(a) plain outbox INSERT, no sequence, 8 clients" "$plain" "1.00"
printf '%-52s %8s %8s %s\n' "(b) emit_event, 8 clients" "$emit" "$(ratio "$emit" "$plain")" ">= 0.85 of (a)"
printf '%-52s %8s %8s\n' "(c) emit_event with idempotency key, 8 clients" "$emit_key" "$(ratio "$emit_key" "$plain")"
printf '%-52s %8s %8s\n' "hot aggregate, emit_event, 1 client" "$hot1" "1.00"
printf '%-52s %8s %8s %s\n' "hot aggregate, emit_event, 8 clients" "$hot8" "$(ratio "$hot8" "$hot1")" ">= 0.9 of 1 client"
