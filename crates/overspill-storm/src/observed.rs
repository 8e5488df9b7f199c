//! VMs that run by themselves (real guests): the storm does not issue their requests, it watches
//! them. A phase begins when the guest says so (a marker on its console), and the engine's
//! counters, sampled at each marker and between markers, give each phase and each time bucket
//! the guest and storage operations that happened in it, the same tiers the driver counts for a
//! synthetic VM. The results are the driver's own types, so the reports do not tell them apart.

use std::sync::Arc;

use overspill_engine::VmStats;

use crate::driver::{add_tiers, storage_tiers, Ops, RunPlan, TierOps, Timeline, VmPhase, VmResult, GUEST};

/// One VM's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Indexed like [`crate::driver::TIERS`]; the guest's own from its requests.
    pub tiers: TierOps,
    pub trims: u64,
    pub flushes: u64,
}

impl Counts {
    pub fn of(s: &VmStats) -> Self {
        let mut tiers = storage_tiers(s);
        // Write zeroes counts as a write, as the driver counts the ones it sends.
        tiers[GUEST] = Ops {
            reads: s.guest_read.ops.get(),
            writes: s.guest_write.ops.get() + s.guest_zero.ops.get(),
            read_bytes: s.guest_read.bytes.get(),
            write_bytes: s.guest_write.bytes.get() + s.guest_zero.bytes.get(),
        };
        Self { tiers, trims: s.guest_trim.ops.get(), flushes: s.guest_flush.ops.get() }
    }

    /// What changed since `earlier`. Counters only grow; a saturating difference keeps a
    /// counter that was replaced (a reconnect with fresh ones) from wrapping around.
    fn since(&self, earlier: &Counts) -> Counts {
        let mut tiers = TierOps::default();
        for (d, (now, then)) in tiers.iter_mut().zip(self.tiers.iter().zip(&earlier.tiers)) {
            *d = Ops {
                reads: now.reads.saturating_sub(then.reads),
                writes: now.writes.saturating_sub(then.writes),
                read_bytes: now.read_bytes.saturating_sub(then.read_bytes),
                write_bytes: now.write_bytes.saturating_sub(then.write_bytes),
            };
        }
        Counts {
            tiers,
            trims: self.trims.saturating_sub(earlier.trims),
            flushes: self.flushes.saturating_sub(earlier.flushes),
        }
    }
}

#[derive(Debug, Clone)]
struct Sample {
    at_ms: u64,
    /// The phase the VM was in up to this sample.
    phase: usize,
    counts: Counts,
}

/// What was seen of one VM. Times are ms since the storm started, and must be given in order.
#[derive(Debug)]
pub struct Observation {
    phase_starts_ms: Vec<Option<u64>>,
    samples: Vec<Sample>,
    stats: Option<Arc<VmStats>>,
    connected_ms: Option<u64>,
    failure: Option<String>,
}

impl Observation {
    /// A VM of `phases` phases started at `started_ms`, when its first phase begins. Its
    /// counters start at zero then: an overlay is new with its connection.
    pub fn new(phases: usize, started_ms: u64) -> Self {
        let mut phase_starts_ms = vec![None; phases.max(1)];
        phase_starts_ms[0] = Some(started_ms);
        Self {
            phase_starts_ms,
            samples: vec![Sample { at_ms: started_ms, phase: 0, counts: Counts::default() }],
            stats: None,
            connected_ms: None,
            failure: None,
        }
    }

    /// The VM's counters, from when its connection was seen.
    pub fn connected(&mut self, at_ms: u64, stats: Arc<VmStats>) {
        if self.stats.is_none() {
            self.stats = Some(stats);
            self.connected_ms = Some(at_ms);
        }
    }

    pub fn is_connected(&self) -> bool {
        self.stats.is_some()
    }

    /// The VM's counters, once connected.
    pub fn stats(&self) -> Option<&Arc<VmStats>> {
        self.stats.as_ref()
    }

    pub fn connected_ms(&self) -> Option<u64> {
        self.connected_ms
    }

