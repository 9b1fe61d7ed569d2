//! pg_outbox: the PostgreSQL side of the transactional outbox.
//!
//! The schema and the SQL API live in `sql/` and are loaded in a fixed order:
//! version 0.1.0's `bootstrap.sql` (tables, roles), the Rust functions below,
//! 0.1.0's `api.sql`, then every upgrade script in order. A fresh install is
//! therefore the same as an upgraded one. Released files are never edited;
//! a change goes into a new `pg_outbox--A--B.sql`.

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;

::pgrx::pg_module_magic!(name, version);

mod emit;

/// `pg_outbox.max_payload_bytes`: the largest payload emit_event accepts.
pub(crate) static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1_000_000);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    GucRegistry::define_int_guc(
        c"pg_outbox.max_payload_bytes",
        c"Largest payload, in bytes, that outbox.emit_event accepts.",
        c"Kafka refuses records above the broker's message.max.bytes (1 MB by default); refusing them at emit time keeps poison events out of the outbox.",
        &MAX_PAYLOAD_BYTES,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::default(),
    );
}

extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);

/// A time-ordered UUID (version 7): event ids sort by creation time, which
/// keeps the primary key index append-mostly.
#[pg_extern(volatile, parallel_safe)]
fn uuid_v7() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
}

extension_sql_file!("../sql/api.sql", name = "api", requires = [uuid_v7]);
extension_sql_file!(
    "../sql/pg_outbox--0.1.0--0.2.0.sql",
    name = "v0_2_0",
    requires = ["api"]
);
extension_sql_file!(
    "../sql/pg_outbox--0.2.0--0.3.0.sql",
    name = "v0_3_0",
    requires = ["v0_2_0"],
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
    fn a_repeated_idempotency_key_replays_the_first_event() {
        let sql = "SELECT event_id, replayed FROM outbox.emit_event('pay', 'p-1', 'Captured', '{}', idempotency_key => 'req-1')";
        let (first, replayed) = Spi::get_two::<pgrx::Uuid, bool>(sql).expect("first call");
        assert_eq!(replayed, Some(false));
        let (again, replayed) = Spi::get_two::<pgrx::Uuid, bool>(sql).expect("second call");
        assert_eq!(replayed, Some(true));
        assert_eq!(first, again);
        let rows = Spi::get_one::<i64>("SELECT count(*) FROM outbox.events").expect("count");
        assert_eq!(rows, Some(1));
    }

    #[pg_test]
    fn current_seq_follows_emits_and_batches() {
        let seq = || {
            Spi::get_one::<i64>("SELECT outbox.current_seq('order', 'o-7')")
                .expect("current_seq")
                .expect("not null")
        };
        assert_eq!(seq(), 0);
        emit("order", "o-7");
        assert_eq!(seq(), 1);
        Spi::run(r#"SELECT * FROM outbox.emit_events('[{"aggregate_type": "order", "aggregate_id": "o-7", "event_type": "E", "payload": 1}, {"aggregate_type": "order", "aggregate_id": "o-7", "event_type": "E", "payload": 2}]')"#)
            .expect("batch");
        assert_eq!(seq(), 3);
    }

    #[pg_test]
    #[should_panic(expected = "sequence conflict on order 'o-8': expected 0, actual 1")]
    fn a_stale_expected_seq_is_refused() {
        emit("order", "o-8");
        Spi::run("SELECT * FROM outbox.emit_event('order', 'o-8', 'E', '{}', expected_seq => 0)")
            .expect("refused");
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
