//! `outbox-forwarder check`: is everything in place for `run`? One line per
//! check, with a fix hint when it fails. Never prints a password.

use std::time::Duration;

use crate::config::{Config, SourceKind};
use crate::database::{self, Outbox, Polling};
use crate::publication;
use crate::slot::{self, Severity};

mod kafka;

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// Passes, with something the operator should know.
    pub warning: bool,
    /// What was found, or what to do.
    pub detail: String,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            ok: true,
            warning: false,
            detail: detail.into(),
        }
    }
    fn warn(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            warning: true,
            ..Check::ok(name, detail)
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            ok: false,
            ..Check::ok(name, detail)
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = match (self.ok, self.warning) {
            (false, _) => "FAIL",
            (true, true) => "warn",
            (true, false) => "ok  ",
        };
        write!(f, "{mark}  {:<12} {}", self.name, self.detail)
    }
}

/// Runs every check; later PostgreSQL checks are skipped when it is unreachable.
pub async fn run(config: &Config) -> Vec<Check> {
    let mut checks = postgres(config).await;
    checks.extend(kafka::checks(config).await);
    checks
}

async fn postgres(config: &Config) -> Vec<Check> {
    let (client, connected) = match connect_primary(config).await {
        Ok(connected) => connected,
        Err(refused) => return vec![refused],
    };
    let mut checks = vec![connected];
    let slot_source = config.source == SourceKind::Slot;
    if slot_source {
        checks.push(wal_level(&client).await);
        checks.push(replication_role(&client, config).await);
    }
    let outbox = match database::probe(&client).await {
        Ok(outbox) => outbox,
        Err(e) => {
            checks.push(Check::fail("extension", e.to_string()));
            return checks;
        }
    };
    checks.push(extension(&outbox, config));
    checks.push(privileges(&client, config).await);
    checks.push(connect_privilege(&client).await);
    if config.parks_aggregates() {
        checks.push(parked(&client, &outbox).await);
    }
    if !slot_source {
        checks.push(polling(&client, &outbox).await);
        return checks;
    }
    checks.push(publication(&client, config).await);
    checks.push(slot_check(&client, config).await);
    checks.push(retention(&client, config).await);
    checks.push(failover(&client, config).await);
    checks
}

/// Connects to the host `run` would stream from (of several, the primary),
/// and says how: over TLS or not.
async fn connect_primary(config: &Config) -> Result<(tokio_postgres::Client, Check), Check> {
    let target = config.postgres.redacted();
    let primary = async {
        let primary = database::primary(&config.postgres).await?;
        Ok::<_, crate::error::Error>((database::connect(&primary).await?, primary.redacted()))
    };
    let (client, target) = match tokio::time::timeout(Duration::from_secs(30), primary).await {
        Ok(Ok((client, primary))) if primary != target => {
            (client, format!("{primary} (the primary of {target})"))
        }
        Ok(Ok((client, _))) => (client, target),
        Ok(Err(e)) => {
            let hint = if e.to_string().contains("TLS") {
                "check sslmode and sslrootcert (the CA that signed the server's certificate)"
            } else {
                "check the URL, the password and pg_hba.conf"
            };
            return Err(Check::fail(
                "postgres",
                format!("cannot connect to {target}: {e}; {hint}"),
            ));
        }
        Err(_) => {
            return Err(Check::fail(
                "postgres",
                format!("no answer from {target} within 30 s; check host, port and firewall"),
            ))
        }
    };
    let sslmode = config.postgres.tls().mode.name();
    let tls = match client
        .query_one(
            "SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND ssl",
            &[],
        )
        .await
    {
        Ok(row) => format!("over {} (sslmode {sslmode})", row.get::<_, String>(0)),
        Err(_) => format!("without TLS (sslmode {sslmode})"),
    };
    let connected = Check::ok("postgres", format!("connected to {target} {tls}"));
    Ok((client, connected))
}

async fn wal_level(client: &tokio_postgres::Client) -> Check {
    match client.query_one("SHOW wal_level", &[]).await {
        Ok(row) if row.get::<_, String>(0) == "logical" => Check::ok("wal_level", "logical"),
        Ok(row) => Check::fail(
            "wal_level",
            format!(
                "is {}; set wal_level = logical in postgresql.conf and restart PostgreSQL",
                row.get::<_, String>(0)
            ),
        ),
        Err(e) => Check::fail("wal_level", e.to_string()),
    }
}

async fn replication_role(client: &tokio_postgres::Client, config: &Config) -> Check {
    match client
        .query_one(
            "SELECT rolreplication FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => {
            Check::ok("replication", "the role has the REPLICATION attribute")
        }
        Ok(_) => Check::fail(
            "replication",
            format!(
                "role {} lacks REPLICATION; run ALTER ROLE {} REPLICATION",
                config.postgres.user(),
                config.postgres.user()
            ),
        ),
        Err(e) => Check::fail("replication", e.to_string()),
    }
}