    /// The phase the VM is in.
    pub fn phase(&self) -> usize {
        self.phase_starts_ms.iter().rposition(Option::is_some).unwrap_or(0)
    }

    pub fn phase_start_ms(&self, phase: usize) -> Option<u64> {
        self.phase_starts_ms.get(phase).copied().flatten()
    }

    /// Reads the counters: what changed since the last sample happened in the current phase.
    pub fn sample(&mut self, at_ms: u64) {
        let Some(stats) = &self.stats else { return };
        let counts = Counts::of(stats);
        let at_ms = at_ms.max(self.end_ms());
        self.samples.push(Sample { at_ms, phase: self.phase(), counts });
    }

    /// The guest says `phase` begins at `at_ms`: what came before belongs to the phase it
    /// leaves. Phases only move forward (a marker repeated or out of order changes nothing, and
    /// says false); one skipped has no start.
    pub fn enter(&mut self, phase: usize, at_ms: u64) -> bool {
        if phase <= self.phase() || phase >= self.phase_starts_ms.len() {
            return false;
        }
        self.sample(at_ms);
        self.phase_starts_ms[phase] = Some(at_ms.max(self.end_ms()));
        true
    }

    /// The VM stopped short; the first reason given is kept.
    pub fn fail(&mut self, why: impl Into<String>) {
        self.failure.get_or_insert_with(|| why.into());
    }

    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// The last moment seen.
    pub fn end_ms(&self) -> u64 {
        self.samples.last().map_or(0, |s| s.at_ms)
    }
}

