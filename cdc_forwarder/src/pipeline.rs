//! The forwarding pipeline and its one subtle rule: when a position may be
//! confirmed to the replication slot.
//!
//! ```text
//!  slot ──pgoutput──▶ decode ──▶ route ──▶ produce ──▶ delivery reports
//!   ▲                                                        │
//!   └────────────── confirm(commit end LSN) ◀── tracker ◀────┘
//! ```
//!
//! PostgreSQL restarts a logical slot at its `confirmed_flush_lsn` and
//! silently skips every transaction that committed at or before it. So a
//! position is confirmed only when every event of every transaction up to it
//! has a successful delivery report from Kafka (`acks=all`). Positions are
//! whole transactions (the commit's end LSN), never single rows: several
//! events share one commit.
//!
//! The [`Tracker`] keeps the transactions in stream order with the number of
//! their events still waiting for a report. Only the oldest transactions that
//! are committed and fully delivered are released, so the confirmed position
//! never passes a transaction that is still in flight, even when reports for
//! later transactions arrive first.
//!
//! An idle outbox must not pin WAL while the rest of the database writes. When
//! nothing is in flight and no transaction is open, a keepalive's position is
//! confirmed: the server has sent everything before it, and we have delivered
//! all of that. Transactions still running on the server commit later, at a
//! higher position, so they are sent again after a restart.
//!
//! On any error the session ends without confirming more; the next session
//! replays from the slot, so delivery is at least once.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use rand::Rng;
use tokio::sync::watch;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::event::EventLayout;
use crate::lsn::Lsn;
use crate::pgoutput::Message;
use crate::producer::{is_poison, Producer};
use crate::replication::{ReplicationStream, StreamEvent};
use crate::routing::Router;
use crate::slot;

/// How long a graceful shutdown waits for outstanding delivery reports.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the forwarder until `shutdown` turns true, reconnecting after
/// transient failures with exponential backoff and jitter.
pub async fn run(config: Config, mut shutdown: watch::Receiver<bool>) -> Result<()> {
    let producer = Producer::new(&config)?;
    let router = Router::new(config.topic_template.clone());
    let mut failures: u32 = 0;
    loop {
        let started = Instant::now();
        match run_session(&config, &producer, &router, &mut shutdown).await {
            Ok(()) => return Ok(()),
            Err(error) if error.is_retryable() => {
                if started.elapsed() > Duration::from_secs(30) {
                    failures = 0;
                }
                failures = failures.saturating_add(1);
                let wait = backoff(failures, config.max_backoff);
                tracing::warn!(error = %error, retry_in_ms = wait.as_millis() as u64, "session ended, reconnecting");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
            }
            Err(error) => return Err(error),
        }
    }
}

/// Exponential backoff from 100 ms up to `max`, with full jitter on the upper half.
fn backoff(failures: u32, max: Duration) -> Duration {
    let base = Duration::from_millis(100).saturating_mul(1 << failures.min(16));
    let capped = base.min(max);
    let half = capped / 2;
    half + rand::rng().random_range(Duration::ZERO..=half)
}

