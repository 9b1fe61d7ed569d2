//! Where PostgreSQL is and how to reach it: libpq's URLs and key/value
//! strings, several hosts, and the TLS parameters with libpq's meaning.

use std::str::FromStr;

use crate::error::{Error, Result};

/// Connection settings for PostgreSQL, parsed from a libpq-style URL or
/// key/value string. The password is kept here only; it never reaches logs.
/// The TLS parameters (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) are
/// read here with libpq's meaning and applied to both kinds of connection.
#[derive(Clone)]
pub struct PgTarget {
    config: tokio_postgres::Config,
    tls: PgTls,
    /// The first host the URL names, kept by [`PgTarget::per_host`]'s
    /// targets: see [`PgTarget::named_host`].
    named_host: String,
}

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    /// TLS when the server offers it, without verification (libpq's default).
    #[default]
    Prefer,
    /// TLS, without verification unless `sslrootcert` is given.
    Require,
    /// TLS, the server certificate signed by a trusted CA.
    VerifyCa,
    /// As verify-ca, and the certificate names the host connected to.
    VerifyFull,
}

impl SslMode {
    pub const NAMES: &'static str = "disable, prefer, require, verify-ca or verify-full";

    fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// TLS settings for PostgreSQL connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    /// CA certificates (PEM) that sign the server's certificate.
    pub root_cert: Option<std::path::PathBuf>,
    /// Client certificate and key (PEM) for `cert` authentication.
    pub client_cert: Option<std::path::PathBuf>,
    pub client_key: Option<std::path::PathBuf>,
}

impl PgTls {
    /// Whether the server's certificate chain is checked. As in libpq,
    /// `require` with an explicit `sslrootcert` behaves like `verify-ca`.
    pub fn verifies_chain(&self) -> bool {
        match self.mode {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            SslMode::Require => self.root_cert.is_some(),
            SslMode::Disable | SslMode::Prefer => false,
        }
    }

    /// Takes the TLS parameters out of a URL's query or a key/value string,
    /// returning the rest for tokio-postgres.
    fn extract(url: &str) -> Result<(String, PgTls)> {
        let mut tls = PgTls::default();
        let mut take = |key: &str, value: String| -> Result<bool> {
            match key {
                "sslmode" => {
                    tls.mode = SslMode::parse(&value).ok_or_else(|| {
                        Error::Config(format!(
                            "postgres url: sslmode {value:?} is not one of {}",
                            SslMode::NAMES
                        ))
                    })?
                }
                "sslrootcert" => tls.root_cert = Some(value.into()),
                "sslcert" => tls.client_cert = Some(value.into()),
                "sslkey" => tls.client_key = Some(value.into()),
                _ => return Ok(false),
            }
            Ok(true)
        };
        let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            match url.split_once('?') {
                None => url.to_owned(),
                Some((base, query)) => {
                    let mut kept = Vec::new();
                    for pair in query.split('&').filter(|p| !p.is_empty()) {
                        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                        if !take(key, percent_decode(value))? {
                            kept.push(pair);
                        }
                    }
                    if kept.is_empty() {
                        base.to_owned()
                    } else {
                        format!("{base}?{}", kept.join("&"))
                    }
                }
            }
        } else {
            let mut kept = Vec::new();
            for word in url.split_whitespace() {
                let taken = match word.split_once('=') {
                    Some((key, value)) => take(key.trim(), value.trim_matches('\'').to_owned())?,
                    None => false,
                };
                if !taken {
                    kept.push(word);
                }
            }
            kept.join(" ")
        };
        if tls.client_cert.is_some() != tls.client_key.is_some() {
            return Err(Error::Config(
                "postgres url: sslcert and sslkey go together; give both or neither".into(),
            ));
        }
        if tls.mode == SslMode::Disable && (tls.root_cert.is_some() || tls.client_cert.is_some()) {
            return Err(Error::Config(
                "postgres url: sslmode=disable contradicts sslrootcert/sslcert; remove one".into(),
            ));
        }
        for path in [&tls.root_cert, &tls.client_cert, &tls.client_key]
            .into_iter()
            .flatten()
        {
            if !path.is_file() {
                return Err(Error::Config(format!(
                    "postgres url: TLS file {} does not exist or is not a file",
                    path.display()
                )));
            }
        }
        Ok((rest, tls))
    }
}

