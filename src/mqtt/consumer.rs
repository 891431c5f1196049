//! The MQTT consumer: a [`ConsumerCore`] over a connection of its own. A poll thread owns the rumqttc
//! connection and feeds the core; the thread in [`Consumer::run`] commits and acks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::deferred::backlog::BacklogThreshold;
use crate::inbox::{Handler, Inbox};
use crate::mqtt::budget::Budget;
use crate::mqtt::conn::{self as mqtt_conn, MqttConfig, Protocol};
use crate::mqtt::core::ConsumerCore;
pub use crate::mqtt::core::{RunSummary, StopHandle};
use crate::mqtt::driver::{self, Driver, End, STOP_WAIT};
use crate::mqtt::dropped_filters::dropped_filters;
use crate::mqtt::extract::{Envelope, ExtractIdentity, UserProperty};
use crate::mqtt::gate::AckGate;
use crate::mqtt::health::{HealthEvents, StatsHandle};
use crate::mqtt::pipeline::SyncOverlap;
use crate::store::error::{Error, Result};

/// Consumes QoS1 deliveries from an MQTT broker into an [`Inbox`]; you write only the handler.
///
/// A poll thread owns the rumqttc connection and only moves packets: it never touches SQLite and never
/// waits on an ack. The thread calling [`Consumer::run`] owns the inbox and:
///
/// 1. collects deliveries for one transaction (adaptive group commit, [`Consumer::batch`]): it starts as soon
///    as one delivery is there and takes along whatever else is already queued; the poll thread keeps
///    receiving while a commit syncs, so what arrives meanwhile forms the next batch: batches follow the
///    commit time and the arrival rate, bounded by the memory budget ([`Consumer::memory_budget`]; the poll
///    thread stops reading the socket while it is used up);
/// 2. finds each identity ([`Consumer::extractor`]); a delivery without one, with a malformed envelope or
///    over the inbox [`Limits`](crate::Limits) is quarantined ([`Inbox::quarantine`]) and then acked;
/// 3. runs one [`Inbox::process_batch_into`] (one commit, one fsync);
/// 4. retries a failed handler up to [`Consumer::handler_attempts`] times, then dead-letters the delivery
///    ([`Inbox::dead_letter_after`]);
/// 5. acks every delivery of the batch in arrival order.
///
/// All of that is a [`ConsumerCore`]; the consumer adds the connection and its poll thread, fed to the core
/// through a [`Feed`](crate::Feed) exactly as an application with a connection of its own does.
///
/// A storage error (or an unknown commit outcome) acks nothing: the batch is retried with backoff, logged
/// with its SQLite code, when [`Error::is_retryable`] (for at most [`Consumer::storage_retry_limit`], then
/// `run` ends with the error); otherwise its deliveries are committed one at a
/// time and the one that fails for good is dead-lettered with the error as its reason. A reconnect drops
/// everything received on the old connection unacked; the broker redelivers it (persistent session) and
/// the inbox recognises what was already committed.
pub struct Consumer {
    core: ConsumerCore,
    mqtt: MqttConfig,
    /// The batch size asked for (the core's is capped at the inflight window for each run).
    batch_size: usize,
    batch_set: bool,
    exit_when_idle: Option<Duration>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("core", &self.core)
            .field("mqtt", &self.mqtt)
            .field("exit_when_idle", &self.exit_when_idle)
            .finish()
    }
}

/// The batch size when none is set: no count, only the memory budget (and the inflight window).
const DEFAULT_BATCH: usize = usize::MAX;

/// Bytes of memory budget per delivery of the default inflight window (MQTT 5 Receive Maximum).
const BUDGET_PER_INFLIGHT: usize = 256;

