//! An outbox event as it arrives from the replication stream: one row of
//! `outbox.events`, matched to its columns by name through the Relation
//! message that precedes it.

use bytes::Bytes;

use crate::pgoutput::Relation;

/// Schema and table the forwarder reads.
pub const EVENTS_SCHEMA: &str = "outbox";
pub const EVENTS_TABLE: &str = "events";

/// One committed event, with every value still in PostgreSQL's text form.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxEvent {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_seq: i64,
    pub event_type: String,
    pub schema_version: i32,
    /// The payload as jsonb's text output.
    pub payload: Bytes,
    /// User headers, a JSON object of strings, if any.
    pub headers: Option<Bytes>,
    /// Per-event topic override, if any.
    pub topic: Option<String>,
    pub occurred_at: String,
}

impl OutboxEvent {
    /// Approximate in-memory size, used to bound the bytes in flight.
    pub fn size(&self) -> usize {
        self.payload.len()
            + self.headers.as_ref().map_or(0, Bytes::len)
            + self.aggregate_id.len()
            + self.aggregate_type.len()
            + self.event_type.len()
            + 96
    }
}

/// The columns, in text form, that [`OutboxEvent::from_row`] reads, for
/// queries on `outbox.events` (the catch-up, replay).
pub const EVENT_COLUMNS: &str = "event_id::text, aggregate_type, aggregate_id, aggregate_seq, \
     event_type, schema_version, payload::text, headers::text, topic, occurred_at::text";
/// How many columns [`EVENT_COLUMNS`] has: a query may select more after them.
pub const EVENT_COLUMN_COUNT: usize = 10;

impl OutboxEvent {
    /// An event from a row selected with [`EVENT_COLUMNS`].
    pub fn from_row(row: &tokio_postgres::Row) -> Self {
        OutboxEvent {
            event_id: row.get(0),
            aggregate_type: row.get(1),
            aggregate_id: row.get(2),
            aggregate_seq: row.get(3),
            event_type: row.get(4),
            schema_version: row.get(5),
            payload: row.get::<_, String>(6).into(),
            headers: row.get::<_, Option<String>>(7).map(Into::into),
            topic: row.get(8),
            occurred_at: row.get(9),
        }
    }
}

/// The table's column layout changed in a way the forwarder cannot read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("outbox.events has no column {0:?}; is the pg_outbox extension version supported by this forwarder?")]
    MissingColumn(&'static str),
    #[error("outbox.events row has {got} values, the relation announced {expected}")]
    WrongArity { expected: usize, got: usize },
    #[error("outbox.events column {column} is NULL or not valid in row {event_id}")]
    BadValue {
        column: &'static str,
        event_id: String,
    },
}

/// Positions of the columns the forwarder reads, taken from a Relation message.
#[derive(Debug, Clone)]
pub struct EventLayout {
    relation_id: u32,
    arity: usize,
    event_id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    aggregate_seq: usize,
    event_type: usize,
    schema_version: usize,
    payload: usize,
    headers: Option<usize>,
    topic: Option<usize>,
    occurred_at: usize,
}

impl EventLayout {
    /// Whether `relation` is the outbox events table.
    pub fn is_events_table(relation: &Relation) -> bool {
        relation.namespace == EVENTS_SCHEMA && relation.name == EVENTS_TABLE
    }

    pub fn from_relation(relation: &Relation) -> Result<Self, LayoutError> {
        let find = |name: &'static str| relation.columns.iter().position(|c| c.name == name);
        let need = |name: &'static str| find(name).ok_or(LayoutError::MissingColumn(name));
        Ok(EventLayout {
            relation_id: relation.id,
            arity: relation.columns.len(),
            event_id: need("event_id")?,
            aggregate_type: need("aggregate_type")?,
            aggregate_id: need("aggregate_id")?,
            aggregate_seq: need("aggregate_seq")?,
            event_type: need("event_type")?,
            schema_version: need("schema_version")?,
            payload: need("payload")?,
            headers: find("headers"),
            topic: find("topic"),
            occurred_at: need("occurred_at")?,
        })
    }

    pub fn relation_id(&self) -> u32 {
        self.relation_id
    }

    /// Builds the event from the values of one Insert message.
    pub fn event(&self, mut values: Vec<Option<Bytes>>) -> Result<OutboxEvent, LayoutError> {
        if values.len() != self.arity {
            return Err(LayoutError::WrongArity {
                expected: self.arity,
                got: values.len(),
            });
        }
        let event_id = text(values[self.event_id].take()).unwrap_or_default();
        let bad = |column: &'static str| LayoutError::BadValue {
            column,
            event_id: event_id.clone(),
        };
        if event_id.is_empty() {
            return Err(bad("event_id"));
        }
        let mut required =
            |i: usize, column: &'static str| text(values[i].take()).ok_or_else(|| bad(column));
        let aggregate_type = required(self.aggregate_type, "aggregate_type")?;
        let aggregate_id = required(self.aggregate_id, "aggregate_id")?;
        let aggregate_seq = required(self.aggregate_seq, "aggregate_seq")?
            .parse()
            .map_err(|_| bad("aggregate_seq"))?;
        let event_type = required(self.event_type, "event_type")?;
        let schema_version = required(self.schema_version, "schema_version")?
            .parse()
            .map_err(|_| bad("schema_version"))?;
        let occurred_at = required(self.occurred_at, "occurred_at")?;
        let payload = values[self.payload].take().ok_or_else(|| bad("payload"))?;
        let headers = self.headers.and_then(|i| values[i].take());
        let topic = self.topic.and_then(|i| text(values[i].take()));
        Ok(OutboxEvent {
            event_id,
            aggregate_type,
            aggregate_id,
            aggregate_seq,
            event_type,
            schema_version,
            payload,
            headers,
            topic,
            occurred_at,
        })
    }
}

fn text(value: Option<Bytes>) -> Option<String> {
    value.and_then(|b| String::from_utf8(b.to_vec()).ok())
}
