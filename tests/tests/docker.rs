//! The Docker artifacts cannot be built here (no Docker engine), so this
//! checks what can be checked: the compose file parses and names the three
//! services, every OUTBOX_ variable it sets is one the forwarder reads, and
//! the images build with the same tool versions and commands as scripts/setup.

use std::path::PathBuf;

use pg_outbox_tests::forwarder_command;
use yaml_rust2::YamlLoader;

fn repo_file(path: &str) -> String {
    let full = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

#[tokio::test]
async fn the_compose_file_parses_and_sets_only_variables_the_forwarder_reads() {
    let docs =
        YamlLoader::load_from_str(&repo_file("docker/compose.yaml")).expect("compose.yaml is YAML");
    let services = &docs[0]["services"];
    for name in ["postgres", "kafka", "forwarder"] {
        assert!(!services[name].is_badvalue(), "service {name} is missing");
    }
    let (code, help, _) = forwarder_command(&["run", "--help"]).await;
    assert_eq!(code, 0);
    let env = services["forwarder"]["environment"]
        .as_hash()
        .expect("forwarder environment");
    assert!(!env.is_empty());
    for key in env.keys() {
        let key = key.as_str().expect("string key");
        assert!(
            help.contains(&format!("env: {key}")),
            "outbox-forwarder does not read {key}"
        );
    }
    assert!(
        services["kafka"]["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("apache/kafka:4.")),
        "the official Apache Kafka 4 image"
    );
}

#[test]
fn the_images_build_like_the_setup_script() {
    let env = repo_file("scripts/env.sh");
    let pgrx = env
        .lines()
        .find_map(|l| l.strip_prefix("PGRX_VERSION="))
        .expect("PGRX_VERSION in env.sh");
    let postgres = repo_file("docker/postgres.Dockerfile");
    assert!(postgres.contains(&format!(
        "cargo install cargo-pgrx --version {pgrx} --locked"
    )));
    assert!(postgres.contains("cargo pgrx init --pg15 /usr/lib/postgresql/15/bin/pg_config"));
    assert!(
        postgres.contains("scripts/released-sql.sh"),
        "released upgrade bases are installed"
    );
    assert!(postgres.contains("wal_level=logical"));
    assert!(repo_file("scripts/setup").contains("scripts/released-sql.sh"));
    let forwarder = repo_file("docker/forwarder.Dockerfile");
    assert!(forwarder.contains("cargo build --release -p cdc_forwarder --bin outbox-forwarder"));
    let init = repo_file("docker/initdb/10-pg_outbox.sh");
    assert!(
        init.contains("CREATE EXTENSION IF NOT EXISTS pg_outbox")
            && init.contains("FROM outbox.roles WHERE purpose = 'relay'")
    );
}
