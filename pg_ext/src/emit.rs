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
//! their messages live in one place (shared with the batch form).

use std::ffi::CStr;

use pgrx::pg_sys::{self, Datum, Oid};
use pgrx::varlena::{varatt_is_1b_e, varatt_is_4b_c, vardata_any, varsize_any, varsize_any_exhdr};

use crate::{BackendCell, DIRECT_INSERT, MAX_PAYLOAD_BYTES};

/// Plans kept for the life of the backend; PostgreSQL revalidates them
/// when the tables change.
#[derive(Clone, Copy)]
struct Plans {
    claim_key: pg_sys::SPIPlanPtr,
    first_for_key: pg_sys::SPIPlanPtr,
    insert: pg_sys::SPIPlanPtr,
}

static PLANS: BackendCell<Option<Plans>> = BackendCell::new(None);

// Built-in functions called through the function manager; pgrx's wrappers
// are Rust functions, not the C entry points DirectFunctionCall needs.
extern "C-unwind" {
    fn hashtext(fcinfo: pg_sys::FunctionCallInfo) -> Datum;
    fn pg_advisory_xact_lock_int4(fcinfo: pg_sys::FunctionCallInfo) -> Datum;
}

const TEXT: Oid = pg_sys::TEXTOID;
const INT8: Oid = pg_sys::INT8OID;

/// A plan kept past SPI_finish, for the life of the backend.
unsafe fn prepare(sql: &CStr, types: &[Oid]) -> pg_sys::SPIPlanPtr {
    let plan = prepare_once(sql, types);
    pg_sys::SPI_keepplan(plan);
    plan
}

