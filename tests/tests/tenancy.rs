//! A cluster shared by several databases, each with its own outbox and its
//! own owner, neither a superuser: each database's roles reach that
//! database's outbox and no other's, in both editions, and an install made
//! when the roles were cluster-wide upgrades, keeps its logins working, and
//! is closed to other databases' logins by the operator's REVOKE.

use pg_outbox_tests::{
    connect, forwarder_command, install_sql_edition, psql_file, server_version, sqlstate,
    try_connect, unique, with_database, Edition, Stack,
};
use tokio_postgres::Client;

/// One tenant: a database, its owner (CREATEROLE, no superuser) and the
/// application and relay logins that the owner made from the database's
/// roles.
struct Tenant {
    db: String,
    owner: String,
    app: String,
    relay: String,
}

const EMIT: &str =
    "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'OrderPlaced', '{}')";

/// A URL of the stack's PostgreSQL for `user` (password `pw`) in `db`.
fn url_of(stack: &Stack, user: &str, db: &str) -> String {
    with_database(&stack.admin_url, db).replacen("postgres:postgres@", &format!("{user}:pw@"), 1)
}

async fn superuser(stack: &Stack, db: &str) -> Client {
    connect(&with_database(&stack.admin_url, db)).await
}

/// A database owned by a new CREATEROLE owner, and the outcome of installing
/// the outbox of `edition` there as that edition is installed: the
/// extension by a superuser, the SQL edition by the owner with psql (an
/// error as `SQLSTATE: message` for the extension, psql's stderr for the
/// SQL edition). `prefix` is set as pg_outbox.role_prefix.
struct Install {
    db: String,
    owner: String,
    outcome: Result<(), String>,
}

/// A new database owned by a new CREATEROLE owner: (database, owner).
async fn owned_database(stack: &Stack) -> (String, String) {
    let owner = unique("own");
    let db = unique("t_tenant");
    superuser(stack, "postgres")
        .await
        .batch_execute(&format!(
            "CREATE ROLE {owner} LOGIN CREATEROLE NOSUPERUSER PASSWORD 'pw'"
        ))
        .await
        .expect("owner");
    superuser(stack, "postgres")
        .await
        .batch_execute(&format!("CREATE DATABASE {db} OWNER {owner}"))
        .await
        .expect("database");
    (db, owner)
}

async fn install(stack: &Stack, edition: Edition, prefix: Option<&str>) -> Install {
    let (db, owner) = owned_database(stack).await;
    let outcome = match edition {
        Edition::Extension => {
            let set = prefix.map_or(String::new(), |p| {
                format!("SET pg_outbox.role_prefix = '{p}';")
            });
            let result = superuser(stack, &db)
                .await
                .batch_execute(&format!("{set} CREATE EXTENSION pg_outbox"))
                .await;
            result.map_err(|e| {
                let message = e
                    .as_db_error()
                    .map_or(e.to_string(), |d| d.message().to_owned());
                format!("{}: {message}", sqlstate::<()>(&Err(e)))
            })
        }
        Edition::Sql => {
            let url = url_of(stack, &owner, &db);
            let url = match prefix {
                Some(p) => format!("{url}?options=-c%20pg_outbox.role_prefix%3D{p}"),
                None => url,
            };
            let (ok, stderr) = psql_file(&url, &pg_outbox_tests::sql_edition_file()).await;
            if ok {
                Ok(())
            } else {
                Err(stderr)
            }
        }
    };
    Install { db, owner, outcome }
}

/// The database's role of `purpose`, as outbox.roles names it.
async fn role(stack: &Stack, db: &str, purpose: &str) -> String {
    superuser(stack, db)
        .await
        .query_one(
            "SELECT role::text FROM outbox.roles WHERE purpose = $1",
            &[&purpose],
        )
        .await
        .expect("outbox.roles names the role")
        .get(0)
}

