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
//! partition. It reads the end of the partition first (a compacted topic
//! keeps every record until its segment rolls, tens of thousands after a
//! busy day), and earlier records only while no record of ours is found.
//!
//! Each forwarder has a topic of its own by default, so no other
//! forwarder's transaction is ever open on the partition it reads. Offsets
//! stored before that, in the one topic all forwarders shared, are read
//! from there while the forwarder's own topic holds none yet.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::ClientContext;
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::horizon::{Horizon, Runs};
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
#[derive(Clone)]
pub struct OffsetStore {
    /// Bootstrap servers and raw properties (TLS, SASL).
    pub client: ClientConfig,
    pub topic: String,
    /// Where to look when `topic` holds no record of ours (an upgrade from
    /// the shared offsets topic).
    pub fallback: Option<String>,
    /// The forwarder's transactional id; one key per forwarder.
    pub key: String,
    /// The topic's replication factor when it is created (-1: the
    /// cluster's default).
    pub replication_factor: i32,
    /// Readers made ready before they are needed (see [`Offsets::prepare`]).
    ready: Arc<Mutex<Option<Readers>>>,
}

/// The offsets topic's two readers, each connected and knowing the topic:
/// read committed, and read uncommitted for the high watermark.
struct Readers {
    committed: BaseConsumer<QuietEof>,
    raw: BaseConsumer<QuietEof>,
    /// The topic's partitions, as the readers learned them.
    partitions: Vec<i32>,
}

impl OffsetStore {
    pub fn new(client: ClientConfig, topic: String, key: String) -> Self {
        OffsetStore {
            client,
            topic,
            fallback: None,
            key,
            replication_factor: -1,
            ready: Arc::default(),
        }
    }

    /// The store of the forwarder `config` describes.
    pub fn of(config: &Config) -> Self {
        OffsetStore {
            fallback: config.offsets_fallback(),
            replication_factor: config.offsets_replication_factor.unwrap_or(-1),
            ..Self::new(
                config.kafka_client(),
                config.offsets_topic(),
                config.transactional_id(),
            )
        }
    }

    /// Creates the compacted offsets topic when it is missing.
    pub async fn ensure_topic(&self) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.client.create()?;
        let topic = NewTopic::new(
            &self.topic,
            1,
            TopicReplication::Fixed(self.replication_factor),
        )
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
    pub async fn load_async(&self, timeout: Duration) -> Result<Option<Stored>> {
        self.blocking(move |store| store.load(timeout)).await
    }

    /// Runs a blocking call of the readers on the blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&OffsetStore) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || call(&store))
            .await
            .map_err(|e| Error::Bug(format!("offset reader panicked: {e}")))?
    }

    /// Makes the readers ready ahead of [`Self::load`], which then only
    /// reads: connecting them takes tens of milliseconds. Blocking.
    fn get_ready(&self) -> Result<()> {
        let readers = self.readers()?;
        *self.ready.lock().unwrap_or_else(|e| e.into_inner()) = Some(readers);
        Ok(())
    }

    /// Two new readers, connected, knowing the topic. Blocking.
    fn readers(&self) -> Result<Readers> {
        let config = |isolation: &str| {
            self.client
                .clone()
                .set("group.id", "pg_outbox-offsets-reader")
                .set("enable.auto.commit", "false")
                .set("enable.partition.eof", "true")
                .set("isolation.level", isolation)
                // Reaching the end costs one empty fetch: do not let the
                // broker hold it for long.
                .set("fetch.wait.max.ms", "10")
                .clone()
        };
        let committed: BaseConsumer<QuietEof> =
            config("read_committed").create_with_context(QuietEof)?;
        let raw: BaseConsumer<QuietEof> =
            config("read_uncommitted").create_with_context(QuietEof)?;
        // Each reader learns the topic first: librdkafka looks up a topic
        // it has not seen, when a partition of it is assigned or queried,
        // only at its next scan, up to a second later.
        committed.fetch_metadata(Some(&self.topic), METADATA_TIMEOUT)?;
        let metadata = raw.fetch_metadata(Some(&self.topic), METADATA_TIMEOUT)?;
        let partitions = metadata
            .topics()
            .iter()
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        drop(metadata);
        Ok(Readers {
            committed,
            raw,
            partitions,
        })
    }

    /// Reads the last committed offset (blocking; call off the async
    /// workers): from the forwarder's own topic, else from the fallback.
    pub fn load(&self, timeout: Duration) -> Result<Option<Stored>> {
        let deadline = Instant::now() + timeout;
        if let Some(stored) = self.load_topic(deadline)? {
            return Ok(Some(stored));
        }
        let Some(fallback) = &self.fallback else {
            return Ok(None);
        };
        let earlier = OffsetStore::new(self.client.clone(), fallback.clone(), self.key.clone());
        let stored = earlier.load_topic(deadline)?;
        if let Some(stored) = &stored {
            tracing::info!(
                from = %fallback,
                to = %self.topic,
                lsn = %stored.lsn,
                "offset read from the offsets topic shared by forwarders before each had its own; the next commit stores it in this forwarder's own"
            );
        }
        Ok(stored)
    }

    /// The last committed offset in `self.topic`, which may not exist.
    fn load_topic(&self, deadline: Instant) -> Result<Option<Stored>> {
        let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Readers {
            committed,
            raw,
            partitions,
        } = match ready {
            Some(readers) => readers,
            None => self.readers()?,
        };
        let mut found: Option<Stored> = None;
        for p in partitions {
            let (low, high) = raw.fetch_watermarks(&self.topic, p, METADATA_TIMEOUT)?;
            // The newest record of ours is near the end; until compaction
            // the partition holds every commit ever made. Read ever longer
            // tails until one has a record of ours or the tail is it all.
            let mut tail = TAIL_RECORDS;
            loop {
                let from = (high - tail).max(low);
                let stored = self.read_range(&committed, p, from, high, deadline)?;
                if stored.is_some() || from == low {
                    if stored.as_ref().map(|s| s.lsn) > found.as_ref().map(|s| s.lsn) {
                        found = stored;
                    }
                    break;
                }
                tail *= 16;
            }
        }
        // Closing the readers takes a while and nothing waits for it.
        std::thread::spawn(move || drop((committed, raw)));
        Ok(found)
    }

    /// The last offset of ours in partition `p` between offsets `from` and
    /// `high`, read committed.
    fn read_range(
        &self,
        consumer: &BaseConsumer<QuietEof>,
        p: i32,
        from: i64,
        high: i64,
        deadline: Instant,
    ) -> Result<Option<Stored>> {
        if from >= high {
            return Ok(None);
        }
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(&self.topic, p, Offset::Offset(from))?;
        consumer.assign(&assignment)?;
        let mut found = None;
        loop {
            if Instant::now() > deadline {
                return Err(Error::Kafka(KafkaError::MessageConsumption(
                    RDKafkaErrorCode::OperationTimedOut,
                )));
            }
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(message)) if message.partition() == p => {
                    if message.key() == Some(self.key.as_bytes()) {
                        if let Some(stored) = message.payload().and_then(decode) {
                            found = Some(stored);
                        }
                    }
                    if message.offset() + 1 >= high {
                        return Ok(found);
                    }
                }
                Some(Err(KafkaError::PartitionEOF(eof))) if eof == p => {
                    let (_, stable) =
                        consumer.fetch_watermarks(&self.topic, p, Duration::from_secs(10))?;
                    let position = consumer
                        .position()?
                        .find_partition(&self.topic, p)
                        .and_then(|e| e.offset().to_raw())
                        .unwrap_or(0);
                    if stable >= high && position >= high {
                        return Ok(found);
                    }
                }
                Some(Ok(_) | Err(KafkaError::PartitionEOF(_))) | None => {}
                Some(Err(e)) => return Err(e.into()),
            }
        }
    }
}

