//! Per-VM accounting, per tier.
//!
//! An operation is counted where it is issued: guest counters at the overlay's entry, storage
//! counters where a file or golden image is actually read or written (so a partial-block write
//! that must read its block first shows up as a storage read). Counters are relaxed atomics so
//! that a metrics exporter on another thread can read them while the VM's connection updates
//! them; only one thread ever writes a given VM's counters.

use std::sync::atomic::{AtomicU64, Ordering};

pub use overspill_block::GuestOp;

#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn absorb(&self, other: &Counter) {
        self.add(other.get());
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    pub fn add(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }

    pub fn sub(&self, value: u64) {
        self.0.fetch_sub(value, Ordering::Relaxed);
    }
}

/// Operations and bytes of one kind.
#[derive(Debug, Default)]
pub struct OpCounter {
    pub ops: Counter,
    pub bytes: Counter,
}

impl OpCounter {
    pub fn add(&self, bytes: u64) {
        self.ops.inc();
        self.bytes.add(bytes);
    }

    /// Several operations at once.
    pub fn add_many(&self, ops: u64, bytes: u64) {
        self.ops.add(ops);
        self.bytes.add(bytes);
    }

    fn absorb(&self, other: &OpCounter) {
        self.ops.absorb(&other.ops);
        self.bytes.absorb(&other.bytes);
    }
}

/// Request sizes in power-of-two buckets: ≤4 KiB, ≤8 KiB, … ≤2 MiB, larger.
#[derive(Debug, Default)]
pub struct SizeHistogram {
    buckets: [Counter; SizeHistogram::BUCKETS],
}

impl SizeHistogram {
    pub const BUCKETS: usize = 11;

    /// Upper bound in bytes of each bucket; the last is unbounded.
    pub fn bucket_upper_bytes(index: usize) -> Option<u64> {
        (index + 1 < Self::BUCKETS).then(|| 4096u64 << index)
    }

    pub fn record(&self, bytes: u64) {
        let index = (0..Self::BUCKETS - 1).find(|&i| bytes <= 4096u64 << i).unwrap_or(Self::BUCKETS - 1);
        self.buckets[index].inc();
    }

    pub fn counts(&self) -> [u64; Self::BUCKETS] {
        std::array::from_fn(|i| self.buckets[i].get())
    }

    fn absorb(&self, other: &SizeHistogram) {
        self.buckets.iter().zip(&other.buckets).for_each(|(a, b)| a.absorb(b));
    }
}

/// Request latencies in fixed buckets (upper bounds in microseconds, the last unbounded), with
/// their sum. The engine keeps no clock: whoever serves the requests times them.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [Counter; LatencyHistogram::BOUNDS_US.len() + 1],
    sum_ns: Counter,
}

impl LatencyHistogram {
    pub const BOUNDS_US: [u64; 13] = [5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 50_000, 250_000, 1_000_000];

    pub fn record(&self, elapsed: std::time::Duration) {
        let us = elapsed.as_micros();
        let index = Self::BOUNDS_US.iter().position(|&b| us <= u128::from(b)).unwrap_or(Self::BOUNDS_US.len());
        self.buckets[index].inc();
        self.sum_ns.add(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Per-bucket counts (not cumulative); the last bucket is above every bound.
    pub fn counts(&self) -> [u64; LatencyHistogram::BOUNDS_US.len() + 1] {
        std::array::from_fn(|i| self.buckets[i].get())
    }

    pub fn sum_ns(&self) -> u64 {
        self.sum_ns.get()
    }

    fn absorb(&self, other: &LatencyHistogram) {
        self.buckets.iter().zip(&other.buckets).for_each(|(a, b)| a.absorb(b));
        self.sum_ns.absorb(&other.sum_ns);
    }
}

/// The storage behind a VM, where [`VmStats`] counts operations actually issued: the one list
/// the metrics, the storm driver, its reports and the planner loop over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageTier {
    /// The golden image's storage (behind its shared read cache, when there is one).
    Golden,
    /// Mode `shared`: the per-VM differencing file on shared storage.
    Shared,
    /// Mode `disk`: the per-VM cache file on local disk.
    CacheFile,
    /// Mode `ram+disk`: the spill log of 2 MiB segments on local disk.
    Spill,
}

impl StorageTier {
    /// In report order.
    pub const ALL: [StorageTier; 4] = [Self::Golden, Self::Shared, Self::CacheFile, Self::Spill];

    /// The `tier` label of the metrics.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Golden => "golden",
            Self::Shared => "shared",
            Self::CacheFile => "cache_file",
            Self::Spill => "spill",
        }
    }

    /// What reports call it.
    pub const fn title(self) -> &'static str {
        match self {
            Self::Golden => "golden image",
            Self::Shared => "shared storage",
            Self::CacheFile => "local cache disk",
            Self::Spill => "spill",
        }
    }

    /// Whether the tier is ever written (the golden image never is).
    pub const fn is_written(self) -> bool {
        !matches!(self, Self::Golden)
    }

    pub fn reads(self, s: &VmStats) -> &OpCounter {
        match self {
            Self::Golden => &s.golden_read,
            Self::Shared => &s.shared_read,
            Self::CacheFile => &s.cache_file_read,
            Self::Spill => &s.spill_read,
        }
    }

    /// `None` for the golden image, which is never written.
    pub fn writes(self, s: &VmStats) -> Option<&OpCounter> {
        match self {
            Self::Golden => None,
            Self::Shared => Some(&s.shared_write),
            Self::CacheFile => Some(&s.cache_file_write),
            Self::Spill => Some(&s.spill_write),
        }
    }
}

