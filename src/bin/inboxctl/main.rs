//! `inboxctl`: look at and repair an edge-inbox database from a shell.
//!
//! Exit codes: 0 success; 1 operational error (the file cannot be opened or read, a check found problems, a
//! requested row or scope does not exist, the database stayed busy); 2 usage error (bad arguments, from clap,
//! and a `prune --apply --as-of` time that cannot be right).
//!
//! Read-only commands open the file read-only; only `requeue`, `prune --apply` and `downgrade` write, and the
//! first two refuse a file of an older schema version instead of migrating it.

mod output;
mod prometheus;
mod times;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use edge_inbox::inspect::{self, ExportRow, FileSizes, Table};
use edge_inbox::rusqlite::Connection;
use edge_inbox::{open_read_only, ClockVerdict, Config, Error, Inbox, Pruning};
use serde::Serialize;

/// Inspect and operate an edge-inbox database (see `inboxctl <command> --help`).
///
/// Exit codes: 0 ok, 1 operational error (cannot open, check failed, not found, busy), 2 usage error.
#[derive(Parser, Debug)]
#[command(name = "inboxctl", version)]
struct Cli {
    /// Path of the inbox database file.
    #[arg(short, long, env = "EDGE_INBOX_DB", global = true)]
    db: Option<PathBuf>,
    /// Print JSON: one document, or one JSON object per line for listings. Times are RFC 3339 (UTC), each
    /// beside its stored Unix value in a `*_unix` field.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Per-scope counters, backlog, dead letters, identities retained, outbox backlog (pending and parked),
    /// and file sizes.
    Stats {
        /// Only this scope.
        #[arg(long)]
        scope: Option<String>,
        /// Output format (`--json` is short for `--format json`).
        #[arg(long, value_enum)]
        format: Option<StatsFormat>,
        /// Write to this file instead of standard output, replacing it atomically (for node_exporter's
        /// textfile collector: a scrape never sees half a file). The database and its -wal and -shm files
        /// are refused.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// One identity (scope + optional producer + message id) or one stored message (by seq).
    ///
    /// Exit code 1 when nothing is recorded under it (an identity's report is printed all the same).
    Show {
        #[command(subcommand)]
        what: Show,
    },
    /// Recorded conflicts (same id, different content), oldest first.
    Conflicts(List),
    /// Quarantined deliveries (no id, malformed, over a limit, expired), oldest first.
    Quarantine(List),
    /// Dead letters, oldest first.
    DeadLetters(List),
    /// Put dead letters back to pending (attempts reset) for the deferred worker. Writes.
    Requeue {
        /// One dead letter by its seq.
        #[arg(long, conflicts_with = "scope", required_unless_present = "scope")]
        seq: Option<i64>,
        /// Every dead letter of this scope.
        #[arg(long)]
        scope: Option<String>,
    },
    /// What retention would prune now (dry run); with --apply, prune it. Uses the stored retention policies.
    Prune {
        /// Actually prune (short write transactions; consumers on the file keep running).
        #[arg(long)]
        apply: bool,
        /// Judge ages as of this Unix time (seconds) instead of now. A stated time overrides the rule that
        /// refuses to prune after a clock jump of more than 30 days (never the database's creation time).
        /// With --apply, a time more than a day ahead of this machine's clock (one in milliseconds, say) or
        /// before 2025 is refused as a usage error.
        #[arg(long)]
        as_of: Option<i64>,
    },
    /// PRAGMA integrity_check, the inbox's own invariants (each breach by name), schema version and file
    /// settings. Exit code 1 when a problem or a breach is found.
    Check {
        /// Report at most this many problems.
        #[arg(long, default_value_t = 100)]
        max_problems: usize,
    },
    /// Take the file back to an older schema version, for a rollback to an older build (stop every process
    /// using the file first). Refused when the older version would read the file otherwise (an identity
    /// layout other than `hashed` for version 5). Writes.
    Downgrade {
        /// Schema version to take the file back to.
        #[arg(long)]
        to: i64,
    },
    /// Write a table as JSON lines or as a CBOR sequence.
    ///
    /// The rows come from one snapshot. While it lasts they go to a file (the new output file, or a
    /// temporary one copied to standard output after the snapshot ends): a reader of the output that stops
    /// (a pager) does not keep the snapshot open, which would keep consumers from starting the WAL over.
    Export {
        /// Which table.
        #[arg(long, value_enum)]
        table: ExportTable,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Jsonl)]
        format: Format,
        /// Output file (default: standard output), created 0600 and replaced atomically; a symlink at the
        /// path is replaced, never written through. The database and its -wal and -shm files are refused.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum Show {
    /// An identity: status, hash, fingerprint, stored message, conflicts.
    Id {
        /// Consumer scope.
        #[arg(long)]
        scope: String,
        /// Producer namespace, if the id is only unique per producer.
        #[arg(long)]
        producer: Option<String>,
        /// Application message id.
        id: String,
    },
    /// A stored message by its seq.
    Seq {
        /// Row id of the message.
        seq: i64,
    },
}

