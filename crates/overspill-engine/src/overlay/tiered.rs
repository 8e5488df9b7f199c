//! The tiered strategy of modes `ram` and `ram+disk`: blocks placed in the RAM tier, the coldest
//! evicted to the spill log's open segment when the VM is at its target, large writes streamed
//! to the log whole, and the log compacted while it pays.

use std::io::IoSliceMut;

use super::{foreign_slot, Core, KeptDisk, Receive, SpillFound, Store};
use crate::arena::{Arena, Owner, Page};
use crate::error::{EngineError, Result};
use crate::map::{self, Slot};
use crate::ram::{RamSlot, RamTier};
use crate::spill::{Purpose, SpillLog};
use crate::stats::VmStats;
use crate::store::BackingFile;
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
enum LandedIn {
    Ram,
    Spill,
}

/// Blocks one request stored, by tier.
#[derive(Debug, Default)]
struct Landed {
    ram: u64,
    spill: u64,
}

impl Landed {
    fn add(&mut self, tier: LandedIn) {
        match tier {
            LandedIn::Ram => self.ram += 1,
            LandedIn::Spill => self.spill += 1,
        }
    }
}

/// How a written block is placed when RAM is full: a block not in memory, or any whole block
/// of a streaming write (see `receive_spans`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Kept in RAM; the coldest block is spilled to make room.
    Hot,
    /// Appended to the spill log.
    Streaming,
}

/// A block's new contents: borrowed from the request, or received into a page of their own,
/// which the RAM tier then keeps without a copy.
enum Contents<'a> {
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

/// The tiered store: blocks in the RAM tier, and in mode `ram+disk` in the spill log beyond it.
pub(super) struct Tiered {
    ram: RamTier,
    /// `None` in mode `ram`, which has no disk and refuses writes beyond its target.
    spill: Option<SpillLog>,
    /// Blocks of the largest write lately (a peak decaying by an eighth with each write): fresh
    /// pages the next one of its kind takes before any of its blocks move to the spill log (see
    /// `pages_wanted`). A peak, so that a VM mixing large and small writes does not punch the
    /// large one's pages after each small one; after more than about five small writes in a
    /// row it does.
    recent_write_blocks: usize,
}

impl Tiered {
    pub(super) fn new(spill: Option<SpillLog>) -> Self {
        Self { ram: RamTier::default(), spill, recent_write_blocks: 0 }
    }

    fn note_write_size(&mut self, blocks: usize) {
        let decayed = self.recent_write_blocks - self.recent_write_blocks.div_ceil(8);
        self.recent_write_blocks = decayed.max(blocks);
    }

    /// The spill log, which a spill slot in the map implies.
    fn spill_of(&mut self, slot: Slot) -> Result<&mut SpillLog> {
        self.spill.as_mut().ok_or_else(|| foreign_slot(slot))
    }

    /// Whether `addr` is in the segment the spill log has open (where it can be written over).
    fn in_open_segment(&self, addr: SpillAddr) -> bool {
        self.spill.as_ref().is_some_and(|spill| spill.is_open(addr.segment))
    }

    fn put_spans(&mut self, core: &mut Core, offset: u64, data: &[u8], landed: &mut Landed) -> Result<()> {
        let placement = if data.len() >= STREAMING_WRITE_BYTES { Placement::Streaming } else { Placement::Hot };
        let mut pos = 0usize;
        for span in block_spans(offset, data.len() as u64) {
            let piece = &data[pos..pos + span.len];
            pos += span.len;
            let tier = if let Ok(whole) = <&Block>::try_from(piece) {
                self.put_block(core, span.block, Contents::Borrowed(whole), placement)?
            } else {
                self.patch_block(core, span, piece)?
            };
            landed.add(tier);
        }
        Ok(())
    }

