//! One VM's copy-on-write overlay over a golden image.
//!
//! Each 4 KiB block of the virtual disk is in exactly one state:
//! - **absent**: never written (or trimmed); reads come from the golden image;
//! - **zero**: covered by a zeroed range and not in the map; reads as zeroes, stores nothing;
//! - **ram**: a page in the RAM tier;
//! - **spill**: a slot of the spill log (a page of the open segment, or on disk);
//! - **file**: at its own offset in an in-place cache file (modes `disk` and `shared`).
//!
//! The block map holds the ram, spill and file states and wins over the zeroed ranges, so that a
//! write into a zeroed range needs no range split. Lookups return a plan ([`Source`]); the I/O runs
//! after. Unaligned requests are cut into head, whole blocks and tail in one place
//! ([`block_spans`]); a partial block is read, patched and stored whole, so a 4 KiB guest write
//! costs at most one 4 KiB read, never a segment rewrite.
//!
//! Writes in `ram+disk` go to RAM while the VM is under its memory target; above it, the coldest
//! RAM block moves to the spill log's open segment to make room (so hot blocks stay in RAM and
//! the disk sees only whole 2 MiB segments), except for large writes (256 KiB and more), which
//! then go to the open segment themselves rather than push hot blocks out. TRIM and
//! WRITE_ZEROES release a block's RAM page or spill slot at once.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;

use crate::arena::{Arena, LivePage, Owner, Page, ARENA_SLACK_PAGES};
use crate::budget::HostMemory;
use crate::error::{EngineError, Result};
use crate::golden::{push_extent, Allocation, Extent, GoldenImage};
use crate::map::{self, BlockMap, Slot};
use crate::ram::{RamSlot, RamTier};
use crate::ranges::RangeSet;
use crate::spill::{Purpose, SpillLog};
use crate::state::{self, CopyAt, Found, SegmentSummaries, StateFiles, ZeroLog, ZeroRecord};
use crate::stats::{OpCounter, VmStats};
use crate::store::BackingFile;
use crate::units::{
    block_spans, Block, BlockIndex, BlockSpan, SegmentId, SpillAddr, BLOCKS_PER_SEGMENT, BLOCK_BYTES, BLOCK_SIZE,
    SEGMENT_BYTES,
};

/// Where a VM's writes go; one per seed configuration, so they can be compared side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteCacheMode {
    /// A per-VM differencing file on shared storage, 4 KiB writes in place (the MCS baseline).
    Shared,
    /// A per-VM cache file on local disk, 4 KiB writes in place (PVS "cache on device hard disk").
    Disk,
    /// RAM only; ENOSPC when the target is reached (PVS "cache in device RAM").
    Ram,
    /// RAM, overflowing in 2 MiB segments to a local spill file (PVS "cache in RAM with overflow").
    RamDisk,
}

impl WriteCacheMode {
    pub const ALL: [WriteCacheMode; 4] = [Self::Shared, Self::Disk, Self::Ram, Self::RamDisk];

    /// Whether the mode needs a backing file, and what it is for.
    pub fn backing_file(self) -> Option<BackingKind> {
        match self {
            Self::Shared => Some(BackingKind::SharedDifferencing),
            Self::Disk => Some(BackingKind::LocalCache),
            Self::Ram => None,
            Self::RamDisk => Some(BackingKind::SpillLog),
        }
    }
}

/// The files a mode writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingKind {
    /// Identity-mapped, sized like the disk, under the shared-storage directory.
    SharedDifferencing,
    /// Identity-mapped, sized like the disk, on local disk.
    LocalCache,
    /// Append-only 2 MiB segments on local disk.
    SpillLog,
}

impl fmt::Display for WriteCacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Shared => "shared",
            Self::Disk => "disk",
            Self::Ram => "ram",
            Self::RamDisk => "ram+disk",
        })
    }
}

impl FromStr for WriteCacheMode {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.to_string() == s)
            .ok_or_else(|| EngineError::Config(format!("unknown mode {s:?}: use shared, disk, ram or ram+disk")))
    }
}

#[derive(Debug, Clone)]
pub struct OverlayConfig {
    pub mode: WriteCacheMode,
    /// The VM's cache memory target: RAM tier, open spill segment and index together.
    pub ram_target_bytes: u64,
    /// Limit on the spill file (mode `ram+disk`); `None` lets the filesystem decide.
    pub spill_max_bytes: Option<u64>,
}

/// Writes at least this large go straight to the spill log when RAM is full, instead of pushing
/// the coldest RAM blocks out to make room: a large write is a file being copied or written
/// whole, unlikely to be read back soon, and it should not flush the VM's hot blocks out of RAM
/// (nor pay an eviction, two copies and an allocation per block: 1 MiB sequential writes went
/// from 1.35-1.6 to 1.7-1.8 GB/s while spilling; the spill writer thread is then the limit).
const STREAMING_WRITE_BYTES: usize = 256 * 1024;

/// Free pages beyond what a VM wants that its arena leaves warm (counted for the host all the
/// same): a VM whose wants move a little (a smaller write after a larger one) does not punch
/// pages it takes again a moment later. None for a VM under pressure (see `after_mutation`).
const COOLING_SLACK_PAGES: usize = BLOCKS_PER_SEGMENT / 4;

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

/// Where a block's current contents are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Golden,
    Zero,
    Ram(RamSlot),
    Spill(SpillAddr),
    File,
}

enum Tier {
    Ram,
    RamDisk(SpillLog),
    /// `stray`: a write to the file failed, and may have left bytes in blocks the map does not
    /// have (see [`Overlay::punch_in_place`]).
    InPlace {
        file: Box<dyn BackingFile>,
        shared: bool,
        blocks: u64,
        stray: bool,
    },
}

