//! Files that live exactly as long as one overlay: the spill log and the in-place cache files.
//!
//! [`BackingFile`] is the seam where simulations inject faults; [`ScratchFile`] is the real one.
//! Nothing here ever syncs: the cache is thrown away with the VM, so durability across a host
//! crash buys nothing and would cost a flush per block.
//!
//! A spill segment is the 512 pages it holds ([`SegmentPages`]): blocks evicted from RAM move into
//! it without a copy, and it goes to disk in order from its offset, 2 MiB back to back (vectored
//! writes of 256 KiB, see [`PAGES_PER_WRITE_CALL`]). Whole segments go through
//! [`BackingFile::start_segment_write`], which by default writes before it returns (simulations
//! stay deterministic). A server's [`ScratchFile`] instead writes them from a thread of their
//! own: the 2 MiB copy into the page cache took a quarter of a spilling VM's request thread
//! (perf, 4K random writes at QD32), and now runs beside it. The pages of segments being written
//! belong to the host, not to a VM: [`SegmentWriters`] lets a few writes run at a time, so a host
//! of hundreds of spilling VMs holds their open segments' pages plus a fixed few segments.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice};
use std::ops::{Deref, DerefMut};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};

use overspill_block::limit::{admit, SystemClock};
use overspill_block::{Limiter, Limits};
use rustix::fs::{FallocateFlags, OFlags};

use crate::arena::Page;
use crate::error::is_no_space;
use crate::units::{BLOCK_SIZE, SEGMENT_BYTES};

/// A spill segment's blocks, slot by slot, each in the page it was received into or kept in RAM.
pub type SegmentPages = Vec<Page>;

pub trait BackingFile: Send {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()>;
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Gives the range's space back to the filesystem; it reads as zeroes afterwards.
    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()>;
    /// Bytes the filesystem has allocated for the file (what `du` shows).
    fn allocated_bytes(&self) -> io::Result<u64>;
    fn path(&self) -> Option<&Path>;

    /// The file is to outlive this handle (a VM's state, kept for the next process): dropping
    /// the handle leaves it where it is.
    fn keep(&mut self) {}

    /// Undoes [`Self::keep`]: the file is this handle's again, and goes with it.
    fn own(&mut self) {}

    /// The byte ranges that hold data, as `[start, end)`, in order; holes (never written, or
    /// punched) are left out. What rebuilds an in-place cache file's block map after a restart.
    fn data_ranges(&mut self) -> io::Result<Vec<(u64, u64)>> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this file cannot tell its data from its holes"))
    }

    /// How many times a file on the same filesystem as this one (as far as the host knows)
    /// was refused space. A spill log that sees the count move gives back the dead segments it
    /// keeps allocated for reuse, so that a VM out of space is not refused while others hold
    /// space they do not need.
    fn space_shortages(&self) -> u64 {
        0
    }

    /// Writes a segment's pages one after another from `offset`. The default gathers them into
    /// one buffer and calls `write_at` once (simulations and fault injection see one write per
    /// segment); a real file writes them with vectored writes, in order.
    fn write_pages_at(&mut self, pages: &[Page], offset: u64) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(pages.len() * BLOCK_SIZE);
        for page in pages {
            bytes.extend_from_slice(&page[..]);
        }
        self.write_at(&bytes, offset)
    }

    /// Starts writing a whole spill segment at `offset`. The default writes it before returning;
    /// a file may instead finish in the background, keeping its own reference to the pages
    /// until then. The caller must not write to the range again before the write has finished.
    fn start_segment_write(&mut self, pages: &Arc<SegmentPages>, offset: u64) -> SegmentWrite {
        SegmentWrite::finished(self.write_pages_at(pages, offset))
    }
}

/// The host's background segment writes: at most `max_in_flight` at a time (a VM that seals a
/// segment when all are busy writes it itself, as if there were none). Memory beyond the VMs'
/// own open segments is thus at most `max_in_flight` segments of 2 MiB being written (and as
/// many aligned buffers for `O_DIRECT` writes), whatever the number of VMs.
///
/// The writes run on up to `max_in_flight` threads that live as long as this (started as they
/// are first needed), each taking the next segment from a queue. A thread per segment cost its
/// spawn and its end (`clone3`, the stack and signal stack mapped and unmapped) for every 2 MiB:
/// 6 % of a spilling VM's server time on 1 MiB sequential writes (perf).
///
/// Every segment write, in the background or in line, passes the host's spill budget
/// ([`Self::budget`], no limit until one is set) first: bytes a second for all VMs' spill
/// writes together, so that the spill disk never takes more than the budget lets through. A
/// writer waits for the budget holding its place; a segment sealed while every writer is busy
/// (waiting, under a tight budget) is written in the VM's own thread, which then waits too.
pub struct SegmentWriters {
    max_in_flight: usize,
    budget: Arc<Limiter>,
    in_flight: AtomicUsize,
    /// Page-aligned buffers that `O_DIRECT` writes gather segments into, kept for the next.
    aligned: Mutex<Vec<AlignedSegment>>,
    /// The queue the writer threads take segments from, and how many threads there are.
    jobs: Mutex<WriterQueue>,
}

