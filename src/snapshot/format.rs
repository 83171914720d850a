//! The snapshot file format (docs/ARCHITECTURE.md §6): pure encoding and decoding, no I/O
//! beyond the `std::io::Read` a decoder is handed.
//!
//! A file is a 48-byte header followed by sections and ends with an END section. Integers are
//! little-endian. Every section carries an XXH3-64 checksum of its 24-byte header (checksum
//! field zeroed) and body, so a flipped bit anywhere is caught before anything of the section is
//! used; the END section carries the totals, so a file cut at a section boundary is caught too.
//! The manifest also records each core file's length and whole-file XXH3-64.
//!
//! ```text
//! header   magic "ICSNAP\r\n" | version u32 | kind u32 | generation u64 | created_unix_ns i64
//!          | core u32 | cores u32 | xxh3-64 of the previous 40 bytes u64
//! section  kind u32 | count u32 | body_len u32 | reserved u32 (0) | checksum u64 | body
//! ENTRIES  body = names | keyspaces | count rows
//!          names     = n u32, then n × (len u16, UTF-8 bytes)
//!          keyspaces = k u32, then k × (tenant u16, model u16, scheme u16, adapter u16) name indexes
//!          row       = keyspace u16 | replica u16 (name index) | tier u8 | hash_len u32 | hash
//!                      | tokens i32 | last_seen_ns i64 | access u32
//! STATS    body = names | count rows; row = tenant u16 | model u16 | replica u16
//!          | cache_memory_bytes i64 | hit_rate f32 | pressure f32 | t2_hit_tokens i64
//!          | t2_query_tokens i64 | last_seen_ns i64 | stats_reported_ns i64
//! MANIFEST body = count × (core u32 | file_len u64 | file_xxh3 u64) | stream_sequence u64
//!          (the last event-log sequence applied before the snapshot began; 0 without one)
//! POLICY   body = the last installed `/policy` body, verbatim (count = 1)
//! EPOCHS   body = count × (replica key u128 | start ms u64 | id hash u64): the producer epoch
//!          table (file `producers.icsnap`, written with every generation; a snapshot without
//!          it restores with an empty table)
//! END      body = sections u64 | entries u64 | stats rows u64 (count = 0)
//! ```
//!
//! Each section is self-contained: its rows name everything through the section's own name
//! table, so any section can be decoded alone and each row routed to the core that owns its
//! `(tenant, model)` under the restoring process's `--shards`.

use std::collections::HashMap;
use std::io::Read;

use inferencecache_index::index::{PersistEntry, PersistStats};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::limits::{MAX_ID_BYTES, MAX_SNAPSHOT_SECTION_BYTES};

/// First 8 bytes of every snapshot file (`\r\n` catches newline translation, as PNG's does).
pub const MAGIC: [u8; 8] = *b"ICSNAP\r\n";
/// Format version; any other version is skipped at restore as incompatible. 2: the manifest
/// records the event log's stream sequence.
pub const VERSION: u32 = 2;
/// Bytes of the file header.
pub const HEADER_BYTES: usize = 48;
/// Bytes of a section header.
pub const SECTION_HEADER_BYTES: usize = 24;

/// Rows after which an encoder closes its section (a section also closes before its name table
/// or body would outgrow its bounds).
pub const SECTION_ROWS: u32 = 8192;
/// Body bytes after which an encoder closes its section.
const SECTION_SOFT_BYTES: usize = 1 << 20;

/// What a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum FileKind {
    /// One core's partitions: STATS and ENTRIES sections.
    Core = 1,
    /// The manifest of one complete generation of core files.
    Manifest = 2,
    /// The last installed `/policy` body.
    Policy = 3,
    /// The producer epoch table (fencing).
    Producers = 4,
}

/// Section kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum SectionKind {
    /// Storage entries.
    Entries = 1,
    /// Replica stats rows.
    Stats = 2,
    /// The manifest's file list.
    Manifest = 3,
    /// A policy body.
    Policy = 4,
    /// Producer epochs.
    Epochs = 5,
    /// The end of the file, with its totals.
    End = 0xFF,
}

