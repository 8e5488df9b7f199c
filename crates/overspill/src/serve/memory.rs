//! Where `serve`'s VMs keep their pages and how the server watches memory: the memory
//! directory and its room, and the thread that feeds free memory to the budget once a second
//! and has VMs and read caches give memory back.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use overspill_engine::budget::{read_cgroup_room, read_mem_available};
use overspill_engine::{HostMemory, PagesRoom, WriteCacheMode, SEGMENT_BYTES};
use overspill_server::vms::VmRegistry;

use crate::size::format_bytes;

/// `--ram-total`, or less when the memory directory's filesystem has less room than that (a
/// `/run` tmpfs is 10-20 % of the host's RAM): the RAM tier's pages live there, and a page it
/// has no room for fails the guest's write with ENOSPC, where a cap makes the VMs spill first.
/// Room is what the filesystem can still take plus what overspill's state files there hold (a
/// restarted server's VMs).
pub(super) fn ram_total_within(memory_dir: &Path, ram_total: u64) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(fs) = nix::sys::statvfs::statvfs(made_or_to_be_made_in(memory_dir)) else { return ram_total };
    let free = fs.blocks_available().saturating_mul(fs.fragment_size());
    let ours: u64 = std::fs::read_dir(memory_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("vm-"))
        .filter_map(|entry| entry.metadata().ok())
        .map(|metadata| metadata.blocks() * 512)
        .sum();
    let room = free.saturating_add(ours);
    if room >= ram_total {
        return ram_total;
    }
    tracing::warn!(
        dir = %memory_dir.display(),
        room = %format_bytes(room),
        ram_total = %format_bytes(ram_total),
        "the memory directory has room for less than --ram-total: the RAM tier is capped at its room, so that VMs spill \
         rather than have writes refused when it is full (give the directory a filesystem of its own, or a larger one)"
    );
    room
}

/// The memory directory's free room, and what to keep free there for the pages VMs take that
/// the budget does not count: per VM three 2 MiB segments (the segment being written, the
/// arena's allocation two steps ahead of the pages it hands out), and once for all the largest
/// request (its pages are taken before its blocks push older ones out; QEMU rarely sends one,
/// and not from many VMs at once). At most a quarter of the filesystem: more would keep the
/// RAM tier off for good on a small one with many VMs. `None` when the directory cannot be read.
fn pages_room(dir: &Path, vms: u64, largest_request: u64) -> Option<PagesRoom> {
    let fs = nix::sys::statvfs::statvfs(made_or_to_be_made_in(dir)).ok()?;
    let size = fs.blocks().saturating_mul(fs.fragment_size());
    let wanted = 3 * SEGMENT_BYTES as u64 * vms.max(1) + largest_request;
    Some(PagesRoom {
        room_bytes: fs.blocks_available().saturating_mul(fs.fragment_size()),
        keep_bytes: wanted.min(size / 4),
    })
}

/// `dir`, or the directory it will be made in (the first VM's files make it): the filesystem its
/// files will be on.
fn made_or_to_be_made_in(dir: &Path) -> &Path {
    dir.ancestors().find(|dir| dir.exists()).unwrap_or(dir)
}

/// Pages in a memory directory on a disk filesystem still outlive the process, but every page the
/// VMs write is written back to that disk: say so, as the operator asked for a RAM tier.
pub(super) fn warn_unless_in_memory(dir: &Path) {
    use nix::sys::statfs::{statfs, FsType, TMPFS_MAGIC};
    // Not among nix's names; linux/magic.h.
    const RAMFS_MAGIC: FsType = FsType(0x8584_58f6);
    match statfs(made_or_to_be_made_in(dir)) {
        Ok(fs) if fs.filesystem_type() == TMPFS_MAGIC || fs.filesystem_type() == RAMFS_MAGIC => {}
        Ok(_) => tracing::warn!(
            dir = %dir.display(),
            "--memory-dir is not on tmpfs: the RAM tier's pages will be written back to its disk"
        ),
        Err(error) => tracing::warn!(dir = %dir.display(), %error, "cannot tell what filesystem --memory-dir is on"),
    }
}

/// An in-place cache file is rebuilt after a restart from the blocks its filesystem reports as
/// data; said now rather than at the first restart, when the VMs are refused.
pub(super) fn warn_unless_blocks_are_told_apart(dir: &Path, mode: WriteCacheMode) {
    match overspill_engine::store::reports_blocks_exactly(dir) {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            dir = %dir.display(),
            %mode,
            "this filesystem reports data in units larger than 4 KiB, or drops written zeroes: VMs in \
             this mode cannot be rebuilt after a restart, and are refused until `overspill vm reset`"
        ),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot tell how this filesystem reports its blocks")
        }
    }
}

