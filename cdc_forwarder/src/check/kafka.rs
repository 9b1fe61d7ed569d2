//! The Kafka side of `check`: the brokers answer with these credentials, and
//! the topics the forwarder writes have the replicas its guarantees need.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;

use super::Check;
use crate::config::Config;

/// Keeps the first error librdkafka reports: it says why (a refused TLS
/// certificate, failed SASL authentication) where the metadata request
/// only says that it failed.
#[derive(Clone, Default)]
struct FirstError(Arc<Mutex<Option<String>>>);

impl FirstError {
    fn keep(&self, text: String) {
        if let Ok(mut first) = self.0.lock() {
            first.get_or_insert(text);
        }
    }
}

impl ClientContext for FirstError {
    fn error(&self, error: KafkaError, reason: &str) {
        self.keep(format!("{error}: {reason}"));
    }

    fn log(&self, level: RDKafkaLogLevel, _facility: &str, message: &str) {
        if matches!(
            level,
            RDKafkaLogLevel::Emerg
                | RDKafkaLogLevel::Alert
                | RDKafkaLogLevel::Critical
                | RDKafkaLogLevel::Error
        ) {
            self.keep(message.to_owned());
        }
    }
}

impl ConsumerContext for FirstError {}

/// What the cluster's metadata says of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TopicReplicas {
    name: String,
    /// The smallest replica count among its partitions.
    replicas: usize,
    /// Partitions with fewer replicas in sync than replicas, or no leader.
    under_replicated: usize,
}

/// The cluster as `check` sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Cluster {
    brokers: usize,
    topics: Vec<TopicReplicas>,
}

impl Cluster {
    fn topic(&self, name: &str) -> Option<&TopicReplicas> {
        self.topics.iter().find(|t| t.name == name)
    }
}

/// The transaction state log, where the coordinators keep transactions.
const TRANSACTION_STATE: &str = "__transaction_state";

pub(super) async fn checks(config: &Config) -> Vec<Check> {
    let client = config.kafka_client();
    let topic = config.offsets_topic();
    let outcome = tokio::task::spawn_blocking(move || {
        let context = FirstError::default();
        let consumer: BaseConsumer<FirstError> = client
            .create_with_context(context.clone())
            .map_err(|e| e.to_string())?;
        let metadata = consumer
            .fetch_metadata(None, Duration::from_secs(10))
            .map_err(|e| {
                // Errors reach the context through the client's queue.
                let _no_message_expected = consumer.poll(Duration::from_millis(100));
                let first = context.0.lock().ok().and_then(|f| f.clone());
                first.unwrap_or_else(|| e.to_string())
            })?;
        let topics = metadata
            .topics()
            .iter()
            .map(|t| TopicReplicas {
                name: t.name().to_owned(),
                replicas: t
                    .partitions()
                    .iter()
                    .map(|p| p.replicas().len())
                    .min()
                    .unwrap_or(0),
                under_replicated: t
                    .partitions()
                    .iter()
                    .filter(|p| p.leader() < 0 || p.isr().len() < p.replicas().len())
                    .count(),
            })
            .collect();
        Ok::<_, String>(Cluster {
            brokers: metadata.brokers().len(),
            topics,
        })
    })
    .await;
    let cluster = match outcome {
        Ok(Ok(cluster)) => cluster,
        Ok(Err(e)) => {
            return vec![Check::fail(
                "kafka",
                format!(
                    "cannot reach {}: {e}; check --kafka-bootstrap, the network and the kafka_security_* / kafka_sasl_* settings",
                    config.kafka_bootstrap
                ),
            )]
        }
        Err(e) => return vec![Check::fail("kafka", e.to_string())],
    };
    let reached = Check::ok(
        "kafka",
        format!(
            "{} broker(s) at {}; offsets topic {} {}",
            cluster.brokers,
            config.kafka_bootstrap,
            topic,
            if cluster.topic(&topic).is_some() {
                "exists"
            } else {
                "will be created (exactly-once mode)"
            }
        ),
    );
    let written = written_topics(config, &cluster);
    let min_insync = min_insync_replicas(config, &written).await;
    vec![reached, replication(&cluster, &written, &min_insync)]
}

/// The topics the forwarder writes that exist now: its offsets topic, its
/// dead-letter topic, and those its topic template names.
fn written_topics(config: &Config, cluster: &Cluster) -> Vec<String> {
    let (prefix, suffix) = config
        .topic_template
        .split_once("{aggregate_type}")
        .unwrap_or((&config.topic_template, ""));
    let offsets = config.offsets_topic();
    cluster
        .topics
        .iter()
        .map(|t| t.name.as_str())
        .filter(|name| {
            *name == offsets
                || config.dead_letter_topic.as_deref() == Some(name)
                || (!name.starts_with("__")
                    && name.len() > prefix.len() + suffix.len()
                    && name.starts_with(prefix)
                    && name.ends_with(suffix))
        })
        .map(str::to_owned)
        .collect()
}

/// Each topic's `min.insync.replicas`, where the cluster tells it.
async fn min_insync_replicas(config: &Config, topics: &[String]) -> Vec<(String, u32)> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    if topics.is_empty() {
        return Vec::new();
    }
    let Ok(admin) = config
        .kafka_client()
        .create::<AdminClient<rdkafka::client::DefaultClientContext>>()
    else {
        return Vec::new();
    };
    let resources: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let Ok(results) = admin.describe_configs(&resources, &options).await else {
        return Vec::new();
    };
    results
        .into_iter()
        .filter_map(|result| {
            let resource = result.ok()?;
            let rdkafka::admin::OwnedResourceSpecifier::Topic(name) = &resource.specifier else {
                return None;
            };
            let value = resource.get("min.insync.replicas")?.value.as_deref()?;
            Some((name.clone(), value.parse().ok()?))
        })
        .collect()
}

