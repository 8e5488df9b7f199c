//! Block status: how each range of the VM's disk is stored, the golden image's own allocation
//! where the VM has not written; and which layer holds each range (`qemu:allocation-depth`).

use std::io;

use super::{Overlay, Source};
use crate::error::{EngineError, Result};
use crate::golden::{push_extent, Allocation, Extent};
use crate::units::{BlockIndex, BLOCK_BYTES};

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

pub use crate::golden::LayerRun;

/// The VM's own writes, zeroes included, wherever they are kept.
pub const DEPTH_OVERLAY: u32 = 1;
/// The golden image's stored data or zeroes, its top layer's (each layer under it one deeper).
pub const DEPTH_GOLDEN: u32 = 2;

fn push_run(runs: &mut Vec<LayerRun>, len: u64, depth: u32) {
    match runs.last_mut() {
        _ if len == 0 => {}
        Some(last) if last.depth == depth => last.len += len,
        _ => runs.push(LayerRun { len, depth }),
    }
}

impl Overlay {
    /// Which layer holds each part of `[offset, offset + len)`: the VM's overlay for what it
    /// wrote or zeroed (a TRIMmed block is the golden image's again), the golden image where it
    /// stores data or zeroes, no layer where it has a hole; in whole blocks, as [`Self::extents`].
    pub fn allocation_depth(&self, offset: u64, len: u64) -> Result<Vec<LayerRun>> {
        self.core.check_range(offset, len)?;
        let mut runs = Vec::new();
        let end = offset + len;
        let mut block = offset / BLOCK_BYTES;
        let end_block = end.div_ceil(BLOCK_BYTES);
        let golden_at = |block: u64| self.core.source(BlockIndex(block)) == Source::Golden;
        while block < end_block {
            let golden = golden_at(block);
            let mut run_end = block + 1;
            while run_end < end_block && golden_at(run_end) == golden {
                run_end += 1;
            }
            let (from, to) = ((block * BLOCK_BYTES).max(offset), (run_end * BLOCK_BYTES).min(end));
            if golden {
                for layer in self.golden_layer_runs(from, to)? {
                    let depth = if layer.depth == 0 { 0 } else { DEPTH_OVERLAY + layer.depth };
                    push_run(&mut runs, layer.len, depth);
                }
            } else {
                push_run(&mut runs, to - from, DEPTH_OVERLAY);
            }
            block = run_end;
        }
        Ok(runs)
    }

    /// How `[offset, offset + len)` of the VM's disk is stored, for block status: what the VM
    /// wrote is data wherever it lives (RAM, spill, cache file); what it zeroed is `Zero` (it
    /// reads as zeroes, and a client that zeroed with NO_HOLE is never told of a hole it did not
    /// ask for); the rest is the golden image's own allocation (holes in a sparse raw file,
    /// unallocated qcow2 clusters, absent VHDX blocks), in whole blocks: a block part data and
    /// part hole is data.
    pub fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.core.check_range(offset, len)?;
        let mut extents = Vec::new();
        let end = offset + len;
        let mut block = offset / BLOCK_BYTES;
        let end_block = end.div_ceil(BLOCK_BYTES);
        while block < end_block {
            let source = self.core.source(BlockIndex(block));
            let mut run_end = block + 1;
            while run_end < end_block && same_kind(self.core.source(BlockIndex(run_end)), source) {
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
    /// The golden image's layer runs over `[from, to)`, in whole blocks (a block two layers
    /// share is the shallower one's, as a block part data and part hole is data), holes past
    /// its end.
    fn golden_layer_runs(&self, from: u64, to: u64) -> Result<Vec<LayerRun>> {
        let io = |source| EngineError::Io { what: "asking the golden image for its layers", source };
        let golden_end = to.min(self.core.golden.size());
        let shallower = |a: u32, b: u32| match (a, b) {
            (0, d) | (d, 0) => d,
            (a, b) => a.min(b),
        };
        let mut runs = Vec::new();
        // The depth of the block being gathered, and where it starts.
        let mut pending: Option<(u64, u32)> = None;
        let mut at = from;
        while at < golden_end {
            let parts = self.core.golden.layer_runs(at, golden_end - at).map_err(io)?;
            if parts.is_empty() || parts.iter().any(|part| part.len == 0) {
                return Err(io(io::Error::other("the golden image reported no layer, or an empty one")));
            }
            for part in parts {
                let part_end = (at + part.len).min(golden_end);
                let mut pos = at;
                while pos < part_end {
                    let block_end = ((pos / BLOCK_BYTES + 1) * BLOCK_BYTES).min(golden_end);
                    let depth = pending.map_or(part.depth, |(_, held)| shallower(held, part.depth));
                    if part_end >= block_end {
                        push_run(&mut runs, block_end - pending.map_or(pos, |(start, _)| start), depth);
                        pending = None;
                        let whole_end = part_end / BLOCK_BYTES * BLOCK_BYTES;
                        if whole_end > block_end {
                            push_run(&mut runs, whole_end - block_end, part.depth);
                            pos = whole_end;
                        } else {
                            pos = block_end;
                        }
                    } else {
                        pending = Some((pending.map_or(pos, |(start, _)| start), depth));
                        pos = part_end;
                    }
                }
                at = part_end;
                if at >= golden_end {
                    break;
                }
            }
        }
        if let Some((start, depth)) = pending {
            push_run(&mut runs, golden_end - start, depth);
        }
        push_run(&mut runs, to - golden_end.max(from), 0);
        Ok(runs)
    }

    fn golden_extents(&self, from: u64, to: u64, extents: &mut Vec<Extent>) -> Result<()> {
        let io = |source| EngineError::Io { what: "asking the golden image for its allocation", source };
        let golden_end = to.min(self.core.golden.size());
        let mut at = from;
        // The state of the block being gathered, and where it starts.
        let mut pending: Option<(u64, Allocation)> = None;
        while at < golden_end {
            let parts = self.core.golden.extents(at, golden_end - at).map_err(io)?;
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
}
