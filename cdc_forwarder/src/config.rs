//! The forwarder's configuration: one place, validated before anything starts.

use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::routing::{is_valid_topic, ValueFormat, DEFAULT_TOPIC_TEMPLATE};

/// Connection settings for PostgreSQL, parsed from a libpq-style URL or
/// key/value string. The password is kept here only; it never reaches logs.
#[derive(Clone)]
pub struct PgTarget {
    config: tokio_postgres::Config,
}

impl PgTarget {
    pub fn parse(url: &str) -> Result<Self> {
        let config = tokio_postgres::Config::from_str(url).map_err(|e| {
            Error::Config(format!("postgres url is not valid ({e}); expected postgres://user:password@host:port/dbname"))
        })?;
        if config.get_dbname().is_none() {
            return Err(Error::Config(
                "postgres url names no database; add /dbname".into(),
            ));
        }
        if config.get_user().is_none() {
            return Err(Error::Config("postgres url names no user".into()));
        }
        Ok(PgTarget { config })
    }

    pub fn sql_config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    pub fn host(&self) -> String {
        match self.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        }
    }

    pub fn port(&self) -> u16 {
        self.config.get_ports().first().copied().unwrap_or(5432)
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or_default()
    }

    pub fn password(&self) -> String {
        self.config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default()
    }

    pub fn dbname(&self) -> &str {
        self.config.get_dbname().unwrap_or_default()
    }

    /// `user@host:port/dbname`, without the password: safe to log.
    pub fn redacted(&self) -> String {
        format!(
            "{}@{}:{}/{}",
            self.user(),
            self.host(),
            self.port(),
            self.dbname()
        )
    }
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// The delivery guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Idempotent producer; a crash can repeat events, never lose them.
    AtLeastOnce,
    /// Transactional producer with offsets stored in Kafka: a
    /// `read_committed` consumer sees every event once.
    ExactlyOnce,
}

/// Everything `outbox-forwarder run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub postgres: PgTarget,
    pub kafka_bootstrap: String,
    pub slot: String,
    pub publication: String,
    /// Create the publication and the slot when they are missing.
    pub create_missing: bool,
    pub topic_template: String,
    /// At most this many events produced but not yet acknowledged by Kafka.
    pub max_in_flight_events: usize,
    /// At most this many payload bytes produced but not yet acknowledged.
    pub max_in_flight_bytes: usize,
    /// Longest wait between reconnection attempts.
    pub max_backoff: Duration,
    pub delivery: Delivery,
    /// Compacted topic of the exactly-once offsets.
    pub offsets_topic: String,
    /// Overrides the transactional id derived from database and slot.
    pub transactional_id_override: Option<String>,
    /// A Kafka transaction is committed once it holds this many events...
    pub batch_max_events: usize,
    /// ...or has been open this long, at the next PostgreSQL commit.
    pub batch_max_time: Duration,
    /// Kafka's `transaction.timeout.ms`.
    pub transaction_timeout: Duration,
    /// Where poison events go; without it a poison event halts the forwarder.
    pub dead_letter_topic: Option<String>,
    /// What a record's value holds.
    pub value_format: ValueFormat,
    /// Raw librdkafka properties (TLS, SASL, tuning), applied to every Kafka client.
    pub kafka_properties: KafkaProperties,
}

/// Raw librdkafka properties. Their values stay out of Debug output: they
/// may hold SASL passwords and key material.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KafkaProperties(pub std::collections::BTreeMap<String, String>);

