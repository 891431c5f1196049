//! Publish-to-PUBACK latency at a steady offered load through mosquitto: the edge-inbox [`Consumer`] with its
//! default settings against the bare consumer that acks on receipt, at 10%, 50% and 90% of the saturation
//! rate measured in the same round, beside the disk's own fsync time.
//!
//! Latency of one message: from the moment the publisher hands it to its client (stamped into the payload)
//! to the moment the consumer's PUBACK for it reaches the broker's side of the consumer's connection. A
//! relay on 127.0.0.1 in front of the broker forwards both directions unchanged and reads the MQTT framing:
//! broker to consumer it maps each QoS1 PUBLISH's packet id to the stamp in its payload, consumer to broker it
//! matches each PUBACK to that stamp. Both consumers are measured by the same relay. The part before the
//! relay's read is split by the publisher's own client: when it wrote each PUBLISH (TCP_NODELAY, as the
//! `Consumer` sets) and when the broker's PUBACK for it came back.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use edge_inbox::{Consumer, Delivery, Inbox, MqttConfig, Tx};
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{Client, Event, MqttOptions};
use rumqttc::Outgoing;

use super::e2e::{
    bare_consume, mosquitto_exe, ready_soon, Countdown, Mosquitto, INFLIGHT, SLICE_DEADLINE,
};
use super::field_vfs::{self, Written};
use super::steal::{Steal, StealWatch};
use super::table::median;
use super::threads::{ThreadWatch, Usage};

/// Loads offered, as fractions of the saturation rate.
const LOADS: [f64; 3] = [0.1, 0.5, 0.9];

/// `--burst-ms`, in microseconds: 0 publishes evenly paced.
static BURST_US: AtomicU64 = AtomicU64::new(0);

/// Publishes each paced load in bursts, one every `every` (`--burst-ms`).
pub fn set_burst(every: Duration) {
    BURST_US.store(every.as_micros() as u64, Ordering::Relaxed);
}

/// When message `i` of a load offered at `rate` leaves, from the slice's start: evenly paced, or with the
/// other messages of its burst at the burst's start.
fn publish_at(i: usize, rate: f64) -> Duration {
    let burst = Duration::from_micros(BURST_US.load(Ordering::Relaxed));
    if burst.is_zero() {
        return Duration::from_secs_f64(i as f64 / rate);
    }
    let per_burst = (rate * burst.as_secs_f64()).max(1.0);
    burst.mul_f64((i as f64 / per_burst).floor())
}

/// Nanoseconds since the first call: the one clock of publisher, relay and report.
fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// The instant [`now_ns`] counts from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// What one run saw at the relay, in nanoseconds of [`now_ns`]: per message its publish stamp, when the
/// relay read its PUBLISH from the broker, and when it read its PUBACK from the consumer.
#[derive(Default)]
struct Seen {
    pending: HashMap<u16, (u64, u64)>,
    acks: Vec<(u64, u64, u64)>,
}

/// A relay in front of the broker for one run's consumer connections.
struct Relay {
    port: u16,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn start(broker: u16) -> anyhow::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        // Named, as the pumps and the publisher's threads are, so that a profile tells the set-up's threads
        // from the consumer's.
        std::thread::Builder::new()
            .name("relay".into())
            .spawn(move || {
                // The pumps it starts inherit its CPUs.
                if let Err(e) = super::cores::pin_current(super::cores::Side::Broker) {
                    eprintln!("relay: {e}");
                }
                while !st.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            let _ = client.set_nonblocking(false);
                            if let Ok(server) = TcpStream::connect(("127.0.0.1", broker)) {
                                let _ = client.set_nodelay(true);
                                let _ = server.set_nodelay(true);
                                pump(server.try_clone(), client.try_clone(), s.clone(), true);
                                pump(Ok(client), Ok(server), s.clone(), false);
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })?;
        Ok(Relay { port, seen, stop })
    }