impl SectionKind {
    fn from_u32(v: u32) -> Option<SectionKind> {
        Some(match v {
            1 => SectionKind::Entries,
            2 => SectionKind::Stats,
            3 => SectionKind::Manifest,
            4 => SectionKind::Policy,
            5 => SectionKind::Epochs,
            0xFF => SectionKind::End,
            _ => return None,
        })
    }
}

/// The file header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the file holds.
    pub kind: FileKind,
    /// Snapshot generation (increases with every complete snapshot).
    pub generation: u64,
    /// When the snapshot was started, unix ns.
    pub created_unix_ns: i64,
    /// The core that wrote it (0 for manifest and policy files).
    pub core: u32,
    /// The writer's `--shards`.
    pub cores: u32,
}

/// Why a file could not be decoded; each maps to a `reason` label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FormatError {
    /// The input ended early.
    Truncated,
    /// A checksum, magic, length or value did not match.
    Corrupt(&'static str),
    /// Another format version.
    Incompatible(u32),
    /// Larger than the restore bounds.
    TooLarge,
    /// The file could not be read.
    Io(std::io::ErrorKind),
}

impl FormatError {
    /// The `reason` label of the skipped-restore counter.
    pub fn reason(&self) -> &'static str {
        match self {
            FormatError::Truncated => "truncated",
            FormatError::Corrupt(_) => "corrupt",
            FormatError::Incompatible(_) => "incompatible",
            FormatError::TooLarge => "too_large",
            FormatError::Io(_) => "io_error",
        }
    }
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatError::Truncated => f.write_str("file is truncated"),
            FormatError::Corrupt(what) => write!(f, "file is corrupt ({what})"),
            FormatError::Incompatible(v) => {
                write!(f, "format version {v}, this server reads version {VERSION}")
            }
            FormatError::TooLarge => f.write_str("file exceeds the restore size bound"),
            FormatError::Io(kind) => write!(f, "read error: {kind}"),
        }
    }
}

impl From<std::io::Error> for FormatError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FormatError::Truncated
        } else {
            FormatError::Io(e.kind())
        }
    }
}

/// Encodes the file header.
pub fn encode_header(h: &Header) -> [u8; HEADER_BYTES] {
    let mut b = [0u8; HEADER_BYTES];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&(h.kind as u32).to_le_bytes());
    b[16..24].copy_from_slice(&h.generation.to_le_bytes());
    b[24..32].copy_from_slice(&h.created_unix_ns.to_le_bytes());
    b[32..36].copy_from_slice(&h.core.to_le_bytes());
    b[36..40].copy_from_slice(&h.cores.to_le_bytes());
    let sum = xxh3_64(&b[..40]);
    b[40..48].copy_from_slice(&sum.to_le_bytes());
    b
}

fn section_checksum(head: &[u8; SECTION_HEADER_BYTES], body: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&head[..16]);
    h.update(body);
    h.digest()
}

/// Appends one section (header, checksum and body) to `out`.
pub fn push_section(out: &mut Vec<u8>, kind: SectionKind, count: u32, body: &[u8]) {
    debug_assert!(body.len() <= MAX_SNAPSHOT_SECTION_BYTES);
    let mut head = [0u8; SECTION_HEADER_BYTES];
    head[0..4].copy_from_slice(&(kind as u32).to_le_bytes());
    head[4..8].copy_from_slice(&count.to_le_bytes());
    head[8..12].copy_from_slice(&(body.len() as u32).to_le_bytes());
    let sum = section_checksum(&head, body);
    head[16..24].copy_from_slice(&sum.to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(body);
}

/// Appends the END section with the file's totals.
pub fn push_end(out: &mut Vec<u8>, totals: &Totals) {
    let mut body = [0u8; 24];
    body[0..8].copy_from_slice(&totals.sections.to_le_bytes());
    body[8..16].copy_from_slice(&totals.entries.to_le_bytes());
    body[16..24].copy_from_slice(&totals.stats.to_le_bytes());
    push_section(out, SectionKind::End, 0, &body);
}

/// Sections and rows written to (or read from) one file, before its END section.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Sections before END.
    pub sections: u64,
    /// Entry rows.
    pub entries: u64,
    /// Stats rows.
    pub stats: u64,
}

/// A section-local name table.
#[derive(Default)]
struct Names {
    index: HashMap<Box<str>, u16>,
    list: Vec<Box<str>>,
    bytes: usize,
}

