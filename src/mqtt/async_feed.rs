//! The inbox on a tokio runtime: [`AsyncFeed`] for an application's own rumqttc `AsyncClient` and
//! `EventLoop`, and waits on a [`CommitThread`] or a [`Consumer`] that never block the runtime's threads and
//! stop them gracefully on a cancellation future.
//!
//! Nothing here commits on the runtime: commits stay on the commit thread (or the thread running
//! [`Consumer::run`]), and every wait that could block (a full feed channel, a join) runs on tokio's blocking
//! pool, which a current-thread runtime has too.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::task::{spawn_blocking, JoinError, JoinHandle};

use crate::inbox::Handler;
use crate::mqtt::consumer::Consumer;
use crate::mqtt::core::{ConsumerCore, RunSummary, StopHandle};
use crate::mqtt::driver::{CommitThread, Feed, FeedClosed};
use crate::mqtt::extract::Inbound;
use crate::mqtt::gate::{AckGate, ConnectionId};
use crate::store::error::Result;

type Handed = std::result::Result<Option<ConnectionId>, FeedClosed>;

/// An event waiting to be handed over, with its number.
type Queued = (u64, Box<dyn FnOnce(&mut Feed) -> Handed + Send>);

/// A [`Feed`] for a task on a tokio runtime that polls a rumqttc `AsyncClient`'s `EventLoop`: the same
/// calls, awaited. A [`Feed`] blocks while its channel is full (back-pressure on the socket); this one hands
/// each event over on tokio's blocking pool instead, so the runtime's threads never block, on a
/// current-thread runtime too. Await each call before polling the event loop again: the next event waits
/// for the previous one, so the commit thread sees them in the order they happened.
///
/// The calls are cancel-safe: each takes its event when it is called, before its future is first polled,
/// so an event whose call was dropped (in a `select!`, by a timeout), even unpolled, is still handed over,
/// in order, ahead of the next call's. Each dropped call keeps its event in memory until then: a task that
/// drops calls and polls the event loop anyway reads past the budget's back-pressure. Build it with
/// [`AsyncFeed::new`] from the feed [`ConsumerCore::spawn`] returns.
pub struct AsyncFeed {
    /// `None` while an event is being handed over.
    feed: Option<Feed>,
    gate: AckGate,
    /// The event being handed over, and its number.
    pending: Option<(u64, JoinHandle<(Feed, Handed)>)>,
    /// Events taken by calls, not yet handed over, oldest first.
    queued: VecDeque<Queued>,
    /// The number of the last event taken.
    taken: u64,
    /// How many connection losses were taken: a CONNACK handed over after a loss taken behind it ends its
    /// connection at the gate at once (see [`AsyncFeed::connected`]).
    losses: Arc<AtomicU64>,
}

impl fmt::Debug for AsyncFeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncFeed")
            .field("feed", &self.feed)
            .field("handing_over", &self.pending.is_some())
            .field("queued", &self.queued.len())
            .finish()
    }
}

impl From<Feed> for AsyncFeed {
    fn from(feed: Feed) -> AsyncFeed {
        AsyncFeed::new(feed)
    }
}

impl AsyncFeed {
    /// Wraps the feed of a commit thread ([`ConsumerCore::spawn`]).
    pub fn new(feed: Feed) -> AsyncFeed {
        AsyncFeed {
            gate: feed.gate().clone(),
            feed: Some(feed),
            pending: None,
            queued: VecDeque::new(),
            taken: 0,
            losses: Arc::default(),
        }
    }

