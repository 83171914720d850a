//! The maintenance stress harness (issue 30): builds the worst shapes a client can make, runs
//! every maintenance task in the server's slices and records the most thread CPU one slice of
//! each task used. Shared by the `maintenance_stress` example (at scale, release build) and the
//! small `maintenance_stress_small` test (default `cargo test`).
#![allow(dead_code)] // each user takes one scale

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use inferencecache_index::index::{
    EntryCursor, Index, IndexConfig, PersistEntry, RestoreCache, SnapshotPartBuilder, SweepBudget,
};
use inferencecache_index::rules::{Eviction, TenantRules};
use inferencecache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, PrefixEntry, cache_event::Type,
};

pub const SEC: i64 = 1_000_000_000;
pub const MIN: i64 = 60 * SEC;
/// The stamp of the entries that expire at the sweep ("old") and of those that stay.
pub const OLD: i64 = 1_700_000_000 * SEC;
pub const NOW: i64 = OLD + 40 * MIN;

/// The server's slice budgets (src/limits.rs): sweep and cap build 250 µs / 16,384 entries,
/// snapshot 500 µs / 16,384 rows.
const SLICE: Duration = Duration::from_micros(250);
const SLICE_ENTRIES: usize = 16_384;
const SNAPSHOT_SLICE: Duration = Duration::from_micros(500);
const SNAPSHOT_STEP: usize = 256;

/// Sizes of the shapes; [`Scale::full`] is the issue's.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    /// Entries of the plain shape (one holder per key, 8 tenants × 8 models).
    pub entries: usize,
    /// Keyspaces (adapters) in one scope.
    pub keyspaces: usize,
    /// Distinct names (replicas, 1,000 per model).
    pub names: usize,
    /// Keys each held by `holders` replicas.
    pub held_keys: usize,
    pub holders: usize,
}

impl Scale {
    pub fn full() -> Scale {
        Scale {
            entries: 10_000_000,
            keyspaces: 1_000_000,
            names: 1_000_000,
            held_keys: 10_000,
            holders: 1024,
        }
    }
    pub fn small() -> Scale {
        Scale {
            entries: 200_000,
            keyspaces: 50_000,
            names: 50_000,
            held_keys: 200,
            holders: 1024,
        }
    }
}

/// Tenants `old-*` expire after 30 minutes (their entries are stamped 40 minutes ago); LFU for
/// `lfu-*`; the policy "churns" by flipping the algorithm of `flip-*` between passes. Tenant
/// [`QUOTA_TENANT`] has a quota of `quota` keys (none while 0).
pub struct Rules {
    pub flipped: bool,
    pub quota: u64,
}

/// The tenant of the `quota` shape.
pub const QUOTA_TENANT: &str = "quota";

impl TenantRules for Rules {
    fn ttl_ns(&self, _: &str) -> i64 {
        30 * MIN
    }
    fn eviction(&self, tenant: &str) -> Eviction {
        if tenant.starts_with("lfu") || (self.flipped && tenant.ends_with('1')) {
            Eviction::Lfu
        } else {
            Eviction::Lru
        }
    }
    fn quota(&self, tenant: &str) -> Option<u64> {
        (tenant == QUOTA_TENANT && self.quota > 0).then_some(self.quota)
    }
}

/// The most thread CPU (and wall) one slice of each task used, and its slice count.
#[derive(Default, Debug)]
pub struct Report {
    pub tasks: BTreeMap<&'static str, (Duration, Duration, u64)>,
    /// The same per shape and task (`shape/task`).
    pub by_shape: BTreeMap<String, (Duration, Duration, u64)>,
    /// Every slice over [`SLOW_SLICE`] of thread CPU, with what the kernel says the thread did
    /// in it (the diagnosis of the rare slow slice).
    pub slow: Vec<SlowSlice>,
    /// Steps measured for comparison, not slices of maintenance (not asserted on): `what`,
    /// thread CPU.
    pub notes: Vec<(String, Duration)>,
    shape: &'static str,
}

