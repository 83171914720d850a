//! A map from `u32` ids (interned names) whose values keep one slot of a vector while present,
//! so a caller that resolved an id once may reach its value again by slot, checked, without a
//! hashed lookup: a run of `PREFIX_EVICTED` events of one `(tenant, model, replica)` counts each
//! removed entry in the tenant's record, the replica's serving count and the model's gauge
//! count, and the event memo keeps their slots (`Index::on_entry_removed_at`).
//!
//! A slot names its id's value until the id is removed; a removed id's slot is reused by a later
//! insert, so a kept slot is always checked against its id ([`SlotMap::holds`]).

use hashbrown::HashMap;

/// An id's slot in a [`SlotMap`], or none.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// See the module docs.
pub(crate) struct SlotMap<V> {
    slot_of: HashMap<u32, u32>,
    /// `(id, value)`; a free slot holds `(NO_SLOT, None)`.
    slots: Vec<(u32, Option<V>)>,
    free: Vec<u32>,
}

impl<V> Default for SlotMap<V> {
    fn default() -> Self {
        SlotMap {
            slot_of: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<V> SlotMap<V> {
    /// Number of ids held.
    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    /// Whether no id is held.
    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    /// The value of `id`.
    #[inline]
    pub fn get(&self, id: &u32) -> Option<&V> {
        let s = *self.slot_of.get(id)?;
        self.slots[s as usize].1.as_ref()
    }

    /// The value of `id`, mutable.
    #[inline]
    pub fn get_mut(&mut self, id: &u32) -> Option<&mut V> {
        let s = *self.slot_of.get(id)?;
        self.slots[s as usize].1.as_mut()
    }

    /// Whether `id` is held.
    pub fn contains_key(&self, id: &u32) -> bool {
        self.slot_of.contains_key(id)
    }

    /// The slot of `id` ([`NO_SLOT`]: not held).
    #[inline]
    pub fn slot(&self, id: &u32) -> u32 {
        self.slot_of.get(id).copied().unwrap_or(NO_SLOT)
    }

    /// Whether `slot` holds `id`.
    #[inline(always)]
    pub fn holds(&self, slot: u32, id: u32) -> bool {
        matches!(self.slots.get(slot as usize), Some((held, Some(_))) if *held == id)
    }

    /// The value of `id`, found at `slot` when that slot holds it, else looked up by id.
    #[inline(always)]
    pub fn get_mut_hinted(&mut self, slot: u32, id: u32) -> Option<&mut V> {
        let s = if self.holds(slot, id) {
            slot
        } else {
            *self.slot_of.get(&id)?
        };
        self.slots[s as usize].1.as_mut()
    }

    /// Sets the value of `id`, returning its previous one.
    pub fn insert(&mut self, id: u32, v: V) -> Option<V> {
        debug_assert_ne!(id, NO_SLOT);
        if let Some(&s) = self.slot_of.get(&id) {
            return self.slots[s as usize].1.replace(v);
        }
        let s = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = (id, Some(v));
                s
            }
            None => {
                self.slots.push((id, Some(v)));
                (self.slots.len() - 1) as u32
            }
        };
        self.slot_of.insert(id, s);
        None
    }

    /// The value of `id`, inserted as `make()` if it is not held.
    pub fn get_or_insert_with(&mut self, id: u32, make: impl FnOnce() -> V) -> &mut V {
        let s = match self.slot_of.get(&id) {
            Some(&s) => s,
            None => {
                self.insert(id, make());
                self.slot_of[&id]
            }
        };
        self.slots[s as usize].1.as_mut().expect("held slot")
    }

    /// Removes `id`, returning its value; its slot is free for a later insert.
    pub fn remove(&mut self, id: &u32) -> Option<V> {
        let s = self.slot_of.remove(id)?;
        let (_, v) = std::mem::replace(&mut self.slots[s as usize], (NO_SLOT, None));
        self.free.push(s);
        v
    }

    /// Every `(id, value)`, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (&u32, &V)> {
        self.slots
            .iter()
            .filter_map(|(id, v)| v.as_ref().map(|v| (id, v)))
    }

    /// Every `(id, value)`, in slot order, the values mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&u32, &mut V)> {
        self.slots
            .iter_mut()
            .filter_map(|(id, v)| v.as_mut().map(|v| (&*id, v)))
    }
}

impl<V> std::ops::Index<&u32> for SlotMap<V> {
    type Output = V;
    fn index(&self, id: &u32) -> &V {
        self.get(id).expect("id held")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a HashMap model under churn: every answer agrees, a kept slot reaches its id's
    /// value while the id is held and never another id's value after its slot was reused.
    #[test]
    fn agrees_with_a_map_and_checks_kept_slots() {
        let mut m: SlotMap<u64> = SlotMap::default();
        let mut model: std::collections::HashMap<u32, u64> = Default::default();
        let mut kept: Vec<(u32, u32)> = Vec::new();
        let mut x = 7u64;
        for step in 0..20_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let id = (x >> 33) as u32 % 50;
            match (x >> 60) % 4 {
                0 | 1 => assert_eq!(m.insert(id, step), model.insert(id, step)),
                2 => assert_eq!(m.remove(&id), model.remove(&id)),
                _ => {
                    let s = m.slot(&id);
                    assert_eq!(s == NO_SLOT, !model.contains_key(&id));
                    if s != NO_SLOT {
                        kept.push((s, id));
                    }
                }
            }
            for &(s, id) in kept.iter().rev().take(8) {
                assert_eq!(m.holds(s, id), m.slot(&id) == s, "slot {s} of {id}");
                assert_eq!(m.get_mut_hinted(s, id).copied(), model.get(&id).copied());
            }
            assert_eq!(m.len(), model.len());
        }
        let mut got: Vec<(u32, u64)> = m.iter().map(|(k, v)| (*k, *v)).collect();
        got.sort_unstable();
        let mut want: Vec<(u32, u64)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(got, want);
    }
}
