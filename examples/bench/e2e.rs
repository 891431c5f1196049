//! Publish-to-PUBACK throughput through mosquitto on loopback: the edge-inbox [`Consumer`] (commit, then
//! PUBACK, in order) against a bare rumqttc consumer that acks every publish on receipt.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use edge_inbox::{Consumer, Delivery, Inbox, MqttConfig, StopHandle, Tx};
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{Client, Event, MqttOptions};
use rumqttc::Outgoing;

use super::field_vfs::Written;
use super::table::{median, SLICES_E2E};
use super::PAYLOAD;

/// The broker's window of unacknowledged QoS1 deliveries per client, both ways (our Receive Maximum,
/// mosquitto's `max_inflight_messages` and the publisher's own limit).
pub const INFLIGHT: u16 = 1024;
/// Longest any one slice may take before the run is abandoned.
pub(crate) const SLICE_DEADLINE: Duration = Duration::from_secs(300);

/// What consumes a row's deliveries.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum E2eRow {
    Bare,
    Inbox(usize),
    /// The same handler and batch straight into `process_batch_into`, no MQTT: the storage's share.
    Core(usize),
}

impl E2eRow {
    fn label(self) -> String {
        match self {
            E2eRow::Bare => "bare rumqttc, PUBACK on receipt (upper bound)".into(),
            E2eRow::Inbox(b) => format!("edge-inbox `Consumer`, batch {b}, commit then PUBACK"),
            E2eRow::Core(b) => format!("core only: `process_batch_into` {b}, no MQTT"),
        }
    }
    fn tag(self) -> String {
        match self {
            E2eRow::Bare => "bare".into(),
            E2eRow::Inbox(b) => format!("inbox{b}"),
            E2eRow::Core(b) => format!("core{b}"),
        }
    }
}

/// A mosquitto on a free loopback port, killed on drop.
pub(crate) struct Mosquitto {
    pub(crate) child: Child,
    pub(crate) port: u16,
}

pub(crate) fn mosquitto_exe() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("mosquitto"))
        .chain([PathBuf::from("/usr/sbin/mosquitto")])
        .find(|p| p.is_file())
}

