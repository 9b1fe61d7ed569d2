//! The aggregate's hash that shards split on, as `outbox.aggregate_hash`
//! defines it in SQL: the first 31 bits of the SHA-256 of the type and the
//! id in UTF-8, joined by a zero byte. Computed here for the executor-free
//! insert, which runs no SQL; a test holds the two to the same values.

use pgrx::pg_sys::{self, Datum};
use sha2::{Digest, Sha256};

use crate::datum::bytes;

/// The hash of an aggregate whose type and id are UTF-8.
pub(crate) fn of_utf8(aggregate_type: &[u8], aggregate_id: &[u8]) -> i32 {
    let digest = Sha256::new()
        .chain_update(aggregate_type)
        .chain_update([0])
        .chain_update(aggregate_id)
        .finalize();
    let first = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    (first & 0x7fff_ffff) as i32
}

/// The hash of an aggregate given as two text datums in the database's
/// encoding.
///
/// # Safety
/// Both are text datums that live for the call.
pub(crate) unsafe fn of_text(aggregate_type: Datum, aggregate_id: Datum) -> i32 {
    // SAFETY: as the caller promises.
    let (aggregate_type, aggregate_id) = unsafe { (utf8(aggregate_type), utf8(aggregate_id)) };
    of_utf8(aggregate_type, aggregate_id)
}

/// The bytes of a text datum in UTF-8: as stored in a UTF-8 (or SQL_ASCII)
/// database, converted in any other.
///
/// # Safety
/// `text` is a text datum that lives for the call.
unsafe fn utf8<'a>(text: Datum) -> &'a [u8] {
    // SAFETY: a text datum; the conversion returns its input when there is
    // nothing to convert, else a NUL-terminated copy in the current memory
    // context.
    unsafe {
        let stored = bytes(text);
        let converted = pg_sys::pg_server_to_any(
            stored.as_ptr().cast(),
            stored.len() as i32,
            pg_sys::pg_enc::PG_UTF8 as i32,
        );
        if converted.cast_const() == stored.as_ptr().cast() {
            stored
        } else {
            std::ffi::CStr::from_ptr(converted).to_bytes()
        }
    }
}

#[cfg(test)]
mod unit {
    #[test]
    fn known_values() {
        // printf 'order\0o-1' | sha256sum: abf2e178...
        assert_eq!(super::of_utf8(b"order", b"o-1"), 0x2bf2_e178);
        assert!(super::of_utf8(b"a", b"bc") != super::of_utf8(b"ab", b"c"));
    }
}
