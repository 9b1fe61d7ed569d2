//! Named crash points at the pipeline's boundaries, armed only by tests.
//!
//! `OUTBOX_FAULT=point` or `OUTBOX_FAULT=point:n` makes the process abort
//! (no cleanup, like SIGKILL) the n-th time (default 1st) it passes `point`.
//! With `OUTBOX_FAULT_STALL_MS=ms` it blocks the thread there for that long
//! instead, as a call that does not return would (the liveness watchdog's
//! test). Unset, a check costs one relaxed atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The boundaries, in pipeline order.
const POINTS: &[&str] = &[
    // Producer set up, before init_transactions (exactly-once) or the first send.
    "producer_init",
    // An event is decoded and routed, before it is handed to Kafka.
    "before_produce",
    // Events handed to Kafka, before the Kafka commit (exactly-once) or
    // before their delivery reports are counted (at-least-once).
    "after_produce",
    // Kafka acknowledged a record, on librdkafka's thread, before the
    // pipeline hears of it.
    "on_delivery_report",
    // Exactly-once: the offset record is sent in the open Kafka
    // transaction, before its commit is asked for.
    "before_kafka_commit",
    // Kafka committed (exactly-once: events and offset record together;
    // at-least-once: all reports in), before the slot is told.
    "after_kafka_commit",
    // The slot was told the new position.
    "after_confirm",
    // Polling: a relay renewed or took leases.
    "after_lease",
    // Polling: a relay marked published events done.
    "after_poll_done",
];

struct Armed {
    point: String,
    at: u64,
    seen: AtomicU64,
    stall: Option<std::time::Duration>,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var("OUTBOX_FAULT").ok()?;
            let (point, at) = match spec.split_once(':') {
                Some((p, n)) => (p.to_owned(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            if !POINTS.contains(&point.as_str()) {
                // A test that arms a point that does not exist would wait
                // for a fault that never comes.
                eprintln!(
                    "OUTBOX_FAULT names no fault point: {point:?} (the points: {})",
                    POINTS.join(", ")
                );
                std::process::exit(2);
            }
            let stall = std::env::var("OUTBOX_FAULT_STALL_MS")
                .ok()
                .and_then(|ms| ms.parse().ok())
                .map(std::time::Duration::from_millis);
            Some(Armed {
                point,
                at: at.max(1),
                seen: AtomicU64::new(0),
                stall,
            })
        })
        .as_ref()
}

/// Aborts the process (or stalls the thread) if `point` is armed and its
/// count is reached.
pub fn check(point: &'static str) {
    if let Some(armed) = armed() {
        if armed.point == point && armed.seen.fetch_add(1, Ordering::Relaxed) + 1 == armed.at {
            if let Some(stall) = armed.stall {
                eprintln!(
                    "fault point {point} fired: stalling {} ms",
                    stall.as_millis()
                );
                std::thread::sleep(stall);
                return;
            }
            eprintln!("fault point {point} fired");
            std::process::abort();
        }
    }
}
