//! RenderTemplate: prompt templates registered per tenant on the controller-facing listener
//! (`PUT|GET|DELETE /templates/{tenant}/{ref}`, docs/BEHAVIOUR.md §11) and rendered on the core
//! that received the call.
//!
//! A template is compiled once, at registration, with the chat-template engine the tokenizer
//! uses ([`crate::tokenizer::hf_environment`]: minijinja configured like `transformers`' sandbox,
//! no loader, so no `include`/`import` and no filesystem). Every render runs with a work budget
//! ([`TEMPLATE_RENDER_FUEL`]) and an output bound ([`MAX_RENDERED_PROMPT_BYTES`]), so a runaway
//! template costs a serving core a bounded few milliseconds and answers `RENDER_ERROR`.
//!
//! **Stable prefix.** At registration the template is rendered twice with every variable set to
//! one of two different private-use sentinel strings; the longest common prefix of the two
//! outputs (cut to a character boundary; empty if either render fails) is the *stable prefix*:
//! the text every render starts with whatever the variables are. When the registration names a
//! tokenizer `model` (one loaded from `--tokenizer-models-dir`), the stable prefix is tokenized
//! as plain text (no chat template, no added special tokens), its **last token is dropped** (it
//! may merge with the text that follows it), and the remaining tokens are fingerprinted in full
//! blocks of `--engine-block-size` with the server's hash scheme (§17). `stable_prefix_hash` is
//! the 8-byte big-endian rolling hash of the last full block: the same bytes a producer reports
//! for that block, so a gateway can look the prefix up (as `prefix_hash`) before it has the whole
//! prompt. It is empty when no model is named, when the stable prefix is shorter than one block,
//! and for a render whose output does not start with the stable prefix (a template that tests
//! `is defined` can take another branch for real variables than for the sentinels).
//!
//! Rendered prompts and variables are returned, never logged or stored.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::sync::Arc;

use inferencecache_index::fingerprint;
use inferencecache_proto::v1alpha1 as pb;
use minijinja::value::{Object, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::limits::{
    MAX_RENDERED_PROMPT_BYTES, MAX_TEMPLATE_BYTES, MAX_TEMPLATE_REVISION_BYTES, MAX_TEMPLATES,
    MAX_TEMPLATES_PER_TENANT, TEMPLATE_RENDER_FUEL,
};
use crate::tenant_registry::PutError;
use crate::tenant_registry::{Full, Lookup, TenantRegistry, check_name};

/// RenderTemplate reason codes (docs/BEHAVIOUR.md §11).
pub mod reason {
    /// Rendered (also the reference's stub answer when no template is registered at all).
    pub const OK: &str = "OK";
    /// No template `template_ref` is registered for `tenant_id` (while some template is).
    pub const TEMPLATE_NOT_FOUND: &str = "TEMPLATE_NOT_FOUND";
    /// The render failed: a template error, `raise_exception`, the work budget or the output
    /// bound.
    pub const RENDER_ERROR: &str = "RENDER_ERROR";
}

/// The `rpc` label of `inferencecache_rpc_calls_total`.
const RPC: &str = "RenderTemplate";

/// Name of the one template in each compiled environment.
const NAME: &str = "template";

/// The two sentinel values the stable prefix is computed with (Unicode private use area).
const SENTINELS: [&str; 2] = ["\u{E000}", "\u{E001}"];

/// One registered, compiled template revision.
pub struct Template {
    revision: String,
    model: String,
    source: String,
    env: Environment<'static>,
    stable_prefix: String,
    stable_prefix_hash: Vec<u8>,
    /// Tokens covered by `stable_prefix_hash` (full blocks).
    stable_prefix_tokens: usize,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template")
            .field("revision", &self.revision)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

/// The `PUT /templates/{tenant}/{ref}` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    /// The Jinja source.
    template: String,
    /// Opaque revision, echoed as `template_revision`.
    revision: String,
    /// Tokenizer model for `stable_prefix_hash` (optional).
    #[serde(default)]
    model: String,
}

/// One row of `GET /templates/{tenant}`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Listed<'a> {
    template_ref: &'a str,
    revision: &'a str,
    model: &'a str,
    stable_prefix_bytes: usize,
    stable_prefix_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    template: Option<&'a str>,
}

/// The registered templates, [`MAX_TEMPLATES_PER_TENANT`] per tenant and [`MAX_TEMPLATES`] in
/// all.
static REGISTRY: TenantRegistry<Template> =
    TenantRegistry::new(MAX_TEMPLATES_PER_TENANT, MAX_TEMPLATES);

