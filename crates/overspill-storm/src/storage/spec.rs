//! What the storage model is told: device classes and their latency curves, arrays (RAID,
//! controller cache, clones) and their specification files.

use serde::{Deserialize, Serialize};

use super::ARRAY_LATENCY_S;

/// A device class: random IOPS by queue depth (its latency curve: latency at depth `q` is
/// `q / iops(q)`) and streaming bandwidth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub name: String,
    /// `[queue depth, IOPS]` points, depths ascending; interpolated linearly, flat past the ends.
    pub iops: Vec<(f64, f64)>,
    pub mb_per_s: f64,
}

/// Random 4 KiB IOPS of each class at a few queue depths, and its bandwidth. docs/planning.md
/// ("Every parameter and its source") gives each figure's source: the disks' depth-1 points from
/// data sheets (seek plus half a revolution) and their depth-32 points about twice that, as deep
/// queues give a disk (loosely sourced; seed 003's own arrays check `hdd15k`'s); `hdd10k`'s
/// bandwidth from its manual's bytes per track, `hdd15k`'s the middle of a 15K disk's sustained
/// rates in its manual (Seagate Cheetah 15K.6: 112-171 MB/s); `ssd` a SATA SSD of the seeds' years (Samsung
/// 850 EVO: its data sheet's depth-1 point and bandwidth, a published run's depth 32); `nvme`
/// Samsung's 960 EVO (1 TB) specification as reviews list it (its random-read maximum is at
/// depth 32 on each of four threads: 128 outstanding). The disks' depth-4 and depth-16 points
/// lie where a disk that reorders its queue, simulated from data-sheet seeks, has climbed from
/// depth 1 to depth 32 (tests/disk_queue_depths.rs); the SSDs' depth-4 points are round figures.
/// `[queue depth, IOPS]` points.
type Curve = &'static [(f64, f64)];

const BUILT_IN: [(&str, Curve, f64); 5] = [
    ("hdd7200", &[(1.0, 80.0), (4.0, 105.0), (16.0, 140.0), (32.0, 165.0)], 150.0),
    ("hdd10k", &[(1.0, 140.0), (4.0, 178.0), (16.0, 240.0), (32.0, 280.0)], 113.0),
    ("hdd15k", &[(1.0, 190.0), (4.0, 241.0), (16.0, 324.0), (32.0, 380.0)], 142.0),
    ("ssd", &[(1.0, 10_000.0), (4.0, 25_000.0), (32.0, 71_000.0)], 540.0),
    ("nvme", &[(1.0, 14_000.0), (4.0, 45_000.0), (128.0, 380_000.0)], 3_200.0),
];

impl DeviceSpec {
    pub fn built_in_names() -> Vec<&'static str> {
        BUILT_IN.iter().map(|(name, _, _)| *name).collect()
    }

    /// A built-in class by name (`sas15k` is `hdd15k`'s older name).
    pub fn built_in(name: &str) -> Option<Self> {
        let name = if name == "sas15k" { "hdd15k" } else { name };
        BUILT_IN.iter().find(|(n, _, _)| *n == name).map(|(name, iops, mb_per_s)| Self {
            name: (*name).into(),
            iops: iops.to_vec(),
            mb_per_s: *mb_per_s,
        })
    }

    pub fn check(&self) -> Result<(), String> {
        if self.iops.is_empty() || self.mb_per_s <= 0.0 {
            return Err(format!("device {}: needs at least one IOPS point and a bandwidth above 0", self.name));
        }
        let ascending = self.iops.windows(2).all(|w| w[0].0 < w[1].0);
        if !ascending || self.iops.iter().any(|&(q, iops)| q < 1.0 || iops <= 0.0 || !iops.is_finite()) {
            return Err(format!("device {}: IOPS points need depths ≥ 1, ascending, and IOPS above 0", self.name));
        }
        Ok(())
    }

    /// Random IOPS with `depth` operations queued.
    pub fn iops_at(&self, depth: usize) -> f64 {
        let q = depth.max(1) as f64;
        let points = &self.iops;
        match points.iter().position(|&(d, _)| d >= q) {
            Some(0) => points[0].1,
            Some(i) => {
                let ((d0, i0), (d1, i1)) = (points[i - 1], points[i]);
                i0 + (i1 - i0) * (q - d0) / (d1 - d0)
            }
            None => points[points.len() - 1].1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Raid {
    #[serde(rename = "0")]
    R0,
    #[serde(rename = "1")]
    R1,
    #[serde(rename = "10")]
    R10,
    #[serde(rename = "5")]
    R5,
    #[serde(rename = "6")]
    R6,
}

impl std::str::FromStr for Raid {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim_start_matches("raid") {
            "0" => Ok(Self::R0),
            "1" => Ok(Self::R1),
            "10" => Ok(Self::R10),
            "5" => Ok(Self::R5),
            "6" => Ok(Self::R6),
            _ => Err(format!("unknown RAID level {s}: use 0, 1, 10, 5 or 6")),
        }
    }
}

impl std::fmt::Display for Raid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let level = match self {
            Self::R0 => "0",
            Self::R1 => "1",
            Self::R10 => "10",
            Self::R5 => "5",
            Self::R6 => "6",
        };
        write!(f, "RAID {level}")
    }
}

