//! Header blocks: requests decoded (`super::hpack`) into a compact [`HeaderList`] (checked against
//! RFC 9113 §8.2–8.3 as it is decoded) and HPACK encoding of responses.
//!
//! Responses are encoded as literals without indexing: the server keeps no dynamic table for
//! its own headers, so no state has to be shared between streams or kept per connection on the
//! sending side, and a gRPC answer's few headers cost a handful of bytes either way.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};

/// The HPACK dynamic table size this server uses for decoding (SETTINGS_HEADER_TABLE_SIZE's
/// default, which the server does not change).
pub const DECODER_TABLE_BYTES: usize = 4096;
/// Per-entry overhead of a header list's size (RFC 9113 §6.5.2).
const ENTRY_OVERHEAD: usize = 32;

/// A decoded header list in one buffer: entries `[u16 name len][u16 value len][name][value]`,
/// pseudo-headers first.
#[derive(Clone, Debug, Default)]
pub struct HeaderList {
    buf: Bytes,
    /// The request's `content-length`, parsed as it was decoded (§8.1.1).
    content_length: Option<u64>,
}

impl HeaderList {
    /// Every `(name, value)` in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let mut rest = &self.buf[..];
        std::iter::from_fn(move || {
            if rest.len() < 4 {
                return None;
            }
            let name_len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
            let value_len = usize::from(u16::from_be_bytes([rest[2], rest[3]]));
            let (name, tail) = rest[4..].split_at(name_len);
            let (value, tail) = tail.split_at(value_len);
            rest = tail;
            Some((name, value))
        })
    }

    /// The request's declared `content-length`, if it has one.
    pub fn content_length(&self) -> Option<u64> {
        self.content_length
    }

    /// Bytes the list occupies.
    pub fn byte_len(&self) -> usize {
        self.buf.len()
    }

    /// The value of the first header named `name`.
    pub fn get(&self, name: &[u8]) -> Option<&[u8]> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The request head as `http` types; `None` when a pseudo-header or value does not parse.
    pub fn to_request(&self) -> Option<http::request::Builder> {
        let mut builder = http::Request::builder().version(http::Version::HTTP_2);
        let mut uri = http::Uri::builder();
        // A URI with a scheme needs an authority; without `:authority` only the path is kept.
        let has_authority = self.get(b":authority").is_some();
        for (name, value) in self.iter() {
            match name {
                b":method" => builder = builder.method(http::Method::from_bytes(value).ok()?),
                b":scheme" if has_authority => uri = uri.scheme(value),
                b":scheme" => {}
                b":authority" => uri = uri.authority(value),
                b":path" => uri = uri.path_and_query(value),
                _ => {
                    let name = HeaderName::from_bytes(name).ok()?;
                    let value = HeaderValue::from_bytes(value).ok()?;
                    builder = builder.header(name, value);
                }
            }
        }
        Some(builder.uri(uri.build().ok()?))
    }

    /// Trailers as a header map; `None` when a name or value does not parse.
    pub fn to_header_map(&self) -> Option<HeaderMap> {
        let mut map = HeaderMap::new();
        for (name, value) in self.iter() {
            map.append(
                HeaderName::from_bytes(name).ok()?,
                HeaderValue::from_bytes(value).ok()?,
            );
        }
        Some(map)
    }
}

/// What a header block decoded to.
#[derive(Debug)]
pub enum Decoded {
    /// A well-formed list.
    List(HeaderList),
    /// Larger than the advertised SETTINGS_MAX_HEADER_LIST_SIZE (decoded, not kept).
    TooLarge,
    /// Malformed (RFC 9113 §8.1.1): a stream error of type PROTOCOL_ERROR.
    Malformed,
}

/// The HPACK decoding state of one connection.
pub struct Decoder {
    hpack: super::hpack::Decoder,
    max_list_bytes: usize,
    /// The last `(:scheme, :authority)` pair that parsed as a URI: clients send the same pair
    /// on every request, so a repeat is a compare.
    uri_memo: Option<(Vec<u8>, Vec<u8>)>,
}

/// An HPACK decoding failure: a connection error of type COMPRESSION_ERROR.
#[derive(Debug)]
pub struct CompressionError;

/// Checks one entry as it is decoded.
struct ListCheck {
    size: usize,
    seen_regular: bool,
    seen_pseudo: u8,
    malformed: bool,
    content_length: Option<u64>,
}

