//! `inboxctl` against a real inbox file: every subcommand's output agrees with what the library committed,
//! writes happen only where asked, and exit codes are 0 / 1 (operational) / 2 (usage).

mod cli_support;
mod common;

use std::path::Path;
use std::time::Duration;

use cli_support::{inboxctl, json, json_lines, ok};
use edge_inbox::{
    Config, Delivery, Fingerprint, Inbox, OutboxProperties, Outcome, Qos, RetentionPolicy, Tx,
};
use openmetrics_parser::prometheus::parse_prometheus;
use openmetrics_parser::{PrometheusType, PrometheusValue};

const SCOPE: &str = "inventory-reservation";
const DAY: i64 = 86_400;

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1)).map_err(anyhow::Error::from)
}

/// A scope name the Prometheus format must escape (quote, backslash, line feed).
const ODD_SCOPE: &str = "odd \"scope\" C:\\gw\nline 2";

/// A processed id with a duplicate and a conflict, a quarantined delivery, a dead letter, a pending message,
/// and a second scope whose handler published three outbox messages, one of them parked (as the relay parks a
/// message the broker refused too many times).
fn populate(path: &Path) -> Inbox {
    let mut inbox = Inbox::open(path, Config::default()).unwrap();
    // Stamped with a send time, as the relay's `sent-at` does: the identity horizon never prunes the identity
    // of a delivery without one.
    let sent = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let d = Delivery::new(SCOPE, "evt-1", "orders/1", b"{\"qty\":1}").with_sent_at(sent);
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Duplicate
    ));
    let other = Delivery::new(SCOPE, "evt-1", "orders/1", b"{\"qty\":2}").with_sent_at(sent);
    assert!(matches!(
        inbox.process(&other, bump).unwrap(),
        Outcome::Conflict { .. }
    ));
    inbox
        .quarantine(
            SCOPE,
            "orders/x",
            b"\x00garbage",
            "delivery carries no application message id",
        )
        .unwrap();
    let dl = Delivery::new(SCOPE, "evt-dl", "orders/2", b"{bad")
        .with_producer("shop-1")
        .with_sent_at(sent);
    assert!(matches!(
        inbox.dead_letter_after(&dl, 3, "bad JSON").unwrap(),
        Outcome::Processed
    ));
    let p = Delivery::new(SCOPE, "evt-p", "orders/3", b"pending body").with_sent_at(sent);
    assert!(matches!(inbox.receive(&p).unwrap(), Outcome::Received));
    let o = Delivery::new("audit", "evt-1", "orders/1", b"{\"qty\":1}");
    let publish_three = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        for topic in ["audit/a", "audit/b", "audit/refused"] {
            tx.publish(topic, d.payload, Qos::AtLeastOnce, &OutboxProperties::new())?;
        }
        Ok(())
    };
    assert!(matches!(
        inbox.process(&o, publish_three).unwrap(),
        Outcome::Processed
    ));
    let parked = inbox
        .connection()
        .execute(
            "UPDATE outbox SET state = 2 WHERE topic = 'audit/refused'",
            [],
        )
        .unwrap();
    assert_eq!(parked, 1);
    inbox
}

/// Moves every time stored in the file at `path` `days` back, as if they had passed: `prune --apply` takes no
/// time ahead of the clock.
fn days_pass(path: &Path, days: i64) {
    let secs = days * DAY;
    edge_inbox::rusqlite::Connection::open(path)
        .unwrap()
        .execute_batch(&format!(
            "UPDATE messages SET received_at = received_at - {secs}, finished_at = finished_at - {secs}, \
               sent_at = sent_at - {secs}; \
             UPDATE identities SET day = CASE WHEN day < 0 THEN day + {days} ELSE day - {days} END; \
             UPDATE quarantine SET at = at - {secs}, last_at = last_at - {secs}; \
             UPDATE conflicts SET at = at - {secs}, last_at = last_at - {secs}; \
             UPDATE inbox_meta SET value = value - {secs} WHERE name IN ('created_at', 'clock_seen');"
        ))
        .unwrap();
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn scope<'a>(stats: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    stats["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["scope"] == name)
        .unwrap_or_else(|| panic!("scope {name} in {stats}"))
}