/// A memory directory of its own for each state directory: two servers with different state
/// never share one, and a server that restarts with the same state finds its pages.
pub(super) fn default_memory_dir(state_dir: &Path) -> PathBuf {
    let absolute = std::path::absolute(state_dir).unwrap_or_else(|_| state_dir.to_owned());
    // FNV-1a: stable across releases, unlike the standard library's hasher.
    let hash = absolute
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    PathBuf::from(format!("/dev/shm/overspill-{hash:016x}"))
}

/// Feeds the host's free memory (and the room left in the memory directory, where VMs' pages
/// are files) to the budget once a second, so VMs shrink under pressure, has VMs that write
/// nothing give memory back where it is needed (`VmRegistry::give_back_memory`), and hands
/// memory the VMs gave back to the system.
pub(super) fn spawn_memory_sampler(
    host: Arc<HostMemory>,
    registry: std::sync::Weak<VmRegistry>,
    read_caches: Arc<overspill_server::images::ReadCacheList>,
    pages_dir: Option<PathBuf>,
    largest_request: u64,
) {
    let mut sampler = Sampler::new(host, registry, read_caches, pages_dir, largest_request);
    let spawned = std::thread::Builder::new().name("memory-sampler".into()).spawn(move || {
        while sampler.tick(read_mem_available()) {
            release_freed_memory();
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    if let Err(error) = spawned {
        tracing::warn!(%error, "could not start the memory sampler");
    }
}

/// What the memory sampler keeps from one second to the next.
struct Sampler {
    host: Arc<HostMemory>,
    registry: std::sync::Weak<VmRegistry>,
    read_caches: Arc<overspill_server::images::ReadCacheList>,
    pages_dir: Option<PathBuf>,
    largest_request: u64,
    quiet: overspill_engine::relief::QuietWatch,
    /// Seconds in a row free memory could not be read.
    unreadable: u64,
}

impl Sampler {
    fn new(
        host: Arc<HostMemory>,
        registry: std::sync::Weak<VmRegistry>,
        read_caches: Arc<overspill_server::images::ReadCacheList>,
        pages_dir: Option<PathBuf>,
        largest_request: u64,
    ) -> Self {
        Self { host, registry, read_caches, pages_dir, largest_request, quiet: Default::default(), unreadable: 0 }
    }

    /// One second's work, given what free memory was read as; false once the server is gone.
    /// A second whose free memory cannot be read (the process out of file descriptors in a
    /// connection burst) is skipped, rebalance and give-back alike, and the next one tries
    /// again: once the sampler ended there, for the server's life, and caps cut under pressure
    /// stayed cut.
    fn tick(&mut self, available: std::io::Result<u64>) -> bool {
        match available {
            // Under a cgroup limit (MemoryMax=, a container) the room left in it is what counts
            // when it is less than the host's free memory.
            Ok(available) => {
                if std::mem::take(&mut self.unreadable) > 0 {
                    tracing::info!("free memory can be read again; the free floor is enforced");
                }
                self.host.rebalance_within(
                    read_cgroup_room().map_or(available, |room| room.min(available)),
                    self.pages_dir.as_deref().and_then(|dir| pages_room(dir, self.host.vms(), self.largest_request)),
                )
            }
            Err(error) => {
                if self.unreadable.is_multiple_of(60) {
                    tracing::warn!(%error, seconds = self.unreadable, "cannot read free memory; the free floor is not enforced until it can be");
                }
                self.unreadable += 1;
                // Nor given back for: the last sample's shortage may be long over.
                return self.registry.strong_count() > 0;
            }
        }
        let Some(registry) = self.registry.upgrade() else { return false };
        let caches: Vec<_> = self.read_caches.caches().into_iter().map(|(_, _, cache)| cache).collect();
        registry.give_back_memory(&self.host, &mut self.quiet, &caches);
        true
    }
}

/// Returns the allocator's free pages to the system. RAM tiers and written spill segments free
/// their 4 KiB pages one by one, and glibc keeps such pages in its arenas, scattered among live
/// ones: `bench/load 256 180 32M` ran at median RSS 915 MiB without the trim and 624 MiB with it
/// (bench/results/load-7317f52.md, load-5bea292.md, before segments were made of pages), at the
/// same IOPS.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_freed_memory() {
    // SAFETY: malloc_trim has no preconditions; it only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_freed_memory() {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second whose free memory cannot be read does not end the sampler: the next one that
    /// can rebalances the budget.
    #[test]
    fn free_memory_unreadable_for_a_while_is_read_again_later() {
        let host = HostMemory::new(1 << 30, 256 << 20);
        let registry = VmRegistry::new(overspill_server::vms::Lifecycle::default()).expect("registry");
        let mut sampler = Sampler::new(host.clone(), Arc::downgrade(&registry), Arc::default(), None, 0);
        assert!(sampler.tick(Err(std::io::Error::from_raw_os_error(24))), "goes on after EMFILE");
        assert_eq!(host.available_bytes(), None);
        assert!(sampler.tick(Ok(512 << 20)));
        assert_eq!(host.available_bytes(), Some(512 << 20));
    }
}
