//! The forwarding pipeline: a [`Source`] of changes, a [`Sink`] that
//! sends them to Kafka, and between them one loop that confirms to the source
//! whatever the sink says is confirmable (the rule is in [`crate::ledger`]).
//!
//! ```text
//!  slot ──pgoutput──▶ SlotSource ──Change──▶ Sink ──▶ Kafka (reports / commits)
//!   ▲                                         │
//!   └──────────── confirm(position) ◀─────────┘
//! ```
//!
//! Around the loop, a session per connection: it holds the slot, runs the
//! first start's catch-up, asks the sink where Kafka stands (exactly-once:
//! the stored offset; the source then skips every transaction Kafka has),
//! records progress for retention, and on shutdown lets the sink finish.
//!
//! First start: the slot is created with an exported snapshot; events that
//! were committed before it are read from that snapshot and delivered (in
//! exactly-once mode in one Kafka transaction whose offset is the slot's
//! consistent point) before streaming starts, so there is no gap and no
//! duplicate between them. `outbox.relay_progress` records that the
//! catch-up is done; an unfinished one is redone on a fresh slot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::config::{Config, Delivery, SourceKind};
use crate::database;
use crate::error::{Error, Result};
use crate::event::{OutboxEvent, EVENT_COLUMNS, EVENT_COLUMN_COUNT};
use crate::faults;
use crate::horizon::{self, Horizon, Mark, ORIGIN_SQL};
use crate::lsn::Lsn;
use crate::metrics::{Metrics, State};
use crate::offsets::OffsetStore;
use crate::parking::{self, Parking};
use crate::poll::{self, PollSource};
use crate::producer::{is_fenced, Producer};
use crate::replication::{CreatedSlot, ReplicationStream};
use crate::routing::Router;
use crate::shard::Shard;
use crate::sink::{
    transactional::Batching, AtLeastOnce, Publisher, Sink, Transactional, DRAIN_TIMEOUT,
};
use crate::slot;
use crate::source::{Change, SlotSource, Source};
use crate::{progress, publication};

/// How often the confirmed position is recorded in `outbox.relay_progress`.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);
/// Rows fetched at a time during the catch-up.
const CATCH_UP_FETCH: i32 = 1_000;

