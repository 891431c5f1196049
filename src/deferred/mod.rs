//! Received-then-deferred mode: the receive side stores a pending message, workers apply it later; the
//! backlog, dead letters and requeueing around them.

pub(crate) mod backlog;
pub(crate) mod dead_letter;
pub(crate) mod receive;
pub(crate) mod requeue;
pub(crate) mod worker;
