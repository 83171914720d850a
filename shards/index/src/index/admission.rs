//! Whether an update's new names and keyspaces fit this core (§4.2: an update that does not is
//! refused whole), decided in bounded steps.
//!
//! Counting every prefix as a new name and keyspace admits almost every update at once. Only
//! near a limit must the update's adapters be looked up one by one, and a 4 MiB message names
//! up to ~250,000 of them: in one step that took 0.38 ms of core time for 4,096 adapters and
//! 7.3 ms for 65,536 (issue 30, `examples/ingest_part_cost.rs`), a step whose length the client
//! chose. So the look-ups run [`ADMISSION_STEP_PREFIXES`] at a time, or until the part's
//! deadline, the part waiting between two steps (`IngestOutcome::admission_pending`; the server
//! runs each step as a maintenance piece). The scan remembers the new adapters it found by
//! their position in the update, so that each counts once: at most one more than the keyspaces
//! that fit, since past that the update is refused.
//!
//! Between two steps other updates may take or free room: the verdict is the room when the scan
//! ends against what the update adds, as a one-step check would give at that instant. Each later
//! part checks its own prefixes again when it applies (a part that no longer fits is refused with
//! the parts before it applied, §4.2).

use std::hash::BuildHasher;
use std::time::Instant;

use hashbrown::{DefaultHashBuilder, HashTable};
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};

use super::Index;

/// Adapters one step of the scan looks up at most (≈ 0.1 µs each, so ≈ 0.2 ms a step), and
/// the size up to which an update is first counted in one go (a few ns per prefix).
pub const ADMISSION_STEP_PREFIXES: usize = 2_048;
/// Prefixes the scan looks up between two reads of the clock.
const CLOCK_EVERY: usize = 64;
/// Prefixes counting goes through between two reads of the clock (a few ns each).
const COUNT_CLOCK_EVERY: usize = 1_024;

/// Whether `deadline` passed.
fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// The check of one part's names and keyspaces, kept by the caller across the steps of that
/// part (a fresh one for each update; it restarts by itself when the part's start moves on).
#[derive(Debug, Default)]
pub struct Admission {
    /// The first prefix of the part this check is for.
    start: usize,
    state: State,
    /// Whether this part's check already ran (or found no need for) a reclaim step.
    reclaimed: bool,
}

#[derive(Debug, Default)]
enum State {
    /// Nothing looked at yet.
    #[default]
    Start,
    /// A large update (over [`ADMISSION_STEP_PREFIXES`] prefixes): counting everything it may
    /// create as new, in steps.
    Counting(Scan),
    /// Looking the adapters up.
    Scanning(Scan),
    /// Found to fit: the part applies at its next attempt.
    Admitted,
}

/// What the scan has counted so far.
#[derive(Debug, Default)]
struct Scan {
    /// The next prefix to look at, relative to the checked prefixes.
    next: usize,
    /// The last prefix looked up: a run of one adapter costs one look-up.
    previous: Option<usize>,
    names: usize,
    name_bytes: usize,
    keyspaces: usize,
    /// The prefixes (positions in the checked prefixes) whose adapter was found new.
    seen: HashTable<u32>,
    hasher: DefaultHashBuilder,
}

/// One step's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admit {
    Fits,
    /// Not decided yet: the caller tries the part again in a later step.
    Pending,
    /// Refused whole: the string table (`true`) or the keyspaces would be over their limits.
    Refused {
        strings_full: bool,
    },
}

/// The adapter a prefix of `u` is stored under.
fn adapter_of<'a>(u: &'a CacheStateUpdate, p: &'a PrefixEntry) -> &'a str {
    if p.adapter_id.is_empty() {
        &u.adapter_id
    } else {
        &p.adapter_id
    }
}

/// The update's own names an ingest interns, and how many of them: tenant, model, replica and
/// scheme with a prefix applied; the first three for stats alone; none otherwise.
fn own_names(u: &CacheStateUpdate, prefixes: bool) -> ([&str; 4], usize) {
    let names = [
        u.tenant_id.as_str(),
        &u.model_id,
        &u.replica_id,
        &u.hash_scheme,
    ];
    let own = match (prefixes, u.stats.is_some()) {
        (true, _) => 4,
        (false, true) => 3,
        (false, false) => 0,
    };
    (names, own)
}

