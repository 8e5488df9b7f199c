//! A read-only qcow2 golden image: the format distributions ship cloud images in, and the one
//! sites keep golden images in as chains of versions.
//!
//! Supported: versions 2 and 3, any cluster size, allocated, unallocated and zero clusters,
//! compressed clusters (deflate, and zstd where the header says so), backing files of any format
//! this crate reads, in chains of any depth up to [`MAX_CHAIN_DEPTH`] (each layer opened
//! read-only; an unallocated cluster reads from the layer below, or zeroes at the bottom), and
//! internal snapshots present but ignored (the active layer is read). Refused when opening:
//! encryption, an external data file, extended L2 entries (subclusters), the corrupt bit,
//! unknown incompatible features, an unknown compression type.
//!
//! Lookups: the L1 table is read at open; L2 tables are read on first use and the most recently
//! used [`L2_CACHE_BYTES`] of them kept (one 64 KiB table maps 512 MiB of disk with 64 KiB
//! clusters: 32 MiB of tables cover 256 GiB; with 4 KiB clusters a table maps 2 MiB, and keeping
//! every table of a 1 TiB image would take 2 GiB).
//! The last few decompressed clusters are kept too: a read cache in front fetches in chunks that
//! may be smaller than a cluster, and each would otherwise inflate the whole cluster again.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use overspill_engine::{
    push_extent, push_layer_run, push_layer_runs_below, Allocation, EngineError, Extent, GoldenImage, LayerRun, Result,
};

use crate::Format;

const MAGIC: u32 = 0x5146_49fb;
/// Host offsets in L1 and standard L2 entries: bits 9–55.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L2_COMPRESSED: u64 = 1 << 62;
const L2_ZERO: u64 = 1;
/// The largest L1 table qemu opens, in bytes.
const MAX_L1_BYTES: usize = 32 << 20;
// Incompatible feature bits (qcow2 v3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_EXTERNAL_DATA: u64 = 1 << 2;
const INCOMPAT_COMPRESSION_TYPE: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
// Header extensions.
const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_DATA_FILE: u32 = 0x4441_5441;
/// A chain deeper than this is a loop or a mistake; qemu's limit is of the same order.
pub const MAX_CHAIN_DEPTH: usize = 64;
/// The most of an image one call of `layer_runs` maps.
const LAYER_RUNS_MAX_BYTES: u64 = 1 << 30;

/// L2 tables an open layer keeps, in bytes: what qemu keeps at most by default (32 MiB).
pub const L2_CACHE_BYTES: u64 = 32 << 20;

fn l2_tables_kept(cluster_bits: u32) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new((L2_CACHE_BYTES >> cluster_bits).max(1) as usize).unwrap_or(std::num::NonZeroUsize::MIN)
}
/// Decompressed clusters kept: enough for a few VMs reading neighbouring clusters at once.
const DECOMPRESSED_KEPT: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    Deflate,
    Zstd,
}

