//! Reads: whole requests or their parts, block by block from wherever each block is, runs of
//! neighbours in one read, golden runs lent by the read cache; prefetch; and the accounting of
//! what was read from which tier.

use bytes::Bytes;

use super::{Core, Overlay, Source, Store};
use crate::error::{EngineError, Result};
use crate::map::Slot;
use crate::stats::Counter;
use crate::units::{block_spans, Block, BlockIndex, BlockSpan, BLOCK_BYTES, BLOCK_SIZE};

impl Overlay {
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.core.check_range(offset, buf.len() as u64)?;
        self.count_read_request();
        self.read_part(offset, buf)
    }

    /// Counts one read request whose bytes come in parts ([`Self::read_part`],
    /// [`Self::read_shared_part`], [`Self::count_unread`]): a server that answers a large read in
    /// slices, or around runs it sends as holes, counts the guest's one request once.
    pub fn count_read_request(&self) {
        self.core.stats.guest_read.ops.inc();
    }

    /// [`Self::read`] of a part of a request counted by [`Self::count_read_request`].
    pub fn read_part(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len() as u64;
        self.core.check_range(offset, len)?;
        self.core.stats.guest_read.bytes.add(len);
        self.core.read_spans(self.store.as_mut(), offset, buf)
    }

    /// A part of a read request answered as zeroes without being read (NBD sends it as a hole
    /// chunk, having asked [`Self::extents`]): counted as read, each block by the tier a read
    /// would have taken it from, so that what the guest read is told whole. Nothing is fetched.
    pub fn count_unread(&mut self, offset: u64, len: u64) -> Result<()> {
        let core = &self.core;
        core.check_range(offset, len)?;
        core.stats.guest_read.bytes.add(len);
        for span in block_spans(offset, len) {
            core.blocks_read_from(core.source(span.block)).inc();
        }
        Ok(())
    }

    /// Reads the golden blocks of a range into the shared read cache and throws them away
    /// (NBD_CMD_CACHE): a VM that says what it will read soon gets it from RAM. Blocks the VM
    /// has written are already here. Returns the bytes fetched from the golden image.
    pub fn prefetch(&mut self, offset: u64, len: u64) -> Result<u64> {
        let core = &self.core;
        core.check_range(offset, len)?;
        const PIECE: u64 = 1 << 20;
        let mut scratch = Vec::new();
        let mut fetched = 0;
        let mut block = offset / BLOCK_BYTES;
        let end_block = (offset + len).div_ceil(BLOCK_BYTES);
        while block < end_block {
            if core.source(BlockIndex(block)) != Source::Golden {
                block += 1;
                continue;
            }
            let mut run_end = block + 1;
            while run_end < end_block
                && run_end - block < PIECE / BLOCK_BYTES
                && core.source(BlockIndex(run_end)) == Source::Golden
            {
                run_end += 1;
            }
            let from = block * BLOCK_BYTES;
            let to = (run_end * BLOCK_BYTES).min(core.golden.size());
            if from < to {
                scratch.resize((to - from) as usize, 0);
                core.read_golden(&mut scratch, from)?;
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
        self.core.check_range(offset, len as u64)?;
        self.count_read_request();
        self.read_shared_part(offset, len)
    }

    /// [`Self::read_shared`] of a part of a request counted by [`Self::count_read_request`].
    pub fn read_shared_part(&mut self, offset: u64, len: usize) -> Result<Vec<Bytes>> {
        let core = &self.core;
        core.check_range(offset, len as u64)?;
        core.stats.guest_read.bytes.add(len as u64);
        let spans: Vec<BlockSpan> = block_spans(offset, len as u64).collect();
        let golden: Vec<bool> = spans.iter().map(|span| core.source(span.block) == Source::Golden).collect();
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < spans.len() {
            let j = i + golden[i..].iter().take_while(|&&g| g == golden[i]).count();
            let run_offset = spans[i].block.byte_offset() + spans[i].within as u64;
            let run_len: usize = spans[i..j].iter().map(|span| span.len).sum();
            if golden[i] {
                let (shared, fetched) = self
                    .core
                    .golden
                    .read_shared(run_offset, run_len)
                    .map_err(|source| EngineError::Io { what: "reading golden image", source })?;
                self.core.count_golden_fetch(run_len, fetched);
                self.core.stats.read_blocks_golden.add((j - i) as u64);
                pieces.extend(shared);
            } else {
                let mut copy = vec![0u8; run_len];
                self.core.read_spans(self.store.as_mut(), run_offset, &mut copy)?;
                pieces.push(Bytes::from(copy));
            }
            i = j;
        }
        Ok(pieces)
    }
}

impl Core {
    /// Reads `[offset, offset + buf.len())` from wherever each block is: runs of golden blocks
    /// in one read of the image, runs of stored ones as the store reads them.
    fn read_spans(&self, store: &mut dyn Store, offset: u64, buf: &mut [u8]) -> Result<()> {
        let spans: Vec<BlockSpan> = block_spans(offset, buf.len() as u64).collect();
        let mut i = 0;
        let mut pos = 0usize;
        while i < spans.len() {
            let span = spans[i];
            let source = self.source(span.block);
            let read = match source {
                // Golden blocks are identity-mapped: a run of them is one read.
                Source::Golden => {
                    let run = 1 + spans[i + 1..].iter().take_while(|s| self.source(s.block) == Source::Golden).count();
                    let run_len: usize = spans[i..i + run].iter().map(|s| s.len).sum();
                    self.read_golden(&mut buf[pos..pos + run_len], span.block.byte_offset() + span.within as u64)?;
                    run
                }
                Source::Zero => {
                    buf[pos..pos + span.len].fill(0);
                    1
                }
                Source::Ram(slot) => store.read_stored(self, Slot::Ram(slot), &spans[i..], &mut buf[pos..])?,
                Source::Spill(addr) => store.read_stored(self, Slot::Spill(addr), &spans[i..], &mut buf[pos..])?,
                Source::File => store.read_stored(self, Slot::File, &spans[i..], &mut buf[pos..])?,
            };
            self.blocks_read_from(source).add(read as u64);
            pos += spans[i..i + read].iter().map(|s| s.len).sum::<usize>();
            i += read;
        }
        Ok(())
    }

    /// The counter of blocks read from where `source` says.
    fn blocks_read_from(&self, source: Source) -> &Counter {
        match source {
            Source::Golden => &self.stats.read_blocks_golden,
            Source::Zero => &self.stats.read_blocks_zero,
            Source::Ram(_) => &self.stats.read_blocks_ram,
            Source::Spill(_) => &self.stats.read_blocks_spill,
            Source::File => &self.stats.read_blocks_cache_file,
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

    /// The current contents of one block, from whichever tier holds it.
    pub(super) fn read_block(&self, store: &mut dyn Store, block: BlockIndex) -> Result<Block> {
        let mut data = [0u8; BLOCK_SIZE];
        let whole = [BlockSpan { block, within: 0, len: BLOCK_SIZE }];
        match self.source(block) {
            Source::Golden => self.read_golden(&mut data, block.byte_offset())?,
            Source::Zero => {}
            Source::Ram(slot) => _ = store.read_stored(self, Slot::Ram(slot), &whole, &mut data)?,
            Source::Spill(addr) => _ = store.read_stored(self, Slot::Spill(addr), &whole, &mut data)?,
            Source::File => _ = store.read_stored(self, Slot::File, &whole, &mut data)?,
        }
        Ok(data)
    }
}
