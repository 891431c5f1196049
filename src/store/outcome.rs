//! What happened to a delivery, and what may be said to the broker about it.

use crate::store::identity::Fingerprint;

/// The result of offering one delivery to the inbox, once the transaction that covers it has committed.
///
/// Every variant is durable when returned. [`Outcome::may_ack`] says which ones the broker may be told about.
/// Storage trouble is never an `Outcome`: it is an [`Error`](crate::Error), and the delivery must not be acked.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// New identity: it and the handler's effect were committed together.
    Processed,
    /// The identity was already committed with the same fingerprint. The handler did not run.
    Duplicate,
    /// The identity was already committed with a *different* fingerprint (same id, other content).
    /// The conflict was recorded in the `conflicts` table and counted; the handler did not run.
    Conflict {
        /// Fingerprint of the content committed first.
        stored: Fingerprint,
        /// Fingerprint of the content just received.
        received: Fingerprint,
    },
    /// The handler returned an error: its effect and the identity were rolled back together, so a
    /// redelivery will run the handler again. Counted durably. Whether to ack or dead-letter is the caller's
    /// policy.
    HandlerFailed(anyhow::Error),
    /// Received-then-deferred mode ([`Inbox::receive`](crate::Inbox::receive)): new identity, stored with
    /// its payload as a *pending* message. Nothing has been applied yet, but a durable obligation to process
    /// it exists, so it may be acked; a worker applies it later.
    Received,
    /// The identity was not found, but the delivery was sent before the scope's pruned identity horizon
    /// ([`Inbox::pruned_before`](crate::Inbox::pruned_before)): it may be a repetition whose identity was
    /// pruned, so by the scope's [`ExpiredPolicy`](crate::ExpiredPolicy) it was not applied and no identity was
    /// recorded. Never reported as a duplicate. Counted durably (`expired`).
    Expired {
        /// The delivery's [`Delivery::sent_at`](crate::Delivery::sent_at).
        sent_at: i64,
        /// The scope's pruned horizon when it was judged.
        pruned_before: i64,
        /// The `quarantine` row that keeps it ([`ExpiredPolicy::Quarantine`](crate::ExpiredPolicy::Quarantine)),
        /// or `None` when it was rejected.
        quarantined: Option<i64>,
    },
    /// Sequence watermarks: the delivery's sequence number is already claimed, but not by this message (another
    /// message id: the producer restarted its counter without persisting it, or two producers share one
    /// namespace), or it can no longer be compared (below the window of recent sequences whose identities are
    /// kept). It was not applied and is kept in the `quarantine` table with the reason; never reported as a
    /// duplicate. Counted durably (`sequence_conflicts` and `quarantined`). May be acked.
    SequenceConflict {
        /// The delivery's sequence number.
        sequence: u64,
        /// Why it could not be taken for a duplicate.
        cause: SequenceConflictCause,
        /// The `quarantine` row that keeps it.
        quarantined: i64,
    },
}

/// Why a numbered delivery in a watermark scope was quarantined ([`Outcome::SequenceConflict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SequenceConflictCause {
    /// The sequence was claimed by another message id: a restarted or duplicated producer.
    OtherMessage,
    /// The sequence is claimed but no identity is kept for it: at or below the high-water mark and older than
    /// the window of recent sequences whose identities are kept, or claimed by a repeat of an already known
    /// message id (which keeps the one row of its first sequence). The inbox cannot tell a redelivery from a
    /// reused number.
    BelowWindow,
}

impl SequenceConflictCause {
    /// `other-message` or `below-window`.
    pub fn name(self) -> &'static str {
        match self {
            SequenceConflictCause::OtherMessage => "other-message",
            SequenceConflictCause::BelowWindow => "below-window",
        }
    }
}

impl Outcome {
    /// True when the delivery may be acknowledged: its fate is durably recorded (processed, recognised as a
    /// duplicate, recorded as a conflict, quarantined as expired or as a sequence conflict). False for a handler failure and a rejected
    /// expired delivery, which nothing durable covers.
    pub fn may_ack(&self) -> bool {
        match self {
            Outcome::HandlerFailed(_) => false,
            Outcome::Expired { quarantined, .. } => quarantined.is_some(),
            _ => true,
        }
    }

    /// A short lower-case name: `processed`, `duplicate`, `conflict`, `handler-failed`, `received`,
    /// `expired` or `sequence-conflict`.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::Conflict { .. } => "conflict",
            Outcome::HandlerFailed(_) => "handler-failed",
            Outcome::Received => "received",
            Outcome::Expired { .. } => "expired",
            Outcome::SequenceConflict { .. } => "sequence-conflict",
        }
    }
}

/// What the inbox durably knows about one identity; see [`Inbox::status`](crate::Inbox::status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// No identity is recorded: the delivery was never committed (or its identity was pruned).
    NotFound,
    /// The identity is committed.
    Recorded {
        /// Fingerprint of the committed content.
        fingerprint: Fingerprint,
        /// Commit time, Unix seconds, rounded down to the UTC day (identities keep day precision to stay compact).
        at: i64,
        /// State of the stored message body while it is open (pending or failed) or dead-lettered
        /// (received-then-deferred mode). `None` when no such body exists: the delivery's effect is committed
        /// (by the strong case, or a deferred message was processed), or a dead letter's body was pruned.
        /// Processed bodies are not looked up here (they are not indexed by id); `inboxctl show` finds one.
        state: Option<MessageState>,
    },
}

/// Life-cycle of a stored message body. Received, pending, processed and dead-lettered are distinct: storing a
/// message does not prove that its intent was carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageState {
    /// Stored and acknowledged; a durable obligation to process it exists.
    Pending,
    /// Its effect is committed.
    Processed,
    /// A processing attempt failed; waiting for a retry.
    Failed,
    /// Gave up after the maximum number of attempts; kept for an operator.
    DeadLettered,
}

impl MessageState {
    pub(crate) fn to_sql(self) -> i64 {
        match self {
            MessageState::Pending => 0,
            MessageState::Processed => 1,
            MessageState::Failed => 2,
            MessageState::DeadLettered => 3,
        }
    }

    pub(crate) fn from_sql(v: i64) -> Option<MessageState> {
        Some(match v {
            0 => MessageState::Pending,
            1 => MessageState::Processed,
            2 => MessageState::Failed,
            3 => MessageState::DeadLettered,
            _ => return None,
        })
    }

    /// A short lower-case name: `pending`, `processed`, `failed` or `dead-lettered`.
    pub fn name(self) -> &'static str {
        match self {
            MessageState::Pending => "pending",
            MessageState::Processed => "processed",
            MessageState::Failed => "failed",
            MessageState::DeadLettered => "dead-lettered",
        }
    }
}
