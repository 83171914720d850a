//! HPACK decoding (RFC 7541): the dynamic table, integer and string literals, and Huffman
//! codes decoded a byte at a time from a lookup table.
//!
//! Why our own: the crates at hand rebuild a map-based Huffman decoder for every string, which
//! made header decoding the largest cost of a request. Here decoding allocates only when the
//! peer adds an entry to the dynamic table, and a Huffman symbol of up to 8 bits (every
//! letter, digit and common punctuation mark) is one table lookup.

use std::collections::VecDeque;
use std::sync::OnceLock;

use super::hpack_tables::{HUFFMAN_CODES, STATIC_TABLE};

/// Per-entry overhead of the dynamic table's size (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;
/// Largest integer a field may carry; more continuation bytes than this needs are an error.
const MAX_INTEGER: usize = 1 << 28;
/// Most bytes one integer may take (RFC 7541 §5.1): the prefix and four continuation bytes,
/// 28 bits, which carries every value up to [`MAX_INTEGER`]. Over-long encodings (padding
/// `0x80` bytes) past it are a COMPRESSION_ERROR, as in `h2`.
const MAX_INTEGER_BYTES: usize = 5;

/// A decoding failure: a connection error of type COMPRESSION_ERROR.
#[derive(Debug, PartialEq, Eq)]
pub struct HpackError(pub &'static str);

/// The decoding state of one connection.
pub struct Decoder {
    /// Newest entry first; each entry is its name followed by its value.
    dynamic: VecDeque<(usize, Box<[u8]>)>,
    size: usize,
    max_size: usize,
    /// Entry bytes evicted since [`Decoder::take_evicted_bytes`] last took them.
    evicted_bytes: u64,
    /// The bound the peer may set `max_size` to (our SETTINGS_HEADER_TABLE_SIZE).
    max_allowed: usize,
    name_scratch: Vec<u8>,
    value_scratch: Vec<u8>,
    /// The last Huffman values decoded: `(encoded, decoded)`. Clients send some values as
    /// literals on every request (nghttp2 never indexes `:path` or `content-length`), so a
    /// repeat is a compare.
    memo: [(Vec<u8>, Vec<u8>); MEMO_SLOTS],
    /// The slot the next new value replaces (round robin).
    memo_next: usize,
    /// Huffman strings decoded (not served from the memo), for the memo's tests.
    #[cfg(test)]
    huffman_decodes: usize,
}

/// Longest encoded Huffman value kept in the memo.
const MEMO_MAX_BYTES: usize = 256;
/// Values the memo keeps: enough for the handful a client repeats unindexed in one block
/// (one slot thrashed between nghttp2's `:path` and `content-length`).
const MEMO_SLOTS: usize = 4;

/// Where a string literal's bytes are: in the block, or decoded into a scratch buffer.
enum Str {
    Raw(usize, usize),
    Name,
    Value,
    /// A memo slot's decoded value.
    Memo(usize),
}

impl Decoder {
    pub fn new(max_table_bytes: usize) -> Self {
        Decoder {
            dynamic: VecDeque::new(),
            size: 0,
            max_size: max_table_bytes,
            evicted_bytes: 0,
            max_allowed: max_table_bytes,
            name_scratch: Vec::new(),
            value_scratch: Vec::new(),
            memo: Default::default(),
            memo_next: 0,
            #[cfg(test)]
            huffman_decodes: 0,
        }
    }

    /// The bytes of dynamic-table entries evicted since the last call (RFC 7541 §4.1 sizes): the
    /// table's churn, for `inferencecache_http2_hpack_evicted_bytes_total`.
    pub fn take_evicted_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.evicted_bytes)
    }

    /// Decodes one complete header block, calling `field` for each `(name, value)` in order.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let mut at = 0;
        let mut fields_seen = false;
        while at < block.len() {
            let b = block[at];
            if b & 0x80 != 0 {
                let index = integer(block, &mut at, 7)?;
                let (name, value) = self.entry(index)?;
                field(name, value);
                fields_seen = true;
            } else if b & 0xe0 == 0x20 {
                // A dynamic table size update: only at the start of a block (§4.2).
                let size = integer(block, &mut at, 5)?;
                if fields_seen || size > self.max_allowed {
                    return Err(HpackError("table size update"));
                }
                self.max_size = size;
                self.evict_to(size);
            } else {
                let (prefix, indexing) = if b & 0xc0 == 0x40 {
                    (6, true)
                } else {
                    (4, false)
                };
                self.literal(block, &mut at, prefix, indexing, &mut field)?;
                fields_seen = true;
            }
        }
        Ok(())
    }

    /// A literal field: name by index or literal, value literal; added to the table if asked.
    fn literal(
        &mut self,
        block: &[u8],
        at: &mut usize,
        prefix: u8,
        indexing: bool,
        field: &mut impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let index = integer(block, at, prefix)?;
        let name_at = if index == 0 {
            Some(self.string(block, at, Str::Name)?)
        } else {
            None
        };
        let value_at = self.string(block, at, Str::Value)?;
        if indexing {
            let mut entry = Vec::new();
            match &name_at {
                Some(s) => entry.extend_from_slice(self.resolve(block, s)),
                None => entry.extend_from_slice(self.entry(index)?.0),
            }
            let name_len = entry.len();
            entry.extend_from_slice(self.resolve(block, &value_at));
            field(&entry[..name_len], &entry[name_len..]);
            self.insert(name_len, entry.into_boxed_slice());
            return Ok(());
        }
        let value = self.resolve(block, &value_at);
        match &name_at {
            Some(s) => field(self.resolve(block, s), value),
            None => field(self.entry(index)?.0, value),
        }
        Ok(())
    }

    fn resolve<'a>(&'a self, block: &'a [u8], s: &Str) -> &'a [u8] {
        match *s {
            Str::Raw(start, end) => &block[start..end],
            Str::Name => &self.name_scratch,
            Str::Value => &self.value_scratch,
            Str::Memo(slot) => &self.memo[slot].1,
        }
    }

    /// A string literal (§5.2): raw bytes stay in the block, Huffman ones go to `into`.
    fn string(&mut self, block: &[u8], at: &mut usize, into: Str) -> Result<Str, HpackError> {
        let huffman = block.get(*at).ok_or(HpackError("truncated string"))? & 0x80 != 0;
        let len = integer(block, at, 7)?;
        let end = at.checked_add(len).filter(|&e| e <= block.len());
        let end = end.ok_or(HpackError("string past the block"))?;
        let raw = &block[*at..end];
        let start = *at;
        *at = end;
        if !huffman {
            return Ok(Str::Raw(start, end));
        }
        let value = matches!(into, Str::Value);
        if value && let Some(slot) = self.memo.iter().position(|(enc, _)| enc == raw) {
            return Ok(Str::Memo(slot));
        }
        let out = match into {
            Str::Name => &mut self.name_scratch,
            _ => &mut self.value_scratch,
        };
        out.clear();
        huffman_decode(raw, out)?;
        #[cfg(test)]
        {
            self.huffman_decodes += 1;
        }
        if value && raw.len() <= MEMO_MAX_BYTES {
            let (enc, dec) = &mut self.memo[self.memo_next];
            self.memo_next = (self.memo_next + 1) % MEMO_SLOTS;
            enc.clear();
            enc.extend_from_slice(raw);
            dec.clear();
            dec.extend_from_slice(&self.value_scratch);
        }
        Ok(into)
    }

    /// Entry `index` of the static then the dynamic table.
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        if index == 0 {
            return Err(HpackError("index 0"));
        }
        if let Some((name, value)) = STATIC_TABLE.get(index - 1) {
            return Ok((name, value));
        }
        let (name_len, data) = self
            .dynamic
            .get(index - 1 - STATIC_TABLE.len())
            .ok_or(HpackError("index past the table"))?;
        Ok(data.split_at(*name_len))
    }

    fn insert(&mut self, name_len: usize, data: Box<[u8]>) {
        let size = data.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            // Larger than the table: the table is emptied and nothing added (§4.4).
            self.evict_to(0);
            return;
        }
        self.evict_to(self.max_size - size);
        self.size += size;
        self.dynamic.push_front((name_len, data));
    }

    fn evict_to(&mut self, bound: usize) {
        while self.size > bound {
            let (_, data) = self.dynamic.pop_back().expect("size counts entries");
            self.size -= data.len() + ENTRY_OVERHEAD;
            self.evicted_bytes += (data.len() + ENTRY_OVERHEAD) as u64;
        }
    }
}

