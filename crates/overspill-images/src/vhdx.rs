//! A read-only VHDX golden image ([MS-VHDX], Hyper-V's format, which Citrix PVS keeps its vDisks
//! in): fixed, dynamic and differencing disks, the last with their parents opened read-only down
//! to a base, so that a vDisk and its versions are served as they are.
//!
//! Everything is checked when opening, so that a read never meets a surprise: both headers
//! (CRC-32C; the valid one with the higher sequence number is current), the region table, the
//! metadata items, every BAT entry (a block that lies outside the file or over another structure
//! is refused), and for a differencing disk its parent: found through the parent locator
//! (`relative_path`, then `absolute_win32_path`), and refused unless its DataWriteGuid is the one
//! the child was made from, since a parent written since would show the child's VM a mix of two
//! disks.
//!
//! Refused when opening: a non-empty log (the file was not closed cleanly; replaying it means
//! writing the file, which a golden image reader never does), format versions other than 1,
//! unknown regions or metadata items marked required, parent locators of other types than VHDX,
//! and any structure that lies partly outside the file.
//!
//! Block states: fully present blocks are read from the file; partially present ones (only in
//! differencing disks) sector by sector from the file or the parent as the sector bitmap says;
//! not present blocks from the parent, or as zeroes in a disk without one; zero, unmapped and
//! undefined blocks read as zeroes (the spec allows zeroes for all three, and zeroes never leak
//! what the file held before).
//!
//! The BAT is read whole at open (8 bytes per block: 32 KiB for a 127 GiB disk in 32 MiB blocks);
//! the sector bitmap of a partially present block is read on first use and kept, the most recently
//! used up to 16 MiB of them.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use overspill_engine::golden::file_identity;
use overspill_engine::{
    push_extent, push_layer_run, push_layer_runs_below, Allocation, EngineError, Extent, GoldenImage, LayerRun, Result,
};

mod format;

use format::*;
pub use format::{guid_string, has_magic};

/// Where a run of guest bytes comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// This file, at a byte offset.
    File(u64),
    /// The parent disk, at the same guest offset.
    Parent,
    /// Zeroes: `Zero` for a block this file says is zero, `Hole` for one it does not store.
    Zeroes(Allocation),
}

pub struct VhdxImage {
    file: File,
    path: PathBuf,
    kind: Kind,
    size: u64,
    block_size: u64,
    logical_sector: u64,
    physical_sector: u32,
    chunk_ratio: u64,
    /// Payload block entries, state and offset, in block order (the sector bitmap entries taken
    /// out), every one checked at open.
    blocks: Vec<u64>,
    /// Per chunk, the file offset of its sector bitmap block: 0 where no block of the chunk is
    /// partially present (and the bitmap is never read).
    bitmaps: Vec<u64>,
    bitmap_cache: Mutex<lru::LruCache<u64, Arc<[u8]>>>,
    parent: Option<Box<VhdxImage>>,
    opened: overspill_engine::golden::FileState,
    data_write_guid: Guid,
    disk_id: Guid,
    identity: String,
}

impl std::fmt::Debug for VhdxImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhdxImage")
            .field("path", &self.path)
            .field("kind", &self.kind)
            .field("size", &self.size)
            .field("block_size", &self.block_size)
            .field("parent", &self.parent)
            .finish_non_exhaustive()
    }
}

fn io_error(what: &'static str) -> impl FnOnce(io::Error) -> EngineError {
    move |source| EngineError::Io { what, source }
}

/// Reads `buf.len()` bytes at `offset`, refusing (rather than failing with a bare EOF) a file
/// too short to hold them.
fn read_structure(file: &File, path: &Path, len: u64, buf: &mut [u8], offset: u64, what: &'static str) -> Result<()> {
    let end = offset.checked_add(buf.len() as u64);
    if end.is_none_or(|end| end > len) {
        return Err(refuse(
            path,
            format!("truncated: the {what} at byte {offset} ends past the end of the file ({len} bytes)"),
        ));
    }
    file.read_exact_at(buf, offset).map_err(io_error("reading VHDX structure"))
}

impl VhdxImage {
    /// Whether this disk reads through a parent (a differencing disk).
    pub fn has_parent(&self) -> bool {
        self.parent.is_some()
    }

    /// Opens a VHDX file and, for a differencing disk, its parents, all read-only.
    pub fn open(path: &Path) -> Result<Self> {
        let image = Self::open_layer(path, &mut Vec::new())?;
        tracing::info!(
            image = %image.describe(),
            kind = image.kind.name(),
            size = image.size,
            block_size = image.block_size,
            logical_sector = image.logical_sector,
            physical_sector = image.physical_sector,
            disk_id = %guid_string(&image.disk_id),
            layers = image.depth(),
            "VHDX golden image opened"
        );
        if image.logical_sector != 512 {
            // NBD has no word for a disk's sector size: the VM's virtual disk sets it, at 512
            // unless told, and a disk made with 4 KiB sectors counts its partitions in them (its
            // GPT header at byte 4096), which a 512-byte reading of it does not find.
            tracing::warn!(
                image = %image.path.display(),
                logical_sector = image.logical_sector,
                "this VHDX has {}-byte logical sectors: give the VM's disk the same \
                 (QEMU: logical_block_size={}; libvirt: <blockio logical_block_size='{}'/>)",
                image.logical_sector,
                image.logical_sector,
                image.logical_sector
            );
        }
        Ok(image)
    }

