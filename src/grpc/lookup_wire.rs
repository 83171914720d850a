//! A LookupRouteRequest read straight from its wire bytes into a [`LookupRouteView`]: strings,
//! the prefix hash and wire block hashes borrowed or copied into reused buffers, so a plain
//! lookup allocates nothing to be decoded.
//!
//! Why not prost here: prost decodes `repeated bytes block_hashes` into one `Bytes` per hash (a
//! reference count up and down each) and every string into a `String`; at saturation that was
//! about a fifth of a LookupRoute's server CPU (perf/RESULTS.md). prost stays the decoder of
//! every other path.
//!
//! Exactness: [`decode`] returns a view only when prost would decode the same bytes to the same
//! values. Anything it does not handle the common way (a group, a field with an unexpected wire
//! type, invalid UTF-8, a malformed varint or length) is `None`, and the call goes to the
//! general path, which decodes with prost and answers exactly as before. The differential test
//! below holds every view it returns against prost's decode of the same bytes.

use inferencecache_index::index::{BlockHashes, StridedHashes};
use inferencecache_index::resolve::LookupRouteView;
use inferencecache_proto::v1alpha1::Slo;

use crate::limits::INLINE_DECODE_KEEP_ENTRIES;

/// Protobuf wire types (the encoding spec's numbers).
const VARINT: u64 = 0;
const I64: u64 = 1;
const LEN: u64 = 2;
const I32: u64 = 5;

/// A core's reused decode buffers: the repeated fields that need converting.
#[derive(Default)]
pub struct DecodeScratch {
    /// `block_hashes` as `(start, end)` offsets into the message.
    ranges: Vec<(usize, usize)>,
    /// `block_hashes` when each is 8 bytes (the engines' big-endian u64 hashes).
    fixed: Vec<[u8; 8]>,
    counts: Vec<i32>,
    token_ids: Vec<u32>,
}

impl DecodeScratch {
    /// Releases any buffer grown beyond [`INLINE_DECODE_KEEP_ENTRIES`] by an unusually long
    /// request, so one 4 MiB message does not pin megabytes per core. Called once the
    /// request's view is gone.
    pub fn trim(&mut self) {
        fn trim_one<T>(v: &mut Vec<T>) {
            if v.capacity() > INLINE_DECODE_KEEP_ENTRIES {
                *v = Vec::new();
            }
        }
        trim_one(&mut self.ranges);
        trim_one(&mut self.fixed);
        trim_one(&mut self.counts);
        trim_one(&mut self.token_ids);
    }
}

/// Decodes `msg`, or `None` when the general path must (see the module docs). Block hashes of
/// 8 bytes each are copied into `scratch`; a chain with any other length borrows them through
/// `slices`, which the caller keeps for as long as the view.
pub fn decode<'a>(
    msg: &'a [u8],
    scratch: &'a mut DecodeScratch,
    slices: &'a mut Vec<&'a [u8]>,
) -> Option<LookupRouteView<'a>> {
    scratch.ranges.clear();
    let mut in_place = InPlace::default();
    scratch.counts.clear();
    scratch.token_ids.clear();
    let mut view = LookupRouteView::default();
    let mut at = 0;
    while at < msg.len() {
        let (tag, wire) = key(msg, &mut at)?;
        match (tag, wire) {
            (1, LEN) => view.model_id = string(msg, &mut at)?,
            (2, LEN) => view.tenant_id = string(msg, &mut at)?,
            (3, LEN) => view.prefix_hash = bytes(msg, &mut at)?,
            (4, VARINT) => view.prefix_token_count = varint(msg, &mut at)? as i32,
            (5, LEN) => view.hash_scheme = string(msg, &mut at)?,
            (6, LEN) => view.slo = Some(slo(bytes(msg, &mut at)?, view.slo.unwrap_or_default())?),
            (7, LEN) => {
                let hash = bytes(msg, &mut at)?;
                in_place.note(at - hash.len(), at, &mut scratch.ranges);
            }
            (8, _) => repeated(msg, &mut at, wire, |v| scratch.counts.push(v as i32))?,
            (9, _) => repeated(msg, &mut at, wire, |v| scratch.token_ids.push(v as u32))?,
            (10, LEN) => view.prompt_text = string(msg, &mut at)?,
            (11, LEN) => view.adapter_id = string(msg, &mut at)?,
            (1..=11, _) => return None,
            _ => skip(msg, &mut at, wire)?,
        }
    }
    if let Some(hashes) = in_place.hashes(msg) {
        view.block_hashes = BlockHashes::Strided(hashes);
        view.block_token_counts = &scratch.counts;
        view.token_ids = &scratch.token_ids;
        return Some(view);
    }
    let scratch: &'a DecodeScratch = fill_hashes(msg, scratch);
    view.block_hashes = if scratch.fixed.len() == scratch.ranges.len() {
        BlockHashes::Fixed(&scratch.fixed)
    } else {
        slices.extend(scratch.ranges.iter().map(|&(s, e)| &msg[s..e]));
        BlockHashes::Slices(slices)
    };
    view.block_token_counts = &scratch.counts;
    view.token_ids = &scratch.token_ids;
    Some(view)
}