#[test]
fn stats_show_and_listings_agree_with_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let inbox = populate(&path);

    let stats = json(&path, &["stats"]);
    let s = scope(&stats, SCOPE);
    for (field, want) in [
        ("processed", 1),
        ("duplicates", 1),
        ("conflicts", 1),
        ("quarantined", 1),
        ("dead_lettered", 1),
        ("dead_letters", 1),
        ("pending", 1),
        ("failed", 0),
        ("identities_retained", 3),
        ("messages_stored", 2),
    ] {
        assert_eq!(s[field], want, "{field} in {s}");
    }
    assert!(s["oldest_pending_age_secs"].is_u64(), "{s}");
    assert_eq!(scope(&stats, "audit")["processed"], 1);
    // Parked is not pending: each row counts in one figure.
    assert_eq!(scope(&stats, "audit")["outbox_pending"], 2);
    assert_eq!(scope(&stats, "audit")["outbox_parked"], 1);
    assert_eq!(
        (&s["outbox_pending"], &s["outbox_parked"]),
        (&0.into(), &0.into())
    );
    assert!(stats["files"]["db_bytes"].as_u64().unwrap() > 0);
    assert!(
        stats["files"]["wal_bytes"].as_u64().unwrap() > 0,
        "the inbox is still open"
    );

    // The library's one call returns the same counters.
    let lib = inbox.stats().unwrap();
    let lib_scope = lib.iter().find(|r| r.scope == SCOPE).unwrap();
    assert_eq!(
        serde_json::to_value(lib_scope).unwrap()["processed"],
        s["processed"]
    );
    assert_eq!(lib_scope.identities_retained, 3);
    assert_eq!(lib_scope.dead_letters, 1);
    let st = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (st.duplicates, st.conflicts),
        (lib_scope.duplicates, lib_scope.conflicts)
    );
    let human = ok(&path, &["stats", "--scope", SCOPE]);
    assert!(human.contains("identities retained 3"), "{human}");
    assert!(!human.contains("audit"), "--scope filters: {human}");
    let audit = ok(&path, &["stats", "--scope", "audit"]);
    assert!(
        audit.contains("outbox pending 2  outbox parked 1"),
        "{audit}"
    );
    let lib_audit = lib.iter().find(|r| r.scope == "audit").unwrap();
    assert_eq!((lib_audit.outbox_pending, lib_audit.outbox_parked), (2, 1));

    // One identity: hash, fingerprint of what was committed first, its conflict.
    let id = json(&path, &["show", "id", "--scope", SCOPE, "evt-1"]);
    assert_eq!(id["status"], "recorded");
    assert_eq!(
        id["fingerprint"],
        Fingerprint::of("orders/1", b"{\"qty\":1}").to_string()
    );
    assert_eq!(id["id_hash"], inbox.id_hash(None, "evt-1").to_hex());
    assert_eq!(id["conflicts"], 1);
    assert!(id["message"].is_null());
    let pending = json(&path, &["show", "id", "--scope", SCOPE, "evt-p"]);
    assert_eq!(pending["message"]["state"], "pending");
    assert_eq!(pending["message"]["body_bytes"], "pending body".len());
    // An identity with nothing recorded: its report, and exit code 1 (as for a seq with no message).
    let not_found = |args: &[&str]| -> serde_json::Value {
        let out = inboxctl(&path, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("no identity recorded"),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if args[0] == "--json" {
            serde_json::from_slice(&out.stdout).expect("one JSON document")
        } else {
            serde_json::Value::String(String::from_utf8(out.stdout).unwrap())
        }
    };
    let missing = not_found(&["--json", "show", "id", "--scope", SCOPE, "never-sent"]);
    assert_eq!(missing["status"], "not-found");
    let human = not_found(&["show", "id", "--scope", SCOPE, "never-sent"]);
    assert!(
        human.as_str().unwrap().contains("never-sent: not-found"),
        "{human}"
    );
    // Producer namespaces are part of the identity.
    let without = not_found(&["--json", "show", "id", "--scope", SCOPE, "evt-dl"]);
    assert_eq!(without["status"], "not-found");
    let dl = json(
        &path,
        &[
            "show",
            "id",
            "--scope",
            SCOPE,
            "--producer",
            "shop-1",
            "evt-dl",
        ],
    );
    assert_eq!(dl["message"]["state"], "dead-lettered");
    let seq = dl["message"]["seq"].as_i64().unwrap();
    let by_seq = json(&path, &["show", "seq", &seq.to_string()]);
    assert_eq!(by_seq["message_id"], "evt-dl");
    assert_eq!(by_seq["attempts"], 3);
    assert_eq!(
        inboxctl(&path, &["show", "seq", "999999"]).status.code(),
        Some(1)
    );

    let conflicts = json_lines(&path, &["conflicts"]);
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0]["message_id"], "evt-1");
    assert_eq!(
        conflicts[0]["received_fingerprint"],
        Fingerprint::of("orders/1", b"{\"qty\":2}").to_string()
    );
    assert!(json_lines(&path, &["conflicts", "--scope", "audit"]).is_empty());
    let q = json_lines(&path, &["quarantine"]);
    assert_eq!(q.len(), 1);
    assert_eq!(q[0]["payload_bytes"], 8);
    assert_eq!(q[0]["scope"], SCOPE);
    let dead = json_lines(&path, &["dead-letters", "--scope", SCOPE]);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["last_error"], "bad JSON");
    drop(inbox);
}