    /// The layers in the chain: 1 for a disk without a parent.
    pub fn depth(&self) -> usize {
        1 + self.parent.as_ref().map_or(0, |p| p.depth())
    }

    /// The logical sector size the disk is to be exposed with (512 or 4096).
    pub fn logical_sector_size(&self) -> u32 {
        self.logical_sector as u32
    }

    /// The physical sector size the disk reports (512 or 4096).
    pub fn physical_sector_size(&self) -> u32 {
        self.physical_sector
    }

    /// The GUID that changes whenever the disk's contents do: what a child's parent locator names.
    pub fn data_write_guid(&self) -> String {
        guid_string(&self.data_write_guid)
    }

    /// `seen`: the (device, inode) of every layer above, to refuse a chain that loops.
    fn open_layer(path: &Path, seen: &mut Vec<(u64, u64)>) -> Result<Self> {
        let file = File::open(path).map_err(io_error("opening golden image"))?;
        let metadata = file.metadata().map_err(io_error("stat golden image"))?;
        if !metadata.is_file() {
            return Err(refuse(path, "not a regular file"));
        }
        seen.push((metadata.dev(), metadata.ino()));
        let len = metadata.len();

        let mut magic = [0u8; 8];
        read_structure(&file, path, len, &mut magic, 0, "file type identifier")?;
        if !has_magic(&magic) {
            return Err(refuse(path, "not a VHDX file (no \"vhdxfile\" signature)"));
        }

        let header = Self::current_header(&file, path, len)?;
        if header.version != 1 {
            return Err(refuse(path, format!("VHDX version {} is not supported (only version 1 is)", header.version)));
        }
        if header.log_guid != [0; 16] {
            return Err(refuse(
                path,
                "the VHDX log is not empty: the file was not closed cleanly, and a read-only reader \
                 must not replay it. Replay the log first, e.g. open it once read-write with \
                 `qemu-img check -r all` or attach it in Hyper-V",
            ));
        }

        let mut spans = Vec::new();
        if header.log_length > 0 {
            spans.push(Span { what: "log", offset: header.log_offset, len: u64::from(header.log_length) });
        }
        let (bat, meta) = Self::regions(&file, path, len, &mut spans)?;
        let md = Self::metadata(&file, path, len, meta)?;

        let block_size = md.block_size.ok_or_else(|| refuse(path, "the file parameters metadata item is missing"))?;
        let size = md.virtual_size.ok_or_else(|| refuse(path, "the virtual disk size metadata item is missing"))?;
        let logical_sector =
            md.logical_sector.ok_or_else(|| refuse(path, "the logical sector size metadata item is missing"))?;
        let physical_sector =
            md.physical_sector.ok_or_else(|| refuse(path, "the physical sector size metadata item is missing"))?;
        let disk_id =
            md.disk_id.ok_or_else(|| refuse(path, "the virtual disk ID (page 83) metadata item is missing"))?;
        if !(MIB..=256 * MIB).contains(&u64::from(block_size)) || !block_size.is_power_of_two() {
            return Err(refuse(path, format!("block size {block_size} is not a power of two from 1 MiB to 256 MiB")));
        }
        for (what, value) in [("logical", logical_sector), ("physical", physical_sector)] {
            if value != 512 && value != 4096 {
                return Err(refuse(path, format!("{what} sector size {value} is neither 512 nor 4096")));
            }
        }
        let (block_size, logical_sector) = (u64::from(block_size), u64::from(logical_sector));
        if size > MAX_VIRTUAL_SIZE || !size.is_multiple_of(logical_sector) {
            return Err(refuse(
                path,
                format!(
                    "virtual disk size {size} is above 64 TiB or not a multiple of the {logical_sector}-byte sector"
                ),
            ));
        }
        let kind = match (md.has_parent, md.leave_blocks_allocated) {
            (true, _) => Kind::Differencing,
            (false, true) => Kind::Fixed,
            (false, false) => Kind::Dynamic,
        };

        // Powers of two all: a 1 MiB block of 512-byte sectors gives 4,096 blocks a chunk, a
        // 256 MiB block of 4 KiB sectors 128.
        let chunk_ratio = SECTORS_PER_BITMAP_BLOCK * logical_sector / block_size;
        let payload_blocks = size.div_ceil(block_size);
        let chunks = payload_blocks.div_ceil(chunk_ratio);
        // A differencing disk's table reaches the last chunk's bitmap entry; the others' may stop
        // at the last payload entry.
        let entries = if kind == Kind::Differencing {
            chunks * (chunk_ratio + 1)
        } else {
            payload_blocks + payload_blocks.saturating_sub(1) / chunk_ratio
        };
        if entries.saturating_mul(8) > bat.len {
            return Err(refuse(
                path,
                format!(
                    "the BAT region ({} bytes) is too small for the {entries} entries of a {size}-byte disk in \
                     {block_size}-byte blocks",
                    bat.len
                ),
            ));
        }
        let table = Self::read_bat(&file, path, len, bat.offset, entries)?;
        let mut blocks = Vec::with_capacity(payload_blocks as usize);
        let mut bitmaps = vec![0u64; chunks as usize];
        for (index, &entry) in table.iter().enumerate() {
            let index = index as u64;
            if (index + 1).is_multiple_of(chunk_ratio + 1) {
                continue;
            }
            let block = index - index / (chunk_ratio + 1);
            if block >= payload_blocks {
                break;
            }
            let state = entry & STATE_MASK;
            let offset = entry & OFFSET_MASK;
            // The bytes of the block that lie within the disk: the last block may be cut short.
            let need = block_size.min(size - block * block_size);
            let check = |what: &str, offset: u64, need: u64| -> Result<()> {
                Self::check_block(len, &spans, offset, need).map_err(|why| refuse(path, format!("{what}: {why}")))
            };
            match state {
                PAYLOAD_NOT_PRESENT | PAYLOAD_UNDEFINED | PAYLOAD_ZERO | PAYLOAD_UNMAPPED | PAYLOAD_UNMAPPED_V095 => {}
                PAYLOAD_FULLY_PRESENT => check(&format!("block {block}"), offset, need)?,
                PAYLOAD_PARTIALLY_PRESENT => {
                    if kind != Kind::Differencing {
                        return Err(refuse(
                            path,
                            format!("block {block} is partially present, which only a differencing disk may be"),
                        ));
                    }
                    check(&format!("block {block}"), offset, need)?;
                    let chunk = block / chunk_ratio;
                    let bitmap_index = chunk * (chunk_ratio + 1) + chunk_ratio;
                    let bitmap = table.get(bitmap_index as usize).copied().unwrap_or(0);
                    if bitmap & STATE_MASK != SB_BLOCK_PRESENT {
                        return Err(refuse(
                            path,
                            format!("block {block} is partially present but its chunk has no sector bitmap"),
                        ));
                    }
                    check(&format!("the sector bitmap of chunk {chunk}"), bitmap & OFFSET_MASK, MIB)?;
                    if let Some(slot) = bitmaps.get_mut(chunk as usize) {
                        *slot = bitmap & OFFSET_MASK;
                    }
                }
                other => return Err(refuse(path, format!("block {block} has the reserved state {other}"))),
            }
            blocks.push(entry);
        }
        drop(table);

        let parent = match &md.parent_locator {
            Some(item) if kind == Kind::Differencing => {
                let locator = parse_parent_locator(item).map_err(|e| refuse(path, e))?;
                Some(Box::new(Self::open_parent(path, &locator, logical_sector, seen)?))
            }
            None if kind == Kind::Differencing => {
                return Err(refuse(path, "a differencing disk without a parent locator"));
            }
            _ => None,
        };
        let mut identity = file_identity(&metadata);
        if let Some(parent) = &parent {
            identity = format!("{identity}; parent {}", parent.identity);
        }
        Ok(Self {
            file,
            path: path.to_path_buf(),
            kind,
            size,
            block_size,
            logical_sector,
            physical_sector,
            chunk_ratio,
            blocks,
            bitmaps,
            bitmap_cache: Mutex::new(lru::LruCache::new(bitmaps_kept(block_size, logical_sector))),
            parent,
            data_write_guid: header.data_write_guid,
            disk_id,
            identity,
            opened: overspill_engine::golden::FileState::of(&metadata),
        })
    }

