//! The spill log: RAM overflow packed into 2 MiB segments, each written in one sequential pass.
//!
//! A segment is in one of three states:
//! - **free**: no data; its range of the file is a hole (never written, or punched), or, for
//!   the segments that died last, still allocated, to be written over by the next segments
//!   (see [`KEPT_FREE_SEGMENTS`]);
//! - **open**: at most one at a time, the pages of the blocks appended to it so far (evicted RAM
//!   pages move in without a copy). Blocks in it are read and overwritten in memory. It is
//!   written out in one piece, 2 MiB, when it is full and space is needed for the next block;
//! - **sealed**: on disk, read one 4 KiB block at a time; or, just after sealing, still being
//!   written (at most one segment at a time), and read from its pages until the write is done.
//!
//! Every slot remembers the block it was written for; a slot is live while the overlay's map
//! still points at it. Overwrites and TRIMs make slots dead ([`SpillLog::release`]); a sealed
//! segment whose last slot dies becomes free and, beyond those kept for reuse, is punched out
//! of the file, so the file's allocated size follows the live data (at most twice it, the most
//! garbage compaction lets stand, or a few segments more). A TRIM gives the kept ones
//! back too ([`SpillLog::give_back_kept`]), as does a VM whose client is quiet for a while, and
//! so does the next write of every VM once any file on the filesystem was refused space
//! ([`SpillLog::heed_space_shortages`]), so that space kept for reuse does not keep another VM
//! refused. Segments with few live slots are compacted by the overlay (which owns the map) when
//! free space runs low or garbage outweighs live data.
//!
//! With a byte limit, one free segment is held back for compaction so that compaction can always
//! make progress; guest data gets `NoSpace` before that reserve is touched.
//!
//! A segment write that fails leaves the segment's pages where they are, readable, and the error
//! goes to the append that asked for it (a file that writes in the background reports it to the
//! append that next seals). Until a retry of that write succeeds, no segment is opened, so every
//! append that needs space fails: the VM gets ENOSPC or EIO and loses nothing it was told it wrote.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use crate::arena::{Arena, Owner, Page};
use crate::error::{EngineError, Result};
use crate::map::MAX_SPILL_SEGMENTS;
use crate::state::SegmentSummaries;
use crate::stats::VmStats;
use crate::store::{BackingFile, SegmentPages, SegmentWrite};
use crate::units::{Block, BlockIndex, SegmentId, SpillAddr, BLOCKS_PER_SEGMENT, BLOCK_SIZE, SEGMENT_BYTES};

/// Free segments kept allocated whatever the live data, the most recently dead first in line for
/// the next segment. Writing over a segment whose pages the page cache still holds (often still
/// dirty, so never written back at all) skips what a hole costs twice: punching it (invalidating
/// its pages, with the file's lock taken against the writer threads) and filling it again (new
/// pages, new blocks from the filesystem). Sequential 1 MiB writes to a spilling VM overwrite
/// whole segments, and perf showed the punches at 13 % of its connection thread. Four is 8 MiB
/// of disk, counted as used. More are kept while the file stays within twice its live data
/// ([`SpillLog::kept_limit`]).
pub const KEPT_FREE_SEGMENTS: usize = 4;

/// Segments a log opens after hearing of a space shortage before it keeps more than
/// [`KEPT_FREE_SEGMENTS`] again: 512 MiB spilled, time for the refused VM to take its room.
pub const LEAN_OPENS_AFTER_SHORTAGE: u32 = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegmentState {
    Free,
    Open,
    Sealed,
}

struct Segment {
    state: SegmentState,
    live: u16,
    /// Which block each slot was written for; empty while the segment is free.
    owners: Vec<BlockIndex>,
}

struct OpenSegment {
    id: SegmentId,
    pages: SegmentPages,
}

/// A sealed segment whose write has not been seen to succeed.
struct Writing {
    id: SegmentId,
    pages: Arc<SegmentPages>,
    /// `None` once the write failed: the data is only in `pages` until a retry succeeds.
    write: Option<SegmentWrite>,
}

/// Who asks for spill space: compaction may use the reserve segment, guest data may not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Guest,
    Compaction,
}

pub struct SpillLog {
    file: Box<dyn BackingFile>,
    /// Where the pages of the open segment come from when a block is appended by copy.
    arena: Arena,
    /// Where a written segment's slots are recorded for a recovery, if the VM's state is kept.
    summaries: Option<SegmentSummaries>,
    segments: Vec<Segment>,
    /// Free segments that are holes, lowest first.
    free: BinaryHeap<Reverse<u32>>,
    /// Free segments still allocated, oldest first (see [`KEPT_FREE_SEGMENTS`]).
    kept: Vec<u32>,
    open: Option<OpenSegment>,
    writing: Option<Writing>,
    max_segments: Option<u32>,
    live_blocks: u64,
    sealed_segments: u32,
    /// Places in the file given up after a failed write (see `drop_failed_write`): never used
    /// again, and not counted against the spill limit (they hold nothing, punched).
    given_up: u64,
    /// Segments whose owner table is allocated (open or sealed): kept as a count so that the
    /// memory figure, asked for on every write, does not walk every segment.
    owner_tables: u64,
    /// The file's [`BackingFile::space_shortages`] when this log last gave its kept segments back.
    shortages_heeded: u64,
    /// Segments still to open, after a space shortage, before more than [`KEPT_FREE_SEGMENTS`]
    /// are kept again.
    lean_opens_left: u32,
}

impl SpillLog {
    pub fn new(file: Box<dyn BackingFile>, max_bytes: Option<u64>, arena: Arena) -> Result<Self> {
        let max_segments = match max_bytes {
            None => None,
            Some(bytes) => {
                let segments = bytes / SEGMENT_BYTES as u64;
                if segments < 2 {
                    return Err(EngineError::Config(format!(
                        "a spill limit of {bytes} bytes holds fewer than two 2 MiB segments"
                    )));
                }
                Some(u32::try_from(segments).unwrap_or(u32::MAX))
            }
        };
        Ok(Self {
            segments: Vec::new(),
            free: BinaryHeap::new(),
            kept: Vec::new(),
            open: None,
            writing: None,
            max_segments,
            live_blocks: 0,
            sealed_segments: 0,
            given_up: 0,
            owner_tables: 0,
            shortages_heeded: file.space_shortages(),
            lean_opens_left: 0,
            file,
            arena,
            summaries: None,
        })
    }

    /// Records each written segment's slots from now on, for a recovery.
    pub(crate) fn set_summaries(&mut self, summaries: SegmentSummaries) {
        self.summaries = Some(summaries);
    }

