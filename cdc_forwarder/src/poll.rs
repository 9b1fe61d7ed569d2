//! The polling source (`--source poll`), for databases that cannot give a
//! relay a replication slot. With `outbox.enable_polling()` every emitted
//! event is also a row of `outbox.pending`, written in the emitting
//! transaction. Relays lease aggregates (`outbox.poll_lease`), fetch the
//! pending events of the aggregates they hold in sequence order
//! (`outbox.poll_fetch`), and once Kafka acknowledged them remove them from
//! the pending set (`outbox.poll_done`). An aggregate is published by one
//! relay at a time; a relay that stops renewing loses its leases when they
//! expire, and whoever takes an aggregate over starts from its first pending
//! event: events can repeat, never go missing or out of order. A relay
//! whose batches wait for Kafka's acknowledgement longer than a lease (a
//! hung broker connection, a stalled pipeline) stops renewing and ends its
//! session, so that a relay stuck in a live process does not keep its
//! aggregates from the others.
//!
//! Positions: each fetched batch is one transaction for the sink, and its
//! number is its position. Confirming a position marks every batch up to it
//! done.
//!
//! The database work runs in a task of its own, so the pipeline's select
//! never cancels a query half-way; batches reach the source over a small
//! channel.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Statement};

use crate::config::{PgTarget, PollSettings};
use crate::database::{self, Polling};
use crate::error::{Error, Result};
use crate::event::{OutboxEvent, EVENT_COLUMNS, EVENT_COLUMN_COUNT};
use crate::faults;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::source::{Change, Source};

/// Batches fetched ahead of the pipeline.
const BATCHES_AHEAD: usize = 2;
/// Aggregates a relay leases in one call at most, so that relays asking at
/// the same time share the pending ones.
const LEASE_STEP: i32 = 100;
/// How long a stopping relay waits for its last bookkeeping.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// An aggregate: its type and id.
type Aggregate = (String, String);

/// Checks that the database can feed polling relays.
pub async fn prepare(sql: &Client) -> Result<()> {
    match crate::database::probe(sql).await?.polling {
        Polling::On => Ok(()),
        Polling::NoOutbox => Err(Error::Setup(
            "outbox.events does not exist in this database: install pg_outbox (CREATE EXTENSION pg_outbox, or the SQL edition's file)".into(),
        )),
        Polling::Unsupported => Err(Error::Setup(
            "this database's pg_outbox predates polling relays (0.5.0): run ALTER EXTENSION pg_outbox UPDATE, or the SQL edition's file again".into(),
        )),
        Polling::Hidden => Err(Error::Setup(
            "this login may not call outbox.poll_status(): grant it this database's relay role (outbox-forwarder check names it)".into(),
        )),
        Polling::Off => Err(Error::Setup(
            "polling is off in this database: run SELECT outbox.enable_polling(); as the outbox's owner (events emitted from then on are published)".into(),
        )),
    }
}

/// Reads the database-wide polling figures into the metrics.
pub async fn record_figures(sql: &Client, metrics: &Metrics) -> Result<()> {
    let row = sql
        .query_one(
            "SELECT pending_events, \
                    coalesce((extract(epoch FROM oldest_pending_age) * 1000)::bigint, 0), \
                    leases_expired \
               FROM outbox.poll_status()",
            &[],
        )
        .await?;
    metrics.polling.pending_events.set(row.get(0));
    metrics.polling.oldest_pending_ms.set(row.get(1));
    metrics.polling.leases_expired.set(row.get(2));
    Ok(())
}

/// Until when this relay's leases are known to hold, on the local clock.
struct LeaseClock {
    base: Instant,
    /// Milliseconds after `base`.
    valid_until: AtomicU64,
}

impl LeaseClock {
    fn renewed(&self, call_started: Instant, lease: Duration) {
        // A renewal leaves every lease at least two thirds of its time
        // (outbox.poll_lease); half is counted, measured from before the call.
        let until = call_started.saturating_duration_since(self.base) + lease / 2;
        self.valid_until
            .store(until.as_millis() as u64, Ordering::Relaxed);
    }

