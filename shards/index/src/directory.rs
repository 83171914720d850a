//! Cross-core facts no single core can answer (docs/BEHAVIOUR.md §7.1, §7.2, §8.5), shared by all
//! cores through an `Arc<Directory>`:
//!
//! 1. does tenant T hold any prefix key on any core (UNKNOWN_TENANT);
//! 2. is every core's prefix map empty, reserved entries included (cold-start carve-out);
//! 3. the global count of non-reserved storage entries (global cap);
//! 4. the per-tenant count of distinct prefix keys across cores (tenant quota).
//!
//! Cores push counter deltas once per operation (ingest, event, sweep, eviction batch); every
//! read is a plain atomic load, so the lookup path never blocks.
//!
//! Entry counts (facts 2 and 3): each index writes its own [`EntryCounter`] slot, with plain
//! stores: a removal event pushes its delta once per event, and two locked adds per event were
//! ~7% of a removal (perf/runs/2026-12-07-table-removals.md). Readers sum the claimed slots
//! (the cap's paths, one slot per core); the cold-start test reads one count of non-empty slots.
//! Past [`ENTRY_SLOTS`] indexes on one directory, the rest share one slot with locked adds.
//!
//! Tenant table: a fixed-capacity open-addressing array of slots. A tenant is identified by a
//! 128-bit XXH3 fingerprint of its name (no strings are stored, so memory is fixed at
//! construction); the chance that two live tenants collide is ~n²/2¹²⁹, negligible for any real
//! tenant count. Each slot packs `state | generation | count` in one `AtomicU64`:
//! * reads and count changes that stay above zero are lock-free (find + CAS on the word);
//! * a tenant's first key (slot claim) and its last key going away (slot retire, reclaiming the
//!   slot as a tombstone that later claims reuse) take a small mutex, so two cores can never
//!   claim two slots for one tenant. A concurrent lock-free updater whose slot is retired sees
//!   the generation change, its CAS fails and it retries through the slow path: race-free.
//! * a reader validates the slot's generation before and after reading the fingerprint
//!   (seqlock), so it never attributes a count to the wrong tenant.
//!
//! If more than `capacity` tenants are live at once, the extra tenants are counted exactly in an
//! overflow map under the slow-path mutex. While that map is non-empty,
//! [`Directory::is_saturated`] is true and the lookup path (which never takes the mutex) treats
//! tenants absent from the table as known, so it never answers UNKNOWN_TENANT wrongly; quota
//! enforcement (ingest path) reads the exact count with [`Directory::tenant_keys_exact`]. The
//! state clears as soon as the overflowing tenants drain.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

const STATE_SHIFT: u32 = 62;
const GEN_SHIFT: u32 = 40;
const GEN_MASK: u64 = (1 << 22) - 1;
const COUNT_MASK: u64 = (1 << 40) - 1;
const EMPTY: u64 = 0;
const LIVE: u64 = 1;
const TOMB: u64 = 2;

/// Default number of tenant slots (fixed memory: 24 bytes each).
pub const DEFAULT_TENANT_CAPACITY: usize = 1 << 16;

/// Indexes (cores) of one directory that get an entry-count slot of their own (fixed memory:
/// 64 bytes each); more share one slot (see [`EntryCounter`]).
pub const ENTRY_SLOTS: usize = 64;

fn state(w: u64) -> u64 {
    w >> STATE_SHIFT
}
fn generation(w: u64) -> u64 {
    (w >> GEN_SHIFT) & GEN_MASK
}
fn count(w: u64) -> u64 {
    w & COUNT_MASK
}
fn word(st: u64, g: u64, c: u64) -> u64 {
    debug_assert!(c <= COUNT_MASK);
    st << STATE_SHIFT | (g & GEN_MASK) << GEN_SHIFT | c
}

/// The table slot of a tenant's count, as [`Directory::add_tenant_keys_found`] returned it: a
/// core keeps it while its own part of the count stays above zero (see
/// [`Directory::add_tenant_keys_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantSlotHint(u32);

/// A tenant's identity in the directory: XXH3-128 of its name. Cores compute it once per tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TenantFp {
    hi: u64,
    lo: u64,
}

