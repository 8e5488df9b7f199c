//! Memory for the read cache's chunks, taken from the system in 2 MiB slabs.
//!
//! A cache filling up on a fresh server spent a fifth of its time in page faults: every 16 KiB
//! chunk came from the allocator as new memory, so each miss took four faults on the reader's
//! latency path, and the allocator grew its heap a little at a time. Here chunks are slots of
//! slabs, and a helper thread keeps one slab mapped and populated ahead of need, so a miss takes
//! a slot whose pages are already there. A chunk the cache lets go gives its slot back for the
//! next miss (the most recently freed first, still warm in the CPU's caches). Slabs are kept as
//! long as the pool: the cache refills what it evicts, so the memory stays bounded by the most
//! chunks ever alive at once, plus the slab held ready. A cache made to give memory back has
//! the pool release its free slots' pages ([`ChunkPool::release_free`]); a released slot is
//! faulted in again by the reader that takes it next.
//!
//! Huge pages were tried before the helper, populated on the reader's path: clearing 2 MiB at
//! once put p99.9 of 4 KiB QD1 reads at 1.8-1.9 ms (0.1 ms without). Populated by the helper
//! they did not clearly pay: 52.7-62.0k IOPS against 55.5-57.9k, and one run of three with a
//! p99.95 of 1.5 ms (3 s runs, builds alternated).

use std::io;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rustix::mm::{MapFlags, ProtFlags};

use crate::stats::Gauge;

/// The memory mapped at a time: one mapping for 128 chunks of 16 KiB.
pub const SLAB_BYTES: usize = 2 << 20;

/// Free slots released per hold of the free list's lock.
const RELEASE_BATCH_SLOTS: usize = 64;

/// One anonymous mapping, carved into equal slots.
struct Slab {
    base: NonNull<u8>,
    bytes: usize,
    resident_bytes: Arc<Gauge>,
    /// Bytes of its slots released and not taken since (already off `resident_bytes`).
    released_bytes: std::sync::atomic::AtomicUsize,
}

// SAFETY: a Slab is only an address range. Who may touch which bytes of it is decided by
// `ChunkBuf`, which owns its slot exclusively; the slab itself is never read or written through.
unsafe impl Send for Slab {}
// SAFETY: as above: shared references to a Slab give no access to its bytes.
unsafe impl Sync for Slab {}

impl Slab {
    /// Maps `bytes` of zeroed memory; `populate` faults every page in now, instead of at the
    /// first touch of a reader.
    fn map(bytes: usize, populate: bool, resident_bytes: &Arc<Gauge>) -> io::Result<Self> {
        // SAFETY: a new private anonymous mapping at an address the kernel picks aliases nothing.
        let start = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                bytes,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| io::Error::new(e.kind(), format!("mapping {bytes} bytes for the read cache: {e}")))?;
        let base = NonNull::new(start.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        if populate {
            // Touched page by page rather than with MADV_POPULATE_WRITE, which holds the
            // process's mmap lock for the whole slab: any mmap or munmap of a reader (the
            // allocator's) then waited for it (p99.95 of 4 KiB QD1 reads 383-537 µs). A fault
            // takes only the lock of its own mapping.
            for page in (0..bytes).step_by(4096) {
                // SAFETY: `page` is inside the mapping just made, which nothing else knows of
                // yet; writing the zero it already holds only makes the kernel back the page.
                unsafe { base.as_ptr().add(page).write_volatile(0) };
            }
        }
        resident_bytes.add(bytes as u64);
        Ok(Self { base, bytes, resident_bytes: resident_bytes.clone(), released_bytes: Default::default() })
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: the range is the mapping `map` made, and no ChunkBuf outlives the slab (each
        // holds an Arc of it).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.bytes) };
        let released = self.released_bytes.load(std::sync::atomic::Ordering::Relaxed);
        self.resident_bytes.sub(self.bytes.saturating_sub(released) as u64);
    }
}

struct Slot {
    slab: Arc<Slab>,
    offset: usize,
    /// Its pages were given back to the system: not counted resident until taken again.
    released: bool,
}

/// The slab the helper keeps ready, and how the pool and the helper talk about it.
#[derive(Default)]
struct Spare {
    slab: Option<Slab>,
    /// The pool took the spare (or found none): the helper should map the next one.
    wanted: bool,
    /// The pool is gone: the helper ends.
    closed: bool,
    helper_started: bool,
}

struct Filler {
    spare: Mutex<Spare>,
    wake: Condvar,
}

impl Filler {
    fn lock(&self) -> MutexGuard<'_, Spare> {
        // Every field of Spare is valid at every step; a panic elsewhere cannot break it.
        self.spare.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The helper: maps and populates a slab whenever the pool has taken the last one.
    fn run(&self, bytes: usize, resident_bytes: &Arc<Gauge>) {
        // The lowest priority: populating takes a core for a few hundred microseconds, and at
        // normal priority a reader waiting for that core showed it in its p99.9 (429-433 µs
        // against 74-151 µs at nice 19, 4 KiB QD1 reads on 2 cores). Failing to lower it only
        // costs that.
        let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19);
        let mut spare = self.lock();
        loop {
            // Only one spare: a request that came while the last one was being made is met by it.
            while (!spare.wanted || spare.slab.is_some()) && !spare.closed {
                spare = self.wake.wait(spare).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
            if spare.closed {
                return;
            }
            spare.wanted = false;
            drop(spare);
            // On failure (out of memory) the pool maps its own when it needs one and reports
            // the error to that reader.
            let slab = Slab::map(bytes, true, resident_bytes).ok();
            spare = self.lock();
            if spare.closed {
                return;
            }
            spare.slab = slab;
        }
    }
}

struct PoolInner {
    slot_bytes: usize,
    slab_bytes: usize,
    free: Mutex<Vec<Slot>>,
    filler: Arc<Filler>,
    resident_bytes: Arc<Gauge>,
}

impl PoolInner {
    fn lock_free(&self) -> MutexGuard<'_, Vec<Slot>> {
        // A list of free slots is valid at every step; a panic elsewhere cannot break it.
        self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        self.filler.lock().closed = true;
        self.filler.wake.notify_all();
    }
}

