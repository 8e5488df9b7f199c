//! The RAM tier: one VM's hot blocks, with a CLOCK hand choosing which to spill.
//!
//! Slots are reused through a free list; a freed slot drops its page so that trimmed or
//! overwritten-elsewhere blocks give their memory back. Each occupied slot knows its owner block
//! so that eviction can update the map. CLOCK (second chance) approximates LRU with one bit per
//! block and O(1) amortised work per eviction: a block touched since the hand last passed it is
//! spared once.

use crate::arena::Page;
use crate::map::MAX_RAM_SLOTS;
use crate::units::{Block, BlockIndex, BLOCK_SIZE};

/// A slot in the RAM tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RamSlot(pub u32);

/// Per slot, in parallel arrays (21 bytes a slot, where a struct of the three took 32): the page
/// (a handle into the VM's arena), the block it holds (32-bit block numbers, as in the map) and
/// the CLOCK reference bit.
#[derive(Default)]
pub struct RamTier {
    pages: Vec<Option<Page>>,
    owners: Vec<u32>,
    referenced: Vec<bool>,
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
        (self.pages.capacity() * std::mem::size_of::<Option<Page>>()
            + self.owners.capacity() * 4
            + self.referenced.capacity()
            + self.free.capacity() * 4) as u64
    }

    /// Stores a page the caller filled already (a block received straight into it).
    pub fn insert(&mut self, owner: BlockIndex, page: Page) -> RamSlot {
        // The overlay maps at most 2^32 blocks.
        let owner = owner.0 as u32;
        let page = Some(page);
        self.occupied += 1;
        match self.free.pop() {
            Some(index) => {
                let i = index as usize;
                self.pages[i] = page;
                self.owners[i] = owner;
                self.referenced[i] = true;
                RamSlot(index)
            }
            None => {
                let index = self.pages.len();
                assert!(index < MAX_RAM_SLOTS as usize, "a VM's RAM tier holds at most 4 TiB");
                self.pages.push(page);
                self.owners.push(owner);
                self.referenced.push(true);
                RamSlot(index as u32)
            }
        }
    }

    pub fn get(&mut self, slot: RamSlot) -> &Block {
        let i = slot.0 as usize;
        self.referenced[i] = true;
        self.pages[i].as_deref().expect("map points only at occupied RAM slots")
    }

    pub fn get_mut(&mut self, slot: RamSlot) -> &mut Block {
        let i = slot.0 as usize;
        self.referenced[i] = true;
        self.pages[i].as_deref_mut().expect("map points only at occupied RAM slots")
    }

    /// Takes a slot's page out so that it can be filled along with others (one vectored read
    /// into many pages). The slot stays occupied; its page must be given back before the tier is
    /// used again.
    pub fn lend(&mut self, slot: RamSlot) -> Page {
        let i = slot.0 as usize;
        self.referenced[i] = true;
        self.pages[i].take().expect("map points only at occupied RAM slots")
    }

    pub fn give_back(&mut self, slot: RamSlot, page: Page) {
        let lent = &mut self.pages[slot.0 as usize];
        debug_assert!(lent.is_none(), "RAM slot {} was not lent", slot.0);
        *lent = Some(page);
    }

    pub fn remove(&mut self, slot: RamSlot) {
        drop(self.take(slot));
    }

    /// Frees a slot and hands its page over (to the spill log, which keeps it).
    pub fn take(&mut self, slot: RamSlot) -> Page {
        let page = self.pages[slot.0 as usize].take().expect("map points only at occupied RAM slots");
        self.occupied -= 1;
        self.free.push(slot.0);
        if self.occupied == 0 {
            // Nothing cached: return the slot tables too.
            *self = Self::default();
        }
        page
    }

    /// The coldest block by CLOCK, without removing it: the caller spills it first and removes
    /// it only once the spill succeeded.
    pub fn coldest(&mut self) -> Option<(RamSlot, BlockIndex)> {
        if self.occupied == 0 {
            return None;
        }
        // Two sweeps suffice: the first clears every reference bit it passes.
        for _ in 0..2 * self.pages.len() {
            if self.hand >= self.pages.len() {
                self.hand = 0;
            }
            let index = self.hand;
            self.hand += 1;
            if self.pages[index].is_none() {
                continue;
            }
            if self.referenced[index] {
                self.referenced[index] = false;
                continue;
            }
            // Slot indices come from u32s handed out by insert.
            return Some((RamSlot(index as u32), BlockIndex(u64::from(self.owners[index]))));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_spares_recently_touched_blocks() {
        let arena = crate::arena::Arena::in_memory(16).expect("arena");
        let mut ram = RamTier::default();
        let a = ram.insert(BlockIndex(1), arena.alloc_copy(&[1; BLOCK_SIZE]).expect("page"));
        let b = ram.insert(BlockIndex(2), arena.alloc_copy(&[2; BLOCK_SIZE]).expect("page"));
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
