# A stand-in for the official rust:1.95-bookworm image where no registry
# (nor static.rust-lang.org) can be reached: this machine's Rust 1.95
# toolchain at the official image's places (RUSTUP_HOME /usr/local/rustup,
# CARGO_HOME /usr/local/cargo, cargo and rustc on PATH), with the C
# toolchain and OpenSSL headers that Rust builds expect of it.
# scripts/containers assembles the build context and builds it as
# rust:1.95-bookworm.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential pkg-config libssl-dev ca-certificates git curl \
 && rm -rf /var/lib/apt/lists/*
ARG TOOLCHAIN=1.95.0-x86_64-unknown-linux-gnu
COPY toolchain/ /usr/local/rustup/toolchains/${TOOLCHAIN}/
RUN install -d /usr/local/cargo/bin \
 && for tool in cargo rustc rustdoc cargo-clippy clippy-driver cargo-fmt rustfmt; do \
      ln -s /usr/local/rustup/toolchains/${TOOLCHAIN}/bin/$tool /usr/local/cargo/bin/$tool; done
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUST_VERSION=1.95.0
