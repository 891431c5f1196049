//! `inboxctl` against a real inbox file: every subcommand's output agrees with what the library committed,
//! writes happen only where asked, and exit codes are 0 / 1 (operational) / 2 (usage).

mod cli_support;
mod common;

use std::path::Path;
use std::time::Duration;

use cli_support::{inboxctl, json, json_lines, ok};
use edge_inbox::{Config, Delivery, Fingerprint, Inbox, Outcome, RetentionPolicy, Tx};

const SCOPE: &str = "inventory-reservation";
const DAY: i64 = 86_400;

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1)).map_err(anyhow::Error::from)
}

/// A processed id with a duplicate and a conflict, a quarantined delivery, a dead letter, a pending message,
/// and a second scope.
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
    assert!(matches!(
        inbox.process(&o, bump).unwrap(),
        Outcome::Processed
    ));
    inbox
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
    let missing = json(&path, &["show", "id", "--scope", SCOPE, "never-sent"]);
    assert_eq!(missing["status"], "not-found");
    // Producer namespaces are part of the identity.
    let without = json(&path, &["show", "id", "--scope", SCOPE, "evt-dl"]);
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

    let missing = dir.path().join("typo.db");
    for args in [
        &["stats"][..],
        &["requeue", "--scope", SCOPE],
        &["prune", "--apply"],
    ] {
        let out = inboxctl(&missing, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.is_empty());
        // One line, each cause said once.
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        let links: Vec<&str> = err.trim_end().split(": ").collect();
        assert!(links.windows(2).all(|w| w[0] != w[1]), "{err}");
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
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let later = (now + 3 * DAY).to_string();

    let before = json(&path, &["stats"]);
    let dry = json(&path, &["prune", "--as-of", &later]);
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

    let applied = json(&path, &["prune", "--apply", "--as-of", &later]);
    assert_eq!(applied["pruned"]["dead_letters"], 1);
    assert_eq!(applied["pruned"]["identities"], 2);
    let s = json(&path, &["stats", "--scope", SCOPE]);
    let s = scope(&s, SCOPE);
    assert_eq!(s["identities_retained"], 1);
    assert_eq!(s["identities_pruned"], 2);
    assert_eq!(s["pending"], 1, "the obligation stays");
    let after = json(&path, &["prune", "--as-of", &later]);
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
