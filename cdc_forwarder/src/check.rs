//! `outbox-forwarder check`: is everything in place for `run`? One line per
//! check, with a fix hint when it fails. Never prints a password.

use std::time::Duration;

use std::sync::{Arc, Mutex};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;

use crate::config::{Config, SourceKind};
use crate::slot::{self, Severity};

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// Passes, with something the operator should know.
    pub warning: bool,
    /// What was found, or what to do.
    pub detail: String,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            ok: true,
            warning: false,
            detail: detail.into(),
        }
    }
    fn warn(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            warning: true,
            ..Check::ok(name, detail)
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            ok: false,
            ..Check::ok(name, detail)
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = match (self.ok, self.warning) {
            (false, _) => "FAIL",
            (true, true) => "warn",
            (true, false) => "ok  ",
        };
        write!(f, "{mark}  {:<12} {}", self.name, self.detail)
    }
}

/// Runs every check; later PostgreSQL checks are skipped when it is unreachable.
pub async fn run(config: &Config) -> Vec<Check> {
    let mut checks = postgres(config).await;
    checks.extend(kafka(config).await);
    checks
}

async fn postgres(config: &Config) -> Vec<Check> {
    let target = config.postgres.redacted();
    // Of several hosts, the one `run` would stream from.
    let primary = async {
        let primary = slot::primary(&config.postgres).await?;
        Ok::<_, crate::error::Error>((slot::connect(&primary).await?, primary.redacted()))
    };
    let (client, target) = match tokio::time::timeout(Duration::from_secs(30), primary).await {
        Ok(Ok((client, primary))) if primary != target => {
            (client, format!("{primary} (the primary of {target})"))
        }
        Ok(Ok((client, _))) => (client, target),
        Ok(Err(e)) => {
            let hint = if e.to_string().contains("TLS") {
                "check sslmode and sslrootcert (the CA that signed the server's certificate)"
            } else {
                "check the URL, the password and pg_hba.conf"
            };
            return vec![Check::fail(
                "postgres",
                format!("cannot connect to {target}: {e}; {hint}"),
            )];
        }
        Err(_) => {
            return vec![Check::fail(
                "postgres",
                format!("no answer from {target} within 30 s; check host, port and firewall"),
            )]
        }
    };
    let one = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await }
    };
    let sslmode = config.postgres.tls().mode.name();
    let tls =
        match one("SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND ssl").await {
            Ok(row) => format!("over {} (sslmode {sslmode})", row.get::<_, String>(0)),
            Err(_) => format!("without TLS (sslmode {sslmode})"),
        };
    let mut checks = vec![Check::ok(
        "postgres",
        format!("connected to {target} {tls}"),
    )];

    let slot_source = config.source == SourceKind::Slot;
    if slot_source {
        checks.push(match one("SHOW wal_level").await {
            Ok(row) if row.get::<_, String>(0) == "logical" => Check::ok("wal_level", "logical"),
            Ok(row) => Check::fail(
                "wal_level",
                format!(
                    "is {}; set wal_level = logical in postgresql.conf and restart PostgreSQL",
                    row.get::<_, String>(0)
                ),
            ),
            Err(e) => Check::fail("wal_level", e.to_string()),
        });
        checks.push(
            match one("SELECT rolreplication FROM pg_roles WHERE rolname = current_user").await {
                Ok(row) if row.get::<_, bool>(0) => {
                    Check::ok("replication", "the role has the REPLICATION attribute")
                }
                Ok(_) => Check::fail(
                    "replication",
                    format!(
                        "role {} lacks REPLICATION; run ALTER ROLE {} REPLICATION",
                        config.postgres.user(),
                        config.postgres.user()
                    ),
                ),
                Err(e) => Check::fail("replication", e.to_string()),
            },
        );
    }
    // The extension, or the SQL edition, which marks its version in the
    // schema's comment.
    let outbox = one(
        "SELECT coalesce((SELECT 'pg_outbox ' || extversion FROM pg_extension WHERE extname = 'pg_outbox'),
                         (SELECT d FROM obj_description(to_regnamespace('outbox'), 'pg_namespace') d
                           WHERE d LIKE 'pg_outbox SQL edition %'))",
    )
    .await;
    checks.push(match outbox.map(|row| row.get::<_, Option<String>>(0)) {
        Ok(Some(installed)) => Check::ok("extension", installed),
        _ => Check::fail(
            "extension",
            format!(
                "pg_outbox is not installed in {}; run CREATE EXTENSION pg_outbox as a superuser, or on managed PostgreSQL install sql/pg_outbox_sql.sql as the database owner",
                config.postgres.dbname()
            ),
        ),
    });
    checks.push(privileges(&client, config).await);
    checks.push(connect_privilege(&client).await);
    if config.parks_aggregates() {
        checks.push(parked(&client).await);
    }
    if !slot_source {
        checks.push(polling(&client).await);
        return checks;
    }
    checks.push(
        match slot::publication_exists(&client, &config.publication).await {
            Ok(true) => Check::ok("publication", format!("{} exists", config.publication)),
            Ok(false) if config.create_missing => Check::ok(
                "publication",
                format!("{} will be created on start", config.publication),
            ),
            Ok(false) => Check::fail(
                "publication",
                format!(
                    "{} is missing; run outbox-forwarder publication create",
                    config.publication
                ),
            ),
            Err(e) => Check::fail("publication", e.to_string()),
        },
    );
    checks.push(match slot::slot_exists(&client, &config.slot).await {
        Ok(true) => Check::ok("slot", format!("{} exists", config.slot)),
        Ok(false) => match one(
            "SELECT current_setting('max_replication_slots')::int > (SELECT count(*) FROM pg_replication_slots)",
        )
        .await
        {
            Ok(row) if row.get::<_, bool>(0) && config.create_missing => {
                Check::ok("slot", format!("{} will be created on start", config.slot))
            }
            Ok(row) if row.get::<_, bool>(0) => Check::fail("slot", format!("{} is missing; run outbox-forwarder slot create", config.slot)),
            Ok(_) => Check::fail("slot", "max_replication_slots is used up; raise it or drop an unused slot"),
            Err(e) => Check::fail("slot", e.to_string()),
        },
        Err(e) => Check::fail("slot", e.to_string()),
    });
    checks.push(match slot::retention(&client, &config.slot).await {
        Ok(retention) => {
            let findings = retention.findings(&config.slot);
            let text = findings
                .iter()
                .map(|(_, text)| text.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            if findings.is_empty() {
                Check::ok("retention", retention.summary())
            } else if findings
                .iter()
                .any(|(severity, _)| *severity == Severity::Error)
            {
                Check::fail("retention", text)
            } else {
                Check::warn("retention", text)
            }
        }
        Err(e) => Check::fail("retention", e.to_string()),
    });
    checks.push(failover(&client, config).await);
    checks
}