/// On a cluster of three or more brokers: a topic the forwarder writes with
/// a single replica, or that acknowledges with a single replica in sync,
/// loses acknowledged events when one broker's disk does; transactions
/// stall while the transaction state log lacks replicas.
fn replication(cluster: &Cluster, written: &[String], min_insync: &[(String, u32)]) -> Check {
    if cluster.brokers < 3 {
        return Check::ok(
            "replicas",
            format!(
                "{} broker(s): no replicas to check (production clusters have three or more)",
                cluster.brokers
            ),
        );
    }
    let mut problems = Vec::new();
    let single: Vec<&str> = written
        .iter()
        .filter(|name| cluster.topic(name).is_some_and(|t| t.replicas <= 1))
        .map(String::as_str)
        .collect();
    if !single.is_empty() {
        problems.push(format!(
            "replication factor 1 on {}: recreate with 3 replicas (kafka-reassign-partitions adds them to a topic that exists)",
            single.join(", ")
        ));
    }
    let lone: Vec<&str> = min_insync
        .iter()
        .filter(|(name, n)| *n <= 1 && cluster.topic(name).is_some_and(|t| t.replicas > 1))
        .map(|(name, _)| name.as_str())
        .collect();
    if !lone.is_empty() {
        problems.push(format!(
            "min.insync.replicas 1 on {}: acks=all then waits for one replica only; set it to 2 (kafka-configs --alter --add-config min.insync.replicas=2)",
            lone.join(", ")
        ));
    }
    match cluster.topic(TRANSACTION_STATE) {
        Some(log) if log.replicas <= 1 => problems.push(format!(
            "the transaction state log ({TRANSACTION_STATE}) has replication factor 1: set transaction.state.log.replication.factor=3 before the first transaction"
        )),
        Some(log) if log.under_replicated > 0 => problems.push(format!(
            "the transaction state log ({TRANSACTION_STATE}) is under-replicated in {} partition(s): a broker is down or behind, and transactions stall while fewer than transaction.state.log.min.isr replicas are in sync",
            log.under_replicated
        )),
        _ => {}
    }
    if problems.is_empty() {
        Check::ok(
            "replicas",
            format!(
                "{} broker(s); {} topic(s) written have replicas and in-sync minimums above 1",
                cluster.brokers,
                written.len()
            ),
        )
    } else {
        Check::warn("replicas", problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(name: &str, replicas: usize, under_replicated: usize) -> TopicReplicas {
        TopicReplicas {
            name: name.into(),
            replicas,
            under_replicated,
        }
    }

    fn cluster(brokers: usize, topics: Vec<TopicReplicas>) -> Cluster {
        Cluster { brokers, topics }
    }

    #[test]
    fn a_written_topic_with_one_replica_or_one_in_sync_is_a_warning_on_three_brokers() {
        let topics = vec![
            topic("outbox.order", 1, 0),
            topic("outbox.invoice", 3, 0),
            topic(TRANSACTION_STATE, 3, 0),
        ];
        let written = vec!["outbox.order".to_owned(), "outbox.invoice".to_owned()];
        let insync = vec![("outbox.invoice".to_owned(), 1)];
        let check = replication(&cluster(3, topics.clone()), &written, &insync);
        assert!(check.ok && check.warning, "{check}");
        assert!(
            check
                .detail
                .contains("replication factor 1 on outbox.order"),
            "{check}"
        );
        assert!(
            check
                .detail
                .contains("min.insync.replicas 1 on outbox.invoice"),
            "{check}"
        );

        // One broker: nothing to replicate to, no warning.
        let single = replication(&cluster(1, topics), &written, &insync);
        assert!(single.ok && !single.warning, "{single}");
    }

    #[test]
    fn a_transaction_state_log_short_of_replicas_is_a_warning() {
        let written = vec!["outbox.order".to_owned()];
        let insync = vec![("outbox.order".to_owned(), 2)];
        let healthy = vec![topic("outbox.order", 3, 0), topic(TRANSACTION_STATE, 3, 0)];
        let check = replication(&cluster(3, healthy), &written, &insync);
        assert!(check.ok && !check.warning, "{check}");

        let behind = vec![topic("outbox.order", 3, 0), topic(TRANSACTION_STATE, 3, 2)];
        let check = replication(&cluster(3, behind), &written, &insync);
        assert!(check.warning, "{check}");
        assert!(
            check.detail.contains("under-replicated in 2 partition(s)"),
            "{check}"
        );

        let single = vec![topic("outbox.order", 3, 0), topic(TRANSACTION_STATE, 1, 0)];
        let check = replication(&cluster(3, single), &written, &insync);
        assert!(
            check
                .detail
                .contains("transaction.state.log.replication.factor"),
            "{check}"
        );
    }

    #[test]
    fn the_written_topics_are_the_offsets_the_dead_letters_and_the_templates() {
        let mut config = Config::new("postgres://u@h/db", "k:9092").expect("config");
        config.dead_letter_topic = Some("dlq".into());
        let names = [
            "outbox.order",
            "outbox.",
            "other.order",
            "dlq",
            "__consumer_offsets",
            &config.offsets_topic(),
        ];
        let all = cluster(3, names.iter().map(|n| topic(n, 3, 0)).collect());
        let mut written = written_topics(&config, &all);
        written.sort();
        let mut expected = vec![
            "dlq".to_owned(),
            "outbox.order".into(),
            config.offsets_topic(),
        ];
        expected.sort();
        assert_eq!(written, expected);
    }
}