impl Names {
    /// Room for `n` more names.
    fn has_room(&self, n: usize) -> bool {
        self.list.len() + n <= u16::MAX as usize
    }
    fn id(&mut self, name: &str) -> u16 {
        if let Some(i) = self.index.get(name) {
            return *i;
        }
        let i = self.list.len() as u16;
        self.list.push(name.into());
        self.index.insert(name.into(), i);
        self.bytes += 2 + name.len();
        i
    }
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.list.len() as u32).to_le_bytes());
        for n in &self.list {
            out.extend_from_slice(&(n.len() as u16).to_le_bytes());
            out.extend_from_slice(n.as_bytes());
        }
    }
    fn clear(&mut self) {
        self.index.clear();
        self.list.clear();
        self.bytes = 0;
    }
}

/// Builds ENTRIES and STATS sections into an output buffer, closing a section whenever it
/// reaches [`SECTION_ROWS`] rows or about 1 MiB; the caller bounds the buffer by the number of
/// rows it pushes before taking it.
#[derive(Default)]
pub struct Encoder {
    out: Vec<u8>,
    kind: Option<SectionKind>,
    names: Names,
    keyspaces: HashMap<[u16; 4], u16>,
    keyspace_list: Vec<[u16; 4]>,
    rows: Vec<u8>,
    count: u32,
    totals: Totals,
    /// The last entry's keyspace names and index in the open section.
    last_ks: Option<([String; 4], u16)>,
    /// The last entry's replica name and index in the open section.
    last_replica: Option<(String, u16)>,
}

impl Encoder {
    /// An empty encoder.
    pub fn new() -> Encoder {
        Encoder::default()
    }

    fn start(&mut self, kind: SectionKind, names: usize, row_bytes: usize) {
        let full = self.count >= SECTION_ROWS
            || !self.names.has_room(names)
            || self.keyspace_list.len() >= u16::MAX as usize
            || self.rows.len() + self.names.bytes + row_bytes > SECTION_SOFT_BYTES;
        if self.kind != Some(kind) || (full && self.count > 0) {
            self.close();
            self.kind = Some(kind);
        }
    }

    /// Appends one entry row.
    pub fn entry(&mut self, e: &PersistEntry<'_>) {
        let names: usize = [e.tenant, e.model, e.scheme, e.adapter, e.replica]
            .iter()
            .map(|n| n.len())
            .sum();
        self.start(SectionKind::Entries, 5, 25 + e.hash.len() + names);
        // Consecutive entries mostly share their keyspace (a key's holders, a chain's blocks):
        // the last one's indexes are reused without hashing.
        let same_ks = self.last_ks.as_ref().is_some_and(|(n, _)| {
            n[0] == e.tenant && n[1] == e.model && n[2] == e.scheme && n[3] == e.adapter
        });
        let ks = if same_ks {
            self.last_ks.as_ref().expect("checked").1
        } else {
            let ids = [
                self.names.id(e.tenant),
                self.names.id(e.model),
                self.names.id(e.scheme),
                self.names.id(e.adapter),
            ];
            let i = match self.keyspaces.get(&ids) {
                Some(i) => *i,
                None => {
                    let i = self.keyspace_list.len() as u16;
                    self.keyspace_list.push(ids);
                    self.keyspaces.insert(ids, i);
                    i
                }
            };
            let owned = [e.tenant, e.model, e.scheme, e.adapter].map(String::from);
            self.last_ks = Some((owned, i));
            i
        };
        let replica = match &self.last_replica {
            Some((name, i)) if name == e.replica => *i,
            _ => {
                let i = self.names.id(e.replica);
                self.last_replica = Some((e.replica.to_string(), i));
                i
            }
        };
        let r = &mut self.rows;
        r.extend_from_slice(&ks.to_le_bytes());
        r.extend_from_slice(&replica.to_le_bytes());
        r.push(e.tier);
        r.extend_from_slice(&(e.hash.len() as u32).to_le_bytes());
        r.extend_from_slice(e.hash);
        r.extend_from_slice(&e.tokens.to_le_bytes());
        r.extend_from_slice(&e.last_seen.to_le_bytes());
        r.extend_from_slice(&e.access.to_le_bytes());
        self.count += 1;
        self.totals.entries += 1;
    }