#[derive(clap::Args, Debug)]
struct List {
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
    /// At most this many rows.
    #[arg(long, default_value_t = 100)]
    limit: usize,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum ExportTable {
    Identities,
    Messages,
    Conflicts,
    Quarantine,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum StatsFormat {
    /// For people.
    Text,
    /// One JSON document, the same as `--json`.
    Json,
    /// The Prometheus text exposition format: one metric family per figure, labelled by db and scope.
    Prometheus,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// One JSON object per line; byte strings as hex.
    Jsonl,
    /// A sequence of CBOR maps; byte strings as CBOR byte strings.
    Cbor,
}

fn main() -> ExitCode {
    let cli = Cli::parse(); // exits with 2 on a usage error
    if let Command::Stats {
        format: Some(f), ..
    } = cli.command
    {
        if cli.json && f != StatsFormat::Json {
            Cli::command()
                .error(
                    clap::error::ErrorKind::ArgumentConflict,
                    "--json asks for --format json; give one of them",
                )
                .exit();
        }
    }
    if let Command::Prune {
        apply: true,
        as_of: Some(t),
    } = cli.command
    {
        if let Some(why) = implausible_as_of(t, unix_now()) {
            Cli::command()
                .error(clap::error::ErrorKind::ValueValidation, why)
                .exit();
        }
    }
    init_logging();
    match run(&cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("inboxctl: {}", cause_chain(&e));
            ExitCode::from(1)
        }
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Why `prune --apply --as-of t` must not run on a machine whose clock reads `now`; `None` when `t` can be
/// right. The library trusts a stated time, so a typo decides what is deleted: a time far ahead (one in
/// milliseconds, `$(date +%s)000`) deletes every dated identity and moves the scope's pruned horizon ahead
/// of every delivery to come, which would then all be quarantined as expired.
fn implausible_as_of(t: i64, now: i64) -> Option<String> {
    const DAY: i64 = 86_400;
    // The value, and its calendar time when it has one (a value in milliseconds is past the year 9999).
    let stated = match jiff::Timestamp::from_second(t) {
        Ok(time) => format!("{t} ({time})"),
        Err(_) => t.to_string(),
    };
    if t > now.saturating_add(DAY) {
        let hint = if t > 100_000_000_000 {
            format!(
                " It looks like milliseconds; in Unix seconds it is {}.",
                t / 1000
            )
        } else if now < edge_inbox::EARLIEST_PLAUSIBLE_TIME {
            " This machine's clock cannot be right: set it first.".to_owned()
        } else {
            String::new()
        };
        Some(format!(
            "--as-of {stated} is more than a day ahead of this machine's clock ({}): pruning as of a time to \
             come deletes what must stay.{hint}",
            times::rfc3339(now)
        ))
    } else if t < edge_inbox::EARLIEST_PLAUSIBLE_TIME {
        Some(format!(
            "--as-of {stated} is before {}, before this software existed: it cannot be right",
            times::rfc3339(edge_inbox::EARLIEST_PLAUSIBLE_TIME)
        ))
    } else {
        None
    }
}

/// Each cause once: some errors already print their source in their own message, so a link that the
/// previous one ends with is not repeated.
fn cause_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// Library log records go to stderr; `RUST_LOG` selects them, warnings and errors by default.
fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
}

fn db(cli: &Cli) -> anyhow::Result<&Path> {
    match &cli.db {
        Some(p) => Ok(p),
        None => bail!("no database given: use --db PATH or set EDGE_INBOX_DB"),
    }
}

fn read_only(path: &Path) -> anyhow::Result<Connection> {
    open_read_only(path).map_err(|e| opening(path, e))
}

/// Opens for writing, refusing to create a file that is not there (a typo must not make an empty inbox), and
/// refusing a file of an older schema: opening it for writing would migrate it, and the build that wrote it
/// (one rolled back to, after `inboxctl downgrade`) could no longer open it.
fn writable(path: &Path) -> anyhow::Result<Inbox> {
    // Refuses a missing file, or one that is not an inbox, before the writable open would create it or
    // install the schema in it.
    let conn = read_only(path)?;
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    drop(conn);
    if version < edge_inbox::SCHEMA_VERSION {
        bail!(
            "{} is at schema version {version}, older than this inboxctl's {}: writing to it would migrate \
             it, and the build that wrote it could then not open it. Use that build's inboxctl, or let a \
             consumer of this build open the file first",
            path.display(),
            edge_inbox::SCHEMA_VERSION
        );
    }
    Inbox::open(path, Config::default()).map_err(|e| opening(path, e))
}

/// An error from opening `path`, naming the path once: in front, unless the error already names it.
fn opening(path: &Path, e: Error) -> anyhow::Error {
    let shown = path.display().to_string();
    if e.to_string().contains(&shown) {
        e.into()
    } else {
        anyhow::Error::from(e).context(format!("opening {shown}"))
    }
}

/// Fails (exit 1) when `scope` is given and names no scope of the inbox: a typo must not read as a scope
/// with nothing in it.
fn known_scope(conn: &Connection, path: &Path, scope: Option<&str>) -> anyhow::Result<()> {
    match scope {
        Some(s) if !inspect::scope_exists(conn, s)? => {
            bail!("no scope {s:?} in {}", path.display())
        }
        _ => Ok(()),
    }
}

/// One JSON document, times as RFC 3339 beside their Unix values.
fn json_text<T: Serialize>(v: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string(&times::in_json(
        serde_json::to_value(v)?,
    ))?)
}

fn print_json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", json_text(v)?);
    Ok(())
}

