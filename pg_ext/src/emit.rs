//! `outbox.emit_event` and the sequence primitive it shares with
//! `outbox.emit_events`, in Rust: a C function in place of a PL/pgSQL
//! interpreter run.
//!
//! How a sequence number is taken: a transaction-scoped advisory lock on the
//! aggregate (held until commit, so writers of one aggregate queue up and
//! commit in sequence order; writers of different aggregates never wait for
//! each other), then the aggregate's newest sequence read through the
//! unique key of `outbox.events` with the latest snapshot, so that even a
//! REPEATABLE READ caller numbers after every committed event. No counter
//! row is written. Retention keeps each aggregate's newest event, and
//! `outbox.sequence_floors` remembers aggregates whose events a 0.2.0 prune
//! removed entirely.
//!
//! The common call runs no SQL statement and starts no executor: the
//! sequence is read straight from the unique key, and the row goes in with
//! a heap insert and an insert into each index, as the executor would do
//! it, while the table is the one the extension made (see
//! [`insert_direct`]). Idempotency keys, doubtful values and a table that
//! an operator changed take the SQL way, through SPI.
//!
//! Validation is checked here for the common case only: anything unusual
//! (headers, a doubtful value) goes to the PL/pgSQL `outbox.check_emit`,
//! which names the broken rule with its SQLSTATE and hint, so the rules and
//! their messages live in one place (shared with the batch form and the SQL
//! edition).
//!
//! Everything PostgreSQL hands out for the length of a call (open
//! relations, an index scan, a registered snapshot, a pinned buffer, a
//! tuple slot, an SPI connection) is held by a guard that gives it back on
//! drop. On an ERROR, pgrx unwinds through these frames; the guards then do
//! nothing, and the transaction's abort releases everything through its
//! resource owner, as it does for PostgreSQL's own code.

use std::ffi::CStr;

use pgrx::pg_sys::{self, Datum, Oid};
use pgrx::varlena::{varatt_is_1b_e, varatt_is_4b_c, vardata_any, varsize_any, varsize_any_exhdr};

use crate::{BackendCell, DIRECT_INSERT, MAX_PAYLOAD_BYTES};

const TEXT: Oid = pg_sys::TEXTOID;
const INT8: Oid = pg_sys::INT8OID;

/// The arguments of `outbox.emit_event`, in the order of its SQL
/// declaration, which `outbox.check_emit` shares. `None` is SQL NULL.
#[derive(Clone, Copy)]
struct Call {
    aggregate_type: Option<Datum>,
    aggregate_id: Option<Datum>,
    event_type: Option<Datum>,
    payload: Option<Datum>,
    headers: Option<Datum>,
    schema_version: Option<Datum>,
    expected_seq: Option<Datum>,
    idempotency_key: Option<Datum>,
    topic: Option<Datum>,
}

/// The SQL types of [`Call`]'s fields, in the same order.
const CALL_TYPES: [Oid; 9] = [
    TEXT,
    TEXT,
    TEXT,
    pg_sys::JSONBOID,
    pg_sys::JSONBOID,
    pg_sys::INT4OID,
    INT8,
    TEXT,
    TEXT,
];

impl Call {
    /// # Safety
    /// `fcinfo` is a call of `outbox.emit_event` as declared in SQL: nine
    /// arguments of [`CALL_TYPES`].
    unsafe fn from_fcinfo(fcinfo: pg_sys::FunctionCallInfo) -> Call {
        let arg = |n: usize| {
            // SAFETY: n < 9, the number of arguments the declaration gives.
            unsafe {
                (!pgrx::fcinfo::pg_arg_is_null(fcinfo, n))
                    .then(|| pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n))
            }
        };
        Call {
            aggregate_type: arg(0),
            aggregate_id: arg(1),
            event_type: arg(2),
            payload: arg(3),
            headers: arg(4),
            schema_version: arg(5),
            expected_seq: arg(6),
            idempotency_key: arg(7),
            topic: arg(8),
        }
    }

    /// The arguments in declaration order, for `outbox.check_emit`.
    fn datums(&self) -> [Option<Datum>; 9] {
        [
            self.aggregate_type,
            self.aggregate_id,
            self.event_type,
            self.payload,
            self.headers,
            self.schema_version,
            self.expected_seq,
            self.idempotency_key,
            self.topic,
        ]
    }

    /// The values of the event row, in the order of [`EVENT_COLUMNS`] (the
    /// last two are the table's defaults).
    fn row(&self, event_id: Datum, seq: i64) -> [Option<Datum>; 9] {
        [
            Some(event_id),
            self.aggregate_type,
            self.aggregate_id,
            Some(Datum::from(seq)),
            self.event_type,
            Some(self.schema_version.unwrap_or(Datum::from(1_i32))),
            self.payload,
            self.headers,
            self.topic,
        ]
    }
}

/// The columns of `outbox.events` in order, with their types; the first
/// nine are the values of the insert, the last two are filled as their
/// defaults (`clock_timestamp()`, `pg_current_xact_id()`) would.
const EVENT_COLUMNS: [(&CStr, Oid); 11] = [
    (c"event_id", pg_sys::UUIDOID),
    (c"aggregate_type", TEXT),
    (c"aggregate_id", TEXT),
    (c"aggregate_seq", INT8),
    (c"event_type", TEXT),
    (c"schema_version", pg_sys::INT4OID),
    (c"payload", pg_sys::JSONBOID),
    (c"headers", pg_sys::JSONBOID),
    (c"topic", TEXT),
    (c"occurred_at", pg_sys::TIMESTAMPTZOID),
    (c"txid", pg_sys::XID8OID),
];

// ---------------------------------------------------------------------------
// Guards

/// A relation opened for this call, closed on drop; its lock is kept until
/// the end of the transaction, as the executor keeps it.
struct Opened {
    relation: pg_sys::Relation,
    index: bool,
}

impl Opened {
    fn table(oid: Oid, mode: u32) -> Opened {
        Opened {
            // SAFETY: raises an ERROR, rather than returning, when the
            // relation is gone; the result is a valid relcache entry.
            relation: unsafe { pg_sys::table_open(oid, mode as _) },
            index: false,
        }
    }

