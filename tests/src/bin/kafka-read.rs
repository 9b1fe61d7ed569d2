//! Prints what a `read_committed` Kafka consumer receives; used by the demo.
//!
//! kafka-read BOOTSTRAP TOPIC[,TOPIC...] COUNT [TIMEOUT_SECONDS]

use std::process::ExitCode;
use std::time::Duration;

use pg_outbox_tests::{Reader, Stack};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(bootstrap), Some(topics), Some(Ok(count))) = (
        args.first(),
        args.get(1),
        args.get(2).map(|c| c.parse::<usize>()),
    ) else {
        eprintln!("usage: kafka-read BOOTSTRAP TOPIC[,TOPIC...] COUNT [TIMEOUT_SECONDS]");
        return ExitCode::from(2);
    };
    let timeout = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(60);
    let stack = Stack {
        admin_url: String::new(),
        forwarder_url: String::new(),
        owner_url: String::new(),
        kafka: bootstrap.clone(),
    };
    let topics: Vec<&str> = topics.split(',').collect();
    let mut reader = Reader::new(&stack, &topics);
    let mut printed = 0;
    let outcome = reader
        .try_read_until(Duration::from_secs(timeout), |records| {
            for r in &records[printed..] {
                println!(
                    "{}[{}]@{}  key={}  seq={}  type={}  id={}  value={}",
                    r.topic,
                    r.partition,
                    r.offset,
                    r.key,
                    r.headers.get("aggregate_seq").map_or("?", String::as_str),
                    r.headers.get("event_type").map_or("?", String::as_str),
                    r.headers.get("event_id").map_or("?", String::as_str),
                    r.payload
                );
            }
            printed = records.len();
            records.len() >= count
        })
        .await;
    if outcome {
        ExitCode::SUCCESS
    } else {
        eprintln!("kafka-read: only {printed} of {count} records arrived within {timeout} s");
        ExitCode::FAILURE
    }
}
