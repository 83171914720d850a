//! Tests of the tokenizer module on real tokenizer files built with the `tokenizers` crate.
//!
//! Expected ids always come from the library's own encoding of the expected rendered prompt, so
//! the tests check our rendering + "no special tokens" call, not the library.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use tokenizers::models::bpe::BPE;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::load::{self, Model};
use super::pool::PoolConfig;
use super::template::{ChatTemplate, SpecialTokens, rewrite_generation_tags, strftime_utc};
use super::{
    MAX_CONCURRENT_TOKENIZE, MAX_PROMPT_TEXT_BYTES, MAX_TOKENS, TokenizeError, Tokenizers,
};

/// ChatML, as used by Qwen2.x (trimmed to the parts a single user turn reaches).
const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The Qwen2 pre-tokenization regex (needs look-ahead and Unicode classes: exercises the
/// pure-Rust fancy-regex backend on a real-world pattern).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A temporary directory removed on drop (no extra dev-dependency).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "ic-tokenizer-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    /// Creates `rel` (a directory) under the root and returns it.
    fn dir(&self, rel: &str) -> PathBuf {
        let p = self.0.join(rel);
        std::fs::create_dir_all(&p).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

/// A word-level tokenizer over a small vocabulary plus ChatML special tokens.
fn wordlevel_tokenizer() -> Tokenizer {
    let words = [
        "[UNK]",
        "user",
        "assistant",
        "system",
        "hello",
        "world",
        "the",
        "cat",
        "<s>",
    ];
    let vocab = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    tok.add_special_tokens(&[
        AddedToken::from(IM_START, true),
        AddedToken::from(IM_END, true),
        AddedToken::from("<s>", true),
    ]);
    tok
}

/// A byte-level BPE with a few merges, Qwen2-style pre-tokenization and ChatML specials.
fn bytelevel_bpe_tokenizer() -> Tokenizer {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort();
    let mut vocab: tokenizers::models::bpe::Vocab = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    for (a, b) in &merges {
        let n = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), n);
    }
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .unwrap();
    let mut tok = Tokenizer::new(model);
    let split = Split::new(
        SplitPattern::Regex(QWEN2_PATTERN.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .unwrap();
    tok.with_pre_tokenizer(Some(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens(&[
        AddedToken::from(IM_START, true),
        AddedToken::from(IM_END, true),
    ]);
    tok
}

fn write_model(dir: &Path, tok: &Tokenizer, config: Option<serde_json::Value>) {
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.join("tokenizer_config.json"), c.to_string()).unwrap();
    }
}

fn chatml_config() -> serde_json::Value {
    serde_json::json!({
        "chat_template": CHATML,
        "eos_token": IM_END,
        "bos_token": null,
        "pad_token": {"content": "<|endoftext|>", "special": true},
    })
}

fn lib_ids(tok: &Tokenizer, rendered: &str) -> Vec<u32> {
    tok.encode(rendered, false).unwrap().get_ids().to_vec()
}

fn tokenize(t: &Tokenizers, model: &str, text: &str) -> Result<Vec<u32>, TokenizeError> {
    block_on(t.submit(model, text.to_string())?)
}

fn render(source: &str, text: &str) -> Result<String, TokenizeError> {
    render_with(source, serde_json::json!({}), text)
}

fn render_with(
    source: &str,
    config: serde_json::Value,
    text: &str,
) -> Result<String, TokenizeError> {
    ChatTemplate::new(source, SpecialTokens::from_config(&config))
        .unwrap()
        .render_user_prompt(text)
}

fn chatml_rendered(text: &str) -> String {
    format!("{IM_START}user\n{text}{IM_END}\n{IM_START}assistant\n")
}

// ---------------------------------------------------------------- encoding on real files

#[test]
fn wordlevel_chatml_matches_library_encoding() {
    let root = TempDir::new("wl");
    let tok = wordlevel_tokenizer();
    write_model(&root.dir("org/chatml"), &tok, Some(chatml_config()));
    let t = Tokenizers::load(root.path());
    assert_eq!(t.models(), vec!["org/chatml".to_string()]);
    assert!(t.is_loaded("org/chatml"));

    let ids = tokenize(&t, "org/chatml", "hello world").unwrap();
    assert_eq!(ids, lib_ids(&tok, &chatml_rendered("hello world")));
    // Spelled out: the template's special tokens are recognised, nothing is added around them
    // (no BOS/EOS from a post-processor), and the generation prompt is present.
    let id = |s: &str| tok.token_to_id(s).unwrap();
    assert_eq!(
        ids,
        vec![
            id(IM_START),
            id("user"),
            id("hello"),
            id("world"),
            id(IM_END),
            id(IM_START),
            id("assistant"),
        ]
    );
}

#[test]
fn bytelevel_bpe_with_qwen2_regex_matches_library_encoding() {
    let root = TempDir::new("bpe");
    let tok = bytelevel_bpe_tokenizer();
    let dir = root.dir("Qwen/Qwen2.5-0.5B-Instruct");
    write_model(&dir, &tok, Some(serde_json::json!({"eos_token": IM_END})));
    std::fs::write(dir.join("chat_template.jinja"), CHATML).unwrap();
    let t = Tokenizers::load(root.path());
    assert!(t.is_loaded("Qwen/Qwen2.5-0.5B-Instruct"));

    let text = "hello, héllo wörld 12345\n\n  it's   ünïcødé ✓ 你好\ttab";
    let ids = tokenize(&t, "Qwen/Qwen2.5-0.5B-Instruct", text).unwrap();
    let rendered = chatml_rendered(text);
    assert_eq!(ids, lib_ids(&tok, &rendered));
    // A real byte-level BPE round-trips and uses the merges.
    assert_eq!(tok.decode(&ids, false).unwrap(), rendered);
    assert!(ids.contains(&tok.token_to_id("hello").unwrap()));
}

#[test]
fn model_without_chat_template_tokenizes_raw_text() {
    let root = TempDir::new("raw");
    let tok = wordlevel_tokenizer();
    write_model(
        &root.dir("base"),
        &tok,
        Some(serde_json::json!({"eos_token": IM_END})),
    );
    let t = Tokenizers::load(root.path());
    let ids = tokenize(&t, "base", "the cat").unwrap();
    assert_eq!(ids, lib_ids(&tok, "the cat"));
    assert_eq!(ids.len(), 2);
}

#[test]
fn chat_template_sources_and_precedence() {
    let root = TempDir::new("prec");
    let tok = wordlevel_tokenizer();
    // chat_template.jinja wins over tokenizer_config.json's field.
    let a = root.dir("a");
    write_model(&a, &tok, Some(chatml_config()));
    std::fs::write(
        a.join("chat_template.jinja"),
        "system {{ messages[0].content }}",
    )
    .unwrap();
    // A list of named templates: the one named "default" is used.
    let b = root.dir("b");
    write_model(
        &b,
        &tok,
        Some(serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "system"},
            {"name": "default", "template": "{{ bos_token }} user {{ messages[0].content }}"},
        ], "bos_token": "<s>"})),
    );
    // chat_template.json (processor style) as the last resort.
    let c = root.dir("c");
    write_model(&c, &tok, None);
    std::fs::write(
        c.join("chat_template.json"),
        serde_json::json!({"chat_template": "assistant {{ messages[0].content }}"}).to_string(),
    )
    .unwrap();
    let t = Tokenizers::load(root.path());
    assert_eq!(t.models(), vec!["a", "b", "c"]);
    assert_eq!(
        tokenize(&t, "a", "cat").unwrap(),
        lib_ids(&tok, "system cat")
    );
    assert_eq!(
        tokenize(&t, "b", "cat").unwrap(),
        lib_ids(&tok, "<s> user cat")
    );
    assert_eq!(
        tokenize(&t, "c", "cat").unwrap(),
        lib_ids(&tok, "assistant cat")
    );
}

