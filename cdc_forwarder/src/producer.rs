//! The Kafka side. At-least-once: an idempotent producer (`acks=all`) whose
//! delivery reports decide when a transaction may be confirmed. Exactly-once:
//! two such producers made transactional, taking turns, with a
//! `transactional.id` derived from the slot (the second's with `.1` after
//! it) so a second forwarder on the slot fences the first.
//!
//! Why two: after a commit the broker writes the transaction's markers, and
//! until they are written it refuses the same transactional id's next
//! transaction its partitions (CONCURRENT_TRANSACTIONS), which librdkafka
//! retries 20 ms later: at 1,000 transactions per second, 2% to 20% of
//! the Kafka transactions waited so in runs on our VM. The other producer's
//! transaction does not wait for those markers, and by the time the first
//! producer's turn comes again they are nearly always written. The other
//! producer also lets the next transaction take records while this one's
//! commit is under way, once this one's records are all acknowledged.
//!
//! The transactional calls block; they run on tokio's blocking pool, never on
//! the async workers.
//!
//! An epoch that aborted is never used again. librdkafka does not implement
//! KIP-890's second part (librdkafka issue 5423): each of its transactions
//! under one producer id runs under the same epoch, and a produce request of
//! transaction T1 that is still on its way (retried after a timeout, or
//! queued in the socket of a broker that hung) when T1 is aborted can land
//! after the abort marker. The broker's check of KIP-890's first part (is
//! the partition in an ongoing transaction of this producer?) then passes
//! once T2 added that partition, and the record of T1 commits with T2: a
//! duplicate when T1's events are sent again in T2, or an event out of
//! order. So after an abort, or a commit that failed or timed out, the
//! producer takes no transaction again ([`Error::EpochSpent`]): the session
//! ends, and the next session's fresh producer calls `init_transactions`
//! under the same transactional id, which aborts what is open and bumps the
//! epoch; every partition leader then refuses the old epoch's late requests.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use rdkafka::types::RDKafkaRespErr;
use tokio::sync::mpsc;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::routing::{header, Route};

/// How long a blocking transactional call may take.
const TXN_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long [`Producer::connect`] waits for a broker, per attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most delivery reports taken at once.
const REPORTS_AT_ONCE: usize = 1024;

/// What a record was sent with, to know its delivery report by.
pub type Tag = usize;
/// A delivery report: the record's tag and Kafka's answer. A refusal for
/// good is [`Error::Poison`] naming the event.
pub type Report = (Tag, Result<()>);
/// The tag of a record whose report nobody waits for.
const UNREPORTED: Tag = Tag::MAX;

pub struct Producer {
    /// One, or two transactional ones taking turns (see
    /// [`Kafka::commit_transaction`]).
    producers: Vec<ThreadedProducer<Reporter>>,
    /// The index of the one that takes records now.
    active: AtomicUsize,
    /// A transaction was aborted, or its commit failed: no transaction
    /// begins under these epochs again (see the module's notes).
    spent: Arc<AtomicBool>,
    reports: mpsc::UnboundedReceiver<Report>,
}

/// Hands librdkafka's delivery reports, on its polling thread, to the
/// producer's owner: a tag and an outcome, no future or allocation per record.
struct Reporter {
    reports: mpsc::UnboundedSender<Report>,
}

impl ClientContext for Reporter {}

impl ProducerContext for Reporter {
    type DeliveryOpaque = Tag;

    fn delivery(&self, result: &DeliveryResult<'_>, tag: Tag) {
        if tag == UNREPORTED {
            return;
        }
        crate::faults::check("on_delivery_report");
        let outcome = match result {
            Ok(_) => Ok(()),
            Err((error, message)) => Err(refusal(error, message)),
        };
        // The owner gone, nobody waits for it.
        let _ = self.reports.send((tag, outcome));
    }
}

/// Kafka's refusal of a record as an error, naming the event by the record's
/// `event_id` header when the refusal is for good.
fn refusal(error: &KafkaError, message: &BorrowedMessage<'_>) -> Error {
    match error.rdkafka_error_code() {
        Some(code) if is_poison(code) => Error::Poison {
            event_id: message
                .headers()
                .and_then(|headers| {
                    headers
                        .iter()
                        .find(|h| h.key == header::EVENT_ID)
                        .and_then(|h| h.value)
                })
                .map_or_else(
                    || "a record without an event_id header".to_owned(),
                    |id| String::from_utf8_lossy(id).into_owned(),
                ),
            reason: format!("kafka refused it: {code}"),
        },
        _ => Error::Kafka(error.clone()),
    }
}

