//! The PostgreSQL side of the stream: the publication on the events table and
//! the logical replication slot, created when missing.

use tokio_postgres::{Client, NoTls};

use crate::config::{Config, PgTarget, SslMode};
use crate::error::{Error, Result};
use crate::horizon::{Mark, ORIGIN_SQL};
use crate::lsn::Lsn;

/// Opens an ordinary SQL connection; the connection task runs in the background.
pub async fn connect(target: &PgTarget) -> Result<Client> {
    let client = if target.tls().mode == SslMode::Disable {
        let (client, connection) = target.sql_config().connect(NoTls).await?;
        tokio::spawn(watch_connection(connection));
        client
    } else {
        let tls = crate::tls::sql_connector(target.tls())?;
        let (client, connection) = target.sql_config().connect(tls).await?;
        tokio::spawn(watch_connection(connection));
        client
    };
    // Timestamps in the same text form as the replication stream's.
    client
        .batch_execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO'")
        .await?;
    Ok(client)
}

/// The primary among the hosts of a multi-host URL: the first that answers
/// and is not in recovery. One host is taken as it is. After a promotion the
/// next session finds the new primary this way, for the SQL and the
/// replication connection alike.
pub async fn primary(target: &PgTarget) -> Result<PgTarget> {
    let hosts = target.per_host();
    if hosts.len() == 1 {
        return Ok(target.clone());
    }
    let mut tried = Vec::new();
    for host in hosts {
        let answer = tokio::time::timeout(PRIMARY_PROBE_TIMEOUT, async {
            let client = connect(&host).await?;
            let row = client.query_one("SELECT pg_is_in_recovery()", &[]).await?;
            Ok::<bool, Error>(row.get(0))
        })
        .await;
        let name = host.redacted();
        match answer {
            Ok(Ok(false)) => return Ok(host),
            Ok(Ok(true)) => tried.push(format!("{name} is a standby")),
            Ok(Err(e)) => tried.push(format!("{name}: {e}")),
            Err(_) => tried.push(format!(
                "{name}: no answer within {PRIMARY_PROBE_TIMEOUT:?}"
            )),
        }
    }
    Err(Error::NoPrimary(tried.join("; ")))
}

/// How long a host of a multi-host URL may take to say whether it is the primary.
const PRIMARY_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn watch_connection<F>(connection: F)
where
    F: std::future::Future<Output = std::result::Result<(), tokio_postgres::Error>>,
{
    if let Err(error) = connection.await {
        tracing::debug!(error = %error, "sql connection closed");
    }
}

/// Checks that the database can feed the forwarder and creates the
/// publication when asked to. The slot is created by the replication
/// session, with the snapshot the first-start catch-up reads.
pub async fn prepare(client: &Client, config: &Config) -> Result<()> {
    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level != "logical" {
        return Err(Error::Setup(format!(
            "wal_level is {wal_level:?}; set wal_level = logical in postgresql.conf and restart PostgreSQL"
        )));
    }
    let has_table = client
        .query_one("SELECT to_regclass('outbox.events') IS NOT NULL", &[])
        .await?
        .get::<_, bool>(0);
    if !has_table {
        return Err(Error::Setup(format!(
            "database {:?} has no outbox.events table; run CREATE EXTENSION pg_outbox there",
            config.postgres.dbname()
        )));
    }

    if !publication_exists(client, &config.publication).await? {
        if !config.create_missing {
            return Err(Error::Setup(format!(
                "publication {:?} does not exist; run `outbox-forwarder publication create` or allow creation",
                config.publication
            )));
        }
        // The extension's definer-rights function creates it, so the
        // forwarder's role needs no ownership of the events table.
        client
            .execute(
                "SELECT outbox.ensure_publication($1)",
                &[&config.publication],
            )
            .await?;
        tracing::info!(publication = %config.publication, "created publication");
    }

    Ok(())
}

pub async fn publication_exists(client: &Client, name: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[&name],
        )
        .await?;
    Ok(row.get(0))
}

pub async fn slot_exists(client: &Client, name: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database())",
            &[&name],
        )
        .await?;
    Ok(row.get(0))
}

/// Why the slot can no longer stream, if it exists and was invalidated
/// (`wal_status` lost; on 17+ any `invalidation_reason`, as an idle timeout).
pub async fn invalidation(client: &Client, name: &str) -> Result<Option<String>> {
    let row = client
        .query_opt(
            "SELECT coalesce(to_jsonb(s) ->> 'invalidation_reason', \
                             CASE WHEN s.wal_status = 'lost' THEN 'wal_removed' END) \
               FROM pg_replication_slots s WHERE slot_name = $1 AND database = current_database()",
            &[&name],
        )
        .await?;
    Ok(row.and_then(|r| r.get(0)))
}