    /// Appends one stats row.
    pub fn stats(&mut self, s: &PersistStats<'_>) {
        let names = s.tenant.len() + s.model.len() + s.replica.len();
        self.start(SectionKind::Stats, 3, 62 + names);
        let ids = [
            self.names.id(s.tenant),
            self.names.id(s.model),
            self.names.id(s.replica),
        ];
        let r = &mut self.rows;
        for i in ids {
            r.extend_from_slice(&i.to_le_bytes());
        }
        r.extend_from_slice(&s.cache_memory_bytes.to_le_bytes());
        r.extend_from_slice(&s.hit_rate.to_le_bytes());
        r.extend_from_slice(&s.pressure.to_le_bytes());
        r.extend_from_slice(&s.t2_hit_tokens.to_le_bytes());
        r.extend_from_slice(&s.t2_query_tokens.to_le_bytes());
        r.extend_from_slice(&s.last_seen.to_le_bytes());
        r.extend_from_slice(&s.stats_reported.to_le_bytes());
        self.count += 1;
        self.totals.stats += 1;
    }

    /// Closes the open section, if any.
    fn close(&mut self) {
        let Some(kind) = self.kind.take() else { return };
        if self.count == 0 {
            return;
        }
        let mut body = Vec::with_capacity(self.rows.len() + self.names.bytes + 16);
        self.names.encode(&mut body);
        if kind == SectionKind::Entries {
            body.extend_from_slice(&(self.keyspace_list.len() as u32).to_le_bytes());
            for ks in &self.keyspace_list {
                for i in ks {
                    body.extend_from_slice(&i.to_le_bytes());
                }
            }
        }
        body.extend_from_slice(&self.rows);
        push_section(&mut self.out, kind, self.count, &body);
        self.totals.sections += 1;
        self.names.clear();
        self.keyspaces.clear();
        self.keyspace_list.clear();
        self.rows.clear();
        self.count = 0;
        self.last_ks = None;
        self.last_replica = None;
    }

    /// Closes the open section and takes the bytes encoded so far (the next output buffer starts
    /// with the same capacity, so a reused encoder does not regrow it).
    pub fn take(&mut self) -> Vec<u8> {
        self.close();
        let cap = self.out.capacity();
        std::mem::replace(&mut self.out, Vec::with_capacity(cap))
    }

    /// Starts counting totals afresh (a reused encoder, one slice at a time).
    pub fn reset_totals(&mut self) {
        self.totals = Totals::default();
    }

    /// Totals of the sections closed so far.
    pub fn totals(&self) -> Totals {
        self.totals
    }
}

/// A bounded little-endian cursor over a verified section body.
struct Cur<'a> {
    b: &'a [u8],
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if self.b.len() < n {
            return Err(FormatError::Corrupt("section body too short"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn i32(&mut self) -> Result<i32, FormatError> {
        Ok(self.u32()? as i32)
    }
    fn i64(&mut self) -> Result<i64, FormatError> {
        Ok(self.u64()? as i64)
    }
    fn f32(&mut self) -> Result<f32, FormatError> {
        Ok(f32::from_bits(self.u32()?))
    }
    fn names(&mut self) -> Result<Vec<&'a str>, FormatError> {
        let n = self.u32()? as usize;
        if n > u16::MAX as usize {
            return Err(FormatError::Corrupt("name table too long"));
        }
        let mut out = Vec::with_capacity(n.min(self.b.len() / 2));
        for _ in 0..n {
            let len = self.u16()? as usize;
            if len > MAX_ID_BYTES {
                return Err(FormatError::Corrupt("name too long"));
            }
            let s = std::str::from_utf8(self.take(len)?)
                .map_err(|_| FormatError::Corrupt("name is not UTF-8"))?;
            out.push(s);
        }
        Ok(out)
    }
}

fn name<'a>(names: &[&'a str], i: u16) -> Result<&'a str, FormatError> {
    names
        .get(i as usize)
        .copied()
        .ok_or(FormatError::Corrupt("name index out of range"))
}

/// One verified section.
pub struct Section<'a> {
    /// Its kind.
    pub kind: SectionKind,
    /// Its row count.
    pub count: u32,
    /// Its body (checksum verified).
    pub body: &'a [u8],
}

