//! The fault campaign: writers emit to shared aggregates while the forwarder
//! is crashed at its fault points, killed at random, fenced by a zombie's
//! successor, has its slot dropped, and PostgreSQL and Kafka restart under
//! it. An independent verifier then compares `outbox.events` with what a
//! read_committed consumer received.
//!
//! fault-campaign [--faults N] [--mode exactly-once|at-least-once] [--seed S] [--failover]
//!                [--source poll]
//!
//! --failover runs on a primary and standby of the campaign's own and adds
//! primary failovers (SIGKILL of the primary, promotion of the standby, a
//! new standby where the old primary was): in exactly-once mode it needs
//! PostgreSQL 17 or later, whose failover slots carry the forwarder's slot.
//!
//! --source poll runs two polling relays (at least once) instead of a slot
//! forwarder: faults hit one of them (crashes at its fault points, SIGKILL
//! and restart under a new name, so its leases must expire; a zombie that
//! resumes after its successor took its aggregates over), and the servers
//! restart under both.
//!
//! Needs the stack's environment (PGURL, FORWARDER_PGURL, KAFKA_BOOTSTRAP).
//! Exits 1 on any loss, phantom or order violation, and on any duplicate in
//! exactly-once mode.

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pg_outbox_tests::pair::Pair;
use pg_outbox_tests::{
    committed_events, server_version, stack_command, try_connect, verdict, with_database, Edition,
    Forwarder, Reader, Record, TestDb,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_postgres::NoTls;

const POINTS: &[&str] = &[
    "producer_init",
    "before_produce",
    "after_produce",
    "before_kafka_commit",
    "after_kafka_commit",
    "after_confirm",
];
/// A polling relay's points: no Kafka transactions, no slot.
const POLL_POINTS: &[&str] = &[
    "producer_init",
    "before_produce",
    "after_produce",
    "after_confirm",
    "after_lease",
    "after_poll_done",
];

/// Polling relays' leases in the campaign: short, so that takeovers happen.
const POLL_LEASE_MS: &str = "2000";

#[derive(Debug, Clone, Copy)]
enum Fault {
    Point(&'static str),
    Kill,
    Zombie,
    PgFast,
    PgImmediate,
    Broker,
    /// The slot is dropped under the forwarder (its walsender terminated).
    SlotLost,
    /// The primary is killed and its standby promoted (with `--failover`).
    Failover,
}

fn pick(rng: &mut StdRng, failover: bool, poll: bool) -> Fault {
    if failover && rng.random_range(0..10) == 0 {
        return Fault::Failover;
    }
    let points = if poll { POLL_POINTS } else { POINTS };
    match rng.random_range(0..100) {
        0..46 => Fault::Point(points[rng.random_range(0..points.len())]),
        46..50 if poll => Fault::Kill,
        46..50 => Fault::SlotLost,
        50..70 => Fault::Kill,
        70..80 => Fault::Zombie,
        80..86 => Fault::PgFast,
        86..92 => Fault::PgImmediate,
        _ => Fault::Broker,
    }
}

struct Args {
    faults: usize,
    exactly_once: bool,
    seed: u64,
    failover: bool,
    poll: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        faults: 50,
        exactly_once: true,
        seed: rand::rng().random(),
        failover: false,
        poll: false,
    };
    let mut mode_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--faults" => args.faults = value()?.parse().map_err(|_| "--faults takes a number")?,
            "--failover" => args.failover = true,
            "--seed" => args.seed = value()?.parse().map_err(|_| "--seed takes a number")?,
            "--source" => {
                args.poll = match value()?.as_str() {
                    "poll" => true,
                    "slot" => false,
                    other => return Err(format!("unknown source {other:?}")),
                }
            }
            "--mode" => {
                mode_given = true;
                args.exactly_once = match value()?.as_str() {
                    "exactly-once" => true,
                    "at-least-once" => false,
                    other => return Err(format!("unknown mode {other:?}")),
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.poll {
        if mode_given && args.exactly_once {
            return Err(
                "--source poll delivers at least once: leave out --mode exactly-once".into(),
            );
        }
        if args.failover {
            return Err("--source poll runs without --failover".into());
        }
        args.exactly_once = false;
    }
    Ok(args)
}

/// A writer that keeps committing (and sometimes rolling back) transactions
/// of 1 to 3 events on shared aggregates until told to stop, riding out
/// restarts. Returns the ids of rolled-back events.
async fn writer(url: String, stop: Arc<AtomicBool>, seed: u64) -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rolled_back = Vec::new();
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.load(Ordering::Relaxed) {
        let c = match &mut client {
            Some(c) if !c.is_closed() => c,
            _ => match tokio_postgres::connect(&url, NoTls).await {
                Ok((c, conn)) => {
                    tokio::spawn(async move {
                        let _closed = conn.await;
                    });
                    client.insert(c)
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let mut aggregates: Vec<usize> = (0..rng.random_range(1..=3))
            .map(|_| rng.random_range(0..12))
            .collect();
        aggregates.sort();
        let rollback = rng.random_range(0..10) == 0;
        let attempt = async {
            let tx = c.transaction().await?;
            let mut ids = Vec::new();
            for a in &aggregates {
                let row = tx
                    .query_one(
                        "SELECT event_id::text FROM outbox.emit_event('campaign', $1, 'Happened', '{}')",
                        &[&format!("agg-{a}")],
                    )
                    .await?;
                ids.push(row.get::<_, String>(0));
            }
            if rollback {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
            }
            Ok::<_, tokio_postgres::Error>(ids)
        };
        match attempt.await {
            Ok(ids) if rollback => rolled_back.extend(ids),
            Ok(_) => {}
            Err(_) => {
                client = None;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..30))).await;
    }
    rolled_back
}

fn signal(sig: &str, pid: i32) {
    let _ignored = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fault-campaign: {e}");
            return ExitCode::from(2);
        }
    };
    let mode: &[&str] = if args.exactly_once {
        &["--delivery", "exactly-once"]
    } else if args.poll {
        &["--source", "poll", "--poll-lease-ms", POLL_LEASE_MS]
    } else {
        &[]
    };
    let mut rng = StdRng::seed_from_u64(args.seed);
    println!(
        "fault campaign: {} faults, {} mode{}, seed {}",
        args.faults,
        if args.exactly_once {
            "exactly-once"
        } else {
            "at-least-once"
        },
        if args.poll { ", polling relays" } else { "" },
        args.seed
    );

    let began = Instant::now();
    let mut pair = args.failover.then(Pair::up);
    let db = match &pair {
        Some(pair) => TestDb::create_on("campaign", Edition::Extension, pair.as_stack()).await,
        None => TestDb::create("campaign").await,
    };
    let version = server_version(&db.admin().await).await;
    if pair.is_some() && args.exactly_once && version < 170000 {
        eprintln!(
            "fault-campaign: --failover in exactly-once mode needs PostgreSQL 17 or later (this is {}): without failover slots the new primary's catch-up repeats the last second or two; use --mode at-least-once",
            version / 10000
        );
        db.drop().await;
        return ExitCode::from(2);
    }
    let topic = db.create_topic("campaign", 3).await;
    // Polling: relays get names; the one the faults hit is renamed when it
    // is killed, so that its leases must expire before they move.
    let mut generation = 0;
    let mut relay_args = |renamed: bool| -> Vec<String> {
        let mut a: Vec<String> = mode.iter().map(|s| s.to_string()).collect();
        if args.poll {
            generation += usize::from(renamed);
            a.extend(["--relay-name".into(), format!("campaign-{generation}")]);
        }
        a
    };
    let spawn = |db: &TestDb, a: &[String], env: &[(&str, &str)]| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        Forwarder::spawn_with_env(db, &a, env)
    };
    let steady = if args.poll {
        db.admin()
            .await
            .batch_execute("SELECT outbox.enable_polling()")
            .await
            .expect("enable polling");
        let a: Vec<&str> = mode
            .iter()
            .copied()
            .chain(["--relay-name", "steady"])
            .collect();
        Some(Forwarder::spawn(&db, &a))
    } else {
        None
    };
    let mut forwarder = spawn(&db, &relay_args(false), &[]);

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3)
        .map(|i| {
            tokio::spawn(writer(
                with_database(&db.stack.admin_url, &db.name),
                stop.clone(),
                args.seed.wrapping_add(i),
            ))
        })
        .collect();

    // The consumer runs throughout; `count` tells the campaign about progress.
    let count = Arc::new(AtomicUsize::new(0));
    let records: Arc<Mutex<Vec<Record>>> = Arc::default();
    let reading = Arc::new(AtomicBool::new(true));
    // Once the campaign hands over the committed ids, the consumer reads until
    // it has seen each of them, then to the end of the topic.
    let target: Arc<Mutex<Option<HashSet<String>>>> = Arc::default();
    let consumer = {
        let (stack, topic, count, records, target) = (
            db.stack.clone(),
            topic.clone(),
            count.clone(),
            records.clone(),
            target.clone(),
        );
        tokio::spawn(async move {
            let mut reader = Reader::new(&stack, &[&topic]);
            let ids = loop {
                if let Some(ids) = target.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    break ids;
                }
                reader.poll(Duration::from_millis(200)).await;
                count.store(reader.records.len(), Ordering::Relaxed);
            };
            let _all_seen = reader
                .try_read_until(Duration::from_secs(180), |records| {
                    let seen: HashSet<&str> = records.iter().map(|r| r.event_id()).collect();
                    ids.iter().all(|id| seen.contains(id.as_str()))
                })
                .await;
            reader
                .read_to_end(&[&topic], Duration::from_secs(120))
                .await;
            *records.lock().unwrap_or_else(|e| e.into_inner()) = reader.records;
        })
    };

    // Peak retained WAL of the slot, sampled throughout.
    let peak_wal = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (url, slot, peak, reading) = (
            with_database(&db.stack.admin_url, &db.name),
            db.slot.clone(),
            peak_wal.clone(),
            reading.clone(),
        );
        tokio::spawn(async move {
            let mut admin: Option<tokio_postgres::Client> = None;
            while reading.load(Ordering::Relaxed) {
                // Reconnects after restarts and failovers.
                if admin.as_ref().is_none_or(|c| c.is_closed()) {
                    admin = try_connect(&url).await.ok();
                }
                let Some(client) = &admin else {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                };
                if let Ok(Some(row)) = client
                    .query_opt(
                        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                {
                    let bytes: Option<i64> = row.get(0);
                    peak.fetch_max(bytes.unwrap_or(0).max(0) as usize, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };

    let mut max_recovery = Duration::ZERO;
    let mut tally = std::collections::BTreeMap::<String, usize>::new();
    let wait_progress = |from: usize, within: Duration| {
        let count = count.clone();
        async move {
            let start = Instant::now();
            while count.load(Ordering::Relaxed) <= from {
                if start.elapsed() > within {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Some(start.elapsed())
        }
    };

    for n in 1..=args.faults {
        // Let the stream run a little, for random timing.
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..600))).await;
        let fault = pick(&mut rng, pair.is_some(), args.poll);
        let before = count.load(Ordering::Relaxed);
        let mut injected = Instant::now();
        match fault {
            Fault::Point(point) => {
                forwarder.kill9().await;
                let at = rng.random_range(1..=150).to_string();
                let armed = spawn(
                    &db,
                    &relay_args(false),
                    &[("OUTBOX_FAULT", &format!("{point}:{at}"))],
                );
                // Wait for the point to fire; if the stream never got that far, kill it.
                let mut armed = armed;
                let fired_by = Instant::now() + Duration::from_secs(5);
                while armed.is_running() && Instant::now() < fired_by {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                armed.kill9().await;
                forwarder = spawn(&db, &relay_args(false), &[]);
            }
            Fault::Kill => {
                forwarder.kill9().await;
                forwarder = spawn(&db, &relay_args(true), &[]);
            }
            Fault::Zombie => {
                let zombie_pid = forwarder.pid();
                signal("-STOP", zombie_pid);
                let admin = db.admin().await;
                let _ = admin
                    .execute(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active",
                        &[&db.slot],
                    )
                    .await;
                let zombie = std::mem::replace(&mut forwarder, spawn(&db, &relay_args(true), &[]));
                // A polling zombie sleeps past its leases, which the others take over.
                let sleep = if args.poll { 1000..4000 } else { 100..1500 };
                tokio::time::sleep(Duration::from_millis(rng.random_range(sleep))).await;
                signal("-CONT", zombie_pid);
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
                zombie.kill9().await;
            }
            Fault::PgFast | Fault::PgImmediate => {
                let how = if matches!(fault, Fault::PgFast) {
                    "fast"
                } else {
                    "immediate"
                };
                match &pair {
                    Some(pair) => pair.stack(&["restart-pg", how]),
                    None => stack_command(&["restart-pg", how]),
                }
            }
            Fault::Broker => stack_command(&["restart-kafka"]),
            Fault::SlotLost => db.lose_slot().await,
            Fault::Failover => {
                let pair = pair.as_mut().expect("failovers run on a pair");
                if version >= 170000 {
                    // As an operator promotes: a standby that holds the slot.
                    pair.wait_slot_synced(&db, Duration::from_secs(90)).await;
                }
                injected = Instant::now();
                pair.kill_primary();
                pair.promote();
            }
        }
        let name = match fault {
            Fault::Point(p) => format!("crash at {p}"),
            other => format!("{other:?}"),
        };
        *tally.entry(name.clone()).or_default() += 1;
        match wait_progress(before, Duration::from_secs(90)).await {
            Some(_) => {
                let recovery = injected.elapsed();
                if recovery > Duration::from_secs(10) {
                    println!(
                        "  fault {n} ({name}): progress again after {:.1} s",
                        recovery.as_secs_f64()
                    );
                }
                max_recovery = max_recovery.max(recovery);
            }
            None => {
                eprintln!("fault {n} ({name}): no progress within 90 s");
                max_recovery = Duration::from_secs(90);
            }
        }
        if let (Fault::Failover, Some(pair)) = (fault, &pair) {
            // A new standby where the old primary was, for the next one.
            pair.standby_up();
        }
        if n % 10 == 0 {
            println!(
                "  {n} faults injected, {} records so far",
                count.load(Ordering::Relaxed)
            );
        }
    }

    // Quiesce: writers stop, one healthy forwarder delivers the rest.
    stop.store(true, Ordering::Relaxed);
    let mut rolled_back = HashSet::new();
    for w in writers {
        rolled_back.extend(w.await.unwrap_or_default());
    }
    let committed = committed_events(&db.admin().await).await;
    *target.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(committed.iter().map(|e| e.0.clone()).collect());
    let _ = consumer.await;
    reading.store(false, Ordering::Relaxed);
    let _ = sampler.await;
    let records = std::mem::take(&mut *records.lock().unwrap_or_else(|e| e.into_inner()));
    let v = verdict(&committed, &records);
    let phantoms = records
        .iter()
        .filter(|r| rolled_back.contains(r.event_id()))
        .count()
        .max(v.phantoms);

    println!("faults injected:");
    for (name, n) in &tally {
        println!("  {name:<28} {n}");
    }
    println!("committed            {}", v.committed);
    println!("delivered            {}", v.received);
    println!("lost                 {}", v.lost);
    println!("duplicates           {}", v.duplicates);
    println!("order violations     {}", v.order_violations);
    println!(
        "phantoms             {phantoms} (of {} rolled-back events)",
        rolled_back.len()
    );
    println!("max recovery         {:.1} s", max_recovery.as_secs_f64());
    println!(
        "peak retained WAL    {} kB",
        peak_wal.load(Ordering::Relaxed) >> 10
    );
    println!(
        "duration             {:.0} s",
        began.elapsed().as_secs_f64()
    );

    forwarder.kill9().await;
    if let Some(steady) = steady {
        steady.kill9().await;
    }
    db.drop().await;
    drop(pair.take());
    let failed = v.lost > 0
        || phantoms > 0
        || v.order_violations > 0
        || (args.exactly_once && v.duplicates > 0);
    if failed {
        println!("campaign FAILED");
        ExitCode::FAILURE
    } else {
        println!("campaign passed");
        ExitCode::SUCCESS
    }
}
