//! The confirm rule, driven through the real pipeline loop and the real
//! sinks, against a source and a Kafka in memory that acknowledge, fail and
//! commit in random order. Every session ends by an error or a shutdown and
//! the next starts where the slot was confirmed, as PostgreSQL would.
//!
//! Checked at every confirmation: Kafka durably holds every event of every
//! transaction at or before the confirmed position (at-least-once: its
//! delivery was acknowledged; exactly-once: its Kafka transaction committed).
//! Checked at the end: every event arrived (exactly-once: once, every
//! Kafka transaction holds whole PostgreSQL transactions, and the horizon in
//! each offset record holds exactly the transactions up to its offset).
//!
//! Transaction ids are not in commit order and have gaps (aborted ones);
//! exactly-once sessions get marks as PostgreSQL would give them: a snapshot
//! after some commit, and an insert position a few commits later.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;

use super::*;
use crate::offsets::{self, Offsets};
use crate::producer::{Kafka, Report, Tag};
use crate::routing::Route;

const OFFSETS_TOPIC: &str = "offsets";

/// A PostgreSQL transaction of the history: its id, its events' ids and
/// its commit end.
#[derive(Debug, Clone)]
struct Txn {
    xid: u64,
    events: Vec<String>,
    end: Lsn,
}

/// A history of transactions with keepalives between some of them.
fn history(rng: &mut StdRng) -> Vec<Txn> {
    let mut next_event = 0;
    let mut txns = (0..rng.random_range(1..40u64))
        .map(|i| {
            let events = (0..rng.random_range(0..6))
                .map(|_| {
                    next_event += 1;
                    format!("e{next_event}")
                })
                .collect();
            Txn {
                // Every other id aborts; neighbours may commit out of order.
                xid: 1_000 + 2 * i,
                events,
                end: Lsn(100 * (i + 1)),
            }
        })
        .collect::<Vec<_>>();
    for i in 1..txns.len() {
        if rng.random_bool(0.3) {
            let xid = txns[i].xid;
            txns[i].xid = txns[i - 1].xid;
            txns[i - 1].xid = xid;
        }
    }
    txns
}

/// A mark as PostgreSQL gives it: the snapshot right after the commit of
/// `history[after]` (ids up to a few transactions later assigned), and the
/// insert position read `gap` commits later.
fn mark(history: &[Txn], after: usize, gap: usize, assigned: usize) -> Mark {
    let last = history.len() - 1;
    let xmax = history[..=(after + assigned).min(last)]
        .iter()
        .map(|t| t.xid + 1)
        .max()
        .unwrap_or(1_000);
    let mut xip: Vec<u64> = history[after + 1..]
        .iter()
        .map(|t| t.xid)
        .filter(|x| *x < xmax)
        .collect();
    xip.sort_unstable();
    let xmin = xip.first().copied().unwrap_or(xmax);
    Mark {
        snapshot: crate::horizon::Snapshot { xmin, xmax, xip },
        lsn: history[(after + gap).min(last)].end,
        exact: false,
        origin: "1/00000001".into(),
    }
}

fn event(id: &str) -> OutboxEvent {
    OutboxEvent {
        event_id: id.into(),
        aggregate_type: "order".into(),
        aggregate_id: "a".into(),
        aggregate_seq: 1,
        event_type: "Placed".into(),
        schema_version: 1,
        payload: bytes::Bytes::from_static(b"{}"),
        headers: None,
        topic: None,
        occurred_at: "2026-12-01 00:00:00+00".into(),
    }
}

/// A record as the tests see it: topic and value (the event id, or the offset).
type Record = (String, String);

/// Where a record's delivery report goes: to its producer, with its tag
/// (none for the offset record, whose report nobody waits for).
type Reply = (mpsc::UnboundedSender<Report>, Option<Tag>);

fn report((to, tag): Reply, outcome: Result<()>) {
    if let Some(tag) = tag {
        // The session gone, nobody waits for it.
        let _ = to.send((tag, outcome));
    }
}

