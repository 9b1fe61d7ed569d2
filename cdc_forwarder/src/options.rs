//! The options of `outbox-forwarder run`, which `check`, `status`, `slot`,
//! `publication` and `replay` share, each declared once: its name (which is
//! also its key in the configuration file), type, default, help and
//! `OUTBOX_` environment variable, as a clap argument.
//!
//! The configuration file is layered under them with clap's own machinery:
//! a value from the file becomes the argument's default, so a flag beats its
//! environment variable, which beats the file, which beats the built-in
//! default. A file key that names no option is refused by name, and a file
//! value is checked by the option's own parser. The configuration
//! reference (docs/src/configuration.md) is checked against [`reference()`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use std::time::Duration;

use clap::{Args, Command, FromArgMatches};

use crate::config::{
    self, Config, Delivery, KafkaProperties, KafkaProtocol, KafkaSecurity, PgTarget, PollSettings,
    SaslMechanism, SourceKind,
};
use crate::error::{Error, Result};
use crate::routing::{ValueFormat, DEFAULT_TOPIC_TEMPLATE};
use crate::shard::Shard;

/// The options; no `Debug`, since two of them may hold passwords.
#[derive(Args, Clone)]
pub struct Options {
    /// PostgreSQL connection URL of the database that has the pg_outbox
    /// extension or its SQL edition, for a role with the REPLICATION
    /// attribute. Several hosts (a:5432,b:5432) are tried in order for the
    /// primary.
    #[arg(long, env = "OUTBOX_POSTGRES_URL", hide_env_values = true)]
    pub postgres_url: Option<String>,
    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "OUTBOX_KAFKA_BOOTSTRAP")]
    pub kafka_bootstrap: Option<String>,
    /// Where events come from: slot (logical replication, the default) or
    /// poll (relays that lease aggregates and publish their pending events,
    /// for databases that cannot have a slot; at least once; needs
    /// outbox.enable_polling()).
    #[arg(long, value_enum, ignore_case = true, env = "OUTBOX_SOURCE", default_value_t = SourceKind::Slot)]
    pub source: SourceKind,
    /// Polling: this relay's name in its leases, unique among the relays
    /// (default: host name and process id).
    #[arg(long, env = "OUTBOX_RELAY_NAME")]
    pub relay_name: Option<String>,
    /// Polling: how long a relay that found nothing pending waits.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL_MS", default_value_t = 100)]
    pub poll_interval_ms: u64,
    /// Polling: how long an aggregate's lease lasts unrenewed; another relay
    /// takes over a stopped relay's aggregates after it.
    #[arg(long, env = "OUTBOX_POLL_LEASE_MS", default_value_t = 5000)]
    pub poll_lease_ms: u64,
    /// Polling: events fetched at a time.
    #[arg(long, env = "OUTBOX_POLL_MAX_EVENTS", default_value_t = 5000)]
    pub poll_max_events: usize,
    /// Polling: aggregates one relay leases at a time.
    #[arg(long, env = "OUTBOX_POLL_MAX_AGGREGATES", default_value_t = 1000)]
    pub poll_max_aggregates: usize,
    /// Logical replication slot to stream from.
    #[arg(long, env = "OUTBOX_SLOT", default_value = "pg_outbox")]
    pub slot: String,
    /// Publication on outbox.events.
    #[arg(long, env = "OUTBOX_PUBLICATION", default_value = "pg_outbox")]
    pub publication: String,
    /// Forward one shard of the outbox, INDEX/COUNT (0/2 is the first of
    /// two): the events whose aggregate's hash is INDEX modulo COUNT, through
    /// the slot and publication named with _INDEX_of_COUNT appended, one
    /// forwarder per shard. Needs pg_outbox 0.8.0; slot source only.
    #[arg(long, env = "OUTBOX_SHARD")]
    pub shard: Option<Shard>,
    /// Topic for an event without an override; {aggregate_type} is replaced.
    #[arg(long, env = "OUTBOX_TOPIC_TEMPLATE", default_value = DEFAULT_TOPIC_TEMPLATE)]
    pub topic_template: String,
    /// Fail instead of creating a missing publication or slot.
    #[arg(long, env = "OUTBOX_NO_CREATE")]
    pub no_create: bool,
    /// Create the slot as an ordinary one on PostgreSQL 17 and later, where
    /// it is otherwise a failover slot (kept in step on standbys that
    /// synchronise slots).
    #[arg(long, env = "OUTBOX_NO_FAILOVER_SLOT")]
    pub no_failover_slot: bool,
    /// Delivery guarantee: at-least-once (idempotent producer) or
    /// exactly-once (Kafka transactions with offsets stored in Kafka, for
    /// read_committed consumers).
    #[arg(long, value_enum, ignore_case = true, env = "OUTBOX_DELIVERY", default_value_t = Delivery::AtLeastOnce)]
    pub delivery: Delivery,
    /// Compacted topic that stores the exactly-once offsets. By default each
    /// forwarder has its own, pg_outbox.offsets.<transactional id>, so that
    /// one forwarder's open transaction never holds back another's start.
    #[arg(long, env = "OUTBOX_OFFSETS_TOPIC")]
    pub offsets_topic: Option<String>,
    /// Replication factor of the offsets topic when the forwarder creates
    /// it (default: the cluster's default.replication.factor).
    #[arg(long, env = "OUTBOX_OFFSETS_REPLICATION_FACTOR", value_parser = clap::value_parser!(i32).range(1..))]
    pub offsets_replication_factor: Option<i32>,
    /// Exactly-once: commit a Kafka transaction at the first PostgreSQL commit
    /// where it holds this many events, even while more wait behind it.
    #[arg(long, env = "OUTBOX_BATCH_MAX_EVENTS", default_value_t = 5000)]
    pub batch_max_events: usize,
    /// Exactly-once: how long a Kafka transaction waits for more PostgreSQL
    /// transactions before its commit starts (0: at once; one commit is in
    /// flight at a time and the next transaction fills meanwhile).
    #[arg(long, env = "OUTBOX_BATCH_LINGER_MS", default_value_t = 0)]
    pub batch_linger_ms: u64,
    /// Send events Kafka refuses (too large, unroutable) to this topic, with
    /// the reason in headers, instead of halting.
    #[arg(long, env = "OUTBOX_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,
    /// With a dead-letter topic, let an aggregate's later events go on to
    /// their topics past a dead-lettered one, as before 0.6 (consumers may
    /// then see its event n+1 without n). By default the aggregate is parked:
    /// its later events are dead-lettered behind the first until
    /// `outbox-forwarder redrive`.
    #[arg(long, env = "OUTBOX_DEAD_LETTER_UNORDERED")]
    pub dead_letter_unordered: bool,
    /// Record values: the raw payload, an envelope JSON with the identity
    /// fields, or CloudEvents binary mode (ce_* headers).
    #[arg(long, value_enum, ignore_case = true, env = "OUTBOX_VALUE_FORMAT", default_value_t = ValueFormat::Raw)]
    pub value_format: ValueFormat,
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address,
    /// for example 0.0.0.0:9187. Off when not set.
    #[arg(long, env = "OUTBOX_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// /readyz fails while the slot's lag is above this many bytes.
    #[arg(long, env = "OUTBOX_READY_MAX_LAG_BYTES", default_value_t = 100 << 20)]
    pub ready_max_lag_bytes: u64,
    /// /readyz fails while events wait for Kafka with no acknowledgement for
    /// this many milliseconds (Kafka reachable but holding them back).
    #[arg(long, env = "OUTBOX_READY_MAX_STALL_MS", default_value_t = 30_000)]
    pub ready_max_stall_ms: u64,
    /// /healthz fails when the forwarding loop made no step for this many
    /// milliseconds (it steps at least once a second while it runs).
    #[arg(long, env = "OUTBOX_LIVENESS_TIMEOUT_MS", default_value_t = 60_000)]
    pub liveness_timeout_ms: u64,
    /// How Kafka clients connect: plaintext, ssl, sasl-plaintext or sasl-ssl.
    /// (TLS to PostgreSQL is set in the URL: ?sslmode=verify-full&sslrootcert=ca.pem.)
    #[arg(
        long,
        value_enum,
        ignore_case = true,
        env = "OUTBOX_KAFKA_SECURITY_PROTOCOL"
    )]
    pub kafka_security_protocol: Option<KafkaProtocol>,
    /// SASL mechanism for sasl-* protocols.
    #[arg(long, value_enum, ignore_case = true, env = "OUTBOX_KAFKA_SASL_MECHANISM", default_value_t = SaslMechanism::Plain)]
    pub kafka_sasl_mechanism: SaslMechanism,
    /// SASL username.
    #[arg(long, env = "OUTBOX_KAFKA_SASL_USERNAME")]
    pub kafka_sasl_username: Option<String>,
    /// SASL password; prefer the environment variable or the file over the
    /// flag, which other users can see in the process list.
    #[arg(long, env = "OUTBOX_KAFKA_SASL_PASSWORD", hide_env_values = true)]
    pub kafka_sasl_password: Option<String>,
    /// CA certificates (PEM file) that sign the brokers' certificates;
    /// without it the system's trust store is used.
    #[arg(long, env = "OUTBOX_KAFKA_SSL_CA")]
    pub kafka_ssl_ca: Option<PathBuf>,
}

