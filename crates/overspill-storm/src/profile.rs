//! Workload profiles: what one VM does in each phase, as documented TOML data, and the
//! deterministic generator that turns a profile into a VM's list of requests.
//!
//! A workload names a disk layout (a system region every VM reads at boot, and per-VM write areas
//! such as the page file, temp, logs and the user profile) and its phases. Each phase gives its
//! source in the seeds, a duration, a number of IOs, the read share, block-size mixes, and the
//! locality of reads (shared golden blocks, re-reads of own writes) and writes (overwrites,
//! deletes). The same seed always gives the same requests, so every write-cache mode and every
//! server sees exactly the same workload.

use std::collections::BTreeMap;

use overspill_block::trace::Trace;
use overspill_block::GuestOp;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;
/// The longest phase a workload may have: a week (a longer one is a typo, and its timeline
/// alone would take gigabytes).
const MAX_PHASE_S: f64 = 7.0 * 24.0 * 3600.0;
/// The most requests one VM may make in a phase (each is kept in memory until the storm runs).
const MAX_PHASE_REQUESTS: u64 = 100_000_000;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("workload {name}: {source}")]
    Parse { name: String, source: toml::de::Error },
    #[error("workload {name}: {message}")]
    Invalid { name: String, message: String },
    #[error("no built-in workload {0:?}; known: {1}")]
    Unknown(String, String),
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub name: String,
    pub description: String,
    /// The platform of the seeds' table (`data/seed-iops.csv`) this workload models, whose
    /// figures the report draws beside a run's own.
    #[serde(default)]
    pub seed_platform: Option<String>,
    pub disk: DiskLayout,
    /// Share of every phase's requests that are the guest's event-log I/O, in its `direct` area
    /// (0: none); which of them are reads, each phase says ([`Phase::event_log_reads`]). Seed
    /// 000's PVS guests had their event logs "redirected directly to the write cache disk so that
    /// they persist and their I/O would not be cached in RAM", which is what its PVS rows show
    /// under a cache that never overflowed.
    #[serde(default)]
    pub direct_share: f64,
    pub phases: Vec<Phase>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DiskLayout {
    pub size_mib: u64,
    /// The golden image's system region, from offset 0: what boots read.
    pub system_mib: u64,
    /// Per-VM write areas; each VM writes its own copy of them.
    pub areas: Vec<Area>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Area {
    pub name: String,
    pub start_mib: u64,
    pub size_mib: u64,
    /// The guest keeps this area on a persistent disk of its own, outside the write cache (event
    /// logs; see [`Workload::direct_share`]). Written only through that share, never trimmed.
    #[serde(default)]
    pub direct: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    pub name: String,
    /// Where the figures come from (a row of `shared/calibration/seed-iops.csv` or a seed).
    pub source: String,
    /// The phase's real duration for one VM, in seconds.
    pub duration_s: f64,
    /// Read and write requests one VM issues in the phase (TRIMs and flushes come on top).
    pub ios: u64,
    pub read_fraction: f64,
    /// Request sizes in bytes with their weights.
    pub read_sizes: Vec<(u32, f64)>,
    pub write_sizes: Vec<(u32, f64)>,
    /// Share of reads that fall on the golden blocks every VM reads in the same order.
    pub read_shared: f64,
    /// Share of reads of blocks this VM wrote earlier; the rest are random system reads.
    pub read_own: f64,
    /// Share of writes that overwrite an earlier write of the same area.
    pub write_overwrite: f64,
    /// How strongly overwrites and re-reads favour recent writes (temp files and the page file
    /// are rewritten and read back soon after they were written): the write picked is `h·u^skew`
    /// writes back in the area's history of `h`, `u` uniform in [0, 1). 1 (the default) picks
    /// uniformly; larger values favour recent writes.
    #[serde(default = "uniform_skew")]
    pub recency_skew: f64,
    /// Write areas with their weights.
    pub write_areas: Vec<(String, f64)>,
    /// TRIMs (file deletes) per write: each trims an earlier write.
    #[serde(default)]
    pub trims_per_write: f64,
    #[serde(default)]
    pub flushes: u64,
    /// Share of the phase's event-log requests ([`Workload::direct_share`]) that are reads; the
    /// rest are appends. Seed 000's cache disk, which took only the event logs, saw 56% reads at
    /// boot and 1-9% afterwards, where the default, none, stands. The seed gives the shares, not
    /// why; our reading: at boot the Event Log service opens the logs kept from earlier runs.
    /// A read drawn before the VM's first append (only at boot: appends are kept across phases)
    /// reads the system region instead.
    #[serde(default)]
    pub event_log_reads: f64,
}

impl Phase {
    /// How many of the phase's requests are reads, and how many writes.
    fn reads_and_writes(&self) -> (u64, u64) {
        let reads = (self.ios as f64 * self.read_fraction).round() as u64;
        (reads, self.ios - reads)
    }

    /// The chance that a read, and that a write, of this phase is event-log I/O: `share` of all
    /// its requests are, `event_log_reads` of those reads, while its read and write counts stay
    /// what the phase says.
    fn direct_odds(&self, share: f64) -> (f64, f64) {
        let (reads, writes) = self.reads_and_writes();
        let (reads, writes) = (reads as f64, writes as f64);
        let direct = share * self.ios as f64;
        let odds = |n: f64, of: f64| if n > 0.0 { n / of } else { 0.0 };
        (odds(direct * self.event_log_reads, reads), odds(direct * (1.0 - self.event_log_reads), writes))
    }
}

/// One request of one VM, at its time in the phase. Profiles make reads, writes, trims and
/// flushes; write zeroes come only from recorded traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// Milliseconds since the phase started (profile time, not wall time).
    pub at_ms: u64,
    pub kind: GuestOp,
    pub offset: u64,
    pub len: u32,
}

