//! `outbox-forwarder status`: what the slots and the stored offset say.

use serde_json::{json, Value};

use crate::config::{Config, Delivery};
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
}

pub struct Status {
    pub slots: Vec<SlotStatus>,
    /// Exactly-once mode: the offset stored in Kafka for this forwarder.
    pub stored_offset: Option<String>,
}

pub async fn collect(config: &Config) -> Result<Status> {
    let client = slot::connect(&config.postgres).await?;
    let rows = client
        .query(
            "SELECT slot_name::text, active, caught_up, confirmed_lsn::text, lag_bytes, retained_wal_bytes, \
                    unforwarded_events, extract(epoch FROM oldest_unforwarded_age)::float8 \
               FROM outbox.status() ORDER BY slot_name",
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
        })
        .collect();
    let stored_offset = if config.delivery == Delivery::ExactlyOnce {
        let store = OffsetStore {
            client: config.kafka_client(),
            topic: config.offsets_topic.clone(),
            key: config.transactional_id(),
        };
        store
            .load_async(std::time::Duration::from_secs(30))
            .await?
            .map(|lsn| lsn.to_string())
    } else {
        None
    };
    Ok(Status {
        slots,
        stored_offset,
    })
}

impl Status {
    pub fn to_json(&self) -> Value {
        json!({
            "stored_offset": self.stored_offset,
            "slots": self.slots.iter().map(|s| json!({
                "slot": s.slot,
                "active": s.active,
                "caught_up": s.caught_up,
                "confirmed_lsn": s.confirmed_lsn,
                "lag_bytes": s.lag_bytes,
                "retained_wal_bytes": s.retained_wal_bytes,
                "unforwarded_events": s.unforwarded_events,
                "oldest_unforwarded_seconds": s.oldest_unforwarded_seconds,
            })).collect::<Vec<_>>(),
        })
    }

    /// A table for people.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "{:<24} {:<7} {:<9} {:<14} {:>12} {:>14} {:>12} {:>12}\n",
            "slot",
            "active",
            "caught_up",
            "confirmed",
            "lag_bytes",
            "retained_wal",
            "unforwarded",
            "oldest_age_s"
        );
        let show = |v: Option<i64>| v.map_or("-".to_owned(), |v| v.to_string());
        for s in &self.slots {
            out.push_str(&format!(
                "{:<24} {:<7} {:<9} {:<14} {:>12} {:>14} {:>12} {:>12}\n",
                s.slot,
                s.active,
                s.caught_up,
                s.confirmed_lsn.as_deref().unwrap_or("-"),
                show(s.lag_bytes),
                show(s.retained_wal_bytes),
                show(s.unforwarded_events),
                s.oldest_unforwarded_seconds
                    .map_or("-".to_owned(), |v| format!("{v:.1}")),
            ));
        }
        if let Some(offset) = &self.stored_offset {
            out.push_str(&format!("stored offset (exactly-once): {offset}\n"));
        }
        out
    }
}
