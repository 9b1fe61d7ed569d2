//! Where events go: a [`Sink`] takes the [`crate::source::Change`]s of the
//! source and answers one question, which position is confirmable now (see
//! [`crate::ledger`] for the rule). Two sinks:
//!
//! - [`AtLeastOnce`]: an idempotent producer; a transaction is confirmable
//!   when every one of its events has its delivery report, and so is every
//!   transaction before it. A crash replays from the slot: events can repeat,
//!   never go missing.
//! - [`Transactional`] (exactly-once): whole PostgreSQL transactions go into
//!   Kafka transactions with an offset record (see [`crate::offsets`]); one
//!   commit is in flight at a time, and the next transaction takes what
//!   arrives meanwhile once the committing one's records are acknowledged
//!   (buffered, bounded, until then).
//!
//! Both route events with the [`Router`] and send poison events (refused by
//! routing or by Kafka for good) to the dead-letter topic, or halt on them
//! when none is configured: never skipped silently.

mod at_least_once;
pub mod transactional;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

pub use at_least_once::AtLeastOnce;
pub use transactional::Transactional;

use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::horizon::{Horizon, Mark};
use crate::ledger::{Released, TxnId};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::parking::{Behind, Parking};
use crate::producer::{Kafka, Report, Tag};
use crate::routing::{Route, Router};

/// How long a sink's graceful shutdown waits for outstanding deliveries.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The PostgreSQL epoch (2000-01-01) in microseconds since the Unix epoch.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;
/// A dead-lettered event keeps its payload up to this size.
const DEAD_LETTER_MAX_PAYLOAD: usize = 512 * 1024;

/// The Kafka side of the pipeline. Events arrive between a [`Sink::begin`]
/// and a [`Sink::commit`], in commit order.
#[allow(async_fn_in_trait)]
pub trait Sink {
    /// Setup before anything is sent (exactly-once: the offsets topic).
    async fn prepare(&mut self) -> Result<()>;
    /// Called once the slot is ours: fences older producers where that
    /// matters and returns the position Kafka already holds, if it keeps one.
    async fn claim(&mut self) -> Result<Option<Lsn>>;

    /// A transaction begins: `xid` is its id, none for the catch-up's.
    fn begin(&mut self, xid: Option<u32>);
    async fn event(&mut self, event: OutboxEvent) -> Result<()>;
    /// `commit_time_micros` is none for the first-start catch-up; `more`:
    /// the source had more changes ready behind this commit.
    async fn commit(
        &mut self,
        end_lsn: Lsn,
        commit_time_micros: Option<i64>,
        more: bool,
    ) -> Result<()>;
    fn keepalive(&mut self, wal_end: Lsn);

    /// Whether the source may send more now (bounded memory).
    fn has_room(&self) -> bool;
    /// Whether a transaction's Begin arrived and its Commit not yet.
    fn reading(&self) -> bool;
    /// What Kafka does not durably hold yet, in the ledger's holds.
    fn held(&self) -> usize;
    /// Something the sink waited for: a delivery report, a Kafka commit, a timer.
    type Step;
    /// Waits for the sink's next step; pending for ever when nothing is
    /// under way. Cancel-safe: it only waits, [`Sink::apply`] acts.
    async fn wait(&mut self) -> Result<Self::Step>;
    async fn apply(&mut self, step: Self::Step) -> Result<()>;
    /// The position to confirm to the source, when it moved.
    fn confirmable(&mut self) -> Option<Lsn>;

    /// A snapshot and the WAL position after it, for sinks that keep a
    /// [`Horizon`] (exactly-once).
    fn mark(&mut self, _mark: Mark) {}
    /// The transactions Kafka is known to hold, where the sink keeps that.
    fn horizon_in_kafka(&self) -> Option<Horizon> {
        None
    }

    /// Graceful end: delivers what can be delivered of complete transactions
    /// and abandons a transaction still being read (it is replayed).
    async fn finish(&mut self) -> Result<()>;
    /// The session ends in `error`: leaves Kafka as clean as it can.
    async fn abandon(&mut self, error: &Error);
}

/// Routes events and sends them or their dead letters.
pub struct Publisher<K> {
    pub kafka: K,
    router: Arc<Router>,
    dead_letter_topic: Option<String>,
    /// Events Kafka refused at delivery in an earlier session, also when
    /// sent alone: poison for certain.
    poisoned: HashSet<String>,
    /// Events Kafka refused at delivery once: the broker refuses a whole
    /// batch for one record too large, so the event named may only have
    /// shared a batch with the poison. Sent alone, it tells which it is.
    suspects: HashSet<String>,
    /// With a dead-letter topic: the parked aggregates (none when the
    /// operator chose unordered dead letters).
    parking: Option<Parking>,
    metrics: Arc<Metrics>,
}

