//! The inventory example as a user runs it: its demo, `run` against a broker (directly, receive-only with
//! workers, announcing through the outbox), SIGTERM, kill -9 and restart, `report`.
#![cfg(feature = "mqtt")]

mod broker;
mod common;
mod inventory_support;
mod outbox_support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use broker::{publish_v5, Broker, Msg};
use inventory_support::{
    announcement_id, event, event_id, example, report, run_cmd, spawn, spawn_cmd, Guard, SCOPE,
};
use outbox_support::Subscriber;

#[test]
fn demo_runs_the_seed_scenario_on_its_own_broker() {
    let out = spawn(&[]).wait(Duration::from_secs(120));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"reserved":{"A-1":3,"B-7":1},"processed":5,"duplicates":1,"conflicts":1,"quarantined":1,"pending":0,"dead_letters":0,"outbox_unsent":0}"#
    );
}

#[test]
fn without_mosquitto_the_demo_runs_on_the_embedded_broker_says_so_first_and_reports_the_same() {
    let child = example(&[])
        .env("EDGE_INBOX_MOSQUITTO", "/nonexistent/mosquitto")
        .env_remove("EDGE_INBOX_LOCAL_BROKER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = Guard(Some(child)).wait(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("broker: rumqttd embedded") && first.contains("--broker HOST:PORT"),
        "first line: {first}"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"reserved":{"A-1":3,"B-7":1},"processed":5,"duplicates":1,"conflicts":1,"quarantined":1,"pending":0,"dead_letters":0,"outbox_unsent":0}"#
    );
}

#[test]
fn run_stops_cleanly_on_sigterm_after_acking_and_report_reads_the_durable_counts() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let db_s = db.to_str().unwrap();
    let addr = broker.addr();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--broker",
            &addr,
            "--db",
            db_s,
            "--client-id",
            "inv-example",
        ];
        args.extend_from_slice(extra);
        spawn(&args)
    };
    // Create the session.
    assert!(run(&["--exit-when-idle", "1"])
        .wait(Duration::from_secs(60))
        .status
        .success());

    let ev = |o: u32, sku: &str, q: u32, k: &str| {
        format!(r#"{{"order":{o},"sku":"{sku}","qty":{q},"kind":"{k}"}}"#)
    };
    broker.publish_v5(
        "orders/1",
        Some("evt-1-created"),
        &ev(1, "A-1", 3, "created"),
    );
    broker.publish_v5(
        "orders/2",
        Some("evt-2-created"),
        &ev(2, "Z-9", 1, "created"),
    );
    broker.publish_v5(
        "orders/1",
        Some("evt-1-created"),
        &ev(1, "A-1", 3, "created"),
    );
    broker.publish_v5(
        "orders/2",
        Some("evt-2-cancelled"),
        &ev(2, "Z-9", 1, "cancelled"),
    );
    broker.publish_v5("orders/3", Some("evt-3-created"), "{not json"); // handler fails, dead-lettered
    broker.publish_v5("orders/4", None, &ev(4, "A-1", 1, "created")); // quarantined

    let consumer = run(&[]);
    let settled = common::wait_for(Duration::from_secs(60), || {
        let st = edge_inbox::Inbox::open(&db, edge_inbox::Config::default())
            .ok()?
            .scope_stats("inventory-reservation")
            .ok()?;
        (st.processed + st.duplicates + st.dead_lettered + st.quarantined >= 6).then_some(())
    });
    assert!(
        settled.is_some(),
        "the consumer did not settle the deliveries"
    );
    let pid = consumer.0.as_ref().unwrap().id();
    assert!(Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let out = consumer.wait(Duration::from_secs(30));
    assert!(
        out.status.success(),
        "SIGTERM is a clean stop: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let expected = serde_json::json!({"reserved":{"A-1":3,"Z-9":0},"processed":3,"duplicates":1,"conflicts":0,"quarantined":1,"pending":0,"dead_letters":1,"outbox_unsent":0});
    assert_eq!(report(&db), expected);
    // Everything was acked before the disconnect: a new run gets no redeliveries, the counts stay.
    assert!(run(&["--exit-when-idle", "1"])
        .wait(Duration::from_secs(60))
        .status
        .success());
    assert_eq!(report(&db), expected);
    let dead: i64 = edge_inbox::Inbox::open(&db, edge_inbox::Config::default())
        .unwrap()
        .scope_stats("inventory-reservation")
        .unwrap()
        .dead_lettered as i64;
    assert_eq!(dead, 1);
}

#[test]
fn the_demo_prints_the_same_report_receiving_only_with_workers_and_announcing() {
    let out = spawn(&["run", "--receive-only", "--workers", "2", "--announce"])
        .success(Duration::from_secs(120));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"reserved":{"A-1":3,"B-7":1},"processed":5,"duplicates":1,"conflicts":1,"quarantined":1,"pending":0,"dead_letters":0,"outbox_unsent":0}"#
    );
}

