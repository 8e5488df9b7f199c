//! A VM's overlay rebuilt from the state a previous overlay left in real files (an arena in a
//! directory, a spill file, segment summaries, a zero log): after a planned hand-over
//! (`keep_state`) and after the overlay simply vanished (as when its process is killed: nothing
//! of it runs again), every block reads what the model says, across RAM, the open segment, the
//! spill log, zeroed and trimmed ranges.

use std::path::Path;
use std::sync::Arc;

use overspill_engine::arena::Arena;
use overspill_engine::state::StateFiles;
use overspill_engine::{
    EngineError, GoldenImage, HostMemory, MemImage, Overlay, OverlayConfig, ScratchFile, VmStats, WriteCacheMode,
    BLOCK_BYTES, SEGMENT_BYTES,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const DISK_BLOCKS: u64 = 8192;
const MIB: u64 = 1 << 20;

fn config_in(mode: WriteCacheMode) -> OverlayConfig {
    // 1 MiB of RAM tier beside the open segment: most writes spill.
    OverlayConfig { mode, ram_target_bytes: 3 * MIB + 256 * 1024, spill_max_bytes: None }
}

fn golden() -> Arc<dyn GoldenImage> {
    Arc::new(MemImage::new((0..DISK_BLOCKS * BLOCK_BYTES).map(|i| (i / 4096) as u8 | 0x80).collect()))
}

fn files(dir: &Path, create: bool) -> (Box<ScratchFile>, StateFiles) {
    let file = |name: &str| {
        Box::new(if create { ScratchFile::create(dir, name, 0) } else { ScratchFile::open(dir, name) }.expect(name))
    };
    (file("vm.spill"), StateFiles { segments: file("vm.segments"), zeros: file("vm.zeros") })
}

fn fresh(dir: &Path) -> Overlay {
    fresh_in(dir, WriteCacheMode::RamDisk)
}

/// A persistent overlay in `mode`: its spill file, or its in-place cache file (as large as the
/// disk), is `vm.spill`.
fn fresh_in(dir: &Path, mode: WriteCacheMode) -> Overlay {
    let (spill, state) = files(dir, true);
    if mode != WriteCacheMode::RamDisk {
        std::fs::File::options()
            .write(true)
            .open(dir.join("vm.spill"))
            .expect("file")
            .set_len(DISK_BLOCKS * BLOCK_BYTES)
            .expect("size");
    }
    let config = config_in(mode);
    let arena = Arena::create(dir, "vm", Overlay::arena_pages(&config)).expect("arena");
    Overlay::persistent(golden(), config, Some(spill), HostMemory::unlimited(), Arc::default(), arena, state)
        .expect("overlay")
}

fn recover(dir: &Path) -> Result<Overlay, EngineError> {
    recover_in(dir, WriteCacheMode::RamDisk)
}

fn recover_in(dir: &Path, mode: WriteCacheMode) -> Result<Overlay, EngineError> {
    let (spill, state) = files(dir, false);
    let segments = (spill.logical_size().expect("spill length") / SEGMENT_BYTES as u64) as u32;
    let config = config_in(mode);
    let arena = Arena::open(dir, "vm", Overlay::arena_pages(&config))?;
    Overlay::recover(
        golden(),
        config,
        Some(spill),
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
        arena,
        state,
        segments,
    )
}

/// What each block should read: `None` for "anything" (trimmed), else its bytes' first value
/// (blocks are written whole with one value).
struct Model {
    blocks: Vec<Option<u8>>,
}

impl Model {
    fn new() -> Self {
        Self { blocks: (0..DISK_BLOCKS).map(|b| Some(b as u8 | 0x80)).collect() }
    }

    fn check(&self, vm: &mut Overlay, when: &str) {
        let mut buf = vec![0u8; (DISK_BLOCKS * BLOCK_BYTES) as usize];
        vm.read(0, &mut buf).expect("read");
        for (block, (bytes, want)) in buf.chunks(4096).zip(&self.blocks).enumerate() {
            if let Some(want) = want {
                assert!(bytes.iter().all(|b| b == want), "{when}: block {block} reads {} not {want}", bytes[0]);
            }
        }
    }
}

/// A mix of 4 KiB and 1 MiB writes, zeroings and trims; about a third of the writes land on
/// blocks already written.
fn work(vm: &mut Overlay, model: &mut Model, rng: &mut SmallRng, ops: usize) {
    for _ in 0..ops {
        let value: u8 = rng.gen_range(1..0x80);
        match rng.gen_range(0..100) {
            0..=69 => {
                let block = rng.gen_range(0..DISK_BLOCKS);
                vm.write(block * BLOCK_BYTES, &[value; 4096]).expect("write");
                model.blocks[block as usize] = Some(value);
            }
            70..=79 => {
                let first = rng.gen_range(0..DISK_BLOCKS - 256);
                vm.write(first * BLOCK_BYTES, &vec![value; MIB as usize]).expect("large write");
                model.blocks[first as usize..first as usize + 256].fill(Some(value));
            }
            80..=89 => {
                let first = rng.gen_range(0..DISK_BLOCKS - 64);
                let len = rng.gen_range(1..64);
                vm.write_zeroes(first * BLOCK_BYTES, len * BLOCK_BYTES).expect("zero");
                model.blocks[first as usize..(first + len) as usize].fill(Some(0));
            }
            _ => {
                let first = rng.gen_range(0..DISK_BLOCKS - 64);
                let len = rng.gen_range(1..64);
                vm.trim(first * BLOCK_BYTES, len * BLOCK_BYTES).expect("trim");
                model.blocks[first as usize..(first + len) as usize].fill(None);
            }
        }
    }
}

#[test]
fn a_kept_overlay_and_a_vanished_one_are_rebuilt_block_for_block() {
    for seed in 0..4 {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut vm = fresh(dir.path());
        work(&mut vm, &mut model, &mut rng, 400);
        assert!(vm.stats().spill_segments_written.get() > 2, "seed {seed}: spilled");
        model.check(&mut vm, "before");

        // A planned hand-over.
        vm.keep_state();
        drop(vm);
        let mut vm = recover(dir.path()).expect("recovered after a hand-over");
        assert!(vm.stats().recovered_blocks.get() > 0);
        model.check(&mut vm, "after a hand-over");
        work(&mut vm, &mut model, &mut rng, 400);
        model.check(&mut vm, "written after a hand-over");

        // The process dies: nothing of the overlay runs again, its files stay as they are.
        std::mem::forget(vm);
        let mut vm = recover(dir.path()).expect("recovered after a crash");
        model.check(&mut vm, "after a crash");
        work(&mut vm, &mut model, &mut rng, 200);
        model.check(&mut vm, "written after a crash");

        // A deliberate end: the files go.
        drop(vm);
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert!(left.is_empty(), "seed {seed}: files left after the VM ended: {left:?}");
    }
}

/// The in-place modes keep no copies in memory: their cache file is the state. After a
/// hand-over and after a crash, its data is the written blocks and the zero log says which of
/// its holes read as zeroes (trimmed ones may read as anything).
#[test]
fn an_in_place_cache_file_is_rebuilt_from_its_data_and_its_zero_log() {
    for (seed, mode) in [(10, WriteCacheMode::Disk), (11, WriteCacheMode::Shared)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut vm = fresh_in(dir.path(), mode);
        work(&mut vm, &mut model, &mut rng, 400);
        model.check(&mut vm, "before");
        vm.keep_state();
        drop(vm);
        let mut vm = recover_in(dir.path(), mode).expect("recovered after a hand-over");
        assert!(vm.stats().recovered_blocks.get() > 0, "{mode}: blocks found in the cache file");
        model.check(&mut vm, "after a hand-over");
        work(&mut vm, &mut model, &mut rng, 300);
        std::mem::forget(vm);
        let mut vm = recover_in(dir.path(), mode).expect("recovered after a crash");
        model.check(&mut vm, "after a crash");
        drop(vm);
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert!(left.is_empty(), "{mode}: files left after the VM ended: {left:?}");
    }
}

/// A cache file with a flaw: on a filesystem that cannot report holes (`no_holes`: all of it is
/// "data"), or whose next write stops half way with ENOSPC (`fills_up_once`: the filesystem
/// filled up mid-write).
struct Flawed {
    file: Box<ScratchFile>,
    no_holes: bool,
    fills_up_once: bool,
}

impl overspill_engine::BackingFile for Flawed {
    fn write_at(&mut self, data: &[u8], offset: u64) -> std::io::Result<()> {
        if std::mem::take(&mut self.fills_up_once) {
            self.file.write_at(&data[..data.len() / 2], offset)?;
            return Err(std::io::ErrorKind::StorageFull.into());
        }
        self.file.write_at(data, offset)
    }
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_at(buf, offset)
    }
    fn punch_hole(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        self.file.punch_hole(offset, len)
    }
    fn allocated_bytes(&self) -> std::io::Result<u64> {
        self.file.allocated_bytes()
    }
    fn path(&self) -> Option<&Path> {
        self.file.path()
    }
    fn data_ranges(&mut self) -> std::io::Result<Vec<(u64, u64)>> {
        if self.no_holes {
            return Ok(vec![(0, self.file.logical_size()?)]);
        }
        self.file.data_ranges()
    }
}