pub struct Qcow2Image {
    file: File,
    path: PathBuf,
    file_len: u64,
    size: u64,
    cluster_bits: u32,
    /// Version 3: L2 entries may mark zero clusters (a reserved bit in version 2).
    zero_clusters: bool,
    compression: Compression,
    l1: Vec<u64>,
    /// L2 tables by host offset, the least recently used out first.
    l2_cache: Mutex<lru::LruCache<u64, Arc<[u64]>>>,
    /// Host offset of a compressed cluster → its bytes, the newest last.
    decompressed: Mutex<Vec<(u64, Arc<[u8]>)>>,
    backing: Option<Arc<dyn GoldenImage>>,
    opened: overspill_engine::golden::FileState,
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

/// The backing file name the header of qcow2 image `path` gives, as written (nothing opened
/// through it); `None` for an image that stands alone.
pub fn backing_file_name(path: &Path) -> Result<Option<String>> {
    let file = File::open(path).map_err(|source| EngineError::Io { what: "opening a qcow2 image", source })?;
    let mut header = [0u8; 20];
    file.read_exact_at(&mut header, 0).map_err(|source| EngineError::Io { what: "reading a qcow2 header", source })?;
    if be32(&header, 0) != MAGIC {
        return Err(refuse(path, "not a qcow2 image"));
    }
    read_backing_name(&file, path, &header)
}

fn read_backing_name(file: &File, path: &Path, header: &[u8]) -> Result<Option<String>> {
    let (offset, len) = (be64(header, 8), u64::from(be32(header, 16)));
    if offset == 0 {
        return Ok(None);
    }
    if len == 0 || len > 1023 {
        return Err(refuse(path, format!("backing file name of {len} bytes")));
    }
    let mut name = vec![0u8; len as usize];
    file.read_exact_at(&mut name, offset)
        .map_err(|source| EngineError::Io { what: "reading qcow2 backing file name", source })?;
    String::from_utf8(name).map(Some).map_err(|_| refuse(path, "the backing file name is not UTF-8"))
}

fn refuse(path: &Path, why: impl std::fmt::Display) -> EngineError {
    EngineError::Config(format!("{}: {why}", path.display()))
}

fn corrupt(path: &Path, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", path.display()))
}

/// Whether a file's first bytes are the qcow2 magic.
pub fn has_magic(first: &[u8]) -> bool {
    first.len() >= 4 && be32(first, 0) == MAGIC
}

/// What the header extensions say that matters to a reader.
#[derive(Default)]
struct Extensions {
    backing_format: Option<String>,
    data_file: bool,
}

/// The header extensions from `at` on, which end at the end marker, the backing file's name
/// (qemu writes it after them; an image without a marker has its name there) or the first
/// cluster's end, whichever comes first.
fn read_extensions(
    file: &File,
    path: &Path,
    mut at: u64,
    header: &[u8],
    cluster: u64,
    file_len: u64,
) -> Result<Extensions> {
    let mut found = Extensions::default();
    let backing_name_at = be64(header, 8);
    let end = match backing_name_at {
        0 => cluster,
        name_at => cluster.min(name_at),
    }
    .min(file_len);
    while at + 8 <= end {
        let mut head = [0u8; 8];
        file.read_exact_at(&mut head, at)
            .map_err(|source| EngineError::Io { what: "reading qcow2 header extensions", source })?;
        let (kind, len) = (be32(&head, 0), be32(&head, 4) as u64);
        if kind == EXT_END {
            break;
        }
        if at + 8 + len > end {
            return Err(refuse(path, "a header extension runs past the header cluster"));
        }
        match kind {
            EXT_BACKING_FORMAT => {
                let mut name = vec![0u8; len as usize];
                file.read_exact_at(&mut name, at + 8)
                    .map_err(|source| EngineError::Io { what: "reading qcow2 backing format", source })?;
                found.backing_format = Some(String::from_utf8_lossy(&name).into_owned());
            }
            EXT_DATA_FILE => found.data_file = true,
            _ => {}
        }
        at += 8 + len.next_multiple_of(8);
    }
    Ok(found)
}

impl Qcow2Image {
    /// Opens an image and the chain of backing files under it.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_layer(path, &[])
    }

    /// Whether this image reads through a backing file.
    pub fn has_backing(&self) -> bool {
        self.backing.is_some()
    }

