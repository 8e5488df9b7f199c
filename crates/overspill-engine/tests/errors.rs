//! What a request that fails leaves behind: its own blocks may read as before or as after it,
//! never as the golden image in place of the VM's data; every other block reads what the VM was
//! told; and the overlay goes on serving once the fault has passed, or has moved elsewhere.

use std::sync::Arc;

use overspill_engine::arena::Arena;
use overspill_engine::faults::{Fault, FaultPlan, FaultyFile, Op, Rule, Trigger};
use overspill_engine::store::MemFile;
use overspill_engine::{HostMemory, MemImage, Overlay, OverlayConfig, VmStats, WriteCacheMode, SEGMENT_BYTES};

const BLOCK: u64 = 4096;
const DISK: usize = 64 << 20;
const GOLDEN: u8 = 0x11;

fn overlay(mode: WriteCacheMode, ram_target_bytes: u64, file: FaultyFile) -> Overlay {
    Overlay::new(
        Arc::new(MemImage::new(vec![GOLDEN; DISK])),
        OverlayConfig { mode, ram_target_bytes, spill_max_bytes: None },
        Some(Box::new(file)),
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
    )
    .expect("overlay")
}

/// A VM whose state outlives the process, in RAM alone, over `arena` and `zeros`.
fn persistent_in_ram(
    ram_target_bytes: u64,
    arena: impl FnOnce(&OverlayConfig) -> Arena,
    zeros: Box<dyn overspill_engine::BackingFile>,
) -> Overlay {
    let config = OverlayConfig { mode: WriteCacheMode::Ram, ram_target_bytes, spill_max_bytes: None };
    let arena = arena(&config);
    Overlay::persistent(
        Arc::new(MemImage::new(vec![GOLDEN; DISK])),
        config,
        None,
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
        arena,
        overspill_engine::state::StateFiles { segments: Box::<MemFile>::default(), zeros },
    )
    .expect("overlay")
}

fn block(vm: &mut Overlay, index: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    vm.read(index * BLOCK, &mut buf).expect("read");
    buf
}

/// A zeroing in place punches the blocks it maps run by run: one that fails part way leaves the
/// runs already punched reading zeroes (what was asked), not the golden image.
#[test]
fn an_in_place_zeroing_failing_part_way_never_shows_the_golden_image() {
    for mode in [WriteCacheMode::Disk, WriteCacheMode::Shared] {
        let file =
            FaultyFile::new(Box::<MemFile>::default(), FaultPlan::new(0).on(Op::Punch, Fault::Io, Trigger::Nth(2)));
        let mut vm = overlay(mode, 0, file);
        vm.write(0, &[0xaa; BLOCK as usize]).expect("write block 0");
        vm.write(2 * BLOCK, &[0xbb; BLOCK as usize]).expect("write block 2");
        vm.write_zeroes(0, 3 * BLOCK).expect_err("the second run's punch fails");
        assert!(block(&mut vm, 0).iter().all(|&b| b == 0), "{mode}: block 0 was punched: it reads zeroes");
        assert!(block(&mut vm, 2).iter().all(|&b| b == 0xbb || b == 0), "{mode}: block 2 as before or after");
        assert!(block(&mut vm, 1).iter().all(|&b| b == GOLDEN || b == 0), "{mode}: block 1 as before or after");
        vm.write_zeroes(0, 3 * BLOCK).expect("the fault has passed");
        for index in 0..3 {
            assert!(block(&mut vm, index).iter().all(|&b| b == 0), "{mode}: block {index}");
        }
    }
}

/// A stretch of the spill file that fails every write: the segment there is kept in memory and
/// tried again while any of its blocks live (its data is the VM's), so spilling waits on it;
/// once they have all died its place is given up, and the log goes on elsewhere.
#[test]
fn a_segment_that_cannot_be_written_is_given_up_once_nothing_in_it_lives() {
    let bad_stretch = Rule::new(Op::Write, Fault::Io, Trigger::From(1)).within(0..SEGMENT_BYTES as u64);
    let file = FaultyFile::new(Box::<MemFile>::default(), FaultPlan::new(0).rule(bad_stretch));
    let mut vm = overlay(WriteCacheMode::RamDisk, 0, file);
    let per_segment = SEGMENT_BYTES as u64 / BLOCK;
    for index in 0..per_segment {
        vm.write(index * BLOCK, &[index as u8 | 1; BLOCK as usize]).expect("into the open segment");
    }
    // The next block seals the first segment, whose write fails, and is refused with it.
    vm.write(per_segment * BLOCK, &[0xcc; BLOCK as usize]).expect_err("the segment cannot be written");
    vm.write(per_segment * BLOCK, &[0xcc; BLOCK as usize]).expect_err("nor on a second try");
    assert!(block(&mut vm, 7).iter().all(|&b| b == 7), "its blocks read from memory meanwhile");
    vm.trim(0, per_segment * BLOCK).expect("trim them all");
    for index in 0..2 * per_segment {
        vm.write(index * BLOCK, &[0xdd; BLOCK as usize]).expect("the log goes on past the bad stretch");
    }
    assert!(block(&mut vm, 3).iter().all(|&b| b == 0xdd) && block(&mut vm, per_segment + 3).iter().all(|&b| b == 0xdd));
    assert!(vm.stats().spill_segments_written.get() >= 1, "segments were written elsewhere");
}