impl Raid {
    /// Disks a small write touches, and the fewest disks the level needs.
    pub(super) fn small_write_disks(self) -> usize {
        match self {
            Self::R0 => 1,
            Self::R1 | Self::R10 | Self::R5 => 2,
            Self::R6 => 3,
        }
    }

    fn min_disks(self) -> usize {
        match self {
            Self::R0 => 1,
            Self::R1 | Self::R10 => 2,
            Self::R5 => 3,
            Self::R6 => 4,
        }
    }

    /// Disks holding data in one stripe (the rest hold copies or parity).
    pub(super) fn data_disks(self, disks: usize) -> usize {
        match self {
            Self::R0 => disks,
            Self::R1 => 1,
            Self::R10 => disks / 2,
            Self::R5 => disks - 1,
            Self::R6 => disks - 2,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// Reads are cached; writes go through to the disks before they are acknowledged.
    ReadOnly,
    /// Writes are acknowledged once in cache and written to the disks afterwards.
    WriteBack,
}

impl std::str::FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "read-only" | "read" => Ok(Self::ReadOnly),
            "write-back" => Ok(Self::WriteBack),
            _ => Err(format!("unknown cache mode {s}: use read-only or write-back")),
        }
    }
}

/// How the VMs' disks lie on the array when nothing caches in front of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Clones {
    /// Every VM reads the blocks it never wrote from one shared golden image (Citrix MCS,
    /// VMware linked clones): the controller cache serves the VMs that boot after the first.
    Linked,
    /// Every VM has a full copy of the golden image (VMware full clones, seed 003's VMs): the
    /// same blocks at different places on the disks, which a cache cannot share.
    Full,
}

impl std::str::FromStr for Clones {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "linked" => Ok(Self::Linked),
            "full" => Ok(Self::Full),
            _ => Err(format!("unknown clones {s}: use linked or full")),
        }
    }
}

/// Everything between the VMs and the disks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StorageSpec {
    pub device: DeviceSpec,
    pub disks: usize,
    pub raid: Raid,
    /// Controller cache bytes (0: none) and how it treats writes.
    pub cache_bytes: u64,
    pub cache_mode: CacheMode,
    /// How much of a write-back cache may hold writes not yet on the disks (arrays commonly set
    /// a write part); reads still use the whole cache. `None`: half of it; a read-only cache
    /// holds no writes and ignores it.
    pub write_cache_bytes: Option<u64>,
    /// Requests the host keeps at the array at once (HBA or LUN queue depth); `None`: no limit.
    pub queue_depth: Option<usize>,
    /// Requests per second the array's controller can handle, cache hits included; `None`: no
    /// limit.
    pub controller_iops: Option<f64>,
    /// The array's own time for every request, on top of the disks' (its fabric and controller):
    /// what a cache hit takes.
    pub array_latency_s: f64,
    /// VMs powered on together, and the least time between one group and the next.
    pub power_on_group: usize,
    pub power_on_interval_s: f64,
    /// Storage reads each power-on waits for (a hypervisor reading the VM's configuration and
    /// creating its swap file) before the next group may be powered on and the VM may boot: how
    /// seed 003's hypervisor made slow storage slow to power VMs on.
    pub power_on_ios: usize,
    /// Requests one booting guest keeps in flight at most.
    pub vm_queue_depth: usize,
    /// Where a VM's reads of golden blocks go when no read cache is in front (overspill's read
    /// cache always reads the one golden image).
    pub clones: Clones,
}

impl StorageSpec {
    /// One device, no cache, no queue limit, every VM powered on at once.
    pub fn single(device: DeviceSpec) -> Self {
        Self {
            device,
            disks: 1,
            raid: Raid::R0,
            cache_bytes: 0,
            cache_mode: CacheMode::WriteBack,
            write_cache_bytes: None,
            queue_depth: None,
            controller_iops: None,
            array_latency_s: ARRAY_LATENCY_S,
            power_on_group: usize::MAX,
            power_on_interval_s: 0.0,
            power_on_ios: 0,
            vm_queue_depth: 4,
            clones: Clones::Linked,
        }
    }

    pub fn check(&self) -> Result<(), String> {
        self.device.check()?;
        if self.disks < self.raid.min_disks() || (self.raid == Raid::R10 && !self.disks.is_multiple_of(2)) {
            return Err(format!(
                "{} needs at least {} disks (an even number for RAID 10)",
                self.raid,
                self.raid.min_disks()
            ));
        }
        if self.raid == Raid::R1 && self.disks != 2 {
            return Err("RAID 1 mirrors two disks: use RAID 10 for more".into());
        }
        if self.write_cache_bytes.is_some_and(|w| w > self.cache_bytes) {
            return Err("the write part of the controller cache cannot be larger than the cache".into());
        }
        if self.queue_depth == Some(0) || self.power_on_group == 0 || self.vm_queue_depth == 0 {
            return Err("queue depths and the power-on group need to be at least 1".into());
        }
        if self.controller_iops.is_some_and(|iops| !(iops > 0.0 && iops.is_finite())) {
            return Err("the controller's IOPS must be above 0".into());
        }
        if !(self.array_latency_s >= 0.0 && self.array_latency_s.is_finite()) {
            return Err("the array's latency must be a time of 0 or more".into());
        }
        if !(self.power_on_interval_s >= 0.0 && self.power_on_interval_s.is_finite()) {
            return Err("the power-on interval must be a time of 0 or more".into());
        }
        Ok(())
    }

