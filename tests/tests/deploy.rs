//! What a deployment is made of, checked with the tools that consume it:
//! the Helm chart with `helm lint --strict` and `helm template`, the alert
//! rules with `promtool check rules` and `promtool test rules`, and the
//! dashboard, the alerts and the compose file against what the forwarder
//! really serves and reads. (scripts/containers test builds and runs the
//! images and the compose quick start themselves.)

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cdc_forwarder::health::Limits;
use cdc_forwarder::metrics::Metrics;
use pg_outbox_tests::forwarder_command;
use yaml_rust2::{Yaml, YamlLoader};

fn repo_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

fn repo_file(path: &str) -> String {
    let full = repo_path(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// Runs a tool scripts/setup installs; returns whether it succeeded, and its
/// standard output when it did, else its standard error too.
fn tool(program: &str, args: &[&str]) -> (bool, String) {
    let output = Command::new(program)
        .args(args)
        .current_dir(repo_path("deploy"))
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (scripts/setup installs it into the cache's tools/bin, which scripts/test puts on PATH)"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        (true, stdout)
    } else {
        (
            false,
            format!("{stdout}{}", String::from_utf8_lossy(&output.stderr)),
        )
    }
}

const REQUIRED: &[&str] = &[
    "--set",
    "kafka.bootstrap=kafka-0:9092\\,kafka-1:9092",
    "--set",
    "postgres.urlSecret.name=orders-forwarder-postgres",
];

fn render(extra: &[&str]) -> (bool, String) {
    let mut args = vec!["template", "orders", "helm/pg-outbox-forwarder"];
    args.extend_from_slice(extra);
    tool("helm", &args)
}

fn manifests(rendered: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(rendered)
        .expect("helm template writes YAML")
        .into_iter()
        .filter(|doc| !doc.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Yaml], kind: &str) -> &'a Yaml {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("no {kind} rendered"))
}

#[test]
fn the_chart_lints_strictly() {
    let (ok, out) = tool(
        "helm",
        &[&["lint", "--strict", "helm/pg-outbox-forwarder"], REQUIRED].concat(),
    );
    assert!(ok, "{out}");
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn the_chart_runs_two_non_root_replicas_probed_on_health_and_readiness() {
    let (ok, out) = render(REQUIRED);
    assert!(ok, "{out}");
    let docs = manifests(&out);
    let deployment = of_kind(&docs, "Deployment");
    assert_eq!(deployment["spec"]["replicas"].as_i64(), Some(2));
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let container = &pod["containers"][0];
    assert_eq!(
        container["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    // A standby that can take over counts as ready, or the
    // PodDisruptionBudget would never let the streaming pod go.
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz?standby=ready")
    );
    assert!(container["resources"]["requests"]["memory"]
        .as_str()
        .is_some());
    assert_eq!(
        of_kind(&docs, "PodDisruptionBudget")["spec"]["maxUnavailable"].as_i64(),
        Some(1)
    );
    assert_eq!(
        of_kind(&docs, "Service")["spec"]["ports"][0]["port"].as_i64(),
        Some(9187)
    );
}

#[test]
fn the_chart_takes_secrets_only_from_a_secret_and_settings_the_forwarder_reads() {
    let (ok, out) = render(REQUIRED);
    assert!(ok, "{out}");
    let docs = manifests(&out);
    let config = of_kind(&docs, "ConfigMap")["data"]
        .as_hash()
        .expect("ConfigMap data");
    let (_, help, _) = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(forwarder_command(&["run", "--help"]));
    for key in config.keys() {
        let key = key.as_str().expect("string key");
        assert!(
            help.contains(&format!("env: {key}")),
            "outbox-forwarder does not read {key}"
        );
        assert!(!key.contains("PASSWORD") && !key.contains("URL"), "{key}");
    }
    let env = &of_kind(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"];
    let url = env
        .as_vec()
        .expect("env")
        .iter()
        .find(|e| e["name"].as_str() == Some("OUTBOX_POSTGRES_URL"))
        .expect("OUTBOX_POSTGRES_URL");
    assert_eq!(
        url["valueFrom"]["secretKeyRef"]["name"].as_str(),
        Some("orders-forwarder-postgres")
    );

    let (ok, out) = render(&["--set", "kafka.bootstrap=k:9092"]);
    assert!(!ok);
    assert!(out.contains("postgres.urlSecret.name is required"), "{out}");
    let (ok, out) = render(
        &[
            REQUIRED,
            &[
                "--set",
                "forwarder.extraConfig.OUTBOX_KAFKA_SASL_PASSWORD=x",
            ],
        ]
        .concat(),
    );
    assert!(!ok);
    assert!(out.contains("secrets go in a Secret"), "{out}");
}

#[test]
fn the_chart_can_ship_the_alert_rules_and_a_service_monitor() {
    let (ok, out) = render(
        &[
            REQUIRED,
            &[
                "--set",
                "metrics.prometheusRule.enabled=true",
                "--set",
                "metrics.serviceMonitor.enabled=true",
            ],
        ]
        .concat(),
    );
    assert!(ok, "{out}");
    let docs = manifests(&out);
    let rule = of_kind(&docs, "PrometheusRule");
    let shipped = &YamlLoader::load_from_str(&repo_file("deploy/prometheus/alerts.yaml"))
        .expect("alerts.yaml")[0]["groups"];
    assert_eq!(&rule["spec"]["groups"], shipped);
    assert_eq!(
        of_kind(&docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"].as_str(),
        Some("metrics")
    );
}

#[test]
fn the_alert_rules_check_and_pass_their_unit_tests() {
    let (ok, out) = tool("promtool", &["check", "rules", "prometheus/alerts.yaml"]);
    assert!(ok, "{out}");
    let (ok, out) = tool(
        "promtool",
        &["test", "rules", "prometheus/alerts.test.yaml"],
    );
    assert!(ok, "{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

/// The `outbox_` metric names an expression uses, without the suffixes a
/// counter's or a histogram's samples add.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find("outbox_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.insert(base.to_owned());
        rest = &tail[end..];
    }
    names
}

#[test]
fn the_dashboard_and_the_alerts_use_only_metrics_the_forwarder_serves() {
    let metrics = Metrics::new(Limits {
        liveness_timeout: Duration::from_secs(60),
        ready_max_lag_bytes: 1,
        ready_max_stall: Duration::from_secs(30),
    });
    // A labelled family is rendered once it has a sample.
    metrics.error("postgres");
    let served = metrics.render();
    let served: BTreeSet<String> = served
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(served.contains("outbox_state"), "{served:?}");
    let exprs = |file: &str| -> String {
        let text = repo_file(file);
        if file.ends_with(".json") {
            let dashboard: serde_json::Value = serde_json::from_str(&text).expect("JSON");
            dashboard["panels"]
                .as_array()
                .expect("panels")
                .iter()
                .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
                .map(|t| t["expr"].as_str().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            text
        }
    };
    for file in [
        "deploy/grafana/pg-outbox-forwarder.json",
        "deploy/prometheus/alerts.yaml",
    ] {
        let used = metric_names(&exprs(file));
        assert!(used.len() >= 8, "{file} uses {used:?}");
        let unknown: Vec<_> = used.difference(&served).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses metrics the forwarder does not serve: {unknown:?}"
        );
    }
}

#[test]
fn the_compose_file_sets_only_variables_the_forwarder_reads() {
    let docs =
        YamlLoader::load_from_str(&repo_file("docker/compose.yaml")).expect("compose.yaml is YAML");
    let services = &docs[0]["services"];
    for name in ["postgres", "kafka", "forwarder"] {
        assert!(!services[name].is_badvalue(), "service {name} is missing");
    }
    let (code, help, _) = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(forwarder_command(&["run", "--help"]));
    assert_eq!(code, 0);
    let env = services["forwarder"]["environment"]
        .as_hash()
        .expect("forwarder environment");
    for key in env.keys() {
        let key = key.as_str().expect("string key");
        assert!(
            help.contains(&format!("env: {key}")),
            "outbox-forwarder does not read {key}"
        );
    }
    for dependency in ["postgres", "kafka"] {
        assert_eq!(
            services["forwarder"]["depends_on"][dependency]["condition"].as_str(),
            Some("service_healthy"),
            "the forwarder starts once {dependency} is healthy"
        );
    }
}
