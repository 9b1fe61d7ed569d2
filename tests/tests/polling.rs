//! Polling relays (`outbox-forwarder run --source poll`): leases, takeover
//! after a killed relay's leases expire, order per aggregate, nothing lost,
//! pending bookkeeping and retention. The relays log in as a role without
//! REPLICATION, as a team that cannot have a slot would.

use std::collections::HashSet;
use std::time::Duration;

use pg_outbox_tests::{
    committed_events, emit, forwarder_command, read_every_committed, wait_until, with_database,
    Forwarder, Reader, TestDb,
};
use rand::Rng;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(90);
/// Short leases, so that takeovers happen within the test.
const LEASE_MS: &str = "1500";

/// A login with outbox_relay and nothing else: no REPLICATION.
async fn poller_url(db: &TestDb) -> String {
    db.superuser()
        .await
        .batch_execute(
            "DO $$ BEGIN
                IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_poller') THEN
                    CREATE ROLE outbox_poller LOGIN NOREPLICATION PASSWORD 'poller' IN ROLE outbox_relay;
                END IF;
             END $$",
        )
        .await
        .expect("poller role");
    let url = with_database(&db.stack.forwarder_url, &db.name);
    url.replacen("outbox_forwarder:forwarder", "outbox_poller:poller", 1)
}

fn relay(db: &TestDb, url: &str, name: &str) -> Forwarder {
    Forwarder::spawn_connected(
        db,
        &[
            "--postgres-url",
            url,
            "--kafka-bootstrap",
            &db.stack.kafka,
            "--source",
            "poll",
            "--relay-name",
            name,
            "--poll-lease-ms",
            LEASE_MS,
        ],
        &[],
    )
}