    fn expired(&self) -> bool {
        self.base.elapsed().as_millis() as u64 >= self.valid_until.load(Ordering::Relaxed)
    }
}

/// Polling relays as a [`Source`].
pub struct PollSource {
    batches: mpsc::Receiver<Result<Vec<Change>>>,
    queue: VecDeque<Change>,
    confirmed: watch::Sender<Lsn>,
    stop: watch::Sender<bool>,
    clock: Arc<LeaseClock>,
    relay: String,
    task: JoinHandle<()>,
}

impl PollSource {
    /// Starts the relay on a connection of its own.
    pub async fn start(
        postgres: &PgTarget,
        settings: &PollSettings,
        metrics: Arc<Metrics>,
    ) -> Result<PollSource> {
        let sql = database::connect(postgres).await?;
        let fetch = sql
            .prepare(&format!(
                "SELECT {EVENT_COLUMNS}, \
                        ((extract(epoch FROM occurred_at) - 946684800) * 1000000)::bigint \
                   FROM outbox.poll_fetch($1, $2, $3)"
            ))
            .await?;
        let clock = Arc::new(LeaseClock {
            base: Instant::now(),
            valid_until: AtomicU64::new(0),
        });
        let (batches_tx, batches) = mpsc::channel(BATCHES_AHEAD);
        let (confirmed, confirmed_rx) = watch::channel(Lsn::ZERO);
        let (stop, stop_rx) = watch::channel(false);
        let relay = Relay {
            sql,
            fetch,
            settings: settings.clone(),
            metrics,
            clock: clock.clone(),
            held: HashSet::new(),
            in_hand: HashMap::new(),
            handed: VecDeque::new(),
            batch_no: 0,
            resume: None,
            next_lease: Instant::now(),
            saturated: false,
            progress: Instant::now(),
        };
        let errors = batches_tx.clone();
        let task = tokio::spawn(async move {
            if let Err(error) = relay.run(batches_tx, confirmed_rx, stop_rx).await {
                let _gone = errors.send(Err(error)).await;
            }
        });
        tracing::info!(relay = %settings.relay, "polling relay started");
        Ok(PollSource {
            batches,
            queue: VecDeque::new(),
            confirmed,
            stop,
            clock,
            relay: settings.relay.clone(),
            task,
        })
    }

    /// Marks what was confirmed done and gives the relay's leases back, so
    /// other relays take its aggregates over at once.
    pub async fn close(mut self) -> Result<()> {
        self.stop.send_replace(true);
        let batches = &mut self.batches;
        let finished = tokio::time::timeout(STOP_TIMEOUT, async {
            // The task may be waiting to hand over a batch, or report an error.
            loop {
                match batches.recv().await {
                    Some(Err(error)) => return Err(error),
                    Some(Ok(_)) => continue,
                    None => return Ok(()),
                }
            }
        })
        .await;
        let _ended = (&mut self.task).await;
        match finished {
            Ok(result) => result,
            Err(_) => Err(Error::Incomplete(
                "the polling relay did not finish its bookkeeping in time; its leases expire by themselves".into(),
            )),
        }
    }
}

impl Drop for PollSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Source for PollSource {
    async fn next(&mut self) -> Result<Change> {
        loop {
            if let Some(change) = self.queue.pop_front() {
                return Ok(change);
            }
            match self.batches.recv().await {
                Some(Ok(batch)) => {
                    if self.clock.expired() {
                        // Another relay may hold these aggregates by now.
                        return Err(Error::LeaseLost(self.relay.clone()));
                    }
                    self.queue.extend(batch);
                }
                Some(Err(error)) => return Err(error),
                None => {
                    return Err(Error::Bug("the polling relay's task ended".into()));
                }
            }
        }
    }

    fn confirm(&mut self, position: Lsn) {
        self.confirmed.send_replace(position);
    }
}

