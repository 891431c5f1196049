//! The MQTT consumer: batches QoS1 deliveries into group commits and acks each one, in arrival order, only
//! after the commit that covers it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::deferred::backlog::BacklogThreshold;
use crate::inbox::{Handler, Inbox};
use crate::mqtt::ack_queue::AckQueue;
use crate::mqtt::conn::{
    self as mqtt_conn, AckQueued, AckToken, Client, Event, MqttConfig, Protocol, Shared,
};
use crate::mqtt::extract::{ExtractIdentity, Identity, Incoming, UserProperty};
use crate::store::error::{Error, Result};
use crate::store::identity::Delivery;
use crate::store::outcome::Outcome;

/// Asks a running [`Consumer`] to stop: it finishes the batch in flight (commit, then its PUBACKs, all
/// written before the DISCONNECT), disconnects and returns from [`Consumer::run`]. Cheap to clone; usable
/// from any thread or a signal handler flag.
#[derive(Debug, Clone, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// Requests the stop.
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// True once a stop was requested.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// The flag itself, e.g. for `signal_hook::flag::register`.
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

/// What one [`Consumer::run`] did. In-memory counts of this run only; the durable totals are in
/// [`Inbox::scope_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunSummary {
    /// Publishes received (QoS0 and QoS1).
    pub received: u64,
    /// PUBACKs written to the broker connection.
    pub acked: u64,
    /// Deliveries whose effect was committed.
    pub processed: u64,
    /// Deliveries recognised as duplicates.
    pub duplicates: u64,
    /// Deliveries recorded as conflicts.
    pub conflicts: u64,
    /// Handler attempts that failed (each rolled back).
    pub handler_failures: u64,
    /// Deliveries moved to the dead letters after the last attempt.
    pub dead_lettered: u64,
    /// Deliveries quarantined (no identity, malformed envelope, over a limit).
    pub quarantined: u64,
    /// Storage errors met (each retried; nothing acked on their account).
    pub storage_errors: u64,
    /// Connections accepted by the broker.
    pub connections: u64,
    /// Deliveries dropped unacked because their connection ended (the broker redelivers them).
    pub dropped_stale: u64,
    /// Deliveries stored as pending ([`Consumer::receive_only`]), to be applied by workers.
    pub stored: u64,
    /// Batches committed, each in one transaction (group commit); a batch that failed for good and was
    /// settled one delivery at a time is not counted.
    pub batches: u64,
}

/// One received publish on its way to an ack.
struct Pending {
    incoming: Incoming,
    identity: Option<Identity>,
    ticket: u64,
}

/// Consumes QoS1 deliveries from an MQTT broker into an [`Inbox`]; you write only the handler.
///
/// A poll thread owns the rumqttc connection and only moves packets: it never touches SQLite and never
/// waits on an ack. The thread calling [`Consumer::run`] owns the inbox and:
///
/// 1. collects deliveries for one transaction (adaptive group commit, [`Consumer::batch`]): it starts as soon
///    as one delivery is there and takes along whatever else is already queued, up to the batch size and never
///    more than the broker's inflight window ([`MqttConfig::inflight`]); the poll thread keeps receiving while a
///    commit syncs, so what arrives meanwhile forms the next batch;
/// 2. finds each identity ([`Consumer::extractor`]); a delivery without one, with a malformed envelope or
///    over the inbox [`Limits`](crate::Limits) is quarantined ([`Inbox::quarantine`]) and then acked;
/// 3. runs one [`Inbox::process_batch_into`] (one commit, one fsync);
/// 4. retries a failed handler up to [`Consumer::handler_attempts`] times, then dead-letters the delivery
///    ([`Inbox::dead_letter_after`]);
/// 5. acks every delivery of the batch in arrival order.
///
/// A storage error (or an unknown commit outcome) acks nothing: the batch is retried with backoff, logged
/// with its SQLite code, when [`Error::is_retryable`]; otherwise its deliveries are committed one at a
/// time and the one that fails for good is dead-lettered with the error as its reason. A reconnect drops
/// everything received on the old connection unacked; the broker redelivers it (persistent session) and
/// the inbox recognises what was already committed.
pub struct Consumer {
    inbox: Inbox,
    scope: String,
    mqtt: MqttConfig,
    extractor: Box<dyn ExtractIdentity>,
    batch_size: usize,
    linger: Duration,
    handler_attempts: u32,
    exit_when_idle: Option<Duration>,
    stop: StopHandle,
    receive_only: Option<BacklogThreshold>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("inbox", &self.inbox)
            .field("scope", &self.scope)
            .field("mqtt", &self.mqtt)
            .field("batch_size", &self.batch_size)
            .field("linger", &self.linger)
            .field("handler_attempts", &self.handler_attempts)
            .finish()
    }
}

