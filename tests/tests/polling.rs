//! Polling relays (`outbox-forwarder run --source poll`): leases, takeover
//! after a killed relay's leases expire, order per aggregate, nothing lost,
//! pending bookkeeping and retention. The relays log in as a role without
//! REPLICATION, as a team that cannot have a slot would.

use std::collections::HashSet;
use std::time::Duration;

use pg_outbox_tests::{
    committed_events, emit, forwarder_command, free_port, http_get, parse_metrics,
    read_every_committed, wait_until, with_database, Forwarder, Reader, TestDb,
};
use rand::Rng;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(90);
/// Short leases, so that takeovers happen within the test.
const LEASE_MS: &str = "1500";

/// A login with the database's relay role and nothing else: no REPLICATION.
async fn poller_url(db: &TestDb) -> String {
    db.superuser()
        .await
        .batch_execute(&format!(
            "DO $$ BEGIN
                IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_poller') THEN
                    CREATE ROLE outbox_poller LOGIN NOREPLICATION PASSWORD 'poller';
                END IF;
             END $$;
             GRANT {} TO outbox_poller",
            db.role("relay").await
        ))
        .await
        .expect("poller role");
    let url = with_database(&db.stack.forwarder_url, &db.name);
    url.replacen("outbox_forwarder:forwarder", "outbox_poller:poller", 1)
}

/// A database with polling enabled (asserted: it was off), the topic of
/// aggregate type `acct` and the relays' URL.
async fn polling_db(test: &str, partitions: i32) -> (TestDb, Client, String, String) {
    let db = TestDb::create(test).await;
    let admin = db.admin().await;
    let enabled: bool = admin
        .query_one("SELECT outbox.enable_polling()", &[])
        .await
        .expect("enable polling")
        .get(0);
    assert!(enabled);
    let topic = db.create_topic("acct", partitions).await;
    let url = poller_url(&db).await;
    (db, admin, topic, url)
}

fn relay(db: &TestDb, url: &str, name: &str) -> Forwarder {
    relay_with(db, url, name, &[])
}

fn relay_with(db: &TestDb, url: &str, name: &str, extra: &[&str]) -> Forwarder {
    relay_with_env(db, url, name, extra, &[])
}

