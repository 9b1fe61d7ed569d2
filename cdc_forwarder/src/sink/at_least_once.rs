//! At-least-once: an idempotent producer (`acks=all`); each event holds its
//! transaction in the ledger until its delivery report arrives.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};

use super::{count_released, unix_micros, Publisher, Sink, DRAIN_TIMEOUT};
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::ledger::{Ledger, TxnId};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::producer::Kafka;

/// How long a forwarder halting on a poison event waits for the events it
/// produced before it to be delivered.
const POISON_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

pub struct AtLeastOnce<K: Kafka> {
    out: Publisher<K>,
    ledger: Ledger,
    reports: FuturesUnordered<Tagged<K::Delivery>>,
    /// Bytes of events whose report has not arrived.
    in_flight_bytes: usize,
    max_events: usize,
    max_bytes: usize,
    metrics: Arc<Metrics>,
}

impl<K: Kafka> AtLeastOnce<K> {
    pub fn new(
        out: Publisher<K>,
        max_events: usize,
        max_bytes: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        AtLeastOnce {
            out,
            ledger: Ledger::default(),
            reports: FuturesUnordered::new(),
            in_flight_bytes: 0,
            max_events,
            max_bytes,
            metrics,
        }
    }

    fn delivered(&mut self, txn: TxnId, size: usize, result: Result<()>) -> Result<()> {
        result?;
        self.ledger.unhold(txn);
        self.in_flight_bytes -= size;
        Ok(())
    }
}

impl<K: Kafka> Sink for AtLeastOnce<K> {
    async fn prepare(&mut self) -> Result<()> {
        Ok(())
    }

    async fn claim(&mut self) -> Result<Option<Lsn>> {
        Ok(None)
    }

    fn begin(&mut self, _xid: Option<u32>) {
        self.ledger.begin();
    }

    async fn event(&mut self, event: OutboxEvent) -> Result<()> {
        let txn = self
            .ledger
            .current()
            .expect("an event outside a transaction");
        let (delivery, size) = self.out.publish(event).await?;
        self.ledger.event(txn, size);
        self.ledger.hold(txn);
        self.in_flight_bytes += size;
        self.reports.push(Tagged {
            delivery,
            txn,
            size,
        });
        Ok(())
    }

    async fn commit(&mut self, end_lsn: Lsn, commit_time_micros: Option<i64>) -> Result<()> {
        if let Some(txn) = self.ledger.current() {
            self.ledger.commit(txn, end_lsn, commit_time_micros);
        }
        Ok(())
    }

    fn keepalive(&mut self, wal_end: Lsn) {
        self.ledger.keepalive(wal_end);
    }

    fn has_room(&self) -> bool {
        self.reports.len() < self.max_events && self.in_flight_bytes < self.max_bytes
    }

    fn reading(&self) -> bool {
        self.ledger.reading()
    }

    type Step = (TxnId, usize, Result<()>);

    async fn wait(&mut self) -> Result<Self::Step> {
        match self.reports.next().await {
            Some(report) => Ok(report),
            None => std::future::pending().await,
        }
    }

    async fn apply(&mut self, (txn, size, result): Self::Step) -> Result<()> {
        self.delivered(txn, size, result)
    }

    fn confirmable(&mut self) -> Option<Lsn> {
        let now = unix_micros();
        let metrics = &self.metrics;
        let lsn = self.ledger.confirm(|r| count_released(metrics, now, r))?;
        crate::faults::check("after_kafka_commit");
        Some(lsn)
    }

    async fn finish(&mut self) -> Result<()> {
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            while let Some((txn, size, result)) = self.reports.next().await {
                self.delivered(txn, size, result)?;
            }
            Ok(())
        });
        match drained.await {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::warn!(
                    in_flight = self.reports.len(),
                    "drain timed out; undelivered events will be replayed"
                );
                Ok(())
            }
        }
    }

    async fn abandon(&mut self, error: &Error) {
        if !matches!(error, Error::Poison { .. }) {
            return;
        }
        // The events produced before the failure still go out, so consumers
        // have everything up to a poison event while the forwarder is
        // halted. None is confirmed: the next start may send them again.
        if let Err(e) = self.out.kafka.flush(POISON_FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "events before the failure not all delivered; the next start sends them");
        }
    }
}

/// A delivery with the transaction and size it stands for.
pub(super) struct Tagged<D> {
    pub delivery: D,
    pub txn: TxnId,
    pub size: usize,
}

impl<D: std::future::Future<Output = Result<()>> + Unpin> std::future::Future for Tagged<D> {
    type Output = (TxnId, usize, Result<()>);

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        std::pin::Pin::new(&mut this.delivery)
            .poll(cx)
            .map(|result| (this.txn, this.size, result))
    }
}
