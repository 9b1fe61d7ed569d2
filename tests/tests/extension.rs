//! The extension's SQL API seen from outside, with several connections:
//! validation, privileges, concurrency, the inbox, retention and status.
//! Run again by scripts/test on extensions upgraded from 0.1.0 and 0.2.0.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use pg_outbox_tests::{
    catalog, connect, emit, has_extension, sqlstate, unique, with_database, Edition, Forwarder,
    Reader, TestDb,
};
use rand::seq::SliceRandom;
use tokio::sync::Barrier;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(120);

async fn count(client: &Client, table: &str) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM outbox.{table}"), &[])
        .await
        .expect("count")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_argument_gets_its_own_sqlstate_and_writes_nothing() {
    let db = TestDb::create("validation").await;
    let client = db.admin().await;
    let long = |n: usize| format!("'{}'", "x".repeat(n));
    let emit = |args: &str| format!("SELECT * FROM outbox.emit_event({args})");
    let ok = "'order', 'o-1', 'Placed', '{}'";
    let big_payload = "jsonb_build_object('blob', repeat('x', 1100000))";
    let batch_of_10001 = "(SELECT jsonb_agg(jsonb_build_object('aggregate_type', 'a', 'aggregate_id', 'b', 'event_type', 'c', 'payload', 1)) FROM generate_series(1, 10001))";
    let cases: Vec<(&str, String, &str)> = vec![
        // emit_event: identifiers
        ("aggregate_type NULL", emit("NULL, 'o-1', 'Placed', '{}'"), "PO001"),
        ("aggregate_type empty", emit("'', 'o-1', 'Placed', '{}'"), "PO001"),
        ("aggregate_type too long", emit(&format!("{}, 'o-1', 'Placed', '{{}}'", long(129))), "PO003"),
        ("aggregate_type not topic-safe", emit("'my order', 'o-1', 'Placed', '{}'"), "PO007"),
        ("aggregate_id NULL", emit("'order', NULL, 'Placed', '{}'"), "PO001"),
        ("aggregate_id empty", emit("'order', '', 'Placed', '{}'"), "PO001"),
        ("aggregate_id too long", emit(&format!("'order', {}, 'Placed', '{{}}'", long(513))), "PO003"),
        ("event_type NULL", emit("'order', 'o-1', NULL, '{}'"), "PO001"),
        ("event_type empty", emit("'order', 'o-1', '', '{}'"), "PO001"),
        ("event_type too long", emit(&format!("'order', 'o-1', {}, '{{}}'", long(256))), "PO003"),
        // payload
        ("payload NULL", emit("'order', 'o-1', 'Placed', NULL"), "PO001"),
        ("payload too large", emit(&format!("'order', 'o-1', 'Placed', {big_payload}")), "PO004"),
        // headers
        ("headers an array", emit(&format!("{ok}, headers => '[1]'")), "PO006"),
        ("headers a string", emit(&format!("{ok}, headers => '\"h\"'")), "PO006"),
        ("header value a number", emit(&format!("{ok}, headers => '{{\"a\": 1}}'")), "PO006"),
        ("header name reserved", emit(&format!("{ok}, headers => '{{\"event_id\": \"x\"}}'")), "PO006"),
        ("header name empty", emit(&format!("{ok}, headers => '{{\"\": \"x\"}}'")), "PO006"),
        ("header name too long", emit(&format!("{ok}, headers => '{{\"{}\": \"x\"}}'", "h".repeat(256))), "PO006"),
        ("header value an object", emit(&format!("{ok}, headers => '{{\"a\": {{\"b\": \"c\"}}}}'")), "PO006"),
        ("header value null", emit(&format!("{ok}, headers => '{{\"a\": \"x\", \"b\": null}}'")), "PO006"),
        // other options
        ("schema_version 0", emit(&format!("{ok}, schema_version => 0")), "PO007"),
        ("schema_version NULL", emit(&format!("{ok}, schema_version => NULL")), "PO007"),
        ("expected_seq negative", emit(&format!("{ok}, expected_seq => -1")), "PO007"),
        ("expected_seq ahead", emit(&format!("{ok}, expected_seq => 5")), "PO101"),
        ("idempotency_key empty", emit(&format!("{ok}, idempotency_key => ''")), "PO003"),
        ("idempotency_key too long", emit(&format!("{ok}, idempotency_key => {}", long(256))), "PO003"),
        ("topic with a space", emit(&format!("{ok}, topic => 'my topic'")), "PO005"),
        ("topic too long", emit(&format!("{ok}, topic => {}", long(250))), "PO005"),
        ("topic ..", emit(&format!("{ok}, topic => '..'")), "PO005"),
        // emit_events
        ("batch NULL", "SELECT * FROM outbox.emit_events(NULL)".into(), "PO008"),
        ("batch an object", "SELECT * FROM outbox.emit_events('{}')".into(), "PO008"),
        ("batch empty", "SELECT * FROM outbox.emit_events('[]')".into(), "PO008"),
        ("batch element a number", "SELECT * FROM outbox.emit_events('[1]')".into(), "PO008"),
        ("batch element without payload", r#"SELECT * FROM outbox.emit_events('[{"aggregate_type": "a", "aggregate_id": "b", "event_type": "c"}]')"#.into(), "PO008"),
        ("batch element with a numeric type", r#"SELECT * FROM outbox.emit_events('[{"aggregate_type": 1, "aggregate_id": "b", "event_type": "c", "payload": 1}]')"#.into(), "PO008"),
        ("batch element with a text schema_version", r#"SELECT * FROM outbox.emit_events('[{"aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": 1, "schema_version": "x"}]')"#.into(), "PO008"),
        ("batch second element bad", r#"SELECT * FROM outbox.emit_events('[{"aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": 1}, {"aggregate_type": "a", "aggregate_id": "", "event_type": "c", "payload": 1}]')"#.into(), "PO001"),
        ("batch too large", format!("SELECT * FROM outbox.emit_events({batch_of_10001})"), "PO008"),
        // current_seq
        ("current_seq NULL", "SELECT outbox.current_seq(NULL, 'x')".into(), "PO001"),
        ("current_seq empty", "SELECT outbox.current_seq('order', '')".into(), "PO001"),
        // inbox
        ("inbox consumer NULL", "SELECT * FROM outbox.inbox_receive(NULL, outbox.uuid_v7())".into(), "PO001"),
        ("inbox event NULL", "SELECT * FROM outbox.inbox_receive('billing', NULL)".into(), "PO001"),
        ("inbox consumer unregistered", "SELECT * FROM outbox.inbox_receive('nobody', outbox.uuid_v7())".into(), "PO011"),
        ("register consumer empty", "SELECT outbox.register_consumer('', 'postgres')".into(), "PO002"),
        ("register consumer too long", format!("SELECT outbox.register_consumer({}, 'postgres')", long(256)), "PO002"),
        ("register consumer NULL owner", "SELECT outbox.register_consumer('billing', NULL)".into(), "PO001"),
        ("register consumer unknown owner", "SELECT outbox.register_consumer('billing', 'no_such_role_x')".into(), "42704"),
        // retention and publication
        ("prune NULL horizon", "SELECT outbox.prune(NULL)".into(), "PO007"),
        ("prune negative horizon", "SELECT outbox.prune('-1 day')".into(), "PO007"),
        ("prune zero rows", "SELECT outbox.prune('1 day', 0)".into(), "PO007"),
        ("publication name empty", "SELECT outbox.ensure_publication('')".into(), "PO002"),
        ("publication name upper case", "SELECT outbox.ensure_publication('Bad-Name')".into(), "PO002"),
        ("shard publication name", "SELECT outbox.ensure_shard_publication('Bad-Name', 0, 2)".into(), "PO002"),
        ("shard past the count", "SELECT outbox.ensure_shard_publication('s_2_of_2', 2, 2)".into(), "PO007"),
        ("shard count zero", "SELECT outbox.ensure_shard_publication('s_0_of_0', 0, 0)".into(), "PO007"),
        ("shard negative", "SELECT outbox.ensure_shard_publication('s_x_of_2', -1, 2)".into(), "PO007"),
        ("shard count NULL", "SELECT outbox.ensure_shard_publication('s_0_of_x', 0, NULL)".into(), "PO007"),
    ];
    let mut wrong = Vec::new();
    for (what, sql, expected) in &cases {
        let got = sqlstate(&client.simple_query(sql).await);
        if got != *expected {
            wrong.push(format!("{what}: expected {expected}, got {got}"));
        }
    }
    // Every header the forwarder sets itself is refused as an event's own,
    // alone and in a batch.
    for name in cdc_forwarder::routing::header::ALL {
        let headers = format!(r#"{{"{name}": "x"}}"#);
        for sql in [
            emit(&format!("{ok}, headers => '{headers}'")),
            format!(
                r#"SELECT * FROM outbox.emit_events('[{{"aggregate_type": "a", "aggregate_id": "b", "event_type": "c", "payload": 1, "headers": {headers}}}]')"#
            ),
        ] {
            let got = sqlstate(&client.simple_query(&sql).await);
            if got != "PO006" {
                wrong.push(format!(
                    "header {name} reserved: expected PO006, got {got} from {sql}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "wrong SQLSTATEs:\n{}", wrong.join("\n"));
    for table in [
        "events",
        "sequence_floors",
        "idempotency_keys",
        "inbox",
        "inbox_consumers",
    ] {
        assert_eq!(
            count(&client, table).await,
            0,
            "a row was written to outbox.{table}"
        );
    }

    // Every error says what to do.
    let err = client
        .simple_query(&emit("'order', '', 'Placed', '{}'"))
        .await
        .expect_err("refused");
    let db_err = err.as_db_error().expect("a server error");
    assert!(db_err.message().contains("aggregate_id"), "{db_err:?}");
    assert!(db_err.hint().is_some_and(|h| !h.is_empty()), "{db_err:?}");
    db.drop().await;
}

/// A login role of this test's own, member of `group`.
async fn login_role(db: &TestDb, group: &str) -> (String, Client) {
    let name = unique("role");
    let admin = db.admin().await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE {name} LOGIN PASSWORD 'pw' IN ROLE {group}"
        ))
        .await
        .expect("create role");
    let url = with_database(&db.stack.admin_url, &db.name).replacen(
        "postgres:postgres@",
        &format!("{name}:pw@"),
        1,
    );
    (name, connect(&url).await)
}

async fn drop_roles(db: &TestDb, roles: &[&str]) {
    let admin = connect(&db.stack.admin_url).await;
    for role in roles {
        let _ = admin
            .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_can_emit_but_never_touch_the_tables() {
    let db = TestDb::create("privileges").await;
    let (app, client) = login_role(&db, &db.role("writer").await).await;

    let row = client
        .query_one(
            "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'Placed', '{}')",
            &[],
        )
        .await
        .expect("the writer role may emit");
    assert_eq!(row.get::<_, i64>(0), 1);
    let denied = [
        "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload) VALUES (gen_random_uuid(), 'order', 'o-1', 7, 'Forged', '{}')",
        "UPDATE outbox.events SET payload = '{}'",
        "DELETE FROM outbox.events",
        "SELECT * FROM outbox.events",
        "INSERT INTO outbox.sequence_floors VALUES ('order', 'o-1', 0)",
        "UPDATE outbox.sequence_floors SET last_seq = 0",
        "DELETE FROM outbox.sequence_floors",
        "SELECT outbox.lock_aggregate('order', 'o-1')",
        "SELECT * FROM outbox.check_emit('a', 'b', 'c', '{}', NULL, 1, NULL, NULL, NULL)",
        "TRUNCATE outbox.events",
        "SELECT outbox.record_relay_progress('s', '0/0')",
        "SELECT outbox.forget_relay('s')",
        "SELECT outbox.prune('0 s')",
        "SELECT outbox.register_consumer('x', 'postgres')",
        "SELECT * FROM outbox.inbox_receive('billing', gen_random_uuid())",
        "SELECT * FROM outbox.inbox",
        "SELECT outbox.check_event('a', 'b', 'c', '{}', NULL, 1, NULL)",
    ];
    for sql in denied {
        assert_eq!(
            sqlstate(&client.simple_query(sql).await),
            "42501",
            "{sql} was allowed"
        );
    }
    // The sequence cannot be forged or reset: it moved only through emit_event.
    let row = client
        .query_one("SELECT outbox.current_seq('order', 'o-1')", &[])
        .await
        .expect("current_seq");
    assert_eq!(row.get::<_, i64>(0), 1);

    // Inbox: a consumer's rows are reachable only by members of its owner.
    let consumer = db.role("consumer").await;
    let (billing, billing_client) = login_role(&db, &consumer).await;
    let (shipping, shipping_client) = login_role(&db, &consumer).await;
    let admin = db.admin().await;
    admin
        .execute(
            "SELECT outbox.register_consumer('billing', $1::text::regrole)",
            &[&billing],
        )
        .await
        .expect("register");
    let event = "'0190a0b0-0000-7000-8000-000000000001'";
    let own = billing_client
        .query_one(
            &format!("SELECT status FROM outbox.inbox_receive('billing', {event})"),
            &[],
        )
        .await
        .expect("own inbox");
    assert_eq!(own.get::<_, String>(0), "new");
    let other = shipping_client
        .simple_query(&format!(
            "SELECT status FROM outbox.inbox_receive('billing', {event})"
        ))
        .await;
    assert_eq!(
        sqlstate(&other),
        "PO011",
        "another consumer's inbox was reachable"
    );

    drop(client);
    drop(billing_client);
    drop(shipping_client);
    db.drop().await;
    drop_roles(&db_stack_only(), &[&app, &billing, &shipping]).await;
}

/// A handle to the stack alone, for cleanup after the test database is gone.
fn db_stack_only() -> TestDb {
    TestDb {
        stack: pg_outbox_tests::Stack::from_env(),
        name: "postgres".into(),
        slot: String::new(),
        topic_prefix: String::new(),
        edition: Edition::Extension,
    }
}

async fn sequences(client: &Client, aggregate_id: &str) -> Vec<i64> {
    client
        .query(
            "SELECT aggregate_seq FROM outbox.events WHERE aggregate_id = $1 ORDER BY aggregate_seq",
            &[&aggregate_id],
        )
        .await
        .expect("read")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Shards split on the hash each emit stores: it must be
/// `outbox.aggregate_hash` of the aggregate whichever way the event went in
/// (the C code's executor-free insert, its SQL insert, a batch, the SQL
/// edition), for any text, and the function a fixed one (SHA-256 of type,
/// zero byte, id in UTF-8: `printf 'order\0o-1' | sha256sum` starts
/// abf2e178).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_event_stores_its_aggregates_hash_however_it_was_emitted() {
    let db = TestDb::create("hash").await;
    let client = db.admin().await;
    let known: i32 = client
        .query_one("SELECT outbox.aggregate_hash('order', 'o-1')", &[])
        .await
        .expect("aggregate_hash")
        .get(0);
    assert_eq!(known, 0x2bf2_e178);
    let ids = [
        "o-1",
        "Ünïcødé-ß",
        "日本語",
        "a b",
        "x'y",
        "0",
        "long-".repeat(100).as_str(),
    ]
    .map(str::to_owned);
    for direct in ["on", "off"] {
        client
            .batch_execute(&format!("SET pg_outbox.direct_insert = {direct}"))
            .await
            .expect("set");
        for id in &ids {
            emit(&client, "order", id, "Placed", "{}").await;
            emit(&client, "invoice", id, "Placed", "{}").await;
        }
    }
    let batch = serde_json::json!(ids
        .iter()
        .map(|id| serde_json::json!({"aggregate_type": "cart", "aggregate_id": id, "event_type": "E", "payload": 1}))
        .collect::<Vec<_>>());
    client
        .execute(
            "SELECT * FROM outbox.emit_events($1::text::jsonb)",
            &[&batch.to_string()],
        )
        .await
        .expect("batch");
    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE aggregate_hash IS DISTINCT FROM outbox.aggregate_hash(aggregate_type, aggregate_id)), \
                    count(DISTINCT aggregate_hash) FROM outbox.events",
            &[],
        )
        .await
        .expect("count");
    let (events, wrong, distinct): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(events, 4 * ids.len() as i64 + ids.len() as i64);
    assert_eq!(wrong, 0, "every stored hash is the function's");
    assert_eq!(distinct, 3 * ids.len() as i64, "one hash per aggregate");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_writers_on_one_hot_aggregate_get_1_to_16000_without_gaps() {
    let db = TestDb::create("hot").await;
    let barrier = Arc::new(Barrier::new(16));
    let mut writers = Vec::new();
    for _ in 0..16 {
        let client = db.admin().await;
        let barrier = barrier.clone();
        writers.push(tokio::spawn(async move {
            let statement = client
                .prepare("SELECT aggregate_seq FROM outbox.emit_event('account', 'hot', 'Credited', '{}')")
                .await
                .expect("prepare");
            barrier.wait().await;
            for _ in 0..1000 {
                client.query_one(&statement, &[]).await.expect("emit");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let seqs = sequences(&db.admin().await, "hot").await;
    assert_eq!(seqs, (1..=16_000).collect::<Vec<i64>>());
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_writers_on_distinct_aggregates_each_count_from_one() {
    let db = TestDb::create("distinct").await;
    let mut writers = Vec::new();
    for w in 0..16 {
        let client = db.admin().await;
        writers.push(tokio::spawn(async move {
            for _ in 0..300 {
                client
                    .query_one(
                        "SELECT 1 FROM outbox.emit_event('account', $1, 'Credited', '{}')",
                        &[&format!("acc-{w}")],
                    )
                    .await
                    .expect("emit");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let client = db.admin().await;
    for w in 0..16 {
        assert_eq!(
            sequences(&client, &format!("acc-{w}")).await,
            (1..=300).collect::<Vec<i64>>()
        );
    }
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_batches_over_shared_aggregates_never_deadlock() {
    let db = TestDb::create("batches").await;
    let barrier = Arc::new(Barrier::new(8));
    let mut writers = Vec::new();
    for _ in 0..8 {
        let mut client = db.admin().await;
        let barrier = barrier.clone();
        writers.push(tokio::spawn(async move {
            barrier.wait().await;
            for _ in 0..40 {
                // The same five aggregates, each batch in another order, and
                // two batches per transaction to hold the locks longer.
                let tx = client.transaction().await.expect("begin");
                for _ in 0..2 {
                    let mut ids: Vec<usize> = (0..5).collect();
                    ids.shuffle(&mut rand::rng());
                    let batch: Vec<String> = ids
                        .iter()
                        .map(|i| format!(r#"{{"aggregate_type": "cart", "aggregate_id": "c-{i}", "event_type": "Touched", "payload": {{}}}}"#))
                        .collect();
                    tx.query(
                        "SELECT * FROM outbox.emit_events($1::text::jsonb)",
                        &[&format!("[{}]", batch.join(","))],
                    )
                    .await
                    .expect("no deadlock");
                }
                tx.commit().await.expect("commit");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let client = db.admin().await;
    for i in 0..5 {
        assert_eq!(
            sequences(&client, &format!("c-{i}")).await,
            (1..=640).collect::<Vec<i64>>()
        );
    }
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_numbers_each_aggregate_consecutively_in_the_given_order() {
    let db = TestDb::create("batch_order").await;
    let client = db.admin().await;
    client
        .query_one("SELECT outbox.emit_event('cart', 'b', 'First', '{}')", &[])
        .await
        .expect("emit");
    let rows = client
        .query(
            r#"SELECT ordinal, aggregate_seq FROM outbox.emit_events('[
                {"aggregate_type": "cart", "aggregate_id": "a", "event_type": "E", "payload": 1},
                {"aggregate_type": "cart", "aggregate_id": "b", "event_type": "E", "payload": 2},
                {"aggregate_type": "cart", "aggregate_id": "a", "event_type": "E", "payload": 3},
                {"aggregate_type": "cart", "aggregate_id": "b", "event_type": "E", "payload": 4, "headers": {"k": "v"}, "topic": "carts.special", "schema_version": 2}
            ]')"#,
            &[],
        )
        .await
        .expect("batch");
    let got: Vec<(i32, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(got, vec![(1, 1), (2, 2), (3, 2), (4, 3)]);
    let last = client
        .query_one(
            "SELECT payload::text, headers::text, topic, schema_version FROM outbox.events WHERE aggregate_id = 'b' AND aggregate_seq = 3",
            &[],
        )
        .await
        .expect("stored");
    assert_eq!(last.get::<_, String>(0), "4");
    assert_eq!(last.get::<_, String>(1), r#"{"k": "v"}"#);
    assert_eq!(last.get::<_, String>(2), "carts.special");
    assert_eq!(last.get::<_, i32>(3), 2);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_retries_with_one_idempotency_key_give_one_event() {
    let db = TestDb::create("idempotency").await;
    let barrier = Arc::new(Barrier::new(16));
    let mut callers = Vec::new();
    for _ in 0..16 {
        let mut client = db.admin().await;
        let barrier = barrier.clone();
        callers.push(tokio::spawn(async move {
            barrier.wait().await;
            let tx = client.transaction().await.expect("begin");
            let row = tx
                .query_one(
                    "SELECT event_id::text, aggregate_seq, replayed FROM outbox.emit_event('payment', 'p-1', 'Captured', '{}', idempotency_key => 'request-42')",
                    &[],
                )
                .await
                .expect("emit");
            // Hold the key a moment so the others really wait on it.
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.commit().await.expect("commit");
            (row.get::<_, String>(0), row.get::<_, i64>(1), row.get::<_, bool>(2))
        }));
    }
    let mut results = Vec::new();
    for c in callers {
        results.push(c.await.expect("caller"));
    }
    let ids: HashSet<&str> = results.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(ids.len(), 1, "every caller got the same event");
    assert_eq!(
        results.iter().filter(|r| !r.2).count(),
        1,
        "exactly one emitted"
    );
    assert!(results.iter().all(|r| r.1 == 1));
    assert_eq!(count(&db.admin().await, "events").await, 1);

    // A different key, or the same key on another aggregate type, emits again.
    let client = db.admin().await;
    let other: bool = client
        .query_one("SELECT replayed FROM outbox.emit_event('refund', 'p-1', 'Issued', '{}', idempotency_key => 'request-42')", &[])
        .await
        .expect("emit")
        .get(0);
    assert!(!other);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expected_seq_lets_exactly_one_of_racing_writers_win_each_step() {
    let db = TestDb::create("expected").await;
    let mut writers = Vec::new();
    for _ in 0..8 {
        let client = db.admin().await;
        writers.push(tokio::spawn(async move {
            let (mut won, mut conflicts) = (0, 0);
            while won < 25 {
                let seen: i64 = client
                    .query_one("SELECT outbox.current_seq('doc', 'd-1')", &[])
                    .await
                    .expect("read")
                    .get(0);
                let result = client
                    .query_one(
                        "SELECT aggregate_seq FROM outbox.emit_event('doc', 'd-1', 'Edited', '{}', expected_seq => $1)",
                        &[&seen],
                    )
                    .await;
                match sqlstate(&result).as_str() {
                    "ok" => {
                        assert_eq!(result.expect("ok").get::<_, i64>(0), seen + 1);
                        won += 1;
                    }
                    "PO101" => conflicts += 1,
                    other => panic!("unexpected {other}"),
                }
            }
            conflicts
        }));
    }
    let mut conflicts = 0;
    for w in writers {
        conflicts += w.await.expect("writer");
    }
    eprintln!("{conflicts} conflicts among 8 writers");
    assert_eq!(
        sequences(&db.admin().await, "d-1").await,
        (1..=200).collect::<Vec<i64>>()
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_tells_new_duplicate_and_gap_inside_the_consumers_transaction() {
    let db = TestDb::create("inbox").await;
    let mut client = db.admin().await;
    client
        .execute(
            "SELECT outbox.register_consumer('billing', current_user::text::regrole)",
            &[],
        )
        .await
        .expect("register");
    let receive = "SELECT status, expected_seq FROM outbox.inbox_receive('billing', $1::text::uuid, 'order', 'o-1', $2)";
    let id = |n: u8| format!("0190a0b0-0000-7000-8000-0000000000{n:02}");
    let mut steps: HashMap<&str, (String, Option<i64>)> = HashMap::new();
    for (name, event, seq) in [
        ("first", 1, 1i64),
        ("again", 1, 1),
        ("second", 2, 2),
        ("skip", 4, 4),
    ] {
        let row = client
            .query_one(receive, &[&id(event), &seq])
            .await
            .expect("receive");
        steps.insert(name, (row.get(0), row.get(1)));
    }
    assert_eq!(steps["first"], ("new".into(), None));
    assert_eq!(steps["again"], ("duplicate".into(), None));
    assert_eq!(steps["second"], ("new".into(), None));
    assert_eq!(
        steps["skip"],
        ("gap".into(), Some(3)),
        "sequence 3 is missing"
    );

    // A consumer that rolls back its transaction leaves no trace.
    let tx = client.transaction().await.expect("begin");
    let row = tx
        .query_one(receive, &[&id(5), &5i64])
        .await
        .expect("receive");
    assert_eq!(row.get::<_, String>(0), "new");
    tx.rollback().await.expect("rollback");
    let row = client
        .query_one(receive, &[&id(5), &5i64])
        .await
        .expect("receive");
    assert_eq!(row.get::<_, String>(0), "new");
    db.drop().await;
}

/// Prunes until `n` events went, polling while the forwarder's progress
/// reaches them; panics after `WAIT`.
async fn prune_until(client: &Client, n: i64) {
    let deadline = std::time::Instant::now() + WAIT;
    let mut pruned = 0;
    while pruned < n {
        assert!(
            std::time::Instant::now() < deadline,
            "only {pruned} of {n} events became prunable"
        );
        pruned += prune(client).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pruned, n);
}

async fn prune(client: &Client) -> i64 {
    client
        .query_one("SELECT outbox.prune('0 seconds', 1000)", &[])
        .await
        .expect("prune")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_only_what_the_forwarder_confirmed() {
    let db = TestDb::create("retention").await;
    let topic = db.create_topic("note", 1).await;
    let client = db.admin().await;
    // Five events of one aggregate at a time.
    let emit_five = |label: &'static str| {
        let client = &client;
        async move {
            for _ in 0..5 {
                client
                    .query_one(
                        "SELECT 1 FROM outbox.emit_event('note', 'n-1', 'Written', $1::text::jsonb)",
                        &[&format!("\"{label}\"")],
                    )
                    .await
                    .expect("emit");
            }
        }
    };
    emit_five("before").await;
    assert_eq!(
        prune(&client).await,
        0,
        "nothing is confirmed without a forwarder"
    );

    let forwarder = Forwarder::spawn(&db, &[]);
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "the first five", |r| r.len() >= 5)
        .await;
    // The newest event stays: it carries the aggregate's numbering.
    prune_until(&client, 4).await;

    // Written while the forwarder is down: never pruned before delivery.
    forwarder.kill9().await;
    db.wait_slot_inactive(WAIT).await;
    emit_five("while_down").await;
    assert_eq!(
        prune(&client).await,
        1,
        "only the delivered event that is no longer the newest"
    );
    let status = client
        .query_one("SELECT active, caught_up, unforwarded_events FROM outbox.status() WHERE slot_name = $1", &[&db.slot])
        .await
        .expect("status");
    assert!(!status.get::<_, bool>(0));
    assert!(status.get::<_, bool>(1));
    assert!(
        status.get::<_, i64>(2) >= 5,
        "status counts the waiting events"
    );
    assert_eq!(count(&client, "events").await, 5);

    let restarted = Forwarder::spawn(&db, &[]);
    reader
        .read_until(WAIT, "the five written while down", |r| r.len() >= 10)
        .await;
    prune_until(&client, 4).await;
    assert_eq!(count(&client, "events").await, 1);
    let newest: i64 = client
        .query_one("SELECT outbox.current_seq('note', 'n-1')", &[])
        .await
        .expect("current_seq")
        .get(0);
    assert_eq!(newest, 10, "the numbering survives pruning");
    let status = client
        .query_one("SELECT active, lag_bytes, unforwarded_events FROM outbox.status() WHERE slot_name = $1", &[&db.slot])
        .await
        .expect("status");
    assert!(status.get::<_, bool>(0));
    restarted.kill9().await;
    db.drop().await;
}

/// A database of its own, owned by `owner` (a role name) when given.
async fn scratch_database(prefix: &str, owner: Option<&str>) -> String {
    let stack = pg_outbox_tests::Stack::from_env();
    let name = unique(prefix);
    let owner = owner.map_or(String::new(), |owner| format!(" OWNER {owner}"));
    connect(&stack.admin_url)
        .await
        .batch_execute(&format!("CREATE DATABASE {name}{owner}"))
        .await
        .expect("create database");
    name
}

async fn drop_databases(names: &[&str]) {
    let admin = connect(&pg_outbox_tests::Stack::from_env().admin_url).await;
    for name in names {
        let _ = admin
            .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_extension_equals_a_fresh_one() {
    if Edition::skip_on_sql("it compares installs of the extension") {
        return;
    }
    // Both installs in databases of their own; their catalogs must match.
    let stack = pg_outbox_tests::Stack::from_env();
    let fresh = scratch_database("t_fresh", None).await;
    let upgraded = scratch_database("t_upgraded", None).await;
    let fresh_client = connect(&with_database(&stack.admin_url, &fresh)).await;
    fresh_client
        .batch_execute("CREATE EXTENSION pg_outbox")
        .await
        .expect("fresh install");
    let upgraded_client = connect(&with_database(&stack.admin_url, &upgraded)).await;
    upgraded_client
        .batch_execute(
            "CREATE EXTENSION pg_outbox VERSION '0.1.0'; ALTER EXTENSION pg_outbox UPDATE",
        )
        .await
        .expect("upgrade");
    let fresh_catalog = catalog::describe(&fresh_client).await;
    let upgraded_catalog = catalog::describe(&upgraded_client).await;
    assert!(fresh_catalog.len() > 100, "{fresh_catalog:#?}");
    assert!(
        fresh_catalog == upgraded_catalog,
        "a fresh install (first) and one upgraded from 0.1.0 (second) differ:\n{}",
        catalog::difference(&fresh_catalog, &upgraded_catalog)
    );
    drop((fresh_client, upgraded_client));
    drop_databases(&[&fresh, &upgraded]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_edition_equals_the_extension_but_for_the_language_of_its_c_functions() {
    if Edition::skip_on_sql("it installs both editions itself") {
        return;
    }
    let stack = pg_outbox_tests::Stack::from_env();
    let owner = pg_outbox_tests::user_of(&stack.owner_url).to_owned();
    let extension = scratch_database("t_ext", None).await;
    let edition = scratch_database("t_edition", Some(&owner)).await;
    let extension_client = connect(&with_database(&stack.admin_url, &extension)).await;
    extension_client
        .batch_execute("CREATE EXTENSION pg_outbox")
        .await
        .expect("extension");
    let edition_url = with_database(&stack.owner_url, &edition);
    pg_outbox_tests::install_sql_edition(&edition_url).await;
    let edition_client = connect(&edition_url).await;
    let owner_is_superuser: bool = edition_client
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .expect("role")
        .get(0);
    assert!(
        !owner_is_superuser,
        "the edition must install without a superuser"
    );

    let extension_catalog = catalog::describe(&extension_client).await;
    let edition_catalog = catalog::describe(&edition_client).await;
    // The functions written in C: their implementation lines may differ.
    let c_functions: Vec<String> = extension_catalog
        .iter()
        .filter_map(|line| {
            let rest = line.strip_prefix("body ")?;
            let (signature, implementation) = rest.split_once(' ')?;
            implementation
                .starts_with("c ")
                .then(|| signature.to_owned())
        })
        .collect();
    assert_eq!(
        c_functions,
        [
            "outbox.check_payload(text,text,integer,jsonb)",
            "outbox.emit_event(text,text,text,jsonb,jsonb,integer,bigint,text,text)",
            "outbox.lock_aggregate(text,text)",
            "outbox.schema_problem(jsonb)",
            "outbox.schemas_changed()",
            "outbox.uuid_v7()"
        ]
    );
    let interface = |catalog: &[String]| -> Vec<String> {
        catalog
            .iter()
            .filter(|line| {
                !c_functions
                    .iter()
                    .any(|f| line.starts_with(&format!("body {f} ")))
            })
            .cloned()
            .collect()
    };
    let (extension_interface, edition_interface) =
        (interface(&extension_catalog), interface(&edition_catalog));
    assert!(
        extension_interface == edition_interface,
        "the extension (first) and the SQL edition (second) differ:\n{}",
        catalog::difference(&extension_interface, &edition_interface)
    );
    assert!(
        !edition_catalog.iter().any(|line| line.contains(" c ")),
        "the SQL edition declares a C function"
    );

    // The edition's event ids are version 7 UUIDs carrying the time.
    let id: String = edition_client
        .query_one("SELECT outbox.uuid_v7()::text", &[])
        .await
        .expect("uuid_v7")
        .get(0);
    assert_eq!(&id[14..15], "7", "version nibble of {id}");
    assert!("89ab".contains(&id[19..20]), "RFC 9562 variant of {id}");
    let millis = u64::from_str_radix(&format!("{}{}", &id[0..8], &id[9..13]), 16).expect("hex");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is past 1970")
        .as_millis() as u64;
    assert!(
        now.abs_diff(millis) < 60_000,
        "{id} carries the time it was made"
    );

    // Run again over itself: nothing changes, no event is lost.
    let emitted: i64 = edition_client
        .query_one(
            "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'Placed', '{}')",
            &[],
        )
        .await
        .expect("emit on the edition")
        .get(0);
    assert_eq!(emitted, 1);
    pg_outbox_tests::install_sql_edition(&edition_url).await;
    assert_eq!(catalog::describe(&edition_client).await, edition_catalog);
    assert_eq!(count(&edition_client, "events").await, 1);

    // Over the extension, or a schema outbox of someone else's: refused.
    let (ok, stderr) = pg_outbox_tests::psql_file(
        &with_database(&stack.admin_url, &extension),
        &pg_outbox_tests::sql_edition_file(),
    )
    .await;
    assert!(!ok);
    assert!(
        stderr.contains("this database has the pg_outbox extension"),
        "{stderr}"
    );
    drop((extension_client, edition_client));
    drop_databases(&[&extension, &edition]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_writers_number_after_what_committed_meanwhile() {
    let db = TestDb::create("rr").await;
    let mut early = db.admin().await;
    let late = db.admin().await;
    let emit = "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'E', '{}')";
    let tx = early
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .expect("begin");
    // The transaction's snapshot is taken here, before the other commit.
    assert_eq!(
        tx.query_one("SELECT outbox.current_seq('order', 'o-1')", &[])
            .await
            .expect("read")
            .get::<_, i64>(0),
        0
    );
    assert_eq!(
        late.query_one(emit, &[])
            .await
            .expect("emit")
            .get::<_, i64>(0),
        1
    );
    if Edition::from_env() == Edition::Sql {
        // The SQL edition reads with the transaction's snapshot: it refuses
        // with a serialization failure, and a retry numbers after.
        assert_eq!(sqlstate(&tx.query_one(emit, &[]).await), "40001");
        tx.rollback().await.expect("rollback");
        let retry = early
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .start()
            .await
            .expect("begin");
        let seq: i64 = retry.query_one(emit, &[]).await.expect("retried").get(0);
        assert_eq!(seq, 2);
        retry.commit().await.expect("commit");
        db.drop().await;
        return;
    }
    let seq: i64 = tx
        .query_one(emit, &[])
        .await
        .expect("no unique violation")
        .get(0);
    assert_eq!(seq, 2, "numbered after the event its snapshot cannot see");
    tx.commit().await.expect("commit");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_from_0_2_0_keeps_every_numbering_and_idempotency_key() {
    if Edition::skip_on_sql("it upgrades the extension") {
        return;
    }
    let stack = pg_outbox_tests::Stack::from_env();
    let name = unique("t_from020");
    connect(&stack.admin_url)
        .await
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create");
    let client = connect(&with_database(&stack.admin_url, &name)).await;
    client
        .batch_execute(
            "CREATE EXTENSION pg_outbox VERSION '0.2.0';
             SELECT outbox.emit_event('order', 'gone', 'E', '{}') FROM generate_series(1, 3);
             SELECT outbox.emit_event('order', 'kept', 'E', '{}') FROM generate_series(1, 2);
             SELECT outbox.emit_event('pay', 'p-1', 'Captured', '{}', idempotency_key => 'req-1');
             -- what a 0.2.0 prune could do: every event of an aggregate gone
             DELETE FROM outbox.events WHERE aggregate_id = 'gone';
             ALTER EXTENSION pg_outbox UPDATE;",
        )
        .await
        .expect("0.2.0 with events, then the upgrade");
    let next = |id: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT aggregate_seq FROM outbox.emit_event('order', $1, 'E', '{}')",
                    &[&id],
                )
                .await
                .expect("emit")
                .get::<_, i64>(0)
        }
    };
    assert_eq!(
        next("gone").await,
        4,
        "numbering resumes after pruned events"
    );
    assert_eq!(next("kept").await, 3);
    let replay = client
        .query_one(
            "SELECT e.event_id = k.event_id, k.aggregate_seq, k.replayed
               FROM outbox.events e,
                    outbox.emit_event('pay', 'p-1', 'Captured', '{}', idempotency_key => 'req-1') k
              WHERE e.aggregate_type = 'pay' AND e.aggregate_id = 'p-1'",
            &[],
        )
        .await
        .expect("replay");
    assert_eq!(
        (
            replay.get::<_, bool>(0),
            replay.get::<_, i64>(1),
            replay.get::<_, bool>(2)
        ),
        (true, 1, true),
        "a key stored by 0.2.0 still replays its event"
    );
    drop(client);
    let _ = connect(&stack.admin_url)
        .await
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_operator_adds_to_the_events_table_is_honoured() {
    // emit_event writes the row without the executor only while the table
    // is the one the extension made (plain indexes aside); a trigger, a
    // CHECK constraint or an expression index sends it through SQL again.
    let db = TestDb::create("added").await;
    let client = db.admin().await;
    let client = &client;
    let emit = |extra: &'static str| async move {
        client
            .query_one(
                &format!("SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'E', '{{}}'{extra})"),
                &[],
            )
            .await
            .map(|row| row.get::<_, i64>(0))
    };
    // Every heap row is in every index (amcheck's heapallindexed). Checked
    // for the extension's executor-free insert; the SQL edition inserts with
    // SQL, and its owner may not install amcheck.
    let on_sql = Edition::from_env() == Edition::Sql;
    if on_sql {
        eprintln!("not checked on the SQL edition: amcheck over the extension's direct insert");
    }
    let checked =
        !on_sql && has_extension(client, "amcheck", "every index holding every row").await;
    let indexes_hold_every_row = || async {
        if !checked {
            return;
        }
        client
            .batch_execute(
                "CREATE EXTENSION IF NOT EXISTS amcheck;
                 SELECT bt_index_check(i.indexrelid, true) FROM pg_index i
                  WHERE i.indrelid = 'outbox.events'::regclass;",
            )
            .await
            .expect("every index holds every row");
    };
    assert_eq!(emit("").await.expect("emit"), 1);

    client
        .batch_execute("CREATE INDEX events_by_type ON outbox.events (event_type, occurred_at)")
        .await
        .expect("plain index");
    assert_eq!(emit("").await.expect("emit"), 2);
    indexes_hold_every_row().await;

    client
        .batch_execute(
            "CREATE TABLE public.seen (seq bigint);
             -- The trigger runs as whoever owns emit_event: the database
             -- owner, in the SQL edition.
             GRANT INSERT ON public.seen TO PUBLIC;
             CREATE FUNCTION public.note() RETURNS trigger LANGUAGE plpgsql
                 AS $$ BEGIN INSERT INTO public.seen VALUES (NEW.aggregate_seq); RETURN NEW; END $$;
             CREATE TRIGGER note AFTER INSERT ON outbox.events
                 FOR EACH ROW EXECUTE FUNCTION public.note();",
        )
        .await
        .expect("trigger");
    assert_eq!(emit("").await.expect("emit"), 3);
    let seen: Vec<i64> = client
        .query("SELECT seq FROM public.seen", &[])
        .await
        .expect("seen")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(seen, vec![3], "the trigger fired for the event");

    client
        .batch_execute(
            "DROP TRIGGER note ON outbox.events;
             ALTER TABLE outbox.events ADD CONSTRAINT small_versions CHECK (schema_version < 5);
             CREATE INDEX events_lower_type ON outbox.events (lower(event_type));",
        )
        .await
        .expect("check constraint and expression index");
    let refused = emit(", schema_version => 7")
        .await
        .expect_err("the CHECK constraint refuses it");
    assert_eq!(
        refused.code(),
        Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION)
    );
    assert_eq!(emit("").await.expect("emit"), 4);
    indexes_hold_every_row().await;
    let stored: i64 = client
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(stored, 4, "the refused event left nothing behind");

    if Edition::from_env() == Edition::Sql {
        eprintln!("not run on the SQL edition: dropping and making the extension again");
        db.drop().await;
        return;
    }
    // The extension dropped and made again under the same session: its new
    // tables are found, not the old ones' ids.
    client
        .batch_execute("DROP EXTENSION pg_outbox CASCADE; CREATE EXTENSION pg_outbox")
        .await
        .expect("reinstall");
    assert_eq!(emit("").await.expect("emit after reinstall"), 1);
    indexes_hold_every_row().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_within_the_rules_are_stored_as_given() {
    // Names count characters, not bytes: 200 two-byte characters are allowed,
    // like 255 one-byte ones.
    let db = TestDb::create("headers").await;
    let client = db.admin().await;
    let headers = serde_json::json!({
        "trace_id": "4bf92f3577b34da6",
        "h".repeat(255): "longest name",
        "é".repeat(200): "multibyte name",
        "tenant": "",
    });
    let id: String = client
        .query_one(
            "SELECT event_id::text FROM outbox.emit_event('order', 'o-1', 'E', '{}', headers => $1::text::jsonb)",
            &[&headers.to_string()],
        )
        .await
        .expect("emit with headers")
        .get(0);
    let stored: String = client
        .query_one(
            "SELECT headers::text FROM outbox.events WHERE event_id = $1::text::uuid",
            &[&id],
        )
        .await
        .expect("stored")
        .get(0);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&stored).expect("json"),
        headers
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbering_reads_past_rolled_back_events_on_vacuumed_pages() {
    if Edition::skip_on_sql(
        "it checks the C function's read from an all-visible index entry, with pg_visibility",
    ) {
        return;
    }
    // The newest sequence comes from the index entry alone when VACUUM has
    // marked its heap page all-visible, and from the heap otherwise, where
    // a rolled-back event's entry is passed over.
    let db = TestDb::create("vacuumed").await;
    let mut client = db.admin().await;
    if !has_extension(
        &client,
        "pg_visibility",
        "the read from an all-visible index entry",
    )
    .await
    {
        db.drop().await;
        return;
    }
    client
        .batch_execute("CREATE EXTENSION pg_visibility")
        .await
        .expect("pg_visibility (PostgreSQL contrib)");
    let emit = "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'E', '{}')";
    let page_all_visible = "SELECT all_visible FROM pg_visibility_map('outbox.events', 0)";
    for expected in 1..=3_i64 {
        let seq: i64 = client.query_one(emit, &[]).await.expect("emit").get(0);
        assert_eq!(seq, expected);
    }
    let rolled_back = client.transaction().await.expect("begin");
    let seq: i64 = rolled_back.query_one(emit, &[]).await.expect("emit").get(0);
    assert_eq!(seq, 4);
    rolled_back.rollback().await.expect("rollback");
    let seq: i64 = client.query_one(emit, &[]).await.expect("emit").get(0);
    assert_eq!(seq, 4, "the rolled-back number is taken again");

    client
        .batch_execute("VACUUM outbox.events")
        .await
        .expect("vacuum");
    let all_visible: bool = client
        .query_one(page_all_visible, &[])
        .await
        .expect("vm")
        .get(0);
    assert!(all_visible, "VACUUM marks the only page all-visible");
    let seq: i64 = client.query_one(emit, &[]).await.expect("emit").get(0);
    assert_eq!(seq, 5, "read from the index entry of a page visible to all");

    let stored: Vec<i64> = client
        .query(
            "SELECT aggregate_seq FROM outbox.events WHERE aggregate_id = 'o-1' ORDER BY 1",
            &[],
        )
        .await
        .expect("stored")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(stored, vec![1, 2, 3, 4, 5]);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_search_path_cannot_lend_functions_to_the_extension() {
    // The writer puts a schema of its own first, with an `=` for text and
    // the functions the validation uses, each of which would raise. None
    // of them may run, on any path of emit_event or of the other functions.
    let db = TestDb::create("search_path").await;
    let (app, client) = login_role(&db, &db.role("writer").await).await;
    db.admin()
        .await
        .batch_execute(&format!("GRANT CREATE ON DATABASE {} TO {app}", db.name))
        .await
        .expect("grant");
    client
        .batch_execute(
            "CREATE SCHEMA trap;
             CREATE FUNCTION trap.texteq(a text, b text) RETURNS boolean LANGUAGE plpgsql
                 AS $$ BEGIN RAISE EXCEPTION 'hijacked: =' USING ERRCODE = 'XX123'; END $$;
             CREATE OPERATOR trap.= (LEFTARG = text, RIGHTARG = text, FUNCTION = trap.texteq);
             CREATE FUNCTION trap.length(t text) RETURNS integer LANGUAGE plpgsql
                 AS $$ BEGIN RAISE EXCEPTION 'hijacked: length' USING ERRCODE = 'XX123'; END $$;
             CREATE FUNCTION trap.jsonb_typeof(j jsonb) RETURNS text LANGUAGE plpgsql
                 AS $$ BEGIN RAISE EXCEPTION 'hijacked: jsonb_typeof' USING ERRCODE = 'XX123'; END $$;
             SET search_path = trap, pg_catalog;",
        )
        .await
        .expect("the trap");
    // The trap works where the caller's own SQL resolves names.
    assert_eq!(
        sqlstate(&client.simple_query("SELECT 'a'::text = 'a'::text").await),
        "XX123"
    );
    let emit = |args: &'static str| {
        let client = &client;
        async move {
            client
                .simple_query(&format!("SELECT * FROM outbox.emit_event({args})"))
                .await
        }
    };
    let calls = [
        // the common call
        ("'order', 'o-1', 'Placed', '{}'", "00000"),
        // with headers
        (
            "'order', 'o-1', 'Placed', '{}', headers => '{\"trace\": \"t\"}'",
            "00000",
        ),
        // idempotency key: claimed, then replayed
        (
            "'order', 'o-1', 'Placed', '{}', idempotency_key => 'k-1'",
            "00000",
        ),
        (
            "'order', 'o-1', 'Placed', '{}', idempotency_key => 'k-1'",
            "00000",
        ),
        // validation in PL/pgSQL: a refusal, and a valid call it has to word
        (
            "'order', 'o-1', 'Placed', '{}', headers => '{\"a\": 1}'",
            "PO006",
        ),
        ("'order', '', 'Placed', '{}'", "PO001"),
        ("'order', repeat('é', 200), 'Placed', '{}'", "00000"),
        // expected_seq
        ("'order', 'o-1', 'Placed', '{}', expected_seq => 0", "PO101"),
    ];
    for (args, expected) in calls {
        let state = match emit(args).await {
            Ok(_) => "00000".to_owned(),
            Err(e) => e.code().map(|c| c.code().to_owned()).unwrap_or_default(),
        };
        assert_eq!(state, expected, "emit_event({args})");
    }
    for sql in [
        "SELECT * FROM outbox.emit_events('[{\"aggregate_type\": \"order\", \"aggregate_id\": \"o-2\", \"event_type\": \"E\", \"payload\": {}}]')",
        "SELECT outbox.current_seq('order', 'o-1')",
    ] {
        client.simple_query(sql).await.expect(sql);
    }
    assert_eq!(
        client
            .query_one("SELECT outbox.current_seq('order', 'o-1')", &[])
            .await
            .expect("current_seq")
            .get::<_, i64>(0),
        3
    );
    drop(client);
    drop_roles(&db, &[&app]).await;
    db.drop().await;
}

/// The installed edition's version, the comment of outbox.inbox, and whether
/// outbox.next_release() exists.
async fn edition_state(client: &Client) -> (String, Option<String>, bool) {
    let row = client
        .query_one(
            "SELECT obj_description('outbox'::regnamespace, 'pg_namespace'),
                    obj_description('outbox.inbox'::regclass, 'pg_class'),
                    to_regprocedure('outbox.next_release()') IS NOT NULL",
            &[],
        )
        .await
        .expect("installed version");
    (row.get(0), row.get(1), row.get(2))
}

/// Three events of aggregate o-1 in an edition about to be upgraded.
async fn emit_three(client: &Client) {
    for _ in 0..3 {
        client
            .query_one(
                "SELECT * FROM outbox.emit_event('order', 'o-1', 'E', '{}', idempotency_key => NULL)",
                &[],
            )
            .await
            .expect("emit before the upgrade");
    }
}

/// After the upgrade: the three events are kept and o-1 numbers on from 4.
async fn assert_kept_and_numbered_on(client: &Client) {
    assert_eq!(count(client, "events").await, 3);
    let next: i64 = client
        .query_one(
            "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', 'E', '{}')",
            &[],
        )
        .await
        .expect("emit after the upgrade")
        .get(0);
    assert_eq!(next, 4);
}

/// Copies the files of from, and of its folders, into to.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("target dir");
    for entry in std::fs::read_dir(from).expect("source dir") {
        let path = entry.expect("entry").path();
        let target = to.join(path.file_name().expect("name"));
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, target).expect("copy");
        }
    }
}

/// The extension's version, as its crate declares it.
fn extension_version(root: &std::path::Path) -> String {
    let manifest =
        std::fs::read_to_string(root.join("pg_ext/Cargo.toml")).expect("pg_ext/Cargo.toml");
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("version line")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_sql_edition_upgrades_an_installed_one_in_place_keeping_its_data() {
    if Edition::skip_on_sql("it assembles and installs editions itself, in the extension pass") {
        return;
    }
    // A next release: today's SQL plus one upgrade step.
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let today = extension_version(&root);
    let (minor, patch) = today.rsplit_once('.').expect("x.y.z");
    let next = format!("{minor}.{}", patch.parse::<u32>().expect("patch") + 1);
    let release = std::env::temp_dir().join(unique("edition_next"));
    std::fs::create_dir_all(&release).expect("temp dir");
    copy_dir(&root.join("pg_ext/sql"), &release);
    std::fs::write(
        release.join(format!("pg_outbox--{today}--{next}.sql")),
        format!(
            "COMMENT ON TABLE outbox.inbox IS 'changed by {next}';\n\
             CREATE FUNCTION outbox.next_release() RETURNS integer LANGUAGE sql AS 'SELECT 41';\n"
        ),
    )
    .expect("step");
    let next_file = release.join(format!("pg_outbox_sql-{next}.sql"));
    let assembled = std::process::Command::new(root.join("scripts/sql-edition"))
        .arg("--out")
        .arg(&next_file)
        .env("OUTBOX_EDITION_SQL_DIR", &release)
        .env("OUTBOX_EDITION_VERSION", &next)
        .output()
        .expect("scripts/sql-edition");
    assert!(
        assembled.status.success(),
        "{}",
        String::from_utf8_lossy(&assembled.stderr)
    );

    // Today's edition, with data in it.
    let stack = pg_outbox_tests::Stack::from_env();
    let owner = pg_outbox_tests::user_of(&stack.owner_url).to_owned();
    let name = scratch_database("t_next", Some(&owner)).await;
    let url = with_database(&stack.owner_url, &name);
    pg_outbox_tests::install_sql_edition(&url).await;
    let client = connect(&url).await;
    emit_three(&client).await;
    assert_eq!(
        edition_state(&client).await.0,
        format!("pg_outbox SQL edition {today}")
    );

    // The next release's file over it: upgraded in place, data kept.
    let (ok, stderr) = pg_outbox_tests::psql_file(&url, &next_file).await;
    assert!(ok, "{stderr}");
    assert_eq!(
        edition_state(&client).await,
        (
            format!("pg_outbox SQL edition {next}"),
            Some(format!("changed by {next}")),
            true
        )
    );
    assert_kept_and_numbered_on(&client).await;

    // Again: nothing changes. The older file over it: refused.
    let before = catalog::describe(&client).await;
    let (ok, stderr) = pg_outbox_tests::psql_file(&url, &next_file).await;
    assert!(ok, "{stderr}");
    assert_eq!(catalog::describe(&client).await, before);
    let (ok, stderr) = pg_outbox_tests::psql_file(&url, &pg_outbox_tests::sql_edition_file()).await;
    assert!(!ok, "an older edition's file ran over a newer one");
    assert!(stderr.contains("newer than this file"), "{stderr}");

    drop(client);
    drop_databases(&[&name]).await;
    let _ = std::fs::remove_dir_all(&release);
}

/// The last commit whose sql/pg_outbox_sql.sql is the released 0.4.0 edition.
const RELEASED_0_4_0_EDITION: &str = "5d8a624";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_released_0_4_0_sql_edition_upgrades_to_todays_in_place() {
    if Edition::skip_on_sql("it installs both editions itself, in the extension pass") {
        return;
    }
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let file = pg_outbox_tests::released_sql_edition(RELEASED_0_4_0_EDITION, "0.4.0");

    let stack = pg_outbox_tests::Stack::from_env();
    let owner = pg_outbox_tests::user_of(&stack.owner_url).to_owned();
    let old = scratch_database("t_ed040", Some(&owner)).await;
    let fresh = scratch_database("t_edfresh", Some(&owner)).await;
    let old_url = with_database(&stack.owner_url, &old);
    let (ok, stderr) = pg_outbox_tests::psql_file(&old_url, &file).await;
    assert!(ok, "{stderr}");
    let client = connect(&old_url).await;
    assert_eq!(
        edition_state(&client).await.0,
        "pg_outbox SQL edition 0.4.0"
    );
    emit_three(&client).await;

    // Today's file over it: upgraded in place, the same catalog as a fresh
    // install of today's, the events kept and numbered on.
    pg_outbox_tests::install_sql_edition(&old_url).await;
    pg_outbox_tests::install_sql_edition(&with_database(&stack.owner_url, &fresh)).await;
    let fresh_client = connect(&with_database(&stack.owner_url, &fresh)).await;
    assert_eq!(
        catalog::describe(&client).await,
        catalog::describe(&fresh_client).await
    );
    let today = extension_version(&root);
    assert_eq!(
        edition_state(&client).await.0,
        format!("pg_outbox SQL edition {today}")
    );
    assert_kept_and_numbered_on(&client).await;
    drop((client, fresh_client));
    drop_databases(&[&old, &fresh]).await;
    let _ = std::fs::remove_file(&file);
}
