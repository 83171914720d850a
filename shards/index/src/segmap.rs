//! A hash map kept in [`SEGMENTS`] maps chosen by the key's hash, for the run store's side
//! tables of per-entry values (LFU counts, odd token counts), which grow with the entries.
//!
//! One hash map grows by rehashing every entry in one step: a side table of millions of entries
//! would stall its core for tens of milliseconds at a growth, in the middle of an ingest or an
//! event. In segments, a growth rehashes one segment: at most 1/[`SEGMENTS`] of the entries
//! (~0.2 ms at 10M entries). Empty segments allocate nothing.

use hashbrown::HashMap;

/// Segments of a [`SegMap`]: a fixed ~40 KiB of empty maps per map.
pub const SEGMENTS: usize = 1024;
const SEGMENT_BITS: u32 = SEGMENTS.trailing_zeros();
const _: () = assert!(SEGMENTS.is_power_of_two());

/// A map from (place, replica) to `V`, in segments (see the module docs).
pub struct SegMap<V> {
    segments: Vec<HashMap<(u64, u32), V>>,
    len: usize,
}

impl<V> Default for SegMap<V> {
    fn default() -> Self {
        SegMap {
            segments: (0..SEGMENTS).map(|_| HashMap::new()).collect(),
            len: 0,
        }
    }
}

impl<V> SegMap<V> {
    /// The segment of `key`: the top bits of a multiplicative mix of both halves.
    #[inline(always)]
    fn segment(key: &(u64, u32)) -> usize {
        let mixed = (key.0 ^ u64::from(key.1).rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (mixed >> (64 - SEGMENT_BITS)) as usize
    }

    #[inline]
    pub fn get(&self, key: &(u64, u32)) -> Option<&V> {
        self.segments[Self::segment(key)].get(key)
    }

    #[inline]
    pub fn insert(&mut self, key: (u64, u32), value: V) -> Option<V> {
        let old = self.segments[Self::segment(&key)].insert(key, value);
        self.len += usize::from(old.is_none());
        old
    }

    #[inline]
    pub fn remove(&mut self, key: &(u64, u32)) -> Option<V> {
        let old = self.segments[Self::segment(key)].remove(key);
        self.len -= usize::from(old.is_some());
        old
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Every key, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &(u64, u32)> {
        self.segments.iter().flat_map(HashMap::keys)
    }

    /// Heap bytes: the segments' tables (a control byte per bucket) and the segment records.
    pub fn heap_bytes(&self) -> usize {
        let bucket = std::mem::size_of::<((u64, u32), V)>() + 1;
        let tables: usize = self.segments.iter().map(|s| s.capacity() * bucket).sum();
        tables + self.segments.capacity() * std::mem::size_of::<HashMap<(u64, u32), V>>()
    }

    /// The most entries one segment holds (what one growth rehashes, at most twice that).
    #[cfg(test)]
    fn largest_segment(&self) -> usize {
        self.segments.iter().map(HashMap::len).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys of one run's consecutive places and a few replicas spread over the segments: no
    /// segment holds more than a few times its share, so no growth rehashes more than that.
    #[test]
    fn a_runs_places_spread_over_the_segments() {
        let mut m = SegMap::default();
        let n = 200_000u64;
        for off in 0..n {
            let place = 7u64 << 32 | off;
            assert_eq!(m.insert((place, (off % 3) as u32), off), None);
        }
        assert_eq!(m.len(), n as usize);
        let share = n as usize / SEGMENTS;
        assert!(m.largest_segment() < 2 * share, "{}", m.largest_segment());
        assert_eq!(m.get(&(7 << 32 | 5, 2)), Some(&5));
        assert_eq!(m.remove(&(7 << 32 | 5, 2)), Some(5));
        assert_eq!(m.remove(&(7 << 32 | 5, 2)), None);
        assert_eq!(
            (m.len(), m.keys().count()),
            (n as usize - 1, n as usize - 1)
        );
    }
}