impl Decoder {
    pub fn new(max_list_bytes: usize) -> Self {
        Decoder {
            hpack: super::hpack::Decoder::new(DECODER_TABLE_BYTES),
            max_list_bytes,
            uri_memo: None,
        }
    }

    /// Decodes one complete header block into `arena` (whose written part becomes the list).
    /// `trailers`: a block that ends a request, which carries no pseudo-headers.
    pub fn decode(
        &mut self,
        block: &[u8],
        trailers: bool,
        arena: &mut BytesMut,
    ) -> Result<Decoded, CompressionError> {
        debug_assert!(arena.is_empty());
        let mut check = ListCheck {
            size: 0,
            seen_regular: false,
            seen_pseudo: 0,
            malformed: false,
            content_length: None,
        };
        let max = self.max_list_bytes;
        self.hpack
            .decode(block, |name, value| {
                check.size += name.len() + value.len() + ENTRY_OVERHEAD;
                if check.size > max || check.malformed {
                    return;
                }
                if !check.admit(name, value, trailers) {
                    check.malformed = true;
                    return;
                }
                arena.put_u16(name.len() as u16);
                arena.put_u16(value.len() as u16);
                arena.put_slice(name);
                arena.put_slice(value);
            })
            .map_err(|_| CompressionError)?;
        let evicted = self.hpack.take_evicted_bytes();
        if evicted > 0 {
            crate::metrics::record_hpack_evicted(evicted);
        }
        let list = HeaderList {
            buf: arena.split().freeze(),
            content_length: check.content_length,
        };
        Ok(if check.size > max {
            Decoded::TooLarge
        } else if check.malformed
            || (!trailers && (check.seen_pseudo & REQUIRED) != REQUIRED)
            || (!trailers && !self.uri_parses(&list))
        {
            Decoded::Malformed
        } else {
            Decoded::List(list)
        })
    }

    /// Whether the request's `:scheme` and `:authority` parse as [`HeaderList::to_request`]
    /// parses them. Checked here, for every request, so that a request the general path could
    /// not convert is malformed on the inline path too (one answer for the same bytes).
    fn uri_parses(&mut self, list: &HeaderList) -> bool {
        // Without `:authority` the request's URI is its path alone (as in `to_request`).
        let Some(authority) = list.get(b":authority") else {
            return true;
        };
        let scheme = list.get(b":scheme").unwrap_or_default();
        if let Some((s, a)) = &self.uri_memo
            && s == scheme
            && a == authority
        {
            return true;
        }
        let uri = http::Uri::builder()
            .scheme(scheme)
            .authority(authority)
            .path_and_query("/")
            .build();
        if uri.is_ok() {
            self.uri_memo = Some((scheme.to_vec(), authority.to_vec()));
        }
        uri.is_ok()
    }
}

const METHOD: u8 = 1;
const SCHEME: u8 = 2;
const PATH: u8 = 4;
const AUTHORITY: u8 = 8;
/// The pseudo-headers every (non-CONNECT) request carries (RFC 9113 §8.3.1).
const REQUIRED: u8 = METHOD | SCHEME | PATH;

/// Whether `value` holds a control character other than HTAB, or DEL. Checked 16 bytes at a
/// time with no early exit inside a chunk, which the compiler turns into vector compares: a
/// value near the list bound (an HPACK bomb references a 4 KB one in every block) costs a few
/// hundred instructions instead of a branch per byte.
fn has_control(value: &[u8]) -> bool {
    let bad = |b: u8| (b < 0x20) & (b != b'\t') | (b == 0x7f);
    let mut chunks = value.chunks_exact(16);
    for chunk in &mut chunks {
        if chunk.iter().fold(false, |seen, &b| seen | bad(b)) {
            return true;
        }
    }
    chunks.remainder().iter().any(|&b| bad(b))
}

