#!/usr/bin/env bash
# Writes the install scripts of released extension versions that the build
# does not generate, into DIR (the extension directory), so that
# `ALTER EXTENSION pg_outbox UPDATE` works from them:
#   scripts/released-sql.sh DIR
# 0.1.0 is its two frozen SQL files around the one Rust function it had.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:?usage: scripts/released-sql.sh EXTENSION_DIR}
{
    cat "$root/pg_ext/sql/bootstrap.sql"
    printf '%s\n' 'CREATE FUNCTION "uuid_v7"() RETURNS uuid STRICT VOLATILE PARALLEL SAFE' \
        "LANGUAGE c AS 'MODULE_PATHNAME', 'uuid_v7_wrapper';"
    cat "$root/pg_ext/sql/api.sql"
} >"$dir/pg_outbox--0.1.0.sql"
