//! What arrived compared with what committed: lost, duplicates, order,
//! phantoms.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::{committed_events, Reader, Record, TestDb};

/// What arrived compared with what committed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub committed: usize,
    pub received: usize,
    pub lost: usize,
    pub duplicates: usize,
    pub phantoms: usize,
    pub order_violations: usize,
}

impl Verdict {
    /// Every committed event delivered once, in order per aggregate, and
    /// nothing of a rolled-back transaction.
    pub fn assert_exactly_once(&self) {
        assert_eq!(
            (
                self.lost,
                self.duplicates,
                self.order_violations,
                self.phantoms
            ),
            (0, 0, 0, 0),
            "{self:?}"
        );
    }
}

/// Compares the records with the committed events: loss, duplicates,
/// phantoms, and per-key order (offset order must follow sequence order, the
/// first arrival of each sequence counted).
pub fn verdict(committed: &[(String, String, i64)], records: &[Record]) -> Verdict {
    use std::collections::{HashMap, HashSet};
    let known: HashSet<&str> = committed.iter().map(|e| e.0.as_str()).collect();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for r in records {
        *seen.entry(r.event_id()).or_default() += 1;
    }
    // (partition, offset, sequence) of each record, per topic and key.
    type Arrivals = Vec<(i32, i64, i64)>;
    let mut by_key: BTreeMap<(&str, &str), Arrivals> = BTreeMap::new();
    for r in records {
        by_key
            .entry((r.topic.as_str(), r.key.as_str()))
            .or_default()
            .push((r.partition, r.offset, r.seq()));
    }
    let mut order_violations = 0;
    for (_, mut list) in by_key {
        list.sort();
        let mut highest = 0;
        for (_, _, seq) in list {
            if seq <= highest {
                // A replay may repeat earlier sequences; a new one must be next.
                continue;
            }
            if seq != highest + 1 {
                order_violations += 1;
            }
            highest = seq;
        }
    }
    Verdict {
        committed: committed.len(),
        received: records.len(),
        lost: committed
            .iter()
            .filter(|e| !seen.contains_key(e.0.as_str()))
            .count(),
        duplicates: seen.values().map(|n| n - 1).sum(),
        phantoms: seen.keys().filter(|id| !known.contains(*id)).count(),
        order_violations,
    }
}

/// Reads until every event committed in `db` has arrived, then on to the end
/// of `topic` so that late duplicates are counted too, and compares.
pub async fn read_every_committed(
    db: &TestDb,
    reader: &mut Reader,
    topic: &str,
    timeout: Duration,
) -> Verdict {
    let committed = committed_events(&db.admin().await).await;
    let ids: std::collections::HashSet<&str> = committed.iter().map(|e| e.0.as_str()).collect();
    reader
        .read_until(timeout, "every committed event", |records| {
            let seen: std::collections::HashSet<&str> =
                records.iter().map(|r| r.event_id()).collect();
            ids.iter().all(|id| seen.contains(id))
        })
        .await;
    reader.read_to_end(&[topic], timeout).await;
    verdict(&committed, &reader.records)
}
