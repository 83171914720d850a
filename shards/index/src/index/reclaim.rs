//! The reclaim pass: frees every keyspace without keys, every scope without keyspaces and
//! serving replicas, every model scope without scopes and stats rows, every tenant record
//! without model scopes, then every interned name nothing refers to any more (issue 30: no
//! client can wedge a core).
//!
//! A client decides how many records and names there are (a producer that sends 4,096 new
//! adapter ids per message makes a million keyspaces in a few minutes), so the pass runs in the
//! same time-budgeted slices as the TTL sweep, and each step is O(1) per record or name: a
//! keyspace leaves its scope's list by `swap_remove` at the position it keeps (`slot`), a scope
//! leaves its model scope's list the same way.
//!
//! Between two slices anything may change. Stages, each a cursor over one table:
//!
//! 1. *Unlink* dead keyspaces, then dead scopes, then dead model scopes (and a tenant record
//!    with its last model scope). An unlinked record is no longer found by name (the next
//!    creation makes a new one) but keeps the fields the eviction heaps' comparators read, and
//!    its id is not reused yet. A record that gains keys again before the cursor reaches it is
//!    simply not dead; one that dies behind the cursor waits for the next pass
//!    (`Index::reclaimable` counts it).
//! 2. Drop the entries gauge's published zeros.
//! 3. *Mark* the names the linked records refer to, with a write barrier: while marking, every
//!    `Strings::intern` marks the id it returns, and `intern` is the only way a record, entry or
//!    stats row comes to name a string. So a name not marked when the marking ends had no
//!    reference when its records were visited and gained none since.
//! 4. *Unlink* every live name that is not marked and that the entries gauge does not hold (a
//!    non-zero or unpublished count): no longer found, still readable.
//! 5. *Release*: drop every cached snapshot that may still name an unlinked id (the cap heap is
//!    retired, its blob references given back in the cap build's slices; so are the quota
//!    heaps'; the last lookup's buffers), then put the unlinked ids on their free lists and give back the
//!    names' bytes. Nothing created after that drop can name an unlinked id, so the release
//!    itself is sliced too.

use super::eviction::BudgetMeter;
use super::{DEAD, Index, SweepBudget};
use hashbrown::HashMap;

/// A reclaim pass in progress ([`Index::reclaim_step`]).
pub(crate) struct ReclaimPass {
    stage: Stage,
    /// The next record, name, gauge zero or released id the stage visits.
    cursor: usize,
    /// The stage's table length when it began: it visits no further, so records created
    /// while it runs cannot keep it going (they are the next pass's; names interned while
    /// marking are marked by `intern`).
    end: usize,
    /// The gauge's published zeros, taken when the pass began.
    zeros: Vec<u32>,
    /// Unlinked ids, released in the last stage.
    keyspaces: Vec<u32>,
    scopes: Vec<u32>,
    models: Vec<u32>,
    strings: Vec<u32>,
    /// The snapshots that may name an unlinked id were dropped (release stage).
    dropped_snapshots: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Keyspaces,
    Scopes,
    Models,
    GaugeZeros,
    MarkModels,
    MarkScopes,
    MarkKeyspaces,
    Strings,
    Release,
}

impl Stage {
    fn next(self) -> Option<Stage> {
        use Stage::*;
        Some(match self {
            Keyspaces => Scopes,
            Scopes => Models,
            Models => GaugeZeros,
            GaugeZeros => MarkModels,
            MarkModels => MarkScopes,
            MarkScopes => MarkKeyspaces,
            MarkKeyspaces => Strings,
            Strings => Release,
            Release => return None,
        })
    }
}

impl Index {
    /// One slice of the reclaim pass (begun here if none is in progress), within `budget`.
    /// Returns the number of names the pass freed once it finished, `None` while it is not.
    pub fn reclaim_step(&mut self, budget: SweepBudget) -> Option<u64> {
        self.finish_clear();
        let mut meter = budget.meter();
        let mut work = 0;
        self.reclaim_slice(&mut meter, &mut work)
    }

    /// Whether a reclaim pass was begun and has not finished.
    pub fn reclaim_in_progress(&self) -> bool {
        self.reclaim_pass.is_some()
    }

