//! The publication on the events table that the slot streams through,
//! created when missing by the extension's definer-rights function.

use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::shard::Shard;

/// Checks that the database (named `dbname` in errors) can feed the
/// forwarder, and creates the publication `name` (of `shard`, when there is
/// one) when it is missing and `create_missing` allows; one that exists
/// must carry what this forwarder is to forward. The slot is created by the
/// replication session, with the snapshot the first-start catch-up reads.
pub async fn prepare(
    client: &Client,
    dbname: &str,
    name: &str,
    shard: Option<Shard>,
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
    if shard.is_some() && !has_shards(client).await? {
        return Err(Error::Setup(format!(
            "database {dbname:?} has an outbox from before shards; run ALTER EXTENSION pg_outbox UPDATE (0.8.0 or later) to forward by shard"
        )));
    }

    let existed = exists(client, name).await?;
    if !existed && !create_missing {
        return Err(Error::Setup(format!(
            "publication {name:?} does not exist; run `outbox-forwarder publication create` or allow creation"
        )));
    }
    ensure(client, name, shard).await?;
    if !existed {
        tracing::info!(publication = %name, shard = shard.map(|s| s.to_string()), "created publication");
    }
    Ok(())
}

/// Creates the publication (of `shard`) if it is missing, through the
/// extension's definer-rights functions, so the forwarder's role needs no
/// ownership of the events table; refuses one that carries other events.
pub async fn ensure(client: &Client, name: &str, shard: Option<Shard>) -> Result<()> {
    match shard {
        Some(shard) => {
            // The function refuses a publication with another filter.
            client
                .execute(
                    "SELECT outbox.ensure_shard_publication($1, $2, $3)",
                    &[&name, &(shard.index as i32), &(shard.count as i32)],
                )
                .await?;
        }
        None => {
            client
                .execute("SELECT outbox.ensure_publication($1)", &[&name])
                .await?;
            if let Some(filter) = row_filter(client, name).await? {
                return Err(Error::Setup(format!(
                    "publication {name:?} carries only the events where {filter}, as a shard's does; forward it with --shard, or give this forwarder a publication of its own"
                )));
            }
        }
    }
    Ok(())
}

/// Whether the outbox has what shards need (0.8.0 on).
async fn has_shards(client: &Client) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT to_regprocedure('outbox.ensure_shard_publication(text, integer, integer)') IS NOT NULL",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// The publication's row filter on outbox.events, if it has one.
pub async fn row_filter(client: &Client, name: &str) -> Result<Option<String>> {
    let row = client
        .query_opt(
            "SELECT pg_get_expr(r.prqual, r.prrelid) FROM pg_publication p \
               JOIN pg_publication_rel r ON r.prpubid = p.oid \
              WHERE p.pubname = $1 AND r.prrelid = 'outbox.events'::regclass",
            &[&name],
        )
        .await?;
    Ok(row.and_then(|r| r.get(0)))
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
