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
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use overspill_engine::arena::Arena;
use overspill_engine::crash;
use overspill_engine::state::StateFiles;
use overspill_engine::{BackingFile, GoldenImage, HostMemory, Overlay, VmStats, WriteCacheMode};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
mod sim;
use sim::*;

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
        scan_matches(self.mode, &self.arena, &self.spill, &self.segments, &self.zeros, &self.model)
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
        // The background pass that moves an idle VM's coldest RAM to its spill log (#49).
        assert!(at("give back", "arena") > 1000, "crash points while giving RAM back: {}", at("give back", "arena"));
        let given_to_spill = at("give back", "spill segment");
        assert!(given_to_spill > 500, "crash points while given-back blocks are spilled: {given_to_spill}");
    }
}