impl<K: Kafka> Publisher<K> {
    pub fn new(
        kafka: K,
        router: Arc<Router>,
        dead_letter_topic: Option<String>,
        poisoned: HashSet<String>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Publisher {
            kafka,
            router,
            dead_letter_topic,
            poisoned,
            suspects: HashSet::new(),
            parking: None,
            metrics,
        }
    }

    /// Events refused at delivery once, to be sent alone (see `suspects`).
    pub fn with_suspects(mut self, suspects: HashSet<String>) -> Self {
        self.suspects = suspects;
        self
    }

    /// Dead letters park their aggregates (see [`crate::parking`]).
    pub fn with_parking(mut self, parking: Parking) -> Self {
        self.parking = Some(parking);
        self
    }

    /// Sends `event` where it routes, or to the dead-letter topic when it is
    /// poison, with `tag` for its delivery report. Returns its size.
    pub async fn publish(&mut self, event: OutboxEvent, tag: Tag) -> Result<usize> {
        let size = event.size();
        if let Some(parking) = &mut self.parking {
            if let Some(behind) = parking.held_behind(&event).await? {
                if behind.first_event_id == event.event_id {
                    // Sent again (a replay): it stays a dead letter until redrive.
                    let reason = "dead-lettered before; its aggregate is parked behind it".into();
                    self.send_dead_letter(event, reason, None, Vec::new(), tag)
                        .await?;
                } else {
                    self.park_behind(event, behind, tag).await?;
                }
                return Ok(size);
            }
        }
        if self.poisoned.contains(&event.event_id) {
            self.dead_letter(event, "kafka refused it at delivery".into(), None, tag)
                .await?;
            return Ok(size);
        }
        let route = match self.router.route(&event) {
            Ok(route) => route,
            Err(e) => {
                self.dead_letter(event, e.to_string(), None, tag).await?;
                return Ok(size);
            }
        };
        crate::faults::check("before_produce");
        let alone = self.suspects.contains(&event.event_id);
        if alone {
            // In a batch of its own: delivered, or refused for itself.
            self.kafka.flush(DRAIN_TIMEOUT)?;
        }
        let sent = self.kafka.send(&event, &route, tag).await;
        if alone && sent.is_ok() {
            self.kafka.flush(DRAIN_TIMEOUT)?;
        }
        match sent {
            Ok(()) => {}
            Err(Error::Poison { reason, .. }) => {
                self.dead_letter(event, reason, Some(route.topic), tag)
                    .await?;
            }
            Err(e) => return Err(e),
        }
        crate::faults::check("after_produce");
        Ok(size)
    }

    /// A poison event: an error that halts the forwarder, or with a
    /// dead-letter topic a record there with the reason in its headers.
    async fn dead_letter(
        &mut self,
        event: OutboxEvent,
        reason: String,
        topic: Option<String>,
        tag: Tag,
    ) -> Result<()> {
        if self.dead_letter_topic.is_none() {
            tracing::error!(event_id = %event.event_id, reason = %reason, "poison event; halting (configure a dead-letter topic to divert such events)");
            return Err(Error::Poison {
                event_id: event.event_id,
                reason,
            });
        }
        if let Some(parking) = &mut self.parking {
            if let Some(behind) = parking.park(&event, &reason).await? {
                if behind.first_event_id != event.event_id {
                    // Poison too, but behind an earlier one of its aggregate.
                    return self.park_behind(event, behind, tag).await;
                }
            }
        }
        self.send_dead_letter(event, reason, topic, Vec::new(), tag)
            .await
    }

    /// An event held back behind its aggregate's first dead-lettered event.
    async fn park_behind(&mut self, event: OutboxEvent, behind: Behind, tag: Tag) -> Result<()> {
        let reason = format!(
            "parked behind event {} (aggregate_seq {}) of its aggregate",
            behind.first_event_id, behind.first_seq
        );
        let extra = vec![(
            "dead_letter_parked_behind".to_owned(),
            behind.first_event_id,
        )];
        self.metrics.parking.parked_events.inc();
        self.send_dead_letter(event, reason, None, extra, tag).await
    }

