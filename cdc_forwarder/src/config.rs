//! The forwarder's configuration: one place, validated before anything starts.

use std::time::Duration;

use crate::error::{Error, Result};
pub use crate::pg_target::{PgTarget, PgTls, SslMode};
use crate::routing::{is_valid_topic, Router, ValueFormat};
use crate::shard::Shard;

/// The delivery guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Delivery {
    /// Idempotent producer; a crash can repeat events, never lose them.
    AtLeastOnce,
    /// Transactional producer with offsets stored in Kafka: a
    /// `read_committed` consumer sees every event once.
    ExactlyOnce,
}

/// Where events are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceKind {
    /// A logical replication slot (pgoutput): commit order, no polling.
    Slot,
    /// Polling relays that lease aggregates and publish their pending
    /// events (outbox.enable_polling()), for databases without a slot.
    Poll,
}

/// How a polling relay works (`--source poll`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollSettings {
    /// This relay's name in its leases; unique among running relays.
    pub relay: String,
    /// How long a relay waits when it found nothing pending.
    pub interval: Duration,
    /// How long a lease lasts without renewal: a killed relay's aggregates
    /// are taken over after it, and a relay whose batches wait that long
    /// for Kafka's acknowledgement lets its leases lapse.
    pub lease: Duration,
    /// Events fetched at a time.
    pub max_events: usize,
    /// Aggregates one relay leases at a time.
    pub max_aggregates: usize,
}

impl PollSettings {
    fn validate(&self) -> Result<()> {
        if self.relay.is_empty() || self.relay.len() > 255 {
            return Err(Error::Config(
                "relay_name must be 1 to 255 characters".into(),
            ));
        }
        if self.max_events == 0 || self.max_aggregates == 0 || self.lease.is_zero() {
            return Err(Error::Config(
                "poll_max_events, poll_max_aggregates and poll_lease_ms must be at least 1".into(),
            ));
        }
        if self.interval >= self.lease / 3 {
            return Err(Error::Config(format!(
                "poll_interval_ms ({} ms) must be under a third of poll_lease_ms ({} ms), so that leases are renewed in time",
                self.interval.as_millis(),
                self.lease.as_millis()
            )));
        }
        Ok(())
    }
}

impl PollSettings {
    /// The relay name of a relay not given one: the host's name and the
    /// process id.
    pub fn host_relay_name() -> String {
        format!("{}:{}", hostname(), std::process::id())
    }
}

/// The host's name, for relay names; "relay" when it cannot be read.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "relay".to_owned())
}

/// The librdkafka settings every producer of the forwarder has, whatever
/// `kafka_properties` say (a contradicting property is refused, naming the
/// option that decides it): key, value, and that option. Idempotence with
/// `acks=all` keeps a retried send from duplicating or reordering records;
/// the Java client's partitioner makes Java producers and consumers agree
/// with us on a key's partition.
pub const PRODUCER_GUARANTEES: [(&str, &str, &str); 3] = [
    ("enable.idempotence", "true", "delivery"),
    ("acks", "all", "delivery"),
    (
        "partitioner",
        "murmur2_random",
        "(Java-compatible partitioning)",
    ),
];

/// The prefix of each forwarder's own offsets topic.
pub const OFFSETS_TOPIC_PREFIX: &str = "pg_outbox.offsets.";
/// The one offsets topic that every forwarder shared before each had its
/// own; read once, on an upgrade.
pub const SHARED_OFFSETS_TOPIC: &str = "pg_outbox.offsets";

/// At most this many events produced but not yet acknowledged by Kafka.
pub const MAX_IN_FLIGHT_EVENTS: usize = 10_000;
/// At most this many payload bytes produced but not yet acknowledged.
pub const MAX_IN_FLIGHT_BYTES: usize = 64 << 20;
/// Longest wait between reconnection attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Kafka's `transaction.timeout.ms` for the exactly-once producer.
pub const TRANSACTION_TIMEOUT: Duration = Duration::from_secs(300);

