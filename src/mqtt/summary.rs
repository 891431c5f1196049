//! What one run of a consumer did, counted in memory: the summary a run returns and its live statistics
//! carry.

/// What one run did. In-memory counts of this run only; the durable totals are in
/// [`Inbox::scope_stats`](crate::Inbox::scope_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunSummary {
    /// Publishes received (QoS0 and QoS1).
    pub received: u64,
    /// PUBACKs sent. In what [`Consumer::run`](crate::Consumer::run) returns, those written to the broker
    /// connection; while a run goes on, and from a core on its commit thread
    /// ([`ConsumerCore::spawn`](crate::ConsumerCore::spawn)), those queued with the MQTT client through the
    /// [`AckGate`](crate::AckGate). A core whose acks the application takes with
    /// [`ConsumerCore::pop_ack`](crate::ConsumerCore::pop_ack) counts none: it stays 0.
    pub acked: u64,
    /// Deliveries whose effect was committed.
    pub processed: u64,
    /// Deliveries recognised as duplicates.
    pub duplicates: u64,
    /// Deliveries recorded as conflicts.
    pub conflicts: u64,
    /// Deliveries whose handler failed at least once (each failed attempt rolled back). A delivery tried
    /// three times counts once here; [`RunSummary::failed_attempts`] counts the attempts.
    pub handler_failures: u64,
    /// Handler attempts that failed, all deliveries together.
    pub failed_attempts: u64,
    /// Deliveries moved to the dead letters after the last attempt.
    pub dead_lettered: u64,
    /// Deliveries quarantined (no identity, malformed envelope, over a limit, expired, a sequence another
    /// message claimed).
    pub quarantined: u64,
    /// Storage errors met (each retried; nothing acked on their account).
    pub storage_errors: u64,
    /// Connections accepted by the broker.
    pub connections: u64,
    /// Deliveries left unacked (the broker redelivers them): their connection ended, or the run ended
    /// before their acks could be handed to the MQTT client.
    pub dropped_stale: u64,
    /// Deliveries stored as pending (receive-only mode), to be applied by workers.
    pub stored: u64,
    /// Batches committed, each in one transaction (group commit); a batch that failed for good and was
    /// settled one delivery at a time is not counted.
    pub batches: u64,
    /// The most memory budget ([`Consumer::memory_budget`](crate::Consumer::memory_budget)) the deliveries
    /// received and not yet committed held at once, in bytes.
    pub peak_held_bytes: u64,
}
