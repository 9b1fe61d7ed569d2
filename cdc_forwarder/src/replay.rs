//! `outbox-forwarder replay`: publishes an aggregate's stored events again,
//! from a sequence number on, to their usual topics, each marked with the
//! header `replayed = true`. For consumers that lost state; it does not touch
//! the slot or the stored offsets.

use crate::config::Config;
use crate::database;
use crate::error::{Error, Result};
use crate::event::{OutboxEvent, EVENT_COLUMNS};
use crate::producer::Producer;

/// Header that marks a replayed record.
pub const REPLAYED_HEADER: &str = "replayed";

/// What to replay.
pub struct Selection {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub from_seq: i64,
}

/// Replays the selection; returns how many events went out. `progress` is
/// told the total first and then each delivered event.
pub async fn run(
    config: &Config,
    selection: &Selection,
    progress: &indicatif::ProgressBar,
) -> Result<u64> {
    if selection.from_seq < 1 {
        return Err(Error::Config("--from-seq must be 1 or more".into()));
    }
    let client = database::connect(&config.postgres).await?;
    let rows = client
        .query(
            &format!(
                "SELECT {EVENT_COLUMNS} FROM outbox.events \
                  WHERE aggregate_type = $1 AND aggregate_id = $2 AND aggregate_seq >= $3 \
                  ORDER BY aggregate_seq"
            ),
            &[
                &selection.aggregate_type,
                &selection.aggregate_id,
                &selection.from_seq,
            ],
        )
        .await?;
    progress.set_length(rows.len() as u64);
    // An ordinary idempotent producer: a replay is not part of the stream's
    // exactly-once transactions.
    let mut producer = Producer::idempotent(config)?;
    let router = config.router();
    let mut sent = 0;
    for row in rows {
        let event = OutboxEvent::from_row(&row);
        let mut route = router
            .route(&event)
            .map_err(|e| Error::from((event.event_id.clone(), e)))?;
        route
            .headers
            .push((REPLAYED_HEADER.to_owned(), "true".to_owned()));
        producer.send(&event, &route, sent).await?;
        sent += 1;
    }
    producer.acknowledged(0..sent, || progress.inc(1)).await?;
    Ok(sent as u64)
}
