//! In-process fuzzing of HPACK decoding (RFC 7541) on stable Rust: seeded generators, no
//! external fuzzer. Each case is a short "connection" of header blocks fed to one decoder:
//!
//! * well-formed blocks from a model encoder that keeps its own copy of the dynamic table and
//!   picks every representation at random (indexed, literal with incremental indexing, without
//!   indexing, never indexed; name by index or literal; raw or Huffman strings; dynamic table
//!   size updates at the start of a block): the decoder must give back exactly the fields
//!   encoded, and its table must hold exactly the model's bytes, never more than its bound;
//! * the same blocks damaged (bytes flipped, cut, spliced, integers padded with zero
//!   continuation bytes up to 5 bytes, random Huffman bits): the decoder must fail or succeed
//!   without panicking, its table within its bound;
//! * the HPACK bomb: a large entry referenced again and again (indexed repetition), and table
//!   churn: the checked decoder (`headers::Decoder`) must flag the list too large without
//!   keeping more than the list bound.
//!
//! The default `cargo test` runs [`SHORT_CASES`] cases from a fixed seed. The long mode runs
//! for `FUZZ_SECS` seconds from `FUZZ_SEED` (or a seed from the clock), printing the seed and
//! the cases run (tests/http2_fuzz_long.sh). A failing case names its seed; reproduce with
//! `FUZZ_SEED=<seed> FUZZ_CASES=1 cargo test --lib http2::fuzz_hpack`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::headers::{DECODER_TABLE_BYTES, Decoded, Decoder as ListDecoder};
use super::hpack::Decoder;
use super::hpack_tables::{HUFFMAN_CODES, STATIC_TABLE};

/// Cases of the default (CI) run: a couple of seconds in a debug build.
const SHORT_CASES: u64 = 3_000;
/// Header blocks per case (one decoder's life).
const BLOCKS_PER_CASE: usize = 8;
/// The header list bound the checked decoder is built with (the server's).
const LIST_BYTES: usize = crate::limits::HTTP2_MAX_HEADER_LIST_BYTES as usize;
/// Per-entry overhead of the table and list sizes (RFC 7541 §4.1, RFC 9113 §6.5.2).
const OVERHEAD: usize = 32;

/// SplitMix64: small, seedable, good enough to pick representations.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// True with probability `1/n`.
    pub(crate) fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Random bytes, fewer than `max`.
    pub(crate) fn some_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max);
        self.bytes(n)
    }
    /// Random bytes, `min` and fewer than `max` more.
    pub(crate) fn some_bytes_from(&mut self, min: usize, max: usize) -> Vec<u8> {
        let n = min + self.below(max);
        self.bytes(n)
    }
}

/// The run's cases: `FUZZ_CASES` or [`SHORT_CASES`], or as many as fit in `FUZZ_SECS`; the base
/// seed from `FUZZ_SEED`, else 0 in the short run and the clock in the long one.
pub(crate) struct Plan {
    pub(crate) seed: u64,
    pub(crate) cases: u64,
    pub(crate) until: Option<Instant>,
}

impl Plan {
    pub(crate) fn from_env(short_cases: u64) -> Plan {
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        let secs = env("FUZZ_SECS");
        let seed = env("FUZZ_SEED").unwrap_or_else(|| match secs {
            Some(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            None => 0,
        });
        Plan {
            seed,
            cases: env("FUZZ_CASES").unwrap_or(if secs.is_some() {
                u64::MAX
            } else {
                short_cases
            }),
            until: secs.map(|s| Instant::now() + Duration::from_secs(s)),
        }
    }

    /// Runs `case(seed)` for every case of the plan; returns the cases run. A panicking case
    /// is reported with its seed.
    pub(crate) fn run(&self, target: &str, mut case: impl FnMut(u64)) -> u64 {
        let mut n = 0;
        while n < self.cases && self.until.is_none_or(|t| Instant::now() < t) {
            let seed = self.seed.wrapping_add(n);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(seed)));
            if let Err(e) = outcome {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("{target}: case with seed {seed} failed after {n} cases: {msg}");
            }
            n += 1;
        }
        eprintln!("{target}: {n} cases from seed {} passed", self.seed);
        n
    }
}