/// The bytes from one 8-byte `block_hashes` entry to the next when the field's entries follow
/// one another: a 1-byte key (field 7, length-delimited), a 1-byte length (8), the hash.
const PACKED_HASH_STRIDE: usize = 10;

/// The `block_hashes` seen so far while they all lie in place: 8 bytes each, one after
/// another ([`PACKED_HASH_STRIDE`] apart, as every encoder writes a repeated field). Then the
/// index reads each hash where the walk needs it and nothing is kept per block, not even its
/// offsets; the first entry that breaks the pattern writes the offsets of those before it and
/// the decoder goes on with offsets (the hashes are then copied or borrowed one by one).
#[derive(Default)]
struct InPlace {
    first: usize,
    count: usize,
    broken: bool,
}

impl InPlace {
    /// Notes the hash at `msg[start..end]`, or its offsets in `ranges` once the pattern broke.
    #[inline]
    fn note(&mut self, start: usize, end: usize, ranges: &mut Vec<(usize, usize)>) {
        if !self.broken {
            if self.count == 0 && end - start == 8 {
                self.first = start;
            }
            if end - start == 8 && start == self.first + self.count * PACKED_HASH_STRIDE {
                self.count += 1;
                return;
            }
            self.broken = true;
            ranges.extend((0..self.count).map(|i| {
                let s = self.first + i * PACKED_HASH_STRIDE;
                (s, s + 8)
            }));
        }
        ranges.push((start, end));
    }

    /// The hashes where they lie, when there are some and the pattern held.
    fn hashes<'a>(&self, msg: &'a [u8]) -> Option<StridedHashes<'a>> {
        if self.broken || self.count == 0 {
            return None;
        }
        StridedHashes::new(&msg[self.first..], PACKED_HASH_STRIDE, self.count)
    }
}

/// Copies the block hashes into `scratch.fixed` when every one is 8 bytes; leaves it short
/// otherwise (the caller then borrows them as slices).
fn fill_hashes<'s>(msg: &[u8], scratch: &'s mut DecodeScratch) -> &'s DecodeScratch {
    scratch.fixed.clear();
    if scratch.ranges.iter().all(|&(s, e)| e - s == 8) {
        let hashes = scratch.ranges.iter().map(|&(s, e)| {
            let mut h = [0u8; 8];
            h.copy_from_slice(&msg[s..e]);
            h
        });
        scratch.fixed.extend(hashes);
    }
    scratch
}

/// A field key: `(field number, wire type)`; prost's rules (a key over u32, an unknown wire
/// type and field 0 are errors).
fn key(msg: &[u8], at: &mut usize) -> Option<(u64, u64)> {
    let key = varint(msg, at)?;
    let (tag, wire) = (key >> 3, key & 7);
    (key <= u64::from(u32::MAX) && tag >= 1 && matches!(wire, VARINT | I64 | LEN | I32))
        .then_some((tag, wire))
}

/// A base-128 varint of at most 10 bytes, the 10th at most 1 (as prost reads them).
fn varint(msg: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let b = *msg.get(*at)?;
        *at += 1;
        if i == 9 && b > 1 {
            return None;
        }
        value |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Some(value);
        }
    }
    None
}

/// A length-delimited field's bytes.
fn bytes<'a>(msg: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let len = usize::try_from(varint(msg, at)?).ok()?;
    let end = at.checked_add(len).filter(|&e| e <= msg.len())?;
    let b = &msg[*at..end];
    *at = end;
    Some(b)
}

/// A string field: its bytes if they are UTF-8 (prost refuses the message otherwise).
fn string<'a>(msg: &'a [u8], at: &mut usize) -> Option<&'a str> {
    std::str::from_utf8(bytes(msg, at)?).ok()
}

/// A repeated varint field, packed (one length-delimited run) or not (one value).
fn repeated(msg: &[u8], at: &mut usize, wire: u64, mut push: impl FnMut(u64)) -> Option<()> {
    match wire {
        VARINT => push(varint(msg, at)?),
        LEN => {
            let run = bytes(msg, at)?;
            let mut i = 0;
            while i < run.len() {
                push(varint(run, &mut i)?);
            }
        }
        _ => return None,
    }
    Some(())
}

