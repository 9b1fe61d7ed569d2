//! Encrypted and authenticated connections: TLS to PostgreSQL with the
//! server's certificate verified (SQL and replication connections alike),
//! SASL over TLS to Kafka, refusals reported in one line, secrets never shown.

use std::time::Duration;

use pg_outbox_tests::{
    forwarder_command, read_every_committed, write_transactions, Forwarder, Reader, Secured, TestDb,
};

const WAIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn events_travel_over_verified_tls_and_sasl_ssl_exactly_once() {
    let secured = Secured::from_env();
    let db = TestDb::create("tls").await;
    let topic = db.create_topic("box", 3).await;
    let url = secured.postgres_url(&db, "verify-full", &secured.ca);
    let forwarder = Forwarder::spawn_connected(
        &db,
        &[
            "--postgres-url",
            &url,
            "--kafka-bootstrap",
            &secured.kafka,
            "--kafka-security-protocol",
            "sasl-ssl",
            "--kafka-sasl-username",
            &secured.sasl_user,
            "--kafka-ssl-ca",
            &secured.ca,
            "--delivery",
            "exactly-once",
        ],
        // The password from the environment, as the docs advise.
        &[("OUTBOX_KAFKA_SASL_PASSWORD", &secured.sasl_password)],
    );
    db.wait_slot_active(WAIT).await;
    write_transactions(&mut db.admin().await, "box", 5, 200).await;
    let mut reader = Reader::new(&db.stack, &[&topic]);
    let verdict = read_every_committed(&db, &mut reader, &topic, WAIT).await;
    eprintln!("{verdict:?}");
    assert!(verdict.committed > 200, "{verdict:?}");
    verdict.assert_exactly_once();

    // Every connection of the forwarder to this database, the walsender of
    // the replication stream included, is encrypted.
    let connections = db
        .admin()
        .await
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
              WHERE a.usename = 'outbox_forwarder' AND a.datname = current_database()",
            &[],
        )
        .await
        .expect("pg_stat_ssl");
    let seen: Vec<(String, bool)> = connections.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(
        seen.iter().any(|(kind, _)| kind == "walsender"),
        "the replication connection is there: {seen:?}"
    );
    assert!(seen.iter().all(|(_, ssl)| *ssl), "all over TLS: {seen:?}");

    let log = forwarder.log.clone();
    let status = forwarder.signal_and_wait("TERM").await;
    assert_eq!(status.code(), Some(0));
    let log = std::fs::read_to_string(log).unwrap_or_default();
    assert!(!log.contains(&secured.sasl_password), "{log}");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_certificates_and_credentials_are_one_line_each_without_secrets() {
    let secured = Secured::from_env();
    let db = TestDb::create("tls_refused").await;
    let good_pg = secured.postgres_url(&db, "verify-full", &secured.ca);
    let kafka_tls = |password: &'static str, ca: Option<&str>| {
        let mut args = vec![
            "--kafka-bootstrap".to_owned(),
            secured.kafka.clone(),
            "--kafka-security-protocol".into(),
            "sasl-ssl".into(),
            "--kafka-sasl-username".into(),
            secured.sasl_user.clone(),
            "--kafka-sasl-password".into(),
            password.into(),
        ];
        if let Some(ca) = ca {
            args.extend(["--kafka-ssl-ca".into(), ca.to_owned()]);
        }
        args
    };
    let check = |pg: String, kafka: Vec<String>| {
        let slot = db.slot.clone();
        async move {
            let mut args = vec![
                "check".to_owned(),
                "--slot".into(),
                slot,
                "--postgres-url".into(),
                pg,
            ];
            args.extend(kafka);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            forwarder_command(&args).await
        }
    };

    // Everything right: every check passes, and says the session is encrypted.
    let (code, out, err) = check(
        good_pg.clone(),
        kafka_tls("kafka-secret", Some(&secured.ca)),
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("over TLS") && out.contains("verify-full"),
        "{out}"
    );

    let cases: [(&str, String, Vec<String>, &str, &str); 4] = [
        (
            "a server certificate signed by another CA",
            secured.postgres_url(&db, "verify-full", &secured.other_ca),
            kafka_tls("kafka-secret", Some(&secured.ca)),
            "FAIL  postgres",
            "certificate verify failed",
        ),
        (
            "a wrong SASL password",
            good_pg.clone(),
            kafka_tls("wrong-password-41", Some(&secured.ca)),
            "FAIL  kafka",
            "Authentication failed",
        ),
        (
            "a broker certificate the system does not trust",
            good_pg.clone(),
            kafka_tls("wrong-password-42", None),
            "FAIL  kafka",
            "certificate verify failed",
        ),
        (
            "sslmode=require trusts an explicit sslrootcert, as libpq does",
            secured.postgres_url(&db, "require", &secured.other_ca),
            kafka_tls("kafka-secret", Some(&secured.ca)),
            "FAIL  postgres",
            "certificate verify failed",
        ),
    ];
    for (what, pg, kafka, line, reason) in cases {
        let (code, out, err) = check(pg, kafka).await;
        assert_eq!(code, 3, "{what}: {out}{err}");
        let failing: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL")).collect();
        assert_eq!(failing.len(), 1, "{what}: one failing line: {out}");
        assert!(
            failing[0].starts_with(line) && failing[0].contains(reason),
            "{what}: {out}"
        );
        for secret in ["wrong-password-4", "kafka-secret", ":forwarder@"] {
            assert!(
                !out.contains(secret) && !err.contains(secret),
                "{what}: {secret} shown: {out}{err}"
            );
        }
    }

    // `run` stops at once on a refused certificate: retrying cannot help.
    let url = secured.postgres_url(&db, "verify-full", &secured.other_ca);
    let refused = Forwarder::spawn_connected(
        &db,
        &["--postgres-url", &url, "--kafka-bootstrap", &db.stack.kafka],
        &[],
    );
    let log = refused.log.clone();
    let status = refused.wait_exit(Duration::from_secs(30)).await;
    assert_ne!(status.code(), Some(0));
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let last = text.lines().last().unwrap_or_default();
    assert!(last.contains("certificate verify failed"), "{text}");
    db.drop().await;
}