struct Slot {
    word: AtomicU64,
    hi: AtomicU64,
    lo: AtomicU64,
}

/// One index's entry counts, alone on its cache line (the owning core writes it on every
/// operation that changes them; other cores only read it).
#[derive(Default)]
#[repr(align(64))]
struct EntrySlot {
    total: AtomicI64,
    non_reserved: AtomicI64,
}

/// The right to write an entry-count slot of a [`Directory`], held by one index: not `Clone`,
/// and [`Directory::add_entries`] takes it by `&mut`, so each claimed slot has one writer at a
/// time, which may then update it with a plain load and store.
/// `None`: the directory's slots were all claimed, and this holder adds to the shared slot.
#[derive(Debug)]
pub struct EntryCounter(Option<usize>);

/// The shared cross-core counters. See the module docs for the protocol.
pub struct Directory {
    /// [`ENTRY_SLOTS`] slots; the first `entry_slots_claimed` are in use.
    entry_slots: Box<[EntrySlot]>,
    entry_slots_claimed: AtomicUsize,
    /// The entry counts of the holders of [`EntryCounter`]`(None)`, added with locked adds.
    shared_entries: EntrySlot,
    /// Claimed slots whose total is not zero: the cold-start test in one load.
    nonempty_slots: AtomicUsize,
    slots: Box<[Slot]>,
    mask: usize,
    /// Slow-path lock; guards claims/retires and the overflow counts of untracked tenants.
    slow: Mutex<HashMap<TenantFp, u64>>,
    /// Number of tenants in the overflow map (read lock-free by the lookup path).
    overflow_live: AtomicUsize,
}

impl Default for Directory {
    fn default() -> Self {
        Directory::new(DEFAULT_TENANT_CAPACITY)
    }
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("total_entries", &self.total_entries())
            .field("non_reserved_entries", &self.non_reserved_entries())
            .field("live_tenants", &self.live_tenants())
            .finish()
    }
}

