//! What an operator sees: check, status, slot and publication commands,
//! misconfigurations, graceful shutdown and a standby that takes over.

use std::time::Duration;

use pg_outbox_tests::{
    connect, forwarder_command, free_port, http_get, parse_metrics, read_every_committed, unique,
    wait_until, with_database, write_transactions, Forwarder, Reader, TestDb,
};

const WAIT: Duration = Duration::from_secs(120);
const EOS: &[&str] = &["--delivery", "exactly-once"];

fn base_args(db: &TestDb) -> Vec<String> {
    vec![
        "--postgres-url".into(),
        db.forwarder_url(),
        "--kafka-bootstrap".into(),
        db.stack.kafka.clone(),
        "--slot".into(),
        db.slot.clone(),
    ]
}

async fn run_cli(command: &[&str], args: &[String]) -> (i32, String, String) {
    let mut all: Vec<&str> = command.to_vec();
    all.extend(args.iter().map(String::as_str));
    forwarder_command(&all).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_on_a_prepared_database_and_status_parses() {
    let db = TestDb::create("cli_ok").await;
    let args = base_args(&db);
    // PostgreSQL's default lets every role connect: a warning, not a failure.
    let (code, out, _) = run_cli(&["check"], &args).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("warn")
            && l.contains(&format!(
                "REVOKE CONNECT ON DATABASE {} FROM PUBLIC",
                db.name
            ))),
        "{out}"
    );
    db.superuser()
        .await
        .batch_execute(&format!(
            "REVOKE CONNECT ON DATABASE {} FROM PUBLIC",
            db.name
        ))
        .await
        .expect("revoke CONNECT from PUBLIC");
    let (code, out, _) = run_cli(&["check"], &args).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.lines().count() >= 9 && out.lines().all(|l| l.starts_with("ok")),
        "{out}"
    );
    assert!(out.lines().any(|l| l.contains("failover")), "{out}");
    // The stack bounds what a slot may retain.
    assert!(
        out.lines()
            .any(|l| l.contains("retention") && l.contains("max_slot_wal_keep_size 8GB")),
        "{out}"
    );

    assert_eq!(run_cli(&["publication", "create"], &args).await.0, 0);
    assert_eq!(run_cli(&["slot", "create"], &args).await.0, 0);
    let (code, out, err) = run_cli(&["status", "--json"], &args).await;
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("status --json is JSON");
    let slot = json["slots"]
        .as_array()
        .expect("slots")
        .iter()
        .find(|s| s["slot"] == db.slot.as_str())
        .expect("our slot is listed");
    assert_eq!(slot["active"], false);
    assert!(slot["lag_bytes"].as_i64().is_some());
    assert_eq!(slot["wal_status"], "reserved");
    assert_eq!(json["warnings"], serde_json::json!([]));
    let (code, table, _) = run_cli(&["status"], &args).await;
    assert_eq!(code, 0);
    assert!(table.contains(&db.slot), "{table}");
    assert_eq!(run_cli(&["slot", "drop"], &args).await.0, 0);
    assert_eq!(run_cli(&["publication", "drop"], &args).await.0, 0);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_misconfiguration_gives_one_clear_line_and_a_nonzero_exit() {
    let db = TestDb::create("cli_bad").await;
    let admin = db.admin().await;
    // A replication role without the database's relay role.
    let bare = unique("bare");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {bare} LOGIN REPLICATION PASSWORD 'pw'"
        ))
        .await
        .expect("role");
    let bare_url = with_database(&db.stack.admin_url, &db.name).replacen(
        "postgres:postgres@",
        &format!("{bare}:pw@"),
        1,
    );
    let no_extension = unique("t_noext");
    admin
        .batch_execute(&format!("CREATE DATABASE {no_extension}"))
        .await
        .expect("db");

    let grant_relay = format!("GRANT {} TO {bare}", db.role("relay").await);
    let wrong_password = db.forwarder_url().replacen(":forwarder@", ":wrong@", 1);
    let no_ext_url = with_database(&db.stack.forwarder_url, &no_extension);
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "wrong password",
            vec![
                "check",
                "--postgres-url",
                &wrong_password,
                "--kafka-bootstrap",
                &db.stack.kafka,
            ],
            "password authentication failed",
        ),
        (
            "unreachable kafka",
            vec![
                "check",
                "--postgres-url",
                &bare_url,
                "--kafka-bootstrap",
                "127.0.0.1:1",
            ],
            "cannot reach 127.0.0.1:1",
        ),
        (
            "missing privilege",
            vec![
                "check",
                "--postgres-url",
                &bare_url,
                "--kafka-bootstrap",
                &db.stack.kafka,
            ],
            &grant_relay,
        ),
        (
            "extension missing",
            vec![
                "check",
                "--postgres-url",
                &no_ext_url,
                "--kafka-bootstrap",
                &db.stack.kafka,
            ],
            "CREATE EXTENSION pg_outbox",
        ),
    ];
    for (what, args, expected) in cases {
        let (code, out, err) = forwarder_command(&args).await;
        assert_ne!(code, 0, "{what}: exit 0");
        let failing: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL")).collect();
        assert!(
            failing.iter().any(|l| l.contains(expected)),
            "{what}: no FAIL line with {expected:?} in\n{out}"
        );
        assert_eq!(
            err.lines().count(),
            1,
            "{what}: one line on stderr, got {err:?}"
        );
        assert!(
            !out.contains(":pw@") && !out.contains(":wrong@") && !err.contains("wrong@"),
            "a password leaked"
        );
    }

    let bad_run: Vec<(&str, Vec<&str>)> = vec![
        (
            "bad url",
            vec![
                "run",
                "--postgres-url",
                "postgres://u:secret@h:notaport/db",
                "--kafka-bootstrap",
                "k:1",
            ],
        ),
        (
            "bad slot name",
            vec![
                "run",
                "--postgres-url",
                "postgres://u:secret@h/db",
                "--kafka-bootstrap",
                "k:1",
                "--slot",
                "Bad-Slot",
            ],
        ),
        (
            "bad topic template",
            vec![
                "run",
                "--postgres-url",
                "postgres://u:secret@h/db",
                "--kafka-bootstrap",
                "k:1",
                "--topic-template",
                "no spaces {aggregate_type}",
            ],
        ),
        ("unknown flag", vec!["run", "--no-such-flag"]),
    ];
    for (what, args) in bad_run {
        let (code, _, err) = forwarder_command(&args).await;
        assert_eq!(code, 2, "{what}: {err}");
        assert!(
            !err.contains("secret"),
            "{what}: the password leaked: {err}"
        );
    }
    let (code, _, err) = forwarder_command(&[
        "run",
        "--postgres-url",
        "postgres://u:secret@h/db",
        "--kafka-bootstrap",
        "k:1",
        "--slot",
        "Bad-Slot",
    ])
    .await;
    assert_eq!((code, err.lines().count()), (2, 1), "{err}");

    admin
        .batch_execute(&format!("DROP DATABASE {no_extension}"))
        .await
        .expect("drop db");
    drop(admin);
    db.drop().await;
    let _ = connect(&pg_outbox_tests::Stack::from_env().admin_url)
        .await
        .batch_execute(&format!("DROP ROLE {bare}"))
        .await;
}

