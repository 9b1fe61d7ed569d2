//! The SQL statements `emit_event` runs through SPI, and their plans.

use super::*;

/// Plans kept for the life of the backend; PostgreSQL revalidates them
/// when the tables change.
#[derive(Clone, Copy)]
pub(super) struct Plans {
    pub(super) claim_key: pg_sys::SPIPlanPtr,
    pub(super) first_for_key: pg_sys::SPIPlanPtr,
    /// The event insert without 0.8.0's aggregate_hash, and with it: each
    /// prepared when first used, since the table has one layout or the other.
    insert: Option<pg_sys::SPIPlanPtr>,
    insert_hashed: Option<pg_sys::SPIPlanPtr>,
}

/// The parameters of the event insert: the columns of [`EVENT_COLUMNS`]
/// that emit_event gives, then aggregate_hash where the table has it.
const INSERT_TYPES: [Oid; 10] = [
    pg_sys::UUIDOID,
    TEXT,
    TEXT,
    INT8,
    TEXT,
    pg_sys::INT4OID,
    pg_sys::JSONBOID,
    pg_sys::JSONBOID,
    TEXT,
    pg_sys::INT4OID,
];

/// The plan of the event insert, with aggregate_hash as its tenth parameter
/// when `hashed`.
pub(super) fn insert_plan(spi: &Spi, hashed: bool) -> pg_sys::SPIPlanPtr {
    let mut plans = plans(spi);
    let kept = if hashed {
        plans.insert_hashed
    } else {
        plans.insert
    };
    if let Some(plan) = kept {
        return plan;
    }
    let plan = if hashed {
        let plan = prepare(
            spi,
            c"INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq,
                                         event_type, schema_version, payload, headers, topic,
                                         aggregate_hash)
              VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            &INSERT_TYPES,
        );
        plans.insert_hashed = Some(plan);
        plan
    } else {
        let plan = prepare(
            spi,
            c"INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_seq,
                                         event_type, schema_version, payload, headers, topic)
              VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            &INSERT_TYPES[..9],
        );
        plans.insert = Some(plan);
        plan
    };
    PLANS.set(Some(plans));
    plan
}

pub(super) static PLANS: BackendCell<Option<Plans>> = BackendCell::new(None);

/// A plan for this call only (SPI_finish frees it). Needs `_spi` open.
pub(super) fn prepare_once(_spi: &Spi, sql: &CStr, types: &[Oid]) -> pg_sys::SPIPlanPtr {
    let mut types = types.to_vec();
    // SAFETY: SPI is connected; the text and types outlive the call.
    let plan = unsafe { pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr()) };
    if plan.is_null() {
        pgrx::error!("pg_outbox: cannot prepare an internal statement");
    }
    plan
}

/// A plan kept past SPI_finish, for the life of the backend.
pub(super) fn prepare(spi: &Spi, sql: &CStr, types: &[Oid]) -> pg_sys::SPIPlanPtr {
    let plan = prepare_once(spi, sql, types);
    // SAFETY: a plan SPI_prepare just made.
    unsafe { pg_sys::SPI_keepplan(plan) };
    plan
}

pub(super) fn plans(spi: &Spi) -> Plans {
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
        insert: None,
        insert_hashed: None,
    };
    PLANS.set(Some(plans));
    plans
}

/// Runs a plan whose parameter types match `args`; the number of rows.
pub(super) fn execute(_spi: &Spi, plan: pg_sys::SPIPlanPtr, args: &[Option<Datum>]) -> u64 {
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
pub(super) fn first_value(_spi: &Spi, column: i32) -> Option<Datum> {
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
