//! A local disk tier in front of a remote golden image: every chunk fetched from the remote store
//! is written to a sparse local file, and read from there ever after. The shared read cache in
//! RAM is bounded and evicts; this tier is bounded only by the image's size, so a golden image's
//! blocks cross the network once per server, however often the RAM cache forgets them.
//!
//! The file lives as long as the server (it is removed when the image is dropped): a restarted
//! server starts cold rather than trust a copy it cannot prove matches the source. If the local
//! disk fails or fills, reads are served from what was fetched and the tier stops growing: a
//! full local disk must never cost a VM a read. Nor may it serve other bytes than the source's:
//! the page cache takes a write at once and the disk may fail it later (a thin pool out of
//! space, a failing disk), after which the file reads as whatever the disk holds, zeroes most
//! likely. So each chunk's CRC-32C is kept in memory from its fetch and checked on every local
//! read; a chunk that fails is fetched again.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use overspill_engine::golden::SourceReads;
use overspill_engine::GoldenImage;

use crate::SourceError;

pub struct LocalTier {
    remote: Arc<dyn GoldenImage>,
    file: File,
    path: PathBuf,
    chunk_bytes: u64,
    /// One bit per chunk: written to the local file.
    present: Vec<AtomicU64>,
    /// Each present chunk's CRC-32C, stored before its present bit is set.
    sums: Vec<AtomicU32>,
    /// Chunks being fetched: readers of one chunk wait for its one fetch, and a fetch of another
    /// chunk waits for nothing (a slow remote read held up no other chunk's).
    fetching: Mutex<HashSet<u64>>,
    fetched: Condvar,
    /// Set after a local write fails: the tier stops growing, reads go on.
    broken: AtomicBool,
}

/// The most memory a local tier's chunk tables may take (a design bound: 256 KiB chunks over a
/// 16 TiB image take 264 MiB).
const MAX_TABLE_BYTES: u64 = 1 << 30;

