//! Stock reservation from order events, exactly once in effect.
//!
//! Order events arrive on `orders/#` as JSON, `{"order":42,"sku":"A-1","qty":1,"kind":"created"}` or
//! `"kind":"cancelled"`, with the application id in the MQTT 5 user property `message-id`
//! (`evt-42-created`). `created` reserves `qty` of the sku, `cancelled` releases it. The broker may deliver
//! an event twice; the reservation happens once.
//!
//! ```text
//! inventory run --broker HOST:PORT --db PATH [--client-id ID] [--topic FILTER] [--exit-when-idle SECS]
//!               [--username NAME [--password-file FILE]] [--tls-ca FILE] [--tls-system-roots]
//!               [--tls-cert FILE --tls-key FILE] [--alpn PROTO]... [--protocol v5|v311]
//!               [--receive-only [--workers N]] [--announce]
//! inventory report --db PATH
//! inventory [run [--db PATH] [--receive-only [--workers N]] [--announce]]   # demo: own local broker
//! ```
//!
//! `inventory --help`, `inventory run --help` and `inventory report --help` describe every flag.
//!
//! `run` consumes until SIGINT/SIGTERM (the batch in flight is committed and acked first), or, with
//! `--exit-when-idle SECS`, until nothing has arrived for SECS and nothing is left to do (below). It exits 0
//! after such a stop and non-zero when it cannot go on, for a supervisor to see: a worker thread or the
//! relay thread ended by itself (the consumer is stopped gracefully first), or the consumer returned
//! without a stop or an idle exit (its connection thread is gone).
//!
//! - `--username NAME`: log in as NAME. The password comes from the environment variable `MQTT_PASSWORD` or
//!   from `--password-file FILE` (its contents, one trailing newline removed; the file wins over the
//!   variable), and is required with a user name. There is deliberately no `--password`: a command-line
//!   value is visible to every user of the machine. A password file that group or others may access (any
//!   of the mode bits 077) is refused, as ssh refuses such a private key: `chmod 600 FILE`. Without
//!   `--tls-ca` the password crosses the network in clear text: the run logs a warning saying so, once. The
//!   password is never logged (the connection settings are logged with it redacted).
//! - `--tls-ca FILE`: connect over TLS, trusting the CA certificates in FILE (PEM); the broker's certificate
//!   must name HOST. `--tls-system-roots`: trust the system's root certificates too (or instead; a cloud
//!   hub). `--tls-cert FILE --tls-key FILE`: the client certificate chain and its private key (PEM; PKCS#8,
//!   SEC1 or PKCS#1), for a broker that requires one; a key that does not match the certificate is an
//!   error at start, naming both files. `--alpn PROTO` (repeatable): ALPN protocols to offer (AWS IoT Core
//!   on port 443: `x-amzn-mqtt-ca`). A certificate the broker rejects (another CA, expired) ends the run at
//!   once, non-zero, with the TLS alert named.
//! - `--protocol v5|v311` (default v5): the consumer's MQTT version. With 3.1.1 the message id comes from a
//!   CBOR envelope in the payload (`edge_inbox::Envelope`); the `--announce` relay always speaks MQTT 5.
//! - `--receive-only`: each delivery is stored as *pending* and acked once that commit is durable; `N`
//!   worker threads (`--workers`, default 1) apply the stored events with the same handler, each tried up to
//!   3 times before it is dead-lettered. With `--exit-when-idle` the run also waits until no stored event
//!   is left to apply (pending or waiting for a retry) before it exits.
//! - `--announce`: each applied event also publishes `{"order":42,"sku":"A-1","qty":1,"kind":"created"}` on
//!   `stock/reserved/<order>` (QoS1) through the outbox: recorded in the same commit as the reservation,
//!   sent after it by a relay thread of this process (its own connection, client id `<ID>-relay`), at least
//!   once, with the user property `message-id` derived from the event's id (the same on every resend), plus
//!   `producer` and `sent-at`. A duplicate, a conflict, a dead letter or a quarantined delivery announces
//!   nothing. With `--exit-when-idle` the run also waits until every announcement is confirmed by the
//!   broker, giving up with a warning (the next run sends the rest) once none was confirmed for SECS or
//!   10 s, whichever is longer.
//!
//! Under systemd (`Type=notify`: `NOTIFY_SOCKET` set, a path or an `@abstract` name) `run` reports its state
//! by sd_notify(3), written by hand over a Unix datagram socket (the library itself never notifies):
//! `STATUS=connecting to HOST:PORT` at start, `READY=1` once the broker first acknowledged its subscription
//! (a message published from then on reaches this consumer), a
//! `STATUS=` line with the connection and the run's counts when they change (at most once a second),
//! `WATCHDOG=1` every half `WATCHDOG_USEC` (when `WATCHDOG_PID` is unset or names this process) only if the
//! consumer's commit loop turned since the last one and the workers and the relay still run, and
//! `STOPPING=1` as soon as SIGINT/SIGTERM asks for the graceful stop. Without `NOTIFY_SOCKET` nothing is
//! sent. The README has a unit file.
//!
//! `report` prints, from the durable counters and tables:
//!
//! ```text
//! {"reserved":{"A-1":3,...},"processed":N,"duplicates":N,"conflicts":N,"quarantined":N,
//!  "pending":N,"dead_letters":N,"outbox_unsent":N}
//! ```
//!
//! (one line) where `pending` counts stored events not yet applied (`--receive-only`; pending or waiting for
//! a retry), `dead_letters` the events the handler refused for good, kept for an operator (`inboxctl
//! dead-letters`, `requeue`), and `outbox_unsent` the announcements committed and not yet confirmed by the
//! broker (parked ones included).
//!
//! Without `--broker` the example starts mosquitto (from `PATH` or `/usr/sbin/mosquitto`) on a free loopback
//! port, or, where mosquitto is not installed, a broker inside this process, and publishes the seed's
//! events: a redelivery, a conflicting reuse of an id and a message without an id included.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use edge_inbox::{
    BacklogThreshold, Config, Consumer, Delivery, Inbox, MqttConfig, OutboxProperties, Protocol,
    Qos, Relay, StatsHandle, StopHandle, TlsConfig, Tx, Worker, WorkerConfig,
};

