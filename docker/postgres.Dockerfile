# PostgreSQL with the pg_outbox extension, wal_level=logical and room for
# the forwarder's slots, on the official postgres image's contract
# (POSTGRES_PASSWORD, POSTGRES_DB, /docker-entrypoint-initdb.d). From the
# repository root, for a major of 15 to 18:
#   docker build -f docker/postgres.Dockerfile --build-arg PG_MAJOR=17 \
#     --build-arg POSTGRES_IMAGE=postgres:17-bookworm -t pg-outbox-postgres:17 .
# The extension is built against the very server it runs in: the build
# stage is the runtime image with the server headers and Rust added.
ARG PG_MAJOR=15
ARG POSTGRES_IMAGE=postgres:15-bookworm

# cargo-pgrx, the same for every major (pinned like scripts/setup's).
FROM rust:1.95-bookworm AS pgrx
RUN cargo install cargo-pgrx --version 0.18.1 --locked

FROM ${POSTGRES_IMAGE} AS build
ARG PG_MAJOR
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      postgresql-server-dev-${PG_MAJOR} build-essential clang libclang-dev pkg-config ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=rust:1.95-bookworm /usr/local/rustup /usr/local/rustup
COPY --from=rust:1.95-bookworm /usr/local/cargo /usr/local/cargo
COPY --from=pgrx /usr/local/cargo/bin/cargo-pgrx /usr/local/cargo/bin/cargo-pgrx
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:$PATH
RUN cargo pgrx init --pg${PG_MAJOR} /usr/lib/postgresql/${PG_MAJOR}/bin/pg_config
WORKDIR /src
COPY . .
# The extension's files under /out, at the server's own paths, with the
# install scripts of released versions for ALTER EXTENSION ... UPDATE.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cd pg_ext \
 && cargo pgrx package --no-default-features --features pg${PG_MAJOR} \
      --pg-config /usr/lib/postgresql/${PG_MAJOR}/bin/pg_config \
 && mkdir -p /out \
 && cp -r /src/target/release/pg_outbox-pg${PG_MAJOR}/usr /out/ \
 && /src/scripts/released-sql.sh /out/usr/share/postgresql/${PG_MAJOR}/extension

FROM ${POSTGRES_IMAGE}
ARG PG_MAJOR
COPY --from=build /out/usr/ /usr/
COPY docker/initdb/ /docker-entrypoint-initdb.d/
HEALTHCHECK --interval=2s --timeout=3s --start-period=60s --retries=30 \
  CMD pg_isready -q -h 127.0.0.1 -U "${POSTGRES_USER:-postgres}" -d "${POSTGRES_DB:-postgres}" || exit 1
CMD ["postgres", "-c", "wal_level=logical", "-c", "max_replication_slots=16", "-c", "max_wal_senders=16", "-c", "max_slot_wal_keep_size=10GB"]
