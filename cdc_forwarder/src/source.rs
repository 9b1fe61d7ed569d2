//! Where events come from: a small vocabulary of changes with their
//! positions, and the slot source that reads them from a logical replication
//! slot (pgoutput), handling relations and skipping what Kafka already has.

use futures::FutureExt;

use crate::error::{Error, Result};
use crate::event::{EventLayout, OutboxEvent};
use crate::lsn::Lsn;
use crate::pgoutput::Message;
use crate::replication::{ReplicationStream, StreamEvent};

/// One step of the outbox's history, in commit order. Events are kept
/// inline: boxing them would cost an allocation per event.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A transaction begins; its events and its commit follow.
    Begin {
        /// Its id, 32 bits as pgoutput sends it.
        xid: u32,
    },
    Event(OutboxEvent),
    Commit {
        /// End of the commit record: the position that confirms this
        /// transaction and everything before it.
        end_lsn: Lsn,
        /// Microseconds since 2000-01-01.
        commit_time_micros: i64,
        /// The source is behind, and a sink may wait for more before
        /// committing: more changes were ready to be read behind this
        /// commit, or the server sent it long after it committed.
        more: bool,
    },
    /// The source had nothing more to send before this position.
    KeepAlive {
        wal_end: Lsn,
    },
}

/// How long after its commit the server may send a transaction's changes
/// while it keeps up with the WAL. Sending them later, it is reading a
/// backlog: more follows, even when the socket has nothing yet (at one event
/// per transaction the walsender decodes slower than the forwarder reads).
const BACKLOG_AGE_MICROS: i64 = 1_000_000;

/// Whether the server sent a transaction from a backlog: both times are the
/// server's, so the clocks of other hosts do not matter.
fn from_backlog(commit_time_micros: i64, sent_micros: i64) -> bool {
    sent_micros - commit_time_micros > BACKLOG_AGE_MICROS
}

/// A stream of [`Change`]s that can be told what is durably delivered.
pub trait Source {
    /// The next change. Cancel-safe: a change is never lost when the future
    /// is dropped before it completes.
    fn next(&mut self) -> impl std::future::Future<Output = Result<Change>> + Send;
    /// Everything up to `lsn` is durably delivered; the source may forget it.
    fn confirm(&mut self, lsn: Lsn);
}

/// The replication slot as a [`Source`].
pub struct SlotSource {
    stream: ReplicationStream,
    layout: Option<EventLayout>,
    /// Transactions whose commit record begins before this are in Kafka already.
    skip_before: Lsn,
    skipping: bool,
    /// A change read ahead, to tell whether more is ready behind a commit.
    ahead: Option<Result<Change>>,
}

impl SlotSource {
    /// Streams from `stream` (started), leaving out every transaction whose
    /// commit record begins before `skip_before`.
    pub fn new(stream: ReplicationStream, skip_before: Lsn) -> Self {
        SlotSource {
            stream,
            layout: None,
            skip_before,
            skipping: false,
            ahead: None,
        }
    }

    pub fn into_stream(self) -> ReplicationStream {
        self.stream
    }
}

impl Source for SlotSource {
    async fn next(&mut self) -> Result<Change> {
        let mut change = match self.ahead.take() {
            Some(change) => change?,
            None => self.read().await?,
        };
        if let Change::Commit { more, .. } = &mut change {
            // Whatever the stream has already received behind the commit.
            self.ahead = self.read().now_or_never();
            *more |= self.ahead.is_some();
        }
        Ok(change)
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.stream.confirm(lsn);
    }
}

impl SlotSource {
    /// The next change from the stream. Cancel-safe: what it consumed
    /// before a pending read is kept in `self`.
    async fn read(&mut self) -> Result<Change> {
        loop {
            let Some(event) = self.stream.next().await? else {
                return Err(Error::Replication(pgwire_replication::PgWireError::Io(
                    std::sync::Arc::new(std::io::ErrorKind::UnexpectedEof.into()),
                )));
            };
            let change = match event {
                StreamEvent::Begin { final_lsn, xid } => {
                    self.skipping = final_lsn < self.skip_before;
                    Change::Begin { xid }
                }
                StreamEvent::Change(Message::Relation(relation)) => {
                    if EventLayout::is_events_table(&relation) {
                        self.layout = Some(EventLayout::from_relation(&relation)?);
                    }
                    continue;
                }
                StreamEvent::Change(Message::Insert {
                    relation_id,
                    values,
                }) => {
                    let Some(layout) = &self.layout else {
                        return Err(Error::Bug(
                            "insert arrived before its relation message".into(),
                        ));
                    };
                    if layout.relation_id() != relation_id {
                        tracing::warn!(
                            relation_id,
                            "ignoring insert into a table that is not outbox.events"
                        );
                        continue;
                    }
                    Change::Event(layout.event(values)?)
                }
                StreamEvent::Change(Message::Other(tag)) => {
                    tracing::debug!(tag = %(tag as char), "ignoring pgoutput message");
                    continue;
                }
                StreamEvent::Change(Message::Begin { .. } | Message::Commit { .. }) => continue,
                StreamEvent::Commit {
                    end_lsn,
                    commit_time_micros,
                    sent_micros,
                } => Change::Commit {
                    end_lsn,
                    commit_time_micros,
                    more: from_backlog(commit_time_micros, sent_micros),
                },
                StreamEvent::KeepAlive { wal_end } => Change::KeepAlive { wal_end },
            };
            if self.skipping {
                // Nothing of a transaction Kafka has, not even a keepalive
                // from inside it.
                self.skipping = !matches!(change, Change::Commit { .. });
                continue;
            }
            return Ok(change);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::from_backlog;

    #[test]
    fn a_transaction_sent_long_after_its_commit_comes_from_a_backlog() {
        let committed = 818_000_000_000_000;
        // Decoded and sent as it committed: the server keeps up.
        assert!(!from_backlog(committed, committed + 3_000));
        // The last change seen is an earlier transaction's.
        assert!(!from_backlog(committed, committed - 5_000));
        // Half a minute of WAL stood between the commit and its sending.
        assert!(from_backlog(committed, committed + 30_000_000));
    }
}
