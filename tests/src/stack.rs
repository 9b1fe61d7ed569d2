//! The running stack (`scripts/stack up`): where PostgreSQL and Kafka are,
//! its faults, and loopback ports.

use std::path::PathBuf;
use std::process::Stdio;

use crate::TestDb;

/// Connection settings of the running stack, from the environment that
/// `scripts/test` exports (the output of `scripts/stack up`).
#[derive(Debug, Clone)]
pub struct Stack {
    pub admin_url: String,
    pub forwarder_url: String,
    /// A database owner without superuser, as managed PostgreSQL gives one.
    pub owner_url: String,
    pub kafka: String,
}

/// A setting `scripts/stack up` prints, from the environment.
fn stack_setting(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| {
        panic!("{key} is not set: run the tests with scripts/test, or export the output of scripts/stack up")
    })
}

impl Stack {
    pub fn from_env() -> Stack {
        let get = stack_setting;
        Stack {
            admin_url: get("PGURL"),
            forwarder_url: get("FORWARDER_PGURL"),
            owner_url: get("OWNER_PGURL"),
            kafka: get("KAFKA_BOOTSTRAP"),
        }
    }
}

/// The stack's TLS endpoints and test credentials, also printed by
/// `scripts/stack up`: its CA, a CA that signed nothing of it, and the
/// broker's SASL_SSL listener with its one user.
#[derive(Debug, Clone)]
pub struct Secured {
    pub ca: String,
    pub other_ca: String,
    pub kafka: String,
    pub sasl_user: String,
    pub sasl_password: String,
}

impl Secured {
    pub fn from_env() -> Secured {
        let get = stack_setting;
        Secured {
            ca: get("TLS_CA"),
            other_ca: get("TLS_OTHER_CA"),
            kafka: get("KAFKA_TLS_BOOTSTRAP"),
            sasl_user: get("KAFKA_SASL_USER"),
            sasl_password: get("KAFKA_SASL_PASSWORD"),
        }
    }

    /// The forwarder's URL for `db` by host name, with TLS verified against `ca`.
    pub fn postgres_url(&self, db: &TestDb, sslmode: &str, ca: &str) -> String {
        let url = db.forwarder_url().replace("@127.0.0.1:", "@localhost:");
        format!("{url}?sslmode={sslmode}&sslrootcert={ca}")
    }
}

/// Runs `scripts/stack` with arguments (restarts for fault tests).
pub fn stack_command(args: &[&str]) {
    stack_command_with(args, &[]);
}

/// The same with environment variables (`OUTBOX_STACK_DIR`, ports: a
/// cluster of the test's own).
pub fn stack_command_with(args: &[&str], env: &[(&str, &str)]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack");
    let status = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .status()
        .expect("scripts/stack");
    assert!(status.success(), "scripts/stack {args:?} failed");
}

/// What `scripts/stack` prints, trimmed, or `None` when it fails.
pub fn stack_output(args: &[&str], env: &[(&str, &str)]) -> Option<String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack");
    let output = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
