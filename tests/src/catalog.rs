//! What an install of the outbox puts in a database, as lines of text that
//! two installs can be compared by: every object of schema `outbox` with
//! what defines it (signatures, defaults, volatility, strictness, parallel
//! safety, SECURITY DEFINER, pinned settings, privileges, comments, columns,
//! collations, indexes, constraints, triggers) and the outbox roles.
//! Privileges name the schema's owner `OWNER` and each of the database's
//! outbox roles by its purpose (`writer`, ...), so that installs made by
//! different roles, in databases of different names, compare equal.

use tokio_postgres::Client;

/// One line per object or property, sorted. A function has two lines: its
/// interface (`function ...`) and its implementation (`body ...`: language,
/// a digest of its source, its pinned settings).
pub async fn describe(client: &Client) -> Vec<String> {
    let owner: String = client
        .query_one(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'outbox'",
            &[],
        )
        .await
        .expect("schema outbox exists")
        .get(0);
    let purposes: std::collections::BTreeMap<String, String> = client
        .query("SELECT role::text, purpose FROM outbox.roles", &[])
        .await
        .expect("outbox.roles")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let acl = |items: Option<Vec<String>>| -> String {
        let Some(items) = items else {
            return "default".into();
        };
        let mut items: Vec<String> = items
            .iter()
            .map(|item| {
                let (grantee, rest) = item.split_once('=').expect("aclitem has =");
                let (privileges, grantor) = rest.split_once('/').expect("aclitem has /");
                let name = |role: &str| {
                    if role == owner {
                        "OWNER".to_owned()
                    } else if let Some(purpose) = purposes.get(role) {
                        purpose.to_uppercase()
                    } else if role.is_empty() {
                        "PUBLIC".to_owned()
                    } else {
                        role.to_owned()
                    }
                };
                format!("{}={privileges}/{}", name(grantee), name(grantor))
            })
            .collect();
        items.sort();
        items.join(",")
    };
    let mut lines = Vec::new();
    let schema = client
        .query_one(
            "SELECT nspacl::text[] FROM pg_namespace WHERE nspname = 'outbox'",
            &[],
        )
        .await
        .expect("schema");
    lines.push(format!("schema outbox acl {}", acl(schema.get(0))));

    for row in client
        .query(
            "SELECT 'function ' || p.oid::regprocedure || ' (' || pg_get_function_arguments(p.oid) || ') returns '
                    || coalesce(pg_get_function_result(p.oid), '-') || ' kind ' || p.prokind::text || ' volatility ' || p.provolatile::text
                    || ' strict ' || p.proisstrict || ' parallel ' || p.proparallel::text || ' definer ' || p.prosecdef
                    || ' leakproof ' || p.proleakproof || ' comment ' || coalesce(obj_description(p.oid, 'pg_proc'), '-'),
                    p.proacl::text[],
                    'body ' || p.oid::regprocedure || ' ' || l.lanname || ' ' || md5(p.prosrc) || ' '
                    || coalesce(p.proconfig::text, 'no settings')
               FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
              WHERE p.pronamespace = 'outbox'::regnamespace",
            &[],
        )
        .await
        .expect("functions")
    {
        lines.push(format!(
            "{} acl {}",
            row.get::<_, String>(0),
            acl(row.get(1))
        ));
        lines.push(row.get(2));
    }

    for row in client
        .query(
            "SELECT 'relation ' || c.relname || ' kind ' || c.relkind::text || ' persistence ' || c.relpersistence::text
                    || ' replica identity ' || c.relreplident::text || ' options ' || coalesce(c.reloptions::text, '-')
                    || ' comment ' || coalesce(obj_description(c.oid, 'pg_class'), '-'),
                    c.relacl::text[]
               FROM pg_class c WHERE c.relnamespace = 'outbox'::regnamespace",
            &[],
        )
        .await
        .expect("relations")
    {
        lines.push(format!(
            "{} acl {}",
            row.get::<_, String>(0),
            acl(row.get(1))
        ));
    }

    let text_of = "
        SELECT 'column ' || c.relname || '.' || a.attname || ' #' || a.attnum || ' '
               || format_type(a.atttypid, a.atttypmod) || ' not null ' || a.attnotnull
               || ' collation ' || coalesce(a.attcollation::regcollation::text, '-')
               || ' default ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '-')
               || ' comment ' || coalesce(col_description(c.oid, a.attnum), '-')
          FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
          LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
         WHERE c.relnamespace = 'outbox'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
        UNION ALL
        SELECT 'index ' || pg_get_indexdef(i.indexrelid) || ' replica identity ' || i.indisreplident
          FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
         WHERE c.relnamespace = 'outbox'::regnamespace
        UNION ALL
        SELECT 'constraint ' || conrelid::regclass || ' ' || conname || ' ' || pg_get_constraintdef(oid)
          FROM pg_constraint WHERE connamespace = 'outbox'::regnamespace
        UNION ALL
        SELECT 'trigger ' || pg_get_triggerdef(t.oid)
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = 'outbox'::regnamespace AND NOT t.tgisinternal
        UNION ALL
        SELECT 'role ' || o.purpose || ' login ' || r.rolcanlogin || ' inherit ' || r.rolinherit
          FROM outbox.roles o JOIN pg_roles r ON r.oid = o.role";
    for row in client.query(text_of, &[]).await.expect("describe") {
        lines.push(row.get(0));
    }
    lines.sort();
    lines
}

/// The lines of `left` missing from `right` and those of `right` missing
/// from `left`, for an assertion message.
pub fn difference(left: &[String], right: &[String]) -> String {
    let only = |a: &[String], b: &[String]| {
        a.iter()
            .filter(|line| !b.contains(line))
            .map(|line| format!("  {line}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!(
        "only in the first:\n{}\nonly in the second:\n{}",
        only(left, right),
        only(right, left)
    )
}