    /// A log rebuilt by a recovery, over a file of `segments` segments: `sealed` lists those
    /// with a live slot, with the block of each slot (dead ones included) and the live count.
    /// Every other segment is free: punched, its summary cleared.
    pub(crate) fn recovered(
        mut self,
        segments: u32,
        sealed: Vec<(u32, Vec<BlockIndex>, u16)>,
        stats: &VmStats,
    ) -> Result<Self> {
        if segments > MAX_SPILL_SEGMENTS {
            return Err(EngineError::Corrupt(format!("a spill file of {segments} segments")));
        }
        self.segments =
            (0..segments).map(|_| Segment { state: SegmentState::Free, live: 0, owners: Vec::new() }).collect();
        for (id, owners, live) in sealed {
            let segment = &mut self.segments[id as usize];
            *segment = Segment { state: SegmentState::Sealed, live, owners };
            self.live_blocks += u64::from(live);
            self.sealed_segments += 1;
            self.owner_tables += 1;
        }
        for id in 0..segments {
            if self.segments[id as usize].state == SegmentState::Free {
                self.punch(id, stats);
                if let Some(summaries) = &mut self.summaries {
                    summaries.clear(id);
                }
            }
        }
        Ok(self)
    }

    /// The files stay for the next process.
    pub fn keep(&mut self) {
        self.file.keep();
        if let Some(summaries) = &mut self.summaries {
            summaries.keep();
        }
    }

    /// Undoes [`Self::keep`].
    pub fn own(&mut self) {
        self.file.own();
        if let Some(summaries) = &mut self.summaries {
            summaries.own();
        }
    }

    fn summarize(&mut self, id: SegmentId, pages: &[Page]) -> Result<()> {
        match &mut self.summaries {
            Some(summaries) => {
                summaries.write(id.0, pages).map_err(|e| EngineError::from_io("writing a segment summary", e))
            }
            None => Ok(()),
        }
    }

    pub fn live_blocks(&self) -> u64 {
        self.live_blocks
    }

    /// Bytes of the file allocated: sealed segments and the free ones kept for reuse (the
    /// other free ones are holes).
    pub fn disk_used_bytes(&self) -> u64 {
        (u64::from(self.sealed_segments) + self.kept.len() as u64) * SEGMENT_BYTES as u64
    }

    /// The file's logical size, or its limit when one is set.
    pub fn disk_size_bytes(&self) -> u64 {
        match self.max_segments {
            Some(max) => u64::from(max) * SEGMENT_BYTES as u64,
            None => self.segments.len() as u64 * SEGMENT_BYTES as u64,
        }
    }

    /// Once nothing in the log lives (the guest trimmed or overwrote it all), gives back the
    /// open segment's pages and the kept free segments' space too: an open segment with no
    /// live slot is just memory. (A segment still being written is freed, pages and space, once
    /// written.)
    pub fn release_pages_if_empty(&mut self, stats: &VmStats) {
        if self.live_blocks > 0 {
            return;
        }
        self.give_back_kept(stats);
        if let Some(open) = self.open.take() {
            let segment = &mut self.segments[open.id.0 as usize];
            segment.state = SegmentState::Free;
            segment.owners = Vec::new();
            self.owner_tables -= 1;
            // Never written as this segment, but it may be a kept one reused, its old bytes
            // still on disk.
            self.punch(open.id.0, stats);
        }
    }

    /// A whole segment counts while the log holds one: the open segment (however full: the VM
    /// keeps room for it, so that RAM is squeezed once, when it starts spilling, not block by
    /// block as the segment fills), and a segment whose write failed. A segment being written in the background is the host's (see
    /// `store::SegmentWriters`): it does not count here, so that the figure, and every eviction
    /// decided from it, is the same in a simulation as in a server, where writes finish in their
    /// own time. The pages in the open segment are the evicted RAM pages themselves, so this is
    /// an upper bound of what the VM holds, not more memory than its RAM tier had.
    pub fn memory_bytes(&self) -> u64 {
        let failed = self.writing.as_ref().is_some_and(|writing| writing.write.is_none());
        // Both at once where a background write failed after the next segment was opened.
        let segment = (usize::from(self.open.is_some()) + usize::from(failed)) * SEGMENT_BYTES;
        let owners = self.owner_tables as usize * BLOCKS_PER_SEGMENT;
        (segment
            + owners * std::mem::size_of::<BlockIndex>()
            + self.segments.capacity() * std::mem::size_of::<Segment>()
            + (self.free.capacity() + self.kept.capacity()) * 4) as u64
    }

    /// Free pages worth keeping in memory for the blocks about to come. A spilling VM's pages
    /// go round: free, in the open segment, in the segment being written, free again; two
    /// segments' worth at most, since a VM never waits on more than one write. The free pages
    /// worth keeping are what that round holds beyond the pages the open and the writing
    /// segment have now, a figure that stays put while a segment fills, is sealed and is
    /// written. It is a ceiling, not a stock: a VM that fills segments slowly has each written
    /// segment's pages back long before it has filled the next, so it never takes the second
    /// segment's worth from the arena. A figure that moved with the writers' timing instead
    /// would punch pages on each fall that the next request faulted back in (docs/performance.md).
    /// None for a VM not spilling now: nothing open, nothing being written.
    pub fn pages_wanted_soon(&self) -> usize {
        if self.open.is_none() && self.writing.is_none() {
            return 0;
        }
        let open = self.open.as_ref().map_or(0, |open| open.pages.len());
        let writing = self.writing.as_ref().map_or(0, |writing| writing.pages.len());
        (2 * BLOCKS_PER_SEGMENT).saturating_sub(open + writing)
    }

    /// Room left in the open segment: free pages up to it are counted in
    /// [`Self::memory_bytes`], which counts the open segment whole.
    pub fn open_room(&self) -> usize {
        self.open.as_ref().map_or(0, |open| BLOCKS_PER_SEGMENT - open.pages.len())
    }

    pub fn backing(&self) -> &dyn BackingFile {
        self.file.as_ref()
    }

    pub fn is_open(&self, segment: SegmentId) -> bool {
        self.open.as_ref().is_some_and(|open| open.id == segment)
    }

    /// Garbage: dead slots in sealed segments.
    fn dead_sealed_blocks(&self) -> u64 {
        let sealed_slots = u64::from(self.sealed_segments) * BLOCKS_PER_SEGMENT as u64;
        let live_in_open = self.open.as_ref().map_or(0, |open| u64::from(self.segments[open.id.0 as usize].live));
        sealed_slots.saturating_sub(self.live_blocks - live_in_open)
    }

