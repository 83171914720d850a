//! Per-tenant policy (docs/BEHAVIOUR.md §12): the `/policy` wire body the controller pushes, its
//! per-version normalisation, and the immutable [`PolicyStore`] the server swaps atomically on
//! every push and hands to each core as an `Arc`.
//!
//! Everything here is pure: the HTTP layer owns the listener, auth and the 1 MiB body limit and
//! calls [`parse_policy_body`]; the handlers call [`PolicyStore::resolve`] once per request.
//!
//! Decoding follows Go's `encoding/json` as used by the reference server, because clients
//! depend on which bodies are accepted: unknown keys are rejected at every level, integers must
//! be integer literals in range, keys match case-insensitively (exact match preferred), `null`
//! behaves like an absent key, duplicate keys keep the last value, and only the first JSON value
//! of the body is read. Known divergences (irrelevant to the real controller, which always
//! sends exact-case, duplicate-free keys): with duplicate keys that differ only in case the
//! winner is not guaranteed to be the last one in document order, `-0` is rejected where an
//! integer is expected, and invalid UTF-8 inside a string is an error (Go substitutes U+FFFD).

use std::collections::HashMap;
use std::fmt;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::PROBE_TENANT;
use crate::rules::{Eviction, TenantRules};

/// Largest `/policy` body the HTTP layer reads (Go's `MaxBytesReader` limit); a JSON value that
/// does not end within this many bytes is a decode error.
pub const MAX_POLICY_BODY_BYTES: usize = 1 << 20;

/// Oldest snapshot version the server still accepts (older bodies are normalised, §12.3).
pub const MIN_POLICY_VERSION: i64 = 3;

/// The version the current controller sends; v7 bodies are stored exactly as written.
pub const CURRENT_POLICY_VERSION: i64 = 7;

/// Matched-tokens floor for a tenant with **no** installed policy (an installed policy that
/// omits the field gets 0 — the §19.1 asymmetry).
pub const DEFAULT_MINIMUM_MATCHED_TOKENS: i32 = 64;

/// Top-score floor when no policy is installed or the policy omits the field.
pub const DEFAULT_ROUTING_FLOOR_SCORE: f32 = 0.1;

/// Chain matcher on unless a policy turns it off.
pub const DEFAULT_ENABLE_CHAIN_MATCHING: bool = true;

/// `POLICY_REQUIRES_CHAIN` gate off unless a policy turns it on.
pub const DEFAULT_REQUIRE_CHAIN: bool = false;

/// `TENANT_HOT` allowed unless a policy forbids it.
pub const DEFAULT_ENABLE_TENANT_HOT: bool = true;

/// Consistent-hash affinity fallback on unless a policy disables it.
pub const DEFAULT_AFFINITY_ROUTING: bool = true;

/// Why a `/policy` body was refused. `Display` renders the exact text the HTTP layer sends with
/// status 400 (it appends the trailing `\n` itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// Malformed JSON, unknown key, wrong type, out-of-range number or over-size body.
    Decode(String),
    /// `version` outside [`MIN_POLICY_VERSION`]..=[`CURRENT_POLICY_VERSION`] (missing = 0).
    UnsupportedVersion,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::Decode(err) => write!(f, "decode policy snapshot: {err}"),
            PolicyError::UnsupportedVersion => f.write_str("unsupported policy snapshot version"),
        }
    }
}

impl std::error::Error for PolicyError {}

/// The `/policy` body (controller wire shape, §12.3). Field types mirror the Go struct so that
/// exactly the same bodies decode; pointer fields are `Option` so "absent" and an explicit zero
/// stay distinguishable through normalisation and resolution.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySnapshot {
    /// Wire version; a missing key decodes as 0 and is then refused as unsupported.
    #[serde(default)]
    pub version: i64,
    /// One entry per namespace (the tenant string the traffic carries). Always emitted, as
    /// `[]` when empty, so consumers never have to handle `null`.
    #[serde(default)]
    pub policies: Vec<PolicySpec>,
    /// Quota-bearing tenants; omitted from the wire when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantSpec>,
}