#[cfg(test)]
impl Decoder {
    /// The dynamic table's size and its current bound (the fuzz tests check both).
    pub(super) fn table_bytes(&self) -> (usize, usize) {
        (self.size, self.max_size)
    }
}

/// An integer with an `n`-bit prefix (§5.1), advancing `at` past it. At most
/// [`MAX_INTEGER_BYTES`] bytes (the prefix and four continuation bytes, as `h2` allows): a
/// longer encoding is an error, so the shift never passes 28 bits whatever the peer sends.
fn integer(block: &[u8], at: &mut usize, prefix_bits: u8) -> Result<usize, HpackError> {
    let max = (1usize << prefix_bits) - 1;
    let first = usize::from(*block.get(*at).ok_or(HpackError("truncated integer"))?) & max;
    *at += 1;
    if first < max {
        return Ok(first);
    }
    let mut value = max;
    for continuation in 0..MAX_INTEGER_BYTES - 1 {
        let b = *block.get(*at).ok_or(HpackError("truncated integer"))?;
        *at += 1;
        value += usize::from(b & 0x7f) << (7 * continuation);
        if value > MAX_INTEGER {
            return Err(HpackError("integer too large"));
        }
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(HpackError("integer too long"))
}

/// Symbols whose codes are at most [`SHORT_BITS`] long decode from one table lookup.
const SHORT_BITS: u32 = 8;

/// The Huffman code as canonical tables: the short-code lookup table, and per code length the
/// first code, where its symbols start in `sorted`, and how many there are.
struct Huffman {
    /// Indexed by the next 8 bits: `(symbol, length)`, length 0 when the code is longer.
    short: [(u16, u8); 256],
    first_code: [u32; 31],
    first_index: [u16; 31],
    count: [u16; 31],
    sorted: [u16; 257],
}

fn huffman() -> &'static Huffman {
    static TABLE: OnceLock<Huffman> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut h = Huffman {
            short: [(0, 0); 256],
            first_code: [0; 31],
            first_index: [0; 31],
            count: [0; 31],
            sorted: [0; 257],
        };
        let mut order: Vec<u16> = (0..257).collect();
        order.sort_by_key(|&s| (HUFFMAN_CODES[usize::from(s)].1, s));
        for (i, &s) in order.iter().enumerate() {
            let (code, len) = HUFFMAN_CODES[usize::from(s)];
            let len = usize::from(len);
            if h.count[len] == 0 {
                h.first_code[len] = code;
                h.first_index[len] = i as u16;
            }
            h.count[len] += 1;
            h.sorted[i] = s;
            if len as u32 <= SHORT_BITS {
                let spread = SHORT_BITS - len as u32;
                let base = (code << spread) as usize;
                for j in 0..(1usize << spread) {
                    h.short[base + j] = (s, len as u8);
                }
            }
        }
        h
    })
}

