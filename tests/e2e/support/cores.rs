//! Which core owns a `(tenant, model)`, through the server's own partition crate, so scenarios
//! can place data on each core.

use inferencecache_partition::owner;

/// Model ids whose `(tenant, model)` partitions are owned by each of `cores` cores.
pub fn models_per_core(tenant: &str, cores: usize) -> Vec<String> {
    first_per_core(cores, |i| format!("model-{i}"), |m| owner(tenant, m, cores))
}

/// The core owning `(tenant, model)` at `cores` cores.
pub fn core_of(tenant: &str, model: &str, cores: usize) -> usize {
    owner(tenant, model, cores)
}

/// Tenant ids (prefix `prefix`) whose `(tenant, model)` partitions land on each of `cores` cores.
pub fn tenants_per_core(prefix: &str, model: &str, cores: usize) -> Vec<String> {
    first_per_core(
        cores,
        |i| format!("{prefix}-{i}"),
        |t| owner(t, model, cores),
    )
}

/// The first name `name(i)` found on each core, trying at most 10,000 names.
fn first_per_core(
    cores: usize,
    name: impl Fn(usize) -> String,
    core: impl Fn(&str) -> usize,
) -> Vec<String> {
    let mut found: Vec<Option<String>> = vec![None; cores];
    for i in 0..10_000 {
        let n = name(i);
        let c = core(&n);
        if found[c].is_none() {
            found[c] = Some(n);
        }
        if found.iter().all(|f| f.is_some()) {
            break;
        }
    }
    found
        .into_iter()
        .map(|f| f.expect("10,000 names reach every core"))
        .collect()
}
