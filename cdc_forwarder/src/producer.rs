//! The Kafka side. At-least-once: an idempotent producer (`acks=all`) whose
//! delivery reports decide when a transaction may be confirmed. Exactly-once:
//! the same producer made transactional, with a `transactional.id` derived
//! from the slot so a second forwarder on the slot fences the first.
//!
//! The transactional calls block; they run on tokio's blocking pool, never on
//! the async workers.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use rdkafka::types::RDKafkaRespErr;

use crate::config::{Config, Delivery};
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::routing::Route;

/// How long a blocking transactional call may take.
const TXN_CALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone)]
pub struct Producer {
    inner: FutureProducer,
}

impl Producer {
    pub fn new(config: &Config) -> Result<Self> {
        let mut client = config.kafka_client();
        client
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // The Java client's partitioner for keyed records, so Java
            // producers and consumers agree with us on a key's partition.
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "5")
            .set("client.id", "outbox-forwarder");
        if config.delivery == Delivery::ExactlyOnce {
            client
                .set("transactional.id", config.transactional_id())
                .set(
                    "transaction.timeout.ms",
                    config.transaction_timeout.as_millis().to_string(),
                );
        }
        let inner: FutureProducer = client.create()?;
        Ok(Producer { inner })
    }

    /// Enqueues one event; the returned future resolves with its delivery report.
    /// A full local queue is backpressure, not an error: wait and try again.
    pub async fn send(&self, event: &OutboxEvent, route: &Route) -> Result<DeliveryFuture> {
        let mut headers = OwnedHeaders::new_with_capacity(route.headers.len());
        for (key, value) in &route.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let record = FutureRecord::to(&route.topic)
            .key(event.aggregate_id.as_bytes())
            .payload(route.value.as_deref().unwrap_or(&event.payload[..]))
            .headers(headers);
        self.enqueue(record, &event.event_id).await
    }

    /// Enqueues a record that is not an event (the offset record).
    pub async fn send_raw(&self, topic: &str, key: &str, value: &str) -> Result<DeliveryFuture> {
        let record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(value.as_bytes());
        self.enqueue(record, "offset record").await
    }

    async fn enqueue(
        &self,
        mut record: FutureRecord<'_, [u8], [u8]>,
        what: &str,
    ) -> Result<DeliveryFuture> {
        loop {
            match self.inner.send_result(record) {
                Ok(delivery) => return Ok(delivery),
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

    /// Registers the transactional id with the broker, fencing any older
    /// producer with the same id and aborting its open transaction.
    pub async fn init_transactions(&self) -> Result<()> {
        self.blocking(|p| p.init_transactions(TXN_CALL_TIMEOUT))
            .await
    }

    pub async fn begin_transaction(&self) -> Result<()> {
        self.blocking(|p| p.begin_transaction()).await
    }

    /// Commits the open transaction; every record in it is then delivered.
    pub async fn commit_transaction(&self) -> Result<()> {
        self.blocking(|p| {
            // commit_transaction flushes first, through rdkafka's flush,
            // which waits in steps of 100 ms (see `flush_now`); after this
            // one it returns at once.
            flush_now(p, TXN_CALL_TIMEOUT)?;
            p.commit_transaction(TXN_CALL_TIMEOUT)
        })
        .await
    }

    pub async fn abort_transaction(&self) -> Result<()> {
        self.blocking(|p| p.abort_transaction(TXN_CALL_TIMEOUT))
            .await
    }

    async fn blocking(
        &self,
        call: impl FnOnce(&FutureProducer) -> rdkafka::error::KafkaResult<()> + Send + 'static,
    ) -> Result<()> {
        let producer = self.inner.clone();
        tokio::task::spawn_blocking(move || call(&producer))
            .await
            .map_err(|e| Error::Setup(format!("kafka call panicked: {e}")))?
            .map_err(Error::from)
    }

    /// Waits for queued records to be delivered, up to `timeout`.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        flush_now(&self.inner, timeout)?;
        Ok(())
    }
}

/// Waits until every queued record is acknowledged or refused, up to
/// `timeout`, sending at once what waits out `linger.ms`. rdkafka's own
/// flush polls for the reports in steps of 100 ms while the producer's
/// polling thread serves them, so it returns up to 100 ms late; librdkafka's
/// waits on a condition variable.
fn flush_now(producer: &FutureProducer, timeout: Duration) -> KafkaResult<()> {
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
    /// Resolves when Kafka acknowledged the record, or refused it: a refusal
    /// for good is [`Error::Poison`] naming the event.
    type Delivery: Future<Output = Result<()>> + Unpin + 'static;

    /// Enqueues an event as routed.
    async fn send(&self, event: &OutboxEvent, route: &Route) -> Result<Self::Delivery>;
    /// Enqueues a record that is not an event (the offset record).
    async fn send_raw(&self, topic: &str, key: &str, value: &str) -> Result<Self::Delivery>;
    /// Registers the transactional id, fencing older producers of it.
    async fn init_transactions(&self) -> Result<()>;
    async fn begin_transaction(&self) -> Result<()>;
    /// Starts committing the open transaction; every record in it is
    /// delivered once the future resolves with `Ok`. The future runs on its
    /// own: it may be polled after the caller was cancelled.
    fn commit_transaction(&self) -> BoxFuture<'static, Result<()>>;
    async fn abort_transaction(&self) -> Result<()>;
    /// Waits for queued records to be delivered, up to `timeout`.
    fn flush(&self, timeout: Duration) -> Result<()>;
}

impl Kafka for Producer {
    type Delivery = BoxFuture<'static, Result<()>>;

    async fn send(&self, event: &OutboxEvent, route: &Route) -> Result<Self::Delivery> {
        let delivery = Producer::send(self, event, route).await?;
        Ok(classify(delivery, &event.event_id))
    }

    async fn send_raw(&self, topic: &str, key: &str, value: &str) -> Result<Self::Delivery> {
        let delivery = Producer::send_raw(self, topic, key, value).await?;
        Ok(classify(delivery, "offset record"))
    }

    async fn init_transactions(&self) -> Result<()> {
        Producer::init_transactions(self).await
    }

    async fn begin_transaction(&self) -> Result<()> {
        Producer::begin_transaction(self).await
    }

    fn commit_transaction(&self) -> BoxFuture<'static, Result<()>> {
        let producer = self.clone();
        async move { Producer::commit_transaction(&producer).await }.boxed()
    }

    async fn abort_transaction(&self) -> Result<()> {
        Producer::abort_transaction(self).await
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        Producer::flush(self, timeout)
    }
}

/// A delivery report as a result, naming the event when Kafka refuses it
/// for good.
fn classify(report: DeliveryFuture, what: &str) -> BoxFuture<'static, Result<()>> {
    let what = what.to_owned();
    async move {
        match report.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => Err(match e.rdkafka_error_code() {
                Some(code) if is_poison(code) => Error::Poison {
                    event_id: what,
                    reason: format!("kafka refused it: {code}"),
                },
                _ => Error::Kafka(e),
            }),
            Err(_) => Err(Error::Kafka(KafkaError::Canceled)),
        }
    }
    .boxed()
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
