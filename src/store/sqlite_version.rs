//! Whether the linked SQLite has the fix for the WAL-reset race (<https://sqlite.org/wal.html#walresetbug>).
//!
//! SQLite 3.7.0 through 3.51.2 can corrupt a database or lose committed transactions when one connection
//! starts the WAL over (its first commit after a complete checkpoint) while another begins a checkpoint: a
//! later checkpoint then skips frames it believes copied. Fixed in 3.51.3, and in the 3.50.7 and 3.44.6
//! patch releases. An inbox is that pattern: its checkpoint thread, its pruners and its consumers are
//! connections checkpointing and writing one file. The `bundled` feature compiles a fixed SQLite; a system
//! library is checked at the process's first open of a file for writing (a read-only connection neither
//! checkpoints nor writes), and an affected one is logged: a distribution may have patched it without
//! changing its version, so it is not refused.

use std::sync::Once;

/// `sqlite3_libversion_number()` of the lowest fixed release of the main line (3.51.3).
const FIXED: i32 = 3_051_003;

/// Whether SQLite `version` (as `sqlite3_libversion_number()`, `X*1000000 + Y*1000 + Z`) has the fix.
pub(crate) fn has_wal_reset_fix(version: i32) -> bool {
    // Outside the range: before WAL existed (3.7.0), or fixed. 3.50.x is series 3050, x its patch.
    let (series, patch) = (version / 1000, version % 1000);
    !(3_007_000..FIXED).contains(&version)
        || (series == 3_050 && patch >= 7)
        || (series == 3_044 && patch >= 6)
}

/// Logs, once per process, a warning when the linked SQLite lacks the fix.
pub(crate) fn warn_if_affected() {
    static CHECKED: Once = Once::new();
    CHECKED.call_once(|| {
        if !has_wal_reset_fix(rusqlite::version_number()) {
            log::warn!(
                "SQLite {} lacks the fix for the WAL-reset race (fixed in 3.51.3, 3.50.7 and 3.44.6; \
                 https://sqlite.org/wal.html#walresetbug): a checkpoint beside a commit that starts the WAL \
                 over may later corrupt the database or lose committed transactions. Build with the \
                 `bundled` feature or link a fixed library",
                rusqlite::version()
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_with_and_without_the_fix() {
        for fixed in [
            3_006_023, 3_051_003, 3_051_010, 3_052_000, 3_053_002, 4_000_000, 3_050_007, 3_050_010,
            3_044_006, 3_044_010,
        ] {
            assert!(has_wal_reset_fix(fixed), "{fixed} has the fix");
        }
        for affected in [
            3_007_000, 3_040_001, 3_044_005, 3_045_000, 3_050_002, 3_050_006, 3_051_000, 3_051_002,
        ] {
            assert!(!has_wal_reset_fix(affected), "{affected} lacks the fix");
        }
    }

    /// The library this crate compiles with `bundled` must be a fixed one.
    #[cfg(feature = "bundled")]
    #[test]
    fn the_bundled_sqlite_has_the_fix() {
        assert!(
            has_wal_reset_fix(rusqlite::version_number()),
            "bundled SQLite {} lacks the WAL-reset fix",
            rusqlite::version()
        );
    }
}