#[test]
fn requeue_writes_only_when_asked_and_refuses_what_is_not_a_dead_letter() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(populate(&path));
    let seq = json_lines(&path, &["dead-letters"])[0]["seq"]
        .as_i64()
        .unwrap()
        .to_string();
    assert_eq!(json(&path, &["requeue", "--seq", &seq])["requeued"], 1);
    assert_eq!(json(&path, &["show", "seq", &seq])["state"], "pending");
    assert!(json_lines(&path, &["dead-letters"]).is_empty());
    let again = inboxctl(&path, &["requeue", "--seq", &seq]);
    assert_eq!(again.status.code(), Some(1), "no longer a dead letter");
    assert!(String::from_utf8_lossy(&again.stderr).contains("not a dead letter"));
    assert_eq!(json(&path, &["requeue", "--scope", SCOPE])["requeued"], 0);
    let s = json(&path, &["stats", "--scope", SCOPE]);
    assert_eq!(scope(&s, SCOPE)["pending"], 2);

    // Requeue of a whole scope.
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    for i in 0..3 {
        let id = format!("dl-{i}");
        let d = Delivery::new("audit", &id, "t", b"x");
        inbox.dead_letter(&d, "refused").unwrap();
    }
    drop(inbox);
    assert_eq!(json(&path, &["requeue", "--scope", "audit"])["requeued"], 3);
    assert_eq!(scope(&json(&path, &["stats"]), "audit")["pending"], 3);
}

#[test]
fn usage_errors_exit_2_and_operational_errors_exit_1_without_creating_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(populate(&path));
    assert_eq!(inboxctl(&path, &["frobnicate"]).status.code(), Some(2));
    assert_eq!(inboxctl(&path, &["requeue"]).status.code(), Some(2));
    assert_eq!(
        inboxctl(&path, &["requeue", "--seq", "1", "--scope", "x"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        inboxctl(&path, &["show", "seq", "abc"]).status.code(),
        Some(2)
    );
    assert_eq!(inboxctl(&path, &["stats", "--help"]).status.code(), Some(0));
    // The long help is the tool's own text, exit codes included.
    let help = inboxctl(&path, &["--help"]);
    assert_eq!(help.status.code(), Some(0));
    let help = String::from_utf8(help.stdout).unwrap();
    assert!(
        help.contains(
            "Exit codes: 0 ok, 1 operational error (cannot open, check failed, not found, busy), 2 usage \
             error."
        ),
        "{help}"
    );

    let missing = dir.path().join("typo.db");
    for args in [
        &["stats"][..],
        &["requeue", "--scope", SCOPE],
        &["prune", "--apply"],
    ] {
        let out = inboxctl(&missing, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        // One line: the path once, the operating system's reason once.
        let cause = std::fs::metadata(&missing).unwrap_err().to_string();
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!("inboxctl: cannot open {}: {cause}\n", missing.display()),
            "{args:?}"
        );
        assert!(!missing.exists(), "{args:?} must not create a database");
    }
    let not_db = dir.path().join("notes.txt");
    std::fs::write(&not_db, vec![b'x'; 8192]).unwrap();
    let out = inboxctl(&not_db, &["stats"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not an SQLite database"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A writing command on another application's SQLite file refuses it and installs nothing.
    let foreign = dir.path().join("other-app.db");
    edge_inbox::rusqlite::Connection::open(&foreign)
        .unwrap()
        .execute_batch("CREATE TABLE settings (k TEXT, v TEXT)")
        .unwrap();
    for args in [&["requeue", "--scope", SCOPE][..], &["prune", "--apply"]] {
        assert_eq!(inboxctl(&foreign, args).status.code(), Some(1), "{args:?}");
    }
    let tables: i64 = edge_inbox::rusqlite::Connection::open(&foreign)
        .unwrap()
        .query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0))
        .unwrap();
    assert_eq!(tables, 1, "the foreign database is left as it was");
}

#[test]
fn prune_is_a_dry_run_unless_applied_and_applies_what_it_previewed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = populate(&path);
    inbox
        .set_retention(
            SCOPE,
            &RetentionPolicy::new()
                .dead_letter_payloads(Duration::from_secs(DAY as u64))
                .identity_horizon(Duration::from_secs(DAY as u64)),
        )
        .unwrap();
    drop(inbox);
    days_pass(&path, 3);
    let as_of = unix_now().to_string();

    let before = json(&path, &["stats"]);
    let dry = json(&path, &["prune", "--as-of", &as_of]);
    assert_eq!(dry["applied"], false);
    let due = &dry["due"].as_array().unwrap()[0];
    assert_eq!(due["scope"], SCOPE);
    assert_eq!(due["dead_letters_due"], 1);
    assert_eq!(due["payloads_due"], 0);
    // evt-1 (no stored message) and evt-dl (its dead letter is due too); never evt-p, which is pending.
    assert_eq!(due["identities_due"], 2);
    // Ages move with the clock (slowly under an emulator); everything stored must not.
    let stored = |stats: serde_json::Value| {
        let mut scopes = stats["scopes"].clone();
        for s in scopes.as_array_mut().unwrap() {
            s.as_object_mut().unwrap().remove("oldest_pending_age_secs");
        }
        scopes
    };
    assert_eq!(
        stored(json(&path, &["stats"])),
        stored(before),
        "a dry run writes nothing"
    );

    let applied = json(&path, &["prune", "--apply", "--as-of", &as_of]);
    assert_eq!(applied["pruned"]["dead_letters"], 1);
    assert_eq!(applied["pruned"]["identities"], 2);
    let s = json(&path, &["stats", "--scope", SCOPE]);
    let s = scope(&s, SCOPE);
    assert_eq!(s["identities_retained"], 1);
    assert_eq!(s["identities_pruned"], 2);
    assert_eq!(s["pending"], 1, "the obligation stays");
    let after = json(&path, &["prune", "--as-of", &as_of]);
    assert_eq!(after["due"][0]["identities_due"], 0);
}

