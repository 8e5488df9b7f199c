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
//! The engine never reads /proc itself, so a simulation drives pressure deterministically.
//! Checks are not reservations: overlays racing on different threads can overshoot the cap by a
//! block each, which the next rebalance corrects.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const NO_CAP: u64 = u64::MAX;

#[derive(Debug)]
pub struct HostMemory {
    cap_bytes: u64,
    floor_bytes: u64,
    used_bytes: AtomicU64,
    vms: AtomicU64,
    per_vm_cap_bytes: AtomicU64,
}

impl HostMemory {
    pub fn new(cap_bytes: u64, floor_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            cap_bytes,
            floor_bytes,
            used_bytes: AtomicU64::new(0),
            vms: AtomicU64::new(0),
            per_vm_cap_bytes: AtomicU64::new(NO_CAP),
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

    /// The most one VM may hold now, whatever its own target.
    pub fn per_vm_cap_bytes(&self) -> u64 {
        self.per_vm_cap_bytes.load(Ordering::Relaxed)
    }

    pub fn effective_target(&self, vm_target_bytes: u64) -> u64 {
        vm_target_bytes.min(self.per_vm_cap_bytes())
    }

    /// Whether the host has room for `bytes` more.
    pub fn has_room(&self, bytes: u64) -> bool {
        self.used_bytes().saturating_add(bytes) <= self.cap_bytes
    }

    pub(crate) fn attach(&self) {
        self.vms.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn detach(&self, accounted_bytes: u64) {
        self.used_bytes.fetch_sub(accounted_bytes, Ordering::Relaxed);
        self.vms.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn account(&self, before: u64, after: u64) {
        if after >= before {
            self.used_bytes.fetch_add(after - before, Ordering::Relaxed);
        } else {
            self.used_bytes.fetch_sub(before - after, Ordering::Relaxed);
        }
    }

    /// Recomputes the per-VM cap from the host's available memory (MemAvailable).
    pub fn rebalance(&self, available_bytes: u64) {
        let used = self.used_bytes();
        let vms = self.vms().max(1);
        let previous = self.per_vm_cap_bytes();
        let mut cap = if available_bytes < self.floor_bytes {
            let deficit = self.floor_bytes - available_bytes;
            previous.min(used.saturating_sub(deficit) / vms)
        } else if previous == NO_CAP {
            NO_CAP
        } else {
            let grown = previous.saturating_add((available_bytes - self.floor_bytes) / vms);
            // Lift the cap once it no longer binds anyone.
            if grown >= self.cap_bytes {
                NO_CAP
            } else {
                grown
            }
        };
        if used > self.cap_bytes {
            cap = cap.min(self.cap_bytes / vms);
        }
        self.per_vm_cap_bytes.store(cap, Ordering::Relaxed);
    }
}

/// Reads MemAvailable from /proc/meminfo, in bytes.
pub fn read_mem_available() -> std::io::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_available(&meminfo)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no MemAvailable line in /proc/meminfo"))
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
        // 40 MiB short of the floor: together the VMs must give 40 MiB back.
        host.rebalance(60 << 20);
        assert_eq!(host.per_vm_cap_bytes(), 80 << 20);
        host.account(200 << 20, 160 << 20);
        host.rebalance(100 << 20);
        assert_eq!(host.per_vm_cap_bytes(), 80 << 20, "at the floor: hold");
        host.rebalance(300 << 20);
        assert_eq!(host.per_vm_cap_bytes(), 180 << 20, "surplus shared out");
        host.rebalance(2 << 30);
        assert_eq!(host.per_vm_cap_bytes(), NO_CAP);
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