/// A tenant whose owner makes its application and relay logins itself,
/// `CREATE ROLE ... IN ROLE`, which on PostgreSQL 16+ needs the owner to
/// hold ADMIN on the database's roles.
async fn tenant(stack: &Stack, edition: Edition) -> Tenant {
    let Install { db, owner, outcome } = install(stack, edition, None).await;
    outcome.expect("install");
    let (app, relay) = (unique("app"), unique("relay"));
    let writer_role = role(stack, &db, "writer").await;
    let relay_role = role(stack, &db, "relay").await;
    connect(&url_of(stack, &owner, &db))
        .await
        .batch_execute(&format!(
            "CREATE ROLE {app} LOGIN PASSWORD 'pw' IN ROLE {writer_role};
             CREATE ROLE {relay} LOGIN PASSWORD 'pw' IN ROLE {relay_role}"
        ))
        .await
        .expect("the owner makes its application and relay logins from the database's roles");
    Tenant {
        db,
        owner,
        app,
        relay,
    }
}

async fn events_in(stack: &Stack, db: &str) -> i64 {
    superuser(stack, db)
        .await
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .await
        .expect("count")
        .get(0)
}

/// The sequence number of the event that `login` emits into `db`.
async fn emit_as(stack: &Stack, login: &str, db: &str) -> i64 {
    connect(&url_of(stack, login, db))
        .await
        .query_one(EMIT, &[])
        .await
        .unwrap_or_else(|e| panic!("{login} emits into {db}: {e}"))
        .get(0)
}

/// What a relay login does: read events, call the relay functions.
const RELAY_CALLS: [&str; 5] = [
    "SELECT count(*) FROM outbox.events",
    "SELECT count(*) FROM outbox.relay_progress",
    "SELECT * FROM outbox.status()",
    "SELECT * FROM outbox.poll_status()",
    "SELECT outbox.ensure_publication('pg_outbox_tenancy')",
];

async fn roles_stay_in_their_database(edition: Edition) {
    let stack = Stack::from_env();
    let version = server_version(&superuser(&stack, "postgres").await).await;
    let (a, b) = (tenant(&stack, edition).await, tenant(&stack, edition).await);
    for (own, other) in [(&a, &b), (&b, &a)] {
        assert_eq!(emit_as(&stack, &own.app, &own.db).await, 1, "emit at home");

        let before = events_in(&stack, &other.db).await;
        let app_away = connect(&url_of(&stack, &own.app, &other.db)).await;
        for call in [
            EMIT,
            "SELECT * FROM outbox.emit_events('[{\"aggregate_type\": \"order\", \"aggregate_id\": \"o-2\", \"event_type\": \"E\", \"payload\": {}}]')",
            "SELECT outbox.current_seq('order', 'o-1')",
        ] {
            let refused = app_away.query(call, &[]).await;
            assert_eq!(sqlstate(&refused), "42501", "{} in {}: {call}", own.app, other.db);
        }
        assert_eq!(
            events_in(&stack, &other.db).await,
            before,
            "nothing written in {}",
            other.db
        );

        let relay_home = connect(&url_of(&stack, &own.relay, &own.db)).await;
        let relay_away = connect(&url_of(&stack, &own.relay, &other.db)).await;
        for call in RELAY_CALLS {
            let home = relay_home.query(call, &[]).await;
            assert_eq!(
                sqlstate(&home),
                "ok",
                "{} in its own {}: {call}: {home:?}",
                own.relay,
                own.db
            );
            let away = relay_away.query(call, &[]).await;
            assert_eq!(
                sqlstate(&away),
                "42501",
                "{} in {}: {call}",
                own.relay,
                other.db
            );
        }
    }

    // A login with REPLICATION may create a slot in any database it can
    // connect to and decode the events there, whatever the outbox's roles:
    // check says so while every role may connect. The owner closes its
    // database to other databases' logins: the install granted CONNECT to
    // the database's roles, so its own logins still come in.
    let b_relay_url = url_of(&stack, &b.relay, &b.db);
    let line = check_line(&stack, &b_relay_url, "connect").await;
    assert!(
        line.starts_with("warn")
            && line.contains(&format!("REVOKE CONNECT ON DATABASE {} FROM PUBLIC", b.db)),
        "{line}"
    );
    let replicator = unique("replicator");
    superuser(&stack, "postgres")
        .await
        .batch_execute(&format!(
            "CREATE ROLE {replicator} LOGIN REPLICATION PASSWORD 'pw' IN ROLE {}",
            role(&stack, &a.db, "relay").await
        ))
        .await
        .expect("a replication login of the first database");
    connect(&url_of(&stack, &b.owner, &b.db))
        .await
        .batch_execute(&format!("REVOKE CONNECT ON DATABASE {} FROM PUBLIC", b.db))
        .await
        .expect("the owner revokes CONNECT from PUBLIC");
    let refused = try_connect(&url_of(&stack, &a.app, &b.db)).await;
    assert_eq!(
        sqlstate(&refused),
        "42501",
        "{} connects to {}",
        a.app,
        b.db
    );
    let slot = unique("t_foreign");
    let (code, _, stderr) = forwarder_command(&[
        "slot",
        "create",
        "--postgres-url",
        &url_of(&stack, &replicator, &b.db),
        "--kafka-bootstrap",
        &stack.kafka,
        "--slot",
        &slot,
    ])
    .await;
    assert!(
        code != 0 && stderr.contains(&format!("permission denied for database \"{}\"", b.db)),
        "the first database's replication login makes a slot in {}: exit {code}: {stderr}",
        b.db
    );
    let slots: i64 = superuser(&stack, &b.db)
        .await
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("slots")
        .get(0);
    assert_eq!(slots, 0);
    let line = check_line(&stack, &b_relay_url, "connect").await;
    assert!(line.starts_with("ok"), "{line}");
    for login in [&b.app, &b.relay] {
        let home = try_connect(&url_of(&stack, login, &b.db)).await;
        assert_eq!(
            sqlstate(&home),
            "ok",
            "{login} connects to its own {}",
            b.db
        );
    }
    eprintln!("PostgreSQL {version}: each database's logins reach only its own outbox");
    for t in [&a, &b] {
        drop_all(&stack, &t.db, &[&t.app, &t.relay, &replicator, &t.owner]).await;
    }
}

