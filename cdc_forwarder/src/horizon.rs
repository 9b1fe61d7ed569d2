//! Which PostgreSQL transactions Kafka holds, in transaction ids: what lets
//! an exactly-once forwarder whose slot is gone (dropped, invalidated, or
//! missing on a promoted 15/16 standby) deliver the stored events Kafka
//! lacks, and none that it has.
//!
//! A slot position says "every transaction that committed before LSN K";
//! once the slot is gone nothing maps an event row to its commit LSN. So the
//! transactional sink also writes, in each offset record, a [`Horizon`]: a
//! snapshot every transaction visible in which is in Kafka, and the ids of
//! the transactions in Kafka that it does not show. Both are checked against
//! `outbox.events.txid` by the catch-up on a new slot.
//!
//! The snapshot comes from a [`Mark`]: `pg_current_snapshot()` and then
//! `pg_current_wal_insert_lsn()`. A transaction visible in the snapshot has
//! its commit record before that LSN, so once the delivered position passes
//! it the mark may become the base, keeping only the listed ids that it
//! does not show: the list holds roughly the transactions of one tick.
//!
//! Without a horizon to start from (a record of an older forwarder, or a
//! list that outgrew [`MAX_RUNS`]), the ids listed from now on are not
//! enough: a transaction delivered earlier may not be visible yet in the
//! next snapshot (its commit record is written before it becomes visible,
//! as while it waits for a synchronous standby). Such a transaction is in
//! progress in that snapshot, the floor. A later mark whose snapshot has
//! none of the floor's transactions in progress shows all of them, and
//! becomes the base.

use std::collections::VecDeque;
use std::fmt;

use crate::error::{Error, Result};
use crate::lsn::Lsn;

/// Runs of ids listed at most (a record of about 1 MB); past it the horizon
/// starts again from a floor.
pub const MAX_RUNS: usize = 50_000;
/// Marks waiting for the delivered position to pass them, at most.
const MAX_CANDIDATES: usize = 16;

/// A `pg_snapshot` (`xmin:xmax:xip,...`), 64-bit transaction ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmin: u64,
    pub xmax: u64,
    /// In progress when it was taken; sorted.
    pub xip: Vec<u64>,
}

impl Snapshot {
    /// Whether a transaction that committed is visible in the snapshot
    /// (`pg_visible_in_snapshot`).
    pub fn shows(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && self.xip.binary_search(&xid).is_err())
    }

    /// The full id of a transaction known by its 32-bit id (as pgoutput
    /// sends it), if it is at or after `xmin`; earlier ones are shown.
    fn widen(&self, xid: u32) -> Option<u64> {
        let ahead = xid.wrapping_sub(self.xmin as u32);
        (ahead < 1 << 31).then(|| self.xmin + u64::from(ahead))
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, xid) in self.xip.iter().enumerate() {
            write!(f, "{}{xid}", if i == 0 { "" } else { "," })?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Snapshot {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("not a pg_snapshot: {text:?}");
        let mut parts = text.splitn(3, ':');
        let mut number =
            || -> Result<u64, String> { parts.next().ok_or_else(bad)?.parse().map_err(|_| bad()) };
        let (xmin, xmax) = (number()?, number()?);
        let mut xip = Vec::new();
        for xid in text.splitn(3, ':').nth(2).ok_or_else(bad)?.split(',') {
            if !xid.is_empty() {
                xip.push(xid.parse().map_err(|_| bad())?);
            }
        }
        xip.sort_unstable();
        Ok(Snapshot { xmin, xmax, xip })
    }
}

/// A snapshot and the WAL insert position read right after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub snapshot: Snapshot,
    pub lsn: Lsn,
    /// A slot's exported snapshot at its consistent point `lsn`: it shows
    /// exactly the transactions that committed before `lsn`.
    pub exact: bool,
    /// The server history it was taken on: [`ORIGIN_SQL`].
    pub origin: String,
}

