//! Sizes and typed indices, so that a block number is never mistaken for a byte offset.

/// The overlay's unit of copy-on-write: every map entry covers one block.
pub const BLOCK_SIZE: usize = 4096;
pub const BLOCK_BYTES: u64 = BLOCK_SIZE as u64;

/// One spill write: RAM overflow leaves in segments of this size, each written with one `pwrite`.
pub const SEGMENT_BYTES: usize = 2 << 20;
pub const BLOCKS_PER_SEGMENT: usize = SEGMENT_BYTES / BLOCK_SIZE;

/// A 4 KiB block of the virtual disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockIndex(pub u64);

impl BlockIndex {
    pub fn containing(byte_offset: u64) -> Self {
        Self(byte_offset / BLOCK_BYTES)
    }

    pub fn byte_offset(self) -> u64 {
        self.0 * BLOCK_BYTES
    }
}

/// A 2 MiB slot of the spill file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u32);

impl SegmentId {
    pub fn byte_offset(self) -> u64 {
        u64::from(self.0) * SEGMENT_BYTES as u64
    }
}

/// Where one spilled block lives: a segment and a block slot inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpillAddr {
    pub segment: SegmentId,
    pub slot: u16,
}

impl SpillAddr {
    pub fn byte_offset(self) -> u64 {
        self.segment.byte_offset() + u64::from(self.slot) * BLOCK_BYTES
    }
}

/// A block's worth of bytes.
pub type Block = [u8; BLOCK_SIZE];

/// The part of one block that a byte range touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpan {
    pub block: BlockIndex,
    /// Offset of the span inside the block.
    pub within: usize,
    pub len: usize,
}

impl BlockSpan {
    pub fn is_whole(&self) -> bool {
        self.len == BLOCK_SIZE
    }
}

/// Splits `[offset, offset + len)` into per-block spans: an unaligned head, whole blocks, an
/// unaligned tail. The one place where unaligned I/O is cut up.
pub fn block_spans(offset: u64, len: u64) -> impl Iterator<Item = BlockSpan> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let block = BlockIndex::containing(pos);
        // Both values are below BLOCK_BYTES, so the casts cannot truncate.
        let within = (pos - block.byte_offset()) as usize;
        let span_len = (BLOCK_BYTES - within as u64).min(end - pos) as usize;
        pos += span_len as u64;
        Some(BlockSpan { block, within, len: span_len })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_the_range_exactly() {
        let spans: Vec<_> = block_spans(4000, 9000).collect();
        assert_eq!(spans.len(), 4);
        assert_eq!(spans[0], BlockSpan { block: BlockIndex(0), within: 4000, len: 96 });
        assert!(spans[1].is_whole() && spans[2].is_whole());
        assert_eq!(spans[3], BlockSpan { block: BlockIndex(3), within: 0, len: 712 });
        assert_eq!(spans.iter().map(|s| s.len).sum::<usize>(), 9000);
        assert_eq!(block_spans(8192, 0).count(), 0);
    }
}
