//! `outbox-forwarder`: parses the command line and hands over to the library.

use std::process::ExitCode;

use cdc_forwarder::config::{
    Delivery, FileConfig, KafkaProperties, KafkaProtocol, KafkaSecurity, SaslMechanism,
};
use cdc_forwarder::metrics::{self, Metrics};
use cdc_forwarder::routing::ValueFormat;
use cdc_forwarder::{check, pipeline, replay, slot, status, Config, Error};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use tokio::sync::watch;

#[derive(Parser)]
#[command(
    name = "outbox-forwarder",
    version,
    about = "Forwards pg_outbox events from PostgreSQL to Kafka"
)]
struct Cli {
    /// TOML configuration file; flags and OUTBOX_ variables override it.
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    config: Option<std::path::PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Human, env = "OUTBOX_LOG_FORMAT", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Stream events from the replication slot into Kafka until SIGTERM or SIGINT.
    Run(RunArgs),
    /// Check that PostgreSQL and Kafka are ready for `run`: one line per check
    /// with a fix hint; exits 3 when any fails.
    Check(RunArgs),
    /// Show the forwarder slots (active, lag, retained WAL, events not yet
    /// forwarded) and, in exactly-once mode, the offset stored in Kafka.
    Status {
        #[command(flatten)]
        args: RunArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create or drop the replication slot.
    Slot {
        #[arg(value_enum)]
        action: Action,
        #[command(flatten)]
        args: RunArgs,
    },
    /// Publish an aggregate's stored events again, from a sequence on, with
    /// the header replayed=true (for a consumer that lost its state).
    Replay {
        /// Aggregate type of the events.
        #[arg(long)]
        aggregate_type: String,
        /// Aggregate id of the events.
        #[arg(long)]
        aggregate_id: String,
        /// First sequence number to replay.
        #[arg(long, default_value_t = 1)]
        from_seq: i64,
        #[command(flatten)]
        args: RunArgs,
    },
    /// Create or drop the publication on outbox.events.
    Publication {
        #[arg(value_enum)]
        action: Action,
        #[command(flatten)]
        args: RunArgs,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Action {
    Create,
    Drop,
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// PostgreSQL connection URL of the database that has the pg_outbox
    /// extension, for a role with the REPLICATION attribute.
    #[arg(long, env = "OUTBOX_POSTGRES_URL", hide_env_values = true)]
    postgres_url: Option<String>,
    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "OUTBOX_KAFKA_BOOTSTRAP")]
    kafka_bootstrap: Option<String>,
    /// Logical replication slot to stream from.
    #[arg(long, env = "OUTBOX_SLOT", default_value = "pg_outbox")]
    slot: String,
    /// Publication on outbox.events.
    #[arg(long, env = "OUTBOX_PUBLICATION", default_value = "pg_outbox")]
    publication: String,
    /// Topic for an event without an override; {aggregate_type} is replaced.
    #[arg(long, env = "OUTBOX_TOPIC_TEMPLATE", default_value = cdc_forwarder::routing::DEFAULT_TOPIC_TEMPLATE)]
    topic_template: String,
    /// Fail instead of creating a missing publication or slot.
    #[arg(long, env = "OUTBOX_NO_CREATE")]
    no_create: bool,
    /// Delivery guarantee: at-least-once (idempotent producer) or
    /// exactly-once (Kafka transactions with offsets stored in Kafka, for
    /// read_committed consumers).
    #[arg(long, value_enum, env = "OUTBOX_DELIVERY", default_value_t = DeliveryArg::AtLeastOnce)]
    delivery: DeliveryArg,
    /// Compacted topic that stores the exactly-once offsets.
    #[arg(
        long,
        env = "OUTBOX_OFFSETS_TOPIC",
        default_value = "pg_outbox.offsets"
    )]
    offsets_topic: String,
    /// Exactly-once: commit a Kafka transaction once it holds this many events...
    #[arg(long, env = "OUTBOX_BATCH_MAX_EVENTS", default_value_t = 5000)]
    batch_max_events: usize,
    /// ...or once it has been open this many milliseconds.
    #[arg(long, env = "OUTBOX_BATCH_MAX_MS", default_value_t = 100)]
    batch_max_ms: u64,
    /// Send events Kafka refuses (too large, unroutable) to this topic, with
    /// the reason in headers, instead of halting.
    #[arg(long, env = "OUTBOX_DEAD_LETTER_TOPIC")]
    dead_letter_topic: Option<String>,
    /// Record values: the raw payload, an envelope JSON with the identity
    /// fields, or CloudEvents binary mode (ce_* headers).
    #[arg(long, value_enum, env = "OUTBOX_VALUE_FORMAT", default_value_t = ValueFormatArg::Raw)]
    value_format: ValueFormatArg,
    /// Serve /metrics (Prometheus), /healthz and /readyz on this address,
    /// for example 0.0.0.0:9187. Off when not set.
    #[arg(long, env = "OUTBOX_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// /readyz fails while the slot's lag is above this many bytes.
    #[arg(long, env = "OUTBOX_READY_MAX_LAG_BYTES", default_value_t = 100 << 20)]
    ready_max_lag_bytes: u64,
    /// How Kafka clients connect: plaintext, ssl, sasl-plaintext or sasl-ssl.
    /// (TLS to PostgreSQL is set in the URL: ?sslmode=verify-full&sslrootcert=ca.pem.)
    #[arg(long, value_enum, env = "OUTBOX_KAFKA_SECURITY_PROTOCOL")]
    kafka_security_protocol: Option<KafkaProtocolArg>,
    /// SASL mechanism for sasl-* protocols.
    #[arg(long, value_enum, ignore_case = true, env = "OUTBOX_KAFKA_SASL_MECHANISM", default_value_t = SaslMechanismArg::Plain)]
    kafka_sasl_mechanism: SaslMechanismArg,
    /// SASL username.
    #[arg(long, env = "OUTBOX_KAFKA_SASL_USERNAME")]
    kafka_sasl_username: Option<String>,
    /// SASL password; prefer the environment variable or the file over the
    /// flag, which other users can see in the process list.
    #[arg(long, env = "OUTBOX_KAFKA_SASL_PASSWORD", hide_env_values = true)]
    kafka_sasl_password: Option<String>,
    /// CA certificates (PEM file) that sign the brokers' certificates;
    /// without it the system's trust store is used.
    #[arg(long, env = "OUTBOX_KAFKA_SSL_CA")]
    kafka_ssl_ca: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum KafkaProtocolArg {
    Plaintext,
    Ssl,
    SaslPlaintext,
    SaslSsl,
}