    /// The valid header with the higher sequence number.
    fn current_header(file: &File, path: &Path, len: u64) -> Result<Header> {
        let mut raw = [[0u8; HEADER_BYTES]; 2];
        let mut parsed = [None, None];
        for ((buf, slot), offset) in raw.iter_mut().zip(parsed.iter_mut()).zip(HEADER_OFFSETS) {
            read_structure(file, path, len, buf, offset, "header")?;
            *slot = parse_header(buf);
        }
        match parsed {
            [Some(a), Some(b)] => match a.sequence.cmp(&b.sequence) {
                std::cmp::Ordering::Greater => Ok(a),
                std::cmp::Ordering::Less => Ok(b),
                // Disk2vhd writes two identical headers; two different ones with one number
                // leave no way to tell which is current.
                std::cmp::Ordering::Equal if raw[0] == raw[1] => Ok(a),
                std::cmp::Ordering::Equal => Err(refuse(
                    path,
                    format!("both VHDX headers have sequence number {} but differ: the file is corrupt", a.sequence),
                )),
            },
            [Some(h), None] | [None, Some(h)] => Ok(h),
            [None, None] => Err(refuse(
                path,
                "neither VHDX header is valid (wrong signature or CRC-32C checksum): the file is corrupt",
            )),
        }
    }

