//! The pages one VM's overlay holds in memory (its RAM tier, its open spill segment and the
//! segment being written), in a shared mapping of a file, so that they can outlive the process.
//!
//! A server's arena is a pair of files in a memory-backed directory (tmpfs): `NAME.pages`, the
//! 4 KiB pages, and `NAME.slots`, a 16-byte header per page naming the block it holds and the
//! sequence number of the write that put it there (0: free). Stores into a shared mapping are in
//! the page cache the moment they are made, so a process killed at any instruction leaves every
//! finished store behind for the next one to find, with no `msync` and no copy. The simulation
//! and the planner use an arena in a `memfd` that nobody else sees.
//!
//! Whatever the engine holds a page for, it holds a [`Page`]: the handle derefs to the block and
//! gives the page back to the arena when dropped, so ownership works as a `Box` would (evicted
//! RAM pages move into the open segment without a copy, segments go to disk from their pages).
//!
//! A header is written seq first to 0, then the block, then the new seq: a process killed
//! between two of those stores leaves a header that is free or complete, never one naming a
//! block with another block's sequence number.

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::fs::{FallocateFlags, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::crash;
use crate::error::{EngineError, Result};
use crate::units::{Block, BlockIndex, BLOCKS_PER_SEGMENT, BLOCK_SIZE};

const HEADER_BYTES: usize = 16;

/// A backstop beside what the owner asks for ([`Arena::cool_beyond`]): when a page is freed
/// and more than twice this many are free, all but this many are punched out of the file so
/// that their memory goes back, whatever the owner wants. Two segments' worth, what a VM
/// streaming writes has going round (the open segment and the one being written), so frees
/// and takes again at once; one segment's worth was too few (each written segment's pages
/// punched here were faulted back in by the next request). A VM writing requests of 3.5 MiB
/// and more wants more than twice this and still meets it.
const WARM_FREE_PAGES: usize = 2 * BLOCKS_PER_SEGMENT;

/// The file grows this many pages at a time (pages past its end must never be touched).
const GROWTH_PAGES: u32 = BLOCKS_PER_SEGMENT as u32;

/// Pages an arena needs beyond a VM's RAM target: the open segment, the one being written, and
/// the pages of one request being received (32 MiB, the largest request a server takes).
pub const ARENA_SLACK_PAGES: u32 = 2 * BLOCKS_PER_SEGMENT as u32 + (32 << 20) / BLOCK_SIZE as u32;

/// What a page's header says: the block it holds and the sequence number of the write that
/// placed it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub block: BlockIndex,
    pub seq: u64,
}

struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(file: &File, len: usize) -> io::Result<Self> {
        // SAFETY: a fresh mapping at an address the kernel picks, over a file this arena owns;
        // nothing else aliases it. Pages past the file's end are never touched: the file is
        // grown before a page beyond it is handed out.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::NORESERVE,
                file.as_fd(),
                0,
            )
        }?;
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { base, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `new` with this length, and every page and header
        // reference into it is gone: pages hold the arena alive until they are dropped.
        if let Err(error) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) } {
            tracing::warn!(%error, "could not unmap an arena");
        }
    }
}

#[derive(Default)]
struct FreeLists {
    /// Free pages still backed by memory, reused first.
    warm: Vec<u32>,
    /// Free pages punched out of the file.
    cold: Vec<u32>,
    /// Pages below this index have been handed out at least once.
    high_water: u32,
    /// Pages the files are sized for.
    file_pages: u32,
    /// Free pages punched so far: memory given back, which the next allocations fault in again.
    punched: u64,
}

struct Shared {
    pages: Mapping,
    headers: Mapping,
    page_file: File,
    header_file: File,
    capacity: u32,
    free: Mutex<FreeLists>,
    /// Set when the state is to outlive this process: headers are then left as they are when
    /// pages are dropped, and the files stay.
    keep: AtomicBool,
    /// The files, if this arena created them (a memfd has none).
    paths: Option<[PathBuf; 2]>,
    /// `FreeLists::high_water`, for the prefault helper to read without the lock.
    handed_out: Arc<AtomicU32>,
    /// Pages below this are allocated in the page file (handed out, or allocated ahead by the
    /// prefault helper); pages at or above it are holes until someone allocates them.
    backed: Arc<AtomicU32>,
}

// SAFETY: the mappings are plain shared memory. Each page index is owned by one `Page` at a
// time (handed out once by `alloc`, returned by its drop or by `free_all`, which consumes it),
// so no two threads write one page;
// headers are written with atomic stores; the free lists are behind a mutex.
unsafe impl Send for Shared {}
// SAFETY: as for Send: shared access goes through `&Page` (reads) or atomics and the mutex.
unsafe impl Sync for Shared {}