    fn receive_spans(
        &mut self,
        core: &mut Core,
        offset: u64,
        len: usize,
        receive: &mut Receive<'_>,
        landed: &mut Landed,
    ) -> Result<()> {
        let placement = if len >= STREAMING_WRITE_BYTES { Placement::Streaming } else { Placement::Hot };
        // A streaming write while RAM is full sends its whole blocks to the spill log whatever
        // they held (`stream_to_spill`), so they are not looked up: the map says what each one
        // replaces when it is placed (the lookup was 2.4 % of the samples of 1 MiB writes while
        // spilling). The others are all looked up first: the lookups are independent, so their
        // cache misses overlap; and once: receiving the payload pushes the map's lines out of
        // the cache, so a second lookup when the block is placed missed again.
        let blind = placement == Placement::Streaming && self.spill.is_some() && !self.ram_has_room(core);
        let spans: Vec<(BlockSpan, Option<Slot>)> = block_spans(offset, len as u64)
            .map(|span| (span, if blind && span.is_whole() { None } else { core.map.get(span.block) }))
            .collect();
        let lent = |&(span, old): &(BlockSpan, Option<Slot>)| span.is_whole() && matches!(old, Some(Slot::Ram(_)));
        let mut fresh_pages = core.arena.alloc_many(spans.iter().filter(|span| !lent(span)).count())?.into_iter();
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
            fresh = self.stream_to_spill(core, fresh, landed)?;
        }
        for (span, page, old) in fresh {
            let tier = if span.is_whole() {
                self.put_block_from(core, span.block, old, Contents::Page(page), placement)?
            } else {
                self.patch_block(core, span, &page[..span.len])?
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
    fn stream_to_spill(
        &mut self,
        core: &mut Core,
        fresh: Vec<FreshBlock>,
        landed: &mut Landed,
    ) -> Result<Vec<FreshBlock>> {
        if self.spill.is_none() {
            return Ok(fresh);
        }
        let mut rest = Vec::new();
        let mut run: Vec<(BlockIndex, SpillAddr)> = Vec::with_capacity(fresh.len());
        let mut room = 0;
        let mut blocks = fresh.into_iter();
        while let Some((span, page, old)) = blocks.next() {
            // (A whole block found in RAM was received into its own page: it is not here.)
            let in_open = matches!(old, Some(Slot::Spill(addr)) if self.in_open_segment(addr));
            if !span.is_whole() || in_open {
                rest.push((span, page, old));
                continue;
            }
            if room == 0 {
                landed.spill += self.map_run(core, &mut run);
                if self.ram_has_room(core) {
                    rest.push((span, page, old));
                    rest.extend(blocks);
                    break;
                }
                let reserved = self.reserve_spill(core);
                match (reserved, &self.spill) {
                    (Ok(()), Some(spill)) => room = spill.open_room(),
                    _ => {
                        // The log takes no more (full, or its last write failed): blocks with a
                        // copy in RAM or in the open segment can still be written over there,
                        // as the per-block path does, which reports the error for the others.
                        // Looked up now, as this path may not have.
                        let relooked = |(span, page, _): FreshBlock| (span, page, core.map.get(span.block));
                        rest.push(relooked((span, page, old)));
                        rest.extend(blocks.map(relooked));
                        break;
                    }
                }
            }
            let page = owned_page(core, span.block, Contents::Page(page))?;
            let Some(spill) = self.spill.as_mut() else { break };
            run.push((span.block, spill.push(span.block, page)));
            room -= 1;
        }
        landed.spill += self.map_run(core, &mut run);
        Ok(rest)
    }

    /// Points the map at a run of blocks just pushed into the spill log and releases the
    /// copies they replace; returns how many there were.
    fn map_run(&mut self, core: &mut Core, run: &mut Vec<(BlockIndex, SpillAddr)>) -> u64 {
        let count = run.len() as u64;
        let mut replaced = Vec::with_capacity(run.len());
        replaced.extend(run.drain(..).filter_map(|(block, addr)| core.map.insert(block, Slot::Spill(addr))));
        for old in replaced {
            self.release(&core.stats, old);
        }
        count
    }

    /// Stores part of a block: the rest is read from wherever the block is now.
    fn patch_block(&mut self, core: &mut Core, span: BlockSpan, piece: &[u8]) -> Result<LandedIn> {
        let mut block = core.read_block(self, span.block)?;
        block[span.within..span.within + span.len].copy_from_slice(piece);
        self.put_block(core, span.block, Contents::Borrowed(&block), Placement::Hot)
    }

    /// Counted once per request: an atomic increment after every 4 KiB copy made the CPU wait
    /// for the copy's stores (4 % of the RAM tier's 1 MiB write throughput).
    fn count_landed(stats: &VmStats, landed: Landed) {
        if landed.ram > 0 {
            stats.write_blocks_ram.add(landed.ram);
        }
        if landed.spill > 0 {
            stats.write_blocks_spill.add(landed.spill);
        }
    }

    /// Overwrites in memory where the block already is in memory, otherwise places it anew and
    /// releases its old copy.
    fn put_block(
        &mut self,
        core: &mut Core,
        block: BlockIndex,
        data: Contents<'_>,
        placement: Placement,
    ) -> Result<LandedIn> {
        let old = core.map.get(block);
        self.put_block_from(core, block, old, data, placement)
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
        core: &mut Core,
        block: BlockIndex,
        old: Option<Slot>,
        data: Contents<'_>,
        placement: Placement,
    ) -> Result<LandedIn> {
        // A copy to write over in place may have moved since it was looked up: placing an
        // earlier block of the same write can compact the log (moving blocks into the open
        // segment) or evict this one from RAM, and its page go to another block. Looked up again.
        let old = match old {
            Some(Slot::Spill(addr)) if self.in_open_segment(addr) => core.map.get(block),
            Some(Slot::Ram(_)) => core.map.get(block),
            other => other,
        };
        match old {
            Some(Slot::Ram(slot)) => {
                crate::crash::point();
                self.ram.get_mut(slot).copy_from_slice(data.bytes());
                Ok(LandedIn::Ram)
            }
            Some(slot @ Slot::Spill(addr)) if self.in_open_segment(addr) => {
                self.spill_of(slot)?.overwrite_open(addr, data.bytes());
                Ok(LandedIn::Spill)
            }
            _ => {
                // Placing can compact the spill log, which may move this very block: release
                // whatever the map holds after placing, not the copy looked up before.
                let new = self.place(core, block, data, placement)?;
                if let Some(current) = core.map.insert(block, new) {
                    self.release(&core.stats, current);
                }
                Ok(if matches!(new, Slot::Ram(_)) { LandedIn::Ram } else { LandedIn::Spill })
            }
        }
    }

    /// Finds a new home for a block that is not in memory. On error nothing changed.
    fn place(&mut self, core: &mut Core, block: BlockIndex, data: Contents<'_>, placement: Placement) -> Result<Slot> {
        if !self.ram_has_room(core) {
            if self.spill.is_none() {
                return Err(EngineError::NoSpace(format!(
                    "RAM cache target of {} bytes reached",
                    core.memory_target_bytes()
                )));
            }
            if self.ram.blocks() == 0 || placement == Placement::Streaming {
                self.reserve_spill(core)?;
                let page = owned_page(core, block, data)?;
                let addr = self.spill.as_mut().map(|spill| spill.push(block, page));
                return addr.map(Slot::Spill).ok_or_else(|| EngineError::NoSpace("no spill log".into()));
            }
            // Keep the new (hot) block in RAM and push the coldest one out.
            self.evict_coldest(core)?;
        }
        let page = owned_page(core, block, data)?;
        Ok(Slot::Ram(self.ram.insert(block, page)))
    }

    fn ram_has_room(&self, core: &Core) -> bool {
        let need = BLOCK_BYTES + map::ENTRY_BYTES;
        let wanted = core.index_bytes() + self.memory_bytes() + need;
        // Within its own target but not what the host allows it (its target cut to a fair
        // share or by the free floor, or all VMs and read caches at the cap): read caches and
        // quiet VMs may be holding what it needs.
        let held = if wanted > core.memory_target_bytes() {
            if wanted <= core.config.ram_target_bytes {
                crate::budget::HELD_BY_CUT
            } else {
                0
            }
        } else if core.host.has_room(need) {
            return true;
        } else {
            crate::budget::HELD_BY_BUDGET
        };
        if held != 0 {
            core.host.note_held(held);
        }
        false
    }

    /// Makes room in the spill log's open segment for guest data; when the space is exhausted,
    /// compacts and retries. On error nothing changed.
    fn reserve_spill(&mut self, core: &mut Core) -> Result<()> {
        loop {
            let Some(spill) = self.spill.as_mut() else {
                return Err(EngineError::NoSpace("no spill log".into()));
            };
            match spill.reserve(Purpose::Guest, &core.stats) {
                // Out of space, any garbage is worth a compaction: each one frees a segment, so
                // this ends, with room or with no garbage left.
                Err(EngineError::NoSpace(message)) if spill.has_garbage() => {
                    if !self.compact_one(core)? {
                        return Err(EngineError::NoSpace(message));
                    }
                }
                other => return other,
            }
        }
    }

    /// Moves the coldest RAM block's page into the spill log, without a copy. On error (no room
    /// in the log) the block stays in RAM.
    fn evict_coldest(&mut self, core: &mut Core) -> Result<()> {
        let Some((slot, owner)) = self.ram.coldest() else { return Ok(()) };
        self.reserve_spill(core)?;
        let Some(spill) = self.spill.as_mut() else { return Ok(()) };
        let page = self.ram.take(slot);
        let addr = spill.push(owner, page);
        core.map.insert(owner, Slot::Spill(addr));
        Ok(())
    }

    fn release(&mut self, stats: &VmStats, old: Slot) {
        match old {
            Slot::Ram(slot) => self.ram.remove(slot),
            // Spill slots exist only with a spill log, file slots never here: nothing to free.
            Slot::Spill(addr) => {
                if let Some(spill) = self.spill.as_mut() {
                    spill.release(addr, stats);
                }
            }
            Slot::File => {}
        }
    }

    /// Moves the live blocks of the emptiest spill segments into the open one, so that their
    /// space can be punched out, while compaction pays.
    fn compact(&mut self, core: &mut Core) -> Result<()> {
        while self.spill.as_ref().is_some_and(SpillLog::wants_compaction) {
            if !self.compact_one(core)? {
                break;
            }
        }
        Ok(())
    }

    /// Moves the live blocks of the emptiest sealed segment into the open one, which frees it.
    /// `false` if no sealed segment has a dead slot.
    fn compact_one(&mut self, core: &mut Core) -> Result<bool> {
        let Some(spill) = self.spill.as_mut() else { return Ok(false) };
        let Some(victim) = spill.compaction_victim() else { return Ok(false) };
        let owners = spill.segment_owners(victim);
        // Slots are below 512.
        let addr = |slot: usize| SpillAddr { segment: victim, slot: slot as u16 };
        // A window at a time, and only windows with a live block: many VMs compacting at once
        // (a uniform workload brings them there together) each hold 256 KiB, not 2 MiB.
        let mut window = vec![0u8; COMPACTION_WINDOW_SLOTS * BLOCK_SIZE];
        for first in (0..owners.len()).step_by(COMPACTION_WINDOW_SLOTS) {
            let slots = first..(first + COMPACTION_WINDOW_SLOTS).min(owners.len());
            let live: Vec<usize> =
                slots.clone().filter(|&slot| core.map.get(owners[slot]) == Some(Slot::Spill(addr(slot)))).collect();
            if live.is_empty() {
                continue;
            }
            let bytes = &mut window[..slots.len() * BLOCK_SIZE];
            spill.read_slots(victim, first, bytes, &core.stats)?;
            for slot in live {
                let at = (slot - first) * BLOCK_SIZE;
                let data: &Block = bytes[at..at + BLOCK_SIZE].try_into().expect("windows are whole blocks");
                let owner = Owner { block: owners[slot], seq: core.next_seq() };
                let new = spill.append(owner, data, Purpose::Compaction, &core.stats)?;
                spill.release(addr(slot), &core.stats);
                core.stats.compaction_bytes_moved.add(BLOCK_BYTES);
                core.map.insert(owners[slot], Slot::Spill(new));
            }
        }
        tracing::debug!(segment = victim.0, "compacted spill segment");
        Ok(true)
    }
}

/// A page holding a new copy of `block`, stamped as such for a recovery.
fn owned_page(core: &mut Core, block: BlockIndex, data: Contents<'_>) -> Result<Page> {
    let page = data.into_page(&core.arena)?;
    let seq = core.next_seq();
    page.set_owner(Owner { block, seq });
    Ok(page)
}

impl Store for Tiered {
    /// Spills until the VM is within its (possibly shrunken) target. Best effort: a full spill
    /// disk leaves the VM over target, and the write that follows reports the error if it needs
    /// space.
    fn before_change(&mut self, core: &mut Core, written: Option<usize>) {
        if let Some(blocks) = written {
            self.note_write_size(blocks);
        }
        self.shrink_to(core, core.memory_target_bytes());
    }

    fn shrink_to(&mut self, core: &mut Core, limit_bytes: u64) {
        if self.spill.is_none() {
            return;
        }
        while self.ram.blocks() > 0 && core.index_bytes() + self.memory_bytes() > limit_bytes {
            if let Err(error) = self.evict_coldest(core) {
                tracing::debug!(%error, "could not spill down to the memory limit");
                break;
            }
        }
    }

    fn write(&mut self, core: &mut Core, offset: u64, data: &[u8]) -> Result<()> {
        let mut landed = Landed::default();
        let result = self.put_spans(core, offset, data, &mut landed);
        Self::count_landed(&core.stats, landed);
        result
    }

    fn write_received(&mut self, core: &mut Core, offset: u64, len: usize, receive: &mut Receive<'_>) -> Result<()> {
        let mut landed = Landed::default();
        let result = self.receive_spans(core, offset, len, receive, &mut landed);
        Self::count_landed(&core.stats, landed);
        result
    }

    fn store_block(&mut self, core: &mut Core, block: BlockIndex, data: &Block) -> Result<()> {
        let mut landed = Landed::default();
        landed.add(self.put_block(core, block, Contents::Borrowed(data), Placement::Hot)?);
        Self::count_landed(&core.stats, landed);
        Ok(())
    }

    fn drop_blocks(&mut self, core: &mut Core, _first: u64, _end: u64, sorted: &[BlockIndex]) -> Result<()> {
        for &block in sorted {
            if let Some(old) = core.map.remove(block) {
                self.release(&core.stats, old);
            }
        }
        if let Some(spill) = self.spill.as_mut() {
            spill.give_back_kept(&core.stats);
        }
        Ok(())
    }

    fn read_stored(&mut self, core: &Core, slot: Slot, spans: &[BlockSpan], buf: &mut [u8]) -> Result<usize> {
        let span = spans[0];
        match slot {
            Slot::Ram(ram_slot) => {
                let page = self.ram.get(ram_slot);
                buf[..span.len].copy_from_slice(&page[span.within..span.within + span.len]);
                Ok(1)
            }
            Slot::Spill(addr) => {
                // Neighbours in the guest's disk that are neighbours in one segment too: one
                // read for the run.
                let next = |i: usize| SpillAddr { segment: addr.segment, slot: addr.slot + i as u16 };
                let run = 1
                    + (1..spans.len())
                        .take_while(|&i| core.map.get(spans[i].block) == Some(Slot::Spill(next(i))))
                        .count();
                let run_len: usize = spans[..run].iter().map(|s| s.len).sum();
                let spill = self.spill_of(slot)?;
                if span.within == 0 && run_len.is_multiple_of(BLOCK_SIZE) {
                    spill.read_run(addr, &mut buf[..run_len], &core.stats)?;
                } else {
                    let mut blocks = vec![0u8; run * BLOCK_SIZE];
                    spill.read_run(addr, &mut blocks, &core.stats)?;
                    buf[..run_len].copy_from_slice(&blocks[span.within..span.within + run_len]);
                }
                Ok(run)
            }
            Slot::File => Err(foreign_slot(slot)),
        }
    }

    fn finish_writes(&mut self, stats: &VmStats) {
        if let Some(spill) = self.spill.as_mut() {
            if let Err(error) = spill.finish_writes(stats) {
                tracing::debug!(%error, "the spill segment being written failed");
            }
        }
    }

    fn settle(&mut self, core: &mut Core) {
        if self.spill.as_ref().is_some_and(SpillLog::wants_compaction) {
            if let Err(error) = self.compact(core) {
                tracing::warn!(%error, "spill compaction stopped");
            }
        }
        if let Some(spill) = self.spill.as_mut() {
            spill.heed_space_shortages(&core.stats);
            spill.release_pages_if_empty(&core.stats);
        }
    }

    fn memory_bytes(&self) -> u64 {
        let spill = self.spill.as_ref().map_or(0, SpillLog::memory_bytes);
        self.ram.data_bytes() + self.ram.index_bytes() + spill
    }

    fn pages_wanted(&self, pressed: bool) -> (usize, usize) {
        match &self.spill {
            Some(spill) => {
                let room = spill.open_room();
                (if pressed { room } else { spill.pages_wanted_soon() + self.recent_write_blocks }, room)
            }
            None => (0, 0),
        }
    }

    fn disk_used_bytes(&self) -> u64 {
        self.spill.as_ref().map_or(0, SpillLog::disk_used_bytes)
    }

    fn disk_size_bytes(&self) -> u64 {
        self.spill.as_ref().map_or(0, SpillLog::disk_size_bytes)
    }

    fn give_back_disk(&mut self, stats: &VmStats, which: KeptDisk) {
        if let Some(spill) = self.spill.as_mut() {
            match which {
                KeptDisk::Spare => spill.give_back_spare_kept(stats),
                KeptDisk::All => spill.give_back_kept(stats),
            }
        }
    }

    fn backing(&self) -> Option<&dyn BackingFile> {
        self.spill.as_ref().map(SpillLog::backing)
    }

    fn keep(&mut self) {
        if let Some(spill) = self.spill.as_mut() {
            spill.keep();
        }
    }

    fn own(&mut self) {
        if let Some(spill) = self.spill.as_mut() {
            spill.own();
        }
    }

    fn adopt_page(&mut self, block: BlockIndex, page: Page) -> Result<Slot> {
        Ok(Slot::Ram(self.ram.insert(block, page)))
    }

    fn recover_disk(&mut self, core: &mut Core, found: SpillFound) -> Result<u64> {
        let SpillFound { segments, live_slots, summary } = found;
        let Some(spill) = self.spill.take() else {
            if live_slots.is_empty() {
                return Ok(0);
            }
            return Err(EngineError::Corrupt("spill slots in a VM without a spill log".into()));
        };
        let sealed = live_slots
            .into_iter()
            .map(|(segment, live)| {
                let owners = summary[segment as usize]
                    .iter()
                    // A slot with no entry is dead; any block number does for it.
                    .map(|owner| owner.map_or(BlockIndex(0), |owner| owner.block))
                    .collect();
                (segment, owners, live)
            })
            .collect();
        self.spill = Some(spill.recovered(segments, sealed, &core.stats)?);
        Ok(0)
    }
}
