//! A set of block ranges, for zeroed extents: zeroing a whole 100 GiB disk must cost one entry,
//! not 26 million.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent half-open ranges `[start, end)`, keyed by start.
#[derive(Debug, Default, Clone)]
pub struct RangeSet {
    ranges: BTreeMap<u64, u64>,
}

impl RangeSet {
    pub fn contains(&self, x: u64) -> bool {
        self.ranges.range(..=x).next_back().is_some_and(|(_, &end)| x < end)
    }

    pub fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        // Absorb a range that starts before and reaches `start`.
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
            }
        }
        // Absorb every range starting inside [start, end].
        let absorbed: Vec<u64> = self.ranges.range(start..=end).map(|(&s, _)| s).collect();
        for s in absorbed {
            if let Some(e) = self.ranges.remove(&s) {
                end = end.max(e);
            }
        }
        self.ranges.insert(start, end);
    }

    pub fn remove(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.ranges.range(..start).next_back() {
            if e > start {
                self.ranges.insert(s, start);
                if e > end {
                    self.ranges.insert(end, e);
                }
            }
        }
        let inside: Vec<(u64, u64)> = self.ranges.range(start..end).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in inside {
            self.ranges.remove(&s);
            if e > end {
                self.ranges.insert(end, e);
            }
        }
    }

    /// How many of `[start, end)` the set holds.
    pub fn covered(&self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        self.ranges.range(..end).rev().take_while(|(_, &e)| e > start).map(|(&s, &e)| e.min(end) - s.max(start)).sum()
    }

    /// The ranges, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&start, &end)| (start, end))
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn memory_bytes(&self) -> u64 {
        // A B-tree node holds up to 11 entries of 16 bytes plus overhead; 48 per entry is close.
        self.ranges.len() as u64 * 48
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn behaves_like_a_bitmap(ops in proptest::collection::vec((any::<bool>(), 0u64..64, 0u64..16), 1..64)) {
            let mut set = RangeSet::default();
            let mut model = [false; 96];
            for (insert, start, len) in ops {
                let end = start + len;
                if insert { set.insert(start, end) } else { set.remove(start, end) }
                for bit in &mut model[start as usize..end as usize] { *bit = insert; }
                for (x, &bit) in model.iter().enumerate() {
                    prop_assert_eq!(set.contains(x as u64), bit, "block {}", x);
                }
                for (first, end) in [(0, 96), (start, end), (start / 2, end + 7)] {
                    let held = model[first as usize..end as usize].iter().filter(|&&bit| bit).count() as u64;
                    prop_assert_eq!(set.covered(first, end), held, "[{}, {})", first, end);
                }
                // Stored ranges stay disjoint and non-adjacent.
                let mut last_end = None;
                for (&s, &e) in &set.ranges {
                    prop_assert!(s < e);
                    if let Some(prev) = last_end { prop_assert!(s > prev); }
                    last_end = Some(e);
                }
            }
        }
    }
}
