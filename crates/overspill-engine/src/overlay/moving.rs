//! Moving an overlay to another server while its VM runs (live migration): what the VM changes
//! is tracked from the moment the move starts, read out as runs of block states and applied to
//! an overlay over the same golden image there.
//!
//! The sender starts with every block that is not the golden image's (the map and the zeroed
//! ranges) as "to move", and each change of the VM adds the blocks it touched. Taking blocks
//! reads what they hold *now*, so a block changed after it was taken is simply taken again: a
//! move is rounds of pre-copy until, with the VM's writes held back, a last take empties the set
//! and the receiver holds exactly what the VM would read. A block is sent as its state, not its
//! history: golden (never written or trimmed: the receiver drops its copy), zero, or data.

use super::{Overlay, Source};
use crate::error::{EngineError, Result};
use crate::ranges::RangeSet;
use crate::units::{BlockIndex, BLOCK_BYTES, BLOCK_SIZE};

/// What a run of blocks holds, as it is moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MovedRun {
    /// Blocks `[first, end)` read from the golden image.
    Golden { first: u64, end: u64 },
    /// Blocks `[first, end)` read as zeroes.
    Zero { first: u64, end: u64 },
    /// Whole blocks from `first` on: `data` is a multiple of 4 KiB.
    Data { first: u64, data: Vec<u8> },
}

impl MovedRun {
    /// The blocks it covers, `[first, end)`.
    pub fn blocks(&self) -> (u64, u64) {
        match self {
            Self::Golden { first, end } | Self::Zero { first, end } => (*first, *end),
            Self::Data { first, data } => (*first, first + data.len() as u64 / BLOCK_BYTES),
        }
    }
}

/// The blocks still to be sent, and how many they are (kept as they change: a sender asks after
/// every message, and summing a set fragmented by random writes each time would cost more than
/// the message).
#[derive(Default)]
pub(super) struct ToMove {
    ranges: RangeSet,
    blocks: u64,
}

impl ToMove {
    fn insert(&mut self, first: u64, end: u64) {
        self.blocks += end.saturating_sub(first) - self.ranges.covered(first, end);
        self.ranges.insert(first, end);
    }

    fn remove(&mut self, first: u64, end: u64) {
        self.blocks -= self.ranges.covered(first, end);
        self.ranges.remove(first, end);
    }
}

/// Ranges scanned block by block per take, at most, beyond which a range is cut: a take holds
/// the VM's lock, and a guest that zeroed a whole large disk must not stall behind one.
const SCAN_BLOCKS_PER_TAKE: u64 = 1 << 20;

impl Overlay {
    /// Starts a move: every block that does not read from the golden image is to be sent, and
    /// from now on each change adds the blocks it touches. Starting again starts over.
    pub fn start_moving(&mut self) {
        let mut to_move = ToMove::default();
        for (first, end) in self.core.zeros.iter() {
            to_move.insert(first, end);
        }
        let mut mapped: Vec<u64> = self.core.map.blocks().map(|block| block.0).collect();
        mapped.sort_unstable();
        let mut run: Option<(u64, u64)> = None;
        for block in mapped {
            run = match run {
                Some((first, end)) if end == block => Some((first, block + 1)),
                Some((first, end)) => {
                    to_move.insert(first, end);
                    Some((block, block + 1))
                }
                None => Some((block, block + 1)),
            };
        }
        if let Some((first, end)) = run {
            to_move.insert(first, end);
        }
        self.core.moving = Some(to_move);
    }

    /// Ends a move (sent whole, or given up): changes are no longer tracked.
    pub fn stop_moving(&mut self) {
        self.core.moving = None;
    }

    /// Whether a move is under way.
    pub fn is_moving(&self) -> bool {
        self.core.moving.is_some()
    }

    /// Blocks still to be sent (data, zeroes and golden alike); 0 when no move is under way.
    pub fn blocks_to_move(&self) -> u64 {
        self.core.moving.as_ref().map_or(0, |set| set.blocks)
    }

