//! Start-up discovery and loading of per-model tokenizer artifacts (docs/BEHAVIOUR.md §18).
//!
//! Every directory under the models root that holds a `tokenizer.json` is a model whose id is
//! its slash-separated path relative to the root. Ids come only from directory names we walked,
//! and a request's `model_id` is only ever a key into the resulting map, so request data never
//! reaches the filesystem.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value as Json;

use super::TokenizeError;
use super::template::{ChatTemplate, SpecialTokens};
use crate::limits::{
    MAX_MODEL_DIR_DEPTH, MAX_TEMPLATE_FILE_BYTES, MAX_TOKENIZER_CONFIG_FILE_BYTES,
    MAX_TOKENIZER_FILE_BYTES, MAX_TOKENIZER_MODELS,
};

/// The file that makes a directory a (supported) model.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// HF tokenizer settings next to `tokenizer.json`: chat template and special tokens.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Standalone chat template written by recent `transformers`; wins over the config's field.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// Processor-style chat template file (`{"chat_template": "..."}`), the last resort.
pub const CHAT_TEMPLATE_JSON_FILE: &str = "chat_template.json";
/// Extension of tiktoken BPE rank files: recognised so they are reported, but not loadable
/// (their split regex and special tokens live in Python code, not in the file).
pub const TIKTOKEN_EXTENSION: &str = "tiktoken";

/// One loaded model: its tokenizer and (optional) chat template, immutable after start-up.
pub struct Model {
    backend: Backend,
}

enum Backend {
    Hf(Box<HfModel>),
    Tiktoken(Box<TiktokenModel>),
    /// Test hook: a scripted encoder (e.g. one that blocks until released).
    #[cfg(test)]
    Fake(FakeEncoder),
}

/// A tiktoken BPE rank file (`*.tiktoken`) with the split pattern and special tokens resolved
/// at load time (see [`load_tiktoken_model`]).
struct TiktokenModel {
    bpe: tiktoken_rs::CoreBPE,
    /// Special tokens exist: rendered templates contain them as text and they must map to their
    /// ids, as HF tokenizers do with added tokens even without adding special tokens.
    has_specials: bool,
    template: Option<ChatTemplate>,
}

struct HfModel {
    tokenizer: tokenizers::Tokenizer,
    /// `None` = the model ships no chat template: the raw text is tokenized.
    template: Option<ChatTemplate>,
}

/// A scripted encoder for pool tests.
#[cfg(test)]
pub type FakeEncoder = Box<dyn Fn(&str) -> Result<Vec<u32>, TokenizeError> + Send + Sync>;

impl Model {
    /// A model backed by a scripted encoder, for tests of the pool and the handle.
    #[cfg(test)]
    pub fn fake(encode: FakeEncoder) -> Self {
        Self {
            backend: Backend::Fake(encode),
        }
    }

    /// Renders `text` as the single user message (with the generation prompt) and tokenizes the
    /// result without adding special tokens: what the engine's chat path feeds the model.
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Hf(hf) => {
                let rendered;
                let input = match &hf.template {
                    Some(t) => {
                        rendered = t.render_user_prompt(text)?;
                        rendered.as_str()
                    }
                    None => text,
                };
                // The library's error text may quote input pieces: keep it out of the error.
                let encoding = hf
                    .tokenizer
                    .encode_fast(input, false)
                    .map_err(|_| TokenizeError::Failed("encoding failed".into()))?;
                Ok(encoding.get_ids().to_vec())
            }
            Backend::Tiktoken(tk) => {
                let rendered;
                let input = match &tk.template {
                    Some(t) => {
                        rendered = t.render_user_prompt(text)?;
                        rendered.as_str()
                    }
                    None => text,
                };
                Ok(if tk.has_specials {
                    tk.bpe.encode_with_special_tokens(input)
                } else {
                    tk.bpe.encode_ordinary(input)
                })
            }
            #[cfg(test)]
            Backend::Fake(f) => f(text),
        }
    }

    /// Tokenizes `text` as is: no chat template, no added special tokens (special-token strings
    /// in the text map to their ids, as in [`Model::encode_chat`]).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Hf(hf) => hf
                .tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|_| TokenizeError::Failed("encoding failed".into())),
            Backend::Tiktoken(tk) => Ok(if tk.has_specials {
                tk.bpe.encode_with_special_tokens(text)
            } else {
                tk.bpe.encode_ordinary(text)
            }),
            #[cfg(test)]
            Backend::Fake(f) => f(text),
        }
    }

    /// Whether the model renders a chat template (false = raw-text fallback).
    pub fn has_chat_template(&self) -> bool {
        match &self.backend {
            Backend::Hf(hf) => hf.template.is_some(),
            Backend::Tiktoken(tk) => tk.template.is_some(),
            #[cfg(test)]
            Backend::Fake(_) => false,
        }
    }
}