/// One namespace's CachePolicy as flattened by the controller. Zero/empty scalars are omitted on
/// the wire, so "absent" and "zero" are the same thing for them; the `Option` members are Go
/// pointers where an explicit value (including 0 / false) must survive.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// The namespace (= tenant id of the traffic); empty entries are dropped by the store.
    #[serde(default)]
    pub namespace: String,
    /// Per-tenant TTL in nanoseconds; `<= 0` means the index default (30 min).
    #[serde(default, rename = "evictionTTL", skip_serializing_if = "is_zero_i64")]
    pub eviction_ttl_ns: i64,
    /// Request-side gate on effective prefix tokens; `<= 0` = off.
    #[serde(
        default,
        rename = "minimumPrefixTokens",
        skip_serializing_if = "is_zero_i32"
    )]
    pub minimum_prefix_tokens: i32,
    /// Result-side per-replica matched-tokens floor; 0 = off (no v7 normalisation to 64).
    #[serde(
        default,
        rename = "minimumMatchedTokens",
        skip_serializing_if = "is_zero_i32"
    )]
    pub minimum_matched_tokens: i32,
    /// Top-score floor; `None` resolves to 0.1, an explicit 0 turns the floor off.
    #[serde(
        default,
        rename = "routingFloorScore",
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_opt_f32",
        serialize_with = "ser_opt_f32"
    )]
    pub routing_floor_score: Option<f32>,
    /// Lookup budget in milliseconds; `<= 0` = no deadline (never "instant").
    #[serde(
        default,
        rename = "lookupTimeoutMs",
        skip_serializing_if = "is_zero_i32"
    )]
    pub lookup_timeout_ms: i32,
    /// Affinity fallback switch; `None` = enabled.
    #[serde(
        default,
        rename = "affinityRouting",
        skip_serializing_if = "Option::is_none"
    )]
    pub affinity_routing: Option<bool>,
    /// `"lfu"` (any case) selects LFU; anything else, including empty, is LRU.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub eviction: String,
    /// Strategy switches; `None` (and each `None` member) take the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<StrategySpec>,
}

/// `spec.strategy` of a CachePolicy; every member is a Go `*bool`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StrategySpec {
    /// Chain matcher on/off; `None` = on.
    #[serde(
        default,
        rename = "enableChainMatching",
        skip_serializing_if = "Option::is_none"
    )]
    pub enable_chain_matching: Option<bool>,
    /// `POLICY_REQUIRES_CHAIN` gate; `None` = off.
    #[serde(
        default,
        rename = "requireChain",
        skip_serializing_if = "Option::is_none"
    )]
    pub require_chain: Option<bool>,
    /// `TENANT_HOT` allowed; `None` = allowed.
    #[serde(
        default,
        rename = "enableTenantHot",
        skip_serializing_if = "Option::is_none"
    )]
    pub enable_tenant_hot: Option<bool>,
}

/// One CacheTenant quota row (§12.2). The controller only sends quota-bearing tenants.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// The tenant string carried by traffic; empty rows are dropped by the store.
    #[serde(default, rename = "tenantID")]
    pub tenant_id: String,
    /// Distinct-prefix-key budget; always present on the wire, negative clamps to 0.
    #[serde(default, rename = "maxIndexEntries")]
    pub max_index_entries: i64,
    /// Carried but unused (only `Fairness` exists).
    #[serde(
        default,
        rename = "isolationMode",
        skip_serializing_if = "String::is_empty"
    )]
    pub isolation_mode: String,
}

fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}

fn is_zero_i32(v: &i32) -> bool {
    *v == 0
}

/// Go decodes a float32 with `ParseFloat(s, 32)`: a finite literal beyond the float32 range is
/// an error rather than a silent infinity.
fn de_opt_f32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
    match Option::<f64>::deserialize(d)? {
        None => Ok(None),
        Some(v) => {
            let narrowed = v as f32;
            if narrowed.is_finite() {
                Ok(Some(narrowed))
            } else {
                Err(D::Error::custom(format!("number {v} overflows float32")))
            }
        }
    }
}

/// Emits the float exactly as Go's `encoding/json` renders a float32 (`0`, `5`, `0.1`,
/// `0.000001`, `1e-7`), which the default serde_json float format does not.
fn ser_opt_f32<S: Serializer>(v: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::Error as _;
    match v {
        None => s.serialize_none(),
        Some(f) => {
            let text = go_json_f32(*f)
                .ok_or_else(|| S::Error::custom(format!("json: unsupported value: {f}")))?;
            let raw = serde_json::value::RawValue::from_string(text).map_err(S::Error::custom)?;
            raw.serialize(s)
        }
    }
}