/// Hands out fixed-size buffers carved from slabs, and takes them back when they drop.
pub struct ChunkPool {
    inner: Arc<PoolInner>,
}

impl ChunkPool {
    /// Buffers of `slot_bytes`, for a cache of about `capacity_bytes`: a cache smaller than a
    /// slab maps only what it can hold. `resident_bytes` follows the memory mapped.
    pub fn new(slot_bytes: usize, capacity_bytes: u64, resident_bytes: Arc<Gauge>) -> Self {
        let slot_bytes = slot_bytes.max(1);
        let capacity = usize::try_from(capacity_bytes).unwrap_or(usize::MAX).max(slot_bytes);
        let slab_bytes = SLAB_BYTES.min(capacity).max(slot_bytes).next_multiple_of(slot_bytes);
        let filler = Arc::new(Filler { spare: Mutex::new(Spare::default()), wake: Condvar::new() });
        Self {
            inner: Arc::new(PoolInner { slot_bytes, slab_bytes, free: Mutex::new(Vec::new()), filler, resident_bytes }),
        }
    }

    /// A buffer of `len` bytes (at most the slot size), holding whatever its last user left in
    /// it: the cache overwrites it with the source's bytes before anyone reads it.
    pub fn take(&self, len: usize) -> io::Result<ChunkBuf> {
        assert!(len <= self.inner.slot_bytes, "a chunk is at most one slot");
        // Not a `match` on the pop: its guard would live through `grow`, which locks again.
        let reused = self.inner.lock_free().pop();
        let slot = match reused {
            Some(mut slot) if slot.released => {
                slot.released = false;
                slot.slab.released_bytes.fetch_sub(self.inner.slot_bytes, std::sync::atomic::Ordering::Relaxed);
                self.inner.resident_bytes.add(self.inner.slot_bytes as u64);
                slot
            }
            Some(slot) => slot,
            None => self.grow()?,
        };
        Ok(ChunkBuf { slot: Some(slot), len, pool: self.inner.clone() })
    }

