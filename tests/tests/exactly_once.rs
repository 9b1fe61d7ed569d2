//! Exactly-once mode and the first-start catch-up, against the real broker:
//! a read_committed consumer must see every committed event once.

use std::collections::HashSet;
use std::time::Duration;

use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
use rdkafka::ClientConfig;

use pg_outbox_tests::{
    catalog, connect, forwarder_command, psql_file, read_every_committed, unique, wait_until,
    with_database, write_transactions, Edition, Forwarder, Reader, TestDb, Verdict,
};

const WAIT: Duration = Duration::from_secs(120);
const EOS: &[&str] = &["--delivery", "exactly-once"];

async fn read_all(db: &TestDb, reader: &mut Reader, topic: &str) -> Verdict {
    read_every_committed(db, reader, topic, WAIT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_survives_sigkill_without_duplicates() {
    let db = TestDb::create("eos_kill").await;
    let topic = db.create_topic("stock", 3).await;
    let first = Forwarder::spawn(&db, EOS);
    db.wait_slot_active(WAIT).await;

    let mut writer_client = db.admin().await;
    let writer = tokio::spawn(async move {
        write_transactions(&mut writer_client, "stock", 8, 600).await;
    });
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the stream to flow", |r| r.len() >= 200)
        .await;
    first.kill9().await;
    db.wait_slot_inactive(WAIT).await;
    let second = Forwarder::spawn(&db, EOS);
    writer.await.expect("writer");

    let v = read_all(&db, &mut reader, &topic).await;
    eprintln!("{v:?}");
    v.assert_exactly_once();
    second.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn events_written_before_the_first_start_are_delivered_once_in_both_modes() {
    for (mode, args) in [("alo", &[][..]), ("eos", EOS)] {
        let db = TestDb::create(&format!("catchup_{mode}")).await;
        let topic = db.create_topic("parcel", 3).await;
        // Written while no slot exists: only the catch-up can deliver these.
        write_transactions(&mut db.admin().await, "parcel", 6, 150).await;

        let mut writer_client = db.admin().await;
        let writer = tokio::spawn(async move {
            write_transactions(&mut writer_client, "parcel", 6, 150).await;
        });
        let forwarder = Forwarder::spawn(&db, args);
        writer.await.expect("writer");

        let mut reader = Reader::new(&db.stack, &[&topic]);
        let v = read_all(&db, &mut reader, &topic).await;
        eprintln!("{mode}: {v:?}");
        v.assert_exactly_once();
        forwarder.kill9().await;
        db.drop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_catch_up_killed_half_way_is_redone_without_duplicates() {
    let db = TestDb::create("catchup_crash").await;
    let topic = db.create_topic("crate", 2).await;
    write_transactions(&mut db.admin().await, "crate", 5, 200).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    a_catch_up_dies_and_is_redone(&db, &mut reader, &topic).await;
    db.drop().await;
}

/// The catch-up dies at its 150th produce; the next forwarder's must leave
/// Kafka with each event once.
async fn a_catch_up_dies_and_is_redone(db: &TestDb, reader: &mut Reader, topic: &str) {
    let crashing = Forwarder::spawn_with_env(db, EOS, &[("OUTBOX_FAULT", "after_produce:150")]);
    let status = crashing.wait_exit(WAIT).await;
    assert!(!status.success(), "the fault point must end the process");

    let forwarder = Forwarder::spawn(db, EOS);
    let v = read_all(db, reader, topic).await;
    eprintln!("{v:?}");
    v.assert_exactly_once();
    forwarder.kill9().await;
}

/// A slot made again after it was lost, whose catch-up dies half way: Kafka
/// holds an offset from the old slot, which must not pass for the new
/// slot's finished catch-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_catch_up_on_a_remade_slot_killed_half_way_is_redone() {
    let db = TestDb::create("remade_crash").await;
    let topic = db.create_topic("crate", 2).await;
    write_transactions(&mut db.admin().await, "crate", 5, 50).await;
    let first = Forwarder::spawn(&db, EOS);
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the first events", |r| r.len() >= 90)
        .await;
    first.kill9().await;
    db.wait_slot_inactive(WAIT).await;
    db.superuser()
        .await
        .execute("SELECT pg_drop_replication_slot($1)", &[&db.slot])
        .await
        .expect("drop the slot");
    write_transactions(&mut db.admin().await, "crate", 5, 200).await;
    a_catch_up_dies_and_is_redone(&db, &mut reader, &topic).await;
    db.drop().await;
}

/// Only the stored offset keeps a restart from publishing the Kafka
/// transaction that committed just before a crash, and the offsets topic is
/// shared: the record must be found behind thousands of other forwarders'.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stored_offset_is_found_behind_other_forwarders_records() {
    let db = TestDb::create("eos_offset_tail").await;
    let topic = db.create_topic("till", 2).await;
    let offsets = unique("offsets");
    let args = ["--delivery", "exactly-once", "--offsets-topic", &offsets];
    let first = Forwarder::spawn(&db, &args);
    db.wait_slot_active(WAIT).await;
    first.kill9().await;
    db.wait_slot_inactive(WAIT).await;

    write_transactions(&mut db.admin().await, "till", 4, 120).await;
    // Dies after its first Kafka commit, before the slot hears of it.
    let crashing = Forwarder::spawn_with_env(&db, &args, &[("OUTBOX_FAULT", "after_kafka_commit")]);
    assert!(
        !crashing.wait_exit(WAIT).await.success(),
        "the fault point must end the process"
    );

    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &db.stack.kafka)
        .create()
        .expect("producer");
    for n in 0..5_000 {
        let key = format!("another-forwarder-{}", n % 7);
        let record = BaseRecord::to(&offsets)
            .key(&key)
            .payload(r#"{"lsn":"0/1"}"#);
        producer
            .send(record)
            .map_err(|(e, _)| e)
            .expect("queue a record");
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).expect("flush");

    let second = Forwarder::spawn(&db, &args);
    write_transactions(&mut db.admin().await, "till", 4, 60).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let v = read_all(&db, &mut reader, &topic).await;
    eprintln!("{v:?}");
    v.assert_exactly_once();
    second.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sql_edition_moves_in_place_to_the_extension_under_a_running_forwarder() {
    if Edition::skip_on_sql("it installs both editions itself") {
        return;
    }
    let mut db = TestDb::create_with("move", Edition::Sql).await;
    let topic = db.create_topic("ledger", 3).await;
    let forwarder = Forwarder::spawn(&db, EOS);
    db.wait_slot_active(WAIT).await;
    // The application: a login with the writer role only, before and after.
    let app = unique("app");
    let admin = connect(&db.stack.admin_url).await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE {app} LOGIN PASSWORD 'pw' IN ROLE {}",
            db.role("writer").await
        ))
        .await
        .expect("application role");
    let mut writer = connect(&with_database(&db.stack.admin_url, &db.name).replacen(
        "postgres:postgres@",
        &format!("{app}:pw@"),
        1,
    ))
    .await;
    write_transactions(&mut writer, "ledger", 4, 100).await;
    let keyed = "SELECT event_id::text, aggregate_seq, replayed FROM outbox.emit_event('ledger', 'ledger-9', 'Keyed', '{}', idempotency_key => 'request-1')";
    let first = writer.query_one(keyed, &[]).await.expect("keyed emit");
    let moved_at: i64 = writer
        .query_one("SELECT outbox.current_seq('ledger', 'ledger-0')", &[])
        .await
        .expect("current_seq")
        .get(0);

    // The move, with the forwarder's progress bookkeeping caught behind it:
    // a session holds the last table the move locks, so the move waits
    // holding the others, the forwarder records its next position and
    // waits on relay_progress, and only then the move goes ahead. (The
    // forwarder's call then runs in the new schema.)
    let superuser_url = with_database(&db.stack.admin_url, &db.name);
    let blocker = connect(&superuser_url).await;
    blocker
        .batch_execute("BEGIN; LOCK TABLE outbox.inbox_positions IN ACCESS SHARE MODE")
        .await
        .expect("hold inbox_positions");
    let mover = tokio::spawn(async move {
        let script = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../sql/sql_edition_to_extension.sql"
        ));
        psql_file(&superuser_url, script).await
    });
    let watcher = connect(&db.stack.admin_url).await;
    wait_until(
        WAIT,
        "the forwarder's progress to wait behind the move",
        || async {
            matches!(
            watcher
                .query_opt(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'
                        AND query LIKE '%record_relay_progress%'",
                    &[&db.name],
                )
                .await,
            Ok(Some(_))
        )
        },
    )
    .await;
    blocker.batch_execute("COMMIT").await.expect("release");
    let (ok, stderr) = mover.await.expect("psql");
    assert!(ok, "{stderr}");

    // The extension now, with the catalog of a fresh install, owned by the
    // superuser that moved it.
    db.edition = Edition::Extension;
    let moved = db.admin().await;
    let fresh_name = unique("t_fresh");
    admin
        .batch_execute(&format!("CREATE DATABASE {fresh_name}"))
        .await
        .expect("create");
    let fresh = connect(&with_database(&db.stack.admin_url, &fresh_name)).await;
    fresh
        .batch_execute("CREATE EXTENSION pg_outbox")
        .await
        .expect("extension");
    let (moved_catalog, fresh_catalog) = (
        catalog::describe(&moved).await,
        catalog::describe(&fresh).await,
    );
    assert!(
        moved_catalog == fresh_catalog,
        "moved (first) and fresh (second) differ:\n{}",
        catalog::difference(&moved_catalog, &fresh_catalog)
    );
    drop(fresh);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE {fresh_name} WITH (FORCE)"))
        .await;

    // Numbering, keys and forwarding carry on.
    let continued: i64 = writer
        .query_one(
            "SELECT aggregate_seq FROM outbox.emit_event('ledger', 'ledger-0', 'Happened', '{}')",
            &[],
        )
        .await
        .expect("emit after the move")
        .get(0);
    assert_eq!(continued, moved_at + 1);
    let again = writer.query_one(keyed, &[]).await.expect("key replay");
    assert_eq!(again.get::<_, String>(0), first.get::<_, String>(0));
    assert!(again.get::<_, bool>(2), "the key replays the first event");
    write_transactions(&mut writer, "ledger", 4, 100).await;

    let mut reader = Reader::new(&db.stack, &[&topic]);
    let v = read_all(&db, &mut reader, &topic).await;
    eprintln!("{v:?}");
    assert!(v.committed > 300, "{v:?}");
    v.assert_exactly_once();
    forwarder.kill9().await;
    drop((writer, moved));
    db.drop().await;
    let _ = admin.batch_execute(&format!("DROP ROLE {app}")).await;
}