impl LocalTier {
    pub fn new(remote: Arc<dyn GoldenImage>, dir: &Path) -> Result<Self, SourceError> {
        let chunk_bytes = remote.preferred_fetch_bytes().unwrap_or(crate::REMOTE_FETCH_BYTES);
        // A sum of 4 bytes and a bit per chunk, kept in memory: refused, with what to change,
        // where small chunks over a large image would take more than a server should spend.
        let table_bytes = remote.size().div_ceil(chunk_bytes).saturating_mul(33).div_ceil(8);
        if table_bytes > MAX_TABLE_BYTES {
            return Err(SourceError::Remote {
                what: remote.describe(),
                message: format!(
                    "a local tier over {} bytes in chunks of {chunk_bytes} would keep {table_bytes} bytes of \
                     checksums in memory, more than {MAX_TABLE_BYTES}: fetch in larger chunks (--remote-chunk)",
                    remote.size()
                ),
            });
        }
        let io_error = |what: String| move |source| SourceError::Io { what, source };
        std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Named like the spill files, so a restarted server removes those of a dead one, and held
        // like them, so a server sharing the directory leaves it alone. A name still taken was
        // left by this pid's program before a restart in place: the next number does.
        let (path, file) = loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(overspill_engine::store::scratch_file_name(&format!("tier{n}"), "golden"));
            match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path) {
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => continue,
                opened => {
                    let file = opened
                        .and_then(|file| overspill_engine::store::hold(&file, &path).map(|()| file))
                        .map_err(io_error(format!("creating {}", path.display())))?;
                    break (path, file);
                }
            }
        };
        if let Err(error) = file.set_len(remote.size()) {
            // Made here, so removed here: a tier never made is never dropped.
            let _ = std::fs::remove_file(&path);
            return Err(io_error(format!("sizing {}", path.display()))(error));
        }
        let chunks = remote.size().div_ceil(chunk_bytes);
        let present = (0..chunks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        let sums = (0..chunks).map(|_| AtomicU32::new(0)).collect();
        tracing::info!(source = %remote.describe(), file = %path.display(), "local disk tier for a remote golden image");
        Ok(Self {
            remote,
            file,
            path,
            chunk_bytes,
            present,
            sums,
            fetching: Mutex::new(HashSet::new()),
            fetched: Condvar::new(),
            broken: AtomicBool::new(false),
        })
    }

    fn chunk_len(&self, chunk: u64) -> usize {
        self.chunk_bytes.min(self.remote.size() - chunk * self.chunk_bytes) as usize
    }

    fn fetching(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.fetching.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `chunk` to this reader alone (until the claim drops), once no other holds it.
    fn claim(&self, chunk: u64) -> Claim<'_> {
        let mut fetching = self.fetching();
        while !fetching.insert(chunk) {
            fetching = self.fetched.wait(fetching).unwrap_or_else(|p| p.into_inner());
        }
        Claim { tier: self, chunk }
    }

    fn is_present(&self, chunk: u64) -> bool {
        self.present[(chunk / 64) as usize].load(Ordering::Acquire) & (1 << (chunk % 64)) != 0
    }

    /// Chunks held locally, for tests and reports.
    pub fn chunks_held(&self) -> u64 {
        self.present.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum()
    }

    /// Fills `part` with `chunk`'s bytes from `within` on: from the local file, checked against
    /// the chunk's sum (read whole for that), else from a fetch.
    fn read_chunk_part(&self, chunk: u64, within: usize, part: &mut [u8], reads: &mut SourceReads) -> io::Result<()> {
        // A second pass only when another reader fetched the chunk meanwhile; a third only if
        // its copy then failed the check (the tier is broken from then on: the fetch returns).
        for _ in 0..3 {
            if self.is_present(chunk) {
                match self.read_local(chunk, within, part) {
                    Ok(()) => return Ok(()),
                    Err(why) => self.distrust(chunk, &why),
                }
            }
            if let Some(data) = self.fetch(chunk, reads)? {
                part.copy_from_slice(&data[within..within + part.len()]);
                return Ok(());
            }
        }
        Err(io::Error::other(format!(
            "{}: chunk at byte {} could not be read",
            self.path.display(),
            chunk * self.chunk_bytes
        )))
    }

    /// `part` of a present chunk from the local file, if the whole chunk there matches its sum.
    fn read_local(&self, chunk: u64, within: usize, part: &mut [u8]) -> Result<(), String> {
        let (start, len) = (chunk * self.chunk_bytes, self.chunk_len(chunk));
        let whole = within == 0 && part.len() == len;
        let mut scratch = Vec::new();
        let local: &mut [u8] = if whole {
            part
        } else {
            scratch.resize(len, 0);
            &mut scratch
        };
        self.file.read_exact_at(local, start).map_err(|e| format!("reading it failed: {e}"))?;
        if crc32c::crc32c(local) != self.sums[chunk as usize].load(Ordering::Relaxed) {
            return Err("its bytes are not what was fetched (a write the disk lost?)".into());
        }
        if !whole {
            part.copy_from_slice(&scratch[within..within + part.len()]);
        }
        Ok(())
    }

    /// A local copy that could not be read back as fetched: the chunk is fetched again, and the
    /// disk no longer trusted with new chunks (those it holds are still read, checked).
    fn distrust(&self, chunk: u64, why: &str) {
        if !self.broken.swap(true, Ordering::Relaxed) {
            tracing::warn!(file = %self.path.display(), offset = chunk * self.chunk_bytes, why, "local disk tier failed a check; new chunks are read from the remote source only");
        }
        let _one_fetch = self.claim(chunk);
        self.present[(chunk / 64) as usize].fetch_and(!(1 << (chunk % 64)), Ordering::AcqRel);
    }

    /// Fetches `chunk` and keeps it locally while the local file takes it; its bytes, or `None`
    /// when another reader made it local meanwhile.
    fn fetch(&self, chunk: u64, reads: &mut SourceReads) -> io::Result<Option<Vec<u8>>> {
        let _one_fetch = self.claim(chunk);
        if self.is_present(chunk) {
            return Ok(None);
        }
        let start = chunk * self.chunk_bytes;
        let mut data = vec![0u8; self.chunk_len(chunk)];
        self.remote.read_at(&mut data, start)?;
        reads.ops += 1;
        reads.bytes += data.len() as u64;
        if self.broken.load(Ordering::Relaxed) {
            return Ok(Some(data));
        }
        match self.file.write_all_at(&data, start) {
            Ok(()) => {
                self.sums[chunk as usize].store(crc32c::crc32c(&data), Ordering::Relaxed);
                self.present[(chunk / 64) as usize].fetch_or(1 << (chunk % 64), Ordering::Release);
            }
            Err(error) => {
                if !self.broken.swap(true, Ordering::Relaxed) {
                    tracing::warn!(file = %self.path.display(), %error, "local disk tier failed; reading from the remote source only");
                }
            }
        }
        Ok(Some(data))
    }
}