/// Dead letters that park their aggregates: the functions exist, and what
/// is parked waits for redrive.
async fn parked(client: &tokio_postgres::Client) -> Check {
    match crate::parking::figures(client).await {
        Ok((0, _)) => Check::ok("dead letters", "none parked; a dead letter parks its aggregate"),
        Ok((parked, oldest)) => Check::warn(
            "dead letters",
            format!(
                "{parked} aggregates parked behind a dead letter, the oldest for {oldest:.0} s; fix the cause, then run outbox-forwarder redrive"
            ),
        ),
        Err(crate::error::Error::Postgres(e)) => Check::fail(
            "dead letters",
            format!(
                "{}; dead letters that keep order need pg_outbox 0.6.0 or later (ALTER EXTENSION pg_outbox UPDATE, or the SQL edition's file again), or pass --dead-letter-unordered",
                crate::error::describe_postgres(&e)
            ),
        ),
        Err(e) => Check::fail("dead letters", e.to_string()),
    }
}

/// Polling relays: polling is on, with what is pending.
async fn polling(client: &tokio_postgres::Client) -> Check {
    use crate::poll::Polling;
    match crate::poll::polling(client).await {
        Ok(Polling::On) => {}
        Ok(Polling::Off) => {
            return Check::fail(
                "polling",
                "off; run SELECT outbox.enable_polling(); as the outbox's owner",
            )
        }
        Ok(Polling::NoOutbox | Polling::Unsupported) => {
            return Check::fail(
                "polling",
                "polling needs pg_outbox 0.5.0 or later (ALTER EXTENSION pg_outbox UPDATE, or the SQL edition's file again)",
            )
        }
        Err(e) => return Check::fail("polling", e.to_string()),
    }
    match client
        .query_one(
            "SELECT enabled, pending_events, leases_held FROM outbox.poll_status()",
            &[],
        )
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => Check::ok(
            "polling",
            format!(
                "enabled; {} events pending, {} aggregates leased",
                row.get::<_, i64>(1),
                row.get::<_, i64>(2)
            ),
        ),
        Ok(_) => Check::fail(
            "polling",
            "off; run SELECT outbox.enable_polling(); as the outbox's owner",
        ),
        Err(e) => Check::fail(
            "polling",
            format!(
                "{}; polling needs pg_outbox 0.5.0 or later (ALTER EXTENSION pg_outbox UPDATE, or the SQL edition's file again)",
                crate::error::describe_postgres(&e)
            ),
        ),
    }
}