#[derive(Clone, Copy, ValueEnum)]
enum SaslMechanismArg {
    Plain,
    #[value(name = "scram-sha-256")]
    ScramSha256,
    #[value(name = "scram-sha-512")]
    ScramSha512,
}

#[derive(Clone, Copy, ValueEnum)]
enum ValueFormatArg {
    Raw,
    Envelope,
    Cloudevents,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeliveryArg {
    AtLeastOnce,
    ExactlyOnce,
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // Which `run` options were given as flags or environment variables:
    // those win over the configuration file.
    let explicit: Vec<String> = matches
        .subcommand()
        .map(|(_, sub)| {
            sub.ids()
                .filter(|id| {
                    matches!(
                        sub.value_source(id.as_str()),
                        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                    )
                })
                .map(|id| id.as_str().to_owned())
                .collect()
        })
        .unwrap_or_default();
    init_logging(cli.log_format);
    match try_main(cli, &explicit) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("outbox-forwarder: {error}");
            ExitCode::from(error.exit_code())
        }
    }
}

fn try_main(cli: Cli, explicit: &[String]) -> Result<(), Error> {
    let file = match &cli.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let config_from = |args: &RunArgs| config_from(args, &file, explicit);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Config(format!("cannot start the async runtime: {e}")))?;
    match cli.command {
        Command::Run(args) => {
            let config = config_from(&args)?;
            runtime.block_on(async {
                let metrics = Metrics::new(args.ready_max_lag_bytes);
                if let Some(listen) = args.metrics_listen {
                    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
                        Error::Config(format!("cannot serve metrics on {listen}: {e}"))
                    })?;
                    tracing::info!(listen = %listen, "serving /metrics, /healthz and /readyz");
                    let metrics = metrics.clone();
                    tokio::spawn(async move {
                        if let Err(error) = metrics::serve(listener, metrics).await {
                            tracing::error!(error = %error, "metrics endpoint stopped");
                        }
                    });
                }
                let shutdown = shutdown_signal();
                pipeline::run(config, metrics, shutdown).await
            })
        }
        Command::Check(args) => {
            let config = config_from(&args)?;
            let checks = runtime.block_on(check::run(&config));
            for line in &checks {
                println!("{line}");
            }
            if checks.iter().all(|c| c.ok) {
                Ok(())
            } else {
                Err(Error::Setup(format!(
                    "{} of {} checks failed",
                    checks.iter().filter(|c| !c.ok).count(),
                    checks.len()
                )))
            }
        }
        Command::Status { args, json } => {
            let config = config_from(&args)?;
            let status = runtime.block_on(status::collect(&config))?;
            if json {
                println!("{}", status.to_json());
            } else {
                print!("{}", status.to_table());
            }
            Ok(())
        }
        Command::Slot { action, args } => {
            let config = config_from(&args)?;
            runtime.block_on(async {
                let client = slot::connect(&config.postgres).await?;
                match action {
                    Action::Create => slot::create_slot(&client, &config.slot).await?,
                    Action::Drop => slot::drop_slot(&client, &config.slot).await?,
                }
                println!(
                    "slot {}: {}",
                    config.slot,
                    match action {
                        Action::Create => "created",
                        Action::Drop => "dropped",
                    }
                );
                Ok(())
            })
        }
        Command::Replay {
            aggregate_type,
            aggregate_id,
            from_seq,
            args,
        } => {
            let config = config_from(&args)?;
            let selection = replay::Selection {
                aggregate_type,
                aggregate_id,
                from_seq,
            };
            let progress = indicatif::ProgressBar::new(0).with_style(
                indicatif::ProgressStyle::with_template("replay {bar:40} {pos}/{len} events")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let sent = runtime.block_on(replay::run(&config, &selection, &progress))?;
            progress.finish_and_clear();
            println!(
                "replayed {sent} events of {} {} from sequence {}",
                selection.aggregate_type, selection.aggregate_id, selection.from_seq
            );
            Ok(())
        }
        Command::Publication { action, args } => {
            let config = config_from(&args)?;
            runtime.block_on(async {
                let client = slot::connect(&config.postgres).await?;
                match action {
                    Action::Create => {
                        client
                            .execute(
                                "SELECT outbox.ensure_publication($1)",
                                &[&config.publication],
                            )
                            .await?;
                    }
                    Action::Drop => slot::drop_publication(&client, &config.publication).await?,
                }
                println!(
                    "publication {}: {}",
                    config.publication,
                    match action {
                        Action::Create => "created",
                        Action::Drop => "dropped",
                    }
                );
                Ok(())
            })
        }
    }
}

