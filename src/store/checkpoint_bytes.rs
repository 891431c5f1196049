//! What a checkpoint wrote into the database file, counted from the checkpointing thread's I/O counters
//! (`/proc/thread-self/io`, read before and after: two reads per checkpoint, none per commit).
//!
//! SQLite reports only the WAL frames a checkpoint copied back, and a page changed by many commits is in many
//! frames but written once (frames overstated the database file's writes 60 times over on a small file). The
//! checkpoint writes each page it copies once, in one write call, so `wchar` (the bytes the thread passed to
//! write calls) across it is those pages. The kernel's `write_bytes` is not: it counts page-cache memory as it
//! turns dirty, a whole folio at a time, and recent kernels (ext4 here) cache a file written in large writes
//! (a copy, a restore) in folios of up to megabytes, one read in sequence in smaller ones. There one 4 KiB page
//! written counted as its whole folio: 96 times the pages of the frames written in `tests/wear.rs`. It serves
//! only for pages smaller than a 4 KiB block, which the device writes whole, and only between its bounds: at
//! least the pages written, at most one block for each.
//!
//! A VFS that writes the database file through a memory map (`SQLITE_MMAP_READWRITE` in a system SQLite), or
//! from another thread, makes no write call here: the count is then 0.

/// The unit the page cache and the file system write a file's data in.
const BLOCK: u64 = 4096;

/// The calling thread's cumulative I/O counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ThreadIo {
    /// Bytes passed to write calls.
    wchar: u64,
    /// Bytes of page cache turned dirty.
    write_bytes: u64,
}

impl ThreadIo {
    /// The counters now; `None` where the kernel does not report them.
    pub(crate) fn now() -> Option<ThreadIo> {
        let text = std::fs::read_to_string("/proc/thread-self/io").ok()?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
        };
        Some(ThreadIo {
            wchar: field("wchar:")?,
            write_bytes: field("write_bytes:")?,
        })
    }
}

/// Bytes the checkpoint run on this thread since `before` wrote into the database file, whose pages are
/// `page_size` bytes; without the counters, the `frames` it copied back times the page size (an upper bound).
pub(crate) fn bytes_copied(before: Option<ThreadIo>, frames: i64, page_size: u64) -> u64 {
    match (before, ThreadIo::now()) {
        (Some(before), Some(after)) => between(before, after, page_size),
        _ => frames.max(0) as u64 * page_size,
    }
}

fn between(before: ThreadIo, after: ThreadIo, page_size: u64) -> u64 {
    let page_size = page_size.max(1);
    // Whole pages: another write of the thread (a log line, the shared-memory file grown by a byte) is not one.
    let pages = after.wchar.saturating_sub(before.wchar) / page_size;
    let written = pages * page_size;
    if page_size >= BLOCK {
        return written;
    }
    after
        .write_bytes
        .saturating_sub(before.write_bytes)
        .clamp(written, pages * BLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(wchar: u64, write_bytes: u64) -> ThreadIo {
        ThreadIo { wchar, write_bytes }
    }

    #[test]
    fn pages_of_a_block_or_more_are_the_bytes_written_whatever_the_page_cache_counted() {
        let before = io(1_000, 8_192);
        // Three 4 KiB pages written into a file cached in 2 MiB folios.
        assert_eq!(
            between(before, io(1_000 + 3 * 4096, 8_192 + 3 * (2 << 20)), 4096),
            3 * 4096
        );
        // Two 8 KiB pages, into pages the thread had already dirtied.
        assert_eq!(between(before, io(1_000 + 16_384, 8_192), 8192), 16_384);
        // A log line beside them.
        assert_eq!(
            between(before, io(1_000 + 2 * 4096 + 120, 8_192), 4096),
            2 * 4096
        );
    }

    #[test]
    fn smaller_pages_count_the_blocks_the_kernel_dirtied_within_what_they_can_touch() {
        let before = io(0, 0);
        // Four 1 KiB pages in two blocks.
        assert_eq!(between(before, io(4 * 1024, 2 * 4096), 1024), 2 * 4096);
        // A large folio: at most one block per page.
        assert_eq!(between(before, io(4 * 1024, 2 << 20), 1024), 4 * 4096);
        // Folios dirty already: at least the pages.
        assert_eq!(between(before, io(4 * 1024, 0), 1024), 4 * 1024);
    }

    #[test]
    fn without_the_counters_the_frames_stand_in() {
        assert_eq!(bytes_copied(None, 5, 4096), 5 * 4096);
        assert_eq!(bytes_copied(None, -1, 4096), 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_counters_are_read_on_linux() {
        let dir = tempfile::tempdir().unwrap();
        let before = ThreadIo::now().expect("/proc/thread-self/io");
        std::fs::write(dir.path().join("f"), [1u8; 3 * 4096]).unwrap();
        let after = ThreadIo::now().unwrap();
        assert!(
            after.wchar >= before.wchar + 3 * 4096,
            "{before:?} {after:?}"
        );
    }
}
