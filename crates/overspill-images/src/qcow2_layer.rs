//! Writing a qcow2 layer: what a VM changed over the image it booted, as a qcow2 (version 3)
//! file whose backing file is that image, which qemu-img and this crate's reader both read.
//!
//! Clusters are 4 KiB, the engine's block: a block the VM wrote is a data cluster, a block it
//! zeroed a zero cluster (reads zeroes, stores nothing), and every other block, trimmed ones
//! included, is unallocated and reads the layer below. No cluster is ever partly the VM's, so
//! nothing of the image below is copied.
//!
//! The file is written front to back and described last: the header and the L1 table have their
//! room at the start, data clusters follow in the order they come, then the L2 tables, the
//! refcount blocks (every cluster used once) and the refcount table, and finally the L1 table and
//! the header. A layer is written under a temporary name by its caller and renamed into place
//! once [`LayerWriter::finish`] has synced it: a crash leaves no half layer under a version's name.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use overspill_engine::{MovedRun, Overlay};

use crate::Format;

const MAGIC: u32 = 0x5146_49fb;
const CLUSTER_BITS: u32 = 12;
const CLUSTER: u64 = 1 << CLUSTER_BITS;
/// Entries of one L2 table (a cluster of 8-byte entries): each maps 4 KiB, the table 2 MiB.
const L2_ENTRIES: u64 = CLUSTER / 8;
/// 16-bit refcounts (refcount_order 4, qemu's default).
const REFCOUNT_ORDER: u32 = 4;
const REFCOUNTS_PER_BLOCK: u64 = CLUSTER / 2;
const HEADER_LENGTH: u32 = 104;
/// The cluster's refcount is exactly one: set on every L1 and L2 entry, as qemu expects.
const COPIED: u64 = 1 << 63;
/// An L2 entry of a cluster that reads as zeroes (qcow2 version 3).
const ZERO: u64 = 1;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_END: u32 = 0;

/// A qcow2 layer being written; see the module's doc.
pub struct LayerWriter {
    file: File,
    disk_bytes: u64,
    backing: Vec<u8>,
    backing_format: &'static str,
    l1_entries: u64,
    /// The L2 tables, by L1 index: each block's entry (0: unallocated).
    l2: BTreeMap<u64, Vec<u64>>,
    /// The next free cluster.
    next: u64,
}

