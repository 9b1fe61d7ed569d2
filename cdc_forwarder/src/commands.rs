//! One function per subcommand of `outbox-forwarder`: each runs the
//! library's part and prints what the operator reads. An `Err` becomes the
//! one line and the exit code `main` gives it.

use cdc_forwarder::metrics::{self, Metrics};
use cdc_forwarder::options::Options;
use cdc_forwarder::{
    check, database, pipeline, publication, redrive, replay, slot, status, Config, Error,
};
use tokio::sync::watch;

use crate::Action;

/// `run`: serves metrics and health when asked, then forwards until a
/// signal.
pub async fn run(config: Config, options: &Options) -> Result<(), Error> {
    let metrics = Metrics::new(options.health_limits());
    if let Some(listen) = options.metrics_listen {
        tokio::spawn(cdc_forwarder::health::probe_kafka(
            config.kafka_client(),
            metrics.health.clone(),
        ));
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| Error::Config(format!("cannot serve metrics on {listen}: {e}")))?;
        tracing::info!(listen = %listen, "serving /metrics, /healthz and /readyz");
        let metrics = metrics.clone();
        tokio::spawn(async move {
            if let Err(error) = metrics::serve(listener, metrics).await {
                tracing::error!(error = %error, "metrics endpoint stopped");
            }
        });
    }
    pipeline::run(config, metrics, shutdown_signal()).await
}

/// `check`: one line per check; fails when any check failed.
pub async fn check(config: Config) -> Result<(), Error> {
    let checks = check::run(&config).await;
    for line in &checks {
        println!("{line}");
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    if failed == 0 {
        Ok(())
    } else {
        Err(Error::Setup(format!(
            "{failed} of {} checks failed",
            checks.len()
        )))
    }
}

/// `status`: a table, or JSON.
pub async fn status(config: Config, json: bool) -> Result<(), Error> {
    let status = status::collect(&config).await?;
    if json {
        println!("{}", status.to_json());
    } else {
        print!("{}", status.to_table());
    }
    Ok(())
}

/// `slot create|drop`.
pub async fn slot(config: Config, action: Action) -> Result<(), Error> {
    let client = database::connect(&config.postgres).await?;
    match action {
        Action::Create => {
            let failover = slot::wants_failover(&client, config.failover_slot).await?;
            slot::create_slot(&client, &config.slot, failover).await?;
        }
        Action::Drop => slot::remove(&client, &config.slot).await?,
    }
    println!("slot {}: {}", config.slot, done(action));
    Ok(())
}

/// `publication create|drop`.
pub async fn publication(config: Config, action: Action) -> Result<(), Error> {
    let client = database::connect(&config.postgres).await?;
    match action {
        Action::Create => {
            publication::ensure(&client, &config.publication, config.shard).await?;
        }
        Action::Drop => publication::drop(&client, &config.publication).await?,
    }
    println!("publication {}: {}", config.publication, done(action));
    Ok(())
}

fn done(action: Action) -> &'static str {
    match action {
        Action::Create => "created",
        Action::Drop => "dropped",
    }
}

/// `replay`: with a progress bar while it publishes.
pub async fn replay(config: Config, selection: replay::Selection) -> Result<(), Error> {
    let progress = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("replay {bar:40} {pos}/{len} events")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let sent = replay::run(&config, &selection, &progress).await?;
    progress.finish_and_clear();
    println!(
        "replayed {sent} events of {} {} from sequence {}",
        selection.aggregate_type, selection.aggregate_id, selection.from_seq
    );
    Ok(())
}

/// `redrive`: a line per aggregate, then the count; fails while an event
/// is still refused.
pub async fn redrive(config: Config, selection: redrive::Selection) -> Result<(), Error> {
    let outcomes = redrive::run(&config, &selection, |outcome| match outcome {
        redrive::Outcome::Redriven {
            aggregate,
            first_seq,
            last_seq,
            events,
        } => println!(
            "{aggregate}: {events} events (aggregate_seq {first_seq} to {last_seq}) published again; unparked"
        ),
        redrive::Outcome::StillRefused { aggregate, reason } => {
            println!("{aggregate}: still refused, left parked: {reason}")
        }
    })
    .await?;
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o, redrive::Outcome::StillRefused { .. }))
        .count();
    println!(
        "redrive: {} aggregates unparked, {refused} still parked",
        outcomes.len() - refused
    );
    if refused > 0 {
        return Err(Error::Setup(format!(
            "{refused} parked aggregates still have a refused event; fix the cause and run redrive again"
        )));
    }
    Ok(())
}

/// `probe`: a running forwarder's /healthz or /readyz, for a container's
/// health check.
pub async fn probe(metrics_listen: std::net::SocketAddr, ready: bool) -> Result<(), Error> {
    let path = if ready { "/readyz" } else { "/healthz" };
    print!("{}", metrics::probe(metrics_listen, path).await?);
    Ok(())
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