    /// One line naming the configuration, as tables and charts show it.
    pub fn describe(&self) -> String {
        let mut out = if self.disks == 1 {
            self.device.name.clone()
        } else {
            format!("{}× {} {}", self.disks, self.device.name, self.raid)
        };
        if self.cache_bytes > 0 {
            let mode = match self.cache_mode {
                CacheMode::ReadOnly => "read",
                CacheMode::WriteBack => "write-back",
            };
            out.push_str(&format!(", {} MiB {mode} cache", self.cache_bytes >> 20));
            if let (CacheMode::WriteBack, Some(write)) = (self.cache_mode, self.write_cache_bytes) {
                out.push_str(&format!(" ({} MiB for writes)", write >> 20));
            }
        }
        if let Some(q) = self.queue_depth {
            out.push_str(&format!(", queue depth {q}"));
        }
        if let Some(iops) = self.controller_iops {
            out.push_str(&format!(", controller {iops:.0} IOPS"));
        }
        if self.power_on_group != usize::MAX {
            out.push_str(&format!(", {} VM per {:.2} s", self.power_on_group, self.power_on_interval_s));
        }
        if self.clones == Clones::Full {
            out.push_str(", full clones");
        }
        out
    }
}

/// A storage configuration as a TOML file gives it: every field but the device may be left out
/// (one disk, no cache, no queue limit, all VMs at once).
///
/// ```toml
/// device = "hdd10k"          # or a table: { name = "...", mb_per_s = 200.0, iops = [[1.0, 150.0], [32.0, 300.0]] }
/// disks = 8
/// raid = "5"
/// cache_mib = 1024
/// cache_mode = "write-back"  # or "read-only"
/// write_cache_mib = 256      # the part that may hold writes (default: half the cache)
/// queue_depth = 32
/// controller_iops = 20000
/// array_latency_ms = 0.2
/// power_on_group = 1
/// power_on_interval_s = 1.3
/// power_on_ios = 10
/// vm_queue_depth = 4
/// clones = "linked"          # or "full"
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageFile {
    pub device: DeviceChoice,
    pub disks: Option<usize>,
    pub raid: Option<Raid>,
    pub cache_mib: Option<u64>,
    pub cache_mode: Option<CacheMode>,
    pub write_cache_mib: Option<u64>,
    pub queue_depth: Option<usize>,
    pub controller_iops: Option<f64>,
    pub array_latency_ms: Option<f64>,
    pub power_on_group: Option<usize>,
    pub power_on_interval_s: Option<f64>,
    pub power_on_ios: Option<usize>,
    pub vm_queue_depth: Option<usize>,
    pub clones: Option<Clones>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum DeviceChoice {
    BuiltIn(String),
    Custom(DeviceSpec),
}

impl DeviceChoice {
    pub fn resolve(&self) -> Result<DeviceSpec, String> {
        match self {
            Self::BuiltIn(name) => DeviceSpec::built_in(name).ok_or_else(|| {
                format!("unknown device {name}: use {} or describe it", DeviceSpec::built_in_names().join(", "))
            }),
            Self::Custom(spec) => spec.check().map(|()| spec.clone()),
        }
    }
}

impl StorageSpec {
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let file: StorageFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let d = Self::single(file.device.resolve()?);
        let spec = Self {
            disks: file.disks.unwrap_or(d.disks),
            raid: file.raid.unwrap_or(d.raid),
            cache_bytes: file.cache_mib.map_or(0, |m| m << 20),
            cache_mode: file.cache_mode.unwrap_or(d.cache_mode),
            write_cache_bytes: file.write_cache_mib.map(|m| m << 20),
            queue_depth: file.queue_depth,
            controller_iops: file.controller_iops,
            array_latency_s: file.array_latency_ms.map_or(ARRAY_LATENCY_S, |ms| ms / 1e3),
            power_on_group: file.power_on_group.unwrap_or(if file.power_on_interval_s.is_some() {
                1
            } else {
                d.power_on_group
            }),
            power_on_interval_s: file.power_on_interval_s.unwrap_or(0.0),
            power_on_ios: file.power_on_ios.unwrap_or(0),
            vm_queue_depth: file.vm_queue_depth.unwrap_or(d.vm_queue_depth),
            clones: file.clones.unwrap_or(d.clones),
            device: d.device,
        };
        spec.check()?;
        Ok(spec)
    }
}
