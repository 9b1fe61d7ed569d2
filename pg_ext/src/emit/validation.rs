//! Whether a call is plainly valid, and what `outbox.check_emit` says when
//! it may not be.

use super::*;

/// Runs `outbox.check_emit`, which names the first rule the call breaks.
pub(super) fn check_emit(spi: &Spi, call: &Call) -> Option<Refusal> {
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
pub(super) fn plainly_valid(call: &Call) -> bool {
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
pub(super) const RESERVED_HEADERS: [&[u8]; 6] = [
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
pub(super) fn headers_plainly_valid(headers: Datum) -> bool {
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

/// Whether a name holds only the characters Kafka allows in a topic name.
pub(super) fn topic_safe(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}