#[test]
fn misused_flags_are_refused_before_connecting_and_a_password_is_never_taken_from_the_command_line()
{
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let pw_file = dir.path().join("pw");
    std::fs::write(&pw_file, "hunter2\n").unwrap();
    let pw_file = pw_file.to_str().unwrap();
    // Port 1: nothing listens; every case must fail on its arguments alone.
    let refused = |extra: &[&str], expect: &str| {
        let mut cmd = run_cmd("127.0.0.1:1", &db, "inv-flags", extra);
        cmd.env_remove("MQTT_PASSWORD");
        let out = spawn_cmd(cmd).wait(Duration::from_secs(60));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted: {stderr}");
        assert!(stderr.contains(expect), "{extra:?}: {stderr}");
        assert!(!stderr.contains("hunter2"), "{extra:?}: {stderr}");
    };
    refused(
        &["--username", "u", "--password", "hunter2"],
        "MQTT_PASSWORD",
    );
    refused(&["--username", "u"], "--username needs a password");
    refused(
        &["--password-file", pw_file],
        "--password-file needs --username",
    );
    refused(&["--workers", "2"], "--workers N is for --receive-only");
    refused(&["--receive-only", "--workers", "0"], "at least 1");
    refused(&["--tls-ca", "/nonexistent/ca.pem"], "cannot read");
    assert!(!db.exists(), "a refused run created the database");
}

#[test]
fn help_exits_0_and_documents_every_command_and_flag_but_the_refused_password() {
    let help = |args: &[&str]| {
        let out = spawn(args).success(Duration::from_secs(60));
        String::from_utf8(out.stdout).unwrap()
    };
    let top = help(&["--help"]);
    for command in ["run", "report"] {
        assert!(
            top.lines().any(|l| l.trim_start().starts_with(command)),
            "{command}:\n{top}"
        );
    }
    let run = help(&["run", "--help"]);
    for flag in [
        "--broker <HOST:PORT>",
        "--db <PATH>",
        "--client-id <ID>",
        "--topic <FILTER>",
        "--exit-when-idle <SECS>",
        "--username <NAME>",
        "--password-file <FILE>",
        "--tls-ca <FILE>",
        "--receive-only",
        "--workers <N>",
        "--announce",
    ] {
        let line = run.lines().find(|l| l.trim_start().starts_with(flag));
        // Documented: the flag's line says more than the flag.
        assert!(
            line.is_some_and(|l| l.trim().len() > flag.len() + 10),
            "{flag}:\n{run}"
        );
    }
    assert!(
        run.contains("[default: inventory-reservation-1]") && run.contains("[default: orders/#]"),
        "{run}"
    );
    assert!(!run.contains("--password <"), "{run}");
    assert!(help(&["report", "--help"]).contains("--db <PATH>"));
}

