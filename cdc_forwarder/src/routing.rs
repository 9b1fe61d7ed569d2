//! Where an event goes in Kafka: topic, key, headers and value.

use crate::event::OutboxEvent;

/// Default topic template: one topic per aggregate type.
pub const DEFAULT_TOPIC_TEMPLATE: &str = "outbox.{aggregate_type}";

/// Header names the forwarder sets on every record.
pub mod header {
    pub const EVENT_ID: &str = "event_id";
    pub const EVENT_TYPE: &str = "event_type";
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    pub const AGGREGATE_SEQ: &str = "aggregate_seq";
    pub const SCHEMA_VERSION: &str = "schema_version";
    pub const OCCURRED_AT: &str = "occurred_at";
    /// The names an event's own headers may not take (`emit_event` and
    /// `emit_events` refuse them with PO006; tests/tests/extension.rs
    /// checks that every name here is refused).
    pub const ALL: [&str; 6] = [
        EVENT_ID,
        EVENT_TYPE,
        AGGREGATE_TYPE,
        AGGREGATE_SEQ,
        SCHEMA_VERSION,
        OCCURRED_AT,
    ];
}

/// Why an event cannot be routed. Such an event is poison: it is never skipped silently.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    #[error("topic {topic:?} is not a valid Kafka topic name (1 to 249 characters of a-z A-Z 0-9 . _ -)")]
    InvalidTopic { topic: String },
    #[error("headers are not a JSON object of strings")]
    InvalidHeaders,
}

/// A record ready to be produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub topic: String,
    /// Header name and value pairs: the forwarder's own, then the user's.
    pub headers: Vec<(String, String)>,
    /// The record value when it is not the payload itself (the envelope).
    pub value: Option<Vec<u8>>,
}

impl Route {
    /// The value of header `name`, if set.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What a record's value holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ValueFormat {
    /// The payload JSON, identity in headers (the default).
    #[default]
    Raw,
    /// A JSON object with the identity fields and `payload`.
    Envelope,
    /// CloudEvents 1.0 binary mode: `ce_*` headers, the payload as data.
    #[value(name = "cloudevents")]
    CloudEvents,
}

/// Turns events into Kafka destinations.
#[derive(Debug, Clone)]
pub struct Router {
    topic_template: String,
    format: ValueFormat,
    /// CloudEvents `source`.
    source: String,
}

impl Router {
    pub fn new(topic_template: impl Into<String>) -> Self {
        Router {
            topic_template: topic_template.into(),
            format: ValueFormat::Raw,
            source: "pg_outbox".into(),
        }
    }

    pub fn with_format(mut self, format: ValueFormat, source: impl Into<String>) -> Self {
        self.format = format;
        self.source = source.into();
        self
    }

    pub fn route(&self, event: &OutboxEvent) -> Result<Route, RouteError> {
        let topic = match &event.topic {
            Some(topic) => topic.clone(),
            None => self
                .topic_template
                .replace("{aggregate_type}", &event.aggregate_type),
        };
        if !is_valid_topic(&topic) {
            return Err(RouteError::InvalidTopic { topic });
        }
        let mut headers = vec![
            (header::EVENT_ID.to_owned(), event.event_id.clone()),
            (header::EVENT_TYPE.to_owned(), event.event_type.clone()),
            (
                header::AGGREGATE_TYPE.to_owned(),
                event.aggregate_type.clone(),
            ),
            (
                header::AGGREGATE_SEQ.to_owned(),
                event.aggregate_seq.to_string(),
            ),
            (
                header::SCHEMA_VERSION.to_owned(),
                event.schema_version.to_string(),
            ),
            (header::OCCURRED_AT.to_owned(), event.occurred_at.clone()),
        ];
        let mut user = serde_json::Map::new();
        if let Some(raw) = &event.headers {
            user = serde_json::from_slice(raw).map_err(|_| RouteError::InvalidHeaders)?;
            for (name, value) in &user {
                let serde_json::Value::String(value) = value else {
                    return Err(RouteError::InvalidHeaders);
                };
                headers.push((name.clone(), value.clone()));
            }
        }
        let value = match self.format {
            ValueFormat::Raw => None,
            ValueFormat::Envelope => Some(envelope(event, &user)),
            ValueFormat::CloudEvents => {
                headers.extend([
                    ("ce_specversion".to_owned(), "1.0".to_owned()),
                    ("ce_id".to_owned(), event.event_id.clone()),
                    ("ce_source".to_owned(), self.source.clone()),
                    ("ce_type".to_owned(), event.event_type.clone()),
                    ("ce_subject".to_owned(), event.aggregate_id.clone()),
                    ("ce_time".to_owned(), rfc3339(&event.occurred_at)),
                    ("ce_sequence".to_owned(), event.aggregate_seq.to_string()),
                    ("ce_aggregatetype".to_owned(), event.aggregate_type.clone()),
                    (
                        "ce_dataschemaversion".to_owned(),
                        event.schema_version.to_string(),
                    ),
                    ("content-type".to_owned(), "application/json".to_owned()),
                ]);
                None
            }
        };
        Ok(Route {
            topic,
            headers,
            value,
        })
    }
}