/// Go's `encoding/json` text for a float32: shortest round-trip digits, plain decimal notation
/// for `1e-6 <= |v| < 1e21`, exponent notation otherwise (with `e-07` shortened to `e-7`).
/// `None` for NaN/±Inf, which Go refuses to encode.
pub fn go_json_f32(v: f32) -> Option<String> {
    if !v.is_finite() {
        return None;
    }
    if v == 0.0 {
        return Some(if v.is_sign_negative() { "-0" } else { "0" }.to_string());
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e')?;
    let exp: i32 = exp.parse().ok()?;
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::with_capacity(digits.len() + 8);
    if negative {
        out.push('-');
    }
    let abs = v.abs();
    if !(1e-6..1e21).contains(&abs) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        if exp < 0 {
            out.push('-');
            // Go prints at least two exponent digits, then json drops the 0 of "e-0X".
            out.push_str(&(-exp).to_string());
        } else {
            out.push('+');
            out.push_str(&format!("{exp:02}"));
        }
    } else {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(&digits);
        } else if point as usize >= digits.len() {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point as usize - digits.len()));
        } else {
            out.push_str(&digits[..point as usize]);
            out.push('.');
            out.push_str(&digits[point as usize..]);
        }
    }
    Some(out)
}

/// Which struct a JSON object is decoded into, so keys can be canonicalised per level.
#[derive(Clone, Copy, Debug)]
enum Level {
    Snapshot,
    Policy,
    Strategy,
    Tenant,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Snapshot => "a policy snapshot",
            Level::Policy => "a policy",
            Level::Strategy => "a strategy",
            Level::Tenant => "a tenant",
        }
    }

    fn fields(self) -> &'static [&'static str] {
        match self {
            Level::Snapshot => &["version", "policies", "tenants"],
            Level::Policy => &[
                "namespace",
                "evictionTTL",
                "minimumPrefixTokens",
                "minimumMatchedTokens",
                "routingFloorScore",
                "lookupTimeoutMs",
                "affinityRouting",
                "eviction",
                "strategy",
            ],
            Level::Strategy => &["enableChainMatching", "requireChain", "enableTenantHot"],
            Level::Tenant => &["tenantID", "maxIndexEntries", "isolationMode"],
        }
    }
}

/// A JSON value of kind `found` where an object of `expected` must be; reported in serde's words
/// (it becomes a [`PolicyError::Decode`]).
#[derive(Debug)]
struct NotAnObject {
    found: &'static str,
    expected: Level,
}

impl fmt::Display for NotAnObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid type: {}, expected {} object",
            self.found,
            self.expected.name()
        )
    }
}

impl std::error::Error for NotAnObject {}

/// Rewrites a decoded JSON tree into what Go's decoder would have seen through serde's stricter
/// lens: keys matched case-insensitively onto the field names, `null` members removed (Go leaves
/// the field untouched), `null` array elements turned into empty objects (Go zero values).
/// Unknown keys are kept so `deny_unknown_fields` still rejects them. A non-object where a struct
/// is expected is an error here, because serde would otherwise accept an array positionally.
fn canonicalise(value: Value, level: Level) -> Result<Value, NotAnObject> {
    let map = match value {
        Value::Object(map) => map,
        // `null` decodes as "nothing set" in Go.
        Value::Null => return Ok(Value::Object(Map::new())),
        other => {
            return Err(NotAnObject {
                found: json_kind(&other),
                expected: level,
            });
        }
    };
    let fields = level.fields();
    let mut out = Map::with_capacity(map.len());
    for (key, v) in map {
        if v.is_null() {
            continue;
        }
        let name = fields
            .iter()
            .find(|f| **f == key)
            .or_else(|| {
                fields
                    .iter()
                    .find(|f| f.to_lowercase() == key.to_lowercase())
            })
            .map(|f| (*f).to_string())
            .unwrap_or(key);
        let v = match (level, name.as_str()) {
            (Level::Snapshot, "policies") => canonicalise_array(v, Level::Policy)?,
            (Level::Snapshot, "tenants") => canonicalise_array(v, Level::Tenant)?,
            (Level::Policy, "strategy") => canonicalise(v, Level::Strategy)?,
            _ => v,
        };
        out.insert(name, v);
    }
    Ok(Value::Object(out))
}