/// The seed's kinds of input: applied events, a redelivery, a conflicting reuse of an id, a handler failure
/// (dead-lettered) and a message without an id (quarantined), plus `bulk` more events for the workers.
fn mixed_events(base: u64, bulk: u64) -> Vec<Msg> {
    let msg = |order: u64, sku: &str, qty: u64, kind: &str| {
        Msg::new(
            &format!("orders/{order}"),
            Some(&event_id(order, kind)),
            event(order, sku, qty, kind),
        )
    };
    let mut msgs = vec![
        msg(base + 1, "A-1", 3, "created"),
        msg(base + 2, "Z-9", 1, "created"),
        msg(base + 1, "A-1", 3, "created"),
        msg(base + 2, "Z-9", 1, "cancelled"),
        msg(base + 2, "Z-9", 7, "cancelled"), // same id, other content: a conflict
        Msg::new(
            "orders/3",
            Some(&event_id(base + 3, "created")),
            "{not json",
        ),
        Msg::new(
            "orders/4",
            None,
            event(base + 4, "A-1", 1, "created").into_bytes(),
        ),
    ];
    msgs.extend((0..bulk).map(|i| msg(base + 10 + i, "W-1", 1, "created")));
    msgs
}

fn mixed_report(bulk: u64) -> serde_json::Value {
    serde_json::json!({"reserved":{"A-1":3,"W-1":bulk,"Z-9":0},"processed":3 + bulk,"duplicates":1,
        "conflicts":1,"quarantined":1,"pending":0,"dead_letters":1,"outbox_unsent":0})
}

#[test]
fn receive_only_with_workers_drains_before_an_idle_exit_and_reports_what_the_direct_mode_reports() {
    let broker = Broker::start();
    let addr = broker.addr();
    let dir = tempfile::tempdir().unwrap();
    let direct = dir.path().join("direct.db");
    let deferred = dir.path().join("deferred.db");
    let deferred_flags = ["--receive-only", "--workers", "3", "--exit-when-idle", "1"];
    let run_direct = || {
        spawn_cmd(run_cmd(
            &addr,
            &direct,
            "inv-direct",
            &["--exit-when-idle", "1"],
        ))
        .success(Duration::from_secs(120))
    };
    let run_deferred = || {
        spawn_cmd(run_cmd(&addr, &deferred, "inv-deferred", &deferred_flags))
            .success(Duration::from_secs(120))
    };
    // Both sessions exist before the events are published.
    run_direct();
    run_deferred();
    let bulk = common::scaled(60) as u64;
    publish_v5(broker.port, &mixed_events(0, bulk));

    run_direct();
    assert_eq!(report(&direct), mixed_report(bulk));
    // Exited only once every stored event was applied: nothing pending right after the exit.
    run_deferred();
    assert_eq!(report(&deferred), mixed_report(bulk));
    let stats = edge_inbox::Inbox::open(&deferred, edge_inbox::Config::default())
        .unwrap()
        .scope_stats(SCOPE)
        .unwrap();
    assert_eq!(
        stats.handler_failures, 3,
        "the poison event was tried 3 times"
    );
    // Every delivery was acked after its receipt: the next run gets none again.
    run_deferred();
    assert_eq!(report(&deferred), mixed_report(bulk));
}

/// The announcements the example must make for [`mixed_events`]: (message id, topic, payload).
fn mixed_announcements(base: u64, bulk: u64) -> BTreeSet<(String, String, String)> {
    let ann = |order: u64, sku: &str, qty: u64, kind: &str| {
        (
            announcement_id(&event_id(order, kind)),
            format!("stock/reserved/{order}"),
            event(order, sku, qty, kind),
        )
    };
    let mut all: BTreeSet<_> = [
        ann(base + 1, "A-1", 3, "created"),
        ann(base + 2, "Z-9", 1, "created"),
        ann(base + 2, "Z-9", 1, "cancelled"),
    ]
    .into_iter()
    .collect();
    all.extend((0..bulk).map(|i| ann(base + 10 + i, "W-1", 1, "created")));
    all
}