impl Directory {
    /// A directory with room for `tenant_capacity` live tenants (rounded up to a power of two).
    pub fn new(tenant_capacity: usize) -> Directory {
        let cap = tenant_capacity.max(8).next_power_of_two();
        let slots = (0..cap)
            .map(|_| Slot {
                word: AtomicU64::new(0),
                hi: AtomicU64::new(0),
                lo: AtomicU64::new(0),
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Directory {
            entry_slots: (0..ENTRY_SLOTS).map(|_| EntrySlot::default()).collect(),
            entry_slots_claimed: AtomicUsize::new(0),
            shared_entries: EntrySlot::default(),
            nonempty_slots: AtomicUsize::new(0),
            slots,
            mask: cap - 1,
            slow: Mutex::new(HashMap::new()),
            overflow_live: AtomicUsize::new(0),
        }
    }

    /// The fingerprint under which a tenant's key count is kept.
    pub fn fingerprint(tenant: &str) -> TenantFp {
        let h = xxhash_rust::xxh3::xxh3_128_with_seed(tenant.as_bytes(), 0x1c_d1_7e_c7);
        TenantFp {
            hi: (h >> 64) as u64,
            lo: h as u64,
        }
    }

    /// A slot for one index's entry counts (see [`EntryCounter`]).
    pub fn entry_counter(&self) -> EntryCounter {
        let i = self.entry_slots_claimed.fetch_add(1, Ordering::AcqRel);
        if i < ENTRY_SLOTS {
            EntryCounter(Some(i))
        } else {
            self.entry_slots_claimed
                .store(ENTRY_SLOTS, Ordering::Release);
            EntryCounter(None)
        }
    }

    /// The claimed slots, then the shared one.
    fn entry_slots(&self) -> impl Iterator<Item = &EntrySlot> {
        let claimed = self
            .entry_slots_claimed
            .load(Ordering::Acquire)
            .min(ENTRY_SLOTS);
        self.entry_slots[..claimed]
            .iter()
            .chain(std::iter::once(&self.shared_entries))
    }

    /// Storage entries on all cores, reserved (probe) entries included (a sum over the
    /// indexes' slots).
    pub fn total_entries(&self) -> i64 {
        (self.entry_slots())
            .map(|s| s.total.load(Ordering::Acquire))
            .sum()
    }

    /// Whether no core holds a storage entry, reserved entries included (cold start): one
    /// load of the count of non-empty slots, and one of the shared slot.
    pub fn holds_no_entries(&self) -> bool {
        self.nonempty_slots.load(Ordering::Acquire) == 0
            && self.shared_entries.total.load(Ordering::Acquire) == 0
    }

    /// Non-reserved storage entries on all cores: the quantity the global cap bounds (a sum
    /// over the indexes' slots).
    pub fn non_reserved_entries(&self) -> i64 {
        (self.entry_slots())
            .map(|s| s.non_reserved.load(Ordering::Acquire))
            .sum()
    }

    /// Applies an index's entry-count deltas to its slot.
    pub fn add_entries(
        &self,
        counter: &mut EntryCounter,
        total_delta: i64,
        non_reserved_delta: i64,
    ) {
        let Some(i) = counter.0 else {
            self.shared_entries
                .total
                .fetch_add(total_delta, Ordering::AcqRel);
            self.shared_entries
                .non_reserved
                .fetch_add(non_reserved_delta, Ordering::AcqRel);
            return;
        };
        let slot = &self.entry_slots[i];
        if total_delta != 0 {
            // One writer per slot (the holder of `counter`): no locked read-modify-write.
            let before = slot.total.load(Ordering::Relaxed);
            let after = before + total_delta;
            debug_assert!(after >= 0, "negative total entries");
            slot.total.store(after, Ordering::Release);
            if before == 0 {
                self.nonempty_slots.fetch_add(1, Ordering::AcqRel);
            } else if after == 0 {
                self.nonempty_slots.fetch_sub(1, Ordering::AcqRel);
            }
        }
        if non_reserved_delta != 0 {
            let before = slot.non_reserved.load(Ordering::Relaxed);
            debug_assert!(
                before + non_reserved_delta >= 0,
                "negative non-reserved entries"
            );
            slot.non_reserved
                .store(before + non_reserved_delta, Ordering::Release);
        }
    }

    /// True while some live tenant could not get a table slot (it is counted in the overflow
    /// map instead).
    pub fn is_saturated(&self) -> bool {
        self.overflow_live.load(Ordering::Acquire) > 0
    }

    /// Finds the live slot of `fp`: `(index, word)`.
    fn find(&self, fp: TenantFp) -> Option<(usize, u64)> {
        let mut i = (fp.lo as usize) & self.mask;
        for _ in 0..=self.mask {
            let s = &self.slots[i];
            loop {
                let w1 = s.word.load(Ordering::Acquire);
                match state(w1) {
                    EMPTY => return None,
                    LIVE => {
                        let hi = s.hi.load(Ordering::Acquire);
                        let lo = s.lo.load(Ordering::Acquire);
                        let w2 = s.word.load(Ordering::Acquire);
                        if state(w2) != LIVE || generation(w2) != generation(w1) {
                            continue; // the slot changed under us: re-read it
                        }
                        if hi == fp.hi && lo == fp.lo {
                            return Some((i, w2));
                        }
                        break;
                    }
                    _ => break,
                }
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Distinct prefix keys of a tenant across all cores, lock-free (0 when unknown, and for a
    /// tenant held in the overflow map: callers check [`Directory::is_saturated`]).
    pub fn tenant_keys(&self, fp: TenantFp) -> u64 {
        self.find(fp).map(|(_, w)| count(w)).unwrap_or(0)
    }

    /// Exact distinct key count, including overflow tenants (may take the slow-path lock when
    /// the table is saturated; ingest path only).
    pub fn tenant_keys_exact(&self, fp: TenantFp) -> u64 {
        if let Some((_, w)) = self.find(fp) {
            return count(w);
        }
        if !self.is_saturated() {
            return 0;
        }
        let overflow = self.slow.lock().unwrap_or_else(|e| e.into_inner());
        match self.find(fp) {
            Some((_, w)) => count(w),
            None => overflow.get(&fp).copied().unwrap_or(0),
        }
    }

    /// Applies a core's delta to a tenant's key count.
    pub fn add_tenant_keys(&self, fp: TenantFp, delta: i64) {
        if delta != 0 {
            self.add_tenant_keys_found(fp, delta);
        }
    }

    /// [`Directory::add_tenant_keys`] (`delta != 0`), returning the table slot that holds the
    /// tenant's count afterwards (None: retired, or counted in the overflow map). A core whose
    /// own count of the tenant's keys stays above zero may keep that slot as a
    /// [`TenantSlotHint`] for its next deltas.
    pub fn add_tenant_keys_found(&self, fp: TenantFp, delta: i64) -> Option<TenantSlotHint> {
        debug_assert_ne!(delta, 0);
        // Fast path: the slot exists and the count stays positive.
        if let Some((i, mut w)) = self.find(fp) {
            let s = &self.slots[i];
            loop {
                let c = count(w) as i64 + delta;
                if c <= 0 {
                    break; // retiring needs the slow path
                }
                let nw = word(LIVE, generation(w), c as u64);
                match s
                    .word
                    .compare_exchange_weak(w, nw, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => return Some(TenantSlotHint(i as u32)),
                    Err(actual) => {
                        if state(actual) != LIVE || generation(actual) != generation(w) {
                            break; // retired meanwhile
                        }
                        w = actual;
                    }
                }
            }
        }
        self.add_slow(fp, delta)
    }

    /// Applies a core's delta to a tenant's key count through the slot `hint` named, without
    /// finding the slot (the seqlock read of its fingerprint and the compare-and-swap loop of
    /// [`Directory::add_tenant_keys`]: most of a removal event's directory work).
    ///
    /// The caller guarantees, as the owner of `hint`: the hint was returned by
    /// [`Directory::add_tenant_keys_found`] for this tenant, and this core's own count of the
    /// tenant's keys, as pushed here, has stayed above zero ever since and stays so with
    /// `delta` (`own_after > 0`). Then the slot cannot have been retired (a count reaches zero
    /// only when every core's part does), so it is still this tenant's, and the count stays
    /// positive: one atomic add on the slot word changes only its count bits.
    pub fn add_tenant_keys_at(&self, hint: TenantSlotHint, delta: i64) {
        let s = &self.slots[hint.0 as usize];
        let before = s.word.fetch_add(delta as u64, Ordering::AcqRel);
        debug_assert!(
            state(before) == LIVE && count(before) as i64 + delta > 0,
            "a tenant slot hint used without this core's keys keeping the slot live"
        );
    }

    fn add_slow(&self, fp: TenantFp, delta: i64) -> Option<TenantSlotHint> {
        let mut overflow = self.slow.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = overflow.get_mut(&fp) {
            // An overflow tenant stays there until it drains, so its count never splits.
            let n = *c as i64 + delta;
            debug_assert!(n >= 0, "tenant key count below zero");
            if n <= 0 {
                overflow.remove(&fp);
                self.overflow_live.store(overflow.len(), Ordering::Release);
            } else {
                *c = n as u64;
            }
            return None;
        }
        if let Some((i, mut w)) = self.find(fp) {
            let s = &self.slots[i];
            loop {
                let c = count(w) as i64 + delta;
                debug_assert!(c >= 0, "tenant key count below zero");
                let nw = if c <= 0 {
                    word(TOMB, generation(w) + 1, 0)
                } else {
                    word(LIVE, generation(w), c as u64)
                };
                match s
                    .word
                    .compare_exchange(w, nw, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => return (c > 0).then_some(TenantSlotHint(i as u32)),
                    Err(actual) => w = actual, // only lock-free count changes can race here
                }
            }
        }
        if delta < 0 {
            debug_assert!(delta >= 0, "decrement of an absent tenant");
            return None;
        }
        // Claim the first tombstone or empty slot of the probe chain. Absence was just checked
        // under the lock, and claims only happen under the lock, so no duplicate can appear.
        let mut i = (fp.lo as usize) & self.mask;
        for _ in 0..=self.mask {
            let s = &self.slots[i];
            let w = s.word.load(Ordering::Acquire);
            if state(w) != LIVE {
                s.hi.store(fp.hi, Ordering::Release);
                s.lo.store(fp.lo, Ordering::Release);
                s.word.store(
                    word(LIVE, generation(w) + 1, delta as u64),
                    Ordering::Release,
                );
                return Some(TenantSlotHint(i as u32));
            }
            i = (i + 1) & self.mask;
        }
        // The table is full: count the tenant exactly in the overflow map.
        overflow.insert(fp, delta as u64);
        self.overflow_live.store(overflow.len(), Ordering::Release);
        None
    }

    /// Number of live tenant slots (tests and debugging; O(capacity)).
    pub fn live_tenants(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| state(s.word.load(Ordering::Acquire)) == LIVE)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn tenant_counts_and_reclaim() {
        let d = Directory::new(8);
        let a = Directory::fingerprint("a");
        let b = Directory::fingerprint("b");
        assert_eq!(d.tenant_keys(a), 0);
        d.add_tenant_keys(a, 3);
        d.add_tenant_keys(b, 1);
        assert_eq!(d.tenant_keys(a), 3);
        d.add_tenant_keys(a, -3);
        assert_eq!(d.tenant_keys(a), 0);
        assert_eq!(d.live_tenants(), 1);
        // Churn far more tenants than slots: reclaimed slots are reused.
        for i in 0..1000 {
            let f = Directory::fingerprint(&format!("t{i}"));
            d.add_tenant_keys(f, 2);
            assert_eq!(d.tenant_keys(f), 2);
            d.add_tenant_keys(f, -2);
        }
        assert!(!d.is_saturated());
        assert_eq!(d.tenant_keys(b), 1);
        assert_eq!(d.live_tenants(), 1);
    }

    #[test]
    fn concurrent_updates_are_exact() {
        let d = Arc::new(Directory::new(64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let d = d.clone();
                std::thread::spawn(move || {
                    let mut entries = d.entry_counter();
                    for i in 0..2000 {
                        let f = Directory::fingerprint(&format!("x{}", i % 5));
                        d.add_tenant_keys(f, 1);
                        d.add_tenant_keys(f, -1);
                        if i % 7 == 0 {
                            d.add_entries(&mut entries, 1, 1);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for i in 0..5 {
            assert_eq!(d.tenant_keys(Directory::fingerprint(&format!("x{i}"))), 0);
        }
        assert_eq!(d.live_tenants(), 0);
        assert_eq!(d.total_entries(), 4 * 286);
        assert_eq!(d.non_reserved_entries(), 4 * 286);
    }

    /// Each index writes its own slot with plain stores; the sums, the cold-start test and the
    /// shared slot of the indexes past [`ENTRY_SLOTS`] stay exact, with writers on several
    /// threads at once.
    #[test]
    fn entry_counts_are_exact_across_slots() {
        let d = Arc::new(Directory::new(8));
        assert!(d.holds_no_entries());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let d = d.clone();
                std::thread::spawn(move || {
                    // More counters than slots: the last ones share one.
                    let mut counters: Vec<_> = (0..ENTRY_SLOTS / 2 + 8)
                        .map(|_| d.entry_counter())
                        .collect();
                    for round in 0..50 {
                        for c in &mut counters {
                            d.add_entries(c, 2, 1);
                        }
                        for c in &mut counters {
                            d.add_entries(c, if round % 2 == 0 { -2 } else { -1 }, -1);
                        }
                    }
                    counters
                })
            })
            .collect();
        let mut counters: Vec<Vec<EntryCounter>> =
            threads.into_iter().map(|t| t.join().unwrap()).collect();
        let n = (4 * (ENTRY_SLOTS / 2 + 8)) as i64;
        let shared = counters.iter().flatten().filter(|c| c.0.is_none()).count();
        assert_eq!(shared as i64, n - ENTRY_SLOTS as i64);
        assert_eq!(d.total_entries(), n * 25);
        assert_eq!(d.non_reserved_entries(), 0);
        assert!(!d.holds_no_entries());
        // Every count back to zero: cold again.
        for c in counters.iter_mut().flatten() {
            d.add_entries(c, -25, 0);
        }
        assert_eq!(d.total_entries(), 0);
        assert!(d.holds_no_entries());
        // A reserved entry alone is not cold.
        d.add_entries(&mut counters[0][0], 1, 0);
        assert!(!d.holds_no_entries());
        assert_eq!(d.non_reserved_entries(), 0);
    }
}
