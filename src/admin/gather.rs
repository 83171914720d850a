//! Admin-path operations that span cores: installing a policy snapshot on every core and
//! gathering per-core state. Never on the request path; each runs as one hop per core.

use std::sync::Arc;

use inferencecache_index::policy::PolicyStore;

use crate::runtime::mailbox;
use crate::shard::CoreState;

/// Hands every core the same immutable policy snapshot (`POST /policy` replace-on-write). Each
/// core swaps its `Arc`, so a lookup sees either the old or the new snapshot, never a mix.
pub async fn install_policy(store: Arc<PolicyStore>) {
    for core in 0..mailbox::cores() {
        let s = store.clone();
        let _ = mailbox::call(core, move |st| st.set_policy(s)).await;
    }
}

/// Runs `f` on every core in turn and collects the results in core order (admin gathers).
pub async fn gather<R, F>(f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(&mut CoreState) -> R + Send + Sync + Clone + 'static,
{
    let mut out = Vec::with_capacity(mailbox::cores());
    for core in 0..mailbox::cores() {
        let g = f.clone();
        if let Ok(r) = mailbox::call(core, move |st| g(st)).await {
            out.push(r);
        }
    }
    out
}
