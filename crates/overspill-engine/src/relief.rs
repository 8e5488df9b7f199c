//! Memory given back when no write would make it happen.
//!
//! A VM gives RAM back on its own only as it writes (its target is enforced before each
//! change). A quiet VM, or one waiting in its reconnect grace, would keep its whole RAM tier
//! while busy neighbours spill, and would not heed a target cut by host pressure. A background
//! pass, once a second, plans what each VM should give back and has its overlay do it
//! ([`crate::Overlay::give_back_memory`]):
//! - every VM holding more than its target now, where that target was cut below the VM's own
//!   (by the free floor, the host cap or the memory directory's room), comes down towards it (a
//!   VM at its own target holds a little more, the free pages it keeps for its next writes: it
//!   is left alone);
//! - when free memory is below the floor, or a VM was refused RAM within its own target because
//!   VMs and read caches together were at `--ram-total` ([`crate::HostMemory::take_held`],
//!   `HELD_BY_BUDGET`), the golden images' read caches give back first, all that is needed at
//!   once (they write nothing), down to their floor, largest first: they are copies of what the
//!   golden image holds, refetched at a cost, where a VM's RAM is the only fast copy of its
//!   writes;
//! - when what the caches gave was not enough, or a VM was held by its target cut (to a fair
//!   share, by the floor or the memory directory's room: `HELD_BY_CUT`, which the caches do not
//!   relieve), the quiet VMs that can spill (largest first) give back
//!   what the held ones may then take, down to [`SPILLING_MINIMUM_BYTES`]: the seeds' cache is
//!   worth having because it uses memory that would otherwise sit idle, and a quiet VM's RAM is
//!   that memory.
//!
//! - read caches that gave back grow back (a step a pass, as far as they were configured) once
//!   no VM has been held (nor free memory below the floor) for [`QUIET_PASSES`] passes, and
//!   then only into room the VMs leave.
//!
//! Each pass moves at most [`STEP_BYTES`] per VM towards its target and [`STEP_BYTES`] in all
//! from quiet VMs, so one pass holds a VM's lock for a bounded time and the spill disks see
//! writes at a bounded rate; pressure that lasts is relieved over several passes. For VMs held
//! by the budget the read caches give [`CACHE_STEP_BYTES`] a pass. The policy is a pure function of what the pass observed, so the simulation drives
//! it like `serve`.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};

use crate::units::SEGMENT_BYTES;

/// The most a pass takes from one VM towards its target, and from quiet VMs in all for held
/// ones: 32 spill segments, a fraction of a second of a local disk's sequential writes.
pub const STEP_BYTES: u64 = 64 << 20;

/// What the read caches give a pass for VMs held by the budget: more than a quiet VM's step, as
/// they write nothing to give it.
pub const CACHE_STEP_BYTES: u64 = 256 << 20;

/// What a spilling VM holds at the least once its RAM tier is in its log: its open segment and
/// an index. Asking a VM holding less to give back would open a segment and count more.
pub const SPILLING_MINIMUM_BYTES: u64 = SEGMENT_BYTES as u64 + SEGMENT_BYTES as u64 / 8;

/// Passes (seconds in `serve`) without a request after which a VM counts as quiet: as
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
    /// Its own target, before any cut ([`crate::Overlay::memory_own_target_bytes`]).
    pub own_target_bytes: u64,
    /// Quiet for [`QUIET_PASSES`], or waiting in its reconnect grace.
    pub quiet: bool,
    /// It has a spill log to move RAM to ([`crate::Overlay::can_spill`]).
    pub can_spill: bool,
}

/// A VM (or read cache) to give memory back down to `limit_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiveBack {
    pub id: u64,
    pub limit_bytes: u64,
}

/// What a pass sees of one read cache: its id and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheMemory {
    pub id: u64,
    pub held_bytes: u64,
}