impl ListCheck {
    /// Whether the entry may appear here (RFC 9113 §8.2.1, §8.2.2, §8.3).
    fn admit(&mut self, name: &[u8], value: &[u8], trailers: bool) -> bool {
        if name.len() > usize::from(u16::MAX) || value.len() > usize::from(u16::MAX) {
            return false;
        }
        // NUL, CR and LF are malformed (§8.2.1); like grpc-go and the `http` crate, so is any
        // other control character but HTAB.
        if has_control(value) {
            return false;
        }
        if let Some(pseudo) = name.strip_prefix(b":") {
            let bit = match pseudo {
                b"method" => METHOD,
                b"scheme" => SCHEME,
                b"path" => PATH,
                b"authority" => AUTHORITY,
                _ => return false,
            };
            let fresh = self.seen_pseudo & bit == 0;
            self.seen_pseudo |= bit;
            let empty_path = bit == PATH && value.is_empty();
            return !trailers && !self.seen_regular && fresh && !empty_path;
        }
        self.seen_regular = true;
        if name.is_empty() || !name.iter().all(|&b| is_lowercase_token(b)) {
            return false;
        }
        match name {
            b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding"
            | b"upgrade" => false,
            b"te" => value == b"trailers",
            b"content-length" if !trailers => self.content_length(value),
            _ => true,
        }
    }

    /// Notes a request's `content-length`: digits only, and every copy the same value
    /// (RFC 9110 §8.6); anything else is malformed.
    fn content_length(&mut self, value: &[u8]) -> bool {
        if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
            return false;
        }
        let n = value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        let first = *self.content_length.get_or_insert(n);
        first == n
    }
}

/// A header-name byte: an RFC 9110 token character, not uppercase.
fn is_lowercase_token(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*'
        | b'+' | b'-' | b'.' | b'^' | b'_' | b'`' | b'|' | b'~')
}

/// Encodes a response head: `:status` then every header, as literals without indexing.
pub fn encode_response_head(status: http::StatusCode, headers: &HeaderMap, out: &mut BytesMut) {
    if status == http::StatusCode::OK {
        out.put_u8(0x88);
    } else {
        // Literal without indexing, indexed name 8 (`:status`).
        out.put_u8(0x08);
        encode_string(status.as_str().as_bytes(), out);
    }
    encode_fields(headers, out);
}

/// Encodes trailers (or any header map) as literals without indexing.
pub fn encode_fields(headers: &HeaderMap, out: &mut BytesMut) {
    for (name, value) in headers {
        out.put_u8(0x00);
        encode_string(name.as_str().as_bytes(), out);
        encode_string(value.as_bytes(), out);
    }
}

/// A string literal without Huffman coding (RFC 7541 §5.2).
fn encode_string(s: &[u8], out: &mut BytesMut) {
    encode_integer(s.len(), 7, 0x00, out);
    out.put_slice(s);
}