mod support;
#[path = "support/systemd.rs"]
mod systemd;

const SCOPE: &str = "inventory-reservation";

/// The whole business logic: one handler. With `announce`, the reservation is also announced through the
/// outbox, in the same transaction.
fn reserve(tx: &mut Tx<'_>, d: &Delivery<'_>, announce: bool) -> anyhow::Result<()> {
    let event: serde_json::Value =
        serde_json::from_slice(d.payload).context("payload is not JSON")?;
    let sku = event["sku"].as_str().context("no sku")?;
    let qty = event["qty"].as_i64().context("no qty")?;
    let (kind, delta) = match event["kind"].as_str() {
        Some("created") => ("created", qty),
        Some("cancelled") => ("cancelled", -qty),
        other => bail!("unknown kind {other:?}"),
    };
    let key = format!("reserved/{sku}");
    let reserved: i64 = tx.get(&key)?.unwrap_or(0);
    tx.put(&key, &(reserved + delta))?;
    if announce {
        let order = event["order"].as_u64().context("no order number")?;
        // Written by hand to keep the documented key order.
        let body = format!(
            r#"{{"order":{order},"sku":{},"qty":{qty},"kind":"{kind}"}}"#,
            serde_json::Value::from(sku)
        );
        tx.publish(
            &format!("stock/reserved/{order}"),
            body.as_bytes(),
            Qos::AtLeastOnce,
            &OutboxProperties::new().content_type("application/json"),
        )?;
    }
    Ok(())
}

/// The handler for this run's mode.
fn handler(announce: bool) -> impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> + Send {
    move |tx: &mut Tx<'_>, d: &Delivery<'_>| reserve(tx, d, announce)
}

