//! `outbox-forwarder status`: what the slots and the stored offset say.

use serde_json::{json, Value};

use crate::config::{Config, Delivery, SourceKind};
use crate::database;
use crate::error::Result;
use crate::offsets::OffsetStore;
use crate::slot;

/// One forwarder slot as `outbox.status()` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotStatus {
    pub slot: String,
    pub active: bool,
    pub caught_up: bool,
    pub confirmed_lsn: Option<String>,
    pub lag_bytes: Option<i64>,
    pub retained_wal_bytes: Option<i64>,
    pub unforwarded_events: Option<i64>,
    pub oldest_unforwarded_seconds: Option<f64>,
    /// `pg_replication_slots.wal_status`: reserved, extended, unreserved or lost.
    pub wal_status: Option<String>,
    /// PostgreSQL 17 and later: whether the slot is a failover slot, and
    /// whether it is a standby's synchronised copy.
    pub failover: Option<bool>,
    pub synced: Option<bool>,
    /// The shard the slot carries, `INDEX/COUNT` (pg_outbox 0.8.0 on).
    pub shard: Option<String>,
}

/// Polling relays, as `outbox.poll_status()` reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct PollStatus {
    pub pending_events: i64,
    pub oldest_pending_seconds: Option<f64>,
    pub leases_held: i64,
    pub leases_expired: i64,
    pub relays: i64,
}

/// An aggregate held back behind a dead-lettered event.
#[derive(Debug, Clone, PartialEq)]
pub struct Parked {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub first_seq: i64,
    pub held_up_to: i64,
    pub reason: String,
    pub parked_seconds: f64,
}

pub struct Status {
    pub slots: Vec<SlotStatus>,
    /// Where polling is enabled (or events are still pending).
    pub polling: Option<PollStatus>,
    /// Aggregates held back behind a dead-lettered event (none before 0.6.0).
    pub parked: Vec<Parked>,
    /// Exactly-once mode: the offset stored in Kafka for this forwarder.
    pub stored_offset: Option<String>,
    /// With it, the horizon that tells a lost slot's catch-up what Kafka
    /// holds: its snapshot and how many transaction ids it lists.
    pub stored_horizon: Option<(String, u64)>,
    /// What threatens the slots' WAL (see [`slot::Retention`]).
    pub warnings: Vec<String>,
}

pub async fn collect(config: &Config) -> Result<Status> {
    let client = database::connect(&config.postgres).await?;
    let rows = client
        .query(
            "SELECT s.slot_name::text, s.active, s.caught_up, s.confirmed_lsn::text, s.lag_bytes, s.retained_wal_bytes, \
                    s.unforwarded_events, extract(epoch FROM s.oldest_unforwarded_age)::float8, \
                    r.wal_status, (to_jsonb(r) ->> 'failover')::bool, (to_jsonb(r) ->> 'synced')::bool, \
                    (to_jsonb(s) ->> 'shard') || '/' || (to_jsonb(s) ->> 'shards') \
               FROM outbox.status() s LEFT JOIN pg_replication_slots r ON r.slot_name = s.slot_name \
              ORDER BY s.slot_name",
            &[],
        )
        .await?;
    let slots = rows
        .iter()
        .map(|r| SlotStatus {
            slot: r.get(0),
            active: r.get(1),
            caught_up: r.get(2),
            confirmed_lsn: r.get(3),
            lag_bytes: r.get(4),
            retained_wal_bytes: r.get(5),
            unforwarded_events: r.get(6),
            oldest_unforwarded_seconds: r.get(7),
            wal_status: r.get(8),
            failover: r.get(9),
            synced: r.get(10),
            shard: r.get(11),
        })
        .collect::<Vec<_>>();
    let outbox = database::probe(&client).await?;
    let polling = poll_status(&client, &outbox).await?;
    let parked = if outbox.parking {
        parked(&client).await?
    } else {
        Vec::new()
    };
    let mut warnings = Vec::new();
    let names = slots.iter().map(|s| s.slot.as_str());
    let configured = (config.source == SourceKind::Slot).then_some(config.slot.as_str());
    for name in configured.into_iter().chain(names) {
        for (_, text) in slot::retention(&client, name).await?.findings(name) {
            if !warnings.contains(&text) {
                warnings.push(text);
            }
        }
    }
    let stored = if config.delivery == Delivery::ExactlyOnce {
        let store = OffsetStore::of(config);
        store.load_async(std::time::Duration::from_secs(30)).await?
    } else {
        None
    };
    let stored_offset = stored.as_ref().map(|s| s.lsn.to_string());
    let stored_horizon = stored
        .and_then(|s| s.horizon)
        .map(|h| (h.base.to_string(), h.xids.count()));
    Ok(Status {
        slots,
        polling,
        parked,
        stored_offset,
        stored_horizon,
        warnings,
    })
}

/// The polling figures, where polling is on or events are still pending
/// (none on an extension older than 0.5.0).
async fn poll_status(
    client: &tokio_postgres::Client,
    outbox: &database::Outbox,
) -> Result<Option<PollStatus>> {
    use crate::database::Polling;
    if matches!(
        outbox.polling,
        Polling::NoOutbox | Polling::Unsupported | Polling::Hidden
    ) {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT pending_events, extract(epoch FROM oldest_pending_age)::float8, \
                    leases_held, leases_expired, relays \
               FROM outbox.poll_status() \
              WHERE enabled OR pending_events > 0",
            &[],
        )
        .await?;
    Ok(row.map(|r| PollStatus {
        pending_events: r.get(0),
        oldest_pending_seconds: r.get(1),
        leases_held: r.get(2),
        leases_expired: r.get(3),
        relays: r.get(4),
    }))
}