/// Drops the slot while writers commit and a forwarder with `args`
/// streams, once the recorded safe snapshot shows at least 300 events;
/// returns what Kafka got, how many events that snapshot showed just before
/// the drop, the forwarder's log and `status --json` afterwards.
async fn a_slot_lost_under_load(
    test: &str,
    args: &[&str],
) -> (Verdict, usize, String, serde_json::Value) {
    let db = TestDb::create(test).await;
    let topic = db.create_topic("parcel", 3).await;
    let forwarder = Forwarder::spawn(&db, args);
    db.wait_slot_active(WAIT).await;

    let mut writer_client = db.admin().await;
    let writer = tokio::spawn(async move {
        write_transactions(&mut writer_client, "parcel", 8, 1_500).await;
    });
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the stream to flow", |r| r.len() >= 300)
        .await;
    let admin = db.admin().await;
    let covered = || async {
        admin
            .query(
                "SELECT e.event_id::text FROM outbox.events e JOIN outbox.relay_progress p \
                  ON p.slot_name = $1 AND pg_visible_in_snapshot(e.txid, p.safe_snapshot)",
                &[&db.slot],
            )
            .await
            .expect("events in the safe snapshot")
            .into_iter()
            .map(|row| row.get::<_, String>(0))
            .collect::<HashSet<String>>()
    };
    wait_until(WAIT, "a safe snapshot showing 300 events", || async {
        covered().await.len() >= 300
    })
    .await;
    let covered = covered().await;
    db.lose_slot().await;
    writer.await.expect("writer");

    let v = read_all(&db, &mut reader, &topic).await;
    let covered_again = reader
        .records
        .iter()
        .filter(|r| covered.contains(r.event_id()))
        .count()
        - covered.len();
    assert_eq!(
        covered_again,
        0,
        "the catch-up repeated events the safe snapshot showed ({} shown)",
        covered.len()
    );
    let covered = covered.len();
    let log = forwarder.log_text();
    assert!(
        log.contains("first-start catch-up done"),
        "no new slot was made:\n{log}"
    );
    forwarder.kill9().await;
    let url = db.forwarder_url();
    let mut status = vec![
        "status",
        "--json",
        "--postgres-url",
        &url,
        "--slot",
        &db.slot,
    ];
    status.extend(["--kafka-bootstrap", &db.stack.kafka]);
    status.extend(args);
    let (code, out, err) = forwarder_command(&status).await;
    assert_eq!(code, 0, "{err}");
    let status = serde_json::from_str(&out).expect("status --json is JSON");
    db.drop().await;
    (v, covered, log, status)
}