impl Producer {
    /// An idempotent producer: at least once, a retried send never
    /// duplicates or reorders.
    pub fn idempotent(config: &Config) -> Result<Self> {
        Self::of_clients(vec![settings(config)])
    }

    /// Two transactional producers taking turns, under `transactional_id`
    /// and `<transactional_id>.1` (see [`Kafka::commit_transaction`]).
    pub fn transactional(config: &Config, transactional_id: &str) -> Result<Self> {
        let mut client = settings(config);
        client.set(
            "transaction.timeout.ms",
            config.transaction_timeout.as_millis().to_string(),
        );
        let clients = [transactional_id.to_owned(), format!("{transactional_id}.1")]
            .into_iter()
            .map(|id| client.clone().set("transactional.id", id).clone())
            .collect();
        Self::of_clients(clients)
    }

    fn of_clients(clients: Vec<ClientConfig>) -> Result<Self> {
        let (sender, reports) = mpsc::unbounded_channel();
        let producers = clients
            .iter()
            .map(|client| {
                client.create_with_context(Reporter {
                    reports: sender.clone(),
                })
            })
            .collect::<KafkaResult<_>>()?;
        Ok(Producer {
            producers,
            active: AtomicUsize::new(0),
            spent: Arc::default(),
            reports,
        })
    }

