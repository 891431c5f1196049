//! Where output goes: files replaced atomically, and progress on a terminal.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::path::Path;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

/// Replaces `path` with `bytes` so that a reader sees the old file or the whole new one, never a part: a
/// temporary file in the same directory (same file system, so the rename is atomic), written and synced,
/// renamed over `path`, then the directory synced so the rename survives a power cut. The temporary name
/// does not end in `.prom`, so node_exporter's textfile collector never reads it.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
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
    let written = (|| -> anyhow::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
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
        write_atomically(&path, b"new contents\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new contents\n");
        let names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("inbox.prom")]);
        // A directory that is not there: an error, and nothing left behind.
        let err = write_atomically(&dir.join("missing/inbox.prom"), b"x").unwrap_err();
        assert!(format!("{err:#}").contains("missing"), "{err:#}");
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1);
    }
}