impl Consumer {
    /// A consumer for the logical consumer function `scope` (e.g. `inventory-reservation`).
    ///
    /// The default extractor is [`UserProperty`] for MQTT 5 and [`Envelope`] for 3.1.1; a batch is whatever
    /// is queued when the previous commit returns (no count limit but the inflight window, no linger), within
    /// the memory budget ([`DEFAULT_MEMORY_BUDGET`](crate::DEFAULT_MEMORY_BUDGET)); a failing handler is tried 3
    /// times.
    pub fn new(inbox: Inbox, scope: impl Into<String>, mqtt: MqttConfig) -> Consumer {
        let extractor: Box<dyn ExtractIdentity> = match mqtt.protocol {
            Protocol::V311 => Box::new(Envelope::default()),
            _ => Box::new(UserProperty::default()),
        };
        Consumer {
            core: ConsumerCore::new(inbox, scope)
                .boxed_extractor(extractor)
                .batch(DEFAULT_BATCH, Duration::ZERO),
            mqtt,
            batch_size: DEFAULT_BATCH,
            batch_set: false,
            exit_when_idle: None,
        }
    }

    /// Where identities come from.
    pub fn extractor(mut self, extractor: impl ExtractIdentity + 'static) -> Self {
        self.core = self.core.extractor(extractor);
        self
    }

    /// Group commit: at most `size` deliveries per transaction (capped at the inflight window).
    ///
    /// With `linger` zero (the default) a batch is whatever is queued when the previous commit returns: a
    /// delivery reaching an idle consumer is committed at once, and under load the batches grow by themselves
    /// because deliveries pile up during each fsync. A non-zero `linger` waits up to that long after the
    /// first delivery for more; it trades latency for fewer fsyncs when deliveries trickle in just slower
    /// than one per commit.
    pub fn batch(mut self, size: usize, linger: Duration) -> Self {
        self.batch_size = size.max(1);
        self.batch_set = true;
        self.core = self.core.batch(size, linger);
        self
    }

    /// The memory budget of deliveries received and not yet committed, in bytes: payload, topic and user
    /// properties plus a fixed overhead per delivery (384 bytes), so that a flood of tiny deliveries is
    /// bounded too. While they hold more, the poll thread stops reading the socket and TCP pushes back on the
    /// broker (which keeps the rest queued in its session). That holds whatever the broker sends: when a
    /// broker that sends far beyond our Receive Maximum (mosquitto 2.0.11 under a flood) fills rumqttc's
    /// request channel with our acks, the commit thread keeps the next acks (as runs of packet ids) and goes
    /// on committing, which makes room for the poll thread, the only one that drains that channel. The
    /// budget bounds the batch too: under load a batch is everything that arrived during the previous
    /// commit, up to it. Unless [`MqttConfig::inflight`] is set, the Receive Maximum announced follows it
    /// (one per 256 bytes, 8192 at the default; between 20 and 65,535). A single delivery larger than the
    /// budget is still read, alone. Default
    /// [`DEFAULT_MEMORY_BUDGET`](crate::DEFAULT_MEMORY_BUDGET) (2 MiB); [`RunSummary::peak_held_bytes`]
    /// reports the most held at once.
    pub fn memory_budget(mut self, bytes: usize) -> Self {
        self.core = self.core.memory_budget(bytes);
        self
    }

    /// When the next batch is committed while the previous one syncs ([`SyncOverlap::Auto`] by default: on
    /// storage whose syncs take a millisecond or more): see
    /// [`ConsumerCore::overlap_syncs`]. A batch's PUBACKs still leave only once a sync that began after
    /// its commit has succeeded.
    pub fn overlap_syncs(mut self, mode: SyncOverlap) -> Self {
        self.core = self.core.overlap_syncs(mode);
        self
    }

    /// Received-then-deferred mode: each delivery is stored as a *pending* message
    /// ([`Inbox::receive_batch_into`]) and acked once that commit is durable; the obligation moves from the
    /// broker to the local store, and [`Worker`](crate::Worker)s apply the effects later. The handler given to
    /// [`Consumer::run`] is not called in this mode. While it runs, the consumer checks the scope's backlog
    /// about every 10 s and logs a warning beyond `backlog_warning` ([`Inbox::warn_if_backlogged`]).
    pub fn receive_only(mut self, backlog_warning: BacklogThreshold) -> Self {
        self.core = self.core.receive_only(backlog_warning);
        self
    }

