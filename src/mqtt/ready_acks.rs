//! Acks made safe to send and not yet handed to the MQTT client, in order, kept as runs of consecutive
//! packet ids.
//!
//! A broker that ignores our Receive Maximum keeps sending while the MQTT client sends our PUBACKs more
//! slowly than it reads (rumqttc serves one request per turn of its loop and reads up to ten packets in
//! another), so acks can wait here by the hundred thousand under a flood. Brokers number a session's
//! deliveries one after the other, so a run of consecutive ids is one entry: the memory follows the gaps in
//! the numbering, not the number of acks.

use std::collections::VecDeque;

use crate::mqtt::gate::{Ack, ConnectionId};

/// The packet id after `id` (MQTT packet ids run from 1 to 65,535, then start over).
fn next(id: u16) -> u16 {
    if id == u16::MAX {
        1
    } else {
        id + 1
    }
}

/// `len` acks on `connection` for the packet ids from `first` on, consecutive.
#[derive(Debug, Clone, Copy)]
struct Run {
    connection: ConnectionId,
    first: u16,
    len: u32,
}

impl Run {
    fn of(ack: Ack) -> Run {
        Run {
            connection: ack.connection,
            first: ack.packet_id,
            len: 1,
        }
    }

    fn last(&self) -> u16 {
        // Ids advance modulo 65,535 over 1..=65,535.
        let offset = (u64::from(self.first) - 1 + u64::from(self.len) - 1) % u64::from(u16::MAX);
        (offset + 1) as u16
    }
}

/// A queue of acks, first in first out.
#[derive(Debug, Default)]
pub(crate) struct ReadyAcks {
    runs: VecDeque<Run>,
    len: usize,
}

impl ReadyAcks {
    pub(crate) fn push_back(&mut self, ack: Ack) {
        self.len += 1;
        if let Some(run) = self.runs.back_mut() {
            if run.connection == ack.connection
                && next(run.last()) == ack.packet_id
                && run.len < u32::MAX
            {
                run.len += 1;
                return;
            }
        }
        self.runs.push_back(Run::of(ack));
    }

    pub(crate) fn pop_front(&mut self) -> Option<Ack> {
        let run = self.runs.front_mut()?;
        let ack = Ack {
            connection: run.connection,
            packet_id: run.first,
        };
        run.first = next(run.first);
        run.len -= 1;
        if run.len == 0 {
            self.runs.pop_front();
        }
        self.len -= 1;
        Some(ack)
    }

    /// Puts back the ack just taken with [`ReadyAcks::pop_front`]: it is first again.
    pub(crate) fn push_front(&mut self, ack: Ack) {
        self.len += 1;
        if let Some(run) = self.runs.front_mut() {
            if run.connection == ack.connection
                && next(ack.packet_id) == run.first
                && run.len < u32::MAX
            {
                run.first = ack.packet_id;
                run.len += 1;
                return;
            }
        }
        self.runs.push_front(Run::of(ack));
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn clear(&mut self) {
        self.runs.clear();
        self.len = 0;
    }

    /// Entries held (for the tests: the memory is this times 16 bytes).
    #[cfg(test)]
    fn runs(&self) -> usize {
        self.runs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ack(connection: u64, packet_id: u16) -> Ack {
        Ack {
            connection: ConnectionId(connection),
            packet_id,
        }
    }

    #[test]
    fn consecutive_ids_across_the_wrap_are_one_entry() {
        let mut q = ReadyAcks::default();
        let ids: Vec<u16> = (0..200_000u32)
            .map(|i| (i % u32::from(u16::MAX)) as u16 + 1)
            .collect();
        for &id in &ids {
            q.push_back(ack(1, id));
        }
        assert_eq!(q.len(), ids.len());
        assert_eq!(q.runs(), 1, "one entry for 200,000 consecutive ids");
        for &id in &ids {
            assert_eq!(q.pop_front(), Some(ack(1, id)));
        }
        assert_eq!((q.pop_front(), q.len(), q.runs()), (None, 0, 0));
    }

    proptest! {
        /// The same acks in the same order as a plain queue, whatever the ids, connections, pops and
        /// put-backs.
        #[test]
        fn behaves_as_a_plain_queue(ops in proptest::collection::vec((0u8..4, 0u64..2, 1u16..6), 0..300)) {
            let mut q = ReadyAcks::default();
            let mut model: VecDeque<Ack> = VecDeque::new();
            let mut last_id = 0u16;
            for (op, connection, step) in ops {
                match op {
                    // Mostly consecutive ids, sometimes a jump, wrapping at 65,535.
                    0 | 1 => {
                        let id = if op == 0 { next(last_id) } else { last_id.wrapping_add(step * 9000).max(1) };
                        last_id = id;
                        q.push_back(ack(connection, id));
                        model.push_back(ack(connection, id));
                    }
                    2 => prop_assert_eq!(q.pop_front(), model.pop_front()),
                    _ => {
                        if let Some(a) = q.pop_front() {
                            prop_assert_eq!(Some(a), model.pop_front());
                            q.push_front(a);
                            model.push_front(a);
                        }
                    }
                }
                prop_assert_eq!(q.len(), model.len());
            }
            while let Some(a) = model.pop_front() {
                prop_assert_eq!(q.pop_front(), Some(a));
            }
            prop_assert!(q.is_empty());
        }
    }
}