pub struct Overlay {
    golden: Arc<dyn GoldenImage>,
    /// Where the VM's pages in memory are: RAM tier, open and in-flight spill segments.
    arena: Arena,
    size: u64,
    config: OverlayConfig,
    map: BlockMap,
    zeros: RangeSet,
    ram: RamTier,
    tier: Tier,
    host: Arc<HostMemory>,
    accounted_bytes: u64,
    /// Blocks of the largest write lately (a peak decaying by an eighth with each write): fresh
    /// pages the next one of its kind takes before any of its blocks move to the spill log (see
    /// `after_mutation`). A peak, so that a VM mixing large and small writes does not punch the
    /// large one's pages after each small one; after more than about five small writes in a
    /// row it does.
    recent_write_blocks: usize,
    stats: Arc<VmStats>,
    /// The sequence number of the last copy of a block made (see `state`).
    seq: u64,
    /// Where zeroings are recorded for a recovery, if the VM's state is kept.
    zero_log: Option<ZeroLog>,
    /// The segment summaries of a VM without a spill log: empty, held so that their file is
    /// kept or removed with the rest of the VM's state (a recovery opens it).
    unused_summaries: Option<SegmentSummaries>,
}

/// Zero-log records beyond which the log is rewritten as the zeroed ranges it adds up to.
const ZERO_LOG_REWRITE_RECORDS: u64 = 256;

impl Overlay {
    /// `backing` must be given exactly when `config.mode.backing_file()` asks for one; in-place
    /// files must be at least as large as the golden image. The VM's pages are in memory no
    /// other process sees.
    pub fn new(
        golden: Arc<dyn GoldenImage>,
        config: OverlayConfig,
        backing: Option<Box<dyn BackingFile>>,
        host: Arc<HostMemory>,
        stats: Arc<VmStats>,
    ) -> Result<Self> {
        let arena = Arena::in_memory(Self::arena_pages(&config))?;
        Self::build(golden, config, backing, host, stats, arena, None)
    }

    /// An overlay whose state outlives the process: its pages in `arena`, its segment summaries
    /// and zero log in `files`, so that [`Self::recover`] can rebuild it. In the in-place modes
    /// the cache file is its own state: what holds data there is written, the zero log says
    /// which holes read as zeroes.
    pub fn persistent(
        golden: Arc<dyn GoldenImage>,
        config: OverlayConfig,
        backing: Option<Box<dyn BackingFile>>,
        host: Arc<HostMemory>,
        stats: Arc<VmStats>,
        arena: Arena,
        files: StateFiles,
    ) -> Result<Self> {
        let zero_log = ZeroLog::create(files.zeros)?;
        Self::build(
            golden,
            config,
            backing,
            host,
            stats,
            arena,
            Some((zero_log, SegmentSummaries::new(files.segments))),
        )
    }

    /// Rebuilds the overlay a previous process left: `live` are the pages its arena holds (see
    /// [`Arena::open`]), `spill_segments` the length of its spill file in segments. The copy of
    /// each block with the highest sequence number wins, unless a later zeroing covers it;
    /// pages that lose are freed, spill segments with nothing live are punched. The state it
    /// is given stays kept until the overlay stands: an error leaves the files and their pages
    /// as they were (the opened files and arena come kept, see [`Arena::open`]).
    #[allow(clippy::too_many_arguments)]
    pub fn recover(
        golden: Arc<dyn GoldenImage>,
        config: OverlayConfig,
        backing: Option<Box<dyn BackingFile>>,
        host: Arc<HostMemory>,
        stats: Arc<VmStats>,
        (arena, live): (Arena, Vec<LivePage>),
        files: StateFiles,
        spill_segments: u32,
    ) -> Result<Self> {
        let spilling = config.mode == WriteCacheMode::RamDisk;
        let owners: Vec<Owner> = live.iter().map(|page| page.owner).collect();
        let disk_blocks = golden.size().div_ceil(BLOCK_BYTES);
        let Found { resolution, summary, zero_log, summaries } =
            state::scan(&owners, files, spilling.then_some(spill_segments), disk_blocks)?;
        let mut overlay = Self::build(golden, config, backing, host, stats, arena, Some((zero_log, summaries)))?;
        let mut pages: Vec<Option<Page>> = live.into_iter().map(|live| Some(live.page)).collect();
        let mut live_slots: std::collections::HashMap<u32, u16> = Default::default();
        for (&block, &(_, at)) in &resolution.current {
            let block = BlockIndex(block);
            let slot = match at {
                CopyAt::Page(i) => {
                    let page = pages[i].take().expect("each page is one block's copy");
                    Slot::Ram(overlay.ram.insert(block, page))
                }
                CopyAt::Spill { segment, slot } => {
                    if !spilling {
                        return Err(EngineError::Corrupt("spill slots in a VM without a spill log".into()));
                    }
                    *live_slots.entry(segment).or_default() += 1;
                    Slot::Spill(SpillAddr { segment: SegmentId(segment), slot })
                }
            };
            overlay.map.insert(block, slot);
        }
        // Copies that lost: freed, their headers cleared, once the recovery stands (below).
        let lost_copies = pages;
        for (first, end) in resolution.zeros {
            overlay.zeros.insert(first, end);
        }
        overlay.seq = resolution.max_seq;
        match std::mem::replace(&mut overlay.tier, Tier::Ram) {
            Tier::RamDisk(spill) => {
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
                overlay.tier = Tier::RamDisk(spill.recovered(spill_segments, sealed, &overlay.stats)?);
            }
            other => overlay.tier = other,
        }
        let mut recovered = resolution.current.len() as u64;
        if let Tier::InPlace { file, blocks, .. } = &mut overlay.tier {
            // Every block that holds data was written (a zeroing or a trim punches its blocks),
            // after any zeroing that covers it: data wins over the zero log here.
            let ranges = file.data_ranges().map_err(|e| EngineError::from_io("finding the cache file's data", e))?;
            // A filesystem that cannot report holes calls the whole file data; taken at its
            // word, every block never written would read as zeroes instead of golden data.
            let data: u64 = ranges.iter().map(|(start, end)| end - start).sum();
            let allocated = file.allocated_bytes().map_err(|e| EngineError::from_io("sizing the cache file", e))?;
            if data > allocated + SEGMENT_BYTES as u64 {
                return Err(EngineError::Corrupt(format!(
                    "the cache file's filesystem reports {data} bytes of data in {allocated} allocated: \
                     it cannot tell written blocks from holes"
                )));
            }
            for (start, end) in ranges {
                let (first, end) = (start / BLOCK_BYTES, end.div_ceil(BLOCK_BYTES).min(disk_blocks));
                for block in (first..end).map(BlockIndex) {
                    if overlay.map.insert(block, Slot::File).is_none() {
                        *blocks += 1;
                        recovered += 1;
                    }
                }
            }
        }
        overlay.stats.recovered_blocks.add(recovered);
        overlay.own_state();
        drop(lost_copies);
        overlay.after_mutation();
        Ok(overlay)
    }