/// What each read cache gives back this pass towards `need_bytes` (free memory below the floor,
/// and a step for VMs held by the budget), largest first, keeping `floor_bytes` together; and
/// what of the need they could not meet. Caches give back without writing anything, so the
/// need is met at once rather than a step a pass.
pub fn plan_read_caches(caches: &[CacheMemory], floor_bytes: u64, need_bytes: u64) -> (Vec<GiveBack>, u64) {
    let total: u64 = caches.iter().map(|cache| cache.held_bytes).sum();
    let mut left = need_bytes.min(total.saturating_sub(floor_bytes));
    let unused = need_bytes - left;
    let mut order: Vec<&CacheMemory> = caches.iter().collect();
    order.sort_by_key(|cache| (Reverse(cache.held_bytes), cache.id));
    let mut given = Vec::new();
    for cache in order {
        let take = cache.held_bytes.min(left);
        if take > 0 {
            given.push(GiveBack { id: cache.id, limit_bytes: cache.held_bytes - take });
            left -= take;
        }
    }
    (given, unused + left)
}

/// What each VM gives back this pass; `held`: some VM was refused RAM within its own target
/// since the last pass; `step_bytes`: the most a VM comes down towards a cut target;
/// `quiet_bytes`: what quiet VMs give in all for held ones (what the read caches left of the
/// step). VMs not listed keep what they hold.
pub fn plan(vms: &[VmMemory], held: bool, step_bytes: u64, quiet_bytes: u64) -> Vec<GiveBack> {
    let mut limits: Vec<u64> = vms
        .iter()
        .map(|vm| match vm.accounted_bytes.checked_sub(vm.target_bytes) {
            Some(over) if over > 0 && vm.target_bytes < vm.own_target_bytes => {
                vm.accounted_bytes - over.min(step_bytes)
            }
            _ => vm.accounted_bytes,
        })
        .collect();
    if held {
        let mut quiet: Vec<usize> = (0..vms.len()).filter(|&i| vms[i].quiet && vms[i].can_spill).collect();
        quiet.sort_by_key(|&i| (Reverse(limits[i]), vms[i].id));
        let mut left = quiet_bytes;
        for i in quiet {
            let take = limits[i].saturating_sub(SPILLING_MINIMUM_BYTES).min(left);
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

/// Which VMs have asked nothing for [`QUIET_PASSES`] passes, from a count of their requests
/// seen at each pass (a VM reading its RAM tier is using it: it is not quiet); and whether the
/// host has been calm (no VM held) as long.
#[derive(Debug, Default)]
pub struct QuietWatch {
    seen: HashMap<u64, (u64, u32)>,
    calm_passes: u32,
}

impl QuietWatch {
    /// Notes whether a VM was held since the last pass; whether none has been for
    /// [`QUIET_PASSES`] passes (read caches may grow back).
    pub fn calm(&mut self, held: bool) -> bool {
        self.calm_passes = if held { 0 } else { self.calm_passes.saturating_add(1) };
        self.calm_passes >= QUIET_PASSES
    }

    /// Notes VM `id`'s count of requests at this pass; whether it has been quiet long enough
    /// (a VM first seen now has not been seen quiet yet).
    pub fn observe(&mut self, id: u64, requests: u64) -> bool {
        match self.seen.get_mut(&id) {
            Some((last, unchanged)) if *last == requests => *unchanged = unchanged.saturating_add(1),
            Some(seen) => *seen = (requests, 0),
            None => {
                self.seen.insert(id, (requests, 0));
            }
        }
        self.seen.get(&id).is_some_and(|(_, unchanged)| *unchanged >= QUIET_PASSES)
    }

    /// Forgets the VMs this pass did not see (gone, or numbered anew).
    pub fn keep_only(&mut self, seen: &HashSet<u64>) {
        self.seen.retain(|id, _| seen.contains(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A VM of 256 MiB's own target.
    fn vm(id: u64, accounted_mib: u64, target_mib: u64, quiet: bool) -> VmMemory {
        VmMemory {
            id,
            accounted_bytes: accounted_mib * MIB,
            target_bytes: target_mib * MIB,
            own_target_bytes: 256 * MIB,
            quiet,
            can_spill: true,
        }
    }

    #[test]
    fn a_vm_over_its_cut_target_comes_down_a_step_at_a_time() {
        let vms = [vm(1, 300, 100, false), vm(2, 150, 100, true), vm(3, 50, 100, true)];
        assert_eq!(
            plan(&vms, false, 64 * MIB, 64 * MIB),
            vec![GiveBack { id: 1, limit_bytes: 236 * MIB }, GiveBack { id: 2, limit_bytes: 100 * MIB }],
            "busy or quiet, over the target: towards it; under it: nothing"
        );
        let warm = [vm(4, 258, 256, false)];
        assert_eq!(plan(&warm, false, 64 * MIB, 64 * MIB), vec![], "over its own target by its warm pages: left alone");
    }

    #[test]
    fn a_held_vm_gets_what_quiet_ones_hold_largest_first() {
        let vms = [vm(1, 40, 256, true), vm(2, 10, 256, false), vm(3, 100, 256, true), vm(4, 30, 256, true)];
        assert_eq!(plan(&vms, false, 64 * MIB, 64 * MIB), vec![], "no one held: no one gives back");
        assert_eq!(
            plan(&vms, true, 64 * MIB, 64 * MIB),
            vec![GiveBack { id: 3, limit_bytes: 36 * MIB }],
            "the largest quiet VM gives the whole step"
        );
        let least = SPILLING_MINIMUM_BYTES;
        assert_eq!(
            plan(&vms, true, 120 * MIB, 120 * MIB),
            vec![GiveBack { id: 1, limit_bytes: 40 * MIB - (120 * MIB - (100 * MIB - least)) }, GiveBack { id: 3, limit_bytes: least }],
            "then the next largest, each down to what a spilling VM holds at the least; the busy one (2) is never asked"
        );
        assert_eq!(
            plan(&[vm(5, 2, 256, true)], true, 64 * MIB, 64 * MIB),
            vec![],
            "a VM holding less than that is not asked"
        );
    }

    #[test]
    fn read_caches_give_back_first_down_to_their_floor() {
        let caches = [CacheMemory { id: 1, held_bytes: 100 * MIB }, CacheMemory { id: 2, held_bytes: 30 * MIB }];
        assert_eq!(plan_read_caches(&caches, 0, 0), (vec![], 0), "no need");
        assert_eq!(
            plan_read_caches(&caches, 0, 64 * MIB),
            (vec![GiveBack { id: 1, limit_bytes: 36 * MIB }], 0),
            "the largest gives all that is needed: nothing unmet"
        );
        assert_eq!(
            plan_read_caches(&caches, 110 * MIB, 64 * MIB),
            (vec![GiveBack { id: 1, limit_bytes: 80 * MIB }], 44 * MIB),
            "20 MiB over the floor: the rest is unmet, for the quiet VMs"
        );
        assert_eq!(
            plan_read_caches(&caches, 0, 120 * MIB),
            (vec![GiveBack { id: 1, limit_bytes: 0 }, GiveBack { id: 2, limit_bytes: 10 * MIB }], 0)
        );
    }

    #[test]
    fn the_host_is_calm_after_passes_without_a_vm_held() {
        let mut watch = QuietWatch::default();
        for pass in 1..QUIET_PASSES {
            assert!(!watch.calm(false), "pass {pass}");
        }
        assert!(watch.calm(false));
        assert!(!watch.calm(true), "a VM held ends it");
        assert!(!watch.calm(false));
    }

    #[test]
    fn vms_without_a_spill_log_are_not_asked_for_held_ones() {
        let mut ram_only = vm(1, 100, 256, true);
        ram_only.can_spill = false;
        let vms = [ram_only, vm(2, 20, 256, true)];
        assert_eq!(plan(&vms, true, 64 * MIB, 64 * MIB), vec![GiveBack { id: 2, limit_bytes: SPILLING_MINIMUM_BYTES }]);
    }

    #[test]
    fn a_vm_is_quiet_after_passes_without_a_change() {
        let mut watch = QuietWatch::default();
        // First seen, then QUIET_PASSES passes seen unchanged.
        for pass in 0..QUIET_PASSES {
            assert!(!watch.observe(7, 5), "pass {pass}");
        }
        assert!(watch.observe(7, 5));
        assert!(!watch.observe(7, 6), "a request ends it");
        watch.keep_only(&HashSet::new());
        for _ in 0..QUIET_PASSES {
            assert!(!watch.observe(7, 6), "forgotten: counted afresh");
        }
        assert!(watch.observe(7, 6));
    }
}
