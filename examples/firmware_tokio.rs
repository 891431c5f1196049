//! The firmware of `examples/firmware.rs` on tokio: ONE rumqttc `AsyncClient` (MQTT 5) publishes telemetry and
//! receives commands, and the commands go through the inbox on that same connection.
//!
//! The runtime is a current-thread one, to show that nothing of the inbox needs a thread of the runtime: a
//! task polls the event loop and hands commands to an [`AsyncFeed`] (a full channel is waited on in tokio's
//! blocking pool); a commit thread ([`ConsumerCore::spawn`]) commits each command with its identity and
//! queues its PUBACK, through the feed's ack gate, only on the connection the command came on; a task
//! publishes telemetry on the same client.
//!
//! ```text
//! cargo run --example firmware_tokio -- --broker 127.0.0.1:1883 --db /tmp/fw.db --device gw7
//! mosquitto_pub -V mqttv5 -q 1 -t cmd/gw7/add -D publish user-property message-id cmd-1 -m '{"add":5}'
//! ```
//!
//! Commands are JSON `{"add": N}` on `cmd/<device>/...` with the user property `message-id`; the handler adds
//! N to `sum` and 1 to `count` in the inbox's key-value state, exactly once per message id. SIGINT/SIGTERM
//! (tokio's signal handler) stop it gracefully: the batch in flight is committed and acked, then the client
//! disconnects. On exit it prints `{"processed":..,"duplicates":..,"telemetry":..}` on stdout; it exits
//! non-zero when the run failed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use edge_inbox::{AsyncFeed, Config, ConsumerCore, Inbox};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, Incoming, MqttOptions};
use tokio::signal::unix::{signal, SignalKind};

#[path = "support/firmware_device.rs"]
mod device;
use device::{slowed, Args, SCOPE, WINDOW};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
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
    let (client, mut eventloop) = AsyncClient::new(options, 1024);

    // Opening runs SQLite (and an fsync): off the runtime's thread, like every commit after it.
    let db = args.db.clone();
    let inbox = tokio::task::spawn_blocking(move || Inbox::open(&db, Config::default())).await??;
    let mut core = ConsumerCore::new(inbox, SCOPE);
    if let Some(idle) = args.exit_when_idle {
        core = core.exit_when_idle(Duration::from_secs(idle));
    }
    let (feed, commits) = core.spawn(slowed(args.apply_ms), client.clone(), WINDOW)?;
    let mut feed = AsyncFeed::new(feed);

    // The graceful stop, in a task of its own so that the event loop keeps writing the last PUBACKs: on
    // SIGTERM/SIGINT the commit thread finishes its batch and queues their acks (`join_until`), and only
    // then is the DISCONNECT queued, behind them. An idle exit of the commit thread ends the same way.
    let stopping = Arc::new(AtomicBool::new(false));
    // Also stopped when the broker refuses the commands' subscription (a permit kept until awaited).
    let refused_stop = Arc::new(tokio::sync::Notify::new());
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let shutdown = {
        let (client, stopping, refused) = (client.clone(), stopping.clone(), refused_stop.clone());
        tokio::spawn(async move {
            let signalled = async {
                tokio::select! {
                    _ = sigterm.recv() => log::info!("SIGTERM: stopping"),
                    _ = sigint.recv() => log::info!("SIGINT: stopping"),
                    _ = refused.notified() => {}
                }
            };
            let (core, result) = commits.join_until(signalled).await;
            stopping.store(true, Ordering::SeqCst);
            let _ = client.disconnect().await;
            // Closing the inbox blocks (a checkpoint, syncs): off the runtime's threads, so that the event
            // loop goes on writing the last PUBACKs and the DISCONNECT meanwhile.
            let _ = tokio::task::spawn_blocking(move || drop(core)).await;
            result
        })
    };

    // Telemetry on the same client.
    let telemetry = Arc::new(AtomicU64::new(0));
    let publisher = {
        let (client, sent, stopping) = (client.clone(), telemetry.clone(), stopping.clone());
        let topic = format!("telemetry/{}", args.device);
        let mut period = tokio::time::interval(Duration::from_millis(args.telemetry_ms));
        tokio::spawn(async move {
            while !stopping.load(Ordering::SeqCst) {
                period.tick().await;
                let n = sent.load(Ordering::Relaxed);
                let body = format!(r#"{{"seq":{n}}}"#);
                if client
                    .try_publish(&topic, QoS::AtLeastOnce, false, body)
                    .is_ok()
                {
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    let commands = format!("cmd/{}/#", args.device);
    let mut backoff = Duration::from_millis(100);
    let mut refused = None;
    loop {
        let event = if shutdown.is_finished() {
            match tokio::time::timeout(Duration::from_secs(10), eventloop.poll()).await {
                Ok(event) => event,
                // The broker did not close the connection after our DISCONNECT: leave it.
                Err(_) => break,
            }
        } else {
            eventloop.poll().await
        };
        match event {
            Ok(Event::Incoming(Incoming::ConnAck(ack))) => {
                backoff = Duration::from_millis(100);
                // A closed feed means the commit thread has ended: the shutdown task takes it from here.
                let _ = feed.connected(ack.session_present).await;
                // Again at every connect: a kept session may lack a filter added since.
                client.try_subscribe(commands.as_str(), QoS::AtLeastOnce)?;
            }
            Ok(Event::Incoming(Incoming::SubAck(ack))) => match device::granted(&ack, &commands) {
                Ok(()) => {
                    let _ = feed.subscribed().await;
                }
                // Stopped like a SIGTERM: the batch in flight is committed and acked first. (A device
                // whose broker refuses only for a while may reconnect later instead, as `Consumer` does.)
                Err(e) => {
                    log::error!("{e:#}: stopping");
                    refused.get_or_insert(e);
                    refused_stop.notify_one();
                }
            },
            Ok(Event::Incoming(Incoming::Publish(p))) => {
                if stopping.load(Ordering::SeqCst) {
                    continue; // not committed by this run: the broker redelivers it
                }
                if p.topic.starts_with(b"cmd/") {
                    let _ = feed.publish_v5(p).await;
                } else if p.qos != QoS::AtMostOnce {
                    // Not for the inbox: acked in turn behind the commands received before it.
                    let _ = feed.pass_through(p.pkid).await;
                }
            }
            Ok(_) => {}
            Err(e) => {
                // First: no ack of the old connection may leave on the next one.
                let _ = feed.lost_v5(&mut eventloop).await;
                if stopping.load(Ordering::SeqCst) {
                    break; // the broker closed the connection after our DISCONNECT
                }
                log::warn!("connection lost: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    drop(feed);
    let _ = publisher.await;
    let summary = shutdown.await??;
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
