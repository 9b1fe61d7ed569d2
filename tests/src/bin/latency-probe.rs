//! Commit-to-Kafka latency at a fixed rate, for `bench/forwarder_latency.sh`.
//!
//! latency-probe PGURL BOOTSTRAP TOPIC RATE SECONDS [WARMUP_SECONDS]
//!
//! Creates TOPIC with `message.timestamp.type=LogAppendTime`, emits RATE
//! single-event transactions per second for SECONDS (aggregate type `lat`),
//! each payload carrying the database clock at emit, and reads TOPIC with a
//! `read_committed` consumer. Prints one line: events sent and received, and
//! p50/p99/max in milliseconds of (Kafka append time - emit clock) and
//! (consumer receive time - emit clock), leaving out the events of the first
//! WARMUP_SECONDS (default 5: a new topic's metadata, partition leaders and
//! the consumer's group join). A forwarder must route aggregate type `lat`
//! to TOPIC.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Message};

/// Connections the writer spreads the rate over.
const WRITERS: u32 = 2;

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn percentile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index] as f64 / 1000.0
}

fn summary(mut micros: Vec<i64>) -> String {
    micros.sort_unstable();
    format!(
        "p50 {:.1} p99 {:.1} max {:.1}",
        percentile(&micros, 0.5),
        percentile(&micros, 0.99),
        percentile(&micros, 1.0)
    )
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(pg_url), Some(bootstrap), Some(topic), Some(Ok(rate)), Some(Ok(seconds))) = (
        args.first(),
        args.get(1),
        args.get(2),
        args.get(3).map(|r| r.parse::<u32>()),
        args.get(4).map(|s| s.parse::<u64>()),
    ) else {
        eprintln!("usage: latency-probe PGURL BOOTSTRAP TOPIC RATE SECONDS");
        return ExitCode::from(2);
    };
    let warmup = args.get(5).and_then(|w| w.parse().ok()).unwrap_or(5);
    match probe(pg_url, bootstrap, topic, rate.max(1), seconds, warmup).await {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("latency-probe: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn probe(
    pg_url: &str,
    bootstrap: &str,
    topic: &str,
    rate: u32,
    seconds: u64,
    warmup: u64,
) -> Result<String, String> {
    let measured_from = now_micros() + i64::try_from(warmup).unwrap_or(0) * 1_000_000;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .map_err(|e| e.to_string())?;
    let new_topic = NewTopic::new(topic, 3, TopicReplication::Fixed(1))
        .set("message.timestamp.type", "LogAppendTime");
    admin
        .create_topics(&[new_topic], &AdminOptions::new())
        .await
        .map_err(|e| e.to_string())?;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("latency-probe-{}", now_micros()))
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "5")
        .create()
        .map_err(|e| e.to_string())?;
    consumer.subscribe(&[topic]).map_err(|e| e.to_string())?;

    let sent = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (client, connection) = tokio_postgres::connect(pg_url, tokio_postgres::NoTls)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let sent = sent.clone();
        writers.push(tokio::spawn(async move {
            let statement = client
                .prepare(
                    "SELECT outbox.emit_event('lat', $1, 'Tick', \
                     jsonb_build_object('t', (extract(epoch FROM clock_timestamp()) * 1e6)::bigint))",
                )
                .await?;
            let mut tick = tokio::time::interval(Duration::from_secs(1) * WRITERS / rate);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let end = Instant::now() + Duration::from_secs(seconds);
            let mut n = 0u64;
            while Instant::now() < end {
                tick.tick().await;
                let aggregate = format!("w{w}-{}", n % 50);
                client.execute(&statement, &[&aggregate]).await?;
                sent.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }

    let mut append = Vec::new();
    let mut receive = Vec::new();
    let mut received = 0u64;
    let mut writing = true;
    let mut deadline = Instant::now() + Duration::from_secs(seconds + 30);
    loop {
        if writing && writers.iter().all(|w| w.is_finished()) {
            writing = false;
            deadline = Instant::now() + Duration::from_secs(30);
        }
        if !writing && received >= sent.load(Ordering::Relaxed) {
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        let message = match tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await
        {
            Ok(Ok(message)) => message,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => continue,
        };
        let arrived = now_micros();
        received += 1;
        let Some(clock) = message
            .payload()
            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
            .and_then(|v| v.get("t")?.as_i64())
        else {
            continue;
        };
        if clock < measured_from {
            continue;
        }
        receive.push(arrived - clock);
        if let Some(ms) = message.timestamp().to_millis() {
            append.push(ms * 1000 - clock);
        }
    }
    for writer in writers {
        writer
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    }
    Ok(format!(
        "sent {} received {} measured {} | append {} | receive {}",
        sent.load(Ordering::Relaxed),
        received,
        receive.len(),
        summary(append),
        summary(receive)
    ))
}