fn canonicalise_array(value: Value, level: Level) -> Result<Value, NotAnObject> {
    match value {
        Value::Array(items) => Ok(Value::Array(
            items
                .into_iter()
                .map(|v| canonicalise(v, level))
                .collect::<Result<_, _>>()?,
        )),
        // Not an array: serde reports the type error with the field's expectation.
        other => Ok(other),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Decodes the first JSON value of a `/policy` body (trailing bytes are ignored, as Go's
/// `Decoder.Decode` does) without checking the version or normalising. A body longer than
/// [`MAX_POLICY_BODY_BYTES`] is decoded from its first MiB only; if the value does not end there
/// the error is Go's `http: request body too large`.
pub fn decode_snapshot(body: &[u8]) -> Result<PolicySnapshot, PolicyError> {
    let truncated = body.len() > MAX_POLICY_BODY_BYTES;
    let window = &body[..body.len().min(MAX_POLICY_BODY_BYTES)];
    let mut de = serde_json::Deserializer::from_slice(window);
    let value = match Value::deserialize(&mut de) {
        Ok(v) => v,
        Err(e) if truncated && e.is_eof() => {
            return Err(PolicyError::Decode(
                "http: request body too large".to_string(),
            ));
        }
        Err(e) => return Err(PolicyError::Decode(e.to_string())),
    };
    let value =
        canonicalise(value, Level::Snapshot).map_err(|e| PolicyError::Decode(e.to_string()))?;
    serde_json::from_value(value).map_err(|e| PolicyError::Decode(e.to_string()))
}

/// The whole server-side `/policy` pipeline: decode, version check, normalisation, store build.
/// On `Err`, the HTTP layer answers 400 with `format!("{err}\n")`; on `Ok` it swaps the store in
/// and answers 204.
pub fn parse_policy_body(body: &[u8]) -> Result<PolicyStore, PolicyError> {
    PolicyStore::from_snapshot(decode_snapshot(body)?)
}

impl PolicySnapshot {
    /// Whether the server accepts this body's version.
    pub fn version_supported(&self) -> bool {
        (MIN_POLICY_VERSION..=CURRENT_POLICY_VERSION).contains(&self.version)
    }

    /// Upgrades older bodies in place to v7 meaning (§12.3); v7 bodies are left untouched, and
    /// an unsupported version is left alone too (it is refused before this matters).
    pub fn normalise(&mut self) {
        let v = self.version;
        for p in &mut self.policies {
            if v < 4 && p.minimum_matched_tokens == 0 {
                p.minimum_matched_tokens = DEFAULT_MINIMUM_MATCHED_TOKENS;
            }
            if v < 5 && p.routing_floor_score.is_none() {
                p.routing_floor_score = Some(DEFAULT_ROUTING_FLOOR_SCORE);
            }
            if v < 6 {
                let s = p.strategy.get_or_insert_with(StrategySpec::default);
                s.enable_chain_matching
                    .get_or_insert(DEFAULT_ENABLE_CHAIN_MATCHING);
                s.require_chain.get_or_insert(DEFAULT_REQUIRE_CHAIN);
                s.enable_tenant_hot.get_or_insert(DEFAULT_ENABLE_TENANT_HOT);
            }
            if v < 7 && p.affinity_routing.is_none() {
                p.affinity_routing = Some(DEFAULT_AFFINITY_ROUTING);
            }
        }
    }

    /// The body exactly as the controller would send it (C145 shape). Fails only for a NaN or
    /// infinite `routingFloorScore` set by hand, which Go's encoder refuses too.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(self)
    }
}

/// Everything a request handler needs from a tenant's policy, already resolved through the
/// §12.4 table so the hot path does one map probe and a copy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResolvedPolicy {
    /// TTL in nanoseconds; 0 = index default (30 min). Never negative.
    pub ttl_ns: i64,
    /// Cap-victim order and whether delivered lookups credit LFU counters.
    pub eviction: Eviction,
    /// Request-side gate; 0 = off. Never negative.
    pub minimum_prefix_tokens: i32,
    /// Result-side per-replica floor (inclusive); 0 = off. 64 without a policy. Never negative.
    pub minimum_matched_tokens: i32,
    /// Top-score floor; 0 = off. 0.1 without a policy or field. Never negative.
    pub routing_floor_score: f32,
    /// Lookup budget in milliseconds; 0 = no deadline.
    pub lookup_timeout_ms: u32,
    /// Chain matcher on.
    pub enable_chain_matching: bool,
    /// `POLICY_REQUIRES_CHAIN` gate on.
    pub require_chain: bool,
    /// `TENANT_HOT` allowed.
    pub enable_tenant_hot: bool,
    /// Consistent-hash affinity fallback on.
    pub affinity_routing: bool,
}

impl ResolvedPolicy {
    /// What a tenant without an installed policy gets (first column of the §12.4 table).
    pub const NO_POLICY: ResolvedPolicy = ResolvedPolicy {
        ttl_ns: 0,
        eviction: Eviction::Lru,
        minimum_prefix_tokens: 0,
        minimum_matched_tokens: DEFAULT_MINIMUM_MATCHED_TOKENS,
        routing_floor_score: DEFAULT_ROUTING_FLOOR_SCORE,
        lookup_timeout_ms: 0,
        enable_chain_matching: DEFAULT_ENABLE_CHAIN_MATCHING,
        require_chain: DEFAULT_REQUIRE_CHAIN,
        enable_tenant_hot: DEFAULT_ENABLE_TENANT_HOT,
        affinity_routing: DEFAULT_AFFINITY_ROUTING,
    };

    /// Resolves one installed (already normalised) policy: absent pointers take defaults, plain
    /// zero ints are "off" — notably `minimumMatchedTokens` 0, not 64.
    pub fn from_spec(p: &PolicySpec) -> ResolvedPolicy {
        let strategy = p.strategy.unwrap_or_default();
        ResolvedPolicy {
            ttl_ns: p.eviction_ttl_ns.max(0),
            eviction: if p.eviction.eq_ignore_ascii_case("lfu") {
                Eviction::Lfu
            } else {
                Eviction::Lru
            },
            minimum_prefix_tokens: p.minimum_prefix_tokens.max(0),
            minimum_matched_tokens: p.minimum_matched_tokens.max(0),
            routing_floor_score: match p.routing_floor_score {
                None => DEFAULT_ROUTING_FLOOR_SCORE,
                Some(v) if v > 0.0 => v,
                // Explicit 0, negatives (and a NaN that cannot come off the wire) = off.
                Some(_) => 0.0,
            },
            lookup_timeout_ms: p.lookup_timeout_ms.max(0) as u32,
            enable_chain_matching: strategy
                .enable_chain_matching
                .unwrap_or(DEFAULT_ENABLE_CHAIN_MATCHING),
            require_chain: strategy.require_chain.unwrap_or(DEFAULT_REQUIRE_CHAIN),
            enable_tenant_hot: strategy
                .enable_tenant_hot
                .unwrap_or(DEFAULT_ENABLE_TENANT_HOT),
            affinity_routing: p.affinity_routing.unwrap_or(DEFAULT_AFFINITY_ROUTING),
        }
    }

    /// The lookup budget as a duration, `None` when the tenant has no deadline.
    pub fn lookup_budget(&self) -> Option<std::time::Duration> {
        (self.lookup_timeout_ms > 0)
            .then(|| std::time::Duration::from_millis(u64::from(self.lookup_timeout_ms)))
    }
}

impl Default for ResolvedPolicy {
    fn default() -> Self {
        ResolvedPolicy::NO_POLICY
    }
}

/// One installed policy: the normalised wire form (kept for introspection) and its resolution.
#[derive(Clone, Debug)]
struct Installed {
    spec: PolicySpec,
    resolved: ResolvedPolicy,
}

/// The server's complete policy state after one push: immutable, replaced as a whole on the
/// next push (policies and quotas together), shared read-only across cores.
#[derive(Clone, Debug, Default)]
pub struct PolicyStore {
    policies: HashMap<String, Installed>,
    quotas: HashMap<String, u64>,
}

impl PolicyStore {
    /// No policies and no quotas: what a freshly started server runs on until the first push.
    pub fn empty() -> PolicyStore {
        PolicyStore::default()
    }

    /// Checks the version, normalises and applies the store rules of §12.3: empty namespaces
    /// and tenant ids dropped, later duplicates win, negative budgets become 0, and the probe
    /// tenant never gets a quota.
    pub fn from_snapshot(mut snapshot: PolicySnapshot) -> Result<PolicyStore, PolicyError> {
        if !snapshot.version_supported() {
            return Err(PolicyError::UnsupportedVersion);
        }
        snapshot.normalise();
        let mut policies = HashMap::with_capacity(snapshot.policies.len());
        for spec in snapshot.policies {
            if spec.namespace.is_empty() {
                continue;
            }
            let resolved = ResolvedPolicy::from_spec(&spec);
            policies.insert(spec.namespace.clone(), Installed { spec, resolved });
        }
        let mut quotas = HashMap::with_capacity(snapshot.tenants.len());
        for t in snapshot.tenants {
            if t.tenant_id.is_empty() || t.tenant_id == PROBE_TENANT {
                continue;
            }
            quotas.insert(t.tenant_id, t.max_index_entries.max(0) as u64);
        }
        Ok(PolicyStore { policies, quotas })
    }

    /// The §12.4 resolution for `tenant` (the namespace key). One hash probe, none at all while
    /// no policy is installed.
    #[inline]
    pub fn resolve(&self, tenant: &str) -> ResolvedPolicy {
        if self.policies.is_empty() {
            return ResolvedPolicy::NO_POLICY;
        }
        self.policies
            .get(tenant)
            .map_or(ResolvedPolicy::NO_POLICY, |p| p.resolved)
    }

    /// The stored (normalised) policy of a namespace, for diagnostics and tests.
    pub fn policy(&self, namespace: &str) -> Option<&PolicySpec> {
        self.policies.get(namespace).map(|p| &p.spec)
    }

    /// The stored eviction string as pushed (`"lfu"`, `"lru"`, …); `""` when absent or when the
    /// namespace has no policy. Resolution to an algorithm is [`PolicyStore::resolve`]'s job.
    pub fn eviction_name(&self, namespace: &str) -> &str {
        self.policies
            .get(namespace)
            .map_or("", |p| p.spec.eviction.as_str())
    }

    /// The tenant's distinct-prefix-key budget; `None` = unbounded (always for the probe tenant).
    pub fn quota(&self, tenant: &str) -> Option<u64> {
        if self.quotas.is_empty() || tenant == PROBE_TENANT {
            return None;
        }
        self.quotas.get(tenant).copied()
    }

    /// Every quota, sorted by tenant id (stable output for logs and tests).
    pub fn quotas(&self) -> Vec<(&str, u64)> {
        let mut out: Vec<(&str, u64)> = self.quotas.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        out.sort_unstable_by(|a, b| a.0.cmp(b.0));
        out
    }

    /// Installed namespaces, sorted.
    pub fn namespaces(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self.policies.keys().map(String::as_str).collect();
        out.sort_unstable();
        out
    }

    /// Whether any policy or quota is installed.
    pub fn is_empty(&self) -> bool {
        self.policies.is_empty() && self.quotas.is_empty()
    }

    /// The store as a v7 body (normalised policies sorted by namespace, quotas sorted by tenant
    /// id): pushing it back yields an equivalent store.
    pub fn to_snapshot(&self) -> PolicySnapshot {
        let mut policies: Vec<PolicySpec> =
            self.policies.values().map(|p| p.spec.clone()).collect();
        policies.sort_unstable_by(|a, b| a.namespace.cmp(&b.namespace));
        PolicySnapshot {
            version: CURRENT_POLICY_VERSION,
            policies,
            tenants: self
                .quotas()
                .into_iter()
                .map(|(id, max)| TenantSpec {
                    tenant_id: id.to_string(),
                    max_index_entries: max.min(i64::MAX as u64) as i64,
                    isolation_mode: String::new(),
                })
                .collect(),
        }
    }
}

impl TenantRules for PolicyStore {
    fn ttl_ns(&self, tenant: &str) -> i64 {
        self.resolve(tenant).ttl_ns
    }

    fn eviction(&self, tenant: &str) -> Eviction {
        self.resolve(tenant).eviction
    }

    fn quota(&self, tenant: &str) -> Option<u64> {
        PolicyStore::quota(self, tenant)
    }
}
