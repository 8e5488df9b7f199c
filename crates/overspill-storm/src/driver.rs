//! The storm driver: N VMs, each on its own real NBD connection and thread, run a workload's
//! phases on a shared timeline (boots one every `boot_interval`, logons one every
//! `logon_interval`, then steady state together).
//!
//! Time is profile time: each request carries the moment the profile puts it at, and results are
//! bucketed by that moment, so the figures do not depend on how fast this machine is. With
//! `speed`, requests are also paced to profile time divided by `speed`; without it they go back
//! to back. When the server runs in this process, the engine's per-VM counters are read after
//! every request, so storage-tier operations are attributed to the phase and moment of the guest
//! request that caused them.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use overspill_engine::{StorageTier, VmStats};
use overspill_nbd::client::{Client, NbdUri};
use serde::Serialize;

use crate::profile::{Op, Workload};
use overspill_block::trace::{Record, Trace, TraceHeader, TraceWriter};
use overspill_block::GuestOp;

/// Where the VMs connect, and (for an in-process server) where their counters are.
pub trait Target: Sync {
    fn uri(&self, vm: usize) -> NbdUri;
    /// The engine's counters of a connected VM, when the server runs in this process.
    fn stats(&self, vm: usize) -> Option<Arc<VmStats>>;
    /// VM `vm`'s boot (its first phase) is done: an in-process server's boot slot goes to the
    /// next VM (`serve --boot-max`, `overspill vm booted`).
    fn booted(&self, vm: usize) {
        let _ = vm;
    }
    /// Whether the guests keep their event logs on a disk of their own (see [`DIRECT`]): true
    /// for an in-process write cache, false for `shared` (MCS) and for a server elsewhere, which
    /// gets every request.
    fn event_logs_apart(&self) -> bool {
        false
    }
}

/// A server outside this process, and no engine counters. Every VM connects to the same URI,
/// but for [`VM_PLACEHOLDER`] in its export name, which becomes the VM's number
/// (`@storm-{n}`: each VM named, as a server that serves unnamed ones read-only needs).
pub struct RemoteTarget(pub NbdUri);

/// In a remote target's export name, stands for the VM's number.
pub const VM_PLACEHOLDER: &str = "{n}";

impl Target for RemoteTarget {
    fn uri(&self, vm: usize) -> NbdUri {
        NbdUri { endpoint: self.0.endpoint.clone(), export: self.0.export.replace(VM_PLACEHOLDER, &vm.to_string()) }
    }

    fn stats(&self, _vm: usize) -> Option<Arc<VmStats>> {
        None
    }
}

#[derive(Debug, Clone)]
pub struct StormConfig {
    pub vms: usize,
    pub boot_interval_s: f64,
    pub logon_interval_s: f64,
    /// Profile seconds per wall second; `None` runs requests back to back.
    pub speed: Option<f64>,
    pub workload_seed: u64,
    /// Width of the IOPS-over-time buckets, in profile seconds.
    pub bucket_s: u64,
}

/// Operations counted at one tier, split into reads and writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Ops {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
}

impl Ops {
    pub fn total(&self) -> u64 {
        self.reads + self.writes
    }

    pub(crate) fn add(&mut self, other: &Ops) {
        self.reads += other.reads;
        self.writes += other.writes;
        self.read_bytes += other.read_bytes;
        self.write_bytes += other.write_bytes;
    }

    pub(crate) fn minus(&self, earlier: &Ops) -> Ops {
        Ops {
            reads: self.reads - earlier.reads,
            writes: self.writes - earlier.writes,
            read_bytes: self.read_bytes - earlier.read_bytes,
            write_bytes: self.write_bytes - earlier.write_bytes,
        }
    }
}

/// The tiers a request can reach, in report order: the guest's requests, what the overlay asked
/// of the golden image (all served by its shared read cache when there is one), then each
/// [`StorageTier`], where operations actually reached storage.
pub const TIERS: [&str; 3 + StorageTier::ALL.len()] = {
    let mut names = ["guest", "read cache", "", "", "", "", "event-log disk"];
    let mut i = 0;
    while i < StorageTier::ALL.len() {
        names[2 + i] = StorageTier::ALL[i].title();
        i += 1;
    }
    names
};