    /// `above`: the (device, inode) of every layer above this one, to refuse a chain that loops
    /// (each layer holds its L1 table while the layers under it open).
    pub(crate) fn open_layer(path: &Path, above: &[(u64, u64)]) -> Result<Self> {
        let file = File::open(path).map_err(|source| EngineError::Io { what: "opening golden image", source })?;
        let mut header = [0u8; 112];
        let metadata = file.metadata().map_err(|source| EngineError::Io { what: "stat golden image", source })?;
        let chain: Vec<(u64, u64)> = above.iter().copied().chain([(metadata.dev(), metadata.ino())]).collect();
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
        let cluster_bits = be32(&header, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(refuse(path, format!("cluster_bits {cluster_bits} out of range")));
        }
        let cluster = 1u64 << cluster_bits;
        let size = be64(&header, 24);
        if be32(&header, 32) != 0 {
            return Err(refuse(path, "encrypted qcow2 images are not supported"));
        }
        let mut compression = Compression::Deflate;
        let mut header_len = 72u64;
        if version == 3 {
            if have < 104 {
                return Err(refuse(path, "too short for a qcow2 version 3 header"));
            }
            header_len = u64::from(be32(&header, 100));
            if !(104..=cluster).contains(&header_len) {
                return Err(refuse(path, format!("header length {header_len} out of range")));
            }
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
            if incompatible & INCOMPAT_COMPRESSION_TYPE != 0 {
                compression = match header.get(104).filter(|_| header_len > 104) {
                    Some(0) => Compression::Deflate,
                    Some(1) => Compression::Zstd,
                    other => {
                        return Err(refuse(path, format!("compression type {other:?} is not supported")));
                    }
                };
            }
        }
        let extensions = read_extensions(&file, path, header_len, &header, cluster, file_len)?;
        if extensions.data_file {
            return Err(refuse(path, "external data files are not supported"));
        }
        let l1_size = be32(&header, 36) as usize;
        let l1_offset = be64(&header, 40);
        let entries_per_l2 = cluster / 8;
        let needed = size.div_ceil(cluster * entries_per_l2);
        if (l1_size as u64) < needed {
            return Err(refuse(path, format!("L1 table of {l1_size} entries cannot map {size} bytes")));
        }
        // qemu's own bound (QCOW_MAX_L1_SIZE, 32 MiB of table), which maps far more than any
        // disk: each layer keeps its table for as long as it is served.
        if l1_size > MAX_L1_BYTES / 8 {
            return Err(refuse(path, format!("an L1 table of {l1_size} entries, more than qemu's 32 MiB of them")));
        }
        if l1_offset.checked_add(l1_size as u64 * 8).is_none_or(|end| end > file_len) {
            return Err(refuse(path, "the L1 table lies past the end of the file"));
        }
        // Only the entries the disk's size reaches: a small disk whose header claims a huge L1
        // table would otherwise cost memory in proportion to the claim.
        let mut raw = vec![0u8; needed as usize * 8];
        file.read_exact_at(&mut raw, l1_offset)
            .map_err(|source| EngineError::Io { what: "reading qcow2 L1 table", source })?;
        let l1 = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        drop(raw);
        let backing = Self::open_backing(&file, path, &header, extensions.backing_format.as_deref(), &chain)?;
        let mut identity = overspill_engine::golden::file_identity(&metadata);
        if let Some(below) = &backing {
            identity = format!("{identity} on {}", below.identity().unwrap_or_default());
        }
        Ok(Self {
            file,
            path: path.to_path_buf(),
            file_len,
            size,
            cluster_bits,
            zero_clusters: version >= 3,
            compression,
            l1,
            l2_cache: Mutex::new(lru::LruCache::new(l2_tables_kept(cluster_bits))),
            decompressed: Mutex::default(),
            backing,
            identity,
            opened: overspill_engine::golden::FileState::of(&metadata),
        })
    }

    /// The layer under this one, if the header names one: a path relative to this image's
    /// directory (as qemu-img writes it) or absolute, in the format the backing format
    /// extension names, or else the one its magic says.
    fn open_backing(
        file: &File,
        path: &Path,
        header: &[u8],
        format: Option<&str>,
        chain: &[(u64, u64)],
    ) -> Result<Option<Arc<dyn GoldenImage>>> {
        let Some(name) = read_backing_name(file, path, header)? else { return Ok(None) };
        if chain.len() >= MAX_CHAIN_DEPTH {
            return Err(refuse(path, format!("the backing chain is deeper than {MAX_CHAIN_DEPTH} layers (a loop?)")));
        }
        if name.contains("://") || name.starts_with("json:") {
            return Err(refuse(path, format!("backing file {name:?} is not a local file")));
        }
        let backing_path = match path.parent() {
            Some(dir) if Path::new(&name).is_relative() => dir.join(&name),
            _ => PathBuf::from(&name),
        };
        // Only a regular file can be a layer: opening a FIFO or a device would block or read
        // something that is not an image.
        match std::fs::metadata(&backing_path) {
            Ok(meta) if chain.contains(&(meta.dev(), meta.ino())) => {
                return Err(refuse(path, format!("backing file {name:?} is a layer above it: the chain loops")));
            }
            Ok(meta) if meta.is_file() => {}
            Ok(_) => return Err(refuse(path, format!("backing file {name:?} is not a regular file"))),
            Err(e) => return Err(refuse(path, format!("backing file {name:?} ({}): {e}", backing_path.display()))),
        }
        let format = match format {
            Some(named) => Format::from_name(named).ok_or_else(|| {
                refuse(
                    path,
                    format!("backing file {name:?} is in format {named:?}, which this reader does not support"),
                )
            })?,
            None => Format::probe(&backing_path).map_err(|e| refuse(path, format!("backing file {name:?}: {e}")))?,
        };
        let below = crate::open_layer(&backing_path, format, chain)
            .map_err(|e| refuse(path, format!("backing file {name:?}: {e}")))?;
        tracing::info!(image = %path.display(), backing = %below.describe(), "qcow2 layer opened on its backing file");
        Ok(Some(below))
    }