/// Everything `outbox-forwarder run` needs, built from the
/// [`Options`](crate::options::Options) (see [`Config::new`] for their defaults).
#[derive(Debug, Clone)]
pub struct Config {
    /// The replication slot, or polling relays.
    pub source: SourceKind,
    /// Used with [`SourceKind::Poll`].
    pub poll: PollSettings,
    pub postgres: PgTarget,
    pub kafka_bootstrap: String,
    /// The slot and the publication, of the shard when there is one.
    pub slot: String,
    pub publication: String,
    /// The shard this forwarder carries; `None`: every event.
    pub shard: Option<Shard>,
    /// Create the publication and the slot when they are missing.
    pub create_missing: bool,
    /// On PostgreSQL 17 and later, create the slot as a failover slot.
    pub failover_slot: bool,
    pub topic_template: String,
    /// At most this many events produced but not yet acknowledged by Kafka.
    pub max_in_flight_events: usize,
    /// At most this many payload bytes produced but not yet acknowledged.
    pub max_in_flight_bytes: usize,
    /// Longest wait between reconnection attempts.
    pub max_backoff: Duration,
    pub delivery: Delivery,
    /// Compacted topic of the exactly-once offsets, when one is chosen; by
    /// default each forwarder has its own (see [`Config::offsets_topic`]).
    pub offsets_topic: Option<String>,
    /// The offsets topic's replication factor when it is created; `None`:
    /// the cluster's default.
    pub offsets_replication_factor: Option<i32>,
    /// A Kafka transaction is committed at the first PostgreSQL commit where
    /// it holds this many events, even while more wait behind it.
    pub batch_max_events: usize,
    /// How long a complete Kafka transaction waits for more before its commit.
    pub batch_linger: Duration,
    /// Kafka's `transaction.timeout.ms`.
    pub transaction_timeout: Duration,
    /// Where poison events go; without it a poison event halts the forwarder.
    pub dead_letter_topic: Option<String>,
    /// With a dead-letter topic: park the aggregate of a dead-lettered event,
    /// holding its later events back (see [`crate::parking`]).
    pub park_aggregates: bool,
    /// What a record's value holds.
    pub value_format: ValueFormat,
    /// How the Kafka clients authenticate and encrypt.
    pub kafka_security: KafkaSecurity,
    /// Raw librdkafka properties (tuning, rarer security settings), applied
    /// to every Kafka client.
    pub kafka_properties: KafkaProperties,
}

/// Kafka's `security.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KafkaProtocol {
    Plaintext,
    Ssl,
    SaslPlaintext,
    SaslSsl,
}

impl KafkaProtocol {
    fn name(self) -> &'static str {
        match self {
            KafkaProtocol::Plaintext => "plaintext",
            KafkaProtocol::Ssl => "ssl",
            KafkaProtocol::SaslPlaintext => "sasl_plaintext",
            KafkaProtocol::SaslSsl => "sasl_ssl",
        }
    }

    pub fn uses_sasl(self) -> bool {
        matches!(self, KafkaProtocol::SaslPlaintext | KafkaProtocol::SaslSsl)
    }
}

/// SASL mechanisms that work with a username and password.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SaslMechanism {
    Plain,
    #[value(name = "scram-sha-256")]
    ScramSha256,
    #[value(name = "scram-sha-512")]
    ScramSha512,
}

impl SaslMechanism {
    fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// Encryption and authentication towards Kafka. The password stays out of
/// Debug output.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KafkaSecurity {
    /// Unset: librdkafka's default (plaintext), or a raw property.
    pub protocol: Option<KafkaProtocol>,
    pub sasl_mechanism: Option<SaslMechanism>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<String>,
    /// CA certificates (PEM) that sign the brokers' certificates; unset:
    /// the system's trust store.
    pub ssl_ca: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for KafkaSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSecurity")
            .field("protocol", &self.protocol)
            .field("sasl_mechanism", &self.sasl_mechanism)
            .field("sasl_username", &self.sasl_username)
            .field("sasl_password", &self.sasl_password.as_ref().map(|_| "***"))
            .field("ssl_ca", &self.ssl_ca)
            .finish()
    }
}

