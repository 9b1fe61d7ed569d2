//! Exactly-once: whole PostgreSQL transactions go into Kafka transactions,
//! each closed by an offset record (see [`crate::offsets`]), and a
//! transaction is confirmable once the Kafka transaction holding its commit
//! has committed.
//!
//! Commits never stall the source. One Kafka commit is in flight at a time.
//! Once every record of that transaction is acknowledged (appended to its
//! partitions), the next Kafka transaction opens on the other producer and
//! takes events while the commit is still under way: its records land behind
//! the committing one's, so each partition keeps the order. What arrives
//! before those acknowledgements is buffered (bounded by the in-flight
//! limits). The next commit starts only once the last one returned.
//! A Kafka transaction is committed at the first PostgreSQL commit boundary
//! where no other commit is in flight and either it holds `batch_max_events`
//! or the source has caught up: nothing complete waits behind it in the
//! buffer and the source had nothing more ready behind that commit (after
//! `batch_linger`, 0 by default). Behind a backlog it fills up to
//! `batch_max_events`, or for [`BACKLOG_WAIT`] at most; a lone event waits
//! for one commit, not for a timer.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt;

use super::{count_released, unix_micros, InFlight, Publisher, Sink};
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::horizon::{Horizon, Mark, Tracker};
use crate::ledger::{Ledger, TxnId};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::offsets::{self, Offsets};
use crate::producer::{Kafka, Report};

/// How long a complete Kafka transaction waits for more while the source is
/// behind, at most (it is committed at `batch_max_events` before that).
pub const BACKLOG_WAIT: Duration = Duration::from_millis(100);

/// When a Kafka transaction is committed and how much may wait.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    /// A Kafka transaction is committed at the first boundary at or above this.
    pub max_events: usize,
    /// How long a complete Kafka transaction waits for more before its commit.
    pub linger: Duration,
    /// Events sent and not acknowledged, plus events buffered, at most.
    pub max_in_flight_events: usize,
    /// The same in bytes.
    pub max_in_flight_bytes: usize,
}

/// The Kafka transaction being filled.
struct Batch {
    opened: Instant,
    events: usize,
    /// PostgreSQL transactions whose commit is in it.
    complete: Vec<TxnId>,
    /// Commit end of the last of them.
    last_end: Option<Lsn>,
}

/// A Kafka commit in flight.
struct Committing {
    future: BoxFuture<'static, Result<()>>,
    complete: Vec<TxnId>,
    end: Lsn,
    started: Instant,
}

/// What arrived while a commit was in flight. Events are kept inline: boxing
/// them would cost an allocation per event.
#[allow(clippy::large_enum_variant)]
enum Item {
    Event(TxnId, OutboxEvent),
    Commit(TxnId, Lsn, Option<u32>),
}

/// What arrived while it could not be sent, in arrival order, with the
/// payload bytes and the commits it holds.
#[derive(Default)]
struct Waiting {
    items: VecDeque<Item>,
    bytes: usize,
    commits: usize,
}

impl Waiting {
    fn push(&mut self, item: Item) {
        match &item {
            Item::Event(_, event) => self.bytes += event.size(),
            Item::Commit(..) => self.commits += 1,
        }
        self.items.push_back(item);
    }

