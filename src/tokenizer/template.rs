//! HF-compatible chat-template rendering on minijinja.
//!
//! `transformers` renders chat templates in a Jinja2 sandbox with `trim_blocks`,
//! `lstrip_blocks`, the `loopcontrols` extension, a `raise_exception` function, a
//! `strftime_now` function, a non-HTML-escaping `tojson` filter and the `{% generation %}` tag;
//! the templates also call Python string/dict methods. Token ids only match the engine's if the
//! rendered text matches byte for byte, so each of those is reproduced here.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use super::TokenizeError;

/// Name under which the model's template is registered in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Nesting depth allowed to templates (macros, includes, recursion) before rendering fails.
const RECURSION_LIMIT: usize = 64;

/// The special-token variables HF passes to templates (`special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Special-token strings from `tokenizer_config.json`, exposed to the template as variables.
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    named: BTreeMap<&'static str, String>,
    additional: Vec<String>,
}

impl SpecialTokens {
    /// Reads `bos_token`, `eos_token`, ... (strings or `{"content": ...}` objects) and
    /// `additional_special_tokens`; missing or null entries stay undefined, as in HF.
    pub fn from_config(config: &Json) -> Self {
        fn token(v: &Json) -> Option<String> {
            match v {
                Json::String(s) => Some(s.clone()),
                Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
                _ => None,
            }
        }
        let named = SPECIAL_TOKEN_KEYS
            .iter()
            .filter_map(|&k| Some((k, token(config.get(k)?)?)))
            .collect();
        let additional = config
            .get("additional_special_tokens")
            .and_then(Json::as_array)
            .map(|a| a.iter().filter_map(token).collect())
            .unwrap_or_default();
        Self { named, additional }
    }
}

/// One model's compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    specials: SpecialTokens,
}

impl ChatTemplate {
    /// Compiles `source` once at load time, so syntax errors surface at start-up (and the model
    /// is skipped) rather than on every request.
    pub fn new(source: &str, specials: SpecialTokens) -> Result<Self, String> {
        let mut env = hf_environment()?;
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| format!("chat template: {}", describe(&e)))?;
        Ok(Self { env, specials })
    }

    /// Renders `[{role: "user", content: text}]` with `add_generation_prompt=true`, the same
    /// call the engine's chat endpoint makes for a single user turn.
    pub fn render_user_prompt(&self, text: &str) -> Result<String, TokenizeError> {
        let message = Value::from_object(Message {
            role: Value::from("user"),
            content: Value::from(text),
        });
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from(vec![message]));
        ctx.insert("add_generation_prompt", Value::from(true));
        // HF passes these explicitly as None: templates test `tools is not none`.
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        for (k, v) in &self.specials.named {
            ctx.insert(k, Value::from(v.as_str()));
        }
        if !self.specials.additional.is_empty() {
            ctx.insert(
                "additional_special_tokens",
                Value::from(self.specials.additional.clone()),
            );
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizeError::Failed(format!("chat template: {}", describe(&e))))?;
        // The error detail may quote evaluated values (i.e. prompt text): only the kind and
        // the line are reported.
        tmpl.render(Value::from(ctx))
            .map_err(|e| TokenizeError::Failed(format!("chat template: {}", describe(&e))))
    }
}

/// A short, prompt-free description of a template error.
fn describe(e: &Error) -> String {
    let what = match e.kind() {
        ErrorKind::InvalidOperation if is_raised(e) => "raise_exception".to_string(),
        kind => format!("{kind}"),
    };
    match e.line() {
        Some(line) => format!("{what} (line {line})"),
        None => what,
    }
}

/// Marker for errors produced by the template's own `raise_exception(...)`.
const RAISED_PREFIX: &str = "template raised: ";

fn is_raised(e: &Error) -> bool {
    e.detail().is_some_and(|d| d.starts_with(RAISED_PREFIX))
}

/// A chat message as a map whose keys enumerate in Python's insertion order (`role` first), so
/// `message|tojson` and `message.items()` match HF.
#[derive(Debug)]
struct Message {
    role: Value,
    content: Value,
}