/// What the slot and Kafka hold, shared by sessions.
struct World {
    rng: StdRng,
    history: Vec<Txn>,
    exactly_once: bool,
    /// The slot's confirmed position.
    confirmed: Lsn,
    /// Records Kafka acknowledged (at-least-once) or committed (exactly-once),
    /// as (topic, value), in order.
    durable: Vec<Record>,
    /// Committed Kafka transactions, as the records in each.
    kafka_txns: Vec<Vec<Record>>,
    /// Each transactional producer's open Kafka transaction: its records,
    /// and whether one failed.
    open: [Option<(Vec<Record>, bool)>; 2],
    /// A Kafka commit is under way.
    committing: bool,
    /// Records sent and not yet acknowledged, with their producer.
    pending: Vec<(Record, Reply, usize)>,
    /// Chance of a failed delivery or commit, per thousand.
    failure_rate: u32,
    violations: Vec<String>,
}

impl World {
    /// Nothing confirmed, nothing in Kafka yet.
    fn shared(seed: u64, history: Vec<Txn>, exactly_once: bool, failure_rate: u32) -> Shared {
        Arc::new(Mutex::new(World {
            rng: StdRng::seed_from_u64(seed),
            history,
            exactly_once,
            confirmed: Lsn::ZERO,
            durable: Vec::new(),
            kafka_txns: Vec::new(),
            open: [None, None],
            committing: false,
            pending: Vec::new(),
            failure_rate,
            violations: Vec::new(),
        }))
    }

    fn durable_events(&self) -> HashMap<String, usize> {
        let mut seen = HashMap::new();
        for (topic, value) in &self.durable {
            if topic != OFFSETS_TOPIC {
                *seen.entry(value.clone()).or_default() += 1;
            }
        }
        seen
    }

    /// Acknowledges or fails some pending records.
    fn deliver_some(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.rng.random_bool(0.3) {
                let (record, reply, producer) = self.pending.swap_remove(i);
                let fail = self.rng.random_range(0..1000) < self.failure_rate;
                match &mut self.open[producer] {
                    Some((_, failed)) if self.exactly_once => *failed |= fail,
                    _ if !fail => self.durable.push(record),
                    _ => {}
                }
                let outcome = if fail {
                    Err(Error::Kafka(rdkafka::error::KafkaError::Canceled))
                } else {
                    Ok(())
                };
                report(reply, outcome);
            } else {
                i += 1;
            }
        }
    }
}

type Shared = Arc<Mutex<World>>;

/// A session's publisher to the in-memory Kafka, with nothing refused.
fn publisher(world: &Shared, metrics: &Arc<Metrics>) -> Publisher<MemoryKafka> {
    Publisher::new(
        MemoryKafka::new(world),
        Arc::new(Router::new("t.{aggregate_type}")),
        None,
        HashSet::new(),
        metrics.clone(),
    )
}

/// A session's producer: in exactly-once mode two transactional ones
/// taking turns at each commit, as the real one has.
struct MemoryKafka {
    world: Shared,
    sender: mpsc::UnboundedSender<Report>,
    reports: mpsc::UnboundedReceiver<Report>,
    /// The producer that takes records now.
    active: AtomicUsize,
}

impl MemoryKafka {
    fn new(world: &Shared) -> Self {
        let (sender, reports) = mpsc::unbounded_channel();
        MemoryKafka {
            world: world.clone(),
            sender,
            reports,
            active: AtomicUsize::new(0),
        }
    }

    fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    fn enqueue(&self, topic: &str, value: &str, tag: Option<Tag>) {
        let mut world = self.world.lock().expect("the world");
        let producer = self.active();
        let record = (topic.to_owned(), value.to_owned());
        let overtaking = world
            .pending
            .iter()
            .find(|((t, _), _, p)| *t == record.0 && *p != producer);
        if let Some((other, ..)) = overtaking {
            // It could be appended before the other producer's record.
            let violation =
                format!("{record:?} sent while {other:?} of the other producer was unacknowledged");
            world.violations.push(violation);
        }
        if let Some((records, _)) = &mut world.open[producer] {
            records.push(record.clone());
        }
        world
            .pending
            .push((record, (self.sender.clone(), tag), producer));
    }
}