    fn index(oid: Oid, mode: u32) -> Opened {
        Opened {
            // SAFETY: as for table_open.
            relation: unsafe { pg_sys::index_open(oid, mode as _) },
            index: true,
        }
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // SAFETY: opened above and closed only here; NoLock keeps the lock.
        unsafe {
            if self.index {
                pg_sys::index_close(self.relation, pg_sys::NoLock as _);
            } else {
                pg_sys::table_close(self.relation, pg_sys::NoLock as _);
            }
        }
    }
}

/// The latest snapshot, registered for this call.
struct LatestSnapshot(pg_sys::Snapshot);

impl LatestSnapshot {
    fn take() -> LatestSnapshot {
        // SAFETY: RegisterSnapshot copies the static latest snapshot into
        // one owned by the current resource owner.
        LatestSnapshot(unsafe { pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot()) })
    }
}

impl Drop for LatestSnapshot {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // SAFETY: registered above, unregistered only here.
        unsafe { pg_sys::UnregisterSnapshot(self.0) }
    }
}

/// An index scan, ended on drop (before its snapshot and relations, which
/// are declared before it and so dropped after it).
struct IndexScan(pg_sys::IndexScanDesc);

impl Drop for IndexScan {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // SAFETY: begun by index_beginscan, ended only here.
        unsafe { pg_sys::index_endscan(self.0) }
    }
}

/// The visibility map page a scan keeps pinned between lookups.
struct VisibilityMapPin(pg_sys::Buffer);

impl Drop for VisibilityMapPin {
    fn drop(&mut self) {
        if std::thread::panicking() || self.0 == pg_sys::InvalidBuffer as pg_sys::Buffer {
            return;
        }
        // SAFETY: pinned by visibilitymap_get_status, released only here.
        unsafe { pg_sys::ReleaseBuffer(self.0) }
    }
}

/// A tuple slot for heap tuples of one relation.
struct Slot(*mut pg_sys::TupleTableSlot);

impl Slot {
    fn for_table(table: &Opened) -> Slot {
        // SAFETY: the relation is open; the slot is made in the current
        // memory context.
        Slot(unsafe { pg_sys::table_slot_create(table.relation, std::ptr::null_mut()) })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // SAFETY: made by table_slot_create, dropped only here.
        unsafe { pg_sys::ExecDropSingleTupleTableSlot(self.0) }
    }
}

/// An SPI connection opened on first need and closed once (on `finish` or
/// drop), with `search_path` pinned to `pg_catalog, pg_temp` while it is
/// open.
///
/// `emit_event` is SECURITY DEFINER without a `SET search_path` clause:
/// that clause costs a configuration change on every call, and the common
/// call resolves no name at all (relations by cached OID, functions by C
/// symbol). The statements below are the only place where names are
/// resolved, so the path is pinned here, the way the clause would pin it,
/// and a caller's own schemas can never supply an operator or function to
/// them.
#[derive(Default)]
struct Spi {
    guc_level: Option<std::ffi::c_int>,
}

impl Spi {
    fn connect(&mut self) {
        if self.guc_level.is_some() {
            return;
        }
        // SAFETY: a GUC nest level and an SPI connection, both undone in
        // finish (or by the transaction's abort on an ERROR).
        unsafe {
            let level = pg_sys::NewGUCNestLevel();
            pg_sys::set_config_option(
                c"search_path".as_ptr(),
                c"pg_catalog, pg_temp".as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
            pg_sys::SPI_connect();
            self.guc_level = Some(level);
        }
    }

    /// Closes the connection: what SPI returned is freed, so copy out what
    /// is needed first.
    fn finish(&mut self) {
        if let Some(level) = self.guc_level.take() {
            // SAFETY: connected in connect, at this nest level.
            unsafe {
                pg_sys::SPI_finish();
                pg_sys::AtEOXact_GUC(true, level);
            }
        }
    }
}

impl Drop for Spi {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.finish();
        }
    }
}

// ---------------------------------------------------------------------------
// SPI statements

/// Plans kept for the life of the backend; PostgreSQL revalidates them
/// when the tables change.
#[derive(Clone, Copy)]
struct Plans {
    claim_key: pg_sys::SPIPlanPtr,
    first_for_key: pg_sys::SPIPlanPtr,
    insert: pg_sys::SPIPlanPtr,
}

static PLANS: BackendCell<Option<Plans>> = BackendCell::new(None);

/// A plan for this call only (SPI_finish frees it). Needs `_spi` open.
fn prepare_once(_spi: &Spi, sql: &CStr, types: &[Oid]) -> pg_sys::SPIPlanPtr {
    let mut types = types.to_vec();
    // SAFETY: SPI is connected; the text and types outlive the call.
    let plan = unsafe { pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr()) };
    if plan.is_null() {
        pgrx::error!("pg_outbox: cannot prepare an internal statement");
    }
    plan
}

/// A plan kept past SPI_finish, for the life of the backend.
fn prepare(spi: &Spi, sql: &CStr, types: &[Oid]) -> pg_sys::SPIPlanPtr {
    let plan = prepare_once(spi, sql, types);
    // SAFETY: a plan SPI_prepare just made.
    unsafe { pg_sys::SPI_keepplan(plan) };
    plan
}

fn plans(spi: &Spi) -> Plans {
    if let Some(plans) = PLANS.get() {
        return plans;
    }
    let plans = Plans {
        claim_key: prepare(
            spi,
            c"INSERT INTO outbox.idempotency_keys
                     (aggregate_type, idempotency_key, event_id, aggregate_id, aggregate_seq)
              VALUES ($1, $2, $3, $4, $5)
              ON CONFLICT (aggregate_type, idempotency_key) DO NOTHING",
            &[TEXT, TEXT, pg_sys::UUIDOID, TEXT, INT8],
        ),
        first_for_key: prepare(
            spi,
            c"SELECT k.event_id, k.aggregate_seq FROM outbox.idempotency_keys k
               WHERE k.aggregate_type = $1 AND k.idempotency_key = $2",
            &[TEXT, TEXT],
        ),
        insert: prepare(
            spi,
            c"INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq,
                                         event_type, schema_version, payload, headers, topic)
              VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            &[
                pg_sys::UUIDOID,
                TEXT,
                TEXT,
                INT8,
                TEXT,
                pg_sys::INT4OID,
                pg_sys::JSONBOID,
                pg_sys::JSONBOID,
                TEXT,
            ],
        ),
    };
    PLANS.set(Some(plans));
    plans
}

