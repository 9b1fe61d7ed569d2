//! A primary and a physical standby of a test's own (`scripts/stack` in a
//! directory and on ports apart from the shared cluster), for failovers.
//! A failover kills the primary and promotes the standby; a new standby can
//! then be made where the old primary was, so the two nodes swap roles and
//! the pair fails over again.

use std::path::PathBuf;
use std::time::Duration;

use crate::{
    free_port, stack_command_with, try_connect, unique, wait_until, with_database, Stack, TestDb,
};

struct Node {
    data: PathBuf,
    log: PathBuf,
    port: u16,
}

pub struct Pair {
    dir: PathBuf,
    nodes: [Node; 2],
    /// Which of `nodes` is the primary.
    primary: usize,
    /// Failovers so far.
    pub failovers: usize,
}

impl Pair {
    /// Starts a primary and a streaming standby of it.
    pub fn up() -> Pair {
        let base = std::env::var("STACK_DIR").expect("STACK_DIR from scripts/stack up");
        let dir = PathBuf::from(base).join(unique("pair"));
        let node = |name: &str| Node {
            data: dir.join(name),
            log: dir.join(format!("{name}.log")),
            port: free_port(),
        };
        let pair = Pair {
            nodes: [node("a"), node("b")],
            dir,
            primary: 0,
            failovers: 0,
        };
        pair.stack(&["up-pg"]);
        pair.stack(&["standby", "up"]);
        pair
    }

    fn primary(&self) -> &Node {
        &self.nodes[self.primary]
    }

    fn standby(&self) -> &Node {
        &self.nodes[1 - self.primary]
    }

    /// Runs `scripts/stack` on this pair, with its present roles.
    pub fn stack(&self, args: &[&str]) {
        let (p, s) = (self.primary(), self.standby());
        let (dir, pdata, plog, pport, sdata, slog, sport) = (
            self.dir.display().to_string(),
            p.data.display().to_string(),
            p.log.display().to_string(),
            p.port.to_string(),
            s.data.display().to_string(),
            s.log.display().to_string(),
            s.port.to_string(),
        );
        stack_command_with(
            args,
            &[
                ("OUTBOX_STACK_DIR", &dir),
                ("OUTBOX_PGDATA", &pdata),
                ("OUTBOX_PG_LOG", &plog),
                ("OUTBOX_PG_PORT", &pport),
                ("OUTBOX_STANDBY_DATA", &sdata),
                ("OUTBOX_STANDBY_LOG", &slog),
                ("OUTBOX_STANDBY_PORT", &sport),
            ],
        );
    }

    /// Both hosts, as an application or the forwarder names them: by two
    /// names, as the hosts of a real pair have, so that what names the
    /// database in Kafka must not follow the host the forwarder reaches.
    pub fn url(&self, credentials: &str) -> String {
        format!(
            "postgres://{credentials}@127.0.0.1:{},localhost:{}/postgres?sslmode=disable",
            self.nodes[0].port, self.nodes[1].port
        )
    }

    /// The pair as a test's stack: writers and the owner reach whichever
    /// node is the primary, the forwarder names both hosts.
    pub fn as_stack(&self) -> Stack {
        let admin_url = self.url("postgres:postgres") + "&target_session_attrs=read-write";
        Stack {
            admin_url: admin_url.clone(),
            owner_url: admin_url,
            forwarder_url: self.url("outbox_forwarder:forwarder"),
            kafka: Stack::from_env().kafka,
        }
    }

    /// SIGKILL to the primary's postmaster.
    pub fn kill_primary(&self) {
        self.stack(&["kill-pg"]);
    }

    /// Promotes the standby: the nodes swap roles, and the pair has no
    /// standby until `standby_up`.
    pub fn promote(&mut self) {
        self.stack(&["standby", "promote"]);
        self.primary = 1 - self.primary;
        self.failovers += 1;
    }

    /// Makes a new standby of the primary where the old primary was.
    pub fn standby_up(&self) {
        self.stack(&["standby", "up"]);
    }

    /// Waits until the standby holds a copy of `db`'s slot that it can
    /// take over (17 and later: synced, not temporary). The standby's copy
    /// becomes usable once the primary's slot has moved past a
    /// running-transactions record the standby replayed; writers must be
    /// running, and this asks the primary for such records.
    pub async fn wait_slot_synced(&self, db: &TestDb, timeout: Duration) {
        let standby_url = format!(
            "postgres://postgres:postgres@127.0.0.1:{}/postgres?sslmode=disable",
            self.standby().port
        );
        // Fresh connections each round: either node may be restarting.
        wait_until(timeout, "a usable copy of the slot on the standby", || async {
            if let Ok(primary) =
                try_connect(&with_database(&db.stack.admin_url, &db.name)).await
            {
                let _ = primary
                    .batch_execute("SELECT pg_log_standby_snapshot()")
                    .await;
            }
            let Ok(standby) = try_connect(&standby_url).await else {
                return false;
            };
            matches!(
                standby
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND synced AND NOT temporary",
                        &[&db.slot],
                    )
                    .await,
                Ok(Some(_))
            )
        })
        .await;
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Keep the logs of a failed test; stop the servers.
            eprintln!("the pair's directory is kept: {}", self.dir.display());
            for node in &self.nodes {
                let pid = std::fs::read_to_string(node.data.join("postmaster.pid"));
                if let Some(pid) = pid.ok().and_then(|p| p.lines().next().map(str::to_owned)) {
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &pid])
                        .status();
                }
            }
            return;
        }
        self.stack(&["standby", "down"]);
        self.stack(&["down-pg"]);
        let _gone = std::fs::remove_dir_all(&self.dir);
    }
}