impl LayerWriter {
    /// Creates `path` (which must not exist) for a layer of a disk of `disk_bytes` over
    /// `backing`, a file name as the layer will find it (relative to the layer's directory)
    /// in `format`.
    pub fn create(path: &Path, disk_bytes: u64, backing: &str, format: Format) -> io::Result<Self> {
        let backing_format = match format {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
            Format::Vhdx => "vhdx",
        };
        let backing = backing.as_bytes().to_vec();
        // Header, its extensions and the backing file's name share the first cluster.
        if backing.is_empty() || backing.len() > 1023 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a backing file name of 1 to 1023 bytes"));
        }
        let file = OpenOptions::new().write(true).create_new(true).mode(0o644).open(path)?;
        let l1_entries = disk_bytes.div_ceil(CLUSTER * L2_ENTRIES).max(1);
        let l1_clusters = (l1_entries * 8).div_ceil(CLUSTER);
        Ok(Self { file, disk_bytes, backing, backing_format, l1_entries, l2: BTreeMap::new(), next: 1 + l1_clusters })
    }

    fn entry(&mut self, block: u64) -> io::Result<&mut u64> {
        if block >= self.disk_bytes.div_ceil(CLUSTER) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("block {block} lies past the disk")));
        }
        let table = self.l2.entry(block / L2_ENTRIES).or_insert_with(|| vec![0; L2_ENTRIES as usize]);
        Ok(&mut table[(block % L2_ENTRIES) as usize])
    }

    /// Blocks from `first` on hold `data` (whole 4 KiB blocks). A block given before is
    /// written over where it lies.
    pub fn data(&mut self, first: u64, data: &[u8]) -> io::Result<()> {
        if !(data.len() as u64).is_multiple_of(CLUSTER) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "data of whole 4 KiB blocks"));
        }
        let blocks = data.len() as u64 / CLUSTER;
        // Runs of blocks whose clusters follow one another go in one write: (first block of
        // the run within `data`, its cluster, blocks).
        let mut run: Option<(u64, u64, u64)> = None;
        for i in 0..blocks {
            let entry = *self.entry(first + i)?;
            let cluster = match entry & !(COPIED | ZERO) {
                0 => {
                    let cluster = self.next;
                    self.next += 1;
                    *self.entry(first + i)? = (cluster * CLUSTER) | COPIED;
                    cluster
                }
                offset => {
                    // A zeroed block written again: its cluster holds data once more.
                    *self.entry(first + i)? = offset | COPIED;
                    offset / CLUSTER
                }
            };
            run = match run {
                Some((start, at, n)) if cluster == at + n => Some((start, at, n + 1)),
                done => {
                    if let Some(done) = done {
                        self.write_run(data, done)?;
                    }
                    Some((i, cluster, 1))
                }
            };
        }
        match run {
            Some(run) => self.write_run(data, run),
            None => Ok(()),
        }
    }

    fn write_run(&self, data: &[u8], (start, cluster, blocks): (u64, u64, u64)) -> io::Result<()> {
        let bytes = &data[(start * CLUSTER) as usize..((start + blocks) * CLUSTER) as usize];
        overspill_engine::crash::point();
        self.file.write_all_at(bytes, cluster * CLUSTER)
    }

    /// Blocks `[first, end)` read as zeroes (whatever the layer below holds there).
    pub fn zeroes(&mut self, first: u64, end: u64) -> io::Result<()> {
        for block in first..end {
            // A block written before keeps its cluster, as a preallocated zero cluster: still
            // referenced, so that its refcount is no leak.
            let entry = self.entry(block)?;
            *entry = match *entry & !(COPIED | ZERO) {
                0 => ZERO,
                offset => offset | COPIED | ZERO,
            };
        }
        Ok(())
    }

    /// Writes the tables and the header, and syncs the file.
    pub fn finish(mut self) -> io::Result<()> {
        let l2_tables: Vec<(u64, Vec<u64>)> = std::mem::take(&mut self.l2).into_iter().collect();
        let mut l1 = vec![0u64; self.l1_entries as usize];
        for (index, table) in &l2_tables {
            let cluster = self.next;
            self.next += 1;
            let bytes: Vec<u8> = table.iter().flat_map(|entry| entry.to_be_bytes()).collect();
            overspill_engine::crash::point();
            self.file.write_all_at(&bytes, cluster * CLUSTER)?;
            l1[*index as usize] = (cluster * CLUSTER) | COPIED;
        }
        // Refcount blocks and table cover every cluster, themselves included.
        let used = self.next;
        let (mut blocks, mut table) = (0u64, 0u64);
        loop {
            let total = used + blocks + table;
            let need_blocks = total.div_ceil(REFCOUNTS_PER_BLOCK);
            let need_table = need_blocks.div_ceil(CLUSTER / 8);
            if (need_blocks, need_table) == (blocks, table) {
                break;
            }
            (blocks, table) = (need_blocks, need_table);
        }
        let total = used + blocks + table;
        let mut table_entries = Vec::with_capacity(blocks as usize);
        for b in 0..blocks {
            let cluster = used + b;
            let covered = (total - b * REFCOUNTS_PER_BLOCK).min(REFCOUNTS_PER_BLOCK);
            let mut refcounts = vec![0u8; CLUSTER as usize];
            for i in 0..covered as usize {
                refcounts[2 * i..2 * i + 2].copy_from_slice(&1u16.to_be_bytes());
            }
            overspill_engine::crash::point();
            self.file.write_all_at(&refcounts, cluster * CLUSTER)?;
            table_entries.push(cluster * CLUSTER);
        }
        let table_at = used + blocks;
        let bytes: Vec<u8> = table_entries.iter().flat_map(|entry| entry.to_be_bytes()).collect();
        overspill_engine::crash::point();
        self.file.write_all_at(&bytes, table_at * CLUSTER)?;
        overspill_engine::crash::point();
        let bytes: Vec<u8> = l1.iter().flat_map(|entry| entry.to_be_bytes()).collect();
        self.file.write_all_at(&bytes, CLUSTER)?;
        overspill_engine::crash::point();
        self.file.set_len(total * CLUSTER)?;
        overspill_engine::crash::point();
        self.file.write_all_at(&self.header(table_at, table), 0)?;
        overspill_engine::crash::point();
        self.file.sync_all()
    }

    fn header(&self, refcount_table_cluster: u64, refcount_table_clusters: u64) -> Vec<u8> {
        let mut header = Vec::with_capacity(CLUSTER as usize);
        let format = self.backing_format.as_bytes();
        let ext_len = 8 + format.len().div_ceil(8) * 8 + 8;
        let backing_at = HEADER_LENGTH as u64 + ext_len as u64;
        header.extend_from_slice(&MAGIC.to_be_bytes());
        header.extend_from_slice(&3u32.to_be_bytes());
        header.extend_from_slice(&backing_at.to_be_bytes());
        header.extend_from_slice(&(self.backing.len() as u32).to_be_bytes());
        header.extend_from_slice(&CLUSTER_BITS.to_be_bytes());
        header.extend_from_slice(&self.disk_bytes.to_be_bytes());
        header.extend_from_slice(&0u32.to_be_bytes()); // no encryption
        header.extend_from_slice(&(self.l1_entries as u32).to_be_bytes());
        header.extend_from_slice(&CLUSTER.to_be_bytes()); // L1 table: the second cluster
        header.extend_from_slice(&(refcount_table_cluster * CLUSTER).to_be_bytes());
        header.extend_from_slice(&(refcount_table_clusters as u32).to_be_bytes());
        header.extend_from_slice(&0u32.to_be_bytes()); // no snapshots
        header.extend_from_slice(&0u64.to_be_bytes());
        header.extend_from_slice(&0u64.to_be_bytes()); // incompatible features
        header.extend_from_slice(&0u64.to_be_bytes()); // compatible features
        header.extend_from_slice(&0u64.to_be_bytes()); // autoclear features
        header.extend_from_slice(&REFCOUNT_ORDER.to_be_bytes());
        header.extend_from_slice(&HEADER_LENGTH.to_be_bytes());
        header.extend_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
        header.extend_from_slice(&(format.len() as u32).to_be_bytes());
        header.extend_from_slice(format);
        header.resize(header.len().div_ceil(8) * 8, 0);
        header.extend_from_slice(&EXT_END.to_be_bytes());
        header.extend_from_slice(&0u32.to_be_bytes());
        header.extend_from_slice(&self.backing);
        header
    }
}