    fn take(&self) -> Vec<(u64, u64, u64)> {
        std::mem::take(&mut self.seen.lock().unwrap().acks)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Forwards `from` to `to` as it arrives and reads the packets on the way: PUBLISH when `down` (broker to
/// consumer), PUBACK otherwise.
fn pump(
    from: std::io::Result<TcpStream>,
    to: std::io::Result<TcpStream>,
    seen: Arc<Mutex<Seen>>,
    down: bool,
) {
    let (Ok(mut from), Ok(mut to)) = (from, to) else {
        return;
    };
    let name = if down {
        "relay-publishes"
    } else {
        "relay-pubacks"
    };
    let started = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let mut chunk = vec![0u8; 64 * 1024];
            let mut buf: Vec<u8> = Vec::new();
            loop {
                let k = match from.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => k,
                };
                // Read before forwarding: a PUBLISH's stamp must be recorded before its PUBACK can come back.
                let at = now_ns();
                buf.extend_from_slice(&chunk[..k]);
                let mut used = 0;
                while let Some((header, body, len)) = packet(&buf[used..]) {
                    let mut s = seen.lock().unwrap();
                    if down && header >> 4 == 3 && (header >> 1) & 3 == 1 {
                        if let Some((pid, stamp)) = publish_stamp(body) {
                            s.pending.insert(pid, (stamp, at));
                        }
                    } else if !down && header >> 4 == 4 && body.len() >= 2 {
                        let pid = u16::from_be_bytes([body[0], body[1]]);
                        if let Some((stamp, down)) = s.pending.remove(&pid) {
                            s.acks.push((stamp, down, at));
                        }
                    }
                    used += len;
                }
                buf.drain(..used);
                if to.write_all(&chunk[..k]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Both);
        });
    // The run then fails for want of the packets this one would have carried.
    if let Err(e) = started {
        eprintln!("relay: cannot start the {name} pump: {e}");
    }
}

/// One whole MQTT packet at the start of `b`: fixed header byte, body, total length.
fn packet(b: &[u8]) -> Option<(u8, &[u8], usize)> {
    let (len, n) = varint(b.get(1..)?)?;
    let total = 1 + n + len;
    (b.len() >= total).then(|| (b[0], &b[1 + n..total], total))
}

/// An MQTT variable byte integer: its value and its length in bytes.
fn varint(b: &[u8]) -> Option<(usize, usize)> {
    let mut v = 0usize;
    for (i, &x) in b.iter().take(4).enumerate() {
        v |= usize::from(x & 0x7f) << (7 * i);
        if x & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// Packet id and payload stamp of an MQTT 5 QoS1 PUBLISH body.
fn publish_stamp(body: &[u8]) -> Option<(u16, u64)> {
    let tl = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    let mut pos = 2 + tl;
    let pid = u16::from_be_bytes([*body.get(pos)?, *body.get(pos + 1)?]);
    pos += 2;
    let (plen, n) = varint(body.get(pos..)?)?;
    pos += n + plen;
    let stamp = body.get(pos..pos + 8)?;
    Some((pid, u64::from_le_bytes(stamp.try_into().ok()?)))
}

/// When the publisher's client wrote a message to the broker and when it read the broker's PUBACK for it,
/// by the message's stamp (both in [`now_ns`]).
type Sent = HashMap<u64, (u64, u64)>;

/// Publishes `n` messages at `rate` per second (0: as fast as the broker takes them), each stamped. Returns,
/// by stamp, when the client wrote each one and when the broker's PUBACK for it came back: the part of a
/// delivery's way that lies before the broker forwards it.
fn publish_paced(
    port: u16,
    client_id: &str,
    topic: &str,
    n: usize,
    rate: f64,
) -> anyhow::Result<Sent> {
    // Its poll thread, started below, inherits the side.
    let _side = super::cores::broker_side()?;
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_outgoing_inflight_upper_limit(INFLIGHT);
    // Each PUBLISH leaves at once: under Nagle's algorithm the publisher's kernel holds the next ones until
    // the broker's side acknowledges the last segment, and a broker late for a moment (busy with a burst of
    // PUBACKs from the consumer) can then hold the publisher's stream for up to a delayed-ACK timeout, which
    // the run would count against the consumer.
    let mut net = o.network_options();
    net.set_tcp_nodelay(true);
    o.set_network_options(net);
    let (client, mut conn) = Client::new(o, 1024);
    let deadline = Instant::now() + SLICE_DEADLINE;
    let (ready_tx, ready_rx) = mpsc::channel();
    // The client writes the messages in the order they were handed to it: the kth outgoing PUBLISH is message
    // k, and its packet id is not reused before the broker's PUBACK for it.
    let poller = std::thread::Builder::new().name("publisher".into()).spawn(
        move || -> anyhow::Result<Vec<(u64, u64)>> {
            let mut times = vec![(0u64, 0u64); n];
            let mut by_pid: HashMap<u16, usize> = HashMap::new();
            let (mut written, mut acked) = (0usize, 0usize);
            while acked < n {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "publisher: {acked} of {n} acked in time"
                );
                match conn.recv_timeout(Duration::from_millis(200)) {
                    Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                        let _ = ready_tx.send(());
                    }
                    Ok(Ok(Event::Outgoing(Outgoing::Publish(pid)))) if written < n => {
                        times[written].0 = now_ns();
                        by_pid.insert(pid, written);
                        written += 1;
                    }
                    Ok(Ok(Event::Incoming(Packet::PubAck(ack)))) => {
                        if let Some(k) = by_pid.remove(&ack.pkid) {
                            times[k].1 = now_ns();
                        }
                        acked += 1;
                    }
                    Ok(Err(e)) => bail!("publisher: {e}"),
                    _ => {}
                }
            }
            Ok(times)
        },
    )?;
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .context("publisher did not connect")?;
    let start = Instant::now();
    let mut stamps = Vec::with_capacity(n);
    for i in 0..n {
        if rate > 0.0 {
            let at = start + publish_at(i, rate);
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        let stamp = now_ns();
        stamps.push(stamp);
        let mut payload = stamp.to_le_bytes().to_vec();
        payload.extend_from_slice(super::PAYLOAD);
        let mut props = PublishProperties::default();
        props
            .user_properties
            .push(("message-id".into(), timed_id(client_id, i as u64)));
        client.publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props)?;
    }
    let times = poller.join().expect("publisher poll thread")?;
    let _ = client.try_disconnect();
    Ok(stamps.into_iter().zip(times).collect())
}

/// The `i`th message id a run publishes: after the file's prefill in time (`--id-shape uuidv7`); the WAL's
/// warm-up commits under a scope of its own.
fn timed_id(client_id: &str, i: u64) -> String {
    super::shaped_id(super::stream_id(client_id, i), super::HISTORY + i)
}

/// Adds one run's CPU time and waits by thread name to a pool.
fn add_usage(pool: &mut BTreeMap<String, Usage>, run: &BTreeMap<String, Usage>) {
    for (name, used) in run {
        *pool.entry(name.clone()).or_default() += *used;
    }
}

/// Which consumer a run measures.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Inbox,
    Bare,
}