    /// The BAT and metadata regions from the region table (the second copy if the first is
    /// damaged), checked to lie in the file apart from each other and the log.
    fn regions(file: &File, path: &Path, len: u64, spans: &mut Vec<Span>) -> Result<(Span, Span)> {
        let mut buf = vec![0u8; REGION_TABLE_BYTES];
        let mut table = None;
        for offset in REGION_TABLE_OFFSETS {
            read_structure(file, path, len, &mut buf, offset, "region table")?;
            if buf.get(..4) == Some(b"regi") && checksum_ok(&buf, 4) {
                table = Some(&buf);
                break;
            }
        }
        let table = table.ok_or_else(|| {
            refuse(path, "neither copy of the region table is valid (wrong signature or CRC-32C checksum)")
        })?;
        let why = |e: Why| refuse(path, format!("region table: {e}"));
        let count = le32(table, 8).map_err(why)?;
        if count > MAX_TABLE_ENTRIES {
            return Err(refuse(path, format!("region table has {count} entries, more than 2047")));
        }
        let (mut bat, mut meta) = (None, None);
        for i in 0..count as usize {
            let at = 16 + i * 32;
            let id: Guid = bytes(table, at).map_err(why)?;
            let offset = le64(table, at + 16).map_err(why)?;
            let length = u64::from(le32(table, at + 24).map_err(why)?);
            let required = le32(table, at + 28).map_err(why)? & 1 != 0;
            let (slot, what) = match id {
                BAT_REGION => (&mut bat, "BAT region"),
                METADATA_REGION => (&mut meta, "metadata region"),
                _ if required => {
                    return Err(refuse(
                        path,
                        format!("region {} is marked required and this reader does not know it", guid_string(&id)),
                    ))
                }
                _ => continue,
            };
            if slot.is_some() {
                return Err(refuse(path, format!("the region table lists the {what} twice")));
            }
            if offset < MIB || length == 0 {
                return Err(refuse(path, format!("the {what} ({length} bytes at {offset}) is empty or in the header")));
            }
            if offset.checked_add(length).is_none_or(|end| end > len) {
                return Err(refuse(
                    path,
                    format!("truncated: the {what} ({length} bytes at {offset}) ends past the end of the file ({len} bytes)"),
                ));
            }
            if let Some(other) = spans.iter().find(|s| s.overlaps(offset, length)) {
                return Err(refuse(path, format!("the {what} overlaps the {}", other.what)));
            }
            let span = Span { what, offset, len: length };
            spans.push(span);
            *slot = Some(span);
        }
        match (bat, meta) {
            (Some(bat), Some(meta)) => Ok((bat, meta)),
            (None, _) => Err(refuse(path, "the region table has no BAT region")),
            (_, None) => Err(refuse(path, "the region table has no metadata region")),
        }
    }