/// Drops `db`, then its outbox roles and `logins` (the owner last).
async fn drop_all(stack: &Stack, db: &str, logins: &[&str]) {
    let roles: Vec<String> =
        match pg_outbox_tests::try_connect(&with_database(&stack.admin_url, db)).await {
            Ok(client) => client
                .query("SELECT role::text FROM outbox.roles", &[])
                .await
                .map(|rows| rows.iter().map(|r| r.get(0)).collect())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
    let admin = superuser(stack, "postgres").await;
    let _in_use = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
    for role in roles
        .iter()
        .map(String::as_str)
        .chain(logins.iter().copied())
    {
        let _left_to_stack_clean = admin
            .batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extension_roles_stay_in_their_database() {
    roles_stay_in_their_database(Edition::Extension).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_edition_roles_stay_in_their_database() {
    roles_stay_in_their_database(Edition::Sql).await;
}

/// A prefix chosen at install names the roles; a prefix whose roles
/// already serve another database, or one too long for the role names, is
/// refused with its SQLSTATE, and nothing is installed.
async fn prefixes(edition: Edition) {
    let stack = Stack::from_env();
    let chosen = unique("shop");
    let first = install(&stack, edition, Some(&chosen)).await;
    first.outcome.as_ref().expect("install with a prefix");
    assert_eq!(
        role(&stack, &first.db, "writer").await,
        format!("{chosen}_writer")
    );
    assert_eq!(
        role(&stack, &first.db, "schema_admin").await,
        format!("{chosen}_schema_admin")
    );

    let taken = install(&stack, edition, Some(&chosen)).await;
    let refused = taken
        .outcome
        .as_ref()
        .expect_err("a second database with the same roles");
    assert!(
        refused.contains(&format!(
            "role \"{chosen}_writer\" already holds privileges in database \"{}\"",
            first.db
        )),
        "{refused}"
    );
    let long = format!("x{}", unique("").repeat(3));
    let too_long = install(&stack, edition, Some(&long)).await;
    let refused_long = too_long
        .outcome
        .as_ref()
        .expect_err("a prefix too long for the role names");
    assert!(
        refused_long.contains("is longer than 50 bytes"),
        "{refused_long}"
    );
    if edition == Edition::Extension {
        assert!(refused.starts_with("42710:"), "{refused}");
        assert!(refused_long.starts_with("42622:"), "{refused_long}");
    }
    for refused in [&taken, &too_long] {
        let client = superuser(&stack, &refused.db).await;
        let row = client
            .query_one(
                "SELECT to_regnamespace('outbox') IS NULL, (SELECT count(*) FROM pg_roles WHERE rolname = $1)",
                &[&format!("{long}_writer")],
            )
            .await
            .expect("state after the refusal");
        assert_eq!(
            (row.get::<_, bool>(0), row.get::<_, i64>(1)),
            (true, 0),
            "nothing installed in {}",
            refused.db
        );
    }
    for i in [&first, &taken, &too_long] {
        drop_all(&stack, &i.db, &[&i.owner]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extension_role_prefixes() {
    prefixes(Edition::Extension).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_edition_role_prefixes() {
    prefixes(Edition::Sql).await;
}

/// The last commit whose sql/pg_outbox_sql.sql is the released 0.6.0 edition,
/// the last whose roles were cluster-wide.
const RELEASED_0_6_0_EDITION: &str = "4e7f70d";

/// A database with the outbox of 0.6.0, its privileges granted to the
/// cluster-wide roles outbox_writer, outbox_relay, ... (which the stack
/// makes once, as the tests install such releases in several databases at
/// once).
async fn install_0_6_0(stack: &Stack, edition: Edition) -> Install {
    let (db, owner) = owned_database(stack).await;
    match edition {
        Edition::Extension => superuser(stack, &db)
            .await
            .batch_execute("CREATE EXTENSION pg_outbox VERSION '0.6.0'")
            .await
            .expect("install 0.6.0"),
        Edition::Sql => {
            let file = pg_outbox_tests::released_sql_edition(RELEASED_0_6_0_EDITION, "0.6.0");
            let (ok, stderr) = psql_file(&url_of(stack, &owner, &db), &file).await;
            assert!(ok, "install the 0.6.0 edition: {stderr}");
            let _ = std::fs::remove_file(&file);
        }
    }
    Install {
        db,
        owner,
        outcome: Ok(()),
    }
}

/// The line of check `name` in what `outbox-forwarder check` says for `url`.
async fn check_line(stack: &Stack, url: &str, name: &str) -> String {
    let (_code, stdout, stderr) = forwarder_command(&[
        "check",
        "--postgres-url",
        url,
        "--kafka-bootstrap",
        &stack.kafka,
    ])
    .await;
    stdout
        .lines()
        .find(|line| line.get(6..).is_some_and(|rest| rest.starts_with(name)))
        .unwrap_or_else(|| panic!("check reports {name}: {stdout}{stderr}"))
        .to_owned()
}

async fn an_install_with_shared_roles_upgrades(edition: Edition) {
    let stack = Stack::from_env();
    let old = install_0_6_0(&stack, edition).await;
    // Logins granted the cluster-wide roles, as releases before 0.7.0 documented
    // (by the superuser: on 16+ a CREATEROLE owner may not grant them).
    let (app, relay, stranger) = (unique("app"), unique("relay"), unique("stranger"));
    superuser(&stack, "postgres")
        .await
        .batch_execute(&format!(
            "CREATE ROLE {app} LOGIN PASSWORD 'pw' IN ROLE outbox_writer;
             CREATE ROLE {relay} LOGIN PASSWORD 'pw' IN ROLE outbox_relay;
             CREATE ROLE {stranger} LOGIN PASSWORD 'pw' IN ROLE outbox_writer"
        ))
        .await
        .expect("logins of the shared roles");
    assert_eq!(emit_as(&stack, &app, &old.db).await, 1, "emit on 0.6.0");

    match edition {
        Edition::Extension => superuser(&stack, &old.db)
            .await
            .batch_execute("ALTER EXTENSION pg_outbox UPDATE")
            .await
            .expect("ALTER EXTENSION pg_outbox UPDATE"),
        Edition::Sql => install_sql_edition(&url_of(&stack, &old.owner, &old.db)).await,
    }
    let held: i64 = superuser(&stack, &old.db)
        .await
        .query_one(
            "SELECT count(*) FROM (
                 SELECT a.grantee FROM pg_proc p, aclexplode(p.proacl) a WHERE p.pronamespace = 'outbox'::regnamespace
                 UNION ALL SELECT a.grantee FROM pg_class c, aclexplode(c.relacl) a WHERE c.relnamespace = 'outbox'::regnamespace
                 UNION ALL SELECT a.grantee FROM pg_namespace n, aclexplode(n.nspacl) a WHERE n.nspname = 'outbox') g
              WHERE g.grantee IN (SELECT oid FROM pg_roles WHERE rolname LIKE 'outbox\\_%')",
            &[],
        )
        .await
        .expect("privileges of the shared roles")
        .get(0);
    assert_eq!(
        held, 0,
        "the shared roles hold no privilege of their own in the upgraded outbox"
    );

    // The logins of the shared roles work on, through them.
    let writer_role = role(&stack, &old.db, "writer").await;
    let relay_role = role(&stack, &old.db, "relay").await;
    assert_eq!(
        emit_as(&stack, &app, &old.db).await,
        2,
        "emit after the upgrade"
    );
    let relay_client = connect(&url_of(&stack, &relay, &old.db)).await;
    for call in RELAY_CALLS {
        let result = relay_client.query(call, &[]).await;
        assert_eq!(
            sqlstate(&result),
            "ok",
            "{relay} after the upgrade: {call}: {result:?}"
        );
    }
    let relay_url = url_of(&stack, &relay, &old.db);
    let line = check_line(&stack, &relay_url, "privileges").await;
    assert!(
        line.contains(&format!("run REVOKE {relay_role} FROM outbox_relay")),
        "{line}"
    );

    // The operator's steps (docs/src/sql-api.md): the logins get this database's roles,
    // then the shared roles are cut off it, by whoever made the roles (the
    // superuser for the extension, the owner for the SQL edition).
    let operator = match edition {
        Edition::Extension => superuser(&stack, &old.db).await,
        Edition::Sql => connect(&url_of(&stack, &old.owner, &old.db)).await,
    };
    let mut steps = format!("GRANT {writer_role} TO {app}; GRANT {relay_role} TO {relay};");
    for purpose in ["writer", "relay", "consumer", "schema_admin"] {
        steps += &format!(
            "REVOKE {} FROM outbox_{purpose};",
            role(&stack, &old.db, purpose).await
        );
    }
    operator
        .batch_execute(&steps)
        .await
        .expect("the operator closes the database");

    assert_eq!(
        emit_as(&stack, &app, &old.db).await,
        3,
        "emit through the database's role"
    );
    let refused = connect(&url_of(&stack, &stranger, &old.db))
        .await
        .query(EMIT, &[])
        .await;
    assert_eq!(
        sqlstate(&refused),
        "42501",
        "a login of the shared outbox_writer emits into {}",
        old.db
    );
    assert_eq!(events_in(&stack, &old.db).await, 3);
    let line = check_line(&stack, &relay_url, "privileges").await;
    assert!(
        line.contains(&format!("member of {relay_role}")) && !line.contains("REVOKE"),
        "{line}"
    );

    drop_all(&stack, &old.db, &[&app, &relay, &stranger, &old.owner]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_with_shared_roles_upgrades_and_is_closed_by_revoke() {
    an_install_with_shared_roles_upgrades(Edition::Extension).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sql_edition_with_shared_roles_upgrades_and_is_closed_by_revoke() {
    an_install_with_shared_roles_upgrades(Edition::Sql).await;
}
