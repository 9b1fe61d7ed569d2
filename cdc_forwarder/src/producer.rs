//! The Kafka side: an idempotent producer (`acks=all`) whose delivery reports
//! decide when a transaction may be confirmed to the slot.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::routing::Route;

pub struct Producer {
    inner: FutureProducer,
}

impl Producer {
    pub fn new(config: &Config) -> Result<Self> {
        let inner: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &config.kafka_bootstrap)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // The Java client's partitioner for keyed records, so Java
            // producers and consumers agree with us on a key's partition.
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "5")
            .set("client.id", "outbox-forwarder")
            .create()?;
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
        let mut record = FutureRecord::to(&route.topic)
            .key(event.aggregate_id.as_bytes())
            .payload(&event.payload[..])
            .headers(headers);
        loop {
            match self.inner.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((KafkaError::MessageProduction(code), _)) if is_poison(code) => {
                    return Err(Error::Poison {
                        event_id: event.event_id.clone(),
                        reason: format!("kafka refused it: {code}"),
                    })
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
    }

    /// Waits for queued records to be delivered, up to `timeout`.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        self.inner.flush(timeout)?;
        Ok(())
    }
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
