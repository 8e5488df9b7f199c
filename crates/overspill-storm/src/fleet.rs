//! The fleet plan: many hosts, each with its own overspill (overlays, read cache, local tier),
//! all reading golden images from one store (a Ceph pool, an object store, a shared file). One
//! host's worth of VMs runs through the engine ([`crate::model`]) with its read cache over a
//! store that counts what reaches it; the store's load is then that host's times the hosts.
//!
//! Hosts are independent in everything but the store: each has its own RAM, spill disk and read
//! cache, and boots its own VMs, so per-host needs are one host's and the store's load adds up.
//! What does not add up is the store's own caching: every host asks it for the same chunks of
//! the same golden image, so a store with a cache of its own (OSD page caches, a CDN) reads its
//! disks less than the sum says; the figures are what crosses the network to it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use overspill_engine::read_cache::DEFAULT_CHUNK_BYTES;
use overspill_engine::{CachedImage, EngineError, GoldenImage, StorageTier, WriteCacheMode};
use serde::Serialize;

use crate::driver::{tier_index, RunPlan};
use crate::model::{simulate_on, ModelConfig};
use crate::report::format_bytes;

/// Where the golden images live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GoldenStore {
    /// Ceph RBD snapshots.
    Rbd,
    /// An S3 object store (or HTTP).
    S3,
    /// A file, local or on a shared filesystem.
    File,
}

impl std::str::FromStr for GoldenStore {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "rbd" => Ok(Self::Rbd),
            "s3" => Ok(Self::S3),
            "file" => Ok(Self::File),
            _ => Err(format!("unknown golden store {s}: use rbd, s3 or file")),
        }
    }
}

impl GoldenStore {
    /// The read cache's chunk for this store, as `serve` picks it: remote sources are fetched in
    /// `--remote-chunk` units (256 KiB by default), files in 16 KiB.
    pub fn chunk_bytes(self) -> u64 {
        match self {
            Self::Rbd | Self::S3 => 256 * 1024,
            Self::File => DEFAULT_CHUNK_BYTES,
        }
    }

    /// Whether `serve --local-tier` applies (remote sources only).
    pub fn has_local_tier(self) -> bool {
        self != Self::File
    }
}

#[derive(Debug, Clone)]
pub struct FleetOptions {
    pub hosts: usize,
    pub vms_per_host: usize,
    pub golden: GoldenStore,
    pub mode: WriteCacheMode,
    pub ram_bytes: u64,
    pub read_cache_bytes: u64,
    /// Seconds between one VM's power-on and the next on a host, for the staggered storm.
    pub stagger_s: f64,
    /// Width of the intervals peaks are taken over.
    pub interval_s: u64,
}

/// What one host needs for its VMs' write caches and read cache.
#[derive(Debug, Clone, Serialize)]
pub struct HostNeeds {
    /// The most RAM the overlays held at once (the sum of each VM's peak: an upper bound), plus
    /// the read cache.
    pub ram_bytes: u64,
    pub read_cache_bytes: u64,
    /// The sum of each VM's largest spill file.
    pub spill_bytes: u64,
    /// Spill operations per second in the busiest interval, all VMs.
    pub spill_peak_iops: f64,
    /// Guest requests of the host's VMs that failed (writes refused for want of room): any is
    /// a plan that does not work, however light its load.
    pub guest_errors: u64,
}