/// Builds a model id from a path relative to the models root, or `None` when the id would be
/// unsafe (absolute, `.`/`..`, empty segments, backslashes, drive prefixes, non-UTF-8).
pub fn model_id_from_relative(rel: &Path) -> Option<String> {
    let mut segments = Vec::new();
    for c in rel.components() {
        match c {
            std::path::Component::Normal(s) => segments.push(s.to_str()?),
            _ => return None,
        }
    }
    let id = segments.join("/");
    is_safe_model_id(&id).then_some(id)
}

/// Whether `id` is a clean, relative, slash-separated model id that cannot name anything
/// outside the models root (the §18 rules, plus no control characters).
pub fn is_safe_model_id(id: &str) -> bool {
    if id.is_empty() || id.starts_with('/') || id.contains('\\') {
        return false;
    }
    if id.chars().any(char::is_control) {
        return false;
    }
    let bytes = id.as_bytes();
    if bytes.len() >= 2 && bytes[0].is_ascii_alphabetic() && bytes[1] == b':' {
        return false;
    }
    id.split('/')
        .all(|s| !s.is_empty() && s != "." && s != "..")
}

/// Walks `root` and loads every model found; failures are logged and skipped, never fatal.
pub fn load_models_dir(root: &Path) -> HashMap<String, Arc<Model>> {
    let started = Instant::now();
    let mut models = HashMap::new();
    let mut skipped = 0usize;
    // Depth-first, children in name order so logs and the model cap are deterministic.
    let mut stack: Vec<(PathBuf, usize)> = vec![(root.to_path_buf(), 0)];
    let mut first = true;
    while let Some((dir, depth)) = stack.pop() {
        let rel = dir.strip_prefix(root).unwrap_or(Path::new(""));
        let listing = match list_dir(&dir) {
            Ok(l) => l,
            Err(e) => {
                if first {
                    tracing::error!(dir = %root.display(), error = %e, "tokenizer_models_dir_unreadable");
                } else {
                    tracing::warn!(path = %rel.display(), error = %e, "tokenizer_models_subdir_unreadable");
                }
                first = false;
                continue;
            }
        };
        first = false;
        if !load_model_in(&dir, rel, &listing, &mut models) {
            skipped += 1;
        }
        if depth < MAX_MODEL_DIR_DEPTH {
            for name in listing.children.into_iter().rev() {
                stack.push((dir.join(name), depth + 1));
            }
        }
    }
    tracing::info!(
        dir = %root.display(),
        models = models.len(),
        skipped,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "tokenizer_models_loaded"
    );
    models
}

/// What one directory holds, in name order.
struct DirListing {
    /// Sub-directories (symlinked directories are not walked: no cycles, no escaping the root).
    children: Vec<std::ffi::OsString>,
    /// `*.tiktoken` files.
    tiktoken_files: Vec<std::ffi::OsString>,
    /// Whether a `tokenizer.json` is present.
    has_tokenizer: bool,
}

fn list_dir(dir: &Path) -> std::io::Result<DirListing> {
    let mut listing = DirListing {
        children: Vec::new(),
        tiktoken_files: Vec::new(),
        has_tokenizer: dir.join(TOKENIZER_FILE).is_file(),
    };
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        // file_type() does not follow symlinks; symlinked files are read normally.
        let Ok(ft) = entry.file_type() else { continue };
        if ft.is_dir() {
            listing.children.push(name);
        } else if Path::new(&name)
            .extension()
            .is_some_and(|e| e == TIKTOKEN_EXTENSION)
        {
            listing.tiktoken_files.push(name);
        }
    }
    listing.children.sort();
    listing.tiktoken_files.sort();
    Ok(listing)
}

