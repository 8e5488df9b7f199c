//! The shared read cache in front of a golden image: every VM of the image reads through it, so a
//! boot storm reads each golden block from storage once, not once per VM (the seeds' "system
//! cache" of the provisioning server).
//!
//! The cache holds fixed-size chunks (16 KiB by default, aligned) under S3-FIFO, which resists
//! scans: a chunk enters a small FIFO (a tenth of the space); if it is read again before it
//! leaves, it moves to the main FIFO, otherwise it leaves and only its number is remembered in a
//! ghost FIFO, so that a chunk coming back soon goes straight to main. Chunks in main that were
//! read since the hand last passed get another lap. One boot's worth of one-time reads therefore
//! cannot push out the blocks every VM reads.
//!
//! Misses are fetched from the source outside the lock, so readers of other chunks are not held
//! up; the consecutive chunks a request misses are fetched with one source read. VMs that miss a
//! chunk while it is being fetched wait for that one fetch instead of issuing their own, so a boot
//! storm of VMs reading the same block in lockstep makes one request.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::io;
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;

use crate::budget::HostMemory;
use crate::chunk_pool::{ChunkBuf, ChunkPool};
use crate::golden::{GoldenImage, SourceReads};
use crate::map::RunHasher;
use crate::stats::{Counter, Gauge};

/// Small enough that a cold 4 KiB read fetches little more than it asked for (64 KiB chunks
/// doubled the p99 of cold 4 KiB reads); a larger read fetches its missing chunks in one request.
pub const DEFAULT_CHUNK_BYTES: u64 = 16 * 1024;

/// What the cache did, for metrics and reports.
#[derive(Debug, Default)]
pub struct ReadCacheStats {
    pub hits: Counter,
    pub misses: Counter,
    /// Misses that waited for another reader's fetch of the same chunk.
    pub coalesced: Counter,
    /// Chunks fetched from the source and the bytes they held.
    pub fetched_chunks: Counter,
    pub fetched_bytes: Counter,
    pub evictions: Counter,
    pub cached_bytes: Gauge,
    pub capacity_bytes: Gauge,
    /// Memory mapped for chunks: the cached bytes, chunks evicted but still being copied out,
    /// free slots (the rest of the last slab, and slots of evicted chunks), and the slab the
    /// helper holds ready.
    pub resident_bytes: Arc<Gauge>,
}

/// A cached chunk's bytes, shared by the cache and the readers copying out of it.
type Chunk = Arc<ChunkBuf>;

/// Part of a chunk: the bytes `range` of it.
type ChunkPiece = (Chunk, std::ops::Range<usize>);

/// A chunk lent out as [`Bytes`]: the reader keeps it alive (an evicted chunk's slot is reused
/// only once the last of these is gone).
struct SharedChunk(Chunk);

impl AsRef<[u8]> for SharedChunk {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

struct Entry {
    data: Chunk,
    /// Reads since it entered or since the main FIFO's hand last passed, capped at 3.
    freq: u8,
    in_main: bool,
}

/// How a fetch ended, kept so that every waiter gets it (io::Error is not Clone).
type FetchOutcome = Result<Chunk, (io::ErrorKind, String)>;

/// A fetch in flight, which later readers of the same chunk wait for.
#[derive(Default)]
struct Pending {
    result: Mutex<Option<FetchOutcome>>,
    ready: Condvar,
}

impl Pending {
    fn complete(&self, result: &io::Result<Chunk>) {
        let shared = match result {
            Ok(data) => Ok(data.clone()),
            Err(e) => Err((e.kind(), e.to_string())),
        };
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(shared);
        self.ready.notify_all();
    }

