//! What the crash simulations share (`crash.rs`, `handover.rs`): a small disk whose blocks
//! carry their number and version, the model of what the VM was told, files in memory with a
//! crash point before each 4 KiB written, the workload, and recoveries checked against the model.
#![allow(dead_code)] // each simulation uses its own subset

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::path::Path;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};

use overspill_engine::arena::{Arena, Owner};
use overspill_engine::crash;
use overspill_engine::state::{self, CopyAt, StateFiles};
use overspill_engine::{
    BackingFile, GoldenImage, HostMemory, MemImage, Overlay, OverlayConfig, VmStats, WriteCacheMode, BLOCK_BYTES,
    SEGMENT_BYTES,
};
use rand::rngs::SmallRng;
use rand::Rng;

use crate::common::receive_into;

pub const DISK_BLOCKS: u64 = 2048;
pub const MIB: u64 = 1 << 20;
/// The version golden blocks carry in their first 16 bytes.
pub const GOLDEN: u64 = u64::MAX;

pub fn config(mode: WriteCacheMode) -> OverlayConfig {
    match mode {
        // 512 KiB of RAM tier beside the open segment, and a spill log of twice the disk: the
        // VM spills, and overwrites make garbage that compaction moves.
        WriteCacheMode::RamDisk => OverlayConfig {
            mode,
            ram_target_bytes: 2 * MIB + 512 * 1024,
            spill_max_bytes: Some(DISK_BLOCKS * BLOCK_BYTES * 2),
        },
        // RAM alone holds the whole disk: nothing is refused.
        _ => OverlayConfig { mode, ram_target_bytes: DISK_BLOCKS * BLOCK_BYTES + MIB, spill_max_bytes: None },
    }
}

/// The file beside the arena that `mode` writes its blocks to, if any: a spill log, or a cache
/// file of the disk's size written in place.
pub fn backing_file(mode: WriteCacheMode) -> Option<SimFile> {
    match mode {
        WriteCacheMode::RamDisk => Some(SimFile::new("spill segment")),
        WriteCacheMode::Ram => None,
        _ => {
            let file = SimFile::new("cache file");
            file.data().len = DISK_BLOCKS * BLOCK_BYTES;
            Some(file)
        }
    }
}

/// A block as the workload writes it: the block number and a version in its first 16 bytes
/// (all a crash point reads), the rest a pattern of both (what a full recovery compares).
pub fn block_bytes(block: u64, version: u64) -> Vec<u8> {
    let mut bytes = vec![(block as u8) ^ (version as u8).rotate_left(3); BLOCK_BYTES as usize];
    bytes[..8].copy_from_slice(&block.to_le_bytes());
    bytes[8..16].copy_from_slice(&version.to_le_bytes());
    bytes
}

pub fn golden() -> Arc<dyn GoldenImage> {
    Arc::new(MemImage::new((0..DISK_BLOCKS).flat_map(|block| block_bytes(block, GOLDEN)).collect()))
}

/// What a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    Golden,
    Zero,
    Data(u64),
    /// Trimmed, or written by a request that failed: anything.
    Any,
}

