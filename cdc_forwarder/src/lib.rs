//! pg_outbox forwarder: streams the inserts of `outbox.events` from a logical
//! replication slot (pgoutput) into Kafka, and confirms a position to the slot
//! only after Kafka acknowledged every event up to it.

pub mod check;
pub mod config;
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
pub mod redrive;
pub mod replay;
pub(crate) mod replication;
pub mod routing;
pub(crate) mod sink;
pub mod slot;
pub(crate) mod source;
pub mod status;
pub(crate) mod tls;

pub use config::Config;
pub use error::{Error, Result};
