# outbox-forwarder: built in a Rust image, run from a slim Debian one as a
# non-root user, with only the binary and what it links besides libc
# (OpenSSL; librdkafka is linked in). The health check asks the
# forwarder's own /healthz.
# From the repository root: docker build -f docker/forwarder.Dockerfile -t outbox-forwarder .
FROM rust:1.95-bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p cdc_forwarder --bin outbox-forwarder \
 && cp target/release/outbox-forwarder /outbox-forwarder

FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates libssl3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
COPY --from=build /outbox-forwarder /usr/local/bin/outbox-forwarder
USER 65532:65532
ENV OUTBOX_METRICS_LISTEN=0.0.0.0:9187 OUTBOX_LOG_FORMAT=json
EXPOSE 9187
HEALTHCHECK --interval=5s --timeout=4s --start-period=30s --retries=3 CMD ["outbox-forwarder", "probe"]
ENTRYPOINT ["outbox-forwarder"]
CMD ["run"]
