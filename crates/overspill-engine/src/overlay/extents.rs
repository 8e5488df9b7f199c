//! Block status: how each range of the VM's disk is stored, the golden image's own allocation
//! where the VM has not written; and which layer holds each range (`qemu:allocation-depth`).

use std::io;

use super::{Overlay, Source};
use crate::error::{EngineError, Result};
use crate::golden::{push_extent, push_layer_run, Allocation, Extent};
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
                    push_layer_run(&mut runs, layer.len, depth);
                }
            } else {
                push_layer_run(&mut runs, to - from, DEPTH_OVERLAY);
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

    /// The golden image's layer runs over `[from, to)`, in whole blocks (a block two layers
    /// share is the shallower one's, as a block part data and part hole is data), no layer's
    /// past its end.
    fn golden_layer_runs(&self, from: u64, to: u64) -> Result<Vec<LayerRun>> {
        let golden = &self.core.golden;
        let mut runs = Vec::new();
        self.golden_blocks(
            from,
            to,
            "layers",
            |at, len| Ok(golden.layer_runs(at, len)?.into_iter().map(|run| (run.len, run.depth)).collect()),
            |a, b| match (a, b) {
                (0, depth) | (depth, 0) => depth,
                (a, b) => a.min(b),
            },
            |len, depth| push_layer_run(&mut runs, len, depth),
            0,
        )?;
        Ok(runs)
    }

    /// The golden image's extents for `[from, to)`, block by block: a block holding any data is
    /// data, else any stored zeroes make it zero, else it is a hole.
    fn golden_extents(&self, from: u64, to: u64, extents: &mut Vec<Extent>) -> Result<()> {
        let golden = &self.core.golden;
        self.golden_blocks(
            from,
            to,
            "extents",
            |at, len| Ok(golden.extents(at, len)?.into_iter().map(|extent| (extent.len, extent.state)).collect()),
            strongest,
            |len, state| push_extent(extents, len, state),
            // Past the end of a golden image shorter than the disk: zeroes nobody stored.
            Allocation::Hole,
        )
    }

    /// Folds what the golden image says of `[from, to)`, runs of some state that `ask` gives
    /// from an offset (at least one byte of it at a time), into whole blocks for `push`: a block
    /// two states share is what `merge` makes of them, and what lies past the image's end is
    /// `past_end`. `what` names the runs in errors.
    #[allow(clippy::too_many_arguments)]
    fn golden_blocks<S: Copy>(
        &self,
        from: u64,
        to: u64,
        what: &str,
        ask: impl Fn(u64, u64) -> io::Result<Vec<(u64, S)>>,
        merge: impl Fn(S, S) -> S,
        mut push: impl FnMut(u64, S),
        past_end: S,
    ) -> Result<()> {
        let io = |source| EngineError::Io { what: "asking the golden image how it is stored", source };
        let golden_end = to.min(self.core.golden.size());
        let mut at = from;
        // The state of the block being gathered, and where it starts.
        let mut pending: Option<(u64, S)> = None;
        while at < golden_end {
            let parts = ask(at, golden_end - at).map_err(io)?;
            if parts.is_empty() || parts.iter().any(|&(len, _)| len == 0) {
                return Err(io(io::Error::other(format!("the golden image reported no {what}, or an empty one"))));
            }
            for (len, state) in parts {
                let part_end = (at + len).min(golden_end);
                let mut pos = at;
                while pos < part_end {
                    let block_end = ((pos / BLOCK_BYTES + 1) * BLOCK_BYTES).min(golden_end);
                    let merged = pending.map_or(state, |(_, held)| merge(held, state));
                    if part_end >= block_end {
                        // This block is complete: emit it, then whole blocks of this part at once.
                        push(block_end - pending.map_or(pos, |(start, _)| start), merged);
                        pending = None;
                        let whole_end = part_end / BLOCK_BYTES * BLOCK_BYTES;
                        if whole_end > block_end {
                            push(whole_end - block_end, state);
                            pos = whole_end;
                        } else {
                            pos = block_end;
                        }
                    } else {
                        pending = Some((pending.map_or(pos, |(start, _)| start), merged));
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
            push(golden_end - start, state);
        }
        push(to - golden_end.max(from), past_end);
        Ok(())
    }
}
