//! Where output goes: files replaced atomically, and progress on a terminal.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, IsTerminal, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

/// Mode of a file only its owner may read: exported rows hold payloads, which the database keeps 0600 too.
pub const PRIVATE: u32 = 0o600;

/// Mode of a file other local users may read (before the umask): the statistics, for node_exporter's
/// textfile collector, which runs as a user of its own. They hold counts and the database's path only.
pub const SHARED: u32 = 0o644;

/// Replaces `path` with what `write` writes, so that a reader sees the old file or the whole new one, never a
/// part, and `path` is never opened itself: a temporary file in the same directory (same file system, so
/// the rename is atomic) is created new with `mode` (never through a symlink: `O_EXCL`), written, synced
/// and renamed over `path`, then the directory is synced so the rename survives a power cut. A symlink at
/// `path` is replaced, its target left untouched; on any error the old file stays as it was and the
/// temporary file is removed. The temporary name does not end in `.prom`, so node_exporter's textfile
/// collector never reads it.
pub fn replace_atomically<T>(
    path: &Path,
    mode: u32,
    write: impl FnOnce(&mut dyn Write) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp_name = OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = dir.join(tmp_name);
    // Left by an earlier run that died with the same process id: no live process can own it.
    let _ = std::fs::remove_file(&tmp);
    let written = (|| -> anyhow::Result<T> {
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
        let f = options
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        let mut out = BufWriter::new(f);
        let value = write(&mut out)?;
        out.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        Ok(value)
    })();
    let value = match written {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))?;
    Ok(value)
}

/// The files of a database (suffix, what it is): renaming over one of them breaks the live database.
const DATABASE_FILES: [(&str, &str); 4] = [
    ("", "the database"),
    ("-wal", "the database's WAL"),
    ("-shm", "the database's shared-memory index"),
    ("-journal", "the database's rollback journal"),
];

/// Refuses `out` as an output path when it is the database at `db` or one of its `-wal`, `-shm` and
/// `-journal` files: [`replace_atomically`] would rename a report over the live database (or its log).
/// Paths are compared canonicalized (another spelling, a symlinked directory, a symlink at `out` that leads
/// to one of them), and, for an `out` that exists, by device and inode too (a hard link, a bind mount).
pub fn refuse_database_files(db: &Path, out: &Path) -> anyhow::Result<()> {
    let db = std::fs::canonicalize(db).with_context(|| format!("resolving {}", db.display()))?;
    // The directory entry that would be replaced, and the file a symlink there leads to.
    let mut paths = Vec::new();
    if let (Some(name), Some(dir)) = (out.file_name(), out.parent()) {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(dir) = std::fs::canonicalize(dir) {
            paths.push(dir.join(name));
        }
    }
    paths.extend(std::fs::canonicalize(out).ok());
    let ids: Vec<(u64, u64)> = [std::fs::symlink_metadata(out), std::fs::metadata(out)]
        .into_iter()
        .filter_map(|m| m.ok().and_then(|m| file_id(&m)))
        .collect();
    for (suffix, what) in DATABASE_FILES {
        let mut file = db.as_os_str().to_owned();
        file.push(suffix);
        let file = PathBuf::from(file);
        let id = std::fs::metadata(&file).ok().and_then(|m| file_id(&m));
        if paths.contains(&file) || id.is_some_and(|id| ids.contains(&id)) {
            anyhow::bail!(
                "refusing to write to {}: that is {what} ({}), which the output would replace",
                out.display(),
                file.display()
            );
        }
    }
    Ok(())
}

/// Device and inode of a file.
#[cfg(unix)]
fn file_id(m: &std::fs::Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn file_id(_: &std::fs::Metadata) -> Option<(u64, u64)> {
    None
}

/// True when `f` is a regular file (standard output redirected to one), which takes writes as fast as a
/// temporary file would.
#[cfg(unix)]
pub fn is_regular_file(f: &impl std::os::fd::AsFd) -> bool {
    f.as_fd()
        .try_clone_to_owned()
        .map(File::from)
        .and_then(|f| f.metadata())
        .is_ok_and(|m| m.is_file())
}

#[cfg(not(unix))]
pub fn is_regular_file<T>(_: &T) -> bool {
    false
}

/// Runs `write` against a private temporary file, then copies that file to `sink`: `write` never waits
/// for whoever reads `sink` (a pipe into a pager that stopped reading). The file is created 0600 in the
/// temporary directory (`TMPDIR`) and is gone afterwards, after an error too; on Unix it has no name from
/// the start, so not even a killed process leaves it behind.
pub fn spooled<T>(
    sink: &mut dyn Write,
    write: impl FnOnce(&mut dyn Write) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut spool = Spool::create()?;
    let value = {
        let mut out = BufWriter::new(&mut spool.file);
        let value = write(&mut out)?;
        out.flush().context("writing a temporary file")?;
        value
    };
    spool.file.seek(SeekFrom::Start(0))?;
    std::io::copy(&mut spool.file, sink)?;
    sink.flush()?;
    Ok(value)
}

/// A temporary file, removed when dropped if it still has a name.
struct Spool {
    file: File,
    path: Option<PathBuf>,
}

impl Spool {
    fn create() -> anyhow::Result<Spool> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!(".inboxctl-{}-{nanos:09}.tmp", std::process::id()));
        let mut options = OpenOptions::new();
        options.read(true).write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, PRIVATE);
        let file = options
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        // Where the system allows it, the open file outlives its name: nothing to remove later.
        let path = std::fs::remove_file(&path).err().map(|_| path);
        Ok(Spool { file, path })
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A progress bar (or, without a total, a counter) on stderr, drawn only when stderr is a terminal: never
/// in pipes, logs or a cron job's mail.
pub fn progress(label: &'static str, total: Option<u64>) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let (bar, template) = match total {
        Some(t) => (ProgressBar::new(t), "{msg}: {wide_bar} {pos}/{len} ({eta})"),
        None => (ProgressBar::new_spinner(), "{spinner} {msg}: {pos}"),
    };
    bar.set_style(ProgressStyle::with_template(template).expect("a valid template"));
    bar.set_message(label);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temporary_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("inbox.prom");
        std::fs::write(&path, "old").unwrap();
        replace_atomically(&path, SHARED, |w| Ok(w.write_all(b"new contents\n")?)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new contents\n");
        let names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("inbox.prom")]);
        // A directory that is not there: an error, and nothing left behind.
        let err = replace_atomically(&dir.join("missing/inbox.prom"), SHARED, |w| {
            Ok(w.write_all(b"x")?)
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("missing"), "{err:#}");
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1);
    }

    #[test]
    fn spooled_output_reaches_the_sink_only_after_the_writer_returns() {
        let mut sink = Vec::new();
        let n = spooled(&mut sink, |w| {
            w.write_all(b"first\n")?;
            w.write_all(&[b'x'; 100_000])?;
            Ok(7)
        })
        .unwrap();
        assert_eq!(n, 7);
        assert_eq!(sink.len(), 6 + 100_000);
        assert!(sink.starts_with(b"first\n"));
        // A failed writer: its error, and nothing copied.
        let mut sink = Vec::new();
        let err = spooled(&mut sink, |w| -> anyhow::Result<()> {
            w.write_all(b"partial")?;
            anyhow::bail!("stopped")
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "stopped");
        assert!(sink.is_empty());
    }
}
