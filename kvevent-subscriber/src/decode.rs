//! Decoding of engine KV-event messages (docs/KV-EVENTS.md §1–§2): ZMQ frames → `(topic, seq,
//! payload)`, and the msgpack payload → a [`Batch`] of [`Event`]s.
//!
//! Decoding goes through a dynamic `rmpv::Value` rather than typed serde structs because the
//! engines disagree on shape (tagged maps vs. tagged arrays with missing trailing fields, array
//! vs. map batches, uint64 vs. negative int64 vs. bytes hashes) and must tolerate unknown
//! fields and tags; a dynamic walk accepts all of them with one code path.

use bytes::Bytes;
use rmpv::Value;

/// Why a message or event could not be decoded. Never carries payload contents (token ids must
/// not reach logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for DecodeError {}

/// An engine block hash, only ever used as a reverse-map key. Integers are normalised to their
/// 64-bit pattern so that a hash ≥ 2^63 sent as uint64 and the same hash sent as a negative
/// int64 are one key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// Integer hash (vLLM default: low 64 bits of SHA-256).
    Int(u64),
    /// Binary hash (e.g. 32-byte SHA-256 when the engine is configured so).
    Bytes(Box<[u8]>),
}

/// One ZMQ message split into its parts; the payload is still msgpack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// Topic frame (empty when the sender omitted it, e.g. old replay replies).
    pub topic: Bytes,
    /// Per-publisher sequence number; `None` is the replay end marker (seq = -1).
    pub seq: Option<u64>,
    /// msgpack batch.
    pub payload: Bytes,
}

/// Splits a multipart message. Live messages are `[topic, seq, payload]`; replay replies are
/// `[seq, payload]` or `[topic, seq, payload]`, possibly behind a REQ-style empty delimiter
/// frame — so the last two frames are always seq and payload and the one before (if any) is
/// the topic.
pub fn split_frames(frames: &[Bytes]) -> Result<RawMessage, DecodeError> {
    let n = frames.len();
    if n < 2 {
        return Err(DecodeError("expected at least [seq, payload] frames"));
    }
    let seq_frame = &frames[n - 2];
    let seq: [u8; 8] = seq_frame[..]
        .try_into()
        .map_err(|_| DecodeError("seq frame is not 8 bytes"))?;
    let seq = if seq == [0xFF; 8] {
        None
    } else {
        Some(u64::from_be_bytes(seq))
    };
    let topic = if n >= 3 {
        frames[n - 3].clone()
    } else {
        Bytes::new()
    };
    Ok(RawMessage {
        topic,
        seq,
        payload: frames[n - 1].clone(),
    })
}

/// One decoded event batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Engine wall-clock time of the batch in seconds (0 when absent).
    pub ts: f64,
    /// Events in engine order.
    pub events: Vec<Event>,
    /// Data-parallel rank of the publisher, when the engine says.
    pub dp_rank: Option<i64>,
}

/// One engine event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Blocks entered a cache medium.
    BlockStored(BlockStored),
    /// Blocks left a cache medium.
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole prefix cache.
    AllBlocksCleared,
    /// A tag this subscriber does not know; ignored (forward compatibility).
    Unknown,
    /// A known tag whose fields are unusable; counted and skipped, other events still apply.
    Invalid(DecodeError),
}