/// Runs a plan whose parameter types match `args`; the number of rows.
fn execute(_spi: &Spi, plan: pg_sys::SPIPlanPtr, args: &[Option<Datum>]) -> u64 {
    let mut values: Vec<Datum> = args.iter().map(|a| a.unwrap_or(Datum::from(0))).collect();
    let nulls: Vec<std::ffi::c_char> = args
        .iter()
        .map(|a| if a.is_some() { b' ' } else { b'n' } as std::ffi::c_char)
        .collect();
    // SAFETY: SPI is connected, and the plan takes these parameters.
    let rc =
        unsafe { pg_sys::SPI_execute_plan(plan, values.as_mut_ptr(), nulls.as_ptr(), false, 0) };
    if rc < 0 {
        pgrx::error!("pg_outbox: an internal statement failed (SPI result {rc})");
    }
    // SAFETY: set by the statement just run.
    unsafe { pg_sys::SPI_processed }
}

/// Column `column` (from 1) of the first row of the last statement's
/// result; valid until SPI is finished.
fn first_value(_spi: &Spi, column: i32) -> Option<Datum> {
    // SAFETY: SPI's result of the last statement, read while connected.
    unsafe {
        let table = pg_sys::SPI_tuptable;
        if table.is_null() || pg_sys::SPI_processed == 0 {
            return None;
        }
        let mut is_null = false;
        let value = pg_sys::SPI_getbinval(*(*table).vals, (*table).tupdesc, column, &mut is_null);
        (!is_null).then_some(value)
    }
}

// ---------------------------------------------------------------------------
// Values

/// The bytes of a text datum.
///
/// # Safety
/// `text` is a text (varlena) datum that lives as long as `'a`.
pub(crate) unsafe fn bytes<'a>(text: Datum) -> &'a [u8] {
    // SAFETY: a varlena, detoasted if need be (a copy in the current memory
    // context, which outlives the call).
    unsafe {
        let v = pg_sys::pg_detoast_datum_packed(text.cast_mut_ptr());
        std::slice::from_raw_parts(vardata_any(v) as *const u8, varsize_any_exhdr(v))
    }
}

fn topic_safe(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn uuid_datum(bytes: [u8; 16]) -> Datum {
    // SAFETY: 16 bytes allocated in the current memory context and filled.
    unsafe {
        let ptr = pg_sys::palloc(16) as *mut u8;
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, 16);
        Datum::from(ptr)
    }
}

/// Copies a uuid out of SPI's memory, which SPI_finish frees.
///
/// # Safety
/// `datum` is a uuid datum.
unsafe fn copy_uuid(datum: Datum) -> [u8; 16] {
    let mut out = [0u8; 16];
    // SAFETY: a uuid is 16 bytes by reference.
    unsafe { std::ptr::copy_nonoverlapping(datum.cast_mut_ptr::<u8>(), out.as_mut_ptr(), 16) };
    out
}

// ---------------------------------------------------------------------------
// The sequence

/// The aggregate's lock, held until the end of the transaction.
fn lock(aggregate_type: Datum, aggregate_id: Datum) {
    // Built-in functions called through the function manager; pgrx's
    // wrappers are Rust functions, not the C entry points
    // DirectFunctionCall needs.
    extern "C-unwind" {
        fn hashtext(fcinfo: pg_sys::FunctionCallInfo) -> Datum;
        fn pg_advisory_xact_lock_int4(fcinfo: pg_sys::FunctionCallInfo) -> Datum;
    }
    let hash = |text: Datum| {
        // SAFETY: hashtext takes one text; the C collation is deterministic.
        unsafe { pg_sys::DirectFunctionCall1Coll(Some(hashtext), pg_sys::C_COLLATION_OID, text) }
    };
    // SAFETY: pg_advisory_xact_lock(int4, int4) with two int4 hashes.
    unsafe {
        pg_sys::DirectFunctionCall2Coll(
            Some(pg_advisory_xact_lock_int4),
            pg_sys::InvalidOid,
            hash(aggregate_type),
            hash(aggregate_id),
        )
    };
}

/// The aggregate's newest sequence, read with the latest snapshot: taken
/// after the lock, it holds every event of the aggregate that committed
/// before, whatever the isolation level. Read straight from the unique key
/// (no executor: starting one cost more than the rest of emit_event).
fn read_latest(aggregate_type: Datum, aggregate_id: Datum) -> i64 {
    let catalog = catalog();
    newest_value(
        catalog.events,
        pg_sys::RowExclusiveLock,
        aggregate_type,
        aggregate_id,
    )
    .or_else(|| {
        catalog.floors_in_use.then(|| {
            newest_value(
                catalog.floors,
                pg_sys::AccessShareLock,
                aggregate_type,
                aggregate_id,
            )
        })?
    })
    .unwrap_or(0)
}

/// A table keyed by (aggregate_type, aggregate_id, ...) and the column that
/// holds the aggregate's sequence.
#[derive(Clone, Copy)]
struct Keyed {
    table: Oid,
    index: Oid,
    column: pg_sys::AttrNumber,
}

/// The OIDs emit_event reads through, looked up once per backend and
/// forgotten when one of the relations changes (a relcache invalidation),
/// so that a dropped and recreated extension is found again.
#[derive(Clone, Copy)]
struct Catalog {
    events: Keyed,
    floors: Keyed,
    /// False when the floors table is empty, as it is unless the extension
    /// was upgraded from 0.2.0: only that upgrade writes it.
    floors_in_use: bool,
}

static CATALOG: BackendCell<Option<Catalog>> = BackendCell::new(None);
static WATCHING: BackendCell<bool> = BackendCell::new(false);

