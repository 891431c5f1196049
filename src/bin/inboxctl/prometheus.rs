//! `stats` in the Prometheus text exposition format (version 0.0.4), as node_exporter's textfile collector
//! reads it: one family per figure, `# HELP` and `# TYPE` first, no timestamps.

use std::fmt::Write;

use edge_inbox::inspect::{BytesWritten, DeviceWear, FileSizes, ScopeReport};

type Figure = fn(&ScopeReport) -> Option<u64>;
type Size = fn(&FileSizes) -> u64;
type Written = fn(&BytesWritten) -> u64;

/// The per-scope families: name, type, help, and the figure of `stats --json` each one carries.
const SCOPE_FAMILIES: &[(&str, &str, &str, Figure)] = &[
    (
        "edge_inbox_processed_total",
        "counter",
        "Deliveries whose effect was committed.",
        |s| Some(s.processed),
    ),
    (
        "edge_inbox_duplicates_total",
        "counter",
        "Redeliveries recognised as duplicates of a committed identity (no second effect).",
        |s| Some(s.duplicates),
    ),
    (
        "edge_inbox_conflicts_total",
        "counter",
        "Arrivals of deliveries that reused a committed id with different content (recorded, not applied), redeliveries included.",
        |s| Some(s.conflicts),
    ),
    (
        "edge_inbox_conflict_records_total",
        "counter",
        "Distinct conflict records made, one per identity and received content.",
        |s| Some(s.conflict_records),
    ),
    (
        "edge_inbox_quarantined_total",
        "counter",
        "Arrivals of quarantined deliveries (no id, malformed, over a limit, expired), redeliveries included.",
        |s| Some(s.quarantined),
    ),
    (
        "edge_inbox_quarantine_records_total",
        "counter",
        "Distinct quarantine records made, one per distinct delivery.",
        |s| Some(s.quarantine_records),
    ),
    (
        "edge_inbox_pending",
        "gauge",
        "Stored messages waiting for the deferred worker.",
        |s| Some(s.pending),
    ),
    (
        "edge_inbox_oldest_pending_age_seconds",
        "gauge",
        "Age of the oldest stored message not yet processed (pending or failed); absent when there is none.",
        |s| s.oldest_pending_age_secs,
    ),
    (
        "edge_inbox_dead_letters",
        "gauge",
        "Dead letters held now.",
        |s| Some(s.dead_letters),
    ),
    (
        "edge_inbox_identities_retained",
        "gauge",
        "Identity rows retained: the evidence against a repeated effect.",
        |s| Some(s.identities_retained),
    ),
    (
        "edge_inbox_outbox_pending",
        "gauge",
        "Outbox messages committed by the scope's handlers and not yet acknowledged by the broker, parked ones not included.",
        |s| Some(s.outbox_pending),
    ),
    (
        "edge_inbox_outbox_parked",
        "gauge",
        "Outbox messages parked: refused by the broker too many times, or ones it cannot take; kept, not sent until requeued.",
        |s| Some(s.outbox_parked),
    ),
];

/// The file families: name, help, and the size each one carries.
const FILE_FAMILIES: &[(&str, &str, Size)] = &[
    (
        "edge_inbox_database_bytes",
        "Size of the database file.",
        |f| f.db_bytes,
    ),
    (
        "edge_inbox_wal_bytes",
        "Size of the write-ahead log (-wal) file.",
        |f| f.wal_bytes,
    ),
];

/// The bytes-written families: name, help, and the figure each one carries.
const WRITTEN_FAMILIES: &[(&str, &str, Written)] = &[
    (
        "edge_inbox_wal_written_bytes_total",
        "Bytes the inbox appended to its WAL over the file's life (as last saved in the file): flash wear.",
        |w| w.wal_bytes,
    ),
    (
        "edge_inbox_checkpoint_written_bytes_total",
        "Bytes the inbox's automatic checkpoints wrote into the database file over the file's life (as last saved).",
        |w| w.checkpoint_bytes,
    ),
];

/// The exposition of one database's figures. Every sample carries a `db` label (the path as given), so the
/// files of several inboxes on one host can sit side by side in the textfile directory without colliding.
/// The device's families appear only where the device reports its wear.
pub fn render(
    db: &str,
    files: &FileSizes,
    written: &BytesWritten,
    device: Option<&DeviceWear>,
    scopes: &[ScopeReport],
) -> String {
    let db = label_value(db);
    let mut out = String::new();
    for (name, kind, help, figure) in SCOPE_FAMILIES {
        family(&mut out, name, kind, help);
        for s in scopes {
            if let Some(v) = figure(s) {
                let scope = label_value(&s.scope);
                let _ = writeln!(out, "{name}{{db=\"{db}\",scope=\"{scope}\"}} {v}");
            }
        }
    }
    for (name, help, size) in FILE_FAMILIES {
        family(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name}{{db=\"{db}\"}} {}", size(files));
    }
    for (name, help, figure) in WRITTEN_FAMILIES {
        family(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name}{{db=\"{db}\"}} {}", figure(written));
    }
    if let Some(d) = device {
        let dev = label_value(&d.device);
        let life = [("a", d.life_time_a), ("b", d.life_time_b)];
        if life.iter().any(|(_, v)| v.is_some()) {
            let name = "edge_inbox_device_life_time_estimate";
            family(
                &mut out,
                name,
                "gauge",
                "eMMC life time used, as the device estimates it: 1 is 0-10 %, 10 is 90-100 %, 11 beyond its rated life.",
            );
            for (kind, v) in life {
                if let Some(v) = v {
                    let _ = writeln!(
                        out,
                        "{name}{{db=\"{db}\",device=\"{dev}\",type=\"{kind}\"}} {v}"
                    );
                }
            }
        }
        if let Some(v) = d.pre_eol_info {
            let name = "edge_inbox_device_pre_eol_info";
            family(
                &mut out,
                name,
                "gauge",
                "eMMC reserved blocks consumed: 1 normal, 2 warning (80 %), 3 urgent.",
            );
            let _ = writeln!(out, "{name}{{db=\"{db}\",device=\"{dev}\"}} {v}");
        }
    }
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {}", help_text(help));
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A label value as the format requires: backslash, double quote and line feed escaped.
fn label_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str(r"\\"),
            '"' => out.push_str(r#"\""#),
            '\n' => out.push_str(r"\n"),
            c => out.push(c),
        }
    }
    out
}

/// Help text: backslash and line feed escaped (a double quote is literal there).
fn help_text(v: &str) -> String {
    v.replace('\\', r"\\").replace('\n', r"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_and_help_are_escaped_as_the_format_says() {
        assert_eq!(label_value("plain@2"), "plain@2");
        assert_eq!(label_value("a\"b\\c\nd"), r#"a\"b\\c\nd"#);
        assert_eq!(help_text("one\\two\n\"three\""), r#"one\\two\n"three""#);
    }

    #[test]
    fn every_family_is_declared_once_before_its_samples() {
        let text = render(
            "inbox.db",
            &FileSizes::default(),
            &BytesWritten::default(),
            None,
            &[],
        );
        for (name, kind, ..) in SCOPE_FAMILIES {
            assert_eq!(text.matches(&format!("# TYPE {name} {kind}\n")).count(), 1);
        }
        assert!(
            text.contains("edge_inbox_wal_bytes{db=\"inbox.db\"} 0\n"),
            "{text}"
        );
    }
}