/// Publishes a marker on `stock/reserved/end` and waits (bounded) until `sub` got it: everything the
/// broker had confirmed before reached `sub` first.
fn until_marker(broker: &Broker, sub: &Subscriber) {
    publish_v5(broker.port, &[Msg::new("stock/reserved/end", None, "end")]);
    let seen = common::wait_for(Duration::from_secs(60), || {
        sub.got()
            .iter()
            .any(|g| g.topic == "stock/reserved/end")
            .then_some(())
    });
    assert!(seen.is_some(), "the marker never arrived");
}

/// Every announcement `sub` got (without the marker), as (message id, topic, payload) with its copies.
fn announcements(sub: &Subscriber) -> BTreeMap<(String, String, String), usize> {
    let mut m = BTreeMap::new();
    for g in sub.got() {
        if g.topic == "stock/reserved/end" {
            continue;
        }
        let key = (
            g.message_id.clone().unwrap_or_default(),
            g.topic.clone(),
            String::from_utf8(g.payload.clone()).unwrap(),
        );
        *m.entry(key).or_insert(0) += 1;
    }
    m
}

#[test]
fn announce_publishes_one_message_per_applied_event_with_its_stable_id_directly_and_from_workers() {
    let broker = Broker::start();
    let addr = broker.addr();
    let dir = tempfile::tempdir().unwrap();
    let bulk = common::scaled(20) as u64;
    for (k, mode) in [&[][..], &["--receive-only", "--workers", "2"][..]]
        .into_iter()
        .enumerate()
    {
        let db = dir.path().join(format!("announce-{k}.db"));
        let client = format!("inv-announce-{k}");
        let mut flags = vec!["--announce", "--exit-when-idle", "1"];
        flags.extend_from_slice(mode);
        let run =
            || spawn_cmd(run_cmd(&addr, &db, &client, &flags)).success(Duration::from_secs(120));
        run();
        let sub = Subscriber::start(broker.port, &format!("inv-ann-sub-{k}"), "stock/reserved/#");
        let base = 1000 * k as u64;
        publish_v5(broker.port, &mixed_events(base, bulk));
        run();
        // The run exited only after the relay's last confirmation.
        assert_eq!(report(&db), mixed_report(bulk), "mode {mode:?}");
        until_marker(&broker, &sub);
        let got = announcements(&sub);
        let keys: BTreeSet<_> = got.keys().cloned().collect();
        assert_eq!(keys, mixed_announcements(base, bulk), "mode {mode:?}");
        let with_props = sub
            .got()
            .into_iter()
            .filter(|g| g.topic != "stock/reserved/end")
            .all(|g| {
                g.producer.as_deref() == Some(SCOPE)
                    && g.content_type.as_deref() == Some("application/json")
                    && g.user_properties.iter().any(|(k, _)| k == "sent-at")
            });
        assert!(with_props, "mode {mode:?}: {:?}", sub.got());
    }
}

/// `n` distinct events (creations of skus `K-0`..`K-4`, every fourth order cancelled again), every
/// seventh creation published twice; and the reservations they add up to.
fn stream(n: u64) -> (Vec<Msg>, u64, BTreeMap<String, i64>) {
    let mut msgs = Vec::new();
    let mut distinct = 0;
    let mut reserved: BTreeMap<String, i64> = BTreeMap::new();
    for i in 0..n {
        let sku = format!("K-{}", i % 5);
        let qty = i % 3 + 1;
        let created = Msg::new(
            &format!("orders/{i}"),
            Some(&event_id(i, "created")),
            event(i, &sku, qty, "created"),
        );
        msgs.push(created.clone());
        distinct += 1;
        *reserved.entry(sku.clone()).or_default() += qty as i64;
        if i % 7 == 0 {
            msgs.push(created);
        }
        if i % 4 == 0 {
            msgs.push(Msg::new(
                &format!("orders/{i}"),
                Some(&event_id(i, "cancelled")),
                event(i, &sku, qty, "cancelled"),
            ));
            distinct += 1;
            *reserved.entry(sku).or_default() -= qty as i64;
        }
    }
    (msgs, distinct, reserved)
}

