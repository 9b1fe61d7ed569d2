//! Event contracts: JSON Schemas registered per event type and version,
//! checked by emit_event and emit_events in every session, immutable once
//! registered, reachable only through the functions. Run on the extension
//! and on the SQL edition (scripts/test).

use pg_outbox_tests::{connect, sqlstate, unique, with_database, Edition, TestDb};
use tokio_postgres::Client;

/// An order as a shop would describe it: 12 properties, nested objects and
/// arrays, formats and bounds.
const ORDER_PLACED: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "title": "OrderPlaced",
  "type": "object",
  "required": ["order_id", "customer", "items", "total", "currency", "placed_at"],
  "additionalProperties": false,
  "properties": {
    "order_id": {"type": "string", "pattern": "^ord-[0-9]+$"},
    "customer": {
      "type": "object",
      "required": ["id", "email"],
      "properties": {"id": {"type": "integer", "minimum": 1}, "email": {"type": "string", "minLength": 3}}
    },
    "items": {
      "type": "array", "minItems": 1, "maxItems": 100,
      "items": {
        "type": "object",
        "required": ["sku", "qty", "price"],
        "properties": {
          "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"},
          "qty": {"type": "integer", "minimum": 1},
          "price": {"type": "number", "exclusiveMinimum": 0}
        }
      }
    },
    "total": {"type": "number", "minimum": 0},
    "currency": {"enum": ["EUR", "USD", "IDR"]},
    "placed_at": {"type": "string", "format": "date-time"},
    "coupon": {"type": ["string", "null"], "maxLength": 20},
    "channel": {"const": "web"},
    "notes": {"type": "string", "maxLength": 500},
    "gift": {"type": "boolean"},
    "tags": {"type": "array", "uniqueItems": true, "items": {"type": "string"}},
    "shipping": {"type": "object", "additionalProperties": {"type": "string"}}
  }
}"#;

const VALID: &str = r#"{"order_id": "ord-1", "customer": {"id": 7, "email": "a@b.c"},
  "items": [{"sku": "ABC-1", "qty": 2, "price": 9.5}], "total": 19, "currency": "EUR",
  "placed_at": "2026-12-02T10:00:00Z", "coupon": null, "channel": "web", "tags": ["x", "y"],
  "shipping": {"city": "Bandung"}}"#;

/// The valid payload with one change: `path` (object keys, array indexes)
/// set to `value`, or removed when `value` is None.
fn changed(path: &[&str], value: Option<serde_json::Value>) -> String {
    let mut payload: serde_json::Value = serde_json::from_str(VALID).expect("valid JSON");
    let (last, parents) = path.split_last().expect("a path");
    let mut at = &mut payload;
    for step in parents {
        at = match step.parse::<usize>() {
            Ok(i) => &mut at[i],
            Err(_) => &mut at[*step],
        };
    }
    let object = at.as_object_mut().expect("an object");
    match value {
        Some(value) => object.insert((*last).to_owned(), value),
        None => object.remove(*last),
    };
    payload.to_string()
}

async fn register(client: &Client, event_type: &str, version: i32, schema: &str) -> bool {
    client
        .query_one(
            "SELECT outbox.register_schema('order', $1, $2, $3::text::jsonb)",
            &[&event_type, &version, &schema],
        )
        .await
        .unwrap_or_else(|e| panic!("register_schema {event_type} {version}: {e:?}"))
        .get(0)
}

async fn emit(
    client: &Client,
    event_type: &str,
    version: i32,
    payload: &str,
) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
    client
        .query_one(
            "SELECT aggregate_seq FROM outbox.emit_event('order', 'o-1', $1, $2::text::jsonb, schema_version => $3)",
            &[&event_type, &payload, &version],
        )
        .await
}

async fn emit_batch(
    client: &Client,
    event_type: &str,
    payload: &str,
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    client
        .query(
            "SELECT * FROM outbox.emit_events(jsonb_build_array(
                 jsonb_build_object('aggregate_type', 'order', 'aggregate_id', 'o-2', 'event_type', 'Noted', 'payload', '{}'::jsonb),
                 jsonb_build_object('aggregate_type', 'order', 'aggregate_id', 'o-2', 'event_type', $1::text, 'payload', $2::text::jsonb)))",
            &[&event_type, &payload],
        )
        .await
}

async fn events(client: &Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .await
        .expect("count")
        .get(0)
}

