//! "COMMIT returns an uncertain error": injected with a VFS that wraps the platform's and fails the fsync of
//! the WAL on demand. The outcome must be `CommitUnknown` (never a duplicate, never acked), and the
//! redelivery plus the identity lookup settle it, with exactly one effect.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};

use edge_inbox::rusqlite::ffi;

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;
use edge_inbox::{Config, Delivery, Error, Inbox, Outcome, Status, Tx};

const SCOPE: &str = "inventory-reservation";
const VFS: &str = "edge-inbox-fault";

static FAIL_WAL_SYNC: AtomicBool = AtomicBool::new(false);

/// Fails the WAL's sync while [`FAIL_WAL_SYNC`] is set.
struct Fault;

impl wrap_vfs::Observer for Fault {
    fn open(&self, _name: Option<&str>, flags: c_int) -> Option<usize> {
        (flags & ffi::SQLITE_OPEN_WAL != 0).then_some(0)
    }

    fn sync(&self, _tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        if FAIL_WAL_SYNC.load(Ordering::SeqCst) {
            return ffi::SQLITE_IOERR_FSYNC;
        }
        real()
    }
}

fn register_fault_vfs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| wrap_vfs::register(VFS, Arc::new(Fault), false));
}

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

fn effects(inbox: &Inbox, id: &str) -> i64 {
    let blob: Option<Vec<u8>> = inbox
        .connection()
        .query_row("SELECT value FROM kv WHERE key = ?1", [id], |r| r.get(0))
        .ok();
    blob.map(|b| ciborium::from_reader(&b[..]).unwrap())
        .unwrap_or(0)
}

/// One test function: the fault switch is process-wide.
#[test]
fn commit_with_unknown_outcome_is_never_a_duplicate_and_settles_on_redelivery() {
    register_fault_vfs();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let config = Config::default().vfs(VFS);
    let mut inbox = Inbox::open(&path, config.clone()).unwrap();
    let warm = Delivery::new(SCOPE, "evt-1", "orders/1", b"x");
    assert!(matches!(
        inbox.process(&warm, bump).unwrap(),
        Outcome::Processed
    ));

    // Same connection: COMMIT fails, then the redelivery settles it.
    let d = Delivery::new(SCOPE, "evt-2", "orders/2", b"x");
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let err = inbox.process(&d, bump).unwrap_err();
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    match &err {
        Error::CommitUnknown { code, .. } => assert_eq!(*code, ffi::SQLITE_IOERR_FSYNC),
        other => panic!("expected CommitUnknown, got {other:?}"),
    }
    assert!(err.is_retryable());
    let redelivered = inbox.process(&d, bump).unwrap();
    assert!(
        matches!(redelivered, Outcome::Processed | Outcome::Duplicate),
        "{redelivered:?}"
    );
    assert_eq!(
        effects(&inbox, "evt-2"),
        1,
        "exactly one effect after the redelivery"
    );
    assert!(matches!(
        inbox.status(SCOPE, None, "evt-2").unwrap(),
        Status::Recorded { .. }
    ));

    // A batch whose COMMIT fails reports no outcome at all; then the process dies and restarts (WAL recovery
    // may or may not bring the frames back), and the broker redelivers the batch.
    let ids: Vec<String> = (0..8).map(|i| format!("batch-{i}")).collect();
    let batch: Vec<_> = ids
        .iter()
        .map(|id| Delivery::new(SCOPE, id, "orders/b", b"x"))
        .collect();
    let mut outcomes = Vec::new();
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let err = inbox
        .process_batch_into(&batch, &mut bump, &mut outcomes)
        .unwrap_err();
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    assert!(matches!(err, Error::CommitUnknown { .. }), "{err:?}");
    assert!(outcomes.is_empty(), "nothing reported as done");
    drop(inbox);

    let mut inbox = Inbox::open(&path, config).unwrap();
    let status = inbox.status(SCOPE, None, "batch-0").unwrap();
    let outcomes = inbox.process_batch(&batch, bump).unwrap();
    let expected = if status == Status::NotFound {
        "processed"
    } else {
        "duplicate"
    };
    assert!(
        outcomes.iter().all(|o| o.name() == expected),
        "lookup and redelivery agree: {outcomes:?}"
    );
    for id in &ids {
        assert_eq!(effects(&inbox, id), 1, "{id}: exactly one effect");
    }
    assert_eq!(effects(&inbox, "evt-2"), 1);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(stats.processed, 10);
}
