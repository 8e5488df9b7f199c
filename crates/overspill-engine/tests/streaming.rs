//! Large writes while RAM is full go straight to the spill log: the VM's hot blocks stay in RAM,
//! and the large write's data reads back from the spill log.

use std::sync::Arc;

use overspill_engine::faults::{Fault, FaultPlan, FaultyFile, Op, Trigger};
use overspill_engine::store::MemFile;
use overspill_engine::{
    EngineError, HostMemory, MemImage, Overlay, OverlayConfig, ScratchFile, VmStats, WriteCacheMode, SEGMENT_BYTES,
};

mod common;
use common::receive_into;

const MIB: u64 = 1 << 20;
const HOT_BLOCKS: u64 = 256;

/// An overlay that already spills, with a hot 1 MiB set in its 2 MiB of RAM, then 8 MiB
/// elsewhere in writes of `chunk` bytes. Returns the overlay and how many hot blocks still read
/// from RAM.
fn hot_set_then_writes_of(chunk: usize, dir: &std::path::Path) -> (Overlay, u64) {
    let golden = Arc::new(MemImage::new(vec![0x11; (64 * MIB) as usize]));
    let spill = ScratchFile::create(dir, &format!("spill-{chunk}"), 0).expect("spill file");
    // 2 MiB of RAM tier, the open segment's buffer and room for the index.
    let target = 2 * MIB + 2 * MIB + 128 * 1024;
    let mut vm = Overlay::new(
        golden,
        OverlayConfig { mode: WriteCacheMode::RamDisk, ram_target_bytes: target, spill_max_bytes: None },
        Some(Box::new(spill)),
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
    )
    .expect("overlay");
    // Already spilling, so that the segment buffer counts before the hot set arrives.
    for i in 0..(8 * MIB / 4096) {
        vm.write(16 * MIB + i * 4096, &[0x77; 4096]).expect("warm-up write");
    }
    assert!(vm.stats().spill_segments_written.get() > 0, "the warm-up spills");
    for i in 0..HOT_BLOCKS {
        vm.write(i * 4096, &[i as u8; 4096]).expect("hot write");
    }
    let large: Vec<u8> = (0..8 * MIB).map(|i| (i / 4096) as u8 ^ 0xa5).collect();
    for (n, piece) in large.chunks(chunk).enumerate() {
        vm.write(32 * MIB + (n * chunk) as u64, piece).expect("large write");
    }
    let before = vm.stats().read_blocks_ram.get();
    let mut buf = vec![0u8; (HOT_BLOCKS * 4096) as usize];
    vm.read(0, &mut buf).expect("hot read");
    let in_ram = vm.stats().read_blocks_ram.get() - before;
    for (i, block) in buf.chunks(4096).enumerate() {
        assert!(block.iter().all(|&b| b == i as u8), "hot block {i} reads back");
    }
    let mut back = vec![0u8; large.len()];
    vm.read(32 * MIB, &mut back).expect("large read");
    assert!(back == large, "the large write reads back");
    (vm, in_ram)
}

#[test]
fn large_writes_bypass_a_full_ram_tier_and_keep_the_hot_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (streamed, hot_in_ram) = hot_set_then_writes_of(1 << 20, dir.path());
    assert_eq!(hot_in_ram, HOT_BLOCKS, "every hot block still in RAM after 8 MiB of 1 MiB writes");
    assert!(streamed.stats().spill_segments_written.get() >= 3, "the large writes went to the spill log");

    // The same 8 MiB in 4 KiB writes is hot data as far as the overlay can tell: it pushes the
    // older blocks out.
    let (_, hot_in_ram) = hot_set_then_writes_of(4096, dir.path());
    assert!(hot_in_ram < HOT_BLOCKS / 2, "4 KiB writes evicted the hot set ({hot_in_ram} blocks left in RAM)");
}

