//! CPU time the hypervisor took from this (virtual) machine during a run: the `steal` column of `/proc/stat`.
//! While a virtual CPU does not run, every thread on it waits, the broker's and the consumer's alike, so a
//! run's tail read beside it tells the machine's noise from the consumer's own work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `/proc/stat` counts in USER_HZ ticks, 1/100 s on Linux whatever the kernel's own tick rate.
const TICK: Duration = Duration::from_millis(10);
/// A read of `/proc/stat` takes about 20 µs: 0.2% of one CPU at this pace.
const EVERY: Duration = Duration::from_millis(10);
/// The span of the worst stretch reported.
const WINDOW: Duration = Duration::from_millis(100);

/// What the hypervisor took during one run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Steal {
    /// Of all the machine's CPU time during the run (every CPU), the share stolen.
    pub(crate) share: f64,
    /// The most CPU time stolen (summed over the CPUs) in any [`WINDOW`] of the run.
    pub(crate) worst: Duration,
}

impl Steal {
    /// The larger of each figure (over the rounds of one row).
    pub(crate) fn max(self, other: Steal) -> Steal {
        Steal {
            share: self.share.max(other.share),
            worst: self.worst.max(other.worst),
        }
    }
}

/// Samples the counters on a thread of its own until [`StealWatch::stop`].
pub(crate) struct StealWatch {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Vec<(Instant, u64, u64)>>>,
}

impl StealWatch {
    /// Starts sampling; a machine without `/proc/stat` (or without a steal column) reports nothing.
    pub(crate) fn start() -> StealWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let handle = read().is_some().then(|| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut samples = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Some((steal, all)) = read() {
                        samples.push((Instant::now(), steal, all));
                    }
                    std::thread::sleep(EVERY);
                }
                if let Some((steal, all)) = read() {
                    samples.push((Instant::now(), steal, all));
                }
                samples
            })
        });
        StealWatch { stop, handle }
    }

    /// Ends sampling: the run's share and its worst stretch.
    pub(crate) fn stop(mut self) -> Option<Steal> {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.handle.take()?.join().ok()?;
        let (first, last) = (samples.first()?, samples.last()?);
        let all = last.2.saturating_sub(first.2);
        let share = if all == 0 {
            0.0
        } else {
            last.1.saturating_sub(first.1) as f64 / all as f64
        };
        // Two pointers: for each sample, the latest one at most WINDOW after it.
        let mut worst = 0;
        let mut j = 0;
        for (i, a) in samples.iter().enumerate() {
            j = j.max(i);
            while j + 1 < samples.len() && samples[j + 1].0.duration_since(a.0) <= WINDOW {
                j += 1;
            }
            worst = worst.max(samples[j].1.saturating_sub(a.1));
        }
        Some(Steal {
            share,
            worst: TICK * worst as u32,
        })
    }
}

impl Drop for StealWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// (steal, all) ticks summed over the CPUs, from the first line of `/proc/stat`: user nice system idle
/// iowait irq softirq steal (guest time is already in user and nice).
fn read() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let mut fields = stat.lines().next()?.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let ticks: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    Some((*ticks.get(7)?, ticks.iter().sum()))
}