impl KafkaSecurity {
    /// The librdkafka properties these settings stand for.
    fn properties(&self) -> Vec<(&'static str, &'static str, String)> {
        let mut out = Vec::new();
        if let Some(protocol) = self.protocol {
            out.push((
                "security.protocol",
                "kafka_security_protocol",
                protocol.name().to_owned(),
            ));
        }
        if let Some(mechanism) = self.sasl_mechanism {
            out.push((
                "sasl.mechanisms",
                "kafka_sasl_mechanism",
                mechanism.name().to_owned(),
            ));
        }
        if let Some(user) = &self.sasl_username {
            out.push(("sasl.username", "kafka_sasl_username", user.clone()));
        }
        if let Some(password) = &self.sasl_password {
            out.push(("sasl.password", "kafka_sasl_password", password.clone()));
        }
        if let Some(ca) = &self.ssl_ca {
            out.push(("ssl.ca.location", "kafka_ssl_ca", ca.display().to_string()));
        }
        out
    }

    fn validate(&self) -> Result<()> {
        let sasl = self.protocol.is_some_and(KafkaProtocol::uses_sasl);
        let sasl_given = self.sasl_mechanism.is_some()
            || self.sasl_username.is_some()
            || self.sasl_password.is_some();
        if sasl_given && !sasl {
            return Err(Error::Config(
                "kafka SASL settings need kafka_security_protocol sasl_ssl or sasl_plaintext"
                    .into(),
            ));
        }
        if sasl && (self.sasl_username.is_none() || self.sasl_password.is_none()) {
            return Err(Error::Config(
                "kafka_security_protocol uses SASL: set kafka_sasl_username and kafka_sasl_password (OUTBOX_KAFKA_SASL_PASSWORD)".into(),
            ));
        }
        if let Some(ca) = &self.ssl_ca {
            if !matches!(
                self.protocol,
                Some(KafkaProtocol::Ssl | KafkaProtocol::SaslSsl)
            ) {
                return Err(Error::Config(
                    "kafka_ssl_ca needs kafka_security_protocol ssl or sasl_ssl".into(),
                ));
            }
            if !ca.is_file() {
                return Err(Error::Config(format!(
                    "kafka_ssl_ca {} does not exist or is not a file",
                    ca.display()
                )));
            }
        }
        Ok(())
    }
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
    /// Whether a dead letter parks its aggregate: with a dead-letter topic,
    /// unless `--dead-letter-unordered`.
    pub fn parks_aggregates(&self) -> bool {
        self.dead_letter_topic.is_some() && self.park_aggregates
    }

    /// The router `run`, `replay` and `redrive` share: the configured
    /// template and value format, the source naming database and slot.
    pub fn router(&self) -> Router {
        Router::new(self.topic_template.clone()).with_format(
            self.value_format,
            format!("pg_outbox/{}/{}", self.postgres.dbname(), self.slot),
        )
    }

    /// The transactional id: one per database and slot, so a second
    /// forwarder on the same slot fences the first. The host is the first
    /// the URL names, whichever is the primary now: a failover keeps the id,
    /// so the forwarder on the new primary fences the old one and reads the
    /// same offsets.
    pub fn transactional_id(&self) -> String {
        format!(
            "pg_outbox.{}.{}.{}",
            self.postgres.named_host(),
            self.postgres.dbname(),
            self.slot
        )
    }