impl Kafka for MemoryKafka {
    async fn send(&self, event: &OutboxEvent, route: &Route, tag: Tag) -> Result<()> {
        self.enqueue(&route.topic, &event.event_id, Some(tag));
        Ok(())
    }

    async fn send_raw(&self, topic: &str, _key: &str, value: &str) -> Result<()> {
        self.enqueue(topic, value, None);
        Ok(())
    }

    async fn reports(&mut self, into: &mut Vec<Report>) {
        // The sender lives in the producer: never closed.
        self.reports.recv_many(into, 64).await;
    }

    async fn init_transactions(&self) -> Result<()> {
        // Fences the older producers: their open transactions are aborted.
        let mut world = self.world.lock().expect("the world");
        world.open = [None, None];
        world.pending.clear();
        Ok(())
    }

    async fn begin_transaction(&self) -> Result<()> {
        let mut world = self.world.lock().expect("the world");
        let open = &mut world.open[self.active()];
        assert!(open.is_none(), "a transaction is already open");
        *open = Some((Vec::new(), false));
        Ok(())
    }

    fn commit_transaction(&self) -> BoxFuture<'static, Result<()>> {
        let world = self.world.clone();
        let producer = self.active();
        self.active.store(1 - producer, Ordering::Relaxed);
        async move {
            {
                let mut world = world.lock().expect("the world");
                if world.committing {
                    world.violations.push("two commits at once".into());
                }
                world.committing = true;
            }
            // A commit takes a while; the source goes on meanwhile.
            let turns = world.lock().expect("the world").rng.random_range(0..30);
            for _ in 0..turns {
                tokio::task::yield_now().await;
            }
            let mut world = world.lock().expect("the world");
            world.committing = false;
            let (records, failed) = world.open[producer].take().expect("no open transaction");
            let fail = failed || world.rng.random_range(0..1000) < world.failure_rate;
            let (this, other) = std::mem::take(&mut world.pending)
                .into_iter()
                .partition(|(.., p)| *p == producer);
            world.pending = other;
            for (_, reply, _) in this {
                let outcome = if fail {
                    Err(Error::Kafka(rdkafka::error::KafkaError::Canceled))
                } else {
                    Ok(())
                };
                report(reply, outcome);
            }
            if fail {
                return Err(Error::Kafka(rdkafka::error::KafkaError::Canceled));
            }
            world.durable.extend(records.iter().cloned());
            world.kafka_txns.push(records);
            Ok(())
        }
        .boxed()
    }

    async fn abort_transaction(&self) -> Result<()> {
        let mut world = self.world.lock().expect("the world");
        let producer = self.active();
        world.open[producer] = None;
        world.pending.retain(|(.., p)| *p != producer);
        Ok(())
    }

    fn flush(&self, _timeout: Duration) -> Result<()> {
        Ok(())
    }
}

struct MemoryOffsets(Shared);

impl Offsets for MemoryOffsets {
    fn address(&self) -> (&str, &str) {
        (OFFSETS_TOPIC, "key")
    }

    async fn prepare(&self) -> Result<()> {
        Ok(())
    }

    async fn stored(&self) -> Result<Option<offsets::Stored>> {
        let world = self.0.lock().expect("the world");
        Ok(world
            .durable
            .iter()
            .rev()
            .find(|(topic, _)| topic == OFFSETS_TOPIC)
            .and_then(|(_, value)| offsets::decode(value.as_bytes())))
    }
}

/// The history from the slot's confirmed position, as PostgreSQL streams it,
/// leaving out what the sink said Kafka has; shuts down after `stop_after`
/// changes if set.
struct MemorySource {
    world: Shared,
    changes: std::collections::VecDeque<Change>,
    confirmed: Lsn,
    stop_after: Option<usize>,
    shutdown: watch::Sender<bool>,
}

