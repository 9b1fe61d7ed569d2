//! Decoder for the logical replication messages of the `pgoutput` plugin
//! (protocol version 1, text tuple format).
//!
//! Only what an insert-only publication produces is decoded into values:
//! Relation, Insert, Begin and Commit. Everything else is reported as
//! [`Message::Other`] with its tag so the caller can decide to ignore it.

use bytes::{Buf, Bytes};

use crate::lsn::Lsn;

/// One column of a relation as announced by a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub type_oid: u32,
}

/// A Relation message: the shape of the tuples that follow for `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<Column>,
}

/// A decoded pgoutput message.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Begin {
        final_lsn: Lsn,
        commit_time_micros: i64,
        xid: u32,
    },
    Commit {
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_time_micros: i64,
    },
    Relation(Relation),
    /// A new row: one value per column, `None` for NULL, text form otherwise.
    Insert {
        relation_id: u32,
        values: Vec<Option<Bytes>>,
    },
    /// Any other message type (Type, Origin, Update, Delete, Truncate, ...).
    Other(u8),
}

/// The bytes were not a well-formed pgoutput message.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("pgoutput message is truncated (tag {tag:?})")]
    Truncated { tag: char },
    #[error("pgoutput message is empty")]
    Empty,
    #[error("pgoutput string is not NUL-terminated UTF-8")]
    BadString,
    #[error("pgoutput insert has tuple marker {0:?}, expected 'N'")]
    BadTupleMarker(char),
    #[error("pgoutput tuple column has kind {0:?}; only text and NULL values are expected")]
    UnsupportedValueKind(char),
}

/// Decodes one pgoutput message.
pub fn decode(mut buf: Bytes) -> Result<Message, DecodeError> {
    if buf.is_empty() {
        return Err(DecodeError::Empty);
    }
    let tag = buf.get_u8();
    let truncated = DecodeError::Truncated { tag: tag as char };
    let mut r = Reader { buf, truncated };
    match tag {
        b'B' => Ok(Message::Begin {
            final_lsn: Lsn(r.u64()?),
            commit_time_micros: r.i64()?,
            xid: r.u32()?,
        }),
        b'C' => {
            let _flags = r.u8()?;
            Ok(Message::Commit {
                commit_lsn: Lsn(r.u64()?),
                end_lsn: Lsn(r.u64()?),
                commit_time_micros: r.i64()?,
            })
        }
        b'R' => {
            let id = r.u32()?;
            let namespace = r.string()?;
            let name = r.string()?;
            let _replica_identity = r.u8()?;
            let ncols = r.u16()?;
            let mut columns = Vec::with_capacity(usize::from(ncols));
            for _ in 0..ncols {
                let _flags = r.u8()?;
                let name = r.string()?;
                let type_oid = r.u32()?;
                let _typmod = r.i32()?;
                columns.push(Column { name, type_oid });
            }
            Ok(Message::Relation(Relation {
                id,
                namespace,
                name,
                columns,
            }))
        }
        b'I' => {
            let relation_id = r.u32()?;
            let marker = r.u8()?;
            if marker != b'N' {
                return Err(DecodeError::BadTupleMarker(marker as char));
            }
            let ncols = r.u16()?;
            let mut values = Vec::with_capacity(usize::from(ncols));
            for _ in 0..ncols {
                match r.u8()? {
                    b'n' => values.push(None),
                    b't' => {
                        let len = r.u32()? as usize;
                        values.push(Some(r.bytes(len)?));
                    }
                    other => return Err(DecodeError::UnsupportedValueKind(other as char)),
                }
            }
            Ok(Message::Insert {
                relation_id,
                values,
            })
        }
        other => Ok(Message::Other(other)),
    }
}

struct Reader {
    buf: Bytes,
    truncated: DecodeError,
}

impl Reader {
    fn need(&self, n: usize) -> Result<(), DecodeError> {
        if self.buf.remaining() < n {
            Err(self.truncated.clone())
        } else {
            Ok(())
        }
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.need(2)?;
        Ok(self.buf.get_u16())
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.need(4)?;
        Ok(self.buf.get_u32())
    }
    fn i32(&mut self) -> Result<i32, DecodeError> {
        self.need(4)?;
        Ok(self.buf.get_i32())
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.need(8)?;
        Ok(self.buf.get_u64())
    }
    fn i64(&mut self) -> Result<i64, DecodeError> {
        self.need(8)?;
        Ok(self.buf.get_i64())
    }
    fn bytes(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        self.need(n)?;
        Ok(self.buf.split_to(n))
    }
    fn string(&mut self) -> Result<String, DecodeError> {
        let end = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::BadString)?;
        let s = self.buf.split_to(end);
        self.buf.advance(1);
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::BadString)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    fn relation_bytes() -> Bytes {
        let mut b = bytes::BytesMut::new();
        b.put_u8(b'R');
        b.put_u32(16384);
        b.put_slice(b"outbox\0events\0");
        b.put_u8(b'd');
        b.put_u16(2);
        for (name, oid) in [("event_id", 2950u32), ("payload", 3802)] {
            b.put_u8(0);
            b.put_slice(name.as_bytes());
            b.put_u8(0);
            b.put_u32(oid);
            b.put_i32(-1);
        }
        b.freeze()
    }

    #[test]
    fn relation_names_its_columns() {
        let Message::Relation(rel) = decode(relation_bytes()).expect("decodes") else {
            panic!("not a relation");
        };
        assert_eq!(rel.id, 16384);
        assert_eq!(
            (rel.namespace.as_str(), rel.name.as_str()),
            ("outbox", "events")
        );
        let names: Vec<_> = rel.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["event_id", "payload"]);
    }

    #[test]
    fn insert_carries_text_and_null_values() {
        let mut b = bytes::BytesMut::new();
        b.put_u8(b'I');
        b.put_u32(16384);
        b.put_u8(b'N');
        b.put_u16(2);
        b.put_u8(b't');
        b.put_u32(3);
        b.put_slice(b"abc");
        b.put_u8(b'n');
        let msg = decode(b.freeze()).expect("decodes");
        assert_eq!(
            msg,
            Message::Insert {
                relation_id: 16384,
                values: vec![Some(Bytes::from_static(b"abc")), None],
            }
        );
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = relation_bytes();
        for len in 1..full.len() {
            assert!(
                decode(full.slice(..len)).is_err(),
                "prefix of {len} bytes decoded"
            );
        }
        assert_eq!(decode(Bytes::new()), Err(DecodeError::Empty));
    }

    #[test]
    fn commit_positions_are_read_in_order() {
        let mut b = bytes::BytesMut::new();
        b.put_u8(b'C');
        b.put_u8(0);
        b.put_u64(0x10);
        b.put_u64(0x20);
        b.put_i64(7);
        assert_eq!(
            decode(b.freeze()).expect("decodes"),
            Message::Commit {
                commit_lsn: Lsn(0x10),
                end_lsn: Lsn(0x20),
                commit_time_micros: 7
            }
        );
    }
}
