//! The logical replication slot: whether it exists or was invalidated, its
//! creation (a failover slot on 17 and later), its confirmed position and
//! the WAL it holds back, and the retention settings that bound that WAL.

use tokio_postgres::Client;

use crate::error::Result;
use crate::lsn::Lsn;

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

/// Drops the slot (it must be inactive) and forgets its catch-up.
pub async fn drop_slot(client: &Client, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    crate::progress::forget(client, slot).await
}

/// `slot drop`: drops the slot and forgets its catch-up and its shard.
pub async fn remove(client: &Client, slot: &str) -> Result<()> {
    drop_slot(client, slot).await?;
    crate::progress::forget_shard(client, slot).await
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

/// Whether the slot is to be a failover slot: `asked` for, and the server
/// (PostgreSQL 17 and later) has them.
pub async fn wants_failover(client: &Client, asked: bool) -> Result<bool> {
    if !asked {
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
