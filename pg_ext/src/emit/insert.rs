//! The executor-free insert of the event row, while `outbox.events` is the
//! table the extension made.

use super::*;

/// Inserts the event row the way the executor's INSERT would, without
/// starting an executor: the heap insert (WAL-logged for logical decoding
/// like any other), then an insert into every index, unique ones checked.
/// Only while `outbox.events` is exactly the table the extension created,
/// give or take plain indexes: its known columns, no insert triggers,
/// rules, CHECK constraints or generated columns, and indexes on plain
/// columns only. Otherwise it writes nothing and returns false, and the
/// caller runs the SQL INSERT, which handles whatever was added.
///
/// It stays while `bench/emit.sh --direct-insert`, which runs emit_event
/// with and without it (`pg_outbox.direct_insert`) in the same rounds,
/// measures it at 1.03 or more (docs/src/benchmarks.md has the figure).
///
/// `hash` is the aggregate's hash, where the table has the column (0.8.0
/// on); the table without it is the layout of the releases before.
pub(super) fn insert_direct(row: &[Option<Datum>; 9], hash: Option<i32>) -> bool {
    let rel = Opened::table(catalog().events.table, pg_sys::RowExclusiveLock);
    let columns = columns(hash.is_some());
    if !plain_table(&rel, columns) {
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
    if let Some(hash) = hash {
        values[11] = Datum::from(hash);
    }
    // SAFETY: the relation is open; plain_table checked that its
    // descriptor has the EVENT_COLUMNS, which values and nulls fill.
    unsafe {
        let desc = (*rel.relation).rd_att;
        let attrs = attributes(desc, columns.len());
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
    plain_table(&rel, columns(catalog().hashed)) && open_plain_indexes(&rel).is_some()
}

/// The columns of the events table: all of [`EVENT_COLUMNS`], or without
/// the last (aggregate_hash), as before 0.8.0.
fn columns(hashed: bool) -> &'static [(&'static CStr, Oid)] {
    if hashed {
        &EVENT_COLUMNS
    } else {
        &EVENT_COLUMNS[..EVENT_COLUMNS.len() - 1]
    }
}

/// Whether the table is the plain events table of exactly `columns`.
pub(super) fn plain_table(rel: &Opened, columns: &[(&CStr, Oid)]) -> bool {
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
            && attrs.len() == columns.len()
            && attrs.iter().zip(columns).all(|(a, &(name, type_))| {
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
pub(super) unsafe fn attributes<'a>(
    desc: pg_sys::TupleDesc,
    n: usize,
) -> &'a [pg_sys::FormData_pg_attribute] {
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
pub(super) struct OpenIndexes {
    pub(super) open: [(pg_sys::Relation, *mut pg_sys::IndexInfo); 8],
    pub(super) len: usize,
}

impl OpenIndexes {
    pub(super) fn iter(&self) -> impl Iterator<Item = &(pg_sys::Relation, *mut pg_sys::IndexInfo)> {
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
pub(super) fn open_plain_indexes(rel: &Opened) -> Option<OpenIndexes> {
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