/// Latencies of messages, by part: publish to PUBACK, and the part of it before the relay read the PUBLISH
/// from the broker (the publisher, the broker and the TCP connection to the consumer), split further.
#[derive(Default, Clone)]
struct Parts {
    total: Vec<Duration>,
    to_consumer: Vec<Duration>,
    /// Of `to_consumer`: in the publisher's client before it wrote the PUBLISH, and from that write to the
    /// broker's PUBACK to the publisher (the broker had the message by then).
    in_publisher: Vec<Duration>,
    to_broker: Vec<Duration>,
    /// The rest: from the relay's read of the PUBLISH to its read of the PUBACK (the consumer's part).
    after_read: Vec<Duration>,
}

impl Parts {
    /// Pools another run's latencies with these.
    fn add(&mut self, other: Parts) {
        self.total.extend(other.total);
        self.to_consumer.extend(other.to_consumer);
        self.in_publisher.extend(other.in_publisher);
        self.to_broker.extend(other.to_broker);
        self.after_read.extend(other.after_read);
    }
}

/// What one run measured (all but its first tenth).
#[derive(Default)]
struct Latencies {
    parts: Parts,
    /// The inbox's syncs of its WAL during the run (every connection's).
    wal_syncs: Vec<Duration>,
    /// Beside `parts.total`, when each message was published ([`now_ns`]).
    published: Vec<u64>,
    /// When the inbox's WAL started over during the run ([`now_ns`]).
    wal_restarts: Vec<u64>,
    /// What the hypervisor took from the machine while the messages were published and consumed.
    steal: Option<Steal>,
    /// CPU time and waits for a core by thread name (and the broker's) meanwhile.
    cpu: BTreeMap<String, Usage>,
}

