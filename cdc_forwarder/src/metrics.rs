//! Prometheus metrics and the health state, shared by the pipeline and the
//! HTTP endpoints (`/metrics`, `/healthz`, `/readyz`).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use crate::health::{Health, Limits};

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

/// Label of `outbox_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorKind {
    pub kind: String,
}

/// What the instance is doing, for `/readyz` and the `outbox_state` gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Starting = 0,
    Streaming = 1,
    Standby = 2,
    Reconnecting = 3,
    Fenced = 4,
    Stopped = 5,
}

pub struct Metrics {
    registry: Registry,
    pub events: Counter,
    pub bytes: Counter,
    pub transactions: Counter,
    pub kafka_commits: Counter,
    pub kafka_commit_seconds: Histogram,
    pub end_to_end_seconds: Histogram,
    pub retries: Counter,
    pub errors: Family<ErrorKind, Counter>,
    pub caught_up_events: Counter,
    pub slot: SlotMetrics,
    pub parking: ParkingMetrics,
    pub polling: PollMetrics,
    state_gauge: Gauge,
    state: AtomicI64,
    /// What `/healthz` and `/readyz` judge by.
    pub health: Arc<Health>,
}

/// The replication slot, as the forwarder last read it.
pub struct SlotMetrics {
    pub lag_bytes: Gauge,
    pub retained_wal_bytes: Gauge,
    /// The slot's `wal_status`, as [`wal_status_code`] numbers it.
    pub wal_status: Gauge,
    pub confirmed_lsn: Gauge,
}

/// Dead letters and the aggregates parked behind them.
pub struct ParkingMetrics {
    pub dead_lettered: Counter,
    /// Events dead-lettered behind an earlier one of their aggregate.
    pub parked_events: Counter,
    /// Aggregates parked behind a dead-lettered event (read each second).
    pub parked_aggregates: Gauge,
    /// How long the oldest parked aggregate has been parked, in seconds.
    pub oldest_seconds: Gauge,
}

/// Polling relays (`--source poll`).
pub struct PollMetrics {
    /// Events no relay has published yet.
    pub pending_events: Gauge,
    /// Age of the oldest pending event, in milliseconds.
    pub oldest_pending_ms: Gauge,
    /// Aggregates this relay leases.
    pub leases_held: Gauge,
    /// Leases past their expiry that no relay took over yet.
    pub leases_expired: Gauge,
    /// Expired leases of other relays this relay took over.
    pub leases_taken_over: Counter,
}

/// Registers `metric` under `name` (prefixed `outbox_`) and hands it back.
fn registered_as<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A new metric of its default kind, registered as by [`registered_as`].
fn registered<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    registered_as(registry, name, help, M::default())
}

impl SlotMetrics {
    fn registered(r: &mut Registry) -> Self {
        SlotMetrics {
            lag_bytes: registered(
                r,
                "replication_lag_bytes",
                "WAL between the server's position and the slot's confirmed position",
            ),
            retained_wal_bytes: registered(
                r,
                "retained_wal_bytes",
                "WAL the slot holds back (from its restart_lsn)",
            ),
            wal_status: registered(
                r,
                "slot_wal_status",
                "The slot's wal_status: 0 reserved, 1 extended, 2 unreserved (soon lost), 3 lost",
            ),
            confirmed_lsn: registered(
                r,
                "confirmed_lsn",
                "Last position confirmed to the slot, as a number",
            ),
        }
    }
}

impl ParkingMetrics {
    fn registered(r: &mut Registry) -> Self {
        ParkingMetrics {
            dead_lettered: registered(
                r,
                "dead_lettered_events",
                "Poison events sent to the dead-letter topic",
            ),
            parked_events: registered(
                r,
                "parked_events",
                "Events dead-lettered behind an earlier dead letter of their aggregate",
            ),
            parked_aggregates: registered(
                r,
                "parked_aggregates",
                "Aggregates held behind a dead-lettered event until redrive (read each second)",
            ),
            oldest_seconds: registered(
                r,
                "parked_oldest_seconds",
                "How long the oldest parked aggregate has been parked",
            ),
        }
    }
}

impl PollMetrics {
    fn registered(r: &mut Registry) -> Self {
        PollMetrics {
            pending_events: registered(
                r,
                "poll_pending_events",
                "Polling: events no relay has published yet (every relay's, read each second)",
            ),
            oldest_pending_ms: registered(
                r,
                "poll_oldest_pending_milliseconds",
                "Polling: age of the oldest pending event",
            ),
            leases_held: registered(
                r,
                "poll_leases_held",
                "Polling: aggregates this relay leases",
            ),
            leases_expired: registered(
                r,
                "poll_leases_expired",
                "Polling: leases past their expiry that no relay has taken over yet",
            ),
            leases_taken_over: registered(
                r,
                "poll_leases_taken_over",
                "Polling: expired leases of other relays that this relay took over",
            ),
        }
    }
}

