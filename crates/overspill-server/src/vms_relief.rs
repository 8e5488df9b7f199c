//! The background pass that has VMs and read caches give memory back without a write to make
//! them (the policy is `overspill_engine::relief`): the golden images' read caches, then quiet
//! VMs and those in their reconnect grace, for VMs held below their targets; and any VM above
//! a target cut by host pressure.

use std::collections::HashSet;
use std::sync::Arc;

use overspill_engine::budget::{HELD_BY_BUDGET, HELD_BY_CUT};
use overspill_engine::relief::{self, CacheMemory, GiveBack, QuietWatch, VmMemory};
use overspill_engine::{CachedImage, HostMemory, Overlay, VmStats, SEGMENT_BYTES};

use super::{lock, VmRegistry};
use crate::live::{Gate, Live};

/// What an in-grace VM gives back per hold of the registry's lock: a few segments sealed, so
/// that connections, first writes and a move's switchover, which take that lock, do not wait
/// for many.
const GRACE_CHUNK_BYTES: u64 = 4 * SEGMENT_BYTES as u64;

/// What an in-grace VM may give back in one hold of the registry's lock now: its segment
/// writes may wait there for the host's spill budget (`--spill-limit-bandwidth`), so while the
/// budget owes none goes, and then one segment at a time (a few segments' wait under the lock
/// held every reconnecting VM's claim and first write for seconds). `None`: not now.
fn grace_chunk_bytes(limits: &crate::vm_limits::VmLimits) -> Option<u64> {
    if !limits.spill_paced() {
        return Some(GRACE_CHUNK_BYTES);
    }
    let budget = limits.host_budget(crate::vm_limits::HostBudget::Spill);
    budget.owed().is_zero().then_some(SEGMENT_BYTES as u64)
}

/// The requests a VM has made so far: quiet is a VM whose count stands still.
fn requests(stats: &VmStats) -> u64 {
    [&stats.guest_read, &stats.guest_write, &stats.guest_zero, &stats.guest_trim, &stats.guest_flush]
        .iter()
        .map(|counter| counter.ops.get())
        .sum()
}

fn seen(id: u64, overlay: &Overlay, quiet: bool) -> VmMemory {
    VmMemory {
        id,
        accounted_bytes: overlay.memory_accounted_bytes(),
        target_bytes: overlay.memory_target_bytes(),
        own_target_bytes: overlay.memory_own_target_bytes(),
        quiet,
        can_spill: overlay.can_spill(),
    }
}

/// Whether a connected VM is moving to or from a peer: the move owns where its blocks are.
fn moving(live: &Live) -> bool {
    let state = live.state();
    state.outgoing || state.gate == Gate::Incoming
}

