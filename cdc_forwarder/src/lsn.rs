//! PostgreSQL log sequence numbers, printed and parsed as `X/Y`.

use std::fmt;
use std::str::FromStr;

/// A position in the PostgreSQL write-ahead log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text was not an LSN of the form `16/B374D848`.
#[derive(Debug, thiserror::Error)]
#[error("invalid LSN {0:?}: expected two hexadecimal numbers separated by '/', like 16/B374D848")]
pub struct ParseLsnError(String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_owned());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_round_trips() {
        for text in ["0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF"] {
            let lsn: Lsn = text.parse().expect("valid");
            assert_eq!(lsn.to_string(), text);
        }
        assert_eq!("1/0".parse::<Lsn>().expect("valid"), Lsn(1 << 32));
    }

    #[test]
    fn malformed_text_is_refused() {
        for text in ["", "16", "16/", "/1", "G/1", "1/2/3", "100000000/0"] {
            assert!(text.parse::<Lsn>().is_err(), "{text:?} parsed");
        }
    }
}
