//! A `read_committed` Kafka consumer that reads back what arrived.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;

use crate::{unique, Stack};

/// One record read back from Kafka.
#[derive(Debug, Clone)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub headers: BTreeMap<String, String>,
    pub payload: String,
    /// The record's timestamp in Unix milliseconds: when the broker appended
    /// it on a topic with `message.timestamp.type=LogAppendTime`.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("record has no header {name}: {self:?}"))
    }

    pub fn event_id(&self) -> &str {
        self.header("event_id")
    }

    pub fn seq(&self) -> i64 {
        self.header("aggregate_seq")
            .parse()
            .expect("numeric sequence")
    }
}

/// A `read_committed` consumer of every partition of its topics, from the
/// earliest offset. It assigns the partitions itself rather than joining a
/// group: a group consumer can stay out of its group after a broker restart
/// (the 500-fault campaign saw one read nothing for minutes while a fresh
/// consumer read every record), and a test's reader has no one to share with.
pub struct Reader {
    consumer: StreamConsumer,
    pub records: Vec<Record>,
    /// Topics not yet assigned because the broker does not know them yet.
    unassigned: Vec<String>,
    /// When the broker was last asked about the unassigned topics.
    looked_up: Option<Instant>,
    /// Where each record was read: a position reset to the earliest offset
    /// reads records again, and that is not Kafka holding them twice.
    read: std::collections::HashSet<(String, i32, i64)>,
    /// When a consumer error was last printed.
    error_printed: Option<Instant>,
}

impl Reader {
    pub fn new(stack: &Stack, topics: &[&str]) -> Reader {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &stack.kafka)
            // librdkafka's incremental assign wants a group id, though no
            // group is joined.
            .set("group.id", unique("reader"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .expect("consumer");
        let mut reader = Reader {
            consumer,
            records: Vec::new(),
            unassigned: topics.iter().map(|t| t.to_string()).collect(),
            looked_up: None,
            read: std::collections::HashSet::new(),
            error_printed: None,
        };
        reader.assign_known_topics();
        reader
    }

    /// Assigns every partition of each topic the broker now knows, from the
    /// earliest offset; a topic it does not know yet is asked about again
    /// at the next poll, at most twice a second.
    fn assign_known_topics(&mut self) {
        if self.unassigned.is_empty()
            || self
                .looked_up
                .is_some_and(|at| at.elapsed() < Duration::from_millis(500))
        {
            return;
        }
        self.looked_up = Some(Instant::now());
        let mut assignment = rdkafka::TopicPartitionList::new();
        let mut unassigned = std::mem::take(&mut self.unassigned);
        unassigned.retain(|topic| {
            let Ok(partitions) = self.partitions(topic, Duration::from_secs(2)) else {
                return true;
            };
            for &partition in &partitions {
                assignment
                    .add_partition_offset(topic, partition, rdkafka::Offset::Beginning)
                    .expect("partition offset");
            }
            partitions.is_empty()
        });
        self.unassigned = unassigned;
        if assignment.count() > 0 {
            self.consumer
                .incremental_assign(&assignment)
                .expect("assign partitions");
        }
    }

    /// Reads until `done(records)` holds, or panics after `timeout`.
    pub async fn read_until(
        &mut self,
        timeout: Duration,
        what: &str,
        done: impl FnMut(&[Record]) -> bool,
    ) {
        let held = self.try_read_until(timeout, done).await;
        assert!(
            held,
            "timed out after {timeout:?} waiting for {what}; have {} records",
            self.records.len()
        );
    }

    /// Reads until `done(records)` holds (true) or `timeout` passes (false).
    pub async fn try_read_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&[Record]) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        while !done(&self.records) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.poll(left.min(Duration::from_millis(500))).await;
        }
        true
    }

    /// The partition's high watermark. Right after a broker restart the
    /// partition may have no leader yet for a moment; that is retried until
    /// `timeout`.
    async fn high_watermark(&mut self, topic: &str, partition: i32, timeout: Duration) -> i64 {
        let deadline = Instant::now() + timeout;
        loop {
            let error =
                match self
                    .consumer
                    .fetch_watermarks(topic, partition, Duration::from_secs(10))
                {
                    Ok((_, high)) => return high,
                    Err(e) => e.to_string(),
                };
            assert!(
                Instant::now() < deadline,
                "watermarks of {topic}/{partition}: {error}"
            );
            eprintln!("watermarks of {topic}/{partition} not yet available: {error}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The partitions of `topic` the broker knows (none for a topic it does
    /// not know).
    fn partitions(&self, topic: &str, timeout: Duration) -> KafkaResult<Vec<i32>> {
        let metadata = self.consumer.fetch_metadata(Some(topic), timeout)?;
        Ok(metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect())
    }

    /// Reads until this consumer's position has reached the end of every
    /// partition of `topics` as it stands now (for read_committed, the last
    /// stable offset): nothing written before this call is left unread.
    pub async fn read_to_end(&mut self, topics: &[&str], timeout: Duration) {
        let mut ends = Vec::new();
        for topic in topics {
            let partitions = self
                .partitions(topic, Duration::from_secs(10))
                .expect("metadata");
            for partition in partitions {
                let high = self.high_watermark(topic, partition, timeout).await;
                ends.push((topic.to_string(), partition, high));
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            let position = self.consumer.position().expect("position");
            let behind = ends.iter().filter(|(t, p, high)| {
                let at = position
                    .find_partition(t, *p)
                    .and_then(|e| e.offset().to_raw())
                    .unwrap_or(0);
                *high > 0 && at < *high
            });
            if behind.count() == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out reading to the end of {topics:?}"
            );
            self.poll(Duration::from_millis(200)).await;
        }
    }

    /// Waits up to `wait` for one record and keeps it.
    pub async fn poll(&mut self, wait: Duration) {
        // An error (a broker that is down) is not a record: the consumer
        // keeps asking. It is printed, at most every 10 s, so that a
        // consumer stuck in an error looks different from one with nothing
        // to read.
        self.assign_known_topics();
        let message = match tokio::time::timeout(wait, self.consumer.recv()).await {
            Ok(Ok(message)) => message,
            Ok(Err(error)) => {
                if self
                    .error_printed
                    .is_none_or(|at| at.elapsed() > Duration::from_secs(10))
                {
                    eprintln!("reader: {error}");
                    self.error_printed = Some(Instant::now());
                }
                return;
            }
            Err(_) => return,
        };
        let text = |b: Option<&[u8]>| {
            b.map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        };
        let position = (
            message.topic().to_owned(),
            message.partition(),
            message.offset(),
        );
        if !self.read.insert(position) {
            return;
        }
        let mut headers = BTreeMap::new();
        if let Some(h) = message.headers() {
            for header in h.iter() {
                headers.insert(header.key.to_owned(), text(header.value));
            }
        }
        self.records.push(Record {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
            key: text(message.key()),
            headers,
            payload: text(message.payload()),
            timestamp_ms: message.timestamp().to_millis(),
        });
    }
}