/// Where in [`TIERS`] (and [`TierOps`]) the guest's requests, the golden-image requests and
/// each storage tier are.
pub const GUEST: usize = 0;
pub const READ_CACHE: usize = 1;
pub const fn tier_index(tier: StorageTier) -> usize {
    2 + tier as usize
}
/// The guest's own persistent disk for its event logs (a workload's `direct` areas), outside
/// the write cache: PVS deployments redirect the event logs to the cache disk "so that they
/// persist and their I/O would not be cached in RAM" (seed 000). Counted here, not sent to
/// overspill, whose VMs would keep them in RAM; `shared` (MCS) has no such disk.
pub const DIRECT: usize = 2 + StorageTier::ALL.len();

/// Counts per tier, indexed like [`TIERS`].
pub type TierOps = [Ops; TIERS.len()];

/// The storage tiers' operations between two samples of the engine's counters; the guest's own
/// and the event-log disk's (counted by the tally) are left alone.
fn set_storage_since(delta: &mut TierOps, now: &TierOps, last: &TierOps) {
    for (tier, (n, l)) in now.iter().zip(last).enumerate().skip(GUEST + 1).take(DIRECT - GUEST - 1) {
        delta[tier] = n.minus(l);
    }
}

pub(crate) fn add_tiers(into: &mut TierOps, from: &TierOps) {
    for (a, b) in into.iter_mut().zip(from) {
        a.add(b);
    }
}

/// The storage tiers of an in-process VM, read from the engine's counters.
pub fn storage_tiers(s: &VmStats) -> TierOps {
    let mut tiers = TierOps::default();
    tiers[READ_CACHE] =
        Ops { reads: s.golden_request.ops.get(), read_bytes: s.golden_request.bytes.get(), ..Ops::default() };
    for tier in StorageTier::ALL {
        let (read, write) = (tier.reads(s), tier.writes(s));
        tiers[tier_index(tier)] = Ops {
            reads: read.ops.get(),
            writes: write.map_or(0, |w| w.ops.get()),
            read_bytes: read.bytes.get(),
            write_bytes: write.map_or(0, |w| w.bytes.get()),
        };
    }
    tiers
}

/// Which tier served each 4 KiB block of guest I/O, from the engine's counters, beside the
/// blocks the guest asked for: the figures that prove the accounting adds up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BlockTally {
    pub guest_read_blocks: u64,
    pub read_ram: u64,
    pub read_spill: u64,
    pub read_golden: u64,
    pub read_zero: u64,
    pub read_cache_file: u64,
    pub guest_write_blocks: u64,
    pub write_ram: u64,
    pub write_spill: u64,
    pub write_cache_file: u64,
}

impl BlockTally {
    pub fn add(&mut self, o: &BlockTally) {
        self.guest_read_blocks += o.guest_read_blocks;
        self.read_ram += o.read_ram;
        self.read_spill += o.read_spill;
        self.read_golden += o.read_golden;
        self.read_zero += o.read_zero;
        self.read_cache_file += o.read_cache_file;
        self.guest_write_blocks += o.guest_write_blocks;
        self.write_ram += o.write_ram;
        self.write_spill += o.write_spill;
        self.write_cache_file += o.write_cache_file;
    }

    pub fn reads_served(&self) -> u64 {
        self.read_ram + self.read_spill + self.read_golden + self.read_zero + self.read_cache_file
    }

    pub fn writes_landed(&self) -> u64 {
        self.write_ram + self.write_spill + self.write_cache_file
    }