    fn wait(&self) -> io::Result<Chunk> {
        let mut result = self.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match result.as_ref() {
                Some(Ok(data)) => return Ok(data.clone()),
                Some(Err((kind, message))) => return Err(io::Error::new(*kind, message.clone())),
                None => result = self.ready.wait(result).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }
}

/// What one chunk of a request needs.
enum Part {
    Have(Chunk),
    /// Another reader is fetching it.
    Wait(Arc<Pending>),
    /// This reader fetches it (and others may wait for it).
    Fetch(Arc<Pending>),
    /// This reader fetched it.
    Fetched(Chunk),
}

struct S3Fifo {
    /// Keyed by chunk number with the block map's run hash: the chunks of a sequential read are
    /// neighbours in the table. With the default (random, SipHash) hasher each was a cache miss
    /// of its own, 3 % of the server's time on 64K sequential reads (perf).
    entries: HashMap<u64, Entry, BuildHasherDefault<RunHasher>>,
    pending: HashMap<u64, Arc<Pending>>,
    small: VecDeque<u64>,
    main: VecDeque<u64>,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64>,
    small_bytes: u64,
    main_bytes: u64,
    /// What the cache may hold now: `configured_bytes`, or less after it gave memory back.
    capacity_bytes: u64,
    configured_bytes: u64,
    chunk_bytes: u64,
}

impl S3Fifo {
    fn get(&mut self, chunk: u64) -> Option<Chunk> {
        let entry = self.entries.get_mut(&chunk)?;
        entry.freq = (entry.freq + 1).min(3);
        Some(entry.data.clone())
    }

    fn held_bytes(&self) -> u64 {
        self.small_bytes + self.main_bytes
    }

    /// Caches `chunk`; within `budget`, only in room the host has, or in place of chunks this
    /// cache holds, or below the read caches' floor.
    fn insert(&mut self, chunk: u64, data: Chunk, stats: &ReadCacheStats, budget: Option<&HostMemory>) {
        let len = data.len() as u64;
        if self.entries.contains_key(&chunk) || len > self.capacity_bytes {
            return;
        }
        let before = self.held_bytes();
        let capacity = match budget {
            Some(host) if !host.read_cache_may_grow(before, len) => before,
            _ => self.capacity_bytes,
        };
        if len > capacity {
            return;
        }
        let in_main = self.ghost_set.remove(&chunk);
        if in_main {
            self.main.push_back(chunk);
            self.main_bytes += len;
        } else {
            self.small.push_back(chunk);
            self.small_bytes += len;
        }
        self.entries.insert(chunk, Entry { data, freq: 0, in_main });
        self.evict_to(capacity, stats);
        if let Some(host) = budget {
            host.account_read_cache(before, self.held_bytes());
        }
    }

    fn evict_to(&mut self, capacity: u64, stats: &ReadCacheStats) {
        while self.held_bytes() > capacity {
            if self.small_bytes > capacity / 10 || self.main.is_empty() {
                self.evict_small(stats);
            } else {
                self.evict_main(stats);
            }
        }
        stats.cached_bytes.set(self.held_bytes());
    }

    fn evict_small(&mut self, stats: &ReadCacheStats) {
        let Some(chunk) = self.small.pop_front() else { return };
        let Some(entry) = self.entries.get_mut(&chunk) else { return };
        let len = entry.data.len() as u64;
        self.small_bytes -= len;
        if entry.freq > 0 {
            // Read again while on probation: it earns a place in main.
            entry.in_main = true;
            entry.freq = 0;
            self.main.push_back(chunk);
            self.main_bytes += len;
        } else {
            self.entries.remove(&chunk);
            stats.evictions.inc();
            self.ghost.push_back(chunk);
            self.ghost_set.insert(chunk);
            // Remember about as many chunks as main can hold.
            let ghost_max = (self.capacity_bytes / self.chunk_bytes).max(1) as usize;
            while self.ghost.len() > ghost_max {
                if let Some(old) = self.ghost.pop_front() {
                    self.ghost_set.remove(&old);
                }
            }
        }
    }

    fn evict_main(&mut self, stats: &ReadCacheStats) {
        while let Some(chunk) = self.main.pop_front() {
            let Some(entry) = self.entries.get_mut(&chunk) else { continue };
            debug_assert!(entry.in_main);
            if entry.freq > 0 {
                entry.freq -= 1;
                self.main.push_back(chunk);
                continue;
            }
            self.main_bytes -= entry.data.len() as u64;
            self.entries.remove(&chunk);
            stats.evictions.inc();
            return;
        }
    }
}

/// A golden image read through a bounded cache shared by all its VMs.
pub struct CachedImage {
    source: Arc<dyn GoldenImage>,
    cache: Mutex<S3Fifo>,
    chunk_bytes: u64,
    pool: ChunkPool,
    stats: Arc<ReadCacheStats>,
    /// The host's memory budget, which the read caches share with the VMs (see
    /// [`Self::within`]).
    budget: Option<Arc<HostMemory>>,
}

impl Drop for CachedImage {
    fn drop(&mut self) {
        if let Some(host) = &self.budget {
            host.detach_read_cache(self.lock().held_bytes());
        }
    }
}

impl CachedImage {
    /// `chunk_bytes` must be a power of two.
    pub fn new(source: Arc<dyn GoldenImage>, capacity_bytes: u64, chunk_bytes: u64) -> Self {
        assert!(chunk_bytes.is_power_of_two(), "chunk size must be a power of two");
        let stats = Arc::new(ReadCacheStats::default());
        stats.capacity_bytes.set(capacity_bytes);
        let cache = S3Fifo {
            entries: HashMap::default(),
            pending: HashMap::new(),
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            ghost_set: HashSet::new(),
            small_bytes: 0,
            main_bytes: 0,
            capacity_bytes,
            configured_bytes: capacity_bytes,
            chunk_bytes,
        };
        let pool = ChunkPool::new(chunk_bytes as usize, capacity_bytes, stats.resident_bytes.clone());
        Self { source, cache: Mutex::new(cache), chunk_bytes, pool, stats, budget: None }
    }