fn catalog() -> Catalog {
    if let Some(catalog) = CATALOG.get() {
        return catalog;
    }
    if !WATCHING.get() {
        // SAFETY: a callback with the signature relcache callbacks have,
        // registered once per backend.
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget_catalog), Datum::from(0)) };
        WATCHING.set(true);
    }
    // SAFETY: catalog lookups by name; each raises or returns InvalidOid
    // (checked below) when the object is missing.
    let keyed = |table: &CStr, index: &CStr, column: &CStr| unsafe {
        let schema = pg_sys::get_namespace_oid(c"outbox".as_ptr(), false);
        let table = pg_sys::get_relname_relid(table.as_ptr(), schema);
        let index = pg_sys::get_relname_relid(index.as_ptr(), schema);
        let column = pg_sys::get_attnum(table, column.as_ptr());
        if table == pg_sys::InvalidOid || index == pg_sys::InvalidOid || column <= 0 {
            pgrx::error!("pg_outbox: its tables are missing; reinstall the extension");
        }
        Keyed {
            table,
            index,
            column,
        }
    };
    let events = keyed(c"events", c"events_aggregate_seq_key", c"aggregate_seq");
    let floors = keyed(c"sequence_floors", c"sequence_floors_pkey", c"last_seq");
    let floors_table = Opened::table(floors.table, pg_sys::AccessShareLock);
    // SAFETY: the relation is open.
    let floors_in_use = unsafe {
        pg_sys::RelationGetNumberOfBlocksInFork(
            floors_table.relation,
            pg_sys::ForkNumber::MAIN_FORKNUM,
        )
    } > 0;
    let catalog = Catalog {
        events,
        floors,
        floors_in_use,
    };
    CATALOG.set(Some(catalog));
    catalog
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn forget_catalog(_arg: Datum, relid: Oid) {
    let ours = |c: &Catalog| {
        [c.events, c.floors]
            .iter()
            .any(|k| k.table == relid || k.index == relid)
    };
    if relid == pg_sys::InvalidOid || CATALOG.get().is_some_and(|c| ours(&c)) {
        CATALOG.set(None);
    }
}

/// The largest sequence among the rows of `keyed` whose leading key
/// columns, (aggregate_type, aggregate_id), equal the given ones.
/// The table is locked in `mode` (the events table in the mode its insert
/// takes, so that one lock serves both).
///
/// Read like an index-only scan: when the visibility map says the heap
/// page of the newest entry is visible to all, the sequence comes from the
/// index entry itself (if the index holds it); otherwise the heap tuple is
/// fetched, and an entry whose tuple the snapshot cannot see (an aborted
/// emit, say) is passed over for the next older one.
fn newest_value(
    keyed: Keyed,
    mode: u32,
    aggregate_type: Datum,
    aggregate_id: Datum,
) -> Option<i64> {
    // Dropped in the reverse order: scan, snapshot, index, heap.
    let heap = Opened::table(keyed.table, mode);
    let index = Opened::index(keyed.index, mode);
    // SAFETY: the index is open; its pg_index row and collations are part
    // of its relcache entry.
    let (in_index, keys) = unsafe {
        let form = &*(*index.relation).rd_index;
        let key_columns = form.indkey.values.as_slice(form.indnkeyatts as usize);
        let in_index = key_columns
            .iter()
            .position(|&column| column == keyed.column)
            .map(|n| n as i32 + 1);
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        for (n, (key, value)) in keys
            .iter_mut()
            .zip([aggregate_type, aggregate_id])
            .enumerate()
        {
            pg_sys::ScanKeyEntryInitialize(
                key,
                0,
                n as pg_sys::AttrNumber + 1,
                pg_sys::BTEqualStrategyNumber as _,
                pg_sys::InvalidOid,
                *(*index.relation).rd_indcollation.add(n),
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                value,
            );
        }
        (in_index, keys)
    };
    let snapshot = LatestSnapshot::take();
    // SAFETY: both relations are open and the snapshot registered; the
    // scan keys are copied by index_rescan.
    let scan = unsafe {
        let scan = IndexScan(pg_sys::index_beginscan(
            heap.relation,
            index.relation,
            snapshot.0,
            // PostgreSQL 18 counts index searches for EXPLAIN here; none asked.
            #[cfg(feature = "pg18")]
            std::ptr::null_mut(),
            2,
            0,
        ));
        (*scan.0).xs_want_itup = in_index.is_some();
        let mut keys = keys;
        pg_sys::index_rescan(scan.0, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        scan
    };
    let mut vm = VisibilityMapPin(pg_sys::InvalidBuffer as _);
    let mut slot: Option<Slot> = None;
    loop {
        // SAFETY: the scan is open; a returned tid points into it.
        let block = unsafe {
            let tid =
                pg_sys::index_getnext_tid(scan.0, pg_sys::ScanDirection::BackwardScanDirection);
            if tid.is_null() {
                return None;
            }
            ((*tid).ip_blkid.bi_hi as u32) << 16 | (*tid).ip_blkid.bi_lo as u32
        };
        if let Some(column) = in_index {
            // SAFETY: a block of the open heap; vm keeps the map page pinned.
            let all_visible = unsafe {
                pg_sys::visibilitymap_get_status(heap.relation, block, &mut vm.0) as u32
                    & pg_sys::VISIBILITYMAP_ALL_VISIBLE
                    != 0
            };
            if all_visible {
                // SAFETY: xs_want_itup is set, so the entry is in xs_itup,
                // described by xs_itupdesc; the key column is NOT NULL.
                return Some(unsafe {
                    pg_sys::nocache_index_getattr((*scan.0).xs_itup, column, (*scan.0).xs_itupdesc)
                        .value() as i64
                });
            }
        }
        let slot = slot.get_or_insert_with(|| Slot::for_table(&heap));
        // SAFETY: the scan stands on an entry; the slot is the heap's.
        if unsafe { pg_sys::index_fetch_heap(scan.0, slot.0) } {
            // SAFETY: a heap tuple of this table in a heap slot; the column
            // is NOT NULL, which nocachegetattr reads whatever else is null.
            return Some(unsafe {
                let tuple = (*slot.0.cast::<pg_sys::HeapTupleTableSlot>()).tuple;
                pg_sys::nocachegetattr(tuple, keyed.column as _, (*heap.relation).rd_att).value()
                    as i64
            });
        }
    }
}

/// `outbox.lock_aggregate(aggregate_type, aggregate_id)`: the primitive of
/// the batch form, which calls it for each aggregate in sorted order.
#[no_mangle]
pub extern "C" fn pg_finfo_lock_aggregate() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// Takes the aggregate's lock until the end of the transaction and returns
/// its newest sequence number (0 for a new aggregate).
///
/// # Safety
/// Called by PostgreSQL through the function manager, as a STRICT function
/// of two texts.
#[no_mangle]
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn lock_aggregate(fcinfo: pg_sys::FunctionCallInfo) -> Datum {
    // SAFETY: two non-NULL arguments (STRICT).
    let (aggregate_type, aggregate_id) = unsafe {
        (
            pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, 0),
            pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, 1),
        )
    };
    lock(aggregate_type, aggregate_id);
    Datum::from(read_latest(aggregate_type, aggregate_id))
}