    pub(crate) fn engine_side(&mut self, s: &VmStats) {
        self.read_ram = s.read_blocks_ram.get();
        self.read_spill = s.read_blocks_spill.get();
        self.read_golden = s.read_blocks_golden.get();
        self.read_zero = s.read_blocks_zero.get();
        self.read_cache_file = s.read_blocks_cache_file.get();
        self.write_ram = s.write_blocks_ram.get();
        self.write_spill = s.write_blocks_spill.get();
        self.write_cache_file = s.write_blocks_cache_file.get();
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct VmPhase {
    pub tiers: TierOps,
    pub trims: u64,
    pub flushes: u64,
    pub errors: u64,
    pub enospc: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct VmResult {
    pub vm: usize,
    pub phases: Vec<VmPhase>,
    /// Per bucket of profile time: ops per tier.
    pub timeline: Vec<TierOps>,
    pub spill_segments_written: u64,
    pub peak_cache_memory_bytes: u64,
    pub peak_cache_disk_bytes: u64,
    pub blocks: BlockTally,
    /// Whether storage tiers were measured (in-process server).
    pub has_storage: bool,
    /// Set when the VM lost its connection and stopped early.
    pub failure: Option<String>,
    /// Seconds since the storm began: when the VM was ready to send its first request (it may
    /// then wait for a boot slot) and when its first phase, its boot, was done.
    pub boot_began_s: Option<f64>,
    pub booted_at_s: Option<f64>,
    /// When its first request was answered: a VM waiting for a boot slot got it then.
    pub first_answered_s: Option<f64>,
    /// How long each of its boot's reads took, as the VM saw them (sent to answered), in µs.
    #[serde(skip)]
    pub boot_read_us: Vec<u32>,
}

/// When each VM starts each phase, and each phase's window over all VMs, in profile ms.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    /// `starts[phase][vm]`.
    pub starts_ms: Vec<Vec<u64>>,
    /// `(start, end)` of each phase over all VMs.
    pub windows_ms: Vec<(u64, u64)>,
}

impl Timeline {
    pub fn end_ms(&self) -> u64 {
        self.windows_ms.last().map_or(0, |w| w.1)
    }
}

/// Everything a storm will do: each VM's requests per phase, and when.
#[derive(Debug, Clone)]
pub struct RunPlan {
    pub phase_names: Vec<String>,
    pub disk_bytes: u64,
    /// The byte ranges of the workload's `direct` areas (event logs): requests there go to the
    /// [`DIRECT`] disk when the target keeps event logs apart. Recorded traces have none.
    pub direct: Vec<(u64, u64)>,
    /// `ops[vm][phase]`, times relative to the VM's start of the phase.
    pub ops: Vec<Vec<Vec<Op>>>,
    pub timeline: Timeline,
}

impl RunPlan {
    /// A workload's phases on `config.vms` VMs: boots one every `boot_interval`, logons one
    /// every `logon_interval`, other phases all together once the one before has ended.
    pub fn from_workload(workload: &Workload, config: &StormConfig) -> Self {
        let mut starts_ms = Vec::new();
        let mut windows_ms = Vec::new();
        let mut phase_start = 0u64;
        for phase in &workload.phases {
            let interval = match phase.name.as_str() {
                "boot" => config.boot_interval_s,
                "logon" => config.logon_interval_s,
                _ => 0.0,
            };
            let duration = (phase.duration_s * 1000.0) as u64;
            let starts: Vec<u64> =
                (0..config.vms).map(|vm| phase_start + (vm as f64 * interval * 1000.0) as u64).collect();
            let end = starts.iter().max().copied().unwrap_or(phase_start) + duration;
            windows_ms.push((phase_start, end));
            starts_ms.push(starts);
            phase_start = end;
        }
        Self {
            phase_names: workload.phases.iter().map(|p| p.name.clone()).collect(),
            disk_bytes: workload.disk_bytes(),
            direct: workload.direct_ranges(),
            ops: (0..config.vms).map(|vm| workload.generate(config.workload_seed, vm as u64)).collect(),
            timeline: Timeline { starts_ms, windows_ms },
        }
    }

    /// One VM per trace, at the times they were recorded. Traces of other phases than the
    /// first's are refused: their requests in phases past its own would be dropped unsaid.
    pub fn from_traces(traces: &[Trace]) -> Result<Self, String> {
        let phase_names = traces.first().map_or_else(Vec::new, |t| t.header.phases.clone());
        if let Some(other) = traces.iter().find(|t| t.header.phases != phase_names) {
            return Err(format!(
                "the traces' phases differ: {phase_names:?} in the first, {:?} in VM {}'s; take traces of one \
                 kind together (a `serve --record` trace has one phase, a storm's those of its profile)",
                other.header.phases, other.header.vm
            ));
        }
        let phases = phase_names.len().max(1);
        let mut starts_ms = vec![vec![0u64; traces.len()]; phases];
        let mut windows_ms = vec![(u64::MAX, 0u64); phases];
        let mut ops = Vec::new();
        for (vm, trace) in traces.iter().enumerate() {
            let mut per_phase = crate::profile::trace_phase_ops(trace);
            per_phase.resize(phases, Vec::new());
            for p in 0..phases {
                let recorded = trace.records.iter().filter(|r| usize::from(r.phase) == p);
                let first = recorded.clone().map(|r| r.time_us / 1000).min();
                let last = recorded.map(|r| r.time_us / 1000).max();
                if let (Some(first), Some(last)) = (first, last) {
                    starts_ms[p][vm] = first;
                    windows_ms[p].0 = windows_ms[p].0.min(first);
                    windows_ms[p].1 = windows_ms[p].1.max(last + 1);
                }
            }
            ops.push(per_phase);
        }
        for w in &mut windows_ms {
            if w.0 == u64::MAX {
                *w = (w.1, w.1);
            }
        }
        Ok(Self {
            phase_names: if phase_names.is_empty() { vec!["recorded".into()] } else { phase_names },
            disk_bytes: traces.iter().map(|t| t.header.disk_bytes).max().unwrap_or(0),
            direct: Vec::new(),
            ops,
            timeline: Timeline { starts_ms, windows_ms },
        })
    }

    pub fn vms(&self) -> usize {
        self.ops.len()
    }

    pub fn total_ops(&self) -> u64 {
        self.ops.iter().flatten().map(|p| p.len() as u64).sum()
    }

    /// Whether `op` is a read or write of an event-log (`direct`) area.
    pub fn is_direct(&self, op: &Op) -> bool {
        matches!(op.kind, GuestOp::Read | GuestOp::Write)
            && self.direct.iter().any(|&(start, end)| op.offset >= start && op.offset + u64::from(op.len) <= end)
    }
}

/// Runs the storm; one result per VM, in VM order. With `record`, each VM's requests are also
/// written to `record/vm-N.trace` as they are issued.
pub fn run(
    plan: &RunPlan,
    config: &StormConfig,
    target: &dyn Target,
    progress: &ProgressBar,
    record: Option<&Path>,
) -> Vec<VmResult> {
    let buckets = (plan.timeline.end_ms() / (config.bucket_s * 1000) + 1) as usize;
    let wall_start = Instant::now();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..plan.vms())
            .map(|vm| {
                let ctx = VmContext { plan, config, target, vm, buckets, wall_start, progress, record };
                scope.spawn(move || run_vm(&ctx))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(vm, h)| h.join().unwrap_or_else(|_| failed(vm, plan, buckets, "VM thread panicked")))
            .collect()
    })
}