/// Stock reservation from order events, exactly once in effect. Without a command: the demo, on a local
/// broker of its own (as `run` without flags).
#[derive(clap::Parser)]
// A repeated flag is not an error: the last one wins.
#[command(name = "inventory", args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Consume order events until SIGINT/SIGTERM (or idle). Without --broker: the demo, on a local broker
    /// of its own, in the mode the other flags ask for.
    Run(Box<RunFlags>),
    /// Print the reservations and the durable counters of a database, as one JSON line.
    Report {
        /// The inbox database (SQLite file).
        #[arg(long, value_name = "PATH")]
        db: PathBuf,
    },
}

const DEFAULT_CLIENT_ID: &str = "inventory-reservation-1";
const DEFAULT_TOPIC: &str = "orders/#";

/// `run`'s flags as given; [`run_args`] checks them.
#[derive(clap::Args)]
struct RunFlags {
    /// The MQTT broker to consume from. Without it, the demo runs on a local broker of its own.
    #[arg(long, value_name = "HOST:PORT")]
    broker: Option<String>,
    /// The inbox database (SQLite file); required with --broker. For the demo: instead of a temporary one.
    #[arg(long, value_name = "PATH")]
    db: Option<PathBuf>,
    /// The MQTT client id; the broker keeps this run's persistent session under it.
    #[arg(long, value_name = "ID", default_value = DEFAULT_CLIENT_ID)]
    client_id: String,
    /// The topic filter to subscribe to.
    #[arg(long, value_name = "FILTER", default_value = DEFAULT_TOPIC)]
    topic: String,
    /// Exit once nothing has arrived for SECS and nothing is left to apply or to announce.
    #[arg(long, value_name = "SECS")]
    exit_when_idle: Option<u64>,
    /// Log in as NAME; the password comes from MQTT_PASSWORD or --password-file (never from the command
    /// line) and is never logged.
    #[arg(long, value_name = "NAME")]
    username: Option<String>,
    /// Read the password for --username from FILE (one trailing newline removed); wins over MQTT_PASSWORD.
    /// Refused unless only its owner may access it (chmod 600).
    #[arg(long, value_name = "FILE")]
    password_file: Option<PathBuf>,
    /// Connect over TLS, trusting the CA certificates (PEM) in FILE; the broker's certificate must name HOST.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// Connect over TLS, trusting the system's root certificates (with or without --tls-ca).
    #[arg(long)]
    tls_system_roots: bool,
    /// Client certificate chain (PEM) for a broker that requires one; needs --tls-key.
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM: PKCS#8, SEC1 or PKCS#1) of --tls-cert.
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// An ALPN protocol to offer over TLS (repeatable), e.g. x-amzn-mqtt-ca.
    #[arg(long = "alpn", value_name = "PROTO")]
    alpn: Vec<String>,
    /// The consumer's MQTT version; with v311 the message id comes from a CBOR envelope.
    #[arg(long, value_enum, default_value = "v5")]
    protocol: ProtocolFlag,
    /// Store each delivery as pending and ack it once that commit is durable; worker threads apply it.
    #[arg(long)]
    receive_only: bool,
    /// Worker threads applying the stored events (with --receive-only; at least 1) [default: 1].
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Also publish each applied event on stock/reserved/<order> (QoS1) through the outbox.
    #[arg(long)]
    announce: bool,
    /// Refused with an explanation (see `run_args`), whether or not a value follows.
    #[arg(long, hide = true, num_args = 0..=1, value_name = "REFUSED")]
    password: Option<Option<String>>,
}

impl Default for RunFlags {
    /// `run` without flags, which is what no command means.
    fn default() -> Self {
        RunFlags {
            broker: None,
            db: None,
            client_id: DEFAULT_CLIENT_ID.into(),
            topic: DEFAULT_TOPIC.into(),
            exit_when_idle: None,
            username: None,
            password_file: None,
            tls_ca: None,
            tls_system_roots: false,
            tls_cert: None,
            tls_key: None,
            alpn: Vec::new(),
            protocol: ProtocolFlag::V5,
            receive_only: false,
            workers: None,
            announce: false,
            password: None,
        }
    }
}

/// `--protocol`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ProtocolFlag {
    V5,
    V311,
}