async fn poll_status(client: &Client) -> (bool, i64, i64, i64) {
    let row = client
        .query_one(
            "SELECT enabled, pending_events, leases_held, relays FROM outbox.poll_status()",
            &[],
        )
        .await
        .expect("poll_status");
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_killed_at_random_lose_nothing_and_keep_aggregate_order() {
    let db = TestDb::create("poll_kill").await;
    let admin = db.admin().await;
    let enabled: bool = admin
        .query_one("SELECT outbox.enable_polling()", &[])
        .await
        .expect("enable polling")
        .get(0);
    assert!(enabled);
    let topic = db.create_topic("acct", 3).await;
    let url = poller_url(&db).await;

    let mut relays: Vec<(String, Forwarder)> = (0..3)
        .map(|i| {
            let name = format!("relay-{i}");
            let f = relay(&db, &url, &name);
            (name, f)
        })
        .collect();

    // 3 writers over 12 shared aggregates, 1 to 3 events per transaction,
    // one transaction in 6 rolled back.
    let mut writers = Vec::new();
    for _ in 0..3 {
        let mut client = db.admin().await;
        writers.push(tokio::spawn(async move {
            for n in 0..300 {
                let mut ids: Vec<usize> = (0..1 + n % 3)
                    .map(|_| rand::rng().random_range(0..12))
                    .collect();
                ids.sort();
                ids.dedup();
                let tx = client.transaction().await.expect("begin");
                for id in ids {
                    emit(&tx, "acct", &format!("acct-{id}"), "Moved", "{}").await;
                }
                if n % 6 == 5 {
                    tx.rollback().await.expect("rollback");
                } else {
                    tx.commit().await.expect("commit");
                }
                let pause = Duration::from_millis(rand::rng().random_range(0..8));
                tokio::time::sleep(pause).await;
            }
        }));
    }

    // While they write: SIGKILL a relay at random every second or so and
    // start it again, half the time under a new name (its leases must then
    // expire before another relay takes them), half the time under its own
    // (it resumes them at once). Meanwhile, note how many relays held leases.
    let mut kills = 0;
    let mut most_relays = 0;
    let mut generation = 0;
    while writers.iter().any(|w| !w.is_finished()) || kills < 6 {
        let pause = Duration::from_millis(rand::rng().random_range(600..1400));
        tokio::time::sleep(pause).await;
        most_relays = most_relays.max(poll_status(&admin).await.3);
        let victim = rand::rng().random_range(0..relays.len());
        let (name, forwarder) = relays.remove(victim);
        forwarder.kill9().await;
        kills += 1;
        let name = if kills % 2 == 0 {
            generation += 1;
            format!("{name}-{generation}")
        } else {
            name
        };
        let f = relay(&db, &url, &name);
        relays.push((name, f));
    }
    for w in writers {
        w.await.expect("writer");
    }

    let mut reader = Reader::new(&db.stack, &[&topic]);
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("{kills} relays killed; {verdict:?}");
    assert!(verdict.committed > 500, "{verdict:?}");
    assert_eq!(verdict.lost, 0, "{verdict:?}");
    assert_eq!(verdict.order_violations, 0, "{verdict:?}");
    assert_eq!(verdict.phantoms, 0, "{verdict:?}");
    assert!(kills >= 5, "only {kills} kills");
    assert!(most_relays >= 2, "the relays never shared the work");
    let took_over = relays
        .iter()
        .any(|(_, f)| f.log_text().contains("took over an expired lease"));
    assert!(
        took_over,
        "no relay took over an expired lease of a killed one"
    );

    // Everything published is done: the pending set drains.
    wait_until(WAIT, "the pending set to drain", || async {
        poll_status(&admin).await.1 == 0
    })
    .await;
    for (_, f) in relays {
        f.kill9().await;
    }
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_relay_gives_its_leases_back_and_retention_waits_for_pending_events() {
    let db = TestDb::create("poll_stop").await;
    let admin = db.admin().await;
    admin
        .batch_execute("SELECT outbox.enable_polling()")
        .await
        .expect("enable polling");
    let topic = db.create_topic("acct", 1).await;
    let url = poller_url(&db).await;

    // Pending and older than the retention window, with no relay running:
    // retention keeps them (each aggregate has a newer event too).
    for _ in 0..2 {
        for id in 0..5 {
            emit(&admin, "acct", &format!("acct-{id}"), "Opened", "{}").await;
        }
    }
    let pruned: i64 = admin
        .query_one("SELECT outbox.prune('0 seconds', 1000)", &[])
        .await
        .expect("prune")
        .get(0);
    assert_eq!(pruned, 0, "retention deleted pending events");
    assert_eq!(poll_status(&admin).await.1, 10);

    // What an operator sees: check passes without REPLICATION, and status
    // shows the pending events.
    let connection = [
        "--postgres-url",
        url.as_str(),
        "--kafka-bootstrap",
        db.stack.kafka.as_str(),
        "--source",
        "poll",
    ];
    let (code, stdout, stderr) =
        forwarder_command(&[&["check"][..], &connection[..]].concat()).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("polling") && stdout.contains("10 events pending"),
        "{stdout}"
    );
    assert!(!stdout.contains("replication"), "{stdout}");
    let (code, stdout, stderr) =
        forwarder_command(&[&["status", "--json"][..], &connection[..]].concat()).await;
    assert_eq!(code, 0, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout).expect("status json");
    assert_eq!(status["polling"]["pending_events"], 10, "{stdout}");
    assert!(
        status["warnings"].as_array().is_some_and(|w| w.is_empty()),
        "{stdout}"
    );

    let forwarder = relay(&db, &url, "stopping");
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "10 records", |r| r.len() >= 10)
        .await;
    wait_until(WAIT, "the pending set to drain", || async {
        poll_status(&admin).await.1 == 0
    })
    .await;
    // Published: now retention may take all but each aggregate's newest.
    let pruned: i64 = admin
        .query_one("SELECT outbox.prune('0 seconds', 1000)", &[])
        .await
        .expect("prune")
        .get(0);
    assert_eq!(pruned, 5);

    // Holding a lease while events keep coming, then SIGTERM: it leaves
    // holding none.
    for id in 0..5 {
        emit(&admin, "acct", &format!("acct-{id}"), "Moved", "{}").await;
    }
    reader
        .read_until(WAIT, "15 records", |r| r.len() >= 15)
        .await;
    let status = forwarder.signal_and_wait("TERM").await;
    assert!(status.success(), "{status:?}");
    let leases: i64 = admin
        .query_one(
            "SELECT count(*) FROM outbox.poll_leases WHERE relay = 'stopping'",
            &[],
        )
        .await
        .expect("leases")
        .get(0);
    assert_eq!(leases, 0, "a stopped relay kept its leases");
    let ids: HashSet<&str> = reader.records.iter().map(|r| r.event_id()).collect();
    assert_eq!(ids.len(), 15);
    assert_eq!(committed_events(&admin).await.len(), 10);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_says_what_is_wrong_where_polling_cannot_run() {
    let db = TestDb::create("poll_off").await;
    let url = poller_url(&db).await;
    let base = [
        "run",
        "--postgres-url",
        &url,
        "--kafka-bootstrap",
        &db.stack.kafka,
        "--source",
        "poll",
    ];

    // Polling was never enabled: exit 3 (setup), one line that says how.
    let (code, _, stderr) = forwarder_command(&base).await;
    assert_eq!(code, 3, "{stderr}");
    assert!(
        stderr.contains("SELECT outbox.enable_polling()"),
        "{stderr}"
    );

    // Exactly-once needs the slot: exit 2 (configuration).
    let mut args = base.to_vec();
    args.extend(["--delivery", "exactly-once"]);
    let (code, _, stderr) = forwarder_command(&args).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("exactly-once needs the slot"), "{stderr}");

    // A poll interval that leaves no time to renew leases.
    let mut args = base.to_vec();
    args.extend(["--poll-interval-ms", "2000", "--poll-lease-ms", "3000"]);
    let (code, _, stderr) = forwarder_command(&args).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("poll_interval_ms"), "{stderr}");

    // The application's calls are refused to outbox tables directly.
    let admin = db.admin().await;
    admin
        .batch_execute("SELECT outbox.enable_polling()")
        .await
        .expect("enable");
    let poller = pg_outbox_tests::connect(&url).await;
    let refused = poller
        .batch_execute("DELETE FROM outbox.pending")
        .await
        .expect_err("the relay's role deleted from outbox.pending directly");
    assert_eq!(refused.code().map(|c| c.code()), Some("42501"), "{refused}");
    db.drop().await;
}