    /// Holds the cache within the host's memory budget, beside the VMs': it grows only into
    /// room they leave (or below the read caches' floor), and its chunks count against
    /// `--ram-total` ([`HostMemory::has_room`]).
    pub fn within(mut self, host: Arc<HostMemory>) -> Self {
        host.attach_read_cache();
        self.budget = Some(host);
        self
    }

    /// What the cache holds now.
    pub fn held_bytes(&self) -> u64 {
        self.lock().held_bytes()
    }

    /// Evicts chunks until the cache holds `bytes` less (its coldest first, as S3-FIFO has
    /// them), lowers what it may hold to that until [`Self::grow_back`], and gives the freed
    /// slots' pages back to the system. Returns the bytes it holds less.
    pub fn give_back(&self, bytes: u64) -> u64 {
        let (before, after) = {
            let mut cache = self.lock();
            let before = cache.held_bytes();
            cache.capacity_bytes = before.saturating_sub(bytes);
            let capacity = cache.capacity_bytes;
            cache.evict_to(capacity, &self.stats);
            (before, cache.held_bytes())
        };
        self.stats.capacity_bytes.set(before.saturating_sub(bytes));
        if let Some(host) = &self.budget {
            host.account_read_cache(before, after);
        }
        // Chunks being copied out by readers keep their slots until the readers are done.
        self.pool.release_free();
        before - after
    }

    /// Lets the cache hold up to `bytes` more again, as far as it was configured to.
    pub fn grow_back(&self, bytes: u64) {
        let mut cache = self.lock();
        cache.capacity_bytes = cache.capacity_bytes.saturating_add(bytes).min(cache.configured_bytes);
        self.stats.capacity_bytes.set(cache.capacity_bytes);
    }

    /// Whether the cache may hold less now than it was configured to.
    pub fn shrunk(&self) -> bool {
        let cache = self.lock();
        cache.capacity_bytes < cache.configured_bytes
    }

