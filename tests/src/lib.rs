//! Harness for the integration tests: a real PostgreSQL and a real Kafka from
//! `scripts/stack up`, one database, slot and topic prefix per test, the real
//! `outbox-forwarder` binary as a child process, and a `read_committed` Kafka
//! consumer that reads back what arrived.

pub mod catalog;
pub mod cluster;
mod database;
mod forwarder;
pub mod pair;
mod reader;
mod stack;
mod verdict;

use std::time::{Duration, Instant};

pub use database::*;
pub use forwarder::*;
pub use reader::*;
pub use stack::*;
pub use verdict::*;

/// Polls `check` every 50 ms until it holds, or panics after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