/// Decodes a Huffman-coded string (§5.2) onto `out`.
fn huffman_decode(mut input: &[u8], out: &mut Vec<u8>) -> Result<(), HpackError> {
    let h = huffman();
    // Bits not yet decoded, in the low `bits` bits of `acc`.
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    loop {
        while bits <= 56 && !input.is_empty() {
            acc = (acc << 8) | u64::from(input[0]);
            input = &input[1..];
            bits += 8;
        }
        if bits == 0 {
            return Ok(());
        }
        let peek = if bits >= SHORT_BITS {
            (acc >> (bits - SHORT_BITS)) as usize & 0xff
        } else {
            ((acc << (SHORT_BITS - bits)) as usize) & 0xff
        };
        let (symbol, len) = h.short[peek];
        if len != 0 && u32::from(len) <= bits {
            out.push(symbol as u8);
            bits -= u32::from(len);
            acc &= (1u64 << bits) - 1;
            continue;
        }
        match long_symbol(h, acc, bits) {
            Some((symbol, len)) if symbol < 256 => {
                out.push(symbol as u8);
                bits -= len;
                acc &= (1u64 << bits) - 1;
            }
            Some(_) => return Err(HpackError("EOS in string")),
            None => return end_padding(acc, bits),
        }
    }
}

/// A symbol whose code is longer than [`SHORT_BITS`], from the canonical tables; `None` when
/// the remaining bits hold no whole code (they must then be padding).
fn long_symbol(h: &Huffman, acc: u64, bits: u32) -> Option<(u16, u32)> {
    for len in SHORT_BITS + 1..=30.min(bits) {
        let code = (acc >> (bits - len)) as u32 & ((1u32 << len) - 1);
        let l = len as usize;
        let offset = code.wrapping_sub(h.first_code[l]);
        if h.count[l] > 0 && code >= h.first_code[l] && offset < u32::from(h.count[l]) {
            return Some((
                h.sorted[usize::from(h.first_index[l]) + offset as usize],
                len,
            ));
        }
    }
    None
}