/// A snapshot and the WAL insert position read after it (see
/// [`crate::horizon`]).
pub async fn mark(client: &Client) -> Result<Mark> {
    let row = client
        .query_one(
            &format!(
                "SELECT pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text, {ORIGIN_SQL}"
            ),
            &[],
        )
        .await?;
    let snapshot: String = row.get(0);
    let lsn: String = row.get(1);
    Ok(Mark {
        snapshot: snapshot.parse().map_err(Error::Bug)?,
        lsn: lsn
            .parse()
            .map_err(|_| Error::Bug(format!("not an LSN: {lsn}")))?,
        exact: false,
        origin: row.get(2),
    })
}

/// The slot's `confirmed_flush_lsn`, if the slot exists.
pub async fn confirmed_flush(client: &Client, slot: &str) -> Result<Option<Lsn>> {
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let text: Option<String> = row.get(0);
    Ok(text.and_then(|t| t.parse().ok()))
}

/// Moves an inactive slot's confirmed position forward to `lsn`, used after
/// the stream closed so the last acknowledged position is not left unsent.
/// Never moves it backward.
pub async fn advance(client: &Client, slot: &str, lsn: Lsn) -> Result<()> {
    // The server releases the slot a moment after the stream closed.
    for _ in 0..100 {
        let active: Option<bool> = client
            .query_opt(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
            .map(|r| r.get(0));
        if active != Some(true) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    match confirmed_flush(client, slot).await? {
        Some(current) if current < lsn => {
            client
                .execute(
                    "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)",
                    &[&slot, &lsn.to_string()],
                )
                .await?;
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Whether this slot's first-start catch-up has completed (recorded by the
/// forwarder in `outbox.relay_progress`).
pub async fn caught_up(client: &Client, slot: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM outbox.relay_progress WHERE slot_name = $1 AND caught_up_at IS NOT NULL)",
            &[&slot],
        )
        .await?;
    Ok(row.get(0))
}

/// Records the confirmed position, and with `caught_up` that the catch-up is done.
pub async fn record_progress(client: &Client, slot: &str, lsn: Lsn, caught_up: bool) -> Result<()> {
    client
        .execute(
            "SELECT outbox.record_relay_progress($1, $2::text::pg_lsn, $3)",
            &[&slot, &lsn.to_string(), &caught_up],
        )
        .await?;
    Ok(())
}

/// Takes the session lock that one instance holds while it creates the slot
/// and catches up; false when another instance holds it.
pub async fn try_lock_catch_up(client: &Client, slot: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('pg_outbox.catch_up.' || $1))",
            &[&slot],
        )
        .await?;
    Ok(row.get(0))
}

pub async fn unlock_catch_up(client: &Client, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT pg_advisory_unlock(hashtext('pg_outbox.catch_up.' || $1))",
            &[&slot],
        )
        .await?;
    Ok(())
}

/// Drops the slot (it must be inactive) and forgets its catch-up.
pub async fn drop_slot(client: &Client, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    forget(client, slot).await
}

/// The last safe snapshot recorded for the slot after a finished catch-up
/// (see `outbox.record_relay_progress`): every transaction it shows is in
/// Kafka.
pub async fn safe_snapshot(client: &Client, slot: &str) -> Result<Option<String>> {
    let row = client
        .query_opt(
            "SELECT safe_snapshot::text FROM outbox.relay_progress \
              WHERE slot_name = $1 AND caught_up_at IS NOT NULL",
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| r.get(0)))
}

/// Forgets what was recorded for the slot: its catch-up counts as undone.
pub async fn forget(client: &Client, slot: &str) -> Result<()> {
    client
        .execute("SELECT outbox.forget_relay($1)", &[&slot])
        .await?;
    Ok(())
}

/// The slot's lag, retained WAL and `wal_status`; `None` without the slot.
pub async fn wal_figures(client: &Client, slot: &str) -> Result<Option<WalFigures>> {
    let row = client
        .query_opt(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, \
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status \
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| WalFigures {
        lag: r.get(0),
        retained: r.get(1),
        wal_status: r.get::<_, Option<String>>(2).unwrap_or_default(),
    }))
}

/// A slot's WAL, in bytes from the server's position (none once lost).
pub struct WalFigures {
    /// To the confirmed position.
    pub lag: Option<i64>,
    /// To the restart position: what the slot holds back.
    pub retained: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (empty: unknown).
    pub wal_status: String,
}

