//! The inbox on a tokio runtime: [`AsyncFeed`] for an application's own rumqttc `AsyncClient` and
//! `EventLoop`, and waits on a [`CommitThread`] or a [`Consumer`] that never block the runtime's threads and
//! stop them gracefully on a cancellation future.
//!
//! Nothing here commits on the runtime: commits stay on the commit thread (or the thread running
//! [`Consumer::run`]), and every wait that could block (a full feed channel, a join) runs on tokio's blocking
//! pool, which a current-thread runtime has too.

use std::fmt;
use std::future::Future;

use tokio::task::{spawn_blocking, JoinError, JoinHandle};

use crate::inbox::Handler;
use crate::mqtt::consumer::Consumer;
use crate::mqtt::core::{ConsumerCore, RunSummary, StopHandle};
use crate::mqtt::driver::{CommitThread, Feed, FeedClosed};
use crate::mqtt::extract::Inbound;
use crate::mqtt::gate::{AckGate, ConnectionId};
use crate::store::error::Result;

type Handed = std::result::Result<Option<ConnectionId>, FeedClosed>;

/// A [`Feed`] for a task on a tokio runtime that polls a rumqttc `AsyncClient`'s `EventLoop`: the same
/// calls, awaited. A [`Feed`] blocks while its channel is full (back-pressure on the socket); this one hands
/// each event over on tokio's blocking pool instead, so the runtime's threads never block, on a
/// current-thread runtime too. Await each call before polling the event loop again: the next event waits
/// for the previous one, so the commit thread sees them in the order they happened.
///
/// The calls are cancel-safe: an event whose call was dropped (in a `select!`) is still handed over, ahead
/// of the next. Build it with [`AsyncFeed::new`] from the feed [`ConsumerCore::spawn`] returns.
pub struct AsyncFeed {
    /// `None` while an event is being handed over.
    feed: Option<Feed>,
    gate: AckGate,
    pending: Option<JoinHandle<(Feed, Handed)>>,
}

impl fmt::Debug for AsyncFeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncFeed")
            .field("feed", &self.feed)
            .field("handing_over", &self.pending.is_some())
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
        }
    }

    /// Runs `f` on the feed on the blocking pool, after the event still in flight, if any.
    async fn hand(&mut self, f: impl FnOnce(&mut Feed) -> Handed + Send + 'static) -> Handed {
        let _ = self.finish_pending().await;
        let mut feed = self.feed.take().ok_or(FeedClosed)?;
        self.pending = Some(spawn_blocking(move || {
            let r = f(&mut feed);
            (feed, r)
        }));
        self.finish_pending().await
    }

    /// Waits for the event in flight (awaiting `&mut JoinHandle` is cancel-safe) and takes the feed back.
    async fn finish_pending(&mut self) -> Handed {
        let Some(handle) = self.pending.as_mut() else {
            return Ok(None);
        };
        let joined = handle.await;
        self.pending = None;
        match joined {
            Ok((feed, r)) => {
                self.feed = Some(feed);
                r
            }
            Err(e) => {
                resume_if_panic(e);
                // The runtime is shutting down: nothing more can be handed over.
                Err(FeedClosed)
            }
        }
    }

    /// [`Feed::connected`]: a CONNACK arrived (rumqttc `Incoming::ConnAck`).
    pub async fn connected(
        &mut self,
        session_present: bool,
    ) -> std::result::Result<ConnectionId, FeedClosed> {
        let id = self
            .hand(move |f| f.connected(session_present).map(Some))
            .await?;
        id.ok_or(FeedClosed)
    }

    /// [`Feed::subscribed`]: the broker acknowledged the current connection's subscriptions.
    pub async fn subscribed(&mut self) -> std::result::Result<(), FeedClosed> {
        self.hand(|f| f.subscribed().map(|()| None)).await.map(drop)
    }

    /// [`Feed::publish`]: a publish for the inbox on the current connection (`packet_id`: `None` for QoS0).
    pub async fn publish(
        &mut self,
        inbound: Inbound,
        packet_id: Option<u16>,
    ) -> std::result::Result<(), FeedClosed> {
        self.hand(move |f| f.publish(inbound, packet_id).map(|()| None))
            .await
            .map(drop)
    }

    /// [`Feed::publish_v5`]: an MQTT 5 publish for the inbox (rumqttc `v5::Incoming::Publish`).
    pub async fn publish_v5(
        &mut self,
        publish: rumqttc::v5::mqttbytes::v5::Publish,
    ) -> std::result::Result<(), FeedClosed> {
        self.hand(move |f| f.publish_v5(publish).map(|()| None))
            .await
            .map(drop)
    }

    /// [`Feed::publish_v311`]: an MQTT 3.1.1 publish for the inbox.
    pub async fn publish_v311(
        &mut self,
        publish: rumqttc::Publish,
    ) -> std::result::Result<(), FeedClosed> {
        self.hand(move |f| f.publish_v311(publish).map(|()| None))
            .await
            .map(drop)
    }

    /// [`Feed::pass_through`]: a QoS1 publish of another topic, handled by the application, acked in turn.
    pub async fn pass_through(&mut self, packet_id: u16) -> std::result::Result<(), FeedClosed> {
        self.hand(move |f| f.pass_through(packet_id).map(|()| None))
            .await
            .map(drop)
    }

    /// [`Feed::lost`]: the connection ended. `purge` runs at once, under the gate's lock, before the first
    /// await: a call dropped before it returns (in a `select!`) has ended the connection at the gate all
    /// the same, so no ack of it can be queued for the next one. Call it for every error `poll` returns, and
    /// await it before polling again.
    pub async fn lost(&mut self, purge: impl FnOnce()) -> std::result::Result<(), FeedClosed> {
        self.gate.lost(purge);
        let gate = self.gate.clone();
        self.lost_sent(move || gate.lost(|| {})).await
    }

    /// [`AsyncFeed::lost`] for rumqttc's MQTT 5 `EventLoop` (what `AsyncClient::new` returns).
    pub async fn lost_v5(
        &mut self,
        eventloop: &mut rumqttc::v5::EventLoop,
    ) -> std::result::Result<(), FeedClosed> {
        self.gate.lost_v5(eventloop);
        let gate = self.gate.clone();
        self.lost_sent(|| gate.lost_v5(eventloop)).await
    }

    /// [`AsyncFeed::lost`] for rumqttc's MQTT 3.1.1 `EventLoop`.
    pub async fn lost_v311(
        &mut self,
        eventloop: &mut rumqttc::EventLoop,
    ) -> std::result::Result<(), FeedClosed> {
        self.gate.lost_v311(eventloop);
        let gate = self.gate.clone();
        self.lost_sent(|| gate.lost_v311(eventloop)).await
    }

    /// After the gate has ended the connection: waits for the event in flight, ends the connection at the
    /// gate again with `again` (a [`AsyncFeed::connected`] still in flight may have opened it meanwhile;
    /// nothing of that connection was handed over yet, so nothing of it is lost), and tells the commit
    /// thread.
    async fn lost_sent(&mut self, again: impl FnOnce()) -> std::result::Result<(), FeedClosed> {
        let _ = self.finish_pending().await;
        again();
        self.hand(|f| f.lost(|| {}).map(|()| None)).await.map(drop)
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
    /// them.
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
    /// that already holds the connection uses [`AsyncFeed`] instead.
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
