//! Files that live exactly as long as one overlay: the spill log and the in-place cache files.
//!
//! [`BackingFile`] is the seam where simulations inject faults; [`ScratchFile`] is the real one.
//! Nothing here ever syncs: the cache is thrown away with the VM, so durability across a host
//! crash buys nothing and would cost a flush per block.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::FallocateFlags;

pub trait BackingFile: Send {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()>;
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Gives the range's space back to the filesystem; it reads as zeroes afterwards.
    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()>;
    /// Bytes the filesystem has allocated for the file (what `du` shows).
    fn allocated_bytes(&self) -> io::Result<u64>;
    fn path(&self) -> Option<&Path>;
}

/// A file created for one overlay and removed when the overlay is dropped.
#[derive(Debug)]
pub struct ScratchFile {
    file: File,
    path: PathBuf,
}

impl ScratchFile {
    /// Creates `dir/name`, refusing to reuse an existing file (it could belong to a live VM).
    pub fn create(dir: &Path, name: &str, logical_size: u64) -> io::Result<Self> {
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
        let scratch = Self { file, path };
        scratch.file.set_len(logical_size)?;
        Ok(scratch)
    }
}

impl BackingFile for ScratchFile {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(data, offset)
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
        rustix::fs::fallocate(&self.file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len)
            .map_err(io::Error::from)
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        // st_blocks counts 512-byte units whatever the filesystem's block size.
        Ok(self.file.metadata()?.blocks() * 512)
    }

    fn path(&self) -> Option<&Path> {
        Some(&self.path)
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "could not remove cache file");
        }
    }
}
