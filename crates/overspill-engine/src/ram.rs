//! The RAM tier: one VM's hot blocks, with a CLOCK hand choosing which to spill.
//!
//! Slots are reused through a free list; a freed slot drops its page so that trimmed or
//! overwritten-elsewhere blocks give their memory back. Each occupied slot knows its owner block
//! so that eviction can update the map. CLOCK (second chance) approximates LRU with one bit per
//! block and O(1) amortised work per eviction: a block touched since the hand last passed it is
//! spared once.

use crate::units::{Block, BlockIndex, BLOCK_SIZE};

/// A slot in the RAM tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RamSlot(pub u32);

struct Slot {
    page: Option<Box<Block>>,
    owner: BlockIndex,
    referenced: bool,
}

#[derive(Default)]
pub struct RamTier {
    slots: Vec<Slot>,
    free: Vec<u32>,
    occupied: usize,
    hand: usize,
}

impl RamTier {
    pub fn blocks(&self) -> usize {
        self.occupied
    }

    pub fn data_bytes(&self) -> u64 {
        (self.occupied * BLOCK_SIZE) as u64
    }

    /// Bookkeeping bytes beyond the pages themselves.
    pub fn index_bytes(&self) -> u64 {
        (self.slots.capacity() * std::mem::size_of::<Slot>() + self.free.capacity() * 4) as u64
    }

    pub fn insert(&mut self, owner: BlockIndex, data: &Block) -> RamSlot {
        let page = Box::new(*data);
        let slot = Slot { page: Some(page), owner, referenced: true };
        self.occupied += 1;
        match self.free.pop() {
            Some(index) => {
                self.slots[index as usize] = slot;
                RamSlot(index)
            }
            None => {
                self.slots.push(slot);
                // The map addresses slots with u32; 2^32 blocks is 16 TiB of RAM per VM.
                RamSlot(u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 RAM slots"))
            }
        }
    }

    pub fn get(&mut self, slot: RamSlot) -> &Block {
        let entry = &mut self.slots[slot.0 as usize];
        entry.referenced = true;
        entry.page.as_deref().expect("map points only at occupied RAM slots")
    }

    pub fn get_mut(&mut self, slot: RamSlot) -> &mut Block {
        let entry = &mut self.slots[slot.0 as usize];
        entry.referenced = true;
        entry.page.as_deref_mut().expect("map points only at occupied RAM slots")
    }

    pub fn remove(&mut self, slot: RamSlot) {
        let entry = &mut self.slots[slot.0 as usize];
        debug_assert!(entry.page.is_some(), "double free of RAM slot {}", slot.0);
        if entry.page.take().is_some() {
            self.occupied -= 1;
            self.free.push(slot.0);
        }
        if self.occupied == 0 {
            // Nothing cached: return the slot table too.
            self.slots = Vec::new();
            self.free = Vec::new();
            self.hand = 0;
        }
    }

    /// The coldest block by CLOCK, without removing it: the caller spills it first and removes
    /// it only once the spill succeeded.
    pub fn coldest(&mut self) -> Option<(RamSlot, BlockIndex)> {
        if self.occupied == 0 {
            return None;
        }
        // Two sweeps suffice: the first clears every reference bit it passes.
        for _ in 0..2 * self.slots.len() {
            if self.hand >= self.slots.len() {
                self.hand = 0;
            }
            let index = self.hand;
            self.hand += 1;
            let entry = &mut self.slots[index];
            if entry.page.is_none() {
                continue;
            }
            if entry.referenced {
                entry.referenced = false;
                continue;
            }
            // Slot indices come from u32s handed out by insert.
            return Some((RamSlot(index as u32), entry.owner));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_spares_recently_touched_blocks() {
        let mut ram = RamTier::default();
        let a = ram.insert(BlockIndex(1), &[1; BLOCK_SIZE]);
        let b = ram.insert(BlockIndex(2), &[2; BLOCK_SIZE]);
        // First sweep clears both bits and returns the first one it revisits.
        let (slot, owner) = ram.coldest().expect("non-empty");
        assert_eq!((slot, owner), (a, BlockIndex(1)));
        ram.get(a);
        let (slot, owner) = ram.coldest().expect("non-empty");
        assert_eq!((slot, owner), (b, BlockIndex(2)));
        ram.remove(b);
        assert_eq!(ram.blocks(), 1);
        assert_eq!(ram.get(a)[0], 1);
        ram.remove(a);
        assert_eq!(ram.blocks(), 0);
        assert!(ram.coldest().is_none());
    }
}
