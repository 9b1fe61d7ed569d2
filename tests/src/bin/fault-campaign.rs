//! The fault campaign: writers emit to shared aggregates while the forwarder
//! is crashed at its fault points, killed at random, fenced by a zombie's
//! successor, has its slot dropped, and PostgreSQL and Kafka restart under
//! it. An independent verifier then compares `outbox.events` with what a
//! read_committed consumer received.
//!
//! fault-campaign [--faults N] [--mode exactly-once|at-least-once] [--seed S] [--failover]
//!                [--source poll] [--kafka-brokers 1|3] [--only KIND] [--shards N]
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
//! --shards N splits the outbox into N shards, each with a forwarder of
//! its own (--shard I/N): the faults hit shard 0's forwarder, the servers
//! restart under all of them, and the verdict covers every shard's events.
//!
//! --kafka-brokers 3 runs against the stack's cluster of three brokers
//! (OUTBOX_KAFKA_BROKERS=3 scripts/stack up) and adds broker faults: SIGKILL
//! of the leader of an outbox partition, of the forwarder's transaction
//! coordinator and of the active controller, SIGSTOP of a broker for longer
//! than the broker session and client request timeouts, and a rolling
//! restart. A killed broker is started again once the stream recovered, and
//! the next fault waits until no partition is under-replicated.
//!
//! --only repeats one kind of Kafka fault: leader-kill, coordinator-kill,
//! controller-kill, broker-pause, rolling-restart (three brokers) or
//! broker-restart (the single broker).
//!
//! Recovery, per fault kind: from the fault to the first event delivered
//! after it.
//!
//! Needs the stack's environment (PGURL, FORWARDER_PGURL, KAFKA_BOOTSTRAP).
//! Exits 1 on any loss, phantom or order violation, and on any duplicate in
//! exactly-once mode.

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pg_outbox_tests::pair::Pair;
use pg_outbox_tests::{
    cluster, committed_events, server_version, stack_command, try_connect, verdict, with_database,
    Edition, Forwarder, Reader, Record, TestDb,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
    /// SIGKILL of the broker leading partition 0 of the outbox topic.
    LeaderKill,
    /// SIGKILL of the transaction coordinator of the forwarder's (first)
    /// transactional id; exactly-once only, since at least once has none.
    CoordinatorKill,
    /// SIGKILL of the KRaft quorum's leader.
    ControllerKill,
    /// SIGSTOP of a broker, SIGCONT after [`PAUSE`].
    BrokerPause,
    /// Each broker restarted in turn, waiting for its replicas to catch up.
    RollingRestart,
}

/// How long a paused broker hangs: past the cluster's broker session
/// timeout (6 s) and the forwarder's request and socket timeouts (10 s).
const PAUSE: Duration = Duration::from_secs(12);

fn pick(rng: &mut StdRng, failover: bool, poll: bool, cluster: bool) -> Fault {
    if failover && rng.random_range(0..10) == 0 {
        return Fault::Failover;
    }
    // On a cluster, two faults in five are the brokers'.
    if cluster && rng.random_range(0..5) < 2 {
        return match rng.random_range(0..100) {
            0..25 => Fault::LeaderKill,
            25..50 => Fault::CoordinatorKill,
            50..70 => Fault::ControllerKill,
            70..92 => Fault::BrokerPause,
            _ => Fault::RollingRestart,
        };
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
        // The whole cluster restarting is rare; its brokers' faults are above.
        _ if cluster => Fault::Kill,
        _ => Fault::Broker,
    }
}

