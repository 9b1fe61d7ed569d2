#!/usr/bin/env bash
# First start of the container: the extension in the application database,
# and a least-privilege login for the forwarder, granted this database's
# relay role (named in outbox.roles).
set -euo pipefail
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<SQL
CREATE EXTENSION IF NOT EXISTS pg_outbox;
CREATE ROLE outbox_forwarder LOGIN REPLICATION PASSWORD '${OUTBOX_FORWARDER_PASSWORD:-forwarder}';
SELECT format('GRANT %s TO outbox_forwarder', role) FROM outbox.roles WHERE purpose = 'relay' \gexec
SQL