/// Compiles and stores `tenant/reference` from a `PUT` body (replacing any earlier revision).
/// Runs on the admin thread: tokenizing the stable prefix is bounded by [`MAX_TEMPLATE_BYTES`].
pub fn put(tenant: &str, reference: &str, body: &[u8], block_size: i32) -> Result<(), PutError> {
    check_name("tenant", tenant)?;
    check_name("template ref", reference)?;
    let body: PutBody = serde_json::from_slice(body)
        .map_err(|e| PutError::Invalid(format!("decode template: {e}")))?;
    if body.template.len() > MAX_TEMPLATE_BYTES {
        crate::metrics::record_limit_hit("template_bytes");
        return Err(PutError::Invalid(format!(
            "template larger than {MAX_TEMPLATE_BYTES} bytes"
        )));
    }
    if body.revision.len() > MAX_TEMPLATE_REVISION_BYTES
        || body.model.len() > MAX_TEMPLATE_REVISION_BYTES
    {
        return Err(PutError::Invalid(format!(
            "revision and model are at most {MAX_TEMPLATE_REVISION_BYTES} bytes"
        )));
    }
    let template = compile(body, block_size).map_err(PutError::Invalid)?;
    REGISTRY
        .put(tenant, reference, template)
        .map_err(|full| match full {
            Full::Tenant(n) => {
                crate::metrics::record_limit_hit("templates_per_tenant");
                PutError::Full(format!("tenant already has {n} templates"))
            }
            Full::Total(n) => {
                crate::metrics::record_limit_hit("templates");
                PutError::Full(format!("{n} templates already registered"))
            }
        })
}

/// Removes `tenant/reference`; whether it existed.
pub fn delete(tenant: &str, reference: &str) -> bool {
    REGISTRY.delete(tenant, reference)
}

/// `GET /templates/{tenant}`: the tenant's templates (without sources) as a JSON array, sorted
/// by ref (`[]` when none).
pub fn list_json(tenant: &str) -> String {
    REGISTRY.with_tenant(tenant, |rows| {
        let rows: Vec<Listed> = rows.map(|(r, t)| listed(r, t, false)).collect();
        serde_json::to_string(&rows).unwrap_or_else(|_| "[]".into())
    })
}

/// `GET /templates/{tenant}/{ref}`: one template with its source, if registered.
pub fn get_json(tenant: &str, reference: &str) -> Option<String> {
    let t = REGISTRY.get(tenant, reference)?;
    serde_json::to_string(&listed(reference, &t, true)).ok()
}

fn listed<'a>(reference: &'a str, t: &'a Template, with_source: bool) -> Listed<'a> {
    Listed {
        template_ref: reference,
        revision: &t.revision,
        model: &t.model,
        stable_prefix_bytes: t.stable_prefix.len(),
        stable_prefix_tokens: t.stable_prefix_tokens,
        template: with_source.then_some(t.source.as_str()),
    }
}

fn compile(body: PutBody, block_size: i32) -> Result<Template, String> {
    let mut env = crate::tokenizer::hf_environment()?;
    env.set_fuel(Some(TEMPLATE_RENDER_FUEL));
    env.add_template_owned(NAME, body.template.clone())
        .map_err(|e| format!("template: {}", describe(&e)))?;
    let stable_prefix = stable_prefix(&env);
    let (stable_prefix_hash, stable_prefix_tokens) =
        prefix_fingerprint(&body.model, &stable_prefix, block_size)?;
    Ok(Template {
        revision: body.revision,
        model: body.model,
        source: body.template,
        env,
        stable_prefix,
        stable_prefix_hash,
        stable_prefix_tokens,
    })
}

/// A context in which every variable (but the environment's globals) is `sentinel`.
#[derive(Debug)]
struct Probe {
    sentinel: &'static str,
    globals: HashSet<String>,
}

impl Object for Probe {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        (!self.globals.contains(key)).then(|| Value::from(self.sentinel))
    }
}

/// The text every render of the compiled template starts with (see the module comment).
fn stable_prefix(env: &Environment<'static>) -> String {
    let globals: HashSet<String> = env.globals().map(|(k, _)| k.to_string()).collect();
    let renders: Vec<Option<String>> = SENTINELS
        .iter()
        .map(|s| {
            let ctx = Value::from_object(Probe {
                sentinel: s,
                globals: globals.clone(),
            });
            render_bounded(env, ctx).ok()
        })
        .collect();
    match (&renders[0], &renders[1]) {
        (Some(a), Some(b)) => common_prefix(a, b).to_string(),
        _ => String::new(),
    }
}

/// The longest common prefix of `a` and `b`, cut back to a character boundary of `a`.
fn common_prefix<'a>(a: &'a str, b: &str) -> &'a str {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(n) {
        n -= 1;
    }
    &a[..n]
}