/// Must run inside SPI_connect.
unsafe fn plans() -> Plans {
    if let Some(plans) = PLANS.get() {
        return plans;
    }
    let plans = Plans {
        claim_key: prepare(
            c"INSERT INTO outbox.idempotency_keys
                     (aggregate_type, idempotency_key, event_id, aggregate_id, aggregate_seq)
              VALUES ($1, $2, $3, $4, $5)
              ON CONFLICT (aggregate_type, idempotency_key) DO NOTHING",
            &[TEXT, TEXT, pg_sys::UUIDOID, TEXT, INT8],
        ),
        first_for_key: prepare(
            c"SELECT k.event_id, k.aggregate_seq FROM outbox.idempotency_keys k
               WHERE k.aggregate_type = $1 AND k.idempotency_key = $2",
            &[TEXT, TEXT],
        ),
        insert: prepare(
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

/// Runs a plan; NULL arguments are `None`.
unsafe fn execute(plan: pg_sys::SPIPlanPtr, args: &[Option<Datum>]) -> u64 {
    let mut values: Vec<Datum> = args.iter().map(|a| a.unwrap_or(Datum::from(0))).collect();
    let nulls: Vec<std::ffi::c_char> = args
        .iter()
        .map(|a| if a.is_some() { b' ' } else { b'n' } as std::ffi::c_char)
        .collect();
    let rc = pg_sys::SPI_execute_plan(plan, values.as_mut_ptr(), nulls.as_ptr(), false, 0);
    if rc < 0 {
        pgrx::error!("pg_outbox: an internal statement failed (SPI result {rc})");
    }
    pg_sys::SPI_processed
}

/// Column `column` (from 1) of the first result row.
unsafe fn first_value(column: i32) -> Option<Datum> {
    let table = pg_sys::SPI_tuptable;
    if table.is_null() || pg_sys::SPI_processed == 0 {
        return None;
    }
    let mut is_null = false;
    let value = pg_sys::SPI_getbinval(*(*table).vals, (*table).tupdesc, column, &mut is_null);
    (!is_null).then_some(value)
}

/// A plan for this call only (SPI_finish frees it).
unsafe fn prepare_once(sql: &CStr, types: &[Oid]) -> pg_sys::SPIPlanPtr {
    let mut types = types.to_vec();
    let plan = pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr());
    if plan.is_null() {
        pgrx::error!("pg_outbox: cannot prepare an internal statement");
    }
    plan
}

unsafe fn bytes<'a>(text: Datum) -> &'a [u8] {
    let v = pg_sys::pg_detoast_datum_packed(text.cast_mut_ptr());
    std::slice::from_raw_parts(vardata_any(v) as *const u8, varsize_any_exhdr(v))
}

fn topic_safe(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Takes the aggregate's lock until the end of the transaction and returns
/// its newest sequence number (0 for a new aggregate).
unsafe fn lock_and_read_latest(aggregate_type: Datum, aggregate_id: Datum) -> i64 {
    lock(aggregate_type, aggregate_id);
    read_latest(aggregate_type, aggregate_id)
}

/// The aggregate's lock, held until the end of the transaction.
unsafe fn lock(aggregate_type: Datum, aggregate_id: Datum) {
    let hash = |text: Datum| {
        pg_sys::DirectFunctionCall1Coll(Some(hashtext), pg_sys::C_COLLATION_OID, text)
    };
    pg_sys::DirectFunctionCall2Coll(
        Some(pg_advisory_xact_lock_int4),
        pg_sys::InvalidOid,
        hash(aggregate_type),
        hash(aggregate_id),
    );
}

/// The aggregate's newest sequence, read with the latest snapshot: taken
/// after the lock, it holds every event of the aggregate that committed
/// before, whatever the isolation level. Read straight from the unique key
/// (no executor: starting one cost more than the rest of emit_event).
unsafe fn read_latest(aggregate_type: Datum, aggregate_id: Datum) -> i64 {
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

unsafe fn catalog() -> Catalog {
    if let Some(catalog) = CATALOG.get() {
        return catalog;
    }
    if !WATCHING.get() {
        pg_sys::CacheRegisterRelcacheCallback(Some(forget_catalog), Datum::from(0));
        WATCHING.set(true);
    }
    let schema = pg_sys::get_namespace_oid(c"outbox".as_ptr(), false);
    let keyed = |table: &CStr, index: &CStr, column: &CStr| {
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
    let catalog = Catalog {
        events: keyed(c"events", c"events_aggregate_seq_key", c"aggregate_seq"),
        floors: keyed(c"sequence_floors", c"sequence_floors_pkey", c"last_seq"),
        floors_in_use: false,
    };
    let floors = pg_sys::table_open(catalog.floors.table, pg_sys::AccessShareLock as _);
    let catalog = Catalog {
        floors_in_use: pg_sys::RelationGetNumberOfBlocksInFork(
            floors,
            pg_sys::ForkNumber::MAIN_FORKNUM,
        ) > 0,
        ..catalog
    };
    pg_sys::table_close(floors, pg_sys::NoLock as _);
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
unsafe fn newest_value(
    keyed: Keyed,
    mode: u32,
    aggregate_type: Datum,
    aggregate_id: Datum,
) -> Option<i64> {
    let heap = pg_sys::table_open(keyed.table, mode as _);
    let index = pg_sys::index_open(keyed.index, mode as _);
    let key_columns = (*(*index).rd_index)
        .indkey
        .values
        .as_slice((*(*index).rd_index).indnkeyatts as usize);
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
            *(*index).rd_indcollation.add(n),
            pg_sys::Oid::from(pg_sys::F_TEXTEQ),
            value,
        );
    }
    let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
    let scan = pg_sys::index_beginscan(heap, index, snapshot, 2, 0);
    (*scan).xs_want_itup = in_index.is_some();
    pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
    let mut vm_buffer: pg_sys::Buffer = pg_sys::InvalidBuffer as _;
    let mut slot: *mut pg_sys::TupleTableSlot = std::ptr::null_mut();
    let mut value = None;
    loop {
        let tid = pg_sys::index_getnext_tid(scan, pg_sys::ScanDirection::BackwardScanDirection);
        if tid.is_null() {
            break;
        }
        let block = ((*tid).ip_blkid.bi_hi as u32) << 16 | (*tid).ip_blkid.bi_lo as u32;
        if let Some(column) = in_index {
            let all_visible = pg_sys::visibilitymap_get_status(heap, block, &mut vm_buffer) as u32
                & pg_sys::VISIBILITYMAP_ALL_VISIBLE
                != 0;
            if all_visible {
                let entry = (*scan).xs_itup;
                value = Some(
                    pg_sys::nocache_index_getattr(entry, column, (*scan).xs_itupdesc).value()
                        as i64,
                );
                break;
            }
        }
        if slot.is_null() {
            slot = pg_sys::table_slot_create(heap, std::ptr::null_mut());
        }
        if pg_sys::index_fetch_heap(scan, slot) {
            let tuple = (*slot.cast::<pg_sys::HeapTupleTableSlot>()).tuple;
            // NOT NULL column: nocachegetattr reads it whatever else is null.
            value = Some(
                pg_sys::nocachegetattr(tuple, keyed.column as _, (*heap).rd_att).value() as i64,
            );
            break;
        }
    }
    if vm_buffer != pg_sys::InvalidBuffer as pg_sys::Buffer {
        pg_sys::ReleaseBuffer(vm_buffer);
    }
    if !slot.is_null() {
        pg_sys::ExecDropSingleTupleTableSlot(slot);
    }
    pg_sys::index_endscan(scan);
    pg_sys::UnregisterSnapshot(snapshot);
    pg_sys::index_close(index, pg_sys::NoLock as _);
    pg_sys::table_close(heap, pg_sys::NoLock as _);
    value
}

/// `outbox.lock_aggregate(aggregate_type, aggregate_id)`: the primitive of
/// the batch form, which calls it for each aggregate in sorted order.
#[no_mangle]
pub extern "C" fn pg_finfo_lock_aggregate() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// # Safety
/// Called by PostgreSQL through the function manager, as a STRICT function.
#[no_mangle]
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn lock_aggregate(fcinfo: pg_sys::FunctionCallInfo) -> Datum {
    let aggregate_type = pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, 0);
    let aggregate_id = pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, 1);
    Datum::from(lock_and_read_latest(aggregate_type, aggregate_id))
}

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
    match emit(fcinfo) {
        Ok(row) => row,
        // Raised here, with every Rust value of the call already dropped.
        Err(refusal) => refusal.raise(),
    }
}

unsafe fn emit(fcinfo: pg_sys::FunctionCallInfo) -> Result<Datum, Refusal> {
    let arg = |n: usize| {
        (!pgrx::fcinfo::pg_arg_is_null(fcinfo, n))
            .then(|| pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n))
    };
    let args: [Option<Datum>; 9] = std::array::from_fn(arg);
    let [aggregate_type, aggregate_id, event_type, payload, headers, schema_version, expected_seq, key, topic] =
        args;

    // SPI only when a statement has to run: the common call runs none.
    let mut spi = Spi::default();
    if !plainly_valid(&args) {
        spi.connect();
        if let Some(refusal) = check_emit(&args) {
            spi.finish();
            return Err(refusal);
        }
    }
    let (Some(aggregate_type), Some(aggregate_id)) = (aggregate_type, aggregate_id) else {
        pgrx::error!("pg_outbox: validation let a NULL identifier through");
    };

    lock(aggregate_type, aggregate_id);
    let id_bytes = crate::event_id();
    let event_id = uuid_datum(id_bytes);
    let schema_version = schema_version.unwrap_or(Datum::from(1_i32));

    let latest = read_latest(aggregate_type, aggregate_id);
    let seq = latest + 1;
    if let Some(key) = key {
        spi.connect();
        let plans = plans();
        // Claimed under the number this event would get; a claim that
        // exists already answers the call with its event, unchanged.
        let claimed = execute(
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
            execute(plans.first_for_key, &[Some(aggregate_type), Some(key)]);
            let first_id = first_value(1).map(|d| copy_uuid(d));
            let first_seq = first_value(2);
            spi.finish();
            return Ok(result(fcinfo, first_id, first_seq, true));
        }
    }
    if let Some(expected) = expected_seq {
        let expected = expected.value() as i64;
        if expected != latest {
            let refusal = Refusal::sequence_conflict(
                bytes(aggregate_type),
                bytes(aggregate_id),
                expected,
                latest,
            );
            spi.finish();
            return Err(refusal);
        }
    }
    let row = [
        Some(event_id),
        Some(aggregate_type),
        Some(aggregate_id),
        Some(Datum::from(seq)),
        event_type,
        Some(schema_version),
        payload,
        headers,
        topic,
    ];
    if !(DIRECT_INSERT.get() && insert_direct(&row)) {
        spi.connect();
        execute(plans().insert, &row);
    }
    spi.finish();
    Ok(result(
        fcinfo,
        Some(id_bytes),
        Some(Datum::from(seq)),
        false,
    ))
}

