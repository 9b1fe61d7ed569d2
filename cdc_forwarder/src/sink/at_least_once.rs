//! At-least-once: an idempotent producer (`acks=all`); each event holds its
//! transaction in the ledger until its delivery report arrives.

use std::sync::Arc;
use std::time::Duration;

use super::{count_released, unix_micros, InFlight, Publisher, Sink, DRAIN_TIMEOUT};
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::ledger::Ledger;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::producer::{Kafka, Report};

/// How long a forwarder halting on a poison event waits for the events it
/// produced before it to be delivered.
const POISON_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

pub struct AtLeastOnce<K: Kafka> {
    out: Publisher<K>,
    ledger: Ledger,
    in_flight: InFlight,
    /// Reports that arrived, taken by the next [`Sink::apply`].
    arrived: Vec<Report>,
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
            in_flight: InFlight::default(),
            arrived: Vec::new(),
            max_events,
            max_bytes,
            metrics,
        }
    }

    /// Each acknowledged event gives back its hold; a refusal ends the session.
    fn take_reports(&mut self) -> Result<()> {
        let ledger = &mut self.ledger;
        self.in_flight
            .take(&mut self.arrived, |txn| ledger.unhold(txn))
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
        let size = self.out.publish(event, self.in_flight.next_tag()).await?;
        self.ledger.event(txn, size);
        self.ledger.hold(txn);
        self.in_flight.sent(txn, size);
        Ok(())
    }

    async fn commit(
        &mut self,
        end_lsn: Lsn,
        commit_time_micros: Option<i64>,
        _more: bool,
    ) -> Result<()> {
        if let Some(txn) = self.ledger.current() {
            self.ledger.commit(txn, end_lsn, commit_time_micros);
        }
        Ok(())
    }

    fn keepalive(&mut self, wal_end: Lsn) {
        self.ledger.keepalive(wal_end);
    }

    fn has_room(&self) -> bool {
        self.in_flight.len() < self.max_events && self.in_flight.bytes() < self.max_bytes
    }

    fn reading(&self) -> bool {
        self.ledger.reading()
    }

    fn held(&self) -> usize {
        self.ledger.holds()
    }

    /// Reports arrived.
    type Step = ();

    async fn wait(&mut self) -> Result<Self::Step> {
        self.out.kafka.reports(&mut self.arrived).await;
        Ok(())
    }

    async fn apply(&mut self, (): Self::Step) -> Result<()> {
        self.take_reports()
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
            while self.in_flight.len() > 0 {
                self.out.kafka.reports(&mut self.arrived).await;
                self.take_reports()?;
            }
            Ok(())
        });
        match drained.await {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::warn!(
                    in_flight = self.in_flight.len(),
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
