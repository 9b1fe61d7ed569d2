//! What consumers see: value formats, and partitions that agree with the
//! Java client's default partitioner.

use std::time::Duration;

use pg_outbox_tests::{emit, Forwarder, Reader, TestDb};

const WAIT: Duration = Duration::from_secs(90);

/// Kafka's murmur2, as the Java client computes it (`Utils.murmur2`),
/// written here independently of librdkafka.
fn java_murmur2(data: &[u8]) -> i32 {
    let seed: u32 = 0x9747_b28c;
    let m: u32 = 0x5bd1_e995;
    let r = 24;
    let length = data.len() as u32;
    let mut h: u32 = seed ^ length;
    for chunk in data.chunks_exact(4) {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(m);
        k ^= k >> r;
        k = k.wrapping_mul(m);
        h = h.wrapping_mul(m);
        h ^= k;
    }
    let tail = &data[data.len() & !3..];
    if tail.len() == 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(m);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(m);
    h ^= h >> 15;
    h as i32
}

/// The partition the Java producer's default partitioner picks for a key.
fn java_partition(key: &str, partitions: i32) -> i32 {
    (java_murmur2(key.as_bytes()) & 0x7fff_ffff) % partitions
}

#[test]
fn the_reference_murmur2_matches_known_java_values() {
    // Values from the Java client's own tests (UtilsTest.testMurmur2).
    assert_eq!(java_murmur2(b"21"), -973932308);
    assert_eq!(java_murmur2(b"foobar"), -790332482);
    assert_eq!(java_murmur2(b"a-little-bit-long-string"), -985981536);
    assert_eq!(java_murmur2(b"a-little-bit-longer-string"), -1486304829);
    assert_eq!(
        java_murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"),
        -58897971
    );
    assert_eq!(java_murmur2(b"abc"), 479470107);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_lands_on_the_partition_a_java_producer_would_choose() {
    let db = TestDb::create("murmur").await;
    let topic = db.create_topic("device", 7).await;
    let forwarder = Forwarder::spawn(&db, &[]);
    db.wait_slot_active(WAIT).await;
    let client = db.admin().await;
    for i in 0..60 {
        emit(
            &client,
            "device",
            &format!("device-{i}-{}", "x".repeat(i % 7)),
            "Pinged",
            "{}",
        )
        .await;
    }
    let mut reader = Reader::new(&db.stack, &[&topic]);
    reader
        .read_until(WAIT, "60 records", |r| r.len() >= 60)
        .await;
    let partitions: std::collections::HashSet<i32> =
        reader.records.iter().map(|r| r.partition).collect();
    assert!(partitions.len() > 3, "keys spread over partitions");
    for r in &reader.records {
        assert_eq!(r.partition, java_partition(&r.key, 7), "key {}", r.key);
    }
    forwarder.kill9().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelope_and_cloudevents_formats_carry_the_identity() {
    for format in ["envelope", "cloudevents"] {
        let db = TestDb::create(&format!("format_{format}")).await;
        let topic = db.create_topic("order", 1).await;
        let forwarder = Forwarder::spawn(&db, &["--value-format", format]);
        db.wait_slot_active(WAIT).await;
        let client = db.admin().await;
        let row = client
            .query_one(
                r#"SELECT event_id::text FROM outbox.emit_event('order', 'o-1', 'Placed', '{"total": 7}', headers => '{"trace": "t-1"}')"#,
                &[],
            )
            .await
            .expect("emit");
        let id: String = row.get(0);
        let mut reader = Reader::new(&db.stack, &[&topic]);
        reader
            .read_until(WAIT, "the record", |r| !r.is_empty())
            .await;
        let record = &reader.records[0];
        assert_eq!(record.event_id(), id);
        if format == "envelope" {
            let value: serde_json::Value =
                serde_json::from_str(&record.payload).expect("JSON value");
            assert_eq!(value["event_id"], id.as_str());
            assert_eq!(value["aggregate_seq"], 1);
            assert_eq!(value["event_type"], "Placed");
            assert_eq!(value["headers"]["trace"], "t-1");
            assert_eq!(value["payload"]["total"], 7);
        } else {
            assert_eq!(record.header("ce_specversion"), "1.0");
            assert_eq!(record.header("ce_id"), id);
            assert_eq!(record.header("ce_type"), "Placed");
            assert_eq!(record.header("ce_subject"), "o-1");
            assert_eq!(record.header("ce_sequence"), "1");
            assert!(record.header("ce_time").ends_with('Z'), "{record:?}");
            let value: serde_json::Value =
                serde_json::from_str(&record.payload).expect("JSON data");
            assert_eq!(value["total"], 7);
        }
        forwarder.kill9().await;
        db.drop().await;
    }
}