    /// Gives the pages of every free slot back to the system (the cache shrank and is not to
    /// refill at once); returns the bytes released. Nothing where a slot is not whole pages
    /// (the kernel would drop the neighbours' pages with it).
    pub fn release_free(&self) -> u64 {
        let slot_bytes = self.inner.slot_bytes;
        if !slot_bytes.is_multiple_of(rustix::param::page_size()) {
            return 0;
        }
        let mut released = 0;
        loop {
            // A batch at a time out of the list, released without its lock: readers taking and
            // freeing slots wait for one batch, not for all.
            let batch: Vec<Slot> = {
                let mut free = self.inner.lock_free();
                let (kept, unreleased): (Vec<Slot>, Vec<Slot>) =
                    std::mem::take(&mut *free).into_iter().partition(|slot| slot.released);
                *free = kept;
                let mut unreleased = unreleased;
                let rest = unreleased.split_off(unreleased.len().min(RELEASE_BATCH_SLOTS));
                free.extend(rest);
                unreleased
            };
            if batch.is_empty() {
                break;
            }
            let mut done = Vec::with_capacity(batch.len());
            for mut slot in batch {
                // SAFETY: the range is one slot, whole pages (checked above) inside its slab's
                // mapping (offset + slot size <= slab bytes), which the slot's Arc keeps mapped;
                // the slot is out of the free list and owned here alone, so no ChunkBuf reads or
                // writes it. Its bytes read back as zeroes afterwards, which is all a freshly
                // taken slot may hold (the cache fills it before anyone reads it).
                let dropped = unsafe {
                    rustix::mm::madvise(
                        slot.slab.base.as_ptr().add(slot.offset).cast(),
                        slot_bytes,
                        rustix::mm::Advice::LinuxDontNeed,
                    )
                };
                if dropped.is_ok() {
                    slot.released = true;
                    slot.slab.released_bytes.fetch_add(slot_bytes, std::sync::atomic::Ordering::Relaxed);
                    self.inner.resident_bytes.sub(slot_bytes as u64);
                    released += slot_bytes as u64;
                }
                done.push(slot);
            }
            let failed = done.iter().any(|slot| !slot.released);
            self.inner.lock_free().extend(done);
            if failed {
                break;
            }
        }
        released
    }

    /// Takes the helper's ready slab (or maps one here if it has none ready yet), asks for the
    /// next, keeps all its slots but one as free, and returns that one.
    fn grow(&self) -> io::Result<Slot> {
        let ready = {
            let mut spare = self.inner.filler.lock();
            spare.wanted = true;
            if !spare.helper_started {
                spare.helper_started = self.start_helper();
            }
            spare.slab.take()
        };
        self.inner.filler.wake.notify_one();
        let slab = Arc::new(match ready {
            Some(slab) => slab,
            // Not populated: the reader pays one fault per page it touches, not all 512.
            None => Slab::map(self.inner.slab_bytes, false, &self.inner.resident_bytes)?,
        });
        let slots = self.inner.slab_bytes / self.inner.slot_bytes;
        let mut free = self.inner.lock_free();
        // Pushed last to first, so that slots are handed out in address order.
        free.extend((1..slots).rev().map(|k| Slot {
            slab: slab.clone(),
            offset: k * self.inner.slot_bytes,
            released: false,
        }));
        Ok(Slot { slab, offset: 0, released: false })
    }

    /// Starts the helper thread; false if the system would not (the pool then maps in line).
    fn start_helper(&self) -> bool {
        let filler = self.inner.filler.clone();
        let bytes = self.inner.slab_bytes;
        let resident_bytes = self.inner.resident_bytes.clone();
        std::thread::Builder::new()
            .name("read-cache-fill".into())
            .stack_size(64 * 1024)
            .spawn(move || filler.run(bytes, &resident_bytes))
            .is_ok()
    }
}

/// One slot of a slab, owned alone: the bytes of a cached chunk.
pub struct ChunkBuf {
    slot: Option<Slot>,
    len: usize,
    pool: Arc<PoolInner>,
}

impl ChunkBuf {
    fn slot(&self) -> &Slot {
        self.slot.as_ref().expect("a ChunkBuf holds its slot until it drops")
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let slot = self.slot();
        // SAFETY: the slot's `len` bytes lie inside its slab (offset + slot size <= slab bytes,
        // and `take` checks len <= slot size), which stays mapped while this buffer holds an
        // Arc of it; this buffer owns the slot alone, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(slot.slab.base.as_ptr().add(slot.offset), self.len) }
    }
}

impl Deref for ChunkBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let slot = self.slot();
        // SAFETY: as in `as_mut_slice`; `&self` rules out a mutable view for this one's lifetime.
        unsafe { std::slice::from_raw_parts(slot.slab.base.as_ptr().add(slot.offset), self.len) }
    }
}

impl Drop for ChunkBuf {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.lock_free().push(slot);
        }
    }
}

