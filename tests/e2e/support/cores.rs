//! Which core owns a `(tenant, model)` partition, with the server's documented partition function
//! (xxh3(model, seed = xxh3(tenant)) mod 256 mod cores), so scenarios can place data on each core.

/// Model ids whose `(tenant, model)` partitions are owned by each of `cores` cores, using the
/// server's documented partition function (xxh3(model, seed = xxh3(tenant)) mod 256 mod cores).
pub fn models_per_core(tenant: &str, cores: usize) -> Vec<String> {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let mut found: Vec<Option<String>> = vec![None; cores];
    for i in 0..10_000 {
        let m = format!("model-{i}");
        let p = xxh3_64_with_seed(m.as_bytes(), xxh3_64(tenant.as_bytes())) % 256;
        let c = (p as usize) % cores;
        if found[c].is_none() {
            found[c] = Some(m);
        }
        if found.iter().all(|f| f.is_some()) {
            break;
        }
    }
    found.into_iter().map(|f| f.unwrap()).collect()
}

/// The core owning `(tenant, model)` (same partition function as [`models_per_core`]).
pub fn core_of(tenant: &str, model: &str, cores: usize) -> usize {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let p = xxh3_64_with_seed(model.as_bytes(), xxh3_64(tenant.as_bytes())) % 256;
    (p as usize) % cores
}

/// Tenant ids (prefix `prefix`) whose `(tenant, model)` partitions land on each of `cores` cores.
pub fn tenants_per_core(prefix: &str, model: &str, cores: usize) -> Vec<String> {
    let mut found: Vec<Option<String>> = vec![None; cores];
    for i in 0..10_000 {
        let t = format!("{prefix}-{i}");
        let c = core_of(&t, model, cores);
        if found[c].is_none() {
            found[c] = Some(t);
        }
        if found.iter().all(|f| f.is_some()) {
            break;
        }
    }
    found.into_iter().map(|f| f.unwrap()).collect()
}
