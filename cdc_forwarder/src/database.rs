//! The database that holds the outbox, as the forwarder reaches it: SQL
//! connections, the primary among the hosts of a multi-host URL, and one
//! probe of what its outbox offers (edition and version, polling relays,
//! parked aggregates), which `run`, `check` and `status` all ask.

use tokio_postgres::{Client, GenericClient, NoTls};

use crate::config::{PgTarget, SslMode};
use crate::error::{Error, Result};

/// Opens an ordinary SQL connection; the connection task runs in the background.
pub async fn connect(target: &PgTarget) -> Result<Client> {
    let client = if target.tls().mode == SslMode::Disable {
        let (client, connection) = target.sql_config().connect(NoTls).await?;
        tokio::spawn(watch_connection(connection));
        client
    } else {
        let tls = crate::tls::sql_connector(target.tls())?;
        let (client, connection) = target.sql_config().connect(tls).await?;
        tokio::spawn(watch_connection(connection));
        client
    };
    // Timestamps in the same text form as the replication stream's.
    client
        .batch_execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO'")
        .await?;
    Ok(client)
}

/// The primary among the hosts of a multi-host URL: the first that answers
/// and is not in recovery. One host is taken as it is. After a promotion the
/// next session finds the new primary this way, for the SQL and the
/// replication connection alike.
pub async fn primary(target: &PgTarget) -> Result<PgTarget> {
    let hosts = target.per_host();
    if hosts.len() == 1 {
        return Ok(target.clone());
    }
    let mut tried = Vec::new();
    for host in hosts {
        let answer = tokio::time::timeout(PRIMARY_PROBE_TIMEOUT, async {
            let client = connect(&host).await?;
            let row = client.query_one("SELECT pg_is_in_recovery()", &[]).await?;
            Ok::<bool, Error>(row.get(0))
        })
        .await;
        let name = host.redacted();
        match answer {
            Ok(Ok(false)) => return Ok(host),
            Ok(Ok(true)) => tried.push(format!("{name} is a standby")),
            Ok(Err(e)) => tried.push(format!("{name}: {e}")),
            Err(_) => tried.push(format!(
                "{name}: no answer within {PRIMARY_PROBE_TIMEOUT:?}"
            )),
        }
    }
    Err(Error::NoPrimary(tried.join("; ")))
}

/// How long a host of a multi-host URL may take to say whether it is the primary.
const PRIMARY_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn watch_connection<F>(connection: F)
where
    F: std::future::Future<Output = std::result::Result<(), tokio_postgres::Error>>,
{
    if let Err(error) = connection.await {
        tracing::debug!(error = %error, "sql connection closed");
    }
}

/// What a database's outbox says of polling relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Polling {
    /// No outbox in this database at all.
    NoOutbox,
    /// An outbox from before polling relays (0.5.0).
    Unsupported,
    /// Polling relays are there, but this login may not ask whether they
    /// are on (it lacks the relay role).
    Hidden,
    Off,
    On,
}

/// What the database's outbox offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outbox {
    /// `pg_outbox <version>` for the extension, `pg_outbox SQL edition
    /// <version>` for the SQL edition; `None` without either.
    pub installed: Option<String>,
    pub polling: Polling,
    /// Whether dead letters can park their aggregate (0.6.0 and later).
    pub parking: bool,
}

/// Asks the database what its outbox offers. The SQL edition marks its
/// version in the schema's comment. Read from the catalogs, so that a login
/// without any privilege on schema outbox learns what is there too.
pub async fn probe(sql: &impl GenericClient) -> Result<Outbox> {
    let row = sql
        .query_one(
            "WITH outbox AS (SELECT oid FROM pg_namespace WHERE nspname = 'outbox'),
                  f AS (SELECT p.oid, p.proname, p.pronargs FROM pg_proc p, outbox
                         WHERE p.pronamespace = outbox.oid)
             SELECT coalesce((SELECT 'pg_outbox ' || extversion FROM pg_extension WHERE extname = 'pg_outbox'),
                             (SELECT d FROM outbox, obj_description(outbox.oid, 'pg_namespace') d
                               WHERE d LIKE 'pg_outbox SQL edition %')),
                    EXISTS (SELECT FROM pg_class c, outbox
                             WHERE c.relnamespace = outbox.oid AND c.relname = 'events'),
                    (SELECT has_schema_privilege(outbox.oid, 'USAGE') AND has_function_privilege(f.oid, 'EXECUTE')
                       FROM f, outbox WHERE f.proname = 'poll_status' AND f.pronargs = 0),
                    EXISTS (SELECT FROM f WHERE f.proname = 'parked' AND f.pronargs = 3)",
            &[],
        )
        .await?;
    let has_events: bool = row.get(1);
    let polling = match row.get::<_, Option<bool>>(2) {
        _ if !has_events => Polling::NoOutbox,
        None => Polling::Unsupported,
        Some(false) => Polling::Hidden,
        Some(true) => {
            let enabled: bool = sql
                .query_one("SELECT enabled FROM outbox.poll_status()", &[])
                .await?
                .get(0);
            if enabled {
                Polling::On
            } else {
                Polling::Off
            }
        }
    };
    Ok(Outbox {
        installed: row.get(0),
        polling,
        parking: has_events && row.get::<_, bool>(3),
    })
}