/// Creates the slot without a snapshot. The forwarder's first start then
/// recreates it with one, to deliver what was committed before.
pub async fn create_slot(client: &Client, slot: &str, failover: bool) -> Result<()> {
    // The failover argument exists from PostgreSQL 17 on only.
    let sql = if failover {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    client.execute(sql, &[&slot]).await?;
    Ok(())
}

/// Whether the slot is to be a failover slot: asked for, and the server
/// (PostgreSQL 17 and later) has them.
pub async fn wants_failover(client: &Client, config: &Config) -> Result<bool> {
    if !config.failover_slot {
        return Ok(false);
    }
    let row = client
        .query_one(
            "SELECT current_setting('server_version_num')::int >= 170000",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

pub async fn drop_publication(client: &Client, name: &str) -> Result<()> {
    client
        .execute("SELECT outbox.drop_publication($1)", &[&name])
        .await?;
    Ok(())
}

/// What decides whether the server keeps the slot's WAL: its
/// `max_slot_wal_keep_size`, the slot's `wal_status`, and on 18
/// `idle_replication_slot_timeout`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    pub max_slot_wal_keep_size: String,
    /// None while the slot does not exist.
    pub wal_status: Option<String>,
    /// None before PostgreSQL 18; "0" when off.
    pub idle_timeout: Option<String>,
}

/// How much a finding matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Warning,
    Error,
}

pub async fn retention(client: &Client, slot: &str) -> Result<Retention> {
    let row = client
        .query_one(
            "SELECT current_setting('max_slot_wal_keep_size'), \
                    (SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1), \
                    current_setting('idle_replication_slot_timeout', true)",
            &[&slot],
        )
        .await?;
    Ok(Retention {
        max_slot_wal_keep_size: row.get(0),
        wal_status: row.get(1),
        idle_timeout: row.get(2),
    })
}

impl Retention {
    /// What an operator should hear about, most serious first.
    pub fn findings(&self, slot: &str) -> Vec<(Severity, String)> {
        let mut found = Vec::new();
        match self.wal_status.as_deref() {
            Some("lost") => found.push((
                Severity::Error,
                format!("slot {slot} is invalidated (wal_status lost): the server removed WAL it still needed; drop it (outbox-forwarder slot drop) and start the forwarder, whose first-start catch-up re-delivers the stored events"),
            )),
            Some("unreserved") => found.push((
                Severity::Warning,
                format!("slot {slot} is past max_slot_wal_keep_size (wal_status unreserved): the next checkpoint invalidates it unless the forwarder catches up"),
            )),
            _ => {}
        }
        if self.max_slot_wal_keep_size == "-1" {
            found.push((
                Severity::Warning,
                "max_slot_wal_keep_size is unlimited: while the forwarder is stopped its slot keeps every WAL segment, up to a full disk; set a limit above the longest stop to ride out".to_owned(),
            ));
        }
        if let Some(timeout) = self.idle_timeout.as_deref().filter(|t| *t != "0") {
            found.push((
                Severity::Warning,
                format!("idle_replication_slot_timeout is {timeout}: a slot no forwarder reads for that long is invalidated; set it to 0 or keep the forwarder running"),
            ));
        }
        found
    }

    /// One line for people.
    pub fn summary(&self) -> String {
        let status = self.wal_status.as_deref().unwrap_or("no slot yet");
        let idle = match self.idle_timeout.as_deref() {
            Some(timeout) => format!(", idle_replication_slot_timeout {timeout}"),
            None => String::new(),
        };
        format!(
            "max_slot_wal_keep_size {}, wal_status {status}{idle}",
            self.max_slot_wal_keep_size
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retention(keep: &str, status: Option<&str>, idle: Option<&str>) -> Retention {
        Retention {
            max_slot_wal_keep_size: keep.into(),
            wal_status: status.map(Into::into),
            idle_timeout: idle.map(Into::into),
        }
    }

    #[test]
    fn a_bounded_reserved_slot_has_nothing_to_say() {
        assert!(retention("8GB", Some("reserved"), None)
            .findings("s")
            .is_empty());
        assert!(retention("8GB", None, Some("0")).findings("s").is_empty());
    }

    #[test]
    fn unbounded_retention_an_idle_timeout_and_a_lost_slot_are_reported() {
        let severities =
            |r: Retention| r.findings("s").into_iter().map(|f| f.0).collect::<Vec<_>>();
        assert_eq!(
            severities(retention("-1", Some("reserved"), None)),
            [Severity::Warning]
        );
        assert_eq!(
            severities(retention("8GB", Some("reserved"), Some("1d"))),
            [Severity::Warning]
        );
        assert_eq!(
            severities(retention("8GB", Some("unreserved"), None)),
            [Severity::Warning]
        );
        assert_eq!(
            severities(retention("-1", Some("lost"), None)),
            [Severity::Error, Severity::Warning]
        );
    }
}