/// Loads the model of one directory, if it holds one. `false` when a model was there but was
/// skipped (unsafe id, over the model cap, or failed to load).
fn load_model_in(
    dir: &Path,
    rel: &Path,
    listing: &DirListing,
    models: &mut HashMap<String, Arc<Model>>,
) -> bool {
    if !listing.has_tokenizer && listing.tiktoken_files.is_empty() {
        return true;
    }
    let Some(id) = model_id_from_relative(rel) else {
        tracing::warn!(path = %rel.display(), reason = "unsafe_model_id", "tokenizer_model_skipped");
        return false;
    };
    if models.len() >= MAX_TOKENIZER_MODELS {
        tracing::warn!(model = %id, reason = "too_many_models", limit = MAX_TOKENIZER_MODELS, "tokenizer_model_skipped");
        return false;
    }
    let t0 = Instant::now();
    // tokenizer.json wins; otherwise the first *.tiktoken file by name.
    let loaded = if listing.has_tokenizer {
        load_hf_model(dir)
    } else {
        load_tiktoken_model(dir, &dir.join(&listing.tiktoken_files[0]))
    };
    match loaded {
        Ok(model) => {
            tracing::info!(
                model = %id,
                chat_template = model.has_chat_template(),
                load_ms = t0.elapsed().as_millis() as u64,
                "tokenizer_model_loaded"
            );
            if !model.has_chat_template() {
                tracing::warn!(model = %id, "tokenizer_model_without_chat_template");
            }
            models.insert(id, Arc::new(model));
            true
        }
        Err(reason) => {
            tracing::warn!(model = %id, reason = %reason, "tokenizer_model_skipped");
            false
        }
    }
}

/// Reads a whole file refusing anything larger than `limit` (checked on the opened file, so a
/// symlink to something huge is refused too).
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let f = std::fs::File::open(path).map_err(|e| format!("{name}: {e}"))?;
    let mut buf = Vec::new();
    f.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| format!("{name}: {e}"))?;
    if buf.len() as u64 > limit {
        return Err(format!("{name}: larger than {limit} bytes"));
    }
    Ok(buf)
}

/// Reads an optional JSON object file; `Ok(None)` when absent.
fn read_json(path: &Path) -> Result<Option<Json>, String> {
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = read_limited(path, MAX_TOKENIZER_CONFIG_FILE_BYTES)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| format!("{name}: invalid JSON: {e}"))
}

/// Loads one HF model directory: `tokenizer.json`, then its chat template and special tokens.
pub fn load_hf_model(dir: &Path) -> Result<Model, String> {
    let bytes = read_limited(&dir.join(TOKENIZER_FILE), MAX_TOKENIZER_FILE_BYTES)?;
    let mut tokenizer =
        tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| format!("{TOKENIZER_FILE}: {e}"))?;
    // Engines encode chat prompts untruncated and unpadded, whatever tokenizer.json presets.
    tokenizer
        .with_truncation(None)
        .map_err(|e| format!("{TOKENIZER_FILE}: {e}"))?;
    tokenizer.with_padding(None);

    let config = read_json(&dir.join(TOKENIZER_CONFIG_FILE))?;
    let specials = config
        .as_ref()
        .map(SpecialTokens::from_config)
        .unwrap_or_default();
    let source = chat_template_source(dir, config.as_ref())?;
    let template = source
        .map(|s| ChatTemplate::new(&s, specials))
        .transpose()?;
    Ok(Model {
        backend: Backend::Hf(Box::new(HfModel {
            tokenizer,
            template,
        })),
    })
}

/// Split pattern of OpenAI's `cl100k_base`: the default for tiktoken rank files, whose pattern is
/// not stored in the file.
pub const CL100K_PATTERN: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";

/// Upper bound on ranks in a tiktoken file (o200k has ~200K).
const MAX_TIKTOKEN_RANKS: usize = 4 << 20;

/// Loads a tiktoken model directory: the BPE ranks from `rank_file` (`<base64 token> <rank>`
/// per line), the split pattern, special tokens and chat template from `tokenizer_config.json`.
///
/// A rank file does not carry its split regex: it is taken from the config's `pat_str` when
/// present, else `o200k_base`'s for a file named `o200k*`, else `cl100k_base`'s. Special tokens
/// are the config's `added_tokens_decoder` entries (id → content).
pub fn load_tiktoken_model(dir: &Path, rank_file: &Path) -> Result<Model, String> {
    let name = rank_file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let bytes = read_limited(rank_file, MAX_TOKENIZER_FILE_BYTES)?;
    let text = std::str::from_utf8(&bytes).map_err(|_| format!("{name}: not UTF-8"))?;
    let (encoder, ranks) = parse_tiktoken_ranks(&name, text)?;
    let config = read_json(&dir.join(TOKENIZER_CONFIG_FILE))?;
    let special = tiktoken_specials(config.as_ref(), &ranks)?;
    let pattern = match config
        .as_ref()
        .and_then(|c| c.get("pat_str"))
        .and_then(Json::as_str)
    {
        Some(p) => p.to_owned(),
        None if name.starts_with("o200k") => tiktoken_rs::O200K_BASE_PAT_STR.to_owned(),
        None => CL100K_PATTERN.to_owned(),
    };
    let has_specials = !special.is_empty();
    let bpe = tiktoken_rs::CoreBPE::new(
        encoder.into_iter().collect(),
        special.into_iter().collect(),
        &pattern,
    )
    .map_err(|e| format!("{name}: {e}"))?;
    let specials = config
        .as_ref()
        .map(SpecialTokens::from_config)
        .unwrap_or_default();
    let source = chat_template_source(dir, config.as_ref())?;
    let template = source
        .map(|s| ChatTemplate::new(&s, specials))
        .transpose()?;
    Ok(Model {
        backend: Backend::Tiktoken(Box::new(TiktokenModel {
            bpe,
            has_specials,
            template,
        })),
    })
}