    pub fn stats(&self) -> &Arc<ReadCacheStats> {
        &self.stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, S3Fifo> {
        // The cache holds only copies of the source's bytes; a panic elsewhere leaves them valid.
        self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Fetches chunks `first..first + count` (already claimed as pending) with one source read,
    /// caches them and hands them to whoever waits. On error the waiters get the error too.
    /// Returns the chunks and what the read cost the storage behind the source (less than the
    /// bytes fetched when the source has a cache of its own, such as a local disk tier).
    /// The bytes `offset..offset + len` as far as the image goes, in order, as ranges of the
    /// chunks that hold them, with what fetching the missing chunks cost.
    fn pieces(&self, offset: u64, len: usize) -> io::Result<(Vec<ChunkPiece>, SourceReads)> {
        let end = offset.saturating_add(len as u64).min(self.size());
        if offset >= end {
            return Ok((Vec::new(), SourceReads::default()));
        }
        let (first, chunks, fetched) = self.chunks(offset, end)?;
        let mut pieces = Vec::with_capacity(chunks.len());
        for (k, chunk) in chunks.into_iter().enumerate() {
            let chunk_start = (first + k as u64) * self.chunk_bytes;
            let from = offset.max(chunk_start);
            let to = end.min(chunk_start + chunk.len() as u64);
            if from < to {
                pieces.push((chunk, (from - chunk_start) as usize..(to - chunk_start) as usize));
            }
        }
        Ok((pieces, fetched))
    }

    /// The chunks holding bytes `offset..end` (inside the image), the first one's number, and
    /// what fetching the missing ones cost: every chunk is classified under one lock, each run of
    /// consecutive misses is one source read, and chunks another reader is fetching are waited for.
    fn chunks(&self, offset: u64, end: u64) -> io::Result<(u64, Vec<Chunk>, SourceReads)> {
        let c = self.chunk_bytes;
        let first = offset / c;
        let mut parts: Vec<Part> = {
            let mut cache = self.lock();
            (first..=(end - 1) / c)
                .map(|chunk| {
                    if let Some(data) = cache.get(chunk) {
                        Part::Have(data)
                    } else if let Some(pending) = cache.pending.get(&chunk) {
                        Part::Wait(pending.clone())
                    } else {
                        let pending = Arc::new(Pending::default());
                        cache.pending.insert(chunk, pending.clone());
                        Part::Fetch(pending)
                    }
                })
                .collect()
        };
        // A source that panics (caught above: a vhost-user worker lives on) would leave its
        // claims pending, and every later reader of those chunks, in every VM, waiting for ever.
        let fetching = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.fetch_claimed(first, &mut parts)));
        let fetched = match fetching {
            Ok(fetched) => fetched?,
            Err(panic) => {
                self.abandon(first, &parts, 0, &io::Error::other("reading the golden image panicked"));
                std::panic::resume_unwind(panic);
            }
        };
        let mut chunks = Vec::with_capacity(parts.len());
        for part in parts {
            chunks.push(match part {
                Part::Have(data) => {
                    self.stats.hits.inc();
                    data
                }
                Part::Wait(pending) => {
                    self.stats.coalesced.inc();
                    pending.wait()?
                }
                Part::Fetched(data) => data,
                Part::Fetch(_) => unreachable!("every claimed chunk was fetched above"),
            });
        }
        Ok((first, chunks, fetched))
    }

    /// Fetches the chunks `parts` claims (`Part::Fetch`, `parts[0]` being chunk `first`), each
    /// run of consecutive misses with one source read, into `Part::Fetched`: what it cost.
    fn fetch_claimed(&self, first: u64, parts: &mut [Part]) -> io::Result<SourceReads> {
        let mut fetched = SourceReads::default();
        let mut i = 0;
        while i < parts.len() {
            let run: Vec<&Arc<Pending>> =
                parts[i..].iter().map_while(|p| if let Part::Fetch(p) = p { Some(p) } else { None }).collect();
            if run.is_empty() {
                i += 1;
                continue;
            }
            let n = run.len();
            let (chunks, reads) = match self.fetch_run(first + i as u64, &run) {
                Ok(fetched_run) => fetched_run,
                Err(e) => {
                    // The chunks this reader claimed further on will not be fetched now; left
                    // pending, every later reader of them would wait forever.
                    self.abandon(first, &parts[i + n..], i + n, &e);
                    return Err(e);
                }
            };
            fetched.ops += reads.ops;
            fetched.bytes += reads.bytes;
            for (k, chunk) in chunks.into_iter().enumerate() {
                parts[i + k] = Part::Fetched(chunk);
            }
            i += n;
        }
        Ok(fetched)
    }

    fn fetch_run(&self, first: u64, pendings: &[&Arc<Pending>]) -> io::Result<(Vec<Chunk>, SourceReads)> {
        let start = first * self.chunk_bytes;
        let end = ((first + pendings.len() as u64) * self.chunk_bytes).min(self.source.size());
        // The chunks are read straight into the buffers the cache keeps: no second buffer to
        // allocate, zero and copy from.
        let chunks = (start..end)
            .step_by(self.chunk_bytes as usize)
            .map(|at| self.pool.take((end - at).min(self.chunk_bytes) as usize))
            .collect::<io::Result<Vec<ChunkBuf>>>()
            .and_then(|mut bufs| {
                let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(ChunkBuf::as_mut_slice).collect();
                let reads = self.source.read_vectored_counted(&mut views, start)?;
                Ok((bufs.into_iter().map(Arc::new).collect::<Vec<Chunk>>(), reads))
            });
        {
            let mut cache = self.lock();
            for (k, _) in pendings.iter().enumerate() {
                cache.pending.remove(&(first + k as u64));
            }
            if let Ok((chunks, _)) = &chunks {
                for (k, chunk) in chunks.iter().enumerate() {
                    cache.insert(first + k as u64, chunk.clone(), &self.stats, self.budget.as_deref());
                }
            }
        }
        match chunks {
            Ok((chunks, reads)) => {
                for (pending, chunk) in pendings.iter().zip(&chunks) {
                    pending.complete(&Ok(chunk.clone()));
                }
                self.stats.misses.add(pendings.len() as u64);
                self.stats.fetched_chunks.add(pendings.len() as u64);
                self.stats.fetched_bytes.add(end - start);
                Ok((chunks, reads))
            }
            Err(e) => {
                let failed = Err(io::Error::new(e.kind(), e.to_string()));
                for pending in pendings {
                    pending.complete(&failed);
                }
                Err(e)
            }
        }
    }