impl Shared {
    /// The page file for the prefault helper, opened anew: a copy of the arena's own
    /// descriptor would share its open file and with it the `flock` of [`Arena::hold`], so a
    /// job still waiting when the VM goes would keep the VM's files held, and the next server
    /// (after a restart in place, or the same name again after a reset) would find them taken.
    /// `None` (no allocation ahead, a slower fill) when it cannot be opened.
    fn helper_descriptor(&self) -> Option<File> {
        if self.paths.is_none() {
            // A memfd: nobody holds it, so a copy holds nothing either.
            return self.page_file.try_clone().ok();
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.page_file);
        // The descriptor's own link reopens this very file, even once renamed or removed.
        match OpenOptions::new().write(true).open(format!("/proc/self/fd/{fd}")) {
            Ok(file) => Some(file),
            Err(error) => {
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    tracing::warn!(%error, "no allocation ahead for RAM tiers (/proc/self/fd cannot be opened): fills are slower");
                }
                None
            }
        }
    }

    fn lists(&self) -> std::sync::MutexGuard<'_, FreeLists> {
        // A panic while holding the lock leaves the lists consistent (each update is one push
        // or pop).
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn header(&self, index: u32, word: usize) -> &AtomicU64 {
        debug_assert!(index < self.capacity);
        let at = index as usize * HEADER_BYTES + word * 8;
        // SAFETY: `at` is inside the header mapping (index below capacity), 8-byte aligned (the
        // mapping is page-aligned, headers are 16 bytes), and only ever accessed atomically.
        unsafe { &*self.headers.base.as_ptr().add(at).cast::<AtomicU64>() }
    }

    fn page_ptr(&self, index: u32) -> *mut Block {
        debug_assert!(index < self.capacity);
        // SAFETY: inside the page mapping, since index is below capacity.
        unsafe { self.pages.base.as_ptr().add(index as usize * BLOCK_SIZE).cast::<Block>() }
    }

    fn set_owner(&self, index: u32, owner: Owner) {
        crash::point();
        self.header(index, 1).store(0, Ordering::Release);
        crash::point();
        self.header(index, 0).store(owner.block.0, Ordering::Release);
        crash::point();
        self.header(index, 1).store(owner.seq, Ordering::Release);
    }

    /// Maps pages `from..to` (never handed out, inside the file) into the page mapping at once,
    /// writable: the VM's first store into each then takes no page fault. One call per growth
    /// step costs less than the step's 512 faults (no trap per page) and leaves the requests
    /// that would have taken them without it: 4 KiB random writes into a RAM tier still filling
    /// took a fault each, the tail of their latency at queue depth 1. Populating changes no
    /// byte; a kernel without `MADV_POPULATE_WRITE` (before 5.14) refuses it, and the VM faults
    /// as before.
    fn map_in(&self, from: u32, to: u32) {
        let to = to.min(self.capacity);
        if from >= to {
            return;
        }
        let len = (to - from) as usize * BLOCK_SIZE;
        // SAFETY: `from..to` is inside the page mapping (below capacity) and the file (the
        // caller's bound), and populating only faults pages in without touching their bytes.
        let populated =
            unsafe { rustix::mm::madvise(self.page_ptr(from).cast(), len, rustix::mm::Advice::LinuxPopulateWrite) };
        if let Err(error) = populated {
            tracing::debug!(%error, "could not map arena pages in ahead");
        }
    }

    fn owner(&self, index: u32) -> Option<Owner> {
        let seq = self.header(index, 1).load(Ordering::Acquire);
        (seq != 0).then(|| Owner { block: BlockIndex(self.header(index, 0).load(Ordering::Acquire)), seq })
    }

    /// The pages among the first `found` whose headers name a block, in index order.
    fn owners(&self, found: u32) -> Vec<(u32, Owner)> {
        (0..found).filter_map(|index| self.owner(index).map(|owner| (index, owner))).collect()
    }

    fn grow_to(&self, lists: &mut FreeLists, pages: u32) -> io::Result<()> {
        let pages = pages.min(self.capacity);
        self.page_file.set_len(u64::from(pages) * BLOCK_SIZE as u64)?;
        let (old, new) = ((lists.file_pages as usize * HEADER_BYTES) as u64, (pages as usize * HEADER_BYTES) as u64);
        self.header_file.set_len(new)?;
        // The headers are stored through the mapping: allocated here, where a full filesystem
        // is an error, not on the store, where it is SIGBUS for the whole process.
        if new > old {
            rustix::fs::fallocate(&self.header_file, FallocateFlags::empty(), old, new - old)?;
        }
        lists.file_pages = pages;
        Ok(())
    }

    /// Allocates pages `from..to` of the page file, unless already done. A store through the
    /// mapping into a page the filesystem has no room for kills the process with SIGBUS (a
    /// tmpfs at its size, every VM of the server with it); allocated first, the page is an
    /// error for the one VM that wanted it.
    fn allocate(&self, from: u32, to: u32) -> Result<()> {
        allocate_pages(&self.page_file, from, to)
            .map_err(|e| EngineError::from_io("allocating pages in the memory directory", e.into()))
    }

    fn release(&self, indexes: &[u32]) {
        if self.keep.load(Ordering::Relaxed) {
            // The pages are state for the next process, not free: their headers and bytes stay.
            return;
        }
        for &index in indexes {
            crash::point();
            self.header(index, 1).store(0, Ordering::Release);
        }
        let mut lists = self.lists();
        lists.warm.extend_from_slice(indexes);
        if lists.warm.len() > 2 * WARM_FREE_PAGES {
            self.cool(&mut lists, WARM_FREE_PAGES);
        }
    }

    /// Punches the free pages beyond `keep` warm ones, the highest first in line, in runs.
    fn cool(&self, lists: &mut FreeLists, keep: usize) {
        lists.warm.sort_unstable_by(|a, b| b.cmp(a));
        let excess = lists.warm.len() - keep;
        let mut cooling: Vec<u32> = lists.warm.drain(..excess).collect();
        cooling.reverse();
        for run in cooling.chunk_by(|a, b| b == &(a + 1)) {
            let offset = u64::from(run[0]) * BLOCK_SIZE as u64;
            let len = (run.len() * BLOCK_SIZE) as u64;
            let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
            if let Err(error) = rustix::fs::fallocate(&self.page_file, flags, offset, len) {
                // The pages stay in memory, reusable; only the host waits longer for them.
                tracing::debug!(%error, "could not punch free arena pages");
            }
        }
        lists.punched += cooling.len() as u64;
        lists.cold.extend(cooling);
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(paths) = &self.paths {
            if !self.keep.load(Ordering::Relaxed) {
                for path in paths {
                    if let Err(error) = std::fs::remove_file(path) {
                        tracing::warn!(path = %path.display(), %error, "could not remove arena file");
                    }
                }
            }
        }
    }
}