static BROKER_NAGLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `--broker-nagle`: the benchmarks' mosquitto keeps its default, Nagle's algorithm on its connections.
pub fn set_broker_nagle(on: bool) {
    BROKER_NAGLE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the benchmarks' mosquitto runs with Nagle's algorithm (see [`set_broker_nagle`]).
pub fn broker_nagle() -> bool {
    BROKER_NAGLE.load(std::sync::atomic::Ordering::Relaxed)
}

impl Mosquitto {
    pub(crate) fn start(exe: &Path, dir: &Path) -> anyhow::Result<Mosquitto> {
        // Started as root, mosquitto drops to its own user; it only needs to read its config here.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let conf = dir.join("mosquitto.conf");
        // No broker persistence: sessions live in memory for the run. The windows are raised so the
        // broker never holds back what a batch of 256 needs, and the queue holds a whole slice. TCP_NODELAY
        // unless `--broker-nagle`: with Nagle's algorithm the broker holds a delivery back until the
        // consumer's host ACKs the previous segment, which a consumer that acks once per commit delays.
        let nodelay = !broker_nagle();
        std::fs::write(
            &conf,
            format!(
                "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n\
                 max_inflight_messages {INFLIGHT}\nmax_queued_messages 1000000\n\
                 set_tcp_nodelay {nodelay}\n\
                 log_dest stderr\nlog_type error\nlog_type warning\n"
            ),
        )?;
        let child = Command::new(exe)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let broker = Mosquitto { child, port };
        super::cores::pin_process(broker.child.id(), super::cores::Side::Broker)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("mosquitto did not start listening on {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(broker)
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Publishes `ids` with QoS1 as fast as the broker takes them, each with its `message-id` user
/// property. Returns the instant of the first publish, taken once the publisher is connected.
fn publish(port: u16, client_id: &str, topic: &str, ids: Vec<String>) -> anyhow::Result<Instant> {
    let _side = super::cores::broker_side()?;
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_outgoing_inflight_upper_limit(INFLIGHT);
    let (client, mut conn) = Client::new(o, 1024);
    let deadline = Instant::now() + SLICE_DEADLINE;
    let n = ids.len();
    let (ready_tx, ready_rx) = mpsc::channel();
    let poller = std::thread::spawn(move || -> anyhow::Result<()> {
        let mut acked = 0;
        while acked < n {
            anyhow::ensure!(
                Instant::now() < deadline,
                "publisher: only {acked} of {n} acked in time"
            );
            match conn.recv_timeout(Duration::from_millis(200)) {
                Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                    let _ = ready_tx.send(());
                }
                Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
                Ok(Err(e)) => bail!("publisher: {e}"),
                _ => {}
            }
        }
        Ok(())
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .context("publisher did not connect")?;
    let start = Instant::now();
    let topic = topic.to_string();
    for id in ids {
        let mut props = PublishProperties::default();
        props.user_properties.push(("message-id".into(), id));
        client.publish_with_properties(topic.clone(), QoS::AtLeastOnce, false, PAYLOAD, props)?;
    }
    poller.join().expect("publisher poll thread")?;
    let _ = client.try_disconnect();
    Ok(start)
}

/// The upper bound: a persistent-session consumer with manual acks that acks each publish as soon as
/// it arrives, on the thread that polls the connection. Returns when `n` are acked and the disconnect
/// (queued after the acks) has gone out, with that instant. `ready` is signalled once subscribed.
pub(crate) fn bare_consume(
    port: u16,
    client_id: &str,
    topic: &str,
    n: usize,
    ready: mpsc::Sender<()>,
) -> anyhow::Result<Instant> {
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_clean_start(false)
        .set_manual_acks(true)
        .set_session_expiry_interval(Some(3600))
        .set_receive_maximum(Some(INFLIGHT));
    let (client, mut conn) = Client::new(o, usize::from(INFLIGHT) + 16);
    let deadline = Instant::now() + SLICE_DEADLINE;
    let mut acked = 0;
    let mut waiting = std::collections::VecDeque::new();
    loop {
        anyhow::ensure!(
            Instant::now() < deadline,
            "bare consumer: {acked} of {n} in time"
        );
        match conn.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                if ack.session_present {
                    let _ = ready.send(());
                } else {
                    client.try_subscribe(topic, QoS::AtLeastOnce)?;
                }
            }
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                let _ = ready.send(());
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => waiting.push_back(p),
            Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) => return Ok(Instant::now()),
            Ok(Err(e)) => bail!("bare consumer: {e}"),
            _ => {}
        }
        // Acks wait here only while rumqttc's request channel is full (it is drained as it polls).
        while let Some(p) = waiting.front() {
            if client.try_ack(p).is_err() {
                break;
            }
            waiting.pop_front();
            acked += 1;
            if acked == n {
                client.try_disconnect()?;
            }
        }
    }
}

/// A `Consumer` run's deliveries, counted in its handler. At the last one it checks where the consumer's threads
/// run (`--split-cores`; they all still run then) and stops the consumer, so that the batch holding that
/// delivery commits and acks before `run` returns.
pub(crate) struct Countdown {
    stop: StopHandle,
    n: usize,
    seen: usize,
    placed: anyhow::Result<()>,
}

impl Countdown {
    pub(crate) fn new(stop: StopHandle, n: usize) -> Countdown {
        Countdown {
            stop,
            n,
            seen: 0,
            placed: Ok(()),
        }
    }

    /// Counts a delivery; returns how many so far.
    pub(crate) fn count(&mut self) -> usize {
        self.seen += 1;
        if self.seen == self.n {
            self.placed = super::cores::check_placement();
            self.stop.stop();
        }
        self.seen
    }

    /// The placement check's verdict (always fine without the split).
    pub(crate) fn placed(self) -> anyhow::Result<()> {
        self.placed
    }
}

/// Signals `ready` 300 ms from now, on a thread of its own: a `Consumer` has no subscribed event to wait for,
/// so a run starts publishing once its poll thread has had time to connect and subscribe.
pub(crate) fn ready_soon(ready: mpsc::Sender<()>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let _ = ready.send(());
    })
}