/// A slice is listed in [`Report::slow`] above this much thread CPU.
pub const SLOW_SLICE: Duration = Duration::from_micros(1000);

/// One slow slice: `getrusage(RUSAGE_THREAD)` deltas over it.
#[derive(Clone, Debug)]
pub struct SlowSlice {
    /// `shape/task` and the slice's number within that task.
    pub task: String,
    pub nth: u64,
    pub cpu: Duration,
    pub wall: Duration,
    /// User and system CPU of the thread over the slice (tick-granular in some kernels).
    pub user: Duration,
    pub sys: Duration,
    /// Minor and major page faults, voluntary and involuntary context switches.
    pub minflt: i64,
    pub majflt: i64,
    pub nvcsw: i64,
    pub nivcsw: i64,
}

/// `getrusage(RUSAGE_THREAD)`: user, system, minflt, majflt, nvcsw, nivcsw.
#[derive(Clone, Copy, Default)]
struct Usage {
    user: Duration,
    sys: Duration,
    minflt: i64,
    majflt: i64,
    nvcsw: i64,
    nivcsw: i64,
}

fn thread_usage() -> Usage {
    #[repr(C)]
    #[derive(Default)]
    struct Timeval {
        sec: i64,
        usec: i64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Rusage {
        utime: Timeval,
        stime: Timeval,
        // maxrss ixrss idrss isrss minflt majflt nswap inblock oublock msgsnd msgrcv nsignals
        // nvcsw nivcsw
        longs: [i64; 14],
    }
    unsafe extern "C" {
        fn getrusage(who: i32, usage: *mut Rusage) -> i32;
    }
    const RUSAGE_THREAD: i32 = 1;
    let mut r = Rusage::default();
    // SAFETY: getrusage writes one struct rusage into the valid local `r`.
    unsafe { getrusage(RUSAGE_THREAD, &mut r) };
    let tv = |t: &Timeval| Duration::new(t.sec as u64, (t.usec * 1000) as u32);
    Usage {
        user: tv(&r.utime),
        sys: tv(&r.stime),
        minflt: r.longs[4],
        majflt: r.longs[5],
        nvcsw: r.longs[12],
        nivcsw: r.longs[13],
    }
}

impl Report {
    fn record(&mut self, task: &'static str, cpu: Duration, wall: Duration) {
        let key = format!("{}/{task}", self.shape);
        for e in [
            self.tasks.entry(task).or_default(),
            self.by_shape.entry(key).or_default(),
        ] {
            e.0 = e.0.max(cpu);
            e.1 = e.1.max(wall);
            e.2 += 1;
        }
    }
    /// The task whose longest slice used the most CPU, with that time.
    pub fn worst(&self) -> Option<(&'static str, Duration)> {
        self.tasks
            .iter()
            .map(|(k, v)| (*k, v.0))
            .max_by_key(|(_, d)| *d)
    }
}

/// This thread's CPU time (Linux `CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu() -> Duration {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid local `ts`.
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.sec as u64, ts.nsec as u32)
}

fn timed<T>(report: &mut Report, task: &'static str, f: impl FnOnce() -> T) -> T {
    let u0 = thread_usage();
    let (t, c) = (Instant::now(), thread_cpu());
    let out = f();
    let (cpu, wall) = (thread_cpu() - c, t.elapsed());
    report.record(task, cpu, wall);
    if cpu > SLOW_SLICE {
        let u1 = thread_usage();
        let key = format!("{}/{task}", report.shape);
        let nth = report.by_shape.get(&key).map_or(0, |e| e.2);
        report.slow.push(SlowSlice {
            task: key,
            nth,
            cpu,
            wall,
            user: u1.user.saturating_sub(u0.user),
            sys: u1.sys.saturating_sub(u0.sys),
            minflt: u1.minflt - u0.minflt,
            majflt: u1.majflt - u0.majflt,
            nvcsw: u1.nvcsw - u0.nvcsw,
            nivcsw: u1.nivcsw - u0.nivcsw,
        });
    }
    out
}