/// A chunk claimed for a fetch; dropped (the fetch done, failed or panicked), the chunk's
/// waiters look again.
struct Claim<'a> {
    tier: &'a LocalTier,
    chunk: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.tier.fetching().remove(&self.chunk);
        self.tier.fetched.notify_all();
    }
}

impl GoldenImage for LocalTier {
    fn size(&self) -> u64 {
        self.remote.size()
    }

    fn read_uncached(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.remote.read_uncached(buf, offset)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_counted(buf, offset).map(|_| ())
    }

    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        let end = offset.saturating_add(buf.len() as u64).min(self.size());
        let inside = (end.saturating_sub(offset) as usize).min(buf.len());
        buf[inside..].fill(0);
        let mut reads = SourceReads::default();
        if offset >= end {
            return Ok(reads);
        }
        let c = self.chunk_bytes;
        for chunk in offset / c..=(end - 1) / c {
            let chunk_start = chunk * c;
            let (from, to) = (offset.max(chunk_start), end.min(chunk_start + c));
            let part = &mut buf[(from - offset) as usize..(to - offset) as usize];
            self.read_chunk_part(chunk, (from - chunk_start) as usize, part, &mut reads)?;
        }
        Ok(reads)
    }

    fn describe(&self) -> String {
        format!("{} with a local disk tier", self.remote.describe())
    }

    fn identity(&self) -> Option<String> {
        self.remote.identity()
    }

    fn matches_identity(&self, recorded: &str) -> bool {
        self.remote.matches_identity(recorded)
    }

    fn unchanged(&self) -> io::Result<()> {
        self.remote.unchanged()
    }

    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<overspill_engine::Extent>> {
        self.remote.extents(offset, len)
    }

    fn preferred_fetch_bytes(&self) -> Option<u64> {
        Some(self.chunk_bytes)
    }
}

impl Drop for LocalTier {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use overspill_engine::MemImage;

    /// Counts what reaches the "remote" image.
    struct Counting {
        inner: MemImage,
        reads: AtomicU64,
    }