/// An integer with an `n`-bit prefix (RFC 7541 §5.1); `first` holds the bits above the prefix.
fn encode_integer(mut value: usize, prefix_bits: u8, first: u8, out: &mut BytesMut) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.put_u8(first | value as u8);
        return;
    }
    out.put_u8(first | max as u8);
    value -= max;
    while value >= 128 {
        out.put_u8((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.put_u8(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literal(name: &str, value: &str) -> Vec<u8> {
        let mut out = BytesMut::new();
        out.put_u8(0);
        encode_string(name.as_bytes(), &mut out);
        encode_string(value.as_bytes(), &mut out);
        out.to_vec()
    }

    fn block(fields: &[(&str, &str)]) -> Vec<u8> {
        fields.iter().flat_map(|(n, v)| literal(n, v)).collect()
    }

    fn request(extra: &[(&str, &str)]) -> Vec<(&'static str, String)> {
        let mut v: Vec<(&str, String)> = vec![
            (":method", "POST".into()),
            (":scheme", "http".into()),
            (":path", "/a.B/C".into()),
        ];
        for (n, val) in extra {
            v.push((Box::leak(n.to_string().into_boxed_str()), val.to_string()));
        }
        v
    }

    fn decode(fields: &[(&str, String)], trailers: bool) -> Decoded {
        let pairs: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let mut d = Decoder::new(16 * 1024);
        d.decode(&block(&pairs), trailers, &mut BytesMut::new())
            .unwrap()
    }

    #[test]
    fn a_request_decodes_and_converts() {
        let Decoded::List(list) = decode(&request(&[("content-type", "application/grpc")]), false)
        else {
            panic!("malformed")
        };
        assert_eq!(list.get(b":path"), Some(&b"/a.B/C"[..]));
        assert_eq!(list.get(b"content-type"), Some(&b"application/grpc"[..]));
        let req = list.to_request().unwrap().body(()).unwrap();
        assert_eq!(req.method(), http::Method::POST);
        assert_eq!(req.uri().path(), "/a.B/C");
        assert_eq!(req.headers()["content-type"], "application/grpc");

        let mut fields = request(&[]);
        fields.push((":authority", "example:1".into()));
        let Decoded::List(list) = decode(&fields, false) else {
            panic!("malformed")
        };
        let req = list.to_request().unwrap().body(()).unwrap();
        assert_eq!(req.uri().to_string(), "http://example:1/a.B/C");
    }

    #[test]
    fn control_characters_are_found_anywhere_in_a_value() {
        for len in [0usize, 1, 15, 16, 17, 40, 4_000] {
            let clean = vec![b'a'; len];
            assert!(!has_control(&clean), "{len}");
            let mut tabbed = clean.clone();
            if len > 0 {
                tabbed[len - 1] = b'\t';
                assert!(!has_control(&tabbed), "HTAB is allowed ({len})");
            }
            for at in [0, len / 2, len.saturating_sub(1)]
                .into_iter()
                .filter(|&at| at < len)
            {
                for bad in [0u8, b'\r', b'\n', 0x1f, 0x7f] {
                    let mut v = clean.clone();
                    v[at] = bad;
                    assert!(has_control(&v), "{bad:#x} at {at} of {len}");
                }
            }
        }
    }

    #[test]
    fn malformed_requests_are_refused() {
        let cases: Vec<Vec<(&str, String)>> = vec![
            request(&[("Content-Type", "x")]),
            request(&[("connection", "close")]),
            request(&[("te", "gzip")]),
            request(&[("x", "a\nb")]),
            request(&[(":unknown", "x")]),
            vec![(":method", "POST".into()), (":path", "/x".into())],
            {
                let mut r = request(&[("a", "b")]);
                r.push((":authority", "late".into()));
                r
            },
            {
                let mut r = request(&[]);
                r.push((":path", "/twice".into()));
                r
            },
        ];
        for fields in cases {
            assert!(
                matches!(decode(&fields, false), Decoded::Malformed),
                "{fields:?}"
            );
        }
        assert!(matches!(
            decode(&request(&[("te", "trailers")]), false),
            Decoded::List(_)
        ));
    }

    #[test]
    fn content_length_is_parsed_or_malformed() {
        let length = |values: &[&str]| {
            let extra: Vec<(&str, &str)> = values.iter().map(|v| ("content-length", *v)).collect();
            match decode(&request(&extra), false) {
                Decoded::List(list) => Some(list.content_length()),
                _ => None,
            }
        };
        assert_eq!(length(&[]), Some(None));
        assert_eq!(length(&["0"]), Some(Some(0)));
        assert_eq!(length(&["1234"]), Some(Some(1234)));
        assert_eq!(length(&["7", "7"]), Some(Some(7)));
        assert_eq!(
            length(&["9999999999999999999"]),
            Some(Some(9_999_999_999_999_999_999))
        );
        for bad in [
            &["7", "8"][..],
            &["-1"],
            &[""],
            &["1 "],
            &["0x10"],
            &["1,1"],
            &["99999999999999999999"],
        ] {
            assert_eq!(length(bad), None, "{bad:?}");
        }
        // In trailers it is an ordinary field.
        assert!(matches!(
            decode(&[("content-length", "x".into())], true),
            Decoded::List(_)
        ));
    }

    #[test]
    fn trailers_carry_no_pseudo_headers() {
        assert!(matches!(
            decode(&[("grpc-status", "0".into())], true),
            Decoded::List(_)
        ));
        assert!(matches!(
            decode(&[(":path", "/x".into())], true),
            Decoded::Malformed
        ));
    }

    #[test]
    fn oversize_lists_are_flagged_but_decoded() {
        let big = "v".repeat(20_000);
        assert!(matches!(
            decode(&request(&[("x", &big)]), false),
            Decoded::TooLarge
        ));
    }

    #[test]
    fn responses_encode_to_what_a_decoder_reads_back() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/grpc"));
        headers.insert(
            "grpc-message",
            HeaderValue::from_str(&"m".repeat(300)).unwrap(),
        );
        let mut out = BytesMut::new();
        encode_response_head(http::StatusCode::NOT_FOUND, &headers, &mut out);
        let decoded = loona_hpack::Decoder::new().decode(&out).unwrap();
        assert_eq!(decoded[0], (b":status".to_vec(), b"404".to_vec()));
        assert_eq!(decoded[1].1, b"application/grpc".to_vec());
        assert_eq!(decoded[2].1.len(), 300);
    }
}
