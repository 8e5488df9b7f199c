//! The in-place strategy of modes `disk` and `shared`: each block at its own offset in a cache
//! file sized like the disk; partial blocks read, patched and written whole.

use std::io::IoSliceMut;

use super::{foreign_slot, whole_blocks, Core, KeptDisk, Receive, SpillFound, Store};
use crate::arena::Page;
use crate::error::{EngineError, Result};
use crate::map::Slot;
use crate::stats::{OpCounter, VmStats};
use crate::store::BackingFile;
use crate::units::{block_spans, Block, BlockIndex, BlockSpan, BLOCK_BYTES, SEGMENT_BYTES};

pub(super) struct InPlace {
    file: Box<dyn BackingFile>,
    /// A differencing file on shared storage (mode `shared`), counted apart from a local one.
    shared: bool,
    /// Blocks the file holds.
    blocks: u64,
    /// The disk's size, which the file is.
    size: u64,
    /// A write to the file failed, and may have left bytes in blocks the map does not have (see
    /// `drop_blocks`).
    stray: bool,
}

impl InPlace {
    pub(super) fn new(file: Box<dyn BackingFile>, shared: bool, size: u64) -> Self {
        Self { file, shared, blocks: 0, size, stray: false }
    }

    fn counters<'a>(&self, stats: &'a VmStats) -> (&'a OpCounter, &'a OpCounter) {
        if self.shared {
            (&stats.shared_read, &stats.shared_write)
        } else {
            (&stats.cache_file_read, &stats.cache_file_write)
        }
    }

    fn write_file(&mut self, core: &mut Core, offset: u64, data: &[u8], first: u64, end: u64) -> Result<()> {
        if let Err(e) = self.file.write_at(data, offset) {
            self.stray = true;
            return Err(EngineError::from_io("writing cache file", e));
        }
        for block in (first..end).map(BlockIndex) {
            if core.map.insert(block, Slot::File).is_none() {
                self.blocks += 1;
            }
        }
        core.stats.write_blocks_cache_file.add(end - first);
        self.counters(&core.stats).1.add(data.len() as u64);
        Ok(())
    }

    fn punch(&mut self, first: u64, end: u64) -> Result<()> {
        self.file
            .punch_hole(first * BLOCK_BYTES, (end - first) * BLOCK_BYTES)
            .map_err(|e| EngineError::from_io("punching cache file", e))
    }
}

impl Store for InPlace {
    fn before_change(&mut self, _core: &mut Core, _written: Option<usize>) {}

    fn shrink_to(&mut self, _core: &mut Core, _limit_bytes: u64) {}

    /// Partial blocks are read, patched and written whole; the aligned body goes down in one
    /// write at its own offset.
    fn write(&mut self, core: &mut Core, offset: u64, data: &[u8]) -> Result<()> {
        let (first, end) = whole_blocks(offset, data.len() as u64);
        let mut pos = 0usize;
        for span in block_spans(offset, data.len() as u64) {
            let piece = &data[pos..pos + span.len];
            pos += span.len;
            if !span.is_whole() {
                let mut block = core.read_block(self, span.block)?;
                block[span.within..span.within + span.len].copy_from_slice(piece);
                self.write_file(core, span.block.byte_offset(), &block, span.block.0, span.block.0 + 1)?;
            }
        }
        if first < end {
            let body_start = (first * BLOCK_BYTES - offset) as usize;
            let body_len = ((end - first) * BLOCK_BYTES) as usize;
            self.write_file(core, first * BLOCK_BYTES, &data[body_start..body_start + body_len], first, end)?;
        }
        Ok(())
    }

    /// The file is written from one buffer anyway.
    fn write_received(&mut self, core: &mut Core, offset: u64, len: usize, receive: &mut Receive<'_>) -> Result<()> {
        let mut data = vec![0; len];
        receive(&mut [IoSliceMut::new(&mut data)]).map_err(|e| EngineError::from_io("receiving data", e))?;
        self.write(core, offset, &data)
    }

    fn store_block(&mut self, core: &mut Core, block: BlockIndex, data: &Block) -> Result<()> {
        self.write(core, block.byte_offset(), data)
    }