/// Puts pages `from..to` of an arena's file in memory from a helper thread, ahead of the VM.
///
/// A first store into a page of a shared file mapping that is a hole allocates and clears the
/// page inside the fault, on the VM's request path: perf showed `shmem_fault` at about 16 % of
/// the connection thread's time on 4 KiB random writes into a RAM tier that is still filling,
/// which ran at half nbdkit memory's rate at queue depth 8. Allocated ahead (`fallocate` keeps
/// the bytes of any page that is already there, so racing the VM is harmless), the fault finds
/// the page in the file and only clears and maps it (tmpfs clears a page allocated this way at
/// its first fault, not before). At most two growth steps (4 MiB) per VM are ready and not yet
/// handed out.
fn prefault(shared: &Arc<Shared>, from: u32, to: u32) {
    // The job holds its own descriptor of the file, not the arena: an arena that goes while its
    // job waits must go at once, its files with it (a VM's clean end removes them).
    type Job = (File, Arc<AtomicU32>, Arc<AtomicU32>, u32, u32);
    static HELPER: std::sync::OnceLock<Option<Mutex<std::sync::mpsc::Sender<Job>>>> = std::sync::OnceLock::new();
    if from >= to {
        return;
    }
    let helper = HELPER.get_or_init(|| {
        let (send, receive) = std::sync::mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new().name("arena-prefault".into()).spawn(move || {
            // As the read cache's helper: at normal priority it would take the core a VM's
            // request is waiting for.
            let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19);
            for (file, handed_out, backed, from, to) in receive {
                allocate_ahead(&file, &handed_out, &backed, from, to);
            }
        });
        spawned.ok().map(|_| Mutex::new(send))
    });
    if let (Some(sender), Some(file)) = (helper, shared.helper_descriptor()) {
        let job = (file, Arc::clone(&shared.handed_out), Arc::clone(&shared.backed), from, to);
        let _ = sender.lock().unwrap_or_else(PoisonError::into_inner).send(job);
    }
}

