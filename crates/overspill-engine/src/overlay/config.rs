//! What an overlay is asked to be: its mode, its memory target, its spill limit.

use std::fmt;
use std::str::FromStr;

use crate::error::{EngineError, Result};

/// Where a VM's writes go; one per seed configuration, so they can be compared side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteCacheMode {
    /// A per-VM differencing file on shared storage, 4 KiB writes in place (the MCS baseline).
    Shared,
    /// A per-VM cache file on local disk, 4 KiB writes in place (PVS "cache on device hard disk").
    Disk,
    /// RAM only; ENOSPC when the target is reached (PVS "cache in device RAM").
    Ram,
    /// RAM, overflowing in 2 MiB segments to a local spill file (PVS "cache in RAM with overflow").
    RamDisk,
}

impl WriteCacheMode {
    pub const ALL: [WriteCacheMode; 4] = [Self::Shared, Self::Disk, Self::Ram, Self::RamDisk];

    /// Whether the mode needs a backing file, and what it is for.
    pub fn backing_file(self) -> Option<BackingKind> {
        match self {
            Self::Shared => Some(BackingKind::SharedDifferencing),
            Self::Disk => Some(BackingKind::LocalCache),
            Self::Ram => None,
            Self::RamDisk => Some(BackingKind::SpillLog),
        }
    }
}

/// The files a mode writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingKind {
    /// Identity-mapped, sized like the disk, under the shared-storage directory.
    SharedDifferencing,
    /// Identity-mapped, sized like the disk, on local disk.
    LocalCache,
    /// Append-only 2 MiB segments on local disk.
    SpillLog,
}

impl fmt::Display for WriteCacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Shared => "shared",
            Self::Disk => "disk",
            Self::Ram => "ram",
            Self::RamDisk => "ram+disk",
        })
    }
}

impl FromStr for WriteCacheMode {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.to_string() == s)
            .ok_or_else(|| EngineError::Config(format!("unknown mode {s:?}: use shared, disk, ram or ram+disk")))
    }
}

#[derive(Debug, Clone)]
pub struct OverlayConfig {
    pub mode: WriteCacheMode,
    /// The VM's cache memory target: RAM tier, open spill segment and index together.
    pub ram_target_bytes: u64,
    /// Limit on the spill file (mode `ram+disk`); `None` lets the filesystem decide.
    pub spill_max_bytes: Option<u64>,
}
