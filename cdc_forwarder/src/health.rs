//! What `/healthz` and `/readyz` answer, and why.
//!
//! Liveness is a watchdog: the forwarding loop, the reconnect loop and the
//! first-start catch-up each mark a step as they go (the forwarding loop at
//! least once a second, when nothing happens), and `/healthz` fails once no
//! step was marked for the liveness timeout. A loop stuck in a call that
//! never returns fails it; a loop that waits on a hung broker does not,
//! since it keeps stepping, and restarting the process would not help it.
//!
//! Readiness says whether this instance forwards now. It fails, each time
//! with the reason in the body, while the instance is not streaming (a
//! standby, reconnecting, fenced), while the slot's lag is above its limit,
//! while Kafka is unreachable (a metadata request, every second, that no
//! broker answers within the probe timeout: a broker stopped with its
//! sockets open answers nothing), and while events wait for Kafka with no
//! acknowledgement for longer than the stall limit (Kafka reachable but
//! refusing or holding back the records, as when a topic has fewer in-sync
//! replicas than it requires). The stall is judged by what the forwarder
//! holds, not by the slot's lag: a transaction still being read while Kafka
//! acknowledges its events is no stall, and neither is an idle slot.
//! Each condition clears by itself when what caused it does.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The limits the endpoints judge by.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// `/healthz` fails when no step was marked for this long.
    pub liveness_timeout: Duration,
    /// `/readyz` fails while the slot's lag is above this many bytes.
    pub ready_max_lag_bytes: u64,
    /// `/readyz` fails while events wait for Kafka with no acknowledgement
    /// for this long.
    pub ready_max_stall: Duration,
}

/// How long a Kafka metadata request may take before Kafka counts as
/// unreachable, and how often one is sent.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// `waiting_since` when nothing waits for Kafka.
const NOTHING_WAITS: u64 = u64::MAX;

/// The watchdog's and the probes' observations, read by the endpoints.
pub struct Health {
    limits: Limits,
    origin: Instant,
    /// Milliseconds since `origin` of the last step.
    last_step: AtomicU64,
    /// Milliseconds since `origin` from which events waited for Kafka with
    /// no acknowledgement ([`NOTHING_WAITS`] when none wait), and how many
    /// holds were waiting at the last look.
    waiting_since: AtomicU64,
    waiting: AtomicUsize,
    /// Since when (milliseconds since `origin`) and why Kafka is unreachable.
    kafka_down: Mutex<Option<(u64, String)>>,
}