// ---------------------------------------------------------------------------
// emit_event

#[no_mangle]
pub extern "C" fn pg_finfo_emit_event() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `outbox.emit_event(aggregate_type, aggregate_id, event_type, payload,
/// headers, schema_version, expected_seq, idempotency_key, topic)`
/// returning `(event_id, aggregate_seq, replayed)`.
///
/// # Safety
/// Called by PostgreSQL through the function manager with the argument
/// types of its SQL declaration.
#[no_mangle]
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn emit_event(fcinfo: pg_sys::FunctionCallInfo) -> Datum {
    // SAFETY: the call is emit_event's, as its declaration says.
    let call = unsafe { Call::from_fcinfo(fcinfo) };
    match emit(fcinfo, call) {
        Ok(row) => row,
        // Raised here, with every Rust value of the call already dropped.
        Err(refusal) => refusal.raise(),
    }
}

fn emit(fcinfo: pg_sys::FunctionCallInfo, call: Call) -> Result<Datum, Refusal> {
    // SPI only when a statement has to run: the common call runs none.
    let mut spi = Spi::default();
    if !plainly_valid(&call) {
        spi.connect();
        if let Some(refusal) = check_emit(&spi, &call) {
            return Err(refusal);
        }
    }
    let (Some(aggregate_type), Some(aggregate_id)) = (call.aggregate_type, call.aggregate_id)
    else {
        pgrx::error!("pg_outbox: validation let a NULL identifier through");
    };

    if let Some(event_type) = call.event_type {
        let version = call.schema_version.map_or(1, |v| v.value() as i32);
        // SAFETY: text and jsonb arguments of this call.
        unsafe { crate::contracts::check(aggregate_type, event_type, version, call.payload) }?;
    }
    lock(aggregate_type, aggregate_id);
    let id_bytes = crate::event_id();
    let event_id = uuid_datum(id_bytes);
    let latest = read_latest(aggregate_type, aggregate_id);
    let seq = latest + 1;
    if let Some(key) = call.idempotency_key {
        spi.connect();
        let plans = plans(&spi);
        // Claimed under the number this event would get; a claim that
        // exists already answers the call with its event, unchanged.
        let claimed = execute(
            &spi,
            plans.claim_key,
            &[
                Some(aggregate_type),
                Some(key),
                Some(event_id),
                Some(aggregate_id),
                Some(Datum::from(seq)),
            ],
        );
        if claimed == 0 {
            execute(
                &spi,
                plans.first_for_key,
                &[Some(aggregate_type), Some(key)],
            );
            // SAFETY: the first column is the key's uuid.
            let first_id = first_value(&spi, 1).map(|d| unsafe { copy_uuid(d) });
            let first_seq = first_value(&spi, 2);
            spi.finish();
            return Ok(result(fcinfo, first_id, first_seq, true));
        }
    }
    if let Some(expected) = call.expected_seq {
        let expected = expected.value() as i64;
        if expected != latest {
            // SAFETY: both are text datums of this call.
            let (aggregate_type, aggregate_id) =
                unsafe { (bytes(aggregate_type), bytes(aggregate_id)) };
            return Err(Refusal::sequence_conflict(
                aggregate_type,
                aggregate_id,
                expected,
                latest,
            ));
        }
    }
    let row = call.row(event_id, seq);
    if !(DIRECT_INSERT.get() && insert_direct(&row)) {
        spi.connect();
        execute(&spi, plans(&spi).insert, &row);
    }
    spi.finish();
    Ok(result(
        fcinfo,
        Some(id_bytes),
        Some(Datum::from(seq)),
        false,
    ))
}

/// Inserts the event row the way the executor's INSERT would, without
/// starting an executor: the heap insert (WAL-logged for logical decoding
/// like any other), then an insert into every index, unique ones checked.
/// Only while `outbox.events` is exactly the table the extension created,
/// give or take plain indexes: its known columns, no insert triggers,
/// rules, CHECK constraints or generated columns, and indexes on plain
/// columns only. Otherwise it writes nothing and returns false, and the
/// caller runs the SQL INSERT, which handles whatever was added.
///
/// Worth about 4% of emit_event's throughput: bench/emit.sh runs emit_event
/// with and without it (`pg_outbox.direct_insert`) in the same rounds.
fn insert_direct(row: &[Option<Datum>; 9]) -> bool {
    let rel = Opened::table(catalog().events.table, pg_sys::RowExclusiveLock);
    if !plain_table(&rel) {
        return false;
    }
    let Some(indexes) = open_plain_indexes(&rel) else {
        return false;
    };
    let mut values = [Datum::from(0); EVENT_COLUMNS.len()];
    let mut nulls = [false; EVENT_COLUMNS.len()];
    for (i, value) in row.iter().enumerate() {
        values[i] = value.unwrap_or(Datum::from(0));
        nulls[i] = value.is_none();
    }
    // SAFETY: plain reads of the clock and of this transaction's id.
    unsafe {
        values[9] = Datum::from(pg_sys::GetCurrentTimestamp());
        values[10] = Datum::from(pg_sys::GetTopFullTransactionId().value);
    }
    // SAFETY: the relation is open; plain_table checked that its
    // descriptor has the EVENT_COLUMNS, which values and nulls fill.
    unsafe {
        let desc = (*rel.relation).rd_att;
        let attrs = attributes(desc, EVENT_COLUMNS.len());
        if attrs
            .iter()
            .zip(nulls)
            .any(|(a, null)| a.attnotnull && null)
        {
            // Validation should have refused it; the SQL INSERT names the column.
            return false;
        }
        let tuple = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());
        pg_sys::heap_insert(
            rel.relation,
            tuple,
            pg_sys::GetCurrentCommandId(true),
            0,
            std::ptr::null_mut(),
        );
        for &(index, info) in indexes.iter() {
            let mut key_values = [Datum::from(0); pg_sys::INDEX_MAX_KEYS as usize];
            let mut key_nulls = [false; pg_sys::INDEX_MAX_KEYS as usize];
            for k in 0..(*info).ii_NumIndexAttrs as usize {
                let column = (*info).ii_IndexAttrNumbers[k] as usize - 1;
                key_values[k] = values[column];
                key_nulls[k] = nulls[column];
            }
            let check = if (*(*index).rd_index).indisunique {
                pg_sys::IndexUniqueCheck::UNIQUE_CHECK_YES
            } else {
                pg_sys::IndexUniqueCheck::UNIQUE_CHECK_NO
            };
            pg_sys::index_insert(
                index,
                key_values.as_mut_ptr(),
                key_nulls.as_mut_ptr(),
                &mut (*tuple).t_self,
                rel.relation,
                check,
                false,
                info,
            );
        }
        pg_sys::heap_freetuple(tuple);
        // The next read of the newest sequence in this transaction sees it.
        pg_sys::CommandCounterIncrement();
    }
    true
}