/// The helper's part of [`prefault`]: allocates the pages of `from..to` the VM has not been
/// handed yet. The helper runs at the lowest priority, so a busy VM may have taken some of the
/// range, freed them and had them punched out (memory given back) before it gets there; an
/// allocation of those would put memory back that the arena counts as given back. Pages the
/// VM takes between the load below and the call are still allocated: a window of microseconds,
/// where it was the helper's whole wait. Once they are allocated, `backed` covers them if it
/// reached `from` (the pages below were handed out, hence allocated): the VM need not.
fn allocate_ahead(file: &File, handed_out: &AtomicU32, backed: &AtomicU32, from: u32, to: u32) {
    let from = from.max(handed_out.load(Ordering::Relaxed));
    if from >= to {
        return;
    }
    match allocate_pages(file, from, to) {
        Ok(()) => {
            let _ = backed.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| (b >= from && b < to).then_some(to));
        }
        Err(error) => tracing::debug!(%error, "could not allocate arena pages ahead"),
    }
}

/// Allocates pages `from..to` of a page file (keeping what is there). Pages past the file's end
/// are allocated without growing it: the VM grows the file when it gets there, and finds them.
fn allocate_pages(file: &File, from: u32, to: u32) -> rustix::io::Result<()> {
    let offset = u64::from(from) * BLOCK_SIZE as u64;
    let len = u64::from(to - from) * BLOCK_SIZE as u64;
    rustix::fs::fallocate(file, FallocateFlags::KEEP_SIZE, offset, len)
}

/// How many pages a pair of arena files holds whole: as many as both are long enough for (a
/// process killed while growing them leaves one longer than the other).
fn pages_in(pages: &File, headers: &File) -> Result<u32> {
    let len = |file: &File| file.metadata().map(|m| m.len());
    let (page_bytes, header_bytes) = len(pages)
        .and_then(|p| Ok((p, len(headers)?)))
        .map_err(|e| EngineError::from_io("reading an arena's size", e))?;
    let found = (page_bytes / BLOCK_SIZE as u64).min(header_bytes / HEADER_BYTES as u64);
    u32::try_from(found).map_err(|_| EngineError::Config("an arena file is too large".into()))
}

/// A VM's page arena; clones share it.
#[derive(Clone)]
pub struct Arena(Arc<Shared>);

/// A page found in use by [`Arena::open`], with what its header says.
pub struct LivePage {
    pub page: Page,
    pub owner: Owner,
}

