//! The library as a new user meets it: errors that read well under `anyhow`, state read outside a handler,
//! deliveries built with named fields.

use edge_inbox::{Config, Delivery, Error, Inbox};

/// `text` names `cause` exactly once.
fn once(text: &str, cause: &str) {
    assert_eq!(text.matches(cause).count(), 1, "{cause:?} in {text:?}");
}

#[test]
fn every_cause_of_an_error_is_printed_once_through_anyhow() {
    let dir = tempfile::tempdir().unwrap();
    let print = |e: Error| {
        let e = anyhow::Error::from(e).context("starting the gateway");
        (format!("{e:#}"), format!("{e:?}"))
    };

    // Error::Open: the operating system's reason.
    let err = Inbox::open(dir.path().join("missing/inbox.db"), Config::default()).unwrap_err();
    assert!(matches!(err, Error::Open { .. }), "{err:?}");
    // ENOENT, as the operating system words it.
    let os_reason = std::io::Error::from_raw_os_error(2).to_string();
    let (alt, debug) = print(err);
    once(&alt, "missing/inbox.db");
    once(&alt, &os_reason);
    once(&debug, &os_reason);

    // Error::Open from SQLite (a directory where the file should be).
    std::fs::create_dir(dir.path().join("a-dir.db")).unwrap();
    let err = Inbox::open(dir.path().join("a-dir.db"), Config::default()).unwrap_err();
    let (alt, debug) = print(err);
    once(&alt, "a-dir.db");
    once(&debug, "a-dir.db");

    // Error::Storage: SQLite's message.
    let conn = edge_inbox::rusqlite::Connection::open_in_memory().unwrap();
    let err = Error::from(conn.execute("DELETE FROM nowhere", []).unwrap_err());
    assert!(matches!(err, Error::Storage { .. }), "{err:?}");
    let (alt, debug) = print(err);
    once(&alt, "no such table: nowhere");
    once(&debug, "no such table: nowhere");

    // Error::InvalidDelivery: the reason.
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let err = inbox
        .process(&Delivery::new("", "evt-1", "t", b"x"), |_tx, _d| Ok(()))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidDelivery(_)), "{err:?}");
    let (alt, debug) = print(err);
    once(&alt, "consumer scope is empty");
    once(&debug, "consumer scope is empty");
}

#[test]
fn state_written_by_handlers_is_read_outside_them_in_the_same_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Sku {
        reserved: i64,
        name: String,
    }
    let reserve = |tx: &mut edge_inbox::Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        let key = format!("reserved/{}", d.topic);
        let n: i64 = tx.get(&key)?.unwrap_or(0);
        tx.put(&key, &(n + 1))?;
        tx.put_in(
            "catalogue",
            d.topic,
            &Sku {
                reserved: n + 1,
                name: format!("item {}", d.topic),
            },
        )?;
        Ok(())
    };
    for (id, sku) in [("e1", "A-1"), ("e2", "A-1"), ("e3", "B-7"), ("e1", "A-1")] {
        inbox
            .process(&Delivery::new("inventory", id, sku, b"{}"), reserve)
            .unwrap();
    }
    inbox
        .process(&Delivery::new("other-scope", "e9", "A-1", b"{}"), reserve)
        .unwrap();

    // The scope's own namespace (Tx::get/put), and one of the handler's choosing (Tx::get_in/put_in).
    assert_eq!(
        inbox.get::<i64>("inventory", "reserved/A-1").unwrap(),
        Some(2)
    );
    assert_eq!(
        inbox.get::<i64>("other-scope", "reserved/A-1").unwrap(),
        Some(1)
    );
    assert_eq!(inbox.get::<i64>("inventory", "reserved/Z-0").unwrap(), None);
    assert_eq!(inbox.get::<i64>("nobody", "reserved/A-1").unwrap(), None);
    assert_eq!(
        inbox.get::<Sku>("catalogue", "B-7").unwrap(),
        Some(Sku {
            reserved: 1,
            name: "item B-7".into()
        })
    );
    // A value of another type: a codec error naming the key, not a panic or a wrong value.
    let err = inbox
        .get::<String>("inventory", "reserved/A-1")
        .unwrap_err();
    assert!(matches!(err, Error::Codec(_)), "{err:?}");
    assert!(err.to_string().contains("inventory/reserved/A-1"), "{err}");

    // A prefix, in key order; `%` and `_` are plain characters in it.
    assert_eq!(
        inbox.entries::<i64>("inventory", "reserved/").unwrap(),
        vec![
            ("reserved/A-1".to_owned(), 2),
            ("reserved/B-7".to_owned(), 1)
        ]
    );
    assert_eq!(
        inbox
            .entries::<i64>("inventory", "reserved/B")
            .unwrap()
            .len(),
        1
    );
    assert!(inbox
        .entries::<i64>("inventory", "reserved_")
        .unwrap()
        .is_empty());
    assert!(inbox.entries::<i64>("inventory", "%").unwrap().is_empty());
    assert_eq!(inbox.entries::<Sku>("catalogue", "").unwrap().len(), 2);
}

#[test]
fn a_delivery_built_by_named_fields_is_the_one_new_builds_and_one_without_an_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let payload = br#"{"sku":"A-1"}"#;
    let named = Delivery::in_scope("inventory")
        .with_message_id("evt-1")
        .with_topic("orders/1")
        .with_payload(payload)
        .with_producer("shop-1")
        .with_sequence(7)
        .with_sent_at(1_700_000_000);
    let positional = Delivery::new("inventory", "evt-1", "orders/1", payload)
        .with_producer("shop-1")
        .with_sequence(7)
        .with_sent_at(1_700_000_000);
    assert_eq!(named, positional);
    assert_eq!(named.fingerprint(), positional.fingerprint());
    let count = |tx: &mut edge_inbox::Tx<'_>, _d: &Delivery<'_>| -> anyhow::Result<()> {
        let n: i64 = tx.get("n")?.unwrap_or(0);
        Ok(tx.put("n", &(n + 1))?)
    };
    assert!(matches!(
        inbox.process(&named, count).unwrap(),
        edge_inbox::Outcome::Processed
    ));
    assert!(matches!(
        inbox.process(&positional, count).unwrap(),
        edge_inbox::Outcome::Duplicate
    ));

    // The message id forgotten: refused before anything is written.
    let no_id = Delivery::in_scope("inventory")
        .with_topic("orders/2")
        .with_payload(payload);
    let err = inbox.process(&no_id, count).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidDelivery(edge_inbox::InvalidDelivery::EmptyMessageId)
        ),
        "{err:?}"
    );
    assert_eq!(inbox.get::<i64>("inventory", "n").unwrap(), Some(1));
}

/// The packages `cargo tree` lists for this crate's library build (no dev-dependencies) with `args`.
fn library_dependencies(args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "--edges",
            "normal,build",
            "--prefix",
            "none",
        ])
        .args([
            "--manifest-path",
            concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        ])
        .args(args)
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_dependent_crate_gets_none_of_the_cli_dependencies_by_default() {
    let cli_only = ["clap", "indicatif", "jiff", "env_logger"];
    let default = library_dependencies(&[]);
    assert!(default.iter().any(|d| d == "rusqlite"), "{default:?}");
    for dep in cli_only {
        assert!(
            !default.iter().any(|d| d == dep),
            "{dep} by default: {default:?}"
        );
    }
    let with_cli = library_dependencies(&["--features", "cli"]);
    for dep in cli_only {
        assert!(
            with_cli.iter().any(|d| d == dep),
            "{dep} with cli: {with_cli:?}"
        );
    }
}