/// `BlockStored` fields the mapping needs (docs/KV-EVENTS.md §2 table, declaration order).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// Engine hash of the block before `block_hashes[0]`; `None` for a root.
    pub parent_block_hash: Option<EngineHash>,
    /// Token ids of all stored blocks; may be empty (offload copies).
    pub token_ids: Vec<u32>,
    /// Tokens per block, when given.
    pub block_size: Option<i64>,
    /// Engine-internal LoRA number.
    pub lora_id: Option<i64>,
    /// Cache medium (`GPU`, `CPU`, `DISK`, ...).
    pub medium: Option<String>,
    /// LoRA adapter name (vLLM).
    pub lora_name: Option<String>,
    /// Per block: the extra keys the engine hashed into the block besides its tokens (vLLM:
    /// the LoRA name, multimodal `(hash, offset)` pairs, the cache salt, prompt-embedding
    /// digests, in that order). `None` for a block without extras; empty when the field is
    /// absent.
    pub extra_keys: Vec<Option<Vec<ExtraKey>>>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
    /// Cache salt of the request that stored the blocks (SGLang); the blocks' hashes are
    /// namespaced by it.
    pub cache_salt: Option<String>,
    /// Attention kind of the KV-cache group (vLLM: `full_attention`, `sliding_window`, ...).
    pub kv_cache_spec_kind: Option<String>,
}

/// One extra key of a block, classified by its msgpack shape (vLLM publishes them untagged:
/// bare strings for the LoRA name and the cache salt, `[identifier, offset]` arrays for
/// multimodal inputs, bytes for prompt-embedding digests).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// A string: the LoRA name (first, when the event has `lora_name`) or a cache salt.
    Str(String),
    /// An array: a multimodal `(identifier, offset)` pair.
    Multimodal,
    /// Bytes: a prompt-embeddings digest.
    Binary,
    /// Anything else.
    Other,
}

/// `BlockRemoved` fields.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Medium the blocks left.
    pub medium: Option<String>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
}

/// Field names of `BlockStored` in declaration order (the legacy array form is positional).
const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

/// Field names of `BlockRemoved` in declaration order.
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

/// Decodes one msgpack batch payload (array or map form).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value(&mut rd).map_err(|_| DecodeError("invalid msgpack"))?;
    let (ts, events, dp_rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            map_get(&value, "ts"),
            map_get(&value, "events"),
            map_get(&value, "data_parallel_rank").or_else(|| map_get(&value, "attn_dp_rank")),
        ),
        _ => return Err(DecodeError("batch is neither array nor map")),
    };
    let ts = match ts {
        None | Some(Value::Nil) => 0.0,
        Some(v) => as_f64(v).ok_or(DecodeError("batch ts is not a number"))?,
    };
    let events = match events {
        Some(Value::Array(evs)) => evs.iter().map(decode_event).collect(),
        None | Some(Value::Nil) => Vec::new(),
        Some(_) => return Err(DecodeError("batch events is not an array")),
    };
    let dp_rank = match dp_rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(as_i64(v).ok_or(DecodeError("dp_rank is not an integer"))?),
    };
    Ok(Batch {
        ts,
        events,
        dp_rank,
    })
}

/// Field access that works for both event forms: by name for the map form, by declaration
/// position for the array form (absent trailing fields read as `None`).
enum Fields<'a> {
    Map(&'a Value),
    Array(&'a [Value], &'static [&'static str]),
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Map(m) => map_get(m, name),
            Fields::Array(items, names) => names
                .iter()
                .position(|n| *n == name)
                .and_then(|i| items.get(i)),
        };
        v.filter(|v| !v.is_nil())
    }
}

/// Decodes one event in either tagged-map or tagged-array form.
pub fn decode_event(v: &Value) -> Event {
    let tag = match v {
        Value::Map(_) => map_get(v, "type").and_then(as_str),
        Value::Array(items) => items.first().and_then(as_str),
        _ => return Event::Invalid(DecodeError("event is neither map nor array")),
    };
    let Some(tag) = tag else {
        return Event::Invalid(DecodeError("event has no type tag"));
    };
    let fields = |names: &'static [&'static str]| match v {
        Value::Array(items) => Fields::Array(&items[1..], names),
        _ => Fields::Map(v),
    };
    let res = match tag {
        "BlockStored" => decode_stored(&fields(&STORED_FIELDS)).map(Event::BlockStored),
        "BlockRemoved" => decode_removed(&fields(&REMOVED_FIELDS)).map(Event::BlockRemoved),
        "AllBlocksCleared" => Ok(Event::AllBlocksCleared),
        _ => Ok(Event::Unknown),
    };
    res.unwrap_or_else(Event::Invalid)
}

