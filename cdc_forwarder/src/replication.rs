//! The replication connection: the one module that speaks the streaming
//! replication protocol (through the `pgwire-replication` crate), so the
//! client can be swapped without touching the pipeline.
//!
//! The stream starts where the slot's `confirmed_flush_lsn` is: we always ask
//! for position 0/0 and PostgreSQL starts at the slot's confirmed position.
//! Nothing is acknowledged to the server until [`ReplicationStream::confirm`]
//! is called; until then the client reports 0/0, which the server ignores.

use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig};

use crate::config::Config;
use crate::error::Result;
use crate::lsn::Lsn;
use crate::pgoutput::{self, Message};

/// What the stream delivers, already decoded.
#[derive(Debug)]
pub enum StreamEvent {
    Begin {
        xid: u32,
    },
    /// A Relation, Insert or other pgoutput message inside a transaction.
    Change(Message),
    Commit {
        end_lsn: Lsn,
        commit_time_micros: i64,
    },
    /// The server's position when it had nothing more to send.
    KeepAlive {
        wal_end: Lsn,
    },
}

pub struct ReplicationStream {
    client: ReplicationClient,
}

impl ReplicationStream {
    /// Connects in replication mode and starts streaming the slot.
    pub async fn start(config: &Config) -> Result<Self> {
        let pg = &config.postgres;
        let cfg = ReplicationConfig::new(
            pg.host(),
            pg.user(),
            pg.password(),
            pg.dbname(),
            config.slot.clone(),
            config.publication.clone(),
        )
        .with_port(pg.port())
        .with_tls(TlsConfig::disabled())
        .with_start_lsn(pgwire_replication::Lsn::ZERO)
        .with_status_interval(Duration::from_secs(1))
        .with_application_name("outbox-forwarder");
        let client = ReplicationClient::connect(cfg).await?;
        Ok(ReplicationStream { client })
    }

    /// The next event; `None` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<StreamEvent>> {
        loop {
            let Some(event) = self.client.recv().await? else {
                return Ok(None);
            };
            let event = match event {
                ReplicationEvent::Begin { xid, .. } => StreamEvent::Begin { xid },
                ReplicationEvent::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => StreamEvent::Commit {
                    end_lsn: Lsn(end_lsn.as_u64()),
                    commit_time_micros,
                },
                ReplicationEvent::XLogData { data, .. } => {
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

    /// Ends the stream after the last confirmation has been sent.
    pub async fn close(mut self) -> Result<()> {
        self.client.shutdown().await?;
        Ok(())
    }
}
