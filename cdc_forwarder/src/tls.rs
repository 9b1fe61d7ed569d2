//! TLS to PostgreSQL, with libpq's `sslmode` meaning, for both kinds of
//! connection: ordinary SQL (tokio-postgres over OpenSSL) and the
//! replication stream (pgwire-replication over rustls).

use openssl::ssl::{SslConnector, SslFiletype, SslMethod, SslVerifyMode};
use postgres_openssl::MakeTlsConnector;

use crate::config::{PgTls, SslMode};
use crate::error::{Error, Result};

/// The connector for SQL connections.
pub fn sql_connector(tls: &PgTls) -> Result<MakeTlsConnector> {
    let fail = |what: &str, e: openssl::error::ErrorStack| {
        Error::Config(format!("postgres TLS: {what}: {e}"))
    };
    let mut builder = SslConnector::builder(SslMethod::tls()).map_err(|e| fail("setup", e))?;
    if let Some(root) = &tls.root_cert {
        builder
            .set_ca_file(root)
            .map_err(|e| fail(&format!("cannot load sslrootcert {}", root.display()), e))?;
    }
    if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
        builder
            .set_certificate_chain_file(cert)
            .map_err(|e| fail(&format!("cannot load sslcert {}", cert.display()), e))?;
        builder
            .set_private_key_file(key, SslFiletype::PEM)
            .map_err(|e| fail(&format!("cannot load sslkey {}", key.display()), e))?;
    }
    builder.set_verify(if tls.verifies_chain() {
        SslVerifyMode::PEER
    } else {
        SslVerifyMode::NONE
    });
    let mut connector = MakeTlsConnector::new(builder.build());
    let check_host = tls.mode == SslMode::VerifyFull;
    connector.set_callback(move |connect, _host| {
        connect.set_verify_hostname(check_host);
        Ok(())
    });
    Ok(connector)
}

/// The same settings for the replication connection.
pub fn replication_tls(tls: &PgTls, host: &str) -> pgwire_replication::TlsConfig {
    use pgwire_replication::{SslMode as Mode, TlsConfig};
    let mut config = match tls.mode {
        SslMode::Disable => TlsConfig::disabled(),
        SslMode::Prefer => TlsConfig {
            mode: Mode::Prefer,
            ..TlsConfig::disabled()
        },
        SslMode::Require if !tls.verifies_chain() => TlsConfig::require(),
        SslMode::Require | SslMode::VerifyCa => TlsConfig::verify_ca(tls.root_cert.clone()),
        // The host as the expected name: an IP address is matched against
        // the certificate's IP entries, as libpq does.
        SslMode::VerifyFull => {
            TlsConfig::verify_full(tls.root_cert.clone()).with_sni_hostname(host)
        }
    };
    if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
        config = config.with_client_cert(cert.clone(), key.clone());
    }
    config
}