fn stats(db: &Path) -> Option<edge_inbox::ScopeStats> {
    edge_inbox::Inbox::open(db, edge_inbox::Config::default())
        .ok()?
        .scope_stats(SCOPE)
        .ok()
}

#[test]
fn kill_9_of_a_receive_only_run_mid_stream_then_a_restart_applies_every_distinct_event_once() {
    let broker = Broker::start();
    let addr = broker.addr();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let flags = ["--receive-only", "--workers", "2"];
    let run = |extra: &[&str]| {
        let mut all = flags.to_vec();
        all.extend_from_slice(extra);
        spawn_cmd(run_cmd(&addr, &db, "inv-kill-deferred", &all))
    };
    run(&["--exit-when-idle", "1"]).success(Duration::from_secs(120));

    let (msgs, distinct, reserved) = stream(common::scaled(1200) as u64);
    let port = broker.port;
    let publisher = std::thread::spawn(move || publish_v5(port, &msgs));
    let running = run(&[]);
    let mid = distinct / 5;
    let hit = common::wait_for(Duration::from_secs(120), || {
        stats(&db).filter(|s| s.processed >= mid)
    });
    assert!(hit.is_some(), "the stream never reached the workers");
    running.kill9();
    let backlog = edge_inbox::Inbox::open(&db, edge_inbox::Config::default())
        .unwrap()
        .backlog(SCOPE)
        .unwrap();
    eprintln!("killed at {:?}, backlog {backlog:?}", stats(&db));
    publisher.join().unwrap();

    // The restart waits for the killed run's leases to expire and drains what it left stored.
    run(&["--exit-when-idle", "2"]).success(Duration::from_secs(180));
    let r = report(&db);
    assert_eq!(r["processed"], distinct, "{r}");
    assert_eq!(r["reserved"], serde_json::json!(reserved), "{r}");
    assert_eq!(
        (&r["pending"], &r["dead_letters"], &r["conflicts"]),
        (&0.into(), &0.into(), &0.into()),
        "{r}"
    );
}

#[test]
fn kill_9_of_an_announcing_run_mid_stream_then_a_restart_announces_every_event_under_one_id() {
    let broker = Broker::start();
    let addr = broker.addr();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let run = |extra: &[&str]| {
        let mut all = vec!["--announce"];
        all.extend_from_slice(extra);
        spawn_cmd(run_cmd(&addr, &db, "inv-kill-announce", &all))
    };
    run(&["--exit-when-idle", "1"]).success(Duration::from_secs(120));
    let sub = Subscriber::start(broker.port, "inv-kill-announce-sub", "stock/reserved/#");

    let n = common::scaled(600) as u64;
    let (msgs, distinct, reserved) = stream(n);
    let port = broker.port;
    let publisher = std::thread::spawn(move || publish_v5(port, &msgs));
    let running = run(&[]);
    let mid = distinct as usize / 5;
    let hit = common::wait_for(Duration::from_secs(120), || {
        (sub.count() >= mid).then_some(())
    });
    assert!(hit.is_some(), "no announcements arrived");
    running.kill9();
    eprintln!(
        "killed after {} announcements received, at {:?}",
        sub.count(),
        stats(&db)
    );
    publisher.join().unwrap();

    // The restart sends what the killed relay left unconfirmed, then exits once all is confirmed.
    run(&["--exit-when-idle", "2"]).success(Duration::from_secs(180));
    let r = report(&db);
    assert_eq!(r["processed"], distinct, "{r}");
    assert_eq!(r["reserved"], serde_json::json!(reserved), "{r}");
    assert_eq!(r["outbox_unsent"], 0, "{r}");
    let rows: i64 = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row("SELECT count(*) FROM outbox", [], |row| row.get(0))
        .unwrap();
    assert_eq!(rows as u64, distinct, "one announcement per applied event");

    until_marker(&broker, &sub);
    let got = announcements(&sub);
    let mut expected = BTreeSet::new();
    for i in 0..n {
        let sku = format!("K-{}", i % 5);
        let qty = i % 3 + 1;
        let mut kinds = vec!["created"];
        if i % 4 == 0 {
            kinds.push("cancelled");
        }
        for kind in kinds {
            expected.insert((
                announcement_id(&event_id(i, kind)),
                format!("stock/reserved/{i}"),
                event(i, &sku, qty, kind),
            ));
        }
    }
    // Each announcement arrived, always under the id derived from its event: a resend after the kill
    // carries the same `message-id` as the first copy, and no copy carries another.
    let keys: BTreeSet<_> = got.keys().cloned().collect();
    assert_eq!(keys, expected);
    let mut ids_per_payload: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (id, _, payload) in got.keys() {
        ids_per_payload.entry(payload).or_default().insert(id);
    }
    assert!(ids_per_payload.values().all(|ids| ids.len() == 1));
    let resent = got.values().filter(|&&copies| copies > 1).count();
    eprintln!(
        "{} announcements, {resent} of them received more than once",
        got.len()
    );
}