#[test]
fn check_reports_settings_and_export_round_trips_payloads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(populate(&path));
    let c = json(&path, &["check"]);
    assert_eq!(c["ok"], true, "{c}");
    assert_eq!(c["schema_version"], edge_inbox::SCHEMA_VERSION);
    assert_eq!(c["journal_mode"], "wal");
    assert_eq!(c["auto_vacuum"], "incremental");
    assert!(c["page_size"].as_i64().unwrap() >= 512);
    assert!(ok(&path, &["check"]).contains("integrity: ok"));

    let ids = json_lines(&path, &["export", "--table", "identities"]);
    assert_eq!(ids.len(), 4, "three in the scope, one in audit");
    assert!(ids.iter().all(|r| r["table"] == "identity"));
    let q = json_lines(&path, &["export", "--table", "quarantine"]);
    assert_eq!(q[0]["payload"], "0067617262616765", "hex of the payload");

    let out = dir.path().join("messages.cbor");
    let out_s = out.to_str().unwrap();
    ok(
        &path,
        &[
            "export", "--table", "messages", "--format", "cbor", "-o", out_s,
        ],
    );
    let bytes = std::fs::read(&out).unwrap();
    let mut rd = &bytes[..];
    let mut bodies = Vec::new();
    while !rd.is_empty() {
        let v: ciborium::Value = ciborium::from_reader(&mut rd).unwrap();
        let map = v.as_map().unwrap();
        let get = |k: &str| {
            map.iter()
                .find(|(key, _)| key.as_text() == Some(k))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("table").unwrap().as_text(), Some("message"));
        bodies.push(get("payload").unwrap().as_bytes().unwrap().clone());
    }
    assert_eq!(bodies, vec![b"{bad".to_vec(), b"pending body".to_vec()]);
    let conflicts = json_lines(&path, &["export", "--table", "conflicts"]);
    assert_eq!(conflicts.len(), 1);
}

/// The per-scope families of `stats --format prometheus`, their types, and the `stats --json` figure of each.
const SCOPE_FAMILIES: &[(&str, PrometheusType, &str)] = &[
    (
        "edge_inbox_processed_total",
        PrometheusType::Counter,
        "processed",
    ),
    (
        "edge_inbox_duplicates_total",
        PrometheusType::Counter,
        "duplicates",
    ),
    (
        "edge_inbox_conflicts_total",
        PrometheusType::Counter,
        "conflicts",
    ),
    (
        "edge_inbox_conflict_records_total",
        PrometheusType::Counter,
        "conflict_records",
    ),
    (
        "edge_inbox_quarantined_total",
        PrometheusType::Counter,
        "quarantined",
    ),
    (
        "edge_inbox_quarantine_records_total",
        PrometheusType::Counter,
        "quarantine_records",
    ),
    ("edge_inbox_pending", PrometheusType::Gauge, "pending"),
    (
        "edge_inbox_oldest_pending_age_seconds",
        PrometheusType::Gauge,
        "oldest_pending_age_secs",
    ),
    (
        "edge_inbox_dead_letters",
        PrometheusType::Gauge,
        "dead_letters",
    ),
    (
        "edge_inbox_identities_retained",
        PrometheusType::Gauge,
        "identities_retained",
    ),
    (
        "edge_inbox_outbox_pending",
        PrometheusType::Gauge,
        "outbox_pending",
    ),
    (
        "edge_inbox_outbox_parked",
        PrometheusType::Gauge,
        "outbox_parked",
    ),
];

