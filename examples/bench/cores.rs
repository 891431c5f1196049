//! `--split-cores`: the consumer under test on CPUs of its own, the broker, the publisher and the relay on
//! the others. On a gateway the broker and the publishers are other machines; on the benchmark's machine
//! they share its CPUs with the consumer, and every thread waits for a core in turn. With the split, the
//! consumer's part of a delivery no longer waits for the broker's or the publisher's turn (its own threads
//! still share its half), and the bare consumer gets the same CPUs, so its bound moves too. The consumer
//! has half the machine's CPUs then, where a gateway gives it all of them: its saturation rate falls.
//!
//! Threads inherit their creator's CPUs. The main thread moves to the consumer's side first, so every inbox
//! it opens and every consumer it starts (with the library's sync, checkpoint and poll threads) stays
//! there; the relay's threads, the broker and the publisher (for the span of [`broker_side`]) go to the
//! other side. Linux only; elsewhere the flag is refused.

use std::sync::OnceLock;

/// The CPUs the process may run on when the split was turned on, in order.
static CPUS: OnceLock<Vec<usize>> = OnceLock::new();

/// Which CPUs a thread belongs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The consumer under test: the upper half of the process's CPUs.
    Consumer,
    /// The broker, the publisher and the relay: the lower half.
    Broker,
}

/// Turns the split on; fails where it cannot be had (fewer than two CPUs, not Linux).
pub(crate) fn enable() -> anyhow::Result<()> {
    let cpus = allowed()?;
    anyhow::ensure!(
        cpus.len() >= 2,
        "--split-cores needs at least two CPUs (this process may use {cpus:?})"
    );
    let (broker, consumer) = cpus.split_at(cpus.len() / 2);
    println!(
        "Cores split: the consumer under test on CPU {consumer:?}; the broker, the publisher and the relay \
         on CPU {broker:?}."
    );
    let _ = CPUS.set(cpus);
    Ok(())
}

/// Whether `--split-cores` is on.
pub(crate) fn split() -> bool {
    CPUS.get().is_some()
}

/// The calling thread on the broker's side until the value is dropped, then back on the consumer's (where the
/// main thread lives under the split); nothing without the split.
pub(crate) fn broker_side() -> anyhow::Result<BrokerSide> {
    pin_current(Side::Broker)?;
    Ok(BrokerSide)
}

/// See [`broker_side`].
pub(crate) struct BrokerSide;

impl Drop for BrokerSide {
    fn drop(&mut self) {
        if let Err(e) = pin_current(Side::Consumer) {
            eprintln!("cannot move the thread back to the consumer's CPUs: {e}");
        }
    }
}

/// How many CPUs the process may use: every one of both sides under the split (the main thread's own
/// affinity then covers the consumer's side only).
pub(crate) fn count() -> usize {
    CPUS.get().map_or_else(
        || std::thread::available_parallelism().map_or(0, |n| n.get()),
        Vec::len,
    )
}

/// Moves the calling thread to `side`'s CPUs (nothing without the split).
pub(crate) fn pin_current(side: Side) -> anyhow::Result<()> {
    if split() {
        set(0, side)?;
    }
    Ok(())
}

/// Moves process `pid` (a single-threaded child such as mosquitto) to `side`'s CPUs.
pub(crate) fn pin_process(pid: u32, side: Side) -> anyhow::Result<()> {
    if split() {
        set(pid as i32, side)?;
    }
    Ok(())
}

/// Checks where the consumer under test runs: fails with its threads (the library's, named `edge-inbox-*`,
/// `inbox-watch` and `mqtt-poll-*`, and the bench's `consumer`) that may run outside its side, with their
/// CPUs, or with the kinds of them not found. Call it while they all run; without the split it passes.
pub(crate) fn check_placement() -> anyhow::Result<()> {
    let Some(cpus) = CPUS.get() else {
        return Ok(());
    };
    let consumer = &cpus[cpus.len() / 2..];
    let mut wrong = Vec::new();
    let mut seen = [false; 3];
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or("")
                .to_owned()
        };
        let name = field("Name:");
        let kind = if name == "consumer" {
            0
        } else if name.starts_with("edge-inbox") || name == "inbox-watch" {
            1
        } else if name.starts_with("mqtt-poll") {
            2
        } else {
            continue;
        };
        seen[kind] = true;
        let list = field("Cpus_allowed_list:");
        let on = cpu_list(&list);
        if on.is_empty() || !on.iter().all(|c| consumer.contains(c)) {
            wrong.push(format!("{name} on CPU {list:?}"));
        }
    }
    for (found, what) in seen.iter().zip(["consumer", "edge-inbox-*", "mqtt-poll-*"]) {
        if !found {
            wrong.push(format!("no thread named {what}"));
        }
    }
    anyhow::ensure!(
        wrong.is_empty(),
        "--split-cores: threads of the consumer off its CPUs: {wrong:?}"
    );
    Ok(())
}

/// The CPUs of a kernel CPU list such as `0-1,4`.
fn cpu_list(list: &str) -> Vec<usize> {
    list.split(',')
        .filter_map(|part| {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            Some(a.trim().parse::<usize>().ok()?..=b.trim().parse::<usize>().ok()?)
        })
        .flatten()
        .collect()
}

/// The CPUs the calling thread may run on.
#[cfg(target_os = "linux")]
fn allowed() -> anyhow::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity writes at most its size, and
    // CPU_ISSET reads within it for CPUs below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let rc = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        anyhow::ensure!(
            rc == 0,
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        );
        Ok((0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

#[cfg(target_os = "linux")]
fn set(tid: i32, side: Side) -> anyhow::Result<()> {
    let cpus = CPUS.get().map(Vec::as_slice).unwrap_or_default();
    let (broker, consumer) = cpus.split_at(cpus.len() / 2);
    let chosen = match side {
        Side::Consumer => consumer,
        Side::Broker => broker,
    };
    // SAFETY: as in `allowed`; CPU_SET writes within the set for the CPUs `allowed` found in one.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in chosen {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    anyhow::ensure!(
        rc == 0,
        "sched_setaffinity({tid}, {side:?}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn allowed() -> anyhow::Result<Vec<usize>> {
    anyhow::bail!("--split-cores is for Linux only")
}

#[cfg(not(target_os = "linux"))]
fn set(_tid: i32, _side: Side) -> anyhow::Result<()> {
    anyhow::bail!("--split-cores is for Linux only")
}