impl MemorySource {
    fn new(
        world: &Shared,
        skip_before: Lsn,
        stop_after: Option<usize>,
        shutdown: watch::Sender<bool>,
    ) -> Self {
        let w = world.lock().expect("the world");
        let mut changes = std::collections::VecDeque::new();
        let mut rng = StdRng::seed_from_u64(w.confirmed.0);
        let last = w.history.last().map(|t| t.end);
        for txn in w.history.iter().filter(|t| t.end > w.confirmed) {
            // The commit record begins just before its end.
            if Lsn(txn.end.0 - 10) < skip_before {
                continue;
            }
            changes.push_back(Change::Begin {
                xid: txn.xid as u32,
            });
            changes.extend(txn.events.iter().map(|id| Change::Event(event(id))));
            changes.push_back(Change::Commit {
                end_lsn: txn.end,
                commit_time_micros: 0,
                // Sometimes the source is behind: the sink may wait for more.
                more: Some(txn.end) != last && rng.random_bool(0.5),
            });
            if rng.random_bool(0.2) {
                changes.push_back(Change::KeepAlive {
                    wal_end: Lsn(txn.end.0 + 50),
                });
            }
        }
        let confirmed = w.confirmed;
        drop(w);
        MemorySource {
            world: world.clone(),
            changes,
            confirmed,
            stop_after,
            shutdown,
        }
    }
}

impl Source for MemorySource {
    async fn next(&mut self) -> Result<Change> {
        loop {
            if self.stop_after == Some(0) || self.changes.is_empty() {
                let _ = self.shutdown.send(true);
            }
            self.stop_after = self.stop_after.map(|n| n.saturating_sub(1));
            match self.changes.pop_front() {
                Some(change) => return Ok(change),
                None => tokio::task::yield_now().await,
            }
        }
    }

    fn confirm(&mut self, lsn: Lsn) {
        let mut world = self.world.lock().expect("the world");
        let durable = world.durable_events();
        let missing: Vec<_> = world
            .history
            .iter()
            .filter(|t| t.end <= lsn)
            .flat_map(|t| &t.events)
            .filter(|id| !durable.contains_key(*id))
            .cloned()
            .collect();
        if !missing.is_empty() {
            world
                .violations
                .push(format!("confirmed {lsn} while Kafka lacks {missing:?}"));
        }
        if lsn < self.confirmed {
            world
                .violations
                .push(format!("confirmed {lsn} after {}", self.confirmed));
        }
        self.confirmed = lsn;
        world.confirmed = world.confirmed.max(lsn);
    }
}