impl std::fmt::Debug for ChunkBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkBuf").field("len", &self.len).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Waits until the helper's work shows in the gauge (it runs on its own thread).
    fn settles_at(resident: &Gauge, bytes: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while resident.get() != bytes as u64 {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn slots_are_disjoint_and_come_back() {
        let resident = Arc::new(Gauge::default());
        let pool = ChunkPool::new(16 * 1024, 1 << 30, resident.clone());
        let per_slab = SLAB_BYTES / (16 * 1024);
        let mut bufs: Vec<ChunkBuf> = (0..per_slab).map(|_| pool.take(16 * 1024).expect("mapped")).collect();
        assert!(settles_at(&resident, 2 * SLAB_BYTES), "one slab in use, the next one made ready");
        bufs.push(pool.take(16 * 1024).expect("the ready slab"));
        assert!(settles_at(&resident, 3 * SLAB_BYTES), "the ready slab taken, another made ready");
        for (k, buf) in bufs.iter_mut().enumerate() {
            buf.as_mut_slice().fill(k as u8);
        }
        for (k, buf) in bufs.iter().enumerate() {
            assert!(buf.iter().all(|&b| b == k as u8), "slot {k} was overwritten by another");
        }
        let freed = bufs.remove(3);
        let freed_addr = freed.as_ptr();
        drop(freed);
        let again = pool.take(100).expect("a free slot");
        assert_eq!(again.as_ptr(), freed_addr, "the slot freed last is taken first");
        assert_eq!(again.len(), 100);
        assert_eq!(resident.get(), 3 * SLAB_BYTES as u64, "a freed slot is reused, not a new slab");
        drop(again);
        drop(pool);
        assert!(resident.get() > 0, "slots still in use keep their slab");
        drop(bufs);
        assert!(settles_at(&resident, 0), "the last buffer's drop unmaps every slab, the ready one too");
    }

    #[test]
    fn released_slots_leave_memory_and_come_back_zeroed() {
        let resident = Arc::new(Gauge::default());
        // A cache of one slab (and the helper's spare beside it).
        let pool = ChunkPool::new(16 * 1024, SLAB_BYTES as u64, resident.clone());
        let mut bufs: Vec<ChunkBuf> = (0..8).map(|_| pool.take(16 * 1024).expect("mapped")).collect();
        bufs.iter_mut().for_each(|buf| buf.as_mut_slice().fill(0xa5));
        assert!(settles_at(&resident, 2 * SLAB_BYTES), "its slab and the ready one");
        bufs.truncate(5);
        let free_slots = SLAB_BYTES / (16 * 1024) - 5;
        assert_eq!(pool.release_free(), (free_slots * 16 * 1024) as u64, "every free slot of the slab");
        assert_eq!(resident.get(), (2 * SLAB_BYTES - free_slots * 16 * 1024) as u64);
        assert_eq!(pool.release_free(), 0, "released once");
        let again = pool.take(16 * 1024).expect("a released slot");
        assert!(again.iter().all(|&b| b == 0), "a released slot's pages come back zeroed");
        assert_eq!(resident.get(), (2 * SLAB_BYTES - (free_slots - 1) * 16 * 1024) as u64, "counted again");
        assert!(bufs.iter().all(|buf| buf.iter().all(|&b| b == 0xa5)), "slots in use untouched");
        drop((again, bufs, pool));
        assert!(settles_at(&resident, 0), "every slab unmapped, released slots not counted twice");
    }

    #[test]
    fn new_memory_is_zeroed_and_slots_tile_the_slab() {
        let pool = ChunkPool::new(16 * 1024, 1 << 30, Arc::new(Gauge::default()));
        let bufs: Vec<ChunkBuf> = (0..3).map(|_| pool.take(16 * 1024).expect("mapped")).collect();
        assert!(bufs.iter().all(|buf| buf.iter().all(|&b| b == 0)));
        assert_eq!(bufs[1].as_ptr() as usize - bufs[0].as_ptr() as usize, 16 * 1024);
        assert_eq!(bufs[2].as_ptr() as usize - bufs[1].as_ptr() as usize, 16 * 1024);
    }

    #[test]
    fn a_small_cache_maps_only_what_it_holds_and_a_chunk_can_exceed_a_slab() {
        let resident = Arc::new(Gauge::default());
        let small = ChunkPool::new(4096, 64 * 1024, resident.clone());
        let _small_buf = small.take(4096).expect("mapped");
        assert!(settles_at(&resident, 2 * 64 * 1024), "a 64 KiB slab in use and one ready");
        let big = ChunkPool::new(4 << 20, 1 << 30, resident.clone());
        let mut big_buf = big.take(4 << 20).expect("mapped");
        big_buf.as_mut_slice()[(4 << 20) - 1] = 7;
        assert!(settles_at(&resident, 2 * 64 * 1024 + 2 * (4 << 20)));
    }
}