    fn build(
        golden: Arc<dyn GoldenImage>,
        config: OverlayConfig,
        backing: Option<Box<dyn BackingFile>>,
        host: Arc<HostMemory>,
        stats: Arc<VmStats>,
        arena: Arena,
        state: Option<(ZeroLog, SegmentSummaries)>,
    ) -> Result<Self> {
        if golden.size().div_ceil(BLOCK_BYTES) > map::MAX_BLOCKS {
            return Err(EngineError::Config(format!(
                "a disk of {} bytes has more than 2^32 blocks of 4 KiB (16 TiB), the most an overlay maps",
                golden.size()
            )));
        }
        let (zero_log, mut summaries) = match state {
            Some((zero_log, summaries)) => (Some(zero_log), Some(summaries)),
            None => (None, None),
        };
        let tier = match (config.mode.backing_file(), backing) {
            (None, None) => Tier::Ram,
            (Some(BackingKind::SpillLog), Some(file)) => {
                let mut spill = SpillLog::new(file, config.spill_max_bytes, arena.clone())?;
                if let Some(summaries) = summaries.take() {
                    spill.set_summaries(summaries);
                }
                Tier::RamDisk(spill)
            }
            (Some(kind @ (BackingKind::LocalCache | BackingKind::SharedDifferencing)), Some(file)) => {
                Tier::InPlace { file, shared: kind == BackingKind::SharedDifferencing, blocks: 0, stray: false }
            }
            (wanted, given) => {
                return Err(EngineError::Config(format!(
                    "mode {} wants backing {wanted:?} but {} was given",
                    config.mode,
                    if given.is_some() { "a file" } else { "none" }
                )))
            }
        };
        host.attach();
        let overlay = Self {
            size: golden.size(),
            golden,
            arena,
            config,
            map: BlockMap::default(),
            zeros: RangeSet::default(),
            ram: RamTier::default(),
            tier,
            host,
            accounted_bytes: 0,
            recent_write_blocks: 0,
            stats,
            seq: 0,
            zero_log,
            unused_summaries: summaries,
        };
        overlay.stats.cache_memory_target_bytes.set(overlay.config.ram_target_bytes);
        overlay.stats.cache_disk_size_bytes.set(overlay.disk_size_bytes());
        Ok(overlay)
    }

    /// The VM's state stays for the next process when this overlay is dropped: its arena, spill
    /// file, summaries and zero log are left as they are. For a server that stops (or hands
    /// over) while the VM lives on; without it, dropping the overlay throws its state away.
    pub fn keep_state(&mut self) {
        self.arena.keep();
        if let Tier::RamDisk(spill) = &mut self.tier {
            spill.keep();
        }
        if let Tier::InPlace { file, .. } = &mut self.tier {
            file.keep();
        }
        if let Some(zero_log) = &mut self.zero_log {
            zero_log.keep();
        }
        if let Some(summaries) = &mut self.unused_summaries {
            summaries.keep();
        }
    }

    /// Undoes [`Self::keep_state`]: the state goes with the overlay again. A recovery ends
    /// with this once the overlay stands; until then the files it opened are kept.
    fn own_state(&mut self) {
        self.arena.own();
        if let Tier::RamDisk(spill) = &mut self.tier {
            spill.own();
        }
        if let Tier::InPlace { file, .. } = &mut self.tier {
            file.own();
        }
        if let Some(zero_log) = &mut self.zero_log {
            zero_log.own();
        }
        if let Some(summaries) = &mut self.unused_summaries {
            summaries.own();
        }
    }

    /// Whether the overlay's state can outlive the process (see [`Self::persistent`]).
    pub fn is_persistent(&self) -> bool {
        self.zero_log.is_some()
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Pages a VM's arena may need: its RAM target, and the pages that can be held beside it.
    pub fn arena_pages(config: &OverlayConfig) -> u32 {
        let target = config.ram_target_bytes.div_ceil(BLOCK_BYTES);
        u32::try_from(target).unwrap_or(u32::MAX).saturating_add(ARENA_SLACK_PAGES)
    }

    pub fn mode(&self) -> WriteCacheMode {
        self.config.mode
    }

    pub fn stats(&self) -> &Arc<VmStats> {
        &self.stats
    }

    /// The backing file (spill log or in-place cache file), for inspection.
    pub fn backing(&self) -> Option<&dyn BackingFile> {
        match &self.tier {
            Tier::Ram => None,
            Tier::RamDisk(spill) => Some(spill.backing()),
            Tier::InPlace { file, .. } => Some(file.as_ref()),
        }
    }

    /// Cache memory in use: RAM pages, the open spill segment and every index structure.
    pub fn memory_used_bytes(&self) -> u64 {
        let spill = match &self.tier {
            Tier::RamDisk(spill) => spill.memory_bytes(),
            _ => 0,
        };
        self.ram.data_bytes() + self.ram.index_bytes() + self.map.memory_bytes() + self.zeros.memory_bytes() + spill
    }

    /// What the host's budget counts for this VM: [`Self::memory_used_bytes`] and the free
    /// pages its arena keeps beyond the open segment's room, as of the end of its last write,
    /// zeroing or trim. Then every page the VM has in memory is in it, except those of a
    /// segment being written (the host's, see `SpillLog::memory_bytes`); pages a background
    /// writer frees after that are counted at the next one.
    pub fn memory_accounted_bytes(&self) -> u64 {
        self.accounted_bytes
    }

    /// The VM is about to wait for its client (its connection lost, its overlay in grace): the
    /// free spill segments kept for its next writes, beyond the few always kept, go back to the
    /// filesystem, where another VM may need them while this one writes nothing.
    pub fn give_back_spare_disk(&mut self) {
        self.give_back_disk(SpillLog::give_back_spare_kept);
    }

    /// The VM's client has sent nothing for a while (while connected): every free spill
    /// segment kept for its next writes goes back to the filesystem, the few always kept too.
    /// Another VM may need the space, and this one would not hear of it until it writes.
    pub fn give_back_idle_disk(&mut self) {
        self.give_back_disk(SpillLog::give_back_kept);
    }

    /// Has the spill log give kept segments back, and counts the disk it holds then.
    fn give_back_disk(&mut self, give_back: impl FnOnce(&mut SpillLog, &VmStats)) {
        if let Tier::RamDisk(spill) = &mut self.tier {
            give_back(spill, &self.stats);
            self.stats.cache_disk_used_bytes.set(self.disk_used_bytes());
        }
    }

    /// Free pages the VM has given back to the host so far (each one faulted in again when it
    /// is next taken).
    pub fn memory_pages_punched(&self) -> u64 {
        self.arena.pages_punched()
    }

    /// Memory the VM's pages really take: its blocks and the free pages its arena keeps for the
    /// next ones (beside [`Self::memory_used_bytes`], which counts an open segment whole).
    pub fn memory_resident_bytes(&self) -> u64 {
        self.arena.resident_pages() * BLOCK_BYTES
    }

    /// The target now in force: the VM's own, cut by host pressure.
    pub fn memory_target_bytes(&self) -> u64 {
        self.host.effective_target(self.config.ram_target_bytes)
    }

    pub fn disk_used_bytes(&self) -> u64 {
        match &self.tier {
            Tier::Ram => 0,
            Tier::RamDisk(spill) => spill.disk_used_bytes(),
            Tier::InPlace { blocks, .. } => blocks * BLOCK_BYTES,
        }
    }

    fn disk_size_bytes(&self) -> u64 {
        match &self.tier {
            Tier::Ram => 0,
            Tier::RamDisk(spill) => spill.disk_size_bytes(),
            Tier::InPlace { .. } => self.size,
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(EngineError::OutOfRange { offset, len, size: self.size }),
        }
    }

    fn source(&self, block: BlockIndex) -> Source {
        match self.map.get(block) {
            Some(Slot::Ram(slot)) => Source::Ram(slot),
            Some(Slot::Spill(addr)) => Source::Spill(addr),
            Some(Slot::File) => Source::File,
            None if self.zeros.contains(block.0) => Source::Zero,
            None => Source::Golden,
        }
    }

    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.count_read_request();
        self.read_part(offset, buf)
    }