// ---------------------------------------------------------------- loading and walking

#[test]
fn walk_finds_nested_ids_and_skips_unsafe_broken_and_unsupported() {
    let root = TempDir::new("walk");
    let tok = wordlevel_tokenizer();
    write_model(
        &root.dir("Qwen/Qwen2.5-0.5B-Instruct"),
        &tok,
        Some(chatml_config()),
    );
    write_model(
        &root.dir("Qwen/Qwen2.5-0.5B-Instruct/nested/deeper"),
        &tok,
        None,
    );
    write_model(&root.dir("llama-3"), &tok, Some(chatml_config()));
    // The root itself is not a model (its id would be empty).
    write_model(root.path(), &tok, None);
    // Unsafe ids: a backslash and a drive prefix in a directory name.
    write_model(&root.dir("evil\\name"), &tok, None);
    write_model(&root.dir("C:"), &tok, None);
    // Broken artifacts are skipped, not fatal.
    std::fs::write(root.dir("broken").join("tokenizer.json"), "{ not json").unwrap();
    write_model(&root.dir("badconfig"), &tok, None);
    std::fs::write(root.path().join("badconfig/tokenizer_config.json"), "[").unwrap();
    write_model(
        &root.dir("badtemplate"),
        &tok,
        Some(serde_json::json!({"chat_template": "{% for x in %}"})),
    );
    // A tiktoken rank file that does not parse (a line without a rank) is skipped.
    std::fs::write(root.dir("tik").join("cl100k.tiktoken"), "aGVsbG8=\n").unwrap();
    // A symlinked directory is not followed.
    let outside = TempDir::new("walk-outside");
    write_model(&outside.dir("m"), &tok, None);
    std::os::unix::fs::symlink(outside.path().join("m"), root.path().join("linked")).unwrap();

    let t = Tokenizers::load(root.path());
    assert_eq!(
        t.models(),
        vec![
            "Qwen/Qwen2.5-0.5B-Instruct",
            "Qwen/Qwen2.5-0.5B-Instruct/nested/deeper",
            "llama-3",
        ]
    );
    for bad in [
        "",
        ".",
        "evil\\name",
        "C:",
        "broken",
        "badconfig",
        "badtemplate",
        "tik",
        "linked",
        "Qwen",
        "/llama-3",
        "llama-3/",
        "./llama-3",
        "Qwen//Qwen2.5-0.5B-Instruct",
    ] {
        assert!(!t.is_loaded(bad), "{bad:?} must not be loaded");
        assert_eq!(tokenize(&t, bad, "x"), Err(TokenizeError::UnknownModel));
    }
    assert!(tokenize(&t, "Qwen/Qwen2.5-0.5B-Instruct/nested/deeper", "the cat").is_ok());
}