    fn metadata(file: &File, path: &Path, len: u64, region: Span) -> Result<Metadata> {
        let table_len = region.len.min(METADATA_TABLE_BYTES);
        let mut table = vec![0u8; table_len as usize];
        read_structure(file, path, len, &mut table, region.offset, "metadata table")?;
        let why = |e: Why| refuse(path, format!("metadata table: {e}"));
        if table.get(..8) != Some(b"metadata") {
            return Err(refuse(path, "the metadata table has no \"metadata\" signature"));
        }
        let count = u32::from(le16(&table, 10).map_err(why)?);
        if count > MAX_TABLE_ENTRIES || 32 + u64::from(count) * 32 > table_len {
            return Err(refuse(path, format!("the metadata table's {count} entries do not fit in it")));
        }
        let mut md = Metadata::default();
        let mut seen = Vec::new();
        for i in 0..count as usize {
            let at = 32 + i * 32;
            let id: Guid = bytes(&table, at).map_err(why)?;
            let offset = le32(&table, at + 16).map_err(why)?;
            let length = le32(&table, at + 20).map_err(why)?;
            let flags = le32(&table, at + 24).map_err(why)?;
            let (is_user, is_required) = (flags & 1 != 0, flags & 4 != 0);
            let known = !is_user
                && [
                    FILE_PARAMETERS,
                    VIRTUAL_DISK_SIZE,
                    PAGE_83_DATA,
                    LOGICAL_SECTOR_SIZE,
                    PHYSICAL_SECTOR_SIZE,
                    PARENT_LOCATOR,
                ]
                .contains(&id);
            if !known {
                if is_required {
                    return Err(refuse(
                        path,
                        format!(
                            "metadata item {} is marked required and this reader does not know it",
                            guid_string(&id)
                        ),
                    ));
                }
                continue;
            }
            if seen.contains(&id) {
                return Err(refuse(path, format!("metadata item {} appears twice", guid_string(&id))));
            }
            seen.push(id);
            if length == 0 || length > MAX_METADATA_ITEM {
                return Err(refuse(path, format!("metadata item {} is {length} bytes long", guid_string(&id))));
            }
            if u64::from(offset) < METADATA_TABLE_BYTES || u64::from(offset) + u64::from(length) > region.len {
                return Err(refuse(
                    path,
                    format!(
                        "metadata item {} ({length} bytes at {offset}) lies outside the metadata region's {} bytes",
                        guid_string(&id),
                        region.len
                    ),
                ));
            }
            let mut item = vec![0u8; length as usize];
            read_structure(file, path, len, &mut item, region.offset + u64::from(offset), "metadata item")?;
            let item_why = |e: Why| refuse(path, format!("metadata item {}: {e}", guid_string(&id)));
            match id {
                FILE_PARAMETERS => {
                    md.block_size = Some(le32(&item, 0).map_err(item_why)?);
                    let bits = le32(&item, 4).map_err(item_why)?;
                    md.leave_blocks_allocated = bits & 1 != 0;
                    md.has_parent = bits & 2 != 0;
                }
                VIRTUAL_DISK_SIZE => md.virtual_size = Some(le64(&item, 0).map_err(item_why)?),
                PAGE_83_DATA => md.disk_id = Some(bytes(&item, 0).map_err(item_why)?),
                LOGICAL_SECTOR_SIZE => md.logical_sector = Some(le32(&item, 0).map_err(item_why)?),
                PHYSICAL_SECTOR_SIZE => md.physical_sector = Some(le32(&item, 0).map_err(item_why)?),
                _ => md.parent_locator = Some(item),
            }
        }
        Ok(md)
    }