    fn free_segments_left(&self) -> Option<u64> {
        self.max_segments.map(|max| {
            let in_use = (self.segments.len() - self.free.len() - self.kept.len()) as u64 - self.given_up;
            // A log recovered under a lower `--spill-max` than it was written under holds more.
            u64::from(max).saturating_sub(in_use)
        })
    }

    /// Whether any sealed segment has a dead slot that compaction could reclaim.
    pub fn has_garbage(&self) -> bool {
        self.dead_sealed_blocks() > 0
    }

    /// Whether compaction would pay: garbage is worth at least a segment, and either space is
    /// running low or garbage outweighs live data (space amplification above 2×).
    pub fn wants_compaction(&self) -> bool {
        let dead = self.dead_sealed_blocks();
        if dead < BLOCKS_PER_SEGMENT as u64 {
            return false;
        }
        let low_space = self.free_segments_left().is_some_and(|left| left <= 2);
        low_space || dead > self.live_blocks
    }

    /// The sealed segment with the fewest live slots, if it has any dead ones. Not one with no
    /// live slot: that one is still being written (or its write failed), is freed once written,
    /// and moving nothing out of it would not free it sooner (compaction would spin on it).
    pub fn compaction_victim(&self) -> Option<SegmentId> {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == SegmentState::Sealed && s.live > 0 && (s.live as usize) < BLOCKS_PER_SEGMENT)
            .min_by_key(|(_, s)| s.live)
            .map(|(i, _)| SegmentId(i as u32))
    }

    /// Reads a whole sealed segment in one sequential read, with its slot owners, for compaction.
    pub fn segment_owners(&self, id: SegmentId) -> Vec<BlockIndex> {
        self.segments[id.0 as usize].owners.clone()
    }

    /// Reads consecutive slots of a sealed segment, from `first_slot` on, in one read.
    pub fn read_slots(&mut self, id: SegmentId, first_slot: usize, buf: &mut [u8], stats: &VmStats) -> Result<()> {
        let start = first_slot * BLOCK_SIZE;
        // Counted as read from the file either way, like a block read (see `read`).
        stats.spill_read.add(buf.len() as u64);
        if let Some(writing) = self.writing.as_ref().filter(|writing| writing.id == id) {
            for (block, page) in buf.chunks_exact_mut(BLOCK_SIZE).zip(&writing.pages[first_slot..]) {
                block.copy_from_slice(&page[..]);
            }
            return Ok(());
        }
        self.file
            .read_at(buf, id.byte_offset() + start as u64)
            .map_err(|e| EngineError::from_io("reading spill segment", e))
    }

    /// Appends a copy of a block. On error nothing changed: the block is not in the log.
    pub fn append(&mut self, owner: Owner, data: &Block, purpose: Purpose, stats: &VmStats) -> Result<SpillAddr> {
        let page = self.arena.alloc_copy(data)?;
        page.set_owner(owner);
        self.reserve(purpose, stats)?;
        Ok(self.push(owner.block, page))
    }

    /// Makes room for one block in the open segment: seals a full one and opens the next. On
    /// error nothing changed. [`Self::push`] then cannot fail, so a caller can move a page in
    /// only once there is room for it.
    pub fn reserve(&mut self, purpose: Purpose, stats: &VmStats) -> Result<()> {
        self.settle_write(false, stats)?;
        let full = self.open.as_ref().is_some_and(|open| open.pages.len() == BLOCKS_PER_SEGMENT);
        if full {
            self.seal(stats)?;
        }
        if self.open.is_none() {
            let id = self.allocate(purpose)?;
            self.open = Some(OpenSegment { id, pages: Vec::with_capacity(BLOCKS_PER_SEGMENT) });
        }
        Ok(())
    }

    /// Puts a block's page in the open segment, which [`Self::reserve`] made room in.
    pub fn push(&mut self, owner: BlockIndex, page: Page) -> SpillAddr {
        let open = self.open.as_mut().expect("reserve opened a segment");
        let segment = &mut self.segments[open.id.0 as usize];
        let slot = open.pages.len();
        debug_assert!(slot < BLOCKS_PER_SEGMENT, "reserve sealed a full segment");
        open.pages.push(page);
        segment.owners.push(owner);
        segment.live += 1;
        self.live_blocks += 1;
        // Slots are below BLOCKS_PER_SEGMENT (512).
        SpillAddr { segment: open.id, slot: slot as u16 }
    }

    fn allocate(&mut self, purpose: Purpose) -> Result<SegmentId> {
        if let Some(left) = self.free_segments_left() {
            let reserve = match purpose {
                Purpose::Guest => 1,
                Purpose::Compaction => 0,
            };
            if left <= reserve {
                return Err(EngineError::NoSpace(format!("spill limit of {} bytes reached", self.disk_size_bytes())));
            }
        }
        let id = match self.kept.pop().or_else(|| self.free.pop().map(|Reverse(id)| id)) {
            Some(id) => id,
            None => {
                if self.segments.len() >= MAX_SPILL_SEGMENTS as usize {
                    return Err(EngineError::NoSpace(
                        "the spill log has the most segments a VM may have (4 TiB)".into(),
                    ));
                }
                self.segments.push(Segment { state: SegmentState::Free, live: 0, owners: Vec::new() });
                // Below MAX_SPILL_SEGMENTS, checked above.
                (self.segments.len() - 1) as u32
            }
        };
        self.lean_opens_left = self.lean_opens_left.saturating_sub(1);
        let segment = &mut self.segments[id as usize];
        debug_assert_eq!(segment.state, SegmentState::Free);
        segment.state = SegmentState::Open;
        segment.owners = Vec::with_capacity(BLOCKS_PER_SEGMENT);
        self.owner_tables += 1;
        Ok(SegmentId(id))
    }

    /// Starts writing the open segment out in one piece, after the one before it is written.
    /// An error (of this write, if the file writes before returning, or of the one before) is
    /// returned with nothing lost: the data stays readable in memory.
    fn seal(&mut self, stats: &VmStats) -> Result<()> {
        self.settle_write(true, stats)?;
        let Some(open) = self.open.take() else { return Ok(()) };
        let id = open.id;
        let pages = Arc::new(open.pages);
        let mut write = self.file.start_segment_write(&pages, id.byte_offset());
        self.segments[id.0 as usize].state = SegmentState::Sealed;
        self.sealed_segments += 1;
        if write.is_finished() {
            let done = write.wait().map_err(|e| EngineError::from_io("writing spill segment", e));
            match done.and_then(|()| self.summarize(id, &pages)) {
                Ok(()) => {
                    self.written(id, stats);
                    self.free_pages(pages);
                }
                Err(error) => {
                    self.writing = Some(Writing { id, pages, write: None });
                    return Err(error);
                }
            }
        } else {
            self.writing = Some(Writing { id, pages, write: Some(write) });
        }
        Ok(())
    }

    /// Waits for the segment being written, if any, so that it is counted; for a VM that ends.
    pub fn finish_writes(&mut self, stats: &VmStats) -> Result<()> {
        self.settle_write(true, stats)
    }

    /// Deals with the segment being written, if any: once its write is done it is retired; a
    /// failed write is tried again here, synchronously. With `wait`, waits for a running write.
    /// On error the segment stays in memory, readable, to be tried again next time.
    fn settle_write(&mut self, wait: bool, stats: &VmStats) -> Result<()> {
        let Some(mut writing) = self.writing.take() else { return Ok(()) };
        if !wait && writing.write.as_mut().is_some_and(|write| !write.is_finished()) {
            self.writing = Some(writing);
            return Ok(());
        }
        // `None`: it failed before; try again.
        let written = writing.write.take().is_some_and(|write| match write.wait() {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(%error, segment = writing.id.0, "spill segment write failed; trying again");
                false
            }
        });
        if !written && self.segments[writing.id.0 as usize].live == 0 {
            self.drop_failed_write(writing);
            return Ok(());
        }
        let result = if written { Ok(()) } else { self.file.write_pages_at(&writing.pages, writing.id.byte_offset()) };
        let result = result
            .map_err(|e| EngineError::from_io("writing spill segment", e))
            .and_then(|()| self.summarize(writing.id, &writing.pages));
        match result {
            Ok(()) => {
                self.written(writing.id, stats);
                self.free_pages(writing.pages);
                Ok(())
            }
            Err(error) => {
                self.writing = Some(writing);
                Err(error)
            }
        }
    }

    /// A segment whose write failed and whose blocks have all died (overwritten, trimmed):
    /// nothing in it is wanted, so it is not written again. Its place in the file is punched
    /// and never used again by this log (a recovery in a next process finds it free): an error
    /// that stays on that part of the file (a bad stretch of the disk) would otherwise fail every
    /// segment put there, and a failed write holds up every segment after it.
    fn drop_failed_write(&mut self, writing: Writing) {
        let id = writing.id;
        tracing::warn!(
            segment = id.0,
            "a spill segment that could not be written holds nothing live: its place is given up"
        );
        self.free_pages(writing.pages);
        self.unseal(id);
        self.given_up += 1;
        if let Err(error) = self.file.punch_hole(id.byte_offset(), SEGMENT_BYTES as u64) {
            tracing::debug!(%error, segment = id.0, "could not punch a spill segment given up");
        }
    }

    /// A written segment's pages, back to the arena at once; if a writer still holds them,
    /// they are freed one by one when the last holder lets go.
    fn free_pages(&self, pages: Arc<SegmentPages>) {
        if let Ok(pages) = Arc::try_unwrap(pages) {
            self.arena.free_all(pages);
        }
    }

    /// A segment is on disk: counted (its pages are the caller's to free).
    fn written(&mut self, id: SegmentId, stats: &VmStats) {
        stats.spill_write.add(SEGMENT_BYTES as u64);
        stats.spill_write_sizes.record(SEGMENT_BYTES as u64);
        stats.spill_segments_written.inc();
        if stats.spill_segments_written.get() == 1 {
            // Once per VM at info: the moment its working set outgrew its RAM target.
            tracing::info!(segment = id.0, "VM started spilling to disk");
        } else {
            tracing::debug!(segment = id.0, live = self.segments[id.0 as usize].live, "spill segment written");
        }
        if self.segments[id.0 as usize].live == 0 {
            // Everything in it died while it was open or being written.
            self.free_segment(id, stats);
        }
    }

    /// Reads blocks that lie next to each other in one segment, `first` and the ones after it,
    /// into `buf` (whole blocks): one read of the file, or copies while the segment is still in
    /// memory. A guest reading back what it wrote in one go finds it this way, since a segment
    /// is filled in the order blocks come.
    pub fn read_run(&mut self, first: SpillAddr, buf: &mut [u8], stats: &VmStats) -> Result<()> {
        debug_assert!(buf.len().is_multiple_of(BLOCK_SIZE));
        debug_assert!(usize::from(first.slot) + buf.len() / BLOCK_SIZE <= BLOCKS_PER_SEGMENT);
        let start = usize::from(first.slot);
        if let Some(open) = self.open.as_ref().filter(|open| open.id == first.segment) {
            for (i, block) in buf.chunks_exact_mut(BLOCK_SIZE).enumerate() {
                block.copy_from_slice(&open.pages[start + i][..]);
            }
            return Ok(());
        }
        if let Some(writing) = self.writing.as_ref().filter(|writing| writing.id == first.segment) {
            // Counted as reads of the file: the blocks are in the file as far as the VM is
            // concerned, and the figure must not depend on whether the write has finished yet.
            for (i, block) in buf.chunks_exact_mut(BLOCK_SIZE).enumerate() {
                block.copy_from_slice(&writing.pages[start + i][..]);
            }
            stats.spill_read.add(buf.len() as u64);
            return Ok(());
        }
        self.file.read_at(buf, first.byte_offset()).map_err(|e| EngineError::from_io("reading spill blocks", e))?;
        stats.spill_read.add(buf.len() as u64);
        Ok(())
    }

    /// Overwrites a block of the open segment in memory; the caller checked [`Self::is_open`].
    pub fn overwrite_open(&mut self, addr: SpillAddr, data: &Block) {
        let open = self.open.as_mut().expect("caller checked the segment is open");
        debug_assert_eq!(open.id, addr.segment);
        crate::crash::point();
        open.pages[usize::from(addr.slot)].copy_from_slice(data);
    }

    /// Marks a slot dead. A sealed segment with no live slot left is punched out of the file;
    /// one still being written is waited for first (so that it is free now, as it would be had
    /// the write been quicker; compaction relies on each victim coming free).
    pub fn release(&mut self, addr: SpillAddr, stats: &VmStats) {
        let segment = &mut self.segments[addr.segment.0 as usize];
        debug_assert!(segment.live > 0);
        segment.live -= 1;
        self.live_blocks -= 1;
        if segment.live > 0 || segment.state != SegmentState::Sealed {
            return;
        }
        if self.writing.as_ref().is_some_and(|writing| writing.id == addr.segment) {
            // Once written it is freed; if the write failed, it stays until a retry succeeds.
            if let Err(error) = self.settle_write(true, stats) {
                tracing::debug!(%error, "a dead spill segment could not be written");
            }
        } else {
            self.free_segment(addr.segment, stats);
        }
    }

    /// A sealed segment with no live slot: kept for reuse, and the oldest kept ones punched
    /// when there are more than [`Self::kept_limit`].
    fn free_segment(&mut self, id: SegmentId, stats: &VmStats) {
        self.unseal(id);
        self.kept.push(id.0);
        self.punch_kept_beyond(self.kept_limit(), stats);
    }

    /// A sealed segment holds nothing any more: its summary cleared (a recovery finds no copy
    /// there), its owner table dropped; the caller says where its id goes.
    fn unseal(&mut self, id: SegmentId) {
        if let Some(summaries) = &mut self.summaries {
            summaries.clear(id.0);
        }
        let segment = &mut self.segments[id.0 as usize];
        segment.state = SegmentState::Free;
        segment.owners = Vec::new();
        self.owner_tables -= 1;
        self.sealed_segments -= 1;
    }

    /// Punches the oldest kept segments until at most `limit` are left.
    fn punch_kept_beyond(&mut self, limit: usize, stats: &VmStats) {
        if self.kept.len() > limit {
            for oldest in self.kept.drain(..self.kept.len() - limit).collect::<Vec<_>>() {
                self.punch(oldest, stats);
            }
        }
    }

    /// Gives back the kept segments beyond the few always kept: the VM is about to wait (its
    /// connection lost, its overlay in grace), and space held for writes that are not coming
    /// may be wanted by another VM, which a VM without a connection would not hear of (see
    /// [`Self::heed_space_shortages`]).
    pub fn give_back_spare_kept(&mut self, stats: &VmStats) {
        self.punch_kept_beyond(KEPT_FREE_SEGMENTS, stats);
    }

    /// How many free segments stay allocated: [`KEPT_FREE_SEGMENTS`], or as many as leave the
    /// file (sealed and kept segments) within twice its live data, which is as much garbage as
    /// compaction lets stand (it starts once dead slots outnumber live ones): the log grows back
    /// into that space before compaction would run again, so a punch there is paid twice for
    /// nothing. Random 4 KiB overwrites of a 512 MiB disk with a 16 MiB RAM target freed segments
    /// in bursts of up to 248 at a time; with four kept, 973 of 1,425 segments written were
    /// punched and refilled, at 184-187k IOPS; with this limit none, at 204-205k
    /// (docs/performance.md). For a while after a file on the filesystem was refused space,
    /// only the few: the space is wanted elsewhere.
    fn kept_limit(&self) -> usize {
        if self.lean_opens_left > 0 {
            return KEPT_FREE_SEGMENTS;
        }
        let live_segments = self.live_blocks.div_ceil(BLOCKS_PER_SEGMENT as u64);
        let room = (2 * live_segments).saturating_sub(u64::from(self.sealed_segments));
        KEPT_FREE_SEGMENTS.max(usize::try_from(room).unwrap_or(usize::MAX))
    }

    /// Gives the kept free segments back if some file on the filesystem was refused space since
    /// this log last did: another VM may need the space more than this one needs to skip a
    /// punch; and keeps only the few for its next [`LEAN_OPENS_AFTER_SHORTAGE`] segments. Called
    /// on every write, so a VM that goes on writing hears of it at once; one that writes nothing
    /// gives its kept segments back anyway once its client is quiet for a while
    /// ([`Self::give_back_kept`]) or its connection is lost (all but the few,
    /// [`Self::give_back_spare_kept`]).
    pub fn heed_space_shortages(&mut self, stats: &VmStats) {
        let shortages = self.file.space_shortages();
        if shortages != self.shortages_heeded {
            self.shortages_heeded = shortages;
            self.lean_opens_left = LEAN_OPENS_AFTER_SHORTAGE;
            if !self.kept.is_empty() {
                tracing::debug!(kept = self.kept.len(), "spill filesystem full somewhere: kept segments given back");
                self.give_back_kept(stats);
            }
        }
    }

    /// Punches every kept free segment: the guest gave blocks back (TRIM), or has been quiet
    /// for a while, so the host gets the disk space back now rather than when the VM next
    /// spills.
    pub fn give_back_kept(&mut self, stats: &VmStats) {
        self.punch_kept_beyond(0, stats);
    }

    fn punch(&mut self, id: u32, stats: &VmStats) {
        self.free.push(Reverse(id));
        // A failed punch only leaves space allocated: the data there is dead either way, so the
        // guest need not hear of it.
        match self.file.punch_hole(SegmentId(id).byte_offset(), SEGMENT_BYTES as u64) {
            Ok(()) => stats.spill_segments_punched.inc(),
            Err(error) => tracing::warn!(%error, segment = id, "could not punch spill segment"),
        }
    }
}

