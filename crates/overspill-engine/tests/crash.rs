//! The crash simulation: one persistent VM's overlay runs a seeded mix of small and large writes,
//! overwrites, zeroings, trims and flushes over a small disk, spilling and compacting (or, in
//! mode `disk`, writing a cache file in place; in mode `ram`, in RAM alone), and is "killed" at
//! every crash point it reaches: before each page-header store, each in-place overwrite of a
//! page, each 4 KiB of every file write (spill segments, their summaries, the cache file, the
//! zero log and its rewrites) and each punch. At every point the state a recovery would find is
//! resolved by the engine's own [`state::scan`] and every block is checked against the model:
//! what the VM was told is written reads back; a block of the request in flight reads as before
//! or as after it (a trimmed block may read as anything). At a seeded sample of points the state
//! is copied and recovered for real ([`Overlay::recover`]); the rebuilt overlay is read whole,
//! written some more, handed over and recovered again, and read whole once more. Ten such
//! states per run are recovered once more after the run, killed in turn at every crash point of
//! that recovery, and what each kill leaves is recovered and read whole.
//!
//! `CRASH_SEEDS=1,2 CRASH_OPS=20000 cargo test --release -p overspill-engine --features
//! crash-points --test crash` replays seeds; a failure names its seed, operation and point.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
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
use rand::{Rng, SeedableRng};

mod common;
use common::receive_into;

const DISK_BLOCKS: u64 = 2048;
const MIB: u64 = 1 << 20;
/// The version golden blocks carry in their first 16 bytes.
const GOLDEN: u64 = u64::MAX;
/// About one crash point in this many is recovered for real, besides the end of each run.
const FULL_RECOVERY_EVERY: u32 = 400;
/// Seeds and their requests: three mixed runs, one that zeroes a lot (its zero log is rewritten
/// several times, with crashes in between), and one each in the modes without a spill log: a
/// cache file written in place, and RAM alone.
const DEFAULT_RUNS: [(u64, usize, Profile, WriteCacheMode); 6] = [
    (1, 400, MIXED, WriteCacheMode::RamDisk),
    (2, 400, MIXED, WriteCacheMode::RamDisk),
    (3, 400, MIXED, WriteCacheMode::RamDisk),
    (4, 2500, ZEROING, WriteCacheMode::RamDisk),
    (5, 600, MIXED, WriteCacheMode::Disk),
    (6, 400, MIXED, WriteCacheMode::Ram),
];
/// What every run together must reach.
const MIN_POINTS: u64 = 100_000;
/// States per run (a uniform sample of those recovered for real, the end of the run among them)
/// recovered again with a crash at each point of the recovery.
const LEFT_PER_RUN: usize = 10;