/// One sample of a parsed exposition.
#[derive(Debug, PartialEq)]
struct Sample {
    family: String,
    kind: PrometheusType,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Every sample, after the parser checked the whole text (families declared once, escapes resolved).
fn parse(text: &str) -> Vec<Sample> {
    let exposition = parse_prometheus(text).unwrap_or_else(|e| panic!("{e:?} in\n{text}"));
    let mut out = Vec::new();
    for (name, family) in &exposition.families {
        assert!(!family.help.is_empty(), "{name} has a HELP line");
        for sample in family.iter_samples() {
            let value = match &sample.value {
                PrometheusValue::Counter(c) => c.value.as_f64(),
                PrometheusValue::Gauge(g) => g.as_f64(),
                other => panic!("{name}: {other:?}"),
            };
            let labels = sample
                .get_labelset()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            out.push(Sample {
                family: name.clone(),
                kind: family.family_type.clone(),
                labels,
                value,
            });
        }
    }
    out
}

fn sample<'a>(parsed: &'a [Sample], family: &str, scope: Option<&str>) -> Option<&'a Sample> {
    parsed.iter().find(|s| {
        s.family == family
            && s.labels
                .iter()
                .find(|(k, _)| k == "scope")
                .map(|(_, v)| v.as_str())
                == scope
    })
}