    impl GoldenImage for Counting {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            self.inner.read_at(buf, offset)
        }
        fn describe(&self) -> String {
            "counting".into()
        }
        fn preferred_fetch_bytes(&self) -> Option<u64> {
            Some(1 << 20)
        }
    }

    #[test]
    fn each_chunk_is_fetched_once_and_reads_match_the_source() {
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
        let remote = Arc::new(Counting { inner: MemImage::new(bytes.clone()), reads: AtomicU64::new(0) });
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::new(remote.clone(), dir.path()).expect("tier");
        for (offset, len) in [(0u64, 100usize), (1_000_000, 100_000), (2_999_990, 20), (500, 2_500_000)] {
            let mut buf = vec![0xffu8; len];
            tier.read_at(&mut buf, offset).expect("read");
            let end = (offset as usize + len).min(bytes.len());
            assert_eq!(&buf[..end - offset as usize], &bytes[offset as usize..end], "{offset}+{len}");
            assert!(buf[end - offset as usize..].iter().all(|&b| b == 0), "past the end reads zero");
        }
        assert_eq!(remote.reads.load(Ordering::Relaxed), 3, "three 1 MiB chunks, each fetched once");
        assert_eq!(tier.chunks_held(), 3);
        let path = tier.path.clone();
        drop(tier);
        assert!(!path.exists(), "the local copy goes with the image");
    }

    /// The disk lost what the page cache took (or something else wrote the file): the chunk's
    /// local copy no longer matches its sum, and is fetched again rather than served; the disk
    /// is then trusted with no more chunks.
    #[test]
    fn a_local_copy_that_changed_under_the_tier_is_fetched_again() {
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let remote = Arc::new(Counting { inner: MemImage::new(bytes.clone()), reads: AtomicU64::new(0) });
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::new(remote.clone(), dir.path()).expect("tier");
        let mut whole = vec![0u8; 1 << 20];
        tier.read_at(&mut whole, 1 << 20).expect("read chunk 1");
        tier.read_at(&mut whole[..5000], 2 << 20).expect("read part of chunk 2");
        assert_eq!(remote.reads.load(Ordering::Relaxed), 2);
        // Zeroes where chunks 1 and 2 were, as a disk that failed the writes would read.
        let other = OpenOptions::new().write(true).open(&tier.path).expect("second handle");
        other.write_all_at(&vec![0u8; 4096], (1 << 20) + 8192).expect("overwrite");
        other.write_all_at(&vec![0u8; 4096], (2 << 20) + 100_000).expect("overwrite");
        for (offset, len) in [(1u64 << 20, 1usize << 20), ((1 << 20) + 8000, 300), ((2 << 20) + 99_000, 2000)] {
            let mut buf = vec![0xeeu8; len];
            tier.read_at(&mut buf, offset).expect("read");
            assert!(buf[..] == bytes[offset as usize..offset as usize + len], "{offset}+{len}: the source's bytes");
        }
        // Once a copy has failed, the disk is trusted with no chunk: each read of one is a fetch.
        assert_eq!(remote.reads.load(Ordering::Relaxed), 5, "chunk 1 fetched again twice, chunk 2 once");
        assert_eq!(tier.chunks_held(), 0);
        tier.read_at(&mut whole, 0).expect("a chunk never fetched");
        assert!(whole[..] == bytes[..1 << 20]);
        assert_eq!((remote.reads.load(Ordering::Relaxed), tier.chunks_held()), (6, 0), "fetched, not kept");
    }

    /// A remote whose read at `slow` takes two seconds; `began` says it began.
    struct Slow {
        inner: MemImage,
        slow: u64,
        began: AtomicBool,
    }

    impl GoldenImage for Slow {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            if offset == self.slow {
                self.began.store(true, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_secs(2));
            }
            self.inner.read_at(buf, offset)
        }
        fn describe(&self) -> String {
            "slow".into()
        }
        fn preferred_fetch_bytes(&self) -> Option<u64> {
            Some(4096)
        }
    }

    /// A slow fetch holds up the readers of its chunk only: chunk 64 (which shared a lock
    /// with chunk 0 until session 52, and waited out its fetch) is fetched meanwhile.
    #[test]
    fn a_slow_fetch_holds_up_no_other_chunk() {
        let remote =
            Arc::new(Slow { inner: MemImage::new(vec![7u8; 1 << 20]), slow: 0, began: AtomicBool::new(false) });
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = Arc::new(LocalTier::new(remote.clone(), dir.path()).expect("tier"));
        let slow = tier.clone();
        let first = std::thread::spawn(move || slow.read_at(&mut [0u8; 4096], 0));
        while !remote.began.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let started = std::time::Instant::now();
        let mut buf = [0u8; 4096];
        tier.read_at(&mut buf, 64 * 4096).expect("chunk 64");
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(1), "chunk 64 waited {took:?} for chunk 0's fetch");
        assert!(buf.iter().all(|&b| b == 7));
        first.join().expect("chunk 0's reader").expect("chunk 0");
        assert_eq!(tier.chunks_held(), 2);
    }

    #[test]
    fn concurrent_readers_of_a_chunk_cause_one_fetch() {
        let remote = Arc::new(Counting { inner: MemImage::new(vec![3u8; 4 << 20]), reads: AtomicU64::new(0) });
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = Arc::new(LocalTier::new(remote.clone(), dir.path()).expect("tier"));
        std::thread::scope(|s| {
            for _ in 0..8 {
                let tier = tier.clone();
                s.spawn(move || {
                    let mut buf = vec![0u8; 4096];
                    tier.read_at(&mut buf, 12_288).expect("read");
                    assert!(buf.iter().all(|&b| b == 3));
                });
            }
        });
        assert_eq!(remote.reads.load(Ordering::Relaxed), 1);
    }
}