const BUILT_IN: &[(&str, &str)] = &[
    ("win7-vdi", include_str!("../workloads/win7-vdi.toml")),
    ("win7-vdi-bloated-profile", include_str!("../workloads/win7-vdi-bloated-profile.toml")),
    ("xenapp-rds", include_str!("../workloads/xenapp-rds.toml")),
    ("linux-boot", include_str!("../workloads/linux-boot.toml")),
];

impl Workload {
    pub fn built_in_names() -> Vec<&'static str> {
        BUILT_IN.iter().map(|(name, _)| *name).collect()
    }

    pub fn built_in(name: &str) -> Result<Self, ProfileError> {
        let text = BUILT_IN
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| *text)
            .ok_or_else(|| ProfileError::Unknown(name.into(), Self::built_in_names().join(", ")))?;
        Self::parse(name, text)
    }

    pub fn parse(name: &str, text: &str) -> Result<Self, ProfileError> {
        let workload: Workload =
            toml::from_str(text).map_err(|source| ProfileError::Parse { name: name.into(), source })?;
        workload.check().map_err(|message| ProfileError::Invalid { name: name.into(), message })?;
        Ok(workload)
    }

    pub fn disk_bytes(&self) -> u64 {
        self.disk.size_mib * MIB
    }

    /// The byte ranges of the `direct` areas.
    pub fn direct_ranges(&self) -> Vec<(u64, u64)> {
        self.disk
            .areas
            .iter()
            .filter(|a| a.direct)
            .map(|a| (a.start_mib * MIB, (a.start_mib + a.size_mib) * MIB))
            .collect()
    }

    fn check(&self) -> Result<(), String> {
        let d = &self.disk;
        if d.system_mib == 0 || d.system_mib > d.size_mib {
            return Err("system region must be inside the disk".into());
        }
        for area in &d.areas {
            if area.size_mib == 0 || area.start_mib + area.size_mib > d.size_mib || area.start_mib < d.system_mib {
                return Err(format!("area {} must lie inside the disk, after the system region", area.name));
            }
        }
        if !(0.0..1.0).contains(&self.direct_share) {
            return Err("direct_share must lie in 0..1".into());
        }
        if self.direct_share > 0.0 && !d.areas.iter().any(|a| a.direct) {
            return Err("direct_share needs an area with direct = true".into());
        }
        // A direct area's bytes are told apart by where they lie: another area over them would
        // have its writes counted as event-log writes, and dropped from the server's tally.
        let span = |a: &Area| (a.start_mib, a.start_mib + a.size_mib);
        for direct in d.areas.iter().filter(|a| a.direct) {
            let (start, end) = span(direct);
            if let Some(other) = d.areas.iter().filter(|a| !a.direct).find(|a| span(a).0 < end && start < span(a).1) {
                return Err(format!("area {} overlaps the direct area {}", other.name, direct.name));
            }
        }
        for phase in &self.phases {
            let fractions =
                [phase.read_fraction, phase.read_shared, phase.read_own, phase.write_overwrite, phase.event_log_reads];
            if fractions.iter().any(|f| !(0.0..=1.0).contains(f)) || phase.read_shared + phase.read_own > 1.0 {
                return Err(format!("phase {}: fractions must lie in 0..=1", phase.name));
            }
            if !(phase.recency_skew >= 1.0 && phase.recency_skew.is_finite()) {
                return Err(format!("phase {}: recency_skew must be 1 or more", phase.name));
            }
            if !(phase.duration_s > 0.0 && phase.duration_s <= MAX_PHASE_S) || phase.ios == 0 {
                return Err(format!("phase {}: needs a duration (above 0, at most a week) and IOs", phase.name));
            }
            if !(phase.trims_per_write >= 0.0 && phase.trims_per_write.is_finite()) {
                return Err(format!("phase {}: trims_per_write must be 0 or more", phase.name));
            }
            let trims = phase.ios as f64 * (1.0 - phase.read_fraction) * phase.trims_per_write;
            if phase.ios as f64 + trims + phase.flushes as f64 > MAX_PHASE_REQUESTS as f64 {
                return Err(format!("phase {}: more than {MAX_PHASE_REQUESTS} requests per VM", phase.name));
            }
            for (size, _) in phase.read_sizes.iter().chain(&phase.write_sizes) {
                if *size == 0 || *size % 512 != 0 || *size > 32 << 20 {
                    return Err(format!("phase {}: sizes must be multiples of 512 up to 32 MiB", phase.name));
                }
            }
            // A read lands anywhere in the system region, a write anywhere in its area.
            if phase.read_sizes.iter().any(|(size, _)| u64::from(*size) >= d.system_mib * MIB) {
                return Err(format!("phase {}: read sizes must be smaller than the system region", phase.name));
            }
            let smallest_area = phase
                .write_areas
                .iter()
                .filter_map(|(name, _)| d.areas.iter().find(|a| &a.name == name))
                .map(|a| a.size_mib * MIB)
                .min();
            if smallest_area.is_some_and(|bytes| phase.write_sizes.iter().any(|(size, _)| u64::from(*size) > bytes)) {
                return Err(format!("phase {}: write sizes must fit the smallest of its write areas", phase.name));
            }
            for (area, _) in &phase.write_areas {
                match d.areas.iter().find(|a| &a.name == area) {
                    None => return Err(format!("phase {}: unknown write area {area}", phase.name)),
                    Some(a) if a.direct => {
                        return Err(format!(
                            "phase {}: {area} is direct: it is written through direct_share",
                            phase.name
                        ))
                    }
                    Some(_) => {}
                }
            }
            let (read_odds, write_odds) = phase.direct_odds(self.direct_share);
            if read_odds > 1.0 || write_odds > 1.0 {
                return Err(format!(
                    "phase {}: direct_share with event_log_reads asks more event-log reads or writes than the phase has",
                    phase.name
                ));
            }
            if phase.read_sizes.is_empty() || phase.write_sizes.is_empty() || phase.write_areas.is_empty() {
                return Err(format!("phase {}: size mixes and areas may not be empty", phase.name));
            }
        }
        Ok(())
    }

    /// Every VM's requests for every phase, in order. `workload_seed` fixes the shared boot
    /// sequence (the same for all VMs); `vm` varies everything else.
    pub fn generate(&self, workload_seed: u64, vm: u64) -> Vec<Vec<Op>> {
        let mut state = VmState::new(&self.disk);
        self.phases
            .iter()
            .enumerate()
            .map(|(index, phase)| {
                let shared_seed = workload_seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let vm_seed = shared_seed ^ (vm + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                state.phase(&self.disk, phase, self.direct_share, shared_seed, vm_seed)
            })
            .collect()
    }
}

