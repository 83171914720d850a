//! The most one step on a run costs with the run at its bounds: 1,024 replicas each holding a
//! `RUN_LEN_LIMIT` (4,096-block) chain in 31 stretches (its tier changes every 128 blocks up to
//! the last 256), 31,744 extents. Times, in µs (median and max of 200 each):
//!
//! * the first replica's first block cut and stored again: the extents after it move (~1 MiB)
//!   both ways;
//! * a cut from the middle of a stretch of a replica at `MAX_REPLICA_EXTENTS`, which takes the
//!   stretch's rest (63 blocks) out with it, then those blocks stored again;
//! * a walk of the whole chain (every replica met in each of its stretches);
//! * the longest single upsert while one replica stores 2M blocks of irregular sizes (each
//!   count off its extent's step, kept in the side table): the side table's growths.
//!
//!     cargo run --release -p inferencecache-index --example run_extents_worst
use inferencecache_index::runstore::{Entry, Hint, Loc, RUN_LEN_LIMIT, RunStore, WalkScratch};
use std::time::Instant;

const REPLICAS: u32 = 1_024;
const STRETCH: usize = 128;
const ROUNDS: usize = 200;

fn hash(b: usize) -> u64 {
    (b as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn entry(replica: u32, b: usize) -> Entry {
    let stretch = b.min(RUN_LEN_LIMIT as usize - 2 * STRETCH) / STRETCH;
    Entry {
        replica,
        tier: (stretch % 2) as u8,
        last_seen: 5,
        tokens: 16 * (b as i32 + 1),
    }
}

/// Stores blocks `from..to` of the chain for `replica`, after block `from - 1`.
fn store_blocks(store: &mut RunStore, replica: u32, from: usize, to: usize) {
    let mut after: Option<Loc> = from.checked_sub(1).and_then(|b| store.find(0, hash(b)));
    let mut hint = Hint::default();
    for b in from..to {
        let up = store.upsert(0, hash(b), after, entry(replica, b), &mut hint);
        after = Some(up.expect("within the bounds").0);
    }
}

/// Median and max of the times `f` reports, µs.
fn timed(mut f: impl FnMut() -> f64) -> (f64, f64) {
    let mut t: Vec<f64> = (0..ROUNDS).map(|_| f()).collect();
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[t.len() - 1])
}

fn micros(at: Instant) -> f64 {
    at.elapsed().as_secs_f64() * 1e6
}

fn main() {
    let len = RUN_LEN_LIMIT as usize;
    let mut store = RunStore::new();
    for replica in 0..REPLICAS {
        store_blocks(&mut store, replica, 0, len);
    }
    let first = store.find(0, hash(0)).expect("held");
    let extents = store.run(first.run).extents().len();
    println!(
        "run of {} blocks, {extents} extents",
        store.along(first).len()
    );
    let (mv_med, mv_max) = timed(|| {
        let at = Instant::now();
        store.release(0, hash(0), 0).expect("held");
        let up = store.upsert(0, hash(0), None, entry(0, 0), &mut Hint::default());
        up.expect("stored back");
        micros(at)
    });
    // Replica 1 at the bound: one split (its 32nd extent), then cuts that drop a stretch's rest.
    store.release(0, hash(STRETCH + 10), 1).expect("held");
    let (mut cut, mut back) = (Vec::new(), Vec::new());
    let (cut_med, cut_max) = timed(|| {
        let at = Instant::now();
        store.release(0, hash(64), 1).expect("held");
        let dropped = store.take_dropped().count();
        let took = micros(at);
        assert_eq!(dropped, STRETCH - 65, "the stretch's rest");
        let at = Instant::now();
        store_blocks(&mut store, 1, 64, STRETCH);
        back.push(micros(at));
        cut.push(took);
        took
    });
    back.sort_by(f64::total_cmp);
    let words: Vec<u64> = (0..len).map(hash).collect();
    let mut scratch = WalkScratch::default();
    let (walk_med, walk_max) = timed(|| {
        let at = Instant::now();
        store.walk(0, &words, 0, 1, |a, b| a.max(b), &mut scratch);
        let took = micros(at);
        assert_eq!(scratch.matched.len(), REPLICAS as usize);
        took
    });
    store.check();
    println!("cut and store back at the front: median {mv_med:.1} µs, max {mv_max:.1} µs");
    println!("cut past the bound (63 dropped): median {cut_med:.1} µs, max {cut_max:.1} µs");
    println!(
        "the 64 blocks stored back:       median {:.1} µs, max {:.1} µs",
        back[back.len() / 2],
        back[back.len() - 1]
    );
    println!("walk of the run:                 median {walk_med:.1} µs, max {walk_max:.1} µs");
    let (slowest, total) = odd_counts_stored(2_000_000);
    println!("2M blocks of irregular sizes:    slowest upsert {slowest:.1} µs, all {total:.2} s");
}

/// Stores `blocks` blocks of irregular sizes for one replica (chains of `RUN_LEN_LIMIT`):
/// the slowest single upsert (µs) and the total time (s).
fn odd_counts_stored(blocks: usize) -> (f64, f64) {
    let mut store = RunStore::new();
    let len = RUN_LEN_LIMIT as usize;
    let (mut slowest, started) = (0f64, Instant::now());
    for c in 0..blocks / len {
        let (mut hint, mut after) = (Hint::default(), None);
        for b in 0..len {
            let e = Entry {
                replica: 1,
                tier: 0,
                last_seen: 5,
                tokens: 16 * (b as i32 + 1) + (b * b % 7) as i32,
            };
            let at = Instant::now();
            let up = store.upsert(0, hash(c * len + b + 1_000_000), after, e, &mut hint);
            slowest = slowest.max(micros(at));
            after = Some(up.expect("room").0);
        }
    }
    (slowest, started.elapsed().as_secs_f64())
}