/// The one place where the command line becomes a configuration.
fn config_from(args: &RunArgs, file: &FileConfig, explicit: &[String]) -> Result<Config, Error> {
    let mut args = args.clone();
    args.apply_file(file, explicit)?;
    let postgres_url = args.postgres_url.as_deref().ok_or_else(|| {
        Error::Config("no PostgreSQL URL: pass --postgres-url, set OUTBOX_POSTGRES_URL, or postgres_url in the config file".into())
    })?;
    let kafka_bootstrap = args.kafka_bootstrap.as_deref().ok_or_else(|| {
        Error::Config("no Kafka bootstrap servers: pass --kafka-bootstrap, set OUTBOX_KAFKA_BOOTSTRAP, or kafka_bootstrap in the config file".into())
    })?;
    let mut config = Config::new(postgres_url, kafka_bootstrap)?;
    config.kafka_properties = KafkaProperties(file.kafka_properties.clone());
    config.slot = args.slot.clone();
    config.publication = args.publication.clone();
    config.topic_template = args.topic_template.clone();
    config.create_missing = !args.no_create;
    config.delivery = match args.delivery {
        DeliveryArg::AtLeastOnce => Delivery::AtLeastOnce,
        DeliveryArg::ExactlyOnce => Delivery::ExactlyOnce,
    };
    config.offsets_topic = args.offsets_topic.clone();
    config.dead_letter_topic = args.dead_letter_topic.clone();
    config.value_format = match args.value_format {
        ValueFormatArg::Raw => ValueFormat::Raw,
        ValueFormatArg::Envelope => ValueFormat::Envelope,
        ValueFormatArg::Cloudevents => ValueFormat::CloudEvents,
    };
    config.batch_max_events = args.batch_max_events;
    config.batch_max_time = std::time::Duration::from_millis(args.batch_max_ms);
    let protocol = args.kafka_security_protocol.map(|p| match p {
        KafkaProtocolArg::Plaintext => KafkaProtocol::Plaintext,
        KafkaProtocolArg::Ssl => KafkaProtocol::Ssl,
        KafkaProtocolArg::SaslPlaintext => KafkaProtocol::SaslPlaintext,
        KafkaProtocolArg::SaslSsl => KafkaProtocol::SaslSsl,
    });
    let sasl = protocol
        .is_some_and(|p| matches!(p, KafkaProtocol::SaslPlaintext | KafkaProtocol::SaslSsl));
    config.kafka_security = KafkaSecurity {
        protocol,
        // The mechanism has a default; it applies only when SASL is used.
        sasl_mechanism: sasl.then_some(match args.kafka_sasl_mechanism {
            SaslMechanismArg::Plain => SaslMechanism::Plain,
            SaslMechanismArg::ScramSha256 => SaslMechanism::ScramSha256,
            SaslMechanismArg::ScramSha512 => SaslMechanism::ScramSha512,
        }),
        sasl_username: args.kafka_sasl_username.clone(),
        sasl_password: args.kafka_sasl_password.clone(),
        ssl_ca: args.kafka_ssl_ca.clone(),
    };
    config.validate()?;
    Ok(config)
}