/// The bits left after the last symbol: at most 7, all ones (a prefix of EOS) (§5.2).
fn end_padding(acc: u64, bits: u32) -> Result<(), HpackError> {
    if bits > 7 {
        return Err(HpackError("padding too long"));
    }
    if acc != (1u64 << bits) - 1 {
        return Err(HpackError("padding not EOS"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn decode_all(d: &mut Decoder, block: &[u8]) -> Vec<(String, String)> {
        let mut v = Vec::new();
        d.decode(block, |n, val| {
            v.push((
                String::from_utf8(n.to_vec()).unwrap(),
                String::from_utf8(val.to_vec()).unwrap(),
            ))
        })
        .unwrap();
        v
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    /// RFC 7541 Appendix C.3: requests without Huffman coding, sharing one dynamic table.
    #[test]
    fn rfc7541_c3_requests() {
        let mut d = Decoder::new(4096);
        let first = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        assert_eq!(
            decode_all(&mut d, &first),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        let second = hex("8286 84be 5808 6e6f 2d63 6163 6865");
        assert_eq!(
            decode_all(&mut d, &second),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache")
            ])
        );
        let third = hex("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65");
        assert_eq!(
            decode_all(&mut d, &third),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(d.size, 164);
    }

    /// RFC 7541 Appendix C.4: the same requests with Huffman coding.
    #[test]
    fn rfc7541_c4_huffman_requests() {
        let mut d = Decoder::new(4096);
        let first = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        assert_eq!(
            decode_all(&mut d, &first)[3],
            ("".to_string() + ":authority", "www.example.com".to_string())
        );
        let second = hex("8286 84be 5886 a8eb 1064 9cbf");
        assert_eq!(
            decode_all(&mut d, &second)[4],
            ("cache-control".to_string(), "no-cache".to_string())
        );
        let third = hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf");
        assert_eq!(
            decode_all(&mut d, &third)[4],
            ("custom-key".to_string(), "custom-value".to_string())
        );
        assert_eq!(d.size, 164);
    }

    /// Huffman-encodes `s` with the table (the test's own encoder).
    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
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
        out
    }

    #[test]
    fn every_byte_value_round_trips_through_huffman() {
        let all: Vec<u8> = (0..=255u8).collect();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for len in 0..300 {
            let s: Vec<u8> = (0..len)
                .map(|i| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    if i % 3 == 0 {
                        all[(seed % 256) as usize]
                    } else {
                        b'a' + (seed % 26) as u8
                    }
                })
                .collect();
            let mut out = Vec::new();
            huffman_decode(&huffman_encode(&s), &mut out).unwrap();
            assert_eq!(out, s);
        }
    }

    #[test]
    fn repeated_huffman_values_decode_the_same() {
        // Literal without indexing, static name :path (4), Huffman value; sent twice, then a
        // different value of the same length.
        let block = |path: &str| {
            let enc = huffman_encode(path.as_bytes());
            let mut b = vec![0x04, 0x80 | enc.len() as u8];
            b.extend(enc);
            b
        };
        let mut d = Decoder::new(4096);
        for path in ["/a.B/Call", "/a.B/Call", "/a.B/Cell", "/a.B/Call"] {
            assert_eq!(decode_all(&mut d, &block(path)), pairs(&[(":path", path)]));
        }
    }

    #[test]
    fn values_repeated_in_every_block_are_decoded_once() {
        // nghttp2 sends `:path` (static 4) and `content-length` (static 28) as Huffman literals
        // without indexing in every request: both must stay in the memo, and values beyond its
        // slots must still decode correctly.
        // The name index as a 4-bit-prefix integer: 4 fits, 28 is 15 + 13.
        let literal = |index: &[u8], value: &str| {
            let enc = huffman_encode(value.as_bytes());
            let mut b = index.to_vec();
            b.push(0x80 | enc.len() as u8);
            b.extend(enc);
            b
        };
        let block =
            |path: &str, len: &str| [literal(&[0x04], path), literal(&[0x0f, 0x0d], len)].concat();
        let mut d = Decoder::new(4096);
        for _ in 0..10 {
            let got = decode_all(&mut d, &block("/a.B/Call", "178"));
            assert_eq!(
                got,
                pairs(&[(":path", "/a.B/Call"), ("content-length", "178")])
            );
        }
        assert_eq!(d.huffman_decodes, 2, "one decode per distinct value");
        let paths: Vec<String> = (0..3 * MEMO_SLOTS)
            .map(|i| format!("/a.B/Call{i}"))
            .collect();
        for round in 0..2 {
            for p in &paths {
                let got = decode_all(&mut d, &block(p, "178"));
                assert_eq!(
                    got,
                    pairs(&[(":path", p.as_str()), ("content-length", "178")]),
                    "{round}"
                );
            }
        }
    }

    #[test]
    fn bad_huffman_padding_is_refused() {
        // "a" is 00011 (5 bits): padding must be ones.
        assert_eq!(
            huffman_decode(&[0b0001_1000], &mut Vec::new()),
            Err(HpackError("padding not EOS"))
        );
        assert!(huffman_decode(&[0b0001_1111], &mut Vec::new()).is_ok());
        // A whole byte of padding is too long.
        assert!(huffman_decode(&[0b0001_1111, 0xff], &mut Vec::new()).is_err());
    }

    #[test]
    fn malformed_blocks_are_errors_not_panics() {
        let mut d = Decoder::new(4096);
        for block in [
            &[0x80][..],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            &[0x41, 0x05, b'a'],
            &[0x00],
            &[0xbf],
            &[0x82, 0x3f, 0xe1, 0x1f],
        ] {
            assert!(d.decode(block, |_, _| {}).is_err(), "{block:?}");
        }
        // A size update above the allowed table size.
        assert!(
            Decoder::new(4096)
                .decode(&hex("3fe2 1f"), |_, _| {})
                .is_err()
        );
        assert!(
            Decoder::new(4096)
                .decode(&hex("3fe1 1f 82"), |_, _| {})
                .is_ok()
        );
    }

    #[test]
    fn integers_decode_at_the_rfc_7541_examples() {
        // §C.1.1: 10 in a 5-bit prefix; §C.1.2: 1337 in a 5-bit prefix; §C.1.3: 42 at 8 bits.
        for (bytes, prefix, want) in [
            (&[0x0a][..], 5, 10),
            (&[0x1f, 0x9a, 0x0a], 5, 1337),
            (&[0x2a], 8, 42),
        ] {
            let mut at = 0;
            assert_eq!(integer(bytes, &mut at, prefix), Ok(want), "{bytes:x?}");
            assert_eq!(at, bytes.len());
        }
    }

    #[test]
    fn integers_take_at_most_five_bytes() {
        // The prefix and four continuation bytes: the largest value allowed decodes.
        let mut at = 0;
        let five = [0x7f, 0x80, 0x80, 0x80, 0x7f];
        assert_eq!(integer(&five, &mut at, 7), Ok(127 + (0x7f << 21)));
        // A redundant zero continuation byte within five bytes is the same value.
        let mut at = 0;
        assert_eq!(integer(&[0x1f, 0x8a, 0x00], &mut at, 5), Ok(31 + 10));
        // Past 28 bits: too large.
        let mut at = 0;
        assert_eq!(
            integer(&[0x7f, 0xff, 0xff, 0xff, 0x7f], &mut at, 7),
            Err(HpackError("integer too large"))
        );
        // Six bytes, even of zero continuations: too long.
        let mut at = 0;
        assert_eq!(
            integer(&[0x7f, 0x80, 0x80, 0x80, 0x80, 0x00], &mut at, 7),
            Err(HpackError("integer too long"))
        );
        // Truncated.
        let mut at = 0;
        assert_eq!(
            integer(&[0x7f, 0x80], &mut at, 7),
            Err(HpackError("truncated integer"))
        );
    }

    #[test]
    fn an_over_long_integer_is_an_error_not_a_panic() {
        // Issue 32: `0xff` and twenty `0x80` shifted past 64 bits (a debug-build panic, a
        // wrong value in release). Now an error in every prefix size and field kind.
        let mut long = vec![0xffu8];
        long.extend_from_slice(&[0x80; 20]);
        let mut at = 0;
        assert_eq!(
            integer(&long, &mut at, 7),
            Err(HpackError("integer too long"))
        );
        let mut at = 0;
        assert!(integer(&long, &mut at, 8).is_err());
        for first in [0xff, 0x3f, 0x7f, 0x0f, 0x1f] {
            let mut block = vec![first];
            block.extend_from_slice(&[0x80; 20]);
            block.push(0x01);
            assert!(
                Decoder::new(4096).decode(&block, |_, _| {}).is_err(),
                "{first:#x}"
            );
        }
    }

    #[test]
    fn the_table_evicts_to_its_size() {
        let mut d = Decoder::new(64);
        // Literal with indexing, new name "ab" value "cd": 36 bytes with overhead.
        let add = hex("4002 6162 0263 64");
        decode_all(&mut d, &add);
        decode_all(&mut d, &add);
        assert_eq!((d.dynamic.len(), d.size), (1, 36));
        assert_eq!(decode_all(&mut d, &[0xbe]), pairs(&[("ab", "cd")]));
        assert!(d.decode(&[0xbf], |_, _| {}).is_err(), "evicted entry");
    }

    #[test]
    fn evicted_bytes_are_counted_once() {
        let mut d = Decoder::new(64);
        let add = hex("4002 6162 0263 64");
        decode_all(&mut d, &add);
        assert_eq!(d.take_evicted_bytes(), 0, "nothing evicted yet");
        decode_all(&mut d, &add);
        assert_eq!(
            d.take_evicted_bytes(),
            36,
            "the first entry made room for the second"
        );
        assert_eq!(d.take_evicted_bytes(), 0, "taken");
        // A table size update to 0 evicts the rest.
        decode_all(&mut d, &[0x20]);
        assert_eq!(d.take_evicted_bytes(), 36);
    }
}
