//! A read-only qcow2 golden image: a small reader for the common case, which refuses what it
//! does not support rather than guess.
//!
//! Supported: versions 2 and 3, any cluster size, allocated clusters, unallocated clusters and
//! v3 zero clusters (both read as zeroes), internal snapshots present but ignored (the active
//! layer is read). Refused when opening: encryption, a backing file, an external data file,
//! extended L2 entries (subclusters), the corrupt bit, unknown incompatible features. Refused
//! when read: compressed clusters (the read fails with `Unsupported`; convert the image with
//! `qemu-img convert -O qcow2` without `-c` first).
//!
//! Lookups: the L1 table is read at open; L2 tables are read on first use and kept (one 64 KiB
//! table maps 512 MiB of disk with 64 KiB clusters, so even a large image's tables are small).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use overspill_engine::{EngineError, GoldenImage, Result};

const MAGIC: u32 = 0x5146_49fb;
/// Host offsets in L1/L2 entries: bits 9–55.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L2_COMPRESSED: u64 = 1 << 62;
const L2_ZERO: u64 = 1;
// Incompatible feature bits (qcow2 v3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_EXTERNAL_DATA: u64 = 1 << 2;
const INCOMPAT_COMPRESSION_TYPE: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;

pub struct Qcow2Image {
    file: File,
    path: PathBuf,
    size: u64,
    cluster_bits: u32,
    l1: Vec<u64>,
    l2_cache: Mutex<HashMap<u64, Arc<[u64]>>>,
    identity: String,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn refuse(path: &Path, why: impl std::fmt::Display) -> EngineError {
    EngineError::Config(format!("{}: {why}", path.display()))
}

/// Whether a file's first bytes are the qcow2 magic.
pub fn has_magic(first: &[u8]) -> bool {
    first.len() >= 4 && be32(first, 0) == MAGIC
}

impl Qcow2Image {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| EngineError::Io { what: "opening golden image", source })?;
        let mut header = [0u8; 112];
        let metadata = file.metadata().map_err(|source| EngineError::Io { what: "stat golden image", source })?;
        let file_len = metadata.len();
        if file_len < 72 {
            return Err(refuse(path, "too short for a qcow2 header"));
        }
        let have = header.len().min(file_len as usize);
        file.read_exact_at(&mut header[..have], 0)
            .map_err(|source| EngineError::Io { what: "reading qcow2 header", source })?;
        if be32(&header, 0) != MAGIC {
            return Err(refuse(path, "not a qcow2 image"));
        }
        let version = be32(&header, 4);
        if version != 2 && version != 3 {
            return Err(refuse(path, format!("qcow2 version {version} is not supported")));
        }
        if be64(&header, 8) != 0 {
            return Err(refuse(
                path,
                "qcow2 images with a backing file are not supported; flatten it with qemu-img convert",
            ));
        }
        let cluster_bits = be32(&header, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(refuse(path, format!("cluster_bits {cluster_bits} out of range")));
        }
        let size = be64(&header, 24);
        if be32(&header, 32) != 0 {
            return Err(refuse(path, "encrypted qcow2 images are not supported"));
        }
        if version == 3 {
            let incompatible = be64(&header, 72);
            let known = INCOMPAT_DIRTY
                | INCOMPAT_CORRUPT
                | INCOMPAT_EXTERNAL_DATA
                | INCOMPAT_COMPRESSION_TYPE
                | INCOMPAT_EXTENDED_L2;
            for (bit, what) in [
                (INCOMPAT_CORRUPT, "the image is marked corrupt"),
                (INCOMPAT_EXTERNAL_DATA, "external data files are not supported"),
                (INCOMPAT_EXTENDED_L2, "extended L2 entries (subclusters) are not supported"),
                (!known, "the image uses incompatible features this reader does not know"),
            ] {
                if incompatible & bit != 0 {
                    return Err(refuse(path, what));
                }
            }
        }
        let l1_size = be32(&header, 36) as usize;
        let l1_offset = be64(&header, 40);
        let cluster = 1u64 << cluster_bits;
        let entries_per_l2 = cluster / 8;
        let needed = size.div_ceil(cluster * entries_per_l2);
        if (l1_size as u64) < needed || l1_size > 32 << 20 {
            return Err(refuse(path, format!("L1 table of {l1_size} entries cannot map {size} bytes")));
        }
        let mut raw = vec![0u8; l1_size * 8];
        file.read_exact_at(&mut raw, l1_offset)
            .map_err(|source| EngineError::Io { what: "reading qcow2 L1 table", source })?;
        let l1 = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        let identity = overspill_engine::golden::file_identity(&metadata);
        Ok(Self { file, path: path.to_path_buf(), size, cluster_bits, l1, l2_cache: Mutex::default(), identity })
    }

    fn l2_table(&self, offset: u64) -> io::Result<Arc<[u64]>> {
        if let Some(table) = self.l2_cache.lock().unwrap_or_else(|p| p.into_inner()).get(&offset) {
            return Ok(table.clone());
        }
        let mut raw = vec![0u8; 1 << self.cluster_bits];
        self.file.read_exact_at(&mut raw, offset)?;
        let table: Arc<[u64]> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect::<Vec<_>>().into();
        self.l2_cache.lock().unwrap_or_else(|p| p.into_inner()).insert(offset, table.clone());
        Ok(table)
    }

    /// Where guest `offset` lives: `Some(host offset)` or `None` for zeroes.
    fn map(&self, offset: u64) -> io::Result<Option<u64>> {
        let cluster = 1u64 << self.cluster_bits;
        let entries = cluster / 8;
        let l1_index = (offset / cluster / entries) as usize;
        let l2_offset = self.l1.get(l1_index).copied().unwrap_or(0) & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(None);
        }
        let entry = self.l2_table(l2_offset)?[((offset / cluster) % entries) as usize];
        if entry & L2_COMPRESSED != 0 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: compressed clusters are not supported", self.path.display()),
            ));
        }
        let host = entry & OFFSET_MASK;
        if entry & L2_ZERO != 0 || host == 0 {
            return Ok(None);
        }
        Ok(Some(host + offset % cluster))
    }
}

impl GoldenImage for Qcow2Image {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let cluster = 1u64 << self.cluster_bits;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            if pos >= self.size {
                buf[done..].fill(0);
                break;
            }
            let n = ((cluster - pos % cluster) as usize).min(buf.len() - done).min((self.size - pos) as usize);
            match self.map(pos)? {
                Some(host) => self.file.read_exact_at(&mut buf[done..done + n], host)?,
                None => buf[done..done + n].fill(0),
            }
            done += n;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("{} (qcow2)", self.path.display())
    }

    fn identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }
}