/// A checked `run`: what the consumer, the workers and the relay need.
struct RunArgs {
    broker: Option<String>,
    db: Option<PathBuf>,
    client_id: String,
    topic: String,
    exit_when_idle: Option<u64>,
    /// User name and password; the password never comes from the command line.
    credentials: Option<(String, String)>,
    /// TLS settings, checked (files read, the key matched to its certificate).
    tls: Option<TlsConfig>,
    /// The consumer's protocol (the relay always speaks MQTT 5).
    protocol: Protocol,
    /// Worker threads when receiving only; `None`: apply on receipt.
    workers: Option<usize>,
    announce: bool,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = <Cli as clap::Parser>::parse();
    match cli.command.unwrap_or_else(|| Command::Run(Box::default())) {
        Command::Run(flags) => {
            let run = run_args(*flags)?;
            match run.broker.clone() {
                Some(broker) => {
                    let db = run.db.clone().context("--db PATH is required")?;
                    consume(&broker, &db, &run)?;
                    Ok(())
                }
                None if run.credentials.is_some() || run.tls.is_some() => {
                    bail!("--username and the --tls flags are for a broker given with --broker HOST:PORT")
                }
                None => demo(run),
            }
        }
        Command::Report { db } => {
            println!("{}", report(&db)?);
            Ok(())
        }
    }
}

/// Checks `run`'s flags together, reads the CA file and the password.
fn run_args(flags: RunFlags) -> anyhow::Result<RunArgs> {
    if flags.password.is_some() {
        bail!(
            "--password is not accepted: a command-line value is visible to every user of the machine; \
             set MQTT_PASSWORD or use --password-file FILE"
        );
    }
    let tls = tls_config(&flags)?;
    if flags.workers == Some(0) {
        bail!("--workers N: at least 1");
    }
    if flags.workers.is_some() && !flags.receive_only {
        bail!("--workers N is for --receive-only");
    }
    let workers = flags.receive_only.then(|| flags.workers.unwrap_or(1));
    // MQTT_PASSWORD alone may be meant for another program: only a file given here is an error.
    if flags.username.is_none() && flags.password_file.is_some() {
        bail!("--password-file needs --username NAME");
    }
    let credentials = match flags.username {
        None => None,
        Some(user) => {
            let password = match &flags.password_file {
                Some(path) => read_password(path)?,
                None => std::env::var("MQTT_PASSWORD").map_err(|_| {
                    anyhow::anyhow!(
                        "--username needs a password: set MQTT_PASSWORD or use --password-file FILE"
                    )
                })?,
            };
            if tls.is_none() {
                // Once per run, not per connection: the consumer, the relay and every reconnect log in.
                log::warn!(
                    "the MQTT password of {user:?} is sent in clear text: the connection is not encrypted \
                     (no TLS: --tls-ca FILE or --tls-system-roots), so anyone on the network path can read it"
                );
            }
            Some((user, password))
        }
    };
    Ok(RunArgs {
        broker: flags.broker,
        db: flags.db,
        client_id: flags.client_id,
        topic: flags.topic,
        exit_when_idle: flags.exit_when_idle,
        credentials,
        tls,
        protocol: match flags.protocol {
            ProtocolFlag::V5 => Protocol::V5,
            ProtocolFlag::V311 => Protocol::V311,
        },
        workers,
        announce: flags.announce,
    })
}

/// The TLS settings the flags ask for, read and checked now: a bad file fails the start, naming it.
fn tls_config(flags: &RunFlags) -> anyhow::Result<Option<TlsConfig>> {
    if flags.tls_ca.is_none() && !flags.tls_system_roots && flags.tls_cert.is_none() {
        if flags.tls_key.is_some() || !flags.alpn.is_empty() {
            bail!("--tls-key and --alpn need TLS: --tls-ca FILE or --tls-system-roots");
        }
        return Ok(None);
    }
    let mut b = TlsConfig::builder();
    if let Some(ca) = &flags.tls_ca {
        b = b.ca_file(ca);
    }
    if flags.tls_system_roots {
        #[cfg(feature = "system-roots")]
        {
            b = b.system_roots();
        }
        #[cfg(not(feature = "system-roots"))]
        bail!("--tls-system-roots: this build lacks the system-roots feature");
    }
    if let Some(cert) = &flags.tls_cert {
        b = b.client_cert_file(cert);
    }
    if let Some(key) = &flags.tls_key {
        b = b.client_key_file(key);
    }
    for proto in &flags.alpn {
        b = b.alpn(proto.as_bytes());
    }
    Ok(Some(b.build().context("TLS settings")?))
}