#[test]
fn an_idle_exit_waits_for_stored_events_a_killed_run_left_under_lease_and_applies_them() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    // What a run killed while applying leaves behind: events stored and acked, claimed under a lease that
    // outlasts the next run's idle time.
    let events: Vec<String> = (0..5).map(|i| event(i, "L-1", 1, "created")).collect();
    let ids: Vec<String> = (0..5).map(|i| event_id(i, "created")).collect();
    let mut inbox = edge_inbox::Inbox::open(&db, edge_inbox::Config::default()).unwrap();
    for (id, body) in ids.iter().zip(&events) {
        let d = edge_inbox::Delivery::new(SCOPE, id, "orders/1", body.as_bytes());
        assert!(matches!(
            inbox.receive(&d).unwrap(),
            edge_inbox::Outcome::Received
        ));
    }
    let mut killed = edge_inbox::Worker::open(
        &db,
        edge_inbox::Config::default(),
        SCOPE,
        edge_inbox::WorkerConfig::default().lease(Duration::from_secs(8)),
    )
    .unwrap();
    assert_eq!(killed.claim(16).unwrap().len(), 5);
    drop(killed);

    let out = spawn_cmd(run_cmd(
        &broker.addr(),
        &db,
        "inv-leased",
        &["--receive-only", "--workers", "2", "--exit-when-idle", "1"],
    ))
    .success(Duration::from_secs(120));
    let r = report(&db);
    assert_eq!(
        (&r["processed"], &r["pending"], &r["reserved"]["L-1"]),
        (&5.into(), &0.into(), &5.into()),
        "{r}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_plain_run_on_a_file_with_stored_deliveries_says_how_many_wait_and_what_applies_them() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    // What a receive-only run stored and no worker applied yet.
    let mut inbox = edge_inbox::Inbox::open(&db, edge_inbox::Config::default()).unwrap();
    for order in 1..=2 {
        let (id, body) = (
            event_id(order, "created"),
            event(order, "W-1", 1, "created"),
        );
        let d = edge_inbox::Delivery::new(SCOPE, &id, "orders/1", body.as_bytes());
        assert!(matches!(
            inbox.receive(&d).unwrap(),
            edge_inbox::Outcome::Received
        ));
    }
    drop(inbox);
    let mut cmd = run_cmd(&broker.addr(), &db, "inv-plain", &["--exit-when-idle", "1"]);
    cmd.env("RUST_LOG", "warn");
    let out = inventory_support::spawn_cmd(cmd).success(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("holds 2 stored deliveries waiting to be applied")
            && stderr.contains("Worker on scope"),
        "{stderr}"
    );
    assert_eq!(report(&db)["pending"], 2, "a plain run leaves them pending");
}