type WriterJob = Box<dyn FnOnce() + Send>;

struct WriterQueue {
    send: mpsc::Sender<WriterJob>,
    /// Taken by the threads, one at a time; they end when the sender goes with `SegmentWriters`.
    receive: Arc<Mutex<mpsc::Receiver<WriterJob>>>,
    threads: usize,
}

impl std::fmt::Debug for SegmentWriters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentWriters")
            .field("max_in_flight", &self.max_in_flight)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl SegmentWriters {
    pub fn new(max_in_flight: usize) -> Arc<Self> {
        let (send, receive) = mpsc::channel();
        let jobs = WriterQueue { send, receive: Arc::new(Mutex::new(receive)), threads: 0 };
        Arc::new(Self {
            max_in_flight,
            budget: Limiter::new(Limits::default(), SystemClock::shared()),
            in_flight: Default::default(),
            aligned: Default::default(),
            jobs: Mutex::new(jobs),
        })
    }

    /// Hands `job` to a writer thread, starting one if fewer run than writes may be in flight.
    /// Called with a permit from [`Self::try_start`]. On error (no thread could be started and
    /// none runs) the job comes back, for the caller to run itself.
    fn run(&self, job: WriterJob) -> Result<(), WriterJob> {
        // A panic while holding the lock leaves a sender and a count: still usable.
        let mut queue = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        if queue.threads < self.max_in_flight {
            let receive = Arc::clone(&queue.receive);
            let spawned =
                std::thread::Builder::new().name("spill-writer".into()).stack_size(64 * 1024).spawn(move || loop {
                    let job = receive.lock().unwrap_or_else(PoisonError::into_inner).recv();
                    match job {
                        Ok(job) => job(),
                        Err(mpsc::RecvError) => return,
                    }
                });
            match spawned {
                Ok(_) => queue.threads += 1,
                Err(error) if queue.threads == 0 => {
                    tracing::debug!(%error, "no spill writer thread; writing in the request's thread");
                    return Err(job);
                }
                Err(error) => tracing::debug!(%error, "no more spill writer threads; queueing for those there are"),
            }
        }
        queue.send.send(job).map_err(|mpsc::SendError(job)| job)
    }

    /// The host's spill budget, shared by every segment write: set its limits live.
    pub fn budget(&self) -> &Arc<Limiter> {
        &self.budget
    }

    /// Waits, in the calling thread, until the spill budget lets `bytes` more be written.
    fn pace(&self, bytes: usize) {
        admit(std::slice::from_ref(&self.budget), bytes as u64);
    }

    fn try_start(&self) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max_in_flight).then_some(n + 1))
            .is_ok()
    }

    fn finished(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    fn aligned(&self) -> MutexGuard<'_, Vec<AlignedSegment>> {
        // A panic while holding the lock leaves only a vector of buffers behind: still usable.
        self.aligned.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take_aligned(&self) -> io::Result<AlignedSegment> {
        match self.aligned().pop() {
            Some(buffer) => Ok(buffer),
            None => AlignedSegment::new(),
        }
    }

    fn give_aligned(&self, buffer: AlignedSegment) {
        let mut pool = self.aligned();
        if pool.len() < self.max_in_flight {
            pool.push(buffer);
        }
    }
}

/// The host's count of ENOSPC from its scratch files' filesystem, shared by the files given it
/// with [`ScratchFile::with_space_shortages`].
#[derive(Debug, Default)]
pub struct SpaceShortages(AtomicU64);

impl SpaceShortages {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Counts `result` if it says the filesystem is full, and passes it on.
    fn note<T>(&self, result: io::Result<T>) -> io::Result<T> {
        if result.as_ref().is_err_and(is_no_space) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

/// One spill segment's bytes in one page-aligned piece, as `O_DIRECT` wants (an array of 4 KiB-
/// aligned pages, seen as bytes through `bytemuck`, so no `unsafe` is needed for the alignment).
struct AlignedSegment(Box<[AlignedPage]>);

#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(4096))]
struct AlignedPage([u8; 4096]);

impl AlignedSegment {
    fn new() -> io::Result<Self> {
        bytemuck::allocation::try_zeroed_slice_box(SEGMENT_BYTES / 4096)
            .map(Self)
            .map_err(|()| io::Error::new(io::ErrorKind::OutOfMemory, "no memory for a 2 MiB segment buffer"))
    }
}

impl std::fmt::Debug for AlignedSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedSegment({} bytes)", self.len())
    }
}