    /// The BAT's first `entries` entries, read in pieces so that a large table is not held twice.
    fn read_bat(file: &File, path: &Path, len: u64, offset: u64, entries: u64) -> Result<Vec<u64>> {
        let mut table = Vec::with_capacity(entries as usize);
        let mut buf = vec![0u8; (entries.min(MIB / 8) * 8) as usize];
        let mut done = 0u64;
        while done < entries {
            let n = (entries - done).min(MIB / 8);
            let piece = &mut buf[..(n * 8) as usize];
            read_structure(file, path, len, piece, offset + done * 8, "BAT")?;
            table.extend(
                piece.chunks_exact(8).map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])),
            );
            done += n;
        }
        Ok(table)
    }

    /// That `need` bytes at `offset` lie in the file, past the header section and clear of the
    /// log, BAT and metadata regions.
    fn check_block(len: u64, spans: &[Span], offset: u64, need: u64) -> std::result::Result<(), Why> {
        if offset < MIB {
            return Err(format!("its offset {offset} lies in the header section"));
        }
        if offset.checked_add(need).is_none_or(|end| end > len) {
            return Err(format!(
                "it lies at byte {offset}, past the end of the file ({len} bytes): the file is truncated or corrupt"
            ));
        }
        if let Some(span) = spans.iter().find(|s| s.overlaps(offset, need)) {
            return Err(format!("it lies at byte {offset}, over the {}", span.what));
        }
        Ok(())
    }

    fn open_parent(
        child: &Path,
        locator: &[(String, String)],
        logical_sector: u64,
        seen: &mut Vec<(u64, u64)>,
    ) -> Result<Self> {
        let value = |key: &str| locator.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        let mut linkages = Vec::new();
        for key in ["parent_linkage", "parent_linkage2"] {
            if let Some(text) = value(key) {
                linkages.push(
                    parse_guid(text)
                        .ok_or_else(|| refuse(child, format!("the parent locator's {key} {text:?} is not a GUID")))?,
                );
            }
        }
        if linkages.is_empty() {
            return Err(refuse(child, "the parent locator has no parent_linkage"));
        }
        if seen.len() >= MAX_CHAIN_DEPTH {
            return Err(refuse(child, format!("the chain of differencing disks is deeper than {MAX_CHAIN_DEPTH}")));
        }

        let mut tried = Vec::new();
        let mut found = None;
        for key in ["relative_path", "volume_path", "absolute_win32_path"] {
            let Some(text) = value(key) else { continue };
            let Some(candidate) = locate(child, key, text) else {
                tried.push(format!("{key} {text:?} (a Windows path, which cannot be resolved here)"));
                continue;
            };
            match std::fs::metadata(&candidate) {
                Ok(meta) => {
                    found = Some((candidate, meta));
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    tried.push(format!("{key} {text:?} as {} (not found)", candidate.display()))
                }
                Err(e) => tried.push(format!("{key} {text:?} as {} ({e})", candidate.display())),
            }
        }
        let Some((parent_path, meta)) = found else {
            let tried = if tried.is_empty() { "the parent locator has no path".to_owned() } else { tried.join("; ") };
            return Err(refuse(child, format!("the parent disk was not found: tried {tried}")));
        };
        // Before opening it: a FIFO named by a hostile locator would block the open for ever.
        if !meta.is_file() {
            return Err(refuse(child, format!("its parent {} is not a regular file", parent_path.display())));
        }
        // Shown in the chain's description and logs: `/store/base.vhdx`, not `/store/v1/../base.vhdx`.
        let parent_path = std::fs::canonicalize(&parent_path).unwrap_or(parent_path);
        if seen.contains(&(meta.dev(), meta.ino())) {
            return Err(refuse(
                child,
                format!("the chain of differencing disks loops: its parent {} is already in it", parent_path.display()),
            ));
        }
        let parent = Self::open_layer(&parent_path, seen)?;
        if !linkages.contains(&parent.data_write_guid) {
            let expected: Vec<String> = linkages.iter().map(guid_string).collect();
            return Err(refuse(
                child,
                format!(
                    "the parent {} has DataWriteGuid {}, but this disk was made on {}: the parent was written since, \
                     and reading the chain would mix two disks",
                    parent_path.display(),
                    guid_string(&parent.data_write_guid),
                    expected.join(" or ")
                ),
            ));
        }
        if parent.logical_sector != logical_sector {
            return Err(refuse(
                child,
                format!(
                    "its parent {} has {}-byte sectors, this disk {logical_sector}-byte ones",
                    parent_path.display(),
                    parent.logical_sector
                ),
            ));
        }
        Ok(parent)
    }

    /// The sector bitmap bits of a partially present block (one bit per logical sector, set where
    /// the sector is in this file).
    fn block_bitmap(&self, block: u64) -> io::Result<Arc<[u8]>> {
        let cache = || self.bitmap_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bits) = cache().get(&block) {
            return Ok(bits.clone());
        }
        let chunk = block / self.chunk_ratio;
        let base = self.bitmaps.get(chunk as usize).copied().filter(|&b| b != 0).ok_or_else(|| corrupt(self))?;
        let bytes = self.block_size / self.logical_sector / 8;
        let mut bits = vec![0u8; bytes as usize];
        self.file.read_exact_at(&mut bits, base + (block % self.chunk_ratio) * bytes)?;
        let bits: Arc<[u8]> = bits.into();
        cache().put(block, bits.clone());
        Ok(bits)
    }

    /// Where guest byte `pos` comes from, and for how many bytes (at most `max`, within one block
    /// and for a partially present one within one run of sectors alike). `pos < size`, `max > 0`.
    fn map(&self, pos: u64, max: u64) -> io::Result<(u64, Source)> {
        let block = pos / self.block_size;
        let within = pos % self.block_size;
        let n = (self.block_size - within).min(max);
        let entry = *self.blocks.get(block as usize).ok_or_else(|| corrupt(self))?;
        let offset = entry & OFFSET_MASK;
        Ok(match entry & STATE_MASK {
            PAYLOAD_FULLY_PRESENT => (n, Source::File(offset + within)),
            PAYLOAD_PARTIALLY_PRESENT => {
                let bits = self.block_bitmap(block)?;
                let bit = |sector: u64| {
                    bits.get((sector / 8) as usize).map(|byte| byte >> (sector % 8) & 1 == 1).unwrap_or(false)
                };
                let first = within / self.logical_sector;
                let present = bit(first);
                let last = (within + n).div_ceil(self.logical_sector);
                let mut end = first + 1;
                while end < last && bit(end) == present {
                    end += 1;
                }
                let len = (end * self.logical_sector).min(within + n) - within;
                (len, if present { Source::File(offset + within) } else { Source::Parent })
            }
            PAYLOAD_NOT_PRESENT if self.parent.is_some() => (n, Source::Parent),
            PAYLOAD_ZERO => (n, Source::Zeroes(Allocation::Zero)),
            _ => (n, Source::Zeroes(Allocation::Hole)),
        })
    }
}

fn corrupt(image: &VhdxImage) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{}: block table lookup out of range", image.path.display()))
}

/// A path from the parent locator on this system: a relative path (with `\` separators) from
/// the child's directory, or an absolute one that is a POSIX path once its `\\?\` prefix is
/// taken off. `None` for what only Windows can resolve: drive letters, UNC shares, volume GUIDs.
fn locate(child: &Path, key: &str, text: &str) -> Option<PathBuf> {
    match key {
        "relative_path" => {
            if text.starts_with('\\') || text.starts_with('/') || text.get(1..2) == Some(":") {
                return None;
            }
            let mut path = child.parent().map(Path::to_path_buf).unwrap_or_default();
            for part in text.split(['\\', '/']).filter(|p| !p.is_empty() && *p != ".") {
                path.push(part);
            }
            Some(path)
        }
        "absolute_win32_path" => {
            let rest = text.strip_prefix("\\\\?\\").unwrap_or(text);
            rest.starts_with('/').then(|| PathBuf::from(rest))
        }
        _ => None,
    }
}