/// The file's table of raw librdkafka properties: the one key that is no
/// option (a table of strings, file only).
const KAFKA_PROPERTIES: &str = "kafka_properties";

impl Options {
    /// What `/healthz` and `/readyz` judge by.
    pub fn health_limits(&self) -> crate::health::Limits {
        crate::health::Limits {
            liveness_timeout: Duration::from_millis(self.liveness_timeout_ms),
            ready_max_lag_bytes: self.ready_max_lag_bytes,
            ready_max_stall: Duration::from_millis(self.ready_max_stall_ms),
        }
    }

    /// Every option at its built-in default: what a run with no flag, no
    /// environment variable and no configuration file has.
    pub fn defaults() -> Result<Options> {
        let matches = arguments()
            .mut_args(|arg| arg.env(None))
            .try_get_matches_from(["options"])
            .map_err(|e| Error::Bug(format!("the options' defaults do not parse: {e}")))?;
        Options::from_arg_matches(&matches)
            .map_err(|e| Error::Bug(format!("the options' defaults do not parse: {e}")))
    }

    /// The configuration these options describe, with the file's raw
    /// librdkafka properties; validated.
    pub fn into_config(self, kafka_properties: &KafkaProperties) -> Result<Config> {
        let postgres_url = self.postgres_url.as_deref().ok_or_else(|| {
            Error::Config("no PostgreSQL URL: pass --postgres-url, set OUTBOX_POSTGRES_URL, or postgres_url in the config file".into())
        })?;
        let kafka_bootstrap = self.kafka_bootstrap.as_deref().ok_or_else(|| {
            Error::Config("no Kafka bootstrap servers: pass --kafka-bootstrap, set OUTBOX_KAFKA_BOOTSTRAP, or kafka_bootstrap in the config file".into())
        })?;
        let protocol = self.kafka_security_protocol;
        let suffix = self.shard.map(|s| s.suffix()).unwrap_or_default();
        let config = Config {
            source: self.source,
            poll: PollSettings {
                relay: self
                    .relay_name
                    .unwrap_or_else(PollSettings::host_relay_name),
                interval: Duration::from_millis(self.poll_interval_ms),
                lease: Duration::from_millis(self.poll_lease_ms),
                max_events: self.poll_max_events,
                max_aggregates: self.poll_max_aggregates,
            },
            postgres: PgTarget::parse(postgres_url)?,
            kafka_bootstrap: kafka_bootstrap.to_owned(),
            slot: format!("{}{suffix}", self.slot),
            publication: format!("{}{suffix}", self.publication),
            shard: self.shard,
            create_missing: !self.no_create,
            failover_slot: !self.no_failover_slot,
            topic_template: self.topic_template,
            max_in_flight_events: config::MAX_IN_FLIGHT_EVENTS,
            max_in_flight_bytes: config::MAX_IN_FLIGHT_BYTES,
            max_backoff: config::MAX_BACKOFF,
            delivery: self.delivery,
            offsets_topic: self.offsets_topic,
            offsets_replication_factor: self.offsets_replication_factor,
            batch_max_events: self.batch_max_events,
            batch_linger: Duration::from_millis(self.batch_linger_ms),
            transaction_timeout: config::TRANSACTION_TIMEOUT,
            dead_letter_topic: self.dead_letter_topic,
            park_aggregates: !self.dead_letter_unordered,
            value_format: self.value_format,
            kafka_security: KafkaSecurity {
                protocol,
                // The mechanism has a default; it applies only when SASL is used.
                sasl_mechanism: protocol
                    .is_some_and(KafkaProtocol::uses_sasl)
                    .then_some(self.kafka_sasl_mechanism),
                sasl_username: self.kafka_sasl_username,
                sasl_password: self.kafka_sasl_password,
                ssl_ca: self.kafka_ssl_ca,
            },
            kafka_properties: kafka_properties.clone(),
        };
        config.validate()?;
        Ok(config)
    }
}