fn budget() -> SweepBudget {
    SweepBudget {
        max_entries: SLICE_ENTRIES,
        deadline: Some(Instant::now() + SLICE),
    }
}

fn update(
    tenant: &str,
    model: &str,
    replica: &str,
    prefixes: Vec<PrefixEntry>,
    ts: i64,
) -> CacheStateUpdate {
    CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        timestamp_us: ts / 1000,
        prefixes,
        stats: None,
        adapter_id: String::new(),
    }
}

fn prefix(h: u64, adapter: &str) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: h.to_be_bytes().to_vec(),
        token_count: 16,
        adapter_id: adapter.into(),
        ..Default::default()
    }
}

/// As the server does (src/sys/memory.rs), unless `MIMALLOC_ALLOW_THP` is set: no transparent
/// huge pages, whose 2 MiB first-touch faults cost 3–7 ms of system time inside one slice.
pub fn no_transparent_huge_pages() {
    unsafe extern "C" {
        fn prctl(option: i32, a: u64, b: u64, c: u64, d: u64) -> i32;
    }
    const PR_SET_THP_DISABLE: i32 = 41;
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE sets one flag of this process's memory descriptor.
        unsafe { prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
}

/// The server's `gradual_buffer_hook` (src/sys/memory.rs): no transparent huge pages on the
/// buffers a cap build fills over many slices, so no slice takes a 2 MiB first-touch fault.
fn no_huge_pages(addr: usize, len: usize) {
    const PAGE: usize = 4096;
    const MADV_NOHUGEPAGE: i32 = 15;
    unsafe extern "C" {
        fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
    }
    let Some(start) = addr.checked_next_multiple_of(PAGE) else {
        return;
    };
    let end = addr.saturating_add(len) / PAGE * PAGE;
    if start < end {
        // SAFETY: only the huge-page policy of whole pages of this process's own buffer changes.
        unsafe { madvise(start as *mut u8, end - start, MADV_NOHUGEPAGE) };
    }
}

fn index(scale: &Scale) -> Index {
    let mut ix = Index::new(IndexConfig {
        gradual_buffer_hook: Some(no_huge_pages),
        max_entries: 0,
        max_keyspaces_per_model: scale.keyspaces + 16,
        max_keyspaces: scale.keyspaces * 2 + 1024,
        max_holders_per_key: scale.holders,
        ..IndexConfig::default()
    });
    // As the server: ALL_CLEARED leaves its removals to slices.
    ix.set_sliced_clears(true);
    ix
}

/// Ingests `n` updates of `per` prefixes from `make(i)`.
fn fill(ix: &mut Index, rules: &Rules, n: usize, mut make: impl FnMut(usize) -> CacheStateUpdate) {
    for i in 0..n {
        let out = ix.ingest(&make(i), NOW, rules);
        assert!(
            !out.rejected_keyspaces_full && !out.rejected_string_table_full,
            "{i}"
        );
    }
}

/// The plain shape: `entries` keys of one holder, 8 tenants × 8 models, half stamped old.
fn plain(ix: &mut Index, rules: &Rules, entries: usize) {
    const PER: usize = 4096;
    fill(ix, rules, entries.div_ceil(PER), |i| {
        let (t, m) = (i % 8, (i / 8) % 8);
        let ts = if i % 2 == 0 { OLD } else { NOW };
        let tenant = if t < 4 {
            format!("t{t}")
        } else {
            format!("lfu{t}")
        };
        let prefixes = (0..PER).map(|j| prefix((i * PER + j) as u64, "")).collect();
        update(
            &tenant,
            &format!("m{m}"),
            &format!("r{}", i % 4),
            prefixes,
            ts,
        )
    });
}

/// One scope with `n` keyspaces (adapter ids), one key each, all old.
fn keyspaces(ix: &mut Index, rules: &Rules, n: usize) {
    const PER: usize = 4096;
    fill(ix, rules, n.div_ceil(PER), |i| {
        let prefixes = (i * PER..((i + 1) * PER).min(n))
            .map(|a| prefix(a as u64, &format!("adapter-{a:08}")))
            .collect();
        update("ks", "m", "r", prefixes, OLD)
    });
}

/// `n` distinct replica names, 1,000 per model, one key each, all old.
fn names(ix: &mut Index, rules: &Rules, n: usize) {
    fill(ix, rules, n, |i| {
        let (m, r) = (i / 1000, i % 1000);
        update(
            "names",
            &format!("m{m}"),
            &format!("replica-{m}-{r}"),
            vec![prefix(i as u64, "")],
            OLD,
        )
    });
}

/// `keys` keys each held by `holders` replicas, half of them old.
fn held(ix: &mut Index, rules: &Rules, keys: usize, holders: usize) {
    const PER: usize = 1024;
    let batches = keys.div_ceil(PER);
    fill(ix, rules, batches * holders, |i| {
        let (b, r) = (i / holders, i % holders);
        let ts = if r % 2 == 0 { OLD } else { NOW };
        let prefixes = (b * PER..((b + 1) * PER).min(keys))
            .map(|k| prefix(k as u64, ""))
            .collect();
        update("held", "m", &format!("h{r}"), prefixes, ts)
    });
}

/// One TTL sweep pass in slices (its reclaim pass recorded apart), with `churn` run between
/// slices (clears, policy changes).
fn sweep(
    ix: &mut Index,
    rules: &mut Rules,
    report: &mut Report,
    mut churn: impl FnMut(&mut Index, &mut Rules, u64, &mut Report),
) {
    ix.sweep_begin(NOW);
    let mut n = 0u64;
    loop {
        let task = if ix.reclaim_in_progress() {
            "reclaim"
        } else {
            "sweep"
        };
        let step = timed(report, task, || ix.sweep_step(rules, budget()));
        if step.finished.is_some() {
            return;
        }
        churn(ix, rules, n, report);
        n += 1;
    }
}

/// Cap candidate builds ahead of need with the cap just under the entries.
fn cap_build(ix: &mut Index, report: &mut Report) {
    ix.set_max_entries(ix.non_reserved_entry_count().max(1));
    while ix.cap_prebuild_wanted() {
        let step = timed(report, "cap_build", || ix.cap_prebuild_step(budget()));
        if !step.in_progress {
            break;
        }
    }
    ix.set_max_entries(0);
}

/// The snapshot export in the server's slices (encoding excluded).
fn snapshot(ix: &Index, report: &mut Report) {
    let mut pos = Some(EntryCursor::START);
    while let Some(p) = pos {
        pos = timed(report, "snapshot_slice", || {
            let start = Instant::now();
            let mut p = p;
            let mut rows = 0;
            loop {
                let next = ix.export_entries(p, SNAPSHOT_STEP, |e| {
                    rows += 1;
                    std::hint::black_box(e);
                });
                match next {
                    Some(n) if rows < SLICE_ENTRIES && start.elapsed() < SNAPSHOT_SLICE => p = n,
                    other => return other,
                }
            }
        });
    }
}

/// Every entry as an owned record (the restore's input; not timed).
fn records(ix: &Index) -> Vec<Owned> {
    let mut out = Vec::with_capacity(ix.entry_count() as usize);
    ix.export_entries(EntryCursor::START, usize::MAX, |e| out.push(Owned::from(e)));
    out
}

/// A snapshot record owned (the restore input).
pub struct Owned {
    names: [String; 5],
    hash: Vec<u8>,
    tokens: i32,
    last_seen: i64,
    tier: u8,
    access: u32,
}

impl From<&PersistEntry<'_>> for Owned {
    fn from(e: &PersistEntry<'_>) -> Owned {
        Owned {
            names: [e.tenant, e.model, e.scheme, e.adapter, e.replica].map(str::to_string),
            hash: e.hash.to_vec(),
            tokens: e.tokens,
            last_seen: e.last_seen,
            tier: e.tier,
            access: e.access,
        }
    }
}