/// The extension, or the SQL edition.
fn extension(outbox: &Outbox, config: &Config) -> Check {
    match &outbox.installed {
        Some(installed) => Check::ok("extension", installed.clone()),
        None => Check::fail(
            "extension",
            format!(
                "pg_outbox is not installed in {}; run CREATE EXTENSION pg_outbox as a superuser, or on managed PostgreSQL install sql/pg_outbox_sql.sql as the database owner",
                config.postgres.dbname()
            ),
        ),
    }
}

async fn publication(client: &tokio_postgres::Client, config: &Config) -> Check {
    let name = &config.publication;
    let carries = match config.shard {
        Some(shard) => format!("shard {shard}"),
        None => "every event".to_owned(),
    };
    let exists = match publication::exists(client, name).await {
        Ok(exists) => exists,
        Err(e) => return Check::fail("publication", e.to_string()),
    };
    if !exists {
        return if config.create_missing {
            Check::ok(
                "publication",
                format!("{name} will be created on start ({carries})"),
            )
        } else {
            Check::fail(
                "publication",
                format!("{name} is missing; run outbox-forwarder publication create"),
            )
        };
    }
    let wanted = config.shard.map(|s| s.row_filter());
    match publication::row_filter(client, name).await {
        Ok(filter) if filter == wanted => {
            Check::ok("publication", format!("{name} exists ({carries})"))
        }
        Ok(filter) => Check::fail(
            "publication",
            format!(
                "{name} filters outbox.events by {}, but this forwarder carries {carries}; give it a publication of its own",
                filter.as_deref().unwrap_or("nothing")
            ),
        ),
        Err(e) => Check::fail("publication", e.to_string()),
    }
}

async fn slot_check(client: &tokio_postgres::Client, config: &Config) -> Check {
    match slot::slot_exists(client, &config.slot).await {
        Ok(true) => Check::ok("slot", format!("{} exists", config.slot)),
        Ok(false) => match client
            .query_one(
                "SELECT current_setting('max_replication_slots')::int > (SELECT count(*) FROM pg_replication_slots)",
                &[],
            )
            .await
        {
            Ok(row) if row.get::<_, bool>(0) && config.create_missing => {
                Check::ok("slot", format!("{} will be created on start", config.slot))
            }
            Ok(row) if row.get::<_, bool>(0) => Check::fail(
                "slot",
                format!("{} is missing; run outbox-forwarder slot create", config.slot),
            ),
            Ok(_) => Check::fail(
                "slot",
                "max_replication_slots is used up; raise it or drop an unused slot",
            ),
            Err(e) => Check::fail("slot", e.to_string()),
        },
        Err(e) => Check::fail("slot", e.to_string()),
    }
}