impl Config {
    /// The configuration of every option's default, for this database and
    /// Kafka cluster; validated.
    pub fn new(postgres_url: &str, kafka_bootstrap: &str) -> Result<Self> {
        Options {
            postgres_url: Some(postgres_url.to_owned()),
            kafka_bootstrap: Some(kafka_bootstrap.to_owned()),
            ..Options::defaults()?
        }
        .into_config(&KafkaProperties::default())
    }
}

/// The options as clap arguments, outside any command.
fn arguments() -> Command {
    Options::augment_args(Command::new("options"))
}

/// One option as the configuration reference shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// The key in the configuration file.
    pub key: String,
    /// `--flag`, or none for a key of the file alone.
    pub flag: Option<String>,
    /// `OUTBOX_...`, or none.
    pub env: Option<String>,
}

/// Every key of the configuration file, with its flag and variable.
pub fn reference() -> Vec<Reference> {
    let command = arguments();
    let mut keys: Vec<Reference> = command
        .get_arguments()
        .map(|arg| Reference {
            key: arg.get_id().to_string(),
            flag: arg.get_long().map(|long| format!("--{long}")),
            env: arg.get_env().map(|env| env.to_string_lossy().into_owned()),
        })
        .collect();
    keys.push(Reference {
        key: KAFKA_PROPERTIES.into(),
        flag: None,
        env: None,
    });
    keys
}