/// The plan the observed VMs followed (each VM's phase starts, each phase's window over all of
/// them; no requests) and their results, with `bucket_s`-wide buckets of storm time.
pub fn results(
    phase_names: &[String],
    disk_bytes: u64,
    observations: &[Observation],
    bucket_s: u64,
) -> (RunPlan, Vec<VmResult>) {
    let bucket_ms = bucket_s.max(1) * 1000;
    let phases = phase_names.len().max(1);
    let end_ms = observations.iter().map(Observation::end_ms).max().unwrap_or(0);
    let buckets = (end_ms / bucket_ms + 1) as usize;
    let mut starts_ms = vec![vec![0u64; observations.len()]; phases];
    let mut windows_ms = vec![(u64::MAX, 0u64); phases];
    let mut results = Vec::with_capacity(observations.len());
    for (vm, o) in observations.iter().enumerate() {
        for p in 0..phases {
            // A phase lasts until the next one the VM began, or until the VM ended.
            let until = o.phase_starts_ms[p + 1..].iter().flatten().next().copied().unwrap_or(o.end_ms());
            starts_ms[p][vm] = o.phase_starts_ms[p].unwrap_or(until);
            if let Some(start) = o.phase_starts_ms[p] {
                windows_ms[p] = (windows_ms[p].0.min(start), windows_ms[p].1.max(until));
            }
        }
        let mut result = VmResult {
            vm,
            phases: vec![VmPhase::default(); phases],
            timeline: vec![TierOps::default(); buckets],
            spill_segments_written: 0,
            peak_cache_memory_bytes: 0,
            peak_cache_disk_bytes: 0,
            blocks: Default::default(),
            has_storage: o.stats.is_some(),
            failure: o.failure.clone(),
            // Real guests say when they booted themselves (`guest_storm`).
            boot_began_s: None,
            booted_at_s: None,
            first_answered_s: None,
            boot_read_us: Vec::new(),
        };
        for pair in o.samples.windows(2) {
            let delta = pair[1].counts.since(&pair[0].counts);
            let phase = &mut result.phases[pair[1].phase.min(phases - 1)];
            add_tiers(&mut phase.tiers, &delta.tiers);
            phase.trims += delta.trims;
            phase.flushes += delta.flushes;
            let bucket = ((pair[1].at_ms / bucket_ms) as usize).min(buckets - 1);
            add_tiers(&mut result.timeline[bucket], &delta.tiers);
        }
        if let Some(s) = o.stats.as_deref() {
            result.spill_segments_written = s.spill_segments_written.get();
            result.peak_cache_memory_bytes = s.cache_memory_peak_bytes.get();
            result.peak_cache_disk_bytes = s.cache_disk_peak_bytes.get();
            result.blocks.engine_side(s);
            // The engine counts each block a guest request touched once, at the tier that
            // served it: those are the blocks the guest asked for.
            result.blocks.guest_read_blocks = result.blocks.reads_served();
            result.blocks.guest_write_blocks = result.blocks.writes_landed();
        }
        results.push(result);
    }
    // A phase no VM reached: an empty window where the one before ended.
    let mut last_end = 0;
    for window in &mut windows_ms {
        if window.0 == u64::MAX {
            *window = (last_end, last_end);
        }
        last_end = window.1;
    }
    let plan = RunPlan {
        phase_names: phase_names.to_vec(),
        disk_bytes,
        direct: Vec::new(),
        ops: vec![vec![Vec::new(); phases]; observations.len()],
        timeline: Timeline { starts_ms, windows_ms },
    };
    (plan, results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::tier_index;
    use overspill_engine::StorageTier;

    fn names() -> Vec<String> {
        ["boot", "logon", "steady"].map(String::from).to_vec()
    }

    #[test]
    fn operations_go_to_the_phase_and_bucket_they_happened_in() {
        let stats = Arc::new(VmStats::default());
        let mut o = Observation::new(3, 1000);
        // Before the connection is seen, nothing can be read; what happened counts at the first
        // sample after it.
        stats.guest_read.add(4096);
        stats.golden_read.add(4096);
        o.sample(1100);
        o.connected(1200, stats.clone());
        stats.guest_read.add(8192);
        o.sample(2500);
        assert!(o.enter(1, 3000));
        assert!(!o.enter(1, 3100), "a repeated marker");
        assert!(!o.enter(0, 3200), "a marker out of order");
        stats.guest_write.add(4096);
        stats.guest_zero.add(65536);
        stats.spill_write.add(2 << 20);
        stats.guest_trim.add(4096);
        // The guest skips logon's end and says steady; its end is its last sample.
        assert!(o.enter(2, 6000));
        stats.guest_flush.add(0);
        stats.shared_read.add(512);
        o.sample(7500);
        let mut late = Observation::new(3, 2000);
        late.fail("did not boot");

        let (plan, results) = results(&names(), 1 << 30, &[o, late], 2);
        let vm = &results[0];
        assert_eq!(vm.phases[0].tiers[GUEST], Ops { reads: 2, writes: 0, read_bytes: 12288, write_bytes: 0 });
        assert_eq!(vm.phases[0].tiers[tier_index(StorageTier::Golden)].reads, 1, "golden image at boot");
        assert_eq!(vm.phases[1].tiers[GUEST], Ops { reads: 0, writes: 2, read_bytes: 0, write_bytes: 69632 });
        assert_eq!(vm.phases[1].tiers[tier_index(StorageTier::Spill)].writes, 1, "spill at logon");
        assert_eq!((vm.phases[1].trims, vm.phases[2].flushes), (1, 1));
        assert_eq!(vm.phases[2].tiers[tier_index(StorageTier::Shared)].reads, 1, "shared storage in steady state");
        // Buckets of 2 s: the boot's samples at 2.5 s and 3 s fall in bucket 1, logon's at 6 s in
        // bucket 3, steady's at 7.5 s in bucket 3.
        assert_eq!(vm.timeline.len(), 4);
        assert_eq!(vm.timeline[1][GUEST].reads, 2);
        assert_eq!(vm.timeline[3][GUEST].writes, 2);
        assert_eq!(vm.timeline[3][tier_index(StorageTier::Shared)].reads, 1);
        assert!(vm.has_storage);
        assert_eq!(results[1].failure.as_deref(), Some("did not boot"));
        assert!(!results[1].has_storage);
        assert_eq!(plan.timeline.windows_ms, [(1000, 3000), (3000, 6000), (6000, 7500)]);
        assert_eq!(plan.timeline.starts_ms[0], [1000, 2000]);
        assert_eq!(plan.timeline.starts_ms[2], [6000, 2000], "a phase not reached starts where the VM ended");
        assert_eq!(plan.phase_names, names());
    }
}