/// Runs sessions over one random history until the slot has confirmed all
/// of it; returns the world for the final checks.
async fn run_until_confirmed(seed: u64, exactly_once: bool, failure_rate: u32) -> World {
    let mut rng = StdRng::seed_from_u64(seed);
    let history = history(&mut rng);
    let last = history.last().map_or(Lsn::ZERO, |t| t.end);
    let world = World::shared(seed ^ 0x5eed, history, exactly_once, failure_rate);
    let metrics = Metrics::new(crate::health::Limits {
        liveness_timeout: Duration::from_secs(60),
        ready_max_lag_bytes: 0,
        ready_max_stall: Duration::from_secs(30),
    });
    // Kafka acknowledges on its own time.
    let broker = tokio::spawn({
        let world = world.clone();
        async move {
            loop {
                world.lock().expect("the world").deliver_some();
                tokio::task::yield_now().await;
            }
        }
    });
    for session in 0.. {
        assert!(session < 200, "seed {seed}: no progress after 200 sessions");
        if world.lock().expect("the world").confirmed >= last {
            break;
        }
        let out = publisher(&world, &metrics);
        // Small limits, so backpressure and buffering are exercised.
        let (limit_events, limit_bytes) = (rng.random_range(1..8), rng.random_range(100..2000));
        let stop_after = rng.random_bool(0.5).then(|| rng.random_range(0..60));
        let (stop, mut shutdown) = watch::channel(false);
        let outcome = if exactly_once {
            let batching = Batching {
                max_events: rng.random_range(1..10),
                linger: Duration::ZERO,
                max_in_flight_events: limit_events,
                max_in_flight_bytes: limit_bytes,
            };
            let mut sink =
                Transactional::new(out, MemoryOffsets(world.clone()), batching, metrics.clone());
            let stored = sink.claim().await.expect("memory offsets");
            // Marks from the first commit not in Kafka on. Without a horizon
            // in Kafka, the first one may be taken while transactions Kafka
            // holds are still in progress (their commit records written
            // before they became visible, as under synchronous replication).
            let claimed_horizon = MemoryOffsets(world.clone())
                .stored()
                .await
                .expect("memory offsets")
                .and_then(|s| s.horizon);
            {
                let w = world.lock().expect("the world");
                let from = w
                    .history
                    .iter()
                    .position(|t| Some(t.end) > stored)
                    .unwrap_or(w.history.len());
                let mut at = from.saturating_sub(1);
                if claimed_horizon.is_none() && at > 0 && rng.random_bool(0.5) {
                    // The floor, and a mark while one of those is still in progress.
                    let back = rng.random_range(1..=at.min(3));
                    for after in [at - back, at - rng.random_range(1..=back)] {
                        let assigned = back + rng.random_range(0..3);
                        sink.mark(mark(&w.history, after, 0, assigned));
                    }
                }
                while at < w.history.len() && rng.random_bool(0.7) {
                    sink.mark(mark(
                        &w.history,
                        at,
                        rng.random_range(0..3),
                        rng.random_range(0..4),
                    ));
                    at += rng.random_range(1..6);
                }
            }
            let mut source =
                MemorySource::new(&world, stored.unwrap_or(Lsn::ZERO), stop_after, stop);
            if let Some(stored) = stored.filter(|s| *s > source.confirmed) {
                source.confirm(stored);
            }
            let outcome = forward(
                &mut source,
                &mut sink,
                &mut shutdown,
                &metrics,
                async |_| Ok(None),
            )
            .await;
            if let Err(error) = &outcome {
                sink.abandon(error).await;
            }
            outcome
        } else {
            let mut sink = AtLeastOnce::new(out, limit_events, limit_bytes, metrics.clone());
            let mut source = MemorySource::new(&world, Lsn::ZERO, stop_after, stop);
            forward(
                &mut source,
                &mut sink,
                &mut shutdown,
                &metrics,
                async |_| Ok(None),
            )
            .await
        };
        let mut w = world.lock().expect("the world");
        // What was still in flight is lost with the session.
        w.pending.clear();
        w.open = [None, None];
        w.committing = false;
        drop(w);
        if let Err(error) = outcome {
            tracing::debug!(%error, session, "session failed");
        }
    }
    broker.abort();
    let _ = broker.await;
    Arc::try_unwrap(world)
        .ok()
        .expect("sessions are over")
        .into_inner()
        .expect("the world")
}

fn check(seed: u64, world: &World) {
    assert!(
        world.violations.is_empty(),
        "seed {seed}: {:?}",
        world.violations
    );
    let seen = world.durable_events();
    for id in world.history.iter().flat_map(|t| &t.events) {
        let n = seen.get(id).copied().unwrap_or(0);
        assert!(n >= 1, "seed {seed}: {id} lost");
        if world.exactly_once {
            assert_eq!(n, 1, "seed {seed}: {id} delivered {n} times");
        }
    }
    if world.exactly_once {
        // Each committed Kafka transaction ends with its offset record and
        // holds whole PostgreSQL transactions, up to that offset.
        let owner: HashMap<&str, Lsn> = world
            .history
            .iter()
            .flat_map(|t| t.events.iter().map(move |e| (e.as_str(), t.end)))
            .collect();
        let mut previous = Lsn::ZERO;
        for records in &world.kafka_txns {
            let (topic, value) = records.last().expect("never empty");
            assert_eq!(topic, OFFSETS_TOPIC, "seed {seed}: {records:?}");
            let stored = offsets::decode(value.as_bytes()).expect("offset");
            let offset = stored.lsn;
            if let Some(horizon) = &stored.horizon {
                // A transaction without events may be confirmed to the slot
                // without Kafka: no event row asks about it.
                for t in world.history.iter().filter(|t| !t.events.is_empty()) {
                    assert_eq!(
                        horizon.holds(t.xid),
                        t.end <= offset,
                        "seed {seed}: horizon {horizon:?} at {offset} and transaction {} of {}",
                        t.xid,
                        t.end
                    );
                }
            }
            for (_, id) in &records[..records.len() - 1] {
                let end = owner[id.as_str()];
                assert!(
                    end <= offset && end > previous,
                    "seed {seed}: {id} of {end} in the transaction up to {offset}"
                );
            }
            let whole: usize = world
                .history
                .iter()
                .filter(|t| t.end > previous && t.end <= offset)
                .map(|t| t.events.len())
                .sum();
            assert_eq!(
                whole,
                records.len() - 1,
                "seed {seed}: a part of a transaction up to {offset}"
            );
            previous = offset;
        }
    }
}