fn uniform_skew() -> f64 {
    1.0
}

/// An index into a history of `len` (> 0) entries, favouring the newest by `skew` (see
/// [`Phase::recency_skew`]); uniform, with the generator's historical draw, when `skew` is 1.
fn recent_index(rng: &mut SmallRng, len: usize, skew: f64) -> usize {
    if skew == 1.0 {
        return rng.gen_range(0..len);
    }
    let back = (len as f64 * rng.gen::<f64>().powf(skew)) as usize;
    len - 1 - back.min(len - 1)
}

fn pick<'a, T>(rng: &mut SmallRng, weighted: &'a [(T, f64)]) -> &'a T {
    let total: f64 = weighted.iter().map(|(_, w)| w).sum();
    let mut x = rng.gen::<f64>() * total;
    for (item, weight) in weighted {
        if x < *weight {
            return item;
        }
        x -= weight;
    }
    &weighted[weighted.len() - 1].0
}

/// What a VM has written so far, per area, so that overwrites, re-reads and deletes hit it; the
/// event-log areas' writes apart, read back only by event-log reads.
struct VmState {
    cursors: BTreeMap<String, u64>,
    written: BTreeMap<String, Vec<(u64, u32)>>,
    direct_written: Vec<(u64, u32)>,
}

impl VmState {
    fn new(disk: &DiskLayout) -> Self {
        Self {
            cursors: disk.areas.iter().map(|a| (a.name.clone(), a.start_mib * MIB)).collect(),
            written: disk.areas.iter().filter(|a| !a.direct).map(|a| (a.name.clone(), Vec::new())).collect(),
            direct_written: Vec::new(),
        }
    }