#[test]
fn stats_in_prometheus_format_carry_the_json_figures() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = populate(&path);
    let odd = Delivery::new(ODD_SCOPE, "evt-1", "orders/1", b"x");
    assert!(matches!(
        inbox.process(&odd, bump).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox.process(&odd, bump).unwrap(),
        Outcome::Duplicate
    ));

    // The inbox stays open and idle: its WAL has a size, and nothing changes between the three runs but the
    // clock, which moves the oldest pending age only forward.
    let before = json(&path, &["stats"]);
    let text = ok(&path, &["stats", "--format", "prometheus"]);
    let after = json(&path, &["stats"]);
    assert_eq!(
        json(&path, &["stats", "--format", "json"])["scopes"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    let parsed = parse(&text);
    let db = path.display().to_string();
    let scopes = before["scopes"].as_array().unwrap();
    assert_eq!(scopes.len(), 3);

    for (family, kind, field) in SCOPE_FAMILIES {
        let mut samples = 0;
        for s in scopes {
            let name = s["scope"].as_str().unwrap();
            let found = sample(&parsed, family, Some(name));
            let Some(want) = s[field].as_u64() else {
                assert!(
                    s[field].is_null() && found.is_none(),
                    "{family} {name}: {found:?}"
                );
                continue;
            };
            let Sample {
                kind: got_kind,
                labels,
                value,
                ..
            } = found.unwrap_or_else(|| panic!("{family}{{scope={name:?}}} in\n{text}"));
            samples += 1;
            assert_eq!(got_kind, kind, "{family}");
            assert_eq!(labels.len(), 2, "{labels:?}");
            assert!(
                labels.contains(&("db".to_owned(), db.clone())),
                "{labels:?}"
            );
            if *field == "oldest_pending_age_secs" {
                let later = scope(&after, name)[field].as_u64().unwrap();
                assert!(
                    (want..=later).contains(&(*value as u64)),
                    "{value} not in {want}..={later}"
                );
            } else {
                assert_eq!(*value, want as f64, "{family}{{scope={name:?}}}");
                assert_eq!(scope(&after, name)[field], s[field], "{field} stays put");
            }
        }
        assert_eq!(
            parsed.iter().filter(|s| s.family == *family).count(),
            samples,
            "{family}: one sample per scope that has the figure"
        );
    }
    // The escaped scope name reads back as it was written.
    assert_eq!(
        sample(&parsed, "edge_inbox_duplicates_total", Some(ODD_SCOPE))
            .unwrap()
            .value,
        1.0
    );
    assert_eq!(
        sample(
            &parsed,
            "edge_inbox_oldest_pending_age_seconds",
            Some("audit")
        ),
        None,
        "no pending message, no age"
    );
    for (family, field) in [
        ("edge_inbox_database_bytes", "db_bytes"),
        ("edge_inbox_wal_bytes", "wal_bytes"),
    ] {
        let Sample {
            kind,
            labels,
            value,
            ..
        } = sample(&parsed, family, None).unwrap();
        assert_eq!(*kind, PrometheusType::Gauge);
        assert_eq!(labels, &vec![("db".to_owned(), db.clone())]);
        let want = before["files"][field].as_u64().unwrap();
        assert!(want > 0, "{field}");
        assert_eq!(*value, want as f64, "{family}");
    }
    assert_eq!(
        parsed.len(),
        12 * 3 - 2 + 2 + 2,
        "every sample accounted for"
    );
    assert_eq!(text.matches("# TYPE ").count(), 16, "one family per figure");
    assert_eq!(
        sample(&parsed, "edge_inbox_outbox_parked", Some("audit"))
            .unwrap()
            .value,
        1.0
    );

    // --json and --format disagreeing is a usage error.
    let both = inboxctl(&path, &["--json", "stats", "--format", "prometheus"]);
    assert_eq!(both.status.code(), Some(2));
    drop(inbox);
}

#[test]
fn stats_output_file_is_replaced_whole_and_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    for i in 0..5 {
        let id = format!("evt-{i}");
        inbox
            .process(&Delivery::new(SCOPE, &id, "t", b"x"), bump)
            .unwrap();
    }
    drop(inbox);
    let textfiles = dir.path().join("textfile");
    std::fs::create_dir(&textfiles).unwrap();
    let prom = textfiles.join("edge_inbox.prom");
    std::fs::write(&prom, "stale contents of an earlier run\n").unwrap();
    let prom_s = prom.to_str().unwrap();

    let printed = ok(&path, &["stats", "--format", "prometheus", "-o", prom_s]);
    assert_eq!(printed, "", "the file, not standard output");
    let written = std::fs::read_to_string(&prom).unwrap();
    // No pending message, so no age: the figures are the same in a second run to standard output.
    assert_eq!(written, ok(&path, &["stats", "--format", "prometheus"]));
    assert!(written.ends_with('\n'));
    let parsed = parse(&written);
    assert_eq!(
        sample(&parsed, "edge_inbox_processed_total", Some(SCOPE))
            .unwrap()
            .value,
        5.0
    );
    let names: Vec<_> = std::fs::read_dir(&textfiles)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names,
        vec!["edge_inbox.prom".to_owned()],
        "no temporary file left"
    );

    // The JSON document goes to a file the same way.
    let doc = textfiles.join("stats.json");
    ok(&path, &["--json", "stats", "-o", doc.to_str().unwrap()]);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&doc).unwrap()).unwrap();
    assert_eq!(scope(&v, SCOPE)["processed"], 5);

    // A directory that is not there: exit 1, nothing created.
    let nowhere = dir.path().join("missing").join("edge_inbox.prom");
    let out = inboxctl(
        &path,
        &[
            "stats",
            "--format",
            "prometheus",
            "-o",
            nowhere.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(!dir.path().join("missing").exists());
}

/// Unix seconds of an RFC 3339 time as the CLI prints it, checked to be UTC with a `Z`.
fn unix_of(rfc3339: &str) -> i64 {
    assert!(
        rfc3339.ends_with('Z') && rfc3339.as_bytes()[10] == b'T',
        "{rfc3339}"
    );
    rfc3339
        .parse::<jiff::Timestamp>()
        .unwrap_or_else(|e| panic!("{rfc3339}: {e}"))
        .as_second()
}

#[test]
fn times_are_rfc3339_for_people_and_unix_seconds_beside_them_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    drop(populate(&path));
    let end = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let when = start..=end;

    for (command, line_has) in [
        ("conflicts", "evt-1"),
        ("quarantine", "orders/x"),
        ("dead-letters", "evt-dl"),
    ] {
        let rows = json_lines(&path, &[command]);
        assert_eq!(rows.len(), 1, "{command}");
        let (field, unix_field) = if command == "dead-letters" {
            ("finished_at", "finished_at_unix")
        } else {
            ("at", "at_unix")
        };
        let unix = rows[0][unix_field]
            .as_i64()
            .unwrap_or_else(|| panic!("{unix_field} in {}", rows[0]));
        assert!(when.contains(&unix), "{command}: {unix} in {when:?}");
        let rfc = rows[0][field].as_str().unwrap();
        assert_eq!(unix_of(rfc), unix, "{command}");
        if command != "dead-letters" {
            // A record's last arrival too: RFC 3339, its stored value beside it.
            let last = rows[0]["last_at_unix"]
                .as_i64()
                .unwrap_or_else(|| panic!("last_at_unix in {}", rows[0]));
            assert!(last >= unix && when.contains(&last), "{command}: {last}");
            let last_rfc = rows[0]["last_at"]
                .as_str()
                .unwrap_or_else(|| panic!("last_at as RFC 3339 in {}", rows[0]));
            assert_eq!(unix_of(last_rfc), last, "{command}");
        }
        let human = ok(&path, &[command]);
        assert!(human.contains(line_has), "{human}");
        assert!(human.contains(&format!(" at {rfc}")), "{command}: {human}");
        assert!(
            !human.contains(&unix.to_string()),
            "{command}: no raw Unix time for people: {human}"
        );
    }

    let seq = json_lines(&path, &["dead-letters"])[0]["seq"]
        .as_i64()
        .unwrap()
        .to_string();
    let m = json(&path, &["show", "seq", &seq]);
    for field in ["received_at", "finished_at", "sent_at"] {
        let unix = m[format!("{field}_unix")].as_i64().unwrap();
        assert_eq!(unix_of(m[field].as_str().unwrap()), unix, "{field}");
    }
    assert!(
        m["lease_until"].is_null() && m["lease_until_ms"].is_null(),
        "{m}"
    );
    let human = ok(&path, &["show", "seq", &seq]);
    assert!(
        human.contains(&format!("received {}", m["received_at"].as_str().unwrap())),
        "{human}"
    );

    let id = json(&path, &["show", "id", "--scope", SCOPE, "evt-1"]);
    let day = id["committed_day_unix"].as_i64().unwrap();
    assert_eq!(day % DAY, 0);
    assert!((start - DAY..=end).contains(&day), "{day}");
    let day_rfc = id["committed_day"].as_str().unwrap();
    assert!(day_rfc.ends_with("T00:00:00Z"), "{day_rfc}");
    assert_eq!(unix_of(day_rfc), day);
    assert!(ok(&path, &["show", "id", "--scope", SCOPE, "evt-1"]).contains(day_rfc));

    let prune = json(&path, &["prune", "--as-of", "1700000000"]);
    assert_eq!(prune["as_of_unix"], 1_700_000_000);
    assert_eq!(prune["as_of"], "2023-11-14T22:13:20Z");
    assert!(ok(&path, &["prune", "--as-of", "1700000000"]).contains("as of 2023-11-14T22:13:20Z"));
}

