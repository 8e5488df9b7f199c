//! The in-place strategy of modes `disk` and `shared`: each block at its own offset in a cache
//! file sized like the disk; partial blocks read, patched and written whole.

use super::{whole_blocks, Overlay, Tier};
use crate::error::{EngineError, Result};
use crate::map::Slot;
use crate::stats::OpCounter;
use crate::store::BackingFile;
use crate::units::{block_spans, BlockIndex, BLOCK_BYTES};

impl Overlay {
    fn in_place_counters(&self, shared: bool) -> (&OpCounter, &OpCounter) {
        if shared {
            (&self.stats.shared_read, &self.stats.shared_write)
        } else {
            (&self.stats.cache_file_read, &self.stats.cache_file_write)
        }
    }

    pub(super) fn read_in_place(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let Tier::InPlace { file, shared, .. } = &mut self.tier else {
            unreachable!("file slots exist only in in-place modes")
        };
        let shared = *shared;
        file.read_at(buf, offset).map_err(|e| EngineError::from_io("reading cache file", e))?;
        self.in_place_counters(shared).0.add(buf.len() as u64);
        Ok(())
    }

    /// Punches the mapped blocks of `[first, end)`, in runs; all of the range once a write has
    /// failed: that write may have left bytes in blocks it never mapped, and a recovery takes
    /// whatever the file holds for data written after any zeroing, so such bytes would come back
    /// in place of the zeroes this zeroing promises. (Only then: a filesystem that cannot punch
    /// would otherwise fail every trim of blocks never written.)
    pub(super) fn punch_in_place(&mut self, first: u64, end: u64, sorted: &[BlockIndex]) -> Result<()> {
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
    pub(super) fn write_in_place(&mut self, offset: u64, data: &[u8]) -> Result<()> {
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
}