impl Deref for AlignedSegment {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl DerefMut for AlignedSegment {
    fn deref_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

/// A segment write that has finished or is still running.
pub struct SegmentWrite(WriteState);

enum WriteState {
    Finished(io::Result<()>),
    Running(mpsc::Receiver<io::Result<()>>),
}

impl SegmentWrite {
    pub fn finished(result: io::Result<()>) -> Self {
        Self(WriteState::Finished(result))
    }

    /// A write whose result will arrive on `done`; a sender dropped without sending is an error.
    pub fn running(done: mpsc::Receiver<io::Result<()>>) -> Self {
        Self(WriteState::Running(done))
    }

    /// Whether it has finished, without waiting.
    pub fn is_finished(&mut self) -> bool {
        if let WriteState::Running(done) = &self.0 {
            match done.try_recv() {
                Ok(result) => self.0 = WriteState::Finished(result),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => self.0 = WriteState::Finished(Err(writer_vanished())),
            }
        }
        true
    }

    /// Waits for the write to finish and returns how it went.
    pub fn wait(self) -> io::Result<()> {
        match self.0 {
            WriteState::Finished(result) => result,
            WriteState::Running(done) => done.recv().unwrap_or_else(|_| Err(writer_vanished())),
        }
    }
}

fn writer_vanished() -> io::Error {
    io::Error::other("the spill writer thread ended without a result")
}

/// A file created for one overlay and removed when the overlay is dropped.
#[derive(Debug)]
pub struct ScratchFile {
    file: Arc<File>,
    /// The same file opened with `O_DIRECT`, for background segment writes; `None` where the
    /// filesystem refuses it (tmpfs before Linux 6.6) or background writes are off.
    direct: Option<Arc<File>>,
    writers: Option<Arc<SegmentWriters>>,
    /// Shared with the host's other scratch files; a file of its own when none was given.
    shortages: Arc<SpaceShortages>,
    path: PathBuf,
    /// Left in place when dropped: a VM's state, kept for the next process.
    kept: bool,
}

/// The name of a scratch file of this process: `overspill-PID-WHAT-HOST.KIND`, where `WHAT` is a
/// number (or `tierN`) without `-` and `HOST` this host's mark ([`host_mark`]). The pid lets a
/// restarted server tell a dead server's files from a live one's; the host's mark keeps it from
/// judging another host's files by this host's pids, where hosts share a directory (an NFS
/// `--shared-dir`) whose locks do not reach across hosts (`nolock`: each host's `flock` then
/// sees only its own).
pub fn scratch_file_name(what: &str, kind: &str) -> String {
    format!("overspill-{}-{what}-{}.{kind}", std::process::id(), host_mark())
}

/// Who made a file named by [`scratch_file_name`]: its pid and kind, and whether this host did
/// (`None` for a name without a host's mark, as servers before the mark named theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchOwner<'a> {
    pub pid: u32,
    pub this_host: Option<bool>,
    pub kind: &'a str,
}

/// Reads a scratch file's name (see [`scratch_file_name`]); `None` for any other name.
pub fn scratch_file_owner(name: &str) -> Option<ScratchOwner<'_>> {
    let rest = name.strip_prefix("overspill-")?;
    let (pid, rest) = rest.split_once('-')?;
    let (stem, kind) = rest.rsplit_once('.')?;
    let this_host = match stem.split_once('-') {
        Some(("", _)) => return None,
        Some((_, mark)) => Some(same_host(mark, host_mark())),
        None => None,
    };
    Some(ScratchOwner { pid: pid.parse().ok()?, this_host, kind })
}

/// Whether two hosts' marks ([`host_mark`]) are one host's: by the machine id where both
/// carry one (a host renamed since, by cloud-init or `hostnamectl`, is still itself), else by
/// the whole mark.
fn same_host(mark: &str, ours: &str) -> bool {
    let machine_id = |mark: &str| {
        let (_, id) = mark.rsplit_once('_')?;
        (id.len() == 8 && id.chars().all(|c| c.is_ascii_hexdigit())).then(|| id.to_owned())
    };
    match (machine_id(mark), machine_id(ours)) {
        (Some(theirs), Some(ours)) => theirs == ours,
        _ => mark == ours,
    }
}