/// CPU time (user + system) of a process so far, in clock ticks (1/100 s on Linux).
fn cpu_ticks(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    super::threads::stat_ticks(&stat).map_or(0, |(_, ticks)| ticks)
}

/// One row's state across slices: its inbox file (kept, so its WAL is warm) and its names.
struct E2eContender {
    row: E2eRow,
    inbox: Option<Inbox>,
    topic: String,
    client_id: String,
    next: usize,
    elapsed: Duration,
    timed: usize,
    acked: u64,
    /// CPU ticks of timed slices: this process (publisher, consumer, SQLite) and the broker.
    cpu_self: u64,
    cpu_broker: u64,
    /// Bytes written during timed slices.
    written: Written,
}

impl E2eContender {
    fn new(dir: &Path, row: E2eRow, round: usize) -> anyhow::Result<E2eContender> {
        let inbox = match row {
            E2eRow::Bare => None,
            E2eRow::Inbox(_) | E2eRow::Core(_) => Some(Inbox::open(
                dir.join(format!("e2e-{}-{round}.db", row.tag())),
                super::inbox_config(),
            )?),
        };
        Ok(E2eContender {
            row,
            inbox,
            topic: format!("bench/e2e/{}/{round}", row.tag()),
            client_id: format!("bench-e2e-{}-{round}", row.tag()),
            next: 0,
            elapsed: Duration::ZERO,
            timed: 0,
            acked: 0,
            cpu_self: 0,
            cpu_broker: 0,
            written: Written::default(),
        })
    }