    /// The compacted topic of this forwarder's exactly-once offsets: the one
    /// chosen, or `pg_outbox.offsets.` and the transactional id (characters
    /// a topic name cannot hold become `_`; a name too long for Kafka is
    /// shortened to a digest). A topic of its own: a `read_committed` read
    /// of a partition waits behind any transaction open on it, and a
    /// forwarder killed inside a commit leaves one open for up to
    /// `transaction.timeout.ms`, which on a shared partition held back every
    /// other forwarder's start.
    pub fn offsets_topic(&self) -> String {
        if let Some(topic) = &self.offsets_topic {
            return topic.clone();
        }
        let id = self.transactional_id();
        let id = id.strip_prefix("pg_outbox.").unwrap_or(&id);
        let name: String = id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let topic = format!("{OFFSETS_TOPIC_PREFIX}{name}");
        if topic.len() <= 249 {
            return topic;
        }
        // FNV-1a: the same name from every build and every run.
        let digest = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        format!("{OFFSETS_TOPIC_PREFIX}{}.{digest:016x}", &name[..200])
    }

    /// Where offsets were kept before each forwarder had its own topic:
    /// read when this forwarder's own topic holds none yet (an upgrade),
    /// unless a topic was chosen.
    pub fn offsets_fallback(&self) -> Option<String> {
        self.offsets_topic
            .is_none()
            .then(|| SHARED_OFFSETS_TOPIC.to_owned())
    }

    /// A Kafka client configuration with the bootstrap servers and the raw
    /// properties; each client adds its own typed settings.
    pub fn kafka_client(&self) -> rdkafka::ClientConfig {
        let mut client = rdkafka::ClientConfig::new();
        for (key, value) in &self.kafka_properties.0 {
            client.set(key, value);
        }
        for (key, _, value) in self.kafka_security.properties() {
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
            (
                "transactional.id",
                "delivery",
                exactly_once.then(|| self.transactional_id()),
            ),
        ]
        .into_iter()
        .chain(
            PRODUCER_GUARANTEES
                .iter()
                .map(|&(key, value, typed)| (key, typed, Some(value.to_owned()))),
        )
        .collect()
    }