struct VmContext<'a> {
    plan: &'a RunPlan,
    config: &'a StormConfig,
    target: &'a dyn Target,
    vm: usize,
    buckets: usize,
    wall_start: Instant,
    progress: &'a ProgressBar,
    record: Option<&'a Path>,
}

fn failed(vm: usize, plan: &RunPlan, buckets: usize, why: &str) -> VmResult {
    VmResult {
        vm,
        phases: vec![VmPhase::default(); plan.phase_names.len()],
        timeline: vec![TierOps::default(); buckets],
        spill_segments_written: 0,
        peak_cache_memory_bytes: 0,
        peak_cache_disk_bytes: 0,
        blocks: BlockTally::default(),
        has_storage: false,
        failure: Some(why.into()),
        boot_began_s: None,
        booted_at_s: None,
        first_answered_s: None,
        boot_read_us: Vec::new(),
    }
}

pub fn progress_bar(total_ops: u64) -> ProgressBar {
    let bar = ProgressBar::new(total_ops);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>18} [{bar:40}] {pos}/{len} requests {per_sec} ETA {eta} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn open_recorder(ctx: &VmContext, dir: &Path) -> Result<TraceWriter, String> {
    let header = TraceHeader {
        disk_bytes: ctx.plan.disk_bytes,
        vm: format!("vm-{}", ctx.vm),
        phases: ctx.plan.phase_names.clone(),
    };
    TraceWriter::create(&dir.join(format!("vm-{}.trace", ctx.vm)), &header).map_err(|e| format!("record: {e}"))
}

/// How one request ended, as the driver needs to know it: done, refused with an errno (counted,
/// the VM goes on), or the connection failed (the VM stops).
pub(crate) enum Outcome {
    Done,
    /// Served by the guest's event-log disk ([`DIRECT`]), not by the write cache.
    Direct,
    Refused {
        errno: u32,
    },
    Failed(String),
}

/// One VM's figures, built as its requests are issued: the guest's side from the requests, the
/// storage side from the engine's counters sampled after each request, so that storage
/// operations are attributed to the phase and moment of the guest request that caused them.
/// The network driver and the in-memory model share it, so their figures mean the same.
pub(crate) struct VmTally {
    pub result: VmResult,
    stats: Option<Arc<VmStats>>,
    last: TierOps,
    bucket_ms: u64,
    last_place: (usize, usize),
    phase_names: Vec<String>,
}

