//! Exactly-once mode and the first-start catch-up, against the real broker:
//! a read_committed consumer must see every committed event once.

use std::time::Duration;

use pg_outbox_tests::{
    read_every_committed, write_transactions, Forwarder, Reader, TestDb, Verdict,
};

const WAIT: Duration = Duration::from_secs(120);
const EOS: &[&str] = &["--delivery", "exactly-once"];

async fn read_all(db: &TestDb, reader: &mut Reader, topic: &str) -> Verdict {
    read_every_committed(db, reader, topic, WAIT).await
}

fn assert_exactly_once(v: &Verdict) {
    assert_eq!(
        (v.lost, v.duplicates, v.phantoms, v.order_violations),
        (0, 0, 0, 0),
        "{v:?}"
    );
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
    assert_exactly_once(&v);
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
        assert_exactly_once(&v);
        forwarder.kill9().await;
        db.drop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_catch_up_killed_half_way_is_redone_without_duplicates() {
    let db = TestDb::create("catchup_crash").await;
    let topic = db.create_topic("crate", 2).await;
    write_transactions(&mut db.admin().await, "crate", 5, 200).await;

    let crashing = Forwarder::spawn_with_env(&db, EOS, &[("OUTBOX_FAULT", "after_produce:150")]);
    let status = crashing.wait_exit(WAIT).await;
    assert!(!status.success(), "the fault point must end the process");

    let forwarder = Forwarder::spawn(&db, EOS);
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let v = read_all(&db, &mut reader, &topic).await;
    eprintln!("{v:?}");
    assert_exactly_once(&v);
    forwarder.kill9().await;
    db.drop().await;
}