    /// A raw librdkafka property may not say otherwise than a typed option:
    /// the option decides, and the refusal names it.
    fn refuse_contradicting_kafka_properties(&self) -> Result<()> {
        let security = self
            .kafka_security
            .properties()
            .into_iter()
            .map(|(key, typed, value)| (key, typed, Some(value)));
        for (key, typed, ours) in self.typed_kafka_settings().into_iter().chain(security) {
            let Some(raw) = self.kafka_properties.0.get(key) else {
                continue;
            };
            let same = match (&ours, key) {
                (Some(v), "acks") => raw == v || raw == "-1",
                (Some(v), _) => raw.eq_ignore_ascii_case(v),
                (None, _) => false,
            };
            if !same {
                return Err(Error::Config(format!(
                    "kafka property {key:?} contradicts the typed option {typed}; remove it and set {typed} instead"
                )));
            }
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<()> {
        self.kafka_security.validate()?;
        if self.source == SourceKind::Poll {
            if self.delivery == Delivery::ExactlyOnce {
                return Err(Error::Config(
                    "--source poll delivers at least once; exactly-once needs the slot (--source slot)".into(),
                ));
            }
            self.poll.validate()?;
            if self.shard.is_some() {
                return Err(Error::Config(
                    "--shard splits the slot's stream; polling relays share the aggregates among themselves (leave --shard out with --source poll)".into(),
                ));
            }
        }
        self.refuse_contradicting_kafka_properties()?;
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
                let sharded = if self.shard.is_some() {
                    ", the shard's suffix included"
                } else {
                    ""
                };
                return Err(Error::Config(format!(
                    "{what} name {name:?} is not valid; use 1 to 63 characters of a-z, 0-9 and _{sharded}"
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
        if !is_valid_topic(&self.offsets_topic()) {
            return Err(Error::Config(format!(
                "offsets topic {:?} is not a valid Kafka topic name",
                self.offsets_topic()
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
    use crate::options::Options;

    #[test]
    fn a_multi_host_url_gives_one_target_per_host_with_the_rest_kept() {
        for url in [
            "postgres://fwd:s3cret@db-a:5433,db-b:5434/app?sslmode=disable&application_name=relay",
            "host=db-a,db-b port=5433,5434 user=fwd password=s3cret dbname=app sslmode=disable application_name=relay",
        ] {
            let target = PgTarget::parse(url).expect(url);
            assert_eq!(target.redacted(), "fwd@db-a:5433,db-b:5434/app");
            let hosts = target.per_host();
            let seen: Vec<_> = hosts.iter().map(|h| (h.host(), h.port())).collect();
            assert_eq!(seen, [("db-a".to_owned(), 5433), ("db-b".to_owned(), 5434)]);
            for one in &hosts {
                assert_eq!((one.user(), one.password().as_str(), one.dbname()), ("fwd", "s3cret", "app"));
                assert_eq!(one.sql_config().get_application_name(), Some("relay"));
                assert_eq!(one.tls().mode, SslMode::Disable);
            }
        }
        // One port serves every host.
        let target = PgTarget::parse("host=db-a,db-b port=6000 user=fwd dbname=app").expect("url");
        let ports: Vec<_> = target.per_host().iter().map(PgTarget::port).collect();
        assert_eq!(ports, [6000, 6000]);
    }

    #[test]
    fn a_failover_to_another_host_keeps_the_transactional_id_and_offsets_topic() {
        let mut named =
            Config::new("postgres://fwd@db-a:5432,db-b:5432/app", "k:9092").expect("valid");
        named.slot = "orders".into();
        let hosts = named.postgres.per_host();
        assert_eq!(hosts[1].host(), "db-b");
        let on_second = Config {
            postgres: hosts[1].clone(),
            ..named.clone()
        };
        assert_eq!(named.transactional_id(), "pg_outbox.db-a.app.orders");
        assert_eq!(on_second.transactional_id(), named.transactional_id());
        assert_eq!(on_second.offsets_topic(), named.offsets_topic());
    }

    #[test]
    fn each_shard_has_a_slot_publication_transactional_id_and_offsets_topic_of_its_own() {
        let options = |shard: Option<&str>, source: SourceKind| Options {
            postgres_url: Some("postgres://fwd@db-a/app".into()),
            kafka_bootstrap: Some("k:9092".into()),
            shard: shard.map(|s| s.parse().expect("a shard")),
            source,
            ..Options::defaults().expect("defaults")
        };
        let config = |shard| {
            options(shard, SourceKind::Slot)
                .into_config(&KafkaProperties::default())
                .expect("valid")
        };
        let (first, second, whole) = (config(Some("0/2")), config(Some("1/2")), config(None));
        assert_eq!(
            (first.slot.as_str(), first.publication.as_str()),
            ("pg_outbox_0_of_2", "pg_outbox_0_of_2")
        );
        assert_eq!(
            first.transactional_id(),
            "pg_outbox.db-a.app.pg_outbox_0_of_2"
        );
        let ids: std::collections::HashSet<String> = [&first, &second, &whole]
            .iter()
            .flat_map(|c| [c.slot.clone(), c.transactional_id(), c.offsets_topic()])
            .collect();
        assert_eq!(ids.len(), 9, "no two forwarders share a name: {ids:?}");
        let polling =
            options(Some("0/2"), SourceKind::Poll).into_config(&KafkaProperties::default());
        assert!(
            matches!(&polling, Err(Error::Config(m)) if m.contains("--shard")),
            "{polling:?}"
        );
    }

    #[test]
    fn each_forwarder_has_an_offsets_topic_of_its_own_unless_one_is_chosen() {
        let mut c = Config::new("postgres://u@db-1/app", "k:9092").expect("valid");
        c.slot = "orders".into();
        assert_eq!(c.offsets_topic(), "pg_outbox.offsets.db-1.app.orders");
        assert_eq!(c.offsets_fallback().as_deref(), Some(SHARED_OFFSETS_TOPIC));

        c.slot = "tenant ä/orders".into();
        assert_eq!(
            c.offsets_topic(),
            "pg_outbox.offsets.db-1.app.tenant___orders"
        );

        let long = |tail: &str| {
            let mut c = c.clone();
            c.slot = format!("{}{tail}", "x".repeat(300));
            c.offsets_topic()
        };
        assert!(is_valid_topic(&long("a")), "{}", long("a"));
        assert_eq!(long("a"), long("a"), "the same name on every start");
        assert_ne!(
            long("a"),
            long("b"),
            "ids alike in their first 200 characters"
        );

        c.offsets_topic = Some("ours".into());
        assert_eq!(c.offsets_topic(), "ours");
        assert_eq!(c.offsets_fallback(), None, "a chosen topic is the only one");
    }

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
    fn tls_parameters_are_read_with_libpq_meaning_and_the_rest_kept() {
        let ca = std::env::temp_dir().join("pg_outbox unit ca.pem");
        std::fs::write(&ca, "not checked here").expect("write");
        let url = format!(
            "postgres://u:p@db.internal:5433/app?connect_timeout=5&sslmode=verify-full&sslrootcert={}&application_name=x",
            ca.display().to_string().replace(' ', "%20")
        );
        let target = PgTarget::parse(&url).expect("valid");
        assert_eq!(target.tls().mode, SslMode::VerifyFull);
        assert_eq!(target.tls().root_cert.as_deref(), Some(ca.as_path()));
        assert_eq!(
            target.sql_config().get_connect_timeout(),
            Some(&Duration::from_secs(5)),
            "other parameters still reach tokio-postgres"
        );
        assert_eq!(target.sql_config().get_application_name(), Some("x"));

        let plain = PgTarget::parse("postgres://u@h/db").expect("valid");
        assert_eq!(plain.tls().mode, SslMode::Prefer, "libpq's default");
        assert!(!plain.tls().verifies_chain());
        let keyword = PgTarget::parse("host=h user=u dbname=db sslmode=require").expect("valid");
        assert_eq!(keyword.tls().mode, SslMode::Require);
        assert!(
            !keyword.tls().verifies_chain(),
            "require alone does not verify"
        );
    }

    #[test]
    fn wrong_tls_parameters_are_refused_by_name() {
        for (url, expected) in [
            ("postgres://u@h/db?sslmode=verify", "sslmode \"verify\""),
            (
                "postgres://u@h/db?sslmode=require&sslcert=/etc/hostname",
                "sslcert and sslkey",
            ),
            (
                "postgres://u@h/db?sslmode=verify-ca&sslrootcert=/no/such/ca.pem",
                "/no/such/ca.pem",
            ),
            (
                "postgres://u@h/db?sslmode=disable&sslrootcert=/etc/hostname",
                "contradicts",
            ),
        ] {
            let err = PgTarget::parse(url).expect_err(url).to_string();
            assert!(err.contains(expected), "{url}: {err}");
        }
    }

    #[test]
    fn kafka_security_settings_are_checked_together_and_hide_the_password() {
        let mut c = Config::new("postgres://u@h/db", "k:9092").expect("valid");
        c.kafka_security.sasl_username = Some("fwd".into());
        let err = c
            .validate()
            .expect_err("SASL without a SASL protocol")
            .to_string();
        assert!(err.contains("sasl_ssl"), "{err}");
        c.kafka_security.protocol = Some(KafkaProtocol::SaslSsl);
        let err = c.validate().expect_err("no password").to_string();
        assert!(err.contains("kafka_sasl_password"), "{err}");
        c.kafka_security.sasl_password = Some("hunter2".into());
        c.kafka_security.sasl_mechanism = Some(SaslMechanism::ScramSha512);
        c.validate().expect("complete");
        assert!(!format!("{c:?}").contains("hunter2"), "{c:?}");
        let client = c.kafka_client();
        assert_eq!(client.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(client.get("sasl.mechanisms"), Some("SCRAM-SHA-512"));
        c.kafka_properties
            .0
            .insert("security.protocol".into(), "PLAINTEXT".into());
        let err = c.validate().expect_err("contradiction").to_string();
        assert!(err.contains("kafka_security_protocol"), "{err}");
        c.kafka_properties
            .0
            .insert("security.protocol".into(), "SASL_SSL".into());
        c.validate().expect("the same value in capitals agrees");
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