/// A relay with environment variables of its own (`OUTBOX_FAULT`).
fn relay_with_env(
    db: &TestDb,
    url: &str,
    name: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Forwarder {
    let mut args = vec![
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
    ];
    args.extend(extra);
    Forwarder::spawn_connected(db, &args, env)
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
    let (db, admin, topic, url) = polling_db("poll_kill", 3).await;

    // A relay holds at most 4 of the 12 aggregates, so that while more
    // than 4 have pending events the work is shared by construction.
    let relay = |name: &str| relay_with(&db, &url, name, &["--poll-max-aggregates", "4"]);
    let mut relays: Vec<(String, Forwarder)> = (0..3)
        .map(|i| {
            let name = format!("relay-{i}");
            let f = relay(&name);
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

    // Meanwhile, note the most relays that held leases at once.
    let sampler = {
        let admin = db.admin().await;
        let writing: Vec<_> = writers.iter().map(|w| w.abort_handle()).collect();
        tokio::spawn(async move {
            let mut most = 0;
            while writing.iter().any(|w| !w.is_finished()) {
                most = most.max(poll_status(&admin).await.3);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        })
    };

    // While they write: SIGKILL a relay at random every second or so and
    // start it again, half the time under a new name (its leases must then
    // expire before another relay takes them), half the time under its own
    // (it resumes them at once).
    let mut kills = 0;
    let mut logs = Vec::new();
    let mut generation = 0;
    while writers.iter().any(|w| !w.is_finished()) || kills < 6 {
        let pause = Duration::from_millis(rand::rng().random_range(600..1400));
        tokio::time::sleep(pause).await;
        let victim = rand::rng().random_range(0..relays.len());
        let (name, forwarder) = relays.remove(victim);
        logs.push(forwarder.log.clone());
        forwarder.kill9().await;
        kills += 1;
        let name = if kills % 2 == 0 {
            generation += 1;
            format!("{name}-{generation}")
        } else {
            name
        };
        let f = relay(&name);
        relays.push((name, f));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let most_relays = sampler.await.expect("lease sampler");

    let mut reader = Reader::new(&db.stack, &[&topic]);
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    logs.extend(relays.iter().map(|(_, f)| f.log.clone()));
    let takeovers: usize = logs
        .iter()
        .map(|l| {
            std::fs::read_to_string(l)
                .unwrap_or_default()
                .matches("took over an expired lease")
                .count()
        })
        .sum();
    eprintln!("{kills} relays killed, {takeovers} expired leases taken over; {verdict:?}");
    assert!(verdict.committed > 500, "{verdict:?}");
    assert_eq!(verdict.lost, 0, "{verdict:?}");
    assert_eq!(verdict.order_violations, 0, "{verdict:?}");
    assert_eq!(verdict.phantoms, 0, "{verdict:?}");
    assert!(kills >= 5, "only {kills} kills");
    assert!(most_relays >= 2, "the relays never shared the work");
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
    let (db, admin, topic, url) = polling_db("poll_stop", 1).await;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_forwarder_takes_over_from_polling_relays_where_they_stopped() {
    let (db, admin, topic, url) = polling_db("poll_to_slot", 2).await;
    let emit_round = |n: usize| {
        let admin = &admin;
        async move {
            for i in 0..n {
                emit(admin, "acct", &format!("acct-{}", i % 5), "Moved", "{}").await;
            }
        }
    };

    // A team starts with polling.
    let poller = relay(&db, &url, "before-the-slot");
    emit_round(10).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "10 records", |r| r.len() >= 10)
        .await;
    wait_until(WAIT, "the pending set to drain", || async {
        poll_status(&admin).await.1 == 0
    })
    .await;
    let status = poller.signal_and_wait("TERM").await;
    assert!(status.success(), "{status:?}");

    // Five more while no relay runs, then the slot forwarder's first start:
    // its catch-up delivers those five, not the ten the relay published.
    emit_round(5).await;
    let forwarder = Forwarder::spawn(&db, &[]);
    db.wait_slot_active(WAIT).await;
    emit_round(3).await;
    // Polling off: the slot alone from here.
    let forgotten: i64 = admin
        .query_one("SELECT outbox.disable_polling()", &[])
        .await
        .expect("disable polling")
        .get(0);
    // The slot does not mark events done: the five and the three it
    // delivered were still pending.
    assert_eq!(forgotten, 8, "pending when polling stopped");
    emit_round(2).await;

    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    assert_eq!(verdict.committed, 20, "{verdict:?}");
    assert_eq!(verdict.lost, 0, "{verdict:?}");
    assert_eq!(verdict.duplicates, 0, "{verdict:?}");
    assert_eq!(verdict.order_violations, 0, "{verdict:?}");
    assert!(
        forwarder
            .log_text()
            .contains("the catch-up delivers only the events still pending"),
        "{}",
        forwarder.log_text()
    );
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregate_leased_by_a_frozen_relay_waits_for_its_lease_to_expire() {
    let (db, admin, topic, url) = polling_db("poll_expiry", 1).await;

    // Three events of acct-1 and one of acct-2 pending, and a relay that
    // froze right after leasing acct-1 for 8 s (its lease taken here, in its
    // name: the first pending aggregate in key order).
    for _ in 0..3 {
        emit(&admin, "acct", "acct-1", "Moved", "{}").await;
    }
    emit(&admin, "acct", "acct-2", "Moved", "{}").await;
    let poller = pg_outbox_tests::connect(&url).await;
    let leased: String = poller
        .query_one(
            "SELECT aggregate_id FROM outbox.poll_lease('frozen', '8 seconds', 1, 1)",
            &[],
        )
        .await
        .expect("lease in the frozen relay's name")
        .get(0);
    assert_eq!(leased, "acct-1");
    let expires: std::time::SystemTime = admin
        .query_one(
            "SELECT expires_at FROM outbox.poll_leases WHERE relay = 'frozen'",
            &[],
        )
        .await
        .expect("the frozen relay's lease")
        .get(0);

    // A live relay publishes acct-2, and leaves acct-1 alone while the
    // frozen relay's lease lasts; its metrics show acct-1's three pending.
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let live = relay_with(&db, &url, "live", &["--metrics-listen", &listen]);
    let scrape = || async {
        http_get(port, "/metrics")
            .await
            .map(|(_, body)| parse_metrics(&body))
            .unwrap_or_default()
    };
    let mut metrics_showed_pending = false;
    let sample = "SELECT clock_timestamp() < $1, \
                         (SELECT relay FROM outbox.poll_leases WHERE aggregate_id = 'acct-1'), \
                         (SELECT count(*) FROM outbox.pending WHERE aggregate_id = 'acct-1'), \
                         (SELECT count(*) FROM outbox.pending WHERE aggregate_id = 'acct-2')";
    let mut saw_acct2_done = false;
    loop {
        let row = admin.query_one(sample, &[&expires]).await.expect("sample");
        let (lease_lives, holder, acct1, acct2): (bool, Option<String>, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if !lease_lives {
            break;
        }
        assert_eq!(
            holder.as_deref(),
            Some("frozen"),
            "acct-1's lease was taken before it expired"
        );
        assert_eq!(
            acct1, 3,
            "acct-1 published while another relay held its lease"
        );
        saw_acct2_done |= acct2 == 0;
        if saw_acct2_done && !metrics_showed_pending {
            let m = scrape().await;
            metrics_showed_pending = m.get("outbox_poll_pending_events") == Some(&3.0)
                && m.get("outbox_poll_oldest_pending_milliseconds") > Some(&0.0);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        metrics_showed_pending,
        "/metrics never showed the three pending events of acct-1: {:?}",
        scrape().await
    );
    assert!(
        saw_acct2_done,
        "the live relay did not publish the free aggregate within 8 s"
    );

    // Expired: the live relay takes acct-1 over, from its first event.
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "all four events", |r| r.len() >= 4)
        .await;
    let seqs: Vec<i64> = reader
        .records
        .iter()
        .filter(|r| r.key == "acct-1")
        .map(|r| r.seq())
        .collect();
    assert_eq!(seqs, [1, 2, 3]);
    wait_until(WAIT, "the takeover in the live relay's log", || async {
        live.log_text().contains("took over an expired lease")
    })
    .await;
    wait_until(
        WAIT,
        "the metrics to count the takeover and no pending",
        || async {
            let m = scrape().await;
            m.get("outbox_poll_leases_taken_over_total") == Some(&1.0)
                && m.get("outbox_poll_pending_events") == Some(&0.0)
                && m.get("outbox_events_forwarded_total") == Some(&4.0)
        },
    )
    .await;
    live.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_never_hears_from_kafka_lets_its_leases_lapse_to_the_others() {
    let (db, admin, topic, url) = polling_db("poll_hung", 2).await;
    for n in 1..=4 {
        for _ in 0..3 {
            emit(&admin, "acct", &format!("acct-{n}"), "Moved", "{}").await;
        }
    }

    // Its first delivery report blocks librdkafka's thread for ten minutes:
    // the relay's process and its leases live on, its pipeline never hears
    // that anything was delivered.
    let hung = relay_with_env(
        &db,
        &url,
        "hung",
        &[],
        &[
            ("OUTBOX_FAULT", "on_delivery_report"),
            ("OUTBOX_FAULT_STALL_MS", "600000"),
        ],
    );
    wait_until(
        WAIT,
        "the hung relay's delivery reports to stall",
        || async {
            hung.log_text()
                .contains("fault point on_delivery_report fired")
        },
    )
    .await;
    let held: i64 = admin
        .query_one(
            "SELECT count(*) FROM outbox.poll_leases WHERE relay = 'hung'",
            &[],
        )
        .await
        .expect("the hung relay's leases")
        .get(0);
    assert!(held > 0, "the hung relay held no aggregate when it stalled");

    // Events emitted since, and another relay: it publishes every
    // aggregate, the hung one's included, while the hung one still waits.
    for n in 1..=4 {
        emit(&admin, "acct", &format!("acct-{n}"), "Moved", "{}").await;
    }
    let live = relay(&db, &url, "live");
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let v = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    assert_eq!(
        (v.committed, v.lost, v.order_violations),
        (16, 0, 0),
        "{v:?}"
    );
    wait_until(WAIT, "nothing pending", || async {
        poll_status(&admin).await.1 == 0
    })
    .await;
    assert!(
        hung.log_text().contains("letting the leases lapse"),
        "the hung relay did not say why it let its leases go:\n{}",
        hung.log_text()
    );
    hung.kill9().await;
    live.kill9().await;
    db.drop().await;
}