/// Huffman-encodes `s` (RFC 7541 §5.2, Appendix B), padded with the EOS prefix.
fn huffman_encode(s: &[u8], out: &mut Vec<u8>) {
    let (mut acc, mut bits) = (0u64, 0u32);
    for &b in s {
        let (code, len) = HUFFMAN_CODES[usize::from(b)];
        acc = (acc << len) | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            out.push((acc >> (bits - 8)) as u8);
            bits -= 8;
            acc &= (1u64 << bits) - 1;
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) | ((1u64 << (8 - bits)) - 1)) as u8);
    }
}

/// An integer with an `n`-bit prefix (§5.1), the minimal encoding, `first` holding the flags.
fn put_integer(out: &mut Vec<u8>, mut value: usize, prefix_bits: u8, first: u8) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A string literal, raw or Huffman.
fn put_string(out: &mut Vec<u8>, s: &[u8], huffman: bool) {
    if huffman {
        let mut enc = Vec::new();
        huffman_encode(s, &mut enc);
        put_integer(out, enc.len(), 7, 0x80);
        out.extend_from_slice(&enc);
    } else {
        put_integer(out, s.len(), 7, 0);
        out.extend_from_slice(s);
    }
}

/// The encoder's model of the decoder's dynamic table.
struct Model {
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max: usize,
}

impl Model {
    fn new() -> Model {
        Model {
            table: VecDeque::new(),
            size: 0,
            max: DECODER_TABLE_BYTES,
        }
    }

    fn evict_to(&mut self, bound: usize) {
        while self.size > bound {
            let (n, v) = self.table.pop_back().expect("size counts entries");
            self.size -= n.len() + v.len() + OVERHEAD;
        }
    }

    fn insert(&mut self, name: &[u8], value: &[u8]) {
        let size = name.len() + value.len() + OVERHEAD;
        if size > self.max {
            self.evict_to(0);
            return;
        }
        self.evict_to(self.max - size);
        self.size += size;
        self.table.push_front((name.to_vec(), value.to_vec()));
    }

    /// 1-based indexes (static, then dynamic) of an exact match and of a name match.
    fn find(&self, name: &[u8], value: &[u8]) -> (Option<usize>, Option<usize>) {
        let all = STATIC_TABLE
            .iter()
            .map(|(n, v)| (*n, *v))
            .chain(self.table.iter().map(|(n, v)| (&n[..], &v[..])));
        let (mut exact, mut named) = (None, None);
        for (i, (n, v)) in all.enumerate() {
            if n == name {
                named.get_or_insert(i + 1);
                if v == value {
                    exact.get_or_insert(i + 1);
                }
            }
        }
        (exact, named)
    }

    /// Encodes `fields` with representations picked by `rng`, after an optional size update.
    fn encode(
        &mut self,
        rng: &mut Rng,
        fields: &[(Vec<u8>, Vec<u8>)],
        update: Option<usize>,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(size) = update {
            put_integer(&mut out, size, 5, 0x20);
            self.max = size;
            self.evict_to(size);
        }
        for (name, value) in fields {
            let (exact, named) = self.find(name, value);
            if let Some(i) = exact.filter(|_| !rng.one_in(4)) {
                put_integer(&mut out, i, 7, 0x80);
                continue;
            }
            let (prefix, first) = match rng.below(3) {
                0 => (6, 0x40),
                1 => (4, 0x00),
                _ => (4, 0x10),
            };
            match named.filter(|_| rng.one_in(2)) {
                Some(i) => put_integer(&mut out, i, prefix, first),
                None => {
                    out.push(first);
                    put_string(&mut out, name, rng.one_in(2));
                }
            }
            put_string(&mut out, value, rng.one_in(2));
            if first == 0x40 {
                self.insert(name, value);
            }
        }
        out
    }
}