/// A persistent overlay's zeroing is logged before it takes effect: an append that fails fails
/// the zeroing with nothing changed (the old data reads back), and the next zeroing works.
#[test]
fn a_zero_log_append_that_fails_fails_its_zeroing_and_changes_nothing() {
    // Write 1 is the log's header; an append is two: the end marker behind, then the record.
    let zeros = FaultyFile::new(Box::<MemFile>::default(), FaultPlan::new(0).on(Op::Write, Fault::Io, Trigger::Nth(3)));
    let arena = |config: &OverlayConfig| Arena::in_memory(Overlay::arena_pages(config)).expect("arena");
    let mut vm = persistent_in_ram(8 << 20, arena, Box::new(zeros));
    vm.write(0, &[0xaa; 2 * BLOCK as usize]).expect("write");
    vm.write_zeroes(0, BLOCK).expect_err("its record could not be logged");
    assert!(block(&mut vm, 0).iter().all(|&b| b == 0xaa), "the zeroing took no effect");
    vm.write_zeroes(BLOCK, BLOCK).expect("the next zeroing is logged");
    assert!(block(&mut vm, 0).iter().all(|&b| b == 0xaa) && block(&mut vm, 1).iter().all(|&b| b == 0));
}

/// A zeros file that counts the writes of its header (offset 0): one per rewrite of the log.
struct CountingHeaders(MemFile, Arc<std::sync::atomic::AtomicUsize>);

impl overspill_engine::BackingFile for CountingHeaders {
    fn write_at(&mut self, data: &[u8], offset: u64) -> std::io::Result<()> {
        if offset == 0 {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.0.write_at(data, offset)
    }
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn punch_hole(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        self.0.punch_hole(offset, len)
    }
    fn allocated_bytes(&self) -> std::io::Result<u64> {
        self.0.allocated_bytes()
    }
    fn path(&self) -> Option<&std::path::Path> {
        None
    }
}

/// A zero log whose rewrite comes out long (many written blocks cut its zeroed range into
/// pieces) is not rewritten again at every zeroing after it: only once it has grown well past
/// what the rewrite left (each rewrite walks the VM's whole map under its lock).
#[test]
fn a_zero_log_rewritten_long_is_not_rewritten_at_every_zeroing() {
    let headers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let zeros = CountingHeaders(MemFile::default(), headers.clone());
    let arena = |config: &OverlayConfig| Arena::in_memory(Overlay::arena_pages(config)).expect("arena");
    let mut vm = persistent_in_ram(16 << 20, arena, Box::new(zeros));
    vm.write_zeroes(0, 4096 * BLOCK).expect("zero a range");
    for index in 0..600 {
        vm.write(2 * index * BLOCK, &[0xaa; BLOCK as usize]).expect("write");
    }
    let zero_one = |vm: &mut Overlay, i: u64| vm.write_zeroes((2 * i + 1) * BLOCK, BLOCK).expect("zero one block");
    let mut i = 0;
    let before = headers.load(std::sync::atomic::Ordering::SeqCst);
    while headers.load(std::sync::atomic::Ordering::SeqCst) == before {
        zero_one(&mut vm, i);
        i += 1;
        assert!(i < 2000, "the log was never rewritten");
    }
    let after_first = headers.load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..100 {
        zero_one(&mut vm, i);
        i += 1;
    }
    let rewrites = headers.load(std::sync::atomic::Ordering::SeqCst) - after_first;
    assert!(rewrites <= 1, "{rewrites} rewrites in 100 zeroings after the first");
    for index in [0, 2, 598 * 2] {
        assert!(block(&mut vm, index).iter().all(|&b| b == 0xaa), "block {index}");
    }
    assert!(block(&mut vm, 1).iter().all(|&b| b == 0));
}

/// A write that needs more pages than the arena has left is refused before anything is
/// received or changed, and the overlay goes on.
#[test]
fn a_write_the_arena_has_no_pages_for_changes_nothing() {
    // Room for 256 pages, whatever the target says.
    let arena = |_: &OverlayConfig| Arena::in_memory(256).expect("arena");
    let mut vm = persistent_in_ram(64 << 20, arena, Box::<MemFile>::default());
    vm.write(0, &[0xaa; BLOCK as usize]).expect("a small write");
    let mut received = false;
    let len = 2 << 20;
    let result = vm.write_received(0, len, |buffers| {
        received = true;
        for buffer in buffers.iter_mut() {
            buffer.fill(0xbb);
        }
        Ok(())
    });
    result.expect_err("512 pages wanted, fewer left");
    assert!(!received, "refused before the payload was taken");
    assert!(block(&mut vm, 0).iter().all(|&b| b == 0xaa) && block(&mut vm, 1).iter().all(|&b| b == GOLDEN));
    vm.write(BLOCK, &[0xcc; BLOCK as usize]).expect("a small write after");
    assert!(block(&mut vm, 1).iter().all(|&b| b == 0xcc));
}
