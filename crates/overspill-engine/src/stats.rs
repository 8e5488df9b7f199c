//! Per-VM accounting, per tier.
//!
//! An operation is counted where it is issued: guest counters at the overlay's entry, storage
//! counters where a file or golden image is actually read or written (so a partial-block write
//! that must read its block first shows up as a storage read). Counters are relaxed atomics so
//! that a metrics exporter on another thread can read them while the VM's connection updates
//! them; only one thread ever writes a given VM's counters.

use std::sync::atomic::{AtomicU64, Ordering};

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

    // Storage: what reached files and the golden image.
    pub golden_read: OpCounter,
    pub spill_read: OpCounter,
    pub spill_write: OpCounter,
    pub spill_write_sizes: SizeHistogram,
    pub spill_segments_written: Counter,
    pub spill_segments_punched: Counter,
    pub compaction_bytes_moved: Counter,
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
}
