//! Fixed, deterministic workloads for the CI instruction-count gate (`perf/gate.sh`).
//!
//! `perf_gate <workload>` builds the inputs, then runs the workload inside a function named
//! `gate_w_<workload>`; `perf/gate.sh` runs each one under
//! `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*gate_w_*'` so only the
//! workload's instructions are counted (not the index build). `perf_gate list` prints the names and
//! their operation counts.
//!
//! `PERF_GATE_INJECT=<workload>` adds a `black_box` spin of `PERF_GATE_INJECT_ITERS` (default
//! 2000) iterations per operation of that workload: a deliberate slowdown used only to prove
//! that the gate fails (perf/RESULTS.md). Product code is never touched.

#[path = "../../../benches/common/mod.rs"]
mod common;

use common::{Built, build_index};
use inferencecache_index::fingerprint;
use inferencecache_index::index::Strategy;
use inferencecache_index::policy::PolicyStore;
use inferencecache_index::rules::NoRules;
use std::hint::black_box;

/// Index size of the lookup and ingest workloads.
const ENTRIES: u64 = 100_000;
/// Operations per lookup / ingest workload.
const OPS: usize = 2_000;

/// Repetitions of the 16K-token fingerprint.
const FINGERPRINTS: usize = 50;
/// Policy resolutions (half installed tenants, half unknown).
const RESOLVES: usize = 20_000;
/// New-chain ingests at the cap (each evicts 64 entries).
const NEW_CHAINS: usize = OPS / 4;

/// Replicas holding the shared prefix of `lookup_shared_512_aged` (stored in 64 bursts).
const SHARED_HOLDERS: u64 = 512;
/// Blocks of that shared prefix.
const SHARED_BLOCKS: u64 = 32;
/// Lookups of that workload (each answers every holder).
const SHARED_OPS: usize = OPS / 10;

/// Workload names and their operation counts (`perf_gate list`).
const WORKLOADS: &[(&str, usize)] = &[
    ("lookup_chain_64", OPS),
    ("lookup_chain_256", OPS),
    ("lookup_exact", OPS),
    ("lookup_miss_64", OPS),
    ("lookup_shared_512_aged", SHARED_OPS),
    ("ingest_refresh_64", OPS),
    ("ingest_new_64_at_cap", NEW_CHAINS),
    ("fingerprint_16k", FINGERPRINTS),
    ("policy_resolve_10k", RESOLVES),
];

/// Extra work per operation when `PERF_GATE_INJECT` names the running workload.
struct Inject(u64);