    /// An event-log write: appended to the (first) direct area, which wraps as a log does.
    fn direct_write(&mut self, rng: &mut SmallRng, disk: &DiskLayout, p: &Phase, at_ms: u64) -> Op {
        let area = disk.areas.iter().find(|a| a.direct).expect("checked at load: direct_share needs one");
        let len = *pick(rng, &p.write_sizes);
        let (start, end) = (area.start_mib * MIB, (area.start_mib + area.size_mib) * MIB);
        let cursor = self.cursors.get_mut(&area.name).expect("one per area");
        if *cursor + u64::from(len) > end {
            *cursor = start;
        }
        let offset = *cursor;
        *cursor += u64::from(len);
        self.direct_written.push((offset, len));
        Op { at_ms, kind: GuestOp::Write, offset, len }
    }

    /// An event-log read: a recent event-log write read back; `None` before the first.
    fn direct_read(&mut self, rng: &mut SmallRng, at_ms: u64) -> Option<Op> {
        let written = &self.direct_written;
        let (offset, len) = *written.get(recent_index(rng, written.len().max(1), 4.0))?;
        Some(Op { at_ms, kind: GuestOp::Read, offset, len })
    }

    fn phase(
        &mut self,
        disk: &DiskLayout,
        phase: &Phase,
        direct_share: f64,
        shared_seed: u64,
        vm_seed: u64,
    ) -> Vec<Op> {
        let mut rng = SmallRng::seed_from_u64(vm_seed);
        // Its own stream, so that a workload without event-log I/O draws what it always drew.
        let mut direct_rng = SmallRng::seed_from_u64(vm_seed ^ 0x6576_656e_746c_6f67);
        // The boot sequence all VMs share: the same offsets and sizes in the same order.
        let mut shared_rng = SmallRng::seed_from_u64(shared_seed);
        let system_bytes = disk.system_mib * MIB;
        let duration_ms = (phase.duration_s * 1000.0) as u64;
        let trims = (phase.ios as f64 * (1.0 - phase.read_fraction) * phase.trims_per_write).round() as u64;
        let total = phase.ios + trims + phase.flushes;
        let mut ops = Vec::with_capacity(total as usize);
        let (mut reads_left, mut writes_left) = phase.reads_and_writes();
        let (mut trims_left, mut flushes_left) = (trims, phase.flushes);
        let (read_odds, write_odds) = phase.direct_odds(direct_share);
        for k in 0..total {
            let at_ms = k * duration_ms / total;
            // Draw the kind so that exactly the planned counts come out, spread evenly.
            let left = reads_left + writes_left + trims_left + flushes_left;
            let x = rng.gen_range(0..left);
            let kind = if x < reads_left {
                GuestOp::Read
            } else if x < reads_left + writes_left {
                GuestOp::Write
            } else if x < reads_left + writes_left + trims_left {
                GuestOp::Trim
            } else {
                GuestOp::Flush
            };
            let odds = match kind {
                GuestOp::Read => read_odds,
                GuestOp::Write => write_odds,
                _ => 0.0,
            };
            let direct = odds > 0.0 && direct_rng.gen::<f64>() < odds;
            let op = match kind {
                GuestOp::Read => {
                    reads_left -= 1;
                    match direct.then(|| self.direct_read(&mut direct_rng, at_ms)).flatten() {
                        Some(op) => op,
                        None => self.read(&mut rng, &mut shared_rng, phase, system_bytes, at_ms),
                    }
                }
                GuestOp::Write if direct => {
                    writes_left -= 1;
                    self.direct_write(&mut direct_rng, disk, phase, at_ms)
                }
                GuestOp::Write => {
                    writes_left -= 1;
                    self.write(&mut rng, disk, phase, at_ms)
                }
                GuestOp::Trim => {
                    trims_left -= 1;
                    self.trim(&mut rng, at_ms)
                }
                GuestOp::Flush => {
                    flushes_left -= 1;
                    Op { at_ms, kind, offset: 0, len: 0 }
                }
                GuestOp::Zero => unreachable!("the kind draw above yields only reads, writes, trims and flushes"),
            };
            ops.push(op);
        }
        ops
    }