/// Whether the slot survives a promotion of a standby: on 17 and later a
/// failover slot, kept in step on standbys that synchronise slots, which
/// the primary waits for when `synchronized_standby_slots` names them.
/// Whether the login holds this database's relay role: the role granted
/// EXECUTE on `outbox.ensure_publication`, read from pg_catalog, which needs
/// no privilege on schema outbox. Warns while the relay role is still held
/// by `outbox_relay`, the cluster-wide role of releases before 0.7.0, whose
/// members reach every database's outbox.
async fn privileges(client: &tokio_postgres::Client, config: &Config) -> Check {
    let rows = client
        .query(
            "SELECT a.grantee::regrole::text, pg_has_role(current_user, a.grantee, 'USAGE'),
                    coalesce(a.grantee <> to_regrole('outbox_relay')
                             AND pg_has_role(to_regrole('outbox_relay')::oid, a.grantee, 'MEMBER'), false)
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.pronamespace = to_regnamespace('outbox') AND p.proname = 'ensure_publication'
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner",
            &[],
        )
        .await;
    let rows = match rows {
        Ok(rows) if !rows.is_empty() => rows,
        Ok(_) => {
            return Check::fail(
                "privileges",
                "no relay role is granted in schema outbox; is the extension installed?",
            )
        }
        Err(e) => return Check::fail("privileges", e.to_string()),
    };
    let user = config.postgres.user();
    let role: String = rows[0].get(0);
    let Some(held) = rows.iter().find(|row| row.get::<_, bool>(1)) else {
        return Check::fail("privileges", format!("run GRANT {role} TO {user}"));
    };
    let role: String = held.get(0);
    if held.get::<_, bool>(2) {
        return Check::warn(
            "privileges",
            format!(
                "member of {role}, which the cluster-wide role outbox_relay still holds: its members reach this \
                 database's outbox from every database's login; once the relays of this database hold {role}, \
                 run REVOKE {role} FROM outbox_relay"
            ),
        );
    }
    Check::ok("privileges", format!("member of {role}"))
}

/// Whether logins of other databases may connect here. The outbox's roles
/// keep other databases' logins out of its tables and functions, but a
/// login with REPLICATION may create a slot in any database it can connect
/// to and decode the events through the publication: PostgreSQL checks no
/// table privilege there. Only CONNECT stops it, and the install granted
/// CONNECT to the database's outbox roles so that PUBLIC's can go.
async fn connect_privilege(client: &tokio_postgres::Client) -> Check {
    let row = client
        .query_one(
            "SELECT current_database()::text, has_database_privilege('public', current_database(), 'CONNECT')",
            &[],
        )
        .await;
    match row {
        Ok(row) if row.get::<_, bool>(1) => {
            let database: String = row.get(0);
            Check::warn(
                "connect",
                format!(
                    "every role may connect to {database}, so any login with REPLICATION on this cluster can \
                     create a slot here and read the outbox's events; run REVOKE CONNECT ON DATABASE {database} \
                     FROM PUBLIC (its outbox roles keep CONNECT)"
                ),
            )
        }
        Ok(row) => Check::ok(
            "connect",
            format!(
                "only roles granted CONNECT may connect to {}",
                row.get::<_, String>(0)
            ),
        ),
        Err(e) => Check::fail("connect", e.to_string()),
    }
}