impl Arena {
    /// An arena in a `memfd`: private to this process, gone with it.
    pub fn in_memory(capacity_pages: u32) -> Result<Self> {
        let create =
            |name: &str| -> io::Result<File> { Ok(File::from(rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)?)) };
        let files = create("overspill-pages").and_then(|pages| Ok((pages, create("overspill-slots")?)));
        let (pages, headers) = files.map_err(|e| EngineError::from_io("creating a memory arena", e))?;
        Self::map(pages, headers, capacity_pages, None, 0)
    }

    /// An arena in `dir/NAME.pages` and `dir/NAME.slots`, which must not exist yet (they could
    /// belong to a live VM).
    pub fn create(dir: &Path, name: &str, capacity_pages: u32) -> Result<Self> {
        let paths = Self::paths(dir, name);
        let create = |path: &Path| OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path);
        let pages = create(&paths[0]).map_err(|e| EngineError::from_io("creating an arena file", e))?;
        let headers = match create(&paths[1]) {
            Ok(file) => file,
            Err(error) => {
                let _ = std::fs::remove_file(&paths[0]);
                return Err(EngineError::from_io("creating an arena file", error));
            }
        };
        Self::map(pages, headers, capacity_pages, Some(paths), 0)
    }

    /// Opens the arena a previous process left in `dir` under `name`, with the pages its
    /// headers say are in use. Files made by an earlier process are this VM's state: the arena
    /// is kept (pages dropped keep their headers, the files stay) until [`Self::own`], so that a
    /// recovery that fails part-way leaves the state as it found it.
    pub fn open(dir: &Path, name: &str, capacity_pages: u32) -> Result<(Self, Vec<LivePage>)> {
        let paths = Self::paths(dir, name);
        let open = |path: &Path| OpenOptions::new().read(true).write(true).open(path);
        let files = open(&paths[0]).and_then(|pages| Ok((pages, open(&paths[1])?)));
        let (pages, headers) = files.map_err(|e| EngineError::from_io("opening an arena file", e))?;
        let found = pages_in(&pages, &headers)?;
        // Headers of pages never handed out may be holes: allocated now, as `grow_to` does.
        if found > 0 {
            rustix::fs::fallocate(&headers, FallocateFlags::empty(), 0, (found as usize * HEADER_BYTES) as u64)
                .map_err(|e| EngineError::from_io("allocating an arena's headers", e.into()))?;
        }
        let arena = Self::map(pages, headers, capacity_pages.max(found), Some(paths), found)?;
        arena.keep();
        let live = arena.0.owners(found);
        {
            let mut lists = arena.0.lists();
            let mut live = live.iter().map(|(index, _)| *index).peekable();
            for index in 0..found {
                if live.next_if_eq(&index).is_none() {
                    lists.warm.push(index);
                }
            }
            lists.high_water = found;
            arena.0.handed_out.store(found, Ordering::Relaxed);
            // The last process's free pages still hold its dead bytes in memory: give them back
            // now, not whenever this VM happens to reuse them.
            arena.0.cool(&mut lists, 0);
        }
        let live = live
            .into_iter()
            .map(|(index, owner)| LivePage { page: Page { index, arena: Arc::clone(&arena.0) }, owner })
            .collect();
        Ok((arena, live))
    }

    /// Removes what `create` would make under `name` in `dir`, if it is there.
    pub fn remove_files(dir: &Path, name: &str) -> io::Result<()> {
        for path in Self::paths(dir, name) {
            match std::fs::remove_file(&path) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
                _ => {}
            }
        }
        Ok(())
    }

    pub fn exists(dir: &Path, name: &str) -> bool {
        Self::paths(dir, name).iter().any(|path| path.exists())
    }

    fn paths(dir: &Path, name: &str) -> [PathBuf; 2] {
        [dir.join(format!("{name}.pages")), dir.join(format!("{name}.slots"))]
    }

    fn map(page_file: File, header_file: File, capacity: u32, paths: Option<[PathBuf; 2]>, found: u32) -> Result<Self> {
        let capacity = capacity.max(1);
        let mapped = Mapping::new(&page_file, capacity as usize * BLOCK_SIZE)
            .and_then(|pages| Ok((pages, Mapping::new(&header_file, capacity as usize * HEADER_BYTES)?)));
        let (pages, headers) = mapped.map_err(|e| EngineError::from_io("mapping a memory arena", e))?;
        let shared = Shared {
            pages,
            headers,
            page_file,
            header_file,
            capacity,
            free: Mutex::new(FreeLists { file_pages: found, ..FreeLists::default() }),
            keep: AtomicBool::new(false),
            paths,
            handed_out: Arc::new(AtomicU32::new(0)),
            backed: Arc::new(AtomicU32::new(found)),
        };
        Ok(Self(Arc::new(shared)))
    }

    /// A free page, holding whatever it held before.
    pub fn alloc(&self) -> Result<Page> {
        let mut lists = self.0.lists();
        self.alloc_locked(&mut lists)
    }

    /// Frees pages with the lists locked once: a written segment's 512 (dropped, each page
    /// locks them once). A page of another arena is freed as dropped.
    pub fn free_all(&self, pages: Vec<Page>) {
        let mut indexes = Vec::with_capacity(pages.len());
        for mut page in pages {
            if Arc::ptr_eq(&page.arena, &self.0) {
                indexes.push(page.index);
                page.index = FREED;
            }
        }
        self.0.release(&indexes);
    }

    /// `count` free pages, the lists locked once (a 1 MiB write takes 256). On error none is
    /// taken.
    pub fn alloc_many(&self, count: usize) -> Result<Vec<Page>> {
        // Before the lock, so that a panic drops the lock first: a page dropped takes it.
        let mut pages = Vec::with_capacity(count);
        let mut lists = self.0.lists();
        for _ in 0..count {
            match self.alloc_locked(&mut lists) {
                Ok(page) => pages.push(page),
                Err(error) => {
                    // The pages go back through the lists: unlock them first.
                    drop(lists);
                    drop(pages);
                    return Err(error);
                }
            }
        }
        Ok(pages)
    }

    fn alloc_locked(&self, lists: &mut FreeLists) -> Result<Page> {
        let shared = &self.0;
        let index = match lists.warm.pop() {
            Some(index) => index,
            // Punched: a hole again.
            None if !lists.cold.is_empty() => {
                let index = lists.cold[lists.cold.len() - 1];
                shared.allocate(index, index + 1)?;
                lists.cold.pop();
                index
            }
            None => {
                let index = lists.high_water;
                if index >= shared.capacity {
                    return Err(EngineError::NoSpace(format!(
                        "the VM's memory arena of {} pages is full",
                        shared.capacity
                    )));
                }
                if index >= lists.file_pages {
                    let pages = lists.file_pages.saturating_add(GROWTH_PAGES.max(lists.file_pages / 4));
                    shared.grow_to(lists, pages).map_err(|e| EngineError::from_io("growing a memory arena", e))?;
                }
                if index >= shared.backed.load(Ordering::Relaxed) {
                    // The helper has not got here (or could not): this step, now.
                    let to = (index + GROWTH_PAGES).min(shared.capacity);
                    shared.allocate(index, to)?;
                    shared.backed.fetch_max(to, Ordering::Relaxed);
                }
                lists.high_water += 1;
                shared.handed_out.store(lists.high_water, Ordering::Relaxed);
                if index.is_multiple_of(GROWTH_PAGES) {
                    // Entering a fresh step: have the one after it made ready (the first time,
                    // this one too).
                    let from = if index == 0 { 0 } else { index + GROWTH_PAGES };
                    prefault(shared, from, (index + 2 * GROWTH_PAGES).min(shared.capacity));
                    shared.map_in(index, (index + GROWTH_PAGES).min(lists.file_pages));
                }
                index
            }
        };
        Ok(Page { index, arena: Arc::clone(shared) })
    }

    /// Gives the memory of free pages beyond `keep` back (they stay the arena's, as holes), once
    /// more than `keep + slack` are free: the owner knows how many it will take again soon, and
    /// free pages it keeps are memory it holds. Returns how many free pages stay in memory.
    pub fn cool_beyond(&self, keep: usize, slack: usize) -> usize {
        let mut lists = self.0.lists();
        if lists.warm.len() > keep + slack {
            self.0.cool(&mut lists, keep);
        }
        lists.warm.len()
    }

    /// Free pages punched out of the file since the arena was made.
    pub fn pages_punched(&self) -> u64 {
        self.0.lists().punched
    }

    /// Pages in memory: handed out, or free and not punched (pages allocated ahead and never
    /// handed out are not counted: nothing has touched them).
    pub fn resident_pages(&self) -> u64 {
        let lists = self.0.lists();
        u64::from(lists.high_water) - lists.cold.len() as u64
    }

    /// A free page holding a copy of `data`.
    pub fn alloc_copy(&self, data: &Block) -> Result<Page> {
        let mut page = self.alloc()?;
        page.copy_from_slice(data);
        Ok(page)
    }

    /// From now on the arena's state outlives it: dropped pages keep their headers, and the
    /// files stay when the arena goes.
    pub fn keep(&self) {
        self.0.keep.store(true, Ordering::Relaxed);
    }

    /// Holds the arena's files for this process while they are open (see
    /// [`crate::store::hold`]); nothing for an arena without files.
    pub fn hold(&self) -> io::Result<()> {
        let Some([pages, headers]) = &self.0.paths else { return Ok(()) };
        crate::store::hold(&self.0.page_file, pages)?;
        crate::store::hold(&self.0.header_file, headers)
    }

    /// Undoes [`Self::keep`]: pages dropped from now on are free, and the files go with the
    /// arena.
    pub fn own(&self) {
        self.0.keep.store(false, Ordering::Relaxed);
    }

    /// Whether the arena is kept past its end (see [`Self::keep`]).
    pub fn is_kept(&self) -> bool {
        self.0.keep.load(Ordering::Relaxed)
    }

    /// Pages the files have room for: the memory the arena may hold at most, free pages kept
    /// warm included.
    pub fn file_pages(&self) -> u32 {
        self.0.lists().file_pages
    }

    pub fn capacity(&self) -> u32 {
        self.0.capacity
    }

    /// What [`Self::open`] would find if this process were killed now: each page in use with
    /// its header and the first 16 bytes it holds. For the crash simulation, which calls it
    /// from a crash point, where no reference into a page is being written through.
    #[cfg(feature = "crash-points")]
    pub fn crash_image(&self) -> Result<Vec<(Owner, [u8; 16])>> {
        let shared = &self.0;
        let found = pages_in(&shared.page_file, &shared.header_file)?;
        Ok(shared
            .owners(found)
            .into_iter()
            .map(|(index, owner)| {
                let mut prefix = [0u8; 16];
                // SAFETY: the page is inside the mapping and the file (index below `found`); a
                // crash point is reached between stores, with no `&mut` to a page alive, so
                // these bytes are not being written while they are read.
                unsafe { std::ptr::copy_nonoverlapping(shared.page_ptr(index).cast::<u8>(), prefix.as_mut_ptr(), 16) };
                (owner, prefix)
            })
            .collect())
    }
}