async fn run_session(
    config: &Config,
    producer: &Producer,
    router: &Router,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<()> {
    let sql = slot::connect(&config.postgres).await?;
    slot::prepare(&sql, config).await?;
    let mut stream = ReplicationStream::start(config).await?;
    tracing::info!(slot = %config.slot, publication = %config.publication, database = %config.postgres.dbname(), "streaming");

    let mut tracker = Tracker::default();
    let mut deliveries = FuturesUnordered::new();
    let mut layout: Option<EventLayout> = None;
    let mut open: Option<u64> = None;
    let mut confirmed = Lsn::ZERO;

    loop {
        let has_room = tracker.events < config.max_in_flight_events
            && tracker.bytes < config.max_in_flight_bytes;
        tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            Some((txn, size, result)) = deliveries.next(), if !deliveries.is_empty() => {
                result?;
                tracker.delivered(txn, size);
                confirm(&stream, &mut tracker, &mut confirmed);
            }
            event = stream.next(), if has_room => {
                let Some(event) = event? else {
                    return Err(Error::Replication(pgwire_replication::PgWireError::Io(
                        std::sync::Arc::new(std::io::ErrorKind::UnexpectedEof.into()),
                    )));
                };
                match event {
                    StreamEvent::Begin { .. } => open = Some(tracker.begin()),
                    StreamEvent::Change(Message::Relation(relation)) => {
                        if EventLayout::is_events_table(&relation) {
                            layout = Some(EventLayout::from_relation(&relation)?);
                        }
                    }
                    StreamEvent::Change(Message::Insert { relation_id, values }) => {
                        let (Some(layout), Some(txn)) = (&layout, open) else {
                            return Err(Error::Setup("insert arrived before its relation or transaction".into()));
                        };
                        if layout.relation_id() != relation_id {
                            tracing::warn!(relation_id, "ignoring insert into a table that is not outbox.events");
                            continue;
                        }
                        let event = layout.event(values)?;
                        let route = router.route(&event).map_err(|e| Error::from((event.event_id.clone(), e)))?;
                        let size = event.size();
                        let report = producer.send(&event, &route).await?;
                        tracker.produced(txn, size);
                        let event_id = event.event_id;
                        deliveries.push(async move {
                            let result = match report.await {
                                Ok(Ok(_)) => Ok(()),
                                Ok(Err((e, _))) => Err(match e.rdkafka_error_code() {
                                    Some(code) if is_poison(code) => Error::Poison {
                                        event_id,
                                        reason: format!("kafka refused it: {code}"),
                                    },
                                    _ => Error::Kafka(e),
                                }),
                                Err(_) => Err(Error::Kafka(rdkafka::error::KafkaError::Canceled)),
                            };
                            (txn, size, result)
                        });
                    }
                    StreamEvent::Change(Message::Other(tag)) => {
                        tracing::debug!(tag = %(tag as char), "ignoring pgoutput message");
                    }
                    StreamEvent::Change(Message::Begin { .. } | Message::Commit { .. }) => {}
                    StreamEvent::Commit { end_lsn, .. } => {
                        if let Some(txn) = open.take() {
                            tracker.commit(txn, end_lsn);
                            confirm(&stream, &mut tracker, &mut confirmed);
                        }
                    }
                    StreamEvent::KeepAlive { wal_end } => {
                        if open.is_none() && tracker.is_empty() && wal_end > confirmed {
                            confirmed = wal_end;
                            stream.confirm(wal_end);
                        }
                    }
                }
            }
        }
    }

    // Graceful shutdown: read nothing more, let outstanding deliveries finish,
    // confirm what is complete, then close the stream.
    tracing::info!(
        in_flight = tracker.events,
        "shutting down, draining deliveries"
    );
    let deadline = tokio::time::sleep(DRAIN_TIMEOUT);
    tokio::pin!(deadline);
    while !deliveries.is_empty() {
        tokio::select! {
            Some((txn, size, result)) = deliveries.next() => {
                if let Err(error) = result {
                    tracing::warn!(error = %error, "delivery failed during shutdown; it will be replayed");
                    break;
                }
                tracker.delivered(txn, size);
                confirm(&stream, &mut tracker, &mut confirmed);
            }
            _ = &mut deadline => {
                tracing::warn!(in_flight = tracker.events, "drain timed out; undelivered events will be replayed");
                break;
            }
        }
    }
    stream.close().await?;
    // The stream may have closed before its last status update went out.
    slot::advance(&sql, &config.slot, confirmed).await?;
    tracing::info!(confirmed_lsn = %confirmed, "stopped");
    Ok(())
}

