//! Topic filters an earlier configuration of the same client subscribed and this one no longer has. The
//! broker keeps a persistent session's subscriptions until they are unsubscribed, so without this a filter
//! removed from the configuration would go on delivering its messages to the handler.

use crate::inbox::Inbox;
use crate::store::error::Result;
use crate::store::schema::meta;
use crate::store::txn::write;

/// Filters recorded per client id, current ones included.
const MAX_RECORDED: usize = 64;

/// Records `current` among the filters ever subscribed for `client_id` through this inbox file and returns
/// the recorded ones no longer in `current`, to unsubscribe on every connection (an UNSUBSCRIBE of a filter
/// the session does not hold is harmless). Without filters the consumer takes what the kept session
/// delivers, so nothing is recorded or dropped.
pub(crate) fn dropped_filters(
    inbox: &Inbox,
    client_id: &str,
    current: &[String],
) -> Result<Vec<String>> {
    if current.is_empty() {
        return Ok(Vec::new());
    }
    let name = format!("mqtt_filters:{client_id}");
    let conn = &inbox.conn;
    write(conn, || {
        // Unreadable (written by hand, say): start the record over.
        let stored: Vec<String> = meta(conn, &name)?
            .and_then(|blob| ciborium::from_reader(&blob[..]).ok())
            .unwrap_or_default();
        let mut all = stored.clone();
        for f in current {
            if !all.contains(f) {
                all.push(f.clone());
            }
        }
        // Bounded: the oldest removed filters are forgotten first (each costs an UNSUBSCRIBE per connection).
        while all.len() > MAX_RECORDED {
            match all.iter().position(|f| !current.contains(f)) {
                Some(oldest) => drop(all.remove(oldest)),
                None => break,
            }
        }
        if all != stored {
            let mut blob = Vec::new();
            ciborium::into_writer(&all, &mut blob)
                .map_err(|e| crate::store::error::Error::Codec(e.to_string()))?;
            conn.prepare_cached(
                "INSERT INTO inbox_meta (name, value) VALUES (?1, ?2) \
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            )?
            .execute((&name, &blob))?;
        }
        Ok(all.into_iter().filter(|f| !current.contains(f)).collect())
    })
}
