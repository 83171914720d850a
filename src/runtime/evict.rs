//! Tenant quota and global cap across cores (docs/BEHAVIOUR.md §7.1, §7.2; docs/ARCHITECTURE.md
//! §1). With several cores an ingest does not evict by itself; once the owner applied it, the
//! ingesting stream asks every core for its first candidates in the reference's order, picks
//! the globally first ones and has each core evict its share, so the victims are exactly those
//! one global index would choose. With one core the index evicts inside the ingest instead,
//! at most one slice's worth (`CAP_ENFORCE_SLICE_MAX_EVICTIONS`); the ingesting stream then runs
//! the rest in slices on the core before the ingest is acknowledged, as the cross-core rounds are.
//!
//! Eviction happens on the ingest path only, never on a lookup. Every step is a
//! [`mailbox::call`] (bounded queues, no blocking wait on a core): two streams enforcing at once
//! on different cores simply interleave, and each re-reads the global counts before every round,
//! so they never evict below the bound.
//!
//! In the reference an ingest and its evictions are one step under the index lock, so a TTL
//! sweep runs either before or after both. Here the owner core decides, in the same step as the
//! ingest, whether evictions must follow ([`pending`]); while any are pending, sweeps wait
//! ([`sweep_may_run`]), so no sweep ever runs between an ingest and its evictions.

use std::sync::atomic::{AtomicUsize, Ordering};

use inferencecache_index::directory::Directory;
use inferencecache_index::index::{CapVictim, select_victims};

use super::mailbox;
use crate::limits::{MAX_CAP_CANDIDATE_ROUNDS, SWEEP_SLICE_PAUSE};
use crate::shard::{self, CapNeed, CoreState, cap_round_max_evictions};

/// Ingests whose cross-core evictions are pending or running.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Whether a TTL sweep may run now: no ingest is between its apply and its evictions.
pub fn sweep_may_run() -> bool {
    IN_FLIGHT.load(Ordering::Acquire) == 0
}

/// Keeps TTL sweeps from starting while held ([`sweep_may_run`]): an update applied in parts
/// holds one from its first part to its last, so no sweep runs inside it, as none runs between
/// an ingest and its evictions.
pub struct SweepHold(());

impl SweepHold {
    pub fn new() -> SweepHold {
        IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
        SweepHold(())
    }
}