/// The system identifier and the timeline, `system/timeline`. Transaction
/// ids mean the same only within one history: a promoted standby that had
/// not received the old primary's last WAL gives those ids out again, and a
/// restore or a copy is another history. A horizon is used only where it
/// was recorded.
pub const ORIGIN_SQL: &str = "(SELECT system_identifier FROM pg_control_system())::text \
     || '/' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8)";

/// Transaction ids as sorted, disjoint, non-adjacent inclusive runs: the
/// transactions of a backlog drain are mostly consecutive ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runs(Vec<(u64, u64)>);

impl Runs {
    pub fn contains(&self, xid: u64) -> bool {
        let i = self.0.partition_point(|r| r.1 < xid);
        self.0.get(i).is_some_and(|r| r.0 <= xid)
    }

    /// How many runs; what a record's size follows.
    pub fn runs(&self) -> usize {
        self.0.len()
    }

    /// How many ids.
    pub fn count(&self) -> u64 {
        self.0.iter().map(|(a, b)| b - a + 1).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    pub fn insert(&mut self, xid: u64) {
        self.insert_run(xid, xid);
    }

    /// Adds `from..=to`; cheap when it lies after every run, as ids mostly do.
    fn insert_run(&mut self, from: u64, to: u64) {
        let i = self.0.partition_point(|r| r.1.saturating_add(1) < from);
        let mut j = i;
        let (mut a, mut b) = (from, to);
        while let Some(&(s, e)) = self.0.get(j) {
            if s > b.saturating_add(1) {
                break;
            }
            a = a.min(s);
            b = b.max(e);
            j += 1;
        }
        self.0.splice(i..j, [(a, b)]);
    }

    /// Keeps the ids `snapshot` does not show.
    fn keep_unshown(&mut self, snapshot: &Snapshot) {
        let mut kept = Runs::default();
        for &(a, b) in &self.0 {
            let first = snapshot.xip.partition_point(|x| *x < a);
            for &x in snapshot.xip[first..].iter().take_while(|x| **x <= b) {
                kept.insert(x);
            }
            if b >= snapshot.xmax {
                kept.insert_run(a.max(snapshot.xmax), b);
            }
        }
        *self = kept;
    }

    /// `start` or `start+n` (start..=start+n), comma-separated.
    pub fn encode(&self) -> String {
        let runs: Vec<String> = self
            .0
            .iter()
            .map(|&(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}+{}", b - a)
                }
            })
            .collect();
        runs.join(",")
    }

    pub fn decode(text: &str) -> Option<Runs> {
        let mut runs = Runs::default();
        for run in text.split(',').filter(|r| !r.is_empty()) {
            let (start, extra): (u64, u64) = match run.split_once('+') {
                Some((start, extra)) => (start.parse().ok()?, extra.parse().ok()?),
                None => (run.parse().ok()?, 0),
            };
            runs.insert_run(start, start.checked_add(extra)?);
        }
        Some(runs)
    }
}

impl FromIterator<u64> for Runs {
    fn from_iter<I: IntoIterator<Item = u64>>(ids: I) -> Self {
        let mut runs = Runs::default();
        for id in ids {
            runs.insert(id);
        }
        runs
    }
}

/// Every transaction visible in `base`, and those in `xids`, are in Kafka.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Horizon {
    pub base: Snapshot,
    pub xids: Runs,
    /// Where `base` was taken (see [`ORIGIN_SQL`]).
    pub origin: String,
}

impl Horizon {
    /// Whether the transaction `txid` is in Kafka.
    pub fn holds(&self, txid: u64) -> bool {
        self.base.shows(txid) || self.xids.contains(txid)
    }
}

/// Keeps the [`Horizon`] of what the sink has put into Kafka transactions.
#[derive(Debug, Default)]
pub struct Tracker {
    known: Option<Horizon>,
    /// Without a known horizon: the floor, once a mark arrived.
    floor: Option<Snapshot>,
    /// Delivered transactions since the base or the floor, not shown by it.
    xids: Runs,
    candidates: VecDeque<Mark>,
}