/// Exactly-once: the new slot's catch-up delivers exactly the stored events
/// Kafka does not hold, by the horizon in the offset record (and the safe
/// snapshot in `outbox.relay_progress`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_slot_is_recovered_without_losing_or_repeating_an_event() {
    let (v, _, log, status) = a_slot_lost_under_load("eos_lost_slot", EOS).await;
    let held: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("left out events of transactions Kafka holds"))
        .collect();
    eprintln!(
        "exactly-once: {v:?}; {held:?}; {}",
        status["stored_horizon"]
    );
    v.assert_exactly_once();
    // status shows the horizon Kafka now holds.
    assert!(status["stored_horizon"]["snapshot"].is_string(), "{status}");
}

/// At-least-once keeps no horizon in Kafka: the catch-up leaves out what the
/// last safe snapshot in `outbox.relay_progress` shows (a second or two
/// behind), so nothing is lost and only the events it did not show may
/// repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_slot_under_at_least_once_loses_nothing() {
    let (v, covered, _, status) = a_slot_lost_under_load("alo_lost_slot", &[]).await;
    assert!(status["stored_horizon"].is_null(), "{status}");
    eprintln!("at-least-once: {v:?}; the safe snapshot showed {covered} events before the drop");
    assert_eq!((v.lost, v.phantoms), (0, 0), "{v:?}");
    assert!(v.duplicates <= v.committed - covered, "{v:?}");
}