impl std::fmt::Debug for KafkaProperties {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

impl Config {
    pub fn new(postgres_url: &str, kafka_bootstrap: &str) -> Result<Self> {
        let config = Config {
            postgres: PgTarget::parse(postgres_url)?,
            kafka_bootstrap: kafka_bootstrap.to_owned(),
            slot: "pg_outbox".into(),
            publication: "pg_outbox".into(),
            create_missing: true,
            topic_template: DEFAULT_TOPIC_TEMPLATE.into(),
            max_in_flight_events: 10_000,
            max_in_flight_bytes: 64 << 20,
            max_backoff: Duration::from_secs(30),
            delivery: Delivery::AtLeastOnce,
            offsets_topic: "pg_outbox.offsets".into(),
            transactional_id_override: None,
            batch_max_events: 5_000,
            batch_max_time: Duration::from_millis(100),
            transaction_timeout: Duration::from_secs(300),
            dead_letter_topic: None,
            value_format: ValueFormat::Raw,
            kafka_properties: KafkaProperties::default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// The transactional id: one per database and slot, so a second
    /// forwarder on the same slot fences the first.
    pub fn transactional_id(&self) -> String {
        self.transactional_id_override.clone().unwrap_or_else(|| {
            format!(
                "pg_outbox.{}.{}.{}",
                self.postgres.host(),
                self.postgres.dbname(),
                self.slot
            )
        })
    }

    /// A Kafka client configuration with the bootstrap servers and the raw
    /// properties; each client adds its own typed settings.
    pub fn kafka_client(&self) -> rdkafka::ClientConfig {
        let mut client = rdkafka::ClientConfig::new();
        for (key, value) in &self.kafka_properties.0 {
            client.set(key, value);
        }
        client.set("bootstrap.servers", &self.kafka_bootstrap);
        client
    }

    /// The librdkafka settings the typed options decide, with their values.
    fn typed_kafka_settings(&self) -> Vec<(&'static str, &'static str, Option<String>)> {
        let exactly_once = self.delivery == Delivery::ExactlyOnce;
        vec![
            (
                "bootstrap.servers",
                "kafka_bootstrap",
                Some(self.kafka_bootstrap.clone()),
            ),
            ("enable.idempotence", "delivery", Some("true".into())),
            ("acks", "delivery", Some("all".into())),
            (
                "partitioner",
                "(Java-compatible partitioning)",
                Some("murmur2_random".into()),
            ),
            (
                "transactional.id",
                "delivery",
                exactly_once.then(|| self.transactional_id()),
            ),
        ]
    }

    pub fn validate(&self) -> Result<()> {
        for (key, typed, ours) in self.typed_kafka_settings() {
            let Some(raw) = self.kafka_properties.0.get(key) else {
                continue;
            };
            let same = match (&ours, key) {
                (Some(v), "acks") => raw == v || raw == "-1",
                (Some(v), _) => raw == v,
                (None, _) => false,
            };
            if !same {
                return Err(Error::Config(format!(
                    "kafka property {key:?} contradicts the typed option {typed}; remove it and set {typed} instead"
                )));
            }
        }
        if self.kafka_bootstrap.trim().is_empty() {
            return Err(Error::Config(
                "kafka bootstrap servers are empty; set --kafka-bootstrap host:port".into(),
            ));
        }
        for (what, name) in [("slot", &self.slot), ("publication", &self.publication)] {
            let ok = !name.is_empty()
                && name.len() <= 63
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !ok {
                return Err(Error::Config(format!(
                    "{what} name {name:?} is not valid; use 1 to 63 characters of a-z, 0-9 and _"
                )));
            }
        }
        let sample = self.topic_template.replace("{aggregate_type}", "x");
        if !is_valid_topic(&sample) {
            return Err(Error::Config(format!(
                "topic template {:?} does not give a valid Kafka topic name",
                self.topic_template
            )));
        }
        if !is_valid_topic(&self.offsets_topic) {
            return Err(Error::Config(format!(
                "offsets topic {:?} is not a valid Kafka topic name",
                self.offsets_topic
            )));
        }
        if let Some(topic) = &self.dead_letter_topic {
            if !is_valid_topic(topic) {
                return Err(Error::Config(format!(
                    "dead-letter topic {topic:?} is not a valid Kafka topic name"
                )));
            }
        }
        if self.batch_max_events == 0 {
            return Err(Error::Config("batch size must be above zero".into()));
        }
        if self.max_in_flight_events == 0 || self.max_in_flight_bytes == 0 {
            return Err(Error::Config("in-flight limits must be above zero".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_never_shows_in_debug_output() {
        let c = Config::new("postgres://fwd:s3cret@127.0.0.1:5433/app", "127.0.0.1:9092")
            .expect("valid");
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("fwd@127.0.0.1:5433/app"), "{shown}");
        assert_eq!(c.postgres.password(), "s3cret");
    }

    #[test]
    fn the_file_refuses_unknown_keys_by_name_and_knows_every_documented_key() {
        let err = FileConfig::parse("slot = \"a\"\nslott = \"b\"\n")
            .err()
            .expect("refused");
        assert!(err.contains("slott"), "{err}");
        let all: String = FILE_KEYS
            .iter()
            .filter(|k| **k != "kafka_properties")
            .map(|k| match *k {
                "no_create" => format!("{k} = true\n"),
                "batch_max_events" | "batch_max_ms" | "ready_max_lag_bytes" => format!("{k} = 1\n"),
                _ => format!("{k} = \"x\"\n"),
            })
            .collect::<String>()
            + "[kafka_properties]\n\"linger.ms\" = \"10\"\n";
        assert!(
            FileConfig::parse(&all).is_ok(),
            "every listed key is accepted"
        );
    }

    #[test]
    fn raw_kafka_properties_may_not_contradict_typed_options() {
        let mut c = Config::new("postgres://u@h/db", "k:9092").expect("valid");
        c.kafka_properties.0.insert("acks".into(), "1".into());
        let err = c.validate().expect_err("acks=1 contradicts").to_string();
        assert!(
            err.contains("\"acks\"") && err.contains("delivery"),
            "{err}"
        );
        c.kafka_properties.0.insert("acks".into(), "all".into());
        c.kafka_properties
            .0
            .insert("sasl.password".into(), "hunter2".into());
        c.validate().expect("agreeing values are fine");
        assert!(
            !format!("{c:?}").contains("hunter2"),
            "secrets stay out of Debug"
        );
        c.kafka_properties
            .0
            .insert("transactional.id".into(), "x".into());
        assert!(
            c.validate().is_err(),
            "a transactional id in at-least-once mode"
        );
    }

    #[test]
    fn bad_inputs_name_what_is_wrong() {
        let err = Config::new("postgres://u@h/", "k:9092").expect_err("no db");
        assert!(err.to_string().contains("no database"), "{err}");
        let err = Config::new("not a url ::", "k:9092").expect_err("bad url");
        assert!(err.to_string().contains("postgres url"), "{err}");
        let mut c = Config::new("postgres://u@h/db", "k:9092").expect("valid");
        c.slot = "Bad-Slot".into();
        assert!(c
            .validate()
            .expect_err("bad slot")
            .to_string()
            .contains("slot name"));
    }
}

/// The configuration file (TOML). Keys are the `run` flags with `_` for `-`;
/// `[kafka_properties]` passes raw librdkafka properties through. Flags and
/// `OUTBOX_` environment variables override it. Unknown keys are refused.
#[derive(Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub postgres_url: Option<String>,
    pub kafka_bootstrap: Option<String>,
    pub slot: Option<String>,
    pub publication: Option<String>,
    pub topic_template: Option<String>,
    pub no_create: Option<bool>,
    pub delivery: Option<String>,
    pub offsets_topic: Option<String>,
    pub batch_max_events: Option<usize>,
    pub batch_max_ms: Option<u64>,
    pub dead_letter_topic: Option<String>,
    pub value_format: Option<String>,
    pub metrics_listen: Option<String>,
    pub ready_max_lag_bytes: Option<u64>,
    #[serde(default)]
    pub kafka_properties: std::collections::BTreeMap<String, String>,
}

/// Every key of the configuration file, for the documentation test.
pub const FILE_KEYS: &[&str] = &[
    "postgres_url",
    "kafka_bootstrap",
    "slot",
    "publication",
    "topic_template",
    "no_create",
    "delivery",
    "offsets_topic",
    "batch_max_events",
    "batch_max_ms",
    "dead_letter_topic",
    "value_format",
    "metrics_listen",
    "ready_max_lag_bytes",
    "kafka_properties",
];

impl FileConfig {
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!("cannot read config file {}: {e}", path.display()))
        })?;
        Self::parse(&text)
            .map_err(|e| Error::Config(format!("config file {}: {e}", path.display())))
    }

    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        toml::from_str(text).map_err(|e| e.message().to_owned())
    }
}
