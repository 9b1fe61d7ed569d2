//! Shards: an outbox split among forwarders by the hash of the aggregate,
//! so that forwarding is not bound to one walsender. Every event stores its
//! aggregate's `outbox.aggregate_hash` at emit; shard `I` of `N` is the
//! events whose hash is `I` modulo `N`. Its forwarder streams them through a
//! publication that filters on that (PostgreSQL 15's row filters) and a
//! slot of its own, and has its own transactional id and offsets: an
//! aggregate lives in one shard, so its order holds, and exactly-once holds
//! per shard.

use std::fmt;
use std::str::FromStr;

/// The most shards an outbox is split into.
pub const MAX_SHARDS: u32 = 1024;

/// Shard `index` of `count`, written `index/count` (0-based: `0/2`, `1/2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    /// What the shard's slot and publication add to the names given:
    /// `_0_of_2`. A layout of another count has other names, so its slots
    /// and offsets never mix with this one's.
    pub fn suffix(&self) -> String {
        format!("_{}_of_{}", self.index, self.count)
    }

    /// The row filter of the shard's publication, as PostgreSQL shows it
    /// (`pg_get_expr`) and `outbox.ensure_shard_publication` makes it.
    pub fn row_filter(&self) -> String {
        format!("((aggregate_hash % {}) = {})", self.count, self.index)
    }

    /// A condition on the `outbox.events` row `e` that holds for the
    /// shard's events, those stored before the hash was (0.8.0) included.
    pub fn condition(&self) -> String {
        format!(
            "coalesce(e.aggregate_hash, outbox.aggregate_hash(e.aggregate_type, e.aggregate_id)) % {} = {}",
            self.count, self.index
        )
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl FromStr for Shard {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || {
            format!("{text:?} is not a shard: write INDEX/COUNT, as 0/2 for the first of two (COUNT 1 to {MAX_SHARDS}, INDEX 0 to COUNT-1)")
        };
        let (index, count) = text.split_once('/').ok_or_else(bad)?;
        let index: u32 = index.trim().parse().map_err(|_| bad())?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        if count == 0 || count > MAX_SHARDS || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_reads_as_index_of_count() {
        let shard: Shard = "1/4".parse().expect("a shard");
        assert_eq!(shard, Shard { index: 1, count: 4 });
        assert_eq!(shard.to_string(), "1/4");
        assert_eq!(shard.suffix(), "_1_of_4");
        for bad in ["", "1", "4/4", "0/0", "-1/2", "a/2", "0/1025", "1/2/3"] {
            let err = bad.parse::<Shard>().expect_err("not a shard");
            assert!(err.contains("INDEX/COUNT"), "{bad}: {err}");
        }
    }
}