async fn failover(client: &tokio_postgres::Client, config: &Config) -> Check {
    let row = match client
        .query_one(
            "SELECT current_setting('server_version_num')::int, \
                    current_setting('synchronized_standby_slots', true), \
                    (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical' AND active)",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::fail("failover", e.to_string()),
    };
    let (version, waits_for, standbys): (i32, Option<String>, i64) =
        (row.get(0), row.get(1), row.get(2));
    if version < 170000 {
        return Check::ok(
            "failover",
            format!("PostgreSQL {} has no failover slots: a promoted standby has no slot, and the forwarder's first start there delivers the stored events again", version / 10000),
        );
    }
    if !config.failover_slot {
        return Check::ok(
            "failover",
            "an ordinary slot (no_failover_slot): a promoted standby will not have it",
        );
    }
    let waits_for = waits_for.unwrap_or_default();
    match (standbys, waits_for.is_empty()) {
        (0, _) => Check::ok("failover", "a failover slot; no standby streams from this server"),
        (n, true) => Check::warn(
            "failover",
            format!("a failover slot, but synchronized_standby_slots is empty while {n} standby(s) stream from this server through physical slots: the forwarder can get ahead of a standby's copy of the slot; name their physical slots there, and give each standby sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name and a dbname in primary_conninfo"),
        ),
        (n, false) => Check::ok(
            "failover",
            format!("a failover slot; {n} standby(s) stream, and the forwarder waits for {waits_for} (each needs sync_replication_slots = on)"),
        ),
    }
}

/// Keeps the first error librdkafka reports: it says why (a refused TLS
/// certificate, failed SASL authentication) where the metadata request
/// only says that it failed.
#[derive(Clone, Default)]
struct FirstError(Arc<Mutex<Option<String>>>);

impl FirstError {
    fn keep(&self, text: String) {
        if let Ok(mut first) = self.0.lock() {
            first.get_or_insert(text);
        }
    }
}

impl ClientContext for FirstError {
    fn error(&self, error: KafkaError, reason: &str) {
        self.keep(format!("{error}: {reason}"));
    }

    fn log(&self, level: RDKafkaLogLevel, _facility: &str, message: &str) {
        if matches!(
            level,
            RDKafkaLogLevel::Emerg
                | RDKafkaLogLevel::Alert
                | RDKafkaLogLevel::Critical
                | RDKafkaLogLevel::Error
        ) {
            self.keep(message.to_owned());
        }
    }
}

impl ConsumerContext for FirstError {}

/// What the cluster's metadata says of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TopicReplicas {
    name: String,
    /// The smallest replica count among its partitions.
    replicas: usize,
    /// Partitions with fewer replicas in sync than replicas, or no leader.
    under_replicated: usize,
}

/// The cluster as `check` sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Cluster {
    brokers: usize,
    topics: Vec<TopicReplicas>,
}

impl Cluster {
    fn topic(&self, name: &str) -> Option<&TopicReplicas> {
        self.topics.iter().find(|t| t.name == name)
    }
}

/// The transaction state log, where the coordinators keep transactions.
const TRANSACTION_STATE: &str = "__transaction_state";