/// What the golden store serves the whole fleet in one storm.
#[derive(Debug, Clone, Serialize)]
pub struct StoreLoad {
    pub storm: String,
    pub caching: String,
    pub peak_iops: f64,
    pub avg_iops: f64,
    pub peak_mib_s: f64,
    pub avg_mib_s: f64,
    pub total_bytes: u64,
    /// From the first power-on to the last boot request.
    pub duration_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct FleetPlan {
    pub hosts: usize,
    pub vms_per_host: usize,
    pub golden: GoldenStore,
    pub mode: String,
    pub ram_per_vm_bytes: u64,
    pub host: HostNeeds,
    pub store: Vec<StoreLoad>,
}

/// A store of zeroes that counts what is read from it; with `local_tier`, a chunk read once is
/// not read again (the host keeps it on its own disk, as `serve --local-tier` does).
struct CountingStore {
    size: u64,
    ops: AtomicU64,
    bytes: AtomicU64,
    local_tier: Option<(u64, Mutex<HashSet<u64>>)>,
}

impl GoldenImage for CountingStore {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        buf.fill(0);
        let len = buf.len() as u64;
        let new_bytes = match &self.local_tier {
            None => len,
            Some((chunk, seen)) => {
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                let chunks = offset / chunk..(offset + len).div_ceil(*chunk);
                chunks.filter(|&c| seen.insert(c)).count() as u64 * chunk
            }
        };
        if new_bytes > 0 {
            self.ops.fetch_add(1, Ordering::Relaxed);
            self.bytes.fetch_add(new_bytes, Ordering::Relaxed);
        }
        Ok(())
    }

    fn describe(&self) -> String {
        "counting store".into()
    }
}

/// One host's VMs: the traces' first phase (the boot) round-robin, VM `i` powered on `i ×
/// stagger_s` after the first.
fn host_plan(boots: &RunPlan, vms: usize, stagger_s: f64) -> RunPlan {
    let k = boots.vms().max(1);
    let ops = (0..vms).map(|vm| boots.ops[vm % k].iter().take(1).cloned().collect()).collect();
    let mut plan = RunPlan { ops, ..boots.clone() };
    plan.phase_names.truncate(1);
    let starts: Vec<u64> = (0..vms).map(|vm| (vm as f64 * stagger_s * 1e3) as u64).collect();
    let end = (0..vms)
        .map(|vm| starts[vm] + plan.ops[vm].first().and_then(|o| o.last()).map_or(0, |o| o.at_ms))
        .max()
        .unwrap_or(0);
    plan.timeline.starts_ms = vec![starts];
    plan.timeline.windows_ms = vec![(0, end + 1)];
    plan
}

