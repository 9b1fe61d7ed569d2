//! The replication connection: the one module that speaks the streaming
//! replication protocol (through the `pgwire-replication` crate), so the
//! client can be swapped without touching the pipeline.
//!
//! A session is opened gated: before streaming starts it can create the slot
//! with an exported snapshot, which the first-start catch-up reads from. The
//! stream then starts where the slot's `confirmed_flush_lsn` is: we ask for
//! position 0/0 and PostgreSQL starts at the slot's confirmed position.
//! Nothing is acknowledged to the server until [`ReplicationStream::confirm`];
//! until then the client reports 0/0, which the server ignores.

use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::pg_target::PgTarget;
use crate::pgoutput::{self, Message};

/// What the stream delivers, already decoded.
#[derive(Debug)]
pub enum StreamEvent {
    Begin {
        /// LSN of the transaction's commit record.
        final_lsn: Lsn,
        /// The transaction's id (32 bits, as pgoutput sends it).
        xid: u32,
    },
    /// A Relation, Insert or other pgoutput message inside a transaction.
    Change(Message),
    Commit {
        end_lsn: Lsn,
        /// Microseconds since 2000-01-01, by the server's clock.
        commit_time_micros: i64,
        /// When the server sent the last change before this commit, by the
        /// same clock.
        sent_micros: i64,
    },
    /// The server's position when it had nothing more to send.
    KeepAlive { wal_end: Lsn },
}

/// A slot created with an exported snapshot.
#[derive(Debug, Clone)]
pub struct CreatedSlot {
    /// Transactions that committed before this point are in the snapshot;
    /// later ones come through the stream.
    pub consistent_point: Lsn,
    /// Usable with SET TRANSACTION SNAPSHOT until the stream starts.
    pub snapshot: String,
}

pub struct ReplicationStream {
    client: ReplicationClient,
    /// The server's clock when it sent the last change read.
    sent_micros: i64,
}

impl ReplicationStream {
    /// Connects to `pg` in replication mode, to stream `slot` through
    /// `publication`; streaming waits for [`Self::start`].
    pub async fn connect(pg: &PgTarget, slot: &str, publication: &str) -> Result<Self> {
        let cfg = ReplicationConfig::new(
            pg.host(),
            pg.user(),
            pg.password(),
            pg.dbname(),
            slot.to_owned(),
            publication.to_owned(),
        )
        .with_port(pg.port())
        .with_tls(crate::tls::replication_tls(pg.tls(), &pg.host()))
        .with_start_lsn(pgwire_replication::Lsn::ZERO)
        .with_status_interval(Duration::from_millis(100))
        .with_options("-c TimeZone=UTC -c DateStyle=ISO")
        .with_application_name("outbox-forwarder");
        let client = ReplicationClient::connect_gated(cfg).await?;
        Ok(ReplicationStream {
            client,
            sent_micros: 0,
        })
    }

    /// CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export'), with `failover` a
    /// failover slot (PostgreSQL 17 and later). The snapshot stays valid
    /// until [`Self::start`].
    pub async fn create_slot(&mut self, slot: &str, failover: bool) -> Result<CreatedSlot> {
        let failover = if failover { ", FAILOVER true" } else { "" };
        let rows = self
            .client
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT \"{slot}\" LOGICAL pgoutput (SNAPSHOT 'export'{failover})"
            ))
            .await?;
        let text = |i: usize| -> Option<String> {
            let row = rows.first()?;
            let value = row.get(i)?.as_ref()?;
            Some(String::from_utf8_lossy(value).into_owned())
        };
        let bad = || Error::Bug("CREATE_REPLICATION_SLOT returned an unexpected row".into());
        let consistent_point = text(1).and_then(|t| t.parse().ok()).ok_or_else(bad)?;
        let snapshot = text(2).ok_or_else(bad)?;
        Ok(CreatedSlot {
            consistent_point,
            snapshot,
        })
    }

    /// Sends START_REPLICATION and waits until the server holds the slot for us.
    pub async fn start(&mut self, slot: &str) -> Result<()> {
        self.client.start().await?;
        match self.client.wait_started().await {
            Ok(()) => Ok(()),
            // 55006 object_in_use: another walsender holds the slot.
            Err(pgwire_replication::PgWireError::Server(message))
                if sqlstate(&message) == Some("55006") =>
            {
                Err(Error::SlotBusy(slot.to_owned()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The next event; `None` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<StreamEvent>> {
        loop {
            let Some(event) = self.client.recv().await? else {
                return Ok(None);
            };
            let event = match event {
                ReplicationEvent::Begin { final_lsn, xid, .. } => StreamEvent::Begin {
                    final_lsn: Lsn(final_lsn.as_u64()),
                    xid,
                },
                ReplicationEvent::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => StreamEvent::Commit {
                    end_lsn: Lsn(end_lsn.as_u64()),
                    commit_time_micros,
                    sent_micros: self.sent_micros,
                },
                ReplicationEvent::XLogData {
                    data,
                    server_time_micros,
                    ..
                } => {
                    self.sent_micros = server_time_micros;
                    StreamEvent::Change(pgoutput::decode(data)?)
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => StreamEvent::KeepAlive {
                    wal_end: Lsn(wal_end.as_u64()),
                },
                // Logical messages are not part of an insert-only publication's
                // stream, and we never set a stop position.
                ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => continue,
            };
            return Ok(Some(event));
        }
    }

    /// Tells the server that everything up to `lsn` is durably delivered; the
    /// slot may release that WAL. Positions only move forward.
    pub fn confirm(&self, lsn: Lsn) {
        self.client
            .update_applied_lsn(pgwire_replication::Lsn::from(lsn.0));
    }

    /// Ends the stream.
    pub async fn close(mut self) -> Result<()> {
        self.client.shutdown().await?;
        Ok(())
    }
}

/// The SQLSTATE of a server error as the replication client words it
/// ("message (SQLSTATE 55006)"), whatever language the server speaks.
fn sqlstate(message: &str) -> Option<&str> {
    let code = message.strip_suffix(')')?.rsplit_once("(SQLSTATE ")?.1;
    (code.len() == 5).then_some(code)
}

#[cfg(test)]
mod tests {
    use super::sqlstate;

    #[test]
    fn a_server_error_is_known_by_its_sqlstate_in_any_language() {
        assert_eq!(
            sqlstate("le slot « s » est actif pour le PID 7 (SQLSTATE 55006)"),
            Some("55006")
        );
        assert_eq!(sqlstate("replication slot \"s\" is active for PID 7"), None);
        assert_eq!(sqlstate("error (SQLSTATE 5500)"), None);
    }
}