#[test]
fn prune_deletes_old_quarantine_and_conflict_records_by_the_stored_policy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = populate(&path);
    inbox
        .set_retention(
            SCOPE,
            &RetentionPolicy::new().quarantine_and_conflicts(Duration::from_secs(DAY as u64)),
        )
        .unwrap();
    drop(inbox);
    days_pass(&path, 2);
    let as_of = unix_now().to_string();
    let before = scope(&json(&path, &["stats", "--scope", SCOPE]), SCOPE).clone();
    let dry = json(&path, &["prune", "--as-of", &as_of]);
    let due = &dry["due"].as_array().unwrap()[0];
    assert_eq!(
        (
            due["quarantine_due"].as_u64(),
            due["conflicts_due"].as_u64()
        ),
        (Some(1), Some(1))
    );
    assert_eq!(
        json_lines(&path, &["quarantine", "--scope", SCOPE]).len(),
        1,
        "a dry run deletes nothing"
    );
    let applied = json(&path, &["prune", "--apply", "--as-of", &as_of]);
    assert_eq!(applied["pruned"]["quarantine_records"], 1);
    assert_eq!(applied["pruned"]["conflict_records"], 1);
    assert!(json_lines(&path, &["quarantine", "--scope", SCOPE]).is_empty());
    assert!(json_lines(&path, &["conflicts", "--scope", SCOPE]).is_empty());
    let after = scope(&json(&path, &["stats", "--scope", SCOPE]), SCOPE).clone();
    for field in [
        "identities_retained",
        "messages_stored",
        "pending",
        "dead_letters",
        "quarantined",
        "conflicts",
    ] {
        assert_eq!(after[field], before[field], "{field}: only the records go");
    }
}

/// Permission bits of `path` (the file itself, not a symlink's target).
fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

#[test]
fn export_output_file_is_private_replaced_whole_and_never_written_through_a_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(populate(&path));
    let exports = dir.path().join("exports");
    std::fs::create_dir(&exports).unwrap();
    let export_to = |out: &Path| {
        ok(
            &path,
            &["export", "--table", "messages", "-o", out.to_str().unwrap()],
        );
    };
    let rows = ok(&path, &["export", "--table", "messages"]);
    assert_eq!(rows.lines().count(), 2, "{rows}");

    // A new file: owner-only, whatever the umask lets through (payloads are as private as the database).
    let fresh = exports.join("messages.jsonl");
    export_to(&fresh);
    assert_eq!(std::fs::read_to_string(&fresh).unwrap(), rows);
    assert_eq!(mode_of(&fresh), 0o600, "a new export file");

    // An existing, longer, world-readable file: replaced whole, and private from then on.
    let old = exports.join("old.jsonl");
    std::fs::write(&old, "x".repeat(10_000)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
    export_to(&old);
    assert_eq!(std::fs::read_to_string(&old).unwrap(), rows);
    assert_eq!(mode_of(&old), 0o600, "a replaced export file");

    // A symlink planted where the export goes: its target is neither written nor truncated; the link is
    // replaced by the export file.
    let target = dir.path().join("precious");
    std::fs::write(&target, "do not touch\n").unwrap();
    let link = exports.join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    export_to(&link);
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "do not touch\n");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_file());
    assert_eq!(std::fs::read_to_string(&link).unwrap(), rows);
    assert_eq!(mode_of(&link), 0o600);

    // A failed export (no such table in a file that is no inbox) leaves the old file as it was.
    let not_inbox = dir.path().join("not-an-inbox.db");
    std::fs::write(&not_inbox, "").unwrap();
    let out = inboxctl(
        &not_inbox,
        &["export", "--table", "messages", "-o", old.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read_to_string(&old).unwrap(), rows);

    let mut names: Vec<_> = std::fs::read_dir(&exports)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["link.jsonl", "messages.jsonl", "old.jsonl"],
        "no temporary file left"
    );
}