fn decode_stored(f: &Fields<'_>) -> Result<BlockStored, DecodeError> {
    let block_hashes = hash_list(f.get("block_hashes"))?;
    let parent_block_hash = f.get("parent_block_hash").map(decode_hash).transpose()?;
    let token_ids = match f.get("token_ids") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or(DecodeError("token id is not a u32"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(DecodeError("token_ids is not an array")),
    };
    let extra_keys = match f.get("extra_keys") {
        Some(Value::Array(items)) => items.iter().map(block_extra_keys).collect(),
        _ => Vec::new(),
    };
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size: opt_int(f.get("block_size"), "block_size is not an integer")?,
        lora_id: opt_int(f.get("lora_id"), "lora_id is not an integer")?,
        medium: f.get("medium").and_then(as_str).map(str::to_owned),
        lora_name: f.get("lora_name").and_then(as_str).map(str::to_owned),
        extra_keys,
        group_idx: opt_int(f.get("group_idx"), "group_idx is not an integer")?,
        cache_salt: f.get("cache_salt").and_then(as_str).map(str::to_owned),
        kv_cache_spec_kind: f
            .get("kv_cache_spec_kind")
            .and_then(as_str)
            .map(str::to_owned),
    })
}

/// One block's entry of `extra_keys`: nil, or a list of keys (a lone non-list value is taken
/// as a one-key list).
fn block_extra_keys(v: &Value) -> Option<Vec<ExtraKey>> {
    let classify = |k: &Value| match k {
        Value::String(s) => s
            .as_str()
            .map_or(ExtraKey::Other, |s| ExtraKey::Str(s.to_owned())),
        Value::Array(_) => ExtraKey::Multimodal,
        Value::Binary(_) => ExtraKey::Binary,
        _ => ExtraKey::Other,
    };
    match v {
        Value::Nil => None,
        Value::Array(keys) => Some(keys.iter().map(classify).collect()),
        other => Some(vec![classify(other)]),
    }
}

fn decode_removed(f: &Fields<'_>) -> Result<BlockRemoved, DecodeError> {
    Ok(BlockRemoved {
        block_hashes: hash_list(f.get("block_hashes"))?,
        medium: f.get("medium").and_then(as_str).map(str::to_owned),
        group_idx: opt_int(f.get("group_idx"), "group_idx is not an integer")?,
    })
}

fn hash_list(v: Option<&Value>) -> Result<Vec<EngineHash>, DecodeError> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(decode_hash).collect(),
        Some(_) => Err(DecodeError("block_hashes is not an array")),
    }
}

/// Accepts uint64, int64 (negative = the same 64-bit pattern) and bytes.
pub fn decode_hash(v: &Value) -> Result<EngineHash, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .map(EngineHash::Int)
            .ok_or(DecodeError("hash integer out of range")),
        Value::Binary(b) => Ok(EngineHash::Bytes(b.clone().into_boxed_slice())),
        _ => Err(DecodeError("hash is neither integer nor bytes")),
    }
}

fn opt_int(v: Option<&Value>, err: &'static str) -> Result<Option<i64>, DecodeError> {
    v.map(|v| as_i64(v).ok_or(DecodeError(err))).transpose()
}

fn map_get<'a>(m: &'a Value, key: &str) -> Option<&'a Value> {
    let Value::Map(entries) = m else { return None };
    entries.iter().find_map(|(k, v)| {
        let matches = match k {
            Value::String(s) => s.as_str() == Some(key),
            Value::Binary(b) => b.as_slice() == key.as_bytes(),
            _ => false,
        };
        matches.then_some(v)
    })
}

fn as_str(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => s.as_str(),
        Value::Binary(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => i.as_i64(),
        _ => None,
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}
