//! `ALL_CLEARED` (§5) in slices: one event may remove every entry of a replica in a model scope,
//! millions on a large core, and finding them scans the core's keys (201 ms of thread CPU at 10M
//! entries in one step, perf/runs/2026-12-06-maintenance-stress.md). With sliced clears on (the
//! server's setting), the event itself only does what is O(scopes of the model): the replica
//! stops serving in each scope (serving counts, sorted lists) and its entries leave the entry
//! counts (tenant, core, directory). Its holders stay in the store, *cleared*: lookups skip them
//! (the lookup knows its model scope, so the check is one comparison per holder started), and
//! the scan that removes them runs in time-budgeted slices ([`Index::clear_step`]), with the key
//! counts of the keys it empties updated as it goes.
//!
//! Exactness: a lookup's answer and its miss class are those after the full clear (the serving
//! sets, the entry counts and the stats row are already final; whether the model scope keeps any
//! key is known, since it keeps one exactly when some replica still serves in it). Everything
//! else that reads or changes the store (ingest, events, the sweep, cap and quota work, exports,
//! GetCacheState) must come after the clear: each such index entry point finishes a clear still
//! pending first ([`Index::finish_clear`], counted), and the server drives the slices itself
//! before it calls them, so that fallback is not the path it takes. Since nothing else changes
//! the store while a clear is pending, the scan's cursor stays exact and at most one clear is
//! pending per core.

use super::eviction::SweepBudget;
use super::store::{FIRST, Loc, NIL, PLACES_PER_STEP, Scan, Store};
use super::{Index, KeyId};

/// An `ALL_CLEARED` whose holders are still in the store.
pub(crate) struct PendingClear {
    /// The model scope the replica was cleared in.
    pub mscope: u32,
    /// The replica's string id.
    pub replica: u32,
    /// Its holders the scan has not removed yet.
    remaining: u64,
    /// The scan's next place.
    pos: Loc,
}

impl Index {
    /// With `on` (the server), `ALL_CLEARED` leaves its removals to [`Index::clear_step`]
    /// slices; off (the default), the event removes them itself.
    pub fn set_sliced_clears(&mut self, on: bool) {
        self.sliced_clears = on;
        if !on {
            self.finish_clear();
        }
    }

    /// Whether an `ALL_CLEARED` still has holders to remove.
    pub fn clear_pending(&self) -> bool {
        self.clear.is_some()
    }

    /// One slice of the pending clear within `budget` (a place visited counts one, a
    /// holder removed like a sweep removal). Returns whether no clear is pending any more.
    pub fn clear_step(&mut self, budget: SweepBudget) -> bool {
        let Some(mut c) = self.clear.take() else {
            return true;
        };
        let mut meter = budget.meter();
        let mut work = 0;
        let mut ended = false;
        while c.remaining > 0 {
            if meter.spent(work) {
                break;
            }
            let pos = match self.store.scan(c.pos, PLACES_PER_STEP) {
                Scan::End => {
                    ended = true;
                    break;
                }
                Scan::Paused(next) => {
                    work += PLACES_PER_STEP;
                    c.pos = next;
                    continue;
                }
                Scan::Held(pos) => pos,
            };
            work += 1;
            let key = self.store.key_at(pos);
            if self.cat.scope_of(key).mscope == c.mscope
                && self.store.holder_of(pos, c.replica).is_some()
            {
                self.remove_cleared_holder(pos, key, c.replica);
                c.remaining -= 1;
                meter.charge_removals(1);
            }
            c.pos = Store::after(pos);
        }
        self.flush();
        debug_assert!(
            c.remaining == 0 || !ended,
            "a cleared holder the scan missed"
        );
        if c.remaining > 0 {
            self.clear = Some(c);
            return false;
        }
        true
    }

    /// Finishes a pending clear in one go: the fallback of an entry point that must see the
    /// store after it (counted: [`Index::take_clear_sync_finishes`]).
    pub fn finish_clear(&mut self) {
        if self.clear.is_some() {
            self.clear_sync_finishes += 1;
            self.clear_step(SweepBudget::UNBOUNDED);
        }
    }