/// Whether an emit on today's `outbox.events` takes [`insert_direct`]: for
/// the tests, since either way the row is stored.
#[cfg(any(test, feature = "pg_test"))]
pub(crate) fn takes_direct_insert() -> bool {
    let rel = Opened::table(catalog().events.table, pg_sys::AccessShareLock);
    plain_table(&rel) && open_plain_indexes(&rel).is_some()
}

/// Whether the table is the plain events table of [`EVENT_COLUMNS`].
fn plain_table(rel: &Opened) -> bool {
    // SAFETY: the relation is open: its relcache entry, descriptor,
    // constraints and triggers are valid while it is.
    unsafe {
        let class = &*(*rel.relation).rd_rel;
        let desc = (*rel.relation).rd_att;
        let constraints = (*desc).constr;
        let triggers = (*rel.relation).trigdesc;
        let attrs = attributes(desc, (*desc).natts as usize);
        class.relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
            && !class.relhasrules
            && !class.relforcerowsecurity
            && (constraints.is_null()
                || ((*constraints).num_check == 0 && !(*constraints).has_generated_stored))
            && (triggers.is_null()
                || !((*triggers).trig_insert_before_row
                    || (*triggers).trig_insert_after_row
                    || (*triggers).trig_insert_instead_row
                    || (*triggers).trig_insert_before_statement
                    || (*triggers).trig_insert_after_statement
                    || (*triggers).trig_insert_new_table))
            && attrs.len() == EVENT_COLUMNS.len()
            && attrs.iter().zip(EVENT_COLUMNS).all(|(a, (name, type_))| {
                let name = name.to_bytes_with_nul();
                !a.attisdropped
                    && a.atttypid == type_
                    && std::slice::from_raw_parts(a.attname.data.as_ptr().cast::<u8>(), name.len())
                        == name
            })
    }
}

/// The first `n` attributes of a tuple descriptor (TupleDescAttr). Before
/// PostgreSQL 18 they are its `attrs` array; from 18 on they follow its
/// `compact_attrs`, one per attribute.
///
/// # Safety
/// `desc` is a valid descriptor with at least `n` attributes that outlives
/// the slice.
unsafe fn attributes<'a>(desc: pg_sys::TupleDesc, n: usize) -> &'a [pg_sys::FormData_pg_attribute] {
    #[cfg(not(feature = "pg18"))]
    // SAFETY: as the caller promises; attrs holds natts entries.
    unsafe {
        (*desc).attrs.as_slice(n)
    }
    #[cfg(feature = "pg18")]
    // SAFETY: as the caller promises; TupleDescAttr's layout in
    // tupdesc.h: natts CompactAttributes, then natts attributes.
    unsafe {
        let first = (*desc)
            .compact_attrs
            .as_ptr()
            .add((*desc).natts as usize)
            .cast::<pg_sys::FormData_pg_attribute>();
        std::slice::from_raw_parts(first, n)
    }
}

/// The open indexes of the events table that take inserts, closed on drop.
/// A fixed array: the table has one index, and a few more are allowed for
/// before the insert goes the SQL way.
struct OpenIndexes {
    open: [(pg_sys::Relation, *mut pg_sys::IndexInfo); 8],
    len: usize,
}

impl OpenIndexes {
    fn iter(&self) -> impl Iterator<Item = &(pg_sys::Relation, *mut pg_sys::IndexInfo)> {
        self.open[..self.len].iter()
    }
}

impl Drop for OpenIndexes {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        for &(index, _) in self.iter() {
            // SAFETY: opened by open_plain_indexes, closed only here.
            unsafe { pg_sys::index_close(index, pg_sys::NoLock as _) };
        }
    }
}

/// The table's indexes that take inserts, each with its IndexInfo, when
/// every one is on plain columns (no expression, predicate or exclusion)
/// with immediate uniqueness, and there are at most 8; None, with nothing
/// left open, otherwise.
fn open_plain_indexes(rel: &Opened) -> Option<OpenIndexes> {
    // SAFETY: the relation is open; the list is its relcache's copy.
    let list = unsafe { pg_sys::RelationGetIndexList(rel.relation) };
    let oids = if list.is_null() {
        &[][..]
    } else {
        // SAFETY: a List of OIDs with `length` cells.
        unsafe { std::slice::from_raw_parts((*list).elements, (*list).length as usize) }
    };
    let mut indexes = OpenIndexes {
        open: [(std::ptr::null_mut(), std::ptr::null_mut()); 8],
        len: 0,
    };
    for cell in oids {
        if indexes.len == indexes.open.len() {
            return None;
        }
        // SAFETY: an OID cell of the list.
        let index = Opened::index(unsafe { cell.oid_value }, pg_sys::RowExclusiveLock);
        // SAFETY: the index is open; BuildIndexInfo reads its catalog entry.
        let (ready, plain, info) = unsafe {
            let form = &*(*index.relation).rd_index;
            if !form.indisready {
                (false, true, std::ptr::null_mut())
            } else {
                let info = pg_sys::BuildIndexInfo(index.relation);
                let plain = (*info).ii_Expressions.is_null()
                    && (*info).ii_Predicate.is_null()
                    && (*info).ii_ExclusionOps.is_null()
                    && (!form.indisunique || form.indimmediate);
                (true, plain, info)
            }
        };
        if !ready {
            // Being built concurrently: the build takes care of this row.
            continue;
        }
        if !plain {
            return None;
        }
        // Now held by `indexes`, which closes it.
        let relation = index.relation;
        std::mem::forget(index);
        indexes.open[indexes.len] = (relation, info);
        indexes.len += 1;
    }
    Some(indexes)
}

