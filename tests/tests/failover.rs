//! A primary failover under a running exactly-once forwarder, on a primary
//! and standby of the test's own (the shared cluster keeps running): writers
//! keep emitting through a multi-host URL, the primary is killed (SIGKILL)
//! and its standby promoted. On 17 and later the failover slot carries on
//! and a read_committed consumer sees every committed event once. On 15 and
//! 16 the standby has no slot: the test states what happens there.

use std::time::{Duration, Instant};

use pg_outbox_tests::pair::Pair;
use pg_outbox_tests::{
    read_every_committed, server_version, with_database, write_transactions_through_restarts,
    Edition, Forwarder, Reader, TestDb,
};

const WAIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_failover_under_exactly_once_loses_and_duplicates_nothing_where_slots_fail_over()
{
    let mut pair = Pair::up();
    let admin_url = pair.as_stack().admin_url;
    let db = TestDb::create_on("failover", Edition::Extension, pair.as_stack()).await;
    let version = server_version(&db.admin().await).await;
    let topic = db.create_topic("ticket", 2).await;
    let url = db.forwarder_url();
    let args = [
        "--postgres-url",
        &url,
        "--kafka-bootstrap",
        &db.stack.kafka,
        "--delivery",
        "exactly-once",
    ];
    let forwarder = Forwarder::spawn_connected(&db, &args, &[]);
    db.wait_slot_active(WAIT).await;

    if version >= 170000 {
        pair.wait_slot_synced(&db, WAIT).await;
    }
    let writer = tokio::spawn(write_transactions_through_restarts(
        with_database(&admin_url, &db.name),
        "ticket".into(),
        6,
        400,
    ));
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the stream to flow", |r| r.len() >= 100)
        .await;
    pair.kill_primary();
    let died = Instant::now();
    let died_at = std::time::SystemTime::now();
    pair.promote();
    let marker: String = {
        let mut promoted = None;
        while promoted.is_none() {
            promoted = tokio_postgres::connect(
                &with_database(&admin_url, &db.name),
                tokio_postgres::NoTls,
            )
            .await
            .ok();
            assert!(
                died.elapsed() < WAIT,
                "the promoted standby takes no writes"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (client, connection) = promoted.expect("connected");
        tokio::spawn(connection);
        client
            .query_one(
                "SELECT event_id::text FROM outbox.emit_event('ticket', 'after-promotion', 'Promoted', '{}')",
                &[],
            )
            .await
            .expect("emit on the new primary")
            .get(0)
    };
    reader
        .read_until(WAIT, "the first event from the new primary", |r| {
            r.iter().any(|r| r.event_id() == marker)
        })
        .await;
    let recovery = died.elapsed();
    writer.await.expect("writer");

    let v = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!(
        "PostgreSQL {}: {v:?}; from the primary's death to the first event from the new primary: {} ms",
        version / 10000,
        recovery.as_millis()
    );
    if version >= 170000 {
        assert_eq!(
            (v.lost, v.duplicates, v.phantoms, v.order_violations),
            (0, 0, 0, 0),
            "{v:?}"
        );
    } else {
        // No slot on the promoted standby: the forwarder creates one there
        // and its catch-up delivers again what committed after the last
        // safe snapshot the standby replicated (the horizon in Kafka names
        // the old timeline, so it does not count). Nothing is lost and the
        // first arrivals keep aggregate order.
        assert_eq!((v.lost, v.order_violations), (0, 0), "{v:?}");
        let bounds = repeats_and_phantoms(&db, &reader, died_at).await;
        eprintln!(
            "PostgreSQL {}: no failover slots; {} events delivered again by the catch-up on the new primary, {} delivered that the new primary never had",
            version / 10000,
            v.duplicates,
            v.phantoms
        );
        // What repeats is what the old primary committed: the new primary's
        // own events arrive once.
        assert_eq!(bounds.repeated_after_death, 0, "{bounds:?}");
        // A phantom is an event the old primary published and never
        // replicated: its place in the aggregate is taken by an event of the
        // new primary, never by one the standby had.
        assert_eq!(bounds.phantoms_shadowing_replicated, 0, "{bounds:?}");
    }
    forwarder.kill9().await;
}

/// The failover's repeats and phantoms, against the bounds the docs give
/// for servers without failover slots.
#[derive(Debug)]
struct Bounds {
    /// Events created on the new primary that arrived more than once.
    repeated_after_death: usize,
    /// Records of no committed event at the place (aggregate, sequence) of
    /// an event created before the primary died.
    phantoms_shadowing_replicated: usize,
}

async fn repeats_and_phantoms(
    db: &TestDb,
    reader: &Reader,
    died_at: std::time::SystemTime,
) -> Bounds {
    use std::collections::HashMap;
    let rows = db
        .admin()
        .await
        .query(
            "SELECT event_id::text, aggregate_id, aggregate_seq, occurred_at < $1 FROM outbox.events",
            &[&died_at],
        )
        .await
        .expect("read the new primary's events");
    let before_death: HashMap<String, bool> = rows.iter().map(|r| (r.get(0), r.get(3))).collect();
    let at_place: HashMap<(String, i64), bool> = rows
        .iter()
        .map(|r| ((r.get(1), r.get(2)), r.get(3)))
        .collect();
    let mut arrivals: HashMap<&str, usize> = HashMap::new();
    for record in &reader.records {
        *arrivals.entry(record.event_id()).or_default() += 1;
    }
    Bounds {
        repeated_after_death: arrivals
            .iter()
            .filter(|(id, n)| **n > 1 && before_death.get(**id) == Some(&false))
            .count(),
        phantoms_shadowing_replicated: reader
            .records
            .iter()
            .filter(|r| !before_death.contains_key(r.event_id()))
            .filter(|r| at_place.get(&(r.key.clone(), r.seq())) == Some(&true))
            .count(),
    }
}