fn producer_prefix(p: Option<&str>) -> String {
    p.map(|p| format!("{p}/")).unwrap_or_default()
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    let path = db(cli)?;
    match &cli.command {
        Command::Stats {
            scope,
            format,
            output,
        } => {
            let format = match format {
                Some(f) => *f,
                None if cli.json => StatsFormat::Json,
                None => StatsFormat::Text,
            };
            stats(path, scope.as_deref(), format, output.as_deref())
        }
        Command::Show { what } => show(cli, path, what),
        Command::Conflicts(l) => {
            let conn = read_only(path)?;
            known_scope(&conn, path, l.scope.as_deref())?;
            let rows = inspect::conflicts(&conn, l.scope.as_deref(), l.limit)?;
            listing(cli, &rows, |c| {
                format!(
                    "#{} {} {}{} topic {:?}: committed {} received {} at {}{}",
                    c.id,
                    c.scope,
                    producer_prefix(c.producer.as_deref()),
                    c.message_id,
                    c.topic,
                    c.stored_fingerprint,
                    c.received_fingerprint,
                    times::rfc3339(c.at),
                    arrivals(c.arrivals, c.last_at)
                )
            })
        }
        Command::Quarantine(l) => {
            let conn = read_only(path)?;
            known_scope(&conn, path, l.scope.as_deref())?;
            let rows = inspect::quarantine(&conn, l.scope.as_deref(), l.limit)?;
            listing(cli, &rows, |q| {
                format!(
                    "#{} {} topic {:?} ({} bytes) at {}{}: {}",
                    q.id,
                    q.scope.as_deref().unwrap_or("-"),
                    q.topic,
                    q.payload_bytes,
                    times::rfc3339(q.at),
                    arrivals(q.arrivals, q.last_at),
                    q.reason
                )
            })
        }
        Command::DeadLetters(l) => {
            let conn = read_only(path)?;
            known_scope(&conn, path, l.scope.as_deref())?;
            let rows = inspect::dead_letters(&conn, l.scope.as_deref(), l.limit)?;
            listing(cli, &rows, |m| {
                format!(
                    "seq {} {} {}{} topic {:?} attempts {} ({}) at {}: {}",
                    m.seq,
                    m.scope,
                    producer_prefix(m.producer.as_deref()),
                    m.message_id,
                    m.topic,
                    m.attempts,
                    m.body_bytes
                        .map_or("body pruned".to_owned(), |b| format!("{b} bytes")),
                    times::rfc3339(m.finished_at.unwrap_or(m.received_at)),
                    m.last_error.as_deref().unwrap_or("")
                )
            })
        }
        Command::Requeue { seq, scope } => requeue(cli, path, *seq, scope.as_deref()),
        Command::Prune { apply, as_of } => prune(cli, path, *apply, *as_of),
        Command::Check { max_problems } => check(cli, path, *max_problems),
        Command::Downgrade { to } => downgrade(cli, path, *to),
        Command::Export {
            table,
            format,
            output,
        } => export(path, *table, *format, output.as_deref()),
    }
}