// ---------------------------------------------------------------------------
// Refusals

/// An error to raise with its own SQLSTATE. (Raised through pgrx, a
/// SQLSTATE that PostgreSQL does not define would become XX000.)
pub(crate) struct Refusal {
    sqlstate: [u8; 5],
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

impl Refusal {
    fn sequence_conflict(
        aggregate_type: &[u8],
        aggregate_id: &[u8],
        expected: i64,
        actual: i64,
    ) -> Refusal {
        let aggregate_type = String::from_utf8_lossy(aggregate_type);
        let aggregate_id = String::from_utf8_lossy(aggregate_id);
        Refusal {
            sqlstate: *b"PO101",
            message: format!(
                "sequence conflict on {aggregate_type} {}: expected {expected}, actual {actual}",
                quote_literal(&aggregate_id)
            ),
            detail: Some(format!("expected_seq={expected} actual_seq={actual}")),
            hint: Some(
                "Another writer changed the aggregate: reload it, decide again, and retry with the new sequence."
                    .into(),
            ),
        }
    }

    /// A payload that breaks the registered schema of its event type and
    /// version (`outbox.check_payload`'s message in the SQL edition is the
    /// same but for the validator's own words after the colon).
    pub(crate) fn payload_breaks_schema(
        aggregate_type: &str,
        event_type: &str,
        version: i32,
        pointer: &str,
        rule: &str,
        schema_path: &str,
        words: &str,
    ) -> Refusal {
        Refusal {
            sqlstate: *b"PO020",
            message: format!(
                "payload of {aggregate_type} event {event_type} version {version} breaks its schema at {} (rule {rule}): {words}",
                if pointer.is_empty() { "its root".to_owned() } else { format!("\"{pointer}\"") }
            ),
            detail: Some(format!("pointer={pointer} rule={rule} schema_path={schema_path}")),
            hint: Some(
                "Fix the payload, or register a new schema version and emit with schema_version => it (outbox.register_schema)."
                    .into(),
            ),
        }
    }

    /// An event type with registered schemas, emitted with a version that
    /// has none.
    pub(crate) fn unregistered_version(
        aggregate_type: &str,
        event_type: &str,
        version: i32,
        known: &[String],
    ) -> Refusal {
        Refusal {
            sqlstate: *b"PO021",
            message: format!(
                "no schema is registered for {aggregate_type} event {event_type} version {version} (registered versions: {})",
                known.join(", ")
            ),
            detail: None,
            hint: Some(
                "Register the version with outbox.register_schema, or emit with a registered schema_version."
                    .into(),
            ),
        }
    }

    /// A registered schema the validator cannot compile.
    pub(crate) fn schema_not_valid(reason: &str) -> Refusal {
        Refusal {
            sqlstate: *b"PO022",
            message: format!(
                "the registered schema is not a JSON Schema the validator can use: {reason}"
            ),
            detail: None,
            hint: Some("Register a corrected schema as a new version.".into()),
        }
    }

    /// ereport(WARNING): the same report, and the call goes on.
    pub(crate) fn warn(self) {
        self.report(pgrx::PgLogLevel::WARNING as _);
    }

    /// ereport(ERROR): does not return.
    pub(crate) fn raise(self) -> ! {
        self.report(pgrx::PgLogLevel::ERROR as _);
        unreachable!("ereport(ERROR) returned")
    }