impl VmTally {
    pub fn new(vm: usize, plan: &RunPlan, buckets: usize, bucket_s: u64, stats: Option<Arc<VmStats>>) -> Self {
        let mut result = failed(vm, plan, buckets, "");
        result.failure = None;
        result.has_storage = stats.is_some();
        let last = stats.as_deref().map(storage_tiers).unwrap_or_default();
        let phase_names = plan.phase_names.clone();
        Self { result, stats, last, bucket_ms: bucket_s * 1000, last_place: (0, 0), phase_names }
    }

    /// Counts `op` of phase `p`, issued at `at_ms` of profile time. Returns false when the VM
    /// must stop (its connection failed).
    pub fn issued(&mut self, p: usize, at_ms: u64, op: &Op, outcome: Outcome) -> bool {
        let result = &mut self.result;
        let mut delta = TierOps::default();
        let len = u64::from(op.len);
        match op.kind {
            GuestOp::Read => delta[GUEST] = Ops { reads: 1, read_bytes: len, ..Ops::default() },
            GuestOp::Write | GuestOp::Zero => delta[GUEST] = Ops { writes: 1, write_bytes: len, ..Ops::default() },
            GuestOp::Trim => result.phases[p].trims += 1,
            GuestOp::Flush => result.phases[p].flushes += 1,
        }
        let mut direct = None;
        match outcome {
            Outcome::Direct => direct = Some(delta[GUEST]),
            Outcome::Done => match op.kind {
                GuestOp::Read => result.blocks.guest_read_blocks += len.div_ceil(4096),
                GuestOp::Write => result.blocks.guest_write_blocks += len.div_ceil(4096),
                _ => {}
            },
            Outcome::Refused { errno } => {
                result.phases[p].errors += 1;
                if errno == ENOSPC {
                    result.phases[p].enospc += 1;
                }
            }
            Outcome::Failed(why) => {
                result.failure = Some(format!("phase {}: {why}", self.phase_names[p]));
                return false;
            }
        }
        if let Some(stats) = self.stats.as_deref() {
            let now = storage_tiers(stats);
            set_storage_since(&mut delta, &now, &self.last);
            self.last = now;
        }
        if let Some(ops) = direct {
            delta[DIRECT] = ops;
        }
        add_tiers(&mut result.phases[p].tiers, &delta);
        let buckets = result.timeline.len();
        let bucket = ((at_ms / self.bucket_ms) as usize).min(buckets - 1);
        add_tiers(&mut result.timeline[bucket], &delta);
        self.last_place = (p, bucket);
        true
    }

    /// The engine's own figures, and with `settled` (a flush has waited for the last spill
    /// segment, written in the background) what reached storage since the last request, counted
    /// with it.
    pub fn finish(mut self, settled: bool) -> VmResult {
        if let Some(stats) = self.stats.as_deref() {
            if settled {
                let mut delta = TierOps::default();
                set_storage_since(&mut delta, &storage_tiers(stats), &self.last);
                let (p, bucket) = self.last_place;
                add_tiers(&mut self.result.phases[p].tiers, &delta);
                add_tiers(&mut self.result.timeline[bucket], &delta);
            }
            self.result.spill_segments_written = stats.spill_segments_written.get();
            self.result.peak_cache_memory_bytes = stats.cache_memory_peak_bytes.get();
            self.result.peak_cache_disk_bytes = stats.cache_disk_peak_bytes.get();
            self.result.blocks.engine_side(stats);
        }
        self.result
    }
}

pub(crate) const ENOSPC: u32 = 28;

/// Content that differs per VM and write, cheaply: the request itself.
pub(crate) fn fill_write(buffer: &mut [u8], vm: usize, op: &Op) {
    let stamp = op.offset ^ ((vm as u64) << 48) ^ op.at_ms;
    for (i, chunk) in buffer.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(stamp.wrapping_add(i as u64)).to_le_bytes()[..chunk.len()]);
    }
}