impl Content {
    pub fn from_prefix(block: u64, prefix: &[u8]) -> Result<Self, String> {
        let word = |i: usize| u64::from_le_bytes(prefix[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        match (word(0), word(1)) {
            (0, 0) => Ok(Self::Zero),
            (b, GOLDEN) if b == block => Ok(Self::Golden),
            (b, version) if b == block => Ok(Self::Data(version)),
            (b, version) => Err(format!("holds block {b}'s version {version}")),
        }
    }

    pub fn bytes(self, block: u64) -> Option<Vec<u8>> {
        match self {
            Self::Golden => Some(block_bytes(block, GOLDEN)),
            Self::Zero => Some(vec![0; BLOCK_BYTES as usize]),
            Self::Data(version) => Some(block_bytes(block, version)),
            Self::Any => None,
        }
    }
}

/// What the VM was told, and the request in flight.
#[derive(Clone)]
pub struct Model {
    pub acked: Vec<Content>,
    pub pending: Option<(Range<u64>, Content)>,
}

impl Model {
    pub fn new() -> Self {
        Self { acked: vec![Content::Golden; DISK_BLOCKS as usize], pending: None }
    }

    pub fn allows(&self, block: u64, found: Content) -> bool {
        let acked = self.acked[block as usize];
        let in_flight = self.pending.as_ref().filter(|(range, _)| range.contains(&block)).map(|(_, content)| *content);
        acked == Content::Any || found == acked || in_flight.is_some_and(|new| new == Content::Any || new == found)
    }

    /// After a crash: the blocks of the request in flight hold whatever was found.
    pub fn settle(&mut self, found: impl Fn(u64) -> Content) {
        if let Some((range, _)) = self.pending.take() {
            for block in range {
                self.acked[block as usize] = found(block);
            }
        }
    }
}

thread_local! {
    /// The file being written at a crash point, for the tally.
    pub static WRITING: Cell<&'static str> = const { Cell::new("") };
}

/// A sparse file in memory, as long as its furthest write (reads past the end fail as a real
/// file's do; holes read as zeroes). Writes reach it 4 KiB at a time with a crash point before
/// each piece; punches too.
#[derive(Clone)]
pub struct SimFile {
    pub name: &'static str,
    pub data: Arc<Mutex<Sparse>>,
}

#[derive(Clone, Default)]
pub struct Sparse {
    pub pages: HashMap<u64, Box<[u8]>>,
    pub len: u64,
}

impl Sparse {
    pub fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if offset + buf.len() as u64 > self.len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let mut at = offset;
        for chunk in buf.chunks_mut(BLOCK_BYTES as usize) {
            let within = (at % BLOCK_BYTES) as usize;
            let n = chunk.len().min(BLOCK_BYTES as usize - within);
            match self.pages.get(&(at / BLOCK_BYTES)) {
                Some(page) => chunk[..n].copy_from_slice(&page[within..within + n]),
                None => chunk[..n].fill(0),
            }
            // A chunk straddling two pages: its tail from the next one.
            if n < chunk.len() {
                self.read(&mut chunk[n..], at + n as u64)?;
            }
            at += chunk.len() as u64;
        }
        Ok(())
    }
}

impl SimFile {
    pub fn new(name: &'static str) -> Self {
        Self { name, data: Arc::default() }
    }

    pub fn data(&self) -> std::sync::MutexGuard<'_, Sparse> {
        self.data.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An independent copy of the file as it is now.
    pub fn snapshot(&self) -> Self {
        Self { name: self.name, data: Arc::new(Mutex::new(self.data().clone())) }
    }

    pub fn len(&self) -> u64 {
        self.data().len
    }

    pub fn crash_point(&self, what: &'static str) {
        WRITING.with(|writing| writing.set(what));
        crash::point();
        WRITING.with(|writing| writing.set(""));
    }
}

impl BackingFile for SimFile {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        // The zero log's records and header are 32 bytes each; a rewrite writes them all at once.
        let what = match (self.name, offset, data.len()) {
            ("zero log", 0, _) => "zero log's header",
            ("zero log", _, len) if len > 32 => "zero log rewrite",
            (name, _, _) => name,
        };
        let mut at = offset;
        let mut rest = data;
        while !rest.is_empty() {
            let within = (at % BLOCK_BYTES) as usize;
            let piece = rest.len().min(BLOCK_BYTES as usize - within);
            self.crash_point(what);
            let mut file = self.data();
            let page = file.pages.entry(at / BLOCK_BYTES).or_insert_with(|| vec![0; BLOCK_BYTES as usize].into());
            page[within..within + piece].copy_from_slice(&rest[..piece]);
            file.len = file.len.max(at + piece as u64);
            drop(file);
            at += piece as u64;
            rest = &rest[piece..];
        }
        Ok(())
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.data().read(buf, offset)
    }

    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.crash_point(self.name);
        let mut file = self.data();
        let end = (offset + len).min(file.len);
        let mut at = offset;
        while at < end {
            let within = (at % BLOCK_BYTES) as usize;
            let n = (end - at).min(BLOCK_BYTES - within as u64) as usize;
            if n == BLOCK_BYTES as usize {
                file.pages.remove(&(at / BLOCK_BYTES));
            } else if let Some(page) = file.pages.get_mut(&(at / BLOCK_BYTES)) {
                page[within..within + n].fill(0);
            }
            at += n as u64;
        }
        Ok(())
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        Ok(self.data().pages.len() as u64 * BLOCK_BYTES)
    }

    fn data_ranges(&mut self) -> io::Result<Vec<(u64, u64)>> {
        let file = self.data();
        let mut pages: Vec<u64> = file.pages.keys().copied().collect();
        pages.sort_unstable();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for page in pages {
            let (start, end) = (page * BLOCK_BYTES, ((page + 1) * BLOCK_BYTES).min(file.len));
            match ranges.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => ranges.push((start, end)),
            }
        }
        Ok(ranges)
    }

    fn path(&self) -> Option<&Path> {
        None
    }
}

