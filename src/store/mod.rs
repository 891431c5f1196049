//! The storage layer: the connection and its hot statements, the schema and its migrations, the transaction
//! primitives and clock, errors, configuration, identities, outcomes and the handler's [`Tx`](state::Tx). It
//! imports nothing from the layers above it.

pub(crate) mod checkpoint_bytes;
pub(crate) mod checkpointer;
pub(crate) mod config;
pub(crate) mod db;
pub(crate) mod error;
pub(crate) mod files;
#[cfg(feature = "mqtt")]
pub(crate) mod group_sync;
pub(crate) mod id_order;
pub(crate) mod identity;
pub(crate) mod outcome;
pub(crate) mod records;
pub(crate) mod schema;
pub(crate) mod sqlite_version;
pub(crate) mod state;
pub(crate) mod txn;
pub(crate) mod wal_sync;
pub(crate) mod wal_watch;
pub(crate) mod wear;
pub(crate) mod writeback;