/// Taken at its word, such a filesystem would make every block never written read as zeroes:
/// the VM is refused instead.
#[test]
fn an_in_place_cache_file_whose_holes_cannot_be_told_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut vm = fresh_in(dir.path(), WriteCacheMode::Disk);
    vm.write(0, &[7; 4096]).expect("write");
    vm.keep_state();
    drop(vm);
    let (cache, state) = files(dir.path(), false);
    let config = config_in(WriteCacheMode::Disk);
    let arena = Arena::open(dir.path(), "vm", Overlay::arena_pages(&config)).expect("arena");
    let stats = Arc::new(VmStats::default());
    let flawed = Flawed { file: cache, no_holes: true, fills_up_once: false };
    let backing = Some(Box::new(flawed) as Box<dyn overspill_engine::BackingFile>);
    match Overlay::recover(golden(), config, backing, HostMemory::unlimited(), stats, arena, state, 0) {
        Err(EngineError::Corrupt(message)) => assert!(message.contains("holes"), "{message}"),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("recovered a cache file whose holes it cannot see"),
    }
    // The refusal left the state as it found it: a filesystem that can tell recovers it.
    let mut vm = recover_in(dir.path(), WriteCacheMode::Disk).expect("the same state, recovered");
    let mut back = vec![0; 4096];
    vm.read(0, &mut back).expect("read");
    assert_eq!(back, vec![7; 4096]);
}

