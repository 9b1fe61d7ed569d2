//! `outbox-forwarder redrive`: once the cause of a dead letter is fixed,
//! publishes what each parked aggregate holds back (its first dead-lettered
//! event and every later one it held) to the topics they route to now, in
//! sequence order, each marked with the header `redriven = true`, and
//! unparks the aggregate, which then flows again (see [`crate::parking`]).
//!
//! One aggregate at a time: its parked row is locked, so the running
//! forwarder parks nothing more behind it meanwhile (it waits); its events go
//! out in one Kafka transaction of redrive's own transactional id; the
//! aggregate is unparked in the same PostgreSQL transaction, committed right
//! after Kafka's. Running it again publishes nothing: what it published is
//! no longer parked. An event still refused leaves its aggregate parked and
//! its transaction aborted, so nothing of that aggregate is published.

use tokio_postgres::Client;

use crate::config::Config;
use crate::database;
use crate::error::{Error, Result};
use crate::event::{OutboxEvent, EVENT_COLUMNS};
use crate::producer::{Kafka, Producer, Tag};
use crate::routing::Router;

/// Header that marks a redriven record.
pub const REDRIVEN_HEADER: &str = "redriven";

/// Which parked aggregates to redrive: all, those of a type, or one.
#[derive(Default)]
pub struct Selection {
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
}

/// What happened to one parked aggregate.
#[derive(Debug)]
pub enum Outcome {
    /// Its held events, `first_seq..=last_seq`, were published; it flows again.
    Redriven {
        aggregate: String,
        first_seq: i64,
        last_seq: i64,
        events: usize,
    },
    /// An event is still refused: it stays parked, nothing was published.
    StillRefused { aggregate: String, reason: String },
}

/// Redrives the selected parked aggregates, telling `progress` of each as it
/// is done; returns every outcome.
pub async fn run(
    config: &Config,
    selection: &Selection,
    mut progress: impl FnMut(&Outcome),
) -> Result<Vec<Outcome>> {
    if selection.aggregate_id.is_some() && selection.aggregate_type.is_none() {
        return Err(Error::Config(
            "--aggregate-id needs --aggregate-type".into(),
        ));
    }
    let mut sql = database::connect(&config.postgres).await?;
    let parked: Vec<(String, String)> = sql
        .query(
            "SELECT aggregate_type, aggregate_id FROM outbox.parked($1, $2)",
            &[&selection.aggregate_type, &selection.aggregate_id],
        )
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut outcomes = Vec::new();
    if parked.is_empty() {
        return Ok(outcomes);
    }
    // A transactional id of its own: the running forwarder's is untouched.
    let redrive_id = format!("{}-redrive", config.transactional_id());
    let mut producer = Producer::transactional(config, &redrive_id)?;
    producer.init_transactions().await?;
    let router = config.router();
    // Tags run on across aggregates: a late report of an aborted one is not
    // taken for the next one's.
    let mut next_tag = 0;
    for (aggregate_type, aggregate_id) in parked {
        if let Some(outcome) = redrive_one(
            &mut sql,
            (&mut producer, &mut next_tag),
            &router,
            &aggregate_type,
            &aggregate_id,
        )
        .await?
        {
            progress(&outcome);
            outcomes.push(outcome);
        }
    }
    Ok(outcomes)
}

async fn redrive_one(
    sql: &mut Client,
    (producer, next_tag): (&mut Producer, &mut Tag),
    router: &Router,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<Option<Outcome>> {
    let aggregate = format!("{aggregate_type}/{aggregate_id}");
    let tx = sql.transaction().await?;
    // Locked until this transaction ends; gone if redriven meanwhile.
    let Some(row) = tx
        .query_opt(
            "SELECT first_seq, held_up_to FROM outbox.parked($1, $2, true)",
            &[&aggregate_type, &aggregate_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let (first_seq, held_up_to): (i64, i64) = (row.get(0), row.get(1));
    let events: Vec<OutboxEvent> = tx
        .query(
            &format!(
                "SELECT {EVENT_COLUMNS} FROM outbox.events \
                  WHERE aggregate_type = $1 AND aggregate_id = $2 AND aggregate_seq BETWEEN $3 AND $4 \
                  ORDER BY aggregate_seq"
            ),
            &[&aggregate_type, &aggregate_id, &first_seq, &held_up_to],
        )
        .await?
        .iter()
        .map(OutboxEvent::from_row)
        .collect();
    producer.begin_transaction().await?;
    match publish(producer, next_tag, router, &events).await {
        Ok(()) => producer.commit_transaction().await?,
        Err(Error::Poison { event_id, reason }) => {
            producer.abort_transaction().await?;
            tx.rollback().await?;
            return Ok(Some(Outcome::StillRefused {
                aggregate,
                reason: format!("event {event_id}: {reason}"),
            }));
        }
        Err(e) => {
            let _ = producer.abort_transaction().await;
            return Err(e);
        }
    }
    tx.query_one(
        "SELECT outbox.unpark($1, $2, $3)",
        &[&aggregate_type, &aggregate_id, &held_up_to],
    )
    .await?;
    tx.commit().await?;
    Ok(Some(Outcome::Redriven {
        aggregate,
        first_seq,
        last_seq: held_up_to,
        events: events.len(),
    }))
}

/// Sends the events, tagged from `next_tag` on, and waits for every
/// acknowledgement.
async fn publish(
    producer: &mut Producer,
    next_tag: &mut Tag,
    router: &Router,
    events: &[OutboxEvent],
) -> Result<()> {
    let first = *next_tag;
    for event in events {
        let mut route = router.route(event).map_err(|e| Error::Poison {
            event_id: event.event_id.clone(),
            reason: e.to_string(),
        })?;
        route
            .headers
            .push((REDRIVEN_HEADER.to_owned(), "true".to_owned()));
        Kafka::send(producer, event, &route, *next_tag).await?;
        *next_tag += 1;
    }
    producer.acknowledged(first..*next_tag, || ()).await
}
