//! What a VM's overlay holds (memory, disk) and how it keeps within its budget: the memory
//! counted for the host after each change, free pages kept or given back, spill space given
//! back when the VM is idle or waiting.

use super::{Core, KeptDisk, Overlay};
use crate::units::{BLOCKS_PER_SEGMENT, BLOCK_BYTES};

/// Free pages beyond what a VM wants that its arena leaves warm (counted for the host all the
/// same): a VM whose wants move a little (a smaller write after a larger one) does not punch
/// pages it takes again a moment later. None for a VM under pressure (see `after_mutation`).
const COOLING_SLACK_PAGES: usize = BLOCKS_PER_SEGMENT / 4;

impl Overlay {
    /// Cache memory in use: RAM pages, the open spill segment and every index structure.
    pub fn memory_used_bytes(&self) -> u64 {
        self.core.index_bytes() + self.store.memory_bytes()
    }

    /// What the host's budget counts for this VM: [`Self::memory_used_bytes`] and the free
    /// pages its arena keeps beyond the open segment's room, as of the end of its last write,
    /// zeroing or trim. Then every page the VM has in memory is in it, except those of a
    /// segment being written (the host's, see `SpillLog::memory_bytes`); pages a background
    /// writer frees after that are counted at the next one.
    pub fn memory_accounted_bytes(&self) -> u64 {
        self.core.accounted_bytes
    }

    /// The VM is about to wait for its client (its connection lost, its overlay in grace): the
    /// free spill segments kept for its next writes, beyond the few always kept, go back to the
    /// filesystem, where another VM may need them while this one writes nothing.
    pub fn give_back_spare_disk(&mut self) {
        self.give_back_disk(KeptDisk::Spare);
    }

    /// The VM's client has sent nothing for a while (while connected): every free spill
    /// segment kept for its next writes goes back to the filesystem, the few always kept too.
    /// Another VM may need the space, and this one would not hear of it until it writes.
    pub fn give_back_idle_disk(&mut self) {
        self.give_back_disk(KeptDisk::All);
    }

    /// Has the spill log give kept segments back, and counts the disk it holds then.
    fn give_back_disk(&mut self, which: KeptDisk) {
        self.store.give_back_disk(&self.core.stats, which);
        self.core.stats.cache_disk_used_bytes.set(self.disk_used_bytes());
    }

    /// Free pages the VM has given back to the host so far (each one faulted in again when it
    /// is next taken).
    pub fn memory_pages_punched(&self) -> u64 {
        self.core.arena.pages_punched()
    }

    /// Memory the VM's pages really take: its blocks and the free pages its arena keeps for the
    /// next ones (beside [`Self::memory_used_bytes`], which counts an open segment whole).
    pub fn memory_resident_bytes(&self) -> u64 {
        self.core.arena.resident_pages() * BLOCK_BYTES
    }

    /// The target now in force: the VM's own, cut by host pressure.
    pub fn memory_target_bytes(&self) -> u64 {
        self.core.memory_target_bytes()
    }

    /// The VM's own target (`--ram`), before any cut.
    pub fn memory_own_target_bytes(&self) -> u64 {
        self.core.config.ram_target_bytes
    }

    pub fn disk_used_bytes(&self) -> u64 {
        self.store.disk_used_bytes()
    }

    /// Gives memory back without a write of the VM's to make it (see [`crate::relief`]): the
    /// coldest RAM blocks go to the spill log until the VM holds at most `limit_bytes`, and the
    /// pages they leave free go back to the system, none kept warm for writes to come. A VM
    /// without a spill log (mode `ram`) gives back only the free pages it kept. Returns how much
    /// less the host's budget counts for the VM.
    pub fn give_back_memory(&mut self, limit_bytes: u64) -> u64 {
        let before = self.core.accounted_bytes;
        self.store.shrink_to(&mut self.core, limit_bytes);
        // The last segment sealed holds its pages until written: a quiet VM would keep them
        // (uncounted) until its next request.
        self.store.finish_writes(&self.core.stats);
        self.settle_memory(Some(limit_bytes));
        before.saturating_sub(self.core.accounted_bytes)
    }

    /// Whether the VM can give RAM back by moving it to disk (it has a spill log; the modes
    /// that write in place hold no RAM tier, and mode `ram` has nowhere to move it).
    pub fn can_spill(&self) -> bool {
        self.core.config.mode == super::WriteCacheMode::RamDisk
    }

    pub(super) fn after_mutation(&mut self) {
        self.settle_memory(None);
    }

    /// Settles the store and counts the VM's memory for the host; `limit_bytes` is a limit the
    /// VM is giving memory back down to, below its target.
    fn settle_memory(&mut self, limit_bytes: Option<u64>) {
        self.store.settle(&mut self.core);
        self.core.map.shrink_if_empty();
        let used = self.memory_used_bytes();
        // Free pages the arena keeps in memory are memory the VM holds, though no block is in
        // them: keep no more than its unused target and what it will take again soon (a write
        // lands in fresh pages before its blocks push older ones into the open segment; the
        // spill log wants its round of pages), and count those beyond the open segment's room
        // (which `used` counts whole) for the host, so that every page kept is a page seen.
        // Fewer would make a VM streaming large writes fault fresh pages in on every request. A
        // VM under pressure (its target cut, or the host at its cap, which these kept pages are
        // not checked against when taken) keeps only its unused target and the open segment's
        // room, exactly: it is to give memory back, not to go fast.
        let core = &mut self.core;
        let target = core.memory_target_bytes();
        let unused = (limit_bytes.unwrap_or(target).min(target).saturating_sub(used) / BLOCK_BYTES) as usize;
        let pressed = limit_bytes.is_some() || target < core.config.ram_target_bytes || !core.host.has_room(0);
        let (soon, covered) = self.store.pages_wanted(pressed);
        let slack = if pressed { 0 } else { COOLING_SLACK_PAGES };
        let kept = core.arena.cool_beyond(unused + soon, slack);
        let accounted = used + kept.saturating_sub(covered) as u64 * BLOCK_BYTES;
        core.host.account(core.accounted_bytes, accounted);
        core.accounted_bytes = accounted;
        let stats = &core.stats;
        stats.cache_memory_used_bytes.set(used);
        stats.cache_memory_target_bytes.set(target);
        if used > stats.cache_memory_peak_bytes.get() {
            stats.cache_memory_peak_bytes.set(used);
        }
        let disk = self.store.disk_used_bytes();
        stats.cache_disk_used_bytes.set(disk);
        stats.cache_disk_size_bytes.set(self.store.disk_size_bytes());
        if disk > stats.cache_disk_peak_bytes.get() {
            stats.cache_disk_peak_bytes.set(disk);
        }
    }
}

impl Core {
    /// The target now in force: the VM's own, cut by host pressure.
    pub(super) fn memory_target_bytes(&self) -> u64 {
        self.host.effective_target(self.config.ram_target_bytes)
    }

    /// Memory the block map and the zeroed ranges take.
    pub(super) fn index_bytes(&self) -> u64 {
        self.map.memory_bytes() + self.zeros.memory_bytes()
    }
}
