//! Stock reservation from order events, exactly once in effect.
//!
//! Order events arrive on `orders/#` as JSON, `{"order":42,"sku":"A-1","qty":1,"kind":"created"}` or
//! `"kind":"cancelled"`, with the application id in the MQTT 5 user property `message-id`
//! (`evt-42-created`). `created` reserves `qty` of the sku, `cancelled` releases it. The broker may deliver
//! an event twice; the reservation happens once.
//!
//! ```text
//! inventory run --broker HOST:PORT --db PATH [--client-id ID] [--topic FILTER] [--exit-when-idle SECS]
//! inventory report --db PATH
//! inventory                      # demo: own local broker, seed events, consume, report
//! ```
//!
//! `report` prints `{"reserved":{"A-1":3,...},"processed":N,"duplicates":N,"conflicts":N,"quarantined":N}`
//! from the durable counters. Without `--broker` the example starts mosquitto (from `PATH` or
//! `/usr/sbin/mosquitto`) on a free loopback port, or, where mosquitto is not installed, a broker inside this
//! process, and publishes the seed's events: a redelivery, a conflicting reuse of an id and a message without
//! an id included.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use edge_inbox::{Config, Consumer, Delivery, Inbox, MqttConfig, Tx};

mod support;

const SCOPE: &str = "inventory-reservation";

/// The whole business logic: one handler.
fn reserve(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let event: serde_json::Value =
        serde_json::from_slice(d.payload).context("payload is not JSON")?;
    let sku = event["sku"].as_str().context("no sku")?;
    let qty = event["qty"].as_i64().context("no qty")?;
    let delta = match event["kind"].as_str() {
        Some("created") => qty,
        Some("cancelled") => -qty,
        other => bail!("unknown kind {other:?}"),
    };
    let key = format!("reserved/{sku}");
    let reserved: i64 = tx.get(&key)?.unwrap_or(0);
    tx.put(&key, &(reserved + delta))?;
    Ok(())
}

struct RunArgs {
    broker: Option<String>,
    db: Option<PathBuf>,
    client_id: String,
    topic: String,
    exit_when_idle: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => demo(None),
        Some("run") => {
            let run = parse_run(&args[1..])?;
            match run.broker.clone() {
                Some(broker) => {
                    let db = run.db.clone().context("--db PATH is required")?;
                    consume(&broker, &db, &run)?;
                    Ok(())
                }
                None => demo(run.db),
            }
        }
        Some("report") => {
            let db = match args.get(1..) {
                Some([flag, path]) if flag == "--db" => PathBuf::from(path),
                _ => bail!("usage: inventory report --db PATH"),
            };
            println!("{}", report(&db)?);
            Ok(())
        }
        Some(other) => bail!(
            "unknown command {other:?}\nusage: inventory run --broker HOST:PORT --db PATH [--client-id ID] \
             [--topic FILTER] [--exit-when-idle SECS]\n       inventory report --db PATH"
        ),
    }
}

fn parse_run(args: &[String]) -> anyhow::Result<RunArgs> {
    let mut run = RunArgs {
        broker: None,
        db: None,
        client_id: "inventory-reservation-1".into(),
        topic: "orders/#".into(),
        exit_when_idle: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--broker" => run.broker = Some(value()?.clone()),
            "--db" => run.db = Some(PathBuf::from(value()?)),
            "--client-id" => run.client_id = value()?.clone(),
            "--topic" => run.topic = value()?.clone(),
            "--exit-when-idle" => {
                run.exit_when_idle = Some(value()?.parse().context("--exit-when-idle SECS")?)
            }
            other => bail!("unknown option {other:?}"),
        }
    }
    Ok(run)
}

