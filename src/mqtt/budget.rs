//! The memory budget of deliveries held between the socket and their commit: the poll side stops reading
//! (so TCP pushes back on the broker) while the deliveries it handed over and not yet committed exceed it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::mqtt::extract::Inbound;

/// What one held delivery costs beyond its bytes (the event, the pending record, its identity, the
/// allocations' headers), so that tiny deliveries are bounded in number too.
pub(crate) const DELIVERY_OVERHEAD: usize = 384;

/// The default of [`Consumer::memory_budget`](crate::Consumer::memory_budget): 2 MiB.
pub const DEFAULT_MEMORY_BUDGET: usize = 2 << 20;

/// Bytes a delivery holds in memory until its batch is committed.
pub(crate) fn held_size(inbound: &Inbound) -> usize {
    let props: usize = inbound
        .user_properties
        .iter()
        .map(|(k, v)| k.len() + v.len() + 48)
        .sum();
    inbound.payload.len() + inbound.topic.len() + props + DELIVERY_OVERHEAD
}

/// Shared by the side that reads the connection ([`Feed`](crate::Feed)) and the commit loop. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Budget(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    limit: usize,
    state: Mutex<State>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    used: usize,
    peak: usize,
    /// The limit is lifted while an ending commit loop waits for room to queue its last acks (see
    /// [`Budget::lend`]).
    lent: bool,
    closed: bool,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Budget {
        Budget(Arc::new(Inner {
            limit: limit.max(1),
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain counters, each updated in one step: a panic elsewhere cannot leave them inconsistent.
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` for one delivery, waiting while the held deliveries already exceed the limit. A
    /// delivery larger than the whole budget still passes when nothing else is held.
    pub(crate) fn acquire(&self, bytes: usize) {
        let mut s = self.lock();
        while s.used > 0 && s.used + bytes > self.0.limit && !s.closed {
            if s.lent {
                break;
            }
            s = self.0.freed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.used += bytes;
        s.peak = s.peak.max(s.used);
    }

    /// Gives back what committed (or dropped) deliveries held.
    pub(crate) fn release(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let mut s = self.lock();
        s.used = s.used.saturating_sub(bytes);
        self.0.freed.notify_all();
    }

    /// Lifts the limit: the commit loop has stopped committing and waits to queue its last acks, and only the
    /// reading side, which may be waiting here, drains the client's request channel.
    pub(crate) fn lend(&self) {
        let mut s = self.lock();
        s.lent = true;
        self.0.freed.notify_all();
    }

    /// Puts the limit back once an ack could be queued again.
    pub(crate) fn restore(&self) {
        self.lock().lent = false;
    }

    /// The commit loop has ended: nothing waits for room any more.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.0.freed.notify_all();
    }

    /// The most held at once so far, in bytes.
    pub(crate) fn peak(&self) -> usize {
        self.lock().peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_full_budget_holds_the_reader_until_bytes_are_released() {
        let b = Budget::new(100);
        b.acquire(60);
        b.acquire(40);
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.acquire(10));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !t.is_finished(),
            "the reader must wait while 100 of 100 bytes are held"
        );
        b.release(60);
        t.join().unwrap();
        assert_eq!(b.peak(), 100);
    }

    #[test]
    fn one_delivery_larger_than_the_budget_passes_alone() {
        let b = Budget::new(10);
        b.acquire(1000);
        b.release(1000);
        b.acquire(1000);
    }
}