/// Token bytes → rank, and the set of ranks, from a rank file's text (`name` for messages).
type Ranks = (HashMap<Vec<u8>, u32>, std::collections::HashSet<u32>);

fn parse_tiktoken_ranks(name: &str, text: &str) -> Result<Ranks, String> {
    use base64::Engine as _;
    let mut encoder: HashMap<Vec<u8>, u32> = HashMap::new();
    let mut ranks = std::collections::HashSet::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (tok, rank) = line
            .split_once(' ')
            .ok_or_else(|| format!("{name}:{}: expected `<base64> <rank>`", n + 1))?;
        let tok = base64::engine::general_purpose::STANDARD
            .decode(tok)
            .map_err(|_| format!("{name}:{}: invalid base64", n + 1))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|_| format!("{name}:{}: invalid rank", n + 1))?;
        // CoreBPE asserts on duplicates: refuse them here so a bad file skips the model.
        if !ranks.insert(rank) || encoder.insert(tok, rank).is_some() {
            return Err(format!("{name}:{}: duplicate token or rank", n + 1));
        }
        if encoder.len() > MAX_TIKTOKEN_RANKS {
            return Err(format!("{name}: more than {MAX_TIKTOKEN_RANKS} ranks"));
        }
    }
    if encoder.is_empty() {
        return Err(format!("{name}: no ranks"));
    }
    Ok((encoder, ranks))
}

/// The config's `added_tokens_decoder` entries (content → id); an id that is also a rank is
/// refused, since CoreBPE would assert on it.
fn tiktoken_specials(
    config: Option<&Json>,
    ranks: &std::collections::HashSet<u32>,
) -> Result<HashMap<String, u32>, String> {
    let mut special = HashMap::new();
    let Some(added) = config
        .and_then(|c| c.get("added_tokens_decoder"))
        .and_then(Json::as_object)
    else {
        return Ok(special);
    };
    for (id, v) in added {
        let Ok(id) = id.parse::<u32>() else { continue };
        if let Some(content) = v.get("content").and_then(Json::as_str) {
            if ranks.contains(&id) {
                return Err(format!("special token id {id} collides with a rank"));
            }
            special.insert(content.to_owned(), id);
        }
    }
    Ok(special)
}

/// Finds the chat template: `chat_template.jinja`, else `tokenizer_config.json`'s
/// `chat_template`, else `chat_template.json`; `Ok(None)` when the model has none.
fn chat_template_source(dir: &Path, config: Option<&Json>) -> Result<Option<String>, String> {
    let jinja = dir.join(CHAT_TEMPLATE_FILE);
    if jinja.is_file() {
        let bytes = read_limited(&jinja, MAX_TEMPLATE_FILE_BYTES)?;
        return String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| format!("{CHAT_TEMPLATE_FILE}: not UTF-8"));
    }
    if let Some(t) = config.and_then(|c| template_from_field(c.get("chat_template"))) {
        return Ok(Some(t));
    }
    let processor = read_json(&dir.join(CHAT_TEMPLATE_JSON_FILE))?;
    Ok(processor.and_then(|c| template_from_field(c.get("chat_template"))))
}

/// A `chat_template` field is a string, or a list of `{name, template}` from which HF uses the
/// one named `default` (a list without one has no usable default).
fn template_from_field(field: Option<&Json>) -> Option<String> {
    match field? {
        Json::String(s) => Some(s.clone()),
        Json::Array(items) => items.iter().find_map(|item| {
            (item.get("name")?.as_str()? == "default")
                .then(|| item.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}