/// The offsets topic a forwarder on `db` has by default: the prefix and its
/// transactional id without `pg_outbox.`.
fn own_offsets_topic(db: &TestDb) -> String {
    let id = db.transactional_id();
    format!(
        "pg_outbox.offsets.{}",
        id.strip_prefix("pg_outbox.").expect("the id's prefix")
    )
}

/// Whether a Kafka transaction is open on partition 0 of `topic`: its last
/// stable offset, which `read_committed` readers wait at, is behind its
/// high watermark.
async fn has_open_transaction(stack: &pg_outbox_tests::Stack, topic: &str) -> bool {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let (kafka, topic) = (stack.kafka.clone(), topic.to_owned());
    let watermarks = move || {
        let watermark = |isolation: &str| {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &kafka)
                .set("group.id", unique("watermarks"))
                .set("isolation.level", isolation)
                .create()
                .expect("consumer");
            consumer
                .fetch_watermarks(&topic, 0, Duration::from_secs(10))
                .map_or(0, |(_, high)| high)
        };
        watermark("read_committed") < watermark("read_uncommitted")
    };
    tokio::task::spawn_blocking(watermarks)
        .await
        .expect("watermark reader")
}

/// A forwarder killed inside its Kafka commit leaves that transaction open
/// until Kafka's transaction timeout (300 s). Another forwarder restarted
/// meanwhile reads its own offsets topic, where nothing waits: it streams
/// exactly once while that transaction is still open. The killed one then
/// fences its transaction away and delivers exactly once too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forwarder_killed_inside_its_commit_holds_back_no_other() {
    let a = TestDb::create("eos_stuck_a").await;
    let b = TestDb::create("eos_stuck_b").await;
    let a_topic = a.create_topic("ore", 2).await;
    let b_topic = b.create_topic("ore", 2).await;

    let b_first = Forwarder::spawn(&b, EOS);
    write_transactions(&mut b.admin().await, "ore", 3, 20).await;
    let mut b_reader = Reader::new(&b.stack, &[&b_topic]);
    b_reader
        .read_until(WAIT, "B's first events", |r| r.len() >= 20)
        .await;

    // A's first commit blocks after its offset record was sent: the
    // transaction stays open on the broker; then A is killed.
    let stuck = Forwarder::spawn_with_env(
        &a,
        EOS,
        &[
            ("OUTBOX_FAULT", "before_kafka_commit"),
            ("OUTBOX_FAULT_STALL_MS", "600000"),
        ],
    );
    write_transactions(&mut a.admin().await, "ore", 3, 20).await;
    let a_offsets = own_offsets_topic(&a);
    wait_until(WAIT, "A's offset record in an open transaction", || {
        has_open_transaction(&a.stack, &a_offsets)
    })
    .await;
    stuck.kill9().await;

    b_first.kill9().await;
    b.wait_slot_inactive(WAIT).await;
    let b_second = Forwarder::spawn(&b, EOS);
    write_transactions(&mut b.admin().await, "ore", 3, 20).await;
    let v = read_all(&b, &mut b_reader, &b_topic).await;
    eprintln!("B: {v:?}");
    v.assert_exactly_once();
    assert!(
        has_open_transaction(&a.stack, &a_offsets).await,
        "B must have streamed while A's transaction was still open"
    );

    a.wait_slot_inactive(WAIT).await;
    let a_again = Forwarder::spawn(&a, EOS);
    let mut a_reader = Reader::new(&a.stack, &[&a_topic]);
    let v = read_all(&a, &mut a_reader, &a_topic).await;
    eprintln!("A: {v:?}");
    v.assert_exactly_once();
    a_again.kill9().await;
    b_second.kill9().await;
    a.drop().await;
    b.drop().await;
}