/// An SPI connection opened on first need and closed once, with
/// `search_path` pinned to `pg_catalog, pg_temp` while it is open.
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
    unsafe fn connect(&mut self) {
        if self.guc_level.is_none() {
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

    unsafe fn finish(&mut self) {
        if let Some(level) = self.guc_level.take() {
            pg_sys::SPI_finish();
            pg_sys::AtEOXact_GUC(true, level);
        }
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

/// Inserts the event row the way the executor's INSERT would, without
/// starting an executor: the heap insert (WAL-logged for logical decoding
/// like any other), then an insert into every index, unique ones checked.
/// Only while `outbox.events` is exactly the table the extension created,
/// give or take plain indexes: its known columns, no insert triggers,
/// rules, CHECK constraints or generated columns, and indexes on plain
/// columns only. Otherwise it writes nothing and returns false, and the
/// caller runs the SQL INSERT, which handles whatever was added.
unsafe fn insert_direct(row: &[Option<Datum>; 9]) -> bool {
    let catalog = catalog();
    let rel = pg_sys::table_open(catalog.events.table, pg_sys::RowExclusiveLock as _);
    let indexes = if plain_table(rel) {
        open_plain_indexes(rel)
    } else {
        None
    };
    let Some(indexes) = indexes else {
        pg_sys::table_close(rel, pg_sys::NoLock as _);
        return false;
    };
    let mut values = [Datum::from(0); EVENT_COLUMNS.len()];
    let mut nulls = [false; EVENT_COLUMNS.len()];
    for (i, value) in row.iter().enumerate() {
        values[i] = value.unwrap_or(Datum::from(0));
        nulls[i] = value.is_none();
    }
    values[9] = Datum::from(pg_sys::GetCurrentTimestamp());
    values[10] = Datum::from(pg_sys::GetTopFullTransactionId().value);
    let desc = (*rel).rd_att;
    let attrs = (*desc).attrs.as_slice(EVENT_COLUMNS.len());
    if attrs
        .iter()
        .zip(nulls)
        .any(|(a, null)| a.attnotnull && null)
    {
        // Validation should have refused it; the SQL INSERT names the column.
        indexes.close();
        pg_sys::table_close(rel, pg_sys::NoLock as _);
        return false;
    }
    let tuple = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());
    pg_sys::heap_insert(
        rel,
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
            rel,
            check,
            false,
            info,
        );
    }
    indexes.close();
    pg_sys::heap_freetuple(tuple);
    pg_sys::table_close(rel, pg_sys::NoLock as _);
    // The next read of the newest sequence in this transaction sees it.
    pg_sys::CommandCounterIncrement();
    true
}

/// Whether the table is the plain events table of [`EVENT_COLUMNS`].
unsafe fn plain_table(rel: pg_sys::Relation) -> bool {
    let class = &*(*rel).rd_rel;
    let desc = (*rel).rd_att;
    let constraints = (*desc).constr;
    let triggers = (*rel).trigdesc;
    let attrs = (*desc).attrs.as_slice((*desc).natts as usize);
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

/// The open indexes of the events table that take inserts. A fixed array:
/// the table has one index, and a few more are allowed for before the
/// insert goes the SQL way.
struct OpenIndexes {
    open: [(pg_sys::Relation, *mut pg_sys::IndexInfo); 8],
    len: usize,
}

impl OpenIndexes {
    fn iter(&self) -> impl Iterator<Item = &(pg_sys::Relation, *mut pg_sys::IndexInfo)> {
        self.open[..self.len].iter()
    }

    unsafe fn close(&self) {
        for &(index, _) in self.iter() {
            pg_sys::index_close(index, pg_sys::NoLock as _);
        }
    }
}

/// The table's indexes that take inserts, each with its IndexInfo, when
/// every one is on plain columns (no expression, predicate or exclusion)
/// with immediate uniqueness, and there are at most 8; None, with nothing
/// left open, otherwise.
unsafe fn open_plain_indexes(rel: pg_sys::Relation) -> Option<OpenIndexes> {
    let list = pg_sys::RelationGetIndexList(rel);
    let oids = if list.is_null() {
        &[][..]
    } else {
        std::slice::from_raw_parts((*list).elements, (*list).length as usize)
    };
    let mut indexes = OpenIndexes {
        open: [(std::ptr::null_mut(), std::ptr::null_mut()); 8],
        len: 0,
    };
    for cell in oids {
        if indexes.len == indexes.open.len() {
            indexes.close();
            return None;
        }
        let index = pg_sys::index_open(cell.oid_value, pg_sys::RowExclusiveLock as _);
        let form = &*(*index).rd_index;
        if !form.indisready {
            // Being built concurrently: the build takes care of this row.
            pg_sys::index_close(index, pg_sys::NoLock as _);
            continue;
        }
        let info = pg_sys::BuildIndexInfo(index);
        indexes.open[indexes.len] = (index, info);
        indexes.len += 1;
        let plain = (*info).ii_Expressions.is_null()
            && (*info).ii_Predicate.is_null()
            && (*info).ii_ExclusionOps.is_null()
            && (!form.indisunique || form.indimmediate);
        if !plain {
            indexes.close();
            return None;
        }
    }
    Some(indexes)
}

/// An error to raise with its own SQLSTATE. (Raised through pgrx, a
/// SQLSTATE that PostgreSQL does not define would become XX000.)
struct Refusal {
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

    /// ereport(ERROR): does not return.
    unsafe fn raise(self) -> ! {
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
            pg_sys::pstrdup(
                std::ffi::CString::new(text.replace('\0', ""))
                    .unwrap_or_default()
                    .as_ptr(),
            )
        };
        let code = self.sqlstate.iter().enumerate().fold(0, |acc, (i, c)| {
            acc | ((((*c as i32) - ('0' as i32)) & 0x3F) << (6 * i))
        });
        let message = pg(&self.message);
        let detail = self.detail.as_deref().map(pg);
        let hint = self.hint.as_deref().map(pg);
        drop(self);
        if errstart(pgrx::PgLogLevel::ERROR as _, std::ptr::null()) {
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
        unreachable!("ereport(ERROR) returned")
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
unsafe fn check_emit(args: &[Option<Datum>; 9]) -> Option<Refusal> {
    let plan = prepare_once(
        c"SELECT * FROM outbox.check_emit($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &[
            TEXT,
            TEXT,
            TEXT,
            pg_sys::JSONBOID,
            pg_sys::JSONBOID,
            pg_sys::INT4OID,
            INT8,
            TEXT,
            TEXT,
        ],
    );
    execute(plan, args);
    let text =
        |column: i32| first_value(column).map(|d| String::from_utf8_lossy(bytes(d)).into_owned());
    let refusal = text(1).map(|sqlstate| Refusal {
        sqlstate: sqlstate.as_bytes().try_into().unwrap_or(*b"XX000"),
        message: text(2).unwrap_or_default(),
        detail: text(3).filter(|d| !d.is_empty()),
        hint: text(4).filter(|h| !h.is_empty()),
    });
    pg_sys::SPI_freeplan(plan);
    refusal
}

/// The common case, checked without leaving Rust: every rule of
/// `outbox.check_emit` holds for values that pass here (the converse need
/// not hold; such calls take the PL/pgSQL path).
unsafe fn plainly_valid(args: &[Option<Datum>; 9]) -> bool {
    let [aggregate_type, aggregate_id, event_type, payload, headers, schema_version, expected_seq, key, topic] =
        *args;
    let (Some(at), Some(id), Some(et), Some(payload), Some(version)) = (
        aggregate_type,
        aggregate_id,
        event_type,
        payload,
        schema_version,
    ) else {
        return false;
    };
    if headers.is_some_and(|h| !headers_plainly_valid(h)) {
        return false;
    }
    let at = bytes(at);
    let id = bytes(id);
    let et = bytes(et);
    let p = payload.cast_mut_ptr::<pg_sys::varlena>();
    let payload_ok = !varatt_is_1b_e(p)
        && !varatt_is_4b_c(p)
        && varsize_any(p) <= MAX_PAYLOAD_BYTES.get().max(0) as usize;
    let key_ok = key.is_none_or(|k| (1..=255).contains(&bytes(k).len()));
    let topic_ok = topic.is_none_or(|t| {
        let t = bytes(t);
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
        && expected_seq.is_none_or(|e| e.value() as i64 >= 0)
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
unsafe fn headers_plainly_valid(headers: Datum) -> bool {
    let headers = headers.cast_mut_ptr::<pg_sys::varlena>();
    if varatt_is_1b_e(headers) || varatt_is_4b_c(headers) {
        return false;
    }
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

unsafe fn uuid_datum(bytes: [u8; 16]) -> Datum {
    let ptr = pg_sys::palloc(16) as *mut u8;
    std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, 16);
    Datum::from(ptr)
}

/// Copies a uuid out of SPI's memory, which SPI_finish frees.
unsafe fn copy_uuid(datum: Datum) -> [u8; 16] {
    let mut out = [0u8; 16];
    std::ptr::copy_nonoverlapping(datum.cast_mut_ptr::<u8>(), out.as_mut_ptr(), 16);
    out
}

/// The `(event_id, aggregate_seq, replayed)` row.
unsafe fn result(
    fcinfo: pg_sys::FunctionCallInfo,
    event_id: Option<[u8; 16]>,
    seq: Option<Datum>,
    replayed: bool,
) -> Datum {
    // The row type, blessed once per call site and kept with the function's cache.
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
        event_id.map_or(Datum::from(0), |b| uuid_datum(b)),
        seq.unwrap_or(Datum::from(0)),
        Datum::from(replayed),
    ];
    let mut nulls = [event_id.is_none(), seq.is_none(), false];
    let tuple = pg_sys::heap_form_tuple(tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr());
    pg_sys::HeapTupleHeaderGetDatum((*tuple).t_data)
}
