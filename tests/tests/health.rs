//! `/healthz` and `/readyz` tell the truth: each failure mode is forced,
//! its 503 and reason seen, and the 200 seen again after recovery, with
//! nothing lost or duplicated meanwhile. The tests pause the shared broker,
//! so they run one at a time.

use std::time::{Duration, Instant};

use pg_outbox_tests::{
    free_port, http_get, read_every_committed, stack_command, write_transactions, Forwarder,
    Reader, TestDb,
};
use tokio::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());
const WAIT: Duration = Duration::from_secs(120);

/// Polls `path` of `forwarder` every 100 ms until its status is `status`
/// (and its body contains `reason`), or panics after `timeout` with the
/// forwarder's own log; returns the body.
async fn until_answer(
    forwarder: &Forwarder,
    port: u16,
    path: &str,
    status: u16,
    reason: &str,
    timeout: Duration,
) -> String {
    let deadline = Instant::now() + timeout;
    let mut last = None;
    while Instant::now() < deadline {
        if let Some((code, body)) = http_get(port, path).await {
            if code == status && body.contains(reason) {
                return body;
            }
            last = Some((code, body));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = forwarder.log_text();
    let own: Vec<&str> = log.lines().filter(|l| !l.contains("rdkafka")).collect();
    panic!(
        "{path} never answered {status} with {reason:?} within {timeout:?}; last: {last:?}\nthe forwarder's log:\n{}",
        own[own.len().saturating_sub(60)..].join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_fails_while_the_loop_is_stuck_and_returns_after() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = TestDb::create("live_stuck").await;
    let topic = db.create_topic("box", 1).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // The fifth confirm blocks its thread for 8 s, as a call that never
    // returns would; the watchdog allows 1 s without a step.
    let forwarder = Forwarder::spawn_with_env(
        &db,
        &["--metrics-listen", &listen, "--liveness-timeout-ms", "1000"],
        &[
            ("OUTBOX_FAULT", "after_confirm:5"),
            ("OUTBOX_FAULT_STALL_MS", "8000"),
        ],
    );
    db.wait_slot_active(WAIT).await;
    until_answer(&forwarder, port, "/healthz", 200, "alive", WAIT).await;
    write_transactions(&mut db.admin().await, "box", 3, 20).await;
    let body = until_answer(
        &forwarder,
        port,
        "/healthz",
        503,
        "no step of the forwarding loop",
        WAIT,
    )
    .await;
    eprintln!("while stuck: {body}");
    until_answer(&forwarder, port, "/healthz", 200, "alive", WAIT).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    assert!(
        verdict.lost == 0 && verdict.order_violations == 0,
        "{verdict:?}"
    );
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_the_broker_hangs_and_returns_after() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = TestDb::create("ready_hung").await;
    let topic = db.create_topic("box", 3).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let forwarder = Forwarder::spawn(
        &db,
        &["--delivery", "exactly-once", "--metrics-listen", &listen],
    );
    db.wait_slot_active(WAIT).await;
    until_answer(&forwarder, port, "/readyz", 200, "ready", WAIT).await;

    // The broker stops with its sockets open, while events arrive.
    stack_command(&["pause-kafka"]);
    let paused = Instant::now();
    let mut writer = db.admin().await;
    write_transactions(&mut writer, "box", 5, 50).await;
    let body = until_answer(
        &forwarder,
        port,
        "/readyz",
        503,
        "kafka unreachable",
        Duration::from_secs(30),
    )
    .await;
    eprintln!("after {:?} of a hung broker: {body}", paused.elapsed());
    // Held for 20 s, past the producer's socket and request timeouts'
    // first rounds: not ready all along, alive all along (the loop steps,
    // and restarting the process would not bring the broker back).
    let mut answers = Vec::new();
    while paused.elapsed() < Duration::from_secs(20) {
        let ready = http_get(port, "/readyz").await.map(|r| r.0);
        let alive = http_get(port, "/healthz").await.map(|r| r.0);
        answers.push((ready, alive));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stack_command(&["resume-kafka"]);
    assert!(
        answers.iter().all(|a| *a == (Some(503), Some(200))),
        "(readyz, healthz) while the broker hangs: {answers:?}"
    );

    let body = until_answer(&forwarder, port, "/readyz", 200, "ready", WAIT).await;
    eprintln!("after the broker's return: {body}");
    write_transactions(&mut writer, "box", 5, 50).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    verdict.assert_exactly_once();
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_kafka_acknowledges_nothing_and_returns_after() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = TestDb::create("ready_stall").await;
    let topic = db.create_topic("box", 1).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // The first delivery report is held on librdkafka's thread for 8 s:
    // Kafka answers metadata requests, the loop steps, and nothing the
    // forwarder sent is acknowledged while its events wait.
    let forwarder = Forwarder::spawn_with_env(
        &db,
        &["--metrics-listen", &listen, "--ready-max-stall-ms", "2000"],
        &[
            ("OUTBOX_FAULT", "on_delivery_report:1"),
            ("OUTBOX_FAULT_STALL_MS", "8000"),
        ],
    );
    db.wait_slot_active(WAIT).await;
    until_answer(&forwarder, port, "/readyz", 200, "ready", WAIT).await;
    write_transactions(&mut db.admin().await, "box", 3, 30).await;
    let body = until_answer(
        &forwarder,
        port,
        "/readyz",
        503,
        "kafka acknowledged nothing for",
        WAIT,
    )
    .await;
    eprintln!("while nothing is acknowledged: {body}");
    assert_eq!(
        http_get(port, "/healthz").await.map(|r| r.0),
        Some(200),
        "the loop steps"
    );

    until_answer(&forwarder, port, "/readyz", 200, "ready", WAIT).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    assert!(
        verdict.lost == 0 && verdict.order_violations == 0,
        "{verdict:?}"
    );
    forwarder.kill9().await;
    db.drop().await;
}