/// What was written in one go lies in order in the spill log, so reading it back is a few large
/// reads of the spill file (one per run of neighbours in a segment), not one per 4 KiB block;
/// reads that start or end inside a block get the same bytes.
#[test]
fn spilled_neighbours_read_back_in_one_read_per_segment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut vm, _) = hot_set_then_writes_of(1 << 20, dir.path());
    let expected: Vec<u8> = (0..8 * MIB).map(|i| (i / 4096) as u8 ^ 0xa5).collect();
    let reads = |vm: &Overlay| vm.stats().spill_read.ops.get();
    let before = reads(&vm);
    let mut back = vec![0u8; expected.len()];
    vm.read(32 * MIB, &mut back).expect("read");
    assert!(back == expected, "the spilled data reads back");
    let taken = reads(&vm) - before;
    // One read per run of neighbours in a segment: 8 MiB spans 4-5 segments, and a segment may
    // hold other blocks between runs (7 here); one read per block was 2,048.
    assert!((1..=8).contains(&taken), "8 MiB of spilled neighbours took {taken} spill reads");
    let before = reads(&vm);
    let mut part = vec![0u8; (MIB + 100) as usize];
    vm.read(32 * MIB + 4000, &mut part).expect("unaligned read");
    assert!(part[..] == expected[4000..4000 + part.len()], "an unaligned read gets the same bytes");
    assert!(reads(&vm) - before <= 3, "took {} spill reads", reads(&vm) - before);
}

/// A large write that lands where RAM already holds its blocks needs no spill space: with RAM
/// and the spill log full, it is written over the blocks in RAM, and reads back, as a small one
/// is.
#[test]
fn a_large_rewrite_of_blocks_in_ram_needs_no_room_in_a_full_spill_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let golden = Arc::new(MemImage::new(vec![0x11; (64 * MIB) as usize]));
    let spill = ScratchFile::create(dir.path(), "spill", 0).expect("spill file");
    let target = 2 * MIB + 2 * MIB + 128 * 1024;
    let config =
        OverlayConfig { mode: WriteCacheMode::RamDisk, ram_target_bytes: target, spill_max_bytes: Some(16 * MIB) };
    let mut vm =
        Overlay::new(golden, config, Some(Box::new(spill)), HostMemory::unlimited(), Arc::new(VmStats::default()))
            .expect("overlay");
    for i in 0..(4 * MIB / 4096) {
        vm.write(16 * MIB + i * 4096, &[0x77; 4096]).expect("warm-up write");
    }
    for i in 0..HOT_BLOCKS {
        vm.write(i * 4096, &[i as u8; 4096]).expect("hot write");
    }
    // Large writes elsewhere fill the log (they bypass the full RAM tier) until it refuses one.
    let filler = vec![0x5a; MIB as usize];
    let full = (0..48u64)
        .find_map(|n| vm.write_received(32 * MIB + n * MIB, filler.len(), |b| receive_into(b, &filler, None)).err());
    assert!(matches!(full, Some(EngineError::NoSpace(_))), "the spill log fills up: {full:?}");

    // Small writes of new blocks fill what RAM has left, until one would need the log too.
    let refused = (0..1024u64).find_map(|i| vm.write(48 * MIB + i * 4096, &[0x99; 4096]).err());
    assert!(matches!(refused, Some(EngineError::NoSpace(_))), "RAM fills up: {refused:?}");
    let rewrite: Vec<u8> = (0..HOT_BLOCKS * 4096).map(|i| (i / 4096) as u8 ^ 0x3c).collect();
    vm.write_received(0, rewrite.len(), |b| receive_into(b, &rewrite, None)).expect("the rewrite of blocks in RAM");
    let mut back = vec![0u8; rewrite.len()];
    vm.read(0, &mut back).expect("read");
    assert!(back == rewrite, "the rewrite reads back");
}

