//! MQTT topic filter matching, for the deliveries a consumer's configured filters no longer cover.

/// Whether `topic` matches `filter` as a broker matches it (MQTT 5, 4.7): `+` one level, `#` the rest
/// (the parent level included), a shared subscription by its filter (`$share/{group}/{filter}`, and
/// EMQX's `$queue/{filter}` and `$exclusive/{filter}`), and a topic that begins with `$` never by a
/// wildcard at the first level.
pub(crate) fn matches(topic: &str, filter: &str) -> bool {
    let filter = if let Some(rest) = filter.strip_prefix("$share/") {
        match rest.split_once('/') {
            Some((_group, f)) => f,
            None => return false,
        }
    } else if let Some(f) = filter
        .strip_prefix("$queue/")
        .or_else(|| filter.strip_prefix("$exclusive/"))
    {
        f
    } else {
        filter
    };
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut levels = topic.split('/');
    for f in filter.split('/') {
        if f == "#" {
            return true;
        }
        match levels.next() {
            Some(t) if f == "+" || f == t => {}
            _ => return false,
        }
    }
    levels.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn matches_as_a_broker_does() {
        for (topic, filter, want) in [
            ("orders/1", "orders/#", true),
            ("orders", "orders/#", true),
            ("orders/1/x", "orders/+", false),
            ("orders/1", "orders/+", true),
            ("orders/", "orders/+", true),
            ("orders/1", "orders/1", true),
            ("orders/1", "orders/2", false),
            ("orders/1", "#", true),
            ("/orders", "+/orders", true),
            ("orders/1", "$share/g/orders/#", true),
            ("other/1", "$share/g/orders/#", false),
            ("orders/1", "$queue/orders/#", true),
            ("orders/1", "$exclusive/orders/1", true),
            ("$SYS/load", "#", false),
            ("$SYS/load", "+/load", false),
            ("$SYS/load", "$SYS/#", true),
            ("a/b", "a/b/c", false),
            ("a/b/c", "a/b", false),
        ] {
            assert_eq!(matches(topic, filter), want, "{topic:?} against {filter:?}");
        }
    }
}
