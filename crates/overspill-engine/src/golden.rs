//! Golden images: read-only by construction.
//!
//! A [`GoldenImage`] offers only reads, so no code path in the engine can write one. A raw file is
//! opened without write permission as a second line of defence.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// Reads that reached an image's underlying storage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceReads {
    pub ops: u64,
    pub bytes: u64,
}

/// The shared, never-written base of every overlay.
pub trait GoldenImage: Send + Sync {
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; bytes past the end of the image read as zero.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Like [`Self::read_at`], and says what it cost the storage behind the image: one read of
    /// `buf.len()` bytes for a plain image, only the misses for a cached one.
    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        self.read_at(buf, offset)?;
        Ok(SourceReads { ops: 1, bytes: buf.len() as u64 })
    }
    fn describe(&self) -> String;
    /// The chunk a read cache in front should fetch at a time, if not the default: remote
    /// stores, where every request costs a round trip, want large ones.
    fn preferred_fetch_bytes(&self) -> Option<u64> {
        None
    }
}

/// Opens a golden image by its format: qcow2 (by its magic) or raw.
pub fn open_image(path: &Path) -> Result<std::sync::Arc<dyn GoldenImage>> {
    if crate::qcow2::is_qcow2(path) {
        Ok(std::sync::Arc::new(crate::qcow2::Qcow2Image::open(path)?))
    } else {
        Ok(std::sync::Arc::new(RawImage::open(path)?))
    }
}

/// A raw disk image file.
#[derive(Debug)]
pub struct RawImage {
    file: File,
    size: u64,
    path: PathBuf,
}

impl RawImage {
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .open(path)
            .map_err(|source| EngineError::Io { what: "opening golden image", source })?;
        let metadata = file.metadata().map_err(|source| EngineError::Io { what: "stat golden image", source })?;
        if !metadata.is_file() {
            return Err(EngineError::Config(format!("{} is not a regular file", path.display())));
        }
        Ok(Self { file, size: metadata.len(), path: path.to_path_buf() })
    }
}

impl GoldenImage for RawImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let n = match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// An image of zeroes that stores nothing: the planner's stand-in for a golden image whose
/// contents do not change any figure.
#[derive(Debug, Clone, Copy)]
pub struct ZeroImage {
    pub size: u64,
}

impl GoldenImage for ZeroImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], _offset: u64) -> io::Result<()> {
        buf.fill(0);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("zeroes ({} bytes)", self.size)
    }
}

/// A golden image held in memory, for simulations and tests.
#[derive(Debug, Clone)]
pub struct MemImage {
    bytes: Vec<u8>,
}

impl MemImage {
    pub fn new(bytes: Vec<u8>) -> Self {
        Self { bytes }
    }
}

impl GoldenImage for MemImage {
    fn size(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.bytes.len());
        let end = start.saturating_add(buf.len()).min(self.bytes.len());
        let n = end - start;
        buf[..n].copy_from_slice(&self.bytes[start..end]);
        buf[n..].fill(0);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("memory ({} bytes)", self.bytes.len())
    }
}
