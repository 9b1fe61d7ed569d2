//! What `emit_event` borrows from PostgreSQL for the length of a call, each
//! held by a guard that gives it back on drop (see the module above).

use super::*;

/// A relation opened for this call, closed on drop; its lock is kept until
/// the end of the transaction, as the executor keeps it.
pub(super) struct Opened {
    pub(super) relation: pg_sys::Relation,
    pub(super) index: bool,
}

impl Opened {
    pub(super) fn table(oid: Oid, mode: u32) -> Opened {
        Opened {
            // SAFETY: raises an ERROR, rather than returning, when the
            // relation is gone; the result is a valid relcache entry.
            relation: unsafe { pg_sys::table_open(oid, mode as _) },
            index: false,
        }
    }

    pub(super) fn index(oid: Oid, mode: u32) -> Opened {
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
pub(super) struct LatestSnapshot(pub(super) pg_sys::Snapshot);

impl LatestSnapshot {
    pub(super) fn take() -> LatestSnapshot {
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
pub(super) struct IndexScan(pub(super) pg_sys::IndexScanDesc);

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
pub(super) struct VisibilityMapPin(pub(super) pg_sys::Buffer);

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
pub(super) struct Slot(pub(super) *mut pg_sys::TupleTableSlot);

impl Slot {
    pub(super) fn for_table(table: &Opened) -> Slot {
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
pub(super) struct Spi {
    pub(super) guc_level: Option<std::ffi::c_int>,
}

impl Spi {
    pub(super) fn connect(&mut self) {
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
    pub(super) fn finish(&mut self) {
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
