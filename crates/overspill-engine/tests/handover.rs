//! The handover simulation: a VM's overlay moves to a receiving overlay (live migration's engine
//! part, `Overlay::start_moving`/`take_moved`/`apply_moved`) while the VM goes on with a seeded
//! mix of writes, overwrites, zeroings, trims and flushes, both ends persistent and spilling, and
//! every crash point either end reaches is a kill. Until the switchover the sender's overlay is
//! the VM's (the receiver's ledger entry says "being made", so a killed receiver's files are
//! removed): at each point, whichever end it is in, what a recovery of the sender would find is
//! checked against the model. At the switchover (the last changes applied, the receiver about to
//! say it has everything) the receiver's state is recovered for real and must read exactly what
//! the VM was told; it is killed in turn at every crash point of that recovery, and what each
//! kill leaves recovers too; the recovered receiver then takes more requests and is recovered
//! once more. The server's side of the protocol (who holds the VM at each ledger write) is
//! tested against real servers in `crates/overspill/tests/migration.rs`.
//!
//! `HANDOVER_SEEDS=1,2 HANDOVER_OPS=800 cargo test --release -p overspill-engine --features
//! crash-points --test handover` replays seeds; a failure names its seed, operation and point.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

use overspill_engine::arena::Arena;
use overspill_engine::crash;
use overspill_engine::state::StateFiles;
use overspill_engine::{BackingFile, GoldenImage, HostMemory, Overlay, OverlayConfig, VmStats, WriteCacheMode};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
mod sim;
use sim::*;

/// Crash points every run together must reach (the issue asks for 10^4 per CI run).
const MIN_POINTS: u64 = 10_000;
const DEFAULT_RUNS: [(u64, usize); 3] = [(11, 300), (12, 300), (13, 300)];

/// Which end a crash point is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Sender,
    Receiver,
}

/// One end's state as a crash point sees it.
struct EndState {
    dir: PathBuf,
    arena: Arena,
    files: [SimFile; 3],
}

impl EndState {
    fn new(root: &std::path::Path, name: &str, config: &OverlayConfig) -> Self {
        let dir = root.join(name);
        std::fs::create_dir(&dir).expect("end dir");
        let arena = Arena::create(&dir, "vm", Overlay::arena_pages(config)).expect("arena");
        Self { dir, arena, files: [SimFile::new("spill segment"), SimFile::new("summary"), SimFile::new("zero log")] }
    }

    fn overlay(&self, golden: &Arc<dyn GoldenImage>, config: OverlayConfig) -> Overlay {
        let [spill, segments, zeros] = self.files.clone();
        Overlay::persistent(
            golden.clone(),
            config,
            Some(Box::new(spill) as Box<dyn BackingFile>),
            HostMemory::unlimited(),
            Arc::new(VmStats::default()),
            self.arena.clone(),
            StateFiles { segments: Box::new(segments), zeros: Box::new(zeros) },
        )
        .expect("overlay")
    }
}

struct Checker {
    seed: u64,
    sender: EndState,
    model: Model,
    end: Rc<Cell<End>>,
    op: usize,
    points: [u64; 2],
    failure: Option<String>,
}

impl Checker {
    fn crash_here(&mut self) {
        if self.failure.is_some() {
            return;
        }
        let end = self.end.get();
        self.points[end as usize] += 1;
        // Killed here, at either end: the sender's state is the VM's.
        let [spill, segments, zeros] = &self.sender.files;
        if let Err(message) =
            scan_matches(WriteCacheMode::RamDisk, &self.sender.arena, spill, segments, zeros, &self.model)
        {
            self.failure = Some(format!(
                "seed {} op {} crash point {} (at the {end:?}): the sender's state: {message}",
                self.seed,
                self.op,
                self.points[0] + self.points[1]
            ));
        }
    }
}

/// A receiver with less RAM than the sender, so that the same blocks lie differently at each end.
fn receiver_config() -> OverlayConfig {
    OverlayConfig { ram_target_bytes: 2 * MIB + 128 * 1024, ..config(WriteCacheMode::RamDisk) }
}

