//! What the forwarder records of each slot in the database
//! (`outbox.relay_progress`): the confirmed position, whether the first-start
//! catch-up finished and the safe snapshot it left; the shard a sharded
//! forwarder's slot carries (`outbox.relay_shards`); and the session lock
//! that lets one instance at a time create the slot and catch up.

use tokio_postgres::Client;

use crate::error::Result;
use crate::lsn::Lsn;
use crate::shard::Shard;

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
pub async fn record(client: &Client, slot: &str, lsn: Lsn, caught_up: bool) -> Result<()> {
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

/// Records which shard the slot carries, for `outbox.status()`.
pub async fn record_shard(client: &Client, slot: &str, shard: Shard) -> Result<()> {
    client
        .execute(
            "SELECT outbox.record_relay_shard($1, $2, $3)",
            &[&slot, &(shard.index as i32), &(shard.count as i32)],
        )
        .await?;
    Ok(())
}

/// Forgets the shard of a dropped slot (pg_outbox 0.8.0 on; before, there
/// is none to forget).
pub async fn forget_shard(client: &Client, slot: &str) -> Result<()> {
    // Looked up first: a call of a missing function fails as it is parsed.
    let known: bool = client
        .query_one(
            "SELECT to_regprocedure('outbox.forget_relay_shard(name)') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if known {
        client
            .execute("SELECT outbox.forget_relay_shard($1)", &[&slot])
            .await?;
    }
    Ok(())
}