impl Tracker {
    /// Starts from the horizon Kafka holds, or from none.
    pub fn starting_at(known: Option<Horizon>) -> Tracker {
        let mut tracker = Tracker::default();
        if let Some(horizon) = known {
            tracker.xids = horizon.xids.clone();
            tracker.known = Some(horizon);
        }
        tracker
    }

    /// The horizon as far as transactions were added, if one is known.
    pub fn horizon(&self) -> Option<Horizon> {
        let known = self.known.as_ref()?;
        Some(Horizon {
            base: known.base.clone(),
            xids: self.xids.clone(),
            origin: known.origin.clone(),
        })
    }

    pub fn mark(&mut self, mark: Mark) {
        if self.known.is_none() && self.floor.is_none() && !mark.exact {
            // Every transaction delivered so far is shown by this snapshot
            // or in progress in it.
            self.xids.clear();
            self.floor = Some(mark.snapshot);
            return;
        }
        if self.candidates.len() >= MAX_CANDIDATES {
            self.candidates.pop_back();
        }
        self.candidates.push_back(mark);
    }

    /// A transaction (its 32-bit id, as pgoutput sends it) is going into Kafka.
    pub fn add(&mut self, xid: u32) {
        let reference = match (&self.known, &self.floor) {
            (Some(known), _) => &known.base,
            (None, Some(floor)) => floor,
            (None, None) => return,
        };
        if let Some(full) = reference.widen(xid) {
            if !reference.shows(full) {
                self.xids.insert(full);
            }
        }
        if self.xids.runs() > MAX_RUNS {
            tracing::warn!(
                limit = MAX_RUNS,
                "the delivered-transaction list outgrew its limit; a lost slot recovered before the next mark may repeat events"
            );
            *self = Tracker::default();
        }
    }

    /// The sink has put every transaction up to `delivered` into Kafka:
    /// adopts the newest mark it passed as the base.
    pub fn advance(&mut self, delivered: Lsn) {
        while let Some(mark) = self.candidates.front() {
            if mark.lsn > delivered {
                break;
            }
            let mark = self.candidates.pop_front().expect("front");
            let adoptable = mark.exact
                || self.known.is_some()
                || self
                    .floor
                    .as_ref()
                    .is_some_and(|floor| floor.xip.iter().all(|x| mark.snapshot.shows(*x)));
            if !adoptable {
                continue;
            }
            if mark.exact {
                self.xids.clear();
            } else {
                self.xids.keep_unshown(&mark.snapshot);
            }
            self.floor = None;
            self.known = Some(Horizon {
                base: mark.snapshot,
                xids: Runs::default(),
                origin: mark.origin,
            });
        }
    }
}

