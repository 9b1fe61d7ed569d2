//! The forwarding pipeline and its one subtle rule: when a position may be
//! confirmed to the replication slot.
//!
//! ```text
//!  slot ──pgoutput──▶ decode ──▶ route ──▶ produce ──▶ delivery reports / Kafka commit
//!   ▲                                                        │
//!   └────────────── confirm(commit end LSN) ◀────────────────┘
//! ```
//!
//! PostgreSQL restarts a logical slot at its `confirmed_flush_lsn` and
//! silently skips every transaction that committed at or before it. So a
//! position is confirmed only when Kafka durably has every event up to it.
//! Positions are whole transactions (the commit's end LSN), never single
//! rows: several events share one commit.
//!
//! At-least-once: the [`Tracker`] keeps the transactions in stream order with
//! the number of their events still waiting for a delivery report (`acks=all`).
//! Only the oldest transactions that are committed and fully delivered are
//! released, so the confirmed position never passes a transaction still in
//! flight, even when reports for later transactions arrive first. A crash
//! replays from the slot: events can repeat, never go missing.
//!
//! Exactly-once: events go into a Kafka transaction that also carries an
//! offset record (see [`crate::offsets`]); it holds whole PostgreSQL
//! transactions and is committed when it reaches `batch_max_events` or has
//! been open `batch_max_time`. Only after the Kafka commit is the slot told.
//! On start, after holding the slot, the forwarder fences older producers of
//! its transactional id (`init_transactions`), reads the stored offset and
//! skips every replayed transaction whose commit record lies before it: a
//! transaction whose commit begins at or after the stored end position is new.
//!
//! Idle outbox: when nothing is in flight and no transaction is open, a
//! keepalive's position is confirmed, so the slot never pins WAL that the rest
//! of the database writes. The server has sent everything before that
//! position and we have delivered all of it; transactions still running
//! commit later, at a higher position, and are sent after a restart.
//!
//! First start: the slot is created with an exported snapshot; events that
//! were committed before it are read from that snapshot and delivered (in
//! exactly-once mode in one Kafka transaction whose offset is the slot's
//! consistent point) before streaming starts, so there is no gap and no
//! duplicate between them. `outbox.relay_progress` records that the
//! catch-up is done; an unfinished one is redone on a fresh slot.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use rand::Rng;
use rdkafka::producer::DeliveryFuture;
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::config::{Config, Delivery};
use crate::error::{Error, Result};
use crate::event::{EventLayout, OutboxEvent, EVENT_COLUMNS};
use crate::faults;
use crate::lsn::Lsn;
use crate::metrics::{Metrics, State};
use crate::offsets::OffsetStore;
use crate::pgoutput::Message;
use crate::producer::{is_fenced, is_poison, Producer};
use crate::replication::{CreatedSlot, ReplicationStream, StreamEvent};
use crate::routing::Router;
use crate::slot;

/// How long a graceful shutdown waits for outstanding delivery reports.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a forwarder halting on a poison event waits for the events it
/// produced before it to be delivered.
const POISON_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the confirmed position is recorded in `outbox.relay_progress`.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);
/// How long reading the stored offset may take.
const OFFSET_LOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// The PostgreSQL epoch (2000-01-01) in microseconds since the Unix epoch.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A dead-lettered event keeps its payload up to this size.
const DEAD_LETTER_MAX_PAYLOAD: usize = 512 * 1024;
/// Rows fetched at a time during the catch-up.
const CATCH_UP_FETCH: i32 = 1_000;