/// How many blocks' sector bitmaps [`BITMAP_CACHE_BYTES`] holds (at least one).
fn bitmaps_kept(block_size: u64, logical_sector: u64) -> std::num::NonZeroUsize {
    let bitmap_bytes = (block_size / logical_sector / 8).max(1);
    std::num::NonZeroUsize::new((BITMAP_CACHE_BYTES / bitmap_bytes) as usize).unwrap_or(std::num::NonZeroUsize::MIN)
}

/// The parent locator's key-value pairs (UTF-16LE strings at offsets within the item).
fn parse_parent_locator(item: &[u8]) -> std::result::Result<Vec<(String, String)>, Why> {
    let why = |e: Why| format!("parent locator: {e}");
    let kind: Guid = bytes(item, 0).map_err(why)?;
    if kind != VHDX_PARENT_TYPE {
        return Err(format!(
            "the parent locator is of type {}, not VHDX: only VHDX parents are supported",
            guid_string(&kind)
        ));
    }
    let count = le16(item, 18).map_err(why)?;
    let mut pairs: Vec<(String, String)> = Vec::with_capacity(usize::from(count));
    let mut keys = std::collections::HashSet::new();
    // The strings are stored in the item: unless they overlap, together they cannot be longer
    // than it, and strings that overlap could make a 1 MiB item decode to gigabytes.
    let mut decoded = 0usize;
    for i in 0..usize::from(count) {
        let at = 20 + i * 12;
        let key_offset = le32(item, at).map_err(why)? as usize;
        let value_offset = le32(item, at + 4).map_err(why)? as usize;
        let key_len = usize::from(le16(item, at + 8).map_err(why)?);
        let value_len = usize::from(le16(item, at + 10).map_err(why)?);
        decoded += key_len + value_len;
        if decoded > item.len() {
            return Err(format!(
                "the parent locator's strings add up to more than its {} bytes (they overlap)",
                item.len()
            ));
        }
        let key = utf16(item, key_offset, key_len).map_err(why)?;
        let value = utf16(item, value_offset, value_len).map_err(why)?;
        if !keys.insert(key.clone()) {
            return Err(format!("the parent locator has the key {key:?} twice"));
        }
        pairs.push((key, value));
    }
    Ok(pairs)
}

fn utf16(item: &[u8], offset: usize, len: usize) -> std::result::Result<String, Why> {
    let raw = offset
        .checked_add(len)
        .and_then(|end| item.get(offset..end))
        .filter(|_| len > 0 && len.is_multiple_of(2))
        .ok_or_else(|| format!("a string of {len} bytes at {offset} is empty, odd-sized or outside the item"))?;
    let units: Vec<u16> = raw.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    String::from_utf16(&units).map_err(|_| format!("the string at {offset} is not valid UTF-16"))
}

