//! The shared read cache in front of a golden image: every VM of the image reads through it, so a
//! boot storm reads each golden block from storage once, not once per VM (the seeds' "system
//! cache" of the provisioning server).
//!
//! The cache holds fixed-size chunks (64 KiB by default, aligned) under S3-FIFO, which resists
//! scans: a chunk enters a small FIFO (a tenth of the space); if it is read again before it
//! leaves, it moves to the main FIFO, otherwise it leaves and only its number is remembered in a
//! ghost FIFO, so that a chunk coming back soon goes straight to main. Chunks in main that were
//! read since the hand last passed get another lap. One boot's worth of one-time reads therefore
//! cannot push out the blocks every VM reads.
//!
//! A miss is fetched from the source outside the lock, so readers of other chunks are not held
//! up; VMs that miss a chunk while it is being fetched wait for that one fetch instead of issuing
//! their own, so a boot storm of VMs reading the same block in lockstep makes one request.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::sync::{Arc, Condvar, Mutex};

use crate::golden::{GoldenImage, SourceReads};
use crate::stats::{Counter, Gauge};

pub const DEFAULT_CHUNK_BYTES: u64 = 64 * 1024;

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
}

struct Entry {
    data: Arc<[u8]>,
    /// Reads since it entered or since the main FIFO's hand last passed, capped at 3.
    freq: u8,
    in_main: bool,
}

/// How a fetch ended, kept so that every waiter gets it (io::Error is not Clone).
type FetchOutcome = Result<Arc<[u8]>, (io::ErrorKind, String)>;

/// A fetch in flight, which later readers of the same chunk wait for.
#[derive(Default)]
struct Pending {
    result: Mutex<Option<FetchOutcome>>,
    ready: Condvar,
}

impl Pending {
    fn complete(&self, result: &io::Result<Arc<[u8]>>) {
        let shared = match result {
            Ok(data) => Ok(data.clone()),
            Err(e) => Err((e.kind(), e.to_string())),
        };
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(shared);
        self.ready.notify_all();
    }

    fn wait(&self) -> io::Result<Arc<[u8]>> {
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

enum Lookup {
    Hit(Arc<[u8]>),
    Wait(Arc<Pending>),
    Fetch(Arc<Pending>),
}

struct S3Fifo {
    entries: HashMap<u64, Entry>,
    pending: HashMap<u64, Arc<Pending>>,
    small: VecDeque<u64>,
    main: VecDeque<u64>,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64>,
    small_bytes: u64,
    main_bytes: u64,
    capacity_bytes: u64,
    chunk_bytes: u64,
}

impl S3Fifo {
    fn get(&mut self, chunk: u64) -> Option<Arc<[u8]>> {
        let entry = self.entries.get_mut(&chunk)?;
        entry.freq = (entry.freq + 1).min(3);
        Some(entry.data.clone())
    }

    fn insert(&mut self, chunk: u64, data: Arc<[u8]>, stats: &ReadCacheStats) {
        if self.entries.contains_key(&chunk) || data.len() as u64 > self.capacity_bytes {
            return;
        }
        let len = data.len() as u64;
        let in_main = self.ghost_set.remove(&chunk);
        if in_main {
            self.main.push_back(chunk);
            self.main_bytes += len;
        } else {
            self.small.push_back(chunk);
            self.small_bytes += len;
        }
        self.entries.insert(chunk, Entry { data, freq: 0, in_main });
        while self.small_bytes + self.main_bytes > self.capacity_bytes {
            if self.small_bytes > self.capacity_bytes / 10 || self.main.is_empty() {
                self.evict_small(stats);
            } else {
                self.evict_main(stats);
            }
        }
        stats.cached_bytes.set(self.small_bytes + self.main_bytes);
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
    stats: Arc<ReadCacheStats>,
}

impl CachedImage {
    /// `chunk_bytes` must be a power of two.
    pub fn new(source: Arc<dyn GoldenImage>, capacity_bytes: u64, chunk_bytes: u64) -> Self {
        assert!(chunk_bytes.is_power_of_two(), "chunk size must be a power of two");
        let stats = Arc::new(ReadCacheStats::default());
        stats.capacity_bytes.set(capacity_bytes);
        let cache = S3Fifo {
            entries: HashMap::new(),
            pending: HashMap::new(),
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            ghost_set: HashSet::new(),
            small_bytes: 0,
            main_bytes: 0,
            capacity_bytes,
            chunk_bytes,
        };
        Self { source, cache: Mutex::new(cache), chunk_bytes, stats }
    }

    pub fn stats(&self) -> &Arc<ReadCacheStats> {
        &self.stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, S3Fifo> {
        // The cache holds only copies of the source's bytes; a panic elsewhere leaves them valid.
        self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The chunk's bytes (shorter at the end of the image), and whether this call fetched it.
    fn chunk(&self, chunk: u64) -> io::Result<(Arc<[u8]>, bool)> {
        let lookup = {
            let mut cache = self.lock();
            if let Some(data) = cache.get(chunk) {
                Lookup::Hit(data)
            } else if let Some(pending) = cache.pending.get(&chunk) {
                Lookup::Wait(pending.clone())
            } else {
                let pending = Arc::new(Pending::default());
                cache.pending.insert(chunk, pending.clone());
                Lookup::Fetch(pending)
            }
        };
        match lookup {
            Lookup::Hit(data) => {
                self.stats.hits.inc();
                Ok((data, false))
            }
            Lookup::Wait(pending) => {
                self.stats.coalesced.inc();
                pending.wait().map(|data| (data, false))
            }
            Lookup::Fetch(pending) => {
                self.stats.misses.inc();
                let result = self.fetch(chunk);
                {
                    let mut cache = self.lock();
                    cache.pending.remove(&chunk);
                    if let Ok(data) = &result {
                        cache.insert(chunk, data.clone(), &self.stats);
                    }
                }
                pending.complete(&result);
                result.map(|data| (data, true))
            }
        }
    }

    fn fetch(&self, chunk: u64) -> io::Result<Arc<[u8]>> {
        let start = chunk * self.chunk_bytes;
        let len = self.chunk_bytes.min(self.source.size().saturating_sub(start));
        let mut data = vec![0u8; len as usize];
        self.source.read_at(&mut data, start)?;
        self.stats.fetched_chunks.inc();
        self.stats.fetched_bytes.add(len);
        Ok(data.into())
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
        let size = self.size();
        let mut fetched = SourceReads::default();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            if pos >= size {
                buf[done..].fill(0);
                break;
            }
            let chunk = pos / self.chunk_bytes;
            let within = (pos - chunk * self.chunk_bytes) as usize;
            let (data, was_fetched) = self.chunk(chunk)?;
            if was_fetched {
                fetched.ops += 1;
                fetched.bytes += data.len() as u64;
            }
            let n = (data.len() - within).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&data[within..within + n]);
            done += n;
        }
        Ok(fetched)
    }

    fn describe(&self) -> String {
        format!("{} through a {}-byte shared read cache", self.source.describe(), self.stats.capacity_bytes.get())
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