/// Runs the forwarder until `shutdown` turns true, reconnecting after
/// transient failures with exponential backoff and jitter.
pub async fn run(
    config: Config,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let router = Router::new(config.topic_template.clone()).with_format(
        config.value_format,
        format!("pg_outbox/{}/{}", config.postgres.dbname(), config.slot),
    );
    // Events Kafka refused at delivery: with a dead-letter topic, the next
    // session sends them there instead of halting again.
    let mut poisoned: HashSet<String> = HashSet::new();
    let mut failures: u32 = 0;
    loop {
        let started = Instant::now();
        let outcome = Session::run(
            &config,
            &router,
            &mut poisoned,
            metrics.clone(),
            &mut shutdown,
        )
        .await;
        let error = match outcome {
            Ok(()) => {
                metrics.set_state(State::Stopped);
                return Ok(());
            }
            Err(Error::Poison { event_id, reason }) if config.dead_letter_topic.is_some() => {
                tracing::warn!(event_id = %event_id, reason = %reason, "kafka refused an event at delivery; replaying to dead-letter it");
                poisoned.insert(event_id);
                continue;
            }
            Err(error) if is_fenced(&error) => Error::Fenced(config.transactional_id()),
            Err(error) => error,
        };
        metrics.error(error.kind());
        if *shutdown.borrow() {
            // Shutting down: report, do not reconnect.
            tracing::warn!(error = %error, "error while shutting down");
            metrics.set_state(State::Stopped);
            return Ok(());
        }
        if !error.is_retryable() {
            metrics.set_state(match error {
                Error::Fenced(_) => State::Fenced,
                _ => State::Stopped,
            });
            return Err(error);
        }
        metrics.retries.inc();
        metrics.set_state(match error {
            Error::SlotBusy(_) => State::Standby,
            _ => State::Reconnecting,
        });
        if started.elapsed() > Duration::from_secs(30) {
            failures = 0;
        }
        failures = failures.saturating_add(1);
        // A standby polls the busy slot at a steady pace so it takes over
        // within seconds of the active instance's end.
        let wait = match error {
            Error::SlotBusy(_) => Duration::from_millis(500),
            _ => backoff(failures, config.max_backoff),
        };
        tracing::warn!(error = %error, retry_in_ms = wait.as_millis() as u64, "session ended, reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => return Ok(()),
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

type Report = BoxFuture<'static, (u64, usize, Result<()>)>;

/// A Kafka transaction being filled (exactly-once mode).
struct KafkaTxn {
    started: Instant,
    events: usize,
    /// Commit end LSN of the last complete PostgreSQL transaction in it.
    last_end: Option<Lsn>,
}

/// A PostgreSQL transaction being read from the stream.
struct OpenTxn {
    id: u64,
    /// Already in Kafka (exactly-once replay): read past it.
    skip: bool,
}

/// One connection to PostgreSQL and Kafka, from start to the first error or
/// to shutdown.
struct Session<'a> {
    config: &'a Config,
    router: &'a Router,
    poisoned: &'a mut HashSet<String>,
    metrics: Arc<Metrics>,
    sql: Client,
    producer: Producer,
    offsets: OffsetStore,
    tracker: Tracker,
    reports: FuturesUnordered<Report>,
    kafka_txn: Option<KafkaTxn>,
    confirmed: Lsn,
    recorded: Lsn,
    dead_lettered: u64,
}

impl<'a> Session<'a> {
    async fn run(
        config: &'a Config,
        router: &'a Router,
        poisoned: &'a mut HashSet<String>,
        metrics: Arc<Metrics>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        let sql = slot::connect(&config.postgres).await?;
        slot::prepare(&sql, config).await?;
        faults::check("producer_init");
        let producer = Producer::new(config)?;
        let offsets = OffsetStore {
            client: config.kafka_client(),
            topic: config.offsets_topic.clone(),
            key: config.transactional_id(),
        };
        let mut session = Session {
            config,
            router,
            poisoned,
            metrics,
            sql,
            producer,
            offsets,
            tracker: Tracker::default(),
            reports: FuturesUnordered::new(),
            kafka_txn: None,
            confirmed: Lsn::ZERO,
            recorded: Lsn::ZERO,
            dead_lettered: 0,
        };
        let outcome = session.serve(shutdown).await;
        if matches!(outcome, Err(Error::Poison { .. })) && config.delivery == Delivery::AtLeastOnce
        {
            // The events produced before the poison one still go out, so
            // consumers have everything up to it while the forwarder is
            // halted. None is confirmed: the next start may send them again.
            if let Err(e) = session.producer.flush(POISON_FLUSH_TIMEOUT) {
                tracing::warn!(error = %e, "events before the poison event not all delivered; the next start sends them");
            }
        }
        outcome
    }

    /// Streams from the slot, after the first-start catch-up if it is due,
    /// until shutdown or an error.
    async fn serve(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<()> {
        let mut stream = ReplicationStream::connect(self.config).await?;
        let mut initialized = false;
        if self.config.delivery == Delivery::ExactlyOnce {
            self.offsets.ensure_topic().await?;
        }
        if !self.is_caught_up().await? {
            initialized = self.create_slot_and_catch_up(&mut stream).await?;
        }
        stream.start(&self.config.slot).await?;
        let mut skip_before = Lsn::ZERO;
        if self.config.delivery == Delivery::ExactlyOnce {
            // Holding the slot now: fence any older producer of our id, then
            // read where Kafka is.
            if !initialized {
                self.producer.init_transactions().await?;
            }
            if let Some(stored) = self.offsets.load_async(OFFSET_LOAD_TIMEOUT).await? {
                skip_before = stored;
                self.confirm(&stream, stored);
                tracing::info!(stored_offset = %stored, "resuming after the stored offset");
            }
        }
        self.metrics.set_state(State::Streaming);
        tracing::info!(slot = %self.config.slot, publication = %self.config.publication, database = %self.config.postgres.dbname(), delivery = ?self.config.delivery, "streaming");
        let outcome = self.stream(&mut stream, skip_before, shutdown).await;
        if outcome.is_err() && self.kafka_txn.is_some() {
            // Best effort: the next session's init_transactions aborts it anyway.
            let _best_effort = self.producer.abort_transaction().await;
        }
        outcome?;
        stream.close().await?;
        // The stream may have closed before its last status update went out.
        slot::advance(&self.sql, &self.config.slot, self.confirmed).await?;
        slot::record_progress(&self.sql, &self.config.slot, self.confirmed, false).await?;
        tracing::info!(confirmed_lsn = %self.confirmed, "stopped");
        Ok(())
    }

    /// Whether the slot exists and its first-start catch-up is complete.
    async fn is_caught_up(&self) -> Result<bool> {
        let slot = &self.config.slot;
        Ok(slot::slot_exists(&self.sql, slot).await? && slot::caught_up(&self.sql, slot).await?)
    }

    /// Creates the slot (dropping one whose catch-up never finished) and
    /// delivers the events committed before it. Returns whether the producer
    /// was initialised for transactions.
    async fn create_slot_and_catch_up(&mut self, stream: &mut ReplicationStream) -> Result<bool> {
        let config = self.config;
        if !slot::try_lock_catch_up(&self.sql, &config.slot).await? {
            return Err(Error::SlotBusy(config.slot.clone()));
        }
        let mut initialized = false;
        if config.delivery == Delivery::ExactlyOnce {
            self.producer.init_transactions().await?;
            initialized = true;
            // Kafka may hold a finished catch-up whose record in PostgreSQL
            // was lost to a crash: then it is done.
            if slot::slot_exists(&self.sql, &config.slot).await? {
                if let Some(stored) = self.offsets.load_async(OFFSET_LOAD_TIMEOUT).await? {
                    slot::record_progress(&self.sql, &config.slot, stored, true).await?;
                    slot::unlock_catch_up(&self.sql, &config.slot).await?;
                    return Ok(initialized);
                }
            }
        }
        if slot::slot_exists(&self.sql, &config.slot).await? {
            if !config.create_missing {
                return Err(Error::Setup(format!(
                    "slot {:?} exists but its first-start catch-up never finished; allow creation so it can be recreated",
                    config.slot
                )));
            }
            tracing::warn!(slot = %config.slot, "slot exists without a finished catch-up; recreating it");
            slot::drop_slot(&self.sql, &config.slot).await?;
        } else if !config.create_missing {
            return Err(Error::Setup(format!(
                "replication slot {:?} does not exist; run `outbox-forwarder slot create` or allow creation",
                config.slot
            )));
        }
        let created = stream.create_slot(&config.slot).await?;
        tracing::info!(slot = %config.slot, consistent_point = %created.consistent_point, "created replication slot");
        let events = self.catch_up(&created).await?;
        slot::record_progress(&self.sql, &config.slot, created.consistent_point, true).await?;
        slot::unlock_catch_up(&self.sql, &config.slot).await?;
        tracing::info!(events, "first-start catch-up done");
        Ok(initialized)
    }

    /// Delivers every event visible in the slot's exported snapshot.
    async fn catch_up(&mut self, created: &CreatedSlot) -> Result<u64> {
        // A connection of its own: the session's stays free for progress.
        let mut reader = slot::connect(&self.config.postgres).await?;
        let tx = reader
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        tx.batch_execute(&format!(
            "SET TRANSACTION SNAPSHOT '{}'",
            created.snapshot.replace('\'', "''")
        ))
        .await?;
        let portal = tx
            .bind(
                &format!(
                    "SELECT {EVENT_COLUMNS} FROM outbox.events \
                      ORDER BY aggregate_type, aggregate_id, aggregate_seq"
                ),
                &[],
            )
            .await?;
        let txn = self.tracker.begin();
        let mut count = 0u64;
        loop {
            let rows = tx.query_portal(&portal, CATCH_UP_FETCH).await?;
            if rows.is_empty() {
                break;
            }
            for row in rows {
                self.produce(txn, OutboxEvent::from_row(&row)).await?;
                count += 1;
                while self.tracker.events >= self.config.max_in_flight_events {
                    self.next_report().await?;
                }
            }
        }
        tx.commit().await?;
        self.tracker.commit(txn, created.consistent_point, None);
        self.metrics.caught_up_events.inc_by(count);
        match self.config.delivery {
            Delivery::ExactlyOnce => {
                if let Some(kafka) = &mut self.kafka_txn {
                    kafka.last_end = Some(created.consistent_point);
                    self.commit_kafka(None).await?;
                } else {
                    // Nothing to deliver: still store where Kafka stands.
                    self.begin_kafka().await?;
                    if let Some(kafka) = &mut self.kafka_txn {
                        kafka.last_end = Some(created.consistent_point);
                    }
                    self.commit_kafka(None).await?;
                }
            }
            Delivery::AtLeastOnce => {
                while !self.reports.is_empty() {
                    self.next_report().await?;
                }
                self.tracker.release();
            }
        }
        Ok(count)
    }

    async fn stream(
        &mut self,
        stream: &mut ReplicationStream,
        skip_before: Lsn,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        let exactly_once = self.config.delivery == Delivery::ExactlyOnce;
        let mut layout: Option<EventLayout> = None;
        let mut open: Option<OpenTxn> = None;
        let mut progress_tick = tokio::time::interval(PROGRESS_INTERVAL);
        // On shutdown, the transaction being read is read to its commit (for
        // at most DRAIN_TIMEOUT), so that what was sent of it is confirmed and
        // not sent again.
        let mut stopping: Option<Instant> = None;
        loop {
            if let Some(since) = stopping {
                if open.is_none() || since.elapsed() > DRAIN_TIMEOUT {
                    break;
                }
            }
            let has_room = self.tracker.events < self.config.max_in_flight_events
                && self.tracker.bytes < self.config.max_in_flight_bytes;
            let batch_due = match (&self.kafka_txn, &open) {
                (Some(k), None) if k.last_end.is_some() => {
                    Some(k.started + self.config.batch_max_time)
                }
                _ => None,
            };
            tokio::select! {
                biased;
                _ = shutdown.changed(), if stopping.is_none() => {
                    stopping = Some(Instant::now());
                }
                Some((txn, size, result)) = self.reports.next(), if !self.reports.is_empty() => {
                    result?;
                    self.tracker.delivered(txn, size);
                    if !exactly_once {
                        self.release(stream);
                    }
                }
                _ = sleep_until_opt(batch_due), if batch_due.is_some() => {
                    self.commit_kafka(Some(stream)).await?;
                }
                _ = progress_tick.tick() => {
                    if self.confirmed > self.recorded {
                        // Bookkeeping for retention and status, which only
                        // wait longer while it lags: a statement the server
                        // refuses (as while the outbox's schema is replaced
                        // under a running forwarder) is tried again at the
                        // next tick. Losing the connection ends the session.
                        match slot::record_progress(&self.sql, &self.config.slot, self.confirmed, false).await {
                            Ok(()) => self.recorded = self.confirmed,
                            Err(Error::Postgres(e)) if e.as_db_error().is_some() => {
                                self.metrics.error("postgres");
                                tracing::warn!(error = %e, "could not record the confirmed position; trying again in a second");
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    if let Some((lag, retained)) = slot::wal_figures(&self.sql, &self.config.slot).await? {
                        self.metrics.lag_bytes.set(lag);
                        self.metrics.retained_wal_bytes.set(retained);
                    }
                }
                event = stream.next(), if has_room => {
                    let Some(event) = event? else {
                        return Err(Error::Replication(pgwire_replication::PgWireError::Io(
                            std::sync::Arc::new(std::io::ErrorKind::UnexpectedEof.into()),
                        )));
                    };
                    match event {
                        StreamEvent::Begin { final_lsn } => {
                            let skip = exactly_once && final_lsn < skip_before;
                            open = Some(OpenTxn { id: self.tracker.begin(), skip });
                        }
                        StreamEvent::Change(Message::Relation(relation)) => {
                            if EventLayout::is_events_table(&relation) {
                                layout = Some(EventLayout::from_relation(&relation)?);
                            }
                        }
                        StreamEvent::Change(Message::Insert { relation_id, values }) => {
                            let (Some(layout), Some(txn)) = (&layout, &open) else {
                                return Err(Error::Setup("insert arrived before its relation or transaction".into()));
                            };
                            if layout.relation_id() != relation_id {
                                tracing::warn!(relation_id, "ignoring insert into a table that is not outbox.events");
                                continue;
                            }
                            if txn.skip {
                                continue;
                            }
                            let txn = txn.id;
                            let event = layout.event(values)?;
                            self.produce(txn, event).await?;
                        }
                        StreamEvent::Change(Message::Other(tag)) => {
                            tracing::debug!(tag = %(tag as char), "ignoring pgoutput message");
                        }
                        StreamEvent::Change(Message::Begin { .. } | Message::Commit { .. }) => {}
                        StreamEvent::Commit { end_lsn, commit_time_micros } => {
                            let Some(txn) = open.take() else { continue };
                            self.tracker.commit(txn.id, end_lsn, Some(commit_time_micros));
                            if !exactly_once {
                                self.release(stream);
                            } else if let Some(kafka) = &mut self.kafka_txn {
                                kafka.last_end = Some(end_lsn);
                                if kafka.events >= self.config.batch_max_events
                                    || kafka.started.elapsed() >= self.config.batch_max_time
                                {
                                    self.commit_kafka(Some(stream)).await?;
                                }
                            } else {
                                // Skipped or without events: nothing waits in Kafka.
                                self.account();
                                if txn.skip || end_lsn > self.confirmed {
                                    self.confirm(stream, end_lsn.max(self.confirmed));
                                }
                            }
                        }
                        StreamEvent::KeepAlive { wal_end } => {
                            if open.is_none() && self.tracker.is_empty() && self.kafka_txn.is_none() {
                                self.confirm(stream, wal_end);
                            }
                        }
                    }
                }
            }
        }

        // Graceful shutdown: read nothing more; finish or abandon what is in
        // flight; confirm what Kafka has.
        tracing::info!(in_flight = self.tracker.events, "shutting down, draining");
        if exactly_once {
            if open.is_some() {
                // A PostgreSQL transaction is half produced: abort, it is replayed.
                if self.kafka_txn.take().is_some() {
                    self.producer.abort_transaction().await?;
                }
            } else if self.kafka_txn.is_some() {
                self.commit_kafka(Some(stream)).await?;
            }
        } else {
            let deadline = tokio::time::sleep(DRAIN_TIMEOUT);
            tokio::pin!(deadline);
            while !self.reports.is_empty() {
                tokio::select! {
                    Some((txn, size, result)) = self.reports.next() => {
                        if let Err(error) = result {
                            tracing::warn!(error = %error, "delivery failed during shutdown; it will be replayed");
                            break;
                        }
                        self.tracker.delivered(txn, size);
                        self.release(stream);
                    }
                    _ = &mut deadline => {
                        tracing::warn!(in_flight = self.tracker.events, "drain timed out; undelivered events will be replayed");
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// Routes and hands one event to Kafka; in exactly-once mode inside the
    /// open Kafka transaction.
    async fn produce(&mut self, txn: u64, event: OutboxEvent) -> Result<()> {
        if self.config.delivery == Delivery::ExactlyOnce && self.kafka_txn.is_none() {
            self.begin_kafka().await?;
        }
        if self.poisoned.contains(&event.event_id) {
            return self
                .dead_letter(txn, event, "kafka refused it at delivery".into(), None)
                .await;
        }
        let route = match self.router.route(&event) {
            Ok(route) => route,
            Err(e) => return self.dead_letter(txn, event, e.to_string(), None).await,
        };
        faults::check("before_produce");
        let size = event.size();
        let report = match self.producer.send(&event, &route).await {
            Ok(report) => report,
            Err(Error::Poison { reason, .. }) => {
                return self
                    .dead_letter(txn, event, reason, Some(route.topic))
                    .await
            }
            Err(e) => return Err(e),
        };
        faults::check("after_produce");
        self.track(txn, size, report, event.event_id);
        Ok(())
    }

    fn track(&mut self, txn: u64, size: usize, report: DeliveryFuture, event_id: String) {
        self.tracker.produced(txn, size);
        if let Some(kafka) = &mut self.kafka_txn {
            kafka.events += 1;
        }
        self.reports.push(watch_report(report, txn, size, event_id));
    }

    /// A poison event: halts the forwarder, or with a dead-letter topic goes
    /// there with the reason in its headers. Never skipped silently.
    async fn dead_letter(
        &mut self,
        txn: u64,
        mut event: OutboxEvent,
        reason: String,
        topic: Option<String>,
    ) -> Result<()> {
        let Some(dead_letter_topic) = &self.config.dead_letter_topic else {
            tracing::error!(event_id = %event.event_id, reason = %reason, "poison event; halting (configure a dead-letter topic to divert such events)");
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
        if event.payload.len() > DEAD_LETTER_MAX_PAYLOAD {
            // Too large for Kafka: the payload stays in outbox.events.
            headers.push(("dead_letter_payload_dropped".to_owned(), "true".to_owned()));
            event.payload = bytes::Bytes::new();
        }
        event.headers = None;
        let route = crate::routing::Route {
            topic: dead_letter_topic.clone(),
            headers,
            value: None,
        };
        let report = self.producer.send(&event, &route).await?;
        self.dead_lettered += 1;
        self.metrics.dead_lettered.inc();
        tracing::warn!(event_id = %event.event_id, reason = %reason, topic = %dead_letter_topic, dead_lettered = self.dead_lettered, "poison event sent to the dead-letter topic");
        self.track(txn, event.size(), report, event.event_id);
        Ok(())
    }

    async fn begin_kafka(&mut self) -> Result<()> {
        self.producer.begin_transaction().await?;
        self.kafka_txn = Some(KafkaTxn {
            started: Instant::now(),
            events: 0,
            last_end: None,
        });
        Ok(())
    }

    /// Commits the open Kafka transaction with its offset record, then
    /// confirms its position to the slot (when streaming).
    async fn commit_kafka(&mut self, stream: Option<&ReplicationStream>) -> Result<()> {
        let Some(kafka) = &self.kafka_txn else {
            return Ok(());
        };
        let Some(end) = kafka.last_end else {
            return Ok(());
        };
        let offset = self.offsets.encode(end);
        let report = self
            .producer
            .send_raw(&self.offsets.topic, &self.offsets.key, &offset)
            .await?;
        let started = Instant::now();
        self.producer.commit_transaction().await?;
        self.metrics
            .kafka_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics.kafka_commits.inc();
        self.kafka_txn = None;
        faults::check("after_kafka_commit");
        // Every report has resolved with the commit; collect them.
        let _offset_report = report.await;
        while !self.reports.is_empty() {
            self.next_report().await?;
        }
        self.account();
        if let Some(stream) = stream {
            self.confirm(stream, end);
        } else {
            self.confirmed = self.confirmed.max(end);
        }
        Ok(())
    }

    async fn next_report(&mut self) -> Result<()> {
        if let Some((txn, size, result)) = self.reports.next().await {
            result?;
            self.tracker.delivered(txn, size);
        }
        Ok(())
    }

    /// At-least-once: confirms the newest position whose events all arrived.
    /// Drops the finished transactions from the tracker and counts them.
    fn account(&mut self) -> Option<Lsn> {
        let metrics = &self.metrics;
        let now = unix_micros();
        self.tracker.release_each(|commit_time, events, bytes| {
            metrics.transactions.inc();
            metrics.events.inc_by(events as u64);
            metrics.bytes.inc_by(bytes as u64);
            if let Some(committed) = commit_time {
                let micros = now - (committed + PG_EPOCH_UNIX_MICROS);
                metrics
                    .end_to_end_seconds
                    .observe((micros.max(0) as f64) / 1e6);
            }
        })
    }

    fn release(&mut self, stream: &ReplicationStream) {
        if let Some(lsn) = self.account() {
            faults::check("after_kafka_commit");
            self.confirm(stream, lsn);
        }
    }

    fn confirm(&mut self, stream: &ReplicationStream, lsn: Lsn) {
        if lsn > self.confirmed {
            self.confirmed = lsn;
            stream.confirm(lsn);
            self.metrics
                .confirmed_lsn
                .set(i64::try_from(lsn.0).unwrap_or(i64::MAX));
            faults::check("after_confirm");
            tracing::debug!(lsn = %lsn, "confirmed");
        }
    }
}

/// Turns a delivery report into (transaction, size, outcome), naming the
/// event when Kafka refuses it for good.
fn watch_report(report: DeliveryFuture, txn: u64, size: usize, event_id: String) -> Report {
    async move {
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
    }
    .boxed()
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
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
    /// PostgreSQL commit time, microseconds since 2000-01-01 (none for a catch-up).
    commit_time: Option<i64>,
    events: usize,
    bytes: usize,
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
        let txn = self.txn(id);
        txn.outstanding += 1;
        txn.events += 1;
        txn.bytes += size;
        self.events += 1;
        self.bytes += size;
    }

    pub fn delivered(&mut self, id: u64, size: usize) {
        self.txn(id).outstanding -= 1;
        self.events -= 1;
        self.bytes -= size;
    }

    pub fn commit(&mut self, id: u64, end_lsn: Lsn, commit_time: Option<i64>) {
        let txn = self.txn(id);
        txn.end_lsn = Some(end_lsn);
        txn.commit_time = commit_time;
    }

    /// Drops the oldest transactions that are committed and fully delivered,
    /// and returns the commit end position of the last one dropped.
    pub fn release(&mut self) -> Option<Lsn> {
        self.release_each(|_, _, _| {})
    }

    /// [`Self::release`], telling `each` the commit time, event count and
    /// bytes of every transaction it drops.
    pub fn release_each(&mut self, mut each: impl FnMut(Option<i64>, usize, usize)) -> Option<Lsn> {
        let mut released = None;
        while let Some(front) = self.txns.front() {
            match front.end_lsn {
                Some(lsn) if front.outstanding == 0 => {
                    each(front.commit_time, front.events, front.bytes);
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
        t.commit(a, Lsn(100), None);
        let b = t.begin();
        t.produced(b, 10);
        t.commit(b, Lsn(200), None);

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
        t.commit(a, Lsn(7), None);
        assert_eq!(t.release(), Some(Lsn(7)));
        let b = t.begin();
        t.commit(b, Lsn(9), None);
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