/// Starts a writer of 400 transactions on `aggregate_type` and returns it
/// with a reader of `topic` that has already seen the stream flow.
async fn write_while_reading(
    db: &TestDb,
    aggregate_type: &'static str,
    topic: &str,
) -> (tokio::task::JoinHandle<()>, Reader) {
    let mut client = db.admin().await;
    let writer =
        tokio::spawn(async move { write_transactions(&mut client, aggregate_type, 5, 400).await });
    let mut reader = Reader::new(&db.stack, &[topic]);
    reader
        .read_until(WAIT, "the stream to flow", |r| r.len() >= 100)
        .await;
    (writer, reader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_drains_and_exits_zero_losing_nothing() {
    for (mode, args) in [("alo", &[][..]), ("eos", EOS)] {
        let db = TestDb::create(&format!("drain_{mode}")).await;
        let topic = db.create_topic("box", 3).await;
        let first = Forwarder::spawn(&db, args);
        db.wait_slot_active(WAIT).await;
        let (writer, mut reader) = write_while_reading(&db, "box", &topic).await;
        let status = first.signal_and_wait("TERM").await;
        assert_eq!(status.code(), Some(0), "{mode}: graceful exit");
        let second = Forwarder::spawn(&db, args);
        writer.await.expect("writer");

        let v = read_every_committed(&db, &mut reader, &topic, WAIT).await;
        eprintln!("{mode}: {v:?}");
        assert_eq!((v.lost, v.phantoms, v.order_violations), (0, 0, 0), "{v:?}");
        // A drained stop confirms what it delivered: nothing is sent twice.
        assert_eq!(v.duplicates, 0, "{mode}: {v:?}");
        second.kill9().await;
        db.drop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_waits_then_takes_over_when_the_active_instance_dies() {
    let db = TestDb::create("standby").await;
    let topic = db.create_topic("lane", 3).await;
    let (active_port, standby_port) = (free_port(), free_port());
    let listen = |port: u16| format!("127.0.0.1:{port}");
    let active_listen = listen(active_port);
    let active = Forwarder::spawn(&db, &[EOS, &["--metrics-listen", &active_listen]].concat());
    db.wait_slot_active(WAIT).await;
    let standby_listen = listen(standby_port);
    let standby = Forwarder::spawn(&db, &[EOS, &["--metrics-listen", &standby_listen]].concat());

    let state = |port: u16| async move {
        http_get(port, "/metrics")
            .await
            .map(|(_, body)| parse_metrics(&body))
            .and_then(|m| m.get("outbox_state").copied())
    };
    wait_until(WAIT, "the second instance to report standby", || async {
        state(standby_port).await == Some(2.0)
    })
    .await;
    let (code, body) = http_get(standby_port, "/readyz")
        .await
        .expect("readyz answers");
    assert_eq!(code, 503);
    assert!(body.contains("not ready: standby"), "{body}");
    // Asked as a Kubernetes readiness probe asks it: a standby that can take
    // over counts as ready.
    let (code, body) = http_get(standby_port, "/readyz?standby=ready")
        .await
        .expect("readyz answers");
    assert_eq!((code, body.as_str()), (200, "ready: standby\n"));
    wait_until(WAIT, "the active instance to be ready", || async {
        http_get(active_port, "/readyz").await.map(|r| r.0) == Some(200)
    })
    .await;

    let (writer, mut reader) = write_while_reading(&db, "lane", &topic).await;
    active.kill9().await;
    let died = std::time::Instant::now();
    wait_until(WAIT, "the standby to take over", || async {
        state(standby_port).await == Some(1.0)
    })
    .await;
    eprintln!(
        "standby took over {:.1} s after the active instance died",
        died.elapsed().as_secs_f64()
    );
    writer.await.expect("writer");

    let v = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    assert_eq!(
        (v.lost, v.duplicates, v.phantoms, v.order_violations),
        (0, 0, 0, 0),
        "{v:?}"
    );
    standby.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_republishes_an_aggregate_from_a_sequence_marked_as_replayed() {
    let db = TestDb::create("replay").await;
    let topic = db.create_topic("order", 2).await;
    let forwarder = Forwarder::spawn(&db, &[]);
    db.wait_slot_active(WAIT).await;
    let client = db.admin().await;
    for _ in 0..10 {
        pg_outbox_tests::emit(&client, "order", "o-1", "Changed", "{}").await;
    }
    pg_outbox_tests::emit(&client, "order", "o-2", "Changed", "{}").await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "11 records", |r| r.len() >= 11)
        .await;

    let mut args = base_args(&db);
    args.extend(["--topic-template".to_owned(), db.topic_template()]);
    let (code, out, err) = run_cli(
        &[
            "replay",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "o-1",
            "--from-seq",
            "4",
        ],
        &args,
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("replayed 7 events"), "{out}");
    reader
        .read_until(WAIT, "the replayed records", |r| r.len() >= 18)
        .await;
    let replayed: Vec<i64> = reader
        .records
        .iter()
        .filter(|r| r.headers.get("replayed").map(String::as_str) == Some("true"))
        .map(|r| r.seq())
        .collect();
    assert_eq!(replayed, (4..=10).collect::<Vec<i64>>());
    forwarder.kill9().await;
    db.drop().await;
}