impl Index {
    /// One step of the check that `checked` (the whole update for its first part, else the
    /// part starting at `start`) fits this core's names and keyspaces; `prefixes`: whether any of
    /// it applies. Cheap checks first (everything counted as new, then a reclaim step if the
    /// tables are full); then the scan, in steps bounded by [`ADMISSION_STEP_PREFIXES`] and
    /// `deadline`. A check that needed a reclaim step or more than one scan step answers
    /// [`Admit::Pending`] even when it is decided, so that the part applies in a step of its own.
    pub(super) fn admit(
        &mut self,
        u: &CacheStateUpdate,
        checked: &[PrefixEntry],
        prefixes: bool,
        (start, deadline): (usize, Option<Instant>),
        admission: &mut Admission,
        now: i64,
    ) -> Admit {
        if admission.start != start {
            *admission = Admission {
                start,
                ..Admission::default()
            };
        }
        let mut steps_before = 0;
        match &mut admission.state {
            State::Admitted => return Admit::Fits,
            State::Scanning(_) => steps_before = 1,
            State::Start if checked.len() > ADMISSION_STEP_PREFIXES => {
                let (names, own) = own_names(u, prefixes);
                admission.state = State::Counting(Scan {
                    names: own,
                    name_bytes: names[..own].iter().map(|s| s.len()).sum(),
                    ..Scan::default()
                });
                return self.admit(u, checked, prefixes, (start, deadline), admission, now);
            }
            State::Counting(count) => {
                steps_before = usize::from(count.next > 0);
                let Some(fits) = self.count_step(u, checked, prefixes, count, deadline) else {
                    return Admit::Pending;
                };
                if fits {
                    admission.state = State::Admitted;
                    return if steps_before == 0 && !past(deadline) {
                        Admit::Fits
                    } else {
                        Admit::Pending
                    };
                }
                admission.state = State::Start;
                steps_before = 1;
                if let Some(verdict) = self.before_scan(u, prefixes, admission, now) {
                    return verdict;
                }
            }
            State::Start => {
                if self.fits_counting_all_new(u, checked, prefixes) {
                    admission.state = State::Admitted;
                    return Admit::Fits;
                }
                if let Some(verdict) = self.before_scan(u, prefixes, admission, now) {
                    return verdict;
                }
            }
        }
        let State::Scanning(scan) = &mut admission.state else {
            unreachable!("scanning")
        };
        let first_step = scan.next == 0 && steps_before == 0;
        match self.scan_step(u, checked, prefixes, scan, deadline) {
            None => Admit::Pending,
            Some(Err(strings_full)) => Admit::Refused { strings_full },
            Some(Ok(())) if first_step && !past(deadline) => {
                admission.state = State::Admitted;
                Admit::Fits
            }
            Some(Ok(())) => {
                admission.state = State::Admitted;
                Admit::Pending
            }
        }
    }

    /// Once counting everything as new did not admit the update: a reclaim step first, if the
    /// check has not run one (the verdict is then [`Admit::Pending`]: the step is spent), then
    /// the scan begins.
    fn before_scan(
        &mut self,
        u: &CacheStateUpdate,
        prefixes: bool,
        admission: &mut Admission,
        now: i64,
    ) -> Option<Admit> {
        if !admission.reclaimed {
            admission.reclaimed = true;
            if self.reclaim_on_full(now) {
                return Some(Admit::Pending);
            }
        }
        admission.state = State::Scanning(self.scan_fixed_names(u, prefixes));
        None
    }

    /// One step of counting a large update's names and keyspaces as if all were new, from
    /// `count.next` until `deadline` (the clock read every [`COUNT_CLOCK_EVERY`] prefixes):
    /// `None` when not done, else whether it fits so counted.
    fn count_step(
        &self,
        u: &CacheStateUpdate,
        checked: &[PrefixEntry],
        prefixes: bool,
        count: &mut Scan,
        deadline: Option<Instant>,
    ) -> Option<bool> {
        if prefixes {
            while count.next < checked.len() {
                let p = &checked[count.next];
                count.next += 1;
                if Self::prefix_applies(p) {
                    count.names += 1;
                    count.name_bytes += adapter_of(u, p).len();
                    count.keyspaces += 1;
                }
                if count.next.is_multiple_of(COUNT_CLOCK_EVERY) && past(deadline) {
                    return None;
                }
            }
        }
        Some(self.scan_fits(u, count).is_ok())
    }

    /// Whether `checked` fits even if every name and keyspace it may create were new, or, when
    /// all its prefixes are in the update's own adapter, with that one adapter looked up.
    /// O(prefixes) additions, no look-up per prefix.
    fn fits_counting_all_new(
        &self,
        u: &CacheStateUpdate,
        checked: &[PrefixEntry],
        prefixes: bool,
    ) -> bool {
        let strings = &self.cat.strings;
        let (names, own) = own_names(u, prefixes);
        let applied = || checked.iter().filter(|p| Self::prefix_applies(p));
        let (mut n, mut bytes) = (own, names[..own].iter().map(|s| s.len()).sum::<usize>());
        let mut keyspaces = 0;
        if prefixes {
            n += checked.len();
            bytes += applied().map(|p| adapter_of(u, p).len()).sum::<usize>();
            keyspaces = applied().count();
        }
        let names_fit = n <= strings.room() && bytes <= strings.room_bytes();
        if names_fit && self.keyspaces_fit(u, keyspaces) {
            return true;
        }
        if !prefixes || !applied().all(|p| p.adapter_id.is_empty()) {
            return false;
        }
        // The common case: every prefix in the update's own adapter (or none).
        let mut scan = self.scan_fixed_names(u, prefixes);
        let adapter = u.adapter_id.as_str();
        if strings.get(adapter).is_none() {
            scan.names += 1;
            scan.name_bytes += adapter.len();
        }
        let known = self
            .cat
            .find_scope(&u.tenant_id, &u.model_id, &u.hash_scheme)
            .and_then(|s| self.cat.find_keyspace(s, adapter))
            .is_some();
        scan.keyspaces = usize::from(!known);
        self.scan_fits(u, &scan).is_ok()
    }