    /// Takes the event `f` now, and returns the wait for it to be handed over (after every event taken
    /// before it) on the blocking pool, with its result.
    fn hand(
        &mut self,
        f: impl FnOnce(&mut Feed) -> Handed + Send + 'static,
    ) -> impl Future<Output = Handed> + Send + '_ {
        self.taken += 1;
        let number = self.taken;
        self.queued.push_back((number, Box::new(f)));
        self.hand_over(number)
    }

    /// Hands the taken events over in order, up to and including event `number`; returns its result (the
    /// results of earlier events, whose calls were dropped, go with them). Awaiting `&mut JoinHandle` is
    /// cancel-safe: dropped meanwhile, the event in flight stays pending for the next call.
    async fn hand_over(&mut self, number: u64) -> Handed {
        loop {
            if let Some((n, handle)) = self.pending.as_mut() {
                let n = *n;
                let joined = handle.await;
                self.pending = None;
                match joined {
                    Ok((feed, r)) => {
                        self.feed = Some(feed);
                        if n >= number {
                            return r;
                        }
                    }
                    Err(e) => {
                        resume_if_panic(e);
                        // The runtime is shutting down: nothing more can be handed over.
                        self.queued.clear();
                        return Err(FeedClosed);
                    }
                }
                continue;
            }
            let Some((n, f)) = self.queued.pop_front() else {
                // Handed over by an earlier wait.
                return Ok(None);
            };
            let Some(mut feed) = self.feed.take() else {
                self.queued.clear();
                return Err(FeedClosed);
            };
            self.pending = Some((
                n,
                spawn_blocking(move || {
                    let r = f(&mut feed);
                    (feed, r)
                }),
            ));
        }
    }

    /// [`Feed::connected`]: a CONNACK arrived (rumqttc `Incoming::ConnAck`).
    ///
    /// Handed over after the events before it, it may come after a loss of this very connection was already
    /// taken (a call dropped, then the event loop failed): the connection is then ended at the gate at once,
    /// so no ack of it can be queued in the client for the next one.
    pub fn connected(
        &mut self,
        session_present: bool,
    ) -> impl Future<Output = std::result::Result<ConnectionId, FeedClosed>> + Send + '_ {
        let losses = self.losses.clone();
        let seen = losses.load(Ordering::SeqCst);
        let gate = self.gate.clone();
        let handed = self.hand(move |f| {
            let id = f.connected(session_present)?;
            // Read after the gate opened: a loss taken since either is seen here or ends the gate itself.
            if losses.load(Ordering::SeqCst) != seen {
                gate.lost(|| {});
            }
            Ok(Some(id))
        });
        async move { handed.await?.ok_or(FeedClosed) }
    }

    /// [`Feed::subscribed`]: the broker acknowledged the current connection's subscriptions.
    pub fn subscribed(
        &mut self,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        let handed = self.hand(|f| f.subscribed().map(|()| None));
        async move { handed.await.map(drop) }
    }

    /// [`Feed::publish`]: a publish for the inbox on the current connection (`packet_id`: `None` for QoS0).
    pub fn publish(
        &mut self,
        inbound: Inbound,
        packet_id: Option<u16>,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        let handed = self.hand(move |f| f.publish(inbound, packet_id).map(|()| None));
        async move { handed.await.map(drop) }
    }

    /// [`Feed::publish_v5`]: an MQTT 5 publish for the inbox (rumqttc `v5::Incoming::Publish`).
    pub fn publish_v5(
        &mut self,
        publish: rumqttc::v5::mqttbytes::v5::Publish,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        let handed = self.hand(move |f| f.publish_v5(publish).map(|()| None));
        async move { handed.await.map(drop) }
    }

    /// [`Feed::publish_v311`]: an MQTT 3.1.1 publish for the inbox.
    pub fn publish_v311(
        &mut self,
        publish: rumqttc::Publish,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        let handed = self.hand(move |f| f.publish_v311(publish).map(|()| None));
        async move { handed.await.map(drop) }
    }

    /// [`Feed::pass_through`]: a QoS1 publish of another topic, handled by the application, acked in turn.
    pub fn pass_through(
        &mut self,
        packet_id: u16,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        let handed = self.hand(move |f| f.pass_through(packet_id).map(|()| None));
        async move { handed.await.map(drop) }
    }

    /// [`Feed::lost`]: the connection ended. `purge` runs when this is called, under the gate's lock, before
    /// the returned future is first polled: a call dropped before it returns (in a `select!`), even unpolled,
    /// has ended the connection at the gate all the same, so no ack of it can be queued for the next one;
    /// the commit thread is told in turn. Call it for every error `poll` returns, and await it before polling
    /// again.
    pub fn lost(
        &mut self,
        purge: impl FnOnce(),
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        self.losses.fetch_add(1, Ordering::SeqCst);
        self.gate.lost(purge);
        self.tell_lost()
    }

    /// The rest of [`AsyncFeed::lost`], once the gate has ended the connection: tells the commit thread.
    fn tell_lost(
        &mut self,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        let gate = self.gate.clone();
        // Ends the gate again in turn: a CONNACK handed over meanwhile has ended it itself, and nothing of
        // the connection after it has been handed over yet.
        let handed = self.hand(move |f| {
            gate.lost(|| {});
            f.lost(|| {}).map(|()| None)
        });
        async move { handed.await.map(drop) }
    }

    /// [`AsyncFeed::lost`] for rumqttc's MQTT 5 `EventLoop` (what `AsyncClient::new` returns).
    pub fn lost_v5(
        &mut self,
        eventloop: &mut rumqttc::v5::EventLoop,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        self.losses.fetch_add(1, Ordering::SeqCst);
        self.gate.lost_v5(eventloop);
        self.tell_lost()
    }

    /// [`AsyncFeed::lost`] for rumqttc's MQTT 3.1.1 `EventLoop`.
    pub fn lost_v311(
        &mut self,
        eventloop: &mut rumqttc::EventLoop,
    ) -> impl Future<Output = std::result::Result<(), FeedClosed>> + Send + '_ {
        self.losses.fetch_add(1, Ordering::SeqCst);
        self.gate.lost_v311(eventloop);
        self.tell_lost()
    }

    /// The gate this feed keeps in step.
    pub fn gate(&self) -> &AckGate {
        &self.gate
    }
}