    /// Counts one read request whose bytes come in parts ([`Self::read_part`],
    /// [`Self::read_shared_part`], [`Self::count_unread`]): a server that answers a large read in
    /// slices, or around runs it sends as holes, counts the guest's one request once.
    pub fn count_read_request(&self) {
        self.stats.guest_read.ops.inc();
    }

    /// [`Self::read`] of a part of a request counted by [`Self::count_read_request`].
    pub fn read_part(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        self.stats.guest_read.bytes.add(len);
        self.read_spans(offset, buf)
    }

    /// A part of a read request answered as zeroes without being read (NBD sends it as a hole
    /// chunk, having asked [`Self::extents`]): counted as read, each block by the tier a read
    /// would have taken it from, so that what the guest read is told whole. Nothing is fetched.
    pub fn count_unread(&mut self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        self.stats.guest_read.bytes.add(len);
        for span in block_spans(offset, len) {
            let counter = match self.source(span.block) {
                Source::Golden => &self.stats.read_blocks_golden,
                Source::Zero => &self.stats.read_blocks_zero,
                Source::Ram(_) => &self.stats.read_blocks_ram,
                Source::Spill(_) => &self.stats.read_blocks_spill,
                Source::File => &self.stats.read_blocks_cache_file,
            };
            counter.inc();
        }
        Ok(())
    }