fn run_vm(ctx: &VmContext) -> VmResult {
    let (plan, config, vm, buckets) = (ctx.plan, ctx.config, ctx.vm, ctx.buckets);
    let mut recorder = match ctx.record.map(|dir| open_recorder(ctx, dir)).transpose() {
        Ok(r) => r,
        Err(e) => return failed(vm, plan, buckets, &e),
    };
    let mut client = match Client::connect(&ctx.target.uri(vm)) {
        Ok(c) => c,
        Err(e) => return failed(vm, plan, buckets, &format!("connect: {e}")),
    };
    let mut tally = VmTally::new(vm, plan, buckets, config.bucket_s, ctx.target.stats(vm));
    let event_logs_apart = ctx.target.event_logs_apart();
    let mut buffer = Vec::new();
    let mut unreported = 0u64;
    let since_start = || ctx.wall_start.elapsed().as_secs_f64();
    'phases: for (p, ops) in plan.ops[vm].iter().enumerate() {
        let start_ms = plan.timeline.starts_ms[p][vm];
        if p == 1 {
            tally.result.booted_at_s = Some(since_start());
            ctx.target.booted(vm);
        }
        for op in ops {
            let at_ms = start_ms + op.at_ms;
            if let Some(speed) = config.speed {
                let due = ctx.wall_start + Duration::from_secs_f64(at_ms as f64 / 1000.0 / speed);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
            }
            tally.result.boot_began_s.get_or_insert_with(since_start);
            // The event logs' requests go to a disk of the guest's own under a write cache, not
            // to the server. Never recorded, whichever configuration records (the first, often
            // `shared`, which does send them): the planner replays a trace into write caches.
            let direct = plan.is_direct(op);
            if direct && event_logs_apart {
                if !tally.issued(p, at_ms, op, Outcome::Direct) {
                    break 'phases;
                }
                unreported += 1;
                continue;
            }
            if let Some(w) = recorder.as_mut().filter(|_| !direct) {
                let record = Record {
                    time_us: at_ms * 1000,
                    offset: op.offset,
                    length: op.len,
                    kind: op.kind,
                    flags: 0,
                    phase: p as u16,
                };
                if let Err(e) = w.record(&record) {
                    tally.result.failure = Some(format!("record: {e}"));
                    break 'phases;
                }
            }
            let sent = Instant::now();
            // The first request may wait for a boot slot: not a read's latency.
            let gated = tally.result.first_answered_s.is_none();
            let outcome = match op.kind {
                GuestOp::Read => {
                    buffer.resize(op.len as usize, 0);
                    let read = client.read(op.offset, &mut buffer);
                    if p == 0 && !gated {
                        let us = sent.elapsed().as_micros();
                        tally.result.boot_read_us.push(u32::try_from(us).unwrap_or(u32::MAX));
                    }
                    read
                }
                GuestOp::Write => {
                    buffer.resize(op.len as usize, 0);
                    fill_write(&mut buffer, vm, op);
                    client.write(op.offset, &buffer, false)
                }
                GuestOp::Trim if client.can_trim() => client.trim(op.offset, op.len),
                GuestOp::Zero => client.write_zeroes(op.offset, op.len, false),
                GuestOp::Flush if client.can_flush() => client.flush(),
                GuestOp::Trim | GuestOp::Flush => Ok(()),
            };
            let outcome = match outcome {
                Ok(()) => Outcome::Done,
                Err(e) => match e.errno() {
                    Some(errno) => Outcome::Refused { errno },
                    None => Outcome::Failed(e.to_string()),
                },
            };
            tally.result.first_answered_s.get_or_insert_with(since_start);
            if !tally.issued(p, at_ms, op, outcome) {
                break 'phases;
            }
            unreported += 1;
            if unreported == 512 {
                ctx.progress.inc(unreported);
                unreported = 0;
                // Whichever VM reported last: VMs move through the profile together.
                ctx.progress.set_message(format!(
                    "{} at {:.0} s of profile time",
                    plan.phase_names.get(p).map_or("", String::as_str),
                    at_ms as f64 / 1000.0
                ));
            }
        }
    }
    ctx.progress.inc(unreported);
    if tally.result.booted_at_s.is_none() && tally.result.failure.is_none() {
        // A workload of one phase: the VM booted when it was done.
        tally.result.booted_at_s = Some(since_start());
        ctx.target.booted(vm);
    }
    if let Some(w) = recorder {
        if let Err(e) = w.finish() {
            tally.result.failure.get_or_insert(format!("record: {e}"));
        }
    }
    // The VM's last spill segment may still be on its way to disk; a flush waits for it, so
    // that it is counted with the last request.
    let settled = tally.result.failure.is_none() && tally.result.has_storage && client.flush().is_ok();
    let result = tally.finish(settled);
    if result.failure.is_none() {
        let _ = client.disconnect();
    }
    result
}