impl Metrics {
    /// Every metric, registered in the order `/metrics` lists them.
    pub fn new(limits: Limits) -> Arc<Self> {
        let mut registry = Registry::with_prefix("outbox");
        let r = &mut registry;
        Arc::new(Metrics {
            events: registered(r, "events_forwarded", "Events Kafka acknowledged"),
            bytes: registered(r, "bytes_forwarded", "Payload bytes Kafka acknowledged"),
            transactions: registered(
                r,
                "transactions_forwarded",
                "PostgreSQL transactions confirmed to the slot",
            ),
            kafka_commits: registered(
                r,
                "kafka_commits",
                "Kafka transactions committed (exactly-once mode)",
            ),
            kafka_commit_seconds: registered_as(
                r,
                "kafka_commit_seconds",
                "Time of one Kafka transaction commit",
                Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            ),
            end_to_end_seconds: registered_as(
                r,
                "end_to_end_seconds",
                "From the PostgreSQL commit to Kafka's acknowledgement, per transaction",
                Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            ),
            slot: SlotMetrics::registered(r),
            retries: registered(r, "retries", "Sessions restarted after a transient failure"),
            errors: registered(r, "errors", "Errors by kind"),
            parking: ParkingMetrics::registered(r),
            caught_up_events: registered(
                r,
                "catch_up_events",
                "Events delivered by first-start catch-ups",
            ),
            polling: PollMetrics::registered(r),
            state_gauge: registered(
                r,
                "state",
                "0 starting, 1 streaming, 2 standby, 3 reconnecting, 4 fenced, 5 stopped",
            ),
            state: AtomicI64::new(State::Starting as i64),
            health: Arc::new(Health::new(limits)),
            registry,
        })
    }

    pub fn set_state(&self, state: State) {
        self.state.store(state as i64, Ordering::Relaxed);
        self.state_gauge.set(state as i64);
    }

    pub fn state(&self) -> i64 {
        self.state.load(Ordering::Relaxed)
    }

    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&ErrorKind {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// `Ok` while this instance forwards, else why not (see [`crate::health`]).
    /// With `standby_ready`, an instance waiting as the standby is ready too
    /// while Kafka answers: a replica that can take over (what a Kubernetes
    /// readiness probe and PodDisruptionBudget should count).
    pub fn readiness(&self, standby_ready: bool) -> Result<(), String> {
        let state = match self.state() {
            1 => None,
            2 if standby_ready => return self.health.kafka_reachable(),
            2 => Some("standby: another instance holds the slot"),
            3 => Some("reconnecting"),
            4 => Some("fenced: a newer instance took the transactional id"),
            5 => Some("stopped"),
            _ => Some("starting"),
        };
        self.health.readiness(state, self.slot.lag_bytes.get())
    }

    /// `Ok` while the forwarding loop steps (see [`crate::health`]).
    pub fn liveness(&self) -> Result<(), String> {
        self.health.liveness()
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// `outbox_slot_wal_status` of a slot's `wal_status`, worse as it grows;
/// an unknown status counts as the worst.
pub fn wal_status_code(wal_status: &str) -> i64 {
    match wal_status {
        "reserved" => 0,
        "extended" => 1,
        "unreserved" => 2,
        _ => 3,
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    use axum::http::StatusCode;
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get({
                let m = metrics.clone();
                move || async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get({
                let m = metrics.clone();
                move || async move {
                    match m.liveness() {
                        Ok(()) => (StatusCode::OK, "alive\n".to_owned()),
                        Err(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not alive: {why}\n"),
                        ),
                    }
                }
            }),
        )
        .route(
            "/readyz",
            get({
                let m = metrics.clone();
                move |uri: axum::http::Uri| async move {
                    let standby_ready = uri
                        .query()
                        .is_some_and(|q| q.split('&').any(|p| p == "standby=ready"));
                    match m.readiness(standby_ready) {
                        Ok(()) if m.state() == 2 => (StatusCode::OK, "ready: standby\n".to_owned()),
                        Ok(()) => (StatusCode::OK, "ready: streaming\n".to_owned()),
                        Err(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            }),
        );
    axum::serve(listener, app).await
}

/// Asks a forwarder's endpoint `path` on `listen` (an unspecified address is
/// asked on loopback) and returns its body when it answers 200 OK.
pub async fn probe(listen: std::net::SocketAddr, path: &str) -> crate::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut address = listen;
    if address.ip().is_unspecified() {
        address.set_ip(match address {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let unhealthy = |why: String| crate::Error::Unhealthy(format!("{path} on {address}: {why}"));
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
            .await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(std::time::Duration::from_secs(3), exchange)
        .await
        .map_err(|_| unhealthy("no answer within 3 s".into()))?
        .map_err(|e| unhealthy(e.to_string()))?;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(body.to_owned())
    } else {
        Err(unhealthy(format!("{status}: {}", body.trim())))
    }
}
