//! The overlay's block map: where each block held in RAM, in the spill log or in an in-place
//! cache file lives. An entry per cached block is most of the index's cost, so an entry is
//! packed into 8 bytes: the block number in 32 bits (disks up to 16 TiB) and the slot in 32, two
//! bits of tier and 30 of address (RAM slots and spill slots up to 4 TiB each per VM). With
//! unpacked 64-bit keys and enum values the index cost 67.8 bytes per cached 4 KiB block.
//!
//! Block numbers are hashed so that each aligned run of 8 blocks lands in 8 adjacent buckets,
//! the runs themselves scattered (see [`RunHasher`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

/// Hashes a block number so that the 8 blocks of an aligned run get adjacent buckets and tags
/// that differ, and runs get buckets spread by a strong mix of the run's number. With a plain
/// hash, each block of a 1 MiB write was a cache miss and a TLB miss in the table, twice (the
/// control bytes, then the entry): 18 % of a spilling VM's samples on sequential 1 MiB writes.
/// Now the 256 blocks of such a write touch 32 places, each one line of control bytes and one
/// of entries; a random 4 KiB write costs what it did, and the table is as large as before.
#[derive(Default)]
pub struct RunHasher(u64);

/// Blocks per run kept together: 8 entries of 8 bytes are one cache line.
const RUN_BITS: u32 = 3;

impl Hasher for RunHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u32` and `write_u64` are used; anything else is folded in byte by byte.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u32(&mut self, block: u32) {
        self.0 = u64::from(block);
    }

    /// The read cache's chunk numbers: consecutive chunks of a sequential read stay together too.
    fn write_u64(&mut self, number: u64) {
        self.0 = number;
    }

    fn finish(&self) -> u64 {
        let within = self.0 & ((1 << RUN_BITS) - 1);
        let run = mix(self.0 >> RUN_BITS);
        // The table takes the bucket from the low bits and a 7-bit tag from the top 7: the
        // position in the run goes into both.
        (run << RUN_BITS | within) ^ (within << 57)
    }
}

/// A 64-bit finalizer (MurmurHash3's fmix64): every input bit moves every output bit.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ x >> 33
}

#[derive(Default)]
pub struct BlockMap {
    entries: HashMap<u32, Packed, BuildHasherDefault<RunHasher>>,
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
            self.entries = HashMap::default();
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

    fn hash(block: u32) -> u64 {
        let mut hasher = RunHasher::default();
        hasher.write_u32(block);
        hasher.finish()
    }

    #[test]
    fn a_run_of_blocks_gets_adjacent_buckets_with_distinct_tags_and_runs_scatter() {
        let mask = (1u64 << 20) - 1;
        let base = hash(8 * 12345);
        for k in 0..8u32 {
            let h = hash(8 * 12345 + k);
            assert_eq!(h & mask, (base & mask) + u64::from(k), "block {k} of the run is next to the one before");
            assert_eq!(h >> 57, (base >> 57) ^ u64::from(k), "each block of a run has its own tag");
        }
        // Runs, even strided ones (filesystem metadata every 128 MiB), spread over the buckets.
        for stride in [1u32, 4096, 32768] {
            let buckets: std::collections::HashSet<u64> =
                (0..4096u32).map(|i| (hash(i * stride * 8) & mask) >> RUN_BITS).collect();
            assert!(buckets.len() > 4000, "stride {stride}: {} distinct runs of 4096", buckets.len());
        }
    }
}