fn listing<T: Serialize>(
    cli: &Cli,
    rows: &[T],
    line: impl Fn(&T) -> String,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    for r in rows {
        if cli.json {
            writeln!(out, "{}", json_text(r)?)?;
        } else {
            writeln!(out, "{}", line(r))?;
        }
    }
    if !cli.json && rows.is_empty() {
        writeln!(out, "(none)")?;
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Serialize)]
struct StatsDoc {
    path: String,
    files: FileSizes,
    /// Bytes the inbox wrote over the file's life, as saved in it.
    bytes_written: inspect::BytesWritten,
    /// The device's own wear figures, where it reports them.
    #[serde(skip_serializing_if = "Option::is_none")]
    device: Option<inspect::DeviceWear>,
    scopes: Vec<inspect::ScopeReport>,
}

/// Where sysfs is: `/sys`, or `EDGE_INBOX_SYSFS` (for tests, which stage a device there).
fn device_wear(path: &Path) -> Option<inspect::DeviceWear> {
    match std::env::var_os("EDGE_INBOX_SYSFS") {
        Some(root) => inspect::device_wear_in(path, Path::new(&root)),
        None => inspect::device_wear(path),
    }
}

fn stats(
    path: &Path,
    scope: Option<&str>,
    format: StatsFormat,
    output: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let conn = read_only(path)?;
    known_scope(&conn, path, scope)?;
    if let Some(file) = output {
        output::refuse_database_files(path, file)?;
    }
    let doc = StatsDoc {
        path: path.display().to_string(),
        scopes: inspect::stats(&conn, scope)?,
        files: FileSizes::of(path),
        bytes_written: inspect::bytes_written(&conn)?,
        device: device_wear(path),
    };
    let text = match format {
        StatsFormat::Text => stats_text(&doc),
        StatsFormat::Json => json_text(&doc)? + "\n",
        StatsFormat::Prometheus => prometheus::render(
            &doc.path,
            &doc.files,
            &doc.bytes_written,
            doc.device.as_ref(),
            &doc.scopes,
        ),
    };
    match output {
        Some(file) => {
            output::replace_atomically(file, output::SHARED, |w| Ok(w.write_all(text.as_bytes())?))?
        }
        None => std::io::stdout().lock().write_all(text.as_bytes())?,
    }
    Ok(ExitCode::SUCCESS)
}