    /// A scan that counted the update's own names not in the string table yet.
    fn scan_fixed_names(&self, u: &CacheStateUpdate, prefixes: bool) -> Scan {
        let (names, own) = own_names(u, prefixes);
        let mut scan = Scan::default();
        for s in names[..own]
            .iter()
            .filter(|s| self.cat.strings.get(s).is_none())
        {
            scan.names += 1;
            scan.name_bytes += s.len();
        }
        scan
    }

    /// Whether `keyspaces` new keyspaces of `u`'s `(tenant, model)` fit the per-model and the
    /// per-core limits.
    fn keyspaces_fit(&self, u: &CacheStateUpdate, keyspaces: usize) -> bool {
        if keyspaces == 0 {
            return true;
        }
        let have_model = self
            .cat
            .find_model(&u.tenant_id, &u.model_id)
            .map_or(0, |m| self.cat.models[m as usize].keyspaces as usize);
        have_model + keyspaces <= self.cfg.max_keyspaces_per_model
            && self.cat.live_keyspaces + keyspaces <= self.cfg.max_keyspaces
    }

    /// `Ok` when what `scan` counted fits; `Err(true)` when the names do not, `Err(false)` when
    /// only the keyspaces do not.
    fn scan_fits(&self, u: &CacheStateUpdate, scan: &Scan) -> Result<(), bool> {
        let strings = &self.cat.strings;
        if scan.names > strings.room() || scan.name_bytes > strings.room_bytes() {
            Err(true)
        } else if !self.keyspaces_fit(u, scan.keyspaces) {
            Err(false)
        } else {
            Ok(())
        }
    }

    /// Looks up the adapters of `checked` from `scan.next`, at most [`ADMISSION_STEP_PREFIXES`]
    /// and until `deadline`: `None` when not done, else whether everything counted fits (as
    /// [`Self::scan_fits`]). Stops at the first adapter over a limit.
    fn scan_step(
        &self,
        u: &CacheStateUpdate,
        checked: &[PrefixEntry],
        prefixes: bool,
        scan: &mut Scan,
        deadline: Option<Instant>,
    ) -> Option<Result<(), bool>> {
        if !prefixes {
            return Some(self.scan_fits(u, scan));
        }
        let scope = self
            .cat
            .find_scope(&u.tenant_id, &u.model_id, &u.hash_scheme);
        let (mut looked_up, mut visited) = (0usize, 0usize);
        while scan.next < checked.len() {
            let i = scan.next;
            visited += 1;
            if looked_up == ADMISSION_STEP_PREFIXES
                || (visited.is_multiple_of(COUNT_CLOCK_EVERY) && past(deadline))
            {
                return None;
            }
            scan.next += 1;
            let p = &checked[i];
            if !Self::prefix_applies(p) {
                continue;
            }
            let adapter = adapter_of(u, p);
            if let Some(j) = scan.previous.replace(i)
                && adapter_of(u, &checked[j]) == adapter
            {
                continue;
            }
            looked_up += 1;
            if looked_up.is_multiple_of(CLOCK_EVERY) && past(deadline) {
                scan.next = i;
                scan.previous = None;
                return None;
            }
            let hash = scan.hasher.hash_one(adapter);
            let same = |j: &u32| adapter_of(u, &checked[*j as usize]) == adapter;
            if scan.seen.find(hash, same).is_some() {
                continue;
            }
            let new_name = self.cat.strings.get(adapter).is_none();
            let known = !new_name
                && scope
                    .and_then(|s| self.cat.find_keyspace(s, adapter))
                    .is_some();
            if known {
                continue;
            }
            let hasher = &scan.hasher;
            scan.seen.insert_unique(hash, i as u32, |j| {
                hasher.hash_one(adapter_of(u, &checked[*j as usize]))
            });
            if new_name {
                scan.names += 1;
                scan.name_bytes += adapter.len();
            }
            scan.keyspaces += 1;
            if let Err(strings_full) = self.scan_fits(u, scan) {
                return Some(Err(strings_full));
            }
        }
        (scan.next >= checked.len()).then(|| self.scan_fits(u, scan))
    }
}