#[test]
fn model_id_safety_rules() {
    for ok in [
        "llama-3",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "a/b/c",
        "ab:c",
        "x/C:",
    ] {
        assert!(load::is_safe_model_id(ok), "{ok:?}");
    }
    for bad in [
        "", ".", "..", "/abs", "a/../b", "a/./b", "a//b", "a/", "./a", "a\\b", "C:", "c:/x", "a:b",
        "C:foo", "a/..", "a\u{0}b", "a\nb",
    ] {
        assert!(!load::is_safe_model_id(bad), "{bad:?}");
    }
    assert_eq!(
        load::model_id_from_relative(Path::new("Qwen/Qwen2.5")),
        Some("Qwen/Qwen2.5".into())
    );
    assert_eq!(load::model_id_from_relative(Path::new("")), None);
    assert_eq!(load::model_id_from_relative(Path::new("/abs")), None);
    assert_eq!(load::model_id_from_relative(Path::new("a/../b")), None);
}

#[test]
fn missing_or_empty_dir_loads_nothing_but_stays_enabled() {
    let root = TempDir::new("empty");
    let t = Tokenizers::load(root.path());
    assert!(t.is_enabled());
    assert!(t.models().is_empty());
    assert_eq!(tokenize(&t, "m", "x"), Err(TokenizeError::UnknownModel));
    let t = Tokenizers::load(&root.path().join("does-not-exist"));
    assert!(t.models().is_empty());
    assert_eq!(tokenize(&t, "m", "x"), Err(TokenizeError::UnknownModel));
}