/// Runs the forwarder until `shutdown` turns true, reconnecting after
/// transient failures with exponential backoff and jitter.
pub async fn run(
    config: Config,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let router = Arc::new(config.router());
    // Events Kafka refused at delivery: with a dead-letter topic, the next
    // session sends them there instead of halting again.
    let mut poisoned: HashSet<String> = HashSet::new();
    // Events refused at delivery once: the next session sends each alone,
    // since the broker refuses a whole batch for one record too large.
    let mut suspects: HashSet<String> = HashSet::new();
    let mut failures: u32 = 0;
    loop {
        metrics.health.step();
        let started = Instant::now();
        let refused = Refused {
            poisoned: &poisoned,
            suspects: &suspects,
        };
        let outcome = session(&config, &router, refused, &metrics, &mut shutdown).await;
        let error = match outcome {
            Ok(()) => {
                metrics.set_state(State::Stopped);
                return Ok(());
            }
            Err(Error::Poison { event_id, reason }) if config.dead_letter_topic.is_some() => {
                tracing::warn!(event_id = %event_id, reason = %reason, "kafka refused an event at delivery; replaying to send it alone, and to dead-letter it if it is refused again");
                if !suspects.insert(event_id.clone()) {
                    // Refused again when it was sent alone.
                    poisoned.insert(event_id);
                }
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
        if rest(wait, &metrics, &mut shutdown).await {
            return Ok(());
        }
    }
}

/// Waits `wait` between sessions, stepping each second for the liveness
/// watchdog (a wait is no stall); true when shutdown came first.
async fn rest(wait: Duration, metrics: &Metrics, shutdown: &mut watch::Receiver<bool>) -> bool {
    let until = tokio::time::Instant::now() + wait;
    let mut beat = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(until) => return false,
            _ = shutdown.changed() => return true,
            _ = beat.tick() => metrics.health.step(),
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

/// One connection to PostgreSQL and Kafka, from start to the first error or
/// to shutdown: the source the configuration names, into the sink its
/// delivery mode asks for (polling is at least once; the configuration
/// refuses it with exactly-once).
async fn session(
    config: &Config,
    router: &Arc<Router>,
    refused: Refused<'_>,
    metrics: &Arc<Metrics>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<()> {
    // Several hosts: this session streams from whichever is the primary now.
    let config = &Config {
        postgres: database::primary(&config.postgres).await?,
        ..config.clone()
    };
    let sql = database::connect(&config.postgres).await?;
    match config.source {
        SourceKind::Slot => {
            publication::prepare(
                &sql,
                config.postgres.dbname(),
                &config.publication,
                config.shard,
                config.create_missing,
            )
            .await?;
            if let Some(shard) = config.shard {
                progress::record_shard(&sql, &config.slot, shard).await?;
            }
        }
        SourceKind::Poll => poll::prepare(&sql).await?,
    }
    faults::check("producer_init");
    let producer = match config.delivery {
        Delivery::ExactlyOnce => Producer::transactional(config, &config.transactional_id())?,
        Delivery::AtLeastOnce => Producer::idempotent(config)?,
    };
    let out = publisher(producer, config, router, refused, metrics).await?;
    if config.delivery == Delivery::ExactlyOnce {
        let offsets = OffsetStore::of(config);
        let batching = Batching {
            max_events: config.batch_max_events,
            linger: config.batch_linger,
            max_in_flight_events: config.max_in_flight_events,
            max_in_flight_bytes: config.max_in_flight_bytes,
        };
        let sink = Transactional::new(out, offsets, batching, metrics.clone());
        return Session::new(config, sql, metrics)
            .serve(sink, shutdown)
            .await;
    }
    let sink = AtLeastOnce::new(
        out,
        config.max_in_flight_events,
        config.max_in_flight_bytes,
        metrics.clone(),
    );
    match config.source {
        SourceKind::Slot => {
            Session::new(config, sql, metrics)
                .serve(sink, shutdown)
                .await
        }
        SourceKind::Poll => poll_session(config, sql, sink, metrics, shutdown).await,
    }
}

/// Events Kafka refused at delivery in earlier sessions (see [`Publisher`]).
#[derive(Clone, Copy)]
struct Refused<'a> {
    poisoned: &'a HashSet<String>,
    suspects: &'a HashSet<String>,
}

/// The session's producer, connected, behind routing and dead letters,
/// which park their aggregates unless the operator chose otherwise.
async fn publisher(
    producer: Producer,
    config: &Config,
    router: &Arc<Router>,
    refused: Refused<'_>,
    metrics: &Arc<Metrics>,
) -> Result<Publisher<Producer>> {
    producer.connect().await;
    let out = Publisher::new(
        producer,
        router.clone(),
        config.dead_letter_topic.clone(),
        refused.poisoned.clone(),
        metrics.clone(),
    )
    .with_suspects(refused.suspects.clone());
    if config.parks_aggregates() {
        return Ok(out.with_parking(Parking::open(&config.postgres).await?));
    }
    Ok(out)
}

/// A polling relay's session: the poll source into the at-least-once sink,
/// until shutdown or an error; on shutdown the relay gives its leases back.
async fn poll_session(
    config: &Config,
    sql: Client,
    mut sink: AtLeastOnce<Producer>,
    metrics: &Arc<Metrics>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<()> {
    let mut source = PollSource::start(&config.postgres, &config.poll, metrics.clone()).await?;
    metrics.set_state(State::Streaming);
    metrics.health.session_started();
    tracing::info!(relay = %config.poll.relay, database = %config.postgres.dbname(), "polling");
    let outcome = forward(&mut source, &mut sink, shutdown, metrics, async |_| {
        poll::record_figures(&sql, metrics).await?;
        record_parked(&sql, config, metrics).await?;
        Ok(None)
    })
    .await;
    match outcome {
        Ok(_) => source.close().await,
        Err(error) => {
            sink.abandon(&error).await;
            Err(error)
        }
    }
}

struct Session<'a> {
    config: &'a Config,
    sql: Client,
    metrics: Arc<Metrics>,
}

impl<'a> Session<'a> {
    fn new(config: &'a Config, sql: Client, metrics: &Arc<Metrics>) -> Self {
        Session {
            config,
            sql,
            metrics: metrics.clone(),
        }
    }

    /// Streams from the slot, after the first-start catch-up if it is due,
    /// until shutdown or an error.
    async fn serve<S: Sink>(self, mut sink: S, shutdown: &mut watch::Receiver<bool>) -> Result<()> {
        let outcome = self.stream(&mut sink, shutdown).await;
        if let Err(error) = &outcome {
            sink.abandon(error).await;
        }
        outcome
    }

    async fn stream<S: Sink>(
        &self,
        sink: &mut S,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        let config = self.config;
        let mut stream =
            ReplicationStream::connect(&config.postgres, &config.slot, &config.publication).await?;
        sink.prepare().await?;
        if !self.is_caught_up().await? {
            self.create_slot_and_catch_up(&mut stream, sink).await?;
        }
        stream.start(&config.slot).await?;
        // Holding the slot now: where is Kafka?
        let claiming = Instant::now();
        let stored = sink.claim().await?;
        let claim_ms = claiming.elapsed().as_millis();
        let mut source = SlotSource::new(stream, stored.unwrap_or(Lsn::ZERO));
        if let Some(stored) = stored {
            source.confirm(stored);
            tracing::info!(stored_offset = %stored, "resuming after the stored offset");
        }
        self.metrics.set_state(State::Streaming);
        self.metrics.health.session_started();
        tracing::info!(slot = %config.slot, publication = %config.publication, database = %config.postgres.dbname(), delivery = ?config.delivery, claim_ms, "streaming");
        let mut recorded = Lsn::ZERO;
        let confirmed = forward(
            &mut source,
            sink,
            shutdown,
            &self.metrics,
            async |confirmed| self.tick(confirmed, &mut recorded).await,
        )
        .await?;
        let confirmed = confirmed.max(stored.unwrap_or(Lsn::ZERO));
        source.into_stream().close().await?;
        // The stream may have closed before its last status update went out.
        slot::advance(&self.sql, &config.slot, confirmed).await?;
        progress::record(&self.sql, &config.slot, confirmed, false).await?;
        tracing::info!(confirmed_lsn = %confirmed, "stopped");
        Ok(())
    }

    /// Records the confirmed position for retention and status, reads the
    /// slot's WAL figures, and in exactly-once mode takes a mark for the
    /// sink's horizon.
    async fn tick(&self, confirmed: Lsn, recorded: &mut Lsn) -> Result<Option<Mark>> {
        if confirmed > *recorded {
            // Bookkeeping that only makes retention wait longer while it
            // lags: a statement the server refuses (as while the outbox's
            // schema is replaced under a running forwarder) is tried again at
            // the next tick. Losing the connection ends the session.
            match progress::record(&self.sql, &self.config.slot, confirmed, false).await {
                Ok(()) => *recorded = confirmed,
                Err(Error::Postgres(e)) if e.as_db_error().is_some() => {
                    self.metrics.error("postgres");
                    tracing::warn!(error = %e, "could not record the confirmed position; trying again in a second");
                }
                Err(e) => return Err(e),
            }
        }
        record_parked(&self.sql, self.config, &self.metrics).await?;
        if let Some(wal) = slot::wal_figures(&self.sql, &self.config.slot).await? {
            if let (Some(lag), Some(retained)) = (wal.lag, wal.retained) {
                self.metrics.slot.lag_bytes.set(lag);
                self.metrics.slot.retained_wal_bytes.set(retained);
            }
            self.metrics
                .slot
                .wal_status
                .set(crate::metrics::wal_status_code(&wal.wal_status));
        }
        if self.config.delivery == Delivery::ExactlyOnce {
            return Ok(Some(horizon::mark(&self.sql).await?));
        }
        Ok(None)
    }

    /// Whether the slot exists, can stream, and its first-start catch-up is
    /// complete.
    async fn is_caught_up(&self) -> Result<bool> {
        let slot = &self.config.slot;
        Ok(slot::slot_exists(&self.sql, slot).await?
            && slot::invalidation(&self.sql, slot).await?.is_none()
            && progress::caught_up(&self.sql, slot).await?)
    }

    /// Creates the slot (dropping one whose catch-up never finished) and
    /// delivers the events committed before it.
    async fn create_slot_and_catch_up<S: Sink>(
        &self,
        stream: &mut ReplicationStream,
        sink: &mut S,
    ) -> Result<()> {
        let config = self.config;
        if !progress::try_lock_catch_up(&self.sql, &config.slot).await? {
            return Err(Error::SlotBusy(config.slot.clone()));
        }
        // What a lost slot's catch-up may leave out, read before its record goes.
        let safe = progress::safe_snapshot(&self.sql, &config.slot).await?;
        if let Some(reason) = slot::invalidation(&self.sql, &config.slot).await? {
            // It can never stream again: what it held back is gone.
            if !config.create_missing {
                return Err(Error::Setup(format!(
                    "slot {:?} is invalidated ({reason}); allow creation so it can be recreated, or drop it with `outbox-forwarder slot drop`",
                    config.slot
                )));
            }
            tracing::warn!(slot = %config.slot, reason, "the slot is invalidated; recreating it, and delivering the stored events Kafka lacks");
            slot::drop_slot(&self.sql, &config.slot).await?;
        } else if slot::slot_exists(&self.sql, &config.slot).await? {
            // Kafka may hold this slot's finished catch-up whose record in
            // PostgreSQL was lost to a crash: its offset is then the slot's
            // consistent point, which nothing has confirmed past yet. An
            // older offset (a slot lost and made again) does not count.
            let created_at = slot::confirmed_flush(&self.sql, &config.slot).await?;
            if let Some(stored) = sink.claim().await?.filter(|s| Some(*s) == created_at) {
                progress::record(&self.sql, &config.slot, stored, true).await?;
                progress::unlock_catch_up(&self.sql, &config.slot).await?;
                return Ok(());
            }
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
        // A slot lost after a finished catch-up: Kafka may say what it holds.
        sink.claim().await?;
        // The new slot's catch-up is undone until it is recorded done; a
        // crash before then redoes it (without the safe snapshot: at least
        // once repeats more, exactly-once has Kafka's horizon).
        progress::forget(&self.sql, &config.slot).await?;
        let failover = slot::wants_failover(&self.sql, config.failover_slot).await?;
        let created = stream.create_slot(&config.slot, failover).await?;
        tracing::info!(slot = %config.slot, consistent_point = %created.consistent_point, failover, "created replication slot");
        let events = self.catch_up(&created, safe.as_deref(), sink).await?;
        progress::record(&self.sql, &config.slot, created.consistent_point, true).await?;
        progress::unlock_catch_up(&self.sql, &config.slot).await?;
        tracing::info!(events, "first-start catch-up done");
        Ok(())
    }

    /// Delivers every event visible in the slot's exported snapshot, as one
    /// transaction ending at the slot's consistent point, but those Kafka is
    /// known to hold: by the sink's horizon (exactly-once), and by `safe`,
    /// the last safe snapshot in `outbox.relay_progress` (any mode; a slot
    /// that was lost after its catch-up).
    async fn catch_up<S: Sink>(
        &self,
        created: &CreatedSlot,
        safe: Option<&str>,
        sink: &mut S,
    ) -> Result<u64> {
        // A connection of its own: the session's stays free for progress.
        let mut reader = database::connect(&self.config.postgres).await?;
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
        let row = tx
            .query_one(
                &format!("SELECT pg_current_snapshot()::text, {ORIGIN_SQL}"),
                &[],
            )
            .await?;
        let (exported, origin): (String, String) = (row.get(0), row.get(1));
        let horizon = sink
            .horizon_in_kafka()
            .filter(|h| recorded_here(h, &origin));
        let base = horizon.as_ref().map(|h| h.base.to_string());
        let query = catch_up_query(polling_enabled(&tx).await?, self.config.shard);
        let portal = tx.bind(&query, &[&base, &safe]).await?;
        sink.begin(None);
        let mut count = 0u64;
        let mut held = 0u64;
        loop {
            self.metrics.health.step();
            let rows = tx.query_portal(&portal, CATCH_UP_FETCH).await?;
            if rows.is_empty() {
                break;
            }
            for row in rows {
                let txid: i64 = row.get(EVENT_COLUMN_COUNT);
                if horizon.as_ref().is_some_and(|h| h.holds(txid as u64)) {
                    held += 1;
                    continue;
                }
                sink.event(OutboxEvent::from_row(&row)).await?;
                count += 1;
                while !sink.has_room() {
                    let step = sink.wait().await?;
                    sink.apply(step).await?;
                }
            }
        }
        tx.commit().await?;
        if held > 0 {
            tracing::info!(held, "left out events of transactions Kafka holds");
        }
        // Every transaction the exported snapshot shows is in Kafka now.
        sink.mark(Mark {
            snapshot: exported.parse().map_err(Error::Bug)?,
            lsn: created.consistent_point,
            exact: true,
            origin,
        });
        sink.commit(created.consistent_point, None, false).await?;
        sink.finish().await?;
        if sink.confirmable() < Some(created.consistent_point) {
            return Err(Error::Incomplete(
                "the first-start catch-up was not fully acknowledged by Kafka; it is redone".into(),
            ));
        }
        self.metrics.caught_up_events.inc_by(count);
        Ok(count)
    }
}

/// Whether Kafka's horizon was recorded on this server's history; one from
/// another (a promoted standby, a restore) is left out, with a warning.
fn recorded_here(horizon: &Horizon, origin: &str) -> bool {
    let here = horizon.origin == origin;
    if !here {
        tracing::warn!(recorded_on = %horizon.origin, server = %origin, "Kafka's horizon was recorded on another server history (a promoted standby, a restore): leaving out only what relay_progress's safe snapshot shows; events committed after it are delivered again");
    }
    here
}

/// The catch-up's query: the events of transactions that neither Kafka's
/// horizon ($1) nor the safe snapshot ($2) shows, in aggregate order; of a
/// sharded forwarder, those of its shard. Where polling relays run, only
/// what is still pending: they published the rest, and a slot that takes
/// over from them starts where they are.
fn catch_up_query(polled: bool, shard: Option<Shard>) -> String {
    if polled {
        tracing::info!("polling is enabled: the catch-up delivers only the events still pending");
    }
    let only_pending = if polled {
        "AND EXISTS (SELECT 1 FROM outbox.pending p WHERE p.aggregate_type = e.aggregate_type \
                        AND p.aggregate_id = e.aggregate_id AND p.aggregate_seq = e.aggregate_seq)"
    } else {
        ""
    };
    let in_shard = shard
        .map(|s| format!("AND {}", s.condition()))
        .unwrap_or_default();
    format!(
        "SELECT {EVENT_COLUMNS}, e.txid::text::bigint FROM outbox.events e \
          WHERE NOT coalesce(pg_visible_in_snapshot(e.txid, $1::text::pg_snapshot), false) \
            AND NOT coalesce(pg_visible_in_snapshot(e.txid, $2::text::pg_snapshot), false) \
            {only_pending} {in_shard} \
          ORDER BY aggregate_type, aggregate_id, aggregate_seq"
    )
}

/// Whether polling relays are enabled (pg_outbox 0.5.0 and later).
async fn polling_enabled(client: &impl tokio_postgres::GenericClient) -> Result<bool> {
    Ok(database::probe(client).await?.polling == database::Polling::On)
}

/// Moves changes from `source` to `sink` and confirms to the source what the
/// sink says is confirmable, until `shutdown` turns true and the transaction
/// being read is complete (or [`DRAIN_TIMEOUT`] passed). `tick` runs every
/// [`PROGRESS_INTERVAL`] with the confirmed position. Returns the last
/// position confirmed.
pub async fn forward<S: Source, K: Sink>(
    source: &mut S,
    sink: &mut K,
    shutdown: &mut watch::Receiver<bool>,
    metrics: &Metrics,
    mut tick: impl AsyncFnMut(Lsn) -> Result<Option<Mark>>,
) -> Result<Lsn> {
    let mut confirmed = Lsn::ZERO;
    let mut ticker = tokio::time::interval(PROGRESS_INTERVAL);
    let mut stopping: Option<Instant> = None;
    loop {
        metrics.health.step();
        if let Some(since) = stopping {
            if !sink.reading() || since.elapsed() > DRAIN_TIMEOUT {
                break;
            }
        }
        tokio::select! {
            biased;
            _ = shutdown.changed(), if stopping.is_none() => {
                tracing::info!("shutting down, draining");
                stopping = Some(Instant::now());
            }
            step = sink.wait() => sink.apply(step?).await?,
            _ = ticker.tick() => {
                if let Some(mark) = tick(confirmed).await? {
                    sink.mark(mark);
                }
            }
            change = source.next(), if sink.has_room() => match change? {
                Change::Begin { xid } => sink.begin(Some(xid)),
                Change::Event(event) => sink.event(event).await?,
                Change::Commit { end_lsn, commit_time_micros, more } => {
                    sink.commit(end_lsn, Some(commit_time_micros), more).await?;
                }
                Change::KeepAlive { wal_end } => sink.keepalive(wal_end),
            },
        }
        if let Some(lsn) = sink.confirmable() {
            confirmed = confirm(source, metrics, lsn);
        }
        metrics.health.waiting_for_kafka(sink.held());
    }
    sink.finish().await?;
    if let Some(lsn) = sink.confirmable() {
        confirmed = confirm(source, metrics, lsn);
    }
    Ok(confirmed)
}

fn confirm<S: Source>(source: &mut S, metrics: &Metrics, lsn: Lsn) -> Lsn {
    source.confirm(lsn);
    metrics
        .slot
        .confirmed_lsn
        .set(i64::try_from(lsn.0).unwrap_or(i64::MAX));
    faults::check("after_confirm");
    tracing::debug!(lsn = %lsn, "confirmed");
    lsn
}

#[cfg(test)]
mod tests;

/// The parked aggregates' figures, each second, where dead letters park.
async fn record_parked(sql: &Client, config: &Config, metrics: &Metrics) -> Result<()> {
    if !config.parks_aggregates() {
        return Ok(());
    }
    let (parked, oldest) = parking::figures(sql).await?;
    metrics.parking.parked_aggregates.set(parked);
    metrics.parking.oldest_seconds.set(oldest as i64);
    Ok(())
}

#[cfg(test)]
mod unit {
    use super::*;

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