    /// Clears finished in one go by an entry point since the last call (see
    /// [`Index::finish_clear`]).
    pub fn take_clear_sync_finishes(&mut self) -> u64 {
        std::mem::take(&mut self.clear_sync_finishes)
    }

    /// `ALL_CLEARED` of `replica` in model scope `mscope`: the replica stops serving in each
    /// scope and its entries leave the counts now; its holders are removed by the pending
    /// clear's slices (or at once without sliced clears). Returns the entries removed.
    pub(crate) fn begin_clear(&mut self, mscope: u32, replica: u32) -> u64 {
        self.finish_clear();
        let mut entries: u64 = 0;
        for si in 0..self.cat.models[mscope as usize].scopes.len() {
            let s = self.cat.models[mscope as usize].scopes[si];
            if let Some(&n) = self.cat.scopes[s as usize].serving.get(&replica) {
                entries += u64::from(n);
                self.stop_serving(s, replica);
            }
        }
        if entries == 0 {
            return 0;
        }
        let tenant = self.cat.models[mscope as usize].tenant;
        self.count_entries_removed(tenant, entries);
        self.clear = Some(PendingClear {
            mscope,
            replica,
            remaining: entries,
            pos: FIRST,
        });
        if !self.sliced_clears {
            self.clear_step(SweepBudget::UNBOUNDED);
        }
        entries
    }

    /// Removes a cleared holder (its entry already left the counts) at place `pos`.
    fn remove_cleared_holder(&mut self, pos: Loc, key: KeyId, replica: u32) {
        let (_, key_gone) = self
            .store
            .remove_holder(pos, replica)
            .expect("cleared holder");
        // A clear removes a replica's entries in place order, each the first of its extent:
        // never one from an extent's middle, so nothing is dropped with it.
        debug_assert!(!self.store.has_dropped(), "a clear cut an extent");
        if key_gone {
            self.on_key_gone(key);
        } else {
            self.quota_touch(key);
        }
    }

    /// The replica a lookup in model scope `mscope` must skip ([`NIL`] for none): its holders
    /// there are cleared but not removed yet.
    #[inline]
    pub(crate) fn cleared_replica(&self, mscope: u32) -> u32 {
        match &self.clear {
            Some(c) if c.mscope == mscope => c.replica,
            _ => NIL,
        }
    }

    /// [`Self::cleared_replica`] for a lookup in keyspace `ks`.
    #[inline]
    pub(crate) fn cleared_in_keyspace(&self, ks: u32) -> u32 {
        if self.clear.is_none() {
            return NIL;
        }
        let scope = self.cat.keyspaces[ks as usize].scope;
        self.cleared_replica(self.cat.scopes[scope as usize].mscope)
    }

    /// Keys of model scope `mscope` a pending clear will remove that the key counts still
    /// hold: all of them when no replica serves in the model scope any more (each key left
    /// has a holder of a serving replica), else none that matters to whether it has keys.
    pub(crate) fn keys_going_with_clear(&self, mscope: u32) -> u64 {
        let Some(c) = &self.clear else {
            return 0;
        };
        if c.mscope != mscope {
            return 0;
        }
        let m = &self.cat.models[mscope as usize];
        let serving = m
            .scopes
            .iter()
            .any(|s| !self.cat.scopes[*s as usize].serving.is_empty());
        if serving { 0 } else { m.prefixes }
    }

    /// [`Self::keys_going_with_clear`] of the model scope a pending clear is in, if that is
    /// one of `tenant`'s.
    pub(crate) fn tenant_keys_going_with_clear(&self, tenant: u32) -> u64 {
        match &self.clear {
            Some(c) if self.cat.models[c.mscope as usize].tenant == tenant => {
                self.keys_going_with_clear(c.mscope)
            }
            _ => 0,
        }
    }

    /// Holders a pending clear has not removed yet (they are no longer entries).
    pub(crate) fn cleared_holders_left(&self) -> u64 {
        self.clear.as_ref().map_or(0, |c| c.remaining)
    }
}