    fn l2_table(&self, offset: u64) -> io::Result<Arc<[u64]>> {
        if let Some(table) = self.l2_cache.lock().unwrap_or_else(|p| p.into_inner()).get(&offset) {
            return Ok(table.clone());
        }
        let mut raw = vec![0u8; 1 << self.cluster_bits];
        self.file.read_exact_at(&mut raw, offset)?;
        let table: Arc<[u64]> = raw.chunks_exact(8).map(|c| be64(c, 0)).collect::<Vec<_>>().into();
        self.l2_cache.lock().unwrap_or_else(|p| p.into_inner()).put(offset, table.clone());
        Ok(table)
    }

    /// Bytes of L2 tables kept now (at most [`L2_CACHE_BYTES`], or one table).
    pub fn l2_cache_bytes(&self) -> u64 {
        (self.l2_cache.lock().unwrap_or_else(|p| p.into_inner()).len() as u64) << self.cluster_bits
    }

    /// The L2 entry of the cluster holding guest `offset`; 0 when no L2 table maps it.
    fn l2_entry(&self, offset: u64) -> io::Result<u64> {
        let cluster = 1u64 << self.cluster_bits;
        let entries = cluster / 8;
        let l1_index = (offset / cluster / entries) as usize;
        let l2_offset = self.l1.get(l1_index).copied().unwrap_or(0) & OFFSET_MASK;
        if l2_offset == 0 {
            return Ok(0);
        }
        // As qemu: a table starts a cluster. (Tables a few bytes apart would each be read and
        // kept, a cluster apiece, for what a handful of clusters hold.)
        if !l2_offset.is_multiple_of(cluster) || l2_offset + cluster > self.file_len {
            return Err(corrupt(&self.path, format!("L1 entry {l1_index} points at {l2_offset}, not an L2 table")));
        }
        let entry = self.l2_table(l2_offset)?[((offset / cluster) % entries) as usize];
        // As qemu: the bit is reserved before version 3, and data read as zeroes is worse than
        // an error.
        if !self.zero_clusters && entry & L2_COMPRESSED == 0 && entry & L2_ZERO != 0 {
            return Err(corrupt(&self.path, format!("a zero cluster at {offset} in a version 2 image")));
        }
        Ok(entry)
    }

    fn cluster_of(&self, entry: u64) -> Cluster {
        if entry & L2_COMPRESSED != 0 {
            // The descriptor: a byte offset in the low bits, then the count of 512-byte sectors
            // the compressed data spans beyond the first, up to bit 61.
            let shift = 62 - (self.cluster_bits - 8);
            let offset = entry & ((1 << shift) - 1);
            let sectors = ((entry >> shift) & ((1 << (self.cluster_bits - 8)) - 1)) + 1;
            return Cluster::Compressed { offset, len: sectors * 512 - (offset & 511) };
        }
        let host = entry & OFFSET_MASK;
        if entry & L2_ZERO != 0 {
            Cluster::Zero { stored: host != 0 }
        } else if host == 0 {
            Cluster::Unallocated
        } else {
            Cluster::Data(host)
        }
    }