impl Model {
    /// The request in flight was answered: with success its blocks hold what it wrote; with
    /// an error (the spill limit can refuse one) they are unspecified.
    pub fn answered(&mut self, ok: bool) {
        let (range, content) = self.pending.take().expect("a request in flight");
        self.acked[range.start as usize..range.end as usize].fill(if ok { content } else { Content::Any });
    }
}

/// A copy of the arena files in `dir` (its stores are in them: the mapping is shared), in a new
/// directory beside it.
pub fn copy_arena(dir: &Path) -> Result<tempfile::TempDir, String> {
    let copy = tempfile::Builder::new().tempdir_in(dir.parent().expect("parent")).map_err(|e| e.to_string())?;
    for suffix in ["pages", "slots"] {
        let name = format!("vm.{suffix}");
        std::fs::copy(dir.join(&name), copy.path().join(&name)).map_err(|e| e.to_string())?;
    }
    Ok(copy)
}

pub fn snapshot(files: &[SimFile; 3]) -> [SimFile; 3] {
    [files[0].snapshot(), files[1].snapshot(), files[2].snapshot()]
}

/// A state a crash point left, and what its recovery read there: recovered again after the run
/// with a crash at the points of that recovery (the hook cannot be set from inside itself).
pub struct Left {
    pub mode: WriteCacheMode,
    pub arena: tempfile::TempDir,
    pub files: [SimFile; 3],
    pub model: Model,
}

/// Recovers `left` and, at each crash point of that recovery (freeing the copies that lost,
/// punching segments with nothing live, what the overlay does once it stands), recovers what a
/// process killed there would leave, which must read what the VM was told; as must the
/// recovery that ran on. The number of points crashed at.
pub fn check_killed_recoveries(golden: &Arc<dyn GoldenImage>, left: &Left) -> Result<u64, String> {
    check_killed_recoveries_with(golden, left, config(left.mode))
}

/// As [`check_killed_recoveries`], for an overlay of `config`.
pub fn check_killed_recoveries_with(
    golden: &Arc<dyn GoldenImage>,
    left: &Left,
    config: OverlayConfig,
) -> Result<u64, String> {
    let work = copy_arena(left.arena.path())?;
    let files = snapshot(&left.files);
    let found: Rc<RefCell<(u64, Option<String>)>> = Rc::default();
    let hook = {
        let (found, dir, files, golden, model, config) =
            (found.clone(), work.path().to_owned(), files.clone(), golden.clone(), left.model.clone(), config.clone());
        move || {
            let mut found = found.borrow_mut();
            found.0 += 1;
            if found.1.is_some() {
                return;
            }
            // Inside the hook: this recovery's own points are skipped.
            let result = copy_arena(&dir).and_then(|copy| {
                let mut vm = recover_with(&golden, config.clone(), copy.path(), &snapshot(&files))
                    .map_err(|e| format!("refused: {e}"))?;
                check_reads(&mut vm, &model)
            });
            if let Err(message) = result {
                found.1 = Some(format!("killed at point {} of a recovery, then recovered: {message}", found.0));
            }
        }
    };
    crash::set(hook);
    let recovered = recover_with(golden, config, work.path(), &files);
    crash::clear();
    let mut vm = recovered.map_err(|e| format!("recovery refused: {e}"))?;
    check_reads(&mut vm, &left.model).map_err(|e| format!("recovered: {e}"))?;
    let (points, failure) = found.take();
    failure.map_or(Ok(points), Err)
}

pub fn recover(
    golden: &Arc<dyn GoldenImage>,
    mode: WriteCacheMode,
    dir: &Path,
    files: &[SimFile; 3],
) -> overspill_engine::Result<Overlay> {
    recover_with(golden, config(mode), dir, files)
}

