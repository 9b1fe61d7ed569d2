//! Dead letters that keep each aggregate's order. When an event is
//! dead-lettered, its aggregate is parked (`outbox.parked_aggregates`): the
//! aggregate's later events are dead-lettered too, marked as parked behind
//! the first, so that no consumer sees its event n+1 before n, while other
//! aggregates flow on. `outbox-forwarder redrive` publishes the held events
//! again once the cause is fixed (see [`crate::redrive`]).
//!
//! PostgreSQL holds the truth, so that a restarted forwarder, a polling
//! relay and redrive agree; the forwarder keeps the set of aggregates it
//! knows to be parked, read at the session's start and grown as it parks,
//! and asks the database only for events of those. Redrive only removes
//! aggregates, so the set is never missing one. A park is written before
//! the dead letter's Kafka transaction commits: after a crash the replayed
//! poison event finds its own park and is dead-lettered again as the first,
//! its successors behind it.

use std::collections::{HashMap, HashSet};

use tokio_postgres::Client;

use crate::config::PgTarget;
use crate::database;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;

/// The event an aggregate is parked behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    pub first_seq: i64,
    pub first_event_id: String,
}

/// The session's view of the parked aggregates.
pub struct Parking {
    sql: Client,
    /// Every parked aggregate (ids by type), and perhaps some that redrive
    /// unparked since. Looked up for every event, without allocating.
    known: HashMap<String, HashSet<String>>,
}

impl Parking {
    /// Connects and reads which aggregates are parked.
    pub async fn open(postgres: &PgTarget) -> Result<Parking> {
        let sql = database::connect(postgres).await?;
        if !database::probe(&sql).await?.parking {
            return Err(Error::Setup(
                "dead letters that keep each aggregate's order need pg_outbox 0.6.0 or later: \
                 run ALTER EXTENSION pg_outbox UPDATE (or the new SQL edition), or pass --dead-letter-unordered"
                    .into(),
            ));
        }
        let mut known: HashMap<String, HashSet<String>> = HashMap::new();
        let parked = sql
            .query(
                "SELECT aggregate_type, aggregate_id FROM outbox.parked()",
                &[],
            )
            .await?;
        for row in parked {
            known.entry(row.get(0)).or_default().insert(row.get(1));
        }
        Ok(Parking { sql, known })
    }

    /// The event `event` is held back behind, when its aggregate is parked
    /// at or before it.
    pub async fn held_behind(&mut self, event: &OutboxEvent) -> Result<Option<Behind>> {
        let known = self
            .known
            .get(&event.aggregate_type)
            .is_some_and(|ids| ids.contains(&event.aggregate_id));
        if !known {
            return Ok(None);
        }
        let behind = self.park_event(event, None).await?;
        if behind.is_none() && !self.is_parked(event).await? {
            // Unparked by redrive since the session read the set.
            if let Some(ids) = self.known.get_mut(&event.aggregate_type) {
                ids.remove(&event.aggregate_id);
            }
        }
        Ok(behind)
    }

    /// Parks the aggregate of a poison event, unless it is parked already;
    /// returns the event it is now parked behind (itself, or an earlier one).
    pub async fn park(&mut self, event: &OutboxEvent, reason: &str) -> Result<Option<Behind>> {
        let behind = self.park_event(event, Some(reason)).await?;
        if behind.is_some() {
            self.known
                .entry(event.aggregate_type.clone())
                .or_default()
                .insert(event.aggregate_id.clone());
            tracing::warn!(aggregate_type = %event.aggregate_type, aggregate_id = %event.aggregate_id, aggregate_seq = event.aggregate_seq, "aggregate parked: its later events are held back until outbox-forwarder redrive");
        }
        Ok(behind)
    }

    async fn park_event(
        &self,
        event: &OutboxEvent,
        reason: Option<&str>,
    ) -> Result<Option<Behind>> {
        let row = self
            .sql
            .query_opt(
                "SELECT first_seq, first_event_id::text FROM outbox.park_event($1, $2, $3, $4::text::uuid, $5)",
                &[
                    &event.aggregate_type,
                    &event.aggregate_id,
                    &event.aggregate_seq,
                    &event.event_id,
                    &reason,
                ],
            )
            .await?;
        Ok(row.map(|row| Behind {
            first_seq: row.get(0),
            first_event_id: row.get(1),
        }))
    }

    async fn is_parked(&self, event: &OutboxEvent) -> Result<bool> {
        Ok(self
            .sql
            .query_opt(
                "SELECT 1 FROM outbox.parked($1, $2)",
                &[&event.aggregate_type, &event.aggregate_id],
            )
            .await?
            .is_some())
    }
}

/// How many aggregates are parked and how long the oldest has been, for
/// `/metrics` and `status`.
pub async fn figures(sql: &Client) -> Result<(i64, f64)> {
    let row = sql
        .query_one(
            "SELECT count(*), coalesce(extract(epoch FROM now() - min(parked_at)), 0)::float8 FROM outbox.parked()",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}