/// A snapshot and the WAL insert position read after it (see
/// the module's docs).
pub async fn mark(client: &tokio_postgres::Client) -> Result<Mark> {
    let row = client
        .query_one(
            &format!(
                "SELECT pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text, {ORIGIN_SQL}"
            ),
            &[],
        )
        .await?;
    let snapshot: String = row.get(0);
    let lsn: String = row.get(1);
    Ok(Mark {
        snapshot: snapshot.parse().map_err(Error::Bug)?,
        lsn: lsn
            .parse()
            .map_err(|_| Error::Bug(format!("not an LSN: {lsn}")))?,
        exact: false,
        origin: row.get(2),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(text: &str) -> Snapshot {
        text.parse().expect("snapshot")
    }

    fn mark(text: &str, lsn: u64) -> Mark {
        Mark {
            snapshot: snapshot(text),
            lsn: Lsn(lsn),
            exact: false,
            origin: "1/00000001".into(),
        }
    }

    #[test]
    fn snapshots_read_and_print_as_postgres_does() {
        let s = snapshot("100:110:103,101");
        assert_eq!(s.xip, vec![101, 103]);
        assert_eq!(s.to_string(), "100:110:101,103");
        assert_eq!(snapshot("5:5:").to_string(), "5:5:");
        assert!(s.shows(99) && s.shows(102) && !s.shows(101) && !s.shows(110));
        assert!("5:x:".parse::<Snapshot>().is_err());
        assert!("5".parse::<Snapshot>().is_err());
    }

    #[test]
    fn listed_ids_round_trip_as_runs() {
        let h = Horizon {
            base: snapshot("1:1:"),
            xids: [21, 7, 9, 8, 11, 20].into_iter().collect(),
            origin: "1/00000001".into(),
        };
        assert_eq!(h.xids.encode(), "7+2,11,20+1");
        assert_eq!(Runs::decode(&h.xids.encode()), Some(h.xids.clone()));
        assert_eq!(Runs::decode(""), Some(Runs::default()));
        assert_eq!(Runs::decode("7+x"), None);
        assert!(h.xids.contains(8) && !h.xids.contains(10) && h.xids.contains(21));
        assert_eq!(h.xids.count(), 6);
        // A run in the middle joins its neighbours.
        let mut joined: Runs = [1, 2, 6, 7].into_iter().collect();
        joined.insert_run(3, 5);
        assert_eq!(joined.encode(), "1+6");
        let mut xids: Runs = (100..=110).collect();
        xids.keep_unshown(&snapshot("103:108:103,105"));
        assert_eq!(xids.encode(), "103,105,108+2");
    }

    #[test]
    fn a_base_is_adopted_once_delivery_passed_its_mark_and_keeps_what_it_does_not_show() {
        let mut t = Tracker::starting_at(Some(Horizon {
            base: snapshot("100:100:"),
            xids: Runs::default(),
            origin: "1/00000001".into(),
        }));
        t.add(100);
        t.add(102);
        t.mark(mark("102:104:102", 500));
        t.add(103);
        t.advance(Lsn(499));
        assert_eq!(t.horizon().expect("a horizon").base, snapshot("100:100:"));
        t.advance(Lsn(500));
        let h = t.horizon().expect("a horizon");
        assert_eq!(h.base, snapshot("102:104:102"));
        assert_eq!(h.xids, Runs::from_iter([102]));
        assert!(h.holds(100) && h.holds(102) && h.holds(103) && !h.holds(104));
    }

    #[test]
    fn without_a_horizon_none_is_claimed_until_a_mark_shows_all_the_floor_had_in_progress() {
        let mut t = Tracker::starting_at(None);
        t.add(90);
        assert_eq!(t.horizon(), None);
        // The floor: 95 is in progress (it may be delivered already).
        t.mark(mark("95:98:95", 100));
        t.add(97);
        // 95 still in progress here: not a base.
        t.mark(mark("95:99:95", 200));
        t.advance(Lsn(300));
        assert_eq!(t.horizon(), None);
        t.mark(mark("99:99:", 400));
        t.add(99);
        t.advance(Lsn(400));
        let h = t.horizon().expect("adopted");
        assert!(h.holds(95) && h.holds(97) && h.holds(99) && !h.holds(100));
    }

    #[test]
    fn an_exact_mark_becomes_the_base_whatever_came_before() {
        let mut t = Tracker::starting_at(None);
        t.mark(Mark {
            exact: true,
            ..mark("50:52:50", 10)
        });
        t.advance(Lsn(10));
        let h = t.horizon().expect("exact");
        assert!(h.holds(51) && !h.holds(50) && h.xids.is_empty());
    }

    #[test]
    fn thirty_two_bit_ids_widen_across_an_epoch() {
        let base = snapshot(&format!("{}:{}:", (1u64 << 32) - 2, (1u64 << 32) + 5));
        assert_eq!(base.widen(1), Some((1u64 << 32) + 1));
        assert_eq!(base.widen(u32::MAX), Some((1u64 << 32) - 1));
        assert_eq!(base.widen(u32::MAX - 10), None);
    }
}