/// As [`recover`], for an overlay of `config`.
pub fn recover_with(
    golden: &Arc<dyn GoldenImage>,
    config: OverlayConfig,
    dir: &Path,
    files: &[SimFile; 3],
) -> overspill_engine::Result<Overlay> {
    let [spill, segments, zeros] = files.clone();
    let spill_segments = (spill.len() / SEGMENT_BYTES as u64) as u32;
    let arena = Arena::open(dir, "vm", Overlay::arena_pages(&config))?;
    let backing: Option<Box<dyn BackingFile>> = (config.mode != WriteCacheMode::Ram).then(|| Box::new(spill) as _);
    Overlay::recover(
        golden.clone(),
        config,
        backing,
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
        arena,
        StateFiles { segments: Box::new(segments), zeros: Box::new(zeros) },
        spill_segments,
    )
}

pub fn read_all(vm: &mut Overlay) -> Vec<Vec<u8>> {
    let mut buf = vec![0u8; (DISK_BLOCKS * BLOCK_BYTES) as usize];
    vm.read(0, &mut buf).expect("read the whole disk");
    buf.chunks(BLOCK_BYTES as usize).map(<[u8]>::to_vec).collect()
}

pub fn check_reads(vm: &mut Overlay, model: &Model) -> Result<(), String> {
    for (block, bytes) in read_all(vm).iter().enumerate() {
        if let Some(want) = model.acked[block].bytes(block as u64) {
            if &want != bytes {
                return Err(format!("block {block} reads {:?}, not {:?}", &bytes[..16], model.acked[block]));
            }
        }
    }
    Ok(())
}

/// The mix of requests of a run.
#[derive(Debug, Clone, Copy)]
pub struct Profile {
    /// Percent of requests that zero a range.
    pub zero_share: u32,
    /// Whether some writes are 1 MiB (they go straight to the spill log).
    pub large_writes: bool,
}

pub const MIXED: Profile = Profile { zero_share: 10, large_writes: true };
pub const ZEROING: Profile = Profile { zero_share: 50, large_writes: false };

/// One request of the workload, on whole blocks.
#[derive(Debug, Clone)]
pub enum Workload {
    Write {
        first: u64,
        blocks: u64,
        received: bool,
    },
    Zero {
        first: u64,
        blocks: u64,
    },
    Trim {
        first: u64,
        blocks: u64,
    },
    Flush,
    /// The server's background pass has the VM give memory back down to this many bytes.
    GiveBack {
        limit_bytes: u64,
    },
}

impl Workload {
    pub fn draw(rng: &mut SmallRng, profile: Profile) -> Self {
        // Most requests of a mixed run go to a hot eighth of the disk: overwrites in RAM and in
        // the log. A run that zeroes a lot writes all over the disk, so that it spills too.
        let anywhere = |rng: &mut SmallRng, blocks: u64| {
            let top = if profile.large_writes && rng.gen_ratio(2, 3) { DISK_BLOCKS / 8 } else { DISK_BLOCKS };
            rng.gen_range(0..top.max(blocks + 1) - blocks)
        };
        let received = rng.gen();
        if rng.gen_range(0..100) < profile.zero_share {
            // Zeroings of a profile that zeroes a lot stay in the hot eighth: their ranges merge,
            // so that the log soon holds many more records than ranges and is rewritten.
            let blocks = rng.gen_range(1..96);
            let first = if profile.zero_share > 30 { rng.gen_range(0..DISK_BLOCKS / 8) } else { anywhere(rng, blocks) };
            return Self::Zero { first, blocks };
        }
        match rng.gen_range(0..100) {
            0..=54 => Self::Write { first: anywhere(rng, 1), blocks: 1, received },
            75..=82 if profile.large_writes => {
                Self::Write { first: rng.gen_range(0..DISK_BLOCKS - 256), blocks: 256, received }
            }
            55..=82 => {
                let blocks = rng.gen_range(2..17);
                Self::Write { first: anywhere(rng, blocks), blocks, received }
            }
            83..=94 => {
                let blocks = rng.gen_range(1..96);
                Self::Trim { first: anywhere(rng, blocks), blocks }
            }
            95..=97 => Self::Flush,
            _ => Self::GiveBack { limit_bytes: rng.gen_range(0..=4) * (1 << 20) },
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Write { blocks: 256, .. } => "1 MiB write",
            Self::Write { .. } => "write",
            Self::Zero { .. } => "zero",
            Self::Trim { .. } => "trim",
            Self::Flush => "flush",
            Self::GiveBack { .. } => "give back",
        }
    }