    /// Punches the mapped blocks of `[first, end)`, in runs; all of the range once a write has
    /// failed: that write may have left bytes in blocks it never mapped, and a recovery takes
    /// whatever the file holds for data written after any zeroing, so such bytes would come back
    /// in place of the zeroes this zeroing promises. (Only then: a filesystem that cannot punch
    /// would otherwise fail every trim of blocks never written.)
    fn drop_blocks(&mut self, core: &mut Core, first: u64, end: u64, sorted: &[BlockIndex]) -> Result<()> {
        if self.stray {
            self.punch(first, end)?;
        }
        let mut i = 0;
        while i < sorted.len() {
            let mut j = i + 1;
            while j < sorted.len() && sorted[j].0 == sorted[j - 1].0 + 1 {
                j += 1;
            }
            if !self.stray {
                self.punch(sorted[i].0, sorted[j - 1].0 + 1)?;
            }
            for block in &sorted[i..j] {
                core.map.remove(*block);
            }
            self.blocks -= (j - i) as u64;
            i = j;
        }
        Ok(())
    }

    /// Blocks are identity-mapped: a run of them is one read.
    fn read_stored(&mut self, core: &Core, slot: Slot, spans: &[BlockSpan], buf: &mut [u8]) -> Result<usize> {
        if slot != Slot::File {
            return Err(foreign_slot(slot));
        }
        let run = 1 + spans[1..].iter().take_while(|span| core.map.get(span.block) == Some(Slot::File)).count();
        let run_len: usize = spans[..run].iter().map(|span| span.len).sum();
        let offset = spans[0].block.byte_offset() + spans[0].within as u64;
        let target = &mut buf[..run_len];
        self.file.read_at(target, offset).map_err(|e| EngineError::from_io("reading cache file", e))?;
        self.counters(&core.stats).0.add(run_len as u64);
        Ok(run)
    }

    fn finish_writes(&mut self, _stats: &VmStats) {}

    fn settle(&mut self, _core: &mut Core) {}

    fn memory_bytes(&self) -> u64 {
        0
    }

    fn pages_wanted(&self, _pressed: bool) -> (usize, usize) {
        (0, 0)
    }

    fn disk_used_bytes(&self) -> u64 {
        self.blocks * BLOCK_BYTES
    }

    fn disk_size_bytes(&self) -> u64 {
        self.size
    }

    fn give_back_disk(&mut self, _stats: &VmStats, _which: KeptDisk) {}

    fn backing(&self) -> Option<&dyn BackingFile> {
        Some(self.file.as_ref())
    }

    fn keep(&mut self) {
        self.file.keep();
    }

    fn own(&mut self) {
        self.file.own();
    }

    fn adopt_page(&mut self, block: BlockIndex, _page: Page) -> Result<Slot> {
        Err(EngineError::Corrupt(format!("a page of block {} in memory in a VM cached in place", block.0)))
    }

    /// Every block that holds data was written (a zeroing or a trim punches its blocks), after
    /// any zeroing that covers it: data wins over the zero log here.
    fn recover_disk(&mut self, core: &mut Core, _spill: SpillFound) -> Result<u64> {
        let ranges = self.file.data_ranges().map_err(|e| EngineError::from_io("finding the cache file's data", e))?;
        // A filesystem that cannot report holes calls the whole file data; taken at its word,
        // every block never written would read as zeroes instead of golden data.
        let data: u64 = ranges.iter().map(|(start, end)| end - start).sum();
        let allocated = self.file.allocated_bytes().map_err(|e| EngineError::from_io("sizing the cache file", e))?;
        if data > allocated + SEGMENT_BYTES as u64 {
            return Err(EngineError::Corrupt(format!(
                "the cache file's filesystem reports {data} bytes of data in {allocated} allocated: \
                 it cannot tell written blocks from holes"
            )));
        }
        let disk_blocks = core.size.div_ceil(BLOCK_BYTES);
        let mut found = 0;
        for (start, end) in ranges {
            let (first, end) = (start / BLOCK_BYTES, end.div_ceil(BLOCK_BYTES).min(disk_blocks));
            for block in (first..end).map(BlockIndex) {
                if core.map.insert(block, Slot::File).is_none() {
                    self.blocks += 1;
                    found += 1;
                }
            }
        }
        Ok(found)
    }
}
