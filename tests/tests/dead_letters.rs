//! Dead letters that keep each aggregate's order: a poison event parks its
//! aggregate, whose later events are held back in the dead-letter topic while
//! other aggregates flow on; once the cause is fixed, `outbox-forwarder
//! redrive` publishes what was held, in order, once.

use std::collections::BTreeMap;
use std::time::Duration;

use pg_outbox_tests::{
    emit, forwarder_command, free_port, http_get, parse_metrics, wait_until, Forwarder, Reader,
    Record, TestDb,
};
use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;

const WAIT: Duration = Duration::from_secs(120);

fn admin(db: &TestDb) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", &db.stack.kafka)
        .create()
        .expect("admin client")
}

/// The test's topic for `aggregate_type`, refusing records above `max_bytes`.
async fn topic_with_limit(db: &TestDb, aggregate_type: &str, max_bytes: usize) -> String {
    let topic = db.topic(aggregate_type);
    let limit = max_bytes.to_string();
    let results = admin(db)
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))
                .set("max.message.bytes", &limit)],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topic");
    for result in results {
        result.expect("topic created");
    }
    topic
}

async fn raise_limit(db: &TestDb, topic: &str) {
    let results = admin(db)
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(topic))
                .set("max.message.bytes", "1000000")],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("alter topic");
    for result in results {
        result.expect("topic altered");
    }
}