/// Restores `records` into `ix` in slices of the sweep's time budget.
fn restore(ix: &mut Index, rules: &Rules, records: &[Owned], report: &mut Report) {
    let mut cache = RestoreCache::default();
    let mut at = 0;
    while at < records.len() {
        at = timed(report, "restore_slice", || {
            let deadline = Instant::now() + SLICE;
            let mut i = at;
            while i < records.len() {
                if i > at && (i - at) % 64 == 0 && Instant::now() >= deadline {
                    break;
                }
                let r = &records[i];
                let [t, m, s, a, rep] = &r.names;
                let e = PersistEntry {
                    tenant: t,
                    model: m,
                    scheme: s,
                    adapter: a,
                    hash: &r.hash,
                    replica: rep,
                    tokens: r.tokens,
                    last_seen: r.last_seen,
                    tier: r.tier,
                    access: r.access,
                };
                ix.restore_entry(&e, NOW, rules, &mut cache);
                i += 1;
            }
            i
        });
    }
    timed(report, "restore_slice", || ix.restore_finish());
}

/// The `/snapshot` part of the core in the server's slices (500 µs / 16,384 entries).
fn snapshot_part(ix: &Index, report: &mut Report) {
    let mut b = SnapshotPartBuilder::default();
    let budget = |b: &mut SnapshotPartBuilder| {
        ix.snapshot_part_step(b, SLICE_ENTRIES, Some(Instant::now() + SNAPSHOT_SLICE))
    };
    while !timed(report, "snapshot_part_slice", || budget(&mut b)) {}
    b.finish();
}

