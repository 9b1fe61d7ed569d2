# outbox-forwarder, built in one stage and run from a slim image.
# Build from the repository root: docker build -f docker/forwarder.Dockerfile .
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake libssl-dev pkg-config && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release -p cdc_forwarder --bin outbox-forwarder

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates zlib1g libssl3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/outbox-forwarder /usr/local/bin/outbox-forwarder
USER 65532:65532
EXPOSE 9187
ENTRYPOINT ["outbox-forwarder"]
CMD ["run"]