/// One handover: crash points at the sender, at the receiver and in the receiver's recovery.
fn run(seed: u64, ops: usize) -> [u64; 3] {
    let base = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let root = tempfile::Builder::new().prefix("overspill-handover").tempdir_in(base).expect("tempdir");
    let golden = golden();
    let sender_state = EndState::new(root.path(), "sender", &config(WriteCacheMode::RamDisk));
    let receiver_state = EndState::new(root.path(), "receiver", &receiver_config());
    let mut sender = sender_state.overlay(&golden, config(WriteCacheMode::RamDisk));
    let mut receiver = receiver_state.overlay(&golden, receiver_config());
    let end = Rc::new(Cell::new(End::Sender));
    let checker = Rc::new(RefCell::new(Checker {
        seed,
        sender: sender_state,
        model: Model::new(),
        end: end.clone(),
        op: 0,
        points: [0, 0],
        failure: None,
    }));
    let hook = Rc::clone(&checker);
    crash::set(move || hook.borrow_mut().crash_here());
    let failed = |checker: &Rc<RefCell<Checker>>| {
        if let Some(failure) = checker.borrow_mut().failure.take() {
            crash::clear();
            panic!("{failure}");
        }
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    let moved = |sender: &mut Overlay, receiver: &mut Overlay, blocks: u64| -> usize {
        let runs = sender.take_moved(blocks).expect("take");
        end.set(End::Receiver);
        for run in &runs {
            receiver.apply_moved(run).expect("apply");
        }
        end.set(End::Sender);
        runs.len()
    };
    // Written before the move begins, as a VM that ran a while.
    let warm_up = ops / 3;
    for op_index in 0..ops {
        if op_index == warm_up {
            sender.start_moving();
        }
        let op = Workload::draw(&mut rng, MIXED);
        let version = op_index as u64 + 1;
        {
            let mut checker = checker.borrow_mut();
            checker.op = op_index;
            checker.model.pending = Some((op.blocks(), op.content(version)));
        }
        let result = op.run(&mut sender, version);
        failed(&checker);
        checker.borrow_mut().model.answered(result.is_ok());
        if op_index >= warm_up && rng.gen_ratio(1, 3) {
            moved(&mut sender, &mut receiver, rng.gen_range(1..200));
            failed(&checker);
        }
    }
    // The switchover: the VM's requests held back, the last changes sent.
    while moved(&mut sender, &mut receiver, 1 << 20) > 0 {}
    failed(&checker);
    crash::clear();
    let checker = Rc::into_inner(checker).expect("the hook is gone").into_inner();
    let model = checker.model.clone();
    check_reads(&mut receiver, &model).unwrap_or_else(|e| panic!("seed {seed}: the receiver as it stands: {e}"));
    drop(sender);
    // The receiver's state, as a receiver killed from here on leaves it.
    let left = Left {
        mode: WriteCacheMode::RamDisk,
        arena: copy_arena(&receiver_state.dir).expect("copy"),
        files: snapshot(&receiver_state.files),
        model: model.clone(),
    };
    let recovery_points = check_killed_recoveries_with(&golden, &left, receiver_config())
        .unwrap_or_else(|e| panic!("seed {seed}: the receiver after the switchover: {e}"));
    // Served from its recovered state: more requests, then recovered once more.
    let copy = copy_arena(&receiver_state.dir).expect("copy");
    let files = snapshot(&receiver_state.files);
    let mut served = recover_with(&golden, receiver_config(), copy.path(), &files).expect("recovered receiver");
    let mut model = model;
    let mut version = 1 << 40 | seed << 20;
    for _ in 0..80 {
        let op = Workload::draw(&mut rng, MIXED);
        version += 1;
        model.pending = Some((op.blocks(), op.content(version)));
        let result = op.run(&mut served, version);
        model.answered(result.is_ok());
    }
    check_reads(&mut served, &model).unwrap_or_else(|e| panic!("seed {seed}: served after the move: {e}"));
    served.keep_state();
    drop(served);
    let mut again = recover_with(&golden, receiver_config(), copy.path(), &files).expect("recovered again");
    check_reads(&mut again, &model).unwrap_or_else(|e| panic!("seed {seed}: recovered after serving: {e}"));
    drop(receiver);
    [checker.points[0], checker.points[1], recovery_points]
}

fn runs() -> Vec<(u64, usize)> {
    let seeds = std::env::var("HANDOVER_SEEDS").ok();
    let ops = std::env::var("HANDOVER_OPS").ok().map(|n| n.parse().expect("HANDOVER_OPS: a number"));
    match (seeds, ops) {
        (None, None) => DEFAULT_RUNS.to_vec(),
        (seeds, ops) => {
            let seeds: Vec<u64> = match seeds {
                Some(list) => list.split(',').map(|s| s.trim().parse().expect("HANDOVER_SEEDS: numbers")).collect(),
                None => DEFAULT_RUNS.iter().map(|run| run.0).collect(),
            };
            seeds.into_iter().map(|seed| (seed, ops.unwrap_or(300))).collect()
        }
    }
}

#[test]
fn every_handover_crash_point_leaves_one_overlay_that_reads_what_the_vm_was_told() {
    let defaults = std::env::var("HANDOVER_SEEDS").is_err() && std::env::var("HANDOVER_OPS").is_err();
    let mut total = 0;
    for (seed, ops) in runs() {
        let [sender, receiver, recovery] = run(seed, ops);
        eprintln!(
            "seed {seed}: {sender} crash points at the sender, {receiver} at the receiver, {recovery} in the receiver's recovery"
        );
        assert!(receiver > 0 && recovery > 0, "seed {seed}: the receiver reached no crash point");
        total += sender + receiver + recovery;
    }
    eprintln!("{total} handover crash points");
    assert!(!defaults || total >= MIN_POINTS, "{total} handover crash points, fewer than {MIN_POINTS}");
}