    fn decompress(&self, offset: u64, len: u64) -> io::Result<Arc<[u8]>> {
        {
            let kept = self.decompressed.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((_, bytes)) = kept.iter().find(|(at, _)| *at == offset) {
                return Ok(bytes.clone());
            }
        }
        // The last cluster's data may end before its last sector does.
        let len = len.min(self.file_len.saturating_sub(offset));
        let mut compressed = vec![0u8; len as usize];
        self.file.read_exact_at(&mut compressed, offset)?;
        let cluster = 1usize << self.cluster_bits;
        let mut out = vec![0u8; cluster];
        let filled = match self.compression {
            // Raw deflate, no zlib header: what qemu writes.
            Compression::Deflate => read_full(&mut flate2::read::DeflateDecoder::new(compressed.as_slice()), &mut out)?,
            Compression::Zstd => read_full(&mut zstd::stream::read::Decoder::new(compressed.as_slice())?, &mut out)?,
        };
        if filled != cluster {
            return Err(corrupt(&self.path, format!("a compressed cluster at {offset} inflates to {filled} bytes")));
        }
        let bytes: Arc<[u8]> = out.into();
        let mut kept = self.decompressed.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= DECOMPRESSED_KEPT {
            kept.remove(0);
        }
        kept.push((offset, bytes.clone()));
        Ok(bytes)
    }

    /// How many bytes from `pos` (at most `left`) read alike as `first`, the cluster at `pos`
    /// does: the clusters after it of the same kind (unallocated, zero, or data stored right
    /// after), so that a read of many clusters is one read of the file or the layer below,
    /// not one per cluster.
    fn run_from(&self, pos: u64, left: usize, first: &Cluster) -> io::Result<usize> {
        let cluster = 1u64 << self.cluster_bits;
        let aligned = |host: u64| {
            // The spec wants data clusters aligned (qemu calls anything else corruption): read
            // at face value, one would serve bytes shifted into the next cluster.
            if host.is_multiple_of(cluster) {
                Ok(())
            } else {
                Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("qcow2 data cluster at unaligned offset {host}: the image is corrupt"),
                ))
            }
        };
        if let Cluster::Data(host) = first {
            aligned(*host)?;
        }
        let mut n = ((cluster - pos % cluster) as usize).min(left);
        while n < left {
            let next = pos + n as u64;
            let joins = match (first, self.cluster_of(self.l2_entry(next)?)) {
                (Cluster::Unallocated, Cluster::Unallocated) | (Cluster::Zero { .. }, Cluster::Zero { .. }) => true,
                (Cluster::Data(host), Cluster::Data(then)) => {
                    aligned(then)?;
                    then == host + (next - pos + pos % cluster)
                }
                _ => false,
            };
            if !joins {
                break;
            }
            n += (cluster as usize).min(left - n);
        }
        Ok(n)
    }

    fn read_below(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match &self.backing {
            // A backing file shorter than this layer reads as zeroes past its end.
            Some(below) if offset < below.size() => {
                let inside = ((below.size() - offset) as usize).min(buf.len());
                below.read_at(&mut buf[..inside], offset)?;
                buf[inside..].fill(0);
            }
            _ => buf.fill(0),
        }
        Ok(())
    }
}

/// Where a cluster's bytes are, from its L2 entry.
enum Cluster {
    Unallocated,
    Zero { stored: bool },
    Data(u64),
    Compressed { offset: u64, len: u64 },
}

/// Reads until `buf` is full or the stream ends, and says how much it read; a stream that
/// goes on past `buf` is corrupt.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
        }
    }
    Ok(filled)
}

