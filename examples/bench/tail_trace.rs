//! `--trace-tail DIR` (`--mode latency`): for each run of the `Consumer`, a timeline around its slowest
//! delivery, written to `DIR/<run>.txt`, and one around the delivery whose own part was slowest (from the
//! relay's read of the PUBLISH to its read of the PUBACK), `DIR/<run>-own.txt`: every delivery published in
//! the window (when the publisher's client wrote it and read the broker's PUBACK for it, when the relay read
//! it, when the handler ran in its batch's transaction, when the relay read its PUBACK), and every write and
//! sync SQLite made to the WAL and the database file meanwhile, by thread (the commit thread's transactions,
//! the sync thread's and the checkpoint thread's syncs). What a slow delivery waited for can be read off it.
//! A write is timed when it returned; a sync when it began and when it ended.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use super::field_vfs::{self, Call, Traced};

static DIR: OnceLock<PathBuf> = OnceLock::new();
/// Per delivery handled while tracing: its publish stamp, and when its handler ran (both in the latency
/// bench's nanoseconds).
static HANDLED: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// The window: from this long before the slowest delivery's publish to this long after its PUBACK.
const BEFORE_NS: u64 = 40_000_000;
const AFTER_NS: u64 = 10_000_000;
/// Writes of one thread to one kind of file this close together are one transaction's (or one copy's).
const SAME_RUN_NS: u64 = 100_000;

pub(crate) fn set_dir(dir: PathBuf) -> anyhow::Result<()> {
    std::fs::create_dir_all(&dir)?;
    let _ = DIR.set(dir);
    Ok(())
}

pub(crate) fn enabled() -> bool {
    DIR.get().is_some()
}

/// Starts recording a `Consumer` run (from the end of its file's preparation).
pub(crate) fn begin() {
    if enabled() {
        HANDLED.lock().unwrap().clear();
        field_vfs::start_trace();
    }
}

/// The handler ran for the delivery published at `stamp`, at `now`.
pub(crate) fn handled(stamp: u64, now: u64) {
    if enabled() {
        HANDLED.lock().unwrap().push((stamp, now));
    }
}

/// Ends the recording of a run and writes its timelines around the slowest of `kept`, whole and by the
/// consumer's part; `acks` are (publish, relay read, PUBACK read) of every delivery of the run (those of the
/// warm-up show in the window too), `sent` the publisher's (write, broker's PUBACK) by publish stamp, `ns`
/// turns an instant into the bench's nanoseconds. The first file written, if tracing.
pub(crate) fn finish(
    name: &str,
    acks: &[(u64, u64, u64)],
    kept: &[(u64, u64, u64)],
    sent: &std::collections::HashMap<u64, (u64, u64)>,
    ns: impl Fn(Instant) -> u64,
) -> anyhow::Result<Option<PathBuf>> {
    let Some(dir) = DIR.get() else {
        return Ok(None);
    };
    let (calls, threads) = field_vfs::take_trace();
    let handled: std::collections::HashMap<u64, u64> =
        std::mem::take(&mut *HANDLED.lock().unwrap())
            .into_iter()
            .collect();
    let Some(&slowest) = kept.iter().max_by_key(|&&(p, _, a)| a.saturating_sub(p)) else {
        return Ok(None);
    };
    let window = |&delivery: &(u64, u64, u64), what: &str| {
        timeline(
            name, what, delivery, acks, sent, &handled, &calls, &threads, &ns,
        )
    };
    let path = dir.join(format!("{name}.txt"));
    std::fs::write(&path, window(&slowest, "the slowest delivery"))?;
    // The consumer's own part (the relay's read of the PUBLISH to its read of the PUBACK) can peak
    // elsewhere than the whole: a broker late for a whole slice hides it.
    if let Some(own) = kept
        .iter()
        .max_by_key(|&&(_, read, a)| a.saturating_sub(read))
    {
        let what = "the delivery with the slowest consumer's part";
        std::fs::write(dir.join(format!("{name}-own.txt")), window(own, what))?;
    }
    Ok(Some(path))
}