    fn read(&mut self, rng: &mut SmallRng, shared: &mut SmallRng, p: &Phase, system: u64, at_ms: u64) -> Op {
        let x = rng.gen::<f64>();
        if x < p.read_shared {
            let len = *pick(shared, &p.read_sizes);
            let offset = shared.gen_range(0..system - u64::from(len)) / 4096 * 4096;
            return Op { at_ms, kind: GuestOp::Read, offset, len };
        }
        if x < p.read_shared + p.read_own {
            let areas: Vec<&Vec<(u64, u32)>> = self.written.values().filter(|w| !w.is_empty()).collect();
            if !areas.is_empty() {
                let writes = areas[rng.gen_range(0..areas.len())];
                let (offset, len) = writes[recent_index(rng, writes.len(), p.recency_skew)];
                return Op { at_ms, kind: GuestOp::Read, offset, len };
            }
        }
        let len = *pick(rng, &p.read_sizes);
        let offset = rng.gen_range(0..system - u64::from(len)) / 4096 * 4096;
        Op { at_ms, kind: GuestOp::Read, offset, len }
    }

    fn write(&mut self, rng: &mut SmallRng, disk: &DiskLayout, p: &Phase, at_ms: u64) -> Op {
        let area_name = pick(rng, &p.write_areas);
        let area = disk.areas.iter().find(|a| &a.name == area_name).expect("checked at load");
        let history = self.written.get_mut(area_name).expect("one per area");
        if !history.is_empty() && rng.gen::<f64>() < p.write_overwrite {
            let (offset, len) = history[recent_index(rng, history.len(), p.recency_skew)];
            return Op { at_ms, kind: GuestOp::Write, offset, len };
        }
        let len = *pick(rng, &p.write_sizes);
        let (start, end) = (area.start_mib * MIB, (area.start_mib + area.size_mib) * MIB);
        let cursor = self.cursors.get_mut(area_name).expect("one per area");
        if *cursor + u64::from(len) > end {
            // The area is full: wrap, as a circular log or a reused page file would.
            *cursor = start;
        }
        let offset = *cursor;
        *cursor += u64::from(len);
        history.push((offset, len));
        Op { at_ms, kind: GuestOp::Write, offset, len }
    }

