//! Exactly-once on a cluster of three brokers with production's replication
//! settings (replication factor 3, min.insync.replicas 2): a partition
//! leader killed, the transaction coordinator killed, a rolling restart, and
//! a coordinator that hangs with its sockets open, each while events arrive,
//! lose, duplicate and reorder nothing. `check` sees the cluster's
//! replication. The tests take brokers down, so they run one at a time;
//! scripts/test runs them against `OUTBOX_KAFKA_BROKERS=3 scripts/stack up`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pg_outbox_tests::cluster::{self, skip_without_cluster};
use pg_outbox_tests::{
    read_every_committed, write_transactions_through_restarts, Forwarder, Reader, TestDb, Verdict,
};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;
use tokio::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());
const WAIT: Duration = Duration::from_secs(180);

/// Writers that commit transactions until stopped, riding out errors.
struct Writers {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writers {
    fn start(db: &TestDb, aggregate_type: &str) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let url = pg_outbox_tests::with_database(&db.stack.admin_url, &db.name);
        let (flag, aggregate_type) = (stop.clone(), aggregate_type.to_owned());
        let task = tokio::spawn(async move {
            while !flag.load(Ordering::Relaxed) {
                write_transactions_through_restarts(url.clone(), aggregate_type.clone(), 12, 20)
                    .await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Writers { stop, task }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("writers");
    }
}

/// Reads until more records than now have arrived: the stream goes on.
async fn goes_on(reader: &mut Reader, after: &str) {
    let seen = reader.records.len();
    reader
        .read_until(
            WAIT,
            &format!("events delivered after {after}"),
            |records| records.len() > seen,
        )
        .await;
}

fn assert_exactly_once(verdict: &Verdict) {
    verdict.assert_exactly_once();
    assert!(verdict.committed > 0, "{verdict:?}");
}

/// The broker that holds `role` now.
fn holder(role: &[&str]) -> String {
    cluster::broker_of(role).unwrap_or_else(|| panic!("the cluster names no broker for {role:?}"))
}

/// Kills the broker, sees the stream go on without it, starts it again
/// and waits until its replicas are back in sync.
async fn kill_and_return(reader: &mut Reader, node: &str, what: &str) {
    cluster::command(&["kill-broker", node]);
    goes_on(reader, &format!("a SIGKILL of broker {node}, {what}")).await;
    cluster::command(&["start-broker", node]);
    assert!(
        cluster::wait_in_sync(WAIT).await,
        "replicas out of sync after broker {node} returned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_through_a_leader_kill_a_coordinator_kill_and_a_rolling_restart() {
    if skip_without_cluster("exactly_once_through_a_leader_kill") {
        return;
    }
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = TestDb::create("cluster_faults").await;
    let topic = db.create_topic("box", 3).await;
    let forwarder = Forwarder::spawn(&db, &["--delivery", "exactly-once"]);
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let writers = Writers::start(&db, "box");
    goes_on(&mut reader, "the start").await;

    let leader = holder(&["leader", &topic, "0"]);
    kill_and_return(&mut reader, &leader, "the leader of partition 0").await;
    let coordinator = holder(&["coordinator", &db.transactional_id()]);
    kill_and_return(&mut reader, &coordinator, "the transaction coordinator").await;
    let rolling = tokio::task::spawn_blocking(|| cluster::command(&["roll-brokers"]));
    goes_on(&mut reader, "the start of a rolling restart").await;
    rolling.await.expect("roll-brokers");
    goes_on(&mut reader, "a rolling restart").await;

    writers.stop().await;
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("leader {leader}, coordinator {coordinator} killed, brokers rolled: {verdict:?}");
    assert_exactly_once(&verdict);
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_transaction_coordinator_loses_and_duplicates_nothing() {
    if skip_without_cluster("a_hung_transaction_coordinator") {
        return;
    }
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = TestDb::create("cluster_hung").await;
    let topic = db.create_topic("box", 3).await;
    let forwarder = Forwarder::spawn(&db, &["--delivery", "exactly-once"]);
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let writers = Writers::start(&db, "box");
    goes_on(&mut reader, "the start").await;

    // The coordinator hangs with transactions of the forwarder in it, past
    // the broker session timeout (6 s) and the forwarder's request timeout
    // (10 s): the cluster moves the coordinator to another broker while the
    // old one still holds the forwarder's requests in its sockets, and
    // answers them when it resumes.
    // The hang lasts until another broker is seen as the coordinator: a
    // lookup can fail while the cluster still elects it (answers a tool's
    // request with the hung broker or none), so it is asked again.
    let hung = holder(&["coordinator", &db.transactional_id()]);
    cluster::command(&["pause-broker", &hung]);
    tokio::time::sleep(Duration::from_secs(14)).await;
    let moved = cluster::wait_for(
        &["coordinator", &db.transactional_id()],
        Duration::from_secs(60),
        |node| matches!(node, "1" | "2" | "3") && node != hung,
    )
    .await;
    cluster::command(&["resume-broker", &hung]);
    assert!(
        moved.as_ref().is_some_and(|m| *m != hung),
        "the coordinator did not move off hung broker {hung} within 74 s: {moved:?}"
    );
    goes_on(&mut reader, "the hung coordinator's return").await;
    assert!(cluster::wait_in_sync(WAIT).await, "replicas out of sync");

    writers.stop().await;
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("coordinator {hung} hung, moved to {moved:?}: {verdict:?}");
    assert_exactly_once(&verdict);
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_warns_of_a_written_topic_with_a_single_replica() {
    if skip_without_cluster("check_warns_of_a_written_topic_with_a_single_replica") {
        return;
    }
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = TestDb::create("cluster_check").await;
    let check = || db.forwarder_subcommand("check");
    db.create_topic("replicated", 3).await;
    let (code, out, _) = check().await;
    assert_eq!(code, 0, "{out}");
    let line = |out: &str| {
        out.lines()
            .find(|l| l.split_whitespace().nth(1) == Some("replicas"))
            .map(str::to_owned)
            .unwrap_or_default()
    };
    assert!(line(&out).starts_with("ok"), "{out}");

    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &db.stack.kafka)
        .create()
        .expect("admin client");
    let single = db.topic("single");
    admin
        .create_topics(
            &[NewTopic::new(&single, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topic");
    let (code, out, _) = check().await;
    assert_eq!(code, 0, "a warning fails nothing: {out}");
    let warning = line(&out);
    assert!(warning.starts_with("warn"), "{out}");
    assert!(
        warning.contains(&format!("replication factor 1 on {single}")),
        "{out}"
    );
    db.drop().await;
}
