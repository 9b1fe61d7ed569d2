//! Poison events, an idle outbox beside a busy database, a very large
//! transaction, and a zombie forwarder: each against the real servers.

use std::time::Duration;

use pg_outbox_tests::{
    committed_events, emit, read_every_committed, verdict, wait_until, write_transactions,
    Forwarder, Reader, TestDb,
};

const WAIT: Duration = Duration::from_secs(120);
const EOS: &[&str] = &["--delivery", "exactly-once"];

/// A payload of about `bytes` bytes.
fn big_payload(bytes: usize) -> String {
    format!(r#"{{"blob": "{}"}}"#, "x".repeat(bytes))
}

/// A connection whose emit_event accepts payloads the broker will refuse:
/// the extension's own limit (1 MB) keeps them out by default.
async fn payload_limit_above_the_broker(db: &TestDb) -> tokio_postgres::Client {
    let client = db.admin().await;
    client
        .batch_execute("SET pg_outbox.max_payload_bytes = 4000000")
        .await
        .expect("set limit");
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_halts_the_forwarder_and_names_the_event() {
    let db = TestDb::create("poison_halt").await;
    let topic = db.create_topic("doc", 1).await;
    let client = payload_limit_above_the_broker(&db).await;
    let (good, _) = emit(&client, "doc", "d-1", "Written", "{}").await;
    let (poison, _) = emit(&client, "doc", "d-1", "Written", &big_payload(2_000_000)).await;

    let forwarder = Forwarder::spawn(&db, &[]);
    let log = forwarder.log.clone();
    let status = forwarder.wait_exit(WAIT).await;
    assert_eq!(status.code(), Some(4), "exit code of a poison event");
    let log = std::fs::read_to_string(log).expect("log");
    assert!(
        log.contains(&poison),
        "the log names the poison event: {log}"
    );

    // Nothing after it was skipped: the good event before it arrived, and the
    // slot still holds the poison event for the next start.
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the event before the poison", |r| {
            r.iter().any(|r| r.event_id() == good)
        })
        .await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_unordered_dead_letters_poison_goes_there_and_the_rest_continues() {
    // The behaviour before 0.6, kept as an option: later events of the
    // poison's aggregate go on to their topic (tests/tests/dead_letters.rs
    // has the default, which parks the aggregate).
    for (mode, args) in [("alo", &[][..]), ("eos", EOS)] {
        let db = TestDb::create(&format!("poison_dlq_{mode}")).await;
        let topic = db.create_topic("doc", 1).await;
        let dlq = db.create_topic("dead", 1).await;
        let forwarder = Forwarder::spawn(
            &db,
            &[
                args,
                &["--dead-letter-topic", &dlq, "--dead-letter-unordered"],
            ]
            .concat(),
        );
        db.wait_slot_active(WAIT).await;

        let client = payload_limit_above_the_broker(&db).await;
        let (before, _) = emit(&client, "doc", "d-1", "Written", "{}").await;
        let (poison, _) = emit(&client, "doc", "d-1", "Written", &big_payload(2_000_000)).await;
        let (after, _) = emit(&client, "doc", "d-1", "Written", "{}").await;
        // The API refuses such a topic; a superuser's direct insert stands in
        // for a row the forwarder cannot route.
        let unroutable: String = client
            .query_one(
                "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, topic) \
                 VALUES (outbox.uuid_v7(), 'doc', 'd-2', 1, 'Odd', '{}', 'bad topic!') RETURNING event_id::text",
                &[],
            )
            .await
            .expect("direct insert")
            .get(0);
        let (last, _) = emit(&client, "doc", "d-3", "Written", "{}").await;
        let mut reader = Reader::new(&db.stack, &[&topic]);
        reader
            .read_until(WAIT, "the events after the poison", |r| {
                r.iter().any(|r| r.event_id() == after) && r.iter().any(|r| r.event_id() == last)
            })
            .await;
        let ids: Vec<&str> = reader.records.iter().map(|r| r.event_id()).collect();
        assert!(ids.contains(&before.as_str()));
        assert!(!ids.contains(&poison.as_str()));

        let mut dead = Reader::new(&db.stack, &[&dlq]);
        dead.read_until(WAIT, "the dead-lettered events", |r| {
            r.iter().any(|r| r.event_id() == poison) && r.iter().any(|r| r.event_id() == unroutable)
        })
        .await;
        let odd = dead
            .records
            .iter()
            .find(|r| r.event_id() == unroutable)
            .expect("present");
        assert!(
            odd.header("dead_letter_reason")
                .contains("not a valid Kafka topic name"),
            "{odd:?}"
        );
        let record = dead
            .records
            .iter()
            .find(|r| r.event_id() == poison)
            .expect("present");
        assert!(
            record
                .header("dead_letter_reason")
                .contains("kafka refused"),
            "{record:?}"
        );
        assert_eq!(record.header("dead_letter_payload_dropped"), "true");
        assert!(
            forwarder
                .log_text()
                .contains("poison event sent to the dead-letter topic"),
            "the log counts it"
        );
        forwarder.kill9().await;
        db.drop().await;
    }
}

/// Bytes of WAL the slot holds back, and how far its confirmed position lags.
async fn slot_lag(client: &tokio_postgres::Client, slot: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, \
                    pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint \
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("slot lag");
    let lag = |i: usize| -> i64 {
        row.try_get::<_, i64>(i)
            .unwrap_or_else(|e| panic!("slot lag column {i}: {e:?}"))
    };
    (lag(0), lag(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_does_not_pin_wal_while_the_database_writes() {
    let db = TestDb::create("idle_wal").await;
    let forwarder = Forwarder::spawn(&db, &[]);
    db.wait_slot_active(WAIT).await;
    let client = db.admin().await;
    client
        .batch_execute("CREATE TABLE filler (id bigint, pad text)")
        .await
        .expect("table");

    // 1 GB of WAL in 110 transactions of about 10 MB, none of them in the outbox.
    let start: i64 = client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
            &[],
        )
        .await
        .expect("lsn")
        .get(0);
    let (mut peak_retained, mut peak_confirmed_lag) = (0, 0);
    let mut confirmed_positions = std::collections::HashSet::new();
    for _ in 0..110 {
        client
            .batch_execute(
                "INSERT INTO filler SELECT g, repeat('x', 1000) FROM generate_series(1, 9000) g; \
                 TRUNCATE filler;",
            )
            .await
            .expect("write");
        let (retained, lag) = slot_lag(&client, &db.slot).await;
        peak_retained = peak_retained.max(retained);
        peak_confirmed_lag = peak_confirmed_lag.max(lag);
        let confirmed: String = client
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&db.slot],
            )
            .await
            .expect("confirmed")
            .get(0);
        confirmed_positions.insert(confirmed);
    }
    let written: i64 = client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
            &[],
        )
        .await
        .expect("lsn")
        .get::<_, i64>(0)
        - start;
    assert!(
        written >= 1_000_000_000,
        "wrote only {written} bytes of WAL"
    );

    // The slot follows: PostgreSQL moves restart_lsn when it next logs the
    // running transactions (a checkpoint does so at once).
    client
        .batch_execute("CHECKPOINT")
        .await
        .expect("checkpoint");
    let limit = 64 * 1024 * 1024;
    wait_until(WAIT, "retained WAL under 64 MB", || async {
        slot_lag(&client, &db.slot).await.0 < limit
    })
    .await;
    let (retained, _) = slot_lag(&client, &db.slot).await;
    eprintln!(
        "wal written {} MB; slot: peak confirmed lag {} kB, peak retained {} MB, retained after a checkpoint {} kB",
        written >> 20,
        peak_confirmed_lag >> 10,
        peak_retained >> 20,
        retained >> 10
    );
    // The forwarder kept confirming while only other tables were written (how
    // closely depends on the machine's load, so that is printed, not asserted).
    assert!(
        confirmed_positions.len() >= 20,
        "the confirmed position moved only {} times in 110 samples",
        confirmed_positions.len()
    );
    forwarder.kill9().await;
    db.drop().await;
}