// ---------------------------------------------------------------- admission and limits

#[test]
fn disabled_handle_is_unavailable() {
    let t = Tokenizers::disabled();
    assert!(!t.is_enabled());
    assert!(!t.is_loaded("m"));
    assert_eq!(tokenize(&t, "m", "x"), Err(TokenizeError::Unavailable));
    // The global handle is disabled until installed.
    assert_eq!(
        block_on(async { super::global().submit("m", "x".into()).err() }),
        Some(TokenizeError::Unavailable)
    );
}

#[test]
fn oversize_text_is_refused_before_queueing() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let t = fake_handle(
        move |text| {
            c.fetch_add(1, Ordering::SeqCst);
            Ok(vec![text.len() as u32])
        },
        PoolConfig::default(),
    );
    let big = "a".repeat(MAX_PROMPT_TEXT_BYTES + 1);
    assert_eq!(t.submit("fake", big).err(), Some(TokenizeError::Oversize));
    assert_eq!(t.in_flight(), 0);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the tokenizer is never called"
    );
    // Exactly the limit is accepted.
    let ids = tokenize(&t, "fake", &"a".repeat(MAX_PROMPT_TEXT_BYTES)).unwrap();
    assert_eq!(ids, vec![MAX_PROMPT_TEXT_BYTES as u32]);
}

#[test]
fn output_longer_than_max_tokens_is_too_long() {
    // Real encode path with a shrunken limit (a 1 MiB prompt takes tens of seconds in a debug
    // build): the ChatML rendering of "hello world" is 7 word-level tokens.
    let root = TempDir::new("toolong");
    let tok = wordlevel_tokenizer();
    write_model(&root.dir("m"), &tok, Some(chatml_config()));
    let models = load::load_models_dir(root.path());
    let t = Tokenizers::from_models_with_limits(
        models.clone(),
        PoolConfig::default(),
        MAX_CONCURRENT_TOKENIZE,
        7,
    );
    assert_eq!(tokenize(&t, "m", "hello world").unwrap().len(), 7);
    let t = Tokenizers::from_models_with_limits(
        models,
        PoolConfig::default(),
        MAX_CONCURRENT_TOKENIZE,
        6,
    );
    assert_eq!(
        tokenize(&t, "m", "hello world"),
        Err(TokenizeError::TooLong)
    );
    // Production limit: exactly MAX_TOKENS passes, one more fails.
    let t = fake_handle(
        |text| Ok(vec![7; text.parse::<usize>().unwrap()]),
        PoolConfig::default(),
    );
    assert_eq!(
        tokenize(&t, "fake", &MAX_TOKENS.to_string()).unwrap().len(),
        MAX_TOKENS
    );
    assert_eq!(
        tokenize(&t, "fake", &(MAX_TOKENS + 1).to_string()),
        Err(TokenizeError::TooLong)
    );
}

/// A handle over one scripted model named "fake".
fn fake_handle(
    f: impl Fn(&str) -> Result<Vec<u32>, TokenizeError> + Send + Sync + 'static,
    cfg: PoolConfig,
) -> Tokenizers {
    let mut models = HashMap::new();
    models.insert("fake".to_string(), Arc::new(Model::fake(Box::new(f))));
    Tokenizers::from_models(models, cfg)
}