impl RunArgs {
    /// Fills what was not given explicitly from the configuration file.
    fn apply_file(&mut self, file: &FileConfig, explicit: &[String]) -> Result<(), Error> {
        let given = |id: &str| explicit.iter().any(|e| e == id);
        macro_rules! take {
            ($field:ident) => {
                if !given(stringify!($field)) {
                    if let Some(v) = &file.$field {
                        self.$field = v.clone().into();
                    }
                }
            };
        }
        take!(postgres_url);
        take!(kafka_bootstrap);
        take!(slot);
        take!(publication);
        take!(topic_template);
        take!(no_create);
        take!(offsets_topic);
        take!(batch_max_events);
        take!(batch_max_ms);
        take!(dead_letter_topic);
        take!(ready_max_lag_bytes);
        take!(kafka_sasl_username);
        take!(kafka_sasl_password);
        if !given("kafka_ssl_ca") {
            if let Some(v) = &file.kafka_ssl_ca {
                self.kafka_ssl_ca = Some(v.into());
            }
        }
        // A choice among names; `_` and `-` and letter case do not matter.
        macro_rules! take_choice {
            ($field:ident, $choice:ty, $choices:literal) => {
                if !given(stringify!($field)) {
                    if let Some(v) = &file.$field {
                        let parsed: $choice = ValueEnum::from_str(&v.replace('_', "-"), true)
                            .map_err(|_| {
                                Error::Config(format!(
                                    "config file: {} {v:?} is not {}",
                                    stringify!($field),
                                    $choices
                                ))
                            })?;
                        self.$field = parsed.into();
                    }
                }
            };
        }
        take_choice!(
            kafka_security_protocol,
            KafkaProtocolArg,
            "plaintext, ssl, sasl_plaintext or sasl_ssl"
        );
        take_choice!(
            kafka_sasl_mechanism,
            SaslMechanismArg,
            "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"
        );
        take_choice!(delivery, DeliveryArg, "at-least-once or exactly-once");
        take_choice!(value_format, ValueFormatArg, "raw, envelope or cloudevents");
        if !given("metrics_listen") {
            if let Some(v) = &file.metrics_listen {
                self.metrics_listen = Some(v.parse().map_err(|_| {
                    Error::Config(format!(
                        "config file: metrics_listen {v:?} is not an address like 0.0.0.0:9187"
                    ))
                })?);
            }
        }
        Ok(())
    }
}

