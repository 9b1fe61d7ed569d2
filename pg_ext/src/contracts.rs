//! Event contracts: JSON Schemas registered per (aggregate type, event type,
//! schema version) in `outbox.event_schemas`, and what `emit_event`,
//! `emit_events` and `outbox.check_payload` do with them.
//!
//! A backend reads the registered schemas and the checking modes once and
//! compiles a schema the first time a payload meets it. A statement that
//! changes either table fires `outbox.schemas_changed()`, which queues a
//! relcache invalidation of the table; every backend forgets what it read
//! when that invalidation reaches it (at the writer's commit), so the next
//! emit reads the tables again. A database without schemas costs an emit
//! one flag test.

use std::cell::RefCell;
use std::collections::HashMap;

use pgrx::pg_sys::{self, Datum, Oid};
use pgrx::prelude::*;

use crate::refusal::Refusal;
use crate::BackendCell;

/// What happens to a payload that breaks its schema (`outbox.schema_checks`;
/// an aggregate type without a row is checked in `Enforce` mode).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Off,
    Warn,
    Enforce,
}

struct Registered {
    version: i32,
    schema: serde_json::Value,
    /// Compiled on first use; a schema the validator cannot compile was
    /// refused at registration, but one registered by another edition is
    /// reported here rather than trusted.
    compiled: Option<Result<jsonschema::Validator, String>>,
}

#[derive(Default)]
struct Contracts {
    /// By aggregate type, then event type, in version order: looked up by
    /// the call's text without copying it.
    events: HashMap<String, HashMap<String, Vec<Registered>>>,
    modes: HashMap<String, Mode>,
}

/// Whether what this backend read is current: None until read or after an
/// invalidation, Some(false) when no schema is registered (the common case,
/// checked without touching the map).
static LOADED: BackendCell<Option<bool>> = BackendCell::new(None);
/// The two tables, whose relcache invalidations make the backend read again.
static TABLES: BackendCell<[Oid; 2]> = BackendCell::new([pg_sys::InvalidOid; 2]);
static WATCHING: BackendCell<bool> = BackendCell::new(false);

thread_local! {
    static CONTRACTS: RefCell<Contracts> = RefCell::new(Contracts::default());
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn forget_contracts(_arg: Datum, relid: Oid) {
    if relid == pg_sys::InvalidOid || TABLES.get().contains(&relid) {
        LOADED.set(None);
    }
}

/// Reads both tables when this backend has not, or was told they changed.
fn load() -> bool {
    if let Some(any) = LOADED.get() {
        return any;
    }
    if !WATCHING.get() {
        // SAFETY: a callback with the signature relcache callbacks have,
        // registered once per backend.
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget_contracts), Datum::from(0)) };
        WATCHING.set(true);
    }
    // SAFETY: catalog lookups by name; InvalidOid when missing.
    let tables = unsafe {
        let schema = pg_sys::get_namespace_oid(c"outbox".as_ptr(), false);
        [
            pg_sys::get_relname_relid(c"event_schemas".as_ptr(), schema),
            pg_sys::get_relname_relid(c"schema_checks".as_ptr(), schema),
        ]
    };
    if tables.contains(&pg_sys::InvalidOid) {
        pgrx::error!(
            "pg_outbox: its schema tables are missing; run ALTER EXTENSION pg_outbox UPDATE"
        );
    }
    TABLES.set(tables);
    let mut contracts = Contracts::default();
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT aggregate_type::pg_catalog.text, event_type::pg_catalog.text, schema_version, schema \
               FROM outbox.event_schemas ORDER BY 1, 2, 3",
            None,
            &[],
        )?;
        for row in rows {
            let (Some(aggregate_type), Some(event_type), Some(version), Some(schema)) = (
                row.get::<String>(1)?,
                row.get::<String>(2)?,
                row.get::<i32>(3)?,
                row.get::<pgrx::JsonB>(4)?,
            ) else {
                continue;
            };
            contracts
                .events
                .entry(aggregate_type)
                .or_default()
                .entry(event_type)
                .or_default()
                .push(Registered {
                    version,
                    schema: schema.0,
                    compiled: None,
                });
        }
        let rows = client.select(
            "SELECT aggregate_type::pg_catalog.text, mode FROM outbox.schema_checks",
            None,
            &[],
        )?;
        for row in rows {
            if let (Some(aggregate_type), Some(mode)) =
                (row.get::<String>(1)?, row.get::<String>(2)?)
            {
                let mode = match mode.as_str() {
                    "off" => Mode::Off,
                    "warn" => Mode::Warn,
                    _ => Mode::Enforce,
                };
                contracts.modes.insert(aggregate_type, mode);
            }
        }
        Ok::<_, pgrx::spi::SpiError>(())
    })
    .unwrap_or_else(|e| pgrx::error!("pg_outbox: could not read the registered schemas: {e}"));
    let any = !contracts.events.is_empty();
    CONTRACTS.with(|c| *c.borrow_mut() = contracts);
    LOADED.set(Some(any));
    any
}

/// The schema's compiled form, or why it has none.
pub(crate) fn compile(schema: &serde_json::Value) -> Result<jsonschema::Validator, String> {
    jsonschema::validator_for(schema).map_err(|e| {
        let at = e.instance_path().as_str();
        if at.is_empty() {
            e.to_string()
        } else {
            format!("at {at}: {e}")
        }
    })
}