    /// Runs the pass in progress (or a new one) until `meter` says the slice is spent; `work`
    /// counts the records, names and ids visited (with what the caller did before).
    pub(crate) fn reclaim_slice(
        &mut self,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> Option<u64> {
        self.flush();
        let mut pass = match self.reclaim_pass.take() {
            Some(p) => p,
            None => self.reclaim_begin(),
        };
        loop {
            let finished = match pass.stage {
                Stage::Keyspaces => self.unlink_keyspaces(&mut pass, meter, work),
                Stage::Scopes => self.unlink_scopes(&mut pass, meter, work),
                Stage::Models => self.unlink_models(&mut pass, meter, work),
                Stage::GaugeZeros => self.drop_gauge_zeros(&mut pass, meter, work),
                Stage::MarkModels => self.mark_models(&mut pass, meter, work),
                Stage::MarkScopes => self.mark_scopes(&mut pass, meter, work),
                Stage::MarkKeyspaces => self.mark_keyspaces(&mut pass, meter, work),
                Stage::Strings => self.unlink_strings(&mut pass, meter, work),
                Stage::Release => self.release_unlinked(&mut pass, meter, work),
            };
            if !finished {
                self.reclaim_pass = Some(pass);
                return None;
            }
            match pass.stage.next() {
                Some(next) => {
                    if next == Stage::MarkModels {
                        self.cat.strings.begin_marking();
                    }
                    pass.stage = next;
                    pass.cursor = 0;
                    pass.end = self.stage_len(&pass);
                    self.reserve_for_stage(&mut pass);
                }
                None => return Some(pass.strings.len() as u64),
            }
        }
    }

    /// The length of the table the pass's stage visits.
    fn stage_len(&self, pass: &ReclaimPass) -> usize {
        match pass.stage {
            Stage::Keyspaces | Stage::MarkKeyspaces => self.cat.keyspaces.len(),
            Stage::Scopes | Stage::MarkScopes => self.cat.scopes.len(),
            Stage::Models | Stage::MarkModels => self.cat.models.len(),
            Stage::GaugeZeros => pass.zeros.len(),
            Stage::Strings => self.cat.strings.slots(),
            Stage::Release => {
                pass.keyspaces.len() + pass.scopes.len() + pass.models.len() + pass.strings.len()
            }
        }
    }

    /// Reserves, when a stage begins, the room its lists may need, so no push in the middle of
    /// a slice doubles a list of a million ids (a copy and fresh pages, milliseconds, in one
    /// step). Address space only: the pages are touched as the ids arrive.
    fn reserve_for_stage(&mut self, pass: &mut ReclaimPass) {
        let end = pass.end;
        match pass.stage {
            Stage::Keyspaces => pass.keyspaces.reserve(end),
            Stage::Scopes => pass.scopes.reserve(end),
            Stage::Models => pass.models.reserve(end),
            Stage::Strings => pass.strings.reserve(end),
            Stage::Release => {
                self.cat.keyspace_free.reserve(pass.keyspaces.len());
                self.cat.scope_free.reserve(pass.scopes.len());
                self.cat.model_free.reserve(pass.models.len());
                self.cat.strings.reserve_free(pass.strings.len());
            }
            _ => {}
        }
    }

    fn reclaim_begin(&mut self) -> ReclaimPass {
        self.reclaimable = 0;
        ReclaimPass {
            stage: Stage::Keyspaces,
            cursor: 0,
            end: self.cat.keyspaces.len(),
            zeros: std::mem::take(&mut self.gauge.zeros),
            keyspaces: Vec::with_capacity(self.cat.keyspaces.len()),
            scopes: Vec::new(),
            models: Vec::new(),
            strings: Vec::new(),
            dropped_snapshots: false,
        }
    }

    /// Stage 1a: keyspaces without keys leave their scope.
    fn unlink_keyspaces(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let k = pass.cursor as u32;
            pass.cursor += 1;
            let r = &self.cat.keyspaces[k as usize];
            if r.slot != DEAD && r.keys == 0 {
                self.unlink_keyspace(k);
                pass.keyspaces.push(k);
            }
        }
        true
    }

    fn unlink_keyspace(&mut self, k: u32) {
        let cat = &mut self.cat;
        cat.bump_epoch();
        let r = &mut cat.keyspaces[k as usize];
        let (scope, adapter, slot) = (r.scope, r.adapter, r.slot as usize);
        r.slot = DEAD;
        cat.keyspace_ids.remove(&(scope, adapter));
        let s = &mut cat.scopes[scope as usize];
        s.keyspaces.swap_remove(slot);
        if let Some(&moved) = s.keyspaces.get(slot) {
            cat.keyspaces[moved as usize].slot = slot as u32;
        }
        let mscope = s.mscope;
        cat.models[mscope as usize].keyspaces -= 1;
        cat.live_keyspaces -= 1;
    }