/// One run: a fresh consumer (and for the inbox a fresh file) takes `n` messages offered at `rate`. Returns
/// the latencies, the achieved rate (first publish to last PUBACK, all of them) and the bytes written during
/// the run (from the end of the file's preparation, its prefill and WAL warm-up, to the last delivery).
fn run_one(
    dir: &Path,
    broker: &Mosquitto,
    kind: Kind,
    tag: &str,
    n: usize,
    rate: f64,
    prefill: usize,
) -> anyhow::Result<(Latencies, f64, Written)> {
    let mut written = Written::now();
    let mut syncs_from = field_vfs::wal_sync_mark();
    let mut restarts_from = Instant::now();
    let relay = Relay::start(broker.port)?;
    let topic = format!("bench/latency/{tag}");
    let client_id = format!("bench-latency-{tag}");
    let (ready_tx, ready_rx) = mpsc::channel();
    let mut sent = Sent::new();
    let mut steal = None;
    let mut cpu = BTreeMap::new();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let consumer = match kind {
            Kind::Bare => {
                let (id, topic, port) = (client_id.clone(), topic.clone(), relay.port);
                std::thread::Builder::new()
                    .name("bare-consumer".into())
                    .spawn_scoped(s, move || {
                        bare_consume(port, &id, &topic, n, ready_tx).map(|_| ())
                    })?
            }
            Kind::Inbox => {
                let path = dir.join(format!("latency-{tag}.db"));
                let mut inbox = Inbox::open(&path, super::inbox_config())?;
                if prefill > 0 {
                    fill(&mut inbox, tag, prefill)?;
                }
                if !super::fresh_wal() {
                    wrap_wal(&inbox, &path, tag)?;
                }
                written = Written::now();
                syncs_from = field_vfs::wal_sync_mark();
                restarts_from = Instant::now();
                super::tail_trace::begin();
                let mqtt = MqttConfig::new("127.0.0.1", relay.port, &client_id)
                    .subscribe(&topic)
                    .inflight(INFLIGHT);
                // Named: its commits show under this name in `--trace-tail`'s timelines.
                std::thread::Builder::new()
                    .name("consumer".into())
                    .spawn_scoped(s, move || {
                        // Default batching; the idle exit only bounds a run that lost deliveries.
                        let mut consumer = Consumer::new(inbox, super::SCOPE, mqtt)
                            .overlap_syncs(super::overlap_syncs())
                            .exit_when_idle(Duration::from_secs(30));
                        let mut last = Countdown::new(consumer.stop_handle(), n);
                        let handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
                            if let Some(stamp) = d.payload.get(..8) {
                                let stamp = u64::from_le_bytes(stamp.try_into()?);
                                super::tail_trace::handled(stamp, now_ns());
                            }
                            tx.put("counter", &(last.count() as u64))?;
                            Ok(())
                        };
                        let waker = ready_soon(ready_tx);
                        let summary = consumer.run(handler);
                        let _ = waker.join();
                        let summary = summary?;
                        anyhow::ensure!(
                            summary.processed == n as u64 && summary.acked == n as u64,
                            "consumer: {summary:?}, expected {n} processed and acked"
                        );
                        last.placed()?;
                        Ok(())
                    })?
            }
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .context("consumer did not subscribe")?;
        let watch = StealWatch::start();
        let threads = ThreadWatch::start(broker.child.id());
        sent = publish_paced(broker.port, &format!("{client_id}-pub"), &topic, n, rate)?;
        let consumed = consumer.join().expect("consumer thread");
        cpu = threads.stop();
        steal = watch.stop();
        consumed
    })?;
    let written = Written::now().since(written);
    let wal_syncs = field_vfs::wal_syncs_since(syncs_from);
    // The last PUBACK was written before the consumer returned; give the relay a moment to read it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while relay.seen.lock().unwrap().acks.len() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let acks = relay.take();
    anyhow::ensure!(
        acks.len() == n,
        "{kind:?} at {rate:.0}/s: the relay matched {} of {n} PUBACKs",
        acks.len()
    );
    let first = acks.iter().map(|a| a.0).min().unwrap_or(0);
    let last = acks.iter().map(|a| a.2).max().unwrap_or(0);
    let achieved = n as f64 / ((last - first).max(1) as f64 / 1e9);
    // The first tenth is warm-up (connection, first WAL frames) and stays out of the latencies.
    let mut acks = acks;
    acks.sort_unstable();
    let kept = &acks[n / 10..];
    if kind == Kind::Inbox {
        let to_ns = |t: Instant| t.duration_since(epoch()).as_nanos() as u64;
        if let Some(path) = super::tail_trace::finish(tag, &acks, kept, &sent, to_ns)? {
            println!(
                "{tag}: timelines around the slowest delivery and the slowest consumer's part in {} \
                 and -own.txt beside it",
                path.display()
            );
        }
    }
    // The WAL's restarts among the kept deliveries: the warm-up's own (its RESTART checkpoint makes the
    // run's first commit start the WAL over) falls before them.
    let first_kept = kept.first().map_or(0, |a| a.0);
    let wal_restarts: Vec<u64> = match kind {
        Kind::Inbox => field_vfs::wal_headers_since(restarts_from)
            .into_iter()
            .map(|t| t.duration_since(epoch()).as_nanos() as u64)
            .filter(|&r| r >= first_kept)
            .collect(),
        Kind::Bare => Vec::new(),
    };
    let parts = Parts {
        total: kept
            .iter()
            .map(|&(p, _, a)| Duration::from_nanos(a.saturating_sub(p)))
            .collect(),
        to_consumer: kept
            .iter()
            .map(|&(p, d, _)| Duration::from_nanos(d.saturating_sub(p)))
            .collect(),
        in_publisher: kept
            .iter()
            .filter_map(|(p, _, _)| {
                sent.get(p)
                    .map(|&(w, _)| Duration::from_nanos(w.saturating_sub(*p)))
            })
            .collect(),
        to_broker: kept
            .iter()
            .filter_map(|(p, _, _)| {
                sent.get(p)
                    .map(|&(w, b)| Duration::from_nanos(b.saturating_sub(w)))
            })
            .collect(),
        after_read: kept
            .iter()
            .map(|&(_, d, a)| Duration::from_nanos(a.saturating_sub(d)))
            .collect(),
    };
    let lat = Latencies {
        parts,
        wal_syncs,
        published: kept.iter().map(|&(p, _, _)| p).collect(),
        wal_restarts,
        steal,
        cpu,
    };
    Ok((lat, achieved, written))
}