/// The envelope: identity fields and the payload, as one JSON object.
fn envelope(event: &OutboxEvent, headers: &serde_json::Map<String, serde_json::Value>) -> Vec<u8> {
    let text = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    let mut out = format!(
        r#"{{"event_id":{},"event_type":{},"aggregate_type":{},"aggregate_id":{},"aggregate_seq":{},"schema_version":{},"occurred_at":{},"headers":{},"payload":"#,
        text(&event.event_id),
        text(&event.event_type),
        text(&event.aggregate_type),
        text(&event.aggregate_id),
        event.aggregate_seq,
        event.schema_version,
        text(&rfc3339(&event.occurred_at)),
        serde_json::Value::Object(headers.clone()),
    )
    .into_bytes();
    // The payload is jsonb's text output: valid JSON as it stands.
    out.extend_from_slice(&event.payload);
    out.push(b'}');
    out
}

/// PostgreSQL's ISO timestamp in UTC (`2026-11-30 10:00:00.123+00`) as
/// RFC 3339 (`2026-11-30T10:00:00.123Z`).
pub fn rfc3339(timestamp: &str) -> String {
    let t = timestamp.replacen(' ', "T", 1);
    match t.strip_suffix("+00") {
        Some(utc) => format!("{utc}Z"),
        None => t,
    }
}

/// Kafka's rule for topic names.
pub fn is_valid_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn event() -> OutboxEvent {
        OutboxEvent {
            event_id: "0190a0b0-0000-7000-8000-000000000001".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_seq: 3,
            event_type: "OrderPlaced".into(),
            schema_version: 1,
            payload: Bytes::from_static(b"{}"),
            headers: Some(Bytes::from_static(br#"{"trace": "abc"}"#)),
            topic: None,
            occurred_at: "2026-11-30 10:00:00+00".into(),
        }
    }

    #[test]
    fn template_names_the_topic_and_headers_carry_the_identity() {
        let route = Router::new(DEFAULT_TOPIC_TEMPLATE)
            .route(&event())
            .expect("routes");
        assert_eq!(route.topic, "outbox.order");
        assert_eq!(route.header(header::AGGREGATE_SEQ), Some("3"));
        assert_eq!(route.header(header::EVENT_TYPE), Some("OrderPlaced"));
        assert_eq!(route.header("trace"), Some("abc"));
    }

    #[test]
    fn override_wins_and_bad_topics_are_refused() {
        let mut e = event();
        e.topic = Some("billing".into());
        assert_eq!(
            Router::new(DEFAULT_TOPIC_TEMPLATE)
                .route(&e)
                .expect("routes")
                .topic,
            "billing"
        );
        e.topic = Some("no spaces".into());
        assert!(matches!(
            Router::new(DEFAULT_TOPIC_TEMPLATE).route(&e),
            Err(RouteError::InvalidTopic { .. })
        ));
        assert!(!is_valid_topic(&"x".repeat(250)));
    }

    #[test]
    fn the_envelope_is_json_holding_identity_and_payload() {
        let mut e = event();
        e.payload = Bytes::from_static(br#"{"total": 42.5}"#);
        let route = Router::new(DEFAULT_TOPIC_TEMPLATE)
            .with_format(ValueFormat::Envelope, "pg_outbox/app")
            .route(&e)
            .expect("routes");
        let value: serde_json::Value =
            serde_json::from_slice(route.value.as_deref().expect("envelope")).expect("JSON");
        assert_eq!(value["aggregate_seq"], 3);
        assert_eq!(value["aggregate_id"], "o-1");
        assert_eq!(value["payload"]["total"], 42.5);
        assert_eq!(value["headers"]["trace"], "abc");
        assert_eq!(value["occurred_at"], "2026-11-30T10:00:00Z");
    }

    #[test]
    fn cloudevents_binary_mode_sets_the_required_attributes() {
        let route = Router::new(DEFAULT_TOPIC_TEMPLATE)
            .with_format(ValueFormat::CloudEvents, "pg_outbox/app")
            .route(&event())
            .expect("routes");
        assert_eq!(route.header("ce_specversion"), Some("1.0"));
        assert_eq!(
            route.header("ce_id"),
            Some("0190a0b0-0000-7000-8000-000000000001")
        );
        assert_eq!(route.header("ce_source"), Some("pg_outbox/app"));
        assert_eq!(route.header("ce_type"), Some("OrderPlaced"));
        assert_eq!(route.header("ce_sequence"), Some("3"));
        assert_eq!(route.header("ce_time"), Some("2026-11-30T10:00:00Z"));
        assert!(route.value.is_none(), "the payload is the data");
    }

    #[test]
    fn non_string_headers_are_refused() {
        let mut e = event();
        e.headers = Some(Bytes::from_static(br#"{"n": 1}"#));
        assert_eq!(
            Router::new(DEFAULT_TOPIC_TEMPLATE).route(&e),
            Err(RouteError::InvalidHeaders)
        );
    }
}
