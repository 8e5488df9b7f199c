//! The overlay's block map: where each block held in RAM, in the spill log or in an in-place
//! cache file lives. An entry per cached block is most of the index's cost, so an entry is
//! packed into 8 bytes: the block number in 32 bits (disks up to 16 TiB) and the slot in 32, two
//! bits of tier and 30 of address (RAM slots and spill slots up to 4 TiB each per VM). With
//! unpacked 64-bit keys and enum values the index cost 67.8 bytes per cached 4 KiB block.

use rustc_hash::FxHashMap;

use crate::ram::RamSlot;
use crate::units::{BlockIndex, SegmentId, SpillAddr, BLOCKS_PER_SEGMENT};

/// Where a block that is not in the golden image, nor zeroed, is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Ram(RamSlot),
    Spill(SpillAddr),
    File,
}

/// Blocks a disk may have: block numbers are stored in 32 bits.
pub const MAX_BLOCKS: u64 = 1 << 32;
/// RAM slots a VM may have.
pub const MAX_RAM_SLOTS: u32 = 1 << ADDRESS_BITS;
/// Spill segments a VM may have.
pub const MAX_SPILL_SEGMENTS: u32 = (1 << ADDRESS_BITS) / BLOCKS_PER_SEGMENT as u32;

const ADDRESS_BITS: u32 = 30;
const ADDRESS_MASK: u32 = (1 << ADDRESS_BITS) - 1;
const TAG_RAM: u32 = 0;
const TAG_SPILL: u32 = 1;
const TAG_FILE: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed(u32);

impl Packed {
    fn pack(slot: Slot) -> Self {
        let (tag, address) = match slot {
            Slot::Ram(RamSlot(index)) => (TAG_RAM, index),
            Slot::Spill(addr) => (TAG_SPILL, addr.segment.0 * BLOCKS_PER_SEGMENT as u32 + u32::from(addr.slot)),
            Slot::File => (TAG_FILE, 0),
        };
        debug_assert!(address <= ADDRESS_MASK, "slot address {address} beyond {ADDRESS_BITS} bits");
        Self(tag << ADDRESS_BITS | address)
    }

    fn unpack(self) -> Slot {
        let address = self.0 & ADDRESS_MASK;
        match self.0 >> ADDRESS_BITS {
            TAG_RAM => Slot::Ram(RamSlot(address)),
            TAG_SPILL => Slot::Spill(SpillAddr {
                segment: SegmentId(address / BLOCKS_PER_SEGMENT as u32),
                // Below BLOCKS_PER_SEGMENT (512).
                slot: (address % BLOCKS_PER_SEGMENT as u32) as u16,
            }),
            _ => Slot::File,
        }
    }
}

#[derive(Default)]
pub struct BlockMap {
    entries: FxHashMap<u32, Packed>,
}

/// Bytes per entry of capacity: key, value and hashbrown's control byte.
pub const ENTRY_BYTES: u64 = (std::mem::size_of::<(u32, Packed)>() + 1) as u64;

fn key(block: BlockIndex) -> u32 {
    u32::try_from(block.0).expect("overlays refuse disks of more than MAX_BLOCKS blocks")
}

impl BlockMap {
    pub fn get(&self, block: BlockIndex) -> Option<Slot> {
        self.entries.get(&key(block)).map(|packed| packed.unpack())
    }

    pub fn contains(&self, block: BlockIndex) -> bool {
        self.entries.contains_key(&key(block))
    }

    /// Sets a block's slot, returning the one it replaces.
    pub fn insert(&mut self, block: BlockIndex, slot: Slot) -> Option<Slot> {
        self.entries.insert(key(block), Packed::pack(slot)).map(Packed::unpack)
    }

    pub fn remove(&mut self, block: BlockIndex) -> Option<Slot> {
        self.entries.remove(&key(block)).map(Packed::unpack)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn blocks(&self) -> impl Iterator<Item = BlockIndex> + '_ {
        self.entries.keys().map(|&block| BlockIndex(u64::from(block)))
    }

    pub fn memory_bytes(&self) -> u64 {
        self.entries.capacity() as u64 * ENTRY_BYTES
    }

    /// An empty map gives its table back (a VM that trimmed everything holds no index).
    pub fn shrink_if_empty(&mut self) {
        if self.entries.is_empty() && self.entries.capacity() > 0 {
            self.entries = FxHashMap::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_survive_packing_at_the_edges_of_their_ranges() {
        let last_segment = SegmentId(MAX_SPILL_SEGMENTS - 1);
        let slots = [
            Slot::Ram(RamSlot(0)),
            Slot::Ram(RamSlot(MAX_RAM_SLOTS - 1)),
            Slot::Spill(SpillAddr { segment: SegmentId(0), slot: 0 }),
            Slot::Spill(SpillAddr { segment: SegmentId(3), slot: 511 }),
            Slot::Spill(SpillAddr { segment: last_segment, slot: 511 }),
            Slot::File,
        ];
        let mut map = BlockMap::default();
        for (i, slot) in slots.iter().enumerate() {
            let block = BlockIndex(MAX_BLOCKS - 1 - i as u64);
            assert_eq!(map.insert(block, *slot), None);
            assert_eq!(map.get(block), Some(*slot));
        }
        assert_eq!(map.insert(BlockIndex(MAX_BLOCKS - 1), Slot::File), Some(slots[0]));
        assert_eq!(map.remove(BlockIndex(MAX_BLOCKS - 2)), Some(slots[1]));
        assert!(!map.contains(BlockIndex(MAX_BLOCKS - 2)));
        assert_eq!(map.len(), slots.len() - 1);
        assert_eq!(ENTRY_BYTES, 9);
    }
}
