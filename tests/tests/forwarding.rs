//! End to end: emit_event in PostgreSQL, outbox-forwarder, read back from Kafka.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use pg_outbox_tests::{
    committed_events, emit, free_port, http_get, parse_metrics, server_version, wait_until,
    Forwarder, Reader, TestDb,
};
use rand::seq::SliceRandom;
use rand::Rng;

const WAIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_arrive_complete_and_in_aggregate_order() {
    let db = TestDb::create("order").await;
    let topic = db.create_topic("account", 3).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let forwarder = Forwarder::spawn(&db, &["--metrics-listen", &listen]);
    db.wait_slot_active(WAIT).await;

    // 4 connections x 250 events over 10 aggregates, in transactions of 1 to
    // 5 events. A transaction locks its aggregates in sorted order, so
    // concurrent writers cannot deadlock.
    let mut writers = Vec::new();
    for writer in 0..4 {
        let client = db.admin().await;
        writers.push(tokio::spawn(async move {
            let mut client = client;
            let mut left = 250;
            let mut n = 0;
            while left > 0 {
                let size = rand::rng().random_range(1..=5).min(left);
                let mut aggregates: Vec<String> = (0..size)
                    .map(|_| format!("acc-{}", rand::rng().random_range(0..10)))
                    .collect();
                aggregates.sort();
                let tx = client.transaction().await.expect("begin");
                for aggregate in &aggregates {
                    n += 1;
                    let payload = format!(r#"{{"writer": {writer}, "n": {n}}}"#);
                    emit(&tx, "account", aggregate, "Credited", &payload).await;
                }
                tx.commit().await.expect("commit");
                left -= size;
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }

    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "1000 records", |r| r.len() >= 1000)
        .await;
    let stored = committed_events(&db.admin().await).await;
    assert_eq!(stored.len(), 1000);

    // Every stored event arrived once, under its aggregate's key.
    let by_id: HashMap<&str, &(String, String, i64)> =
        stored.iter().map(|e| (e.0.as_str(), e)).collect();
    let mut seen = HashSet::new();
    for record in &reader.records {
        let (_, aggregate_id, seq) = by_id
            .get(record.event_id())
            .unwrap_or_else(|| panic!("record for an unknown event: {record:?}"));
        assert!(
            seen.insert(record.event_id().to_owned()),
            "duplicate {record:?}"
        );
        assert_eq!(&record.key, aggregate_id);
        assert_eq!(record.seq(), *seq);
        assert_eq!(record.header("event_type"), "Credited");
        assert_eq!(record.header("aggregate_type"), "account");
        assert_eq!(record.header("schema_version"), "1");
        assert!(record.payload.contains("\"writer\""), "{}", record.payload);
    }

    // Per aggregate: one partition, sequences 1..n without gap, and Kafka's
    // offset order is sequence order.
    let mut per_key: BTreeMap<&str, Vec<(i32, i64, i64)>> = BTreeMap::new();
    for r in &reader.records {
        per_key
            .entry(&r.key)
            .or_default()
            .push((r.partition, r.offset, r.seq()));
    }
    assert_eq!(per_key.len(), 10);
    for (key, mut records) in per_key {
        let partitions: HashSet<i32> = records.iter().map(|r| r.0).collect();
        assert_eq!(partitions.len(), 1, "{key} spread over partitions");
        records.sort();
        let seqs: Vec<i64> = records.iter().map(|r| r.2).collect();
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(
            seqs, expected,
            "{key}: offsets out of sequence order or gaps"
        );
    }

    // The metrics, scraped and parsed during the run, count what was delivered.
    let scrape = || async {
        http_get(port, "/metrics")
            .await
            .map(|(_, body)| parse_metrics(&body))
            .unwrap_or_default()
    };
    wait_until(WAIT, "the metrics to count 1000 events", || async {
        scrape().await.get("outbox_events_forwarded_total") == Some(&1000.0)
    })
    .await;
    let samples = scrape().await;
    assert!(samples["outbox_transactions_forwarded_total"] >= 1.0);
    assert!(samples["outbox_bytes_forwarded_total"] > 0.0);
    assert_eq!(
        samples["outbox_end_to_end_seconds_count"],
        samples["outbox_transactions_forwarded_total"]
    );
    assert_eq!(samples["outbox_state"], 1.0, "streaming");
    assert!(samples["outbox_confirmed_lsn"] > 0.0);
    assert_eq!(http_get(port, "/healthz").await.map(|r| r.0), Some(200));
    assert_eq!(http_get(port, "/readyz").await.map(|r| r.0), Some(200));

    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_never_reaches_kafka() {
    let db = TestDb::create("rollback").await;
    let topic = db.create_topic("cart", 1).await;
    let forwarder = Forwarder::spawn(&db, &[]);
    db.wait_slot_active(WAIT).await;

    let mut client = db.admin().await;
    let tx = client.transaction().await.expect("begin");
    let (phantom, _) = emit(&tx, "cart", "c-1", "ItemAdded", "{}").await;
    emit(&tx, "cart", "c-2", "ItemAdded", "{}").await;
    tx.rollback().await.expect("rollback");

    // The next committed event reuses the first sequence number: the rolled
    // back one left no gap.
    let (committed, seq) = emit(&client, "cart", "c-1", "CheckedOut", "{}").await;
    assert_eq!(seq, 1);

    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the committed event", |r| {
            r.iter().any(|r| r.event_id() == committed)
        })
        .await;
    // Everything written before the committed event has been read by now, and
    // the partition holds only that event.
    assert!(reader.records.iter().all(|r| r.event_id() != phantom));
    assert_eq!(reader.records.len(), 1, "{:?}", reader.records);
    assert_eq!(committed_events(&client).await.len(), 1);

    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_committed_event_survives_a_forwarder_killed_mid_stream() {
    let db = TestDb::create("kill").await;
    let topic = db.create_topic("ledger", 3).await;
    let forwarder = Forwarder::spawn(&db, &[]);
    db.wait_slot_active(WAIT).await;

    // A writer keeps committing while the forwarder is killed and restarted.
    let writer_client = db.admin().await;
    let writer = tokio::spawn(async move {
        let mut client = writer_client;
        for batch in 0..600 {
            let tx = client.transaction().await.expect("begin");
            let mut order: Vec<usize> = (0..8).collect();
            order.shuffle(&mut rand::rng());
            let mut chosen: Vec<usize> = order.into_iter().take(1 + batch % 3).collect();
            chosen.sort();
            for a in chosen {
                emit(&tx, "ledger", &format!("l-{a}"), "Posted", "{}").await;
            }
            tx.commit().await.expect("commit");
        }
    });

    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the stream to be flowing", |r| r.len() >= 200)
        .await;
    forwarder.kill9().await;
    db.wait_slot_inactive(WAIT).await;
    let restarted = Forwarder::spawn(&db, &[]);
    writer.await.expect("writer");

    let stored = committed_events(&db.admin().await).await;
    let committed: HashSet<String> = stored.iter().map(|e| e.0.clone()).collect();
    reader
        .read_until(WAIT, "every committed event", |records| {
            let seen: HashSet<&str> = records.iter().map(|r| r.event_id()).collect();
            committed.iter().all(|id| seen.contains(id.as_str()))
        })
        .await;
    let seen: HashSet<&str> = reader.records.iter().map(|r| r.event_id()).collect();
    assert!(
        seen.iter().all(|id| committed.contains(*id)),
        "a record that is not a committed event"
    );
    let duplicates = reader.records.len() - seen.len();
    eprintln!(
        "committed {}, received {}, duplicates after the kill {duplicates}",
        committed.len(),
        reader.records.len()
    );

    restarted.kill9().await;
    db.drop().await;
}

/// A URL may name several hosts, as libpq's does; the forwarder streams from
/// the one that answers as the primary, here the second: nothing listens on
/// the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_streams_from_the_host_that_answers_as_primary() {
    let db = TestDb::create("multihost").await;
    let topic = db.create_topic("parcel", 1).await;
    let url = db
        .forwarder_url()
        .replacen("@127.0.0.1:", "@127.0.0.1:1,127.0.0.1:", 1);
    assert_ne!(url, db.forwarder_url());
    let args = ["--postgres-url", &url, "--kafka-bootstrap", &db.stack.kafka];
    let forwarder = Forwarder::spawn_connected(&db, &args, &[]);
    db.wait_slot_active(WAIT).await;

    let (shipped, _) = emit(&db.admin().await, "parcel", "p-1", "Shipped", "{}").await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the event", |r| {
            r.iter().any(|r| r.event_id() == shipped)
        })
        .await;
    forwarder.kill9().await;
    db.drop().await;
}

/// On PostgreSQL 17 and later the forwarder's slot is a failover slot,
/// unless it is told otherwise; earlier versions have no such slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_is_a_failover_slot_where_the_server_has_them() {
    for (args, expected) in [(&[][..], true), (&["--no-failover-slot"][..], false)] {
        let db = TestDb::create("failover_slot").await;
        let admin = db.admin().await;
        let version = server_version(&admin).await;
        if version < 170000 {
            eprintln!("not checked on PostgreSQL {version}: failover slots came with 17");
            db.drop().await;
            return;
        }
        let forwarder = Forwarder::spawn(&db, args);
        db.wait_slot_active(WAIT).await;
        let failover: bool = admin
            .query_one(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
                &[&db.slot],
            )
            .await
            .expect("the slot")
            .get(0);
        assert_eq!(failover, expected, "{args:?}");
        forwarder.kill9().await;
        db.drop().await;
    }
}