impl Drop for SweepHold {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Evictions owed by one applied ingest; counted in flight from creation until dropped.
pub struct Pending {
    tenant: String,
    quota: Option<u64>,
    /// One core: the global-cap evictions the ingest's own step left owed
    /// (`CoreState::cap_enforce_slice`), not a cross-core selection.
    local_cap: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Called on the owner core right after it applied an ingest for `tenant` (same step): the
/// evictions that must follow, if the tenant is over its `quota` or the index over the global
/// cap. Always `None` with one core (the index evicted inside the ingest).
pub fn pending(st: &CoreState, tenant: &str, quota: Option<u64>) -> Option<Pending> {
    if shard::cores() <= 1 || !st.index.config().cross_core_eviction {
        // The index evicted inside the ingest, at most a slice of the cap's share.
        if !st.index.cap_enforce_owed() {
            return None;
        }
        IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
        return Some(Pending {
            tenant: tenant.to_string(),
            quota: None,
            local_cap: true,
        });
    }
    let dir = st.index.directory();
    let max = st.index.config().max_entries;
    let over_cap = max > 0 && dir.non_reserved_entries() > max as i64;
    let over_quota =
        quota.is_some_and(|b| dir.tenant_keys_exact(Directory::fingerprint(tenant)) > b);
    if !over_cap && !over_quota {
        return None;
    }
    IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
    Some(Pending {
        tenant: tenant.to_string(),
        quota,
        local_cap: false,
    })
}

/// Runs the global-cap evictions an ingest left owed on `core` in slices
/// ([`SWEEP_SLICE_PAUSE`] apart, each after the victims it needs are ready), until none are
/// owed; `absorb` takes each slice's `after_evict` result. Each slice evicts at least one entry,
/// so this ends.
async fn enforce_owed_cap<R: Send + 'static>(
    core: usize,
    after_evict: fn() -> R,
    absorb: &mut impl FnMut(R),
) {
    loop {
        let slice = mailbox::call_piece(core, CapNeed::Owed, move |st| {
            (st.cap_enforce_slice(), after_evict())
        });
        let Ok((done, removals)) = slice.await else {
            return;
        };
        absorb(removals);
        if done {
            return;
        }
        mailbox::pause(SWEEP_SLICE_PAUSE).await;
    }
}

/// Runs `round` for each core concurrently and collects the answers (a core that cannot be
/// reached, i.e. shutdown, contributes the default). Each core first readies the cap victims
/// `need` says the round takes there, in slices.
async fn on_every_core<R, F>(cores: usize, need: CapNeed, mut round: F) -> Vec<R>
where
    R: Send + Default + 'static,
    F: FnMut(usize) -> Box<dyn FnOnce(&mut CoreState) -> R + Send>,
{
    let calls = (0..cores).map(|c| {
        let f = round(c);
        let need = need.clone();
        async move { mailbox::call_piece(c, need, f).await.unwrap_or_default() }
    });
    futures_util::future::join_all(calls).await
}

impl Pending {
    /// Enforces the tenant's quota (when it has one) and then the global cap, across all cores.
    /// `after_evict` runs on each core right after it evicted its share (the change feed takes
    /// the removals it held there); `absorb` takes its results in eviction order, as they come
    /// (so the caller bounds what it keeps of them).
    pub async fn enforce<R: Send + 'static>(
        self,
        after_evict: fn() -> R,
        absorb: &mut impl FnMut(R),
    ) {
        if self.local_cap {
            return enforce_owed_cap(0, after_evict, absorb).await;
        }
        let cores = shard::cores();
        let info =
            |st: &mut CoreState| (st.index.directory().clone(), st.index.config().max_entries);
        // On a core (the gRPC handlers) the shared directory is at hand.
        let (dir, max) = if shard::current_core().is_some() {
            shard::with_core(info)
        } else {
            match mailbox::call(0, info).await {
                Ok(x) => x,
                Err(_) => return,
            }
        };
        let tenant = self.tenant.as_str();
        if let Some(budget) = self.quota {
            let fp = Directory::fingerprint(tenant);
            // The directory counts keys a pending ALL_CLEARED is still removing: read it once
            // every core's is done.
            on_every_core(cores, CapNeed::Nothing, |_| Box::new(|_| ())).await;
            loop {
                let global = dir.tenant_keys_exact(fp);
                if global <= budget {
                    break;
                }
                let over = (global - budget) as usize;
                let need = CapNeed::QuotaCandidates {
                    tenant: tenant.into(),
                    k: over,
                };
                let parts = on_every_core(cores, need, |_| {
                    let t = tenant.to_string();
                    Box::new(move |st| st.quota_candidates(&t, over))
                })
                .await;
                let mut picks = select_victims(&parts, over);
                let evicted = sum_evicted(
                    on_every_core(cores, CapNeed::Nothing, |c| {
                        let (t, v) = (tenant.to_string(), std::mem::take(&mut picks[c]));
                        Box::new(move |st| (st.evict_quota(&t, &v), Some(after_evict())))
                    })
                    .await,
                    absorb,
                );
                if evicted == 0 {
                    break;
                }
            }
        }
        if max == 0 {
            return;
        }
        loop {
            let over = dir.non_reserved_entries() - max as i64;
            if over <= 0 {
                break;
            }
            // At most a slice's worth per round: each core's candidate request and eviction
            // stay bounded steps, and the globally first victims in rounds are the same set.
            let over = (over as usize).min(cap_round_max_evictions());
            let parts = cap_candidates_everywhere(cores, over).await;
            let mut picks = select_victims(&parts, over);
            let evicted = sum_evicted(
                on_every_core(cores, CapNeed::Nothing, |c| {
                    let v = std::mem::take(&mut picks[c]);
                    Box::new(move |st| (st.evict_cap(&v), Some(after_evict())))
                })
                .await,
                absorb,
            );
            if evicted == 0 {
                break;
            }
        }
    }
}

/// Every core's `over` first global-cap candidates, each core readying them in slices first
/// (`CapNeed::Candidates`). A core whose heap ran out of live snapshots while answering (stale
/// ones, which readiness cannot see) answers `None` rather than build in one go, and the round
/// is asked again after its slices; the last of [`MAX_CAP_CANDIDATE_ROUNDS`] may build.
async fn cap_candidates_everywhere(cores: usize, over: usize) -> Vec<Vec<CapVictim>> {
    for round in 1..=MAX_CAP_CANDIDATE_ROUNDS {
        let build = round == MAX_CAP_CANDIDATE_ROUNDS;
        let parts = on_every_core(cores, CapNeed::Candidates(over), |_| {
            Box::new(move |st| st.cap_candidates(over, build))
        })
        .await;
        if build || parts.iter().all(Option::is_some) {
            return parts.into_iter().map(Option::unwrap_or_default).collect();
        }
        crate::metrics::record_cap_candidate_retry();
        mailbox::pause(SWEEP_SLICE_PAUSE).await;
    }
    unreachable!("the last round builds")
}

/// Total evicted over one round's answers, keeping each core's `after_evict` result.
fn sum_evicted<R>(answers: Vec<(u64, Option<R>)>, absorb: &mut impl FnMut(R)) -> u64 {
    let mut total = 0;
    for (n, r) in answers {
        total += n;
        r.into_iter().for_each(&mut *absorb);
    }
    total
}