/// Every figure the engine keeps for one VM.
#[derive(Debug, Default)]
pub struct VmStats {
    // What the guest asked for.
    pub guest_read: OpCounter,
    pub guest_write: OpCounter,
    pub guest_trim: OpCounter,
    pub guest_zero: OpCounter,
    pub guest_flush: OpCounter,

    // Which tier served each 4 KiB block of guest reads: exactly one per block.
    pub read_blocks_ram: Counter,
    pub read_blocks_spill: Counter,
    pub read_blocks_golden: Counter,
    pub read_blocks_zero: Counter,
    pub read_blocks_cache_file: Counter,

    // Where guest write blocks landed, one per block written (whole or partial).
    pub write_blocks_ram: Counter,
    pub write_blocks_spill: Counter,
    pub write_blocks_cache_file: Counter,
    pub zero_blocks: Counter,

    /// Reads the overlay asked of the golden image (served by the shared read cache when there
    /// is one, else by the image's storage).
    pub golden_request: OpCounter,
    // Storage: what reached files and the golden image's storage.
    pub golden_read: OpCounter,
    pub spill_read: OpCounter,
    pub spill_write: OpCounter,
    pub spill_write_sizes: SizeHistogram,
    pub spill_segments_written: Counter,
    pub spill_segments_punched: Counter,
    pub compaction_bytes_moved: Counter,
    /// Blocks a recovery found written when it rebuilt this overlay from a previous process's
    /// state.
    pub recovered_blocks: Counter,
    /// Mode `disk`: the per-VM cache file on local disk.
    pub cache_file_read: OpCounter,
    pub cache_file_write: OpCounter,
    /// Mode `shared`: the per-VM differencing file on shared storage.
    pub shared_read: OpCounter,
    pub shared_write: OpCounter,

    // Levels.
    pub cache_memory_used_bytes: Gauge,
    pub cache_memory_target_bytes: Gauge,
    pub cache_memory_peak_bytes: Gauge,
    pub cache_disk_used_bytes: Gauge,
    pub cache_disk_size_bytes: Gauge,
    pub cache_disk_peak_bytes: Gauge,

    /// Service time of each guest command, indexed like [`GuestOp::ALL`].
    pub latency: [LatencyHistogram; 5],
}

impl VmStats {
    pub fn guest(&self, op: GuestOp) -> &OpCounter {
        match op {
            GuestOp::Read => &self.guest_read,
            GuestOp::Write => &self.guest_write,
            GuestOp::Trim => &self.guest_trim,
            GuestOp::Zero => &self.guest_zero,
            GuestOp::Flush => &self.guest_flush,
        }
    }

    pub fn latency(&self, op: GuestOp) -> &LatencyHistogram {
        &self.latency[op as usize]
    }

    /// Adds every counter and histogram of `other` into `self`, for server-wide totals that keep
    /// counting after a VM leaves. Levels (gauges) describe the present and are not summed.
    pub fn absorb(&self, other: &VmStats) {
        for op in GuestOp::ALL {
            self.guest(op).absorb(other.guest(op));
            self.latency(op).absorb(other.latency(op));
        }
        for (a, b) in [
            (&self.read_blocks_ram, &other.read_blocks_ram),
            (&self.read_blocks_spill, &other.read_blocks_spill),
            (&self.read_blocks_golden, &other.read_blocks_golden),
            (&self.read_blocks_zero, &other.read_blocks_zero),
            (&self.read_blocks_cache_file, &other.read_blocks_cache_file),
            (&self.write_blocks_ram, &other.write_blocks_ram),
            (&self.write_blocks_spill, &other.write_blocks_spill),
            (&self.write_blocks_cache_file, &other.write_blocks_cache_file),
            (&self.zero_blocks, &other.zero_blocks),
            (&self.spill_segments_written, &other.spill_segments_written),
            (&self.spill_segments_punched, &other.spill_segments_punched),
            (&self.compaction_bytes_moved, &other.compaction_bytes_moved),
        ] {
            a.absorb(b);
        }
        self.golden_request.absorb(&other.golden_request);
        for tier in StorageTier::ALL {
            tier.reads(self).absorb(tier.reads(other));
            if let (Some(a), Some(b)) = (tier.writes(self), tier.writes(other)) {
                a.absorb(b);
            }
        }
        self.spill_write_sizes.absorb(&other.spill_write_sizes);
    }
}

/// Service times measured around a device (the engine keeps no clock) land in the VM's
/// histograms.
impl overspill_block::Latencies for VmStats {
    fn record(&self, op: GuestOp, spent: std::time::Duration) {
        self.latency(op).record(spent);
    }
}