    /// Releases the chunks of `parts` (the request's parts from index `skip` on) that this reader
    /// claimed but will not fetch, passing `error` to anyone already waiting for them.
    fn abandon(&self, first: u64, parts: &[Part], skip: usize, error: &io::Error) {
        let claimed: Vec<(u64, &Arc<Pending>)> = parts
            .iter()
            .enumerate()
            .filter_map(|(k, part)| match part {
                Part::Fetch(pending) => Some((first + (skip + k) as u64, pending)),
                _ => None,
            })
            .collect();
        if claimed.is_empty() {
            return;
        }
        {
            let mut cache = self.lock();
            for (chunk, _) in &claimed {
                cache.pending.remove(chunk);
            }
        }
        let failed = Err(io::Error::new(error.kind(), error.to_string()));
        for (_, pending) in claimed {
            pending.complete(&failed);
        }
    }
}

impl GoldenImage for CachedImage {
    fn size(&self) -> u64 {
        self.source.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_counted(buf, offset).map(|_| ())
    }

    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        let (pieces, fetched) = self.pieces(offset, buf.len())?;
        let mut at = 0;
        for (chunk, range) in pieces {
            let len = range.len();
            buf[at..at + len].copy_from_slice(&chunk[range]);
            at += len;
        }
        buf[at..].fill(0);
        Ok(fetched)
    }

    fn read_shared(&self, offset: u64, len: usize) -> io::Result<(Vec<Bytes>, SourceReads)> {
        let (pieces, fetched) = self.pieces(offset, len)?;
        let mut shared: Vec<Bytes> =
            pieces.into_iter().map(|(chunk, range)| Bytes::from_owner(SharedChunk(chunk)).slice(range)).collect();
        let past_end = len - shared.iter().map(Bytes::len).sum::<usize>();
        if past_end > 0 {
            shared.push(Bytes::from(vec![0u8; past_end]));
        }
        Ok((shared, fetched))
    }

    fn read_uncached(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.source.read_uncached(buf, offset)
    }

    fn describe(&self) -> String {
        format!("{} through a {}-byte shared read cache", self.source.describe(), self.stats.capacity_bytes.get())
    }

    fn identity(&self) -> Option<String> {
        self.source.identity()
    }

    fn matches_identity(&self, recorded: &str) -> bool {
        self.source.matches_identity(recorded)
    }

    fn unchanged(&self) -> io::Result<()> {
        self.source.unchanged()
    }

    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<crate::golden::Extent>> {
        self.source.extents(offset, len)
    }

