//! Admin-path operations that span cores: installing a policy snapshot on every core and
//! gathering per-core state. Never on the request path; each runs as one hop per core.

use std::sync::Arc;

use inferencecache_index::index::{SnapshotPart, SnapshotPartBuilder};
use inferencecache_index::policy::PolicyStore;

use crate::limits::{SNAPSHOT_SLICE_BUDGET, SNAPSHOT_SLICE_MAX_ENTRIES};
use crate::runtime::mailbox;

/// Hands every core the same immutable policy snapshot (`POST /policy` replace-on-write). Each
/// core swaps its `Arc`, so a lookup sees either the old or the new snapshot, never a mix.
pub async fn install_policy(store: Arc<PolicyStore>) {
    for core in 0..mailbox::cores() {
        let s = store.clone();
        let _ = mailbox::call(core, move |st| st.set_policy(s)).await;
    }
}

/// Every core's `/snapshot` part in core order, each built in slices of at most
/// [`SNAPSHOT_SLICE_BUDGET`] / [`SNAPSHOT_SLICE_MAX_ENTRIES`] (one hop per slice), so a core
/// serves its requests between two instead of walking all its entries in one step.
pub async fn snapshot_parts() -> Vec<SnapshotPart> {
    let mut out = Vec::with_capacity(mailbox::cores());
    for core in 0..mailbox::cores() {
        if let Some(p) = snapshot_part(core).await {
            out.push(p);
        }
    }
    out
}

/// One core's `/snapshot` part; `None` when the core cannot be reached.
async fn snapshot_part(core: usize) -> Option<SnapshotPart> {
    let mut b = Box::new(SnapshotPartBuilder::default());
    loop {
        let slice = mailbox::call(core, move |st| {
            let deadline = std::time::Instant::now() + SNAPSHOT_SLICE_BUDGET;
            let done =
                st.index
                    .snapshot_part_step(&mut b, SNAPSHOT_SLICE_MAX_ENTRIES, Some(deadline));
            (done, b)
        });
        let (done, back) = slice.await.ok()?;
        if done {
            return Some(back.finish());
        }
        b = back;
    }
}