    pub fn blocks(&self) -> Range<u64> {
        match *self {
            Self::Write { first, blocks, .. } | Self::Zero { first, blocks } | Self::Trim { first, blocks } => {
                first..first + blocks
            }
            Self::Flush | Self::GiveBack { .. } => 0..0,
        }
    }

    pub fn content(&self, version: u64) -> Content {
        match self {
            Self::Write { .. } => Content::Data(version),
            Self::Zero { .. } => Content::Zero,
            Self::Trim { .. } => Content::Any,
            Self::Flush | Self::GiveBack { .. } => Content::Any,
        }
    }

    pub fn run(&self, vm: &mut Overlay, version: u64) -> overspill_engine::Result<()> {
        let range = self.blocks();
        let (offset, len) = (range.start * BLOCK_BYTES, (range.end - range.start) * BLOCK_BYTES);
        match *self {
            Self::Write { received: false, .. } => {
                let data: Vec<u8> = range.flat_map(|block| block_bytes(block, version)).collect();
                vm.write(offset, &data)
            }
            Self::Write { received: true, .. } => {
                let data: Vec<u8> = range.flat_map(|block| block_bytes(block, version)).collect();
                // As a server receives it: straight from the "socket" into the pages.
                vm.write_received(offset, len as usize, |buffers| receive_into(buffers, &data, None))
            }
            Self::Zero { .. } => vm.write_zeroes(offset, len),
            Self::Trim { .. } => vm.trim(offset, len),
            Self::Flush => vm.flush(),
            Self::GiveBack { limit_bytes } => {
                vm.give_back_memory(limit_bytes);
                Ok(())
            }
        }
    }
}

/// What a recovery would decide from the state as it is now (`arena` and the files beside it),
/// checked block by block against `model`.
pub fn scan_matches(
    mode: WriteCacheMode,
    arena: &Arena,
    spill: &SimFile,
    segments: &SimFile,
    zeros: &SimFile,
    model: &Model,
) -> Result<(), String> {
    let image = arena.crash_image().map_err(|e| format!("arena: {e}"))?;
    let owners: Vec<Owner> = image.iter().map(|(owner, _)| *owner).collect();
    let files = StateFiles { segments: Box::new(segments.clone()), zeros: Box::new(zeros.clone()) };
    let spilling = mode == WriteCacheMode::RamDisk;
    let segments = spilling.then_some((spill.len() / SEGMENT_BYTES as u64) as u32);
    let found = state::scan(&owners, files, segments, DISK_BLOCKS).map_err(|e| format!("refused: {e}"))?;
    let zeros = &found.resolution.zeros;
    let spill = spill.data();
    let in_place = !spilling && mode != WriteCacheMode::Ram;
    let mut prefix = [0u8; 16];
    for block in 0..DISK_BLOCKS {
        // In place, a block that holds data in the file was written after any zeroing of it.
        let in_file = in_place && spill.pages.contains_key(&block);
        let content = match found.resolution.current.get(&block) {
            _ if in_file => spill
                .read(&mut prefix, block * BLOCK_BYTES)
                .map_err(|_| "past the cache file's end".to_string())
                .and_then(|()| Content::from_prefix(block, &prefix)),
            Some((_, CopyAt::Page(i))) => Content::from_prefix(block, &image[*i].1),
            Some((_, CopyAt::Spill { segment, slot })) => {
                let at = u64::from(*segment) * SEGMENT_BYTES as u64 + u64::from(*slot) * BLOCK_BYTES;
                spill
                    .read(&mut prefix, at)
                    .map_err(|_| "its copy is past the spill file's end".to_string())
                    .and_then(|()| Content::from_prefix(block, &prefix))
            }
            None if zeros.iter().any(|(first, end)| (*first..*end).contains(&block)) => Ok(Content::Zero),
            None => Ok(Content::Golden),
        }
        .map_err(|e| format!("block {block}: {e}"))?;
        if !model.allows(block, content) {
            return Err(format!(
                "block {block} would read {content:?}; the VM was told {:?} (in flight: {:?})",
                model.acked[block as usize], model.pending
            ));
        }
    }
    Ok(())
}