/// How long a metadata or watermark request of the readers may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// How many records at the end of a partition are read first.
const TAIL_RECORDS: i64 = 256;

/// What an offset record says: the position Kafka holds every transaction
/// up to, and in transaction ids (see [`crate::horizon`]) when known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub lsn: Lsn,
    pub horizon: Option<Horizon>,
}

pub fn encode(lsn: Lsn, horizon: Option<&Horizon>) -> String {
    match horizon {
        None => format!(r#"{{"lsn":"{lsn}"}}"#),
        Some(h) => format!(
            r#"{{"lsn":"{lsn}","snapshot":"{}","xids":"{}","origin":"{}"}}"#,
            h.base,
            h.xids.encode(),
            h.origin
        ),
    }
}

/// An offset record's value, if it is one. Records written before horizons
/// existed, or with one that does not read, have none.
pub fn decode(value: &[u8]) -> Option<Stored> {
    let v: serde_json::Value = serde_json::from_slice(value).ok()?;
    let text = |key: &str| v.get(key).and_then(|x| x.as_str());
    let horizon = (|| {
        Some(Horizon {
            base: text("snapshot")?.parse().ok()?,
            xids: Runs::decode(text("xids")?)?,
            origin: text("origin")?.to_owned(),
        })
    })();
    Some(Stored {
        lsn: text("lsn")?.parse().ok()?,
        horizon,
    })
}

/// Where the transactional sink keeps its offset. [`OffsetStore`] is the
/// real one, in Kafka; the pipeline's tests have one in memory.
#[allow(async_fn_in_trait)]
pub trait Offsets {
    /// Topic and key of the offset records.
    fn address(&self) -> (&str, &str);
    /// Creates the (compacted) topic when it is missing and gets ready to
    /// read it; called before the slot is held.
    async fn prepare(&self) -> Result<()>;
    /// The last committed offset record, if any.
    async fn stored(&self) -> Result<Option<Stored>>;
}

/// How long reading the stored offset may take.
const LOAD_TIMEOUT: Duration = Duration::from_secs(60);

impl Offsets for OffsetStore {
    fn address(&self) -> (&str, &str) {
        (&self.topic, &self.key)
    }

    async fn prepare(&self) -> Result<()> {
        self.ensure_topic().await?;
        self.blocking(OffsetStore::get_ready).await
    }

    async fn stored(&self) -> Result<Option<Stored>> {
        self.load_async(LOAD_TIMEOUT).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_values_round_trip() {
        let lsn = Lsn(0x1_6B37_4D48);
        let plain = Stored { lsn, horizon: None };
        assert_eq!(decode(encode(lsn, None).as_bytes()), Some(plain));
        let horizon = Horizon {
            base: "700:705:701".parse().expect("snapshot"),
            xids: [701, 705, 706].into_iter().collect(),
            origin: "7714164429801179135/00000002".into(),
        };
        let full = Stored {
            lsn,
            horizon: Some(horizon.clone()),
        };
        assert_eq!(decode(encode(lsn, Some(&horizon)).as_bytes()), Some(full));
        assert_eq!(decode(b"{}"), None);
        assert_eq!(decode(b"garbage"), None);
    }
}