fn peak_rss_kb(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_of_200000_events_streams_through_with_bounded_memory() {
    let db = TestDb::create("large_txn").await;
    let topic = db.create_topic("bulk", 3).await;
    let forwarder = Forwarder::spawn(&db, EOS);
    db.wait_slot_active(WAIT).await;

    // About 200 MB of payload in one transaction.
    let client = db.admin().await;
    client
        .batch_execute(
            "SELECT outbox.emit_event('bulk', 'b-' || (g % 100), 'Loaded', \
                    jsonb_build_object('n', g, 'pad', repeat('p', 1000))) \
               FROM generate_series(1, 200000) g",
        )
        .await
        .expect("large transaction");

    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT * 3, "200000 records", |r| r.len() >= 200_000)
        .await;
    let rss = peak_rss_kb(forwarder.pid());
    eprintln!(
        "forwarder peak RSS for one 200000-event transaction: {} MB",
        rss >> 10
    );
    let v = verdict(&committed_events(&client).await, &reader.records);
    assert_eq!(
        (v.lost, v.duplicates, v.order_violations),
        (0, 0, 0),
        "{v:?}"
    );
    // Holding the transaction would take over 200 MB of payload alone.
    assert!(
        rss < 200 * 1024,
        "peak RSS {rss} kB: the transaction was not streamed"
    );
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_forwarder_fences_a_paused_first_one() {
    let db = TestDb::create("zombie").await;
    let topic = db.create_topic("seat", 3).await;
    let first = Forwarder::spawn(&db, EOS);
    db.wait_slot_active(WAIT).await;
    let mut writer_client = db.admin().await;
    let writer = tokio::spawn(async move {
        write_transactions(&mut writer_client, "seat", 6, 400).await;
    });
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the stream to flow", |r| r.len() >= 100)
        .await;

    // The first instance freezes mid-stream (a long GC pause, a partition);
    // the server drops its replication connection and a second one takes over.
    let signal = |sig: &str, pid: i32| {
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("kill");
    };
    signal("-STOP", first.pid());
    let admin = db.admin().await;
    admin
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1",
            &[&db.slot],
        )
        .await
        .expect("terminate walsender");
    db.wait_slot_inactive(WAIT).await;
    let second = Forwarder::spawn(&db, EOS);
    db.wait_slot_active(WAIT).await;
    writer.await.expect("writer");

    // The zombie wakes up: whatever it had in flight must not reach a
    // read_committed consumer.
    signal("-CONT", first.pid());
    let v = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("{v:?}");
    assert_eq!(
        (v.lost, v.duplicates, v.phantoms, v.order_violations),
        (0, 0, 0, 0),
        "{v:?}"
    );
    first.kill9().await;
    second.kill9().await;
    db.drop().await;
}