impl Object for Message {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(self.role.clone()),
            "content" => Some(self.content.clone()),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// An environment configured like `transformers`' chat-template sandbox: no loader (so no
/// `include`/`import` and no filesystem access), a recursion limit, HF's functions and filters.
/// Also the engine of the tenant templates RenderTemplate serves (`src/templates`).
pub fn hf_environment() -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| format!("template syntax config: {e}"))?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_recursion_limit(RECURSION_LIMIT);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: Option<String>| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED_PREFIX}{}", msg.unwrap_or_default()),
            ))
        },
    );
    env.add_function("strftime_now", |format: String| -> String {
        strftime_utc(&format, now_unix_secs())
    });
    env.add_filter("tojson", tojson);
    Ok(env)
}

/// HF's `{% generation %}…{% endgeneration %}` (assistant-mask tracking) does not affect the
/// rendered text; it is rewritten to `{% if true %}…{% endif %}`, keeping any whitespace-control
/// markers so trimming stays identical.
pub fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = split_marker_front(inner);
        let (body, trail) = split_marker_back(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(out, "{{%{lead} {r} {trail}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_marker_front(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => (&s[..1], &s[1..]),
        _ => ("", s),
    }
}

fn split_marker_back(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-' | b'+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

/// HF's `tojson`: Python `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` — unlike minijinja's built-in it does not HTML-escape, and its separators
/// are Python's.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent =
        match indent {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => match v.as_str() {
                Some(s) => Some(s.to_owned()),
                None => Some(" ".repeat(v.as_usize().ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: bad indent")
                })?)),
            },
        };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (
                    a.as_str().unwrap_or(",").to_owned(),
                    b.as_str().unwrap_or(":").to_owned(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// Nesting depth `tojson` follows before giving up (cyclic or absurdly deep values).
const MAX_JSON_DEPTH: usize = 128;

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, depth: usize) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nested too deeply",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Ok(f) = f64::try_from(v.clone()) {
                write_float(out, f);
            } else {
                let _ = write!(out, "{v}");
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), o, depth, |out, i| {
                write_json(out, &items[i], o, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            write_container(out, '{', '}', keys.len(), o, depth, |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(s) => write_json_str(out, s, o.ensure_ascii),
                    None => write_json_str(out, &key.to_string(), o.ensure_ascii),
                }
                out.push_str(&o.key_sep);
                write_json(out, &v.get_item(key)?, o, depth + 1)
            })?;
        }
        ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize {}", v.kind()),
            ));
        }
        _ => write_json_str(out, &v.to_string(), o.ensure_ascii),
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    o: &JsonOpts,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// Python's float repr for the common cases (`1.0`, `0.5`, `1e-05`, `NaN`, `Infinity`).
fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else if f == f.trunc() && f.abs() < 1e16 {
        let _ = write!(out, "{f:.1}");
    } else {
        let _ = write!(out, "{f}");
    }
}

/// A JSON string literal escaped like Python's `json.dumps`.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

pub(super) fn now_unix_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `strftime` in UTC for the directives chat templates use (date stamps in system prompts);
/// unknown directives are copied verbatim.
pub fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (y, m, d) = crate::sys::civil::civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let wd = (days + 3).rem_euclid(7) as usize;
    let month = MONTHS[(m - 1) as usize];
    let weekday = WEEKDAYS[wd];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match spec {
            'd' => write!(out, "{d:02}"),
            'e' => write!(out, "{d:2}"),
            'm' => write!(out, "{m:02}"),
            'Y' => write!(out, "{y}"),
            'y' => write!(out, "{:02}", y.rem_euclid(100)),
            'B' => write!(out, "{month}"),
            'b' | 'h' => write!(out, "{}", &month[..3]),
            'A' => write!(out, "{weekday}"),
            'a' => write!(out, "{}", &weekday[..3]),
            'H' => write!(out, "{hh:02}"),
            'I' => write!(out, "{:02}", if hh % 12 == 0 { 12 } else { hh % 12 }),
            'p' => write!(out, "{}", if hh < 12 { "AM" } else { "PM" }),
            'M' => write!(out, "{mm:02}"),
            'S' => write!(out, "{ss:02}"),
            'F' => write!(out, "{y}-{m:02}-{d:02}"),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}