/// The slot's retained WAL against the server's limits.
async fn retention(client: &tokio_postgres::Client, config: &Config) -> Check {
    match slot::retention(client, &config.slot).await {
        Ok(retention) => {
            let findings = retention.findings(&config.slot);
            let text = findings
                .iter()
                .map(|(_, text)| text.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            if findings.is_empty() {
                Check::ok("retention", retention.summary())
            } else if findings
                .iter()
                .any(|(severity, _)| *severity == Severity::Error)
            {
                Check::fail("retention", text)
            } else {
                Check::warn("retention", text)
            }
        }
        Err(e) => Check::fail("retention", e.to_string()),
    }
}

/// Dead letters that park their aggregates: the functions exist, and what
/// is parked waits for redrive.
async fn parked(client: &tokio_postgres::Client, outbox: &Outbox) -> Check {
    if !outbox.parking {
        return Check::fail(
            "dead letters",
            "dead letters that keep order need pg_outbox 0.6.0 or later (ALTER EXTENSION pg_outbox UPDATE, or the SQL edition's file again), or pass --dead-letter-unordered",
        );
    }
    match crate::parking::figures(client).await {
        Ok((0, _)) => Check::ok("dead letters", "none parked; a dead letter parks its aggregate"),
        Ok((parked, oldest)) => Check::warn(
            "dead letters",
            format!(
                "{parked} aggregates parked behind a dead letter, the oldest for {oldest:.0} s; fix the cause, then run outbox-forwarder redrive"
            ),
        ),
        Err(e) => Check::fail("dead letters", e.to_string()),
    }
}

/// Polling relays: polling is on, with what is pending.
async fn polling(client: &tokio_postgres::Client, outbox: &Outbox) -> Check {
    match outbox.polling {
        Polling::On => {}
        Polling::Off => {
            return Check::fail(
                "polling",
                "off; run SELECT outbox.enable_polling(); as the outbox's owner",
            )
        }
        Polling::Hidden => {
            return Check::fail(
                "polling",
                "this login may not call outbox.poll_status(); see the privileges check",
            )
        }
        Polling::NoOutbox | Polling::Unsupported => {
            return Check::fail(
                "polling",
                "polling needs pg_outbox 0.5.0 or later (ALTER EXTENSION pg_outbox UPDATE, or the SQL edition's file again)",
            )
        }
    }
    match client
        .query_one(
            "SELECT pending_events, leases_held FROM outbox.poll_status()",
            &[],
        )
        .await
    {
        Ok(row) => Check::ok(
            "polling",
            format!(
                "enabled; {} events pending, {} aggregates leased",
                row.get::<_, i64>(0),
                row.get::<_, i64>(1)
            ),
        ),
        Err(e) => Check::fail("polling", crate::error::describe_postgres(&e)),
    }
}

/// Whether the login holds this database's relay role: the role granted
/// EXECUTE on `outbox.ensure_publication`, read from pg_catalog, which needs
/// no privilege on schema outbox. Warns while the relay role is still held
/// by `outbox_relay`, the cluster-wide role of releases before 0.7.0, whose
/// members reach every database's outbox.
async fn privileges(client: &tokio_postgres::Client, config: &Config) -> Check {
    let rows = client
        .query(
            "SELECT a.grantee::regrole::text, pg_has_role(current_user, a.grantee, 'USAGE'),
                    coalesce(a.grantee <> to_regrole('outbox_relay')
                             AND pg_has_role(to_regrole('outbox_relay')::oid, a.grantee, 'MEMBER'), false)
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.pronamespace = to_regnamespace('outbox') AND p.proname = 'ensure_publication'
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner",
            &[],
        )
        .await;
    let rows = match rows {
        Ok(rows) if !rows.is_empty() => rows,
        Ok(_) => {
            return Check::fail(
                "privileges",
                "no relay role is granted in schema outbox; is the extension installed?",
            )
        }
        Err(e) => return Check::fail("privileges", e.to_string()),
    };
    let user = config.postgres.user();
    let role: String = rows[0].get(0);
    let Some(held) = rows.iter().find(|row| row.get::<_, bool>(1)) else {
        return Check::fail("privileges", format!("run GRANT {role} TO {user}"));
    };
    let role: String = held.get(0);
    if held.get::<_, bool>(2) {
        return Check::warn(
            "privileges",
            format!(
                "member of {role}, which the cluster-wide role outbox_relay still holds: its members reach this \
                 database's outbox from every database's login; once the relays of this database hold {role}, \
                 run REVOKE {role} FROM outbox_relay"
            ),
        );
    }
    Check::ok("privileges", format!("member of {role}"))
}

/// Whether logins of other databases may connect here. The outbox's roles
/// keep other databases' logins out of its tables and functions, but a
/// login with REPLICATION may create a slot in any database it can connect
/// to and decode the events through the publication: PostgreSQL checks no
/// table privilege there. Only CONNECT stops it, and the install granted
/// CONNECT to the database's outbox roles so that PUBLIC's can go.
async fn connect_privilege(client: &tokio_postgres::Client) -> Check {
    let row = client
        .query_one(
            "SELECT current_database()::text, has_database_privilege('public', current_database(), 'CONNECT')",
            &[],
        )
        .await;
    match row {
        Ok(row) if row.get::<_, bool>(1) => {
            let database: String = row.get(0);
            Check::warn(
                "connect",
                format!(
                    "every role may connect to {database}, so any login with REPLICATION on this cluster can \
                     create a slot here and read the outbox's events; run REVOKE CONNECT ON DATABASE {database} \
                     FROM PUBLIC (its outbox roles keep CONNECT)"
                ),
            )
        }
        Ok(row) => Check::ok(
            "connect",
            format!(
                "only roles granted CONNECT may connect to {}",
                row.get::<_, String>(0)
            ),
        ),
        Err(e) => Check::fail("connect", e.to_string()),
    }
}

/// Whether the slot survives a promotion of a standby: on 17 and later a
/// failover slot, kept in step on standbys that synchronise slots, which
/// the primary waits for when `synchronized_standby_slots` names them.
async fn failover(client: &tokio_postgres::Client, config: &Config) -> Check {
    let row = match client
        .query_one(
            "SELECT current_setting('server_version_num')::int, \
                    current_setting('synchronized_standby_slots', true), \
                    (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical' AND active)",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::fail("failover", e.to_string()),
    };
    let (version, waits_for, standbys): (i32, Option<String>, i64) =
        (row.get(0), row.get(1), row.get(2));
    if version < 170000 {
        return Check::ok(
            "failover",
            format!("PostgreSQL {} has no failover slots: a promoted standby has no slot, and the forwarder's first start there delivers the stored events again", version / 10000),
        );
    }
    if !config.failover_slot {
        return Check::ok(
            "failover",
            "an ordinary slot (no_failover_slot): a promoted standby will not have it",
        );
    }
    let waits_for = waits_for.unwrap_or_default();
    match (standbys, waits_for.is_empty()) {
        (0, _) => Check::ok("failover", "a failover slot; no standby streams from this server"),
        (n, true) => Check::warn(
            "failover",
            format!("a failover slot, but synchronized_standby_slots is empty while {n} standby(s) stream from this server through physical slots: the forwarder can get ahead of a standby's copy of the slot; name their physical slots there, and give each standby sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name and a dbname in primary_conninfo"),
        ),
        (n, false) => Check::ok(
            "failover",
            format!("a failover slot; {n} standby(s) stream, and the forwarder waits for {waits_for} (each needs sync_replication_slots = on)"),
        ),
    }
}