/// One page of an arena, owned like a `Box<Block>`: dropping it frees the page.
pub struct Page {
    index: u32,
    arena: Arc<Shared>,
}

impl Page {
    /// Says in the page's header which block it holds since which write; what a recovery
    /// finds.
    pub fn set_owner(&self, owner: Owner) {
        self.arena.set_owner(self.index, owner);
    }

    pub fn owner(&self) -> Option<Owner> {
        self.arena.owner(self.index)
    }

    pub fn index(&self) -> u32 {
        self.index
    }
}

impl Deref for Page {
    type Target = Block;

    fn deref(&self) -> &Block {
        // SAFETY: the page is inside the mapping and within the file (grown before it was handed
        // out), and this handle is its only owner: writes need `&mut self`.
        unsafe { &*self.arena.page_ptr(self.index) }
    }
}

impl DerefMut for Page {
    fn deref_mut(&mut self) -> &mut Block {
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference.
        unsafe { &mut *self.arena.page_ptr(self.index) }
    }
}

/// The index of a page handle whose page [`Arena::free_all`] freed: its drop frees nothing.
const FREED: u32 = u32::MAX;

impl Drop for Page {
    fn drop(&mut self) {
        if self.index != FREED {
            self.arena.release(&[self.index]);
        }
    }
}

