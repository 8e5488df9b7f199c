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
//!
//! The overlay is two parts: a [`Core`] every mode shares (the block map, the zeroed ranges, the
//! golden image, the VM's pages and counters) and a [`Store`], the strategy that keeps the
//! blocks the VM wrote: [`Tiered`] for `ram` and `ram+disk` (`tiered`), [`InPlace`] for `disk` and
//! `shared` (`in_place`). The mode picks the store once, when the overlay is built; after that no
//! request asks which mode it is in. This file holds the block states and the requests that
//! change them; beside it: reads (`reads`), block status (`extents`), memory and disk accounting
//! (`budget`), and rebuilding an overlay a previous process left (`recovery`).

use std::io::{self, IoSliceMut};
use std::sync::Arc;

use crate::arena::{Arena, ARENA_SLACK_PAGES};
use crate::budget::HostMemory;
use crate::error::{EngineError, Result};
use crate::golden::GoldenImage;
use crate::map::{BlockMap, Slot};
use crate::ranges::RangeSet;
use crate::spill::SpillLog;
use crate::state::{SegmentSummaries, StateFiles, ZeroLog, ZeroRecord};
use crate::stats::VmStats;
use crate::store::BackingFile;
use crate::units::{block_spans, Block, BlockIndex, BlockSpan, SpillAddr, BLOCK_BYTES};

mod budget;
mod config;
mod extents;
mod in_place;
mod moving;
mod reads;
mod recovery;
mod tiered;

pub use config::{BackingKind, OverlayConfig, WriteCacheMode};
pub use extents::{LayerRun, DEPTH_GOLDEN, DEPTH_OVERLAY};
use in_place::InPlace;
pub use moving::MovedRun;
use recovery::SpillFound;
use tiered::Tiered;

/// Where a block's current contents are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Golden,
    Zero,
    Ram(crate::ram::RamSlot),
    Spill(SpillAddr),
    File,
}

/// Fills the buffers it is handed, in order, with a write's payload (see
/// [`Overlay::write_received`]).
type Receive<'a> = dyn FnMut(&mut [IoSliceMut<'_>]) -> io::Result<()> + 'a;

/// Which kept spill segments a VM gives back to the filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeptDisk {
    /// Those beyond the few always kept.
    Spare,
    All,
}