async fn property(exactly_once: bool) {
    for seed in 0..300 {
        let failure_rate = [0, 5, 50][seed as usize % 3];
        let world = run_until_confirmed(seed, exactly_once, failure_rate).await;
        check(seed, &world);
    }
}

#[tokio::test]
async fn at_least_once_confirms_only_what_kafka_acknowledged_and_loses_nothing() {
    property(false).await;
}

#[tokio::test]
async fn exactly_once_confirms_only_committed_transactions_and_delivers_each_event_once() {
    property(true).await;
}

/// Steps the sink while it has something to do without waiting on a
/// timer still to come: reports, commits (which take some turns), the
/// buffer behind them, a linger that has run out.
async fn settle<K: Kafka, O: Offsets>(sink: &mut Transactional<K, O>) {
    let mut idle = 0;
    while idle < 100 {
        tokio::task::yield_now().await;
        match sink.wait().now_or_never() {
            Some(step) => {
                sink.apply(step.expect("wait")).await.expect("apply");
                idle = 0;
            }
            None => idle += 1,
        }
    }
}

/// The sizes of the Kafka transactions that single-event PostgreSQL
/// transactions go into when they arrive one at a time, each commit saying
/// whether the source had more ready behind it, the sink settling in
/// between; with `keepalive`, the source then says it caught up.
async fn kafka_transaction_sizes(more: &[bool], max_events: usize, keepalive: bool) -> Vec<usize> {
    let world = World::shared(7, Vec::new(), true, 0);
    let metrics = Metrics::new(crate::health::Limits {
        liveness_timeout: Duration::from_secs(60),
        ready_max_lag_bytes: 0,
        ready_max_stall: Duration::from_secs(30),
    });
    let out = publisher(&world, &metrics);
    let batching = Batching {
        max_events,
        linger: Duration::ZERO,
        max_in_flight_events: 1_000,
        max_in_flight_bytes: 1 << 20,
    };
    let mut sink = Transactional::new(out, MemoryOffsets(world.clone()), batching, metrics);
    sink.claim().await.expect("memory offsets");
    for (i, &more) in more.iter().enumerate() {
        sink.begin(Some(i as u32));
        sink.event(event(&format!("e{i}"))).await.expect("event");
        sink.commit(Lsn(100 * (i as u64 + 1)), Some(0), more)
            .await
            .expect("commit");
        settle(&mut sink).await;
    }
    if keepalive {
        sink.keepalive(Lsn(100 * (more.len() as u64 + 1)));
        settle(&mut sink).await;
    }
    let world = world.lock().expect("the world");
    world
        .kafka_txns
        .iter()
        .map(|records| records.iter().filter(|(t, _)| t != OFFSETS_TOPIC).count())
        .collect()
}

#[tokio::test]
async fn caught_up_each_postgresql_commit_is_committed_to_kafka_at_once() {
    assert_eq!(
        kafka_transaction_sizes(&[false; 6], 100, false).await,
        [1; 6]
    );
}

#[tokio::test]
async fn behind_a_backlog_a_kafka_transaction_fills_until_the_source_catches_up() {
    let mut more = [true; 6];
    more[5] = false;
    assert_eq!(kafka_transaction_sizes(&more, 100, false).await, [6]);
    // Still behind: nothing is committed yet.
    assert!(kafka_transaction_sizes(&[true; 6], 100, false)
        .await
        .is_empty());
}

#[tokio::test]
async fn behind_a_backlog_a_kafka_transaction_is_committed_at_batch_max_events() {
    assert_eq!(
        kafka_transaction_sizes(&[true; 10], 4, true).await,
        [4, 4, 2]
    );
}

#[tokio::test]
async fn a_keepalive_says_the_source_caught_up() {
    assert_eq!(kafka_transaction_sizes(&[true; 3], 100, true).await, [3]);
}