    async fn send_dead_letter(
        &mut self,
        mut event: OutboxEvent,
        reason: String,
        topic: Option<String>,
        extra: Vec<(String, String)>,
        tag: Tag,
    ) -> Result<()> {
        let Some(dead_letter_topic) = &self.dead_letter_topic else {
            return Err(Error::Poison {
                event_id: event.event_id,
                reason,
            });
        };
        let mut headers = vec![
            ("event_id".to_owned(), event.event_id.clone()),
            ("event_type".to_owned(), event.event_type.clone()),
            ("aggregate_type".to_owned(), event.aggregate_type.clone()),
            ("aggregate_seq".to_owned(), event.aggregate_seq.to_string()),
            ("dead_letter_reason".to_owned(), reason.clone()),
        ];
        if let Some(topic) = topic.or_else(|| event.topic.clone()) {
            headers.push(("dead_letter_topic".to_owned(), topic));
        }
        headers.extend(extra);
        if event.payload.len() > DEAD_LETTER_MAX_PAYLOAD {
            // Too large for Kafka: the payload stays in outbox.events.
            headers.push(("dead_letter_payload_dropped".to_owned(), "true".to_owned()));
            event.payload = bytes::Bytes::new();
        }
        event.headers = None;
        let route = Route {
            topic: dead_letter_topic.clone(),
            headers,
            value: None,
        };
        self.kafka.send(&event, &route, tag).await?;
        self.metrics.parking.dead_lettered.inc();
        tracing::warn!(event_id = %event.event_id, reason = %reason, topic = %dead_letter_topic, "poison event sent to the dead-letter topic");
        Ok(())
    }
}

/// The records sent and not yet reported, by tag. Tags are handed out in
/// sending order; reports come back in any order across partitions.
#[derive(Debug, Default)]
struct InFlight {
    /// The tag of `records[0]`.
    first: Tag,
    /// Each record's transaction and size; none once reported.
    records: VecDeque<Option<(TxnId, usize)>>,
    len: usize,
    bytes: usize,
}

impl InFlight {
    /// The tag the next record is sent with.
    fn next_tag(&self) -> Tag {
        self.first + self.records.len()
    }

    /// The record tagged [`InFlight::next_tag`] was sent.
    fn sent(&mut self, txn: TxnId, size: usize) {
        self.records.push_back(Some((txn, size)));
        self.len += 1;
        self.bytes += size;
    }

    /// The transaction and size of the record a report is for; none when it
    /// is not in flight.
    fn reported(&mut self, tag: Tag) -> Option<(TxnId, usize)> {
        let record = self.records.get_mut(tag.checked_sub(self.first)?)?.take()?;
        self.len -= 1;
        self.bytes -= record.1;
        while let Some(None) = self.records.front() {
            self.records.pop_front();
            self.first += 1;
        }
        Some(record)
    }

    /// Takes `reports`: each acknowledged record of those in flight gives
    /// its transaction to `acknowledged`; a refusal is the error.
    fn take(
        &mut self,
        reports: &mut Vec<Report>,
        mut acknowledged: impl FnMut(TxnId),
    ) -> Result<()> {
        for (tag, outcome) in reports.drain(..) {
            if let Some((txn, _)) = self.reported(tag) {
                outcome?;
                acknowledged(txn);
            }
        }
        Ok(())
    }

    fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Counts a transaction that left the ledger in the forwarded totals and its
/// commit-to-acknowledgement time. The first-start catch-up, which has no
/// commit time, has a counter of its own.
fn count_released(metrics: &Metrics, now_unix_micros: i64, released: Released) {
    let Some(committed) = released.commit_time else {
        return;
    };
    metrics.transactions.inc();
    metrics.events.inc_by(released.events as u64);
    metrics.bytes.inc_by(released.bytes as u64);
    let micros = now_unix_micros - (committed + PG_EPOCH_UNIX_MICROS);
    metrics
        .end_to_end_seconds
        .observe((micros.max(0) as f64) / 1e6);
}

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::InFlight;

    #[test]
    fn reports_in_any_order_free_their_records_once() {
        let mut in_flight = InFlight::default();
        for (txn, size) in [(0, 10), (0, 20), (1, 30)] {
            assert_eq!(
                in_flight.next_tag(),
                in_flight.first + in_flight.records.len()
            );
            in_flight.sent(txn, size);
        }
        assert_eq!(in_flight.reported(1), Some((0, 20)));
        assert_eq!(in_flight.reported(1), None, "a report counts once");
        assert_eq!((in_flight.len(), in_flight.bytes()), (2, 40));
        assert_eq!(in_flight.reported(0), Some((0, 10)));
        assert_eq!(in_flight.next_tag(), 3, "tags are never handed out twice");
        assert_eq!(in_flight.reported(7), None, "a tag never sent");
        assert_eq!(in_flight.reported(2), Some((1, 30)));
        assert_eq!((in_flight.len(), in_flight.bytes()), (0, 0));
        assert!(in_flight.records.is_empty());
    }
}