/// `samples` rewrites of the same 4 KiB in place, each followed by `fdatasync`, on a file in `dir`: the sync
/// of a WAL at its steady size, which the inbox runs are timed on (an append would also commit the file's
/// new size).
fn fsyncs(dir: &Path, samples: usize) -> anyhow::Result<Vec<Duration>> {
    let path = dir.join("fsync-probe");
    let mut f = super::FsyncFile::create(&path)?;
    // Once outside the samples: the file's first write appends.
    f.write_sync()?;
    let mut out = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        f.write_sync()?;
        field_vfs::after_sync();
        out.push(t.elapsed());
    }
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(out)
}

/// The scope of [`wrap_wal`]'s deliveries: their identities sit in a key range of their own, apart from the
/// run's.
const WARM_UP_SCOPE: &str = "wal-warm-up";

/// Commits deliveries of another scope, one per transaction at `synchronous=NORMAL` (quick, and nothing
/// here is timed; through an inbox of its own on the file, as the inbox puts back a level lowered through
/// its connection before the next commit), until the WAL has wrapped once (a chunk that did not grow it),
/// then copies them back with the file's size kept: the run is timed on a WAL of its steady size, as on a
/// gateway that has run for a while, not on a fresh WAL's first pass, whose appends make every sync also
/// commit the file's size.
fn wrap_wal(inbox: &Inbox, path: &Path, tag: &str) -> anyhow::Result<()> {
    const CHUNK: usize = 500;
    const MAX_CHUNKS: usize = 400;
    let wal = std::path::PathBuf::from(format!("{}-wal", path.display()));
    let config = super::inbox_config().synchronous(edge_inbox::Synchronous::Normal);
    let mut warm = Inbox::open(path, config)?;
    let mut handler = super::kv_handler();
    super::table::until_wal_wraps(&wal, MAX_CHUNKS, |chunk| {
        for id in super::ids(&format!("w-{tag}-{chunk}"), CHUNK) {
            let d = Delivery::new(WARM_UP_SCOPE, &id, super::TOPIC, super::PAYLOAD);
            warm.process(&d, &mut handler)?;
        }
        Ok(())
    })?;
    drop(warm);
    let conn = inbox.connection();
    super::table::checkpoint(conn, "RESTART")
}

/// A level of the report: 0 is saturation, then the loads of [`LOADS`].
fn level_label(level: usize) -> String {
    if level == 0 {
        "saturation".to_string()
    } else {
        format!("{:.0}%", LOADS[level - 1] * 100.0)
    }
}