/// Builds one shape and runs its maintenance tasks.
type Shape = fn(&Scale, &mut Rules, &mut Report);

/// Builds each shape whose name `only` accepts (`plain`, `keyspaces`, `names`, `held`,
/// `quota`), runs
/// every maintenance task on it, and returns the report. `log` is told what runs.
pub fn run(scale: Scale, only: impl Fn(&str) -> bool, mut log: impl FnMut(&str)) -> Report {
    let mut report = Report::default();
    let mut rules = Rules {
        flipped: false,
        quota: 0,
    };
    let shapes: [(&'static str, Shape); 5] = [
        ("plain", run_plain),
        ("keyspaces", run_keyspaces),
        ("names", run_names),
        ("held", run_held),
        ("quota", run_quota),
    ];
    for (name, shape) in shapes.into_iter().filter(|(n, _)| only(n)) {
        log(name);
        report.shape = name;
        shape(&scale, &mut rules, &mut report);
    }
    report
}

/// Plain entries, with clears and policy churn between the sweep's slices, the cap build
/// before and after, the snapshot, and the restore of that snapshot.
fn run_plain(scale: &Scale, rules: &mut Rules, report: &mut Report) {
    let mut ix = index(scale);
    plain(&mut ix, rules, scale.entries);
    cap_build(&mut ix, report);
    snapshot(&ix, report);
    snapshot_part(&ix, report);
    let records = records(&ix);
    sweep(&mut ix, rules, report, |ix, rules, n, report| {
        if n % 64 == 0 {
            rules.flipped = !rules.flipped;
            ix.rules_changed();
        }
        if n % 97 == 0 {
            // From the second of the 8×8 scopes on (update 9 and after, r1/m1/t1 first): the
            // scan passes more places than one slice may visit before it finds the first
            // cleared entry, so a clear runs in more than one slice however fast each is.
            let k = n + 97;
            let e = CacheEvent {
                r#type: Type::AllCleared as i32,
                replica_id: format!("r{}", k % 4),
                model_id: format!("m{}", k % 8),
                tenant_id: format!("t{}", k % 4),
                ..Default::default()
            };
            // The event, then its removals in slices (as the server runs them before the
            // sweep's next slice).
            timed(report, "all_cleared", || ix.apply_event(&e, NOW, rules));
            while !timed(report, "clear_slice", || ix.clear_step(budget())) {}
            assert_eq!(ix.take_clear_sync_finishes(), 0);
        }
    });
    cap_build(&mut ix, report);
    drop(ix);
    let mut fresh = index(scale);
    restore(&mut fresh, rules, &records, report);
}

/// One scope full of keyspaces, all expiring: the issue's reclaim.
fn run_keyspaces(scale: &Scale, rules: &mut Rules, report: &mut Report) {
    let mut ix = index(scale);
    keyspaces(&mut ix, rules, scale.keyspaces);
    snapshot(&ix, report);
    sweep(&mut ix, rules, report, |_, _, _, _| {});
    assert_eq!(ix.keyspace_count(), 0);
}

/// Many names (replicas, 1,000 per model), all expiring.
fn run_names(scale: &Scale, rules: &mut Rules, report: &mut Report) {
    let mut ix = index(scale);
    names(&mut ix, rules, scale.names);
    sweep(&mut ix, rules, report, |_, _, _, _| {});
}

/// Full keys: `holders` holders each, half expiring.
fn run_held(scale: &Scale, rules: &mut Rules, report: &mut Report) {
    let mut ix = index(scale);
    held(&mut ix, rules, scale.held_keys, scale.holders);
    cap_build(&mut ix, report);
    snapshot(&ix, report);
    sweep(&mut ix, rules, report, |_, _, _, _| {});
}

/// `entries` keys of one holder: a tenant at its quota with a tenth of them, other tenants the
/// rest. The tenant's next ingest first readies its quota victims in slices
/// (`quota_build`, what the server runs before that ingest), then evicts from the ready heap
/// (`quota_ingest`, the ingest's own step: 16 new keys, 16 victims).
fn run_quota(scale: &Scale, rules: &mut Rules, report: &mut Report) {
    const PER: usize = 4096;
    let mut ix = index(scale);
    let quota = scale.entries / 10;
    fill(&mut ix, rules, scale.entries.div_ceil(PER), |i| {
        let tenant = if i * PER < quota {
            QUOTA_TENANT.to_string()
        } else {
            format!("t{}", i % 8)
        };
        let prefixes = (0..PER).map(|j| prefix((i * PER + j) as u64, "")).collect();
        let ts = NOW - (i as i64) * SEC;
        update(&tenant, &format!("m{}", i % 8), "r", prefixes, ts)
    });
    // The quota in force from now: the tenant's keys.
    rules.quota = (quota.div_ceil(PER) * PER) as u64;
    let fresh = |i: usize| prefix((scale.entries + i) as u64, "");
    // For comparison: an ingest whose victims were not readied builds the heap in one go (what
    // every such ingest did before the quota build was sliced). Then the heaps are dropped.
    let u = update(QUOTA_TENANT, "m0", "r", (16..32).map(fresh).collect(), NOW);
    let c = thread_cpu();
    let out = ix.ingest(&u, NOW, rules);
    let one_go = thread_cpu() - c;
    assert_eq!(out.quota_evicted_keys, 16);
    assert_eq!(ix.take_quota_sync_builds(), 1);
    report.notes.push((
        "quota: ingest building its quota heap in one go".into(),
        one_go,
    ));
    ix.set_min_candidates(1024);
    let need = ix.quota_victims_for_ingest(QUOTA_TENANT, rules.quota, 16);
    assert!(need > 0, "the tenant is at its quota");
    while ix.quota_victims_pending(QUOTA_TENANT, need) {
        timed(report, "quota_build", || {
            ix.quota_victims_step(QUOTA_TENANT, need, budget())
        });
    }
    let u = update(QUOTA_TENANT, "m0", "r", (0..16).map(fresh).collect(), NOW);
    let out = timed(report, "quota_ingest", || ix.ingest(&u, NOW, rules));
    assert_eq!(out.quota_evicted_keys, 16);
    assert_eq!(ix.take_quota_sync_builds(), 0, "no build on the ingest");
    rules.quota = 0;
}
