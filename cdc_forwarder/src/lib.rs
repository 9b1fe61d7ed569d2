//! pg_outbox forwarder: streams the inserts of `outbox.events` from a logical
//! replication slot (pgoutput) into Kafka, and confirms a position to the slot
//! only after Kafka acknowledged every event up to it.

pub mod check;
pub mod config;
pub mod error;
pub mod event;
pub mod faults;
pub mod health;
pub mod horizon;
pub mod ledger;
pub mod lsn;
pub mod metrics;
pub mod offsets;
pub mod options;
pub mod parking;
pub mod pg_target;
pub mod pgoutput;
pub mod pipeline;
pub mod poll;
pub mod producer;
pub mod redrive;
pub mod replay;
pub mod replication;
pub mod routing;
pub mod sink;
pub mod slot;
pub mod source;
pub mod status;
pub mod tls;

pub use config::Config;
pub use error::{Error, Result};
