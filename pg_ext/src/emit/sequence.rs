//! The sequence: the aggregate's lock and its newest sequence, read
//! straight from the unique key of `outbox.events`.

use super::*;

/// The aggregate's lock, held until the end of the transaction.
pub(super) fn lock(aggregate_type: Datum, aggregate_id: Datum) {
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
pub(super) fn read_latest(aggregate_type: Datum, aggregate_id: Datum) -> i64 {
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
pub(super) struct Keyed {
    pub(super) table: Oid,
    pub(super) index: Oid,
    pub(super) column: pg_sys::AttrNumber,
}

/// The OIDs emit_event reads through, looked up once per backend and
/// forgotten when one of the relations changes (a relcache invalidation),
/// so that a dropped and recreated extension is found again.
#[derive(Clone, Copy)]
pub(super) struct Catalog {
    pub(super) events: Keyed,
    pub(super) floors: Keyed,
    /// False when the floors table is empty, as it is unless the extension
    /// was upgraded from 0.2.0: only that upgrade writes it.
    pub(super) floors_in_use: bool,
    /// Whether the events table has `aggregate_hash` (0.8.0 on): before
    /// `ALTER EXTENSION pg_outbox UPDATE` it may not yet.
    pub(super) hashed: bool,
}

pub(super) static CATALOG: BackendCell<Option<Catalog>> = BackendCell::new(None);
pub(super) static WATCHING: BackendCell<bool> = BackendCell::new(false);

pub(super) fn catalog() -> Catalog {
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
    // SAFETY: a catalog lookup by name; 0 or less when the column is missing.
    let hashed = unsafe { pg_sys::get_attnum(events.table, c"aggregate_hash".as_ptr()) } > 0;
    let catalog = Catalog {
        events,
        floors,
        floors_in_use,
        hashed,
    };
    CATALOG.set(Some(catalog));
    catalog
}

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn forget_catalog(_arg: Datum, relid: Oid) {
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
pub(super) fn newest_value(
    keyed: Keyed,
    mode: u32,
    aggregate_type: Datum,
    aggregate_id: Datum,
) -> Option<i64> {
    // Dropped in the reverse order: scan, snapshot, index, heap.
    let heap = Opened::table(keyed.table, mode);
    let index = Opened::index(keyed.index, mode);
    let (in_index, keys) = aggregate_keys(&index, keyed.column, aggregate_type, aggregate_id);
    let snapshot = LatestSnapshot::take();
    let scan = backward_scan(&heap, &index, &snapshot, keys, in_index.is_some());
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

/// The scan keys that select one aggregate's entries of `index`
/// (aggregate_type, aggregate_id), and the position of `column` among the
/// index's key columns, if the index holds it.
fn aggregate_keys(
    index: &Opened,
    column: pg_sys::AttrNumber,
    aggregate_type: Datum,
    aggregate_id: Datum,
) -> (Option<i32>, [pg_sys::ScanKeyData; 2]) {
    // SAFETY: the index is open; its pg_index row and collations are part
    // of its relcache entry.
    unsafe {
        let form = &*(*index.relation).rd_index;
        let key_columns = form.indkey.values.as_slice(form.indnkeyatts as usize);
        let in_index = key_columns
            .iter()
            .position(|&key_column| key_column == column)
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
    }
}

/// An index scan of `heap` through `index` under `snapshot`, positioned by
/// `keys`, to be read newest first; with `want_itup` it returns the index
/// entries themselves too.
fn backward_scan(
    heap: &Opened,
    index: &Opened,
    snapshot: &LatestSnapshot,
    mut keys: [pg_sys::ScanKeyData; 2],
    want_itup: bool,
) -> IndexScan {
    // SAFETY: both relations are open and the snapshot registered; the
    // scan keys are copied by index_rescan.
    unsafe {
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
        (*scan.0).xs_want_itup = want_itup;
        pg_sys::index_rescan(scan.0, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        scan
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