/// The SLO message merged into `into` (a repeated SLO field merges, as in prost).
fn slo(msg: &[u8], mut into: Slo) -> Option<Slo> {
    let mut at = 0;
    while at < msg.len() {
        match key(msg, &mut at)? {
            (1, VARINT) => into.ttft_ms = varint(msg, &mut at)? as i32,
            (2, VARINT) => into.tbt_ms = varint(msg, &mut at)? as i32,
            (1 | 2, _) => return None,
            (_, wire) => skip(msg, &mut at, wire)?,
        }
    }
    Some(into)
}

/// Skips an unknown field (groups are left to prost).
fn skip(msg: &[u8], at: &mut usize, wire: u64) -> Option<()> {
    let len = match wire {
        VARINT => return varint(msg, at).map(drop),
        LEN => return bytes(msg, at).map(drop),
        I64 => 8,
        I32 => 4,
        _ => return None,
    };
    *at = at.checked_add(len).filter(|&e| e <= msg.len())?;
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferencecache_proto::v1alpha1::LookupRouteRequest;
    use proptest::prelude::*;
    use prost::Message;

    /// The differential check: a view from [`decode`] must equal prost's decode of the bytes.
    fn check(msg: &[u8]) -> Option<()> {
        let mut scratch = DecodeScratch::default();
        let mut slices = Vec::new();
        let fast = decode(msg, &mut scratch, &mut slices);
        let prost = LookupRouteRequest::decode(msg);
        match (&fast, &prost) {
            (Some(view), Ok(req)) => assert_eq!(*view, LookupRouteView::from(req), "{msg:?}"),
            (Some(view), Err(e)) => panic!("decoded {view:?}, prost refused: {e}; {msg:?}"),
            (None, _) => {}
        }
        fast.map(drop)
    }

    fn request() -> impl proptest::strategy::Strategy<Value = LookupRouteRequest> {
        let hash = prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 8..=8),
            1 => prop::collection::vec(any::<u8>(), 0..40),
        ];
        (
            (
                "\\PC{0,12}",
                "[a-z]{0,8}",
                "[a-z]{0,6}",
                "\\PC{0,20}",
                "[a-z]{0,4}",
            ),
            (prop::collection::vec(any::<u8>(), 0..12), any::<i32>()),
            prop::option::of((any::<i32>(), any::<i32>())),
            prop::collection::vec(hash, 0..40),
            prop::collection::vec(any::<i32>(), 0..40),
            prop::collection::vec(any::<u32>(), 0..40),
        )
            .prop_map(|(names, prefix, slo, hashes, counts, tokens)| {
                let (model_id, tenant_id, hash_scheme, prompt_text, adapter_id) = names;
                LookupRouteRequest {
                    model_id,
                    tenant_id,
                    prefix_hash: prefix.0,
                    prefix_token_count: prefix.1,
                    hash_scheme,
                    slo: slo.map(|(ttft_ms, tbt_ms)| Slo { ttft_ms, tbt_ms }),
                    block_hashes: hashes.into_iter().map(Into::into).collect(),
                    block_token_counts: counts,
                    token_ids: tokens,
                    prompt_text,
                    adapter_id,
                }
            })
    }

    proptest! {
        /// Every well-formed request decodes, to exactly what prost decodes.
        #[test]
        fn every_encoded_request_decodes_as_prost_does(req in request()) {
            let msg = req.encode_to_vec();
            prop_assert!(check(&msg).is_some(), "refused {req:?}");
        }

        /// Mutated, cut and extended messages: a view is returned only when prost agrees.
        #[test]
        fn damaged_messages_decode_as_prost_does_or_not_at_all(
            req in request(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..6),
            tail in prop::collection::vec(any::<u8>(), 0..16),
        ) {
            let mut msg = req.encode_to_vec();
            for (at, byte, op) in edits {
                let i = if msg.is_empty() { 0 } else { at.index(msg.len()) };
                match op {
                    0 if !msg.is_empty() => msg[i] = byte,
                    1 => msg.insert(i, byte),
                    2 if !msg.is_empty() => { msg.remove(i); }
                    _ => msg.truncate(i),
                }
            }
            msg.extend(tail);
            check(&msg);
        }

        /// Arbitrary bytes: never a panic, never a view prost would not give.
        #[test]
        fn arbitrary_bytes_decode_as_prost_does_or_not_at_all(
            msg in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            check(&msg);
        }
    }

    /// Encodings prost accepts that its own encoder never writes: unpacked repeated varints,
    /// repeated scalars and strings (the last wins), two SLO fields (merged), unknown fields of
    /// every wire type but groups, and non-minimal varints.
    #[test]
    fn other_valid_encodings_decode_as_prost_does() {
        let cases: &[&[u8]] = &[
            &[0x40, 0x10, 0x40, 0x20],                         // counts 16, 32 unpacked
            &[0x42, 0x02, 0x10, 0x20, 0x40, 0x05],             // packed then unpacked
            &[0x48, 0xff, 0xff, 0xff, 0xff, 0x0f],             // token id u32::MAX
            &[0x0a, 0x01, b'a', 0x0a, 0x01, b'b'],             // model "a" then "b"
            &[0x20, 0x01, 0x20, 0x02],                         // prefix_token_count 1 then 2
            &[0x32, 0x02, 0x08, 0x05, 0x32, 0x02, 0x10, 0x07], // SLO {ttft 5} + {tbt 7}
            &[0x32, 0x04, 0x08, 0x05, 0x18, 0x01],             // SLO with an unknown field
            &[
                0x60, 0x01, 0x69, 0, 0, 0, 0, 0, 0, 0, 0, 0x75, 0, 0, 0, 0, 0x7a, 0x00,
            ], // unknowns
            &[0x20, 0x80, 0x00],                               // a two-byte zero
            &[
                0x20, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ], // -1 as 10 bytes
            &[0x3a, 0x00, 0x3a, 0x03, 1, 2, 3, 0x42, 0x02, 1, 2], // hashes of 0 and 3 bytes
            &[],
        ];
        for msg in cases {
            assert!(check(msg).is_some(), "{msg:?}");
        }
    }

    /// What goes to prost instead: groups, wire types a known field cannot have, invalid UTF-8,
    /// over-long varints and lengths past the end.
    #[test]
    fn unusual_or_broken_encodings_go_to_the_general_path() {
        let cases: &[&[u8]] = &[
            &[0x63, 0x64],       // a group (field 12)
            &[0x08, 0x01],       // model_id as a varint
            &[0x3d, 0, 0, 0, 0], // a block hash as fixed32
            &[0x0a, 0x01, 0xff], // invalid UTF-8
            &[
                0x20, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
            ], // 10th byte 2
            &[0x0a, 0x05, b'a'], // length past the end
            &[0x00, 0x01],       // field 0
            &[0x42, 0x02, 0x80], // packed run ends inside a varint
        ];
        for msg in cases {
            assert!(check(msg).is_none(), "{msg:?}");
        }
    }

    #[test]
    fn eight_byte_hashes_are_borrowed_in_place_or_copied_and_others_borrowed() {
        let eight = LookupRouteRequest {
            block_hashes: vec![vec![1u8; 8].into(), vec![2u8; 8].into()],
            ..Default::default()
        };
        let mut mixed = eight.clone();
        mixed.block_hashes.push(vec![3u8; 5].into());
        let (mut scratch, mut slices) = (DecodeScratch::default(), Vec::new());
        let msg = eight.encode_to_vec();
        let view = decode(&msg, &mut scratch, &mut slices).unwrap();
        assert!(matches!(view.block_hashes, BlockHashes::Strided(h) if h.len() == 2));
        assert_eq!(view.block_hashes.get(1), [2u8; 8]);
        // Not one after another (a count between them): copied.
        let mut apart = eight.encode_to_vec();
        apart.splice(10..10, [0x40, 0x10]);
        let (mut scratch, mut slices) = (DecodeScratch::default(), Vec::new());
        let view = decode(&apart, &mut scratch, &mut slices).unwrap();
        assert!(matches!(view.block_hashes, BlockHashes::Fixed(h) if h.len() == 2));
        assert_eq!(view.block_hashes.get(1), [2u8; 8]);
        let (mut scratch, mut slices) = (DecodeScratch::default(), Vec::new());
        let msg = mixed.encode_to_vec();
        let view = decode(&msg, &mut scratch, &mut slices).unwrap();
        assert!(matches!(view.block_hashes, BlockHashes::Slices(h) if h.len() == 3));
        // The two in place before the 5-byte one keep their offsets.
        assert_eq!(view.block_hashes.get(0), [1u8; 8]);
        assert_eq!(view.block_hashes.get(1), [2u8; 8]);
        assert_eq!(view.block_hashes.get(2), [3u8; 5]);
    }

    #[test]
    fn scratch_keeps_a_bounded_capacity() {
        let n = 4 * INLINE_DECODE_KEEP_ENTRIES;
        let req = LookupRouteRequest {
            block_hashes: (0..n as u64)
                .map(|i| i.to_be_bytes().to_vec().into())
                .collect(),
            block_token_counts: vec![16; n],
            token_ids: vec![7; n],
            ..Default::default()
        };
        let msg = req.encode_to_vec();
        let mut scratch = DecodeScratch::default();
        let mut slices = Vec::new();
        assert!(decode(&msg, &mut scratch, &mut slices).is_some());
        scratch.trim();
        for cap in [
            scratch.ranges.capacity(),
            scratch.fixed.capacity(),
            scratch.counts.capacity(),
            scratch.token_ids.capacity(),
        ] {
            assert!(cap <= INLINE_DECODE_KEEP_ENTRIES, "{cap}");
        }
    }
}
