//! The PostgreSQL side of the stream: the publication on the events table and
//! the logical replication slot, created when missing.

use tokio_postgres::{Client, NoTls};

use crate::config::{Config, PgTarget, SslMode};
use crate::error::{Error, Result};
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
    client
        .execute("SELECT outbox.forget_relay($1)", &[&slot])
        .await?;
    Ok(())
}

/// The slot's lag (server position minus confirmed position) and retained
/// WAL (server position minus restart_lsn), in bytes.
pub async fn wal_figures(client: &Client, slot: &str) -> Result<Option<(i64, i64)>> {
    let row = client
        .query_opt(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, \
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint \
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| Some((r.get::<_, Option<i64>>(0)?, r.get::<_, Option<i64>>(1)?))))
}

/// Creates the slot without a snapshot. The forwarder's first start then
/// recreates it with one, to deliver what was committed before.
pub async fn create_slot(client: &Client, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await?;
    Ok(())
}

pub async fn drop_publication(client: &Client, name: &str) -> Result<()> {
    client
        .execute("SELECT outbox.drop_publication($1)", &[&name])
        .await?;
    Ok(())
}