/// A write that failed part way leaves bytes in blocks it never mapped; a zeroing acknowledged
/// after it must still read as zeroes once the cache file is recovered (a recovery takes what
/// the file holds for data written after the zeroing).
#[test]
fn a_zeroing_after_a_failed_write_reads_as_zeroes_after_a_crash() {
    for mode in [WriteCacheMode::Disk, WriteCacheMode::Shared] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (cache, state) = files(dir.path(), true);
        std::fs::File::options()
            .write(true)
            .open(dir.path().join("vm.spill"))
            .expect("file")
            .set_len(DISK_BLOCKS * BLOCK_BYTES)
            .expect("size");
        let config = config_in(mode);
        let arena = Arena::create(dir.path(), "vm", Overlay::arena_pages(&config)).expect("arena");
        let flawed = Flawed { file: cache, no_holes: false, fills_up_once: true };
        let backing = Some(Box::new(flawed) as Box<dyn overspill_engine::BackingFile>);
        let mut vm =
            Overlay::persistent(golden(), config, backing, HostMemory::unlimited(), Arc::default(), arena, state)
                .expect("overlay");
        assert!(vm.write(0, &[9; 4 * 4096]).is_err(), "{mode}: the write fails");
        vm.write_zeroes(0, 4 * 4096).expect("the zeroing");
        let mut back = vec![1; 4 * 4096];
        vm.read(0, &mut back).expect("read");
        assert!(back.iter().all(|&b| b == 0), "{mode}: zeroes before the crash");
        std::mem::forget(vm);
        let mut vm = recover_in(dir.path(), mode).expect("recovered after a crash");
        vm.read(0, &mut back).expect("read");
        assert!(back.iter().all(|&b| b == 0), "{mode}: block 0 reads {} after the crash, not zeroes", back[0]);
    }
}

#[test]
fn state_that_does_not_check_out_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut vm = fresh(dir.path());
    vm.write(0, &[7; 4096]).expect("write");
    vm.keep_state();
    drop(vm);
    std::fs::write(dir.path().join("vm.zeros"), b"not a zero log").expect("overwrite");
    match recover(dir.path()) {
        Err(EngineError::Corrupt(message)) => assert!(message.contains("zero log"), "{message}"),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("recovered from a corrupt zero log"),
    }
    // Refused, not removed: the files (and the written page) stay for a look, until a reset.
    for name in ["vm.spill", "vm.segments", "vm.zeros", "vm.pages", "vm.slots"] {
        assert!(dir.path().join(name).exists(), "{name} went with the failed recovery");
    }
    let (_arena, live) = Arena::open(dir.path(), "vm", 1024).expect("the arena, again");
    assert_eq!(live.len(), 1, "the written page lost its header in the failed recovery");
    assert!(live[0].page.iter().all(|&b| b == 7), "the written page lost its bytes in the failed recovery");
}