    /// Stage 1b: scopes without keyspaces and serving replicas leave their model scope.
    fn unlink_scopes(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let s = pass.cursor as u32;
            pass.cursor += 1;
            let r = &self.cat.scopes[s as usize];
            if r.slot != DEAD && r.keyspaces.is_empty() && r.serving.is_empty() {
                self.unlink_scope(s);
                pass.scopes.push(s);
            }
        }
        true
    }

    fn unlink_scope(&mut self, s: u32) {
        let cat = &mut self.cat;
        cat.bump_epoch();
        let r = &mut cat.scopes[s as usize];
        let (key, mscope, slot) = ((r.tenant, r.model, r.scheme), r.mscope, r.slot as usize);
        r.slot = DEAD;
        r.serving = Default::default();
        r.sorted = Vec::new();
        r.keyspaces = Vec::new();
        cat.scope_ids.remove(&key);
        let list = &mut cat.models[mscope as usize].scopes;
        list.swap_remove(slot);
        if let Some(&moved) = list.get(slot) {
            cat.scopes[moved as usize].slot = slot as u32;
        }
    }

    /// Stage 1c: model scopes without scopes and stats rows, and a tenant record with its last
    /// model scope. Nothing the comparators read names a model scope, so its fields go at once.
    fn unlink_models(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let m = pass.cursor as u32;
            pass.cursor += 1;
            let r = &self.cat.models[m as usize];
            if r.tenant == DEAD || !r.scopes.is_empty() || !r.stats.is_empty() {
                continue;
            }
            let (tenant, model) = (r.tenant, r.model);
            self.cat.bump_epoch();
            self.cat.model_ids.remove(&(tenant, model));
            let r = &mut self.cat.models[m as usize];
            r.tenant = DEAD;
            r.model = DEAD;
            r.stats = HashMap::new();
            r.scopes = Vec::new();
            let t = self.cat.tenants.get_mut(&tenant).expect("tenant record");
            t.models -= 1;
            if t.models == 0 {
                self.cat.tenants.remove(&tenant);
            }
            pass.models.push(m);
        }
        true
    }

    /// Stage 2: the gauge forgets models whose 0 was published and that stayed at 0.
    fn drop_gauge_zeros(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let m = pass.zeros[pass.cursor];
            pass.cursor += 1;
            if let Some(e) = self.gauge.counts.get_mut(&m) {
                e.2 = false;
                if e.0 == 0 && !e.1 {
                    self.gauge.counts.remove(&m);
                }
            }
        }
        pass.zeros = Vec::new();
        true
    }

    /// Stage 3a: names of the linked model scopes (tenant, model, stats rows' replicas: at most
    /// `max_stats_rows_per_model` per record).
    fn mark_models(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        let cat = &mut self.cat;
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            let r = &cat.models[pass.cursor];
            pass.cursor += 1;
            *work += 1 + r.stats.len();
            if r.tenant == DEAD {
                continue;
            }
            cat.strings.mark(r.tenant);
            cat.strings.mark(r.model);
            for rep in r.stats.keys() {
                cat.strings.mark(*rep);
            }
        }
        true
    }

    /// Stage 3b: names of the linked scopes (tenant, model, scheme, serving replicas).
    fn mark_scopes(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        let cat = &mut self.cat;
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            let r = &cat.scopes[pass.cursor];
            pass.cursor += 1;
            *work += 1 + r.sorted.len();
            if r.slot == DEAD {
                continue;
            }
            cat.strings.mark(r.tenant);
            cat.strings.mark(r.model);
            cat.strings.mark(r.scheme);
            for rep in &r.sorted {
                cat.strings.mark(*rep);
            }
        }
        true
    }

    /// Stage 3c: adapters of the linked keyspaces.
    fn mark_keyspaces(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        let cat = &mut self.cat;
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let r = &cat.keyspaces[pass.cursor];
            pass.cursor += 1;
            if r.slot != DEAD {
                cat.strings.mark(r.adapter);
            }
        }
        true
    }

    /// Stage 4: unmarked live names the gauge does not hold are unlinked (a gauge entry of a
    /// published 0 goes with its name). Marking ends with the stage.
    fn unlink_strings(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        while pass.cursor < pass.end {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let id = pass.cursor as u32;
            pass.cursor += 1;
            if !self.cat.strings.is_live(id) || self.cat.strings.is_marked(id) {
                continue;
            }
            match self.gauge.counts.get(&id) {
                Some((c, dirty, _)) if *c > 0 || *dirty => continue,
                Some(_) => {
                    self.gauge.counts.remove(&id);
                }
                None => {}
            }
            self.cat.unlink_string(id);
            pass.strings.push(id);
        }
        self.cat.strings.end_marking();
        true
    }

    /// Stage 5: drops the snapshots that may name an unlinked id (once), then releases the ids.
    fn release_unlinked(
        &mut self,
        pass: &mut ReclaimPass,
        meter: &mut BudgetMeter,
        work: &mut usize,
    ) -> bool {
        let unlinked = pass.end;
        if unlinked == 0 {
            return true;
        }
        if !pass.dropped_snapshots {
            pass.dropped_snapshots = true;
            self.cap_forget();
            self.quota_retire_all();
            self.reset_last();
        }
        while pass.cursor < unlinked {
            if meter.spent(*work) {
                return false;
            }
            *work += 1;
            let mut i = pass.cursor;
            pass.cursor += 1;
            let cat = &mut self.cat;
            if i < pass.keyspaces.len() {
                cat.keyspace_free.push(pass.keyspaces[i]);
                continue;
            }
            i -= pass.keyspaces.len();
            if i < pass.scopes.len() {
                cat.scope_free.push(pass.scopes[i]);
                continue;
            }
            i -= pass.scopes.len();
            if i < pass.models.len() {
                cat.model_free.push(pass.models[i]);
                continue;
            }
            i -= pass.models.len();
            cat.strings.release(pass.strings[i]);
        }
        true
    }
}