    /// How `[offset, offset + len)` of the VM's disk is stored, for block status: what the VM
    /// wrote is data wherever it lives (RAM, spill, cache file); what it zeroed is `Zero` (it
    /// reads as zeroes, and a client that zeroed with NO_HOLE is never told of a hole it did not
    /// ask for); the rest is the golden image's own allocation (holes in a sparse raw file,
    /// unallocated qcow2 clusters, absent VHDX blocks), in whole blocks: a block part data and
    /// part hole is data.
    pub fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.check_range(offset, len)?;
        let mut extents = Vec::new();
        let end = offset + len;
        let mut block = offset / BLOCK_BYTES;
        let end_block = end.div_ceil(BLOCK_BYTES);
        while block < end_block {
            let source = self.source(BlockIndex(block));
            let mut run_end = block + 1;
            while run_end < end_block && same_kind(self.source(BlockIndex(run_end)), source) {
                run_end += 1;
            }
            let (from, to) = ((block * BLOCK_BYTES).max(offset), (run_end * BLOCK_BYTES).min(end));
            match source {
                Source::Golden => self.golden_extents(from, to, &mut extents)?,
                Source::Zero => push_extent(&mut extents, to - from, Allocation::Zero),
                Source::Ram(_) | Source::Spill(_) | Source::File => {
                    push_extent(&mut extents, to - from, Allocation::Data)
                }
            }
            block = run_end;
        }
        Ok(extents)
    }

    /// The golden image's extents for `[from, to)`, block by block: a block holding any data is
    /// data, else any stored zeroes make it zero, else it is a hole.
    fn golden_extents(&self, from: u64, to: u64, extents: &mut Vec<Extent>) -> Result<()> {
        let io = |source| EngineError::Io { what: "asking the golden image for its allocation", source };
        let golden_end = to.min(self.golden.size());
        let mut at = from;
        // The state of the block being gathered, and where it starts.
        let mut pending: Option<(u64, Allocation)> = None;
        while at < golden_end {
            let parts = self.golden.extents(at, golden_end - at).map_err(io)?;
            if parts.is_empty() {
                return Err(io(io::Error::other("the golden image reported no extents")));
            }
            for part in parts {
                if part.len == 0 {
                    return Err(io(io::Error::other("the golden image reported an empty extent")));
                }
                let part_end = (at + part.len).min(golden_end);
                let mut pos = at;
                while pos < part_end {
                    let block_end = ((pos / BLOCK_BYTES + 1) * BLOCK_BYTES).min(golden_end);
                    let state = match pending {
                        Some((_, held)) => strongest(held, part.state),
                        None => part.state,
                    };
                    if part_end >= block_end {
                        // This block is complete: emit it, then whole blocks of this part at once.
                        let start = pending.map_or(pos, |(start, _)| start);
                        push_extent(extents, block_end - start, state);
                        pending = None;
                        let whole_end = part_end / BLOCK_BYTES * BLOCK_BYTES;
                        if whole_end > block_end {
                            push_extent(extents, whole_end - block_end, part.state);
                            pos = whole_end;
                        } else {
                            pos = block_end;
                        }
                    } else {
                        pending = Some((pending.map_or(pos, |(start, _)| start), state));
                        pos = part_end;
                    }
                }
                at = part_end;
                if at >= golden_end {
                    break;
                }
            }
        }
        if let Some((start, state)) = pending {
            push_extent(extents, golden_end - start, state);
        }
        // Past the end of a golden image shorter than the disk: zeroes nobody stored.
        push_extent(extents, to - golden_end.max(from), Allocation::Hole);
        Ok(())
    }

    /// Reads the golden blocks of a range into the shared read cache and throws them away
    /// (NBD_CMD_CACHE): a VM that says what it will read soon gets it from RAM. Blocks the VM
    /// has written are already here. Returns the bytes fetched from the golden image.
    pub fn prefetch(&mut self, offset: u64, len: u64) -> Result<u64> {
        self.check_range(offset, len)?;
        const PIECE: u64 = 1 << 20;
        let mut scratch = Vec::new();
        let mut fetched = 0;
        let mut block = offset / BLOCK_BYTES;
        let end_block = (offset + len).div_ceil(BLOCK_BYTES);
        while block < end_block {
            if self.source(BlockIndex(block)) != Source::Golden {
                block += 1;
                continue;
            }
            let mut run_end = block + 1;
            while run_end < end_block
                && run_end - block < PIECE / BLOCK_BYTES
                && self.source(BlockIndex(run_end)) == Source::Golden
            {
                run_end += 1;
            }
            let from = block * BLOCK_BYTES;
            let to = (run_end * BLOCK_BYTES).min(self.golden.size());
            if from < to {
                scratch.resize((to - from) as usize, 0);
                self.read_golden(&mut scratch, from)?;
                fetched += to - from;
            }
            block = run_end;
        }
        Ok(fetched)
    }

    /// Reads `len` bytes at `offset` as pieces to send in order: runs of golden blocks are the
    /// shared read cache's own bytes (no copy on the way to the socket; a large read of golden
    /// data spent a quarter of its time copying them), everything else is copied as by
    /// [`Self::read`], a run at a time.
    pub fn read_shared(&mut self, offset: u64, len: usize) -> Result<Vec<Bytes>> {
        self.check_range(offset, len as u64)?;
        self.count_read_request();
        self.read_shared_part(offset, len)
    }

    /// [`Self::read_shared`] of a part of a request counted by [`Self::count_read_request`].
    pub fn read_shared_part(&mut self, offset: u64, len: usize) -> Result<Vec<Bytes>> {
        self.check_range(offset, len as u64)?;
        self.stats.guest_read.bytes.add(len as u64);
        let spans: Vec<BlockSpan> = block_spans(offset, len as u64).collect();
        let golden: Vec<bool> = spans.iter().map(|span| self.source(span.block) == Source::Golden).collect();
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < spans.len() {
            let j = i + golden[i..].iter().take_while(|&&g| g == golden[i]).count();
            let run_offset = spans[i].block.byte_offset() + spans[i].within as u64;
            let run_len: usize = spans[i..j].iter().map(|span| span.len).sum();
            if golden[i] {
                let (shared, fetched) = self
                    .golden
                    .read_shared(run_offset, run_len)
                    .map_err(|source| EngineError::Io { what: "reading golden image", source })?;
                self.count_golden_fetch(run_len, fetched);
                self.stats.read_blocks_golden.add((j - i) as u64);
                pieces.extend(shared);
            } else {
                let mut copy = vec![0u8; run_len];
                self.read_spans(run_offset, &mut copy)?;
                pieces.push(Bytes::from(copy));
            }
            i = j;
        }
        Ok(pieces)
    }

    fn read_spans(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len() as u64;
        let spans: Vec<BlockSpan> = block_spans(offset, len).collect();
        let mut i = 0;
        let mut pos = 0usize;
        while i < spans.len() {
            let span = spans[i];
            let source = self.source(span.block);
            match source {
                // Golden and in-place file blocks are identity-mapped: a run of them is one read.
                Source::Golden | Source::File => {
                    let mut run_len = span.len;
                    let mut j = i + 1;
                    while j < spans.len() && self.source(spans[j].block) == source {
                        run_len += spans[j].len;
                        j += 1;
                    }
                    let run_offset = span.block.byte_offset() + span.within as u64;
                    let target = &mut buf[pos..pos + run_len];
                    let blocks = (j - i) as u64;
                    if source == Source::Golden {
                        self.read_golden(target, run_offset)?;
                        self.stats.read_blocks_golden.add(blocks);
                    } else {
                        self.read_in_place(target, run_offset)?;
                        self.stats.read_blocks_cache_file.add(blocks);
                    }
                    pos += run_len;
                    i = j;
                    continue;
                }
                Source::Zero => {
                    buf[pos..pos + span.len].fill(0);
                    self.stats.read_blocks_zero.inc();
                }
                Source::Ram(slot) => {
                    let page = self.ram.get(slot);
                    buf[pos..pos + span.len].copy_from_slice(&page[span.within..span.within + span.len]);
                    self.stats.read_blocks_ram.inc();
                }
                Source::Spill(addr) => {
                    // Neighbours in the guest's disk that are neighbours in one segment too:
                    // one read for the run.
                    let mut j = i + 1;
                    while j < spans.len()
                        && self.source(spans[j].block)
                            == Source::Spill(SpillAddr { segment: addr.segment, slot: addr.slot + (j - i) as u16 })
                    {
                        j += 1;
                    }
                    let run_len: usize = spans[i..j].iter().map(|s| s.len).sum();
                    let whole = span.within == 0 && run_len.is_multiple_of(BLOCK_SIZE);
                    let (spill, stats) = self.spill_and_stats();
                    if whole {
                        spill.read_run(addr, &mut buf[pos..pos + run_len], stats)?;
                    } else {
                        let mut blocks = vec![0u8; (j - i) * BLOCK_SIZE];
                        spill.read_run(addr, &mut blocks, stats)?;
                        buf[pos..pos + run_len].copy_from_slice(&blocks[span.within..span.within + run_len]);
                    }
                    self.stats.read_blocks_spill.add((j - i) as u64);
                    pos += run_len;
                    i = j;
                    continue;
                }
            }
            pos += span.len;
            i += 1;
        }
        Ok(())
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        self.check_range(offset, len)?;
        self.stats.guest_write.add(len);
        self.note_write_size(block_count(offset, len));
        self.shrink_to_target();
        let result = self.write_spans(offset, data);
        self.after_mutation();
        result
    }

    fn note_write_size(&mut self, blocks: usize) {
        let decayed = self.recent_write_blocks - self.recent_write_blocks.div_ceil(8);
        self.recent_write_blocks = decayed.max(blocks);
    }

    fn write_spans(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        if let Tier::InPlace { .. } = self.tier {
            return self.write_in_place(offset, data);
        }
        let mut landed = Landed::default();
        let result = self.put_spans(offset, data, &mut landed);
        self.count_landed(landed);
        result
    }

    fn put_spans(&mut self, offset: u64, data: &[u8], landed: &mut Landed) -> Result<()> {
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

    /// Writes `len` bytes at `offset` that are still on their way (in a socket): `receive` fills
    /// the buffers it is handed, in order, with them. Blocks already in RAM are received straight
    /// into their pages (but for a large write while RAM is full, which goes to the spill log
    /// whole), and new ones into fresh pages the RAM tier then keeps, so a RAM-tier
    /// write costs one copy where going through a request buffer cost two (the second was 30 %
    /// of the server's time on 1 MiB writes). If `receive` fails, its error is returned and the
    /// range holds unspecified data, as after any failed write.
    pub fn write_received(
        &mut self,
        offset: u64,
        len: usize,
        receive: impl FnOnce(&mut [IoSliceMut<'_>]) -> io::Result<()>,
    ) -> Result<()> {
        self.check_range(offset, len as u64)?;
        if let Tier::InPlace { .. } = self.tier {
            // The file is written from one buffer anyway.
            let mut data = vec![0; len];
            receive(&mut [IoSliceMut::new(&mut data)]).map_err(|e| EngineError::from_io("receiving data", e))?;
            return self.write(offset, &data);
        }
        self.note_write_size(block_count(offset, len as u64));
        self.shrink_to_target();
        let mut landed = Landed::default();
        let mut received = false;
        let receive = |buffers: &mut [IoSliceMut<'_>]| {
            let result = receive(buffers);
            received = result.is_ok();
            result
        };
        let result = self.receive_spans(offset, len, receive, &mut landed);
        // A write the guest never finished sending is not one of its writes.
        if received {
            self.stats.guest_write.add(len as u64);
        }
        self.count_landed(landed);
        self.after_mutation();
        result
    }

    fn receive_spans(
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
    fn count_landed(&self, landed: Landed) {
        if landed.ram > 0 {
            self.stats.write_blocks_ram.add(landed.ram);
        }
        if landed.spill > 0 {
            self.stats.write_blocks_spill.add(landed.spill);
        }
    }

    /// Zeroes a range without storing data: whole blocks join the zeroed ranges, partial ones are
    /// patched. `NO_HOLE` makes no difference here, since nothing is preallocated for a VM that
    /// is thrown away, and zeroing is never slower than writing (so FAST_ZERO always holds).
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        self.stats.guest_zero.add(len);
        self.shrink_to_target();
        let result = self.zero_spans(offset, len);
        self.after_mutation();
        result
    }

    fn zero_spans(&mut self, offset: u64, len: u64) -> Result<()> {
        let (whole_first, whole_end) = whole_blocks(offset, len);
        for span in block_spans(offset, len).filter(|span| !span.is_whole()) {
            let mut block = self.read_block(span.block)?;
            block[span.within..span.within + span.len].fill(0);
            self.store_block(span.block, &block)?;
        }
        if whole_first < whole_end {
            // Recorded before any copy is released: a recovery then finds the range zeroed,
            // whatever this request had done when the process stopped.
            if self.zero_log.is_some() {
                let seq = self.next_seq();
                let record = ZeroRecord { first: whole_first, end: whole_end, seq };
                self.zero_log.as_mut().expect("checked").append(record)?;
            }
            // Zeroed before the copies go (the map wins over zeroed ranges): in place, blocks
            // are punched run by run, and a run punched before a later one failed must read
            // zeroes, not the golden image.
            self.zeros.insert(whole_first, whole_end);
            self.drop_blocks(whole_first, whole_end)?;
            self.stats.zero_blocks.add(whole_end - whole_first);
            self.rewrite_zero_log_if_long();
        }
        Ok(())
    }

    /// Rewrites the zero log as the zeroed ranges less the blocks written since, once its
    /// records outnumber those ranges by far (a guest zeroing the same blocks over and over
    /// must not grow it forever).
    fn rewrite_zero_log_if_long(&mut self) {
        let Some(zero_log) = &self.zero_log else { return };
        let limit = ZERO_LOG_REWRITE_RECORDS + 4 * self.zeros.len() as u64 + self.map.len() as u64 / 16;
        if zero_log.records() <= limit {
            return;
        }
        let mut written: Vec<u64> =
            self.map.blocks().map(|block| block.0).filter(|&b| self.zeros.contains(b)).collect();
        written.sort_unstable();
        let seq = self.next_seq();
        let mut records = Vec::with_capacity(self.zeros.len() + written.len());
        let mut written = written.into_iter().peekable();
        for (start, end) in self.zeros.iter() {
            let mut first = start;
            while let Some(&block) = written.peek() {
                if block >= end {
                    break;
                }
                if block > first {
                    records.push(ZeroRecord { first, end: block, seq });
                }
                first = block + 1;
                written.next();
            }
            if first < end {
                records.push(ZeroRecord { first, end, seq });
            }
        }
        if let Err(error) = self.zero_log.as_mut().expect("checked").rewrite(&records) {
            // The long log is still whole; the next zeroing tries again.
            tracing::warn!(%error, "could not rewrite the zero log");
        }
    }

    /// Gives whole blocks back: RAM pages and spill slots are freed, in-place file blocks are
    /// punched, and the blocks read from the golden image again. Partial blocks are left alone,
    /// which TRIM allows.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        self.stats.guest_trim.add(len);
        let (first, end) = whole_blocks(offset, len);
        let result = if first < end {
            self.zeros.remove(first, end);
            self.drop_blocks(first, end)
        } else {
            Ok(())
        };
        self.after_mutation();
        result
    }

    /// Nothing to make durable: the cache dies with the VM. A spill segment still being written
    /// is waited for, so that after a flush every acknowledged write is in RAM or in the hands
    /// of the spill file's filesystem, and every figure counts it. A failed segment write is
    /// not the flush's failure: the data stays readable in memory, and the next append that
    /// needs space reports it.
    pub fn flush(&mut self) -> Result<()> {
        self.stats.guest_flush.add(0);
        if let Tier::RamDisk(spill) = &mut self.tier {
            if let Err(error) = spill.finish_writes(&self.stats) {
                tracing::debug!(%error, "flush: the spill segment being written failed");
            }
            // A written segment may have freed its space and its owner table: account for it.
            self.after_mutation();
        }
        Ok(())
    }

    fn spill_mut(&mut self) -> &mut SpillLog {
        self.spill_and_stats().0
    }

    /// The spill log with the counters it updates (disjoint borrows of `self`).
    fn spill_and_stats(&mut self) -> (&mut SpillLog, &VmStats) {
        match &mut self.tier {
            Tier::RamDisk(spill) => (spill, &self.stats),
            _ => unreachable!("spill slots exist only in ram+disk mode"),
        }
    }

    fn read_golden(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let fetched = self
            .golden
            .read_counted(buf, offset)
            .map_err(|source| EngineError::Io { what: "reading golden image", source })?;
        self.count_golden_fetch(buf.len(), fetched);
        Ok(())
    }

    /// Counts `len` bytes asked of the golden image and what that cost the storage behind it.
    fn count_golden_fetch(&self, len: usize, fetched: crate::golden::SourceReads) {
        self.stats.golden_request.add(len as u64);
        self.stats.golden_read.add_many(fetched.ops, fetched.bytes);
    }

    fn in_place_counters(&self, shared: bool) -> (&OpCounter, &OpCounter) {
        if shared {
            (&self.stats.shared_read, &self.stats.shared_write)
        } else {
            (&self.stats.cache_file_read, &self.stats.cache_file_write)
        }
    }

    fn read_in_place(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let Tier::InPlace { file, shared, .. } = &mut self.tier else {
            unreachable!("file slots exist only in in-place modes")
        };
        let shared = *shared;
        file.read_at(buf, offset).map_err(|e| EngineError::from_io("reading cache file", e))?;
        self.in_place_counters(shared).0.add(buf.len() as u64);
        Ok(())
    }

    /// The current contents of one block, from whichever tier holds it.
    fn read_block(&mut self, block: BlockIndex) -> Result<Block> {
        let mut data = [0u8; BLOCK_SIZE];
        match self.source(block) {
            Source::Golden => self.read_golden(&mut data, block.byte_offset())?,
            Source::Zero => {}
            Source::Ram(slot) => data.copy_from_slice(self.ram.get(slot)),
            Source::Spill(addr) => {
                let (spill, stats) = self.spill_and_stats();
                spill.read(addr, &mut data, stats)?
            }
            Source::File => self.read_in_place(&mut data, block.byte_offset())?,
        }
        Ok(data)
    }

    /// Stores a whole block in whatever tier the mode uses.
    fn store_block(&mut self, block: BlockIndex, data: &Block) -> Result<()> {
        if let Tier::InPlace { .. } = self.tier {
            self.write_in_place(block.byte_offset(), data)
        } else {
            let mut landed = Landed::default();
            landed.add(self.put_block(block, Contents::Borrowed(data), Placement::Hot)?);
            self.count_landed(landed);
            Ok(())
        }
    }

    /// Modes `ram` and `ram+disk`: overwrite in memory where the block already is in memory,
    /// otherwise place it anew and release its old copy.
    fn put_block(&mut self, block: BlockIndex, data: Contents<'_>, placement: Placement) -> Result<LandedIn> {
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
    fn place(&mut self, block: BlockIndex, data: Contents<'_>, placement: Placement) -> Result<Slot> {
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
    fn shrink_to_target(&mut self) {
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

    fn release(&mut self, old: Slot) {
        match old {
            Slot::Ram(slot) => self.ram.remove(slot),
            Slot::Spill(addr) => {
                let (spill, stats) = self.spill_and_stats();
                spill.release(addr, stats);
            }
            Slot::File => unreachable!("in-place blocks are overwritten in place, never released"),
        }
    }

    /// Removes every mapped block in `[first, end)`, freeing its storage.
    fn drop_blocks(&mut self, first: u64, end: u64) -> Result<()> {
        let mut mapped: Vec<BlockIndex> = if end - first <= self.map.len() as u64 {
            (first..end).map(BlockIndex).filter(|b| self.map.contains(*b)).collect()
        } else {
            self.map.blocks().filter(|b| (first..end).contains(&b.0)).collect()
        };
        mapped.sort_unstable();
        if let Tier::InPlace { .. } = self.tier {
            return self.punch_in_place(first, end, &mapped);
        }
        for block in mapped {
            if let Some(old) = self.map.remove(block) {
                self.release(old);
            }
        }
        if let Tier::RamDisk(spill) = &mut self.tier {
            spill.give_back_kept(&self.stats);
        }
        Ok(())
    }

    /// Punches the mapped blocks of `[first, end)`, in runs; all of the range once a write has
    /// failed: that write may have left bytes in blocks it never mapped, and a recovery takes
    /// whatever the file holds for data written after any zeroing, so such bytes would come back
    /// in place of the zeroes this zeroing promises. (Only then: a filesystem that cannot punch
    /// would otherwise fail every trim of blocks never written.)
    fn punch_in_place(&mut self, first: u64, end: u64, sorted: &[BlockIndex]) -> Result<()> {
        let Tier::InPlace { file, blocks, stray, .. } = &mut self.tier else { unreachable!("checked by caller") };
        let punch = |file: &mut Box<dyn BackingFile>, first: u64, end: u64| {
            file.punch_hole(first * BLOCK_BYTES, (end - first) * BLOCK_BYTES)
                .map_err(|e| EngineError::from_io("punching cache file", e))
        };
        if *stray {
            punch(file, first, end)?;
        }
        let mut i = 0;
        while i < sorted.len() {
            let mut j = i + 1;
            while j < sorted.len() && sorted[j].0 == sorted[j - 1].0 + 1 {
                j += 1;
            }
            if !*stray {
                punch(file, sorted[i].0, sorted[j - 1].0 + 1)?;
            }
            for block in &sorted[i..j] {
                self.map.remove(*block);
            }
            *blocks -= (j - i) as u64;
            i = j;
        }
        Ok(())
    }

    /// Modes `disk` and `shared`: partial blocks are read, patched and written whole; the
    /// aligned body goes down in one write at its own offset.
    fn write_in_place(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let (first, end) = whole_blocks(offset, data.len() as u64);
        let mut pos = 0usize;
        for span in block_spans(offset, data.len() as u64) {
            let piece = &data[pos..pos + span.len];
            pos += span.len;
            if !span.is_whole() {
                let mut block = self.read_block(span.block)?;
                block[span.within..span.within + span.len].copy_from_slice(piece);
                self.write_file(span.block.byte_offset(), &block, span.block.0, span.block.0 + 1)?;
            }
        }
        if first < end {
            let body_start = (first * BLOCK_BYTES - offset) as usize;
            let body_len = ((end - first) * BLOCK_BYTES) as usize;
            self.write_file(first * BLOCK_BYTES, &data[body_start..body_start + body_len], first, end)?;
        }
        Ok(())
    }

    fn write_file(&mut self, offset: u64, data: &[u8], first: u64, end: u64) -> Result<()> {
        let Tier::InPlace { file, shared, blocks, stray } = &mut self.tier else { unreachable!("in-place mode") };
        if let Err(e) = file.write_at(data, offset) {
            *stray = true;
            return Err(EngineError::from_io("writing cache file", e));
        }
        let shared = *shared;
        for block in (first..end).map(BlockIndex) {
            if self.map.insert(block, Slot::File).is_none() {
                *blocks += 1;
            }
        }
        self.stats.write_blocks_cache_file.add(end - first);
        self.in_place_counters(shared).1.add(data.len() as u64);
        Ok(())
    }

    /// Moves the live blocks of the emptiest spill segments into the open one, so that their
    /// space can be punched out, while compaction pays.
    fn compact(&mut self) -> Result<()> {
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

    fn after_mutation(&mut self) {
        if matches!(self.tier, Tier::RamDisk(_)) {
            if self.spill_mut().wants_compaction() {
                if let Err(error) = self.compact() {
                    tracing::warn!(%error, "spill compaction stopped");
                }
            }
            let (spill, stats) = self.spill_and_stats();
            spill.heed_space_shortages(stats);
            spill.release_pages_if_empty(stats);
        }
        self.map.shrink_if_empty();
        let used = self.memory_used_bytes();
        // Free pages the arena keeps in memory are memory the VM holds, though no block is in
        // them: keep no more than its unused target and what it will take again soon (a write
        // lands in fresh pages before its blocks push older ones into the open segment; the
        // spill log wants its round of pages), and count those beyond the open segment's room
        // (which `used` counts whole) for the host, so that every page kept is a page seen.
        // Fewer would make a VM streaming large writes fault fresh pages in on every request. A
        // VM under pressure (its target cut, or the host at its cap, which these kept pages are
        // not checked against when taken) keeps only its unused target and the open segment's
        // room, exactly: it is to give memory back, not to go fast.
        let target = self.memory_target_bytes();
        let unused = (target.saturating_sub(used) / BLOCK_BYTES) as usize;
        let pressed = target < self.config.ram_target_bytes || !self.host.has_room(0);
        let (soon, covered) = match &self.tier {
            Tier::RamDisk(spill) => {
                let room = spill.open_room();
                (if pressed { room } else { spill.pages_wanted_soon() + self.recent_write_blocks }, room)
            }
            _ => (0, 0),
        };
        let slack = if pressed { 0 } else { COOLING_SLACK_PAGES };
        let kept = self.arena.cool_beyond(unused + soon, slack);
        let accounted = used + kept.saturating_sub(covered) as u64 * BLOCK_BYTES;
        self.host.account(self.accounted_bytes, accounted);
        self.accounted_bytes = accounted;
        let stats = &self.stats;
        stats.cache_memory_used_bytes.set(used);
        stats.cache_memory_target_bytes.set(target);
        if used > stats.cache_memory_peak_bytes.get() {
            stats.cache_memory_peak_bytes.set(used);
        }
        let disk = self.disk_used_bytes();
        stats.cache_disk_used_bytes.set(disk);
        stats.cache_disk_size_bytes.set(self.disk_size_bytes());
        if disk > stats.cache_disk_peak_bytes.get() {
            stats.cache_disk_peak_bytes.set(disk);
        }
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        if let Tier::RamDisk(spill) = &mut self.tier {
            // The last segment may still be on its way to disk: wait, so that it is counted.
            if let Err(error) = spill.finish_writes(&self.stats) {
                tracing::debug!(%error, "the last spill segment of a departing VM was not written");
            }
        }
        self.host.detach(self.accounted_bytes);
    }
}

/// Whether two blocks belong in one extent: data is data wherever it is kept.
fn same_kind(a: Source, b: Source) -> bool {
    let stored = |s: Source| matches!(s, Source::Ram(_) | Source::Spill(_) | Source::File);
    a == b || (stored(a) && stored(b))
}

/// What a block holding both is reported as: data over zeroes over holes.
fn strongest(a: Allocation, b: Allocation) -> Allocation {
    match (a, b) {
        (Allocation::Data, _) | (_, Allocation::Data) => Allocation::Data,
        (Allocation::Zero, _) | (_, Allocation::Zero) => Allocation::Zero,
        _ => Allocation::Hole,
    }
}

/// The whole blocks inside `[offset, offset + len)`, as `[first, end)` block indices.
fn whole_blocks(offset: u64, len: u64) -> (u64, u64) {
    let first = offset.div_ceil(BLOCK_BYTES);
    let end = (offset + len) / BLOCK_BYTES;
    (first, end.max(first))
}

/// How many blocks `[offset, offset + len)` touches.
fn block_count(offset: u64, len: u64) -> usize {
    if len == 0 {
        return 0;
    }
    ((offset + len).div_ceil(BLOCK_BYTES) - offset / BLOCK_BYTES) as usize
}
