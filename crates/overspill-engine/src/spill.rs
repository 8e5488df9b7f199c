//! The spill log: RAM overflow packed into 2 MiB segments, each written with one `pwrite`.
//!
//! A segment is in one of three states:
//! - **free**: no data; its range of the file is a hole (never written, or punched);
//! - **open**: at most one at a time, a 2 MiB buffer in memory that evicted and compacted blocks
//!   are appended to. Blocks in it are read and overwritten in memory. It is written out in one
//!   piece when it is full and space is needed for the next block;
//! - **sealed**: on disk, read one 4 KiB block at a time.
//!
//! Every slot remembers the block it was written for; a slot is live while the overlay's map
//! still points at it. Overwrites and TRIMs make slots dead ([`SpillLog::release`]); a sealed
//! segment whose last slot dies is punched out of the file and becomes free, so the file's
//! allocated size follows the live data. Segments with few live slots are compacted by the
//! overlay (which owns the map) when free space runs low or garbage outweighs live data.
//!
//! With a byte limit, one free segment is held back for compaction so that compaction can always
//! make progress; guest data gets `NoSpace` before that reserve is touched.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::error::{EngineError, Result};
use crate::stats::VmStats;
use crate::store::BackingFile;
use crate::units::{Block, BlockIndex, SegmentId, SpillAddr, BLOCKS_PER_SEGMENT, BLOCK_SIZE, SEGMENT_BYTES};

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
    buffer: Box<[u8]>,
}

/// Who asks for spill space: compaction may use the reserve segment, guest data may not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Guest,
    Compaction,
}

pub struct SpillLog {
    file: Box<dyn BackingFile>,
    segments: Vec<Segment>,
    free: BinaryHeap<Reverse<u32>>,
    open: Option<OpenSegment>,
    max_segments: Option<u32>,
    live_blocks: u64,
    sealed_segments: u32,
    /// Segments whose owner table is allocated (open or sealed): kept as a count so that the
    /// memory figure, asked for on every write, does not walk every segment.
    owner_tables: u64,
    /// The buffer of the last segment written out, reused for the next open one: allocating and
    /// zeroing 2 MiB per segment cost as much as copying the blocks into it.
    spare_buffer: Option<Box<[u8]>>,
}

