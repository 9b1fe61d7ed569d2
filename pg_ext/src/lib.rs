//! pg_outbox: the PostgreSQL side of the transactional outbox.
//!
//! The schema and the SQL API live in `sql/` and are loaded in a fixed order:
//! `bootstrap.sql` (tables, roles), then the Rust functions below, then
//! `api.sql` (emit_event and friends, which call them).

use pgrx::prelude::*;

::pgrx::pg_module_magic!(name, version);

extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);

/// A time-ordered UUID (version 7): event ids sort by creation time, which
/// keeps the primary key index append-mostly.
#[pg_extern(volatile, parallel_safe)]
fn uuid_v7() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
}

extension_sql_file!(
    "../sql/api.sql",
    name = "api",
    requires = [uuid_v7],
    finalize
);

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn emit(aggregate_type: &str, aggregate_id: &str) -> (pgrx::Uuid, i64) {
        let sql = format!(
            "SELECT event_id, aggregate_seq FROM outbox.emit_event('{aggregate_type}', '{aggregate_id}', 'Happened', '{{\"n\": 1}}')"
        );
        let (id, seq) = Spi::get_two::<pgrx::Uuid, i64>(&sql).expect("emit_event runs");
        (id.expect("event id"), seq.expect("sequence"))
    }

    #[pg_test]
    fn sequences_start_at_one_and_count_per_aggregate() {
        assert_eq!(emit("order", "o-1").1, 1);
        assert_eq!(emit("order", "o-1").1, 2);
        assert_eq!(
            emit("order", "o-2").1,
            1,
            "another aggregate has its own sequence"
        );
        assert_eq!(
            emit("invoice", "o-1").1,
            1,
            "the type is part of the aggregate's identity"
        );
        assert_eq!(emit("order", "o-1").1, 3);
    }

    #[pg_test]
    fn returned_values_are_the_stored_row() {
        let (id, seq) = emit("order", "o-9");
        let stored = Spi::get_two::<i64, String>(&format!(
            "SELECT aggregate_seq, event_type FROM outbox.events WHERE event_id = '{id}'"
        ))
        .expect("row exists");
        assert_eq!(stored, (Some(seq), Some("Happened".to_owned())));
        let txid_is_ours = Spi::get_one::<bool>(&format!(
            "SELECT txid = pg_current_xact_id() FROM outbox.events WHERE event_id = '{id}'"
        ))
        .expect("row exists");
        assert_eq!(txid_is_ours, Some(true));
    }

    #[pg_test]
    fn event_ids_are_version_7_and_increase() {
        let (a, _) = emit("order", "o-3");
        let (b, _) = emit("order", "o-3");
        assert_eq!(a.as_bytes()[6] >> 4, 7, "version nibble");
        assert!(a.as_bytes() < b.as_bytes(), "ids sort by creation");
    }

    #[pg_test]
    #[should_panic(expected = "aggregate_id must not be NULL or empty")]
    fn empty_aggregate_id_is_refused() {
        emit("order", "");
    }

    #[pg_test]
    #[should_panic(expected = "outbox events are immutable")]
    fn stored_events_cannot_be_changed() {
        emit("order", "o-4");
        Spi::run("UPDATE outbox.events SET event_type = 'Forged'").expect("refused");
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