fn config(mode: WriteCacheMode) -> OverlayConfig {
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
fn backing_file(mode: WriteCacheMode) -> Option<SimFile> {
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
fn block_bytes(block: u64, version: u64) -> Vec<u8> {
    let mut bytes = vec![(block as u8) ^ (version as u8).rotate_left(3); BLOCK_BYTES as usize];
    bytes[..8].copy_from_slice(&block.to_le_bytes());
    bytes[8..16].copy_from_slice(&version.to_le_bytes());
    bytes
}

fn golden() -> Arc<dyn GoldenImage> {
    Arc::new(MemImage::new((0..DISK_BLOCKS).flat_map(|block| block_bytes(block, GOLDEN)).collect()))
}

/// What a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    Golden,
    Zero,
    Data(u64),
    /// Trimmed, or written by a request that failed: anything.
    Any,
}

impl Content {
    fn from_prefix(block: u64, prefix: &[u8]) -> Result<Self, String> {
        let word = |i: usize| u64::from_le_bytes(prefix[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        match (word(0), word(1)) {
            (0, 0) => Ok(Self::Zero),
            (b, GOLDEN) if b == block => Ok(Self::Golden),
            (b, version) if b == block => Ok(Self::Data(version)),
            (b, version) => Err(format!("holds block {b}'s version {version}")),
        }
    }

    fn bytes(self, block: u64) -> Option<Vec<u8>> {
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
struct Model {
    acked: Vec<Content>,
    pending: Option<(Range<u64>, Content)>,
}

impl Model {
    fn new() -> Self {
        Self { acked: vec![Content::Golden; DISK_BLOCKS as usize], pending: None }
    }

    fn allows(&self, block: u64, found: Content) -> bool {
        let acked = self.acked[block as usize];
        let in_flight = self.pending.as_ref().filter(|(range, _)| range.contains(&block)).map(|(_, content)| *content);
        acked == Content::Any || found == acked || in_flight.is_some_and(|new| new == Content::Any || new == found)
    }

    /// After a crash: the blocks of the request in flight hold whatever was found.
    fn settle(&mut self, found: impl Fn(u64) -> Content) {
        if let Some((range, _)) = self.pending.take() {
            for block in range {
                self.acked[block as usize] = found(block);
            }
        }
    }
}

thread_local! {
    /// The file being written at a crash point, for the tally.
    static WRITING: Cell<&'static str> = const { Cell::new("") };
}

/// A sparse file in memory, as long as its furthest write (reads past the end fail as a real
/// file's do; holes read as zeroes). Writes reach it 4 KiB at a time with a crash point before
/// each piece; punches too.
#[derive(Clone)]
struct SimFile {
    name: &'static str,
    data: Arc<Mutex<Sparse>>,
}

#[derive(Clone, Default)]
struct Sparse {
    pages: HashMap<u64, Box<[u8]>>,
    len: u64,
}

impl Sparse {
    fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
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
    fn new(name: &'static str) -> Self {
        Self { name, data: Arc::default() }
    }

    fn data(&self) -> std::sync::MutexGuard<'_, Sparse> {
        self.data.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An independent copy of the file as it is now.
    fn snapshot(&self) -> Self {
        Self { name: self.name, data: Arc::new(Mutex::new(self.data().clone())) }
    }

    fn len(&self) -> u64 {
        self.data().len
    }

    fn crash_point(&self, what: &'static str) {
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

/// The VM's state as the crash points see it, and what they found.
struct Checker {
    seed: u64,
    mode: WriteCacheMode,
    golden: Arc<dyn GoldenImage>,
    dir: PathBuf,
    arena: Arena,
    /// The spill log or the in-place cache file (a file that stays empty in mode `ram`).
    spill: SimFile,
    segments: SimFile,
    zeros: SimFile,
    model: Model,
    op: usize,
    op_kind: &'static str,
    rng: SmallRng,
    points: u64,
    full_recoveries: u64,
    /// Crash points by the operation in flight and what was about to change.
    tally: BTreeMap<(&'static str, &'static str), u64>,
    failure: Option<String>,
    /// States recovered for real, kept to be recovered again with crashes in the recovery.
    left: Vec<Left>,
    left_rng: SmallRng,
}

impl Checker {
    fn crash_here(&mut self) {
        if self.failure.is_some() {
            return;
        }
        self.points += 1;
        let writing = WRITING.with(Cell::get);
        *self.tally.entry((self.op_kind, if writing.is_empty() { "arena" } else { writing })).or_default() += 1;
        let result = self.check_scan().and_then(|()| {
            // A rewrite of the zero log cut short leaves records in the region the recovered
            // process rewrites into next: recovered for real more often, and zeroing after.
            let in_rewrite = writing == "zero log rewrite";
            if self.rng.gen_ratio(1, if in_rewrite { FULL_RECOVERY_EVERY / 40 } else { FULL_RECOVERY_EVERY }) {
                self.check_full_recovery(if in_rewrite { ZEROING } else { MIXED })
            } else {
                Ok(())
            }
        });
        if let Err(message) = result {
            self.failure = Some(format!(
                "seed {} op {} ({}) crash point {} (writing {:?}): {message}",
                self.seed, self.op, self.op_kind, self.points, writing
            ));
        }
    }

    /// What a recovery would decide, read from the state as it is now, checked block by block.
    fn check_scan(&self) -> Result<(), String> {
        let image = self.arena.crash_image().map_err(|e| format!("arena: {e}"))?;
        let owners: Vec<Owner> = image.iter().map(|(owner, _)| *owner).collect();
        let files = StateFiles { segments: Box::new(self.segments.clone()), zeros: Box::new(self.zeros.clone()) };
        let spilling = self.mode == WriteCacheMode::RamDisk;
        let segments = spilling.then_some((self.spill.len() / SEGMENT_BYTES as u64) as u32);
        let found = state::scan(&owners, files, segments, DISK_BLOCKS).map_err(|e| format!("refused: {e}"))?;
        let zeros = &found.resolution.zeros;
        let spill = self.spill.data();
        let in_place = !spilling && self.mode != WriteCacheMode::Ram;
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
            if !self.model.allows(block, content) {
                return Err(format!(
                    "block {block} would read {content:?}; the VM was told {:?} (in flight: {:?})",
                    self.model.acked[block as usize], self.model.pending
                ));
            }
        }
        Ok(())
    }

    /// Copies the state as it is now, recovers it for real, and checks the rebuilt overlay;
    /// then runs `profile`'s requests on it, checks a recovery of it killed between requests,
    /// hands it over and recovers it again.
    fn check_full_recovery(&mut self, profile: Profile) -> Result<(), String> {
        self.full_recoveries += 1;
        let copy = copy_arena(&self.dir)?;
        let files = [self.spill.snapshot(), self.segments.snapshot(), self.zeros.snapshot()];
        // Which of the states recovered so far are kept: a uniform sample of the run (reservoir).
        let keep = if self.left.len() < LEFT_PER_RUN {
            Some(self.left.len())
        } else {
            Some(self.left_rng.gen_range(0..self.full_recoveries) as usize).filter(|&i| i < LEFT_PER_RUN)
        };
        let left = match keep {
            Some(i) => Some((i, copy_arena(&self.dir)?, snapshot(&files))),
            None => None,
        };
        let mode = self.mode;
        let mut vm = recover(&self.golden, mode, copy.path(), &files).map_err(|e| format!("recovery refused: {e}"))?;
        let mut model = self.model.clone();
        let mut failure = None;
        let found = read_all(&mut vm);
        for block in 0..DISK_BLOCKS {
            let bytes = &found[block as usize];
            let content = Content::from_prefix(block, bytes).unwrap_or(Content::Any);
            let whole = content.bytes(block).is_some_and(|want| &want == bytes);
            if (!whole || !model.allows(block, content)) && failure.is_none() {
                failure = Some(format!(
                    "recovered block {block} reads {:?}; the VM was told {:?} (in flight {:?})",
                    &bytes[..16],
                    model.acked[block as usize],
                    model.pending
                ));
            }
        }
        if let Some(failure) = failure {
            return Err(failure);
        }
        model.settle(|block| Content::from_prefix(block, &found[block as usize]).unwrap_or(Content::Any));
        if let Some((i, arena, files)) = left {
            let left = Left { mode, arena, files, model: model.clone() };
            if i < self.left.len() {
                self.left[i] = left;
            } else {
                self.left.push(left);
            }
        }
        // Numbers above anything the crashed process used: a recovery must continue past them.
        let mut rng = SmallRng::seed_from_u64(self.points);
        let mut version = 1 << 40 | self.points << 12;
        for _ in 0..60 {
            let op = Workload::draw(&mut rng, profile);
            version += 1;
            model.pending = Some((op.blocks(), op.content(version)));
            let result = op.run(&mut vm, version);
            model.answered(result.is_ok());
        }
        check_reads(&mut vm, &model).map_err(|e| format!("written after a recovery: {e}"))?;
        // Killed in turn, between requests: what a recovered process made of the state it found
        // recovers too (a zero log it rewrote into the region a killed rewrite had written must
        // not bring that rewrite's records back).
        let killed = copy_arena(copy.path())?;
        let mut next = recover(&self.golden, mode, killed.path(), &snapshot(&files))
            .map_err(|e| format!("recovery refused: {e}"))?;
        check_reads(&mut next, &model).map_err(|e| format!("a recovered process killed: {e}"))?;
        drop(next);
        vm.keep_state();
        drop(vm);
        let mut vm =
            recover(&self.golden, mode, copy.path(), &files).map_err(|e| format!("second recovery refused: {e}"))?;
        check_reads(&mut vm, &model).map_err(|e| format!("recovered twice: {e}"))
    }
}

impl Model {
    /// The request in flight was answered: with success its blocks hold what it wrote; with
    /// an error (the spill limit can refuse one) they are unspecified.
    fn answered(&mut self, ok: bool) {
        let (range, content) = self.pending.take().expect("a request in flight");
        self.acked[range.start as usize..range.end as usize].fill(if ok { content } else { Content::Any });
    }
}

/// A copy of the arena files in `dir` (its stores are in them: the mapping is shared), in a new
/// directory beside it.
fn copy_arena(dir: &Path) -> Result<tempfile::TempDir, String> {
    let copy = tempfile::Builder::new().tempdir_in(dir.parent().expect("parent")).map_err(|e| e.to_string())?;
    for suffix in ["pages", "slots"] {
        let name = format!("vm.{suffix}");
        std::fs::copy(dir.join(&name), copy.path().join(&name)).map_err(|e| e.to_string())?;
    }
    Ok(copy)
}

fn snapshot(files: &[SimFile; 3]) -> [SimFile; 3] {
    [files[0].snapshot(), files[1].snapshot(), files[2].snapshot()]
}

/// A state a crash point left, and what its recovery read there: recovered again after the run
/// with a crash at the points of that recovery (the hook cannot be set from inside itself).
struct Left {
    mode: WriteCacheMode,
    arena: tempfile::TempDir,
    files: [SimFile; 3],
    model: Model,
}

/// Recovers `left` and, at each crash point of that recovery (freeing the copies that lost,
/// punching segments with nothing live, what the overlay does once it stands), recovers what a
/// process killed there would leave, which must read what the VM was told; as must the
/// recovery that ran on. The number of points crashed at.
fn check_killed_recoveries(golden: &Arc<dyn GoldenImage>, left: &Left) -> Result<u64, String> {
    let work = copy_arena(left.arena.path())?;
    let files = snapshot(&left.files);
    let found: Rc<RefCell<(u64, Option<String>)>> = Rc::default();
    let hook = {
        let (found, dir, files, golden, model, mode) =
            (found.clone(), work.path().to_owned(), files.clone(), golden.clone(), left.model.clone(), left.mode);
        move || {
            let mut found = found.borrow_mut();
            found.0 += 1;
            if found.1.is_some() {
                return;
            }
            // Inside the hook: this recovery's own points are skipped.
            let result = copy_arena(&dir).and_then(|copy| {
                let mut vm =
                    recover(&golden, mode, copy.path(), &snapshot(&files)).map_err(|e| format!("refused: {e}"))?;
                check_reads(&mut vm, &model)
            });
            if let Err(message) = result {
                found.1 = Some(format!("killed at point {} of a recovery, then recovered: {message}", found.0));
            }
        }
    };
    crash::set(hook);
    let recovered = recover(golden, left.mode, work.path(), &files);
    crash::clear();
    let mut vm = recovered.map_err(|e| format!("recovery refused: {e}"))?;
    check_reads(&mut vm, &left.model).map_err(|e| format!("recovered: {e}"))?;
    let (points, failure) = found.take();
    failure.map_or(Ok(points), Err)
}

fn recover(
    golden: &Arc<dyn GoldenImage>,
    mode: WriteCacheMode,
    dir: &Path,
    files: &[SimFile; 3],
) -> overspill_engine::Result<Overlay> {
    let [spill, segments, zeros] = files.clone();
    let spill_segments = (spill.len() / SEGMENT_BYTES as u64) as u32;
    let arena = Arena::open(dir, "vm", Overlay::arena_pages(&config(mode)))?;
    let backing: Option<Box<dyn BackingFile>> = (mode != WriteCacheMode::Ram).then(|| Box::new(spill) as _);
    Overlay::recover(
        golden.clone(),
        config(mode),
        backing,
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
        arena,
        StateFiles { segments: Box::new(segments), zeros: Box::new(zeros) },
        spill_segments,
    )
}

fn read_all(vm: &mut Overlay) -> Vec<Vec<u8>> {
    let mut buf = vec![0u8; (DISK_BLOCKS * BLOCK_BYTES) as usize];
    vm.read(0, &mut buf).expect("read the whole disk");
    buf.chunks(BLOCK_BYTES as usize).map(<[u8]>::to_vec).collect()
}

fn check_reads(vm: &mut Overlay, model: &Model) -> Result<(), String> {
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
struct Profile {
    /// Percent of requests that zero a range.
    zero_share: u32,
    /// Whether some writes are 1 MiB (they go straight to the spill log).
    large_writes: bool,
}

const MIXED: Profile = Profile { zero_share: 10, large_writes: true };
const ZEROING: Profile = Profile { zero_share: 50, large_writes: false };

/// One request of the workload, on whole blocks.
#[derive(Debug, Clone)]
enum Workload {
    Write { first: u64, blocks: u64, received: bool },
    Zero { first: u64, blocks: u64 },
    Trim { first: u64, blocks: u64 },
    Flush,
}

impl Workload {
    fn draw(rng: &mut SmallRng, profile: Profile) -> Self {
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
            _ => Self::Flush,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Write { blocks: 256, .. } => "1 MiB write",
            Self::Write { .. } => "write",
            Self::Zero { .. } => "zero",
            Self::Trim { .. } => "trim",
            Self::Flush => "flush",
        }
    }

    fn blocks(&self) -> Range<u64> {
        match *self {
            Self::Write { first, blocks, .. } | Self::Zero { first, blocks } | Self::Trim { first, blocks } => {
                first..first + blocks
            }
            Self::Flush => 0..0,
        }
    }

    fn content(&self, version: u64) -> Content {
        match self {
            Self::Write { .. } => Content::Data(version),
            Self::Zero { .. } => Content::Zero,
            Self::Trim { .. } => Content::Any,
            Self::Flush => Content::Any,
        }
    }

    fn run(&self, vm: &mut Overlay, version: u64) -> overspill_engine::Result<()> {
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
        }
    }
}

struct RunSummary {
    points: u64,
    full_recoveries: u64,
    compaction_points: u64,
    /// Crash points inside recoveries.
    recovery_points: u64,
    tally: BTreeMap<(&'static str, &'static str), u64>,
}

fn run(seed: u64, ops: usize, profile: Profile, mode: WriteCacheMode) -> RunSummary {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let root = tempfile::Builder::new().prefix("overspill-crash").tempdir_in(base).expect("tempdir");
    let dir = root.path().join("vm");
    std::fs::create_dir(&dir).expect("vm dir");
    let golden = golden();
    let arena = Arena::create(&dir, "vm", Overlay::arena_pages(&config(mode))).expect("arena");
    let backing = backing_file(mode);
    let spill = backing.clone().unwrap_or_else(|| SimFile::new("nothing"));
    let (segments, zeros) = (SimFile::new("summary"), SimFile::new("zero log"));
    let stats = Arc::new(VmStats::default());
    let mut vm = Overlay::persistent(
        golden.clone(),
        config(mode),
        backing.map(|file| Box::new(file) as Box<dyn BackingFile>),
        HostMemory::unlimited(),
        stats.clone(),
        arena.clone(),
        StateFiles { segments: Box::new(segments.clone()), zeros: Box::new(zeros.clone()) },
    )
    .expect("overlay");
    let checker = Rc::new(RefCell::new(Checker {
        seed,
        mode,
        golden,
        dir,
        arena,
        spill,
        segments,
        zeros,
        model: Model::new(),
        op: 0,
        op_kind: "",
        rng: SmallRng::seed_from_u64(seed ^ 0xc4a5),
        points: 0,
        full_recoveries: 0,
        tally: BTreeMap::new(),
        failure: None,
        left: Vec::new(),
        left_rng: SmallRng::seed_from_u64(seed ^ 0x1e57),
    }));
    let hook = Rc::clone(&checker);
    crash::set(move || hook.borrow_mut().crash_here());
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut compaction_points = 0;
    let mut refused = 0;
    for op_index in 0..ops {
        let op = Workload::draw(&mut rng, profile);
        let version = op_index as u64 + 1;
        let points_before = {
            let mut checker = checker.borrow_mut();
            checker.op = op_index;
            checker.op_kind = op.kind();
            checker.model.pending = Some((op.blocks(), op.content(version)));
            checker.points
        };
        let moved_before = stats.compaction_bytes_moved.get();
        let result = op.run(&mut vm, version);
        let mut checker = checker.borrow_mut();
        if let Some(failure) = checker.failure.take() {
            crash::clear();
            panic!("{failure}");
        }
        if let Err(error) = &result {
            refused += 1;
            assert!(refused < ops / 50, "seed {seed}: too many refusals, the last at op {op_index}: {error}");
        }
        checker.model.answered(result.is_ok());
        if stats.compaction_bytes_moved.get() > moved_before {
            compaction_points += checker.points - points_before;
        }
        if op_index % 500 == 0 {
            check_reads(&mut vm, &checker.model).unwrap_or_else(|e| panic!("seed {seed} op {op_index}: {e}"));
        }
    }
    crash::clear();
    let mut checker = Rc::into_inner(checker).expect("the hook is gone").into_inner();
    // The end of the run is a crash point too.
    checker.op_kind = "end";
    checker.check_full_recovery(MIXED).unwrap_or_else(|e| panic!("seed {seed} at the end: {e}"));
    if mode == WriteCacheMode::RamDisk {
        assert!(stats.spill_segments_written.get() > 0, "seed {seed}: the VM spilled");
    }
    let mut recovery_points = 0;
    for (i, left) in checker.left.iter().enumerate() {
        recovery_points += check_killed_recoveries(&checker.golden, left)
            .unwrap_or_else(|e| panic!("seed {seed}, state {i} recovered for real: {e}"));
    }
    RunSummary {
        points: checker.points,
        full_recoveries: checker.full_recoveries,
        compaction_points,
        recovery_points,
        tally: checker.tally,
    }
}

/// `(seed, requests, profile, mode)` of each run: `CRASH_SEEDS` and `CRASH_OPS` replace the
/// defaults (seeds divisible by 4 zero a lot; seed 5, 11, 17… writes a cache file in place,
/// seed 6, 12, 18… keeps RAM alone, the others spill).
fn runs() -> Vec<(u64, usize, Profile, WriteCacheMode)> {
    let seeds = std::env::var("CRASH_SEEDS").ok();
    let ops = std::env::var("CRASH_OPS").ok().map(|n| n.parse().expect("CRASH_OPS: a number"));
    if seeds.is_none() && ops.is_none() {
        return DEFAULT_RUNS.to_vec();
    }
    let seeds: Vec<u64> = match seeds {
        Some(list) => list.split(',').map(|s| s.trim().parse().expect("CRASH_SEEDS: numbers")).collect(),
        None => DEFAULT_RUNS.iter().map(|run| run.0).collect(),
    };
    let mode = |seed: u64| match seed % 6 {
        5 => WriteCacheMode::Disk,
        0 => WriteCacheMode::Ram,
        _ => WriteCacheMode::RamDisk,
    };
    seeds
        .into_iter()
        .map(|seed| (seed, ops.unwrap_or(1000), if seed % 4 == 0 { ZEROING } else { MIXED }, mode(seed)))
        .collect()
}

#[test]
fn every_crash_point_recovers_what_the_vm_was_told() {
    let mut total =
        RunSummary { points: 0, full_recoveries: 0, compaction_points: 0, recovery_points: 0, tally: BTreeMap::new() };
    let defaults = std::env::var("CRASH_SEEDS").is_err() && std::env::var("CRASH_OPS").is_err();
    for (seed, ops, profile, mode) in runs() {
        let summary = run(seed, ops, profile, mode);
        assert!(!defaults || summary.points > 5000, "seed {seed} (mode {mode}): {} crash points", summary.points);
        eprintln!(
            "seed {seed} (mode {mode}): {} crash points, {} recovered for real, {} in requests that compacted, {} in recoveries",
            summary.points, summary.full_recoveries, summary.compaction_points, summary.recovery_points
        );
        total.points += summary.points;
        total.recovery_points += summary.recovery_points;
        total.full_recoveries += summary.full_recoveries;
        total.compaction_points += summary.compaction_points;
        for (key, count) in summary.tally {
            *total.tally.entry(key).or_default() += count;
        }
    }
    for ((op, writing), count) in &total.tally {
        eprintln!("  {count:>8} points in {op}, before a change to the {writing}");
    }
    let at = |op: &str, writing: &str| total.tally.get(&(op, writing)).copied().unwrap_or(0);
    if defaults {
        assert!(total.points >= MIN_POINTS, "{} crash points, fewer than {MIN_POINTS}", total.points);
        assert!(total.compaction_points > 1000, "crash points during compaction: {}", total.compaction_points);
        assert!(at("trim", "arena") > 1000, "crash points during trims");
        assert!(at("zero", "zero log") > 100, "crash points while the zero log is written");
        let rewrites = at("zero", "zero log rewrite");
        assert!(rewrites >= 3, "crash points while the zero log is rewritten: {rewrites}");
        let switches = at("zero", "zero log's header");
        assert!(switches >= 3, "crash points before the zero log switches regions: {switches}");
        let segment_writes: u64 = ["write", "1 MiB write"].iter().map(|op| at(op, "spill segment")).sum();
        assert!(segment_writes > 10_000, "crash points during segment writes: {segment_writes}");
        assert!(total.full_recoveries > 50, "full recoveries: {}", total.full_recoveries);
        assert!(total.recovery_points > 300, "crash points inside recoveries: {}", total.recovery_points);
        let in_place: u64 = ["write", "1 MiB write"].iter().map(|op| at(op, "cache file")).sum();
        assert!(in_place > 1000, "crash points during writes in place: {in_place}");
        assert!(at("zero", "cache file") > 20, "crash points during punches in place");
    }
}
