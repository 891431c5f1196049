//! The built-in key-value state read outside a handler: what handlers wrote through [`Tx`], decoded, without
//! SQL or CBOR in the application.

use serde::de::DeserializeOwned;

use crate::inbox::Inbox;
use crate::store::error::{Error, Result};
#[cfg(doc)]
use crate::store::state::Tx;

impl Inbox {
    /// Reads `key` from namespace `ns`, as a handler's [`Tx::get_in`] would: `ns` is the scope for what
    /// handlers wrote with [`Tx::put`] (a scope's own namespace), or the namespace they gave
    /// [`Tx::put_in`]. `None` if there is no such key.
    ///
    /// A read of its own, outside any delivery's transaction: it sees what is committed. A value that does
    /// not decode as `T` is an [`Error::Codec`].
    ///
    /// ```
    /// use edge_inbox::{Config, Delivery, Inbox, Tx};
    /// # fn main() -> anyhow::Result<()> {
    /// # let dir = tempfile::tempdir()?;
    /// let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
    /// let reserve = |tx: &mut Tx<'_>, _d: &Delivery<'_>| -> anyhow::Result<()> {
    ///     let reserved: i64 = tx.get("reserved/A-1")?.unwrap_or(0);
    ///     tx.put("reserved/A-1", &(reserved + 1))?;
    ///     Ok(())
    /// };
    /// inbox.process(&Delivery::new("inventory-reservation", "evt-42", "orders/42", b"{}"), reserve)?;
    /// // From a status page, a report, a test:
    /// let reserved: Option<i64> = inbox.get("inventory-reservation", "reserved/A-1")?;
    /// assert_eq!(reserved, Some(1));
    /// # Ok(()) }
    /// ```
    pub fn get<T: DeserializeOwned>(&self, ns: &str, key: &str) -> Result<Option<T>> {
        let found = self.conn.kv_get(ns, key, |blob| {
            ciborium::from_reader::<T, _>(blob).map_err(|e| e.to_string())
        })?;
        match found {
            None => Ok(None),
            Some(Ok(v)) => Ok(Some(v)),
            Some(Err(why)) => Err(Error::Codec(format!("value of {ns}/{key}: {why}"))),
        }
    }

    /// Every key of namespace `ns` that starts with `prefix` (plain text: no wildcards), in key order, with
    /// its value; `""` for the whole namespace. Namespaces as in [`Inbox::get`]. All matches are read into
    /// memory: pick a prefix for a large namespace.
    ///
    /// ```
    /// use edge_inbox::{Config, Delivery, Inbox, Tx};
    /// # fn main() -> anyhow::Result<()> {
    /// # let dir = tempfile::tempdir()?;
    /// let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
    /// for (id, sku) in [("evt-1", "A-1"), ("evt-2", "B-7")] {
    ///     let d = Delivery::new("inventory-reservation", id, "orders", sku.as_bytes());
    ///     inbox.process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
    ///         let key = format!("reserved/{}", std::str::from_utf8(d.payload)?);
    ///         tx.put(&key, &1i64)?;
    ///         Ok(())
    ///     })?;
    /// }
    /// let reserved: Vec<(String, i64)> = inbox.entries("inventory-reservation", "reserved/")?;
    /// assert_eq!(reserved, [("reserved/A-1".to_owned(), 1), ("reserved/B-7".to_owned(), 1)]);
    /// # Ok(()) }
    /// ```
    pub fn entries<T: DeserializeOwned>(&self, ns: &str, prefix: &str) -> Result<Vec<(String, T)>> {
        // A range scan of the primary key (ns, key) from `prefix`, ended at the first key without it: no
        // LIKE, whose `%` and `_` a key may contain.
        let mut stmt = self
            .conn
            .prepare_cached("SELECT key, value FROM kv WHERE ns = ?1 AND key >= ?2 ORDER BY key")?;
        let mut rows = stmt.query((ns, prefix))?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            let key = row.get_ref(0)?.as_str().map_err(rusqlite::Error::from)?;
            if !key.starts_with(prefix) {
                break;
            }
            let blob = row.get_ref(1)?.as_blob().map_err(rusqlite::Error::from)?;
            let value = ciborium::from_reader::<T, _>(blob)
                .map_err(|e| Error::Codec(format!("value of {ns}/{key}: {e}")))?;
            out.push((key.to_owned(), value));
        }
        Ok(out)
    }
}