/// Header names the generator draws from: the static table's, gRPC's, and random ones.
fn field(rng: &mut Rng, model: &Model) -> (Vec<u8>, Vec<u8>) {
    if !model.table.is_empty() && rng.one_in(4) {
        return model.table[rng.below(model.table.len())].clone();
    }
    if rng.one_in(4) {
        let (n, v) = STATIC_TABLE[rng.below(STATIC_TABLE.len())];
        let value = if rng.one_in(2) {
            v.to_vec()
        } else {
            text(rng, 24)
        };
        return (n.to_vec(), value);
    }
    let names: [&[u8]; 6] = [
        b"content-type",
        b"te",
        b"grpc-timeout",
        b"x-request-id",
        b":path",
        b"user-agent",
    ];
    let name = if rng.one_in(3) {
        text(rng, 16)
    } else {
        names[rng.below(names.len())].to_vec()
    };
    let value = match rng.below(8) {
        // Any byte (every Huffman symbol up to 30 bits).
        0 => rng.some_bytes(64),
        // Larger than the whole table: empties it (§4.4).
        1 => text(rng, 4200),
        _ => text(rng, 200),
    };
    (name, value)
}

/// Lowercase text up to `max` bytes.
fn text(rng: &mut Rng, max: usize) -> Vec<u8> {
    let n = rng.below(max + 1);
    (0..n)
        .map(|_| b"abcdefghij-./0123456789"[rng.below(23)])
        .collect()
}

/// A header list as the generator sees it.
type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// One block of a case: fields, an optional size update, and the block's bytes.
fn well_formed_block(rng: &mut Rng, model: &mut Model) -> (Fields, Vec<u8>) {
    let fields: Vec<_> = (0..rng.below(12)).map(|_| field(rng, model)).collect();
    let update = match rng.below(8) {
        0 => Some(rng.below(DECODER_TABLE_BYTES + 1)),
        1 => Some(0),
        2 => Some(DECODER_TABLE_BYTES),
        _ => None,
    };
    let block = model.encode(rng, &fields, update);
    (fields, block)
}

/// A well-formed block damaged: bytes flipped, cut, spliced, padded integers, random bits.
fn damage(rng: &mut Rng, block: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(7) {
            0 if !block.is_empty() => {
                let i = rng.below(block.len());
                block[i] ^= 1 << rng.below(8);
            }
            1 if !block.is_empty() => block.truncate(rng.below(block.len())),
            2 => {
                let at = rng.below(block.len() + 1);
                let junk = rng.some_bytes_from(1, 16);
                block.splice(at..at, junk);
            }
            3 => {
                // An integer at its prefix's maximum, then zero continuation bytes (at most
                // 5 bytes in all, as h2 accepts) and a final byte.
                let at = rng.below(block.len() + 1);
                let mut int = vec![[0xffu8, 0x7f, 0x3f, 0x1f, 0x0f][rng.below(5)]];
                int.extend(std::iter::repeat_n(0x80, rng.below(3)));
                int.push(rng.below(0x80) as u8);
                block.splice(at..at, int);
            }
            4 => {
                // A Huffman string of random bits (bad padding, EOS inside, long codes).
                let mut s = vec![0x00];
                let junk = rng.some_bytes(40);
                put_integer(&mut s, junk.len(), 7, 0x80);
                s.extend_from_slice(&junk);
                s.push(0x00);
                block.extend_from_slice(&s);
            }
            5 => {
                // An index anywhere, often just past the table.
                put_integer(block, rng.below(STATIC_TABLE.len() + 120), 7, 0x80);
            }
            _ => {
                // A size update in the middle of the block (only allowed at its start).
                put_integer(block, rng.below(2 * DECODER_TABLE_BYTES), 5, 0x20);
            }
        }
    }
}

/// The table bytes must stay within the decoder's bound whatever it was fed.
fn assert_table_bounded(d: &Decoder) {
    let (size, max) = d.table_bytes();
    assert!(
        size <= max && max <= DECODER_TABLE_BYTES,
        "table holds {size} bytes, bound {max}"
    );
}

/// One case: well-formed blocks (checked exactly), and a damaged one now and then.
fn hpack_case(seed: u64) {
    let mut rng = Rng::new(seed);
    let mut d = Decoder::new(DECODER_TABLE_BYTES);
    let mut model = Model::new();
    for _ in 0..BLOCKS_PER_CASE {
        let (fields, mut block) = well_formed_block(&mut rng, &mut model);
        if rng.one_in(6) {
            damage(&mut rng, &mut block);
            let _ = d.decode(&block, |_, _| {});
            assert_table_bounded(&d);
            // The model no longer knows the table: a connection would be closed here.
            return;
        }
        let mut got = Vec::new();
        d.decode(&block, |n, v| got.push((n.to_vec(), v.to_vec())))
            .unwrap_or_else(|e| panic!("a well-formed block refused: {e:?}: {block:02x?}"));
        assert!(got == fields, "decoded fields differ from those encoded");
        assert_eq!(d.table_bytes(), (model.size, model.max), "table size");
        assert_table_bounded(&d);
    }
}

