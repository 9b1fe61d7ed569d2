#!/usr/bin/env bash
# Starts PostgreSQL the way the official postgres image does, for an image
# made from Debian's packages where no registry can be reached:
#   POSTGRES_PASSWORD   the superuser's password (required unless
#                       POSTGRES_HOST_AUTH_METHOD=trust)
#   POSTGRES_USER       the superuser (postgres)
#   POSTGRES_DB         a database made at the first start (POSTGRES_USER)
#   POSTGRES_INITDB_ARGS, POSTGRES_HOST_AUTH_METHOD (scram-sha-256)
#   /docker-entrypoint-initdb.d/*.sh, *.sql   run once, in name order, on a
#                       server that listens on its socket only
# Arguments that start with '-' are the server's: `postgres -c ...`.
set -Eeuo pipefail

[ "${1:0:1}" = - ] && set -- postgres "$@"
if [ "$1" != postgres ]; then exec "$@"; fi

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$BASH_SOURCE" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_USER:=postgres}"
    : "${POSTGRES_DB:=$POSTGRES_USER}"
    : "${POSTGRES_HOST_AUTH_METHOD:=scram-sha-256}"
    if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$POSTGRES_HOST_AUTH_METHOD" != trust ]; then
        echo "error: the database is not initialised and POSTGRES_PASSWORD is not set; set it, or POSTGRES_HOST_AUTH_METHOD=trust to allow every connection without one" >&2
        exit 1
    fi
    # shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a list of flags
    initdb -D "$PGDATA" --username="$POSTGRES_USER" --auth-local=trust \
        --pwfile=<(printf '%s\n' "${POSTGRES_PASSWORD:-}") ${POSTGRES_INITDB_ARGS:-} >/dev/null
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    echo "host all all all $POSTGRES_HOST_AUTH_METHOD" >>"$PGDATA/pg_hba.conf"

    pg_ctl -D "$PGDATA" -w -s -o "-c listen_addresses=''" start
    psql=(psql -v ON_ERROR_STOP=1 -X -q --username "$POSTGRES_USER" --dbname postgres)
    if [ "$POSTGRES_DB" != postgres ]; then
        "${psql[@]}" -c "CREATE DATABASE \"$POSTGRES_DB\""
    fi
    export POSTGRES_USER POSTGRES_DB
    for f in /docker-entrypoint-initdb.d/*; do
        case $f in
            *.sh) if [ -x "$f" ]; then "$f"; else . "$f"; fi ;;
            *.sql) "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
            *.sql.gz) gunzip -c "$f" | "${psql[@]}" --dbname "$POSTGRES_DB" ;;
            *) [ -e "$f" ] && echo "ignoring $f" ;;
        esac
    done
    pg_ctl -D "$PGDATA" -w -s -m fast stop
    echo "database initialised; starting the server"
fi

exec "$@"