impl GoldenImage for Qcow2Image {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // A file changed under the reader fails in many ways (a table pointing past the end, an
        // unaligned cluster, a short read): the change is what the operator must hear of, not
        // "corrupt". The layers below checked their own files as they were read.
        let read = (|| -> io::Result<()> {
            let cluster = 1u64 << self.cluster_bits;
            let mut done = 0usize;
            while done < buf.len() {
                let pos = offset + done as u64;
                if pos >= self.size {
                    buf[done..].fill(0);
                    break;
                }
                let left = (buf.len() - done).min((self.size - pos) as usize);
                let kind = self.cluster_of(self.l2_entry(pos)?);
                let n = self.run_from(pos, left, &kind)?;
                let part = &mut buf[done..done + n];
                match kind {
                    Cluster::Data(host) => self.file.read_exact_at(part, host + pos % cluster)?,
                    Cluster::Zero { .. } => part.fill(0),
                    Cluster::Unallocated => self.read_below(part, pos)?,
                    Cluster::Compressed { offset, len } => {
                        let bytes = self.decompress(offset, len)?;
                        let from = (pos % cluster) as usize;
                        part.copy_from_slice(&bytes[from..from + n]);
                    }
                }
                done += n;
            }
            Ok(())
        })();
        self.opened.check(&self.file, &self.path)?;
        read
    }

    fn layer_runs(&self, offset: u64, len: u64) -> io::Result<Vec<LayerRun>> {
        let mut runs: Vec<LayerRun> = Vec::new();
        // A bounded piece per call (the caller asks again for the rest).
        let len = len.min(LAYER_RUNS_MAX_BYTES);
        let mapped = (|| -> io::Result<()> {
            let mut done = 0u64;
            while done < len {
                let pos = offset + done;
                if pos >= self.size {
                    push_layer_run(&mut runs, len - done, 0);
                    break;
                }
                let kind = self.cluster_of(self.l2_entry(pos)?);
                let n = self.run_from(pos, (len - done).min(self.size - pos) as usize, &kind)? as u64;
                match (&kind, &self.backing) {
                    (Cluster::Unallocated, Some(below)) => push_layer_runs_below(&mut runs, below.as_ref(), pos, n)?,
                    (Cluster::Unallocated, None) => push_layer_run(&mut runs, n, 0),
                    _ => push_layer_run(&mut runs, n, 1),
                }
                done += n;
            }
            Ok(())
        })();
        self.opened.check(&self.file, &self.path)?;
        mapped.map(|()| runs)
    }

    fn unchanged(&self) -> io::Result<()> {
        self.opened.check(&self.file, &self.path)?;
        self.backing.as_ref().map_or(Ok(()), |below| below.unchanged())
    }

    fn describe(&self) -> String {
        match &self.backing {
            Some(below) => format!("{} (qcow2) on {}", self.path.display(), below.describe()),
            None => format!("{} (qcow2)", self.path.display()),
        }
    }

    fn identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }

    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        // Checked after the look, as a read is: a map of a file changed under the server
        // would tell holes where the guest reads data.
        let mapped = (|| -> io::Result<Vec<Extent>> {
            let cluster = 1u64 << self.cluster_bits;
            let end = (offset + len).min(self.size);
            let mut extents = Vec::new();
            let mut pos = offset;
            while pos < end {
                let mut n = (cluster - pos % cluster).min(end - pos);
                let entry = self.l2_entry(pos)?;
                if entry == 0 {
                    // One L2 table's whole span is unallocated when its L1 entry is empty: step over
                    // it at once rather than cluster by cluster.
                    let span = cluster * (cluster / 8);
                    let l1_index = (pos / span) as usize;
                    if self.l1.get(l1_index).copied().unwrap_or(0) & OFFSET_MASK == 0 {
                        n = (span - pos % span).min(end - pos);
                    }
                }
                match self.cluster_of(entry) {
                    Cluster::Data(_) | Cluster::Compressed { .. } => push_extent(&mut extents, n, Allocation::Data),
                    Cluster::Zero { stored: true } => push_extent(&mut extents, n, Allocation::Zero),
                    Cluster::Zero { stored: false } => push_extent(&mut extents, n, Allocation::Hole),
                    Cluster::Unallocated => match &self.backing {
                        Some(below) if pos < below.size() => {
                            // The unallocated clusters that follow, in one question to the layer
                            // below: asked cluster by cluster, an almost empty L2 table cost 8,192
                            // of them (two seeks each for a raw file).
                            while pos + n < end
                                && matches!(self.cluster_of(self.l2_entry(pos + n)?), Cluster::Unallocated)
                            {
                                n = (n + cluster).min(end - pos);
                            }
                            let inside = n.min(below.size() - pos);
                            let mut covered = 0;
                            while covered < inside {
                                let parts = below.extents(pos + covered, inside - covered)?;
                                if parts.is_empty() {
                                    return Err(corrupt(&self.path, "the backing file reported no extents"));
                                }
                                for part in parts {
                                    push_extent(&mut extents, part.len, part.state);
                                    covered += part.len;
                                }
                            }
                            push_extent(&mut extents, n - inside, Allocation::Hole);
                        }
                        _ => push_extent(&mut extents, n, Allocation::Hole),
                    },
                }
                pos += n;
            }
            Ok(extents)
        })();
        self.opened.check(&self.file, &self.path)?;
        mapped
    }
}