/// `%XX` escapes in a URL query value (file paths may carry them).
fn percent_decode(value: &str) -> String {
    let mut out = Vec::with_capacity(value.len());
    let mut rest = value.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        let escaped = (byte == b'%')
            .then(|| tail.get(..2))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(decoded) => {
                out.push(decoded);
                rest = &tail[2..];
            }
            None => {
                out.push(byte);
                rest = tail;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl PgTarget {
    pub fn parse(url: &str) -> Result<Self> {
        let (rest, tls) = PgTls::extract(url)?;
        let mut config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
            Error::Config(format!("postgres url is not valid ({e}); expected postgres://user:password@host:port/dbname"))
        })?;
        config.ssl_mode(match tls.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        if config.get_dbname().is_none() {
            return Err(Error::Config(
                "postgres url names no database; add /dbname".into(),
            ));
        }
        if config.get_user().is_none() {
            return Err(Error::Config("postgres url names no user".into()));
        }
        let mut target = PgTarget {
            config,
            tls,
            named_host: String::new(),
        };
        target.named_host = target.host();
        Ok(target)
    }

    /// The first host the URL names, whichever of its hosts this target
    /// connects to: what names the database in Kafka (the transactional id
    /// and the offsets topic), so that a failover from the first host of a
    /// multi-host URL to another keeps both.
    pub fn named_host(&self) -> &str {
        &self.named_host
    }

    pub fn tls(&self) -> &PgTls {
        &self.tls
    }

    pub fn sql_config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    pub fn host(&self) -> String {
        match self.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        }
    }

    pub fn port(&self) -> u16 {
        self.config.get_ports().first().copied().unwrap_or(5432)
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or_default()
    }

    pub fn password(&self) -> String {
        self.config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default()
    }

    pub fn dbname(&self) -> &str {
        self.config.get_dbname().unwrap_or_default()
    }

    /// `user@host:port/dbname` (every host of a multi-host URL), without
    /// the password: safe to log.
    pub fn redacted(&self) -> String {
        let hosts = self
            .per_host()
            .iter()
            .map(|one| format!("{}:{}", one.host(), one.port()))
            .collect::<Vec<_>>()
            .join(",");
        format!("{}@{hosts}/{}", self.user(), self.dbname())
    }

    /// One target per host of a multi-host URL (`postgres://a:5432,b:5432/db`,
    /// or `host=a,b port=5432,5432`), in order, each keeping every other
    /// setting; the target itself when it names one host.
    pub fn per_host(&self) -> Vec<PgTarget> {
        let all = &self.config;
        let hosts = all.get_hosts();
        if hosts.len() <= 1 {
            return vec![self.clone()];
        }
        let ports = all.get_ports();
        hosts
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let mut one = tokio_postgres::Config::new();
                match host {
                    tokio_postgres::config::Host::Tcp(name) => one.host(name),
                    #[cfg(unix)]
                    tokio_postgres::config::Host::Unix(path) => one.host_path(path),
                };
                // libpq: one port for every host, or one per host.
                one.port(ports.get(i).or(ports.first()).copied().unwrap_or(5432));
                if let Some(addr) = all.get_hostaddrs().get(i) {
                    one.hostaddr(*addr);
                }
                if let Some(user) = all.get_user() {
                    one.user(user);
                }
                if let Some(password) = all.get_password() {
                    one.password(password);
                }
                if let Some(dbname) = all.get_dbname() {
                    one.dbname(dbname);
                }
                if let Some(options) = all.get_options() {
                    one.options(options);
                }
                if let Some(name) = all.get_application_name() {
                    one.application_name(name);
                }
                if let Some(timeout) = all.get_connect_timeout() {
                    one.connect_timeout(*timeout);
                }
                if let Some(timeout) = all.get_tcp_user_timeout() {
                    one.tcp_user_timeout(*timeout);
                }
                one.ssl_mode(all.get_ssl_mode())
                    .keepalives(all.get_keepalives())
                    .keepalives_idle(all.get_keepalives_idle())
                    .channel_binding(all.get_channel_binding());
                PgTarget {
                    config: one,
                    tls: self.tls.clone(),
                    named_host: self.named_host.clone(),
                }
            })
            .collect()
    }
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}
