//! Exactly-once mode and the first-start catch-up, against the real broker:
//! a read_committed consumer must see every committed event once.

use std::time::Duration;

use pg_outbox_tests::{
    catalog, connect, psql_file, read_every_committed, unique, wait_until, with_database,
    write_transactions, Edition, Forwarder, Reader, TestDb, Verdict,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sql_edition_moves_in_place_to_the_extension_under_a_running_forwarder() {
    if Edition::skip_on_sql("it installs both editions itself") {
        return;
    }
    let mut db = TestDb::create_with("move", Edition::Sql).await;
    let topic = db.create_topic("ledger", 3).await;
    let forwarder = Forwarder::spawn(&db, EOS);
    db.wait_slot_active(WAIT).await;
    // The application: a login with outbox_writer only, before and after.
    let app = unique("app");
    let admin = connect(&db.stack.admin_url).await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE {app} LOGIN PASSWORD 'pw' IN ROLE outbox_writer"
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
    assert_exactly_once(&v);
    forwarder.kill9().await;
    drop((writer, moved));
    db.drop().await;
    let _ = admin.batch_execute(&format!("DROP ROLE {app}")).await;
}