/// Whether process `pid` of this host (and PID namespace) runs.
pub fn process_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// This host's mark in scratch file names: its name (characters other than letters, digits and
/// `-` as `_`) and the start of its machine id, where it has one (hosts cloned from one image
/// often keep its name: `localhost`, `ubuntu`).
pub fn host_mark() -> &'static str {
    static MARK: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARK.get_or_init(|| {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default().trim().to_owned();
        let name: String = read("/proc/sys/kernel/hostname")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        let name = if name.is_empty() { "host".to_owned() } else { name };
        let machine = read("/etc/machine-id");
        match machine.get(..8).filter(|id| id.chars().all(|c| c.is_ascii_hexdigit())) {
            Some(id) => format!("{name}_{id}"),
            None => name,
        }
    })
}

/// Marks `file` as held by this process for as long as it has the file open (an exclusive
/// `flock`, which the kernel drops when the process ends, however it ends): a VM's state files
/// are named after the VM, and two servers sharing a directory may each have a VM of one name.
/// An error if another process holds it. Where the filesystem has no locks, nothing is held.
pub fn hold(file: &File, path: &Path) -> io::Result<()> {
    use rustix::fs::{flock, FlockOperation};
    match flock(file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(io::Error::new(
            io::ErrorKind::ResourceBusy,
            format!("{} is held by another process (a server sharing this directory?)", path.display()),
        )),
        Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Whether another process holds `path` (see [`hold`]); a file this process holds counts too,
/// since the check opens it anew.
pub fn held_elsewhere(path: &Path) -> bool {
    held(path) == Some(true)
}

/// Whether anyone holds `path` (see [`hold`]; this process too, since the check opens it anew):
/// `None` when that cannot be told (a filesystem without locks, a file that cannot be opened).
pub fn held(path: &Path) -> Option<bool> {
    use rustix::fs::{flock, FlockOperation};
    // Not through a link, and never waiting on a FIFO someone named like a cache file.
    let flags = (OFlags::NOFOLLOW | OFlags::NONBLOCK).bits() as i32;
    let file = OpenOptions::new().read(true).custom_flags(flags).open(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    // A lock the probe takes goes with its descriptor, dropped on return.
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Some(false),
        Err(rustix::io::Errno::WOULDBLOCK) => Some(true),
        Err(_) => None,
    }
}

impl ScratchFile {
    /// Creates `dir/name`, refusing to reuse an existing file (it could belong to a live VM).
    pub fn create(dir: &Path, name: &str, logical_size: u64) -> io::Result<Self> {
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
        let scratch = Self::from_file(file, path);
        scratch.file.set_len(logical_size)?;
        Ok(scratch)
    }

    /// Opens `dir/name`, which an earlier overlay of the same VM created and kept. It stays
    /// kept until [`BackingFile::own`]: a recovery that fails part-way leaves the VM's state
    /// where it was, for the operator to look at (only `vm reset` removes it).
    pub fn open(dir: &Path, name: &str) -> io::Result<Self> {
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        let mut opened = Self::from_file(file, path);
        opened.kept = true;
        Ok(opened)
    }

    /// The file, held for this process while it is open (see [`hold`]).
    pub fn held(self) -> io::Result<Self> {
        hold(&self.file, &self.path)?;
        Ok(self)
    }

    fn from_file(file: File, path: PathBuf) -> Self {
        Self { file: Arc::new(file), direct: None, writers: None, shortages: Arc::default(), path, kept: false }
    }

    /// The file's size in bytes.
    pub fn logical_size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    /// Writes whole segments from a thread of their own, so that the VM's requests go on while
    /// its last segment goes to disk. With `direct`, the writes use `O_DIRECT` where the
    /// filesystem takes it (not tmpfs before Linux 6.6): the writer thread gathers the segment's
    /// pages into an aligned buffer and writes that, with no copy into the page cache and no
    /// dirty pages, at the price of waiting for the disk itself (measured here: 157k against 215-236k
    /// spilling 4K writes per second, the virtual disk being slower for direct writes into
    /// freshly punched space than the page cache is to absorb them). Reads stay buffered: the
    /// kernel drops cached pages a direct write covers, so they never see stale data.
    pub fn with_background_segment_writes(mut self, writers: Arc<SegmentWriters>, direct: bool) -> Self {
        if direct {
            let flags = OFlags::DIRECT.bits() as i32;
            match OpenOptions::new().write(true).custom_flags(flags).open(&self.path) {
                Ok(file) => self.direct = Some(Arc::new(file)),
                Err(error) => {
                    let path = self.path.display();
                    tracing::warn!(%error, %path, "no O_DIRECT here; spill writes go through the page cache")
                }
            }
        }
        self.writers = Some(writers);
        self
    }

    /// Counts this file's ENOSPC in `shortages`, which the host's other scratch files share, so
    /// that their spill logs hear of a full filesystem (see [`BackingFile::space_shortages`]).
    pub fn with_space_shortages(mut self, shortages: Arc<SpaceShortages>) -> Self {
        self.shortages = shortages;
        self
    }
}

/// Pages a segment write hands the kernel per `pwritev`: 256 KiB. ext4 (Linux 6.16 on) sizes its
/// page-cache folios from the write, and `ext4_block_write_begin`, which walks a folio's block
/// heads, took 12 % of a server spilling 1M writes with one 2 MiB call per segment against 7 % in
/// 256 KiB calls (perf); IOPS rose 6-8 % and p99 halved (4K writes: a few %, within noise). The
/// disk sees the same either way: the pieces are written in order, back to back, and writeback
/// sends the contiguous dirty range in requests of several MiB (`/sys/block/*/stat`: 3.5 MiB on
/// average in both cases).
const PAGES_PER_WRITE_CALL: usize = 64;

/// Writes a segment's pages in order from `offset` on, with vectored writes.
fn write_pages(file: &File, pages: &[Page], mut offset: u64) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = pages.iter().map(|page| IoSlice::new(&page[..])).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let piece = rest.len().min(PAGES_PER_WRITE_CALL);
        match rustix::io::pwritev(file, &rest[..piece], offset) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "spill file took no bytes")),
            Ok(n) => {
                offset += n as u64;
                IoSlice::advance_slices(&mut rest, n);
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Writes a segment from a writer thread: with `O_DIRECT` gathered into an aligned buffer first
/// (a direct write refused for its alignment, EINVAL on a device with sectors larger than a
/// page, is done again through the page cache), otherwise straight from its pages.
fn write_segment(
    direct: Option<(&File, &SegmentWriters)>,
    buffered: &File,
    pages: &[Page],
    offset: u64,
) -> io::Result<()> {
    if let Some((direct, writers)) = direct {
        let mut aligned = writers.take_aligned()?;
        let len = pages.len() * BLOCK_SIZE;
        for (slot, page) in aligned[..len].chunks_exact_mut(BLOCK_SIZE).zip(pages) {
            slot.copy_from_slice(&page[..]);
        }
        let written = direct.write_all_at(&aligned[..len], offset);
        writers.give_aligned(aligned);
        match written {
            Err(error) if error.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {}
            other => return other,
        }
    }
    write_pages(buffered, pages, offset)
}

/// Whether the filesystem of `dir` reports data and holes at exactly 4 KiB: a block written
/// (zeroes too) is data, a block never written a hole. An in-place cache file is rebuilt after a
/// restart from what its filesystem reports: one that allocates in larger units (ZFS records, a
/// tmpfs with huge pages, ext4 bigalloc) would make the neighbours of a written block read as
/// zeroes instead of golden data, and one that drops written zeroes (ZFS with compression) would
/// show golden data where the VM wrote zeroes. Probed with a file of its own (unnamed where the
/// filesystem can, removed after where not); once per directory and process (a restart rebuilds
/// every in-place VM of the directory, and each probe waits for a sync).
pub fn reports_blocks_exactly(dir: &Path) -> io::Result<bool> {
    static PROBED: Mutex<Vec<(PathBuf, bool)>> = Mutex::new(Vec::new());
    let known = |probed: &[(PathBuf, bool)]| probed.iter().find(|(d, _)| d == dir).map(|&(_, exact)| exact);
    if let Some(exact) = known(&PROBED.lock().unwrap_or_else(PoisonError::into_inner)) {
        return Ok(exact);
    }
    let exact = probe_blocks(dir)?;
    PROBED.lock().unwrap_or_else(PoisonError::into_inner).push((dir.to_owned(), exact));
    Ok(exact)
}

/// How `open` says a filesystem has no `O_TMPFILE`.
const NO_TMPFILE: [rustix::io::Errno; 3] =
    [rustix::io::Errno::OPNOTSUPP, rustix::io::Errno::ISDIR, rustix::io::Errno::INVAL];

/// A file of the probe's own in `dir`: unnamed where the filesystem can (`O_TMPFILE`), so that a
/// process killed in the middle of a probe leaves nothing; elsewhere a named one
/// ([`named_probe_file`]), removed after.
fn probe_file(dir: &Path) -> io::Result<(File, Option<PathBuf>)> {
    let unnamed = OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags((OFlags::TMPFILE | OFlags::CLOEXEC).bits() as i32)
        .open(dir);
    match unnamed {
        Ok(file) => return Ok((file, None)),
        // No O_TMPFILE here (an older filesystem, NFS, FUSE).
        Err(e) if NO_TMPFILE.iter().any(|errno| e.raw_os_error() == Some(errno.raw_os_error())) => {}
        Err(e) => return Err(e),
    }
    let (file, path) = named_probe_file(dir)?;
    Ok((file, Some(path)))
}

/// A probe file named for this process, moment and call: a name a killed probe left (its pid
/// taken again by a server restarted in a container) must not make every later probe fail. A
/// killed probe's file stays (8 KiB of data), only where the filesystem has no `O_TMPFILE`.
fn named_probe_file(dir: &Path) -> io::Result<(File, PathBuf)> {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!(".overspill-hole-probe-{}-{nanos}-{call}", std::process::id()));
    let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
    Ok((file, path))
}

