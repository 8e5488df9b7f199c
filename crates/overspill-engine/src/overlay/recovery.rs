//! What lets an overlay outlive its process: rebuilding one from the state a previous process
//! left (pages, segment summaries, zero log, cache file), and keeping the zero log short.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Core, Overlay, OverlayConfig, WriteCacheMode, ZERO_LOG_REWRITE_RECORDS};
use crate::arena::{Arena, LivePage, Owner, Page};
use crate::budget::HostMemory;
use crate::error::{EngineError, Result};
use crate::golden::GoldenImage;
use crate::map::Slot;
use crate::state::{self, CopyAt, Found, StateFiles, ZeroRecord};
use crate::stats::VmStats;
use crate::store::BackingFile;
use crate::units::{BlockIndex, SegmentId, SpillAddr, BLOCK_BYTES};

/// What a recovery found of the spill log, for the store to rebuild it from.
pub(super) struct SpillFound {
    /// The spill file's length in segments.
    pub(super) segments: u32,
    /// Live blocks per sealed segment that holds any.
    pub(super) live_slots: HashMap<u32, u16>,
    /// Each segment's slots, as summarised.
    pub(super) summary: Vec<Vec<Option<Owner>>>,
}

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
        let mut live_slots: HashMap<u32, u16> = HashMap::new();
        for (&block, &(_, at)) in &resolution.current {
            let block = BlockIndex(block);
            let slot = match at {
                CopyAt::Page(i) => {
                    let page = pages[i].take().expect("each page is one block's copy");
                    overlay.store.adopt_page(block, page)?
                }
                CopyAt::Spill { segment, slot } => {
                    if !spilling {
                        return Err(EngineError::Corrupt("spill slots in a VM without a spill log".into()));
                    }
                    *live_slots.entry(segment).or_default() += 1;
                    Slot::Spill(SpillAddr { segment: SegmentId(segment), slot })
                }
            };
            overlay.core.map.insert(block, slot);
        }
        // Copies that lost: freed, their headers cleared, once the recovery stands (below).
        let lost_copies = pages;
        for (first, end) in resolution.zeros {
            overlay.core.zeros.insert(first, end);
        }
        overlay.core.seq = resolution.max_seq;
        let found = SpillFound { segments: spill_segments, live_slots, summary };
        let on_disk = overlay.store.recover_disk(&mut overlay.core, found)?;
        overlay.core.stats.recovered_blocks.add(resolution.current.len() as u64 + on_disk);
        overlay.own_state();
        drop(lost_copies);
        overlay.after_mutation();
        Ok(overlay)
    }
}

impl Core {
    /// Rewrites the zero log as the zeroed ranges less the blocks written since, once its
    /// records outnumber those ranges by far (a guest zeroing the same blocks over and over
    /// must not grow it forever), and twice what the last rewrite left: one whose ranges the
    /// VM's writes cut into many pieces comes out long, and must not be rewritten again (the
    /// whole map walked under the VM's lock) at every zeroing after it.
    pub(super) fn rewrite_zero_log_if_long(&mut self) {
        let Some(zero_log) = &self.zero_log else { return };
        let limit = ZERO_LOG_REWRITE_RECORDS + 4 * self.zeros.len() as u64 + self.map.len() as u64 / 16;
        if zero_log.records() <= limit.max(2 * zero_log.rewritten_to()) {
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
