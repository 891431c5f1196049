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