impl Consumer {
    /// A consumer for the logical consumer function `scope` (e.g. `inventory-reservation`).
    ///
    /// The default extractor is [`UserProperty`] for MQTT 5 and [`Envelope`](crate::Envelope) for 3.1.1;
    /// the default batch is up to 64 deliveries (capped at the inflight window) with no linger; a failing
    /// handler is tried 3 times.
    pub fn new(inbox: Inbox, scope: impl Into<String>, mqtt: MqttConfig) -> Consumer {
        let extractor: Box<dyn ExtractIdentity> = match mqtt.protocol {
            Protocol::V311 => Box::new(crate::mqtt::extract::Envelope::default()),
            _ => Box::new(UserProperty::default()),
        };
        Consumer {
            inbox,
            scope: scope.into(),
            mqtt,
            extractor,
            batch_size: 64,
            linger: Duration::ZERO,
            handler_attempts: 3,
            exit_when_idle: None,
            stop: StopHandle::default(),
            receive_only: None,
        }
    }

    /// Where identities come from.
    pub fn extractor(mut self, extractor: impl ExtractIdentity + 'static) -> Self {
        self.extractor = Box::new(extractor);
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
        self.linger = linger;
        self
    }

    /// Received-then-deferred mode: each delivery is stored as a *pending* message
    /// ([`Inbox::receive_batch_into`]) and acked once that commit is durable; the obligation moves from the
    /// broker to the local store, and [`Worker`](crate::Worker)s apply the effects later. The handler given to
    /// [`Consumer::run`] is not called in this mode. While it runs, the consumer checks the scope's backlog
    /// about every 10 s and logs a warning beyond `backlog_warning` ([`Inbox::warn_if_backlogged`]).
    pub fn receive_only(mut self, backlog_warning: BacklogThreshold) -> Self {
        self.receive_only = Some(backlog_warning);
        self
    }

    /// How many times the handler is tried on one delivery before it is dead-lettered and acked. At least 1.
    pub fn handler_attempts(mut self, attempts: u32) -> Self {
        self.handler_attempts = attempts.max(1);
        self
    }

    /// Makes [`Consumer::run`] return once nothing has arrived for `idle` (counted from the start, the latest
    /// connection or the latest delivery) and nothing is in flight
    /// (batch jobs, tests, the example's `--exit-when-idle`).
    pub fn exit_when_idle(mut self, idle: Duration) -> Self {
        self.exit_when_idle = Some(idle);
        self
    }

    /// A handle that stops [`Consumer::run`] from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// The inbox, e.g. for [`Inbox::scope_stats`] between runs.
    pub fn inbox(&mut self) -> &mut Inbox {
        &mut self.inbox
    }

    /// Gives the inbox back.
    pub fn into_inbox(self) -> Inbox {
        self.inbox
    }