impl std::fmt::Debug for Page {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Page({})", self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefault_job_still_waiting_does_not_hold_the_files_of_an_arena_gone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arena = Arena::create(dir.path(), "vm", 1024).expect("arena");
        arena.hold().expect("holding the arena");
        let waiting_job = arena.0.helper_descriptor().expect("the helper's descriptor");
        arena.keep();
        drop(arena);
        let pages = dir.path().join("vm.pages");
        assert_eq!(crate::store::held(&pages), Some(false), "the helper's descriptor holds the page file");
        // It is the same file all the same: an allocation ahead lands in the VM's pages.
        allocate_pages(&waiting_job, 0, 1).expect("allocating through the helper's descriptor");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(waiting_job.metadata().expect("metadata").ino(), pages.metadata().expect("metadata").ino());
    }

    #[test]
    fn pages_and_their_owners_outlive_the_arena_that_kept_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let arena = Arena::create(dir.path(), "vm", 1024).expect("arena");
        let mut pages = Vec::new();
        for i in 0..600u64 {
            let mut page = arena.alloc().expect("page");
            page.fill(i as u8);
            page.set_owner(Owner { block: BlockIndex(i * 3), seq: i + 1 });
            pages.push(page);
        }
        // A page freed before the end is free afterwards too, and its bytes are given back.
        let freed = pages.swap_remove(5);
        let freed_at = u64::from(freed.index) * BLOCK_SIZE as u64;
        drop(freed);
        arena.keep();
        drop(pages);
        drop(arena);
        let (arena, live) = Arena::open(dir.path(), "vm", 1024).expect("reopened");
        assert_eq!(live.len(), 599);
        for LivePage { page, owner } in &live {
            let i = owner.seq - 1;
            assert_eq!(owner.block, BlockIndex(i * 3));
            assert!(page.iter().all(|&b| b == i as u8), "page of block {} kept its bytes", owner.block.0);
        }
        assert!(!live.iter().any(|live| live.owner.seq == 6));
        let mut bytes = vec![1u8; BLOCK_SIZE];
        let file = File::open(dir.path().join("vm.pages")).expect("page file");
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut bytes, freed_at).expect("read");
        assert!(bytes.iter().all(|&b| b == 0), "the free page still holds the last process's bytes");
        assert_eq!(arena.resident_pages(), 599);
        // Opened, it is kept until owned: dropping it now would leave everything.
        assert!(arena.is_kept());
        arena.own();
        drop(live);
        drop(arena);
        assert!(!Arena::exists(dir.path(), "vm"));
    }

    #[test]
    fn freed_pages_are_reused_and_the_excess_punched() {
        let arena = Arena::in_memory(8192).expect("arena");
        let pages: Vec<Page> = (0..4 * WARM_FREE_PAGES).map(|_| arena.alloc().expect("page")).collect();
        let grown = arena.file_pages();
        drop(pages);
        assert!(arena.0.lists().warm.len() <= 2 * WARM_FREE_PAGES);
        let again: Vec<Page> = (0..4 * WARM_FREE_PAGES).map(|_| arena.alloc().expect("page")).collect();
        assert_eq!(arena.file_pages(), grown, "reused, not grown");
        assert!(again.iter().all(|page| page.owner().is_none()), "freed pages have no owner");
        let full = Arena::in_memory(2).expect("arena");
        assert!(matches!(full.alloc_many(3), Err(EngineError::NoSpace(_))), "three pages of two");
        let _two = full.alloc_many(2).expect("the two pages, none kept by the refused three");
        assert!(matches!(full.alloc(), Err(EngineError::NoSpace(_))));
    }

    #[test]
    fn pages_freed_together_come_back_each_to_its_own_arena_and_lose_their_owners() {
        let (one, other) = (Arena::in_memory(4).expect("arena"), Arena::in_memory(1).expect("arena"));
        let mut pages = one.alloc_many(4).expect("four pages");
        for (i, page) in pages.iter().enumerate() {
            page.set_owner(Owner { block: BlockIndex(i as u64), seq: i as u64 + 1 });
        }
        pages.push(other.alloc().expect("the other arena's page"));
        assert!(matches!(one.alloc(), Err(EngineError::NoSpace(_))), "full before");
        one.free_all(pages);
        let again = one.alloc_many(4).expect("all four pages free again");
        assert!(again.iter().all(|page| page.owner().is_none()), "freed pages have no owner");
        assert!(matches!(one.alloc(), Err(EngineError::NoSpace(_))), "the other arena's page did not join this one");
        let _back = other.alloc().expect("the other arena's page is free in its own arena");
    }

    #[test]
    fn pages_allocated_ahead_skip_those_the_vm_was_handed_already() {
        let file: File = rustix::fs::memfd_create("ahead", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd").into();
        file.set_len(200 * BLOCK_SIZE as u64).expect("size");
        // The VM took pages 0..120 (then freed them, and they were punched) before the helper
        // came to a job for 0..200.
        let backed = AtomicU32::new(120);
        allocate_ahead(&file, &AtomicU32::new(120), &backed, 0, 200);
        let sectors = rustix::fs::fstat(&file).expect("fstat").st_blocks as u64;
        assert_eq!(sectors * 512, 80 * BLOCK_SIZE as u64, "only the 80 pages not handed out are allocated");
        assert_eq!(backed.load(Ordering::Relaxed), 200, "the VM need not allocate them itself");
        allocate_ahead(&file, &AtomicU32::new(250), &backed, 0, 200);
        assert_eq!(rustix::fs::fstat(&file).expect("fstat").st_blocks as u64, sectors, "nothing left to allocate");
        // A job beyond pages nobody allocated does not vouch for them.
        let short = AtomicU32::new(50);
        allocate_ahead(&file, &AtomicU32::new(50), &short, 100, 150);
        assert_eq!(short.load(Ordering::Relaxed), 50);
    }

    /// Every page handed out is allocated in the file first (a store into a hole of a full tmpfs
    /// is SIGBUS for the process): fresh pages whether or not the helper got there, and pages
    /// punched out and handed out again.
    #[test]
    fn pages_are_allocated_in_the_file_before_they_are_handed_out() {
        let arena = Arena::in_memory(4 * GROWTH_PAGES).expect("arena");
        // Pages the memfd has (its blocks), once the prefault helper is done with its jobs.
        let settled = || {
            let blocks = || rustix::fs::fstat(&arena.0.page_file).expect("fstat").st_blocks as u64 * 512;
            let mut last = blocks();
            loop {
                std::thread::sleep(std::time::Duration::from_millis(50));
                let now = blocks();
                if now == last {
                    return now / BLOCK_SIZE as u64;
                }
                last = now;
            }
        };
        let pages = arena.alloc_many(GROWTH_PAGES as usize + 1).expect("pages");
        assert!(settled() > u64::from(GROWTH_PAGES));
        // Freed and punched, then handed out again: allocated one by one as they go.
        drop(pages);
        arena.cool_beyond(0, 0);
        assert_eq!(arena.pages_punched(), u64::from(GROWTH_PAGES) + 1);
        let punched = settled();
        let again = arena.alloc_many(10).expect("pages");
        assert_eq!(settled(), punched + 10, "punched pages handed out again as holes");
        drop(again);
    }

    /// This thread's minor page faults so far (`/proc/thread-self/stat`, field 10).
    fn minor_faults() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("stat");
        // The fields after the command name, which is in parentheses and may hold spaces.
        let after = &stat[stat.rfind(')').expect("comm") + 2..];
        after.split(' ').nth(7).and_then(|f| f.parse().ok()).expect("minflt")
    }

    /// A fresh growth step's pages are mapped in when the VM enters it: its stores into them
    /// take no page fault each (the tail of a 4 KiB write's latency while a RAM tier fills).
    #[test]
    fn a_fresh_steps_pages_are_mapped_in_before_the_vm_stores_into_them() {
        let arena = Arena::in_memory(4 * GROWTH_PAGES).expect("arena");
        let first = arena.alloc().expect("the step's first page");
        let before = minor_faults();
        let mut rest = arena.alloc_many(GROWTH_PAGES as usize - 1).expect("the step's other pages");
        for page in &mut rest {
            page[0] = 1;
        }
        let faults = minor_faults() - before;
        // The Vec of pages and the stack fault a few; a fault per page would be 511.
        assert!(faults < u64::from(GROWTH_PAGES) / 8, "{faults} faults storing into {} fresh pages", rest.len());
        drop((first, rest));
    }
}