    fn report(self, level: std::ffi::c_int) {
        extern "C-unwind" {
            fn errstart(elevel: std::ffi::c_int, domain: *const std::ffi::c_char) -> bool;
            fn errcode(sqlerrcode: std::ffi::c_int) -> std::ffi::c_int;
            fn errmsg(fmt: *const std::ffi::c_char, ...) -> std::ffi::c_int;
            fn errdetail(fmt: *const std::ffi::c_char, ...) -> std::ffi::c_int;
            fn errhint(fmt: *const std::ffi::c_char, ...) -> std::ffi::c_int;
            fn errfinish(
                filename: *const std::ffi::c_char,
                lineno: std::ffi::c_int,
                funcname: *const std::ffi::c_char,
            );
        }
        // Copies in PostgreSQL memory, then nothing of Rust's is left to drop.
        let pg = |text: &str| {
            let text = std::ffi::CString::new(text.replace('\0', "")).unwrap_or_default();
            // SAFETY: pstrdup copies the NUL-terminated text.
            unsafe { pg_sys::pstrdup(text.as_ptr()) }
        };
        let code = self.sqlstate.iter().enumerate().fold(0, |acc, (i, c)| {
            acc | ((((*c as i32) - ('0' as i32)) & 0x3F) << (6 * i))
        });
        let message = pg(&self.message);
        let detail = self.detail.as_deref().map(pg);
        let hint = self.hint.as_deref().map(pg);
        drop(self);
        // SAFETY: ereport's expansion, with "%s" formats over strings in
        // PostgreSQL memory; errfinish at ERROR longjmps out.
        unsafe {
            if errstart(level, std::ptr::null()) {
                errcode(code);
                errmsg(c"%s".as_ptr(), message);
                if let Some(detail) = detail {
                    errdetail(c"%s".as_ptr(), detail);
                }
                if let Some(hint) = hint {
                    errhint(c"%s".as_ptr(), hint);
                }
                errfinish(c"emit.rs".as_ptr(), line!() as _, c"emit_event".as_ptr());
            }
        }
    }
}

/// SQL's quote_literal.
fn quote_literal(text: &str) -> String {
    let quoted = text.replace('\'', "''");
    if quoted.contains('\\') {
        format!("E'{}'", quoted.replace('\\', "\\\\"))
    } else {
        format!("'{quoted}'")
    }
}

/// Runs `outbox.check_emit`, which names the first rule the call breaks.
fn check_emit(spi: &Spi, call: &Call) -> Option<Refusal> {
    let plan = prepare_once(
        spi,
        c"SELECT * FROM outbox.check_emit($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &CALL_TYPES,
    );
    execute(spi, plan, &call.datums());
    let text = |column: i32| {
        // SAFETY: check_emit's columns are texts.
        first_value(spi, column).map(|d| String::from_utf8_lossy(unsafe { bytes(d) }).into_owned())
    };
    let refusal = text(1).map(|sqlstate| Refusal {
        sqlstate: sqlstate.as_bytes().try_into().unwrap_or(*b"XX000"),
        message: text(2).unwrap_or_default(),
        detail: text(3).filter(|d| !d.is_empty()),
        hint: text(4).filter(|h| !h.is_empty()),
    });
    // SAFETY: the plan made above, used no more.
    unsafe { pg_sys::SPI_freeplan(plan) };
    refusal
}

/// The common case, checked without leaving Rust: every rule of
/// `outbox.check_emit` holds for values that pass here (the converse need
/// not hold; such calls take the PL/pgSQL path).
fn plainly_valid(call: &Call) -> bool {
    let (Some(at), Some(id), Some(et), Some(payload), Some(version)) = (
        call.aggregate_type,
        call.aggregate_id,
        call.event_type,
        call.payload,
        call.schema_version,
    ) else {
        return false;
    };
    if call.headers.is_some_and(|h| !headers_plainly_valid(h)) {
        return false;
    }
    // SAFETY: the text arguments of this call.
    let (at, id, et) = unsafe { (bytes(at), bytes(id), bytes(et)) };
    let p = payload.cast_mut_ptr::<pg_sys::varlena>();
    // SAFETY: the jsonb argument, a varlena; its header is read, not its data.
    let payload_ok = unsafe {
        !varatt_is_1b_e(p)
            && !varatt_is_4b_c(p)
            && varsize_any(p) <= MAX_PAYLOAD_BYTES.get().max(0) as usize
    };
    // SAFETY: text arguments of this call.
    let key_ok = call
        .idempotency_key
        .is_none_or(|k| (1..=255).contains(&unsafe { bytes(k) }.len()));
    let topic_ok = call.topic.is_none_or(|t| {
        // SAFETY: a text argument of this call.
        let t = unsafe { bytes(t) };
        t.len() <= 249 && topic_safe(t) && t != b"." && t != b".."
    });
    at.len() <= 128
        && topic_safe(at)
        && !id.is_empty()
        && id.len() <= 512
        && !et.is_empty()
        && et.len() <= 255
        && payload_ok
        && version.value() as i32 >= 1
        && call.expected_seq.is_none_or(|e| e.value() as i64 >= 0)
        && key_ok
        && topic_ok
}

/// Header names the forwarder sets itself (`outbox.check_event` has the
/// same list).
const RESERVED_HEADERS: [&[u8]; 6] = [
    b"event_id",
    b"event_type",
    b"aggregate_type",
    b"aggregate_seq",
    b"schema_version",
    b"occurred_at",
];

/// Whether the headers are plainly a JSON object of strings under names of
/// 1 to 255 bytes that are not reserved (anything else goes to
/// `check_emit`, which has the whole rule and its message).
fn headers_plainly_valid(headers: Datum) -> bool {
    let headers = headers.cast_mut_ptr::<pg_sys::varlena>();
    // SAFETY: the jsonb argument; its header is read.
    if unsafe { varatt_is_1b_e(headers) || varatt_is_4b_c(headers) } {
        return false;
    }
    // SAFETY: an uncompressed, inline jsonb, walked with PostgreSQL's own
    // iterator; key strings point into it.
    unsafe {
        let jsonb = pg_sys::pg_detoast_datum(headers).cast::<pg_sys::Jsonb>();
        let root = &mut (*jsonb).root;
        if root.header & pg_sys::JB_FOBJECT == 0 {
            return false;
        }
        let mut iterator = pg_sys::JsonbIteratorInit(root);
        let mut value: pg_sys::JsonbValue = std::mem::zeroed();
        use pg_sys::JsonbIteratorToken::*;
        loop {
            match pg_sys::JsonbIteratorNext(&mut iterator, &mut value, true) {
                WJB_BEGIN_OBJECT | WJB_END_OBJECT => {}
                WJB_DONE => return true,
                WJB_KEY => {
                    let name = value.val.string;
                    let name = std::slice::from_raw_parts(name.val.cast::<u8>(), name.len as usize);
                    if name.is_empty() || name.len() > 255 || RESERVED_HEADERS.contains(&name) {
                        return false;
                    }
                }
                WJB_VALUE if value.type_ == pg_sys::jbvType::jbvString => {}
                _ => return false,
            }
        }
    }
}

/// The `(event_id, aggregate_seq, replayed)` row. Build it after SPI is
/// finished: it belongs to the caller's memory context.
fn result(
    fcinfo: pg_sys::FunctionCallInfo,
    event_id: Option<[u8; 16]>,
    seq: Option<Datum>,
    replayed: bool,
) -> Datum {
    // SAFETY: the call's own flinfo; the row type is blessed once per call
    // site and kept in fn_extra, in the function's memory context.
    unsafe {
        let flinfo = (*fcinfo).flinfo;
        let mut tupdesc = (*flinfo).fn_extra as pg_sys::TupleDesc;
        if tupdesc.is_null() {
            let mut described: pg_sys::TupleDesc = std::ptr::null_mut();
            if pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut described)
                != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE
            {
                pgrx::error!("pg_outbox: emit_event must return a row");
            }
            let previous = pg_sys::MemoryContextSwitchTo((*flinfo).fn_mcxt);
            tupdesc = pg_sys::BlessTupleDesc(pg_sys::CreateTupleDescCopy(described));
            pg_sys::MemoryContextSwitchTo(previous);
            (*flinfo).fn_extra = tupdesc.cast();
        }
        let mut values = [
            event_id.map_or(Datum::from(0), uuid_datum),
            seq.unwrap_or(Datum::from(0)),
            Datum::from(replayed),
        ];
        let mut nulls = [event_id.is_none(), seq.is_none(), false];
        let tuple = pg_sys::heap_form_tuple(tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr());
        pg_sys::HeapTupleHeaderGetDatum((*tuple).t_data)
    }
}