fn probe_blocks(dir: &Path) -> io::Result<bool> {
    use rustix::fs::{seek, SeekFrom};
    const MIB: u64 = 1 << 20;
    let (file, path) = probe_file(dir)?;
    let probe = || -> io::Result<bool> {
        file.set_len(4 * MIB)?;
        // In different 2 MiB units, so that huge pages show.
        file.write_all_at(&[0x5a; BLOCK_SIZE], MIB)?;
        file.write_all_at(&[0; BLOCK_SIZE], 3 * MIB)?;
        // Some filesystems settle what is data only once it is written out.
        file.sync_data()?;
        let block = BLOCK_SIZE as u64;
        Ok(seek(&file, SeekFrom::Data(0))? == MIB
            && seek(&file, SeekFrom::Hole(MIB))? == MIB + block
            && seek(&file, SeekFrom::Data(MIB + block))? == 3 * MIB
            && seek(&file, SeekFrom::Hole(3 * MIB))? == 3 * MIB + block)
    };
    let exact = probe();
    if let Some(path) = path {
        std::fs::remove_file(&path)?;
    }
    exact
}

impl BackingFile for ScratchFile {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        self.shortages.note(self.file.write_all_at(data, offset))
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self.file.read_exact_at(buf, offset) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                Err(io::Error::new(io::ErrorKind::UnexpectedEof, "cache file shorter than its map"))
            }
            other => other,
        }
    }

    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()> {
        rustix::fs::fallocate(&*self.file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len)
            .map_err(io::Error::from)
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        // st_blocks counts 512-byte units whatever the filesystem's block size.
        Ok(self.file.metadata()?.blocks() * 512)
    }

    fn path(&self) -> Option<&Path> {
        Some(&self.path)
    }

    fn keep(&mut self) {
        self.kept = true;
    }

    fn own(&mut self) {
        self.kept = false;
    }

    fn data_ranges(&mut self) -> io::Result<Vec<(u64, u64)>> {
        use rustix::fs::SeekFrom;
        if let Some(dir) = self.path.parent() {
            if !reports_blocks_exactly(dir)? {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "{} reports data in units larger than 4 KiB, or drops written zeroes: \
                         the blocks a VM wrote cannot be told from those it did not",
                        dir.display()
                    ),
                ));
            }
        }
        let len = self.logical_size()?;
        let mut ranges = Vec::new();
        let mut at = 0;
        while at < len {
            let start = match rustix::fs::seek(&*self.file, SeekFrom::Data(at)) {
                Ok(start) => start,
                // No data from `at` on.
                Err(rustix::io::Errno::NXIO) => break,
                Err(error) => return Err(error.into()),
            };
            let end = rustix::fs::seek(&*self.file, SeekFrom::Hole(start))?;
            ranges.push((start, end));
            at = end;
        }
        Ok(ranges)
    }

    fn space_shortages(&self) -> u64 {
        self.shortages.count()
    }

    /// In the VM's own thread (no writer free, or a retry): paced by the host's spill budget
    /// like the writers' own.
    fn write_pages_at(&mut self, pages: &[Page], offset: u64) -> io::Result<()> {
        if let Some(writers) = &self.writers {
            writers.pace(pages.len() * BLOCK_SIZE);
        }
        self.shortages.note(write_pages(&self.file, pages, offset))
    }

    fn start_segment_write(&mut self, pages: &Arc<SegmentPages>, offset: u64) -> SegmentWrite {
        let bytes = pages.len() * BLOCK_SIZE;
        let Some(writers) = self.writers.as_ref().filter(|writers| writers.try_start()) else {
            // In line, through the page cache: an aligned copy would cost the VM's own thread.
            return SegmentWrite::finished(self.write_pages_at(pages, offset));
        };
        let (done, result) = mpsc::sync_channel(1);
        let (direct, buffered, shared) = (self.direct.clone(), Arc::clone(&self.file), Arc::clone(pages));
        let (writer, shortages) = (Arc::clone(writers), Arc::clone(&self.shortages));
        let job: WriterJob = Box::new(move || {
            writer.pace(bytes);
            let written = shortages.note(write_segment(
                direct.as_deref().map(|file| (file, &*writer)),
                &buffered,
                &shared,
                offset,
            ));
            // The pages go back to their owner before the result does: the VM's reference is
            // then the last, and its thread frees them as soon as it hears. The file too: a copy
            // of it still here once the VM has gone would keep its `flock` (see [`hold`]).
            drop((shared, direct, buffered));
            writer.finished();
            let _ = done.send(written);
        });
        match writers.run(job) {
            Ok(()) => SegmentWrite::running(result),
            Err(job) => {
                drop(job);
                writers.finished();
                SegmentWrite::finished(self.write_pages_at(pages, offset))
            }
        }
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        if let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "could not remove cache file");
        }
    }
}