    fn pop(&mut self) -> Option<Item> {
        let item = self.items.pop_front()?;
        match &item {
            Item::Event(_, event) => self.bytes -= event.size(),
            Item::Commit(..) => self.commits -= 1,
        }
        Some(item)
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// What [`Sink::wait`] found.
pub enum Step {
    Reported,
    Committed(Result<()>),
    Lingered,
}

pub struct Transactional<K: Kafka, O> {
    out: Publisher<K>,
    offsets: O,
    batching: Batching,
    metrics: Arc<Metrics>,
    ledger: Ledger,
    initialized: bool,
    /// The offset Kafka holds.
    stored: Lsn,
    /// The transactions put into Kafka transactions, by id.
    tracker: Tracker,
    /// The id of the PostgreSQL transaction being read.
    xid: Option<u32>,
    /// The source had more ready behind the last commit it sent, and no
    /// keepalive came since: more is on its way.
    behind: bool,
    batch: Option<Batch>,
    committing: Option<Committing>,
    /// Empty whenever events may be sent (see [`Transactional::may_send`]).
    waiting: Waiting,
    in_flight: InFlight,
    /// Reports that arrived, taken by the next [`Sink::apply`].
    arrived: Vec<Report>,
}

impl<K: Kafka, O: Offsets> Transactional<K, O> {
    pub fn new(out: Publisher<K>, offsets: O, batching: Batching, metrics: Arc<Metrics>) -> Self {
        Transactional {
            out,
            offsets,
            batching,
            metrics,
            ledger: Ledger::default(),
            initialized: false,
            stored: Lsn::ZERO,
            tracker: Tracker::default(),
            xid: None,
            behind: false,
            batch: None,
            committing: None,
            waiting: Waiting::default(),
            in_flight: InFlight::default(),
            arrived: Vec::new(),
        }
    }

    /// Registers the transactional id, fencing older producers of it.
    async fn initialize(&mut self) -> Result<()> {
        if !self.initialized {
            self.out.kafka.init_transactions().await?;
            self.initialized = true;
        }
        Ok(())
    }

    async fn send(&mut self, txn: TxnId, event: OutboxEvent) -> Result<()> {
        if self.batch.is_none() {
            self.initialize().await?;
            self.out.kafka.begin_transaction().await?;
            self.batch = Some(Batch {
                opened: Instant::now(),
                events: 0,
                complete: Vec::new(),
                last_end: None,
            });
        }
        let size = self.out.publish(event, self.in_flight.next_tag()).await?;
        self.ledger.event(txn, size);
        self.in_flight.sent(txn, size);
        if let Some(batch) = &mut self.batch {
            batch.events += 1;
        }
        Ok(())
    }

    /// Reports of records in flight leave it; a refusal ends the session.
    /// Once the committing transaction's records are all acknowledged, what
    /// waits in the buffer goes into the next one.
    async fn take_reports(&mut self) -> Result<()> {
        self.in_flight.take(&mut self.arrived, |_| ())?;
        self.resume().await
    }

    /// Whether records may go to Kafka now: no commit is in flight, or the
    /// next Kafka transaction is open, or every record of the committing one
    /// is acknowledged, so that the next one's land behind them. Records of
    /// two producers keep no order between them otherwise.
    fn may_send(&self) -> bool {
        self.committing.is_none() || self.batch.is_some() || self.in_flight.len() == 0
    }

    /// Whether what arrives now waits in the buffer, behind what already does.
    fn buffering(&self) -> bool {
        !self.waiting.is_empty() || !self.may_send()
    }

    /// Sends what was buffered, as far as it may go now, starting a commit
    /// at a boundary where one is due.
    async fn resume(&mut self) -> Result<()> {
        while self.may_send() {
            let Some(item) = self.waiting.pop() else {
                break;
            };
            match item {
                Item::Event(txn, event) => self.send(txn, event).await?,
                Item::Commit(txn, end, xid) => {
                    self.close(txn, end, xid);
                    if self.due() {
                        self.start_commit().await?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A PostgreSQL commit reached the Kafka side.
    fn close(&mut self, txn: TxnId, end: Lsn, xid: Option<u32>) {
        if let Some(xid) = xid {
            self.tracker.add(xid);
        }
        match &mut self.batch {
            Some(batch) => {
                batch.complete.push(txn);
                batch.last_end = Some(end);
            }
            // No event of it waits in Kafka.
            None => self.ledger.unhold(txn),
        }
    }

    /// Whether the Kafka transaction, at a commit boundary, is to be
    /// committed now.
    fn due(&self) -> bool {
        let Some(batch) = &self.batch else {
            return false;
        };
        self.committing.is_none()
            && batch.last_end.is_some()
            && (batch.events >= self.batching.max_events
                || (self.waiting.commits == 0 && batch.opened.elapsed() >= self.linger()))
    }

    /// How long a complete Kafka transaction waits for more: longer while
    /// the source is behind, since more is on its way.
    fn linger(&self) -> Duration {
        if self.behind {
            self.batching.linger.max(BACKLOG_WAIT)
        } else {
            self.batching.linger
        }
    }

    /// Closes the Kafka transaction with its offset record and starts the commit.
    async fn start_commit(&mut self) -> Result<()> {
        let Some(batch) = self.batch.take() else {
            return Ok(());
        };
        let Some(end) = batch.last_end else {
            self.batch = Some(batch);
            return Ok(());
        };
        self.send_offset(end).await?;
        crate::faults::check("before_kafka_commit");
        self.committing = Some(Committing {
            future: self.out.kafka.commit_transaction(),
            complete: batch.complete,
            end,
            started: Instant::now(),
        });
        Ok(())
    }

    /// The commit in flight returned.
    async fn committed(&mut self, result: Result<()>) -> Result<()> {
        let Some(committing) = self.committing.take() else {
            return Ok(());
        };
        if let Err(error) = result {
            // A record Kafka refused for good says more than the commit.
            while let Some(()) = self.out.kafka.reports(&mut self.arrived).now_or_never() {}
            let poison = self
                .arrived
                .drain(..)
                .find_map(|(_, outcome)| match outcome {
                    Err(poison @ Error::Poison { .. }) => Some(poison),
                    _ => None,
                });
            return Err(poison.unwrap_or(error));
        }
        self.metrics
            .kafka_commit_seconds
            .observe(committing.started.elapsed().as_secs_f64());
        self.metrics.kafka_commits.inc();
        crate::faults::check("after_kafka_commit");
        self.stored = committing.end;
        for txn in committing.complete {
            self.ledger.unhold(txn);
        }
        self.resume().await?;
        // The next Kafka transaction may have become due meanwhile, at a
        // boundary: nothing of a later PostgreSQL transaction in it. (With
        // no commit in flight, `resume` emptied the buffer.)
        if !self.ledger.reading() && self.due() {
            self.start_commit().await?;
        }
        Ok(())
    }

    /// Adds the offset record of `position` to the open Kafka transaction,
    /// with the horizon as of that position. Its delivery is the commit's:
    /// nobody waits for its report.
    async fn send_offset(&mut self, position: Lsn) -> Result<()> {
        self.tracker.advance(position);
        let value = offsets::encode(position, self.tracker.horizon().as_ref());
        let (topic, key) = self.offsets.address();
        self.out.kafka.send_raw(topic, key, &value).await
    }

    /// A Kafka transaction holding only the offset record, so Kafka knows
    /// `position` even when no event moved it there.
    async fn store_position(&mut self, position: Lsn) -> Result<()> {
        self.initialize().await?;
        self.out.kafka.begin_transaction().await?;
        self.send_offset(position).await?;
        self.out.kafka.commit_transaction().await?;
        self.stored = position;
        Ok(())
    }
}

impl<K: Kafka, O: Offsets> Sink for Transactional<K, O> {
    type Step = Step;

    async fn prepare(&mut self) -> Result<()> {
        self.offsets.prepare().await
    }

    async fn claim(&mut self) -> Result<Option<Lsn>> {
        self.initialize().await?;
        let stored = self.offsets.stored().await?;
        if self.ledger.is_settled() {
            self.tracker = Tracker::starting_at(stored.as_ref().and_then(|s| s.horizon.clone()));
        }
        let stored = stored.map(|s| s.lsn);
        if let Some(stored) = stored {
            self.stored = self.stored.max(stored);
            if self.ledger.is_settled() {
                self.ledger = Ledger::starting_at(self.ledger.confirmed().max(stored));
            }
        }
        Ok(stored)
    }

    fn begin(&mut self, xid: Option<u32>) {
        let txn = self.ledger.begin();
        self.ledger.hold(txn);
        self.xid = xid;
    }

    async fn event(&mut self, event: OutboxEvent) -> Result<()> {
        let txn = self
            .ledger
            .current()
            .expect("an event outside a transaction");
        if self.buffering() {
            self.waiting.push(Item::Event(txn, event));
            return Ok(());
        }
        self.send(txn, event).await
    }

    async fn commit(
        &mut self,
        end_lsn: Lsn,
        commit_time_micros: Option<i64>,
        more: bool,
    ) -> Result<()> {
        let Some(txn) = self.ledger.current() else {
            return Ok(());
        };
        self.ledger.commit(txn, end_lsn, commit_time_micros);
        let xid = self.xid.take();
        self.behind = more;
        if self.buffering() {
            self.waiting.push(Item::Commit(txn, end_lsn, xid));
            return Ok(());
        }
        self.close(txn, end_lsn, xid);
        if self.due() {
            self.start_commit().await?;
        }
        Ok(())
    }

    fn keepalive(&mut self, wal_end: Lsn) {
        self.ledger.keepalive(wal_end);
        // The server had nothing more to send: the source caught up.
        self.behind = false;
    }

    fn has_room(&self) -> bool {
        self.in_flight.len() + self.waiting.len() < self.batching.max_in_flight_events
            && self.in_flight.bytes() + self.waiting.bytes < self.batching.max_in_flight_bytes
    }

    fn reading(&self) -> bool {
        self.ledger.reading()
    }

    fn held(&self) -> usize {
        self.ledger.holds()
    }

    async fn wait(&mut self) -> Result<Step> {
        // A complete Kafka transaction waiting out its linger, with nothing
        // of a later PostgreSQL transaction in it yet.
        let linger = match (&self.batch, &self.committing, self.ledger.current()) {
            (Some(batch), None, None) if batch.last_end.is_some() => {
                Some(batch.opened + self.linger())
            }
            _ => None,
        };
        // A deadline already past is taken at once, not at the timer's next
        // tick (a millisecond).
        let lingered = linger.is_some_and(|at| at <= Instant::now());
        let reporting = self.in_flight.len() > 0;
        let (kafka, arrived) = (&mut self.out.kafka, &mut self.arrived);
        let committing = &mut self.committing;
        tokio::select! {
            biased;
            () = kafka.reports(arrived), if reporting => Ok(Step::Reported),
            result = async { committing.as_mut().expect("checked").future.as_mut().await }, if committing.is_some() => {
                Ok(Step::Committed(result))
            }
            () = std::future::ready(()), if lingered => Ok(Step::Lingered),
            () = async { tokio::time::sleep_until(linger.expect("checked").into()).await }, if linger.is_some() => {
                Ok(Step::Lingered)
            }
            else => std::future::pending().await,
        }
    }

    async fn apply(&mut self, step: Step) -> Result<()> {
        match step {
            Step::Reported => self.take_reports().await,
            Step::Committed(result) => self.committed(result).await,
            Step::Lingered if self.due() && !self.ledger.reading() => self.start_commit().await,
            Step::Lingered => Ok(()),
        }
    }

    fn confirmable(&mut self) -> Option<Lsn> {
        let now = unix_micros();
        let metrics = &self.metrics;
        self.ledger.confirm(|r| count_released(metrics, now, r))
    }

    fn mark(&mut self, mark: Mark) {
        self.tracker.mark(mark);
    }

    fn horizon_in_kafka(&self) -> Option<Horizon> {
        self.tracker.horizon()
    }

    async fn finish(&mut self) -> Result<()> {
        loop {
            if let Some(committing) = &mut self.committing {
                let result = committing.future.as_mut().await;
                self.committed(result).await?;
            } else if !self.ledger.reading()
                && self.batch.as_ref().is_some_and(|b| b.last_end.is_some())
            {
                self.start_commit().await?;
            } else {
                break;
            }
        }
        while let Some(()) = self.out.kafka.reports(&mut self.arrived).now_or_never() {
            self.take_reports().await?;
        }
        if self.batch.take().is_some() {
            // A PostgreSQL transaction is half sent: abort, it is replayed.
            self.out.kafka.abort_transaction().await?;
            return Ok(());
        }
        let position = self.ledger.position();
        if !self.ledger.reading() && position > self.stored {
            self.store_position(position).await?;
        }
        Ok(())
    }

    async fn abandon(&mut self, _error: &Error) {
        if self.batch.is_some() {
            // Best effort: the next session's fencing aborts it anyway.
            let _best_effort = self.out.kafka.abort_transaction().await;
        }
    }
}