impl CommitThread {
    /// Waits for the commit thread to end without blocking the runtime (the join runs on tokio's blocking
    /// pool). When `cancel` completes first (a signal, a cancellation token's `cancelled()`), stops it
    /// gracefully as [`CommitThread::stop`] does: the batch in flight is committed and its PUBACKs are
    /// queued, and nothing uncommitted is acked; then waits for it. Dropping the returned future stops the
    /// thread too (it still ends in the background).
    ///
    /// The PUBACKs are queued in the `AsyncClient`'s request channel: keep polling the event loop (in another
    /// task) while this runs, and queue the DISCONNECT only once it has returned, so that it goes behind
    /// them. The core it gives back owns the inbox, whose drop blocks (it joins the checkpoint thread and
    /// lets SQLite checkpoint, with syncs): drop it on the blocking pool
    /// (`tokio::task::spawn_blocking(move || drop(core))`), not on a runtime thread.
    pub async fn join_until(
        self,
        cancel: impl Future<Output = ()>,
    ) -> (ConsumerCore, Result<RunSummary>) {
        let stop = self.stop_handle();
        until(stop, spawn_blocking(move || self.join()), cancel).await
    }
}

impl Consumer {
    /// [`Consumer::run`] from a tokio runtime (a current-thread one too): the run goes on tokio's blocking
    /// pool, so commits never block the runtime's threads, and it stops gracefully when `cancel` completes
    /// (the batch in flight is committed, its PUBACKs and then a DISCONNECT are written, nothing uncommitted
    /// is acked), as with [`StopHandle::stop`]. Dropping the returned future stops the run too (it ends in
    /// the background). Gives the consumer back with the result; it can run again.
    ///
    /// The consumer keeps its own connection (and rumqttc's runtime on its poll thread); an application
    /// that already holds the connection uses [`AsyncFeed`] instead. As with [`CommitThread::join_until`],
    /// drop the consumer given back on the blocking pool: its drop closes the inbox, which blocks.
    pub async fn run_until<H>(
        mut self,
        handler: H,
        cancel: impl Future<Output = ()>,
    ) -> (Consumer, Result<RunSummary>)
    where
        H: Handler + Send + 'static,
    {
        let stop = self.stop_handle();
        let run = spawn_blocking(move || {
            let r = self.run(handler);
            (self, r)
        });
        let (consumer, result) = until(stop.clone(), run, cancel).await;
        // The run is over: the stop it was asked for is spent, and the consumer can run again.
        stop.reset();
        (consumer, result)
    }
}

/// Waits for `task`; on `cancel`, stops it and keeps waiting. Stops it when dropped before it ended.
async fn until<T>(
    stop: StopHandle,
    mut task: JoinHandle<T>,
    cancel: impl Future<Output = ()>,
) -> T {
    let mut guard = StopOnDrop(Some(stop));
    let joined = {
        let cancel = std::pin::pin!(cancel);
        tokio::select! {
            joined = &mut task => joined,
            () = cancel => {
                if let Some(stop) = &guard.0 {
                    stop.stop();
                }
                task.await
            }
        }
    };
    // Ended: a stop now would make the consumer's next run return at once.
    guard.0 = None;
    match joined {
        Ok(v) => v,
        Err(e) => {
            resume_if_panic(e);
            panic!("the tokio runtime shut down while the inbox's commit thread ran")
        }
    }
}

struct StopOnDrop(Option<StopHandle>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(stop) = &self.0 {
            stop.stop();
        }
    }
}

fn resume_if_panic(e: JoinError) {
    if e.is_panic() {
        std::panic::resume_unwind(e.into_panic());
    }
}