fn stats_text(doc: &StatsDoc) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: database {} bytes, WAL {} bytes",
        doc.path, doc.files.db_bytes, doc.files.wal_bytes
    );
    let w = &doc.bytes_written;
    let _ = writeln!(
        out,
        "written over the file's life: WAL {} bytes, checkpoints {} bytes, total {} bytes",
        w.wal_bytes,
        w.checkpoint_bytes,
        w.total()
    );
    if let Some(d) = &doc.device {
        let text = |v: Option<u8>| v.map_or("-".to_owned(), inspect::DeviceWear::life_time_text);
        let _ = writeln!(
            out,
            "device {}: life time used {} (type A), {} (type B), pre-EOL {}",
            d.device,
            text(d.life_time_a),
            text(d.life_time_b),
            d.pre_eol_info
                .map_or("-", inspect::DeviceWear::pre_eol_text)
        );
    }
    for s in &doc.scopes {
        let _ = writeln!(out, "scope {}", s.scope);
        let _ = writeln!(
            out,
            "  processed {}  duplicates {}  conflicts {} ({} records)  handler failures {}  quarantined {} ({} records)  \
             expired {}",
            s.processed,
            s.duplicates,
            s.conflicts,
            s.conflict_records,
            s.handler_failures,
            s.quarantined,
            s.quarantine_records,
            s.expired
        );
        let _ = writeln!(
            out,
            "  pending {}  failed {}  in flight {}  oldest pending {}  dead letters {} (ever {})",
            s.pending,
            s.failed,
            s.in_flight,
            s.oldest_pending_age_secs
                .map_or("-".to_owned(), |a| format!("{a}s")),
            s.dead_letters,
            s.dead_lettered
        );
        let _ = writeln!(
            out,
            "  identities retained {}  watermark producers {}  messages stored {}  pruned: {} identities, {} payloads",
            s.identities_retained,
            s.watermark_producers,
            s.messages_stored,
            s.identities_pruned,
            s.payloads_pruned
        );
        let _ = writeln!(
            out,
            "  sequence conflicts {}  identities without send time {} (never pruned)  re-dated {}  \
             outbox pending {}  outbox parked {}",
            s.sequence_conflicts,
            s.identities_undated,
            s.identities_restamped,
            s.outbox_pending,
            s.outbox_parked
        );
    }
    if doc.scopes.is_empty() {
        let _ = writeln!(out, "(no scopes)");
    }
    out
}