/// The configuration file (TOML): option values by key, and the raw
/// librdkafka properties of `[kafka_properties]`.
#[derive(Default)]
pub struct ConfigFile {
    values: Vec<(String, String)>,
    pub kafka_properties: KafkaProperties,
}

impl ConfigFile {
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!("cannot read config file {}: {e}", path.display()))
        })?;
        Self::parse(&text)
            .map_err(|e| Error::Config(format!("config file {}: {e}", path.display())))
    }

    /// Reads the file and checks each value with its option's parser.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| e.message().to_owned())?;
        let command = arguments();
        let mut file = ConfigFile::default();
        for (key, value) in table {
            if key == KAFKA_PROPERTIES {
                let properties: BTreeMap<String, String> = value
                    .try_into()
                    .map_err(|_| format!("{KAFKA_PROPERTIES} must be a table of strings"))?;
                file.kafka_properties = KafkaProperties(properties);
                continue;
            }
            let Some(arg) = command.get_arguments().find(|a| a.get_id() == key.as_str()) else {
                return Err(format!("unknown key `{key}`"));
            };
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(format!(
                        "{key} must be a string, a number or a boolean, not {}",
                        other.type_str()
                    ))
                }
            };
            let choices = arg.get_possible_values();
            let text = if !arg.get_action().takes_values() {
                // A switch: true or false.
                match text.as_str() {
                    "true" | "false" => text,
                    _ => return Err(format!("{key} must be true or false, not {text:?}")),
                }
            } else if choices.is_empty() {
                // Checked by the option's own parser, as a flag would be.
                let long = arg.get_long().unwrap_or(key.as_str());
                Command::new("file")
                    .no_binary_name(true)
                    .arg(arg.clone())
                    .try_get_matches_from([format!("--{long}"), text.clone()])
                    .map_err(|e| format!("{key} {text:?} is not valid: {}", e.kind()))?;
                text
            } else {
                // A choice among names; `_` and `-` and letter case do not matter.
                let wanted = text.replace('_', "-");
                choices
                    .iter()
                    .find(|c| c.get_name().eq_ignore_ascii_case(&wanted))
                    .map(|c| c.get_name().to_owned())
                    .ok_or_else(|| {
                        let names: Vec<&str> = choices.iter().map(|c| c.get_name()).collect();
                        format!("{key} {text:?} is not one of {}", names.join(", "))
                    })?
            };
            file.values.push((key, text));
        }
        Ok(file)
    }

    /// `command` with the file's values as the defaults of the options, in
    /// every subcommand that takes them.
    pub fn apply(&self, mut command: Command) -> Command {
        let takers: Vec<String> = command
            .get_subcommands()
            .filter(|sub| sub.get_arguments().any(|a| a.get_id() == "slot"))
            .map(|sub| sub.get_name().to_owned())
            .collect();
        for name in takers {
            command = command.mut_subcommand(name, |mut sub| {
                for (key, value) in &self.values {
                    sub = sub.mut_arg(key, |arg| arg.default_value(value.clone()));
                }
                sub
            });
        }
        command
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_refuses_unknown_keys_by_name_and_accepts_every_option() {
        let err = ConfigFile::parse("slot = \"a\"\nslott = \"b\"\n")
            .err()
            .expect("refused");
        assert!(err.contains("slott"), "{err}");
        let all: String = reference()
            .iter()
            .filter(|r| r.key != KAFKA_PROPERTIES)
            .map(|r| match r.key.as_str() {
                "no_create" | "no_failover_slot" | "dead_letter_unordered" => {
                    format!("{} = true\n", r.key)
                }
                "batch_max_events"
                | "batch_linger_ms"
                | "ready_max_lag_bytes"
                | "ready_max_stall_ms"
                | "liveness_timeout_ms"
                | "poll_interval_ms"
                | "poll_lease_ms"
                | "poll_max_events"
                | "poll_max_aggregates"
                | "offsets_replication_factor" => {
                    format!("{} = 1\n", r.key)
                }
                "delivery" => "delivery = \"exactly_once\"\n".into(),
                "source" => "source = \"Poll\"\n".into(),
                "value_format" => "value_format = \"CloudEvents\"\n".into(),
                "kafka_security_protocol" => "kafka_security_protocol = \"SASL_SSL\"\n".into(),
                "kafka_sasl_mechanism" => "kafka_sasl_mechanism = \"SCRAM-SHA-512\"\n".into(),
                "metrics_listen" => "metrics_listen = \"0.0.0.0:9187\"\n".into(),
                "shard" => "shard = \"1/4\"\n".into(),
                _ => format!("{} = \"x\"\n", r.key),
            })
            .collect::<String>()
            + "[kafka_properties]\n\"linger.ms\" = \"10\"\n";
        let file = ConfigFile::parse(&all).expect("every option is a key");
        assert_eq!(file.values.len(), reference().len() - 1);
        assert_eq!(file.kafka_properties.0["linger.ms"], "10");
    }

    #[test]
    fn file_values_are_checked_by_their_options_parser() {
        for (text, expected) in [
            (
                "metrics_listen = \"nowhere\"\n",
                "metrics_listen \"nowhere\"",
            ),
            ("batch_max_events = -1\n", "batch_max_events \"-1\""),
            (
                "kafka_sasl_mechanism = \"GSSAPI\"\n",
                "kafka_sasl_mechanism \"GSSAPI\" is not one of plain",
            ),
            ("slot = [1]\n", "slot must be a string"),
            (
                "[kafka_properties]\nlinger = 1\n",
                "kafka_properties must be a table of strings",
            ),
        ] {
            let err = ConfigFile::parse(text).err().expect(text);
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}
