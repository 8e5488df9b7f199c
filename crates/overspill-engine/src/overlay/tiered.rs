//! The tiered strategy of modes `ram` and `ram+disk`: blocks placed in the RAM tier, the coldest
//! evicted to the spill log's open segment when the VM is at its target, large writes streamed
//! to the log whole, and the log compacted while it pays.

use std::io::{self, IoSliceMut};

use super::{Overlay, Tier};
use crate::arena::{Arena, Owner, Page};
use crate::error::{EngineError, Result};
use crate::map::{self, Slot};
use crate::ram::RamSlot;
use crate::spill::{Purpose, SpillLog};
use crate::stats::VmStats;
use crate::units::{block_spans, Block, BlockIndex, BlockSpan, SpillAddr, BLOCK_BYTES, BLOCK_SIZE};

/// Writes at least this large go straight to the spill log when RAM is full, instead of pushing
/// the coldest RAM blocks out to make room: a large write is a file being copied or written
/// whole, unlikely to be read back soon, and it should not flush the VM's hot blocks out of RAM
/// (nor pay an eviction, two copies and an allocation per block: 1 MiB sequential writes went
/// from 1.35-1.6 to 1.7-1.8 GB/s while spilling; the spill writer thread is then the limit).
const STREAMING_WRITE_BYTES: usize = 256 * 1024;

/// Slots compaction reads at once (256 KiB).
const COMPACTION_WINDOW_SLOTS: usize = 64;

/// Where `put_block` stored a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LandedIn {
    Ram,
    Spill,
}

/// Blocks one request stored, by tier.
#[derive(Debug, Default)]
pub(super) struct Landed {
    pub(super) ram: u64,
    pub(super) spill: u64,
}

impl Landed {
    pub(super) fn add(&mut self, tier: LandedIn) {
        match tier {
            LandedIn::Ram => self.ram += 1,
            LandedIn::Spill => self.spill += 1,
        }
    }
}

/// How a written block is placed when RAM is full: a block not in memory, or any whole block
/// of a streaming write (see `receive_spans`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placement {
    /// Kept in RAM; the coldest block is spilled to make room.
    Hot,
    /// Appended to the spill log.
    Streaming,
}

/// A block's new contents: borrowed from the request, or received into a page of their own,
/// which the RAM tier then keeps without a copy.
pub(super) enum Contents<'a> {
    Borrowed(&'a Block),
    Page(Page),
}

impl Contents<'_> {
    fn bytes(&self) -> &Block {
        match self {
            Self::Borrowed(data) => data,
            Self::Page(page) => page,
        }
    }

    fn into_page(self, arena: &Arena) -> Result<Page> {
        match self {
            Self::Borrowed(data) => arena.alloc_copy(data),
            Self::Page(page) => Ok(page),
        }
    }
}

/// Where a block of a write being received lands.
enum Landing {
    /// The block's own RAM page, taken out of the tier while it is filled.
    Lent(RamSlot, Page),
    /// A new page: the block is placed once it is filled. With where the block was when the
    /// write began, or `None` if it was not looked up (see [`Overlay::put_block_from`]).
    Fresh(Page, Option<Slot>),
}

impl Landing {
    fn page(&mut self) -> &mut Block {
        match self {
            Self::Lent(_, page) | Self::Fresh(page, _) => page,
        }
    }
}

/// A block of a write received into a fresh page, with where it was when the write began.
type FreshBlock = (BlockSpan, Page, Option<Slot>);

impl Overlay {
    pub(super) fn put_spans(&mut self, offset: u64, data: &[u8], landed: &mut Landed) -> Result<()> {
        let placement = if data.len() >= STREAMING_WRITE_BYTES { Placement::Streaming } else { Placement::Hot };
        let mut pos = 0usize;
        for span in block_spans(offset, data.len() as u64) {
            let piece = &data[pos..pos + span.len];
            pos += span.len;
            let tier = if let Ok(whole) = <&Block>::try_from(piece) {
                self.put_block(span.block, Contents::Borrowed(whole), placement)?
            } else {
                self.patch_block(span, piece)?
            };
            landed.add(tier);
        }
        Ok(())
    }

