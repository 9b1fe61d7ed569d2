//! Errors raised with a SQLSTATE of their own, a message, a detail and a hint.

use pgrx::pg_sys;

/// An error to raise with its own SQLSTATE. (Raised through pgrx, a
/// SQLSTATE that PostgreSQL does not define would become XX000.)
pub(crate) struct Refusal {
    pub(crate) sqlstate: [u8; 5],
    pub(crate) message: String,
    pub(crate) detail: Option<String>,
    pub(crate) hint: Option<String>,
}

impl Refusal {
    pub(crate) fn sequence_conflict(
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

    pub(crate) fn report(self, level: std::ffi::c_int) {
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
pub(crate) fn quote_literal(text: &str) -> String {
    let quoted = text.replace('\'', "''");
    if quoted.contains('\\') {
        format!("E'{}'", quoted.replace('\\', "\\\\"))
    } else {
        format!("'{quoted}'")
    }
}
