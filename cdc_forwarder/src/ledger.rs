//! The confirm rule: which position may be told to the replication slot.
//!
//! PostgreSQL restarts a logical slot at its `confirmed_flush_lsn` and
//! silently skips every transaction that committed at or before it, so a
//! position is confirmable only when Kafka durably holds every event up to it.
//! Positions are whole transactions (the commit's end LSN), never single rows.
//!
//! The ledger keeps the PostgreSQL transactions read from the stream and not
//! yet confirmed, in stream order. Each carries *holds*: a sink takes one for
//! everything of the transaction that Kafka does not durably have yet and
//! gives it back when Kafka has it. The at-least-once sink holds once per
//! event until its delivery report; the transactional sink once per
//! transaction until the Kafka transaction holding it commits. The rule is the
//! same for both:
//!
//! - the confirmable position is the commit end of the last transaction of the
//!   longest prefix of committed transactions without holds;
//! - a keepalive's position is confirmable when no transaction is being read
//!   and none waits: the server has sent everything before it and Kafka has
//!   all of that, and transactions still running commit later, at a higher
//!   position (an idle outbox never pins WAL);
//! - positions only move forward.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// A transaction's place in the ledger.
pub type TxnId = u64;

/// What a transaction was, told when it leaves the ledger (for metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// PostgreSQL commit time, microseconds since 2000-01-01 (none for a catch-up).
    pub commit_time: Option<i64>,
    pub events: usize,
    pub bytes: usize,
}

#[derive(Debug, Default)]
struct Entry {
    end: Option<Lsn>,
    commit_time: Option<i64>,
    holds: usize,
    events: usize,
    bytes: usize,
}

#[derive(Debug, Default)]
pub struct Ledger {
    entries: VecDeque<Entry>,
    /// Id of `entries[0]`.
    first: TxnId,
    /// The transaction being read, if its commit has not arrived.
    reading: Option<TxnId>,
    /// The newest keepalive position not yet confirmable.
    keepalive: Lsn,
    confirmed: Lsn,
    /// Holds over all transactions.
    holds: usize,
    /// Bytes of events produced and not yet released.
    bytes: usize,
}

impl Ledger {
    /// A ledger whose confirmed position starts at `confirmed`.
    pub fn starting_at(confirmed: Lsn) -> Self {
        Ledger {
            confirmed,
            ..Ledger::default()
        }
    }

    /// A transaction's Begin: returns its id.
    pub fn begin(&mut self) -> TxnId {
        self.entries.push_back(Entry::default());
        let id = self.first + self.entries.len() as u64 - 1;
        self.reading = Some(id);
        id
    }

    /// An event of transaction `id` was handed to Kafka.
    pub fn event(&mut self, id: TxnId, bytes: usize) {
        let entry = self.entry(id);
        entry.events += 1;
        entry.bytes += bytes;
        self.bytes += bytes;
    }

    /// Something of transaction `id` is not yet durable in Kafka.
    pub fn hold(&mut self, id: TxnId) {
        self.entry(id).holds += 1;
        self.holds += 1;
    }

    /// Kafka durably has what a [`Self::hold`] on `id` stood for.
    pub fn unhold(&mut self, id: TxnId) {
        let entry = self.entry(id);
        entry.holds = entry.holds.checked_sub(1).expect("unhold without a hold");
        self.holds -= 1;
    }

    /// The Commit of transaction `id`.
    pub fn commit(&mut self, id: TxnId, end: Lsn, commit_time: Option<i64>) {
        let entry = self.entry(id);
        entry.end = Some(end);
        entry.commit_time = commit_time;
        if self.reading == Some(id) {
            self.reading = None;
        }
    }

    /// A keepalive: the server had nothing more to send before `wal_end`.
    pub fn keepalive(&mut self, wal_end: Lsn) {
        self.keepalive = self.keepalive.max(wal_end);
    }

    /// The transaction whose Begin was read and whose Commit not yet.
    pub fn current(&self) -> Option<TxnId> {
        self.reading
    }

    /// Whether a transaction's Begin was read and its Commit not yet.
    pub fn reading(&self) -> bool {
        self.reading.is_some()
    }

    /// Whether every transaction read is confirmed or confirmable.
    pub fn is_settled(&self) -> bool {
        self.entries.is_empty() && self.reading.is_none()
    }

    /// Holds over all transactions: what Kafka does not durably have yet.
    pub fn holds(&self) -> usize {
        self.holds
    }

    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// The position [`Self::confirm`] would reach now.
    pub fn position(&self) -> Lsn {
        let mut position = self.confirmed;
        for entry in &self.entries {
            match entry.end {
                Some(end) if entry.holds == 0 => position = position.max(end),
                _ => return position,
            }
        }
        if self.reading.is_none() {
            position = position.max(self.keepalive);
        }
        position
    }

    /// Releases what became confirmable, telling `each` about every
    /// transaction released, and returns the new confirmed position if it
    /// moved.
    pub fn confirm(&mut self, mut each: impl FnMut(Released)) -> Option<Lsn> {
        let before = self.confirmed;
        while let Some(front) = self.entries.front() {
            match front.end {
                Some(end) if front.holds == 0 => {
                    each(Released {
                        commit_time: front.commit_time,
                        events: front.events,
                        bytes: front.bytes,
                    });
                    self.bytes -= front.bytes;
                    self.confirmed = self.confirmed.max(end);
                    self.entries.pop_front();
                    self.first += 1;
                }
                _ => break,
            }
        }
        if self.is_settled() {
            self.confirmed = self.confirmed.max(self.keepalive);
        }
        (self.confirmed > before).then_some(self.confirmed)
    }

    fn entry(&mut self, id: TxnId) -> &mut Entry {
        let index = id
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok())
            .expect("transaction already released");
        &mut self.entries[index]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_waits_for_every_event_before_it() {
        let mut l = Ledger::default();
        let a = l.begin();
        l.hold(a);
        l.hold(a);
        l.commit(a, Lsn(100), None);
        let b = l.begin();
        l.hold(b);
        l.commit(b, Lsn(200), None);

        // b's only report arrives first: nothing may be confirmed yet.
        l.unhold(b);
        assert_eq!(l.confirm(|_| {}), None);
        l.unhold(a);
        assert_eq!(l.confirm(|_| {}), None, "a still has one event in flight");
        l.unhold(a);
        assert_eq!(l.confirm(|_| {}), Some(Lsn(200)));
        assert!(l.is_settled());
    }

    #[test]
    fn a_transaction_being_read_holds_back_itself_and_keepalives() {
        let mut l = Ledger::default();
        let a = l.begin();
        l.keepalive(Lsn(50));
        assert_eq!(l.confirm(|_| {}), None, "a has not committed");
        l.commit(a, Lsn(70), None);
        assert_eq!(l.confirm(|_| {}), Some(Lsn(70)));
        l.keepalive(Lsn(90));
        assert_eq!(l.confirm(|_| {}), Some(Lsn(90)), "idle: the keepalive");
        let b = l.begin();
        l.hold(b);
        l.commit(b, Lsn(120), None);
        l.keepalive(Lsn(130));
        assert_eq!(l.confirm(|_| {}), None, "b is not in Kafka yet");
        l.unhold(b);
        assert_eq!(l.confirm(|_| {}), Some(Lsn(130)));
    }

    #[test]
    fn positions_never_go_back() {
        let mut l = Ledger::starting_at(Lsn(500));
        let a = l.begin();
        l.commit(a, Lsn(400), None);
        assert_eq!(l.confirm(|_| {}), None);
        assert_eq!(l.confirmed(), Lsn(500));
    }
}
