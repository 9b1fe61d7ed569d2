//! Lists or deletes the test stack's Kafka topics by name prefix, so that
//! benches and test runs do not leave gigabytes behind in the broker.
//!
//! kafka-topics BOOTSTRAP list [PREFIX]
//! kafka-topics BOOTSTRAP drop PREFIX

use std::process::ExitCode;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;

const USAGE: &str =
    "usage: kafka-topics BOOTSTRAP list [PREFIX] | kafka-topics BOOTSTRAP drop PREFIX";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(bootstrap), Some(verb)) = (args.first(), args.get(1)) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let prefix = args.get(2).map_or("", String::as_str);
    if verb == "drop" && prefix.is_empty() {
        eprintln!("kafka-topics: drop needs a non-empty PREFIX ({USAGE})");
        return ExitCode::from(2);
    }
    let admin: AdminClient<DefaultClientContext> = match ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
    {
        Ok(admin) => admin,
        Err(e) => {
            eprintln!("kafka-topics: {e}");
            return ExitCode::FAILURE;
        }
    };
    let metadata = match admin.inner().fetch_metadata(None, Duration::from_secs(30)) {
        Ok(metadata) => metadata,
        Err(e) => {
            eprintln!("kafka-topics: listing topics at {bootstrap}: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Internal topics (__consumer_offsets, __transaction_state) are never ours.
    let topics: Vec<&str> = metadata
        .topics()
        .iter()
        .map(|t| t.name())
        .filter(|name| name.starts_with(prefix) && !name.starts_with("__"))
        .collect();
    match verb.as_str() {
        "list" => {
            for topic in topics {
                println!("{topic}");
            }
            ExitCode::SUCCESS
        }
        "drop" => {
            let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(60)));
            let mut failed = 0;
            // A few hundred names per request keeps each request small.
            for chunk in topics.chunks(200) {
                match admin.delete_topics(chunk, &options).await {
                    Ok(results) => {
                        for result in results {
                            if let Err((name, code)) = result {
                                eprintln!("kafka-topics: deleting {name}: {code}");
                                failed += 1;
                            }
                        }
                    }
                    Err(e) => {
                        eprintln!("kafka-topics: deleting topics: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            println!("deleted {} topic(s) named {prefix}*", topics.len() - failed);
            if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        _ => {
            eprintln!("kafka-topics: unknown verb {verb:?} ({USAGE})");
            ExitCode::from(2)
        }
    }
}