/// A sysfs tree with an eMMC partition for the device `path` lives on, as Linux lays it out.
fn fake_sysfs(root: &Path, path: &Path) {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).unwrap().dev();
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    let disk = root.join("devices/platform/mmc1/mmc_host/mmc1/mmc1:0001/block/mmcblk1");
    let part = disk.join("mmcblk1p1");
    std::fs::create_dir_all(&part).unwrap();
    std::fs::write(part.join("partition"), "1\n").unwrap();
    std::fs::create_dir_all(disk.join("device")).unwrap();
    std::fs::write(disk.join("device/life_time"), "0x01 0x03\n").unwrap();
    std::fs::write(disk.join("device/pre_eol_info"), "0x01\n").unwrap();
    std::fs::create_dir_all(root.join("dev/block")).unwrap();
    std::os::unix::fs::symlink(&part, root.join(format!("dev/block/{major}:{minor}"))).unwrap();
}

fn stats_with_sysfs(db: &Path, sysfs: &Path, args: &[&str]) -> String {
    let exe = env!("CARGO_BIN_EXE_inboxctl");
    let out = common::through_runner(Path::new(exe))
        .env_remove("EDGE_INBOX_DB")
        .env("EDGE_INBOX_SYSFS", sysfs)
        .arg("--db")
        .arg(db)
        .args(args)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn stats_show_the_bytes_written_and_the_devices_wear() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // Checkpoints in the commits: with the inbox's checkpoint thread, one still running when the figures are
    // read here would add to them before the inbox closes.
    let config = Config::default()
        .wal_autocheckpoint(10)
        .checkpoint_thread(false);
    let mut inbox = Inbox::open(&path, config).unwrap();
    for i in 0..40 {
        let id = format!("evt-{i}");
        let d = Delivery::new(SCOPE, &id, "orders/1", b"{}");
        assert!(matches!(
            inbox.process(&d, bump).unwrap(),
            Outcome::Processed
        ));
    }
    let w = inbox.bytes_written().unwrap();
    assert!(w.wal_bytes > 0 && w.checkpoint_bytes > 0, "{w:?}");
    drop(inbox);

    let doc = json(&path, &["stats"]);
    assert_eq!(
        doc["bytes_written"]["wal_bytes"].as_u64(),
        Some(w.wal_bytes)
    );
    assert_eq!(
        doc["bytes_written"]["checkpoint_bytes"].as_u64(),
        Some(w.checkpoint_bytes)
    );
    let text = ok(&path, &["stats"]);
    let line = format!(
        "written over the file's life: WAL {} bytes, checkpoints {} bytes, total {} bytes",
        w.wal_bytes,
        w.checkpoint_bytes,
        w.total()
    );
    assert!(text.contains(&line), "{text}");
    let prom = parse(&ok(&path, &["stats", "--format", "prometheus"]));
    for (family, want) in [
        ("edge_inbox_wal_written_bytes_total", w.wal_bytes),
        (
            "edge_inbox_checkpoint_written_bytes_total",
            w.checkpoint_bytes,
        ),
    ] {
        let s = sample(&prom, family, None).unwrap_or_else(|| panic!("{family}"));
        assert_eq!(s.kind, PrometheusType::Counter);
        assert_eq!(s.value, want as f64, "{family}");
    }

    // This machine's disk reports no eMMC wear (the test runs where it does not): nothing is shown.
    if edge_inbox::inspect::device_wear(&path).is_none() {
        assert!(doc.get("device").is_none(), "{doc}");
        assert!(!text.contains("device "), "{text}");
        assert!(!prom
            .iter()
            .any(|s| s.family.starts_with("edge_inbox_device_")));
    }

    // An eMMC device, staged in a sysfs tree of its own.
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path(), &path);
    let doc: serde_json::Value =
        serde_json::from_str(&stats_with_sysfs(&path, sys.path(), &["--json", "stats"])).unwrap();
    assert_eq!(
        doc["device"],
        serde_json::json!({"device": "mmcblk1", "life_time_a": 1, "life_time_b": 3, "pre_eol_info": 1})
    );
    let text = stats_with_sysfs(&path, sys.path(), &["stats"]);
    assert!(
        text.contains(
            "device mmcblk1: life time used 0-10% (type A), 20-30% (type B), pre-EOL normal"
        ),
        "{text}"
    );
    let prom = parse(&stats_with_sysfs(
        &path,
        sys.path(),
        &["stats", "--format", "prometheus"],
    ));
    let life: Vec<_> = prom
        .iter()
        .filter(|s| s.family == "edge_inbox_device_life_time_estimate")
        .map(|s| {
            let t = s
                .labels
                .iter()
                .find(|(k, _)| k == "type")
                .unwrap()
                .1
                .clone();
            assert!(s
                .labels
                .contains(&("device".to_owned(), "mmcblk1".to_owned())));
            (t, s.value)
        })
        .collect();
    assert_eq!(life, vec![("a".to_owned(), 1.0), ("b".to_owned(), 3.0)]);
    let eol = prom
        .iter()
        .find(|s| s.family == "edge_inbox_device_pre_eol_info")
        .unwrap();
    assert_eq!(eol.value, 1.0);
}