fn confirm(stream: &ReplicationStream, tracker: &mut Tracker, confirmed: &mut Lsn) {
    if let Some(lsn) = tracker.release() {
        if lsn > *confirmed {
            *confirmed = lsn;
            stream.confirm(lsn);
            tracing::debug!(lsn = %lsn, "confirmed");
        }
    }
}

/// Transactions in stream order, each with its events still awaiting a
/// delivery report. See the module documentation.
#[derive(Debug, Default)]
pub struct Tracker {
    txns: VecDeque<Txn>,
    /// Id of `txns[0]`.
    first: u64,
    /// Events produced and not yet reported, over all transactions.
    pub events: usize,
    /// Their approximate size in bytes.
    pub bytes: usize,
}

#[derive(Debug, Default)]
struct Txn {
    end_lsn: Option<Lsn>,
    outstanding: usize,
}

impl Tracker {
    /// Opens a transaction and returns its id.
    pub fn begin(&mut self) -> u64 {
        self.txns.push_back(Txn::default());
        self.first + self.txns.len() as u64 - 1
    }

    fn txn(&mut self, id: u64) -> &mut Txn {
        let index = usize::try_from(id - self.first).unwrap_or(usize::MAX);
        &mut self.txns[index]
    }

    pub fn produced(&mut self, id: u64, size: usize) {
        self.txn(id).outstanding += 1;
        self.events += 1;
        self.bytes += size;
    }

    pub fn delivered(&mut self, id: u64, size: usize) {
        self.txn(id).outstanding -= 1;
        self.events -= 1;
        self.bytes -= size;
    }

    pub fn commit(&mut self, id: u64, end_lsn: Lsn) {
        self.txn(id).end_lsn = Some(end_lsn);
    }

    /// Drops the oldest transactions that are committed and fully delivered,
    /// and returns the commit end position of the last one dropped.
    pub fn release(&mut self) -> Option<Lsn> {
        let mut released = None;
        while let Some(front) = self.txns.front() {
            match front.end_lsn {
                Some(lsn) if front.outstanding == 0 => {
                    released = Some(lsn);
                    self.txns.pop_front();
                    self.first += 1;
                }
                _ => break,
            }
        }
        released
    }

    pub fn is_empty(&self) -> bool {
        self.txns.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_is_released_only_when_everything_before_it_is_delivered() {
        let mut t = Tracker::default();
        let a = t.begin();
        t.produced(a, 10);
        t.produced(a, 10);
        t.commit(a, Lsn(100));
        let b = t.begin();
        t.produced(b, 10);
        t.commit(b, Lsn(200));

        // b's only report arrives first: nothing may be confirmed yet.
        t.delivered(b, 10);
        assert_eq!(t.release(), None);
        t.delivered(a, 10);
        assert_eq!(t.release(), None, "a still has one event in flight");
        t.delivered(a, 10);
        assert_eq!(t.release(), Some(Lsn(200)));
        assert!(t.is_empty());
        assert_eq!((t.events, t.bytes), (0, 0));
    }

    #[test]
    fn an_open_transaction_holds_back_later_ones() {
        let mut t = Tracker::default();
        let a = t.begin();
        t.produced(a, 1);
        t.delivered(a, 1);
        assert_eq!(t.release(), None, "a has not committed");
        t.commit(a, Lsn(7));
        assert_eq!(t.release(), Some(Lsn(7)));
        let b = t.begin();
        t.commit(b, Lsn(9));
        assert_eq!(
            t.release(),
            Some(Lsn(9)),
            "an empty transaction is released at once"
        );
    }

    #[test]
    fn backoff_grows_and_stays_under_the_cap() {
        let max = Duration::from_secs(5);
        for failures in 1..40 {
            let d = backoff(failures, max);
            assert!(d <= max, "{d:?}");
        }
        assert!(backoff(1, max) <= Duration::from_millis(200));
        assert!(backoff(10, max) >= Duration::from_millis(2500));
    }
}
