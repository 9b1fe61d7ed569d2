//! The PostgreSQL side of the stream: the publication on the events table and
//! the logical replication slot, created when missing.

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

use crate::config::{Config, PgTarget};
use crate::error::{Error, Result};

/// Opens an ordinary SQL connection; the connection task runs in the background.
pub async fn connect(target: &PgTarget) -> Result<Client> {
    let (client, connection) = target.sql_config().connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(error = %error, "sql connection closed");
        }
    });
    Ok(client)
}

/// Checks that the database can feed the forwarder and creates the
/// publication and slot when asked to.
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

    if !slot_exists(client, &config.slot).await? {
        if !config.create_missing {
            return Err(Error::Setup(format!(
                "replication slot {:?} does not exist; run `outbox-forwarder slot create` or allow creation",
                config.slot
            )));
        }
        match client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&config.slot],
            )
            .await
        {
            Ok(_) => tracing::info!(slot = %config.slot, "created replication slot"),
            // Another instance created it first: that is the slot we want.
            Err(e) if e.code() == Some(&SqlState::DUPLICATE_OBJECT) => {}
            Err(e) => return Err(e.into()),
        }
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
pub async fn confirmed_flush(client: &Client, slot: &str) -> Result<Option<crate::lsn::Lsn>> {
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
pub async fn advance(client: &Client, slot: &str, lsn: crate::lsn::Lsn) -> Result<()> {
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