impl VmRegistry {
    /// One pass of giving memory back; `watch` carries what earlier passes saw of each VM's
    /// requests; `read_caches` are the golden images' read caches within `host`'s budget.
    /// Returns the bytes given back (also counted by `host`).
    ///
    /// A connected VM's overlay is locked only when free and never under the registry's lock
    /// (a request path takes that lock while holding the overlay's): a VM busy with a request
    /// is not quiet, and gives back as it writes. A VM moving to or from a peer is left alone:
    /// the move owns where its blocks are. One in its grace is worked on under the registry's
    /// lock, a few segments at a time (see [`grace_chunk_bytes`]).
    pub fn give_back_memory(&self, host: &HostMemory, watch: &mut QuietWatch, read_caches: &[Arc<CachedImage>]) -> u64 {
        let held = host.take_held();
        let deficit = host.free_deficit_bytes();
        let calm = watch.calm(held != 0 || deficit > 0);
        let caches: Vec<CacheMemory> = read_caches
            .iter()
            .enumerate()
            .map(|(id, cache)| CacheMemory { id: id as u64, held_bytes: cache.held_bytes() })
            .collect();
        let for_budget = if held & HELD_BY_BUDGET != 0 { relief::CACHE_STEP_BYTES } else { 0 };
        let (cache_plan, unmet) =
            relief::plan_read_caches(&caches, host.read_cache_floor_bytes(), deficit.saturating_add(for_budget));
        // Quiet VMs give for VMs whose target was cut (which the caches' memory does not lift),
        // and for what the caches could not give.
        let quiet_bytes = if held & HELD_BY_CUT != 0 || (held != 0 && unmet > 0) { relief::STEP_BYTES } else { 0 };
        let mut given = 0;
        for GiveBack { id, limit_bytes } in cache_plan {
            let cache = &read_caches[id as usize];
            given += cache.give_back(cache.held_bytes().saturating_sub(limit_bytes));
        }
        if calm {
            for cache in read_caches.iter().filter(|cache| cache.shrunk()) {
                cache.grow_back(relief::STEP_BYTES);
            }
        }
        let mut connected: Vec<(u64, Arc<Live>, bool)> = Vec::new();
        let mut in_grace = Vec::new();
        {
            let inner = lock(&self.inner);
            let numbers: HashSet<u64> = inner.vms.keys().copied().collect();
            for (&number, entry) in &inner.vms {
                let quiet = watch.observe(number, requests(&entry.handle.stats));
                if entry.moving.is_some() {
                    continue;
                }
                if let Some(grace) = &entry.grace {
                    in_grace.push(seen(number, &grace.parked.overlay, true));
                } else if let Some(live) = entry.live.as_ref().and_then(std::sync::Weak::upgrade) {
                    connected.push((number, live, quiet));
                }
            }
            watch.keep_only(&numbers);
        }
        // In-grace VMs that cannot give now (the spill budget owes) are left out of the plan, so
        // that quiet connected VMs are asked instead.
        let mut vms = if grace_chunk_bytes(&self.limits).is_some() { in_grace } else { Vec::new() };
        for (number, live, quiet) in &connected {
            // Checked before the overlay's lock is tried, not under it: the pass never holds two
            // locks at once. A move that begins in between finds blocks moved within the
            // overlay, which it copies as they are.
            if moving(live) {
                continue;
            }
            if let Ok(vm) = live.vm.try_lock() {
                vms.extend(vm.as_ref().map(|vm| seen(*number, &vm.overlay, *quiet)));
            }
        }
        for GiveBack { id, limit_bytes } in relief::plan(&vms, quiet_bytes > 0, relief::STEP_BYTES, quiet_bytes) {
            match connected.iter().find(|(number, ..)| *number == id) {
                Some((_, live, _)) => {
                    if let Ok(mut vm) = live.vm.try_lock() {
                        given += vm.as_mut().map_or(0, |vm| vm.overlay.give_back_memory(limit_bytes));
                    }
                }
                None => {
                    while let Some(chunk) = grace_chunk_bytes(&self.limits) {
                        let mut inner = lock(&self.inner);
                        let Some(entry) = inner.vms.get_mut(&id).filter(|entry| entry.moving.is_none()) else { break };
                        let Some(grace) = entry.grace.as_mut() else { break };
                        let overlay = &mut grace.parked.overlay;
                        let held = overlay.memory_accounted_bytes();
                        if held <= limit_bytes {
                            break;
                        }
                        let freed = overlay.give_back_memory(limit_bytes.max(held.saturating_sub(chunk)));
                        given += freed;
                        if freed == 0 {
                            break;
                        }
                    }
                }
            }
        }
        if given > 0 {
            host.note_given_back(given);
            tracing::debug!(given, held, deficit, "VMs and read caches gave memory back");
        }
        given
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm_limits::{HostBudget, VmLimits};
    use overspill_block::limit::SystemClock;
    use overspill_block::{Limiter, Limits, Rate};

    /// Under a spill budget an in-grace VM gives back one segment per hold of the registry's
    /// lock, and none while the budget owes (its writes would wait under the lock).
    #[test]
    fn an_in_grace_vm_gives_back_under_the_lock_only_what_the_spill_budget_lets_go_at_once() {
        let limits = VmLimits::default();
        assert_eq!(grace_chunk_bytes(&limits), Some(GRACE_CHUNK_BYTES), "no budget: a few segments");
        let budget = Limiter::new(Limits::default(), SystemClock::shared());
        limits.use_spill_budget(budget.clone());
        assert_eq!(grace_chunk_bytes(&limits), Some(SEGMENT_BYTES as u64), "paced, owing nothing: one segment");
        let rate = Rate { per_second: 1 << 20, burst: 1 << 20 };
        limits.set_host(HostBudget::Spill, None, Some(Some(rate)));
        overspill_block::limit::reserve(&[budget], 0, 8 << 20);
        assert_eq!(grace_chunk_bytes(&limits), None, "the budget owes seconds: not now");
    }
}