/// A payload of about `bytes` bytes.
fn payload(bytes: usize) -> String {
    format!(r#"{{"blob": "{}"}}"#, "x".repeat(bytes))
}

/// The sequences of `aggregate_id` in the order the records arrived.
fn sequences(records: &[Record], aggregate_id: &str) -> Vec<i64> {
    records
        .iter()
        .filter(|r| r.key == aggregate_id)
        .map(Record::seq)
        .collect()
}

fn by_event(records: &[Record]) -> BTreeMap<&str, &Record> {
    records.iter().map(|r| (r.event_id(), r)).collect()
}

async fn redrive(db: &TestDb) -> (i32, String, String) {
    db.forwarder_subcommand("redrive").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_parks_its_aggregate_and_redrive_delivers_it_in_order_once() {
    let db = TestDb::create("parking").await;
    let topic = topic_with_limit(&db, "acct", 20_000).await;
    let dlq = db.create_topic("dead", 1).await;
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let forwarder = Forwarder::spawn(
        &db,
        &[
            "--delivery",
            "exactly-once",
            "--dead-letter-topic",
            &dlq,
            "--metrics-listen",
            &metrics,
        ],
    );
    db.wait_slot_active(WAIT).await;

    // a-1's second event is larger than the topic takes; a-2 flows beside it.
    let client = db.admin().await;
    let mut ids = BTreeMap::new();
    for (aggregate, bytes) in [
        ("a-1", 10),
        ("a-2", 10),
        ("a-1", 50_000),
        ("a-2", 10),
        ("a-1", 10),
        ("a-2", 10),
        ("a-1", 10),
    ] {
        let (id, seq) = emit(&client, "acct", aggregate, "Changed", &payload(bytes)).await;
        ids.insert((aggregate, seq), id);
    }
    let mut dead = Reader::new(&db.stack, &[&dlq]);
    dead.read_until(WAIT, "a-1's events from the poison on", |r| r.len() >= 3)
        .await;
    let (id, seq) = emit(&client, "acct", "a-1", "Changed", "{}").await;
    ids.insert(("a-1", seq), id);
    dead.read_until(WAIT, "a-1's event after the park", |r| r.len() >= 4)
        .await;

    // The dead-letter topic holds a-1 from the poison on, in order: the
    // poison with Kafka's reason, the rest parked behind it.
    let seen: Vec<(String, i64, String)> = dead
        .records
        .iter()
        .map(|r| {
            (
                r.key.clone(),
                r.seq(),
                r.header("dead_letter_reason").to_owned(),
            )
        })
        .collect();
    assert_eq!(sequences(&dead.records, "a-1"), [2, 3, 4, 5], "{seen:?}");
    let poison = &ids[&("a-1", 2)];
    let first = by_event(&dead.records)[poison.as_str()];
    assert!(
        first.header("dead_letter_reason").contains("kafka refused"),
        "{first:?}"
    );
    for seq in [3, 4, 5] {
        let held = by_event(&dead.records)[ids[&("a-1", seq)].as_str()];
        assert_eq!(held.header("dead_letter_parked_behind"), poison, "{held:?}");
    }
    // The topic has a-1 up to the poison and all of a-2.
    let mut main = Reader::new(&db.stack, &[&topic]);
    main.read_until(WAIT, "a-2's events", |r| sequences(r, "a-2").len() == 3)
        .await;
    assert_eq!(sequences(&main.records, "a-1"), [1]);

    // status and /metrics show the parked aggregate.
    let url = db.forwarder_url();
    let (code, out, err) = forwarder_command(&[
        "status",
        "--json",
        "--postgres-url",
        &url,
        "--kafka-bootstrap",
        &db.stack.kafka,
        "--slot",
        &db.slot,
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let parked = &status["parked"];
    assert_eq!(parked.as_array().map(Vec::len), Some(1), "{status}");
    assert_eq!(parked[0]["aggregate_id"], "a-1");
    assert_eq!(parked[0]["first_seq"], 2);
    assert_eq!(parked[0]["held_up_to"], 5);
    wait_until(WAIT, "the parked gauge", || async {
        let Some((200, text)) = http_get(port, "/metrics").await else {
            return false;
        };
        let figures = parse_metrics(&text);
        figures.get("outbox_parked_aggregates") == Some(&1.0)
            && figures.get("outbox_parked_events_total") == Some(&3.0)
    })
    .await;

    // The cause fixed, redrive publishes what a-1 held, in order, once.
    raise_limit(&db, &topic).await;
    let (code, out, err) = redrive(&db).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("acct/a-1: 4 events (aggregate_seq 2 to 5) published again; unparked"),
        "{out}"
    );
    let (code, out, err) = redrive(&db).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("redrive: 0 aggregates unparked"),
        "running it again publishes nothing: {out}"
    );

    // a-1 flows again.
    let (after, _) = emit(&client, "acct", "a-1", "Changed", "{}").await;
    main.read_until(WAIT, "a-1's event after the redrive", |r| {
        r.iter().any(|r| r.event_id() == after)
    })
    .await;
    main.read_to_end(&[&topic], Duration::from_secs(10)).await;
    assert_eq!(
        sequences(&main.records, "a-1"),
        [1, 2, 3, 4, 5, 6],
        "whole, in order, once"
    );
    assert_eq!(
        sequences(&main.records, "a-2"),
        [1, 2, 3],
        "a-2 undisturbed"
    );
    for seq in 2..=5 {
        let record = by_event(&main.records)[ids[&("a-1", seq)].as_str()];
        assert_eq!(record.header("redriven"), "true");
    }
    assert!(!by_event(&main.records)[after.as_str()]
        .headers
        .contains_key("redriven"));
    let (code, out, _) = forwarder_command(&[
        "status",
        "--json",
        "--postgres-url",
        &url,
        "--kafka-bootstrap",
        &db.stack.kafka,
        "--slot",
        &db.slot,
    ])
    .await;
    assert_eq!(code, 0);
    let status: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        status["parked"].as_array().map(Vec::len),
        Some(0),
        "{status}"
    );
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_still_refused_stays_parked_and_nothing_of_its_aggregate_is_published() {
    let db = TestDb::create("parking_refused").await;
    let topic = topic_with_limit(&db, "acct", 20_000).await;
    let dlq = db.create_topic("dead", 1).await;
    let forwarder = Forwarder::spawn(
        &db,
        &["--delivery", "exactly-once", "--dead-letter-topic", &dlq],
    );
    db.wait_slot_active(WAIT).await;
    let client = db.admin().await;
    emit(&client, "acct", "b-1", "Changed", &payload(50_000)).await;
    emit(&client, "acct", "b-1", "Changed", "{}").await;
    let mut dead = Reader::new(&db.stack, &[&dlq]);
    dead.read_until(WAIT, "b-1 dead-lettered and parked", |r| r.len() >= 2)
        .await;

    // Not fixed: redrive refuses, publishes nothing, keeps it parked.
    let (code, out, _) = redrive(&db).await;
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("acct/b-1: still refused, left parked"),
        "{out}"
    );
    let mut main = Reader::new(&db.stack, &[&topic]);
    main.read_to_end(&[&topic], Duration::from_secs(5)).await;
    assert!(
        sequences(&main.records, "b-1").is_empty(),
        "{:?}",
        main.records
    );
    let parked: i64 = client
        .query_one("SELECT count(*) FROM outbox.parked_aggregates", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(parked, 1);
    // check says what waits, and what to do.
    let url = db.forwarder_url();
    let (_, out, err) = forwarder_command(&[
        "check",
        "--postgres-url",
        &url,
        "--kafka-bootstrap",
        &db.stack.kafka,
        "--slot",
        &db.slot,
        "--dead-letter-topic",
        &dlq,
    ])
    .await;
    let line = out
        .lines()
        .find(|l| l.contains("dead letters"))
        .unwrap_or_else(|| panic!("no dead-letter line: {out}{err}"));
    assert!(
        line.contains("1 aggregates parked") && line.contains("outbox-forwarder redrive"),
        "{line}"
    );
    forwarder.kill9().await;
    db.drop().await;
}