/// Plans the fleet from recorded (or generated) boots: `boots` holds one or more VMs' traces.
pub fn plan_fleet(boots: &RunPlan, options: &FleetOptions) -> Result<FleetPlan, EngineError> {
    let config = ModelConfig {
        mode: options.mode,
        ram_bytes: options.ram_bytes,
        read_cache_bytes: 0,
        bucket_s: options.interval_s,
    };
    let hosts = options.hosts as f64;
    let mut store = Vec::new();
    let mut host = None;
    let mut cachings = vec![("no read cache", 0, false), ("read cache", options.read_cache_bytes, false)];
    if options.golden.has_local_tier() {
        cachings.push(("read cache and local tier", options.read_cache_bytes, true));
    }
    for (storm, stagger_s) in [("all at once", 0.0), ("staggered", options.stagger_s)] {
        let plan = host_plan(boots, options.vms_per_host, stagger_s);
        for &(caching, cache_bytes, local_tier) in &cachings {
            let chunk = options.golden.chunk_bytes();
            let counting = Arc::new(CountingStore {
                size: plan.disk_bytes,
                ops: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                local_tier: local_tier.then(|| (chunk, Mutex::new(HashSet::new()))),
            });
            let golden: Arc<dyn GoldenImage> = if cache_bytes > 0 {
                Arc::new(CachedImage::new(counting.clone(), cache_bytes, chunk))
            } else {
                counting.clone()
            };
            let interval_ms = options.interval_s.max(1) * 1000;
            let mut per_interval: Vec<(u64, u64)> = Vec::new();
            let mut last = (0u64, 0u64);
            let mut last_ms = 0u64;
            let results = simulate_on(&plan, &config, golden, |vm, phase, op, _| {
                let now = (counting.ops.load(Ordering::Relaxed), counting.bytes.load(Ordering::Relaxed));
                let at_ms = plan.timeline.starts_ms[phase][vm] + op.at_ms;
                last_ms = last_ms.max(at_ms);
                let slot = (at_ms / interval_ms) as usize;
                if per_interval.len() <= slot {
                    per_interval.resize(slot + 1, (0, 0));
                }
                per_interval[slot].0 += now.0 - last.0;
                per_interval[slot].1 += now.1 - last.1;
                last = now;
            })?;
            let seconds = options.interval_s.max(1) as f64;
            let duration_s = (last_ms as f64 / 1e3).max(seconds);
            let peak = per_interval.iter().fold((0, 0), |a, &(o, b)| (a.0.max(o), a.1.max(b)));
            store.push(StoreLoad {
                storm: storm.into(),
                caching: caching.into(),
                peak_iops: hosts * peak.0 as f64 / seconds,
                avg_iops: hosts * last.0 as f64 / duration_s,
                peak_mib_s: hosts * peak.1 as f64 / seconds / 1_048_576.0,
                avg_mib_s: hosts * last.1 as f64 / duration_s / 1_048_576.0,
                total_bytes: options.hosts as u64 * last.1,
                duration_s,
            });
            if host.is_none() {
                let spill = tier_index(StorageTier::Spill);
                let slots = results.iter().map(|r| r.timeline.len()).max().unwrap_or(0);
                let spill_peak = (0..slots)
                    .map(|i| results.iter().filter_map(|r| r.timeline.get(i)).map(|t| t[spill].total()).sum::<u64>())
                    .max()
                    .unwrap_or(0);
                host = Some(HostNeeds {
                    ram_bytes: results.iter().map(|r| r.peak_cache_memory_bytes).sum::<u64>()
                        + options.read_cache_bytes,
                    read_cache_bytes: options.read_cache_bytes,
                    spill_bytes: results.iter().map(|r| r.peak_cache_disk_bytes).sum(),
                    spill_peak_iops: spill_peak as f64 / seconds,
                    guest_errors: results.iter().flat_map(|r| &r.phases).map(|p| p.errors).sum(),
                });
            }
        }
    }
    Ok(FleetPlan {
        hosts: options.hosts,
        vms_per_host: options.vms_per_host,
        golden: options.golden,
        mode: options.mode.to_string(),
        ram_per_vm_bytes: options.ram_bytes,
        host: host.expect("at least one storm is simulated"),
        store,
    })
}

/// The fleet plan as Markdown (docs/scale-out.md quotes it).
pub fn markdown(plan: &FleetPlan) -> String {
    let h = &plan.host;
    let failed = if h.guest_errors > 0 {
        format!(
            "**FAILED: {} guest requests of a host's VMs failed** (writes refused for want of room at {} per \
             VM): the load below is no saving.\n\n",
            h.guest_errors,
            format_bytes(plan.ram_per_vm_bytes)
        )
    } else {
        String::new()
    };
    let mut out = failed
        + &format!(
            "{} hosts × {} VMs, golden images on {:?}, `{}` at {} per VM.\n\n\
         Per host: RAM {} (overlays' peaks summed, plus a {} read cache), spill disk {}, \
         spill {:.1} IOPS in the busiest interval.\n\n\
         | storm | host caching | golden store peak IOPS | avg IOPS | peak MiB/s | avg MiB/s | read in all |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
            plan.hosts,
            plan.vms_per_host,
            plan.golden,
            plan.mode,
            format_bytes(plan.ram_per_vm_bytes),
            format_bytes(h.ram_bytes),
            format_bytes(h.read_cache_bytes),
            format_bytes(h.spill_bytes),
            h.spill_peak_iops,
        );
    for s in &plan.store {
        out.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {} |\n",
            s.storm,
            s.caching,
            s.peak_iops,
            s.avg_iops,
            s.peak_mib_s,
            s.avg_mib_s,
            format_bytes(s.total_bytes)
        ));
    }
    out
}
