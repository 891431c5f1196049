//! Times as RFC 3339 UTC for people, with the stored Unix values kept beside them in JSON.

use serde_json::{Map, Value};

/// Fields of the JSON documents that hold Unix seconds: each becomes an RFC 3339 string under its own name,
/// with the stored number as `<name>_unix`.
const SECONDS: &[&str] = &[
    "at",
    "last_at",
    "sent_at",
    "received_at",
    "finished_at",
    "committed_day",
    "as_of",
];

/// Fields that hold Unix milliseconds, kept as they are, and the RFC 3339 field added beside each.
const MILLIS: &[(&str, &str)] = &[("lease_until_ms", "lease_until")];

/// `secs` (Unix seconds) as RFC 3339 in UTC, e.g. `2026-12-03T05:38:26Z`; the raw number, marked as such,
/// when it is outside the years a calendar can show (a clock or a row gone badly wrong).
pub fn rfc3339(secs: i64) -> String {
    jiff::Timestamp::from_second(secs)
        .map_or_else(|_| format!("{secs} (Unix seconds)"), |t| t.to_string())
}

/// `ms` (Unix milliseconds) as RFC 3339 in UTC, with the fraction of a second when there is one.
pub fn rfc3339_ms(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map_or_else(|_| format!("{ms} (Unix milliseconds)"), |t| t.to_string())
}

fn rfc3339_json(v: &Value, from: fn(i64) -> Result<jiff::Timestamp, jiff::Error>) -> Value {
    v.as_i64()
        .and_then(|n| from(n).ok())
        .map_or(Value::Null, |t| Value::String(t.to_string()))
}

/// `v` with its known time fields, at any depth, as RFC 3339: a seconds field under its own name, its number
/// moved to `<name>_unix`; a milliseconds field kept, an RFC 3339 field added beside it. Null stays null.
pub fn in_json(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut out = Map::new();
            for (key, value) in map {
                let value = in_json(value);
                if SECONDS.contains(&key.as_str()) && (value.is_i64() || value.is_null()) {
                    out.insert(
                        key.clone(),
                        rfc3339_json(&value, jiff::Timestamp::from_second),
                    );
                    out.insert(format!("{key}_unix"), value);
                } else if let Some((_, name)) = MILLIS.iter().find(|(raw, _)| *raw == key) {
                    out.insert(
                        (*name).to_owned(),
                        rfc3339_json(&value, jiff::Timestamp::from_millisecond),
                    );
                    out.insert(key, value);
                } else {
                    out.insert(key, value);
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.into_iter().map(in_json).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn seconds_become_rfc3339_beside_the_unix_value() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_123_456_789), "2005-08-07T23:19:49Z");
        assert_eq!(rfc3339(i64::MAX), format!("{} (Unix seconds)", i64::MAX));
        assert_eq!(rfc3339_ms(1_123_456_789_250), "2005-08-07T23:19:49.25Z");
        let v = in_json(json!({
            "at": 86_400,
            "last_at": 172_800,
            "finished_at": null,
            "message": {"received_at": 1_123_456_789, "lease_until_ms": 1_123_456_789_250_i64},
            "rows": [{"as_of": 0}],
            "attempts": 3,
        }));
        assert_eq!(
            v,
            json!({
                "at": "1970-01-02T00:00:00Z",
                "at_unix": 86_400,
                "last_at": "1970-01-03T00:00:00Z",
                "last_at_unix": 172_800,
                "finished_at": null,
                "finished_at_unix": null,
                "message": {
                    "received_at": "2005-08-07T23:19:49Z",
                    "received_at_unix": 1_123_456_789,
                    "lease_until_ms": 1_123_456_789_250_i64,
                    "lease_until": "2005-08-07T23:19:49.25Z",
                },
                "rows": [{"as_of": "1970-01-01T00:00:00Z", "as_of_unix": 0}],
                "attempts": 3,
            })
        );
    }
}
