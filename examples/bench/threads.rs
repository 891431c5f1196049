//! CPU time by thread during a run: this process's threads by name (the consumer's, the library's, the
//! relay's, the publisher's) and the broker's process. With `--split-cores` it tells which side of the
//! machine a run kept busy; without it, where the two shared cores went.
//!
//! The kernel keeps a thread's CPU time only while the thread lives, so a thread that ends between two
//! reads loses what it used since the last one: [`EVERY`] bounds that loss. The reading thread itself is left
//! out (under `--split-cores` it runs on the consumer's side, as the steal watch does).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the threads' counters are read.
const EVERY: Duration = Duration::from_millis(50);
/// `/proc` counts CPU time in USER_HZ ticks, 1/100 s on Linux.
pub(crate) const TICK: Duration = Duration::from_millis(10);
/// The sampling thread's own name, left out of what it reports.
const NAME: &str = "thread-watch";

/// A thread's or a process's name and CPU ticks (user + system) from the text of its `stat` file.
pub(crate) fn stat_ticks(stat: &str) -> Option<(&str, u64)> {
    let name = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file; the split starts at field 3.
    let get = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    Some((name, get(11)? + get(12)?))
}

/// Every thread of this process and the broker's process, by (pid, tid): name and ticks so far.
fn read(broker: u32) -> HashMap<(u32, u32), (String, u64)> {
    let mut seen = HashMap::new();
    let me = std::process::id();
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        if let Some((name, ticks)) = stat_ticks(&stat) {
            seen.insert((me, tid), (name.to_owned(), ticks));
        }
    }
    let stat = std::fs::read_to_string(format!("/proc/{broker}/stat")).unwrap_or_default();
    if let Some((_, ticks)) = stat_ticks(&stat) {
        seen.insert((broker, broker), ("mosquitto".to_owned(), ticks));
    }
    seen
}

/// Reads the counters on a thread of its own until [`ThreadWatch::stop`].
pub(crate) struct ThreadWatch {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<BTreeMap<String, u64>>>,
}

impl ThreadWatch {
    /// Starts reading; `broker` is the broker's process id.
    pub(crate) fn start(broker: u32) -> ThreadWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(move || {
                let before = read(broker);
                let mut latest = before.clone();
                loop {
                    let done = s.load(Ordering::Relaxed);
                    latest.extend(read(broker));
                    if done {
                        break;
                    }
                    std::thread::sleep(EVERY);
                }
                let mut by_name = BTreeMap::new();
                for (key, (name, ticks)) in latest {
                    if name == NAME {
                        continue;
                    }
                    let from = before.get(&key).map_or(0, |b| b.1);
                    *by_name.entry(name).or_insert(0) += ticks.saturating_sub(from);
                }
                by_name
            })
            .ok();
        ThreadWatch { stop, handle }
    }

    /// Ends reading: CPU ticks by name since the start (threads of one name summed).
    pub(crate) fn stop(mut self) -> BTreeMap<String, u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for ThreadWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