/// A backing file held in memory, for simulations (the planner) that must not touch the disk.
/// Space is tracked in 64 KiB pages so that punched holes give memory back as a file would.
#[derive(Debug, Default)]
pub struct MemFile {
    pages: std::collections::HashMap<u64, Box<[u8]>>,
}

const MEM_PAGE: u64 = 64 * 1024;

impl MemFile {
    fn page_span(offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        // (page, offset within page, offset within the caller's buffer, length)
        let end = offset + len as u64;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let page = pos / MEM_PAGE;
            let within = (pos % MEM_PAGE) as usize;
            let n = ((MEM_PAGE - within as u64).min(end - pos)) as usize;
            let item = (page, within, (pos - offset) as usize, n);
            pos += n as u64;
            Some(item)
        })
    }
}

impl BackingFile for MemFile {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        for (page, within, from, n) in Self::page_span(offset, data.len()) {
            let bytes = self.pages.entry(page).or_insert_with(|| vec![0u8; MEM_PAGE as usize].into_boxed_slice());
            bytes[within..within + n].copy_from_slice(&data[from..from + n]);
        }
        Ok(())
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        for (page, within, to, n) in Self::page_span(offset, buf.len()) {
            match self.pages.get(&page) {
                Some(bytes) => buf[to..to + n].copy_from_slice(&bytes[within..within + n]),
                None => buf[to..to + n].fill(0),
            }
        }
        Ok(())
    }

    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("hole too large"))?;
        for (page, within, _, n) in Self::page_span(offset, len) {
            if n as u64 == MEM_PAGE {
                self.pages.remove(&page);
            } else if let Some(bytes) = self.pages.get_mut(&page) {
                bytes[within..within + n].fill(0);
            }
        }
        Ok(())
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        Ok(self.pages.len() as u64 * MEM_PAGE)
    }

    fn path(&self) -> Option<&Path> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered_pages(count: usize) -> SegmentPages {
        let arena = crate::arena::Arena::in_memory(count as u32).expect("arena");
        (0..count)
            .map(|n| {
                let mut page = arena.alloc().expect("page");
                page.fill(0);
                page[..8].copy_from_slice(&(n as u64).to_le_bytes());
                page[BLOCK_SIZE - 1] = n as u8;
                page
            })
            .collect()
    }

    /// The filesystems the tests run on (ext4, tmpfs) report 4 KiB blocks as they are, and
    /// the probe leaves nothing behind; nor does a file an earlier probe of this pid left (a
    /// server killed in its probe, restarted in a container under the same pid) stop it, and
    /// that file, not this probe's, is left alone.
    #[test]
    fn the_probe_finds_blocks_reported_exactly_and_cleans_up() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let left = dir.path().join(format!(".overspill-hole-probe-{}", std::process::id()));
        std::fs::write(&left, b"left by a killed probe").expect("leftover");
        assert!(probe_blocks(dir.path()).expect("probe"));
        assert!(reports_blocks_exactly(dir.path()).expect("probe"));
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").flatten().map(|e| e.path()).collect();
        assert_eq!(names, [left], "the probe's file is left, or the leftover gone");
        // Where there is no O_TMPFILE: a name of its own each time.
        let (_, first) = named_probe_file(dir.path()).expect("named");
        let (_, second) = named_probe_file(dir.path()).expect("named again");
        assert_ne!(first, second);
    }

    #[test]
    fn a_segment_written_in_pieces_lands_page_by_page_at_its_offset() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut file = ScratchFile::create(dir.path(), "spill", 4 * SEGMENT_BYTES as u64).expect("spill file");
        let pages = numbered_pages(SEGMENT_BYTES / BLOCK_SIZE);
        assert!(pages.len() > PAGES_PER_WRITE_CALL, "the segment takes more than one call");
        let offset = SEGMENT_BYTES as u64;
        file.write_pages_at(&pages, offset).expect("segment written");
        let mut back = [0u8; BLOCK_SIZE];
        for (n, page) in pages.iter().enumerate() {
            file.read_at(&mut back, offset + (n * BLOCK_SIZE) as u64).expect("page read");
            assert!(back == **page, "page {n} read back differs");
        }
        file.read_at(&mut back, 0).expect("first page read");
        assert_eq!(back, [0u8; BLOCK_SIZE], "nothing before the segment's offset");
    }

    #[test]
    fn background_segment_writes_reuse_their_threads_and_each_lands_where_it_was_sent() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let writers = SegmentWriters::new(2);
        let files: Vec<ScratchFile> = (0..3)
            .map(|n| {
                let file = ScratchFile::create(dir.path(), &format!("spill-{n}"), 8 * SEGMENT_BYTES as u64);
                file.expect("spill file").with_background_segment_writes(Arc::clone(&writers), false)
            })
            .collect();
        let mut files = files;
        let pages = Arc::new(numbered_pages(SEGMENT_BYTES / BLOCK_SIZE));
        // More writes than writers, several per file at once: the third of a round finds no
        // permit and writes in line; the others queue for the two threads.
        for round in 0..8u64 {
            let writes: Vec<SegmentWrite> =
                files.iter_mut().map(|file| file.start_segment_write(&pages, round * SEGMENT_BYTES as u64)).collect();
            for write in writes {
                write.wait().expect("segment written");
            }
        }
        assert!(writers.jobs.lock().expect("queue").threads <= 2, "no more threads than writes at once");
        let mut back = [0u8; BLOCK_SIZE];
        for file in &mut files {
            for round in 0..8u64 {
                for n in [0, 300, 511] {
                    file.read_at(&mut back, round * SEGMENT_BYTES as u64 + (n * BLOCK_SIZE) as u64).expect("read");
                    assert!(back == *pages[n], "round {round} page {n} read back differs");
                }
            }
        }
        assert_eq!(writers.in_flight.load(Ordering::Acquire), 0, "every permit came back");
    }

    /// The host's spill budget holds every VM's segment writes together, in the background and
    /// in line alike, to its rate: over the time they took, at most rate × time + burst, and a
    /// segment more (the one that went into debt).
    #[test]
    fn the_spill_budget_holds_all_segment_writes_to_its_rate() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let writers = SegmentWriters::new(1);
        let (rate, burst) = (16 * SEGMENT_BYTES as u64, SEGMENT_BYTES as u64);
        writers.budget().set(Limits { ops: None, bytes: Some(overspill_block::Rate { per_second: rate, burst }) });
        let mut files: Vec<ScratchFile> = (0..2)
            .map(|n| {
                let file = ScratchFile::create(dir.path(), &format!("spill-{n}"), 8 * SEGMENT_BYTES as u64);
                file.expect("spill file").with_background_segment_writes(Arc::clone(&writers), false)
            })
            .collect();
        let pages = Arc::new(numbered_pages(SEGMENT_BYTES / BLOCK_SIZE));
        let started = std::time::Instant::now();
        let mut written = 0u64;
        // Two files at once and one writer thread: one write of each round goes in line.
        for round in 0..8u64 {
            let writes: Vec<SegmentWrite> =
                files.iter_mut().map(|file| file.start_segment_write(&pages, round * SEGMENT_BYTES as u64)).collect();
            for write in writes {
                write.wait().expect("segment written");
                written += SEGMENT_BYTES as u64;
            }
        }
        let took = started.elapsed().as_secs_f64();
        let allowed = rate as f64 * took + (burst + SEGMENT_BYTES as u64) as f64;
        assert!(written as f64 <= allowed, "{written} bytes in {took:.3} s at {rate}/s, burst {burst}");
        let (throttled, waiting) = writers.budget().throttled();
        assert!(throttled > std::time::Duration::ZERO && waiting == 0, "{throttled:?} {waiting}");
    }
}