/// The timeline of one window, around the delivery `(publish, relay's read, PUBACK read)`.
#[allow(clippy::too_many_arguments)]
fn timeline(
    name: &str,
    what: &str,
    (p, read, a): (u64, u64, u64),
    acks: &[(u64, u64, u64)],
    sent: &std::collections::HashMap<u64, (u64, u64)>,
    handled: &std::collections::HashMap<u64, u64>,
    calls: &[Traced],
    threads: &[String],
    ns: &impl Fn(Instant) -> u64,
) -> String {
    let (from, to) = (p.saturating_sub(BEFORE_NS), a + AFTER_NS);
    let at = |t: u64| (t as f64 - from as f64) / 1e6;
    let mut lines: Vec<(u64, String)> = Vec::new();
    for &(p, read, acked) in acks.iter().filter(|&&(p, _, _)| (from..=to).contains(&p)) {
        let handler = handled
            .get(&p)
            .map_or("-".to_owned(), |&h| format!("+{:.2}", at(h) - at(p)));
        let publisher = sent
            .get(&p)
            .map_or("written -  broker -".to_owned(), |&(w, b)| {
                format!(
                    "written +{:.2}  broker +{:.2}",
                    at(w) - at(p),
                    at(b) - at(p)
                )
            });
        lines.push((
            p,
            format!(
                "delivery  {publisher}  read +{:.2}  handled {handler}  acked +{:.2}",
                at(read) - at(p),
                at(acked) - at(p)
            ),
        ));
    }
    lines.extend(vfs_lines(calls, threads, ns, from, to, &at));
    lines.sort_by_key(|l| l.0);
    let mut out = format!(
        "# {name}: from {} ms before the publish of {what} ({:.2} ms to its PUBACK, {:.2} ms from the \
         relay's read of it) to {} ms after its PUBACK. Times in ms from the window's start; a delivery's \
         line is at its publish, with when the publisher's client wrote it and read the broker's PUBACK for \
         it, the relay's read of it, its handler (inside its batch's transaction) and the relay's read of \
         its PUBACK after it.\n",
        BEFORE_NS / 1_000_000,
        (a - p) as f64 / 1e6,
        a.saturating_sub(read) as f64 / 1e6,
        AFTER_NS / 1_000_000,
    );
    for (t, line) in lines {
        let _ = writeln!(out, "{:9.3}  {line}", at(t));
    }
    out
}

/// Writes of one thread to one kind of file, close together.
#[derive(Clone, Copy)]
struct Run {
    thread: u32,
    wal: bool,
    first: u64,
    last: u64,
    writes: u32,
    bytes: u64,
}

/// The VFS calls in `from..=to`: each run of writes of one thread to one file as a line, and each sync's
/// beginning and end.
fn vfs_lines(
    calls: &[Traced],
    threads: &[String],
    ns: &impl Fn(Instant) -> u64,
    from: u64,
    to: u64,
    at: &impl Fn(u64) -> f64,
) -> Vec<(u64, String)> {
    let file = |wal: bool| if wal { "WAL" } else { "database file" };
    let who = |t: u32| threads.get(t as usize).map_or("?", String::as_str);
    let line = |r: &Run| {
        let what = format!(
            "{}: {} writes, {} bytes to the {}, until {:.3}",
            who(r.thread),
            r.writes,
            r.bytes,
            file(r.wal),
            at(r.last)
        );
        (r.first, what)
    };
    let mut lines = Vec::new();
    let mut open: Vec<Run> = Vec::new();
    for c in calls {
        let t = ns(c.at);
        if t < from || t > to {
            continue;
        }
        match c.call {
            Call::Write { bytes } => {
                let next = Run {
                    thread: c.thread,
                    wal: c.wal,
                    first: t,
                    last: t,
                    writes: 1,
                    bytes: u64::from(bytes),
                };
                match open
                    .iter_mut()
                    .find(|r| r.thread == c.thread && r.wal == c.wal)
                {
                    Some(r) if t - r.last <= SAME_RUN_NS => {
                        r.last = t;
                        r.writes += 1;
                        r.bytes += u64::from(bytes);
                    }
                    Some(r) => {
                        lines.push(line(r));
                        *r = next;
                    }
                    None => open.push(next),
                }
            }
            Call::SyncBegins => {
                // A thread's sync ends its run of writes: the next ones are another transaction's.
                open.retain(|r| {
                    let done = r.thread == c.thread;
                    if done {
                        lines.push(line(r));
                    }
                    !done
                });
                lines.push((
                    t,
                    format!("{}: sync of the {} begins", who(c.thread), file(c.wal)),
                ));
            }
            Call::SyncEnds { took } => lines.push((
                t,
                format!(
                    "{}: sync of the {} ends ({:.2} ms)",
                    who(c.thread),
                    file(c.wal),
                    took.as_secs_f64() * 1e3
                ),
            )),
        }
    }
    lines.extend(open.iter().map(line));
    lines
}