/// A strategy for keeping the blocks a VM wrote. It is handed the [`Core`] with each call rather
/// than holding it, so that the two can be borrowed apart.
trait Store: Send {
    /// A write touching `written` blocks, or a zeroing (`None`), is about to change the overlay:
    /// room may be made.
    fn before_change(&mut self, core: &mut Core, written: Option<usize>);
    /// Moves the coldest RAM blocks to the spill log until the VM's memory is at most
    /// `limit_bytes` or its RAM tier is empty (nothing where there is no log to move them to).
    fn shrink_to(&mut self, core: &mut Core, limit_bytes: u64);
    /// Stores `data` at `offset`, inside the disk.
    fn write(&mut self, core: &mut Core, offset: u64, data: &[u8]) -> Result<()>;
    /// Stores the `len` bytes at `offset` that `receive` fills in.
    fn write_received(&mut self, core: &mut Core, offset: u64, len: usize, receive: &mut Receive<'_>) -> Result<()>;
    fn store_block(&mut self, core: &mut Core, block: BlockIndex, data: &Block) -> Result<()>;
    /// Takes `sorted`, the mapped blocks of `[first, end)` in order, out of the map and frees
    /// what they held.
    fn drop_blocks(&mut self, core: &mut Core, first: u64, end: u64, sorted: &[BlockIndex]) -> Result<()>;
    /// Reads the stored blocks `spans` begins with, the first one at `slot`, into the start of
    /// `buf`; returns how many spans it read (at least one).
    fn read_stored(&mut self, core: &Core, slot: Slot, spans: &[BlockSpan], buf: &mut [u8]) -> Result<usize>;
    /// Waits for data still on its way to disk, so that every figure counts it.
    fn finish_writes(&mut self, stats: &VmStats);
    /// Stays within its limits after a change (compaction, a filling disk).
    fn settle(&mut self, core: &mut Core);
    /// Memory held beyond the core's indexes.
    fn memory_bytes(&self) -> u64;
    /// Free pages wanted again soon, and how many of them [`Self::memory_bytes`] counts already.
    fn pages_wanted(&self, pressed: bool) -> (usize, usize);
    fn disk_used_bytes(&self) -> u64;
    fn disk_size_bytes(&self) -> u64;
    fn give_back_disk(&mut self, stats: &VmStats, which: KeptDisk);
    fn backing(&self) -> Option<&dyn BackingFile>;
    /// The files stay for the next process when the store is dropped (see
    /// [`Overlay::keep_state`]); [`Self::own`] undoes it.
    fn keep(&mut self);
    fn own(&mut self);
    /// Recovery: takes a page holding the copy of `block` a previous process left in memory.
    fn adopt_page(&mut self, block: BlockIndex, page: crate::arena::Page) -> Result<Slot>;
    /// Recovery: rebuilds what is on disk; returns the blocks found there and not yet mapped.
    fn recover_disk(&mut self, core: &mut Core, spill: SpillFound) -> Result<u64>;
}

/// What every strategy shares: the block states, the golden image below them, the VM's pages
/// and counters, and the state that lets the overlay outlive its process.
struct Core {
    golden: Arc<dyn GoldenImage>,
    /// Where the VM's pages in memory are: RAM tier, open and in-flight spill segments.
    arena: Arena,
    size: u64,
    config: OverlayConfig,
    map: BlockMap,
    zeros: RangeSet,
    host: Arc<HostMemory>,
    accounted_bytes: u64,
    stats: Arc<VmStats>,
    /// The sequence number of the last copy of a block made (see `state`).
    seq: u64,
    /// Where zeroings are recorded for a recovery, if the VM's state is kept.
    zero_log: Option<ZeroLog>,
    /// The segment summaries of a VM without a spill log: empty, held so that their file is
    /// kept or removed with the rest of the VM's state (a recovery opens it).
    unused_summaries: Option<SegmentSummaries>,
    /// Blocks still to be sent while the overlay moves to another server (see `moving`).
    moving: Option<moving::ToMove>,
}

pub struct Overlay {
    core: Core,
    store: Box<dyn Store>,
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