/// Turns the first SIGTERM or SIGINT into a graceful shutdown; a second one
/// ends the process at once.
fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::info!("shutdown requested");
        let _ignored_if_finished = tx.send(true);
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::warn!("second signal, exiting at once");
        std::process::exit(130);
    });
    rx
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of `check` given on a command line, with a file.
    fn config(flags: &[&str], file: &str) -> Result<Config, Error> {
        let mut argv = vec![
            "outbox-forwarder",
            "check",
            "--postgres-url",
            "postgres://u@h/db",
            "--kafka-bootstrap",
            "k:9092",
        ];
        argv.extend(flags);
        let matches = Cli::command()
            .try_get_matches_from(argv)
            .expect("valid flags");
        let explicit: Vec<String> = matches
            .subcommand()
            .map(|(_, sub)| {
                sub.ids()
                    .filter(|id| sub.value_source(id.as_str()) == Some(ValueSource::CommandLine))
                    .map(|id| id.as_str().to_owned())
                    .collect()
            })
            .unwrap_or_default();
        let Command::Check(args) = Cli::from_arg_matches(&matches).expect("cli").command else {
            panic!("check");
        };
        let file = FileConfig::parse(file).expect("file parses");
        config_from(&args, &file, &explicit)
    }

    #[test]
    fn choices_in_the_file_are_read_as_documented_and_flags_win() {
        let c = config(
            &[],
            "delivery = \"exactly-once\"\nvalue_format = \"envelope\"\nkafka_security_protocol = \"SASL_SSL\"\n\
             kafka_sasl_mechanism = \"SCRAM-SHA-512\"\nkafka_sasl_username = \"u\"\nkafka_sasl_password = \"p\"\n",
        )
        .expect("valid");
        assert_eq!(c.delivery, Delivery::ExactlyOnce);
        assert_eq!(c.value_format, ValueFormat::Envelope);
        assert_eq!(c.kafka_security.protocol, Some(KafkaProtocol::SaslSsl));
        assert_eq!(
            c.kafka_security.sasl_mechanism,
            Some(SaslMechanism::ScramSha512)
        );

        let c = config(
            &[
                "--delivery",
                "at-least-once",
                "--kafka-sasl-mechanism",
                "SCRAM-SHA-256",
            ],
            "delivery = \"exactly-once\"\nkafka_security_protocol = \"sasl_plaintext\"\n\
             kafka_sasl_username = \"u\"\nkafka_sasl_password = \"p\"\n",
        )
        .expect("valid");
        assert_eq!(c.delivery, Delivery::AtLeastOnce, "the flag wins");
        assert_eq!(
            c.kafka_security.sasl_mechanism,
            Some(SaslMechanism::ScramSha256)
        );

        let err = config(&[], "kafka_sasl_mechanism = \"GSSAPI\"\n").expect_err("not built in");
        assert!(
            err.to_string().contains("kafka_sasl_mechanism \"GSSAPI\""),
            "{err}"
        );
    }
}