    /// Takes blocks still to be sent, from the lowest, as runs of what they hold now: up to
    /// `max_data_blocks` blocks of data (zero and golden runs cost nothing to send and are not
    /// counted). Empty when nothing is left, or no move is under way.
    pub fn take_moved(&mut self, max_data_blocks: u64) -> Result<Vec<MovedRun>> {
        let mut runs = Vec::new();
        let mut data_left = max_data_blocks.max(1);
        let mut scan_left = SCAN_BLOCKS_PER_TAKE;
        while data_left > 0 && scan_left > 0 {
            let Some((first, end)) = self.core.moving.as_ref().and_then(|set| set.ranges.iter().next()) else {
                break;
            };
            let end = end.min(first + scan_left);
            let taken_end = self.classify(first, end, &mut data_left, &mut runs)?;
            scan_left = scan_left.saturating_sub(taken_end - first);
            if let Some(set) = self.core.moving.as_mut() {
                set.remove(first, taken_end);
            }
        }
        Ok(runs)
    }

    /// Appends the runs of `[first, end)` to `runs`, up to `data_left` blocks of data; returns
    /// where it stopped.
    fn classify(&mut self, first: u64, end: u64, data_left: &mut u64, runs: &mut Vec<MovedRun>) -> Result<u64> {
        let mut block = first;
        while block < end && *data_left > 0 {
            let source = self.core.source(BlockIndex(block));
            let mut run_end = block + 1;
            match source {
                Source::Golden | Source::Zero => {
                    while run_end < end && same_kind(self.core.source(BlockIndex(run_end)), source) {
                        run_end += 1;
                    }
                    runs.push(match source {
                        Source::Golden => MovedRun::Golden { first: block, end: run_end },
                        _ => MovedRun::Zero { first: block, end: run_end },
                    });
                }
                Source::Ram(_) | Source::Spill(_) | Source::File => {
                    while run_end < end && run_end - block < *data_left && self.core.map.contains(BlockIndex(run_end)) {
                        run_end += 1;
                    }
                    let mut data = vec![0u8; ((run_end - block) * BLOCK_BYTES) as usize];
                    for (i, chunk) in data.chunks_exact_mut(BLOCK_SIZE).enumerate() {
                        let index = BlockIndex(block + i as u64);
                        chunk.copy_from_slice(&self.core.read_block(self.store.as_mut(), index)?);
                    }
                    *data_left -= run_end - block;
                    runs.push(MovedRun::Data { first: block, data });
                }
            }
            block = run_end;
        }
        Ok(block)
    }

    /// The receiving end: makes blocks hold what a run says, as the sender's did when it was
    /// taken. Not counted as the guest's writes (the tiers count where the blocks land).
    pub fn apply_moved(&mut self, run: &MovedRun) -> Result<()> {
        let (first, end) = run.blocks();
        if end > self.core.size.div_ceil(BLOCK_BYTES) || first >= end {
            return Err(EngineError::Corrupt(format!(
                "a moved run of blocks [{first}, {end}) does not fit a disk of {} bytes",
                self.core.size
            )));
        }
        self.core.note_changed(first * BLOCK_BYTES, (end - first) * BLOCK_BYTES);
        let result = match run {
            MovedRun::Golden { first, end } => {
                self.core.zeros.remove(*first, *end);
                self.drop_blocks(*first, *end)
            }
            MovedRun::Zero { first, end } => {
                self.store.before_change(&mut self.core, None);
                let offset = first * BLOCK_BYTES;
                self.zero_spans(offset, ((end - first) * BLOCK_BYTES).min(self.core.size - offset))
            }
            MovedRun::Data { first, data } => {
                // The last block of a disk whose size is not a multiple of 4 KiB is partial.
                let offset = first * BLOCK_BYTES;
                let len = (data.len() as u64).min(self.core.size - offset) as usize;
                self.store.before_change(&mut self.core, Some(len.div_ceil(BLOCK_SIZE)));
                self.store.write(&mut self.core, offset, &data[..len])
            }
        };
        self.after_mutation();
        result
    }
}

fn same_kind(a: Source, b: Source) -> bool {
    matches!((a, b), (Source::Golden, Source::Golden) | (Source::Zero, Source::Zero))
}

impl super::Core {
    /// A change of `[offset, offset + len)` is about to be made: under a move, its blocks are
    /// to be sent (again). Before the change, so that a change that fails half-way is sent too.
    pub(super) fn note_changed(&mut self, offset: u64, len: u64) {
        if let Some(set) = self.moving.as_mut() {
            set.insert(offset / BLOCK_BYTES, (offset + len).div_ceil(BLOCK_BYTES));
        }
    }
}