    /// Connects, subscribes and consumes until stopped (or idle, with [`Consumer::exit_when_idle`]).
    /// The handler runs on the calling thread, which owns the inbox. After an idle exit `run` may be
    /// called again; after a [`StopHandle::stop`] it returns at once.
    ///
    /// Connection trouble is retried with backoff, storage errors too; `Err` only when the poll thread
    /// cannot be started.
    pub fn run<H: Handler>(&mut self, mut handler: H) -> Result<RunSummary> {
        let window = usize::from(self.mqtt.inflight);
        let batch_size = self.batch_size.min(window);
        if batch_size < self.batch_size {
            log::info!(
                "batch size {} capped at the broker's inflight window {window}",
                self.batch_size
            );
        }
        let (tx, rx) = sync_channel(window + 16);
        let shared = Arc::new(Shared::new());
        let (client, poller) = mqtt_conn::start(&self.mqtt, tx, shared.clone()).map_err(|e| {
            Error::InvalidArgument(format!("cannot start the MQTT poll thread: {e}"))
        })?;
        log::info!(
            "consumer for scope {} starting: {:?}",
            self.scope,
            self.mqtt
        );
        let mut run = Run {
            inbox: &mut self.inbox,
            scope: &self.scope,
            extractor: &*self.extractor,
            handler_attempts: self.handler_attempts,
            client: &client,
            shared: &shared,
            queue: AckQueue::new(),
            summary: RunSummary::default(),
            epoch: 0,
            outcomes: Vec::with_capacity(batch_size),
            rx,
            backlog: VecDeque::new(),
            user_stop: self.stop.clone(),
            receive_only: self.receive_only.is_some(),
            window,
            overfed_warned: 0,
        };
        let mut batch: Vec<Pending> = Vec::with_capacity(batch_size);
        let mut last_activity = Instant::now();
        let mut connections_seen = 0;
        let mut backlog_checked = Instant::now();
        loop {
            if self.stop.is_stopped() {
                break;
            }
            if let Some(threshold) = &self.receive_only {
                if backlog_checked.elapsed() >= Duration::from_secs(10) {
                    backlog_checked = Instant::now();
                    if let Err(e) = run.inbox.warn_if_backlogged(run.scope, threshold) {
                        log::warn!("cannot read the backlog of scope {}: {e}", run.scope);
                    }
                }
            }
            match run.collect(&mut batch, batch_size, self.linger) {
                Collected::Some => {
                    run.settle(&mut batch, &mut handler);
                    last_activity = Instant::now();
                }
                Collected::Nothing => {
                    // A (re)connection is activity too: idle time counts from the latest session start, so a
                    // slow handshake does not end the run before the broker had a chance to deliver.
                    if run.summary.connections != connections_seen {
                        connections_seen = run.summary.connections;
                        last_activity = Instant::now();
                    }
                    if let Some(idle) = self.exit_when_idle {
                        if last_activity.elapsed() >= idle {
                            log::info!("idle for {idle:?}: stopping");
                            break;
                        }
                    }
                }
                Collected::Disconnected => break,
            }
        }
        // The batch's PUBACKs are queued; the DISCONNECT goes behind them, and the poll thread ends once the
        // broker has closed the connection after reading them. Whatever still arrives was never committed here: left unacked for the broker to
        // redeliver, and drained only so that the poll thread is never stuck handing it over.
        shared.stop.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + STOP_WAIT;
        let mut disconnect_queued = false;
        loop {
            if !disconnect_queued {
                disconnect_queued = client.try_disconnect();
            }
            match run.rx.recv_timeout(Duration::from_millis(20)) {
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
        let mut summary = run.summary;
        drop(run);
        if poller.is_finished() {
            let _ = poller.join();
        }
        summary.acked = shared.acks_written();
        log::info!("consumer for scope {} stopped: {summary:?}", self.scope);
        Ok(summary)
    }
}

/// How long a stop waits for the last PUBACKs and the DISCONNECT to be written.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// What a commit attempt came to.
enum Tried<T> {
    Done(T),
    /// The connection ended or a stop came while storage kept failing: nothing may be acked.
    GaveUp,
    /// A failure that would repeat (not [retryable](Error::is_retryable)).
    Failed(Error),
}

enum Collected {
    Some,
    Nothing,
    Disconnected,
}

/// State of one run, on the thread that owns the inbox.
struct Run<'a> {
    inbox: &'a mut Inbox,
    scope: &'a str,
    extractor: &'a dyn ExtractIdentity,
    handler_attempts: u32,
    client: &'a Client,
    shared: &'a Shared,
    queue: AckQueue<Option<AckToken>>,
    summary: RunSummary,
    /// The connection the current batch was received on.
    epoch: u64,
    outcomes: Vec<Outcome>,
    rx: Receiver<Event>,
    /// Events drained from the channel while waiting to queue an ack, in arrival order.
    backlog: VecDeque<Event>,
    user_stop: StopHandle,
    receive_only: bool,
    /// The inflight window: how many unacked deliveries the broker may send.
    window: usize,
    /// The connection an overfeeding broker was last warned about.
    overfed_warned: u64,
}

impl Run<'_> {
    /// Fills `batch` with deliveries of one connection: waits up to 100 ms for the first, then takes what is
    /// already queued, waiting up to `linger` (if any) for more.
    fn collect(&mut self, batch: &mut Vec<Pending>, size: usize, linger: Duration) -> Collected {
        batch.clear();
        let mut deadline: Option<Instant> = None;
        while batch.len() < size {
            let wait = match deadline {
                None => Duration::from_millis(100),
                Some(d) => d.saturating_duration_since(Instant::now()),
            };
            let next = match self.backlog.pop_front() {
                Some(e) => Ok(e),
                None if wait.is_zero() => self.rx.try_recv().map_err(|e| match e {
                    TryRecvError::Empty => RecvTimeoutError::Timeout,
                    TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                }),
                None => self.rx.recv_timeout(wait),
            };
            let event = match next {
                Ok(e) => e,
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    return if batch.is_empty() {
                        Collected::Disconnected
                    } else {
                        Collected::Some
                    };
                }
            };
            match event {
                Event::Connected {
                    epoch,
                    session_present,
                } => {
                    self.summary.connections += 1;
                    self.drop_stale(batch.len());
                    batch.clear();
                    self.epoch = epoch;
                    if !session_present && self.summary.connections > 1 {
                        log::warn!(
                            "the broker did not keep our session (expired, or restarted without persistence): \
                             deliveries published while we were away may not arrive"
                        );
                    }
                }
                Event::Publish {
                    epoch,
                    incoming,
                    token,
                } => {
                    self.summary.received += 1;
                    if epoch != self.epoch {
                        // Received on a connection that is gone: its redelivery will come on the new one.
                        self.summary.dropped_stale += 1;
                        continue;
                    }
                    let ticket = self.queue.push(token);
                    batch.push(Pending {
                        incoming,
                        identity: None,
                        ticket,
                    });
                    deadline.get_or_insert_with(|| Instant::now() + linger);
                }
            }
            if self.stopping() {
                break;
            }
        }
        if batch.is_empty() {
            Collected::Nothing
        } else {
            Collected::Some
        }
    }

    fn drop_stale(&mut self, n: usize) {
        if n > 0 || self.queue.len() > 0 {
            log::info!("reconnected: dropping {n} unacked deliveries of the old connection; the broker redelivers them");
        }
        self.summary.dropped_stale += n as u64;
        self.queue.clear();
    }

    /// Counts a settled outcome in this run's summary.
    fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Processed => self.summary.processed += 1,
            Outcome::Duplicate => self.summary.duplicates += 1,
            Outcome::Conflict { .. } => self.summary.conflicts += 1,
            Outcome::Expired { .. } => self.summary.quarantined += 1,
            Outcome::Received => self.summary.stored += 1,
            // Handler failures are counted where they are retried.
            _ => {}
        }
    }

    fn stopping(&self) -> bool {
        self.user_stop.is_stopped() || self.shared.stop.load(Ordering::Relaxed)
    }

    fn connection_current(&self) -> bool {
        self.shared.epoch() == self.epoch
    }

    /// Commits the batch and acks it, in arrival order. Returns early, acking nothing more, when the
    /// connection ends or a stop is requested while storage keeps failing.
    fn settle<H: Handler>(&mut self, batch: &mut [Pending], handler: &mut H) {
        let limits = *self.inbox.config().get_limits();
        // Identity and limits first: bad input is quarantined, so it can be acked like the rest.
        let mut good: Vec<usize> = Vec::with_capacity(batch.len());
        for (i, p) in batch.iter_mut().enumerate() {
            // An identity that was found but breaks a limit is kept, so its sequence can be claimed.
            let (why, known) = match self.extractor.extract(&p.incoming) {
                Ok(id) => match delivery_of(self.scope, &p.incoming, &id).validate(&limits) {
                    Ok(()) => {
                        p.identity = Some(id);
                        good.push(i);
                        continue;
                    }
                    Err(why) => (why, Some(id)),
                },
                Err(why) => (why, None),
            };
            let reason = why.to_string();
            log::warn!(
                "bad delivery on topic {:?} ({} bytes): {reason}; quarantining it",
                p.incoming.topic,
                p.incoming.payload.len()
            );
            let (scope, incoming) = (self.scope, &p.incoming);
            let kept = self.retry("quarantine", |inbox| match &known {
                Some(id) => inbox.quarantine_delivery(&delivery_of(scope, incoming, id), &reason),
                None => inbox
                    .quarantine(scope, &incoming.topic, &incoming.payload, &reason)
                    .map(Some),
            });
            match kept {
                None => return self.abandon(batch.len()),
                Some(Some(_)) => self.summary.quarantined += 1,
                // Its sequence was claimed by this very message before: a redelivery.
                Some(None) => self.summary.duplicates += 1,
            }
            self.queue.settle(p.ticket);
        }

        let deliveries: Vec<Delivery<'_>> = good
            .iter()
            .map(|&i| {
                delivery_of(
                    self.scope,
                    &batch[i].incoming,
                    batch[i].identity.as_ref().expect("extracted"),
                )
            })
            .collect();
        let mut outcomes = std::mem::take(&mut self.outcomes);
        let receive_only = self.receive_only;
        let committed = self.attempt("commit", |inbox| {
            if receive_only {
                inbox.receive_batch_into(&deliveries, &mut outcomes)
            } else {
                inbox.process_batch_into(&deliveries, handler, &mut outcomes)
            }
        });
        let mut all_settled = true;
        match committed {
            Tried::GaveUp => all_settled = false,
            Tried::Done(()) => {
                self.summary.batches += 1;
                for (k, outcome) in outcomes.drain(..).enumerate() {
                    if !self.settle_one(&deliveries[k], outcome, handler) {
                        all_settled = false;
                        break;
                    }
                    self.queue.settle(batch[good[k]].ticket);
                }
            }
            Tried::Failed(why) => {
                // A deterministic failure would fail the batch forever: find the delivery behind it alone.
                log::warn!(
                    "a batch of {} failed for good ({why}); settling its deliveries one at a time",
                    deliveries.len()
                );
                for (k, d) in deliveries.iter().enumerate() {
                    let alone = self.attempt("commit", |inbox| {
                        if receive_only {
                            inbox.receive(d)
                        } else {
                            inbox.process(d, &mut *handler)
                        }
                    });
                    let settled = match alone {
                        Tried::Done(outcome) => self.settle_one(d, outcome, handler),
                        Tried::GaveUp => false,
                        Tried::Failed(why) => self.dead_letter(d, 1, &format!("{why}")),
                    };
                    if !settled {
                        all_settled = false;
                        break;
                    }
                    self.queue.settle(batch[good[k]].ticket);
                }
            }
        }
        outcomes.clear();
        self.outcomes = outcomes;
        if !all_settled {
            return self.abandon(batch.len());
        }
        self.ack_ready();
    }

    /// Makes one committed outcome final (retrying a failed handler, quarantining an expired delivery) and
    /// counts it. False when storage trouble outlived the connection or a stop (nothing may be acked).
    fn settle_one<H: Handler>(
        &mut self,
        d: &Delivery<'_>,
        outcome: Outcome,
        handler: &mut H,
    ) -> bool {
        match outcome {
            Outcome::HandlerFailed(err) => {
                self.summary.handler_failures += 1;
                self.retry_handler(d, err, handler)
            }
            Outcome::Expired {
                quarantined: None,
                sent_at,
                pruned_before,
            } => self.quarantine_expired(d, sent_at, pruned_before),
            other => {
                self.count(&other);
                true
            }
        }
    }

    /// An expired delivery rejected by the scope's policy. A consumer cannot refuse a delivery without
    /// stalling on it, so its body is kept in quarantine before it is acked: nothing silently lost. False
    /// when storage trouble outlived the connection or a stop (nothing may be acked).
    fn quarantine_expired(&mut self, d: &Delivery<'_>, sent_at: i64, pruned_before: i64) -> bool {
        let reason = format!(
            "expired: sent at {sent_at}, before the pruned identity horizon {pruned_before}"
        );
        let scope = self.scope;
        let kept = self.retry("quarantine", |inbox| {
            inbox.quarantine(scope, d.topic, d.payload, &reason)
        });
        if kept.is_some() {
            self.summary.quarantined += 1;
        }
        kept.is_some()
    }

    /// Tries a failed delivery again, alone, up to the attempt limit; then dead-letters it. False when
    /// storage trouble outlived the connection or a stop (nothing may be acked).
    fn retry_handler<H: Handler>(
        &mut self,
        d: &Delivery<'_>,
        mut err: anyhow::Error,
        handler: &mut H,
    ) -> bool {
        let mut attempts = 1;
        while attempts < self.handler_attempts {
            attempts += 1;
            std::thread::sleep(Duration::from_millis(10 * u64::from(attempts)));
            match self.attempt("commit", |inbox| inbox.process(d, &mut *handler)) {
                Tried::GaveUp => return false,
                Tried::Failed(why) => {
                    let reason = format!("handler failed {attempts} time(s), the last with: {why}");
                    return self.dead_letter(d, attempts, &reason);
                }
                Tried::Done(Outcome::HandlerFailed(e)) => {
                    self.summary.handler_failures += 1;
                    err = e;
                }
                Tried::Done(Outcome::Expired {
                    quarantined: None,
                    sent_at,
                    pruned_before,
                }) => {
                    return self.quarantine_expired(d, sent_at, pruned_before);
                }
                Tried::Done(o) => {
                    self.count(&o);
                    return true;
                }
            }
        }
        let reason = format!("handler failed {attempts} time(s): {err:#}");
        self.dead_letter(d, attempts, &reason)
    }

    /// Records `d` as a dead letter with its reason; only then may it be acked. The record is retried
    /// whatever the error: without it nothing may be acked. False when storage trouble outlived the
    /// connection or a stop.
    fn dead_letter(&mut self, d: &Delivery<'_>, attempts: u32, reason: &str) -> bool {
        match self.retry("dead letter", |inbox| {
            inbox.dead_letter_after(d, attempts, reason)
        }) {
            None => false,
            Some(Outcome::Processed) => {
                self.summary.dead_lettered += 1;
                true
            }
            Some(Outcome::Expired {
                quarantined: None,
                sent_at,
                pruned_before,
            }) => self.quarantine_expired(d, sent_at, pruned_before),
            Some(other) => {
                self.count(&other);
                true
            }
        }
    }

    /// Runs `f` until it succeeds, backing off on errors, whatever they are: for the durable records that
    /// must exist before an ack (quarantine, dead letters). `None` when the connection the batch came on has
    /// ended or a stop was requested first: then nothing of the batch may be acked.
    fn retry<T>(&mut self, what: &str, f: impl FnMut(&mut Inbox) -> Result<T>) -> Option<T> {
        match self.backoff(what, true, f) {
            Tried::Done(v) => Some(v),
            Tried::GaveUp | Tried::Failed(_) => None,
        }
    }

    /// Like [`Run::retry`] for a commit of deliveries, but an error that is not
    /// [retryable](Error::is_retryable) comes back as [`Tried::Failed`] at once: trying again would fail
    /// the same way and hold back everything behind it.
    fn attempt<T>(&mut self, what: &str, f: impl FnMut(&mut Inbox) -> Result<T>) -> Tried<T> {
        self.backoff(what, false, f)
    }

    fn backoff<T>(
        &mut self,
        what: &str,
        retry_all: bool,
        mut f: impl FnMut(&mut Inbox) -> Result<T>,
    ) -> Tried<T> {
        let mut backoff = Duration::from_millis(50);
        loop {
            match f(self.inbox) {
                Ok(v) => return Tried::Done(v),
                Err(e) if !retry_all && !e.is_retryable() => {
                    self.summary.storage_errors += 1;
                    log::error!(
                        "{what} failed for good (SQLite code {}): {e}; not acked",
                        e.sqlite_code()
                            .map_or_else(|| "none".to_owned(), |c| c.to_string())
                    );
                    return Tried::Failed(e);
                }
                Err(e) => {
                    self.summary.storage_errors += 1;
                    log::error!(
                        "{what} failed (SQLite code {}): {e}; not acked, retrying in {backoff:?}",
                        e.sqlite_code()
                            .map_or_else(|| "none".to_owned(), |c| c.to_string())
                    );
                    let until = Instant::now() + backoff;
                    while Instant::now() < until {
                        if !self.connection_current() || self.stopping() {
                            return Tried::GaveUp;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Gives up on the batch: nothing more of it is acked; the broker redelivers it.
    fn abandon(&mut self, n: usize) {
        log::warn!("leaving {n} deliveries unacked; the broker redelivers them");
        self.queue.clear();
    }

    /// Queues the PUBACKs of every settled delivery at the front of the queue, in arrival order, for the
    /// connection they came on; once it has ended, the rest stay unacked (the broker redelivers them).
    fn ack_ready(&mut self) {
        while let Some(token) = self.queue.pop_ready() {
            let Some(token) = token else { continue };
            if !self.queue_ack(token) {
                let left = self.queue.len() + 1;
                log::info!(
                    "the connection ended before the acks: leaving {left} settled deliveries unacked; \
                     the broker redelivers them"
                );
                self.summary.dropped_stale += left as u64;
                self.queue.clear();
                return;
            }
            self.summary.acked += 1;
        }
    }
}

impl Run<'_> {
    /// Queues one PUBACK for the connection of the batch, draining incoming events into the backlog while
    /// rumqttc's request channel is full. False when that connection has ended or the poll thread is gone
    /// (the broker redelivers instead). A stop does not end the wait: the batch's acks go out first.
    fn queue_ack(&mut self, token: AckToken) -> bool {
        let mut stopping_since: Option<Instant> = None;
        loop {
            match self.client.try_ack_on(self.shared, self.epoch, token) {
                AckQueued::Queued => return true,
                AckQueued::Stale => return false,
                AckQueued::Full => {}
            }
            if self.stopping() {
                let since = *stopping_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= STOP_WAIT {
                    return false;
                }
            }
            match self.rx.try_recv() {
                Ok(e) => {
                    self.backlog.push_back(e);
                    self.warn_if_overfed();
                }
                Err(TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(1)),
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }
}

impl Run<'_> {
    /// More deliveries held unacked than the inflight window allows: the broker does not wait for our
    /// PUBACKs (MQTT 5 Receive Maximum, or the 3.1.1 window configured). They are kept in memory until
    /// committed, so memory grows with the broker's backlog; said once per connection.
    fn warn_if_overfed(&mut self) {
        if self.backlog.len() > self.window && self.overfed_warned != self.epoch {
            self.overfed_warned = self.epoch;
            log::warn!(
                "{} deliveries wait unacked in memory, more than the inflight window of {}: the broker does \
                 not wait for our PUBACKs (it ignores the window), so memory grows with its backlog until \
                 the commits catch up",
                self.backlog.len(),
                self.window
            );
        }
    }
}

fn delivery_of<'a>(scope: &'a str, incoming: &'a Incoming, id: &'a Identity) -> Delivery<'a> {
    let payload = id.body.as_deref().unwrap_or(&incoming.payload);
    let mut d = Delivery::new(scope, &id.message_id, &incoming.topic, payload);
    if let Some(p) = id.producer.as_deref() {
        d = d.with_producer(p);
    }
    if let Some(s) = id.sequence {
        d = d.with_sequence(s);
    }
    if let Some(t) = id.sent_at {
        d = d.with_sent_at(t);
    }
    d
}
