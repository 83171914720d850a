//! A bounded per-tenant registry of named, immutable objects: what the controller-facing
//! listener registers with `PUT /{kind}/{tenant}/{ref}` and the serving cores read. RenderTemplate
//! keeps its compiled templates in one (`templates/`), LookupPDRoute its prefill/decode
//! topologies in another (`pd/`); this module sits below both.
//!
//! Written only by the admin thread (registration, deletion); a reader takes the read lock just
//! long enough to clone one `Arc`. Bounded per tenant and in total (the caller's limits from
//! [`crate::limits`]); a refusal says which bound was hit so the caller can count it. Never
//! touched by LookupRoute.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::limits::MAX_ID_BYTES;

/// Objects by tenant, then by reference (both sorted, so listings are in reference order).
type ByTenant<T> = BTreeMap<String, BTreeMap<String, Arc<T>>>;

struct Inner<T> {
    by_tenant: ByTenant<T>,
    count: usize,
}

/// See the module docs. `const`-constructible, so it can be a `static`.
pub struct TenantRegistry<T> {
    inner: RwLock<Inner<T>>,
    max_per_tenant: usize,
    max_total: usize,
}

/// Why a registration was refused; the admin listener answers 400 or 409.
#[derive(Debug, PartialEq, Eq)]
pub enum PutError {
    /// Malformed body or names, oversize input, an object that does not compile: 400.
    Invalid(String),
    /// A bound of the registry was reached: 409.
    Full(String),
}

/// Which bound refused a new registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// The tenant already has `max_per_tenant` objects.
    Tenant(usize),
    /// The registry already holds `max_total` objects.
    Total(usize),
}

/// The answer of [`TenantRegistry::find`].
pub enum Lookup<T> {
    /// Nothing is registered at all, for any tenant (the callers answer the reference's stub).
    NothingRegistered,
    /// Something is registered, but not this `(tenant, reference)`.
    Missing,
    /// The object.
    Found(Arc<T>),
}

