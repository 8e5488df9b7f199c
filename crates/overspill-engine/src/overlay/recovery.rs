//! What lets an overlay outlive its process: rebuilding one from the state a previous process
//! left (pages, segment summaries, zero log, cache file), and keeping the zero log short.

use std::sync::Arc;

use super::{Overlay, OverlayConfig, Tier, WriteCacheMode, ZERO_LOG_REWRITE_RECORDS};
use crate::arena::{Arena, LivePage, Owner, Page};
use crate::budget::HostMemory;
use crate::error::{EngineError, Result};
use crate::golden::GoldenImage;
use crate::map::Slot;
use crate::state::{self, CopyAt, Found, StateFiles, ZeroRecord};
use crate::stats::VmStats;
use crate::store::BackingFile;
use crate::units::{BlockIndex, SegmentId, SpillAddr, BLOCK_BYTES, SEGMENT_BYTES};

impl Overlay {
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

    /// Rewrites the zero log as the zeroed ranges less the blocks written since, once its
    /// records outnumber those ranges by far (a guest zeroing the same blocks over and over
    /// must not grow it forever).
    pub(super) fn rewrite_zero_log_if_long(&mut self) {
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
}
