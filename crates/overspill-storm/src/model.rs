//! The storm without sockets: every VM's requests go straight into an engine [`Overlay`] (the
//! code `serve` runs), with spill and cache files in memory and a golden image of zeroes, one
//! request at a time in profile-time order. Deterministic, so the planner and the calibration
//! tests get the same figures from the same requests on any machine, and the same accounting as
//! the network driver ([`crate::driver`]), which the live-storm tests hold it to.

use std::sync::Arc;

use overspill_engine::golden::ZeroImage;
use overspill_engine::read_cache::DEFAULT_CHUNK_BYTES;
use overspill_engine::store::MemFile;
use overspill_engine::{
    CachedImage, EngineError, GoldenImage, HostMemory, Overlay, OverlayConfig, VmStats, WriteCacheMode,
};

use crate::driver::{fill_write, Outcome, RunPlan, VmResult, VmTally};
use crate::profile::Op;
use overspill_block::GuestOp;

/// One configuration to model: what `serve` would be started with.
#[derive(Debug, Clone, Copy)]
pub struct ModelConfig {
    pub mode: WriteCacheMode,
    pub ram_bytes: u64,
    /// The shared read cache in front of the golden image; 0 for none.
    pub read_cache_bytes: u64,
    /// Width of the IOPS-over-time buckets, in profile seconds.
    pub bucket_s: u64,
}

/// Runs `plan` through fresh overlays; one result per VM, in VM order, as [`crate::driver::run`]
/// gives them.
pub fn simulate(plan: &RunPlan, config: &ModelConfig) -> Result<Vec<VmResult>, EngineError> {
    simulate_observed(plan, config, |_, _, _, _| {})
}

/// [`simulate`], calling `observe(vm, phase, op, stats)` after each request with the VM's
/// counters as they stand then: what each request cost the storage is the change since the VM's
/// request before.
pub fn simulate_observed(
    plan: &RunPlan,
    config: &ModelConfig,
    observe: impl FnMut(usize, usize, &Op, &VmStats),
) -> Result<Vec<VmResult>, EngineError> {
    let zero: Arc<dyn GoldenImage> = Arc::new(ZeroImage { size: plan.disk_bytes });
    let golden: Arc<dyn GoldenImage> = if config.read_cache_bytes > 0 {
        Arc::new(CachedImage::new(zero, config.read_cache_bytes, DEFAULT_CHUNK_BYTES))
    } else {
        zero
    };
    simulate_on(plan, config, golden, observe)
}

/// [`simulate_observed`] over a golden image of the caller's (`config.read_cache_bytes` is not
/// looked at: put a cache in `golden` to have one).
pub fn simulate_on(
    plan: &RunPlan,
    config: &ModelConfig,
    golden: Arc<dyn GoldenImage>,
    mut observe: impl FnMut(usize, usize, &Op, &VmStats),
) -> Result<Vec<VmResult>, EngineError> {
    // No free-memory floor, as in the storm: the figures must not depend on this host.
    let host = HostMemory::new(u64::MAX, 0);
    let buckets = (plan.timeline.end_ms() / (config.bucket_s * 1000) + 1) as usize;
    let mut vms = Vec::with_capacity(plan.vms());
    let mut all_stats = Vec::with_capacity(plan.vms());
    for vm in 0..plan.vms() {
        let stats = Arc::new(VmStats::default());
        all_stats.push(stats.clone());
        let backing = config.mode.backing_file().map(|_| Box::new(MemFile::default()) as _);
        let overlay_config =
            OverlayConfig { mode: config.mode, ram_target_bytes: config.ram_bytes, spill_max_bytes: None };
        let overlay = Overlay::new(golden.clone(), overlay_config, backing, host.clone(), stats.clone())?;
        vms.push((overlay, VmTally::new(vm, plan, buckets, config.bucket_s, Some(stats))));
    }
    // All VMs' requests in profile-time order, as they would reach a shared read cache.
    let mut order: Vec<(u64, usize, usize, usize)> = Vec::with_capacity(plan.total_ops() as usize);
    for (vm, phases) in plan.ops.iter().enumerate() {
        for (p, ops) in phases.iter().enumerate() {
            let start_ms = plan.timeline.starts_ms[p][vm];
            order.extend(ops.iter().enumerate().map(|(i, op)| (start_ms + op.at_ms, vm, p, i)));
        }
    }
    order.sort_unstable();
    let largest = plan.ops.iter().flatten().flatten().map(|op| op.len).max().unwrap_or(0);
    let mut buffer = vec![0u8; largest as usize];
    let event_logs_apart = config.mode != WriteCacheMode::Shared;
    for (at_ms, vm, p, i) in order {
        let op = &plan.ops[vm][p][i];
        let (overlay, tally) = &mut vms[vm];
        if event_logs_apart && plan.is_direct(op) {
            tally.issued(p, at_ms, op, Outcome::Direct);
            observe(vm, p, op, &all_stats[vm]);
            continue;
        }
        let len = op.len as usize;
        let outcome = match op.kind {
            GuestOp::Read => overlay.read(op.offset, &mut buffer[..len]),
            GuestOp::Write => {
                fill_write(&mut buffer[..len], vm, op);
                overlay.write(op.offset, &buffer[..len])
            }
            GuestOp::Trim => overlay.trim(op.offset, u64::from(op.len)),
            GuestOp::Zero => overlay.write_zeroes(op.offset, u64::from(op.len)),
            GuestOp::Flush => overlay.flush(),
        };
        let outcome = match outcome {
            Ok(()) => Outcome::Done,
            Err(EngineError::NoSpace(_)) => Outcome::Refused { errno: crate::driver::ENOSPC },
            // What the server would answer: the VM goes on, as it would over NBD.
            Err(EngineError::OutOfRange { .. }) => Outcome::Refused { errno: EINVAL },
            Err(_) => Outcome::Refused { errno: EIO },
        };
        tally.issued(p, at_ms, op, outcome);
        observe(vm, p, op, &all_stats[vm]);
    }
    Ok(vms
        .into_iter()
        .map(|(mut overlay, tally)| {
            let settled = tally.result.failure.is_none() && overlay.flush().is_ok();
            tally.finish(settled)
        })
        .collect())
}

const EIO: u32 = 5;
const EINVAL: u32 = 22;