/// Where the `Consumer`'s slowest 1% at a load fell in time: how many were published from 60 ms before to
/// 10 ms after one of the WAL's restarts (behind the catch-up that made it, and the new header's sync), beside
/// the share of all deliveries published in those windows, and in how many bursts they came (chains of
/// publishes less than 20 ms apart). A tail made of a few large bursts beside restarts is the catch-ups'
/// pauses; one spread over many small bursts is each delivery's own wait.
fn tail_report(label: &str, timed: &mut [(u64, Duration)], restarts: &[u64]) {
    if timed.is_empty() {
        return;
    }
    const MS: u64 = 1_000_000;
    let near = |p: u64| {
        restarts
            .iter()
            .any(|&r| p + 60 * MS >= r && p <= r + 10 * MS)
    };
    let all_near = timed.iter().filter(|&&(p, _)| near(p)).count();
    timed.sort_unstable_by_key(|&(_, d)| std::cmp::Reverse(d));
    let count = (timed.len() / 100).max(1);
    let from = timed[count - 1].1;
    let mut slow: Vec<u64> = timed[..count].iter().map(|&(p, _)| p).collect();
    slow.sort_unstable();
    let slow_near = slow.iter().filter(|&&p| near(p)).count();
    let mut bursts = vec![1usize];
    for w in slow.windows(2) {
        if w[1] - w[0] < 20 * MS {
            *bursts.last_mut().unwrap() += 1;
        } else {
            bursts.push(1);
        }
    }
    bursts.sort_unstable_by(|a, b| b.cmp(a));
    let largest: Vec<String> = bursts.iter().take(5).map(usize::to_string).collect();
    println!(
        "At {label}: the `Consumer`'s slowest 1% ({count} deliveries, from {:.2} ms): {slow_near} published from 60 ms before to 10 ms after one of the WAL's {} restarts (of all deliveries, {:.1}% were); {} bursts (chains of publishes < 20 ms apart), the largest {}",
        ms(from),
        restarts.len(),
        100.0 * all_near as f64 / timed.len() as f64,
        bursts.len(),
        largest.join(", ")
    );
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Commits `count` earlier deliveries to `inbox` (other ids, transactions of 4096, the run's handler) and
/// checkpoints them: the run then measures a file with a history, its bytes counted from there.
fn fill(inbox: &mut Inbox, tag: &str, count: usize) -> anyhow::Result<()> {
    let mut handler = super::kv_handler();
    let mut outcomes = Vec::new();
    for ids in super::table::prefill_chunks(&format!("p-{tag}"), count) {
        super::table::fill_inbox(inbox, &ids, &mut handler, &mut outcomes)?;
    }
    super::table::checkpoint_truncate(inbox.connection())
}

/// Runs every round: saturation of both consumers, then each load for both, then the fsync probe. With
/// `prefill`, each inbox file first gets that many earlier deliveries.
pub fn run(dir: &Path, n: usize, rounds: usize, prefill: usize) -> anyhow::Result<()> {
    let Some(exe) = mosquitto_exe() else {
        println!(
            "\n--mode latency skipped: mosquitto not found on PATH nor at /usr/sbin/mosquitto"
        );
        return Ok(());
    };
    let broker_dir = tempfile::Builder::new()
        .prefix("mosquitto-")
        .tempdir_in(dir)?;
    let broker = Mosquitto::start(&exe, broker_dir.path())?;
    eprintln!("mosquitto ({}) on 127.0.0.1:{}", exe.display(), broker.port);
    let kinds = [Kind::Inbox, Kind::Bare];
    // [kind][level]: latencies pooled over rounds; level 0 is saturation.
    let mut lat: Vec<Vec<Parts>> = vec![vec![Parts::default(); 1 + LOADS.len()]; 2];
    let mut sat: Vec<Vec<f64>> = vec![Vec::new(); 2];
    let mut offered: Vec<Vec<f64>> = vec![Vec::new(); LOADS.len()];
    let mut disk = Vec::new();
    // [level]: bytes the inbox runs wrote, pooled over rounds, and their deliveries.
    let mut bytes = vec![(Written::default(), 0u64); 1 + LOADS.len()];
    // [level]: the inbox runs' syncs of the WAL, pooled over rounds.
    let mut wal_syncs: Vec<Vec<Duration>> = vec![Vec::new(); 1 + LOADS.len()];
    // [level]: the inbox runs' (publish time, latency) and the WAL's restarts, pooled over rounds.
    let mut timed: Vec<Vec<(u64, Duration)>> = vec![Vec::new(); 1 + LOADS.len()];
    let mut restarts: Vec<Vec<u64>> = vec![Vec::new(); 1 + LOADS.len()];
    // [kind][level]: CPU time and waits by thread name, summed over the rounds.
    let mut cpu: Vec<Vec<BTreeMap<String, Usage>>> =
        vec![vec![BTreeMap::new(); 1 + LOADS.len()]; 2];
    // [kind][level]: the most the hypervisor took in a run, over the rounds.
    let mut steal: Vec<Vec<Option<Steal>>> = vec![vec![None; 1 + LOADS.len()]; 2];
    let mut note_steal = |k: usize, level: usize, s: Option<Steal>| {
        let cell: &mut Option<Steal> = &mut steal[k][level];
        *cell = match (*cell, s) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    };
    for round in 0..rounds {
        for (k, &kind) in kinds.iter().enumerate() {
            let (l, rate, w) = run_one(
                dir,
                &broker,
                kind,
                &format!("{kind:?}-sat-{round}"),
                n,
                0.0,
                prefill,
            )?;
            note_steal(k, 0, l.steal);
            add_usage(&mut cpu[k][0], &l.cpu);
            lat[k][0].add(l.parts);
            sat[k].push(rate);
            if kind == Kind::Inbox {
                bytes[0].0.add(w);
                bytes[0].1 += n as u64;
                wal_syncs[0].extend(l.wal_syncs);
            }
        }
        let base = *sat[0].last().unwrap();
        for (j, load) in LOADS.iter().enumerate() {
            let rate = base * load;
            offered[j].push(rate);
            for (k, &kind) in kinds.iter().enumerate() {
                let tag = format!("{kind:?}-{}-{round}", (load * 100.0) as u32);
                let (l, _, w) = run_one(dir, &broker, kind, &tag, n, rate, prefill)?;
                if kind == Kind::Inbox {
                    timed[1 + j].extend(
                        l.published
                            .iter()
                            .copied()
                            .zip(l.parts.total.iter().copied()),
                    );
                    restarts[1 + j].extend(l.wal_restarts.iter().copied());
                }
                note_steal(k, 1 + j, l.steal);
                add_usage(&mut cpu[k][1 + j], &l.cpu);
                lat[k][1 + j].add(l.parts);
                if kind == Kind::Inbox {
                    bytes[1 + j].0.add(w);
                    bytes[1 + j].1 += n as u64;
                    wal_syncs[1 + j].extend(l.wal_syncs);
                }
            }
        }
        disk.extend(fsyncs(dir, n.min(1000))?);
    }
    let (f50, f99) = (pct(&mut disk, 0.5), pct(&mut disk, 0.99));
    println!(
        "\n## Publish-to-PUBACK latency (n = {n} per run, {rounds} round(s), pooled; sync +{} ms; {prefill} earlier deliveries in each inbox file)\n",
        field_vfs::delay().as_millis()
    );
    println!(
        "Disk: fsync (4 KiB rewritten in place + fdatasync) p50 {:.2} ms, p99 {:.2} ms ({} samples)\n",
        ms(f50),
        ms(f99),
        disk.len()
    );
    println!(
        "Broker {}. \"to consumer\": the part of the latency before the relay read the PUBLISH from the broker.\n",
        if super::e2e::broker_nagle() {
            "with Nagle's algorithm (mosquitto's default)"
        } else {
            "with TCP_NODELAY (`set_tcp_nodelay true`)"
        }
    );
    println!("| load | offered msgs/s | consumer | p50 ms | p99 ms | max ms | to consumer p50 / p99 ms | bytes/delivery: WAL | database file | block layer | syncs/delivery |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let names = [
        "edge-inbox `Consumer` (defaults)",
        "bare, PUBACK on receipt",
    ];
    for level in 0..=LOADS.len() {
        let label = level_label(level);
        let rate = if level == 0 {
            String::from("unpaced")
        } else {
            format!("{:.0}", median(offered[level - 1].clone()))
        };
        for k in 0..2 {
            let v = &mut lat[k][level].total;
            let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
            let max = *v.last().unwrap();
            let t = &mut lat[k][level].to_consumer;
            let (t50, t99) = (pct(t, 0.5), pct(t, 0.99));
            let written = if k == 0 {
                let (w, d) = &bytes[level];
                let (wal, db, block) = w.per(*d);
                format!(
                    "{wal:.0} | {db:.0} | {block:.0} | {:.3}",
                    w.syncs as f64 / (*d).max(1) as f64
                )
            } else {
                "- | - | - | -".into()
            };
            println!(
                "| {label} | {rate} | {} | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} | {written} |",
                names[k],
                ms(p50),
                ms(p99),
                ms(max),
                ms(t50),
                ms(t99)
            );
        }
    }
    // Where the part before the relay's read went: the same publisher and broker serve both consumers, so a
    // difference between them there is the broker's (or the machine's), not the consumer's own work.
    println!("\nWhere the time went, p50 / p99 ms: in the publisher's client (stamp to its write), from that write to the broker's PUBACK to the publisher, before the relay read the PUBLISH in all (\"to consumer\" above), and from that read to the relay's read of the PUBACK (the consumer's part).\n");
    println!("| load | consumer | in the publisher's client | write to the broker's PUBACK | to consumer | relay's read to PUBACK |");
    println!("|---|---|---:|---:|---:|---:|");
    for level in 0..=LOADS.len() {
        for (kind, name) in lat.iter_mut().zip(names) {
            let cell = |v: &mut Vec<Duration>| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.2} / {:.2}", ms(pct(v, 0.5)), ms(pct(v, 0.99)))
                }
            };
            let p = &mut kind[level];
            println!(
                "| {} | {name} | {} | {} | {} | {} |",
                level_label(level),
                cell(&mut p.in_publisher),
                cell(&mut p.to_broker),
                cell(&mut p.to_consumer),
                cell(&mut p.after_read)
            );
        }
    }
    let (si, sb) = (median(sat[0].clone()), median(sat[1].clone()));
    println!("\nSaturation (first publish to last PUBACK, median of rounds): `Consumer` {si:.0} msgs/s, bare {sb:.0} msgs/s = {:.2}x (target >= 0.95x)", si / sb);
    // Each round's own pair, measured one after the other: the spread between rounds is the bare consumer's
    // as much as the `Consumer`'s.
    if rounds > 1 {
        let each: Vec<String> = sat[0]
            .iter()
            .zip(&sat[1])
            .map(|(i, b)| format!("{i:.0} / {b:.0} = {:.2}x", i / b))
            .collect();
        let ratios = sat[0].iter().zip(&sat[1]).map(|(i, b)| i / b).collect();
        println!(
            "Saturation per round, `Consumer` / bare msgs/s: {}; median of the rounds' ratios {:.2}x",
            each.join(", "),
            median(ratios)
        );
    }
    let (i99, b99) = (
        pct(&mut lat[0][1].total, 0.99),
        pct(&mut lat[1][1].total, 0.99),
    );
    println!(
        "At 10% load: `Consumer` p99 {:.2} ms vs bare p99 + 2x fsync p99 = {:.2} ms (target: not above)",
        ms(i99),
        ms(b99 + f99 * 2)
    );
    // The probe writes 4 KiB per sync; the inbox's syncs carry its commits' pages, so they may take longer.
    // A device that stalls now and then (the benchmark machine's virtual disk: `--mode disk` saw one sync of
    // 251 ms in five minutes) shows in the max and in the count of slow syncs, not in the p99.
    let mut line = String::from(
        "The inbox's own syncs of its WAL (every connection's, simulated delay included), p50 / p99 / max ms (syncs, of them over 10 ms + the delay):",
    );
    let slow = Duration::from_millis(10) + field_vfs::delay();
    for (level, v) in wal_syncs.iter_mut().enumerate() {
        let label = level_label(level);
        if v.is_empty() {
            line += &format!(" {label} none;");
        } else {
            let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
            line += &format!(
                " {label} {:.2} / {:.2} / {:.2} ({}, {});",
                ms(p50),
                ms(p99),
                ms(*v.last().unwrap()),
                v.len(),
                v.iter().filter(|&&d| d > slow).count()
            );
        }
    }
    println!("{}", line.trim_end_matches(';'));
    if !wal_syncs[1].is_empty() {
        let s99 = pct(&mut wal_syncs[1], 0.99);
        println!(
            "At 10% load, with those syncs: bare p99 + 2x the inbox's WAL sync p99 = {:.2} ms (for comparison; the target is the line above)",
            ms(b99 + s99 * 2)
        );
    }
    // The same bound on the consumer's part alone: a broker that serves one consumer later than the other (it
    // shares the machine's cores with the consumer's threads) weighs in the whole latency, not in this part.
    let [inbox_part, bare_part] = &mut lat[..] else {
        unreachable!("two consumers");
    };
    // 10% and 50% load: the levels the targets name.
    for (level, (i, b)) in inbox_part
        .iter_mut()
        .zip(bare_part)
        .enumerate()
        .skip(1)
        .take(2)
    {
        let (i99, b99) = (pct(&mut i.after_read, 0.99), pct(&mut b.after_read, 0.99));
        println!(
            "At {} load, from the relay's read of the PUBLISH to its read of the PUBACK: `Consumer` p99 {:.2} ms vs bare p99 + 2x fsync p99 = {:.2} ms (for comparison)",
            level_label(level),
            ms(i99),
            ms(b99 + f99 * 2)
        );
    }
    // A virtual machine's CPUs stall every thread at once; where one run lost much, its tail is the machine's.
    if steal.iter().flatten().any(Option::is_some) {
        let mut line = String::from(
            "CPU time the hypervisor took from the machine (steal in /proc/stat) while each run published and consumed, the most of any round: share of all CPU time, and in brackets the most in any 100 ms (ms of CPU, all CPUs):",
        );
        let cell = |s: Option<Steal>| {
            s.map_or("-".to_string(), |s| {
                format!("{:.1}% ({} ms)", s.share * 100.0, s.worst.as_millis())
            })
        };
        for (level, (&inbox, &bare)) in steal[0].iter().zip(&steal[1]).enumerate() {
            line += &format!(
                " {} `Consumer` {}, bare {};",
                level_label(level),
                cell(inbox),
                cell(bare)
            );
        }
        println!("{}", line.trim_end_matches(';'));
    }
    // Which threads, and so which side of the machine (`--split-cores`), a run kept busy.
    if cpu.iter().flatten().any(|c| !c.is_empty()) {
        println!(
            "\nCPU time by thread while each run published and consumed, ms per 1,000 deliveries, and \
             in brackets the time it waited for a core while runnable (ms per 1,000 deliveries) and the \
             times it was put on a core (per delivery). Each thread is read every 50 ms; the thread named \
             after this program is its main thread, which paces the publishes; mosquitto is the broker's \
             process.\n"
        );
        let deliveries = (n * rounds) as f64;
        let ms = |ns: u64| ns as f64 / 1e3 / deliveries;
        let shown = |u: &Usage| match u.sched {
            Some(s) => format!(
                "{:.1} [{:.1}; {:.2}]",
                ms(u.cpu_ns),
                ms(s.waited_ns),
                s.runs as f64 / deliveries
            ),
            None => format!("{:.1}", ms(u.cpu_ns)),
        };
        for (level, (inbox, bare)) in cpu[0].iter().zip(&cpu[1]).enumerate() {
            for (who, threads) in [("`Consumer`", inbox), ("bare", bare)] {
                let each: Vec<String> = threads
                    .iter()
                    .filter(|(_, u)| ms(u.cpu_ns) >= 0.05)
                    .map(|(name, u)| format!("{name} {}", shown(u)))
                    .collect();
                let mut all = Usage::default();
                for u in threads.values() {
                    all += *u;
                }
                println!(
                    "- {} {who}: {} (all {})",
                    level_label(level),
                    each.join(", "),
                    shown(&all)
                );
            }
        }
        println!();
    }
    for level in 1..=LOADS.len() {
        tail_report(
            &format!("{} load", level_label(level)),
            &mut timed[level],
            &restarts[level],
        );
    }
    Ok(())
}