    /// Publishes `len` new deliveries and consumes them; times first publish to last PUBACK.
    fn slice(&mut self, broker: &Mosquitto, len: usize, timed: bool) -> anyhow::Result<()> {
        let port = broker.port;
        let broker_pid = broker.child.id().to_string();
        let cpu = (cpu_ticks("self"), cpu_ticks(&broker_pid));
        let written = Written::now();
        let prefix = format!("{}-{}", self.client_id, self.next);
        let ids = super::ids(&prefix, len);
        self.next += len;
        if let E2eRow::Core(batch) = self.row {
            let inbox = self.inbox.as_mut().expect("core row");
            let ds = super::deliveries(&ids, PAYLOAD);
            let mut outcomes = Vec::with_capacity(batch);
            let mut handler = super::kv_handler();
            let (done, t) = super::timed(|| {
                super::process_batches(inbox, &ds, batch, &mut handler, &mut outcomes)
            });
            anyhow::ensure!(done? == len, "core row: unexpected outcomes");
            if timed {
                self.elapsed += t;
                self.timed += len;
                self.cpu_self += cpu_ticks("self") - cpu.0;
                self.cpu_broker += cpu_ticks(&broker_pid) - cpu.1;
                self.written.add(Written::now().since(written));
            }
            self.acked += len as u64;
            return Ok(());
        }
        let (ready_tx, ready_rx) = mpsc::channel();
        let acked = std::thread::scope(|s| -> anyhow::Result<u64> {
            let consumer = match self.row {
                E2eRow::Bare => {
                    let (id, topic) = (self.client_id.clone(), self.topic.clone());
                    s.spawn(move || {
                        bare_consume(port, &id, &topic, len, ready_tx).map(|t| (t, len as u64))
                    })
                }
                E2eRow::Core(_) => unreachable!("handled above"),
                E2eRow::Inbox(batch) => {
                    let inbox = self.inbox.take().expect("inbox row");
                    let mqtt = MqttConfig::new("127.0.0.1", port, &self.client_id)
                        .subscribe(&self.topic)
                        .inflight(INFLIGHT);
                    let inbox_slot = &mut self.inbox;
                    // Named as in the latency mode (`--split-cores` looks for it).
                    std::thread::Builder::new()
                        .name("consumer".into())
                        .spawn_scoped(s, move || {
                            // Idle exit only bounds a run that lost deliveries; a complete one stops
                            // itself at the last delivery.
                            let mut consumer = Consumer::new(inbox, super::SCOPE, mqtt)
                                .batch(batch, Duration::ZERO)
                                .overlap_syncs(super::overlap_syncs())
                                .exit_when_idle(Duration::from_secs(30));
                            let mut last = Countdown::new(consumer.stop_handle(), len);
                            // The trivial handler of the table, counting.
                            let handler =
                                |tx: &mut Tx<'_>, _d: &Delivery<'_>| -> anyhow::Result<()> {
                                    tx.put("counter", &(last.count() as u64))?;
                                    Ok(())
                                };
                            // The broker keeps the session: the first run subscribes, later ones find
                            // their deliveries queued.
                            let waker = ready_soon(ready_tx);
                            let summary = consumer.run(handler);
                            let end = Instant::now();
                            let _ = waker.join();
                            *inbox_slot = Some(consumer.into_inbox());
                            let summary = summary?;
                            anyhow::ensure!(
                                summary.processed == len as u64
                                    && summary.acked == len as u64
                                    && summary.duplicates == 0,
                                "consumer: {summary:?}, expected {len} processed and acked"
                            );
                            last.placed()?;
                            Ok((end, summary.acked))
                        })?
                }
            };
            ready_rx
                .recv_timeout(Duration::from_secs(10))
                .context("consumer did not subscribe")?;
            let publisher = format!("{}-pub", self.client_id);
            let start = publish(port, &publisher, &self.topic, ids)?;
            let (end, acked) = consumer.join().expect("consumer thread")?;
            if timed {
                self.elapsed += end - start;
                self.timed += len;
                self.cpu_self += cpu_ticks("self") - cpu.0;
                self.cpu_broker += cpu_ticks(&broker_pid) - cpu.1;
                self.written.add(Written::now().since(written));
            }
            Ok(acked)
        })?;
        self.acked += acked;
        Ok(())
    }

    fn rate(&self) -> f64 {
        self.timed as f64 / self.elapsed.as_secs_f64()
    }

    /// CPU µs per message of this process and of the broker, and the cores busy on average (both
    /// processes over the timed wall time).
    fn cpu(&self) -> [f64; 3] {
        let us = |ticks: u64| ticks as f64 * 10_000.0 / self.timed as f64;
        let cores = (self.cpu_self + self.cpu_broker) as f64 / 100.0 / self.elapsed.as_secs_f64();
        [us(self.cpu_self), us(self.cpu_broker), cores]
    }
}

