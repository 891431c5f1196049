//! Where output goes: files replaced atomically, and progress on a terminal.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::Path;

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
}