    pub(super) fn receive_spans(
        &mut self,
        offset: u64,
        len: usize,
        receive: impl FnOnce(&mut [IoSliceMut<'_>]) -> io::Result<()>,
        landed: &mut Landed,
    ) -> Result<()> {
        let placement = if len >= STREAMING_WRITE_BYTES { Placement::Streaming } else { Placement::Hot };
        // A streaming write while RAM is full sends its whole blocks to the spill log whatever
        // they held (`stream_to_spill`), so they are not looked up: the map says what each one
        // replaces when it is placed (the lookup was 2.4 % of the samples of 1 MiB writes while
        // spilling). The others are all looked up first: the lookups are independent, so their
        // cache misses overlap; and once: receiving the payload pushes the map's lines out of
        // the cache, so a second lookup when the block is placed missed again.
        let blind = placement == Placement::Streaming && matches!(self.tier, Tier::RamDisk(_)) && !self.ram_has_room();
        let spans: Vec<(BlockSpan, Option<Slot>)> = block_spans(offset, len as u64)
            .map(|span| (span, if blind && span.is_whole() { None } else { self.map.get(span.block) }))
            .collect();
        let lent = |&(span, old): &(BlockSpan, Option<Slot>)| span.is_whole() && matches!(old, Some(Slot::Ram(_)));
        let mut fresh_pages = self.arena.alloc_many(spans.iter().filter(|span| !lent(span)).count())?.into_iter();
        let mut landings: Vec<(BlockSpan, Landing)> = spans
            .into_iter()
            .map(|(span, old)| match old {
                Some(Slot::Ram(slot)) if span.is_whole() => (span, Landing::Lent(slot, self.ram.lend(slot))),
                // One page was allocated for each span that is not lent.
                _ => (span, Landing::Fresh(fresh_pages.next().expect("a page per span"), old)),
            })
            .collect();
        let received = {
            let mut buffers: Vec<IoSliceMut<'_>> =
                landings.iter_mut().map(|(span, landing)| IoSliceMut::new(&mut landing.page()[..span.len])).collect();
            receive(&mut buffers)
        };
        // RAM is whole again before anything is placed (placing may evict).
        let mut fresh: Vec<FreshBlock> = Vec::with_capacity(landings.len());
        for (span, landing) in landings {
            match landing {
                Landing::Lent(slot, page) => {
                    self.ram.give_back(slot, page);
                    landed.add(LandedIn::Ram);
                }
                Landing::Fresh(page, old) => fresh.push((span, page, old)),
            }
        }
        received.map_err(|e| EngineError::from_io("receiving data", e))?;
        if placement == Placement::Streaming {
            fresh = self.stream_to_spill(fresh, landed)?;
        }
        for (span, page, old) in fresh {
            let tier = if span.is_whole() {
                self.put_block_from(span.block, old, Contents::Page(page), placement)?
            } else {
                self.patch_block(span, &page[..span.len])?
            };
            landed.add(tier);
        }
        Ok(())
    }

    /// Appends a streaming write's whole new blocks to the spill log a run at a time while RAM
    /// has no room: one reservation per run of the open segment's room, then the map updated in
    /// a loop of its own, so that its cache misses overlap. [`Self::put_block_from`] does the
    /// same block by block; its reservation, room check and bookkeeping per block were most of
    /// the server's own time on 1 MiB writes while spilling. Returns the blocks it leaves to
    /// that path: partial ones, those found in the open segment (written over in place there),
    /// and what is left of the write once RAM has room or once the log takes no more.
    ///
    /// A block's old copy is whatever the map holds when the run is mapped, not `old` (`None`
    /// for a block not looked up): reserving can compact, which moves blocks (into the open
    /// segment, too).
    fn stream_to_spill(&mut self, fresh: Vec<FreshBlock>, landed: &mut Landed) -> Result<Vec<FreshBlock>> {
        if !matches!(self.tier, Tier::RamDisk(_)) {
            return Ok(fresh);
        }
        let mut rest = Vec::new();
        let mut run: Vec<(BlockIndex, SpillAddr)> = Vec::with_capacity(fresh.len());
        let mut room = 0;
        let mut blocks = fresh.into_iter();
        while let Some((span, page, old)) = blocks.next() {
            // (A whole block found in RAM was received into its own page: it is not here.)
            let in_open = matches!(old, Some(Slot::Spill(addr)) if self.spill_mut().is_open(addr.segment));
            if !span.is_whole() || in_open {
                rest.push((span, page, old));
                continue;
            }
            if room == 0 {
                landed.spill += self.map_run(&mut run);
                if self.ram_has_room() {
                    rest.push((span, page, old));
                    rest.extend(blocks);
                    break;
                }
                if self.reserve_spill().is_err() {
                    // The log takes no more (full, or its last write failed): blocks with a copy
                    // in RAM or in the open segment can still be written over there, as the
                    // per-block path does, which reports the error for the others. Looked up
                    // now, as this path may not have.
                    let relooked = |(span, page, _): FreshBlock| (span, page, self.map.get(span.block));
                    rest.push(relooked((span, page, old)));
                    rest.extend(blocks.map(relooked));
                    break;
                }
                room = self.spill_mut().open_room();
            }
            let page = self.owned_page(span.block, Contents::Page(page))?;
            run.push((span.block, self.spill_mut().push(span.block, page)));
            room -= 1;
        }
        landed.spill += self.map_run(&mut run);
        Ok(rest)
    }

    /// Points the map at a run of blocks just pushed into the spill log and releases the
    /// copies they replace; returns how many there were.
    fn map_run(&mut self, run: &mut Vec<(BlockIndex, SpillAddr)>) -> u64 {
        let count = run.len() as u64;
        let mut replaced = Vec::with_capacity(run.len());
        replaced.extend(run.drain(..).filter_map(|(block, addr)| self.map.insert(block, Slot::Spill(addr))));
        for old in replaced {
            self.release(old);
        }
        count
    }

    /// Stores part of a block: the rest is read from wherever the block is now.
    fn patch_block(&mut self, span: BlockSpan, piece: &[u8]) -> Result<LandedIn> {
        let mut block = self.read_block(span.block)?;
        block[span.within..span.within + span.len].copy_from_slice(piece);
        self.put_block(span.block, Contents::Borrowed(&block), Placement::Hot)
    }

    /// Counted once per request: an atomic increment after every 4 KiB copy made the CPU wait
    /// for the copy's stores (4 % of the RAM tier's 1 MiB write throughput).
    pub(super) fn count_landed(&self, landed: Landed) {
        if landed.ram > 0 {
            self.stats.write_blocks_ram.add(landed.ram);
        }
        if landed.spill > 0 {
            self.stats.write_blocks_spill.add(landed.spill);
        }
    }

    /// Modes `ram` and `ram+disk`: overwrite in memory where the block already is in memory,
    /// otherwise place it anew and release its old copy.
    pub(super) fn put_block(
        &mut self,
        block: BlockIndex,
        data: Contents<'_>,
        placement: Placement,
    ) -> Result<LandedIn> {
        self.put_block_from(block, self.map.get(block), data, placement)
    }

    /// [`Self::put_block`], `old` being where the map said the block was earlier in the same
    /// write, or `None` if it was not looked up (see `receive_spans`). Placing the blocks
    /// before it may have moved it since (an eviction seals segments, compaction moves blocks
    /// out of sealed ones); what makes an out-of-date `old` safe: it is never RAM (a whole
    /// block found in RAM is received into its own page, never placed), and a block placed
    /// anew releases whatever the map holds by then, not `old`: a copy in RAM too. Only a
    /// block said to be in the segment open now is looked up again: a segment sealed
    /// meanwhile, emptied by compaction and reused can be open again under the same number.
    fn put_block_from(
        &mut self,
        block: BlockIndex,
        old: Option<Slot>,
        data: Contents<'_>,
        placement: Placement,
    ) -> Result<LandedIn> {
        // A copy to write over in place may have moved since it was looked up: placing an
        // earlier block of the same write can compact the log (moving blocks into the open
        // segment) or evict this one from RAM, and its page go to another block. Looked up again.
        let old = match old {
            Some(Slot::Spill(addr)) if self.spill_mut().is_open(addr.segment) => self.map.get(block),
            Some(Slot::Ram(_)) => self.map.get(block),
            other => other,
        };
        match old {
            Some(Slot::Ram(slot)) => {
                crate::crash::point();
                self.ram.get_mut(slot).copy_from_slice(data.bytes());
                Ok(LandedIn::Ram)
            }
            Some(Slot::Spill(addr)) if self.spill_mut().is_open(addr.segment) => {
                self.spill_mut().overwrite_open(addr, data.bytes());
                Ok(LandedIn::Spill)
            }
            _ => {
                // Placing can compact the spill log, which may move this very block: release
                // whatever the map holds after placing, not the copy looked up before.
                let new = self.place(block, data, placement)?;
                if let Some(current) = self.map.insert(block, new) {
                    self.release(current);
                }
                Ok(if matches!(new, Slot::Ram(_)) { LandedIn::Ram } else { LandedIn::Spill })
            }
        }
    }

    /// Finds a new home for a block that is not in memory. On error nothing changed.
    pub(super) fn place(&mut self, block: BlockIndex, data: Contents<'_>, placement: Placement) -> Result<Slot> {
        if !self.ram_has_room() {
            match self.tier {
                Tier::RamDisk(_) => {
                    if self.ram.blocks() == 0 || placement == Placement::Streaming {
                        self.reserve_spill()?;
                        let page = self.owned_page(block, data)?;
                        return Ok(Slot::Spill(self.spill_mut().push(block, page)));
                    }
                    // Keep the new (hot) block in RAM and push the coldest one out.
                    self.evict_coldest()?;
                }
                _ => {
                    return Err(EngineError::NoSpace(format!(
                        "RAM cache target of {} bytes reached",
                        self.memory_target_bytes()
                    )))
                }
            }
        }
        let page = self.owned_page(block, data)?;
        Ok(Slot::Ram(self.ram.insert(block, page)))
    }

    /// A page holding a new copy of `block`, stamped as such for a recovery.
    fn owned_page(&mut self, block: BlockIndex, data: Contents<'_>) -> Result<Page> {
        let page = data.into_page(&self.arena)?;
        let seq = self.next_seq();
        page.set_owner(Owner { block, seq });
        Ok(page)
    }

    fn ram_has_room(&self) -> bool {
        let need = BLOCK_BYTES + map::ENTRY_BYTES;
        self.memory_used_bytes() + need <= self.memory_target_bytes() && self.host.has_room(need)
    }

    /// Makes room in the spill log's open segment for guest data; when the space is exhausted,
    /// compacts and retries. On error nothing changed.
    fn reserve_spill(&mut self) -> Result<()> {
        loop {
            let (spill, stats) = self.spill_and_stats();
            match spill.reserve(Purpose::Guest, stats) {
                // Out of space, any garbage is worth a compaction: each one frees a segment, so
                // this ends, with room or with no garbage left.
                Err(EngineError::NoSpace(message)) if spill.has_garbage() => {
                    if !self.compact_one()? {
                        return Err(EngineError::NoSpace(message));
                    }
                }
                other => return other,
            }
        }
    }

    /// Moves the coldest RAM block's page into the spill log, without a copy. On error (no room
    /// in the log) the block stays in RAM.
    fn evict_coldest(&mut self) -> Result<()> {
        let Some((slot, owner)) = self.ram.coldest() else { return Ok(()) };
        self.reserve_spill()?;
        let page = self.ram.take(slot);
        let addr = self.spill_mut().push(owner, page);
        self.map.insert(owner, Slot::Spill(addr));
        Ok(())
    }

    /// Spills until the VM is within its (possibly shrunken) target. Best effort: a full spill
    /// disk leaves the VM over target, and the write that follows reports the error if it needs
    /// space.
    pub(super) fn shrink_to_target(&mut self) {
        if !matches!(self.tier, Tier::RamDisk(_)) {
            return;
        }
        while self.ram.blocks() > 0 && self.memory_used_bytes() > self.memory_target_bytes() {
            if let Err(error) = self.evict_coldest() {
                tracing::debug!(%error, "could not spill down to the memory target");
                break;
            }
        }
    }

    pub(super) fn release(&mut self, old: Slot) {
        match old {
            Slot::Ram(slot) => self.ram.remove(slot),
            Slot::Spill(addr) => {
                let (spill, stats) = self.spill_and_stats();
                spill.release(addr, stats);
            }
            Slot::File => unreachable!("in-place blocks are overwritten in place, never released"),
        }
    }

    /// Moves the live blocks of the emptiest spill segments into the open one, so that their
    /// space can be punched out, while compaction pays.
    pub(super) fn compact(&mut self) -> Result<()> {
        while self.spill_mut().wants_compaction() {
            if !self.compact_one()? {
                break;
            }
        }
        Ok(())
    }

    /// Moves the live blocks of the emptiest sealed segment into the open one, which frees it.
    /// `false` if no sealed segment has a dead slot.
    fn compact_one(&mut self) -> Result<bool> {
        let Some(victim) = self.spill_mut().compaction_victim() else { return Ok(false) };
        let owners = self.spill_mut().segment_owners(victim);
        // Slots are below 512.
        let addr = |slot: usize| SpillAddr { segment: victim, slot: slot as u16 };
        // A window at a time, and only windows with a live block: many VMs compacting at once
        // (a uniform workload brings them there together) each hold 256 KiB, not 2 MiB.
        let mut window = vec![0u8; COMPACTION_WINDOW_SLOTS * BLOCK_SIZE];
        for first in (0..owners.len()).step_by(COMPACTION_WINDOW_SLOTS) {
            let slots = first..(first + COMPACTION_WINDOW_SLOTS).min(owners.len());
            let live: Vec<usize> =
                slots.clone().filter(|&slot| self.map.get(owners[slot]) == Some(Slot::Spill(addr(slot)))).collect();
            if live.is_empty() {
                continue;
            }
            let bytes = &mut window[..slots.len() * BLOCK_SIZE];
            let (spill, stats) = self.spill_and_stats();
            spill.read_slots(victim, first, bytes, stats)?;
            for slot in live {
                let at = (slot - first) * BLOCK_SIZE;
                let data: &Block = bytes[at..at + BLOCK_SIZE].try_into().expect("windows are whole blocks");
                let owner = Owner { block: owners[slot], seq: self.next_seq() };
                let (spill, stats) = self.spill_and_stats();
                let new = spill.append(owner, data, Purpose::Compaction, stats)?;
                spill.release(addr(slot), stats);
                stats.compaction_bytes_moved.add(BLOCK_BYTES);
                self.map.insert(owners[slot], Slot::Spill(new));
            }
        }
        tracing::debug!(segment = victim.0, "compacted spill segment");
        Ok(true)
    }

    pub(super) fn spill_mut(&mut self) -> &mut SpillLog {
        self.spill_and_stats().0
    }

    /// The spill log with the counters it updates (disjoint borrows of `self`).
    pub(super) fn spill_and_stats(&mut self) -> (&mut SpillLog, &VmStats) {
        match &mut self.tier {
            Tier::RamDisk(spill) => (spill, &self.stats),
            _ => unreachable!("spill slots exist only in ram+disk mode"),
        }
    }
}