/// The password in `path`: its contents without one trailing newline. The error never shows the contents.
///
/// Refused, as ssh refuses a private key, when group or others have any access to the file: a password
/// others can read is no secret, and a warning would be easy to miss. The mode is read from the opened file,
/// so it is the one of the file read.
fn read_password(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let cannot_read = || format!("--password-file: cannot read {}", path.display());
    let mut file = std::fs::File::open(path).with_context(cannot_read)?;
    let mode = file
        .metadata()
        .with_context(cannot_read)?
        .permissions()
        .mode()
        & 0o7777;
    if mode & 0o077 != 0 {
        bail!(
            "--password-file: {} is accessible by group or others (mode {mode:04o}); \
             make it private: chmod 600 {}",
            path.display(),
            path.display()
        );
    }
    let mut text = String::new();
    file.read_to_string(&mut text).with_context(cannot_read)?;
    let password = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    if password.is_empty() {
        bail!("--password-file: {} is empty", path.display());
    }
    Ok(password.to_owned())
}

/// The broker connection of this run for `client_id` (the consumer's, or the relay's).
fn mqtt_config(host: &str, port: u16, client_id: &str, run: &RunArgs) -> MqttConfig {
    let mut mqtt = MqttConfig::new(host, port, client_id);
    if let Some((user, password)) = &run.credentials {
        mqtt = mqtt.credentials(user, password);
    }
    if let Some(tls) = &run.tls {
        mqtt = mqtt.tls(tls.clone());
    }
    mqtt
}

/// Consumes until SIGINT/SIGTERM (or idle, with `--exit-when-idle`).
fn consume(broker: &str, db: &Path, run: &RunArgs) -> anyhow::Result<edge_inbox::RunSummary> {
    let (host, port) = broker.rsplit_once(':').context("--broker HOST:PORT")?;
    let port: u16 = port.parse().context("--broker HOST:PORT")?;
    let inbox = Inbox::open(db, Config::default())?;
    let mqtt = mqtt_config(host, port, &run.client_id, run)
        .protocol(run.protocol)
        .subscribe(&run.topic);
    let mut consumer = Consumer::new(inbox, SCOPE, mqtt).handler_attempts(3);
    if run.workers.is_some() {
        consumer = consumer.receive_only(BacklogThreshold::default());
    }
    if let Some(secs) = run.exit_when_idle {
        consumer = consumer.exit_when_idle(Duration::from_secs(secs));
    }
    let stop = consumer.stop_handle();
    let stats = consumer.stats();
    let notifier = systemd::Notifier::from_env()?;
    if let Some(n) = &notifier {
        n.notify(&format!("STATUS=connecting to {broker}"));
    }
    // The batch in flight is finished, committed and acked before the consumer returns.
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.flag())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.flag())?;

    // The relay reads the outbox through its own connection to the file, and its own client id.
    let relay = if run.announce {
        Some(Relay::start(
            Inbox::open(db, Config::default())?,
            mqtt_config(host, port, &format!("{}-relay", run.client_id), run),
        )?)
    } else {
        None
    };
    let workers = Workers::start(db, run.workers.unwrap_or(0), run.announce)?;
    // A worker or the relay that ends by itself stops the consumer: the run cannot do its job any more,
    // and a supervisor must see that (a non-zero exit), not a process that consumes for nobody.
    let consuming = AtomicBool::new(true);
    let (summary, lost) = std::thread::scope(|s| {
        let watcher = s.spawn(|| watch(&workers, relay.as_ref(), &stop, &consuming));
        if let Some(n) = &notifier {
            let health = Health {
                stats: &stats,
                workers: &workers,
                relay: relay.as_ref(),
                stop: &stop,
                consuming: &consuming,
            };
            s.spawn(move || health.notify_systemd(n, broker));
        }
        let summary = consumer.run(handler(run.announce));
        consuming.store(false, Ordering::SeqCst);
        let lost = watcher.join().unwrap_or(Some(
            "the thread watching the workers and the relay panicked",
        ));
        (summary, lost)
    });
    // Idle: what was received is applied (and announced) before the exit; a signal skips the waits.
    let idle = run.exit_when_idle.map(Duration::from_secs);
    let drained = match idle {
        Some(_) if summary.is_ok() && !workers.is_empty() => workers.drain(db, &stop),
        _ => Ok(()),
    };
    let stopped = workers.stop();
    if let (Some(idle), Some(relay), true) = (idle, &relay, summary.is_ok() && drained.is_ok()) {
        wait_for_outbox(db, relay, &stop, idle.max(Duration::from_secs(10)))?;
    }
    // Asked to stop only below: a relay that is not running now ended by itself.
    let relay_lost = relay.as_ref().is_some_and(|r| !r.is_running());
    if let Some(relay) = relay {
        log::info!("relay stopped: {:?}", relay.stop());
    }
    drained?;
    stopped?;
    let summary = summary?;
    if relay_lost {
        bail!("the outbox relay thread ended by itself (see the log above): announcements were not sent");
    }
    if let Some(why) = lost {
        bail!("{why} while the consumer ran (see the log above)");
    }
    // `run` returns Ok on a stop, on an idle exit, and when its connection thread is gone: the last is no
    // success. (With --exit-when-idle it cannot be told from an idle exit here.)
    if !stop.is_stopped() && idle.is_none() {
        bail!("the consumer ended without a stop: its connection to the broker is gone (see the log above)");
    }
    Ok(summary)
}

