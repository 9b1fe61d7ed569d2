//! The `outbox-forwarder` binary as a child process, and its HTTP endpoints.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::{unique, TestDb};

/// The `outbox-forwarder` binary built by `scripts/test`.
pub fn forwarder_bin() -> PathBuf {
    if let Ok(path) = std::env::var("OUTBOX_FORWARDER_BIN") {
        return PathBuf::from(path);
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/outbox-forwarder");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build -p cdc_forwarder` first (scripts/test does)",
        path.display()
    );
    path
}

/// A running `outbox-forwarder run` process.
pub struct Forwarder {
    child: Child,
    pub log: PathBuf,
}

impl Forwarder {
    /// Starts the forwarder for `db` with extra command-line arguments.
    pub fn spawn(db: &TestDb, extra: &[&str]) -> Forwarder {
        Self::spawn_with_env(db, extra, &[])
    }

    /// Starts the forwarder with extra arguments and environment variables
    /// (`OUTBOX_FAULT` arms a fault point).
    pub fn spawn_with_env(db: &TestDb, extra: &[&str], env: &[(&str, &str)]) -> Forwarder {
        let url = db.forwarder_url();
        let mut args = vec!["--postgres-url", &url, "--kafka-bootstrap", &db.stack.kafka];
        args.extend(extra);
        Self::spawn_connected(db, &args, env)
    }

    /// Starts the forwarder with arguments that include how it connects to
    /// PostgreSQL and Kafka.
    pub fn spawn_connected(db: &TestDb, args: &[&str], env: &[(&str, &str)]) -> Forwarder {
        let log = std::env::temp_dir().join(format!("{}-{}.log", db.name, unique("fwd")));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(forwarder_bin())
            .arg("run")
            .args(["--slot", &db.slot])
            .args(["--topic-template", &db.topic_template()])
            .args(args)
            .env("OUTBOX_LOG", "info,cdc_forwarder=debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn outbox-forwarder");
        Forwarder { child, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    /// Waits for the process to end by itself (a fault point fired).
    pub async fn wait_exit(mut self, timeout: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .expect("forwarder exits in time")
            .expect("exit status")
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL: the process gets no chance to clean up.
    pub async fn kill9(mut self) {
        self.child.start_kill().expect("kill");
        let _status = self.child.wait().await;
    }

    /// Sends a signal and waits for the exit status.
    pub async fn signal_and_wait(mut self, signal: &str) -> std::process::ExitStatus {
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("kill command");
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("forwarder exits within 30 s")
            .expect("exit status")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// GETs `path` from 127.0.0.1:`port`; returns the status code and body.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Parses a Prometheus/OpenMetrics text exposition into sample name (with
/// labels) and value, checking that every line is a comment or a sample.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("not a sample line: {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("not a number in {line:?}"));
        samples.insert(name.to_owned(), value);
    }
    assert!(
        text.trim_end().ends_with("# EOF"),
        "exposition does not end with # EOF"
    );
    samples
}

/// Runs `outbox-forwarder` with arguments to completion: exit code, stdout, stderr.
pub async fn forwarder_command(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(forwarder_bin())
        .args(args)
        .output()
        .await
        .expect("run outbox-forwarder");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
