//! Shards: the outbox split between forwarders by the hash of the
//! aggregate. Each shard's forwarder must carry its own aggregates' events
//! and no other's, and the shards together every committed event once, in
//! order per aggregate, through kills and first-start catch-ups.

use std::collections::HashSet;
use std::time::Duration;

use pg_outbox_tests::{
    forwarder_command, read_every_committed, write_transactions, Forwarder, Reader, TestDb,
};

const WAIT: Duration = Duration::from_secs(120);

fn exactly_once_shard(shard: &str) -> [&str; 4] {
    ["--delivery", "exactly-once", "--shard", shard]
}

/// The ids of the stored events whose aggregate is in shard `index` of 2.
async fn shard_events(db: &TestDb, index: i32) -> HashSet<String> {
    db.admin()
        .await
        .query(
            "SELECT event_id::text FROM outbox.events WHERE aggregate_hash % 2 = $1",
            &[&index],
        )
        .await
        .expect("read events")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_shard_carries_its_own_aggregates_and_together_every_event_once() {
    let db = TestDb::create("shards").await;
    let topic = db.create_topic("order", 3).await;
    let slot = |index: u32| format!("{}_{index}_of_2", db.slot);
    // Stored before any forwarder runs: only the catch-ups deliver these.
    write_transactions(&mut db.admin().await, "order", 24, 150).await;
    let first = Forwarder::spawn(&db, &exactly_once_shard("0/2"));
    db.wait_named_slot_active(&slot(0), WAIT).await;
    write_transactions(&mut db.admin().await, "order", 24, 150).await;

    // Shard 0 alone: every event of its aggregates and none of the others'.
    let (ours, theirs) = (shard_events(&db, 0).await, shard_events(&db, 1).await);
    assert!(
        !ours.is_empty() && !theirs.is_empty(),
        "24 aggregates fall in both shards"
    );
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "shard 0's events", |records| {
            let seen: HashSet<&str> = records.iter().map(|r| r.event_id()).collect();
            ours.iter().all(|id| seen.contains(id.as_str()))
        })
        .await;
    reader.read_to_end(&[&topic], WAIT).await;
    let strays: Vec<&str> = reader
        .records
        .iter()
        .map(|r| r.event_id())
        .filter(|id| !ours.contains(*id))
        .collect();
    assert!(
        strays.is_empty(),
        "shard 0 published other shards' events: {strays:?}"
    );

    // The second shard catches up and streams beside the first, which is
    // killed and restarted while writers go on.
    let second = Forwarder::spawn(&db, &exactly_once_shard("1/2"));
    let mut writer_client = db.admin().await;
    let writer = tokio::spawn(async move {
        write_transactions(&mut writer_client, "order", 24, 400).await;
    });
    db.wait_named_slot_active(&slot(1), WAIT).await;
    first.kill9().await;
    db.wait_named_slot_inactive(&slot(0), WAIT).await;
    let first = Forwarder::spawn(&db, &exactly_once_shard("0/2"));
    writer.await.expect("writer");
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("{verdict:?}");
    verdict.assert_exactly_once();

    // status shows each shard's slot; check knows the shard's publication
    // and refuses it to a forwarder of every event.
    let (url, template) = (db.forwarder_url(), db.topic_template());
    let base = [
        "--postgres-url",
        url.as_str(),
        "--kafka-bootstrap",
        db.stack.kafka.as_str(),
        "--slot",
        db.slot.as_str(),
        "--topic-template",
        template.as_str(),
    ];
    let run = |extra: &'static [&'static str]| {
        // The subcommand first, then how to connect, then its options.
        let mut args: Vec<&str> = extra[..1].to_vec();
        args.extend(base);
        args.extend(&extra[1..]);
        async move { forwarder_command(&args).await }
    };
    let (code, out, err) = run(&["status", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("status --json");
    let shards: Vec<(String, String)> = status["slots"]
        .as_array()
        .expect("slots")
        .iter()
        .map(|s| {
            (
                s["slot"].as_str().unwrap_or("").to_owned(),
                s["shard"].as_str().unwrap_or("-").to_owned(),
            )
        })
        .collect();
    assert!(shards.contains(&(slot(0), "0/2".into())), "{shards:?}");
    assert!(shards.contains(&(slot(1), "1/2".into())), "{shards:?}");
    let (code, out, err) = run(&["check", "--shard", "1/2"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("shard 1/2"), "{out}");
    let (code, out, err) = run(&["check", "--publication", "pg_outbox_1_of_2"]).await;
    assert_ne!(
        code, 0,
        "a shard's publication does not pass for every event's: {out}"
    );
    assert!(
        format!("{out}{err}").contains("((aggregate_hash % 2) = 1)"),
        "{out}{err}"
    );
    first.kill9().await;
    second.kill9().await;
    db.drop().await;
}