impl<T> TenantRegistry<T> {
    /// An empty registry with its two bounds.
    pub const fn new(max_per_tenant: usize, max_total: usize) -> Self {
        TenantRegistry {
            inner: RwLock::new(Inner {
                by_tenant: BTreeMap::new(),
                count: 0,
            }),
            max_per_tenant,
            max_total,
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner<T>> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner<T>> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `value` as `tenant/reference`, replacing an earlier one (a replacement is never
    /// refused); a new one is refused past either bound.
    pub fn put(&self, tenant: &str, reference: &str, value: T) -> Result<(), Full> {
        let mut reg = self.write();
        let in_tenant = reg.by_tenant.get(tenant);
        let replaces = in_tenant.is_some_and(|t| t.contains_key(reference));
        if !replaces {
            if in_tenant.map_or(0, BTreeMap::len) >= self.max_per_tenant {
                return Err(Full::Tenant(self.max_per_tenant));
            }
            if reg.count >= self.max_total {
                return Err(Full::Total(self.max_total));
            }
            reg.count += 1;
        }
        reg.by_tenant
            .entry(tenant.to_string())
            .or_default()
            .insert(reference.to_string(), Arc::new(value));
        Ok(())
    }

    /// Removes `tenant/reference`; whether it existed.
    pub fn delete(&self, tenant: &str, reference: &str) -> bool {
        let mut reg = self.write();
        let Some(t) = reg.by_tenant.get_mut(tenant) else {
            return false;
        };
        let removed = t.remove(reference).is_some();
        if t.is_empty() {
            reg.by_tenant.remove(tenant);
        }
        if removed {
            reg.count -= 1;
        }
        removed
    }

    /// `tenant/reference`, telling an empty registry apart from a missing object (one read
    /// lock, one `Arc` clone).
    pub fn find(&self, tenant: &str, reference: &str) -> Lookup<T> {
        let reg = self.read();
        if reg.count == 0 {
            return Lookup::NothingRegistered;
        }
        match reg.by_tenant.get(tenant).and_then(|t| t.get(reference)) {
            Some(v) => Lookup::Found(v.clone()),
            None => Lookup::Missing,
        }
    }

    /// `tenant/reference`, if registered.
    pub fn get(&self, tenant: &str, reference: &str) -> Option<Arc<T>> {
        match self.find(tenant, reference) {
            Lookup::Found(v) => Some(v),
            Lookup::NothingRegistered | Lookup::Missing => None,
        }
    }

    /// Runs `f` over the tenant's objects in reference order (none when it has none), under the
    /// read lock.
    pub fn with_tenant<R>(
        &self,
        tenant: &str,
        f: impl FnOnce(&mut dyn Iterator<Item = (&str, &T)>) -> R,
    ) -> R {
        let reg = self.read();
        let mut rows = reg
            .by_tenant
            .get(tenant)
            .into_iter()
            .flatten()
            .map(|(r, v)| (r.as_str(), &**v));
        f(&mut rows)
    }

    /// Objects registered, all tenants.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.read().count
    }

    /// Whether nothing is registered.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks a tenant, reference or replica name: 1 to [`MAX_ID_BYTES`] bytes.
pub fn check_name(what: &str, name: &str) -> Result<(), PutError> {
    if name.is_empty() || name.len() > MAX_ID_BYTES {
        return Err(PutError::Invalid(format!(
            "{what} must be 1 to {MAX_ID_BYTES} bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(r: &TenantRegistry<u32>, t: &str, k: &str) -> Option<Option<u32>> {
        match r.find(t, k) {
            Lookup::NothingRegistered => None,
            Lookup::Missing => Some(None),
            Lookup::Found(v) => Some(Some(*v)),
        }
    }

    #[test]
    fn put_replace_delete_and_the_empty_registry() {
        let r = TenantRegistry::new(4, 8);
        assert_eq!(found(&r, "t", "a"), None, "nothing registered at all");
        r.put("t", "a", 1).unwrap();
        r.put("t", "a", 2).unwrap();
        assert_eq!(r.len(), 1, "a replacement is not a new object");
        assert_eq!(found(&r, "t", "a"), Some(Some(2)));
        assert_eq!(found(&r, "t", "b"), Some(None));
        assert_eq!(found(&r, "u", "a"), Some(None));
        assert_eq!(r.get("t", "a").as_deref(), Some(&2));
        r.put("t", "0", 0).unwrap();
        let listed: Vec<_> =
            r.with_tenant("t", |rows| rows.map(|(k, v)| (k.to_string(), *v)).collect());
        assert_eq!(listed, vec![("0".to_string(), 0), ("a".to_string(), 2)]);
        assert!(r.with_tenant("u", |rows| rows.next().is_none()));
        assert!(r.delete("t", "a"));
        assert!(!r.delete("t", "a"));
        assert!(!r.delete("u", "a"));
        assert!(r.delete("t", "0"));
        assert!(r.is_empty());
        assert_eq!(found(&r, "t", "a"), None, "empty again: the stub");
    }

    #[test]
    fn both_bounds_refuse_new_objects_but_not_replacements() {
        let r = TenantRegistry::new(2, 3);
        r.put("t", "a", 1).unwrap();
        r.put("t", "b", 1).unwrap();
        assert_eq!(r.put("t", "c", 1), Err(Full::Tenant(2)));
        r.put("t", "b", 2).unwrap();
        r.put("u", "a", 1).unwrap();
        assert_eq!(r.put("v", "a", 1), Err(Full::Total(3)));
        assert_eq!(r.len(), 3);
        assert!(r.delete("t", "a"));
        r.put("v", "a", 1).unwrap();
    }

    #[test]
    fn names_are_one_to_max_id_bytes() {
        assert!(check_name("tenant", "t").is_ok());
        assert!(check_name("tenant", "").is_err());
        assert!(check_name("tenant", &"x".repeat(MAX_ID_BYTES)).is_ok());
        let e = check_name("tenant", &"x".repeat(MAX_ID_BYTES + 1));
        assert!(
            matches!(&e, Err(PutError::Invalid(m)) if m.starts_with("tenant must be")),
            "{e:?}"
        );
    }
}
