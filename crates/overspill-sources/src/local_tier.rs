//! A local disk tier in front of a remote golden image: every chunk fetched from the remote store
//! is written to a sparse local file, and read from there ever after. The shared read cache in
//! RAM is bounded and evicts; this tier is bounded only by the image's size, so a golden image's
//! blocks cross the network once per server, however often the RAM cache forgets them.
//!
//! The file lives as long as the server (it is removed when the image is dropped): a restarted
//! server starts cold rather than trust a copy it cannot prove matches the source. If the local
//! disk fails or fills, reads are served from what was fetched and the tier stops growing: a
//! full local disk must never cost a VM a read.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use overspill_engine::golden::SourceReads;
use overspill_engine::GoldenImage;

use crate::SourceError;

/// Fetches of different chunks proceed in parallel; readers of one chunk wait for one fetch.
const STRIPES: usize = 64;

pub struct LocalTier {
    remote: Arc<dyn GoldenImage>,
    file: File,
    path: PathBuf,
    chunk_bytes: u64,
    /// One bit per chunk: written to the local file.
    present: Vec<AtomicU64>,
    stripes: Vec<Mutex<()>>,
    /// Set after a local write fails: the tier stops growing, reads go on.
    broken: AtomicBool,
}

impl LocalTier {
    pub fn new(remote: Arc<dyn GoldenImage>, dir: &Path) -> Result<Self, SourceError> {
        let chunk_bytes = remote.preferred_fetch_bytes().unwrap_or(crate::REMOTE_FETCH_BYTES);
        let io_error = |what: String| move |source| SourceError::Io { what, source };
        std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Named like the spill files, so a restarted server removes those of a dead one, and held
        // like them, so a server sharing the directory leaves it alone. A name still taken was
        // left by this pid's program before a restart in place: the next number does.
        let (path, file) = loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!("overspill-{}-tier{n}.golden", std::process::id()));
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
        file.set_len(remote.size()).map_err(io_error(format!("sizing {}", path.display())))?;
        let chunks = remote.size().div_ceil(chunk_bytes);
        let present = (0..chunks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        let stripes = (0..STRIPES).map(|_| Mutex::new(())).collect();
        tracing::info!(source = %remote.describe(), file = %path.display(), "local disk tier for a remote golden image");
        Ok(Self { remote, file, path, chunk_bytes, present, stripes, broken: AtomicBool::new(false) })
    }

    fn is_present(&self, chunk: u64) -> bool {
        self.present[(chunk / 64) as usize].load(Ordering::Acquire) & (1 << (chunk % 64)) != 0
    }

    /// Chunks held locally, for tests and reports.
    pub fn chunks_held(&self) -> u64 {
        self.present.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum()
    }

    /// Makes `chunk` local, or returns its bytes when the local file cannot take them.
    fn fetch(&self, chunk: u64, reads: &mut SourceReads) -> io::Result<Option<Vec<u8>>> {
        let _one_fetch = self.stripes[(chunk % STRIPES as u64) as usize].lock().unwrap_or_else(|p| p.into_inner());
        if self.is_present(chunk) {
            return Ok(None);
        }
        let start = chunk * self.chunk_bytes;
        let len = self.chunk_bytes.min(self.remote.size() - start) as usize;
        let mut data = vec![0u8; len];
        self.remote.read_at(&mut data, start)?;
        reads.ops += 1;
        reads.bytes += len as u64;
        if self.broken.load(Ordering::Relaxed) {
            return Ok(Some(data));
        }
        match self.file.write_all_at(&data, start) {
            Ok(()) => {
                self.present[(chunk / 64) as usize].fetch_or(1 << (chunk % 64), Ordering::Release);
                Ok(None)
            }
            Err(error) => {
                if !self.broken.swap(true, Ordering::Relaxed) {
                    tracing::warn!(file = %self.path.display(), %error, "local disk tier failed; reading from the remote source only");
                }
                Ok(Some(data))
            }
        }
    }
}

impl GoldenImage for LocalTier {
    fn size(&self) -> u64 {
        self.remote.size()
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
        let mut local_from = offset;
        for chunk in offset / c..=(end - 1) / c {
            if self.is_present(chunk) {
                continue;
            }
            if let Some(data) = self.fetch(chunk, &mut reads)? {
                // Not kept locally: copy this chunk's part straight from what was fetched, after
                // reading the local part before it.
                let chunk_start = chunk * c;
                let from = offset.max(chunk_start);
                let to = end.min(chunk_start + data.len() as u64);
                if local_from < from {
                    self.file.read_exact_at(
                        &mut buf[(local_from - offset) as usize..(from - offset) as usize],
                        local_from,
                    )?;
                }
                buf[(from - offset) as usize..(to - offset) as usize]
                    .copy_from_slice(&data[(from - chunk_start) as usize..(to - chunk_start) as usize]);
                local_from = to;
            }
        }
        if local_from < end {
            self.file.read_exact_at(&mut buf[(local_from - offset) as usize..(end - offset) as usize], local_from)?;
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
