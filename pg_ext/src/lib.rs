//! pg_outbox: the PostgreSQL side of the transactional outbox.
//!
//! The schema and the SQL API of the current version are the files of
//! `sql/schema/`, one concern each, which a fresh install runs in the order
//! of their names after pgrx declares the Rust function below. An older install reaches the same catalog through
//! the released upgrade scripts `sql/pg_outbox--A--B.sql` (never edited; a
//! test compares the catalogs), and 0.1.0's own install script is rebuilt
//! from its frozen `bootstrap.sql` and `api.sql` by
//! `scripts/released-sql.sh`. The SQL edition for managed PostgreSQL is
//! assembled from `sql/schema/` too (`scripts/sql-edition`).

// PostgreSQL's C API is unsafe to call; each unsafe block says why its use
// is sound, and the resources it hands out are closed by guards (emit.rs).
#![allow(unsafe_code)]

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;

::pgrx::pg_module_magic!(name, version);

mod aggregate_hash;
mod contracts;
mod datum;
mod emit;
mod refusal;

/// `pg_outbox.max_payload_bytes`: the largest payload emit_event accepts.
pub(crate) static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1_000_000);

/// `pg_outbox.direct_insert`: whether emit_event inserts the event row
/// without the executor (see `emit::insert_direct`). For measuring what it
/// is worth (bench/emit.sh); there is no reason to turn it off otherwise.
pub(crate) static DIRECT_INSERT: GucSetting<bool> = GucSetting::<bool>::new(true);

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
    GucRegistry::define_bool_guc(
        c"pg_outbox.direct_insert",
        c"Whether emit_event inserts the event row without starting the executor.",
        c"On by default; off runs the SQL INSERT on every call. For benchmarks.",
        &DIRECT_INSERT,
        GucContext::Userset,
        GucFlags::default(),
    );
}

/// A time-ordered UUID (version 7): event ids sort by creation time, which
/// keeps the primary key index append-mostly.
#[pg_extern(volatile, parallel_safe)]
fn uuid_v7() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(event_id())
}

/// A version 7 UUID as RFC 9562 lays it out: 48 bits of Unix milliseconds,
/// then 12 bits of the sub-millisecond fraction (so ids of one backend keep
/// their order within a millisecond, as in PostgreSQL 18's uuidv7), then 62
/// random bits from [`random_bits`].
pub(crate) fn event_id() -> [u8; 16] {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let millis = now.as_millis() as u64;
    let fraction = ((now.subsec_nanos() % 1_000_000) as u64 * 4096 / 1_000_000) as u16;
    let mut id = [0u8; 16];
    id[..6].copy_from_slice(&millis.to_be_bytes()[2..]);
    id[6] = 0x70 | (fraction >> 8) as u8;
    id[7] = fraction as u8;
    id[8..].copy_from_slice(&random_bits().to_be_bytes());
    id[8] = 0x80 | (id[8] & 0x3F);
    id
}

/// State kept for the life of a backend. A backend runs one thread, so a
/// plain cell will do (a `thread_local!` costs a call per access in a
/// shared library).
pub(crate) struct BackendCell<T>(std::cell::Cell<T>);

// SAFETY: PostgreSQL calls the extension from its backend's only thread.
unsafe impl<T> Sync for BackendCell<T> {}

impl<T: Copy> BackendCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        BackendCell(std::cell::Cell::new(value))
    }
    pub(crate) fn get(&self) -> T {
        self.0.get()
    }
    pub(crate) fn set(&self, value: T) {
        self.0.set(value)
    }
}

/// The backend's xoshiro256** generator, seeded with 256 bits from
/// `pg_strong_random` on first use. Ids need bits that never repeat within
/// a backend and do not collide between backends, not secrecy; one strong
/// seed per backend gives that without OpenSSL's locking on every id.
static RANDOM_STATE: BackendCell<Option<[u64; 4]>> = BackendCell::new(None);

fn random_bits() -> u64 {
    let mut s = RANDOM_STATE.get().unwrap_or_else(|| {
        let mut seed = [0u8; 32];
        // SAFETY: fills the 32 bytes given; PostgreSQL initialised its
        // generator in this process before any SQL ran.
        if !unsafe { pg_sys::pg_strong_random(seed.as_mut_ptr().cast(), seed.len()) } {
            pgrx::error!("pg_outbox: could not seed the event id generator");
        }
        let mut state = [0u64; 4];
        for (word, bytes) in state.iter_mut().zip(seed.chunks_exact(8)) {
            *word = u64::from_le_bytes(bytes.try_into().unwrap_or_default());
        }
        if state == [0; 4] {
            state[0] = 1;
        }
        state
    });
    let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
    let t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = s[3].rotate_left(45);
    RANDOM_STATE.set(Some(s));
    result
}

extension_sql_file!(
    "../sql/schema/01-roles.sql",
    name = "roles",
    requires = [uuid_v7]
);
extension_sql_file!(
    "../sql/schema/02-tables.sql",
    name = "tables",
    requires = ["roles"]
);
extension_sql_file!(
    "../sql/schema/03-emit.sql",
    name = "emit",
    requires = ["tables"]
);
extension_sql_file!(
    "../sql/schema/04-forwarder.sql",
    name = "forwarder",
    requires = ["emit"]
);
extension_sql_file!(
    "../sql/schema/05-inbox.sql",
    name = "inbox",
    requires = ["forwarder"]
);
extension_sql_file!(
    "../sql/schema/06-polling.sql",
    name = "polling",
    requires = ["inbox"]
);
extension_sql_file!(
    "../sql/schema/07-contracts.sql",
    name = "contracts",
    requires = ["polling"]
);
extension_sql_file!(
    "../sql/schema/08-dead-letters.sql",
    name = "dead_letters",
    requires = ["contracts"]
);
extension_sql_file!(
    "../sql/schema/09-retention.sql",
    name = "retention",
    requires = ["dead_letters"]
);
extension_sql_file!(
    "../sql/schema/10-privileges.sql",
    name = "privileges",
    requires = ["retention"],
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

    /// The table the extension creates is the one its executor-free
    /// insert writes, on every PostgreSQL version built for (their tuple
    /// descriptors differ).
    #[pg_test]
    fn the_extensions_own_table_takes_the_direct_insert() {
        assert!(crate::emit::insert::takes_direct_insert());
        Spi::run("CREATE TRIGGER count_inserts BEFORE INSERT ON outbox.events FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()")
            .expect("a trigger");
        assert!(
            !crate::emit::insert::takes_direct_insert(),
            "a trigger sends the insert the SQL way"
        );
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
        assert_eq!(a.as_bytes()[8] >> 6, 0b10, "RFC 9562 variant");
        assert!(a.as_bytes() < b.as_bytes(), "ids sort by creation");
        let millis = u64::from_be_bytes([
            0,
            0,
            a.as_bytes()[0],
            a.as_bytes()[1],
            a.as_bytes()[2],
            a.as_bytes()[3],
            a.as_bytes()[4],
            a.as_bytes()[5],
        ]);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("the clock is past 1970")
            .as_millis() as u64;
        assert!(now - millis < 60_000, "the id carries the time it was made");
        let ids: std::collections::HashSet<[u8; 16]> =
            (0..10_000).map(|_| crate::event_id()).collect();
        assert_eq!(ids.len(), 10_000, "random bits make every id distinct");
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
