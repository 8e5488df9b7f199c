//! Host-wide memory budget shared by every overlay.
//!
//! Three limits bound a VM's cache memory (RAM tier, open spill segment and index):
//! - its own target (`--ram`);
//! - the host cap (`--ram-total`): a VM may not grow while all VMs together are at the cap, and
//!   once they are over it every VM's target is cut to its fair share;
//! - the free floor: the seeds' cache "only uses memory if it is free". A sampler outside the
//!   engine reads the host's available memory and calls [`HostMemory::rebalance`]; below the
//!   floor, per-VM caps shrink by the deficit so overlays spill until the floor holds again, and
//!   above it they grow back by the surplus (gradually, so that the cache does not oscillate
//!   around the floor).
//!
//! The shared read caches of the golden images count against `--ram-total` too, beside the
//! VMs (not against the memory directory's room: their chunks are anonymous memory): they grow
//! only into room the VMs leave and while free memory is above the floor (or while they hold
//! less than their own floor), and give back first, when a VM is held by the budget or free
//! memory falls below the floor (see [`crate::relief`]); the VMs are cut only for what the
//! caches cannot give.
//!
//! The engine never reads /proc itself, so a simulation drives pressure deterministically.
//! Checks are not reservations: overlays racing on different threads can overshoot the cap by a
//! block each, which the next rebalance corrects.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

const NO_CAP: u64 = u64::MAX;

#[derive(Debug)]
pub struct HostMemory {
    cap_bytes: u64,
    floor_bytes: u64,
    used_bytes: AtomicU64,
    vms: AtomicU64,
    per_vm_cap_bytes: AtomicU64,
    /// The last free-memory figure [`HostMemory::rebalance`] saw (`NOT_SAMPLED` before one).
    available_bytes: AtomicU64,
    /// What the memory directory had room for at the last rebalance (`NO_CAP` where not told).
    room_cap_bytes: AtomicU64,
    /// Since the last [`HostMemory::take_held`], a VM under its own target was refused RAM
    /// because all together were at the budget (`HELD_BY_BUDGET`), or because its target was
    /// cut (`HELD_BY_CUT`).
    held: AtomicU8,
    /// What VMs gave back without a write of theirs to make them (see [`crate::relief`]).
    given_back_bytes: AtomicU64,
    /// What the golden images' read caches hold together, and what they may hold whatever the
    /// VMs need.
    read_cache_bytes: AtomicU64,
    read_cache_floor_bytes: AtomicU64,
    /// `--ram-total` as given: the read caches' bound with the VMs (`cap_bytes` may be less,
    /// cut to the memory directory's size, which holds the VMs' pages only).
    budget_bytes: AtomicU64,
    read_caches: AtomicU64,
    /// The per-VM cap came from the VMs going over `--ram-total` (each cut to its fair share):
    /// it grows back only by the room the cap leaves, not by free memory, which says nothing
    /// of it (lifted the next second, the cut let the first VMs keep it all again).
    cut_by_cap: AtomicBool,
}

/// Why VMs were held since the last pass (bits of [`HostMemory::take_held`]).
pub const HELD_BY_BUDGET: u8 = 1;
pub const HELD_BY_CUT: u8 = 2;

const NOT_SAMPLED: u64 = u64::MAX;