/// Data blocks read out of an overlay at a time: the writer is handed 16 MiB at most at once.
const BLOCKS_PER_TAKE: u64 = 4096;

/// Writes what `overlay` changed over the image it runs over as a layer at `path` over
/// `backing` (a file name as for [`LayerWriter::create`], in `format`): the blocks it wrote as
/// data, those it zeroed as zero clusters; what reads the image below (never written, or
/// trimmed) is left out, to read through. The overlay is only read: its VM goes on after it.
pub fn write_overlay(overlay: &mut Overlay, path: &Path, backing: &str, format: Format) -> io::Result<()> {
    let mut writer = LayerWriter::create(path, overlay.size(), backing, format)?;
    // The move's walk reads every block that is not the image's, in order.
    overlay.start_moving();
    let copied = (|| -> io::Result<()> {
        loop {
            let runs = overlay.take_moved(BLOCKS_PER_TAKE).map_err(io::Error::other)?;
            if runs.is_empty() {
                return Ok(());
            }
            for run in runs {
                match run {
                    MovedRun::Data { first, data } => writer.data(first, &data)?,
                    MovedRun::Zero { first, end } => writer.zeroes(first, end)?,
                    MovedRun::Golden { .. } => {}
                }
            }
        }
    })();
    overlay.stop_moving();
    copied?;
    writer.finish()
}