fn show(cli: &Cli, path: &Path, what: &Show) -> anyhow::Result<ExitCode> {
    let conn = read_only(path)?;
    match what {
        Show::Id {
            scope,
            producer,
            id,
        } => {
            let rep = inspect::identity(&conn, scope, producer.as_deref(), id)?;
            if cli.json {
                print_json(&rep)?;
            } else {
                println!(
                    "{} {}{}: {} (hash {})",
                    rep.scope,
                    producer_prefix(rep.producer.as_deref()),
                    rep.message_id,
                    rep.status,
                    rep.id_hash
                );
                if let (Some(fp), Some(day)) = (&rep.fingerprint, rep.committed_day) {
                    println!(
                        "  fingerprint {fp}, committed during the UTC day starting {}",
                        times::rfc3339(day)
                    );
                }
                match &rep.message {
                    Some(m) => print_message(m),
                    None => println!("  no stored message"),
                }
                if rep.conflicts > 0 {
                    println!("  {} conflict(s) recorded", rep.conflicts);
                }
            }
            // A requested row that does not exist: the report says what was looked up, the exit code that
            // nothing is recorded under it.
            if rep.status == "not-found" {
                eprintln!(
                    "inboxctl: no identity recorded for {} in scope {}",
                    producer_prefix(rep.producer.as_deref()) + &rep.message_id,
                    rep.scope
                );
                return Ok(ExitCode::from(1));
            }
            Ok(ExitCode::SUCCESS)
        }
        Show::Seq { seq } => {
            let Some(m) = inspect::message(&conn, *seq)? else {
                bail!("no stored message with seq {seq}");
            };
            if cli.json {
                print_json(&m)?;
            } else {
                print_message(&m);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_message(m: &inspect::MessageReport) {
    println!(
        "  message seq {} in {}: {} topic {:?}, {}, attempts {}, claims {}",
        m.seq,
        m.scope,
        m.state,
        m.topic,
        m.body_bytes
            .map_or("body pruned".to_owned(), |b| format!("body {b} bytes")),
        m.attempts,
        m.claims
    );
    let mut when = format!("  received {}", times::rfc3339(m.received_at));
    if let Some(t) = m.sent_at {
        when += &format!(", sent {}", times::rfc3339(t));
    }
    if let Some(t) = m.finished_at {
        when += &format!(", finished {}", times::rfc3339(t));
    }
    if let (Some(owner), Some(ms)) = (&m.lease_owner, m.lease_until_ms) {
        when += &format!(", leased by {owner} until {}", times::rfc3339_ms(ms));
    }
    println!("{when}");
    if let Some(e) = &m.last_error {
        println!("  last error: {e}");
    }
}

#[derive(Serialize)]
struct RequeueDoc {
    requeued: usize,
}

fn requeue(
    cli: &Cli,
    path: &Path,
    seq: Option<i64>,
    scope: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let mut inbox = writable(path)?;
    let n = match (seq, scope) {
        (Some(seq), _) => {
            if !inbox.requeue_dead_letter(seq)? {
                bail!("seq {seq} is not a dead letter with a body");
            }
            1
        }
        (None, Some(scope)) => {
            known_scope(inbox.connection(), path, Some(scope))?;
            inbox.requeue_dead_letters(scope)?
        }
        (None, None) => unreachable!("clap requires --seq or --scope"),
    };
    if cli.json {
        print_json(&RequeueDoc { requeued: n })?;
    } else {
        println!("requeued {n} dead letter(s)");
    }
    Ok(ExitCode::SUCCESS)
}

/// `, N arrivals, last at T` for a record that arrived more than once.
fn arrivals(n: u64, last_at: i64) -> String {
    if n > 1 {
        format!(", {n} arrivals, last at {}", times::rfc3339(last_at))
    } else {
        String::new()
    }
}

#[derive(Serialize)]
struct PruneDoc {
    applied: bool,
    as_of: i64,
    due: Vec<inspect::PrunePreview>,
    /// Outbox messages the broker confirmed more than `Pruning::sent_outbox` ago (7 days), also due.
    sent_outbox_due: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pruned: Option<Pruned>,
    /// Why retention does not trust the time (`None` when it does); with `--as-of`, what the stated time
    /// overrode.
    clock_warning: Option<String>,
    /// Retention refused to prune: the clock cannot be right (nothing was deleted).
    clock_refused: bool,
    /// The time stated with `--as-of` is one the clock-jump rule refuses; it was used anyway.
    clock_overridden: bool,
}

#[derive(Serialize)]
struct Pruned {
    payloads: u64,
    dead_letters: u64,
    identities: u64,
    quarantine_records: u64,
    conflict_records: u64,
    sent_outbox: u64,
    pages_reclaimed: u64,
    steps: u64,
}

/// How long to rest after a prune step that took `took`: the rule of `Inbox::prune`
/// ([`Pruning::rest_after`] with the default options), so that the pass takes about a tenth of the disk's
/// time and consumers on the file keep their commit times on slow flash. `took` here includes the step's own
/// checkpoint, which the library leaves out: a little longer a rest.
fn prune_rest(took: Duration) -> Duration {
    Pruning::default().rest_after(took)
}

fn prune(cli: &Cli, path: &Path, apply: bool, as_of: Option<i64>) -> anyhow::Result<ExitCode> {
    let now = as_of.unwrap_or_else(unix_now);
    let ro = read_only(path)?;
    let due = inspect::prune_preview(&ro, now)?;
    let sent_outbox_due = match Pruning::default().get_sent_outbox() {
        Some(age) => inspect::sent_outbox_due(&ro, now.saturating_sub(age.as_secs() as i64))?,
        None => 0,
    };
    let jump = Pruning::default().get_max_clock_jump();
    let verdict = edge_inbox::clock_verdict(&ro, now, jump)?;
    drop(ro);
    // Only a time the operator states may override the jump rule; the clock's own reading is judged by it.
    let overridden = as_of.is_some() && matches!(verdict, ClockVerdict::TooFarAhead { .. });
    let mut doc = PruneDoc {
        applied: apply,
        as_of: now,
        due,
        sent_outbox_due,
        pruned: None,
        clock_warning: verdict.warning(now),
        clock_refused: !apply && !verdict.is_plausible() && !overridden,
        clock_overridden: overridden,
    };
    if apply {
        let mut inbox = writable(path)?;
        let opts = match as_of {
            Some(t) => Pruning::default().as_of(t),
            None => Pruning::default(),
        };
        let progress = output::progress("pruning", None);
        let mut total = Pruned {
            payloads: 0,
            dead_letters: 0,
            identities: 0,
            quarantine_records: 0,
            conflict_records: 0,
            sent_outbox: 0,
            pages_reclaimed: 0,
            steps: 0,
        };
        let mut busy = 0;
        loop {
            let started = std::time::Instant::now();
            let step = match inbox.prune_step(&opts) {
                // A consumer holds the write lock: give it the file and try again, bounded.
                Err(Error::Busy { .. }) if busy < 100 => {
                    busy += 1;
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                other => other?,
            };
            busy = 0;
            doc.clock_refused |= step.clock_refused;
            total.payloads += step.payloads_pruned;
            total.dead_letters += step.dead_letters_pruned;
            total.identities += step.identities_pruned;
            total.quarantine_records += step.quarantine_pruned;
            total.conflict_records += step.conflicts_pruned;
            total.sent_outbox += step.outbox_pruned;
            total.pages_reclaimed += step.pages_reclaimed;
            total.steps += step.steps;
            progress.set_position(total.payloads + total.dead_letters + total.identities);
            if step.done {
                break;
            }
            std::thread::sleep(prune_rest(started.elapsed()));
        }
        progress.finish_and_clear();
        doc.pruned = Some(total);
    }
    // Asked to prune and refused: an operational error, not a success with nothing to do.
    let code = if apply && doc.clock_refused {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    if cli.json {
        print_json(&doc)?;
        return Ok(code);
    }
    if doc.clock_overridden {
        println!(
            "--as-of overrides the clock-jump rule: {}",
            doc.clock_warning.as_deref().unwrap_or_default()
        );
    } else if let Some(w) = &doc.clock_warning {
        println!("clock WARNING: {w}");
    }
    for d in &doc.due {
        println!(
            "scope {}: {} processed payloads, {} dead letters, {} identities, {} quarantine and {} conflict records due",
            d.scope,
            d.payloads_due,
            d.dead_letters_due,
            d.identities_due,
            d.quarantine_due,
            d.conflicts_due
        );
    }
    if doc.due.is_empty() {
        println!("no scope has a retention policy: no message or identity is ever pruned");
    }
    if let Some(age) = Pruning::default().get_sent_outbox() {
        println!(
            "outbox: {} messages sent more than {} days ago due",
            doc.sent_outbox_due,
            age.as_secs() / 86_400
        );
    }
    match &doc.pruned {
        Some(_) if doc.clock_refused => eprintln!(
            "retention refused to prune: the clock cannot be right; nothing deleted (state the time with \
             --as-of if it is)"
        ),
        Some(p) => println!(
            "pruned {} payloads, {} dead letters, {} identities, {} quarantine and {} conflict records, \
             {} sent outbox messages; {} pages reclaimed in {} steps",
            p.payloads,
            p.dead_letters,
            p.identities,
            p.quarantine_records,
            p.conflict_records,
            p.sent_outbox,
            p.pages_reclaimed,
            p.steps
        ),
        None if doc.clock_refused => println!(
            "dry run as of {}: nothing deleted; --apply would be refused (the clock cannot be right)",
            times::rfc3339(doc.as_of)
        ),
        None => println!(
            "dry run as of {}: nothing deleted (use --apply to prune)",
            times::rfc3339(doc.as_of)
        ),
    }
    Ok(code)
}

#[derive(Serialize)]
struct CheckDoc {
    #[serde(flatten)]
    report: inspect::CheckReport,
    files: FileSizes,
}

#[derive(Serialize)]
struct DowngradeDoc {
    from: i64,
    to: i64,
}

fn downgrade(cli: &Cli, path: &Path, to: i64) -> anyhow::Result<ExitCode> {
    let from = edge_inbox::downgrade_schema(path, to).map_err(|e| opening(path, e))?;
    if cli.json {
        print_json(&DowngradeDoc { from, to })?;
    } else if from == to {
        println!("schema version {to} already: nothing to do");
    } else {
        println!("schema version {from} -> {to}");
    }
    Ok(ExitCode::SUCCESS)
}

fn check(cli: &Cli, path: &Path, max_problems: usize) -> anyhow::Result<ExitCode> {
    let conn = read_only(path)?;
    let doc = CheckDoc {
        report: inspect::check(&conn, max_problems)?,
        files: FileSizes::of(path),
    };
    let r = &doc.report;
    if cli.json {
        print_json(&doc)?;
    } else {
        println!(
            "integrity: {}",
            if r.problems.is_empty() {
                "ok"
            } else {
                "PROBLEMS"
            }
        );
        for p in &r.problems {
            println!("  {p}");
        }
        // No breach found is not "ok" when the checks did not run.
        let invariants = match &r.invariants_not_checked {
            Some(why) => format!("NOT CHECKED ({why})"),
            None if r.breaches.is_empty() => "ok".to_owned(),
            None => "BREACHED".to_owned(),
        };
        println!("invariants: {invariants}");
        for b in &r.breaches {
            println!(
                "  {} in {}: {} row(s), e.g. {}",
                b.name,
                b.scope
                    .as_deref()
                    .map_or("no existing scope".to_owned(), |s| format!("scope {s:?}")),
                b.count,
                b.example
            );
        }
        println!(
            "schema version {} (this build supports {}); journal_mode {}; auto_vacuum {}; synchronous {} \
             (this connection; each inbox sets its own)",
            r.schema_version, r.supported_schema_version, r.journal_mode, r.auto_vacuum, r.synchronous
        );
        println!(
            "page size {}; {} pages, {} free; database {} bytes, WAL {} bytes",
            r.page_size, r.page_count, r.freelist_count, doc.files.db_bytes, doc.files.wal_bytes
        );
        println!(
            "identity key {}, order {}; clock {}; identities with a commit day before the database existed {}",
            r.id_key,
            r.id_order,
            r.clock_warning.as_deref().map_or("plausible".into(), |w| format!("WARNING: {w}")),
            r.identities_implausible_day
        );
    }
    Ok(if r.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn export(
    path: &Path,
    table: ExportTable,
    format: Format,
    output: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let conn = read_only(path)?;
    if let Some(p) = output {
        output::refuse_database_files(path, p)?;
    }
    let table = match table {
        ExportTable::Identities => Table::Identities,
        ExportTable::Messages => Table::Messages,
        ExportTable::Conflicts => Table::Conflicts,
        ExportTable::Quarantine => Table::Quarantine,
    };
    let progress = output::progress("exporting", Some(inspect::count(&conn, table)?));
    let rows = |out: &mut dyn Write| -> anyhow::Result<u64> {
        let mut done = 0;
        let n = inspect::export(&conn, table, |row: ExportRow| -> anyhow::Result<()> {
            match format {
                Format::Jsonl => {
                    serde_json::to_writer(&mut *out, &row)?;
                    out.write_all(b"\n")?;
                }
                Format::Cbor => ciborium::into_writer(&row, &mut *out)?,
            }
            done += 1;
            progress.set_position(done);
            Ok(())
        })?;
        Ok(n)
    };
    // The snapshot lasts as long as `rows` writes, and no checkpoint can start the WAL over while it does:
    // the rows go to a file, never straight to a reader that may stall.
    let n = match output {
        // Payloads: as private as the database, and never written through a link planted at the path. The
        // rows go to a new file beside it, renamed over it once the snapshot has ended.
        Some(p) => output::replace_atomically(p, output::PRIVATE, rows)?,
        None => {
            let mut stdout = std::io::stdout().lock();
            if output::is_regular_file(&stdout) {
                // Redirected to a file: as fast as a temporary one, without writing the rows twice.
                let mut out = std::io::BufWriter::new(stdout);
                let n = rows(&mut out)?;
                out.flush()?;
                n
            } else {
                output::spooled(&mut stdout, rows)?
            }
        }
    };
    progress.finish_and_clear();
    if output.is_some() {
        eprintln!("exported {n} row(s)");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prune_rests_as_the_library_does() {
        let ms = Duration::from_millis;
        assert_eq!(prune_rest(Duration::ZERO), ms(10), "at least the pause");
        assert_eq!(prune_rest(ms(1)), ms(10));
        assert_eq!(prune_rest(ms(5)), ms(45), "nine times the step");
        assert_eq!(prune_rest(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn a_stated_time_must_be_within_a_day_ahead_and_after_2025() {
        let now = 1_780_000_000;
        assert_eq!(implausible_as_of(now, now), None);
        assert_eq!(implausible_as_of(now + 86_400, now), None);
        assert_eq!(
            implausible_as_of(edge_inbox::EARLIEST_PLAUSIBLE_TIME, now),
            None
        );
        let ms = implausible_as_of(now * 1000, now).unwrap();
        assert!(
            ms.contains("1780000000000") && ms.contains("milliseconds"),
            "{ms}"
        );
        let ahead = implausible_as_of(now + 86_401, now).unwrap();
        assert!(
            ahead.contains("ahead") && !ahead.contains("milliseconds"),
            "{ahead}"
        );
        let early = implausible_as_of(edge_inbox::EARLIEST_PLAUSIBLE_TIME - 1, now).unwrap();
        assert!(early.contains("before"), "{early}");
        // A machine that booted at 1970 cannot judge a stated time: it says so.
        assert!(implausible_as_of(now, 0).unwrap().contains("set it first"));
    }
}
