# Shared settings of the project's scripts; sourced, never run.
# Everything fetched is cached outside the work tree; runtime state lives in
# STACK_DIR, readable by the postgres user.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_DIR=${OUTBOX_CACHE_DIR:-/var/cache/pg_outbox}
STACK_DIR=${OUTBOX_STACK_DIR:-/var/tmp/pg_outbox}
PG_BIN=/usr/lib/postgresql/15/bin
PG_CONFIG=$PG_BIN/pg_config
PG_PORT=${OUTBOX_PG_PORT:-55432}
KAFKA_PORT=${OUTBOX_KAFKA_PORT:-59092}
KAFKA_CONTROLLER_PORT=${OUTBOX_KAFKA_CONTROLLER_PORT:-59093}
# A second listener with TLS and SASL/PLAIN, for the tests of secured Kafka.
KAFKA_TLS_PORT=${OUTBOX_KAFKA_TLS_PORT:-59096}
KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/scripts/kafka/pom.xml")
KAFKA_LIBS=$CACHE_DIR/kafka-$KAFKA_VERSION/libs
PGRX_VERSION=0.18.1

PG_SUPERUSER_PASSWORD=postgres
FORWARDER_ROLE=outbox_forwarder
FORWARDER_PASSWORD=forwarder
# The database owner of a managed service: CREATEROLE, not a superuser.
OWNER_ROLE=outbox_owner
OWNER_PASSWORD=owner

PGURL="postgres://postgres:$PG_SUPERUSER_PASSWORD@127.0.0.1:$PG_PORT/postgres"
FORWARDER_PGURL="postgres://$FORWARDER_ROLE:$FORWARDER_PASSWORD@127.0.0.1:$PG_PORT/postgres"
OWNER_PGURL="postgres://$OWNER_ROLE:$OWNER_PASSWORD@127.0.0.1:$PG_PORT/postgres"
KAFKA_BOOTSTRAP="127.0.0.1:$KAFKA_PORT"
KAFKA_TLS_BOOTSTRAP="localhost:$KAFKA_TLS_PORT"
KAFKA_SASL_USER=forwarder
KAFKA_SASL_PASSWORD=kafka-secret
# TLS material of the local stack: a test CA, and server certificates for
# localhost and 127.0.0.1 that PostgreSQL and the broker present.
TLS_DIR=$STACK_DIR/tls

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