    fn layer_runs(&self, offset: u64, len: u64) -> io::Result<Vec<crate::golden::LayerRun>> {
        self.source.layer_runs(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::golden::MemImage;

    fn image(len: usize) -> (Vec<u8>, Arc<dyn GoldenImage>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        (bytes.clone(), Arc::new(MemImage::new(bytes)))
    }

    #[test]
    fn reads_match_the_source_and_repeat_reads_hit() {
        let (bytes, source) = image(300_000);
        let cache = CachedImage::new(source, 1 << 20, 4096);
        for (offset, len) in [(0usize, 10usize), (4000, 9000), (299_990, 10), (123_456, 70_000), (299_999, 5)] {
            let mut buf = vec![0xffu8; len];
            cache.read_at(&mut buf, offset as u64).expect("read");
            let end = (offset + len).min(bytes.len());
            assert_eq!(&buf[..end - offset], &bytes[offset..end], "{offset}+{len}");
            assert!(buf[end - offset..].iter().all(|&b| b == 0), "past the end reads zero");
        }
        let misses = cache.stats().misses.get();
        let mut buf = vec![0u8; 9000];
        let fetched = cache.read_counted(&mut buf, 4000).expect("read");
        assert_eq!(fetched, SourceReads::default(), "second read costs the source nothing");
        assert_eq!(cache.stats().misses.get(), misses);
    }

    /// Within the host's budget the cache takes only room the VMs leave (or its floor), gives
    /// back on demand, frees the pages, reads right throughout, and is counted out when it goes.
    #[test]
    fn a_cache_within_the_budget_takes_what_the_vms_leave_and_gives_it_back() {
        const MIB: u64 = 1 << 20;
        let bytes: Vec<u8> = (0..16 * MIB).map(|i| (i / 4096) as u8 ^ (i % 251) as u8).collect();
        let source = Arc::new(MemImage::new(bytes.clone()));
        let host = HostMemory::new(4 * MIB, 0);
        host.set_read_caches(4 * MIB, MIB);
        let cache = CachedImage::new(source, 16 * MIB, 16 * 1024).within(host.clone());
        let check = |offset: u64, len: u64| {
            let mut buf = vec![0u8; len as usize];
            cache.read_at(&mut buf, offset).expect("read");
            assert!(buf == bytes[offset as usize..(offset + len) as usize], "bytes at {offset}");
        };
        check(0, 8 * MIB);
        assert_eq!(cache.held_bytes(), 4 * MIB, "as much as the cap, no VM holding any");
        assert_eq!(host.read_cache_bytes(), 4 * MIB);
        assert!(!host.has_room(4096), "the VMs see the cap taken");

        host.account(0, 3 * MIB); // a VM takes 3 MiB, over the cap together
        let fetched = cache.stats().fetched_bytes.get();
        check(8 * MIB, 2 * MIB);
        assert_eq!(cache.stats().fetched_bytes.get() - fetched, 2 * MIB);
        assert_eq!(cache.held_bytes(), 4 * MIB, "no room: new chunks take the place of old ones");

        let resident = cache.stats().resident_bytes.get();
        assert_eq!(cache.give_back(3 * MIB), 3 * MIB);
        assert_eq!((cache.held_bytes(), host.read_cache_bytes()), (MIB, MIB));
        assert!(host.has_room(0), "VMs and cache within the cap again");
        // The pool's helper may have mapped its spare slab since `resident` was read.
        let spare = crate::chunk_pool::SLAB_BYTES as u64;
        assert!(cache.stats().resident_bytes.get() <= resident + spare - 3 * MIB, "the pages left memory");
        assert!(cache.shrunk());
        check(0, 16 * MIB);
        assert_eq!(cache.held_bytes(), MIB, "it stays down until it grows back");
        host.account(3 * MIB, 0);
        cache.grow_back(64 * MIB);
        assert!(!cache.shrunk(), "back to its configured 16 MiB");
        check(0, 4 * MIB);
        assert_eq!(cache.held_bytes(), 4 * MIB, "and up to the cap again");
        drop(cache);
        assert_eq!(host.read_cache_bytes(), 0, "a cache dropped is counted out");
    }

    /// A source that counts reads and is slow, so that concurrent readers overlap.
    struct Slow {
        inner: MemImage,
        reads: Counter,
    }

    impl GoldenImage for Slow {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.reads.inc();
            std::thread::sleep(std::time::Duration::from_millis(20));
            self.inner.read_at(buf, offset)
        }
        fn describe(&self) -> String {
            "slow".into()
        }
    }

    #[test]
    fn concurrent_misses_of_one_chunk_make_one_fetch() {
        let source = Arc::new(Slow { inner: MemImage::new(vec![7u8; 1 << 20]), reads: Counter::default() });
        let cache = Arc::new(CachedImage::new(source.clone(), 1 << 20, 65536));
        std::thread::scope(|scope| {
            for _ in 0..8 {
                let cache = cache.clone();
                scope.spawn(move || {
                    let mut buf = vec![0u8; 4096];
                    cache.read_at(&mut buf, 8192).expect("read");
                    assert!(buf.iter().all(|&b| b == 7));
                });
            }
        });
        assert_eq!(source.reads.get(), 1, "one fetch for eight readers");
        assert_eq!(cache.stats().misses.get(), 1);
        assert_eq!(cache.stats().hits.get() + cache.stats().coalesced.get(), 7);
    }

    #[test]
    fn consecutive_misses_are_one_source_read() {
        let source = Arc::new(Slow {
            inner: MemImage::new((0..=255u8).cycle().take(1 << 20).collect()),
            reads: Counter::default(),
        });
        let cache = CachedImage::new(source.clone(), 1 << 20, 16 * 1024);
        // Chunk 1 cached first, so a 64 KiB read from chunk 0 misses 0, hits 1, misses 2 and 3.
        let mut buf = vec![0u8; 100];
        cache.read_at(&mut buf, 20_000).expect("read");
        let mut big = vec![0u8; 65536];
        let fetched = cache.read_counted(&mut big, 1000).expect("read");
        assert_eq!(fetched.ops, 2, "two runs of misses: chunk 0, then chunks 2 and 3 (and 4) together");
        assert_eq!(source.reads.get(), 3);
        assert!(big.iter().enumerate().all(|(i, &b)| b == ((1000 + i) % 256) as u8), "bytes in order");
    }

    /// Fails every read that touches `bad`; panics instead if `panics`.
    struct Failing {
        inner: MemImage,
        bad: std::ops::Range<u64>,
        panics: bool,
    }

    impl GoldenImage for Failing {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            if offset < self.bad.end && self.bad.start < offset + buf.len() as u64 {
                assert!(!self.panics, "a reader's bug");
                return Err(io::Error::other("bad sector"));
            }
            self.inner.read_at(buf, offset)
        }
        fn describe(&self) -> String {
            "failing".into()
        }
    }

