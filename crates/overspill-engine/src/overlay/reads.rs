//! Reads: whole requests or their parts, block by block from wherever each block is, runs of
//! neighbours in one read, golden runs lent by the read cache; prefetch; and the accounting of
//! what was read from which tier.

use bytes::Bytes;

use super::{Overlay, Source};
use crate::error::{EngineError, Result};
use crate::units::{block_spans, Block, BlockIndex, BlockSpan, SpillAddr, BLOCK_BYTES, BLOCK_SIZE};

impl Overlay {
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

    /// The current contents of one block, from whichever tier holds it.
    pub(super) fn read_block(&mut self, block: BlockIndex) -> Result<Block> {
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
}