impl Drop for SpillLog {
    fn drop(&mut self) {
        // The file goes with the log: let a write still running finish first, so that its space
        // is given back when the file is removed, not some time after.
        if let Some(write) = self.writing.take().and_then(|writing| writing.write) {
            let _ = write.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Mutex};

    use super::*;
    use crate::store::MemFile;

    type Held = Arc<Mutex<Vec<(Arc<SegmentPages>, u64, mpsc::SyncSender<io::Result<()>>)>>>;

    /// A file whose segment writes run "in the background" until the test finishes them, and
    /// whose ordinary writes (the log's retries) fail while `full` is set.
    struct HeldWrites {
        file: MemFile,
        held: Held,
        full: Arc<AtomicBool>,
    }

    impl BackingFile for HeldWrites {
        fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
            if self.full.load(Ordering::Relaxed) {
                return Err(io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()));
            }
            self.file.write_at(data, offset)
        }
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.file.read_at(buf, offset)
        }
        fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()> {
            self.file.punch_hole(offset, len)
        }
        fn allocated_bytes(&self) -> io::Result<u64> {
            self.file.allocated_bytes()
        }
        fn path(&self) -> Option<&std::path::Path> {
            None
        }
        fn start_segment_write(&mut self, pages: &Arc<SegmentPages>, offset: u64) -> SegmentWrite {
            let (done, result) = mpsc::sync_channel(1);
            self.held.lock().expect("lock").push((Arc::clone(pages), offset, done));
            SegmentWrite::running(result)
        }
    }

    fn test_arena() -> Arena {
        Arena::in_memory(1 << 16).expect("arena")
    }

    fn block(i: u64) -> Block {
        [(i % 251) as u8 + 1; BLOCK_SIZE]
    }

    fn read(log: &mut SpillLog, addr: SpillAddr, stats: &VmStats) -> Block {
        let mut buf = [0u8; BLOCK_SIZE];
        log.read_run(addr, &mut buf, stats).expect("read");
        buf
    }

    /// A log over a file that holds its segment writes, filled with one segment and one block:
    /// the first segment sealed and its write held, the next one open.
    fn one_segment_being_written(full: bool) -> (SpillLog, Held, Arc<AtomicBool>, VmStats, Vec<SpillAddr>) {
        let held: Held = Arc::default();
        let full = Arc::new(AtomicBool::new(full));
        let file = HeldWrites { file: MemFile::default(), held: held.clone(), full: full.clone() };
        let stats = VmStats::default();
        let mut log = SpillLog::new(Box::new(file), None, test_arena()).expect("log");
        let addrs: Vec<SpillAddr> = (0..=BLOCKS_PER_SEGMENT as u64)
            .map(|i| {
                log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, &stats).expect("append")
            })
            .collect();
        (log, held, full, stats, addrs)
    }

    /// A segment whose blocks all died while it was open is still sealed and written; if that
    /// write fails, it is not tried again (on a full disk the retry failed the next append).
    #[test]
    fn a_segment_dead_before_its_background_write_failed_is_not_tried_again() {
        let held: Held = Arc::default();
        let full = Arc::new(AtomicBool::new(true));
        let file = HeldWrites { file: MemFile::default(), held: held.clone(), full };
        let stats = VmStats::default();
        let mut log = SpillLog::new(Box::new(file), None, test_arena()).expect("log");
        let append = |log: &mut SpillLog, i: u64| {
            log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, &stats)
        };
        for i in 0..BLOCKS_PER_SEGMENT as u64 {
            let addr = append(&mut log, i).expect("append");
            log.release(addr, &stats);
        }
        append(&mut log, 9000).expect("seals the dead segment; its write runs");
        let (_, _, done) = held.lock().expect("lock").pop().expect("held write");
        done.send(Err(io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()))).expect("send");
        append(&mut log, 9001).expect("nothing in the failed segment lives: not written again");
        assert_eq!(stats.spill_segments_written.get(), 0);
    }

    #[test]
    fn a_segment_being_written_is_read_from_memory_and_a_failed_write_keeps_it_until_a_retry_succeeds() {
        let (mut log, held, full, stats, addrs) = one_segment_being_written(false);
        // The first segment is sealed and its write is running; the last block opened the next.
        assert_eq!(held.lock().expect("lock").len(), 1);
        assert_eq!(stats.spill_segments_written.get(), 0, "not counted before it is written");
        let memory = log.memory_bytes();
        assert!(memory >= SEGMENT_BYTES as u64, "the open segment counts whole");
        assert!(memory < 2 * SEGMENT_BYTES as u64, "the segment being written is the host's, not the VM's");
        assert_eq!(read(&mut log, addrs[7], &stats), block(7), "read from the pages being written");

        // The background write fails, and so does the retry: the append gets ENOSPC, data stays.
        let (_, _, done) = held.lock().expect("lock").pop().expect("held write");
        done.send(Err(io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()))).expect("send");
        full.store(true, Ordering::Relaxed);
        let refused = log.append(Owner { block: BlockIndex(9999), seq: 1 }, &block(9999), Purpose::Guest, &stats);
        assert!(matches!(refused, Err(EngineError::NoSpace(_))), "{refused:?}");
        assert_eq!(read(&mut log, addrs[7], &stats), block(7), "a failed write loses nothing");
        assert_eq!(read(&mut log, addrs[BLOCKS_PER_SEGMENT], &stats), block(BLOCKS_PER_SEGMENT as u64));

        // Space comes back: the next append retries, succeeds, and the segment reads from disk.
        full.store(false, Ordering::Relaxed);
        log.append(Owner { block: BlockIndex(9999), seq: 1 }, &block(9999), Purpose::Guest, &stats)
            .expect("append after the retry");
        assert_eq!(stats.spill_segments_written.get(), 1);
        assert_eq!(read(&mut log, addrs[7], &stats), block(7), "read back from the file");
    }

    /// A VM's log recovered by a server started with a lower `--spill-max` than the one it
    /// spilled under holds more than the limit: its next spill is refused (the subtraction
    /// once overflowed: a panic in debug builds, no limit at all in release ones).
    #[test]
    fn a_log_recovered_over_more_segments_than_its_limit_refuses_the_next_spill() {
        let stats = VmStats::default();
        let log =
            SpillLog::new(Box::new(MemFile::default()), Some(4 * SEGMENT_BYTES as u64), test_arena()).expect("log");
        let sealed = (0..6u32)
            .map(|id| {
                let first = u64::from(id) * BLOCKS_PER_SEGMENT as u64;
                (id, (first..first + BLOCKS_PER_SEGMENT as u64).map(BlockIndex).collect(), 1)
            })
            .collect();
        let mut log = log.recovered(6, sealed, &stats).expect("recovered");
        let refused = log.append(Owner { block: BlockIndex(1 << 20), seq: 1 }, &block(1), Purpose::Guest, &stats);
        assert!(matches!(refused, Err(EngineError::NoSpace(_))), "{refused:?}");
    }

    /// A segment whose background write failed stays in the VM's memory beside the segment
    /// opened after it: both count.
    #[test]
    fn a_failed_segment_and_the_open_one_both_count_in_memory() {
        let (mut log, held, full, stats, _) = one_segment_being_written(true);
        let (_, _, done) = held.lock().expect("lock").pop().expect("held write");
        done.send(Err(io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()))).expect("send");
        let refused = log.append(Owner { block: BlockIndex(9999), seq: 1 }, &block(9999), Purpose::Guest, &stats);
        assert!(matches!(refused, Err(EngineError::NoSpace(_))), "{refused:?}");
        assert!(log.memory_bytes() >= 2 * SEGMENT_BYTES as u64, "{} bytes", log.memory_bytes());
        full.store(false, Ordering::Relaxed);
    }

    /// A kept segment (dead, its bytes still on disk) reused as the open one, then trimmed
    /// with everything else: its space is given back too.
    #[test]
    fn a_kept_segment_reopened_and_emptied_gives_its_space_back() {
        let stats = VmStats::default();
        let mut log = SpillLog::new(Box::new(MemFile::default()), None, test_arena()).expect("log");
        let append = |log: &mut SpillLog, i: u64| {
            log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, &stats).expect("append")
        };
        let first: Vec<SpillAddr> = (0..BLOCKS_PER_SEGMENT as u64).map(|i| append(&mut log, i)).collect();
        let mut live = vec![append(&mut log, 100_000)];
        for addr in first {
            log.release(addr, &stats);
        }
        live.extend((0..BLOCKS_PER_SEGMENT as u64).map(|i| append(&mut log, 200_000 + i)));
        for addr in live {
            log.release(addr, &stats);
        }
        log.release_pages_if_empty(&stats);
        assert_eq!(log.disk_used_bytes(), 0);
        assert_eq!(log.backing().allocated_bytes().expect("allocated"), 0, "space left behind on disk");
    }

    #[test]
    fn a_segment_that_dies_while_being_written_is_freed_once_written() {
        let (mut log, held, _, stats, addrs) = one_segment_being_written(false);
        for addr in &addrs[..BLOCKS_PER_SEGMENT - 1] {
            log.release(*addr, &stats);
        }
        assert_eq!(stats.spill_segments_punched.get(), 0);
        // The last release waits for the write, which the "disk" finishes a little later.
        let disk = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let (pages, offset, done) = held.lock().expect("lock").pop().expect("held write");
            assert_eq!(offset, 0);
            drop(pages);
            done.send(Ok(())).expect("send");
        });
        log.release(addrs[BLOCKS_PER_SEGMENT - 1], &stats);
        disk.join().expect("disk thread");
        assert_eq!(stats.spill_segments_written.get(), 1);
        assert_eq!(log.disk_used_bytes(), SEGMENT_BYTES as u64, "freed once written, and kept for reuse");
        log.give_back_kept(&stats);
        assert_eq!(stats.spill_segments_punched.get(), 1);
        assert_eq!(log.disk_used_bytes(), 0);
    }

    #[test]
    fn a_segment_whose_write_failed_and_whose_blocks_all_died_is_no_compaction_victim() {
        let (mut log, held, full, stats, addrs) = one_segment_being_written(true);
        let (_, _, done) = held.lock().expect("lock").pop().expect("held write");
        done.send(Err(io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()))).expect("send");
        // The guest trims everything while the disk is still full: the failed segment holds
        // nothing live and is given up at once, not kept as garbage (an overlay's compaction
        // loop once picked such a segment, moved nothing, and spun).
        for addr in &addrs {
            log.release(*addr, &stats);
        }
        assert!(!log.wants_compaction(), "no garbage left");
        assert_eq!(log.compaction_victim(), None);
        full.store(false, Ordering::Relaxed);
        log.finish_writes(&stats).expect("nothing left to write");
        assert_eq!(log.disk_used_bytes(), 0, "nothing in it lives: given up, never written");
        assert_eq!(stats.spill_segments_written.get(), 0);
    }

    #[test]
    fn dead_segments_are_written_over_the_latest_first_and_only_a_few_are_kept() {
        let stats = VmStats::default();
        let mut log = SpillLog::new(Box::new(MemFile::default()), None, test_arena()).expect("log");
        let segments = KEPT_FREE_SEGMENTS + 3;
        let mut addrs = Vec::new();
        for i in 0..(segments * BLOCKS_PER_SEGMENT) as u64 {
            addrs.push(
                log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, &stats).expect("append"),
            );
        }
        // One more block seals the last full segment.
        let extra = (segments * BLOCKS_PER_SEGMENT) as u64;
        addrs.push(
            log.append(Owner { block: BlockIndex(extra), seq: 1 }, &block(extra), Purpose::Guest, &stats)
                .expect("append"),
        );
        assert_eq!(stats.spill_segments_written.get(), segments as u64);
        // Every segment but the last dies, in order.
        for addr in &addrs[..(segments - 1) * BLOCKS_PER_SEGMENT] {
            log.release(*addr, &stats);
        }
        let died = segments as u64 - 1;
        assert_eq!(stats.spill_segments_punched.get(), died - KEPT_FREE_SEGMENTS as u64, "the oldest punched");
        let on_disk = 1 + KEPT_FREE_SEGMENTS as u64;
        assert_eq!(log.disk_used_bytes(), on_disk * SEGMENT_BYTES as u64, "kept segments count as used");
        // The open segment fills up and the next one opens where the last one died.
        let base = extra + 1;
        for i in base..base + BLOCKS_PER_SEGMENT as u64 {
            log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, &stats).expect("append");
        }
        let opened = log.open.as_ref().map(|open| open.id).expect("an open segment");
        assert_eq!(opened, SegmentId(died as u32 - 1), "the segment that died last is reused first");
        let live = (segments - 1) * BLOCKS_PER_SEGMENT;
        assert!(read(&mut log, addrs[live], &stats) == block(live as u64), "the live sealed segment reads back");
        log.give_back_kept(&stats);
        assert_eq!(stats.spill_segments_punched.get(), died - 1, "all but the reused one punched");
        assert_eq!(log.disk_used_bytes(), 2 * SEGMENT_BYTES as u64, "the live sealed segment and the reused one");
    }

    /// Appends `segments` full segments and one block more (which seals the last), from block 0.
    fn filled(log: &mut SpillLog, segments: usize, stats: &VmStats) -> Result<Vec<SpillAddr>> {
        (0..=(segments * BLOCKS_PER_SEGMENT) as u64)
            .map(|i| log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, stats))
            .collect()
    }

    /// Segments freed while the file is within twice its live data stay allocated for the log
    /// to grow back into; past that, the oldest are punched down to what that allows, or to the
    /// few always kept. A VM about to wait keeps only the few.
    #[test]
    fn free_segments_are_kept_within_twice_the_live_data_and_punched_beyond() {
        let segment = SEGMENT_BYTES as u64;
        let with_ten_dead = |stats: &VmStats| {
            let mut log = SpillLog::new(Box::new(MemFile::default()), None, test_arena()).expect("log");
            let addrs = filled(&mut log, 20, stats).expect("append");
            for addr in &addrs[..10 * BLOCKS_PER_SEGMENT] {
                log.release(*addr, stats);
            }
            (log, addrs)
        };
        let slots = |addrs: &[SpillAddr], n: usize, range: std::ops::Range<usize>| -> Vec<SpillAddr> {
            range.map(|slot| addrs[n * BLOCKS_PER_SEGMENT + slot]).collect()
        };

        let stats = VmStats::default();
        let (mut log, addrs) = with_ten_dead(&stats);
        // 10 sealed segments and a block live: 11 segments' worth allow 22 on disk.
        assert_eq!(stats.spill_segments_punched.get(), 0, "within twice the live data nothing is punched");
        assert_eq!(log.disk_used_bytes(), 20 * segment, "10 sealed and 10 kept");
        // Half of segments 10-17 dies (garbage, no segment freed), then the rest of segment 10.
        for n in 10..18 {
            for addr in slots(&addrs, n, 0..BLOCKS_PER_SEGMENT / 2) {
                log.release(addr, &stats);
            }
        }
        assert_eq!(stats.spill_segments_punched.get(), 0, "nothing punched until a segment is freed");
        for addr in slots(&addrs, 10, BLOCKS_PER_SEGMENT / 2..BLOCKS_PER_SEGMENT) {
            log.release(addr, &stats);
        }
        // 9 sealed, 5.5 segments' worth live (6 rounded up): 12 on disk at most, so 3 kept, and
        // the floor of 4 holds: 7 of the 11 kept are punched.
        assert_eq!(stats.spill_segments_punched.get(), 7);
        assert_eq!(log.disk_used_bytes(), (9 + KEPT_FREE_SEGMENTS as u64) * segment);
        let last = 19 * BLOCKS_PER_SEGMENT + 7;
        assert!(read(&mut log, addrs[last], &stats) == block(last as u64), "live data reads back");

        let stats = VmStats::default();
        let (mut log, _) = with_ten_dead(&stats);
        log.give_back_spare_kept(&stats);
        assert_eq!(stats.spill_segments_punched.get(), 10 - KEPT_FREE_SEGMENTS as u64);
        assert_eq!(log.disk_used_bytes(), (10 + KEPT_FREE_SEGMENTS as u64) * segment);
    }

    /// After hearing of a shortage, a VM keeps only the few free segments for a while, however
    /// many its live data would allow.
    #[test]
    fn after_a_shortage_only_the_few_are_kept() {
        use crate::faults::{FaultPlan, FaultyFile, SpaceLimit};
        let disk = SpaceLimit::new(18 * SEGMENT_BYTES as u64);
        let on_disk = |seed| {
            let file = FaultyFile::new(Box::new(MemFile::default()), FaultPlan::new(seed));
            Box::new(file.with_space_limit(Arc::clone(&disk)))
        };
        let (stats_a, stats_b) = (VmStats::default(), VmStats::default());
        let mut b = SpillLog::new(on_disk(1), None, test_arena()).expect("log");
        let addrs = filled(&mut b, 16, &stats_b).expect("room for B");
        let free_segments = |b: &mut SpillLog, segments: std::ops::Range<usize>| {
            for addr in &addrs[segments.start * BLOCKS_PER_SEGMENT..segments.end * BLOCKS_PER_SEGMENT] {
                b.release(*addr, &stats_b);
            }
        };
        free_segments(&mut b, 0..6);
        assert_eq!(stats_b.spill_segments_punched.get(), 0, "6 kept: 10 sealed, 22 allowed");
        let mut a = SpillLog::new(on_disk(2), None, test_arena()).expect("log");
        filled(&mut a, 2, &stats_a).expect("room for two segments");
        let refused = (0..BLOCKS_PER_SEGMENT as u64).try_for_each(|i| {
            a.append(Owner { block: BlockIndex(1 << 20 | i), seq: 1 }, &block(i), Purpose::Guest, &stats_a).map(|_| ())
        });
        assert!(matches!(refused, Err(EngineError::NoSpace(_))), "the disk is full: {refused:?}");
        b.heed_space_shortages(&stats_b);
        assert_eq!(stats_b.spill_segments_punched.get(), 6, "all kept given back");
        // Six more die: their live data would allow 8 kept, the shortage allows the few.
        free_segments(&mut b, 6..12);
        assert_eq!(stats_b.spill_segments_punched.get(), 6 + 6 - KEPT_FREE_SEGMENTS as u64);
        assert_eq!(b.disk_used_bytes(), (4 + KEPT_FREE_SEGMENTS as u64) * SEGMENT_BYTES as u64);
    }

    #[test]
    fn a_vm_out_of_shared_space_makes_the_others_give_their_kept_segments_back() {
        use crate::faults::{FaultPlan, FaultyFile, SpaceLimit};
        let segment = SEGMENT_BYTES as u64;
        let disk = SpaceLimit::new(6 * segment);
        let on_disk = |seed| {
            let file = FaultyFile::new(Box::new(MemFile::default()), FaultPlan::new(seed));
            Box::new(file.with_space_limit(Arc::clone(&disk)))
        };
        let fill = |log: &mut SpillLog, segments: usize, stats: &VmStats| -> Result<Vec<SpillAddr>> {
            // One block more than the segments: the last one full is sealed, and written.
            (0..=(segments * BLOCKS_PER_SEGMENT) as u64)
                .map(|i| log.append(Owner { block: BlockIndex(i), seq: 1 }, &block(i), Purpose::Guest, stats))
                .collect()
        };
        let (stats_b, stats_a) = (VmStats::default(), VmStats::default());
        // VM B writes three segments, then overwrites them all: they stay allocated, kept.
        let mut b = SpillLog::new(on_disk(1), None, test_arena()).expect("log");
        let addrs = fill(&mut b, 3, &stats_b).expect("room for B");
        for addr in &addrs[..3 * BLOCKS_PER_SEGMENT] {
            b.release(*addr, &stats_b);
        }
        b.heed_space_shortages(&stats_b);
        assert_eq!(b.disk_used_bytes(), 3 * segment, "kept while nobody is short of space");
        assert_eq!(disk.used_bytes(), 3 * segment);
        // VM A fills what is left and is refused its fourth segment.
        let mut a = SpillLog::new(on_disk(2), None, test_arena()).expect("log");
        fill(&mut a, 3, &stats_a).expect("room for three segments");
        let refused = (0..BLOCKS_PER_SEGMENT as u64).try_for_each(|i| {
            a.append(Owner { block: BlockIndex(1 << 20 | i), seq: 1 }, &block(i), Purpose::Guest, &stats_a).map(|_| ())
        });
        assert!(matches!(refused, Err(EngineError::NoSpace(_))), "the disk is full: {refused:?}");
        assert!(a.finish_writes(&stats_a).is_err(), "still full while B keeps its dead segments");
        // B's next write hears of it and punches them; A's retry then fits.
        b.heed_space_shortages(&stats_b);
        assert_eq!(stats_b.spill_segments_punched.get(), 3);
        assert_eq!(b.disk_used_bytes(), 0);
        a.finish_writes(&stats_a).expect("the retry fits in the space B gave back");
        assert_eq!(a.disk_used_bytes(), 4 * segment);
    }
}