/// The parked aggregates, oldest first (pg_outbox 0.6.0 and later).
async fn parked(client: &tokio_postgres::Client) -> Result<Vec<Parked>> {
    let rows = client
        .query(
            "SELECT aggregate_type, aggregate_id, first_seq, held_up_to, reason, \
                    extract(epoch FROM now() - parked_at)::float8 \
               FROM outbox.parked()",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Parked {
            aggregate_type: r.get(0),
            aggregate_id: r.get(1),
            first_seq: r.get(2),
            held_up_to: r.get(3),
            reason: r.get(4),
            parked_seconds: r.get(5),
        })
        .collect())
}

impl Status {
    pub fn to_json(&self) -> Value {
        json!({
            "polling": self.polling.as_ref().map(|p| json!({
                "pending_events": p.pending_events,
                "oldest_pending_seconds": p.oldest_pending_seconds,
                "leases_held": p.leases_held,
                "leases_expired": p.leases_expired,
                "relays": p.relays,
            })),
            "parked": self.parked.iter().map(|p| json!({
                "aggregate_type": p.aggregate_type,
                "aggregate_id": p.aggregate_id,
                "first_seq": p.first_seq,
                "held_up_to": p.held_up_to,
                "reason": p.reason,
                "parked_seconds": p.parked_seconds,
            })).collect::<Vec<_>>(),
            "stored_offset": self.stored_offset,
            "stored_horizon": self.stored_horizon.as_ref().map(|(snapshot, listed)| json!({
                "snapshot": snapshot,
                "listed_transactions": listed,
            })),
            "slots": self.slots.iter().map(|s| json!({
                "slot": s.slot,
                "active": s.active,
                "caught_up": s.caught_up,
                "confirmed_lsn": s.confirmed_lsn,
                "lag_bytes": s.lag_bytes,
                "retained_wal_bytes": s.retained_wal_bytes,
                "unforwarded_events": s.unforwarded_events,
                "oldest_unforwarded_seconds": s.oldest_unforwarded_seconds,
                "wal_status": s.wal_status,
                "failover": s.failover,
                "synced": s.synced,
                "shard": s.shard,
            })).collect::<Vec<_>>(),
            "warnings": self.warnings,
        })
    }

    /// A table for people.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "{:<24} {:<7} {:<9} {:<14} {:>12} {:>14} {:>12} {:>12} {:<10} {:<8} {:<6}\n",
            "slot",
            "active",
            "caught_up",
            "confirmed",
            "lag_bytes",
            "retained_wal",
            "unforwarded",
            "oldest_age_s",
            "wal_status",
            "failover",
            "shard"
        );
        let show = |v: Option<i64>| v.map_or("-".to_owned(), |v| v.to_string());
        for s in &self.slots {
            let failover = match (s.failover, s.synced) {
                (None, _) => "-",
                (Some(false), _) => "no",
                (Some(true), Some(true)) => "synced",
                (Some(true), _) => "yes",
            };
            out.push_str(&format!(
                "{:<24} {:<7} {:<9} {:<14} {:>12} {:>14} {:>12} {:>12} {:<10} {:<8} {:<6}\n",
                s.slot,
                s.active,
                s.caught_up,
                s.confirmed_lsn.as_deref().unwrap_or("-"),
                show(s.lag_bytes),
                show(s.retained_wal_bytes),
                show(s.unforwarded_events),
                s.oldest_unforwarded_seconds
                    .map_or("-".to_owned(), |v| format!("{v:.1}")),
                s.wal_status.as_deref().unwrap_or("-"),
                failover,
                s.shard.as_deref().unwrap_or("-"),
            ));
        }
        if let Some(p) = &self.polling {
            out.push_str(&format!(
                "polling: {} pending events, oldest {} s; {} leases held by {} relays, {} expired\n",
                p.pending_events,
                p.oldest_pending_seconds
                    .map_or("-".to_owned(), |v| format!("{v:.1}")),
                p.leases_held,
                p.relays,
                p.leases_expired,
            ));
        }
        if let Some(oldest) = self.parked.first() {
            out.push_str(&format!(
                "parked: {} aggregates held back behind a dead letter, the oldest for {:.0} s ({}/{} from aggregate_seq {}: {}); outbox-forwarder redrive publishes them once the cause is fixed\n",
                self.parked.len(),
                oldest.parked_seconds,
                oldest.aggregate_type,
                oldest.aggregate_id,
                oldest.first_seq,
                oldest.reason,
            ));
        }
        if let Some(offset) = &self.stored_offset {
            out.push_str(&format!("stored offset (exactly-once): {offset}\n"));
            match &self.stored_horizon {
                Some((snapshot, listed)) => out.push_str(&format!(
                    "stored horizon: snapshot {snapshot} and {listed} listed transactions (what a lost slot's catch-up leaves out)\n"
                )),
                None => out.push_str(
                    "stored horizon: none yet (a lost slot's catch-up would repeat events since the last safe snapshot)\n",
                ),
            }
        }
        for warning in &self.warnings {
            out.push_str(&format!("warning: {warning}\n"));
        }
        out
    }
}
