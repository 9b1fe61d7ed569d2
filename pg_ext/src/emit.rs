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
use pgrx::varlena::{varatt_is_1b_e, varatt_is_4b_c, varsize_any};

use crate::datum::{bytes, copy_uuid, uuid_datum};
use crate::refusal::Refusal;
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
/// nine are the values of the insert, the next two are filled as their
/// defaults (`clock_timestamp()`, `pg_current_xact_id()`) would, and the
/// last, added in 0.8.0, is the aggregate's hash.
const EVENT_COLUMNS: [(&CStr, Oid); 12] = [
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
    (c"aggregate_hash", pg_sys::INT4OID),
];

mod guards;
pub(crate) mod insert;
mod plans;
mod sequence;
mod validation;

use guards::*;
use insert::*;
use plans::*;
use sequence::*;
use validation::*;

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
    let hashed = catalog().hashed;
    // SAFETY: both are text datums of this call.
    let hash =
        hashed.then(|| unsafe { crate::aggregate_hash::of_text(aggregate_type, aggregate_id) });
    if !(DIRECT_INSERT.get() && insert_direct(&row, hash)) {
        spi.connect();
        let mut args = [None; 10];
        args[..9].copy_from_slice(&row);
        args[9] = hash.map(Datum::from);
        let args = if hashed { &args[..] } else { &args[..9] };
        execute(&spi, insert_plan(&spi, hashed), args);
    }
    spi.finish();
    Ok(result(
        fcinfo,
        Some(id_bytes),
        Some(Datum::from(seq)),
        false,
    ))
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