impl Health {
    pub fn new(limits: Limits) -> Health {
        Health {
            limits,
            origin: Instant::now(),
            last_step: AtomicU64::new(0),
            waiting_since: AtomicU64::new(NOTHING_WAITS),
            waiting: AtomicUsize::new(0),
            kafka_down: Mutex::new(None),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn since(&self, at: u64) -> Duration {
        Duration::from_millis(self.now().saturating_sub(at))
    }

    /// The loop made a step.
    pub fn step(&self) {
        self.last_step.store(self.now(), Ordering::Relaxed);
    }

    /// What the sink holds for Kafka now: `held` holds (events sent and not
    /// acknowledged, or transactions not yet committed in Kafka). Fewer than
    /// at the last look is Kafka's progress; the first hold after none
    /// starts the clock.
    pub fn waiting_for_kafka(&self, held: usize) {
        let before = self.waiting.swap(held, Ordering::Relaxed);
        if held == 0 {
            self.waiting_since.store(NOTHING_WAITS, Ordering::Relaxed);
        } else if held < before || before == 0 {
            self.waiting_since.store(self.now(), Ordering::Relaxed);
        }
    }

    /// A new session starts: nothing of an earlier session waits.
    pub fn session_started(&self) {
        self.waiting_for_kafka(0);
    }

    /// The outcome of a Kafka probe sent at `asked`.
    pub fn kafka_probed(&self, asked: Instant, outcome: Result<(), String>) {
        let mut down = self.kafka_down.lock().unwrap_or_else(|e| e.into_inner());
        match outcome {
            Ok(()) => *down = None,
            Err(error) => {
                let asked = u64::try_from(asked.saturating_duration_since(self.origin).as_millis())
                    .unwrap_or(u64::MAX);
                let since = down.as_ref().map_or(asked, |(since, _)| *since);
                *down = Some((since, error));
            }
        }
    }

    /// `Ok` while the loop steps, else why not.
    pub fn liveness(&self) -> Result<(), String> {
        let quiet = self.since(self.last_step.load(Ordering::Relaxed));
        if quiet > self.limits.liveness_timeout {
            return Err(format!(
                "no step of the forwarding loop for {:.1} s (liveness timeout {} s)",
                quiet.as_secs_f64(),
                self.limits.liveness_timeout.as_secs_f64()
            ));
        }
        Ok(())
    }

    /// `Ok` while this instance forwards, else why not. `state` names what
    /// the instance does (`None` when streaming); `lag` is the slot's lag
    /// (0 for a polling relay).
    pub fn readiness(&self, state: Option<&str>, lag: i64) -> Result<(), String> {
        if let Some(state) = state {
            return Err(state.to_owned());
        }
        self.kafka_reachable()?;
        let max_lag = i64::try_from(self.limits.ready_max_lag_bytes).unwrap_or(i64::MAX);
        if lag > max_lag {
            return Err(format!("lag {lag} bytes, above {max_lag}"));
        }
        let since = self.waiting_since.load(Ordering::Relaxed);
        if since != NOTHING_WAITS && self.since(since) > self.limits.ready_max_stall {
            return Err(format!(
                "kafka acknowledged nothing for {:.0} s while {} wait",
                self.since(since).as_secs_f64(),
                self.waiting.load(Ordering::Relaxed)
            ));
        }
        Ok(())
    }
}

impl Health {
    /// `Ok` unless the last metadata probes found no broker answering.
    pub fn kafka_reachable(&self) -> Result<(), String> {
        match self
            .kafka_down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            Some((since, error)) => Err(format!(
                "kafka unreachable for {:.0} s: {error}",
                self.since(*since).as_secs_f64()
            )),
            None => Ok(()),
        }
    }
}

/// Asks Kafka for its metadata every second until the process ends, and
/// records whether any broker answered within [`PROBE_TIMEOUT`].
pub async fn probe_kafka(client: rdkafka::ClientConfig, health: std::sync::Arc<Health>) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = match client.create() {
        Ok(consumer) => consumer,
        Err(error) => {
            health.kafka_probed(Instant::now(), Err(error.to_string()));
            return;
        }
    };
    let consumer = std::sync::Arc::new(consumer);
    let mut interval = tokio::time::interval(PROBE_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let asked = Instant::now();
        let probe = consumer.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            probe
                .fetch_metadata(None, PROBE_TIMEOUT)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        health.kafka_probed(asked, outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(liveness_ms: u64, stall_ms: u64) -> Health {
        Health::new(Limits {
            liveness_timeout: Duration::from_millis(liveness_ms),
            ready_max_lag_bytes: 1000,
            ready_max_stall: Duration::from_millis(stall_ms),
        })
    }

    #[test]
    fn liveness_fails_once_no_step_came_within_the_timeout_and_returns_with_the_next() {
        let h = health(50, 1000);
        h.step();
        assert!(h.liveness().is_ok());
        std::thread::sleep(Duration::from_millis(80));
        let reason = h.liveness().expect_err("no step for 80 ms");
        assert!(
            reason.starts_with("no step of the forwarding loop"),
            "{reason}"
        );
        h.step();
        assert!(h.liveness().is_ok());
    }

    #[test]
    fn readiness_names_each_reason_and_clears_with_it() {
        let h = health(1000, 50);
        h.session_started();
        assert_eq!(h.readiness(Some("standby"), 0), Err("standby".into()));
        assert!(h.readiness(None, 0).is_ok());

        h.kafka_probed(Instant::now(), Err("timed out".into()));
        let reason = h.readiness(None, 0).expect_err("kafka down");
        assert!(
            reason.starts_with("kafka unreachable for") && reason.ends_with("timed out"),
            "{reason}"
        );
        h.kafka_probed(Instant::now(), Ok(()));
        assert!(h.readiness(None, 0).is_ok());

        assert!(h
            .readiness(None, 2000)
            .expect_err("lag")
            .starts_with("lag 2000 bytes"));

        // Events wait with no acknowledgement, past the stall limit.
        h.waiting_for_kafka(3);
        assert!(h.readiness(None, 500).is_ok(), "within the stall limit");
        std::thread::sleep(Duration::from_millis(80));
        h.waiting_for_kafka(5);
        let reason = h.readiness(None, 500).expect_err("stalled");
        assert!(
            reason.starts_with("kafka acknowledged nothing for") && reason.ends_with("5 wait"),
            "{reason}"
        );
        // An acknowledgement restarts the clock, though events still wait.
        h.waiting_for_kafka(4);
        assert!(h.readiness(None, 500).is_ok());
        std::thread::sleep(Duration::from_millis(80));
        assert!(h.readiness(None, 500).is_err(), "stalled again");
        // Nothing waiting is no stall, whatever the lag: an idle slot.
        h.waiting_for_kafka(0);
        std::thread::sleep(Duration::from_millis(80));
        assert!(h.readiness(None, 500).is_ok());
        // A new session owes nothing for the last one's holds.
        h.waiting_for_kafka(2);
        std::thread::sleep(Duration::from_millis(80));
        h.session_started();
        assert!(h.readiness(None, 500).is_ok());
    }
}
