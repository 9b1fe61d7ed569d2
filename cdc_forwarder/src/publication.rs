//! The publication on the events table that the slot streams through,
//! created when missing by the extension's definer-rights function.

use tokio_postgres::Client;

use crate::error::{Error, Result};

/// Checks that the database (named `dbname` in errors) can feed the
/// forwarder, and creates the publication `name` when it is missing and
/// `create_missing` allows. The slot is created by the replication session,
/// with the snapshot the first-start catch-up reads.
pub async fn prepare(
    client: &Client,
    dbname: &str,
    name: &str,
    create_missing: bool,
) -> Result<()> {
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
            "database {dbname:?} has no outbox.events table; run CREATE EXTENSION pg_outbox there"
        )));
    }

    if !exists(client, name).await? {
        if !create_missing {
            return Err(Error::Setup(format!(
                "publication {name:?} does not exist; run `outbox-forwarder publication create` or allow creation"
            )));
        }
        // The extension's definer-rights function creates it, so the
        // forwarder's role needs no ownership of the events table.
        client
            .execute("SELECT outbox.ensure_publication($1)", &[&name])
            .await?;
        tracing::info!(publication = %name, "created publication");
    }

    Ok(())
}

pub async fn exists(client: &Client, name: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[&name],
        )
        .await?;
    Ok(row.get(0))
}

pub async fn drop(client: &Client, name: &str) -> Result<()> {
    client
        .execute("SELECT outbox.drop_publication($1)", &[&name])
        .await?;
    Ok(())
}
