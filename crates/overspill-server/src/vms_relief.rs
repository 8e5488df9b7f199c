//! The background pass that has VMs give memory back without a write of theirs to make them
//! (the policy is `overspill_engine::relief`): quiet VMs and those in their reconnect grace
//! for VMs held below their targets, and any VM above a target cut by host pressure.

use std::sync::Arc;

use overspill_engine::relief::{self, GiveBack, QuietWatch, VmMemory};
use overspill_engine::{HostMemory, Overlay, VmStats};

use super::{lock, VmRegistry};
use crate::live::Live;

/// What a VM has changed so far: quiet is a VM whose count stands still.
fn changes(stats: &VmStats) -> u64 {
    stats.guest_write.ops.get() + stats.guest_zero.ops.get()
}

fn seen(id: u64, overlay: &Overlay, quiet: bool) -> VmMemory {
    VmMemory {
        id,
        accounted_bytes: overlay.memory_accounted_bytes(),
        target_bytes: overlay.memory_target_bytes(),
        quiet,
        can_spill: overlay.can_spill(),
    }
}

impl VmRegistry {
    /// One pass of giving memory back; `watch` carries what earlier passes saw of each VM's
    /// writes. Returns the bytes given back (also counted by `host`).
    ///
    /// A connected VM's overlay is locked only when free and never under the registry's lock
    /// (a request path takes that lock while holding the overlay's): a VM busy with a request
    /// is not quiet, and gives back as it writes. A VM moving to or from a peer is left alone:
    /// the move owns where its blocks are. One in its grace is worked on under the registry's
    /// lock, for at most a step's worth of blocks.
    pub fn give_back_memory(&self, host: &HostMemory, watch: &mut QuietWatch) -> u64 {
        let held = host.take_held();
        let mut connected: Vec<(u64, Arc<Live>, bool)> = Vec::new();
        let mut in_grace = Vec::new();
        {
            let inner = lock(&self.inner);
            let numbers: Vec<u64> = inner.vms.keys().copied().collect();
            for (&number, entry) in &inner.vms {
                let quiet = watch.observe(number, changes(&entry.handle.stats));
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
        let mut vms = in_grace;
        for (number, live, quiet) in &connected {
            if let Ok(vm) = live.vm.try_lock() {
                vms.extend(vm.as_ref().map(|vm| seen(*number, &vm.overlay, *quiet)));
            }
        }
        let mut given = 0;
        for GiveBack { id, limit_bytes } in relief::plan(&vms, held, relief::STEP_BYTES) {
            match connected.iter().find(|(number, ..)| *number == id) {
                Some((_, live, _)) => {
                    if let Ok(mut vm) = live.vm.try_lock() {
                        given += vm.as_mut().map_or(0, |vm| vm.overlay.give_back_memory(limit_bytes));
                    }
                }
                None => {
                    let mut inner = lock(&self.inner);
                    if let Some(grace) = inner.vms.get_mut(&id).and_then(|entry| entry.grace.as_mut()) {
                        given += grace.parked.overlay.give_back_memory(limit_bytes);
                    }
                }
            }
        }
        if given > 0 {
            host.note_given_back(given);
            tracing::debug!(given, held, "VMs gave memory back");
        }
        given
    }
}