impl Index {
    /// Linked keyspaces on this core (bounded by `IndexConfig::max_keyspaces`).
    pub fn keyspace_count(&self) -> usize {
        self.cat.live_keyspaces
    }

    /// Linked keyspaces of one `(tenant, model)` (bounded by
    /// `IndexConfig::max_keyspaces_per_model`).
    pub fn model_keyspace_count(&self, tenant: &str, model: &str) -> usize {
        self.cat
            .find_model(tenant, model)
            .map_or(0, |m| self.cat.models[m as usize].keyspaces as usize)
    }

    /// Checks the catalog's links and counts (tests, between any two operations or slices):
    /// every linked record is found by its names and sits at its `slot` in its parent's list,
    /// the keyspace counts add up, and every name a linked record, a stored entry or a stats
    /// row refers to is live. Panics on the first violation. O(records + entries).
    #[doc(hidden)]
    pub fn check_catalog(&self) {
        let cat = &self.cat;
        let live = |id: u32, what: &str| assert!(cat.strings.is_live(id), "{what} {id} not live");
        let mut per_model = vec![0u32; cat.models.len()];
        let mut linked = 0;
        for (k, r) in cat.keyspaces.iter().enumerate() {
            if r.slot == DEAD {
                continue;
            }
            linked += 1;
            let s = &cat.scopes[r.scope as usize];
            assert_ne!(s.slot, DEAD, "keyspace {k} in an unlinked scope");
            assert_eq!(s.keyspaces[r.slot as usize], k as u32, "keyspace {k} slot");
            assert_eq!(
                cat.keyspace_ids.get(&(r.scope, r.adapter)),
                Some(&(k as u32))
            );
            live(r.adapter, "adapter");
            per_model[s.mscope as usize] += 1;
        }
        assert_eq!(linked, cat.live_keyspaces, "core keyspace count");
        for (i, r) in cat.scopes.iter().enumerate() {
            if r.slot == DEAD {
                continue;
            }
            let m = &cat.models[r.mscope as usize];
            assert_ne!(m.tenant, DEAD, "scope {i} in a freed model scope");
            assert_eq!(m.scopes[r.slot as usize], i as u32, "scope {i} slot");
            assert_eq!(
                cat.scope_ids.get(&(r.tenant, r.model, r.scheme)),
                Some(&(i as u32))
            );
            assert_eq!(r.serving.len(), r.sorted.len());
            for x in [r.tenant, r.model, r.scheme].iter().chain(&r.sorted) {
                live(*x, "scope name");
            }
        }
        for (i, r) in cat.models.iter().enumerate() {
            if r.tenant == DEAD {
                continue;
            }
            assert_eq!(r.keyspaces, per_model[i], "model {i} keyspace count");
            assert_eq!(cat.model_ids.get(&(r.tenant, r.model)), Some(&(i as u32)));
            assert!(
                cat.tenants.contains_key(&r.tenant),
                "model {i} without tenant"
            );
            for x in [r.tenant, r.model].iter().chain(r.stats.keys()) {
                live(*x, "model name");
            }
        }
        for pos in self.store.places() {
            let key = self.store.key_at(pos);
            let ks = &cat.keyspaces[key.keyspace() as usize];
            assert_ne!(ks.slot, DEAD, "a key in an unlinked keyspace");
            for h in self.store.holders_uncounted(pos) {
                live(h.replica(), "holder");
            }
        }
    }
}
