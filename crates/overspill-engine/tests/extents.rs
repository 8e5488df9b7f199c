//! The overlay's block status: what a VM wrote, zeroed and trimmed, over a golden image whose
//! own extents do not fall on block boundaries (a VHDX sector bitmap reports 512-byte runs),
//! reported in whole 4 KiB blocks: a block part data is data, a block part zero and part hole
//! is zero.

use std::io;
use std::sync::Arc;

use overspill_engine::{
    push_extent, Allocation, Extent, GoldenImage, HostMemory, LayerRun, MemImage, Overlay, OverlayConfig, VmStats,
    WriteCacheMode, DEPTH_GOLDEN, DEPTH_OVERLAY,
};

const SIZE: u64 = 64 << 10;

/// 64 KiB of zeroes whose extents are: hole to 5000, data to 9000, zero to 13000, hole to
/// 20480, data to 20992, hole to the end; asked a range, it answers at most 2 extents at a time
/// (as a reader stopping at a table's end may).
struct Ragged(MemImage);

impl GoldenImage for Ragged {
    fn size(&self) -> u64 {
        SIZE
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn describe(&self) -> String {
        "ragged".into()
    }
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let runs = [
            (5000, Allocation::Hole),
            (9000, Allocation::Data),
            (13000, Allocation::Zero),
            (20480, Allocation::Hole),
            (20992, Allocation::Data),
            (SIZE, Allocation::Hole),
        ];
        let (end, mut at, mut out) = (offset + len, offset, Vec::new());
        for (run_end, state) in runs {
            if at < run_end && at < end && out.len() < 2 {
                let to = run_end.min(end);
                push_extent(&mut out, to - at, state);
                at = to;
            }
        }
        Ok(out)
    }
}

fn overlay() -> Overlay {
    let golden = Arc::new(Ragged(MemImage::new(vec![0; SIZE as usize])));
    let config = OverlayConfig { mode: WriteCacheMode::Ram, ram_target_bytes: 1 << 20, spill_max_bytes: None };
    Overlay::new(golden, config, None, HostMemory::unlimited(), Arc::new(VmStats::default())).expect("overlay")
}

fn states(extents: &[Extent]) -> Vec<(u64, Allocation)> {
    extents.iter().map(|e| (e.len, e.state)).collect()
}

#[test]
fn golden_extents_are_reported_in_whole_blocks_under_the_vms_own() {
    let mut vm = overlay();
    use Allocation::*;
    // Blocks: 0 hole, 1 hole+data (data), 2 data+zero (data), 3 zero+hole (zero), 4 hole,
    // 5 data+hole (data), 6.. hole.
    assert_eq!(
        states(&vm.extents(0, SIZE).expect("extents")),
        [(4096, Hole), (8192, Data), (4096, Zero), (4096, Hole), (4096, Data), (SIZE - 24576, Hole)]
    );
    // An unaligned start and end keep their partial blocks' states.
    assert_eq!(states(&vm.extents(12500, 10000).expect("extents")), [(3884, Zero), (4096, Hole), (2020, Data)]);
    // The VM's own state wins: a write over a hole, zeroes over data, a trim back to golden.
    vm.write(8 * 4096, &[7; 4096]).expect("write");
    vm.write_zeroes(0, 8192).expect("zero");
    vm.trim(5 * 4096, 4096).expect("trim");
    assert_eq!(
        states(&vm.extents(0, SIZE).expect("extents")),
        [
            (8192, Zero),
            (4096, Data),
            (4096, Zero),
            (4096, Hole),
            (4096, Data),
            (8192, Hole),
            (4096, Data),
            (SIZE - 36864, Hole)
        ]
    );
}

fn depths(runs: &[LayerRun]) -> Vec<(u64, u32)> {
    runs.iter().map(|r| (r.len, r.depth)).collect()
}

/// `qemu:allocation-depth`: the VM's own blocks (written or zeroed, in RAM or spilled) are the
/// overlay's, a trimmed block is the golden image's again, and the golden image's holes are
/// no layer's; in whole blocks, as block status.
#[test]
fn each_block_is_reported_by_the_layer_that_holds_it() {
    let mut vm = overlay();
    // Golden blocks: 0 hole, 1-3 data or zero (golden), 4 hole, 5 data, 6.. hole.
    assert_eq!(
        depths(&vm.allocation_depth(0, SIZE).expect("depths")),
        [(4096, 0), (3 * 4096, DEPTH_GOLDEN), (4096, 0), (4096, DEPTH_GOLDEN), (SIZE - 24576, 0)]
    );
    vm.write(8 * 4096, &[7; 4096]).expect("write over a hole");
    vm.write(4096, &[7; 4096]).expect("write over data");
    vm.write_zeroes(3 * 4096, 4096).expect("zeroes over zeroes");
    vm.trim(4096, 4096).expect("trim: golden again");
    assert_eq!(
        depths(&vm.allocation_depth(0, SIZE).expect("depths")),
        [
            (4096, 0),
            (2 * 4096, DEPTH_GOLDEN),
            (4096, DEPTH_OVERLAY),
            (4096, 0),
            (4096, DEPTH_GOLDEN),
            (2 * 4096, 0),
            (4096, DEPTH_OVERLAY),
            (SIZE - 36864, 0)
        ]
    );
    // Part of a range: the first and last runs are cut at its ends.
    assert_eq!(
        depths(&vm.allocation_depth(12500, 10000).expect("depths")),
        [(3884, DEPTH_OVERLAY), (4096, 0), (2020, DEPTH_GOLDEN)]
    );
}