async fn kafka(config: &Config) -> Vec<Check> {
    let client = config.kafka_client();
    let topic = config.offsets_topic();
    let outcome = tokio::task::spawn_blocking(move || {
        let context = FirstError::default();
        let consumer: BaseConsumer<FirstError> = client
            .create_with_context(context.clone())
            .map_err(|e| e.to_string())?;
        let metadata = consumer
            .fetch_metadata(None, Duration::from_secs(10))
            .map_err(|e| {
                // Errors reach the context through the client's queue.
                let _no_message_expected = consumer.poll(Duration::from_millis(100));
                let first = context.0.lock().ok().and_then(|f| f.clone());
                first.unwrap_or_else(|| e.to_string())
            })?;
        let topics = metadata
            .topics()
            .iter()
            .map(|t| TopicReplicas {
                name: t.name().to_owned(),
                replicas: t
                    .partitions()
                    .iter()
                    .map(|p| p.replicas().len())
                    .min()
                    .unwrap_or(0),
                under_replicated: t
                    .partitions()
                    .iter()
                    .filter(|p| p.leader() < 0 || p.isr().len() < p.replicas().len())
                    .count(),
            })
            .collect();
        Ok::<_, String>(Cluster {
            brokers: metadata.brokers().len(),
            topics,
        })
    })
    .await;
    let cluster = match outcome {
        Ok(Ok(cluster)) => cluster,
        Ok(Err(e)) => {
            return vec![Check::fail(
                "kafka",
                format!(
                    "cannot reach {}: {e}; check --kafka-bootstrap, the network and the kafka_security_* / kafka_sasl_* settings",
                    config.kafka_bootstrap
                ),
            )]
        }
        Err(e) => return vec![Check::fail("kafka", e.to_string())],
    };
    let reached = Check::ok(
        "kafka",
        format!(
            "{} broker(s) at {}; offsets topic {} {}",
            cluster.brokers,
            config.kafka_bootstrap,
            topic,
            if cluster.topic(&topic).is_some() {
                "exists"
            } else {
                "will be created (exactly-once mode)"
            }
        ),
    );
    let written = written_topics(config, &cluster);
    let min_insync = min_insync_replicas(config, &written).await;
    vec![reached, replication(&cluster, &written, &min_insync)]
}

/// The topics the forwarder writes that exist now: its offsets topic, its
/// dead-letter topic, and those its topic template names.
fn written_topics(config: &Config, cluster: &Cluster) -> Vec<String> {
    let (prefix, suffix) = config
        .topic_template
        .split_once("{aggregate_type}")
        .unwrap_or((&config.topic_template, ""));
    let offsets = config.offsets_topic();
    cluster
        .topics
        .iter()
        .map(|t| t.name.as_str())
        .filter(|name| {
            *name == offsets
                || config.dead_letter_topic.as_deref() == Some(name)
                || (!name.starts_with("__")
                    && name.len() > prefix.len() + suffix.len()
                    && name.starts_with(prefix)
                    && name.ends_with(suffix))
        })
        .map(str::to_owned)
        .collect()
}

/// Each topic's `min.insync.replicas`, where the cluster tells it.
async fn min_insync_replicas(config: &Config, topics: &[String]) -> Vec<(String, u32)> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    if topics.is_empty() {
        return Vec::new();
    }
    let Ok(admin) = config
        .kafka_client()
        .create::<AdminClient<rdkafka::client::DefaultClientContext>>()
    else {
        return Vec::new();
    };
    let resources: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let Ok(results) = admin.describe_configs(&resources, &options).await else {
        return Vec::new();
    };
    results
        .into_iter()
        .filter_map(|result| {
            let resource = result.ok()?;
            let rdkafka::admin::OwnedResourceSpecifier::Topic(name) = &resource.specifier else {
                return None;
            };
            let value = resource.get("min.insync.replicas")?.value.as_deref()?;
            Some((name.clone(), value.parse().ok()?))
        })
        .collect()
}

