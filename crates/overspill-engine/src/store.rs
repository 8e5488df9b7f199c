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