impl HostMemory {
    pub fn new(cap_bytes: u64, floor_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            cap_bytes,
            floor_bytes,
            used_bytes: AtomicU64::new(0),
            vms: AtomicU64::new(0),
            per_vm_cap_bytes: AtomicU64::new(NO_CAP),
            available_bytes: AtomicU64::new(NOT_SAMPLED),
            room_cap_bytes: AtomicU64::new(NO_CAP),
            held: AtomicU8::new(0),
            given_back_bytes: AtomicU64::new(0),
            read_cache_bytes: AtomicU64::new(0),
            read_cache_floor_bytes: AtomicU64::new(0),
            budget_bytes: AtomicU64::new(cap_bytes),
            read_caches: AtomicU64::new(0),
            cut_by_cap: AtomicBool::new(false),
        })
    }

    pub fn unlimited() -> Arc<Self> {
        Self::new(u64::MAX, 0)
    }

    pub fn cap_bytes(&self) -> u64 {
        self.cap_bytes
    }

    pub fn floor_bytes(&self) -> u64 {
        self.floor_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }

    pub fn vms(&self) -> u64 {
        self.vms.load(Ordering::Relaxed)
    }

    /// Free memory at the last rebalance, if there was one.
    pub fn available_bytes(&self) -> Option<u64> {
        Some(self.available_bytes.load(Ordering::Relaxed)).filter(|&b| b != NOT_SAMPLED)
    }

    /// The most one VM may hold now, whatever its own target.
    pub fn per_vm_cap_bytes(&self) -> u64 {
        self.per_vm_cap_bytes.load(Ordering::Relaxed)
    }

    pub fn effective_target(&self, vm_target_bytes: u64) -> u64 {
        vm_target_bytes.min(self.per_vm_cap_bytes())
    }

    /// How many VMs the cap holds when each needs at least `minimum_bytes` (a spilling VM's
    /// open segment): past that, the cap could not be kept, however targets were cut.
    pub fn vms_that_fit(&self, minimum_bytes: u64) -> u64 {
        self.cap_bytes / minimum_bytes.max(1)
    }

    /// Whether one more VM needing `minimum_bytes` fits beside those attached now.
    pub fn admits(&self, minimum_bytes: u64) -> bool {
        self.vms() < self.vms_that_fit(minimum_bytes)
    }

    /// Whether the host has room for `bytes` more of a VM's: the VMs within their cap (and the
    /// memory directory's room), and the VMs and read caches together within `--ram-total`.
    pub fn has_room(&self, bytes: u64) -> bool {
        let used = self.used_bytes().saturating_add(bytes);
        used <= self.total_cap_bytes() && used.saturating_add(self.read_cache_bytes()) <= self.budget_bytes()
    }

    fn budget_bytes(&self) -> u64 {
        self.budget_bytes.load(Ordering::Relaxed)
    }

    /// Free memory below the floor at the last sample (0 when above it, or not sampled).
    pub fn free_deficit_bytes(&self) -> u64 {
        self.available_bytes().map_or(0, |available| self.floor_bytes.saturating_sub(available))
    }

    /// What the read caches hold together.
    pub fn read_cache_bytes(&self) -> u64 {
        self.read_cache_bytes.load(Ordering::Relaxed)
    }

    pub fn read_cache_floor_bytes(&self) -> u64 {
        self.read_cache_floor_bytes.load(Ordering::Relaxed)
    }

    /// Bounds the read caches: together with the VMs by `budget_bytes` (`--ram-total` as
    /// given), and `floor_bytes` they may hold whatever the VMs need (they give back first, but
    /// not below it).
    pub fn set_read_caches(&self, budget_bytes: u64, floor_bytes: u64) {
        self.budget_bytes.store(budget_bytes, Ordering::Relaxed);
        self.read_cache_floor_bytes.store(floor_bytes, Ordering::Relaxed);
    }

    /// Whether a read cache holding `own_bytes` may hold `bytes` more: within its share of the
    /// floor (so that a new image version's cache is not starved by the others), within the
    /// floor all together, or in room the VMs leave while free memory is above the floor.
    pub fn read_cache_may_grow(&self, own_bytes: u64, bytes: u64) -> bool {
        let floor = self.read_cache_floor_bytes();
        let share = floor / self.read_caches.load(Ordering::Relaxed).max(1);
        let total = self.read_cache_bytes().saturating_add(bytes);
        own_bytes.saturating_add(bytes) <= share
            || total <= floor
            || (self.free_deficit_bytes() == 0 && self.used_bytes().saturating_add(total) <= self.budget_bytes())
    }

    pub(crate) fn attach_read_cache(&self) {
        self.read_caches.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn detach_read_cache(&self, held_bytes: u64) {
        self.account_read_cache(held_bytes, 0);
        self.read_caches.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn account_read_cache(&self, before: u64, after: u64) {
        move_by(&self.read_cache_bytes, before, after);
    }

    /// The cap on all VMs together now: `--ram-total`, or less where the memory directory's
    /// room was short at the last rebalance.
    pub fn total_cap_bytes(&self) -> u64 {
        self.cap_bytes.min(self.room_cap_bytes.load(Ordering::Relaxed))
    }

    /// A VM wanted RAM within its own target and the host had none left for it
    /// ([`HELD_BY_BUDGET`]) or had cut its target below ([`HELD_BY_CUT`]).
    pub(crate) fn note_held(&self, why: u8) {
        self.held.fetch_or(why, Ordering::Relaxed);
    }

    /// Why VMs were held back since the last call (which clears it): bits, 0 for none.
    pub fn take_held(&self) -> u8 {
        self.held.swap(0, Ordering::Relaxed)
    }

    pub fn note_given_back(&self, bytes: u64) {
        self.given_back_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Memory VMs gave back so far without a write of theirs to make them.
    pub fn given_back_bytes(&self) -> u64 {
        self.given_back_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn attach(&self) {
        self.vms.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn detach(&self, accounted_bytes: u64) {
        self.used_bytes.fetch_sub(accounted_bytes, Ordering::Relaxed);
        self.vms.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn account(&self, before: u64, after: u64) {
        move_by(&self.used_bytes, before, after);
    }

    /// Recomputes the per-VM cap from the host's available memory (MemAvailable).
    pub fn rebalance(&self, available_bytes: u64) {
        self.rebalance_within(available_bytes, None);
    }

    /// As [`Self::rebalance`], also bounding the VMs together by the room of the filesystem
    /// their pages live in (a tmpfs memory directory): what they hold now, plus its free room,
    /// less `keep_bytes`. Other users of that filesystem (`/run` is everyone's) can take its room
    /// after the server started, and a page the filesystem refuses fails the guest's write,
    /// where a VM held back spills instead.
    ///
    /// The VMs stop growing where the room left is the room to keep ([`Self::has_room`]). They
    /// give memory back only once it is below half of that (their own uncounted pages use some
    /// of it in the normal course: cutting them then would push a VM's RAM tier out every few
    /// seconds), and grow again only by what the room has beyond it.
    pub fn rebalance_within(&self, available_bytes: u64, pages_room: Option<PagesRoom>) {
        self.available_bytes.store(available_bytes.min(NOT_SAMPLED - 1), Ordering::Relaxed);
        let used = self.used_bytes();
        let room_cap =
            pages_room.map_or(NO_CAP, |room| used.saturating_add(room.room_bytes).saturating_sub(room.keep_bytes));
        self.room_cap_bytes.store(room_cap, Ordering::Relaxed);
        let (room_deficit, room_surplus) = match pages_room {
            Some(PagesRoom { room_bytes, keep_bytes }) if room_bytes < keep_bytes / 2 => (keep_bytes - room_bytes, 0),
            Some(PagesRoom { room_bytes, keep_bytes }) => (0, room_bytes.saturating_sub(keep_bytes)),
            None => (0, u64::MAX),
        };
        // Below the free floor the read caches give back first (the relief pass has them):
        // the VMs are cut only for what the caches hold no more of above their floor.
        let caches_above_floor = self.read_cache_bytes().saturating_sub(self.read_cache_floor_bytes());
        let free_deficit = self.floor_bytes.saturating_sub(available_bytes).saturating_sub(caches_above_floor);
        let deficit = free_deficit.max(room_deficit);
        let vms = self.vms().max(1);
        let previous = self.per_vm_cap_bytes();
        let mut cap = if deficit > 0 {
            previous.min(used.saturating_sub(deficit) / vms)
        } else if previous == NO_CAP {
            NO_CAP
        } else {
            let mut surplus = available_bytes.saturating_sub(self.floor_bytes).min(room_surplus);
            if self.cut_by_cap.load(Ordering::Relaxed) {
                surplus = surplus.min(self.cap_bytes.saturating_sub(used));
            }
            let grown = previous.saturating_add(surplus / vms);
            // Lift the cap once it no longer binds anyone.
            if grown >= self.total_cap_bytes() {
                NO_CAP
            } else {
                grown
            }
        };
        if used > self.cap_bytes {
            cap = cap.min(self.cap_bytes / vms);
            self.cut_by_cap.store(true, Ordering::Relaxed);
        } else if cap == NO_CAP {
            self.cut_by_cap.store(false, Ordering::Relaxed);
        }
        self.per_vm_cap_bytes.store(cap, Ordering::Relaxed);
    }
}

/// Moves `total` by what one holder's part of it went from, `before`, to, `after`.
fn move_by(total: &AtomicU64, before: u64, after: u64) {
    if after >= before {
        total.fetch_add(after - before, Ordering::Relaxed);
    } else {
        total.fetch_sub(before - after, Ordering::Relaxed);
    }
}

/// What the filesystem holding the VMs' pages has free, and how much of it to keep free: pages
/// are allocated ahead of use and a write lands in fresh pages before it pushes older ones out,
/// neither of which the budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagesRoom {
    pub room_bytes: u64,
    pub keep_bytes: u64,
}

/// Reads MemAvailable from /proc/meminfo, in bytes.
pub fn read_mem_available() -> std::io::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_available(&meminfo)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no MemAvailable line in /proc/meminfo"))
}

/// Memory this process may still take before its cgroup's limit (`MemoryMax=` of a systemd
/// unit, a container's limit): the limit less what the cgroup uses, cgroup v2 or v1. `None`
/// when there is no limit or it cannot be read. Page cache counts in the cgroup's use, as the
/// kernel counts it when it enforces the limit.
pub fn read_cgroup_room() -> Option<u64> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let (limit, usage) = cgroup_limit_and_usage(&membership, Path::new("/sys/fs/cgroup"))?;
    Some(limit.saturating_sub(usage))
}

/// The memory limit and use of the cgroup `membership` (/proc/self/cgroup) names, under the
/// cgroup filesystem at `root`.
fn cgroup_limit_and_usage(membership: &str, root: &Path) -> Option<(u64, u64)> {
    let read = |path: std::path::PathBuf| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            // v1: limit_in_bytes holds a huge number when there is no limit.
            let dir = root.join("memory").join(relative);
            let limit = read(dir.join("memory.limit_in_bytes"))?;
            if limit >= 1 << 60 {
                return None;
            }
            return Some((limit, read(dir.join("memory.usage_in_bytes"))?));
        }
        if controllers.is_empty() {
            // v2: "max" when there is no limit (the unified tree at the root or under unified/).
            for base in [root.to_path_buf(), root.join("unified")] {
                let dir = base.join(relative);
                if let Some(limit) = read(dir.join("memory.max")) {
                    return Some((limit, read(dir.join("memory.current"))?));
                }
            }
        }
    }
    None
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_limits_v1_and_v2() {
        let root = tempfile::tempdir().expect("tempdir");
        let write = |path: &str, text: &str| {
            let path = root.path().join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        };
        write("memory/vm/memory.limit_in_bytes", "1073741824\n");
        write("memory/vm/memory.usage_in_bytes", "73741824\n");
        assert_eq!(cgroup_limit_and_usage("4:memory:/vm\n0::/\n", root.path()), Some((1 << 30, 73_741_824)));
        write("memory/free/memory.limit_in_bytes", "9223372036854771712\n");
        write("memory/free/memory.usage_in_bytes", "1\n");
        assert_eq!(cgroup_limit_and_usage("4:memory:/free\n", root.path()), None, "no limit");
        write("system.slice/overspill.service/memory.max", "536870912\n");
        write("system.slice/overspill.service/memory.current", "1048576\n");
        assert_eq!(
            cgroup_limit_and_usage("0::/system.slice/overspill.service\n", root.path()),
            Some((512 << 20, 1 << 20))
        );
        write("unlimited/memory.max", "max\n");
        assert_eq!(cgroup_limit_and_usage("0::/unlimited\n", root.path()), None, "max: no limit");
    }

    #[test]
    fn parses_meminfo() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n";
        assert_eq!(parse_mem_available(text), Some(1_024_000));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn caps_shrink_below_the_floor_and_recover_above_it() {
        let host = HostMemory::new(1 << 30, 100 << 20);
        host.attach();
        host.attach();
        host.account(0, 200 << 20);
        assert_eq!(host.effective_target(64 << 20), 64 << 20);
        assert_eq!(host.available_bytes(), None, "nothing sampled yet");
        // 40 MiB short of the floor: together the VMs must give 40 MiB back.
        host.rebalance(60 << 20);
        assert_eq!(host.per_vm_cap_bytes(), 80 << 20);
        assert_eq!(host.available_bytes(), Some(60 << 20), "the sample is kept for the metrics");
        host.account(200 << 20, 160 << 20);
        host.rebalance(100 << 20);
        assert_eq!(host.per_vm_cap_bytes(), 80 << 20, "at the floor: hold");
        host.rebalance(300 << 20);
        assert_eq!(host.per_vm_cap_bytes(), 180 << 20, "surplus shared out");
        host.rebalance(2 << 30);
        assert_eq!(host.per_vm_cap_bytes(), NO_CAP);
    }

    /// VMs over `--ram-total` are each cut to their fair share, and the cut holds while they
    /// are at the cap, however much memory is free: it grows back only as room under the cap
    /// comes back.
    #[test]
    fn a_cut_to_the_fair_share_holds_while_the_vms_are_at_the_cap() {
        let host = HostMemory::new(100 << 20, 0);
        for _ in 0..4 {
            host.attach();
        }
        host.account(0, 101 << 20);
        host.rebalance(16 << 30);
        assert_eq!(host.per_vm_cap_bytes(), 25 << 20);
        host.account(101 << 20, 100 << 20);
        host.rebalance(16 << 30);
        assert_eq!(host.per_vm_cap_bytes(), 25 << 20, "at the cap: the fair share holds");
        host.account(100 << 20, 60 << 20);
        host.rebalance(16 << 30);
        assert_eq!(host.per_vm_cap_bytes(), 35 << 20, "grown by the room under the cap, shared");
        host.account(60 << 20, 0);
        for _ in 0..4 {
            host.rebalance(16 << 30);
        }
        assert_eq!(host.per_vm_cap_bytes(), NO_CAP, "lifted once it binds no one");
    }

    /// The memory directory short of room cuts the VMs, though memory is plentiful, and bounds
    /// them together by its room; a room just under what is kept (the VMs' own uncounted pages)
    /// cuts no one.
    #[test]
    fn the_pages_filesystems_room_bounds_the_vms_together() {
        let host = HostMemory::new(1 << 30, 0);
        host.attach();
        host.attach();
        host.account(0, 100 << 20);
        let room = |room_mib: u64| Some(PagesRoom { room_bytes: room_mib << 20, keep_bytes: 8 << 20 });
        host.rebalance_within(16 << 30, room(6));
        assert_eq!(host.per_vm_cap_bytes(), NO_CAP, "under the room to keep, above half of it: no one cut");
        assert_eq!(host.total_cap_bytes(), 98 << 20);
        assert!(!host.has_room(4096), "but no one grows");
        host.rebalance_within(16 << 30, room(2));
        assert_eq!(host.total_cap_bytes(), 94 << 20, "6 MiB short of the room to keep");
        assert_eq!(host.per_vm_cap_bytes(), 47 << 20, "each VM cut to its share of what is left");
        host.account(100 << 20, 94 << 20);
        host.rebalance_within(16 << 30, room(6));
        assert_eq!(host.per_vm_cap_bytes(), 47 << 20, "room back, under what is kept: the cut holds");
        host.rebalance_within(16 << 30, room(28));
        assert_eq!(host.per_vm_cap_bytes(), 57 << 20, "grown by the room's surplus, not memory's");
        assert!(host.has_room(20 << 20) && !host.has_room((20 << 20) + 4096), "all together to the room");
        host.rebalance_within(100 << 20, room(4 << 10));
        assert_eq!(host.per_vm_cap_bytes(), 107 << 20, "memory's surplus when it is the smaller");
        assert_eq!(host.cap_bytes(), 1 << 30, "--ram-total itself is as it was");
        host.rebalance_within(16 << 30, None);
        assert_eq!((host.per_vm_cap_bytes(), host.total_cap_bytes()), (NO_CAP, 1 << 30));
    }

    /// The read caches share `--ram-total` with the VMs, not the memory directory's room; below
    /// the free floor they are counted on to give back before the VMs are cut, and do not grow;
    /// a new cache always gets its share of the floor.
    #[test]
    fn read_caches_share_the_budget_not_the_pages_room() {
        let host = HostMemory::new(1 << 30, 100 << 20);
        host.set_read_caches(1 << 30, 64 << 20);
        host.attach();
        host.account(0, 300 << 20);
        host.attach_read_cache();
        host.attach_read_cache();
        host.account_read_cache(0, 600 << 20);
        let room = Some(PagesRoom { room_bytes: 200 << 20, keep_bytes: 100 << 20 });
        host.rebalance_within(4 << 30, room);
        assert_eq!(host.total_cap_bytes(), 400 << 20, "the pages' room bounds the VMs");
        assert!(host.has_room(100 << 20), "the caches' 600 MiB are not in the memory directory");
        assert!(!host.has_room((124 << 20) + 1), "but VMs and caches together stay in --ram-total");
        assert!(!host.read_cache_may_grow(600 << 20, 200 << 20), "the budget is full");
        assert!(host.read_cache_may_grow(0, 16 << 10), "a new cache gets its share of the floor");
        assert!(!host.read_cache_may_grow(32 << 20, 200 << 20), "not past it when the budget is full");

        // 300 MiB short of the free floor: the caches hold 536 MiB above theirs, so no VM is cut.
        host.rebalance_within(100 << 20, None);
        assert_eq!(host.free_deficit_bytes(), 0, "100 MiB free is the floor");
        host.rebalance_within(0, None);
        assert_eq!(host.free_deficit_bytes(), 100 << 20);
        assert_eq!(host.per_vm_cap_bytes(), NO_CAP, "the caches give back first");
        host.account_read_cache(600 << 20, 64 << 20);
        assert!(!host.read_cache_may_grow(64 << 20, 16 << 10), "below the free floor caches do not grow past theirs");
        host.rebalance_within(0, None);
        assert_eq!(host.per_vm_cap_bytes(), 200 << 20, "then the VMs: 100 MiB of their 300");
    }

    #[test]
    fn host_cap_cuts_everyone_to_a_fair_share() {
        let host = HostMemory::new(100 << 20, 0);
        for _ in 0..4 {
            host.attach();
        }
        host.account(0, 120 << 20);
        assert!(!host.has_room(1));
        host.rebalance(u64::MAX);
        assert_eq!(host.per_vm_cap_bytes(), 25 << 20);
        host.detach(120 << 20);
        assert_eq!(host.used_bytes(), 0);
    }
}
