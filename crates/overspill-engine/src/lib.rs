//! The storage engine of overspill: one copy-on-write overlay per VM over a read-only golden
//! image, with a bounded RAM tier that overflows in 2 MiB segments to a local spill log, and the
//! accounting of every tier.
//!
//! The engine knows nothing of NBD or sockets. It is synchronous and deterministic: files and
//! the host's memory pressure come in through seams ([`BackingFile`], [`HostMemory::rebalance`])
//! so that the planner and the simulation tests run the same code as the server.

pub mod arena;
pub mod budget;
mod chunk_pool;
pub mod crash;
pub mod error;
pub mod faults;
pub mod golden;
mod map;
pub mod overlay;
pub mod ram;
mod ranges;
pub mod read_cache;
pub mod relief;
pub mod spill;
pub mod state;
pub mod stats;
pub mod store;
pub mod units;

pub use budget::{HostMemory, PagesRoom};
pub use error::{EngineError, Result};
pub use golden::{
    push_extent, push_layer_run, push_layer_runs_below, Allocation, Extent, GoldenImage, ImageLayer, MemImage,
    RawImage, SourceReads,
};
pub use overlay::{
    BackingKind, LayerRun, MovedRun, Overlay, OverlayConfig, WriteCacheMode, DEPTH_GOLDEN, DEPTH_OVERLAY,
};
pub use read_cache::CachedImage;
pub use stats::{StorageTier, VmStats};
pub use store::{BackingFile, ScratchFile, SegmentWriters, SpaceShortages};
pub use units::{BLOCK_BYTES, BLOCK_SIZE, SEGMENT_BYTES};

/// The largest disk an overlay maps: 2^32 blocks of 4 KiB (16 TiB).
pub const MAX_DISK_BYTES: u64 = map::MAX_BLOCKS * BLOCK_BYTES;
