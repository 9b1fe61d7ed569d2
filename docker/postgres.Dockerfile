# PostgreSQL 15 with the pg_outbox extension and wal_level=logical.
# Build from the repository root: docker build -f docker/postgres.Dockerfile .
# The build runs the same commands as scripts/setup.
FROM rust:1.95-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15 postgresql-server-dev-15 libclang-dev clang \
 && rm -rf /var/lib/apt/lists/*
RUN cargo install cargo-pgrx --version 0.18.1 --locked \
 && cargo pgrx init --pg15 /usr/lib/postgresql/15/bin/pg_config
WORKDIR /src
COPY . .
RUN cd pg_ext && cargo pgrx package --pg-config /usr/lib/postgresql/15/bin/pg_config \
 && mkdir -p /out && cp -r /src/target/release/pg_outbox-pg15/usr /out/ \
  && /src/scripts/released-sql.sh /out/usr/share/postgresql/15/extension

FROM postgres:15-bookworm
COPY --from=build /out/usr/ /usr/
COPY docker/initdb/ /docker-entrypoint-initdb.d/
CMD ["postgres", "-c", "wal_level=logical", "-c", "max_replication_slots=16", "-c", "max_wal_senders=16", "-c", "max_slot_wal_keep_size=10GB"]