/// On a cluster of three or more brokers: a topic the forwarder writes with
/// a single replica, or that acknowledges with a single replica in sync,
/// loses acknowledged events when one broker's disk does; transactions
/// stall while the transaction state log lacks replicas.
fn replication(cluster: &Cluster, written: &[String], min_insync: &[(String, u32)]) -> Check {
    if cluster.brokers < 3 {
        return Check::ok(
            "replicas",
            format!(
                "{} broker(s): no replicas to check (production clusters have three or more)",
                cluster.brokers
            ),
        );
    }
    let mut problems = Vec::new();
    let single: Vec<&str> = written
        .iter()
        .filter(|name| cluster.topic(name).is_some_and(|t| t.replicas <= 1))
        .map(String::as_str)
        .collect();
    if !single.is_empty() {
        problems.push(format!(
            "replication factor 1 on {}: recreate with 3 replicas (kafka-reassign-partitions adds them to a topic that exists)",
            single.join(", ")
        ));
    }
    let lone: Vec<&str> = min_insync
        .iter()
        .filter(|(name, n)| *n <= 1 && cluster.topic(name).is_some_and(|t| t.replicas > 1))
        .map(|(name, _)| name.as_str())
        .collect();
    if !lone.is_empty() {
        problems.push(format!(
            "min.insync.replicas 1 on {}: acks=all then waits for one replica only; set it to 2 (kafka-configs --alter --add-config min.insync.replicas=2)",
            lone.join(", ")
        ));
    }
    match cluster.topic(TRANSACTION_STATE) {
        Some(log) if log.replicas <= 1 => problems.push(format!(
            "the transaction state log ({TRANSACTION_STATE}) has replication factor 1: set transaction.state.log.replication.factor=3 before the first transaction"
        )),
        Some(log) if log.under_replicated > 0 => problems.push(format!(
            "the transaction state log ({TRANSACTION_STATE}) is under-replicated in {} partition(s): a broker is down or behind, and transactions stall while fewer than transaction.state.log.min.isr replicas are in sync",
            log.under_replicated
        )),
        _ => {}
    }
    if problems.is_empty() {
        Check::ok(
            "replicas",
            format!(
                "{} broker(s); {} topic(s) written have replicas and in-sync minimums above 1",
                cluster.brokers,
                written.len()
            ),
        )
    } else {
        Check::warn("replicas", problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(name: &str, replicas: usize, under_replicated: usize) -> TopicReplicas {
        TopicReplicas {
            name: name.into(),
            replicas,
            under_replicated,
        }
    }

    fn cluster(brokers: usize, topics: Vec<TopicReplicas>) -> Cluster {
        Cluster { brokers, topics }
    }

    #[test]
    fn a_written_topic_with_one_replica_or_one_in_sync_is_a_warning_on_three_brokers() {
        let topics = vec![
            topic("outbox.order", 1, 0),
            topic("outbox.invoice", 3, 0),
            topic(TRANSACTION_STATE, 3, 0),
        ];
        let written = vec!["outbox.order".to_owned(), "outbox.invoice".to_owned()];
        let insync = vec![("outbox.invoice".to_owned(), 1)];
        let check = replication(&cluster(3, topics.clone()), &written, &insync);
        assert!(check.ok && check.warning, "{check}");
        assert!(
            check
                .detail
                .contains("replication factor 1 on outbox.order"),
            "{check}"
        );
        assert!(
            check
                .detail
                .contains("min.insync.replicas 1 on outbox.invoice"),
            "{check}"
        );

        // One broker: nothing to replicate to, no warning.
        let single = replication(&cluster(1, topics), &written, &insync);
        assert!(single.ok && !single.warning, "{single}");
    }

    #[test]
    fn a_transaction_state_log_short_of_replicas_is_a_warning() {
        let written = vec!["outbox.order".to_owned()];
        let insync = vec![("outbox.order".to_owned(), 2)];
        let healthy = vec![topic("outbox.order", 3, 0), topic(TRANSACTION_STATE, 3, 0)];
        let check = replication(&cluster(3, healthy), &written, &insync);
        assert!(check.ok && !check.warning, "{check}");

        let behind = vec![topic("outbox.order", 3, 0), topic(TRANSACTION_STATE, 3, 2)];
        let check = replication(&cluster(3, behind), &written, &insync);
        assert!(check.warning, "{check}");
        assert!(
            check.detail.contains("under-replicated in 2 partition(s)"),
            "{check}"
        );

        let single = vec![topic("outbox.order", 3, 0), topic(TRANSACTION_STATE, 1, 0)];
        let check = replication(&cluster(3, single), &written, &insync);
        assert!(
            check
                .detail
                .contains("transaction.state.log.replication.factor"),
            "{check}"
        );
    }

    #[test]
    fn the_written_topics_are_the_offsets_the_dead_letters_and_the_templates() {
        let mut config = Config::new("postgres://u@h/db", "k:9092").expect("config");
        config.dead_letter_topic = Some("dlq".into());
        let names = [
            "outbox.order",
            "outbox.",
            "other.order",
            "dlq",
            "__consumer_offsets",
            &config.offsets_topic(),
        ];
        let all = cluster(3, names.iter().map(|n| topic(n, 3, 0)).collect());
        let mut written = written_topics(&config, &all);
        written.sort();
        let mut expected = vec![
            "dlq".to_owned(),
            "outbox.order".into(),
            config.offsets_topic(),
        ];
        expected.sort();
        assert_eq!(written, expected);
    }
}
