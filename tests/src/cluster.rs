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
    wait_for(&["under-replicated"], timeout, |count| count == "0")
        .await
        .is_some()
}

/// Asks `broker-of` about `role` until its answer is `accepted`, as while
/// the cluster elects a new holder; the last answer, or `None` when none
/// was accepted within `timeout`.
pub async fn wait_for(
    role: &[&str],
    timeout: Duration,
    accepted: impl Fn(&str) -> bool,
) -> Option<String> {
    let until = Instant::now() + timeout;
    let args: Vec<String> = ["broker-of"]
        .iter()
        .chain(role)
        .map(|a| a.to_string())
        .collect();
    while Instant::now() < until {
        let args = args.clone();
        let answer = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            stack_output(&args, CLUSTER)
        })
        .await
        .ok()
        .flatten();
        if answer.as_deref().is_some_and(&accepted) {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    None
}