/// A gate the fake model blocks on until opened; counts the calls that reached the model.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
    calls: AtomicUsize,
}

impl Gate {
    fn wait(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

fn gated_handle(gate: &Arc<Gate>) -> Tokenizers {
    let g = gate.clone();
    fake_handle(
        move |text| {
            g.wait();
            Ok(text.bytes().map(u32::from).collect())
        },
        PoolConfig::default(),
    )
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn the_65th_concurrent_call_is_shed_immediately() {
    let gate = Arc::new(Gate::default());
    let t = gated_handle(&gate);
    let futures: Vec<_> = (0..MAX_CONCURRENT_TOKENIZE)
        .map(|i| t.submit("fake", format!("{i}")).expect("within the limit"))
        .collect();
    assert_eq!(t.in_flight(), MAX_CONCURRENT_TOKENIZE);
    // Both workers are blocked inside the model; the rest are queued holding their slots.
    wait_until("workers to block", || {
        gate.calls.load(Ordering::SeqCst) == 2
    });
    // Admission does not wait: this thread holds the only key to the gate, so a submit that
    // waited for a slot would never return; answering Saturated at all proves it did not.
    assert_eq!(
        t.submit("fake", "65".into()).err(),
        Some(TokenizeError::Saturated)
    );

    gate.open();
    for (i, f) in futures.into_iter().enumerate() {
        let expected: Vec<u32> = format!("{i}").bytes().map(u32::from).collect();
        assert_eq!(block_on(f).unwrap(), expected);
    }
    wait_until("slots to be released", || t.in_flight() == 0);
    assert!(tokenize(&t, "fake", "again").is_ok());
}

#[test]
fn slots_are_released_when_callers_stop_waiting() {
    let gate = Arc::new(Gate::default());
    let t = gated_handle(&gate);
    let futures: Vec<_> = (0..MAX_CONCURRENT_TOKENIZE)
        .map(|i| t.submit("fake", format!("{i}")).unwrap())
        .collect();
    wait_until("workers to block", || {
        gate.calls.load(Ordering::SeqCst) == 2
    });
    // Every caller gives up (deadline fired): the slots stay taken until the work is done.
    drop(futures);
    assert_eq!(
        t.submit("fake", "x".into()).err(),
        Some(TokenizeError::Saturated)
    );
    gate.open();
    wait_until("slots to be released", || t.in_flight() == 0);
    // Only the two jobs already running reached the model; queued ones were skipped.
    assert_eq!(gate.calls.load(Ordering::SeqCst), 2);
    let again: Vec<_> = (0..MAX_CONCURRENT_TOKENIZE)
        .map(|_| t.submit("fake", "y".into()).unwrap())
        .collect();
    for f in again {
        assert_eq!(block_on(f).unwrap(), vec![u32::from(b'y')]);
    }
}

#[test]
fn errors_and_panics_are_failures_and_the_pool_survives() {
    let t = fake_handle(
        |text| match text {
            "panic" => panic!("scripted panic"),
            "fail" => Err(TokenizeError::Failed("scripted".into())),
            "empty" => Ok(Vec::new()),
            _ => Ok(vec![1, 2, 3]),
        },
        PoolConfig {
            workers: 1,
            cpus: None,
        },
    );
    assert!(matches!(
        tokenize(&t, "fake", "panic"),
        Err(TokenizeError::Failed(_))
    ));
    assert_eq!(
        tokenize(&t, "fake", "fail"),
        Err(TokenizeError::Failed("scripted".into()))
    );
    assert_eq!(tokenize(&t, "fake", "empty"), Ok(Vec::new()));
    assert_eq!(tokenize(&t, "fake", "ok"), Ok(vec![1, 2, 3]));
    wait_until("slots to be released", || t.in_flight() == 0);
}

#[test]
fn futures_are_send_and_resolve_without_a_runtime() {
    fn assert_send<T: Send + 'static>(_: &T) {}
    let t = fake_handle(|_| Ok(vec![9]), PoolConfig::default());
    let f = t.submit("fake", "x".into()).unwrap();
    assert_send(&f);
    assert_send(&t);
    // Polled from a plain thread with no tokio runtime anywhere.
    let got = std::thread::spawn(move || block_on(f)).join().unwrap();
    assert_eq!(got, Ok(vec![9]));
}

#[test]
fn pinned_pool_config_spares_the_serving_cpus() {
    let all = PoolConfig::sparing_serving_cores(0)
        .cpus
        .unwrap_or_default();
    assert!(!all.is_empty());
    let one = PoolConfig::sparing_serving_cores(1);
    match one.cpus {
        Some(c) => assert_eq!(c, all[1..].to_vec()),
        None => assert_eq!(all.len(), 1),
    }
    assert!(PoolConfig::sparing_serving_cores(all.len()).cpus.is_none());
    // Pinned workers still serve.
    let t = fake_handle(|_| Ok(vec![1]), PoolConfig::sparing_serving_cores(1));
    assert_eq!(tokenize(&t, "fake", "x"), Ok(vec![1]));
}

// ---------------------------------------------------------------- HF template compatibility

#[test]
fn failures_never_quote_the_prompt() {
    let secret = "SECRET-PROMPT-TEXT";
    let err = render(
        "{% if messages[0].content %}{{ raise_exception('bad: ' + messages[0].content) }}{% endif %}",
        secret,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("raise_exception"), "{msg}");
    assert!(!msg.contains(secret), "{msg}");
    let err = render("{{ messages[0].content + 1 }}", secret).unwrap_err();
    assert!(!err.to_string().contains(secret), "{err}");
}

#[test]
fn hf_template_features() {
    // bos/eos variables, additional special tokens, tools/documents are none, trim/lstrip blocks.
    let cfg = serde_json::json!({
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "additional_special_tokens": ["<x>", {"content": "<y>"}],
    });
    let src = "{{ bos_token }}\n  {% if tools is not none %}TOOLS{% endif %}\n{% if documents is none %}[nodocs]{% endif %}\n{{ eos_token }}{{ additional_special_tokens|join(',') }}{{ unk_token }}";
    assert_eq!(
        render_with(src, cfg, "x").unwrap(),
        "<s>\n[nodocs]</s><x>,<y>"
    );
    // Loop controls.
    let src = "{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}";
    assert_eq!(render(src, "x").unwrap(), "023");
    // Python string and dict methods.
    let src = "{{ messages[0].content.strip().upper() }}|{{ messages[0].content.startswith('  a') }}|{% for k, v in messages[0].items() %}{{ k }}={{ v|trim }};{% endfor %}|{{ messages[0].get('missing', 'dflt') }}|{{ 'tool_calls' in messages[0] }}|{{ messages[0] is mapping }}";
    assert_eq!(
        render(src, "  a b  ").unwrap(),
        "A B|True|role=user;content=a b;|dflt|False|True"
    );
    // HF tojson: Python separators, no HTML escaping, key order preserved, indent.
    assert_eq!(
        render("{{ messages[0]|tojson }}", "a\"b<&>é\n").unwrap(),
        r#"{"role": "user", "content": "a\"b<&>é\n"}"#
    );
    assert_eq!(
        render(
            "{{ {'z': 1, 'a': [true, none, 1.5]}|tojson(indent=2) }}",
            "x"
        )
        .unwrap(),
        "{\n  \"z\": 1,\n  \"a\": [\n    true,\n    null,\n    1.5\n  ]\n}"
    );
    assert_eq!(
        render(
            "{{ {'z': 1, 'a': 'é'}|tojson(sort_keys=true, ensure_ascii=true) }}",
            "x"
        )
        .unwrap(),
        r#"{"a": "\u00e9", "z": 1}"#
    );
    // namespace(), loop variables, add_generation_prompt.
    let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ loop.index }}{{ loop.last }}{% endfor %}{{ ns.n }}{{ add_generation_prompt }}";
    // Booleans print the Python way, as in Jinja2.
    assert_eq!(render(src, "x").unwrap(), "1True1True");
    // The {% generation %} tag renders its body unchanged, whitespace control included.
    let src = "A {%- generation -%} B {%- endgeneration %} C{% generation %}D{% endgeneration %}";
    assert_eq!(render(src, "x").unwrap(), "AB CD");
    assert_eq!(
        rewrite_generation_tags("{%- generation %}x{% endgeneration -%}{{ y }}{% if a %}"),
        "{%- if true %}x{% endif -%}{{ y }}{% if a %}"
    );
    // strftime_now exists and produces a date (the value depends on the clock).
    assert_eq!(
        render("{{ strftime_now('%Y') | length }}", "x").unwrap(),
        "4"
    );
}

#[test]
fn strftime_matches_python_for_common_directives() {
    // 2024-07-26T00:00:00Z, the Llama 3.1 template's default date.
    assert_eq!(strftime_utc("%d %b %Y", 1_721_952_000), "26 Jul 2024");
    assert_eq!(
        strftime_utc(
            "%a %A %b %B %d %e %H %I %p %M %S %y %F %% %Q",
            1_764_678_896
        ),
        "Tue Tuesday Dec December 02  2 12 12 PM 34 56 25 2025-12-02 % %Q"
    );
    assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", 0), "1970-01-01 00:00:00");
    assert_eq!(strftime_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
}

/// A Llama-3.1-style template (system date header, bos_token, trim filters, loop controls): it
/// must compile and render the shape the engine produces for one user turn.
#[test]
fn llama3_style_template_renders() {
    let src = r#"{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;
    let cfg = serde_json::json!({"bos_token": "<|begin_of_text|>"});
    let out = render_with(src, cfg, "  hi there ").unwrap();
    let today = strftime_utc("%d %b %Y", super::template::now_unix_secs());
    assert_eq!(
        out,
        format!(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: {today}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    );
}

/// Compares against reference ids computed by HF `transformers` on real tokenizer files (see
/// `reference_ids.py`); needs those files, so it only runs on demand.
#[test]
#[ignore = "needs real tokenizer files and IC_TOKENIZER_REFERENCE (see reference_ids.py)"]
fn real_models_match_reference() {
    let path = std::env::var("IC_TOKENIZER_REFERENCE").expect("IC_TOKENIZER_REFERENCE");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let dir = reference["models_dir"].as_str().unwrap();
    let t = Tokenizers::load(Path::new(dir));
    let cases = reference["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    let mut mismatches = Vec::new();
    for case in cases {
        let model = case["model"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = tokenize(&t, model, text).unwrap();
        if got != want {
            mismatches.push(format!(
                "{model}: {text:?}\n  got  {got:?}\n  want {want:?}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    eprintln!("{} reference cases matched", cases.len());
}

#[test]
fn tokenize_for_lookup_maps_every_failure_to_none() {
    let t = fake_handle(
        |text| match text {
            "empty" => Ok(Vec::new()),
            "fail" => Err(TokenizeError::Failed("scripted".into())),
            _ => Ok(vec![4, 2]),
        },
        PoolConfig::default(),
    );
    assert_eq!(
        block_on(t.tokenize_for_lookup("fake", "ok".into())),
        Some(vec![4, 2])
    );
    assert_eq!(
        block_on(t.tokenize_for_lookup("fake", "empty".into())),
        None
    );
    assert_eq!(block_on(t.tokenize_for_lookup("fake", "fail".into())), None);
    assert_eq!(block_on(t.tokenize_for_lookup("nope", "ok".into())), None);
    let big = "a".repeat(MAX_PROMPT_TEXT_BYTES + 1);
    assert_eq!(block_on(t.tokenize_for_lookup("fake", big)), None);
    assert_eq!(
        block_on(Tokenizers::disabled().tokenize_for_lookup("fake", "ok".into())),
        None
    );
    // Admission happens at the call, not at the first poll: an unpolled future holds a slot.
    let held = t.tokenize_for_lookup("fake", "ok".into());
    wait_until("the held job to finish", || t.in_flight() == 0);
    drop(held);
}

#[test]
fn truncation_and_padding_presets_are_ignored() {
    let root = TempDir::new("trunc");
    let mut tok = wordlevel_tokenizer();
    tok.with_truncation(Some(tokenizers::TruncationParams {
        max_length: 2,
        ..Default::default()
    }))
    .unwrap();
    tok.with_padding(Some(tokenizers::PaddingParams {
        strategy: tokenizers::PaddingStrategy::Fixed(16),
        ..Default::default()
    }));
    write_model(&root.dir("m"), &tok, None);
    let t = Tokenizers::load(root.path());
    let ids = tokenize(&t, "m", "the cat hello world").unwrap();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    assert_eq!(ids, vec![id("the"), id("cat"), id("hello"), id("world")]);
}

/// Writes a tiny tiktoken model: ranks 0..=255 for single bytes, then merges "ab", "abc",
/// " a" (ranks 256..=258), one special token `<|gen|>` (id 300) and a chat template that
/// appends it as the generation prompt.
fn write_tiktoken_model(dir: &std::path::Path) {
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let mut ranks = String::new();
    for b in 0u8..=255 {
        ranks.push_str(&format!("{} {}\n", b64(&[b]), b));
    }
    for (i, m) in [&b"ab"[..], b"abc", b" a"].iter().enumerate() {
        ranks.push_str(&format!("{} {}\n", b64(m), 256 + i));
    }
    std::fs::write(dir.join("tiny.tiktoken"), ranks).unwrap();
    let cfg = serde_json::json!({
        "added_tokens_decoder": {"300": {"content": "<|gen|>", "special": true}},
        "chat_template": "{{ messages[0]['content'] }}{% if add_generation_prompt %}<|gen|>{% endif %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}

#[test]
fn tiktoken_model_matches_the_library_encoding() {
    let root = TempDir::new("tiktoken");
    write_tiktoken_model(&root.dir("org/tiny-tik"));
    let t = Tokenizers::load(root.path());
    assert_eq!(t.models(), vec!["org/tiny-tik"]);
    let ids = tokenize(&t, "org/tiny-tik", "abc ab").unwrap();

    // The library's own encoding of the rendered prompt, with the same ranks and pattern.
    let mut enc = std::collections::HashMap::new();
    for b in 0u8..=255 {
        enc.insert(vec![b], u32::from(b));
    }
    for (i, m) in [&b"ab"[..], b"abc", b" a"].iter().enumerate() {
        enc.insert(m.to_vec(), 256 + i as u32);
    }
    let special = std::collections::HashMap::from([("<|gen|>".to_string(), 300u32)]);
    let bpe = tiktoken_rs::CoreBPE::new(
        enc.into_iter().collect(),
        special.into_iter().collect(),
        super::load::CL100K_PATTERN,
    )
    .unwrap();
    assert_eq!(ids, bpe.encode_with_special_tokens("abc ab<|gen|>"));
    // And concretely: "abc" " a" "b" "<|gen|>" under the cl100k split (" ab" is one piece).
    assert_eq!(ids.last(), Some(&300));
    assert_eq!(ids[0], 257);
}

#[test]
fn tiktoken_duplicate_ranks_skip_the_model_without_panicking() {
    let root = TempDir::new("tiktoken-dup");
    let dir = root.dir("dup");
    std::fs::write(dir.join("x.tiktoken"), "YQ== 0\nYg== 0\n").unwrap();
    let t = Tokenizers::load(root.path());
    assert!(t.models().is_empty());
}