impl GoldenImage for VhdxImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // A file changed under the reader fails in many ways (a table pointing past the end, an
        // unaligned cluster, a short read): the change is what the operator must hear of, not
        // "corrupt". The layers below checked their own files as they were read.
        let read = (|| -> io::Result<()> {
            // Neighbouring runs from one source are read at once: the blocks of a fixed disk lie in
            // order in the file, and a parent is asked once for a run of blocks it holds.
            let mut pending: Option<(usize, usize, Source)> = None;
            let flush = |buf: &mut [u8], run: Option<(usize, usize, Source)>| -> io::Result<()> {
                let Some((start, len, source)) = run else { return Ok(()) };
                let part = &mut buf[start..start + len];
                match source {
                    Source::File(at) => self.file.read_exact_at(part, at),
                    Source::Zeroes(_) => {
                        part.fill(0);
                        Ok(())
                    }
                    Source::Parent => match &self.parent {
                        Some(parent) => parent.read_at(part, offset + start as u64),
                        None => Err(corrupt(self)),
                    },
                }
            };
            let mut done = 0usize;
            while done < buf.len() {
                let pos = match offset.checked_add(done as u64) {
                    Some(pos) if pos < self.size => pos,
                    _ => {
                        flush(buf, pending.take())?;
                        buf[done..].fill(0);
                        return self.opened.check(&self.file, &self.path);
                    }
                };
                let max = ((buf.len() - done) as u64).min(self.size - pos);
                let (n, source) = self.map(pos, max)?;
                let n = n as usize;
                pending = match pending {
                    Some((start, len, run)) if follows(run, len, source) => Some((start, len + n, run)),
                    other => {
                        flush(buf, other)?;
                        Some((done, n, source))
                    }
                };
                done += n;
            }
            flush(buf, pending)?;
            Ok(())
        })();
        self.opened.check(&self.file, &self.path)?;
        read
    }

    fn unchanged(&self) -> io::Result<()> {
        self.opened.check(&self.file, &self.path)?;
        self.parent.as_ref().map_or(Ok(()), |parent| parent.unchanged())
    }

    fn describe(&self) -> String {
        let own = match self.logical_sector {
            512 => format!("{} (vhdx)", self.path.display()),
            sector => format!("{} (vhdx, {sector}-byte logical sectors)", self.path.display()),
        };
        match &self.parent {
            Some(parent) => format!("{own} on {}", parent.describe()),
            None => own,
        }
    }

    fn identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }

    /// Blocks this file does not store are holes (or the parent's answer, in a differencing
    /// disk), zero blocks are zeroes, the rest data.
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        // Checked after the look, as a read is: a map of a file changed under the server
        // would tell holes where the guest reads data.
        let mapped = (|| -> io::Result<Vec<Extent>> {
            let mut extents = Vec::new();
            let end = offset.saturating_add(len).min(self.size);
            if offset >= end {
                push_extent(&mut extents, len, Allocation::Hole);
                return Ok(extents);
            }
            let mut pos = offset;
            let mut parent_run: Option<(u64, u64)> = None;
            let mut steps = 0usize;
            while pos < end && steps < MAX_EXTENT_STEPS && extents.len() < MAX_EXTENTS {
                steps += 1;
                let (n, source) = self.map(pos, end - pos)?;
                match source {
                    Source::Parent => {
                        parent_run = match parent_run {
                            Some((start, run)) => Some((start, run + n)),
                            None => Some((pos, n)),
                        };
                    }
                    other => {
                        if let Some((start, run)) = parent_run.take() {
                            if !self.parent_extents(&mut extents, start, run)? {
                                return Ok(extents);
                            }
                        }
                        let state = match other {
                            Source::Zeroes(state) => state,
                            _ => Allocation::Data,
                        };
                        push_extent(&mut extents, n, state);
                    }
                }
                pos += n;
            }
            if let Some((start, run)) = parent_run {
                self.parent_extents(&mut extents, start, run)?;
            }
            Ok(extents)
        })();
        self.opened.check(&self.file, &self.path)?;
        mapped
    }

    /// This disk's own sectors (data, or blocks it says are zero) are layer 1, its parent's one
    /// layer deeper (`qemu:allocation-depth`); a piece at a time, as [`Self::extents`].
    fn layer_runs(&self, offset: u64, len: u64) -> io::Result<Vec<LayerRun>> {
        let mapped = (|| -> io::Result<Vec<LayerRun>> {
            let mut runs = Vec::new();
            let end = offset.saturating_add(len).min(self.size);
            if offset >= end {
                push_layer_run(&mut runs, len, 0);
                return Ok(runs);
            }
            let mut pos = offset;
            let mut steps = 0usize;
            while pos < end && steps < MAX_EXTENT_STEPS && runs.len() < MAX_EXTENTS {
                steps += 1;
                let (n, source) = self.map(pos, end - pos)?;
                match (source, &self.parent) {
                    (Source::Parent, Some(parent)) => push_layer_runs_below(&mut runs, parent.as_ref(), pos, n)?,
                    (Source::Parent, None) => return Err(corrupt(self)),
                    (Source::Zeroes(Allocation::Hole), _) => push_layer_run(&mut runs, n, 0),
                    (Source::File(_) | Source::Zeroes(_), _) => push_layer_run(&mut runs, n, 1),
                }
                pos += n;
            }
            Ok(runs)
        })();
        self.opened.check(&self.file, &self.path)?;
        mapped
    }
}

/// Whether a run of `source` can extend one of `run` that is `len` bytes long.
fn follows(run: Source, len: usize, source: Source) -> bool {
    match (run, source) {
        (Source::File(a), Source::File(b)) => a.checked_add(len as u64) == Some(b),
        (Source::Parent, Source::Parent) => true,
        (Source::Zeroes(_), Source::Zeroes(_)) => true,
        _ => false,
    }
}

impl VhdxImage {
    /// Appends the parent's extents for `[start, start + len)`, holes past its end; false when
    /// the parent stopped early, so that the caller stops there too.
    fn parent_extents(&self, extents: &mut Vec<Extent>, start: u64, len: u64) -> io::Result<bool> {
        let Some(parent) = &self.parent else { return Err(corrupt(self)) };
        let inside = parent.size().saturating_sub(start).min(len);
        if inside > 0 {
            let mut got = 0u64;
            for extent in parent.extents(start, inside)? {
                let take = extent.len.min(inside - got);
                push_extent(extents, take, extent.state);
                got += take;
                if got == inside {
                    break;
                }
            }
            if got < inside {
                return Ok(false);
            }
        }
        push_extent(extents, len - inside, Allocation::Hole);
        Ok(true)
    }
}

#[cfg(test)]
#[path = "vhdx_tests.rs"]
mod tests;
