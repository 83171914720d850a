//! A tiny real tokenizer model for the prompt_text tests: a WordLevel `tokenizer.json` with
//! words `w0..w199` (ids 1000..1199) and a chat template that appends ` GEN` (id 7) as the
//! generation prompt, written to a fresh temp directory.

use std::path::PathBuf;

use super::pb;

pub const MODEL: &str = "acme/tiny-wl";

/// Writes the tiny model under a fresh temp root and returns the root.
pub fn model_root(tag: &str) -> PathBuf {
    let root = super::unique_temp_path(&format!("tiny-model-{tag}"));
    let dir = root.join(MODEL);
    std::fs::create_dir_all(&dir).unwrap();
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    vocab.insert("GEN".into(), 7.into());
    for n in 0..200u32 {
        vocab.insert(format!("w{n}"), (1000 + n).into());
    }
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let cfg = serde_json::json!({
        "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}{% if add_generation_prompt %} GEN{% endif %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    root
}

/// Self-check that the generated tokenizer.json loads and encodes as the tests assume.
pub fn check_tokenizer(root: &std::path::Path) {
    let t = tokenizers::Tokenizer::from_file(root.join(MODEL).join("tokenizer.json"))
        .expect("tiny tokenizer loads");
    let enc = t.encode("w0 w1 w2 GEN", false).unwrap();
    assert_eq!(enc.get_ids(), &[1000, 1001, 1002, 7]);
}

pub fn words(k: u32) -> String {
    (0..k)
        .map(|n| format!("w{n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The tokens the server must produce for `words(k)` (template + generation prompt).
pub fn expected_tokens(k: u32) -> Vec<u32> {
    let mut v: Vec<u32> = (1000..1000 + k).collect();
    v.push(7);
    v
}

pub fn prompt_lookup(tenant: &str, model: &str, text: String) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        prompt_text: text,
        ..Default::default()
    }
}

/// The server's test-only tokenizer gate (`INFERENCECACHE_TEST_TOKENIZE_GATE`, see
/// src/tokenizer/pool.rs): while the gate file does not exist, the tokenizer workers hold every
/// job they take, so tokenizations stay admitted for as long as a test needs (the server gives
/// up waiting after 120 s). Created closed; the file is removed on drop.
pub struct TokenizeGate {
    path: PathBuf,
}

impl TokenizeGate {
    /// The environment variable the server reads.
    pub const ENV: &'static str = "INFERENCECACHE_TEST_TOKENIZE_GATE";

    /// A closed gate (its file does not exist yet).
    pub fn closed(tag: &str) -> Self {
        let path = super::unique_temp_path(&format!("tokenize-gate-{tag}"));
        let _ = std::fs::remove_file(&path);
        Self { path }
    }

    /// The `(name, value)` pair to start the server with (`StartOpts::env`).
    pub fn env(&self) -> (&'static str, &str) {
        (Self::ENV, self.path.to_str().expect("utf-8 temp path"))
    }

    /// Opens the gate: the held jobs (and every later one) run.
    pub fn open(&self) {
        std::fs::write(&self.path, b"open").expect("create the gate file");
    }
}

impl Drop for TokenizeGate {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The `inferencecache_tokenizer_in_flight` gauge (tokenizations admitted and not finished).
pub fn tokenizer_in_flight(srv: &super::Server) -> Option<f64> {
    super::metric_value(
        &super::metrics_text(srv),
        "inferencecache_tokenizer_in_flight",
    )
}