    /// Reads chunks 0 to 2 with chunk 1 cached (two runs of misses: chunk 0, then chunk 2) from a
    /// source whose chunk 0 fails (an error, or a panic), then chunk 2 alone: it must be read,
    /// not waited for, and nothing stay claimed.
    fn a_read_of_chunk_2_after_chunk_0_failed(panics: bool) {
        let chunk = 16 * 1024u64;
        let source = Arc::new(Failing { inner: MemImage::new(vec![9u8; 1 << 20]), bad: 0..1, panics });
        let cache = Arc::new(CachedImage::new(source, 1 << 20, chunk));
        let mut buf = vec![0u8; 100];
        cache.read_at(&mut buf, chunk).expect("chunk 1 reads");
        let failing = cache.clone();
        let read = std::thread::spawn(move || failing.read_at(&mut vec![0u8; 3 * chunk as usize], 0)).join();
        match read {
            Err(_) => assert!(panics, "chunk 0's read panicked"),
            Ok(read) => assert!(!panics && read.is_err(), "chunk 0 is bad: {read:?}"),
        }
        assert!(cache.lock().pending.is_empty(), "claims left pending");
        let (done, finished) = std::sync::mpsc::channel();
        let reader = cache.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let _ = done.send(reader.read_at(&mut buf, 2 * chunk).map(|()| buf));
        });
        let read = finished.recv_timeout(std::time::Duration::from_secs(60)).expect("a read of chunk 2 must not hang");
        assert!(read.expect("chunk 2 is good").iter().all(|&b| b == 9));
    }

    /// A request whose first run of misses fails must not leave its later misses claimed: the
    /// next reader of those chunks would wait for a fetch nobody makes (this hung the simulation).
    #[test]
    fn a_failed_fetch_releases_every_chunk_the_request_claimed() {
        a_read_of_chunk_2_after_chunk_0_failed(false);
    }

    /// The same when the source read panics (a reader's bug; a vhost-user worker catches it and
    /// lives on): every later reader of those chunks, in any VM, waited for ever.
    #[test]
    fn a_panicking_fetch_releases_every_chunk_the_request_claimed() {
        a_read_of_chunk_2_after_chunk_0_failed(true);
    }

    #[test]
    fn a_scan_does_not_push_out_the_hot_set() {
        let (_, source) = image(64 << 20);
        let chunk = 4096u64;
        let cache = CachedImage::new(source, 256 * chunk, chunk);
        let mut buf = vec![0u8; chunk as usize];
        // A hot set read three times (so it reaches main), then a long scan read once.
        for _ in 0..3 {
            for i in 0..100 {
                cache.read_at(&mut buf, i * chunk).expect("read");
            }
        }
        for i in 1000..10_000 {
            cache.read_at(&mut buf, i * chunk).expect("read");
        }
        let before = cache.stats().misses.get();
        for i in 0..100 {
            cache.read_at(&mut buf, i * chunk).expect("read");
        }
        assert_eq!(cache.stats().misses.get(), before, "hot chunks survived the scan");
        assert!(cache.stats().cached_bytes.get() <= 256 * chunk);
        assert!(cache.stats().evictions.get() > 0);
    }
}