/// A payload checked against its schema: Ok when it matches, has no schema
/// to match, or its aggregate type is not checked; a warning is raised here
/// in `warn` mode; a refusal to raise in `enforce` mode.
///
/// # Safety
/// The datums are the text and jsonb arguments of the caller's call.
pub(crate) unsafe fn check(
    aggregate_type: Datum,
    event_type: Datum,
    version: i32,
    payload: Option<Datum>,
) -> Result<(), Refusal> {
    if !load() {
        return Ok(());
    }
    // SAFETY: text datums of the caller's call, as the contract says.
    let (aggregate_type, event_type) = unsafe {
        (
            String::from_utf8_lossy(crate::datum::bytes(aggregate_type)),
            String::from_utf8_lossy(crate::datum::bytes(event_type)),
        )
    };
    let problem = CONTRACTS.with(|contracts| {
        let mut contracts = contracts.borrow_mut();
        let mode = contracts
            .modes
            .get(aggregate_type.as_ref())
            .copied()
            .unwrap_or(Mode::Enforce);
        if mode == Mode::Off {
            return None;
        }
        let versions = contracts
            .events
            .get_mut(aggregate_type.as_ref())?
            .get_mut(event_type.as_ref())?;
        let Some(registered) = versions.iter_mut().find(|r| r.version == version) else {
            let known: Vec<String> = versions.iter().map(|r| r.version.to_string()).collect();
            return Some((
                mode,
                Refusal::unregistered_version(&aggregate_type, &event_type, version, &known),
            ));
        };
        let schema = &registered.schema;
        let validator = registered.compiled.get_or_insert_with(|| compile(schema));
        let validator = match validator {
            Ok(validator) => validator,
            Err(reason) => {
                return Some((mode, Refusal::schema_not_valid(reason)));
            }
        };
        // SAFETY: the jsonb argument of the caller's call.
        let payload =
            payload.and_then(|p| unsafe { <pgrx::JsonB as FromDatum>::from_datum(p, false) });
        let payload = payload.map_or(serde_json::Value::Null, |p| p.0);
        let error = validator.validate(&payload).err()?;
        Some((
            mode,
            Refusal::payload_breaks_schema(
                &aggregate_type,
                &event_type,
                version,
                error.instance_path().as_str(),
                error.kind().keyword(),
                error.schema_path().as_str(),
                &error.to_string(),
            ),
        ))
    });
    match problem {
        None => Ok(()),
        Some((Mode::Enforce, refusal)) => Err(refusal),
        Some((_, refusal)) => {
            refusal.warn();
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------
// The C functions of the schema API

#[no_mangle]
pub extern "C" fn pg_finfo_check_payload() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `outbox.check_payload(aggregate_type, event_type, schema_version,
/// payload)`: what `emit_event` checks against the registered schema, on
/// its own (`emit_events` calls it per event). Returns nothing; raises
/// PO020/PO021 in `enforce` mode, warns in `warn` mode.
///
/// # Safety
/// Called by PostgreSQL through the function manager with the argument
/// types of its SQL declaration (text, text, integer, jsonb; STRICT).
#[no_mangle]
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn check_payload(fcinfo: pg_sys::FunctionCallInfo) -> Datum {
    // SAFETY: four non-NULL arguments (the function is STRICT).
    let outcome = unsafe {
        let arg = |n| pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n);
        check(arg(0), arg(1), arg(2).value() as i32, Some(arg(3)))
    };
    match outcome {
        Ok(()) => pgrx::fcinfo::pg_return_void(),
        Err(refusal) => refusal.raise(),
    }
}

#[no_mangle]
pub extern "C" fn pg_finfo_schema_problem() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `outbox.schema_problem(schema jsonb) RETURNS text`: why the validator
/// cannot use the schema, or NULL when it can (`register_schema` refuses a
/// schema with a problem).
///
/// # Safety
/// Called by PostgreSQL through the function manager with one jsonb
/// argument (STRICT).
#[no_mangle]
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn schema_problem(fcinfo: pg_sys::FunctionCallInfo) -> Datum {
    // SAFETY: one non-NULL jsonb argument (the function is STRICT).
    let schema = unsafe {
        <pgrx::JsonB as FromDatum>::from_datum(pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, 0), false)
    };
    let problem = match schema {
        Some(schema) => compile(&schema.0).err(),
        None => Some("the schema is NULL".to_owned()),
    };
    match problem {
        // SAFETY: a text made in the caller's memory context.
        Some(problem) => problem
            .into_datum()
            .unwrap_or_else(|| unsafe { pgrx::fcinfo::pg_return_null(fcinfo) }),
        // SAFETY: the function's own call.
        None => unsafe { pgrx::fcinfo::pg_return_null(fcinfo) },
    }
}

#[no_mangle]
pub extern "C" fn pg_finfo_schemas_changed() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `outbox.schemas_changed()`, the statement trigger on both tables: queues
/// an invalidation of the table, which every backend receives when the
/// transaction commits (this one at once).
///
/// # Safety
/// Called by PostgreSQL as a trigger function.
#[no_mangle]
#[pgrx::pg_guard]
pub unsafe extern "C-unwind" fn schemas_changed(fcinfo: pg_sys::FunctionCallInfo) -> Datum {
    // SAFETY: a trigger call carries its TriggerData in the context.
    unsafe {
        let context = (*fcinfo).context;
        if context.is_null() || (*context).type_ != pg_sys::NodeTag::T_TriggerData {
            pgrx::error!("pg_outbox: schemas_changed() is a trigger function");
        }
        let data = context.cast::<pg_sys::TriggerData>();
        pg_sys::CacheInvalidateRelcacheByRelid((*(*data).tg_relation).rd_id);
    }
    // A statement trigger returns a null pointer (not an SQL NULL).
    Datum::from(0)
}
