//! The forwarder's errors, classified once: whether a retry can help, and
//! which exit code the process ends with.

use crate::event::LayoutError;
use crate::pgoutput::DecodeError;
use crate::routing::RouteError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is wrong; nothing was started.
    #[error("configuration: {0}")]
    Config(String),

    /// The operator must act: PostgreSQL is reachable but lacks what the
    /// forwarder needs (wal_level, the outbox, polling, a slot it may not
    /// create), a `check` failed, or redrive left an event still refused.
    /// Never retried; exit code 3; the message says what to do.
    #[error("{0}")]
    Setup(String),

    #[error("postgres: {}", describe_postgres(.0))]
    Postgres(#[from] tokio_postgres::Error),

    #[error("replication stream: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),

    #[error("replication stream: {0}")]
    Decode(#[from] DecodeError),

    #[error("outbox table layout: {0}")]
    Layout(#[from] LayoutError),

    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),

    /// None of the hosts of a multi-host URL is a reachable primary (as
    /// during a failover): tried again.
    #[error("no primary among the PostgreSQL hosts: {0}")]
    NoPrimary(String),

    /// Another instance holds the slot (or is creating it): this one waits
    /// as a standby and tries again.
    #[error("slot {0} is in use by another instance; waiting as standby")]
    SlotBusy(String),

    /// Another forwarder took over the slot's transactional id.
    #[error("fenced: another forwarder instance took over transactional id {0}; this one stops producing")]
    Fenced(String),

    /// A polling relay could not renew its leases in time: it stops
    /// publishing, and starts again with fresh leases.
    #[error("polling relay {0} lost its leases (not renewed before they expired)")]
    LeaseLost(String),

    /// A Kafka transaction of this producer was aborted or failed to
    /// commit: the next one waits for a fresh producer, whose
    /// `init_transactions` fences the old epoch's late requests.
    #[error("kafka: a transaction was aborted or its commit failed; a fresh producer takes over the transactional id before the next one")]
    EpochSpent,

    /// A running forwarder's health endpoint did not answer 200 OK.
    #[error("{0}")]
    Unhealthy(String),

    /// A step that Kafka or PostgreSQL did not finish in time (a first-start
    /// catch-up not fully acknowledged, a relay's bookkeeping cut short):
    /// the session starts again and redoes it.
    #[error("{0}")]
    Incomplete(String),

    /// Something that cannot happen did: a task panicked, a server answered
    /// outside the protocol. Not retried; the message says where.
    #[error("internal error (please report it): {0}")]
    Bug(String),

    /// An event that cannot be delivered; it is never skipped silently.
    #[error("event {event_id} cannot be delivered: {reason}")]
    Poison { event_id: String, reason: String },
}

impl From<(String, RouteError)> for Error {
    fn from((event_id, err): (String, RouteError)) -> Self {
        Error::Poison {
            event_id,
            reason: err.to_string(),
        }
    }
}

impl Error {
    /// Whether reconnecting and replaying from the slot can succeed.
    ///
    /// Connection loss, server restarts and broker unavailability are
    /// transient. Authentication, privileges, missing objects, malformed
    /// data and poison events are definite: retrying would only repeat them.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Config(_)
            | Error::Setup(_)
            | Error::Decode(_)
            | Error::Layout(_)
            | Error::Fenced(_)
            | Error::Unhealthy(_)
            | Error::Bug(_)
            | Error::Poison { .. } => false,
            // A certificate that does not verify stays refused until an
            // operator changes the certificate or the sslrootcert.
            Error::Postgres(e) if certificate_refused(&describe_postgres(e)) => false,
            Error::Replication(pgwire_replication::PgWireError::Tls(text))
                if certificate_refused(text) =>
            {
                false
            }
            Error::Postgres(e) => match e.code() {
                // Class 28 (authorization), 42 (syntax, privilege, undefined
                // object) and 3D (no such database) will not heal by retrying.
                Some(state) => !matches!(&state.code()[..2], "28" | "42" | "3D"),
                None => true,
            },
            Error::Replication(e) => !e.is_auth(),
            Error::Kafka(_)
            | Error::EpochSpent
            | Error::SlotBusy(_)
            | Error::NoPrimary(_)
            | Error::Incomplete(_)
            | Error::LeaseLost(_) => true,
        }
    }

    /// A short name for the `kind` label of the errors metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Config(_) => "config",
            Error::Setup(_) => "setup",
            Error::Postgres(_) => "postgres",
            Error::Replication(_) => "replication",
            Error::Decode(_) => "decode",
            Error::Layout(_) => "layout",
            Error::Kafka(_) | Error::EpochSpent => "kafka",
            Error::SlotBusy(_) => "slot_busy",
            Error::NoPrimary(_) => "no_primary",
            Error::Fenced(_) => "fenced",
            Error::Unhealthy(_) => "unhealthy",
            Error::LeaseLost(_) => "lease_lost",
            Error::Incomplete(_) => "incomplete",
            Error::Bug(_) => "bug",
            Error::Poison { .. } => "poison",
        }
    }

    /// Process exit code for this error: 2 configuration, 3 setup, 4 poison
    /// event, 5 fenced, 1 anything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Config(_) => 2,
            Error::Setup(_) => 3,
            Error::Poison { .. } => 4,
            Error::Fenced(_) => 5,
            _ => 1,
        }
    }
}

/// Whether a TLS failure is the server's certificate being refused (by
/// OpenSSL on SQL connections, by rustls on the replication connection).
fn certificate_refused(text: &str) -> bool {
    text.contains("certificate verify failed") || text.contains("invalid peer certificate")
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A PostgreSQL error in one line: the server's message and SQLSTATE, or the
/// client's error and its cause (tokio-postgres alone says only "db error").
pub fn describe_postgres(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{} (SQLSTATE {})", db.message(), db.code().code());
    }
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn an_unfinished_step_is_retried_and_a_bug_is_not_called_setup() {
        let unfinished = Error::Incomplete("catch-up not acknowledged".into());
        assert!(unfinished.is_retryable());
        let bug = Error::Bug("a task panicked".into());
        assert!(!bug.is_retryable());
        assert_eq!(
            bug.exit_code(),
            1,
            "exit code 3 says PostgreSQL is not set up"
        );
    }
}