    fn build(
        golden: Arc<dyn GoldenImage>,
        config: OverlayConfig,
        backing: Option<Box<dyn BackingFile>>,
        host: Arc<HostMemory>,
        stats: Arc<VmStats>,
        arena: Arena,
        state: Option<(ZeroLog, SegmentSummaries)>,
    ) -> Result<Self> {
        if golden.size() > crate::MAX_DISK_BYTES {
            return Err(EngineError::Config(format!(
                "a disk of {} bytes has more than 2^32 blocks of 4 KiB (16 TiB), the most an overlay maps",
                golden.size()
            )));
        }
        let (zero_log, mut summaries) = match state {
            Some((zero_log, summaries)) => (Some(zero_log), Some(summaries)),
            None => (None, None),
        };
        let store: Box<dyn Store> = match (config.mode.backing_file(), backing) {
            (None, None) => Box::new(Tiered::new(None)),
            (Some(BackingKind::SpillLog), Some(file)) => {
                let mut spill = SpillLog::new(file, config.spill_max_bytes, arena.clone())?;
                if let Some(summaries) = summaries.take() {
                    spill.set_summaries(summaries);
                }
                Box::new(Tiered::new(Some(spill)))
            }
            (Some(kind @ (BackingKind::LocalCache | BackingKind::SharedDifferencing)), Some(file)) => {
                Box::new(InPlace::new(file, kind == BackingKind::SharedDifferencing, golden.size()))
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
        let core = Core {
            size: golden.size(),
            golden,
            arena,
            config,
            map: BlockMap::default(),
            zeros: RangeSet::default(),
            host,
            accounted_bytes: 0,
            stats,
            seq: 0,
            zero_log,
            unused_summaries: summaries,
            moving: None,
        };
        core.stats.cache_memory_target_bytes.set(core.config.ram_target_bytes);
        core.stats.cache_disk_size_bytes.set(store.disk_size_bytes());
        Ok(Self { core, store })
    }

    /// The VM's state stays for the next process when this overlay is dropped: its arena, spill
    /// file, summaries and zero log are left as they are. For a server that stops (or hands
    /// over) while the VM lives on; without it, dropping the overlay throws its state away.
    pub fn keep_state(&mut self) {
        self.core.arena.keep();
        self.store.keep();
        if let Some(zero_log) = &mut self.core.zero_log {
            zero_log.keep();
        }
        if let Some(summaries) = &mut self.core.unused_summaries {
            summaries.keep();
        }
    }

    /// Undoes [`Self::keep_state`]: the state goes with the overlay again. A recovery ends
    /// with this once the overlay stands; until then the files it opened are kept.
    fn own_state(&mut self) {
        self.core.arena.own();
        self.store.own();
        if let Some(zero_log) = &mut self.core.zero_log {
            zero_log.own();
        }
        if let Some(summaries) = &mut self.core.unused_summaries {
            summaries.own();
        }
    }

    /// Whether the overlay's state can outlive the process (see [`Self::persistent`]).
    pub fn is_persistent(&self) -> bool {
        self.core.zero_log.is_some()
    }

    /// What tells the golden image under this overlay from other contents (see
    /// [`GoldenImage::identity`]).
    pub fn image_identity(&self) -> Option<String> {
        self.core.golden.identity()
    }

    pub fn size(&self) -> u64 {
        self.core.size
    }

    /// Pages a VM's arena may need: its RAM target, and the pages that can be held beside it.
    pub fn arena_pages(config: &OverlayConfig) -> u32 {
        let target = config.ram_target_bytes.div_ceil(BLOCK_BYTES);
        u32::try_from(target).unwrap_or(u32::MAX).saturating_add(ARENA_SLACK_PAGES)
    }

    pub fn mode(&self) -> WriteCacheMode {
        self.core.config.mode
    }

    pub fn stats(&self) -> &Arc<VmStats> {
        &self.core.stats
    }

    /// The backing file (spill log or in-place cache file), for inspection.
    pub fn backing(&self) -> Option<&dyn BackingFile> {
        self.store.backing()
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        self.core.check_range(offset, len)?;
        self.core.stats.guest_write.add(len);
        self.core.note_changed(offset, len);
        self.store.before_change(&mut self.core, Some(block_count(offset, len)));
        let result = self.store.write(&mut self.core, offset, data);
        self.after_mutation();
        result
    }

    /// Writes `len` bytes at `offset` that are still on their way (in a socket): `receive` fills
    /// the buffers it is handed, in order, with them. In the tiered modes blocks already in RAM
    /// are received straight into their pages (but for a large write while RAM is full, which
    /// goes to the spill log whole), and new ones into fresh pages the RAM tier then keeps, so a
    /// RAM-tier write costs one copy where going through a request buffer cost two (the second
    /// was 30 % of the server's time on 1 MiB writes). If `receive` fails, its error is returned
    /// and the range holds unspecified data, as after any failed write.
    pub fn write_received(
        &mut self,
        offset: u64,
        len: usize,
        receive: impl FnOnce(&mut [IoSliceMut<'_>]) -> io::Result<()>,
    ) -> Result<()> {
        self.core.check_range(offset, len as u64)?;
        self.core.note_changed(offset, len as u64);
        self.store.before_change(&mut self.core, Some(block_count(offset, len as u64)));
        let mut receive = Some(receive);
        let mut received = false;
        let mut receive_once = |buffers: &mut [IoSliceMut<'_>]| {
            let result = match receive.take() {
                Some(receive) => receive(buffers),
                None => Err(io::Error::other("a write's payload was asked for twice")),
            };
            received = result.is_ok();
            result
        };
        let result = self.store.write_received(&mut self.core, offset, len, &mut receive_once);
        // A write the guest never finished sending is not one of its writes.
        if received {
            self.core.stats.guest_write.add(len as u64);
        }
        self.after_mutation();
        result
    }

    /// Zeroes a range without storing data: whole blocks join the zeroed ranges, partial ones are
    /// patched. `NO_HOLE` makes no difference here, since nothing is preallocated for a VM that
    /// is thrown away, and zeroing is never slower than writing (so FAST_ZERO always holds).
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<()> {
        self.core.check_range(offset, len)?;
        self.core.stats.guest_zero.add(len);
        self.core.note_changed(offset, len);
        self.store.before_change(&mut self.core, None);
        let result = self.zero_spans(offset, len);
        self.after_mutation();
        result
    }

    fn zero_spans(&mut self, offset: u64, len: u64) -> Result<()> {
        let (whole_first, whole_end) = whole_blocks(offset, len);
        for span in block_spans(offset, len).filter(|span| !span.is_whole()) {
            let mut block = self.core.read_block(self.store.as_mut(), span.block)?;
            block[span.within..span.within + span.len].fill(0);
            self.store.store_block(&mut self.core, span.block, &block)?;
        }
        if whole_first < whole_end {
            // Recorded before any copy is released: a recovery then finds the range zeroed,
            // whatever this request had done when the process stopped.
            if self.core.zero_log.is_some() {
                let seq = self.core.next_seq();
                let record = ZeroRecord { first: whole_first, end: whole_end, seq };
                self.core.zero_log.as_mut().expect("checked").append(record)?;
            }
            // Zeroed before the copies go (the map wins over zeroed ranges): in place, blocks
            // are punched run by run, and a run punched before a later one failed must read
            // zeroes, not the golden image.
            self.core.zeros.insert(whole_first, whole_end);
            self.drop_blocks(whole_first, whole_end)?;
            self.core.stats.zero_blocks.add(whole_end - whole_first);
            self.core.rewrite_zero_log_if_long();
        }
        Ok(())
    }

    /// Gives whole blocks back: RAM pages and spill slots are freed, in-place file blocks are
    /// punched, and the blocks read from the golden image again. Partial blocks are left alone,
    /// which TRIM allows.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        self.core.check_range(offset, len)?;
        self.core.stats.guest_trim.add(len);
        self.core.note_changed(offset, len);
        let (first, end) = whole_blocks(offset, len);
        let result = if first < end {
            self.core.zeros.remove(first, end);
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
        self.core.stats.guest_flush.add(0);
        self.store.finish_writes(&self.core.stats);
        // A written segment may have freed its space and its owner table: account for it.
        self.after_mutation();
        Ok(())
    }

    /// Removes every mapped block in `[first, end)`, freeing its storage.
    fn drop_blocks(&mut self, first: u64, end: u64) -> Result<()> {
        let map = &self.core.map;
        let mut mapped: Vec<BlockIndex> = if end - first <= map.len() as u64 {
            (first..end).map(BlockIndex).filter(|b| map.contains(*b)).collect()
        } else {
            map.blocks().filter(|b| (first..end).contains(&b.0)).collect()
        };
        mapped.sort_unstable();
        self.store.drop_blocks(&mut self.core, first, end, &mapped)
    }
}

impl Core {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
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
}

impl Drop for Overlay {
    fn drop(&mut self) {
        // The last segment may still be on its way to disk: wait, so that it is counted.
        self.store.finish_writes(&self.core.stats);
        self.core.host.detach(self.core.accounted_bytes);
    }
}

/// A slot a store never makes was found in the map (a spill slot in place, say).
fn foreign_slot(slot: Slot) -> EngineError {
    EngineError::Corrupt(format!("the block map holds {slot:?}, which this VM's mode never stores"))
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
