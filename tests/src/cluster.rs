//! The stack's cluster of three brokers (`OUTBOX_KAFKA_BROKERS=3 scripts/stack
//! up`): its fault commands, and which broker holds a role.

use std::time::{Duration, Instant};

use crate::{stack_command_with, stack_output};

const CLUSTER: &[(&str, &str)] = &[("OUTBOX_KAFKA_BROKERS", "3")];

/// Whether the tests run against the cluster; prints why a cluster test
/// does not run otherwise, and tells the caller to return: never a silent skip.
pub fn skip_without_cluster(test: &str) -> bool {
    let here = std::env::var("OUTBOX_KAFKA_BROKERS").as_deref() == Ok("3")
        && std::env::var("KAFKA_BOOTSTRAP").is_ok_and(|b| b.contains(','));
    if !here {
        eprintln!("{test}: not run on a single broker; scripts/test runs it on the cluster (OUTBOX_KAFKA_BROKERS=3)");
    }
    !here
}

/// `scripts/stack` on the cluster: kill-broker, start-broker, pause-broker,
/// resume-broker, restart-broker N, roll-brokers.
pub fn command(args: &[&str]) {
    stack_command_with(args, CLUSTER);
}

/// The broker (1, 2 or 3) that holds a role: `controller`, `coordinator
/// TRANSACTIONAL_ID` or `leader TOPIC PARTITION`; `None` when the cluster
/// names none.
pub fn broker_of(role: &[&str]) -> Option<String> {
    let node = stack_output(&[&["broker-of"], role].concat(), CLUSTER)?;
    matches!(node.as_str(), "1" | "2" | "3").then_some(node)
}

/// Waits until every partition has all its replicas in sync, so that the
/// next fault finds the cluster whole; false after `timeout`.
pub async fn wait_in_sync(timeout: Duration) -> bool {
    let until = Instant::now() + timeout;
    while Instant::now() < until {
        let count = tokio::task::spawn_blocking(|| {
            stack_output(&["broker-of", "under-replicated"], CLUSTER)
        })
        .await
        .ok()
        .flatten();
        if count.as_deref() == Some("0") {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}