/// Watches, while `consuming`, for a worker or the relay thread that ended by itself; stops the consumer
/// and says which when one did.
fn watch(
    workers: &Workers,
    relay: Option<&Relay>,
    stop: &StopHandle,
    consuming: &AtomicBool,
) -> Option<&'static str> {
    while consuming.load(Ordering::SeqCst) {
        let lost = if workers.threads.iter().any(|t| t.is_finished()) {
            Some("a worker thread ended")
        } else if relay.is_some_and(|r| !r.is_running()) {
            Some("the outbox relay thread ended")
        } else {
            None
        };
        if let Some(why) = lost {
            log::error!("{why}: stopping the consumer");
            stop.stop();
            return lost;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// What the systemd notifications are made of.
struct Health<'a> {
    stats: &'a StatsHandle,
    workers: &'a Workers,
    relay: Option<&'a Relay>,
    stop: &'a StopHandle,
    consuming: &'a AtomicBool,
}

impl Health<'_> {
    /// Tells systemd, while the consumer runs: `READY=1` once the broker first acknowledged its subscription
    /// (before it, a message published may match no subscription and be dropped); `WATCHDOG=1` at half the
    /// watchdog timeout, only if the consumer's commit loop turned since the last one (it turns at
    /// least every 100 ms unless stuck in a commit or a handler) and the workers and the relay still run; a
    /// `STATUS=` line when the state changes (at most once a second); `STOPPING=1` as soon as a stop is
    /// asked (the batch in flight is then committed and acked), or when the consumer returned.
    fn notify_systemd(&self, n: &systemd::Notifier, broker: &str) {
        let mut ready = false;
        let mut stopping = false;
        let mut status = String::new();
        let mut status_at: Option<Instant> = None;
        let mut last_ping = Instant::now();
        let mut turns_at_ping = self.stats.snapshot().turns;
        while self.consuming.load(Ordering::SeqCst) {
            let now = self.stats.snapshot();
            if self.stop.is_stopped() && !stopping {
                stopping = true;
                n.notify("STOPPING=1\nSTATUS=stopping: committing and acking the batch in flight");
            }
            if !ready && now.subscribed {
                ready = true;
                n.notify("READY=1");
            }
            let line = match now.connection {
                _ if stopping => None,
                Some(c) => {
                    let s = now.summary;
                    let subscribed = if now.subscribed { "" } else { ", subscribing" };
                    Some(format!(
                        "connected to {broker} ({c:?}{subscribed}): received {}, processed {}, duplicates {}, \
                         conflicts {}, quarantined {}, stored {}, dead-lettered {}",
                        s.received, s.processed, s.duplicates, s.conflicts, s.quarantined, s.stored,
                        s.dead_lettered
                    ))
                }
                None => Some(match &now.last_lost_cause {
                    Some(why) => format!("reconnecting to {broker}: {why}"),
                    None => format!("connecting to {broker}"),
                }),
            };
            if let Some(line) = line {
                if line != status && status_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
                {
                    n.notify(&format!("STATUS={line}"));
                    (status, status_at) = (line, Some(Instant::now()));
                }
            }
            if let Some(every) = n.watchdog_interval() {
                if last_ping.elapsed() >= every {
                    let alive = now.running
                        && !self.workers.threads.iter().any(|t| t.is_finished())
                        && self.relay.is_none_or(|r| r.is_running());
                    if alive && now.turns != turns_at_ping {
                        n.notify("WATCHDOG=1");
                        (last_ping, turns_at_ping) = (Instant::now(), now.turns);
                    } else {
                        log::warn!(
                            "the consumer made no progress for {every:?}: not feeding the watchdog"
                        );
                        last_ping = Instant::now();
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !stopping {
            n.notify("STOPPING=1");
        }
    }
}

/// The worker threads of `--receive-only`, each on its own connection.
struct Workers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<edge_inbox::Result<edge_inbox::Drained>>>,
}

impl Workers {
    fn start(db: &Path, n: usize, announce: bool) -> anyhow::Result<Workers> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            // A lease left by a killed run makes its events claimable again after 10 s.
            let config = WorkerConfig::default()
                .lease(Duration::from_secs(10))
                .max_attempts(3)
                .backoff(Duration::from_millis(50), Duration::from_secs(1));
            let mut worker = Worker::open(db, Config::default(), SCOPE, config)?;
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("inventory-worker-{i}"))
                    .spawn(move || worker.run_until(&stop, &mut handler(announce)))?,
            );
        }
        Ok(Workers { stop, threads })
    }

    fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Waits until no stored event is left to apply, or a signal, or a worker ended by itself (an error,
    /// reported by [`Workers::stop`]).
    fn drain(&self, db: &Path, stop: &StopHandle) -> anyhow::Result<()> {
        let inbox = Inbox::open(db, Config::default())?;
        let mut said = false;
        while !stop.is_stopped() && !self.threads.iter().any(|t| t.is_finished()) {
            let backlog = inbox.backlog(SCOPE)?;
            let left = backlog.pending + backlog.failed;
            if left == 0 {
                break;
            }
            if !said {
                log::info!("idle: waiting for {left} stored event(s) to be applied");
                said = true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn stop(self) -> anyhow::Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        let mut failed = None;
        for t in self.threads {
            match t.join() {
                Ok(Ok(drained)) => log::info!("worker stopped: {drained:?}"),
                Ok(Err(e)) => failed = Some(anyhow::Error::new(e).context("a worker stopped")),
                Err(_) => failed = Some(anyhow::anyhow!("a worker thread panicked")),
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Waits until the relay has sent every announcement, a signal, or `patience` without a confirmation.
fn wait_for_outbox(
    db: &Path,
    relay: &Relay,
    stop: &StopHandle,
    patience: Duration,
) -> anyhow::Result<()> {
    let inbox = Inbox::open(db, Config::default())?;
    let mut confirmed = relay.stats().confirmed;
    let mut progress = Instant::now();
    let mut said = false;
    while !stop.is_stopped() {
        let unsent = inbox.outbox_backlog()?.pending;
        if unsent == 0 {
            break;
        }
        if !said {
            log::info!("idle: waiting for {unsent} announcement(s) to be confirmed by the broker");
            said = true;
        }
        let now = relay.stats().confirmed;
        if now != confirmed {
            (confirmed, progress) = (now, Instant::now());
        } else if progress.elapsed() >= patience || !relay.is_running() {
            log::warn!(
                "{unsent} announcement(s) not confirmed by the broker after {patience:?} without progress; \
                 the next run sends them"
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn report(db: &Path) -> anyhow::Result<String> {
    if !db.exists() {
        bail!("{} does not exist", db.display());
    }
    let inbox = Inbox::open(db, Config::default())?;
    let mut reserved = serde_json::Map::new();
    // What the handler wrote with `tx.put("reserved/<sku>", ..)`, in the scope's namespace.
    for (key, qty) in inbox.entries::<i64>(SCOPE, "reserved/")? {
        reserved.insert(key["reserved/".len()..].to_owned(), qty.into());
    }
    let stats = inbox.scope_stats(SCOPE)?;
    let backlog = inbox.backlog(SCOPE)?;
    let outbox = inbox.outbox_backlog()?;
    // Written by hand to keep the documented key order.
    Ok(format!(
        r#"{{"reserved":{},"processed":{},"duplicates":{},"conflicts":{},"quarantined":{},"pending":{},"dead_letters":{},"outbox_unsent":{}}}"#,
        serde_json::Value::Object(reserved),
        stats.processed,
        stats.duplicates,
        stats.conflicts,
        stats.quarantined,
        backlog.pending + backlog.failed,
        backlog.dead_letters,
        outbox.pending + outbox.parked
    ))
}

/// The seed's scenario end to end on this machine, in the mode `mode` asks for (`--receive-only`,
/// `--workers`, `--announce`; its database, if given).
fn demo(mode: RunArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Started as root, mosquitto drops to its own user; it only needs to read its config here.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let db = mode
        .db
        .clone()
        .unwrap_or_else(|| dir.path().join("inventory.db"));
    let broker = support::LocalBroker::start(dir.path())?;
    let addr = broker.addr();
    eprintln!(
        "{}",
        broker.banner("inventory run --broker HOST:PORT --db PATH")
    );
    eprintln!("inbox {}", db.display());
    let run = RunArgs {
        broker: Some(addr.clone()),
        db: Some(db.clone()),
        client_id: "inventory-demo".into(),
        topic: "orders/#".into(),
        exit_when_idle: Some(1),
        ..mode
    };
    // First connection: the broker now keeps a persistent session with our subscription.
    consume(&addr, &db, &run)?;

    let created = |order: u32, sku: &str, qty: u32| {
        format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"created"}}"#)
    };
    let cancelled = |order: u32, sku: &str, qty: u32| {
        format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"cancelled"}}"#)
    };
    let events: Vec<(&str, Option<&str>, String)> = vec![
        ("orders/42", Some("evt-42-created"), created(42, "A-1", 1)),
        ("orders/43", Some("evt-43-created"), created(43, "A-1", 2)),
        // The broker redelivers 42 (our PUBACK was lost): recognised, not applied again.
        ("orders/42", Some("evt-42-created"), created(42, "A-1", 1)),
        ("orders/44", Some("evt-44-created"), created(44, "B-7", 1)),
        (
            "orders/43",
            Some("evt-43-cancelled"),
            cancelled(43, "A-1", 2),
        ),
        // A buggy producer reuses an id for other content: a recorded conflict, not applied.
        ("orders/44", Some("evt-44-created"), created(44, "B-7", 5)),
        // No id at all: quarantined, acked, kept for an operator.
        ("orders/45", None, created(45, "A-1", 9)),
        ("orders/46", Some("evt-46-created"), created(46, "A-1", 2)),
    ];
    support::publish(broker.port, "inventory-demo-publisher", &events)?;
    eprintln!("published {} events; consuming until idle", events.len());
    let run = RunArgs {
        exit_when_idle: Some(2),
        ..run
    };
    let summary = consume(&addr, &db, &run)?;
    eprintln!("this run: {summary:?}");
    println!("{}", report(&db)?);
    Ok(())
}