    /// Connects each producer to a broker of the cluster, best effort,
    /// before its producer id is wanted. librdkafka asks for the id only
    /// over a connection to a broker it learned from the cluster, not over
    /// the bootstrap connection it closes once it knows the brokers; when
    /// none is up it tries again after half a second. Without this, half of
    /// the starts waited those 500 ms in `init_transactions` (and an
    /// idempotent producer's first records as long).
    pub async fn connect(&self) {
        for producer in &self.producers {
            let producer = producer.clone();
            let connected = tokio::task::spawn_blocking(move || {
                // The first answer may come from the bootstrap address (id
                // -1); the next goes over a connection to a cluster broker.
                for _ in 0..3 {
                    match producer.client().fetch_metadata(None, CONNECT_TIMEOUT) {
                        Ok(metadata) if metadata.orig_broker_id() >= 0 => return Ok(()),
                        Ok(_) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            })
            .await;
            if let Ok(Err(e)) = connected {
                // Nothing is lost: the producer keeps trying on its own.
                tracing::debug!(error = %e, "kafka not reached yet");
                return;
            }
        }
    }

    /// The producer that takes records now.
    fn active(&self) -> &ThreadedProducer<Reporter> {
        &self.producers[self.active.load(Ordering::Relaxed)]
    }

    /// Enqueues one event; its delivery report comes from
    /// [`Producer::reports`] with `tag`. A full local queue is backpressure,
    /// not an error: wait and try again.
    pub async fn send(&self, event: &OutboxEvent, route: &Route, tag: Tag) -> Result<()> {
        let mut headers = OwnedHeaders::new_with_capacity(route.headers.len());
        for (key, value) in &route.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let record = BaseRecord::with_opaque_to(&route.topic, tag)
            .key(event.aggregate_id.as_bytes())
            .payload(route.value.as_deref().unwrap_or(&event.payload[..]))
            .headers(headers);
        self.enqueue(record, &event.event_id).await
    }

    /// Enqueues a record that is not an event (the offset record); nobody
    /// waits for its report.
    pub async fn send_raw(&self, topic: &str, key: &str, value: &str) -> Result<()> {
        let record = BaseRecord::with_opaque_to(topic, UNREPORTED)
            .key(key.as_bytes())
            .payload(value.as_bytes());
        self.enqueue(record, "offset record").await
    }

    async fn enqueue(&self, mut record: BaseRecord<'_, [u8], [u8], Tag>, what: &str) -> Result<()> {
        loop {
            match self.active().send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((KafkaError::MessageProduction(code), _)) if is_poison(code) => {
                    return Err(Error::Poison {
                        event_id: what.to_owned(),
                        reason: format!("kafka refused it: {code}"),
                    })
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
    }

    /// Waits for delivery reports and moves those that arrived into `into`.
    /// Cancel-safe.
    pub async fn reports(&mut self, into: &mut Vec<Report>) {
        if self.reports.recv_many(into, REPORTS_AT_ONCE).await == 0 {
            // The sender lives in the producer: never closed while it lives.
            std::future::pending::<()>().await;
        }
    }

    /// Waits for the reports of the records sent with `tags`, calling
    /// `acknowledged` for each acknowledgement; the first refusal is the
    /// error. Reports of other records (left from an aborted batch) are
    /// passed over.
    pub async fn acknowledged(
        &mut self,
        tags: std::ops::Range<Tag>,
        mut acknowledged: impl FnMut(),
    ) -> Result<()> {
        let mut reports = Vec::new();
        let mut left = tags.len();
        while left > 0 {
            self.reports(&mut reports).await;
            for (_, outcome) in reports.drain(..).filter(|(tag, _)| tags.contains(tag)) {
                outcome?;
                left -= 1;
                acknowledged();
            }
        }
        Ok(())
    }

    /// Registers the transactional ids with the broker, fencing any older
    /// producer with the same ids and aborting their open transactions.
    pub async fn init_transactions(&self) -> Result<()> {
        for producer in &self.producers {
            blocking(producer.clone(), |p| p.init_transactions(TXN_CALL_TIMEOUT)).await?;
        }
        Ok(())
    }

    pub async fn begin_transaction(&self) -> Result<()> {
        if self.spent.load(Ordering::Acquire) {
            return Err(Error::EpochSpent);
        }
        blocking(self.active().clone(), |p| p.begin_transaction()).await
    }

    /// Commits the open transaction; every record in it is then delivered.
    pub async fn commit_transaction(&self) -> Result<()> {
        Kafka::commit_transaction(self).await
    }

    pub async fn abort_transaction(&self) -> Result<()> {
        self.spent.store(true, Ordering::Release);
        blocking(self.active().clone(), |p| {
            p.abort_transaction(TXN_CALL_TIMEOUT)
        })
        .await
    }

    /// Waits for queued records to be delivered, up to `timeout`.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        for producer in &self.producers {
            flush_now(producer, timeout)?;
        }
        Ok(())
    }
}

/// Runs a blocking transactional call on tokio's blocking pool.
async fn blocking(
    producer: ThreadedProducer<Reporter>,
    call: impl FnOnce(&ThreadedProducer<Reporter>) -> KafkaResult<()> + Send + 'static,
) -> Result<()> {
    tokio::task::spawn_blocking(move || call(&producer))
        .await
        .map_err(|e| Error::Bug(format!("kafka call panicked: {e}")))?
        .map_err(Error::from)
}

fn commit(producer: &ThreadedProducer<Reporter>) -> KafkaResult<()> {
    // commit_transaction flushes first, through rdkafka's flush, which waits
    // in steps of 100 ms (see `flush_now`); after this one it returns at once.
    flush_now(producer, TXN_CALL_TIMEOUT)?;
    producer.commit_transaction(TXN_CALL_TIMEOUT)
}

/// Waits until every queued record is acknowledged or refused, up to
/// `timeout`, sending at once what waits out `linger.ms`. rdkafka's own
/// flush polls for the reports in steps of 100 ms while the producer's
/// polling thread serves them, so it returns up to 100 ms late; librdkafka's
/// waits on a condition variable.
fn flush_now(producer: &ThreadedProducer<Reporter>, timeout: Duration) -> KafkaResult<()> {
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    #[allow(unsafe_code)]
    // SAFETY: the handle is valid while `producer` lives, and librdkafka's
    // flush may be called from any thread.
    let code = unsafe { rdkafka::bindings::rd_kafka_flush(producer.client().native_ptr(), millis) };
    match code {
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR => Ok(()),
        code => Err(KafkaError::Flush(code.into())),
    }
}

/// What a sink needs of Kafka. [`Producer`] is the real one; the pipeline's
/// tests have one in memory.
#[allow(async_fn_in_trait)]
pub trait Kafka {
    /// Enqueues an event as routed; its report comes from [`Kafka::reports`]
    /// with `tag`.
    async fn send(&self, event: &OutboxEvent, route: &Route, tag: Tag) -> Result<()>;
    /// Enqueues a record that is not an event (the offset record), whose
    /// report nobody waits for: its delivery is the commit's.
    async fn send_raw(&self, topic: &str, key: &str, value: &str) -> Result<()>;
    /// Waits for delivery reports, Kafka's acknowledgement or refusal of
    /// records sent, and moves those that arrived into `into`; pending for
    /// ever when none will. Cancel-safe.
    async fn reports(&mut self, into: &mut Vec<Report>);
    /// Registers the transactional id, fencing older producers of it.
    async fn init_transactions(&self) -> Result<()>;
    async fn begin_transaction(&self) -> Result<()>;
    /// Starts committing the open transaction; every record in it is
    /// delivered once the future resolves with `Ok`. The future runs on its
    /// own: it may be polled after the caller was cancelled.
    /// The next transaction goes through the other transactional id (see
    /// the module's notes): begin it once every record of this one is
    /// acknowledged, since records of two producers keep no order between
    /// them in a partition, and commit it once this commit returned.
    fn commit_transaction(&self) -> BoxFuture<'static, Result<()>>;
    async fn abort_transaction(&self) -> Result<()>;
    /// Waits for queued records to be delivered, up to `timeout`.
    fn flush(&self, timeout: Duration) -> Result<()>;
}

impl Kafka for Producer {
    async fn send(&self, event: &OutboxEvent, route: &Route, tag: Tag) -> Result<()> {
        Producer::send(self, event, route, tag).await
    }

    async fn send_raw(&self, topic: &str, key: &str, value: &str) -> Result<()> {
        Producer::send_raw(self, topic, key, value).await
    }

    async fn reports(&mut self, into: &mut Vec<Report>) {
        Producer::reports(self, into).await;
    }

    async fn init_transactions(&self) -> Result<()> {
        Producer::init_transactions(self).await
    }

    async fn begin_transaction(&self) -> Result<()> {
        Producer::begin_transaction(self).await
    }

    fn commit_transaction(&self) -> BoxFuture<'static, Result<()>> {
        let committing = self.active().clone();
        let turns = self.producers.len();
        self.active.store(
            (self.active.load(Ordering::Relaxed) + 1) % turns,
            Ordering::Relaxed,
        );
        let spent = self.spent.clone();
        blocking(committing, commit)
            .inspect(move |result| {
                if result.is_err() {
                    spent.store(true, Ordering::Release);
                }
            })
            .boxed()
    }

    async fn abort_transaction(&self) -> Result<()> {
        Producer::abort_transaction(self).await
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        Producer::flush(self, timeout)
    }
}

/// The librdkafka settings of the forwarder's producers, transactional id
/// aside: the operator's `kafka_properties` under ours.
fn settings(config: &Config) -> ClientConfig {
    let mut client = config.kafka_client();
    for (key, value, _option) in crate::config::PRODUCER_GUARANTEES {
        client.set(key, value);
    }
    // Defaults the operator's kafka_properties may change. The timeouts:
    // a broker that hangs with its sockets open answers nothing, and
    // librdkafka waits out socket.timeout.ms (60 s by default) on each
    // request to it before it asks the cluster who leads now; a broker that
    // was down is tried again after a backoff that grows to
    // reconnect.backoff.max.ms (10 s by default) while it restarts.
    for (key, value) in [
        ("linger.ms", "5"),
        ("client.id", "outbox-forwarder"),
        ("socket.timeout.ms", "10000"),
        ("request.timeout.ms", "10000"),
        ("reconnect.backoff.max.ms", "1000"),
    ] {
        if client.get(key).is_none() {
            client.set(key, value);
        }
    }
    client
}

/// Codes that say this record will never be accepted, whatever the retry.
pub fn is_poison(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::InvalidRecord
    )
}

/// Whether a Kafka error means another instance took over the transactional id.
pub fn is_fenced(error: &Error) -> bool {
    match error {
        Error::Kafka(KafkaError::Transaction(e)) => matches!(
            e.code(),
            RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::Fenced
        ),
        Error::Kafka(e) => matches!(
            e.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::ProducerFenced
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::Fenced
            )
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_properties_change_the_defaults_but_not_the_guarantees() {
        let mut config = Config::new("postgres://u@h/db", "k:9092").expect("config");
        let defaults = settings(&config);
        assert_eq!(defaults.get("linger.ms"), Some("5"));
        assert_eq!(defaults.get("client.id"), Some("outbox-forwarder"));
        for (key, value) in [("linger.ms", "20"), ("client.id", "orders-relay")] {
            config.kafka_properties.0.insert(key.into(), value.into());
        }
        let tuned = settings(&config);
        assert_eq!(tuned.get("linger.ms"), Some("20"));
        assert_eq!(tuned.get("client.id"), Some("orders-relay"));
        assert_eq!(tuned.get("enable.idempotence"), Some("true"));
        assert_eq!(tuned.get("acks"), Some("all"));
    }
}
