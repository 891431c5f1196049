//! Acks leave in arrival order (MQTT-4.6.0-2), whatever order the deliveries are settled in.

use std::collections::VecDeque;

/// Deliveries in arrival order, each waiting until its fate is durable. [`AckQueue::pop_ready`] releases
/// only the settled prefix: a settled delivery waits behind an earlier unsettled one.
#[derive(Debug)]
pub(crate) struct AckQueue<T> {
    slots: VecDeque<(T, bool)>,
    /// Arrival number of the front slot.
    base: u64,
}

impl<T> AckQueue<T> {
    pub(crate) fn new() -> Self {
        AckQueue {
            slots: VecDeque::new(),
            base: 0,
        }
    }

    /// Registers a delivery in arrival order; returns its ticket.
    pub(crate) fn push(&mut self, token: T) -> u64 {
        self.slots.push_back((token, false));
        self.base + self.slots.len() as u64 - 1
    }

    /// Marks a delivery's fate as durable (it may be acked once everything before it is).
    pub(crate) fn settle(&mut self, ticket: u64) {
        if let Some(i) = ticket.checked_sub(self.base) {
            if let Some(slot) = self.slots.get_mut(i as usize) {
                slot.1 = true;
            }
        }
    }

    /// The next delivery to ack, if it and everything before it are settled.
    pub(crate) fn pop_ready(&mut self) -> Option<T> {
        if self.slots.front().is_some_and(|s| s.1) {
            self.base += 1;
            self.slots.pop_front().map(|s| s.0)
        } else {
            None
        }
    }

    /// Forgets everything (a reconnect: the broker redelivers what was not acked). Tickets stay unique.
    pub(crate) fn clear(&mut self) {
        self.base += self.slots.len() as u64;
        self.slots.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_leave_in_arrival_order_when_settled_out_of_order() {
        let mut q = AckQueue::new();
        let t: Vec<u64> = (0..5).map(|i| q.push(i)).collect();
        q.settle(t[2]);
        q.settle(t[1]);
        assert_eq!(q.pop_ready(), None, "the first delivery is not settled yet");
        q.settle(t[0]);
        assert_eq!(
            (q.pop_ready(), q.pop_ready(), q.pop_ready(), q.pop_ready()),
            (Some(0), Some(1), Some(2), None)
        );
        q.settle(t[4]);
        assert_eq!(q.pop_ready(), None);
        q.settle(t[3]);
        assert_eq!(
            (q.pop_ready(), q.pop_ready(), q.pop_ready()),
            (Some(3), Some(4), None)
        );
    }

    #[test]
    fn clear_drops_in_flight_and_stale_tickets_do_nothing() {
        let mut q = AckQueue::new();
        let old = q.push("old");
        q.clear();
        let new = q.push("new");
        q.settle(old);
        assert_eq!(
            q.pop_ready(),
            None,
            "a ticket from before the reconnect must not settle a new delivery"
        );
        q.settle(new);
        assert_eq!(q.pop_ready(), Some("new"));
        assert_eq!(q.len(), 0);
    }
}