/// The relay's database side.
struct Relay {
    sql: Client,
    fetch: Statement,
    settings: PollSettings,
    metrics: Arc<Metrics>,
    clock: Arc<LeaseClock>,
    /// The aggregates this relay leases.
    held: HashSet<Aggregate>,
    /// Per aggregate, the last sequence handed to the pipeline and not yet
    /// marked done.
    in_hand: HashMap<Aggregate, i64>,
    /// Batches handed to the pipeline and not yet done: each with its
    /// number and, per aggregate, its last sequence.
    handed: VecDeque<(u64, Vec<(Aggregate, i64)>)>,
    batch_no: u64,
    /// Where the last lease walk ended: the next one starts after it.
    resume: Option<Aggregate>,
    next_lease: Instant,
    /// The last fetch filled a whole batch: leases are then renewed on
    /// their schedule only.
    saturated: bool,
    /// When the pipeline last showed progress: a batch handed while none
    /// was outstanding, or batches marked done.
    progress: Instant,
}

impl Relay {
    async fn run(
        mut self,
        batches: mpsc::Sender<Result<Vec<Change>>>,
        mut confirmed: watch::Receiver<Lsn>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<()> {
        loop {
            let position = *confirmed.borrow_and_update();
            self.mark_done(position).await?;
            if *stop.borrow_and_update() {
                self.release().await?;
                return Ok(());
            }
            if self.stalled() {
                tracing::warn!(
                    relay = %self.settings.relay,
                    batches = self.handed.len(),
                    lease_ms = self.settings.lease.as_millis() as u64,
                    "no batch acknowledged by Kafka for a whole lease: letting the leases lapse so that other relays publish these aggregates"
                );
                return Err(Error::LeaseLost(self.settings.relay.clone()));
            }
            if !self.saturated || Instant::now() >= self.next_lease {
                self.lease().await?;
            }
            let permit = tokio::select! {
                permit = batches.reserve() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return Ok(()),
                },
                changed = confirmed.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    continue;
                }
                _ = stop.changed() => continue,
                _ = tokio::time::sleep_until(self.next_lease.into()) => continue,
            };
            match self.fetch().await? {
                Some(batch) => permit.send(Ok(batch)),
                None => {
                    drop(permit);
                    tokio::select! {
                        _ = tokio::time::sleep(self.settings.interval) => {}
                        _ = stop.changed() => {}
                    }
                }
            }
        }
    }

    /// Whether batches have waited for Kafka a whole lease: renewing then
    /// would hold their aggregates for a pipeline that is not moving.
    fn stalled(&self) -> bool {
        !self.handed.is_empty() && self.progress.elapsed() >= self.settings.lease
    }

    /// Renews this relay's leases, gives back aggregates with nothing
    /// pending, and leases more.
    async fn lease(&mut self) -> Result<()> {
        let started = Instant::now();
        let lease_ms = i64::try_from(self.settings.lease.as_millis()).unwrap_or(i64::MAX);
        let max = i32::try_from(self.settings.max_aggregates).unwrap_or(i32::MAX);
        let (resume_type, resume_id) = match &self.resume {
            Some((t, i)) => (Some(t.as_str()), Some(i.as_str())),
            None => (None, None),
        };
        let rows = self
            .sql
            .query(
                "SELECT aggregate_type, aggregate_id, taken_over \
                   FROM outbox.poll_lease($1, $2 * interval '1 millisecond', $3, $4, $5, $6)",
                &[
                    &self.settings.relay,
                    &(lease_ms as f64),
                    &max,
                    &LEASE_STEP,
                    &resume_type,
                    &resume_id,
                ],
            )
            .await?;
        self.clock.renewed(started, self.settings.lease);
        faults::check("after_lease");
        self.next_lease = started + self.settings.lease / 3;
        let mut held = HashSet::with_capacity(rows.len());
        let mut last_claimed: Option<Aggregate> = None;
        for row in rows {
            let aggregate: Aggregate = (row.get(0), row.get(1));
            let taken_over: bool = row.get(2);
            if taken_over {
                self.metrics.polling.leases_taken_over.inc();
                tracing::info!(aggregate_type = %aggregate.0, aggregate_id = %aggregate.1, "took over an expired lease");
            }
            if !self.held.contains(&aggregate)
                && last_claimed.as_ref().is_none_or(|last| aggregate > *last)
            {
                last_claimed = Some(aggregate.clone());
            }
            held.insert(aggregate);
        }
        for lost in self
            .in_hand
            .keys()
            .filter(|a| self.held.contains(*a) && !held.contains(*a))
        {
            // Its events in hand were published or are on their way: the
            // relay that took it over starts from its first pending one.
            tracing::warn!(aggregate_type = %lost.0, aggregate_id = %lost.1, "lease lost to another relay");
        }
        if last_claimed.is_some() {
            self.resume = last_claimed;
        }
        self.metrics.polling.leases_held.set(held.len() as i64);
        self.held = held;
        Ok(())
    }

    /// The next pending events of the held aggregates, as one transaction.
    async fn fetch(&mut self) -> Result<Option<Vec<Change>>> {
        if self.held.is_empty() {
            self.saturated = false;
            return Ok(None);
        }
        let max = i32::try_from(self.settings.max_events).unwrap_or(i32::MAX);
        // Keyed 'type/id': an aggregate type has no '/'.
        let in_hand: serde_json::Map<String, serde_json::Value> = self
            .in_hand
            .iter()
            .map(|((t, i), seq)| (format!("{t}/{i}"), (*seq).into()))
            .collect();
        let in_hand = serde_json::Value::Object(in_hand);
        let rows = self
            .sql
            .query(&self.fetch, &[&self.settings.relay, &max, &in_hand])
            .await?;
        self.saturated = rows.len() >= self.settings.max_events;
        if rows.is_empty() {
            return Ok(None);
        }
        self.batch_no += 1;
        let mut changes = Vec::with_capacity(rows.len() + 2);
        changes.push(Change::Begin {
            xid: self.batch_no as u32,
        });
        let mut last: HashMap<Aggregate, i64> = HashMap::new();
        let mut newest = i64::MIN;
        for row in &rows {
            let event = OutboxEvent::from_row(row);
            newest = newest.max(row.get::<_, i64>(EVENT_COLUMN_COUNT));
            last.insert(
                (event.aggregate_type.clone(), event.aggregate_id.clone()),
                event.aggregate_seq,
            );
            changes.push(Change::Event(event));
        }
        changes.push(Change::Commit {
            end_lsn: Lsn(self.batch_no),
            commit_time_micros: newest,
            more: false,
        });
        for (aggregate, seq) in &last {
            self.in_hand.insert(aggregate.clone(), *seq);
        }
        if self.handed.is_empty() {
            self.progress = Instant::now();
        }
        self.handed
            .push_back((self.batch_no, last.into_iter().collect()));
        Ok(Some(changes))
    }

    /// Removes the events of every batch up to `position` from the pending set.
    async fn mark_done(&mut self, position: Lsn) -> Result<()> {
        let mut done: HashMap<Aggregate, i64> = HashMap::new();
        while self.handed.front().is_some_and(|(n, _)| *n <= position.0) {
            let Some((_, aggregates)) = self.handed.pop_front() else {
                break;
            };
            for (aggregate, seq) in aggregates {
                let entry = done.entry(aggregate).or_insert(seq);
                *entry = (*entry).max(seq);
            }
        }
        if done.is_empty() {
            return Ok(());
        }
        let (mut types, mut ids, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        for ((t, i), seq) in &done {
            types.push(t.as_str());
            ids.push(i.as_str());
            seqs.push(*seq);
        }
        self.sql
            .execute(
                "SELECT outbox.poll_done($1, $2, $3)",
                &[&types, &ids, &seqs],
            )
            .await?;
        faults::check("after_poll_done");
        self.progress = Instant::now();
        for (aggregate, seq) in done {
            if self.in_hand.get(&aggregate) == Some(&seq) {
                self.in_hand.remove(&aggregate);
            }
        }
        Ok(())
    }

    async fn release(&mut self) -> Result<()> {
        self.sql
            .execute("SELECT outbox.poll_release($1)", &[&self.settings.relay])
            .await?;
        self.held.clear();
        self.metrics.polling.leases_held.set(0);
        tracing::info!(relay = %self.settings.relay, "polling relay released its leases");
        Ok(())
    }
}
