//! CPU time by thread during a run: this process's threads by name (the consumer's, the library's, the
//! relay's, the publisher's) and the broker's process. With `--split-cores` it tells which side of the
//! machine a run kept busy; without it, where the two shared cores went.
//!
//! Beside the CPU time it reads, from each thread's `schedstat`, how long it waited, runnable, for a core
//! (on shared cores, the time the run's threads queued behind one another; with `--split-cores`, what was
//! left of it on each side) and how many times it was put on a core: a thread woken for every packet
//! runs once per packet, and each run costs its side a switch. Where the kernel keeps no `schedstat` (built
//! without scheduler statistics), the CPU time comes from `stat`'s ticks and the rest is not shown.
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
const TICK: Duration = Duration::from_millis(10);
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

/// What one thread or process used: CPU time, and from `schedstat` its waits for a core and its runs.
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Usage {
    /// CPU time, user + system, in nanoseconds.
    pub(crate) cpu_ns: u64,
    /// `schedstat`'s figures; `None` where the kernel keeps none.
    pub(crate) sched: Option<Sched>,
}

/// A thread's scheduling beside its CPU time.
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Sched {
    /// Time runnable but not running, in nanoseconds.
    pub(crate) waited_ns: u64,
    /// Times put on a core.
    pub(crate) runs: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Usage) {
        self.cpu_ns += other.cpu_ns;
        self.sched = match (self.sched, other.sched) {
            (Some(a), Some(b)) => Some(Sched {
                waited_ns: a.waited_ns + b.waited_ns,
                runs: a.runs + b.runs,
            }),
            (a, b) => a.or(b),
        };
    }
}

impl Usage {
    /// What was used since `from`.
    fn since(self, from: Usage) -> Usage {
        let before = from.sched.unwrap_or_default();
        Usage {
            cpu_ns: self.cpu_ns.saturating_sub(from.cpu_ns),
            sched: self.sched.map(|s| Sched {
                waited_ns: s.waited_ns.saturating_sub(before.waited_ns),
                runs: s.runs.saturating_sub(before.runs),
            }),
        }
    }
}

/// CPU time in nanoseconds and the scheduling figures from the text of a `schedstat` file.
fn schedstat(text: &str) -> Option<(u64, Sched)> {
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    let (cpu_ns, waited_ns, runs) = (fields.next()??, fields.next()??, fields.next()??);
    Some((cpu_ns, Sched { waited_ns, runs }))
}

/// A thread's or process's name and usage from its `/proc` folder.
fn usage(dir: &std::path::Path) -> Option<(String, Usage)> {
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    let (name, ticks) = stat_ticks(&stat)?;
    let used = match std::fs::read_to_string(dir.join("schedstat"))
        .ok()
        .as_deref()
        .and_then(schedstat)
    {
        Some((cpu_ns, sched)) => Usage {
            cpu_ns,
            sched: Some(sched),
        },
        None => Usage {
            cpu_ns: ticks * TICK.as_nanos() as u64,
            sched: None,
        },
    };
    Some((name.to_owned(), used))
}

/// Every thread of this process and the broker's process, by (pid, tid): name and usage so far.
fn read(broker: u32) -> HashMap<(u32, u32), (String, Usage)> {
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
        if let Some(found) = usage(&task.path()) {
            seen.insert((me, tid), found);
        }
    }
    if let Some((_, used)) = usage(std::path::Path::new(&format!("/proc/{broker}"))) {
        seen.insert((broker, broker), ("mosquitto".to_owned(), used));
    }
    seen
}

/// Reads the counters on a thread of its own until [`ThreadWatch::stop`].
pub(crate) struct ThreadWatch {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<BTreeMap<String, Usage>>>,
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
                for (key, (name, used)) in latest {
                    if name == NAME {
                        continue;
                    }
                    let from = before.get(&key).map_or(Usage::default(), |b| b.1);
                    *by_name.entry(name).or_default() += used.since(from);
                }
                by_name
            })
            .ok();
        ThreadWatch { stop, handle }
    }

    /// Ends reading: usage by name since the start (threads of one name summed).
    pub(crate) fn stop(mut self) -> BTreeMap<String, Usage> {
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