impl Section<'_> {
    /// Decodes every row of an ENTRIES section into `f`. A malformed body is reported before
    /// `f` sees any row of it.
    pub fn entries(&self, mut f: impl FnMut(&PersistEntry<'_>)) -> Result<(), FormatError> {
        // Decode twice: first to validate, then to hand rows out, so a section is all or nothing.
        self.decode_entries(&mut |_| {})?;
        self.decode_entries(&mut f)
    }

    fn decode_entries(&self, f: &mut dyn FnMut(&PersistEntry<'_>)) -> Result<(), FormatError> {
        let mut c = Cur { b: self.body };
        let names = c.names()?;
        let k = c.u32()? as usize;
        if k > u16::MAX as usize {
            return Err(FormatError::Corrupt("keyspace table too long"));
        }
        let mut keyspaces = Vec::with_capacity(k.min(c.b.len() / 8));
        for _ in 0..k {
            let ks = [
                name(&names, c.u16()?)?,
                name(&names, c.u16()?)?,
                name(&names, c.u16()?)?,
                name(&names, c.u16()?)?,
            ];
            keyspaces.push(ks);
        }
        for _ in 0..self.count {
            let ks = keyspaces
                .get(c.u16()? as usize)
                .ok_or(FormatError::Corrupt("keyspace index out of range"))?;
            let replica = name(&names, c.u16()?)?;
            let tier = c.u8()?;
            let hash_len = c.u32()? as usize;
            let hash = c.take(hash_len)?;
            f(&PersistEntry {
                tenant: ks[0],
                model: ks[1],
                scheme: ks[2],
                adapter: ks[3],
                hash,
                replica,
                tier,
                tokens: c.i32()?,
                last_seen: c.i64()?,
                access: c.u32()?,
            });
        }
        if !c.b.is_empty() {
            return Err(FormatError::Corrupt("trailing bytes in section"));
        }
        Ok(())
    }

    /// Decodes every row of a STATS section into `f` (validated whole first).
    pub fn stats(&self, mut f: impl FnMut(&PersistStats<'_>)) -> Result<(), FormatError> {
        self.decode_stats(&mut |_| {})?;
        self.decode_stats(&mut f)
    }

    fn decode_stats(&self, f: &mut dyn FnMut(&PersistStats<'_>)) -> Result<(), FormatError> {
        let mut c = Cur { b: self.body };
        let names = c.names()?;
        for _ in 0..self.count {
            f(&PersistStats {
                tenant: name(&names, c.u16()?)?,
                model: name(&names, c.u16()?)?,
                replica: name(&names, c.u16()?)?,
                cache_memory_bytes: c.i64()?,
                hit_rate: c.f32()?,
                pressure: c.f32()?,
                t2_hit_tokens: c.i64()?,
                t2_query_tokens: c.i64()?,
                last_seen: c.i64()?,
                stats_reported: c.i64()?,
            });
        }
        if !c.b.is_empty() {
            return Err(FormatError::Corrupt("trailing bytes in section"));
        }
        Ok(())
    }

    /// The manifest's `(core, file_len, file_xxh3)` rows and the stream sequence it includes.
    pub fn manifest(&self) -> Result<(Vec<ManifestRow>, u64), FormatError> {
        let mut c = Cur { b: self.body };
        let mut out = Vec::new();
        for _ in 0..self.count {
            out.push((c.u32()?, c.u64()?, c.u64()?));
        }
        let stream_sequence = c.u64()?;
        if !c.b.is_empty() {
            return Err(FormatError::Corrupt("trailing bytes in manifest"));
        }
        Ok((out, stream_sequence))
    }
}

/// Reads one file: header, then verified sections until END. Bounded: a section body larger
/// than [`MAX_SNAPSHOT_SECTION_BYTES`] or a file longer than `max_bytes` is refused before it is
/// read; only one section is held at a time.
pub struct Decoder<R> {
    r: R,
    buf: Vec<u8>,
    read: u64,
    max_bytes: u64,
    hasher: Xxh3,
    seen: Totals,
    ended: bool,
}

impl<R: Read> Decoder<R> {
    /// Reads and checks the header (magic, header checksum, version).
    pub fn open(mut r: R, max_bytes: u64) -> Result<(Decoder<R>, Header), FormatError> {
        let mut b = [0u8; HEADER_BYTES];
        r.read_exact(&mut b)?;
        if b[0..8] != MAGIC {
            return Err(FormatError::Corrupt("bad magic"));
        }
        let stored = u64::from_le_bytes(b[40..48].try_into().expect("8"));
        if xxh3_64(&b[..40]) != stored {
            return Err(FormatError::Corrupt("header checksum mismatch"));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4"));
        if version != VERSION {
            return Err(FormatError::Incompatible(version));
        }
        let kind = match u32::from_le_bytes(b[12..16].try_into().expect("4")) {
            1 => FileKind::Core,
            2 => FileKind::Manifest,
            3 => FileKind::Policy,
            4 => FileKind::Producers,
            _ => return Err(FormatError::Corrupt("unknown file kind")),
        };
        let header = Header {
            kind,
            generation: u64::from_le_bytes(b[16..24].try_into().expect("8")),
            created_unix_ns: i64::from_le_bytes(b[24..32].try_into().expect("8")),
            core: u32::from_le_bytes(b[32..36].try_into().expect("4")),
            cores: u32::from_le_bytes(b[36..40].try_into().expect("4")),
        };
        let mut hasher = Xxh3::new();
        hasher.update(&b);
        let d = Decoder {
            r,
            buf: Vec::new(),
            read: HEADER_BYTES as u64,
            max_bytes,
            hasher,
            seen: Totals::default(),
            ended: false,
        };
        Ok((d, header))
    }

    /// The next section before END, or `None` once END was read and matched the totals (and
    /// nothing follows it).
    pub fn next_section(&mut self) -> Result<Option<Section<'_>>, FormatError> {
        if self.ended {
            return Ok(None);
        }
        let mut head = [0u8; SECTION_HEADER_BYTES];
        self.r.read_exact(&mut head)?;
        self.hasher.update(&head);
        let kind = u32::from_le_bytes(head[0..4].try_into().expect("4"));
        let count = u32::from_le_bytes(head[4..8].try_into().expect("4"));
        let len = u32::from_le_bytes(head[8..12].try_into().expect("4")) as usize;
        let stored = u64::from_le_bytes(head[16..24].try_into().expect("8"));
        if len > MAX_SNAPSHOT_SECTION_BYTES {
            return Err(FormatError::Corrupt("section length out of range"));
        }
        self.read += (SECTION_HEADER_BYTES + len) as u64;
        if self.read > self.max_bytes {
            return Err(FormatError::TooLarge);
        }
        self.buf.clear();
        self.buf.resize(len, 0);
        self.r.read_exact(&mut self.buf)?;
        self.hasher.update(&self.buf);
        let mut zeroed = head;
        zeroed[16..24].fill(0);
        if section_checksum(&zeroed, &self.buf) != stored {
            return Err(FormatError::Corrupt("section checksum mismatch"));
        }
        let kind = SectionKind::from_u32(kind).ok_or(FormatError::Corrupt("unknown section"))?;
        if kind == SectionKind::End {
            let mut c = Cur { b: &self.buf };
            let totals = Totals {
                sections: c.u64()?,
                entries: c.u64()?,
                stats: c.u64()?,
            };
            if totals != self.seen || !c.b.is_empty() {
                return Err(FormatError::Corrupt("totals do not match the sections"));
            }
            let mut extra = [0u8; 1];
            if self.r.read(&mut extra)? != 0 {
                return Err(FormatError::Corrupt("bytes after the end section"));
            }
            self.ended = true;
            return Ok(None);
        }
        self.seen.sections += 1;
        match kind {
            SectionKind::Entries => self.seen.entries += count as u64,
            SectionKind::Stats => self.seen.stats += count as u64,
            _ => {}
        }
        Ok(Some(Section {
            kind,
            count,
            body: &self.buf,
        }))
    }

    /// Bytes read so far and their XXH3-64 (complete once [`Decoder::next_section`] returned
    /// `None`).
    pub fn digest(&self) -> (u64, u64) {
        (self.read, self.hasher.digest())
    }
}

/// Encodes a whole single-section file (manifest, policy).
pub fn encode_file(header: &Header, kind: SectionKind, count: u32, body: &[u8]) -> Vec<u8> {
    let mut out = encode_header(header).to_vec();
    push_section(&mut out, kind, count, body);
    push_end(
        &mut out,
        &Totals {
            sections: 1,
            ..Totals::default()
        },
    );
    out
}

/// One manifest row: `(core, file_len, file_xxh3)`.
pub type ManifestRow = (u32, u64, u64);

/// The manifest body for `(core, file_len, file_xxh3)` rows and the event log's stream
/// sequence the snapshot includes.
pub fn manifest_body(files: &[(u32, u64, u64)], stream_sequence: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(files.len() * 20 + 8);
    for (core, len, sum) in files {
        b.extend_from_slice(&core.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&sum.to_le_bytes());
    }
    b.extend_from_slice(&stream_sequence.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: Header = Header {
        kind: FileKind::Core,
        generation: 7,
        created_unix_ns: 1_700_000_000_000_000_000,
        core: 1,
        cores: 2,
    };

    #[derive(Clone, Debug, PartialEq)]
    struct OwnedEntry(
        String,
        String,
        String,
        String,
        Vec<u8>,
        String,
        i32,
        i64,
        u8,
        u32,
    );

    fn entries(n: usize) -> Vec<OwnedEntry> {
        (0..n)
            .map(|i| {
                OwnedEntry(
                    format!("tenant-{}", i % 3),
                    format!("model-{}", i % 5),
                    "scheme".into(),
                    if i % 7 == 0 {
                        "lora".into()
                    } else {
                        String::new()
                    },
                    if i % 11 == 0 {
                        vec![i as u8; 13]
                    } else {
                        (i as u64).to_be_bytes().to_vec()
                    },
                    format!("replica-{}", i % 4),
                    i as i32 * 16,
                    1_700_000_000_000_000_000 + i as i64,
                    (i % 5) as u8,
                    i as u32 % 9,
                )
            })
            .collect()
    }

    fn as_entry(o: &OwnedEntry) -> PersistEntry<'_> {
        PersistEntry {
            tenant: &o.0,
            model: &o.1,
            scheme: &o.2,
            adapter: &o.3,
            hash: &o.4,
            replica: &o.5,
            tokens: o.6,
            last_seen: o.7,
            tier: o.8,
            access: o.9,
        }
    }

    fn owned(e: &PersistEntry<'_>) -> OwnedEntry {
        OwnedEntry(
            e.tenant.into(),
            e.model.into(),
            e.scheme.into(),
            e.adapter.into(),
            e.hash.to_vec(),
            e.replica.into(),
            e.tokens,
            e.last_seen,
            e.tier,
            e.access,
        )
    }

    fn stats_row(i: usize) -> PersistStats<'static> {
        PersistStats {
            tenant: "tenant-0",
            model: "model-1",
            replica: ["r-a", "r-b"][i % 2],
            cache_memory_bytes: i as i64 * 1000,
            hit_rate: 0.25 * i as f32,
            pressure: 0.5,
            t2_hit_tokens: 3,
            t2_query_tokens: 4,
            last_seen: 11 + i as i64,
            stats_reported: 12 + i as i64,
        }
    }

    /// A core file with `n` entries and 2 stats rows, written in two slices like the writer.
    fn file(n: usize) -> (Vec<u8>, Vec<OwnedEntry>) {
        let es = entries(n);
        let mut out = encode_header(&HEADER).to_vec();
        let mut enc = Encoder::new();
        enc.stats(&stats_row(0));
        enc.stats(&stats_row(1));
        for e in &es[..n / 2] {
            enc.entry(&as_entry(e));
        }
        out.extend(enc.take());
        for e in &es[n / 2..] {
            enc.entry(&as_entry(e));
        }
        out.extend(enc.take());
        push_end(&mut out, &enc.totals());
        (out, es)
    }

    type Decoded = (Header, Vec<OwnedEntry>, Vec<(String, i64)>);

    fn decode(bytes: &[u8]) -> Result<Decoded, FormatError> {
        let (mut d, header) = Decoder::open(bytes, u64::MAX)?;
        let (mut es, mut ss) = (Vec::new(), Vec::new());
        while let Some(s) = d.next_section()? {
            match s.kind {
                SectionKind::Entries => s.entries(|e| es.push(owned(e)))?,
                SectionKind::Stats => {
                    s.stats(|r| ss.push((r.replica.to_string(), r.cache_memory_bytes)))?
                }
                _ => return Err(FormatError::Corrupt("unexpected section")),
            }
        }
        let (len, sum) = d.digest();
        assert_eq!(len, bytes.len() as u64);
        assert_eq!(sum, xxh3_64(bytes));
        Ok((header, es, ss))
    }

    #[test]
    fn round_trip_keeps_every_field_across_several_sections() {
        let (bytes, es) = file(20_000);
        let (h, got, stats) = decode(&bytes).expect("decodes");
        assert_eq!(h, HEADER);
        assert_eq!(got, es);
        assert_eq!(stats, vec![("r-a".into(), 0), ("r-b".into(), 1000)]);
    }

    #[test]
    fn empty_file_round_trips() {
        let mut out = encode_header(&HEADER).to_vec();
        push_end(&mut out, &Totals::default());
        let (_, es, ss) = decode(&out).expect("decodes");
        assert!(es.is_empty() && ss.is_empty());
    }

    #[test]
    fn every_truncation_is_detected() {
        let (bytes, _) = file(50);
        for len in 0..bytes.len() {
            let err = decode(&bytes[..len]).expect_err("truncated file decoded");
            assert_eq!(err, FormatError::Truncated, "cut at {len}");
        }
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let (bytes, _) = file(30);
        for byte in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[byte] ^= 1 << bit;
                match decode(&b) {
                    Err(FormatError::Corrupt(_))
                    | Err(FormatError::Truncated)
                    | Err(FormatError::Incompatible(_)) => {}
                    other => panic!("flip at {byte}:{bit} gave {other:?}"),
                }
            }
        }
    }

    #[test]
    fn another_version_is_incompatible() {
        let (mut bytes, _) = file(3);
        bytes[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        let sum = xxh3_64(&bytes[..40]);
        bytes[40..48].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(
            decode(&bytes).err(),
            Some(FormatError::Incompatible(VERSION + 1))
        );
    }

    #[test]
    fn trailing_bytes_and_oversized_files_are_refused() {
        let (mut bytes, _) = file(3);
        let len = bytes.len() as u64;
        assert!(matches!(
            Decoder::open(&bytes[..], len - 1).and_then(|(mut d, _)| {
                while d.next_section()?.is_some() {}
                Ok(())
            }),
            Err(FormatError::TooLarge)
        ));
        bytes.push(0);
        assert!(matches!(decode(&bytes), Err(FormatError::Corrupt(_))));
    }

    #[test]
    fn a_section_that_fails_validation_hands_out_no_row() {
        // A well-checksummed section whose rows point past its name table.
        let mut body = Vec::new();
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&1u16.to_le_bytes());
        body.push(b't');
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&[0u8; 8]);
        let row = |r: &mut Vec<u8>, replica: u16| {
            r.extend_from_slice(&0u16.to_le_bytes());
            r.extend_from_slice(&replica.to_le_bytes());
            r.push(1);
            r.extend_from_slice(&0u32.to_le_bytes());
            r.extend_from_slice(&[0u8; 16]);
        };
        row(&mut body, 0);
        row(&mut body, 9);
        let s = Section {
            kind: SectionKind::Entries,
            count: 2,
            body: &body,
        };
        let mut seen = 0;
        assert!(s.entries(|_| seen += 1).is_err());
        assert_eq!(seen, 0);
    }

    #[test]
    fn manifest_and_policy_files_round_trip() {
        let h = Header {
            kind: FileKind::Manifest,
            ..HEADER
        };
        let rows = vec![(0, 100, 5), (1, 200, 6)];
        let bytes = encode_file(&h, SectionKind::Manifest, 2, &manifest_body(&rows, 4242));
        let (mut d, got) = Decoder::open(&bytes[..], u64::MAX).unwrap();
        assert_eq!(got, h);
        let s = d.next_section().unwrap().unwrap();
        assert_eq!(s.kind, SectionKind::Manifest);
        assert_eq!(s.manifest().unwrap(), (rows, 4242));
        assert!(d.next_section().unwrap().is_none());
    }
}