/// `stable_prefix_hash` and the tokens it covers (see the module comment).
fn prefix_fingerprint(
    model: &str,
    prefix: &str,
    block_size: i32,
) -> Result<(Vec<u8>, usize), String> {
    if model.is_empty() || prefix.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let mut tokens = crate::tokenizer::global()
        .encode_text_here(model, prefix)
        .map_err(|e| format!("tokenize the stable prefix with model {model:?}: {e}"))?;
    tokens.pop();
    let hashes = fingerprint::prefix_hashes(&tokens, block_size, None);
    Ok(match hashes.last() {
        Some(h) => (
            h.to_be_bytes().to_vec(),
            hashes.len() * block_size.max(0) as usize,
        ),
        None => (Vec::new(), 0),
    })
}

/// Why a render failed; no variant carries rendered text or variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RenderFailure {
    /// The work budget ran out.
    Fuel,
    /// The output passed [`MAX_RENDERED_PROMPT_BYTES`].
    Output,
    /// Any other template error.
    Template,
}

/// An `io::Write` that refuses to grow past [`MAX_RENDERED_PROMPT_BYTES`].
struct Bounded<'a> {
    buf: &'a mut Vec<u8>,
    over: &'a mut bool,
}

impl io::Write for Bounded<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        if self.buf.len() + b.len() > MAX_RENDERED_PROMPT_BYTES {
            *self.over = true;
            return Err(io::Error::other("rendered prompt too large"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn render_bounded(env: &Environment<'static>, ctx: Value) -> Result<String, RenderFailure> {
    let tmpl = env
        .get_template(NAME)
        .map_err(|_| RenderFailure::Template)?;
    let mut buf = Vec::new();
    let mut over = false;
    let out = tmpl.render_captured_to(
        ctx,
        Bounded {
            buf: &mut buf,
            over: &mut over,
        },
    );
    match out {
        Ok(_) => String::from_utf8(buf).map_err(|_| RenderFailure::Template),
        Err(_) if over => Err(RenderFailure::Output),
        Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(RenderFailure::Fuel),
        Err(_) => Err(RenderFailure::Template),
    }
}

/// A short, value-free description of a compile error (kind and line).
fn describe(e: &minijinja::Error) -> String {
    match e.line() {
        Some(line) => format!("{} (line {line})", e.kind()),
        None => e.kind().to_string(),
    }
}

/// Answers one RenderTemplate call; never fails. With no template registered at all the answer
/// is the reference's stub (`{reason_code: "OK"}`, every other field empty).
/// The stub records no metric, like the reference.
pub fn render(req: pb::RenderTemplateRequest) -> pb::RenderTemplateResponse {
    match render_inner(req) {
        Some((resp, code)) => {
            crate::metrics::record_rpc(RPC, code);
            resp
        }
        None => pb::RenderTemplateResponse {
            reason_code: reason::OK.into(),
            ..Default::default()
        },
    }
}

/// `None` = no template registered at all (the reference's stub).
fn render_inner(
    req: pb::RenderTemplateRequest,
) -> Option<(pb::RenderTemplateResponse, &'static str)> {
    let t = match REGISTRY.find(&req.tenant_id, &req.template_ref) {
        Lookup::NothingRegistered => return None,
        Lookup::Found(t) => t,
        Lookup::Missing => {
            let resp = pb::RenderTemplateResponse {
                reason_code: reason::TEMPLATE_NOT_FOUND.into(),
                tenant_namespace: req.tenant_id.into_bytes(),
                ..Default::default()
            };
            return Some((resp, reason::TEMPLATE_NOT_FOUND));
        }
    };
    Some(answer(&t, req.tenant_id, req.variables))
}

/// Renders `t` for `tenant` with `variables` (the registered-template answer).
fn answer(
    t: &Template,
    tenant: String,
    variables: HashMap<String, String>,
) -> (pb::RenderTemplateResponse, &'static str) {
    let vars: BTreeMap<String, String> = variables.into_iter().collect();
    match render_bounded(&t.env, Value::from(vars)) {
        Ok(text) => {
            let stable_prefix_hash = if text.starts_with(&t.stable_prefix) {
                t.stable_prefix_hash.clone()
            } else {
                Vec::new()
            };
            let resp = pb::RenderTemplateResponse {
                rendered_prompt: text.into_bytes(),
                stable_prefix_hash,
                tenant_namespace: tenant.into_bytes(),
                reason_code: reason::OK.into(),
                template_revision: t.revision.clone(),
            };
            (resp, reason::OK)
        }
        Err(why) => {
            match why {
                RenderFailure::Fuel => crate::metrics::record_limit_hit("template_render_fuel"),
                RenderFailure::Output => {
                    crate::metrics::record_limit_hit("template_rendered_bytes")
                }
                RenderFailure::Template => {}
            }
            let resp = pb::RenderTemplateResponse {
                tenant_namespace: tenant.into_bytes(),
                reason_code: reason::RENDER_ERROR.into(),
                template_revision: t.revision.clone(),
                ..Default::default()
            };
            (resp, reason::RENDER_ERROR)
        }
    }
}

#[cfg(test)]
mod tests;