/// Bytes that differ from block to block and from one `seed` to another: a block's bytes found
/// in another block, or an old copy of a block, do not pass for the expected ones.
fn pattern(seed: u64, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len)
        .map(|x| ((x / 8 + (seed << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (x % 8 * 8)) as u8)
        .collect()
}

/// A large write while RAM is full goes to the spill log without looking its blocks up; if the
/// log refuses it midway (a segment write failed), the rest is looked up and placed block by
/// block, and some of its blocks are found in RAM. Its partial head block, placed first, pushes
/// the coldest RAM block, one of the write's own, out to the log (the failed segment write is
/// tried again and works) and takes that block's page. The evicted block must be written where
/// it is now, not into the page it was found in: that was acknowledged with the head block
/// reading the other block's bytes, and that block its old ones.
#[test]
fn a_large_write_that_evicts_its_own_block_from_ram_lands_every_block_where_it_belongs() {
    const BLOCK: u64 = 4096;
    let segment_blocks = SEGMENT_BYTES as u64 / BLOCK;
    let golden = pattern(0, 0, 16 * MIB);
    let plan = FaultPlan::new(0).on(Op::Write, Fault::Io, Trigger::Nth(1));
    let spill = FaultyFile::new(Box::<MemFile>::default(), plan);
    let faults = spill.handle();
    faults.disarm();
    // Under 200 blocks of RAM tier beside the open segment and the index.
    let target = SEGMENT_BYTES as u64 + 768 * 1024;
    let config = OverlayConfig { mode: WriteCacheMode::RamDisk, ram_target_bytes: target, spill_max_bytes: None };
    let golden_image = Arc::new(MemImage::new(golden.clone()));
    let stats = Arc::new(VmStats::default());
    let mut vm =
        Overlay::new(golden_image, config, Some(Box::new(spill)), HostMemory::unlimited(), stats).expect("overlay");
    // 4 KiB writes of new blocks from `first_hot` on, until the VM spills and its RAM is full:
    // the last write pushed a block out (RAM did not grow by its page), and the VM is within its
    // target (the next write spills nothing before it starts). RAM holds only these blocks.
    let first_hot = 1024;
    let mut hot = 0;
    loop {
        let before = vm.memory_used_bytes();
        let offset = (first_hot + hot) * BLOCK;
        vm.write(offset, &pattern(1, offset, BLOCK)).expect("small write");
        hot += 1;
        let used = vm.memory_used_bytes();
        let full = before <= target && used <= target && used < before + BLOCK;
        if hot >= 2 * segment_blocks && vm.stats().spill_segments_written.get() > 0 && full {
            break;
        }
        assert!(hot < 4 * segment_blocks, "RAM never settled full within the target ({used} bytes used)");
    }
    // From inside the block before a segment's worth of new blocks, which fill the open segment
    // whatever room it has (the failed write seals it), through the hot blocks, to inside the
    // block after them.
    let start = (first_hot - segment_blocks - 1) * BLOCK + 1000;
    let end = (first_hot + hot) * BLOCK + 3000;
    let data = pattern(2, start, end - start);
    faults.arm();
    vm.write_received(start, data.len(), |b| receive_into(b, &data, None))
        .expect("the failed segment write is tried again and works: the write is acknowledged");
    assert_eq!(faults.injected().io, 1, "the segment write failed once");

    // The write, and a block either side of it, read back.
    let (from, to) = (start / BLOCK * BLOCK - BLOCK, end.div_ceil(BLOCK) * BLOCK + BLOCK);
    let mut expected = golden[from as usize..to as usize].to_vec();
    expected[(start - from) as usize..(end - from) as usize].copy_from_slice(&data);
    let mut back = vec![0u8; (to - from) as usize];
    vm.read(from, &mut back).expect("read");
    if let Some(i) = back.iter().zip(&expected).position(|(a, b)| a != b) {
        let at = from + i as u64;
        panic!("byte {at} (block {}) reads wrong; the write covers {start}..{end}", at / BLOCK);
    }
}