    /// How many times the handler is tried on one delivery before it is dead-lettered and acked. At least 1.
    pub fn handler_attempts(mut self, attempts: u32) -> Self {
        self.core = self.core.handler_attempts(attempts);
        self
    }

    /// How long a storage operation that keeps failing with a retryable error (busy, I/O, full disk,
    /// read-only, unknown commit outcome) is retried before [`Consumer::run`] ends with that error, acking
    /// nothing of the batch: a supervisor sees the failure and restarts the process, and the broker
    /// redelivers. The log shows every failed attempt with its SQLite code, then the final error. Default 60
    /// s.
    pub fn storage_retry_limit(mut self, limit: Duration) -> Self {
        self.core = self.core.storage_retry_limit(limit);
        self
    }

    /// Makes [`Consumer::run`] return once nothing has arrived for `idle` (counted from the start, the latest
    /// connection or the latest delivery) and nothing is in flight
    /// (batch jobs, tests, the example's `--exit-when-idle`). A run that never connected in that time ends
    /// with an error instead.
    pub fn exit_when_idle(mut self, idle: Duration) -> Self {
        self.exit_when_idle = Some(idle);
        self
    }

    /// A handle that stops [`Consumer::run`] from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        self.core.stop_handle()
    }

    /// Live statistics, readable from any thread while [`Consumer::run`] runs: the run's counts so far and
    /// the connection ([`StatsHandle::snapshot`]).
    pub fn stats(&self) -> StatsHandle {
        self.core.stats()
    }

    /// Connection and outcome events over a bounded channel of `capacity` events; see
    /// [`ConsumerCore::events`]. At the end of a run a [`HealthEvent::ConnectionLost`](crate::HealthEvent)
    /// with the cause "the run ended" closes the last connection.
    pub fn events(&mut self, capacity: usize) -> HealthEvents {
        self.core.events(capacity)
    }

    /// The inbox, e.g. for [`Inbox::scope_stats`] between runs.
    pub fn inbox(&mut self) -> &mut Inbox {
        self.core.inbox()
    }

    /// Gives the inbox back.
    pub fn into_inbox(self) -> Inbox {
        self.core.into_inbox()
    }

    /// Connects, subscribes and consumes until stopped (or idle, with [`Consumer::exit_when_idle`]).
    /// The handler runs on the calling thread, which owns the inbox. After an idle exit `run` may be
    /// called again; after a [`StopHandle::stop`] it returns at once.
    ///
    /// Connection trouble is retried with backoff once a connection has succeeded, storage errors too
    /// (for at most [`Consumer::storage_retry_limit`]). `Err` when the poll thread cannot be started, when
    /// the first connection fails in a way retrying cannot heal (the broker refuses the credentials or the
    /// client id, TLS material that does not parse or a certificate the other side rejects), when a setting
    /// is refused before connecting ([`Error::InvalidArgument`]: a topic filter that is not valid MQTT, a
    /// host with a scheme or a port in it, an empty client id or a session expiry of 0, which would give up
    /// the persistent session, a keep-alive outside 5 s to 65,535 s), when the broker refuses a
    /// filter or grants it only at QoS0 before it granted the subscription once in this run
    /// ([`Error::Connection`]: such deliveries are never acked nor redelivered; refused after a grant, the
    /// consumer connects again), when an idle limit passes without any connection, or when storage keeps
    /// failing.
    pub fn run<H: Handler>(&mut self, mut handler: H) -> Result<RunSummary> {
        self.mqtt.check(true)?;
        let mut mqtt = self.mqtt.clone();
        if !mqtt.inflight_set {
            mqtt.inflight =
                (self.core.memory_budget / BUDGET_PER_INFLIGHT).clamp(20, 65_535) as u16;
        }
        let window = usize::from(mqtt.inflight);
        let batch_size = self.batch_size.min(window);
        if batch_size < self.batch_size && self.batch_set {
            log::info!(
                "batch size {} capped at the broker's inflight window {window}",
                self.batch_size
            );
        }
        self.core.batch_size = batch_size;
        self.core.summary = RunSummary::default();
        let gate = AckGate::new();
        self.core.set_gate(gate.clone());
        let budget = Budget::new(self.core.memory_budget);
        let (mut feed, rx) = driver::channel(gate.clone(), budget.clone());
        // It subscribes at QoS 1: a QoS 2 delivery is one a kept session queued under an older subscription.
        feed.qos2_leftovers = true;
        let waker = feed.waker();
        let closing = Arc::new(AtomicBool::new(false));
        self.core.filters = mqtt.topics.clone();
        let dropped = match dropped_filters(self.core.inbox(), &mqtt.client_id, &mqtt.topics) {
            Ok(dropped) => dropped,
            Err(e) => {
                log::warn!("cannot read the filters subscribed before ({e}); none is unsubscribed");
                Vec::new()
            }
        };
        if !dropped.is_empty() {
            log::info!("unsubscribing filters no longer configured: {dropped:?}");
        }
        self.core.removed_filters = dropped.clone();
        let (client, poller) =
            mqtt_conn::start(&mqtt, feed, closing.clone(), dropped).map_err(|e| {
                Error::InvalidArgument(format!("cannot start the MQTT poll thread: {e}"))
            })?;
        log::info!(
            "consumer for scope {} starting: {:?}",
            self.core.scope(),
            mqtt
        );
        self.warn_if_pending_waits();
        let mut driver = Driver::new(
            &mut self.core,
            &rx,
            &gate,
            &client,
            window,
            budget.clone(),
            waker,
        );
        driver.exit_when_idle = self.exit_when_idle;
        let end = driver.run(&mut handler);
        // Dropping the driver closes the budget: nothing waits for room any more.
        drop(driver);
        // The batch's PUBACKs are queued; the DISCONNECT goes behind them, and the poll thread ends once the
        // broker has closed the connection after reading them. Whatever still arrives was never committed
        // here: left unacked for the broker to redeliver, and drained only so that the poll thread is never
        // stuck handing it over.
        closing.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + STOP_WAIT;
        let mut disconnect_queued = false;
        loop {
            if !disconnect_queued {
                disconnect_queued = client.try_disconnect();
            }
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if poller.is_finished() {
                break;
            }
            if Instant::now() >= deadline {
                log::warn!("the connection did not close in {STOP_WAIT:?}; leaving it behind");
                break;
            }
        }
        if poller.is_finished() {
            let _ = poller.join();
        }
        let mut summary = self.core.summary;
        summary.acked = gate.acks_written();
        summary.peak_held_bytes = budget.peak() as u64;
        self.core.finish_run(&summary);
        let scope = self.core.scope();
        match end {
            Err(e) => {
                log::error!("consumer for scope {scope} failed: {e} ({summary:?})");
                Err(e)
            }
            Ok(End::Idle) if summary.connections == 0 => {
                let e = Error::InvalidArgument(format!(
                    "no connection to the broker {}:{} succeeded before the idle limit",
                    self.mqtt.host, self.mqtt.port
                ));
                log::error!("consumer for scope {scope}: {e}");
                Err(e)
            }
            Ok(_) => {
                log::info!("consumer for scope {scope} stopped: {summary:?}");
                Ok(summary)
            }
        }
    }

    /// A plain run does not apply deliveries a receive-only run stored: says so when some wait.
    fn warn_if_pending_waits(&mut self) {
        if self.core.receive_only.is_some() {
            return;
        }
        let scope = self.core.scope().to_owned();
        match self.core.inbox().backlog(&scope) {
            Ok(b) if b.pending + b.failed > 0 => log::warn!(
                "scope {scope} holds {} stored deliveries waiting to be applied (pending {}, failed and \
                 waiting for a retry {}), stored by a receive-only run: this run does not apply them; a \
                 Worker on scope {scope} does",
                b.pending + b.failed,
                b.pending,
                b.failed
            ),
            Ok(_) => {}
            Err(e) => log::warn!("cannot read the stored deliveries of scope {scope}: {e}"),
        }
    }
}