/// Runs `rounds` rounds of `n` messages per row, rows taking turns slice by slice (order rotated per
/// slice), and prints the table. Skips with a message when mosquitto is not installed.
pub fn run(dir: &Path, n: usize, rounds: usize, batches: &[usize]) -> anyhow::Result<()> {
    let Some(exe) = mosquitto_exe() else {
        println!("\n--mode e2e skipped: mosquitto not found on PATH nor at /usr/sbin/mosquitto");
        return Ok(());
    };
    let broker_dir = tempfile::Builder::new()
        .prefix("mosquitto-")
        .tempdir_in(dir)?;
    let broker = Mosquitto::start(&exe, broker_dir.path())?;
    eprintln!("mosquitto ({}) on 127.0.0.1:{}", exe.display(), broker.port);
    let mut rows = vec![E2eRow::Bare];
    for &b in batches {
        rows.extend([E2eRow::Inbox(b), E2eRow::Core(b)]);
    }
    let slice = (n / SLICES_E2E).max(1);
    let mut rates: Vec<Vec<f64>> = Vec::new();
    let mut cpus: Vec<Vec<[f64; 3]>> = Vec::new();
    let mut bytes = vec![(Written::default(), 0u64); rows.len()];
    for round in 0..rounds {
        let mut cs = rows
            .iter()
            .map(|&r| E2eContender::new(dir, r, round))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Warm-up (untimed): creates the sessions and subscriptions and wraps each inbox's WAL once.
        for c in &mut cs {
            c.slice(&broker, 1100, false)?;
        }
        for s in 0..SLICES_E2E {
            let k = cs.len();
            for j in 0..k {
                let c = &mut cs[(s + j) % k];
                c.slice(&broker, slice, true)?;
            }
        }
        for c in &cs {
            eprintln!(
                "round {}: {:<60} {:>10.0} msg/s ({} acked)",
                round + 1,
                c.row.label(),
                c.rate(),
                c.acked
            );
        }
        rates.push(cs.iter().map(E2eContender::rate).collect());
        for (b, c) in bytes.iter_mut().zip(&cs) {
            b.0.add(c.written);
            b.1 += c.timed as u64;
        }
        cpus.push(cs.iter().map(E2eContender::cpu).collect());
        drop(cs);
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::remove_file(path)?;
            }
        }
    }
    drop(broker);
    println!(
        "\n| end to end, mosquitto on loopback, QoS1, synchronous=FULL, n={} per row, {SLICES_E2E} slices, median of {rounds} rounds | msgs/s | ratio to bare | `Consumer` / core only, same batch | target | met? |",
        slice * SLICES_E2E
    );
    println!("|---|---:|---:|---:|---|---|");
    for (i, row) in rows.iter().enumerate() {
        let rate = median(rates.iter().map(|r| r[i]).collect());
        let ratio = median(rates.iter().map(|r| r[i] / r[0]).collect());
        // The core row follows its consumer row.
        let vs_core = match row {
            E2eRow::Inbox(_) => format!(
                "{:.2}x",
                median(rates.iter().map(|r| r[i] / r[i + 1]).collect())
            ),
            _ => "-".into(),
        };
        let (target, met) = match row {
            E2eRow::Inbox(b) if *b > 1 => (">= 0.8x", if ratio >= 0.8 { "yes" } else { "**no**" }),
            _ => ("-", "-"),
        };
        println!(
            "| {} | {rate:.0} | {ratio:.2}x | {vs_core} | {target} | {met} |",
            row.label()
        );
    }
    println!("\nPer-round rates (msgs/s):\n");
    for (i, row) in rows.iter().enumerate() {
        let per: Vec<String> = rates.iter().map(|r| format!("{:.0}", r[i])).collect();
        println!("- {}: {}", row.label(), per.join(", "));
    }
    println!(
        "\n| CPU per message (timed slices, median of {rounds} rounds) | this process (publisher, consumer, SQLite) µs | mosquitto µs | cores busy (of {}) |",
        super::cores::count()
    );
    println!("|---|---:|---:|---:|");
    for (i, row) in rows.iter().enumerate() {
        let m = |k: usize| median(cpus.iter().map(|c| c[i][k]).collect());
        println!(
            "| {} | {:.1} | {:.1} | {:.2} |",
            row.label(),
            m(0),
            m(1),
            m(2)
        );
    }
    println!(
        "\n| bytes written per delivery (timed slices, pooled over {rounds} rounds; sync +{} ms) | WAL | database file | block layer | syncs |",
        super::field_vfs::delay().as_millis()
    );
    println!("|---|---:|---:|---:|---:|");
    for (row, (w, d)) in rows.iter().zip(&bytes) {
        let (wal, db, block) = w.per(*d);
        println!(
            "| {} | {wal:.0} | {db:.0} | {block:.0} | {:.3} |",
            row.label(),
            w.syncs as f64 / (*d).max(1) as f64
        );
    }
    Ok(())
}
