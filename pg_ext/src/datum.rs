//! Datums as Rust values: the bytes of a text, a uuid.

use pgrx::pg_sys::{self, Datum};
use pgrx::varlena::{vardata_any, varsize_any_exhdr};

/// The bytes of a text datum.
///
/// # Safety
/// `text` is a text (varlena) datum that lives as long as `'a`.
pub(crate) unsafe fn bytes<'a>(text: Datum) -> &'a [u8] {
    // SAFETY: a varlena, detoasted if need be (a copy in the current memory
    // context, which outlives the call).
    unsafe {
        let v = pg_sys::pg_detoast_datum_packed(text.cast_mut_ptr());
        std::slice::from_raw_parts(vardata_any(v) as *const u8, varsize_any_exhdr(v))
    }
}

pub(crate) fn uuid_datum(bytes: [u8; 16]) -> Datum {
    // SAFETY: 16 bytes allocated in the current memory context and filled.
    unsafe {
        let ptr = pg_sys::palloc(16) as *mut u8;
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, 16);
        Datum::from(ptr)
    }
}

/// Copies a uuid out of SPI's memory, which SPI_finish frees.
///
/// # Safety
/// `datum` is a uuid datum.
pub(crate) unsafe fn copy_uuid(datum: Datum) -> [u8; 16] {
    let mut out = [0u8; 16];
    // SAFETY: a uuid is 16 bytes by reference.
    unsafe { std::ptr::copy_nonoverlapping(datum.cast_mut_ptr::<u8>(), out.as_mut_ptr(), 16) };
    out
}
