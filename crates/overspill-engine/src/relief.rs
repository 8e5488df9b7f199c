//! Memory given back when no write would make it happen.
//!
//! A VM gives RAM back on its own only as it writes (its target is enforced before each
//! change). A quiet VM, or one waiting in its reconnect grace, would keep its whole RAM tier
//! while busy neighbours spill, and would not heed a target cut by host pressure. A background
//! pass, once a second, plans what each VM should give back and has its overlay do it
//! ([`crate::Overlay::give_back_memory`]):
//! - every VM holding more than its target now (cut by the free floor, the host cap or the
//!   memory directory's room) comes down towards it;
//! - when a VM was refused RAM within its own target because all VMs together were at the cap
//!   ([`crate::HostMemory::take_held`]), the quiet VMs that can spill (largest first) give back
//!   what the held ones may then take: the seeds' cache is worth having because it uses memory
//!   that would otherwise sit idle, and a quiet VM's RAM is that memory.
//!
//! Each pass moves at most [`STEP_BYTES`] per VM towards its target and [`STEP_BYTES`] in all
//! from quiet VMs, so one pass holds a VM's lock for a bounded time and the spill disks see
//! writes at a bounded rate; pressure that lasts is relieved over several passes. The policy
//! is a pure function of what the pass observed, so the simulation drives it like `serve`.

use std::cmp::Reverse;
use std::collections::HashMap;

/// The most a pass takes from one VM towards its target, and from quiet VMs in all for held
/// ones: 32 spill segments, a fraction of a second of a local disk's sequential writes.
pub const STEP_BYTES: u64 = 64 << 20;

/// Passes (seconds in `serve`) without a write or zeroing after which a VM counts as quiet: as
/// long as the NBD frontend waits before calling a connection idle, far longer than a pause in
/// a guest's burst.
pub const QUIET_PASSES: u32 = 10;

/// What a pass sees of one VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmMemory {
    pub id: u64,
    /// What the host's budget counts for it ([`crate::Overlay::memory_accounted_bytes`]).
    pub accounted_bytes: u64,
    /// Its target now in force ([`crate::Overlay::memory_target_bytes`]).
    pub target_bytes: u64,
    /// Quiet for [`QUIET_PASSES`], or waiting in its reconnect grace.
    pub quiet: bool,
    /// It has a spill log to move RAM to ([`crate::Overlay::can_spill`]).
    pub can_spill: bool,
}

/// A VM to give memory back down to `limit_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiveBack {
    pub id: u64,
    pub limit_bytes: u64,
}

/// What each VM gives back this pass; `held`: some VM was refused RAM within its own target
/// since the last pass. VMs not listed keep what they hold.
pub fn plan(vms: &[VmMemory], held: bool, step_bytes: u64) -> Vec<GiveBack> {
    let mut limits: Vec<u64> = vms
        .iter()
        .map(|vm| match vm.accounted_bytes.checked_sub(vm.target_bytes) {
            Some(over) if over > 0 => vm.accounted_bytes - over.min(step_bytes),
            _ => vm.accounted_bytes,
        })
        .collect();
    if held {
        let mut quiet: Vec<usize> = (0..vms.len()).filter(|&i| vms[i].quiet && vms[i].can_spill).collect();
        quiet.sort_by_key(|&i| (Reverse(limits[i]), vms[i].id));
        let mut left = step_bytes;
        for i in quiet {
            let take = limits[i].min(left);
            limits[i] -= take;
            left -= take;
        }
    }
    vms.iter()
        .zip(limits)
        .filter(|(vm, limit)| *limit < vm.accounted_bytes)
        .map(|(vm, limit_bytes)| GiveBack { id: vm.id, limit_bytes })
        .collect()
}

/// Which VMs have changed nothing for [`QUIET_PASSES`] passes, from a count of their changes
/// (writes and zeroings) seen at each pass.
#[derive(Debug, Default)]
pub struct QuietWatch {
    seen: HashMap<u64, (u64, u32)>,
}

impl QuietWatch {
    /// Notes VM `id`'s count of changes at this pass; whether it has been quiet long enough.
    pub fn observe(&mut self, id: u64, changes: u64) -> bool {
        let (last, unchanged) = self.seen.entry(id).or_insert((changes, 0));
        if *last == changes {
            *unchanged = unchanged.saturating_add(1);
        } else {
            (*last, *unchanged) = (changes, 0);
        }
        *unchanged >= QUIET_PASSES
    }

    /// Forgets the VMs this pass did not see (gone, or numbered anew).
    pub fn keep_only(&mut self, seen: &[u64]) {
        self.seen.retain(|id, _| seen.contains(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn vm(id: u64, accounted_mib: u64, target_mib: u64, quiet: bool) -> VmMemory {
        VmMemory { id, accounted_bytes: accounted_mib * MIB, target_bytes: target_mib * MIB, quiet, can_spill: true }
    }

    #[test]
    fn a_vm_over_its_target_comes_down_a_step_at_a_time() {
        let vms = [vm(1, 300, 100, false), vm(2, 150, 100, true), vm(3, 50, 100, true)];
        assert_eq!(
            plan(&vms, false, 64 * MIB),
            vec![GiveBack { id: 1, limit_bytes: 236 * MIB }, GiveBack { id: 2, limit_bytes: 100 * MIB }],
            "busy or quiet, over the target: towards it; under it: nothing"
        );
    }

    #[test]
    fn a_held_vm_gets_what_quiet_ones_hold_largest_first() {
        let vms = [vm(1, 40, 256, true), vm(2, 10, 256, false), vm(3, 100, 256, true), vm(4, 30, 256, true)];
        assert_eq!(plan(&vms, false, 64 * MIB), vec![], "no one held: no one gives back");
        assert_eq!(
            plan(&vms, true, 64 * MIB),
            vec![GiveBack { id: 3, limit_bytes: 36 * MIB }],
            "the largest quiet VM gives the whole step"
        );
        assert_eq!(
            plan(&vms, true, 120 * MIB),
            vec![GiveBack { id: 1, limit_bytes: 20 * MIB }, GiveBack { id: 3, limit_bytes: 0 }],
            "then the next largest; the busy one (2) is never asked"
        );
    }

    #[test]
    fn vms_without_a_spill_log_are_not_asked_for_held_ones() {
        let mut ram_only = vm(1, 100, 256, true);
        ram_only.can_spill = false;
        let vms = [ram_only, vm(2, 20, 256, true)];
        assert_eq!(plan(&vms, true, 64 * MIB), vec![GiveBack { id: 2, limit_bytes: 0 }]);
    }

    #[test]
    fn a_vm_is_quiet_after_passes_without_a_change() {
        let mut watch = QuietWatch::default();
        for pass in 1..QUIET_PASSES {
            assert!(!watch.observe(7, 5), "pass {pass}");
        }
        assert!(watch.observe(7, 5));
        assert!(!watch.observe(7, 6), "a write ends it");
        watch.keep_only(&[]);
        for _ in 1..QUIET_PASSES {
            assert!(!watch.observe(7, 6), "forgotten: counted afresh");
        }
        assert!(watch.observe(7, 6));
    }
}