/// One case of the checked decoder: blocks with an HPACK bomb (a large entry indexed
/// repeatedly) or table churn, plus raw random bytes; lists stay within the bound.
fn list_case(seed: u64) {
    let mut rng = Rng::new(seed);
    let mut d = ListDecoder::new(LIST_BYTES);
    let mut model = Model::new();
    let mut arena = BytesMut::new();
    for _ in 0..BLOCKS_PER_CASE {
        let (mut fields, mut block) = well_formed_block(&mut rng, &mut model);
        if rng.one_in(3) {
            // Indexed repetition: one entry of up to 4,000 bytes, referenced up to 600 times.
            let value = text(&mut rng, 4000);
            let entry = (b"x-bomb".to_vec(), value);
            block.extend(model.encode(&mut rng, std::slice::from_ref(&entry), None));
            fields.push(entry.clone());
            let (exact, _) = model.find(&entry.0, &entry.1);
            for _ in 0..rng.below(600) {
                match exact {
                    Some(i) => put_integer(&mut block, i, 7, 0x80),
                    // Not in the table (larger than it): no repetition to make.
                    None => break,
                }
                fields.push(entry.clone());
            }
        }
        let raw = rng.one_in(8);
        if raw {
            block = rng.some_bytes(300);
        }
        let decoded = d.decode(&block, rng.one_in(4), &mut arena);
        // A refused block closes the connection: the arena is not used again.
        assert!(
            decoded.is_err() || arena.is_empty(),
            "the arena's written part became the list"
        );
        let listed: usize = fields
            .iter()
            .map(|(n, v)| n.len() + v.len() + OVERHEAD)
            .sum();
        match decoded {
            Ok(Decoded::List(list)) => {
                assert!(
                    list.byte_len() <= LIST_BYTES,
                    "a list of {}",
                    list.byte_len()
                );
                if !raw {
                    assert!(listed <= LIST_BYTES, "a list of {listed} bytes not flagged");
                    let got: Vec<_> = list.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect();
                    assert!(
                        got == fields,
                        "checked list differs from the fields encoded"
                    );
                }
            }
            Ok(Decoded::TooLarge) => assert!(raw || listed > LIST_BYTES, "{listed} not too large"),
            Ok(Decoded::Malformed) => assert!(raw || listed <= LIST_BYTES, "{listed} not flagged"),
            Err(_) if raw => return,
            Err(e) => panic!("a well-formed block refused: {e:?}"),
        }
        if raw {
            return;
        }
    }
}

#[test]
fn fuzz_hpack_blocks() {
    let n = Plan::from_env(SHORT_CASES).run("fuzz_hpack_blocks", hpack_case);
    assert!(n > 0);
}

#[test]
fn fuzz_hpack_header_lists() {
    let n = Plan::from_env(SHORT_CASES / 3).run("fuzz_hpack_header_lists", list_case);
    assert!(n > 0);
}

/// RFC 7541 §5.1 leaves the continuation bytes unbounded; `0xff` and twenty `0x80` must be a
/// decoding error (COMPRESSION_ERROR), not a panic or a wrapped value (issue 32).
#[test]
fn over_long_integer_is_an_error_not_a_panic() {
    let mut block = vec![0xff];
    block.extend(std::iter::repeat_n(0x80, 20));
    block.push(0x00);
    let mut d = Decoder::new(DECODER_TABLE_BYTES);
    assert!(d.decode(&block, |_, _| {}).is_err());
    // Ten zero continuation bytes then 1: a shift past 63 bits, which a release build wraps
    // into a small, different value.
    let mut block = vec![0xff];
    block.extend(std::iter::repeat_n(0x80, 10));
    block.push(0x01);
    assert!(d.decode(&block, |_, _| {}).is_err());
}
