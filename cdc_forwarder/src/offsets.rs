//! Durable offsets for exactly-once mode, kept in Kafka itself.
//!
//! Each Kafka transaction of the forwarder carries, beside the events of
//! whole PostgreSQL transactions, one offset record: key = the forwarder's
//! transactional id, value = the commit end LSN of the last PostgreSQL
//! transaction in it. The record commits or aborts with the events, so the
//! stored offset is exactly what a `read_committed` consumer can see.
//!
//! Contract: the stored offset only moves forward, and only inside a Kafka
//! transaction that also holds every event up to it. On start the forwarder
//! reads it back and skips every replayed PostgreSQL transaction that
//! committed at or before it.
//!
//! Reading it back: after `init_transactions` our own earlier transactions
//! are all decided (committed, or aborted by the fencing). Another
//! forwarder's open transaction on the same partition can still hold the
//! last stable offset back, and our committed records may lie beyond it, so
//! the reader waits until it has consumed up to the high watermark that
//! existed right after `init_transactions`, not just to the first end of
//! partition.

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::ClientContext;
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::error::{Error, Result};
use crate::lsn::Lsn;

/// Client context that does not log the end-of-partition events the reader
/// asks for: they are how it knows it has read everything.
struct QuietEof;

impl ClientContext for QuietEof {
    fn error(&self, error: KafkaError, reason: &str) {
        let end_of_partition = matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        );
        if !end_of_partition {
            tracing::warn!(error = %error, reason, "kafka client error while reading offsets");
        }
    }
}

impl ConsumerContext for QuietEof {}

/// Where a forwarder's offsets live and under which key.
#[derive(Debug, Clone)]
pub struct OffsetStore {
    /// Bootstrap servers and raw properties (TLS, SASL).
    pub client: ClientConfig,
    pub topic: String,
    /// The forwarder's transactional id; one key per forwarder.
    pub key: String,
}

impl OffsetStore {
    /// Creates the compacted offsets topic when it is missing.
    pub async fn ensure_topic(&self) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.client.create()?;
        let topic = NewTopic::new(&self.topic, 1, TopicReplication::Fixed(-1))
            .set("cleanup.policy", "compact");
        let results = admin
            .create_topics(
                &[topic],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
            )
            .await?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => {
                    tracing::error!(topic = %topic, code = %code, "cannot create the offsets topic");
                    return Err(Error::Kafka(KafkaError::AdminOp(code)));
                }
            }
        }
        Ok(())
    }

    /// [`Self::load`] on the blocking pool.
    pub async fn load_async(&self, timeout: Duration) -> Result<Option<Lsn>> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.load(timeout))
            .await
            .map_err(|e| Error::Setup(format!("offset reader panicked: {e}")))?
    }

    /// Reads the last committed offset (blocking; call off the async workers).
    pub fn load(&self, timeout: Duration) -> Result<Option<Lsn>> {
        let deadline = Instant::now() + timeout;
        let config = |isolation: &str| {
            self.client
                .clone()
                .set("group.id", "pg_outbox-offsets-reader")
                .set("enable.auto.commit", "false")
                .set("enable.partition.eof", "true")
                .set("isolation.level", isolation)
                .clone()
        };
        let committed: BaseConsumer<QuietEof> =
            config("read_committed").create_with_context(QuietEof)?;
        let raw: BaseConsumer<QuietEof> =
            config("read_uncommitted").create_with_context(QuietEof)?;

        let metadata = raw.fetch_metadata(Some(&self.topic), Duration::from_secs(10))?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut targets = Vec::new();
        let mut assignment = TopicPartitionList::new();
        for &p in &partitions {
            let (_, high) = raw.fetch_watermarks(&self.topic, p, Duration::from_secs(10))?;
            if high > 0 {
                targets.push((p, high));
                assignment.add_partition_offset(&self.topic, p, Offset::Beginning)?;
            }
        }
        if targets.is_empty() {
            return Ok(None);
        }
        committed.assign(&assignment)?;

        let mut found = None;
        let mut done = vec![false; targets.len()];
        while !done.iter().all(|d| *d) {
            if Instant::now() > deadline {
                return Err(Error::Kafka(KafkaError::MessageConsumption(
                    RDKafkaErrorCode::OperationTimedOut,
                )));
            }
            match committed.poll(Duration::from_millis(200)) {
                Some(Ok(message)) => {
                    if message.key() == Some(self.key.as_bytes()) {
                        if let Some(lsn) = message.payload().and_then(decode) {
                            found = Some(lsn);
                        }
                    }
                    let i = targets.iter().position(|t| t.0 == message.partition());
                    if let Some(i) = i {
                        if message.offset() + 1 >= targets[i].1 {
                            done[i] = true;
                        }
                    }
                }
                Some(Err(KafkaError::PartitionEOF(p))) => {
                    // At the end of what read_committed may see: complete once
                    // that end has reached the target high watermark.
                    if let Some(i) = targets.iter().position(|t| t.0 == p) {
                        let (_, stable) =
                            committed.fetch_watermarks(&self.topic, p, Duration::from_secs(10))?;
                        let position = committed
                            .position()?
                            .find_partition(&self.topic, p)
                            .and_then(|e| e.offset().to_raw())
                            .unwrap_or(0);
                        if stable >= targets[i].1 && position >= targets[i].1 {
                            done[i] = true;
                        }
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => {}
            }
        }
        Ok(found)
    }
}

/// The value of an offset record.
pub fn encode(lsn: Lsn) -> String {
    format!(r#"{{"lsn":"{lsn}"}}"#)
}

/// The position in an offset record's value, if it is one.
pub fn decode(value: &[u8]) -> Option<Lsn> {
    let v: serde_json::Value = serde_json::from_slice(value).ok()?;
    v.get("lsn")?.as_str()?.parse().ok()
}

/// Where the transactional sink keeps its offset. [`OffsetStore`] is the
/// real one, in Kafka; the pipeline's tests have one in memory.
#[allow(async_fn_in_trait)]
pub trait Offsets {
    /// Topic and key of the offset records.
    fn address(&self) -> (&str, &str);
    /// Creates the (compacted) topic when it is missing.
    async fn ensure_topic(&self) -> Result<()>;
    /// The last committed offset, if any.
    async fn stored(&self) -> Result<Option<Lsn>>;
}

/// How long reading the stored offset may take.
const LOAD_TIMEOUT: Duration = Duration::from_secs(60);

impl Offsets for OffsetStore {
    fn address(&self) -> (&str, &str) {
        (&self.topic, &self.key)
    }

    async fn ensure_topic(&self) -> Result<()> {
        OffsetStore::ensure_topic(self).await
    }

    async fn stored(&self) -> Result<Option<Lsn>> {
        self.load_async(LOAD_TIMEOUT).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_values_round_trip() {
        let lsn = Lsn(0x1_6B37_4D48);
        assert_eq!(decode(encode(lsn).as_bytes()), Some(lsn));
        assert_eq!(decode(b"{}"), None);
        assert_eq!(decode(b"garbage"), None);
    }
}