impl SpillLog {
    pub fn new(file: Box<dyn BackingFile>, max_bytes: Option<u64>) -> Result<Self> {
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
            file,
            segments: Vec::new(),
            free: BinaryHeap::new(),
            open: None,
            max_segments,
            live_blocks: 0,
            sealed_segments: 0,
            owner_tables: 0,
            spare_buffer: None,
        })
    }

    pub fn live_blocks(&self) -> u64 {
        self.live_blocks
    }

    /// Bytes of the file holding data: sealed segments (free ones are holes).
    pub fn disk_used_bytes(&self) -> u64 {
        u64::from(self.sealed_segments) * SEGMENT_BYTES as u64
    }

    /// The file's logical size, or its limit when one is set.
    pub fn disk_size_bytes(&self) -> u64 {
        match self.max_segments {
            Some(max) => u64::from(max) * SEGMENT_BYTES as u64,
            None => self.segments.len() as u64 * SEGMENT_BYTES as u64,
        }
    }

    /// Frees the buffer kept from the last sealed segment; the next segment allocates its own.
    pub fn drop_spare_buffer(&mut self) {
        self.spare_buffer = None;
    }

    pub fn memory_bytes(&self) -> u64 {
        let buffer = if self.open.is_some() || self.spare_buffer.is_some() { SEGMENT_BYTES } else { 0 };
        let owners = self.owner_tables as usize * BLOCKS_PER_SEGMENT;
        (buffer
            + owners * std::mem::size_of::<BlockIndex>()
            + self.segments.capacity() * std::mem::size_of::<Segment>()
            + self.free.capacity() * 4) as u64
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
            let in_use = self.segments.len() as u64 - self.free.len() as u64;
            u64::from(max) - in_use
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

    /// The sealed segment with the fewest live slots, if it has any dead ones.
    pub fn compaction_victim(&self) -> Option<SegmentId> {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == SegmentState::Sealed && (s.live as usize) < BLOCKS_PER_SEGMENT)
            .min_by_key(|(_, s)| s.live)
            .map(|(i, _)| SegmentId(i as u32))
    }

    /// Reads a whole sealed segment in one sequential read, with its slot owners, for compaction.
    pub fn read_segment(&mut self, id: SegmentId, stats: &VmStats) -> Result<(Box<[u8]>, Vec<BlockIndex>)> {
        let mut buffer = vec![0u8; SEGMENT_BYTES].into_boxed_slice();
        self.file
            .read_at(&mut buffer, id.byte_offset())
            .map_err(|e| EngineError::from_io("reading spill segment", e))?;
        stats.spill_read.add(SEGMENT_BYTES as u64);
        Ok((buffer, self.segments[id.0 as usize].owners.clone()))
    }

    /// Appends a block. On error nothing changed: the block is not in the log.
    pub fn append(&mut self, owner: BlockIndex, data: &Block, purpose: Purpose, stats: &VmStats) -> Result<SpillAddr> {
        let full =
            self.open.as_ref().is_some_and(|open| self.segments[open.id.0 as usize].owners.len() == BLOCKS_PER_SEGMENT);
        if full {
            self.seal(stats)?;
        }
        if self.open.is_none() {
            let id = self.allocate(purpose)?;
            // A reused buffer holds the old segment's bytes; every slot is written before it is
            // read or sealed, since segments are written out only when full.
            let buffer = self.spare_buffer.take().unwrap_or_else(|| vec![0u8; SEGMENT_BYTES].into_boxed_slice());
            self.open = Some(OpenSegment { id, buffer });
        }
        let open = self.open.as_mut().expect("opened above");
        let segment = &mut self.segments[open.id.0 as usize];
        let slot = segment.owners.len();
        open.buffer[slot * BLOCK_SIZE..(slot + 1) * BLOCK_SIZE].copy_from_slice(data);
        segment.owners.push(owner);
        segment.live += 1;
        self.live_blocks += 1;
        // Slots are below BLOCKS_PER_SEGMENT (512).
        Ok(SpillAddr { segment: open.id, slot: slot as u16 })
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
        let id = match self.free.pop() {
            Some(Reverse(id)) => id,
            None => {
                self.segments.push(Segment { state: SegmentState::Free, live: 0, owners: Vec::new() });
                u32::try_from(self.segments.len() - 1)
                    .map_err(|_| EngineError::NoSpace("spill log has 2^32 segments".into()))?
            }
        };
        let segment = &mut self.segments[id as usize];
        debug_assert_eq!(segment.state, SegmentState::Free);
        segment.state = SegmentState::Open;
        segment.owners = Vec::with_capacity(BLOCKS_PER_SEGMENT);
        self.owner_tables += 1;
        Ok(SegmentId(id))
    }

    /// Writes the open segment out in one piece. On error it stays open and readable.
    fn seal(&mut self, stats: &VmStats) -> Result<()> {
        let Some(open) = self.open.as_ref() else { return Ok(()) };
        self.file
            .write_at(&open.buffer, open.id.byte_offset())
            .map_err(|e| EngineError::from_io("writing spill segment", e))?;
        stats.spill_write.add(SEGMENT_BYTES as u64);
        stats.spill_write_sizes.record(SEGMENT_BYTES as u64);
        stats.spill_segments_written.inc();
        let id = open.id;
        if stats.spill_segments_written.get() == 1 {
            // Once per VM at info: the moment its working set outgrew its RAM target.
            tracing::info!(segment = id.0, "VM started spilling to disk");
        } else {
            tracing::debug!(segment = id.0, live = self.segments[id.0 as usize].live, "spill segment written");
        }
        self.spare_buffer = self.open.take().map(|open| open.buffer);
        self.segments[id.0 as usize].state = SegmentState::Sealed;
        self.sealed_segments += 1;
        if self.segments[id.0 as usize].live == 0 {
            // Everything in it died while it was open.
            self.free_segment(id, stats);
        }
        Ok(())
    }

    pub fn read(&mut self, addr: SpillAddr, buf: &mut Block, stats: &VmStats) -> Result<()> {
        if let Some(open) = self.open.as_ref().filter(|open| open.id == addr.segment) {
            let start = usize::from(addr.slot) * BLOCK_SIZE;
            buf.copy_from_slice(&open.buffer[start..start + BLOCK_SIZE]);
            return Ok(());
        }
        self.file.read_at(buf, addr.byte_offset()).map_err(|e| EngineError::from_io("reading spill block", e))?;
        stats.spill_read.add(BLOCK_SIZE as u64);
        Ok(())
    }

    /// Overwrites a block of the open segment in memory; the caller checked [`Self::is_open`].
    pub fn overwrite_open(&mut self, addr: SpillAddr, data: &Block) {
        let open = self.open.as_mut().expect("caller checked the segment is open");
        debug_assert_eq!(open.id, addr.segment);
        let start = usize::from(addr.slot) * BLOCK_SIZE;
        open.buffer[start..start + BLOCK_SIZE].copy_from_slice(data);
    }

    /// Marks a slot dead. A sealed segment with no live slot left is punched out of the file.
    pub fn release(&mut self, addr: SpillAddr, stats: &VmStats) {
        let segment = &mut self.segments[addr.segment.0 as usize];
        debug_assert!(segment.live > 0);
        segment.live -= 1;
        self.live_blocks -= 1;
        if segment.live == 0 && segment.state == SegmentState::Sealed {
            self.free_segment(addr.segment, stats);
        }
    }

    fn free_segment(&mut self, id: SegmentId, stats: &VmStats) {
        let segment = &mut self.segments[id.0 as usize];
        segment.state = SegmentState::Free;
        segment.owners = Vec::new();
        self.owner_tables -= 1;
        self.sealed_segments -= 1;
        self.free.push(Reverse(id.0));
        // A failed punch only leaves space allocated: the data there is dead either way, so the
        // guest need not hear of it.
        match self.file.punch_hole(id.byte_offset(), SEGMENT_BYTES as u64) {
            Ok(()) => stats.spill_segments_punched.inc(),
            Err(error) => tracing::warn!(%error, segment = id.0, "could not punch spill segment"),
        }
    }
}
