//! Firmware that already owns its MQTT connection: ONE rumqttc (MQTT 5, sync) client publishes telemetry and
//! receives commands, and the commands go through the inbox on that same connection.
//!
//! The main thread polls the connection and feeds the inbox ([`Feed`]); a commit thread
//! ([`ConsumerCore::spawn`]) commits each command with its identity and queues its PUBACK, through the feed's
//! ack gate, only on the connection the command came on; a telemetry thread publishes on the same client.
//!
//! ```text
//! cargo run --example firmware -- --broker 127.0.0.1:1883 --db /tmp/fw.db --device gw7
//! mosquitto_pub -V mqttv5 -q 1 -t cmd/gw7/add -D publish user-property message-id cmd-1 -m '{"add":5}'
//! ```
//!
//! Commands are JSON `{"add": N}` on `cmd/<device>/...` with the user property `message-id`; the handler adds
//! N to `sum` and 1 to `count` in the inbox's key-value state, exactly once per message id. SIGINT/SIGTERM stop
//! it gracefully: the batch in flight is committed and acked, then the client disconnects. On exit it prints
//! `{"processed":..,"duplicates":..,"telemetry":..}` on stdout; it exits non-zero when the run failed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use edge_inbox::{Config, ConsumerCore, Inbox};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{Client, Event, Incoming, MqttOptions};

#[path = "support/firmware_device.rs"]
mod device;
use device::{slowed, Args, SCOPE, WINDOW};

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let (host, port) = args
        .broker
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("--broker must be HOST:PORT"))?;
    let port: u16 = port.parse()?;

    // The firmware's one connection: persistent session and manual acks, which the inbox needs.
    let mut options = MqttOptions::new(&args.device, host, port);
    options
        .set_clean_start(false)
        .set_manual_acks(true)
        .set_keep_alive(Duration::from_secs(30));
    options.set_session_expiry_interval(Some(7 * 24 * 3600));
    options.set_receive_maximum(Some(WINDOW));
    options.set_max_packet_size(Some(edge_inbox::DEFAULT_MAX_PACKET));
    // A batch's PUBACKs leave back to back: without this, all but the first wait for a delayed TCP ACK.
    let mut network = options.network_options();
    network.set_tcp_nodelay(true);
    options.set_network_options(network);
    let (client, mut connection) = Client::new(options, 1024);

    let inbox = Inbox::open(&args.db, Config::default())?;
    let mut core = ConsumerCore::new(inbox, SCOPE);
    if let Some(idle) = args.exit_when_idle {
        core = core.exit_when_idle(Duration::from_secs(idle));
    }
    let (mut feed, commits) = core.spawn(slowed(args.apply_ms), client.clone(), WINDOW)?;

    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;

    // Telemetry on the same client, from a thread of its own.
    let telemetry = Arc::new(AtomicU64::new(0));
    let telemetry_stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let (client, sent, done) = (client.clone(), telemetry.clone(), telemetry_stop.clone());
        let topic = format!("telemetry/{}", args.device);
        let period = Duration::from_millis(args.telemetry_ms);
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let n = sent.load(Ordering::Relaxed);
                let body = format!(r#"{{"seq":{n}}}"#);
                if client
                    .try_publish(&topic, QoS::AtLeastOnce, false, body)
                    .is_ok()
                {
                    sent.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(period);
            }
        })
    };

    // The stop, on a thread of its own: on SIGTERM/SIGINT (or once the commit thread has ended by itself)
    // the commit thread finishes its batch and queues its acks, and the DISCONNECT goes behind them. The
    // loop below blocks in `recv` meanwhile, never in a `recv_timeout`: a poll cut short by a timeout can
    // drop a request rumqttc has already taken from its channel (a PUBACK among them) while the later ones
    // are written, acks out of arrival order.
    let stopping = Arc::new(AtomicBool::new(false));
    let stopper = {
        let (stop, stopping, client) = (stop.clone(), stopping.clone(), client.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) && !commits.is_finished() {
                std::thread::sleep(Duration::from_millis(20));
            }
            commits.stop();
            telemetry_stop.store(true, Ordering::Relaxed);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !commits.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            stopping.store(true, Ordering::SeqCst);
            while client.try_disconnect().is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            commits.join()
        })
    };

    let commands = format!("cmd/{}/#", args.device);
    let mut backoff = Duration::from_millis(100);
    let mut refused = None;
    let mut stopping_since: Option<Instant> = None;
    loop {
        if stopping_since.is_none() && stopping.load(Ordering::SeqCst) {
            stopping_since = Some(Instant::now());
        }
        // Bounded: the broker closes the connection after our DISCONNECT, and pings come meanwhile.
        if stopping_since.is_some_and(|since| since.elapsed() > Duration::from_secs(10)) {
            break;
        }
        match connection.recv() {
            Ok(Ok(Event::Incoming(Incoming::ConnAck(ack)))) => {
                backoff = Duration::from_millis(100);
                // A closed feed means the commit thread has ended: the stopper takes it from there.
                let _ = feed.connected(ack.session_present);
                // Again at every connect: a kept session may lack a filter added since.
                client.try_subscribe(commands.as_str(), QoS::AtLeastOnce)?;
            }
            Ok(Ok(Event::Incoming(Incoming::SubAck(ack)))) => {
                match device::granted(&ack, &commands) {
                    Ok(()) => {
                        let _ = feed.subscribed();
                    }
                    // Stopped like a SIGTERM: the batch in flight is committed and acked first. (A device
                    // whose broker refuses only for a while may reconnect later instead, as `Consumer` does.)
                    Err(e) => {
                        log::error!("{e:#}: stopping");
                        refused.get_or_insert(e);
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
            Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => {
                if stop.load(Ordering::Relaxed) || stopping_since.is_some() {
                    continue; // not committed by this run: the broker redelivers it
                }
                if p.topic.starts_with(b"cmd/") {
                    let _ = feed.publish_v5(p);
                } else if p.qos != QoS::AtMostOnce {
                    // Not for the inbox: acked in turn behind the commands received before it.
                    let _ = feed.pass_through(p.pkid);
                }
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                // First: no ack of the old connection may leave on the next one.
                let _ = feed.because(&e).lost_v5(&mut connection.eventloop);
                if stopping.load(Ordering::SeqCst) {
                    break; // the broker closed the connection after our DISCONNECT
                }
                log::warn!("connection lost: {e}; retrying in {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(_) => break,
        }
    }
    drop(feed);
    let _ = publisher.join();
    let (_core, result) = stopper
        .join()
        .map_err(|_| anyhow::anyhow!("the stopping thread panicked"))?;
    let summary = result?;
    if let Some(e) = refused {
        return Err(e);
    }
    println!(
        r#"{{"processed":{},"duplicates":{},"telemetry":{}}}"#,
        summary.processed,
        summary.duplicates,
        telemetry.load(Ordering::Relaxed)
    );
    Ok(())
}