    fn trim(&mut self, rng: &mut SmallRng, at_ms: u64) -> Op {
        let candidates: Vec<String> =
            self.written.iter().filter(|(_, w)| !w.is_empty()).map(|(n, _)| n.clone()).collect();
        if candidates.is_empty() {
            return Op { at_ms, kind: GuestOp::Flush, offset: 0, len: 0 };
        }
        let name = &candidates[rng.gen_range(0..candidates.len())];
        let history = self.written.get_mut(name).expect("listed above");
        let (offset, len) = history.swap_remove(rng.gen_range(0..history.len()));
        Op { at_ms, kind: GuestOp::Trim, offset, len }
    }
}

/// The requests of each phase of a recorded trace, with times relative to the phase's first
/// request.
pub fn trace_phase_ops(trace: &Trace) -> Vec<Vec<Op>> {
    let mut phases: Vec<Vec<Op>> = vec![Vec::new(); trace.header.phases.len().max(1)];
    let mut starts: Vec<Option<u64>> = vec![None; phases.len()];
    for r in &trace.records {
        let p = usize::from(r.phase);
        let start = *starts[p].get_or_insert(r.time_us);
        let at_ms = r.time_us.saturating_sub(start) / 1000;
        phases[p].push(Op { at_ms, kind: r.kind, offset: r.offset, len: r.length });
    }
    phases
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traces_phases_become_ops_timed_from_each_phases_first_request() {
        use overspill_block::trace::{Record, TraceHeader};
        let header = TraceHeader { disk_bytes: 1 << 30, vm: "vm".into(), phases: vec!["boot".into(), "steady".into()] };
        let record = |time_us, kind, phase| Record { time_us, offset: 0, length: 4096, kind, flags: 0, phase };
        let records = vec![
            record(5, GuestOp::Read, 0),
            record(3_005, GuestOp::Write, 0),
            record(2_000_000, GuestOp::Trim, 1),
            record(2_007_000, GuestOp::Flush, 1),
        ];
        let trace = Trace { header, records, truncated_bytes: 0 };
        let phases = trace_phase_ops(&trace);
        let times: Vec<Vec<(u64, GuestOp)>> =
            phases.iter().map(|ops| ops.iter().map(|op| (op.at_ms, op.kind)).collect()).collect();
        assert_eq!(
            times,
            vec![vec![(0, GuestOp::Read), (3, GuestOp::Write)], vec![(0, GuestOp::Trim), (7, GuestOp::Flush)]]
        );
    }

    #[test]
    fn every_built_in_workload_loads() {
        for name in Workload::built_in_names() {
            let w = Workload::built_in(name).expect(name);
            assert!(!w.phases.is_empty(), "{name}");
        }
        assert!(Workload::built_in("nope").is_err());
    }

    #[test]
    fn generation_is_deterministic_and_shares_the_boot_sequence() {
        let w = Workload::built_in("win7-vdi").expect("built in");
        let a = w.generate(1, 0);
        assert_eq!(a, w.generate(1, 0));
        let b = w.generate(1, 1);
        let shared = |ops: &[Op]| -> std::collections::BTreeSet<u64> {
            ops.iter()
                .filter(|o| o.kind == GuestOp::Read && o.offset < w.disk.system_mib * MIB)
                .map(|o| o.offset)
                .collect()
        };
        let (sa, sb) = (shared(&a[0]), shared(&b[0]));
        let common = sa.intersection(&sb).count();
        assert!(common * 10 >= sa.len() * 8, "boot reads of two VMs mostly coincide: {common} of {}", sa.len());
    }

    #[test]
    fn malformed_profiles_are_refused_with_a_reason() {
        let good = include_str!("../workloads/linux-boot.toml");
        let bad = good.replace("read_fraction = 0.966", "read_fraction = 7.0");
        let err = Workload::parse("x", &bad).expect_err("fraction above 1");
        assert!(err.to_string().contains("fractions"), "{err}");
        let unknown_field = format!("{good}\nbogus = 1\n");
        assert!(Workload::parse("x", &unknown_field).is_err());
        // An area over the event log's would have its writes taken for event-log writes.
        let win7 = include_str!("../workloads/win7-vdi.toml");
        assert!(Workload::parse("x", win7).is_ok());
        let overlapping = win7.replace(
            r#"{ name = "logs", start_mib = 3072, size_mib = 128 }"#,
            r#"{ name = "logs", start_mib = 3072, size_mib = 200 }"#,
        );
        assert_ne!(overlapping, win7, "the test edits the logs area");
        let err = Workload::parse("x", &overlapping).expect_err("logs over the event log");
        assert!(err.to_string().contains("overlaps the direct area eventlog"), "{err}");
        // Boot has 3,513 writes: event logs of 20% of its 25,096 requests, all appends, are more.
        let all_appends = win7
            .replace("direct_share = 0.02136", "direct_share = 0.2")
            .replace("event_log_reads = 0.56", "event_log_reads = 0.0");
        let err = Workload::parse("x", &all_appends).expect_err("more event-log writes than writes");
        assert!(err.to_string().contains("phase boot: direct_share with event_log_reads"), "{err}");
        // What passed the check and then panicked or aborted the storm.
        let reads_of_a_mib = [("system_mib = 1024", "system_mib = 1"), ("[[4096, 0.57]", "[[1048576, 0.57]")];
        let var_of_a_mib = [
            ("start_mib = 1024, size_mib = 512", "start_mib = 1024, size_mib = 1"),
            ("[262144, 0.2]]", "[2097152, 0.2]]"),
        ];
        for (edits, why) in [
            (&reads_of_a_mib[..], "smaller than the system region"),
            (&var_of_a_mib[..], "fit the smallest"),
            (&[("duration_s = 20", "duration_s = inf")][..], "at most a week"),
            (&[("duration_s = 20", "duration_s = 1e12")][..], "at most a week"),
            (&[("duration_s = 20", "duration_s = nan")][..], "at most a week"),
        ] {
            let bad = edits.iter().fold(good.to_owned(), |text, (from, to)| {
                assert!(text.contains(from), "the test edits {from}");
                text.replacen(from, to, 1)
            });
            let err = Workload::parse("x", &bad).expect_err(why);
            assert!(err.to_string().contains(why), "{edits:?}: {err}");
        }
    }

    #[test]
    fn event_log_requests_are_the_share_asked_and_read_only_where_a_phase_says() {
        let win7 = Workload::built_in("win7-vdi").expect("built in");
        let direct = win7.direct_ranges();
        let in_log = |op: &Op| direct.iter().any(|&(start, end)| op.offset >= start && op.offset < end);
        let vms = 20;
        for (index, phase) in win7.phases.iter().enumerate() {
            let (mut reads, mut writes, mut requests) = (0.0, 0.0, 0.0);
            for vm in 0..vms {
                for op in
                    win7.generate(3, vm)[index].iter().filter(|op| matches!(op.kind, GuestOp::Read | GuestOp::Write))
                {
                    requests += 1.0;
                    match (in_log(op), op.kind) {
                        (false, _) => {}
                        (true, GuestOp::Read) => reads += 1.0,
                        (true, _) => writes += 1.0,
                    }
                }
            }
            let share = (reads + writes) / requests;
            let read_share = reads / (reads + writes);
            assert!((share / win7.direct_share - 1.0).abs() < 0.1, "{}: {share:.4} of requests", phase.name);
            assert!((read_share - phase.event_log_reads).abs() < 0.05, "{}: {read_share:.3} reads", phase.name);
        }
    }
}