/// Consumes until SIGINT/SIGTERM (or idle, with `--exit-when-idle`).
fn consume(broker: &str, db: &Path, run: &RunArgs) -> anyhow::Result<edge_inbox::RunSummary> {
    let (host, port) = broker.rsplit_once(':').context("--broker HOST:PORT")?;
    let port: u16 = port.parse().context("--broker HOST:PORT")?;
    let inbox = Inbox::open(db, Config::default())?;
    let mqtt = MqttConfig::new(host, port, &run.client_id).subscribe(&run.topic);
    let mut consumer = Consumer::new(inbox, SCOPE, mqtt).handler_attempts(3);
    if let Some(secs) = run.exit_when_idle {
        consumer = consumer.exit_when_idle(Duration::from_secs(secs));
    }
    let stop = consumer.stop_handle();
    // The batch in flight is finished, committed and acked before the consumer returns.
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.flag())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.flag())?;
    Ok(consumer.run(reserve)?)
}

fn report(db: &Path) -> anyhow::Result<String> {
    if !db.exists() {
        bail!("{} does not exist", db.display());
    }
    let inbox = Inbox::open(db, Config::default())?;
    let mut reserved = serde_json::Map::new();
    let mut stmt = inbox
        .connection()
        .prepare("SELECT substr(key, 10), value FROM kv WHERE ns = ?1 AND key LIKE 'reserved/%' ORDER BY key")?;
    let rows = stmt.query_map([SCOPE], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))
    })?;
    for row in rows {
        let (sku, value) = row?;
        let qty: i64 = ciborium::from_reader(&value[..]).context("stored quantity")?;
        reserved.insert(sku, qty.into());
    }
    let stats = inbox.scope_stats(SCOPE)?;
    // Written by hand to keep the documented key order.
    Ok(format!(
        r#"{{"reserved":{},"processed":{},"duplicates":{},"conflicts":{},"quarantined":{}}}"#,
        serde_json::Value::Object(reserved),
        stats.processed,
        stats.duplicates,
        stats.conflicts,
        stats.quarantined
    ))
}

/// The seed's scenario end to end on this machine.
fn demo(db: Option<PathBuf>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Started as root, mosquitto drops to its own user; it only needs to read its config here.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let db = db.unwrap_or_else(|| dir.path().join("inventory.db"));
    let broker = support::LocalBroker::start(dir.path())?;
    let addr = broker.addr();
    eprintln!(
        "{}",
        broker.banner("inventory run --broker HOST:PORT --db PATH")
    );
    eprintln!("inbox {}", db.display());
    let run = RunArgs {
        broker: Some(addr.clone()),
        db: Some(db.clone()),
        client_id: "inventory-demo".into(),
        topic: "orders/#".into(),
        exit_when_idle: Some(1),
    };
    // First connection: the broker now keeps a persistent session with our subscription.
    consume(&addr, &db, &run)?;

    let created = |order: u32, sku: &str, qty: u32| {
        format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"created"}}"#)
    };
    let cancelled = |order: u32, sku: &str, qty: u32| {
        format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"cancelled"}}"#)
    };
    let events: Vec<(&str, Option<&str>, String)> = vec![
        ("orders/42", Some("evt-42-created"), created(42, "A-1", 1)),
        ("orders/43", Some("evt-43-created"), created(43, "A-1", 2)),
        // The broker redelivers 42 (our PUBACK was lost): recognised, not applied again.
        ("orders/42", Some("evt-42-created"), created(42, "A-1", 1)),
        ("orders/44", Some("evt-44-created"), created(44, "B-7", 1)),
        (
            "orders/43",
            Some("evt-43-cancelled"),
            cancelled(43, "A-1", 2),
        ),
        // A buggy producer reuses an id for other content: a recorded conflict, not applied.
        ("orders/44", Some("evt-44-created"), created(44, "B-7", 5)),
        // No id at all: quarantined, acked, kept for an operator.
        ("orders/45", None, created(45, "A-1", 9)),
        ("orders/46", Some("evt-46-created"), created(46, "A-1", 2)),
    ];
    support::publish(broker.port, "inventory-demo-publisher", &events)?;
    eprintln!("published {} events; consuming until idle", events.len());
    let run = RunArgs {
        exit_when_idle: Some(2),
        ..run
    };
    let summary = consume(&addr, &db, &run)?;
    eprintln!("this run: {summary:?}");
    println!("{}", report(&db)?);
    Ok(())
}
