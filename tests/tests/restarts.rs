//! PostgreSQL and Kafka restart under a running forwarder. These restart the
//! shared servers, so this binary's tests run one at a time (cargo runs test
//! binaries one after another).

use std::time::Duration;
use tokio::sync::Mutex;

use pg_outbox_tests::{
    read_every_committed, stack_command, with_database, write_transactions_through_restarts,
    Forwarder, Reader, TestDb,
};

const WAIT: Duration = Duration::from_secs(180);
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

async fn run_through(restarts: &[&[&str]], args: &[&str], name: &str) {
    let db = TestDb::create(name).await;
    let topic = db.create_topic("trip", 3).await;
    let forwarder = Forwarder::spawn(&db, args);
    db.wait_slot_active(WAIT).await;
    let writer = tokio::spawn(write_transactions_through_restarts(
        with_database(&db.stack.admin_url, &db.name),
        "trip".into(),
        6,
        900,
    ));
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let mut wanted = 0;
    for restart in restarts {
        wanted += 100;
        reader
            .read_until(WAIT, "the stream to flow", |r| r.len() >= wanted)
            .await;
        stack_command(restart);
        wanted = reader.records.len();
    }
    writer.await.expect("writer");

    let v = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("{name}: {v:?}");
    assert_eq!((v.lost, v.phantoms, v.order_violations), (0, 0, 0), "{v:?}");
    if args.contains(&"exactly-once") {
        assert_eq!(v.duplicates, 0, "{v:?}");
    }
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_fast_and_immediate_restarts_lose_and_duplicate_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    run_through(
        &[&["restart-pg", "fast"], &["restart-pg", "immediate"]],
        &["--delivery", "exactly-once"],
        "pg_restart",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_restart_loses_and_duplicates_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    run_through(
        &[&["restart-kafka"]],
        &["--delivery", "exactly-once"],
        "kafka_restart",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_least_once_rides_out_both_restarts_without_loss() {
    let _serial = ONE_AT_A_TIME.lock().await;
    run_through(
        &[&["restart-pg", "immediate"], &["restart-kafka"]],
        &[],
        "alo_restarts",
    )
    .await;
}