impl Inject {
    fn for_workload(name: &str) -> Inject {
        let on = std::env::var("PERF_GATE_INJECT").is_ok_and(|w| w == name);
        let iters = std::env::var("PERF_GATE_INJECT_ITERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000);
        Inject(if on { iters } else { 0 })
    }

    #[inline(always)]
    fn apply(&self) {
        for i in 0..self.0 {
            black_box(i);
        }
    }
}

#[inline(never)]
fn gate_w_lookup(b: &mut Built, qs: &[common::ChainQuery], inj: &Inject) -> u64 {
    let mut sum = 0;
    for q in qs {
        let (_, n) = b.lookup_chain(black_box(q));
        inj.apply();
        sum += n as u64;
    }
    sum
}

#[inline(never)]
fn gate_w_exact(b: &mut Built, keys: &[[u8; 8]], inj: &Inject) -> u64 {
    let mut sum = 0;
    for k in keys {
        let (s, n) = b.lookup_exact(black_box(k));
        inj.apply();
        assert_eq!(s, Strategy::PrefixMatch);
        sum += n as u64;
    }
    sum
}

#[inline(never)]
fn gate_w_ingest(
    b: &mut Built,
    ups: &[inferencecache_proto::v1alpha1::CacheStateUpdate],
    inj: &Inject,
) -> u64 {
    let mut sum = 0;
    for u in ups {
        sum += b.ix.ingest(black_box(u), b.now, &NoRules).upserts;
        inj.apply();
    }
    sum
}

#[inline(never)]
fn gate_w_fingerprint(toks: &[u32], reps: usize, inj: &Inject) -> usize {
    let mut sum = 0;
    for _ in 0..reps {
        sum += fingerprint::chain(black_box(toks), common::BLOCK_TOKENS)
            .0
            .len();
        inj.apply();
    }
    sum
}

#[inline(never)]
fn gate_w_policy(store: &PolicyStore, tenants: &[String], inj: &Inject) -> u64 {
    let mut sum = 0;
    for t in tenants {
        sum += store.resolve(black_box(t)).lookup_timeout_ms as u64;
        inj.apply();
    }
    sum
}

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let inj = Inject::for_workload(&name);
    let out = match name.as_str() {
        "list" => {
            for (w, ops) in WORKLOADS {
                println!("{w} {ops}");
            }
            return;
        }
        "lookup_chain_64" | "lookup_chain_256" | "lookup_miss_64" => {
            let mut b = build_index(ENTRIES);
            let qs = match name.as_str() {
                "lookup_chain_64" => b.chain_queries(64, OPS, 0x64),
                "lookup_chain_256" => b.chain_queries(256, OPS, 0x256),
                _ => b.miss_queries(64, OPS),
            };
            let hits = gate_w_lookup(&mut b, &qs, &inj);
            assert!(
                name.contains("miss") == (hits == 0),
                "unexpected lookup result"
            );
            hits
        }
        "lookup_shared_512_aged" => {
            // A prefix the replicas of a large fleet stored in bursts (a shared system prompt):
            // holders score with their own freshness, 64 distinct times among 512 holders, in
            // no relation to the order of their names (as on the Mooncake trace at 1,024
            // workers).
            let mut b = build_index(ENTRIES);
            let first = (b.chains + 1) * common::CHAIN_BLOCKS;
            for r in 0..SHARED_HOLDERS {
                let update = common::chain_update(first, SHARED_BLOCKS, 1_000 + r);
                let burst = (r.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as i64;
                let stored_at = b.now - (burst + 1) * 1_000_000;
                b.ix.ingest(&update, stored_at, &NoRules);
            }
            let qs: Vec<_> = (0..SHARED_OPS)
                .map(|_| common::ChainQuery {
                    hashes: (0..SHARED_BLOCKS)
                        .map(|k| common::block_hash(first + k).to_vec())
                        .collect(),
                    counts: vec![common::BLOCK_TOKENS; SHARED_BLOCKS as usize],
                })
                .collect();
            let answered = gate_w_lookup(&mut b, &qs, &inj);
            assert_eq!(
                answered,
                SHARED_HOLDERS * SHARED_OPS as u64,
                "every holder answers"
            );
            answered
        }
        "lookup_exact" => {
            let mut b = build_index(ENTRIES);
            let keys = b.exact_keys(OPS, 0xe4ac7);
            gate_w_exact(&mut b, &keys, &inj)
        }
        "ingest_refresh_64" => {
            let mut b = build_index(ENTRIES);
            let ups = b.refresh_updates(64, OPS, 0x1a9e);
            gate_w_ingest(&mut b, &ups, &inj)
        }
        "ingest_new_64_at_cap" => {
            let mut b = build_index(ENTRIES);
            b.cap_here();
            let ups: Vec<_> = (0..NEW_CHAINS as u64)
                .map(|s| common::new_chain_update(b.chains, s, 64))
                .collect();
            gate_w_ingest(&mut b, &ups, &inj)
        }
        "fingerprint_16k" => {
            let toks = common::tokens(16 * 1024, 0x70c5);
            gate_w_fingerprint(&toks, FINGERPRINTS, &inj) as u64
        }
        "policy_resolve_10k" => {
            let store = common::policy_store(10_000);
            // Half installed tenants, half unknown ones.
            let tenants: Vec<String> = (0..RESOLVES)
                .map(|i| format!("tenant-{}", (i * 7919) % 20_000))
                .collect();
            gate_w_policy(&store, &tenants, &inj)
        }
        _ => {
            eprintln!(
                "usage: perf_gate <workload>|list  (workloads: {})",
                WORKLOADS.iter().map(|w| w.0).collect::<Vec<_>>().join(", ")
            );
            std::process::exit(2);
        }
    };
    println!("{name}: result {out}");
}