fn message_of<T>(result: Result<T, tokio_postgres::Error>) -> String {
    let error = result.err().expect("refused");
    error
        .as_db_error()
        .map_or_else(|| error.to_string(), |db| db.message().to_owned())
}

/// (SQLSTATE, pointer, rule) of the error, the last two from its detail.
fn violation(result: Result<impl Sized, tokio_postgres::Error>) -> (String, String, String) {
    let error = result.err().expect("refused");
    let db = error.as_db_error().expect("a server error");
    let detail = db.detail().unwrap_or_default();
    let field = |name: &str| {
        detail
            .split(' ')
            .find_map(|part| part.strip_prefix(&format!("{name}=")))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        db.message().contains("order event OrderPlaced version 1"),
        "{db:?}"
    );
    (db.code().code().to_owned(), field("pointer"), field("rule"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_breaks_its_schema_is_refused_naming_the_first_violation() {
    let db = TestDb::create("contracts").await;
    let client = db.admin().await;
    assert!(register(&client, "OrderPlaced", 1, ORDER_PLACED).await);

    assert_eq!(
        emit(&client, "OrderPlaced", 1, VALID)
            .await
            .expect("a valid payload is stored")
            .get::<_, i64>(0),
        1
    );
    use serde_json::json;
    let cases = [
        (
            changed(&["order_id"], Some(json!("order-1"))),
            "/order_id",
            "pattern",
        ),
        (changed(&["customer"], None), "", "required"),
        (
            changed(&["customer", "id"], Some(json!(0))),
            "/customer/id",
            "minimum",
        ),
        (
            changed(&["customer", "id"], Some(json!(1.5))),
            "/customer/id",
            "type",
        ),
        (changed(&["items"], Some(json!([]))), "/items", "minItems"),
        (
            changed(
                &["items"],
                Some(
                    json!([{"sku": "ABC-1", "qty": 1, "price": 1}, {"sku": "ABC-2", "qty": 0, "price": 1}]),
                ),
            ),
            "/items/1/qty",
            "minimum",
        ),
        (
            changed(
                &["items"],
                Some(json!([{"sku": "ABC-1", "qty": 1, "price": 0}])),
            ),
            "/items/0/price",
            "exclusiveMinimum",
        ),
        (
            changed(&["currency"], Some(json!("GBP"))),
            "/currency",
            "enum",
        ),
        (
            changed(&["channel"], Some(json!("app"))),
            "/channel",
            "const",
        ),
        (changed(&["coupon"], Some(json!(42))), "/coupon", "type"),
        (
            changed(&["notes"], Some(json!("n".repeat(501)))),
            "/notes",
            "maxLength",
        ),
        (
            changed(&["tags"], Some(json!(["x", "x"]))),
            "/tags",
            "uniqueItems",
        ),
        (
            changed(&["shipping"], Some(json!({"city": 1}))),
            "/shipping/city",
            "type",
        ),
        (
            changed(&["surprise"], Some(json!(true))),
            "",
            "additionalProperties",
        ),
        ("[1, 2]".to_owned(), "", "type"),
    ];
    for (payload, pointer, rule) in &cases {
        let expected = (
            "PO020".to_owned(),
            (*pointer).to_owned(),
            (*rule).to_owned(),
        );
        assert_eq!(
            violation(emit(&client, "OrderPlaced", 1, payload).await),
            expected,
            "emit_event {payload}"
        );
        assert_eq!(
            violation(emit_batch(&client, "OrderPlaced", payload).await),
            expected,
            "emit_events {payload}"
        );
    }
    assert_eq!(events(&client).await, 1, "no refused event was written");

    // A version without a schema, where the event type has one.
    let refused = emit(&client, "OrderPlaced", 2, VALID).await;
    assert_eq!(sqlstate(&refused), "PO021");
    let message = message_of(refused);
    assert!(message.contains("registered versions: 1"), "{message}");
    // The next version is registered; both are checked by their own schema.
    let v2 = ORDER_PLACED.replace(r#""minItems": 1"#, r#""minItems": 0"#);
    assert!(register(&client, "OrderPlaced", 2, &v2).await);
    let empty = changed(&["items"], Some(json!([])));
    assert_eq!(
        emit(&client, "OrderPlaced", 2, &empty)
            .await
            .expect("version 2 allows no items")
            .get::<_, i64>(0),
        2
    );
    assert_eq!(
        sqlstate(&emit(&client, "OrderPlaced", 1, &empty).await),
        "PO020"
    );
    // An event type without any schema is not checked.
    assert_eq!(
        sqlstate(&emit(&client, "OrderNoted", 1, "[\"anything\"]").await),
        "ok"
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_sessions_follow_schemas_and_modes_from_the_commit_that_changes_them() {
    let db = TestDb::create("contracts_sessions").await;
    let operator = db.admin().await;
    let app = db.admin().await;
    let bad = changed(&["currency"], Some(serde_json::json!("GBP")));

    // The application's session has emitted (and, in the extension, read
    // the schemas) before anything is registered.
    assert_eq!(sqlstate(&emit(&app, "OrderPlaced", 1, &bad).await), "ok");
    operator.batch_execute("BEGIN").await.expect("begin");
    register(&operator, "OrderPlaced", 1, ORDER_PLACED).await;
    assert_eq!(
        sqlstate(&emit(&app, "OrderPlaced", 1, &bad).await),
        "ok",
        "a schema not yet committed checks nothing"
    );
    operator.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(
        sqlstate(&emit(&app, "OrderPlaced", 1, &bad).await),
        "PO020",
        "a committed schema is checked in a session that read before"
    );

    let set = |mode: &'static str| {
        let operator = &operator;
        async move {
            operator
                .execute("SELECT outbox.set_schema_check('order', $1)", &[&mode])
                .await
                .expect("set_schema_check");
        }
    };
    set("warn").await;
    let before = events(&operator).await;
    assert_eq!(
        sqlstate(&emit(&app, "OrderPlaced", 1, &bad).await),
        "ok",
        "warn stores the event"
    );
    assert_eq!(events(&operator).await, before + 1);
    set("off").await;
    assert_eq!(sqlstate(&emit(&app, "OrderPlaced", 2, &bad).await), "ok");
    set("enforce").await;
    assert_eq!(sqlstate(&emit(&app, "OrderPlaced", 1, &bad).await), "PO020");

    let modes = operator
        .query(
            "SELECT event_type, schema_version, check_mode FROM outbox.schemas ORDER BY 1, 2",
            &[],
        )
        .await
        .expect("the schemas view");
    let modes: Vec<(String, i32, String)> = modes
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        modes,
        vec![("OrderPlaced".to_owned(), 1, "enforce".to_owned())]
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_schema_never_changes_and_a_bad_one_is_never_registered() {
    let db = TestDb::create("contracts_immutable").await;
    let client = db.admin().await;
    assert!(register(&client, "OrderPlaced", 1, ORDER_PLACED).await);
    assert!(
        !register(&client, "OrderPlaced", 1, ORDER_PLACED).await,
        "the same schema again is a no-op"
    );
    let other = ORDER_PLACED.replace("\"minimum\": 0", "\"minimum\": 1");
    let attempts = [
        (
            format!("SELECT outbox.register_schema('order', 'OrderPlaced', 1, '{other}')"),
            "PO023",
        ),
        ("UPDATE outbox.event_schemas SET schema = '{}'".to_owned(), "PO023"),
        ("DELETE FROM outbox.event_schemas".to_owned(), "PO023"),
        ("TRUNCATE outbox.event_schemas".to_owned(), "PO023"),
        (
            "SELECT outbox.register_schema('order', 'Bad', 1, '{\"type\": 5}')".to_owned(),
            "PO022",
        ),
        (
            "SELECT outbox.register_schema('order', 'Bad', 1, '\"a string\"')".to_owned(),
            "PO022",
        ),
        (
            "SELECT outbox.register_schema('order', 'Bad', 1, '{\"properties\": {\"a\": {\"minimum\": \"x\"}}}')".to_owned(),
            "PO022",
        ),
        (
            "SELECT outbox.register_schema('order', 'Bad', 0, '{}')".to_owned(),
            "PO007",
        ),
        (
            "SELECT outbox.register_schema('my order', 'Bad', 1, '{}')".to_owned(),
            "PO007",
        ),
        (
            "SELECT outbox.register_schema('order', 'Bad', 1, NULL)".to_owned(),
            "PO001",
        ),
        (
            "SELECT outbox.set_schema_check('order', 'loud')".to_owned(),
            "PO007",
        ),
    ];
    for (sql, code) in &attempts {
        assert_eq!(sqlstate(&client.simple_query(sql).await), *code, "{sql}");
    }
    let stored: serde_json::Value = client
        .query_one(
            "SELECT schema FROM outbox.event_schemas WHERE event_type = 'OrderPlaced'",
            &[],
        )
        .await
        .expect("the schema")
        .get(0);
    assert_eq!(
        stored,
        serde_json::from_str::<serde_json::Value>(ORDER_PLACED).expect("JSON")
    );
    let registered: i64 = client
        .query_one("SELECT count(*) FROM outbox.event_schemas", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(registered, 1, "nothing else was registered");

    // What the SQL edition cannot check, it refuses to register; the
    // extension checks the whole of JSON Schema.
    let one_of = r#"{"type": "object", "properties": {"amount": {"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "^[0-9]+$"}]}}}"#;
    let registered = client
        .query_one(
            "SELECT outbox.register_schema('order', 'Paid', 1, $1::text::jsonb)",
            &[&one_of],
        )
        .await;
    match db.edition {
        Edition::Sql => {
            assert_eq!(sqlstate(&registered), "PO022");
            let message = message_of(registered);
            assert!(
                message.contains("does not check the keyword oneOf"),
                "{message}"
            );
        }
        Edition::Extension => {
            registered.expect("registered");
            let paid = |amount: &str| {
                let payload = format!("{{\"amount\": {amount}}}");
                let client = &client;
                async move { sqlstate(&emit(client, "Paid", 1, &payload).await) }
            };
            assert_eq!(paid("12").await, "ok");
            assert_eq!(paid("\"12\"").await, "ok");
            assert_eq!(paid("1.5").await, "PO020");
        }
    }
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_schema_admins_register_and_writers_reach_schemas_through_the_functions() {
    let db = TestDb::create("contracts_roles").await;
    let admin = db.admin().await;
    let mut roles = Vec::new();
    let mut login = |group: String| {
        let name = unique("role");
        roles.push(name.clone());
        let admin = &admin;
        let db = &db;
        async move {
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
            connect(&url).await
        }
    };
    let writer = login(db.role("writer").await).await;
    let schema_admin = login(db.role("schema_admin").await).await;

    assert!(register(&schema_admin, "OrderPlaced", 1, ORDER_PLACED).await);
    schema_admin
        .execute("SELECT outbox.set_schema_check('order', 'enforce')", &[])
        .await
        .expect("a schema admin sets the mode");
    let by: String = schema_admin
        .query_one(
            "SELECT registered_by::text FROM outbox.schemas WHERE event_type = 'OrderPlaced'",
            &[],
        )
        .await
        .expect("the view")
        .get(0);
    assert_eq!(by, roles[1], "registered_by names the caller");

    for sql in [
        "SELECT outbox.register_schema('order', 'Forged', 1, '{}')",
        "SELECT outbox.set_schema_check('order', 'off')",
        "INSERT INTO outbox.event_schemas (aggregate_type, event_type, schema_version, schema) VALUES ('order', 'Forged', 1, '{}')",
        "INSERT INTO outbox.schema_checks (aggregate_type, mode) VALUES ('order', 'off')",
        "SELECT * FROM outbox.event_schemas",
        "SELECT * FROM outbox.schema_checks",
    ] {
        assert_eq!(
            sqlstate(&writer.simple_query(sql).await),
            "42501",
            "{sql} was allowed to a writer"
        );
    }
    // A writer sees the contracts and checks a payload before emitting.
    let seen: i64 = writer
        .query_one("SELECT count(*) FROM outbox.schemas", &[])
        .await
        .expect("a writer reads the view")
        .get(0);
    assert_eq!(seen, 1);
    let bad = changed(&["total"], Some(serde_json::json!(-1)));
    let checked = writer
        .query_one(
            "SELECT outbox.check_payload('order', 'OrderPlaced', 1, $1::text::jsonb)",
            &[&bad],
        )
        .await;
    assert_eq!(sqlstate(&checked), "PO020");
    assert_eq!(
        sqlstate(&emit(&writer, "OrderPlaced", 1, &bad).await),
        "PO020"
    );
    assert_eq!(
        sqlstate(&emit(&writer, "OrderPlaced", 1, VALID).await),
        "ok"
    );

    drop(writer);
    drop(schema_admin);
    db.drop().await;
    let admin = connect(&pg_outbox_tests::Stack::from_env().admin_url).await;
    for role in roles {
        let _ = admin
            .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
            .await;
    }
}
