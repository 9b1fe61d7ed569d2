//! `outbox-forwarder`: parses the command line and hands over to the library.

use std::process::ExitCode;

use cdc_forwarder::config::KafkaProperties;
use cdc_forwarder::options::{ConfigFile, Options};
use cdc_forwarder::{redrive, replay, Error};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

mod commands;

/// mimalloc, for Rust's allocations and (feature `override`) librdkafka's:
/// records are allocated on the pipeline's thread and freed on librdkafka's,
/// which glibc's malloc serves slowly (a third of the forwarder's CPU in a
/// profile). Without transparent huge pages (feature `no_thp`), which took
/// peak RSS from 65 to 38 MB in the same run; docs/src/benchmarks.md has the figures.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keeps peak memory near glibc's: arenas are committed as they are used, and
/// freed pages go back to the system at once.
fn tune_allocator() {
    // Positions in mimalloc.h's `mi_option_e`; the crate names only some.
    const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    #[allow(unsafe_code)]
    // SAFETY: mi_option_set stores a value in mimalloc's option table; any
    // option and value are valid, from any thread, at any time.
    unsafe {
        libmimalloc_sys::mi_option_set(ARENA_EAGER_COMMIT, 0);
        libmimalloc_sys::mi_option_set(PURGE_DELAY, 0);
    }
}

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
    Run(Options),
    /// Check that PostgreSQL and Kafka are ready for `run`: one line per check
    /// with a fix hint; exits 3 when any fails.
    Check(Options),
    /// Show the forwarder slots (active, lag, retained WAL, events not yet
    /// forwarded) and, in exactly-once mode, the offset stored in Kafka.
    Status {
        #[command(flatten)]
        args: Options,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create or drop the replication slot.
    Slot {
        #[arg(value_enum)]
        action: Action,
        #[command(flatten)]
        args: Options,
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
        args: Options,
    },
    /// Publish what parked aggregates hold back (their dead-lettered events
    /// and those held behind them) to the topics they route to now, in
    /// sequence order, with the header redriven=true, and let the aggregates
    /// flow again. Run it once the cause is fixed; running it again
    /// publishes nothing new. Exits 3 when an event is still refused.
    Redrive {
        /// Only the parked aggregates of this type.
        #[arg(long)]
        aggregate_type: Option<String>,
        /// Only this aggregate (with --aggregate-type).
        #[arg(long)]
        aggregate_id: Option<String>,
        #[command(flatten)]
        args: Options,
    },
    /// Create or drop the publication on outbox.events.
    Publication {
        #[arg(value_enum)]
        action: Action,
        #[command(flatten)]
        args: Options,
    },
    /// Ask a running forwarder's /healthz (or /readyz) and print its answer;
    /// exits 0 when it is 200 OK and 1 otherwise: a container's health check,
    /// in an image that has no HTTP client.
    Probe {
        /// Ask /readyz instead of /healthz.
        #[arg(long)]
        ready: bool,
        /// The forwarder's --metrics-listen address (0.0.0.0 is asked on
        /// 127.0.0.1).
        #[arg(long, env = "OUTBOX_METRICS_LISTEN", default_value = "127.0.0.1:9187")]
        metrics_listen: std::net::SocketAddr,
    },
}

/// What `slot` and `publication` do.
#[derive(Clone, Copy, ValueEnum)]
enum Action {
    Create,
    Drop,
}

fn main() -> ExitCode {
    tune_allocator();
    // Parsed twice: first for --config (and --help, --version, bad flags),
    // then with the file's values as the options' defaults.
    let first = Cli::command().get_matches();
    let file = match first.get_one::<std::path::PathBuf>("config") {
        Some(path) => match ConfigFile::load(path) {
            Ok(file) => file,
            Err(error) => {
                eprintln!("outbox-forwarder: {error}");
                return ExitCode::from(error.exit_code());
            }
        },
        None => ConfigFile::default(),
    };
    let matches = file.apply(Cli::command()).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_logging(cli.log_format);
    match try_main(cli, &file.kafka_properties) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("outbox-forwarder: {error}");
            ExitCode::from(error.exit_code())
        }
    }
}

fn try_main(cli: Cli, kafka_properties: &KafkaProperties) -> Result<(), Error> {
    let config_from = |options: &Options| options.clone().into_config(kafka_properties);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Config(format!("cannot start the async runtime: {e}")))?;
    match cli.command {
        Command::Run(args) => runtime.block_on(commands::run(config_from(&args)?, &args)),
        Command::Check(args) => runtime.block_on(commands::check(config_from(&args)?)),
        Command::Status { args, json } => {
            runtime.block_on(commands::status(config_from(&args)?, json))
        }
        Command::Slot { action, args } => {
            runtime.block_on(commands::slot(config_from(&args)?, action))
        }
        Command::Publication { action, args } => {
            runtime.block_on(commands::publication(config_from(&args)?, action))
        }
        Command::Replay {
            aggregate_type,
            aggregate_id,
            from_seq,
            args,
        } => {
            let selection = replay::Selection {
                aggregate_type,
                aggregate_id,
                from_seq,
            };
            runtime.block_on(commands::replay(config_from(&args)?, selection))
        }
        Command::Redrive {
            aggregate_type,
            aggregate_id,
            args,
        } => {
            let selection = redrive::Selection {
                aggregate_type,
                aggregate_id,
            };
            runtime.block_on(commands::redrive(config_from(&args)?, selection))
        }
        Command::Probe {
            ready,
            metrics_listen,
        } => runtime.block_on(commands::probe(metrics_listen, ready)),
    }
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
    use cdc_forwarder::config::{Delivery, KafkaProtocol, SaslMechanism};
    use cdc_forwarder::routing::ValueFormat;
    use cdc_forwarder::Config;

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
        let file = ConfigFile::parse(file).map_err(Error::Config)?;
        let matches = file
            .apply(Cli::command())
            .try_get_matches_from(argv)
            .expect("valid flags");
        let Command::Check(options) = Cli::from_arg_matches(&matches).expect("cli").command else {
            panic!("check");
        };
        options.into_config(&file.kafka_properties)
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

    #[test]
    fn a_flag_beats_its_variable_which_beats_the_file_which_beats_the_default() {
        let file = "slot = \"from_file\"\nbatch_linger_ms = 7\n";
        assert_eq!(config(&[], "").expect("valid").slot, "pg_outbox");
        assert_eq!(config(&[], file).expect("valid").slot, "from_file");
        assert_eq!(
            config(&[], file).expect("valid").batch_linger,
            std::time::Duration::from_millis(7)
        );
        // The only test that sets this variable.
        std::env::set_var("OUTBOX_SLOT", "from_env");
        let from_env = config(&[], file).expect("valid").slot;
        let from_flag = config(&["--slot", "from_flag"], file).expect("valid").slot;
        std::env::remove_var("OUTBOX_SLOT");
        assert_eq!(from_env, "from_env");
        assert_eq!(from_flag, "from_flag");
    }
}