struct Args {
    faults: usize,
    exactly_once: bool,
    seed: u64,
    failover: bool,
    poll: bool,
    /// The stack's cluster of three brokers instead of the single one.
    cluster: bool,
    /// Only this broker fault, to study one kind's recovery.
    only: Option<Fault>,
    /// Shards of the outbox, each with its own forwarder.
    shards: Option<u32>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        faults: 50,
        exactly_once: true,
        seed: rand::rng().random(),
        failover: false,
        poll: false,
        cluster: std::env::var("OUTBOX_KAFKA_BROKERS").as_deref() == Ok("3"),
        only: None,
        shards: None,
    };
    let mut mode_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--faults" => args.faults = value()?.parse().map_err(|_| "--faults takes a number")?,
            "--failover" => args.failover = true,
            "--kafka-brokers" => {
                args.cluster = match value()?.as_str() {
                    "3" => true,
                    "1" => false,
                    other => return Err(format!("--kafka-brokers is 1 or 3, not {other:?}")),
                }
            }
            "--only" => {
                args.only = Some(match value()?.as_str() {
                    "leader-kill" => Fault::LeaderKill,
                    "coordinator-kill" => Fault::CoordinatorKill,
                    "controller-kill" => Fault::ControllerKill,
                    "broker-pause" => Fault::BrokerPause,
                    "rolling-restart" => Fault::RollingRestart,
                    "broker-restart" => Fault::Broker,
                    other => return Err(format!("--only takes leader-kill, coordinator-kill, controller-kill, broker-pause, rolling-restart or broker-restart, not {other:?}")),
                })
            }
            "--shards" => {
                let n: u32 = value()?
                    .parse()
                    .map_err(|_| "--shards takes a number from 2 to 16")?;
                if !(2..=16).contains(&n) {
                    return Err("--shards takes a number from 2 to 16".into());
                }
                args.shards = Some(n);
            }
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
        if args.shards.is_some() {
            return Err(
                "--source poll runs without --shards (relays share the aggregates themselves)"
                    .into(),
            );
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
        let Some(c) = pg_outbox_tests::reconnected(&mut client, &url).await else {
            continue;
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

/// A recovery time of a fault kind; a fault with no progress within 90 s
/// counts as 90 s.
fn record(
    recoveries: &mut std::collections::BTreeMap<String, Vec<Duration>>,
    name: &str,
    n: usize,
    recovery: Option<Duration>,
) {
    let time = match recovery {
        Some(time) => {
            if time > Duration::from_secs(10) {
                println!(
                    "  fault {n} ({name}): progress again after {:.1} s",
                    time.as_secs_f64()
                );
            }
            time
        }
        None => {
            eprintln!("fault {n} ({name}): no progress within 90 s");
            Duration::from_secs(90)
        }
    };
    recoveries.entry(name.to_owned()).or_default().push(time);
}

/// Waits until the cluster is whole again, or says it is not.
async fn wait_in_sync() {
    if !cluster::wait_in_sync(Duration::from_secs(180)).await {
        eprintln!("the cluster stayed under-replicated for 180 s");
    }
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
    if args.cluster
        && (std::env::var("OUTBOX_KAFKA_BROKERS").as_deref() != Ok("3")
            || !std::env::var("KAFKA_BOOTSTRAP").is_ok_and(|b| b.contains(',')))
    {
        eprintln!("fault-campaign: --kafka-brokers 3 needs the cluster's environment: run scripts/campaign --kafka-brokers 3, or export the output of OUTBOX_KAFKA_BROKERS=3 scripts/stack up and OUTBOX_KAFKA_BROKERS=3");
        return ExitCode::from(2);
    }
    let mut rng = StdRng::seed_from_u64(args.seed);
    println!(
        "fault campaign: {} faults, {} mode{}{}, seed {}",
        args.faults,
        if args.exactly_once {
            "exactly-once"
        } else {
            "at-least-once"
        },
        if args.poll { ", polling relays" } else { "" },
        if args.cluster { ", three brokers" } else { "" },
        args.seed
    );
    if let Some(n) = args.shards {
        println!("{n} shards, each with its own forwarder; the faults hit shard 0's");
    }

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
    // Append times tell when each event reached Kafka, whatever the reader's lag.
    let topic = db
        .create_topic_with(
            "campaign",
            3,
            &[("message.timestamp.type", "LogAppendTime")],
        )
        .await;
    // Polling: relays get names; the one the faults hit is renamed when it
    // is killed, so that its leases must expire before they move.
    let mut generation = 0;
    // Shards: the faulted forwarder is shard 0's, with a slot of its own.
    let shard_of = |index: u32| args.shards.map(|n| format!("{index}/{n}"));
    let fault_slot = match args.shards {
        Some(n) => format!("{}_0_of_{n}", db.slot),
        None => db.slot.clone(),
    };
    let mut relay_args = |renamed: bool| -> Vec<String> {
        let mut a: Vec<String> = mode.iter().map(|s| s.to_string()).collect();
        if let Some(shard) = shard_of(0) {
            a.extend(["--shard".into(), shard]);
        }
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
    // Beside the faulted one: a steady polling relay, or the other shards'
    // forwarders.
    let mut steady = Vec::new();
    if args.poll {
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
        steady.push(Forwarder::spawn(&db, &a));
    }
    for index in 1..args.shards.unwrap_or(1) {
        let shard = shard_of(index).unwrap_or_default();
        let a: Vec<&str> = mode.iter().copied().chain(["--shard", &shard]).collect();
        steady.push(Forwarder::spawn(&db, &a));
    }
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

    // The consumer runs throughout; `count` tells the campaign about
    // progress, `appended` the latest append time it read (Unix ms).
    let count = Arc::new(AtomicUsize::new(0));
    let appended = Arc::new(AtomicI64::new(0));
    let records: Arc<Mutex<Vec<Record>>> = Arc::default();
    let reading = Arc::new(AtomicBool::new(true));
    // Once the campaign hands over the committed ids, the consumer reads until
    // it has seen each of them, then to the end of the topic.
    let target: Arc<Mutex<Option<HashSet<String>>>> = Arc::default();
    let consumer = {
        let (stack, topic, count, records, target, appended) = (
            db.stack.clone(),
            topic.clone(),
            count.clone(),
            records.clone(),
            target.clone(),
            appended.clone(),
        );
        tokio::spawn(async move {
            let mut reader = Reader::new(&stack, &[&topic]);
            let ids = loop {
                if let Some(ids) = target.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    break ids;
                }
                let seen = reader.records.len();
                reader.poll(Duration::from_millis(200)).await;
                for record in &reader.records[seen..] {
                    appended.fetch_max(record.timestamp_ms.unwrap_or(0), Ordering::Relaxed);
                }
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
            fault_slot.clone(),
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
    let mut recoveries = std::collections::BTreeMap::<String, Vec<Duration>>::new();
    let transactional_id = db.transactional_id();
    // Recovery: from the fault to the append of the first event read after
    // it; `None` when none is appended within `within`.
    let recovered = |injected: Instant, within: Duration| {
        let appended = appended.clone();
        async move {
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            let fault_ms = now_ms - injected.elapsed().as_millis() as i64;
            loop {
                let at = appended.load(Ordering::Relaxed);
                if at > fault_ms {
                    return Some(Duration::from_millis((at - fault_ms) as u64));
                }
                if injected.elapsed() > within {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    for n in 1..=args.faults {
        // Let the stream run a little, for random timing.
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..600))).await;
        let fault = args
            .only
            .unwrap_or_else(|| pick(&mut rng, pair.is_some(), args.poll, args.cluster));
        let name = match fault {
            Fault::Point(p) => format!("crash at {p}"),
            other => format!("{other:?}"),
        };
        if let Fault::RollingRestart = fault {
            // A recovery per broker stopped.
            for node in ["1", "2", "3"] {
                let injected = Instant::now();
                let restarting = tokio::task::spawn_blocking(move || {
                    cluster::command(&["restart-broker", node]);
                });
                let recovery = recovered(injected, Duration::from_secs(90)).await;
                let _ = restarting.await;
                record(&mut recoveries, &name, n, recovery);
                wait_in_sync().await;
            }
            *tally.entry(name).or_default() += 1;
            max_recovery = recoveries
                .values()
                .flatten()
                .copied()
                .max()
                .unwrap_or_default();
            continue;
        }
        let mut injected = Instant::now();
        // What brings the cluster back whole after a broker fault.
        let mut killed: Option<String> = None;
        let mut resuming = None;
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
                        &[&fault_slot],
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
            Fault::LeaderKill | Fault::CoordinatorKill | Fault::ControllerKill => {
                let partition = "0".to_owned();
                let role: Vec<&str> = match fault {
                    Fault::LeaderKill => vec!["leader", &topic, &partition],
                    Fault::CoordinatorKill => vec!["coordinator", &transactional_id],
                    _ => vec!["controller"],
                };
                match cluster::broker_of(&role) {
                    Some(node) => {
                        injected = Instant::now();
                        cluster::command(&["kill-broker", &node]);
                        killed = Some(node);
                    }
                    None => println!("  fault {n} ({name}): the cluster named no broker for it"),
                }
            }
            Fault::BrokerPause => {
                let node = rng.random_range(1..=3).to_string();
                cluster::command(&["pause-broker", &node]);
                injected = Instant::now();
                resuming = Some(tokio::spawn(async move {
                    tokio::time::sleep(PAUSE).await;
                    cluster::command(&["resume-broker", &node]);
                }));
            }
            Fault::RollingRestart => unreachable!("handled above"),
            Fault::SlotLost => db.lose_named_slot(&fault_slot).await,
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
        *tally.entry(name.clone()).or_default() += 1;
        let recovery = recovered(injected, Duration::from_secs(90)).await;
        record(&mut recoveries, &name, n, recovery);
        max_recovery = max_recovery.max(recovery.unwrap_or(Duration::from_secs(90)));
        if let Some(resuming) = resuming {
            let _ = resuming.await;
        }
        if let Some(node) = killed {
            cluster::command(&["start-broker", &node]);
        }
        if args.cluster {
            wait_in_sync().await;
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
    println!("recovery, from the fault to the append of the first event delivered after it (s):");
    println!(
        "  {:<28} {:>5} {:>7} {:>7} {:>7}",
        "", "n", "median", "p95", "max"
    );
    for (name, times) in &mut recoveries {
        times.sort();
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize].as_secs_f64();
        println!(
            "  {name:<28} {:>5} {:>7.1} {:>7.1} {:>7.1}",
            times.len(),
            at(0.5),
            at(0.95),
            at(1.0)
        );
    }
    println!(
        "peak retained WAL    {} kB",
        peak_wal.load(Ordering::Relaxed) >> 10
    );
    println!(
        "duration             {:.0} s",
        began.elapsed().as_secs_f64()
    );

    if v.lost > 0 && args.poll {
        // Where the missing events stand: still pending, and leased by whom.
        let rows = db
            .admin()
            .await
            .query(
                "SELECT coalesce(l.relay, '(no lease)'), count(DISTINCT (p.aggregate_type, p.aggregate_id)), count(*), \
                        coalesce(max(l.expires_at) > clock_timestamp(), false) \
                   FROM outbox.pending p LEFT JOIN outbox.poll_leases l USING (aggregate_type, aggregate_id) \
                  GROUP BY 1 ORDER BY 1",
                &[],
            )
            .await
            .unwrap_or_default();
        println!("still pending, by the relay leasing them:");
        for row in rows {
            let (relay, aggregates, events, live): (String, i64, i64, bool) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            println!("  {relay:<20} {aggregates} aggregates, {events} events, lease live: {live}");
        }
        println!(
            "forwarder logs: {} and {}",
            forwarder.log.display(),
            steady
                .iter()
                .map(|s| s.log.display().to_string())
                .collect::<Vec<_>>()
                .join(" and ")
        );
    }
    let failed = v.lost > 0
        || phantoms > 0
        || v.order_violations > 0
        || (args.exactly_once && v.duplicates > 0);
    if failed {
        // The forwarders' own account of the end, kept with the verdict:
        // the log files live in a temporary directory that may be gone by
        // the time someone reads the report.
        for log in std::iter::once(&forwarder.log).chain(steady.iter().map(|s| &s.log)) {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            println!("last lines of {}:", log.display());
            for line in &lines[lines.len().saturating_sub(40)..] {
                println!("  {line}");
            }
        }
    }
    forwarder.kill9().await;
    for steady in steady {
        steady.kill9().await;
    }
    db.drop().await;
    drop(pair.take());
    if failed {
        println!("campaign FAILED");
        ExitCode::FAILURE
    } else {
        println!("campaign passed");
        ExitCode::SUCCESS
    }
}
