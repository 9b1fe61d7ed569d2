//! pg_outbox forwarder: streams the inserts of `outbox.events` from a logical
//! replication slot (pgoutput) into Kafka, and confirms a position to the slot
//! only after Kafka acknowledged every event up to it.
//!
//! # Layout
//!
//! Events flow from a [`source`] through the [`pipeline`] into a [`sink`]:
//!
//! - **Sources.** [`replication`] speaks the streaming replication protocol,
//!   [`pgoutput`] decodes its messages into [`event`]s; [`poll`] is the other
//!   source, relays that lease aggregates.
//! - **The loop.** [`pipeline`] runs sessions (connect, slot, first-start
//!   catch-up) and moves changes from source to sink; [`ledger`] holds the
//!   confirm rule, [`horizon`] which transactions Kafka already holds.
//! - **Sinks.** [`sink`] routes ([`routing`]), dead-letters ([`parking`]) and
//!   bounds what is in flight; its two kinds are at least once and
//!   transactional ([`offsets`] stores the exactly-once position); [`producer`]
//!   builds the librdkafka producers.
//! - **PostgreSQL.** [`database`] connects, finds the primary and probes what
//!   the outbox offers; [`publication`], [`slot`] and [`progress`] are the
//!   objects the stream needs; [`pg_target`] and [`tls`] parse and secure the
//!   connection URL.
//! - **The operator's side.** [`options`] declares every option once and
//!   [`config`] is built from them; [`check`], [`status`], [`replay`] and
//!   [`redrive`] are subcommands; [`metrics`] and [`health`] serve
//!   `/metrics`, `/healthz` and `/readyz`; [`error`] classifies every failure
//!   where it is raised; [`faults`] are the crash points tests arm.

// The layout names internal modules too: it is read with
// `cargo doc --document-private-items`.
#![allow(rustdoc::private_intra_doc_links)]

pub mod check;
pub mod config;
pub mod database;
pub mod error;
pub(crate) mod event;
pub(crate) mod faults;
pub mod health;
pub(crate) mod horizon;
pub(crate) mod ledger;
pub(crate) mod lsn;
pub mod metrics;
pub(crate) mod offsets;
pub mod options;
pub(crate) mod parking;
pub(crate) mod pg_target;
pub(crate) mod pgoutput;
pub mod pipeline;
pub(crate) mod poll;
pub(crate) mod producer;
pub(crate) mod progress;
pub mod publication;
pub mod redrive;
pub mod replay;
pub(crate) mod replication;
pub mod routing;
pub mod shard;
pub(crate) mod sink;
pub mod slot;
pub(crate) mod source;
pub mod status;
pub(crate) mod tls;

pub use config::Config;
pub use error::{Error, Result};