/// A forwarder from before per-forwarder offsets topics kept its offset in
/// the shared `pg_outbox.offsets`. Upgraded, its first start finds it there
/// (its own topic is still empty): the Kafka transaction that committed just
/// before the crash, which the slot never heard of, is not published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upgraded_forwarder_keeps_the_offset_of_the_shared_topic() {
    let db = TestDb::create("eos_offsets_upgrade").await;
    let topic = db.create_topic("lot", 2).await;
    let shared = [
        "--delivery",
        "exactly-once",
        "--offsets-topic",
        "pg_outbox.offsets",
    ];
    let first = Forwarder::spawn(&db, &shared);
    db.wait_slot_active(WAIT).await;
    first.kill9().await;
    db.wait_slot_inactive(WAIT).await;

    write_transactions(&mut db.admin().await, "lot", 4, 120).await;
    let crashing =
        Forwarder::spawn_with_env(&db, &shared, &[("OUTBOX_FAULT", "after_kafka_commit")]);
    assert!(
        !crashing.wait_exit(WAIT).await.success(),
        "the fault point must end the process"
    );

    let upgraded = Forwarder::spawn(&db, EOS);
    write_transactions(&mut db.admin().await, "lot", 4, 60).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let v = read_all(&db, &mut reader, &topic).await;
    eprintln!("{v:?}");
    v.assert_exactly_once();
    assert!(
        upgraded
            .log_text()
            .contains("offset read from the offsets topic shared"),
        "the upgraded forwarder says where its offset came from"
    );
    upgraded.kill9().await;
    db.drop().await;
}
