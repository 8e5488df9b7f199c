//! Host memory pressure: when free memory falls below the floor, VMs' targets shrink, overlays
//! spill down to them, and nothing a guest wrote is lost.

use std::sync::Arc;

use overspill_engine::{
    HostMemory, MemImage, Overlay, OverlayConfig, ScratchFile, SegmentWriters, VmStats, WriteCacheMode, SEGMENT_BYTES,
};

const MIB: u64 = 1 << 20;

fn overlay(host: &Arc<HostMemory>, dir: &std::path::Path, name: &str) -> Overlay {
    let golden = Arc::new(MemImage::new(vec![0x11; (64 * MIB) as usize]));
    let spill = ScratchFile::create(dir, name, 0).expect("spill file");
    Overlay::new(
        golden,
        OverlayConfig { mode: WriteCacheMode::RamDisk, ram_target_bytes: 32 * MIB, spill_max_bytes: None },
        Some(Box::new(spill)),
        host.clone(),
        Arc::new(VmStats::default()),
    )
    .expect("overlay")
}

fn block(vm: u8, i: u64) -> Vec<u8> {
    vec![vm ^ (i as u8) ^ 0x5a; 4096]
}

#[test]
fn targets_shrink_below_the_free_floor_and_data_survives() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = HostMemory::new(u64::MAX, 1 << 30);
    let mut vms: Vec<Overlay> = (0..2).map(|i| overlay(&host, dir.path(), &format!("vm{i}"))).collect();
    for (v, vm) in vms.iter_mut().enumerate() {
        for i in 0..(16 * MIB / 4096) {
            vm.write(i * 4096, &block(v as u8, i)).expect("write");
        }
        assert!(vm.memory_used_bytes() >= 16 * MIB, "all in RAM while memory is plentiful");
        assert_eq!(vm.stats().spill_segments_written.get(), 0);
    }
    // Free memory 20 MiB under the 1 GiB floor: the VMs together must give 20 MiB back.
    host.rebalance((1 << 30) - 20 * MIB);
    let cap = host.per_vm_cap_bytes();
    assert!(cap < 16 * MIB, "per-VM cap {cap} shrank below what each VM holds");
    for (v, vm) in vms.iter_mut().enumerate() {
        // The next write spills the VM down to its shrunken target before it lands.
        vm.write(40 * MIB, &block(v as u8, 9999)).expect("write under pressure");
        assert!(vm.memory_used_bytes() <= cap + 2 * MIB + 8192, "within one open segment of the cap");
        // The pages it spilled are free once written: it keeps in memory no more than it
        // accounts for (its open segment counts whole), not the megabytes it gave back.
        let (resident, used) = (vm.memory_resident_bytes(), vm.memory_used_bytes());
        assert!(resident <= used, "vm {v}: {resident} bytes of pages in memory, {used} accounted");
        assert!(vm.stats().spill_segments_written.get() > 0, "it spilled");
        let mut buf = vec![0u8; 4096];
        for i in 0..(16 * MIB / 4096) {
            vm.read(i * 4096, &mut buf).expect("read");
            assert_eq!(buf, block(v as u8, i), "vm {v} block {i}");
        }
    }
    // Pressure gone: the cap lifts again.
    host.rebalance(8 << 30);
    assert!(host.per_vm_cap_bytes() > 32 * MIB);
}

/// A VM streaming 1 MiB writes past its RAM target, its segments written by background
/// writers as in a server: the free pages it keeps stay put while segments fill and are
/// written (the keep once rose and fell by hundreds of pages with the writers' timing, and
/// every fall punched pages the next write faulted back in), and the host counts every page
/// it keeps.
#[test]
fn a_vm_streaming_large_writes_keeps_its_round_of_pages_and_the_host_sees_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = HostMemory::new(u64::MAX, 0);
    let golden = Arc::new(MemImage::new(vec![0x11; (64 * MIB) as usize]));
    let spill = ScratchFile::create(dir.path(), "vm", 0)
        .expect("spill file")
        .with_background_segment_writes(SegmentWriters::new(2), false);
    let mut vm = Overlay::new(
        golden,
        OverlayConfig { mode: WriteCacheMode::RamDisk, ram_target_bytes: 4 * MIB, spill_max_bytes: None },
        Some(Box::new(spill)),
        host.clone(),
        Arc::new(VmStats::default()),
    )
    .expect("overlay");
    let write_pass = |vm: &mut Overlay, pass: u8| {
        for mib in 0..48 {
            let data: Vec<u8> = (0..MIB).map(|i| (i / 4096) as u8 ^ mib as u8 ^ pass).collect();
            vm.write(mib * MIB, &data).expect("write");
        }
    };
    write_pass(&mut vm, 0);
    let punched_warming_up = vm.memory_pages_punched();
    for pass in 1..=4 {
        write_pass(&mut vm, pass);
    }
    let punched = vm.memory_pages_punched() - punched_warming_up;
    // 192 MiB is 49,152 pages; a page punched per write would be 192.
    assert!(punched < 128, "{punched} pages punched while streaming");
    assert!(vm.stats().spill_segments_written.get() >= 96, "it spilled");
    let segment = overspill_engine::SEGMENT_BYTES as u64;
    let (resident, accounted) = (vm.memory_resident_bytes(), vm.memory_accounted_bytes());
    assert!(resident <= accounted + segment, "{resident} bytes in memory, {accounted} accounted");
    assert_eq!(host.used_bytes(), accounted);
    let mut buf = vec![0u8; MIB as usize];
    for mib in 0..48 {
        vm.read(mib * MIB, &mut buf).expect("read");
        assert!(buf.iter().enumerate().all(|(i, &b)| b == (i / 4096) as u8 ^ mib as u8 ^ 4), "MiB {mib}");
    }
}

/// A VM about to wait for its client keeps only a few of the dead segments its spill file holds
/// for its next writes: dead segments beside live spilled data stay allocated while the VM
/// writes, and go back to the filesystem when it stops (`Overlay::give_back_spare_disk`).
#[test]
fn a_vm_about_to_wait_gives_back_its_spare_spill_segments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = HostMemory::unlimited();
    let mut vm = overlay(&host, dir.path(), "waits");
    // 128 KiB writes: below the streaming size, so RAM keeps the newest blocks and spills the
    // coldest.
    let fill = |vm: &mut Overlay, from: u64, to: u64, seed: u8| {
        for piece in from * 8..to * 8 {
            let data: Vec<u8> = (0..32).flat_map(|i| block(seed, piece * 32 + i)).collect();
            vm.write(piece * MIB / 8, &data).expect("write");
        }
    };
    // 20 MiB that stay spilled and live, 20 MiB that die, 24 MiB that push them out of RAM.
    fill(&mut vm, 0, 20, 1);
    fill(&mut vm, 20, 40, 2);
    fill(&mut vm, 40, 64, 3);
    vm.trim(40 * MIB, 24 * MIB).expect("trim");
    let punched_before = vm.stats().spill_segments_punched.get();
    // The 20 MiB written again fit in RAM: their spilled copies die, no segment opens.
    fill(&mut vm, 20, 40, 4);
    let kept_dead = vm.stats().spill_segments_punched.get() == punched_before;
    assert!(kept_dead, "dead segments beside 20 MiB of live spilled data are kept, not punched");
    let before = vm.disk_used_bytes();
    vm.give_back_spare_disk();
    let given = vm.stats().spill_segments_punched.get() - punched_before;
    assert!(given > 0, "nothing given back ({before} bytes used)");
    assert_eq!(before - vm.disk_used_bytes(), given * SEGMENT_BYTES as u64, "each segment given back is one less used");
    assert_eq!(vm.stats().cache_disk_used_bytes.get(), vm.disk_used_bytes());
    vm.give_back_spare_disk();
    assert_eq!(vm.stats().spill_segments_punched.get() - punched_before, given, "only the few are left");
    for (from, seed) in [(0, 1), (20, 4)] {
        let mut back = vec![0; 4096];
        vm.read((from + 5) * MIB, &mut back).expect("read");
        assert_eq!(back, block(seed, (from + 5) * 256), "data at {} MiB", from + 5);
    }
}

/// The host at its cap: a quiet VM holding most of it gives its RAM back when a busy one is held
/// below its own target (as the server's background pass has it do), the busy one then writes
/// to RAM again, and every block of the quiet one reads back.
#[test]
fn a_quiet_vm_gives_ram_to_a_held_one_and_keeps_its_data() {
    use overspill_engine::relief::{plan, VmMemory, SPILLING_MINIMUM_BYTES, STEP_BYTES};
    let dir = tempfile::tempdir().expect("tempdir");
    let host = HostMemory::new(40 * MIB, 0);
    let (mut quiet, mut busy) = (overlay(&host, dir.path(), "quiet"), overlay(&host, dir.path(), "busy"));
    let blocks = 28 * MIB / 4096;
    for i in 0..blocks {
        quiet.write(i * 4096, &block(1, i)).expect("write");
    }
    assert_eq!(quiet.stats().spill_segments_written.get(), 0, "all in RAM: the host had room");
    assert_eq!(host.take_held(), 0, "no one held yet");
    for i in 0..blocks {
        busy.write(i * 4096, &block(2, i)).expect("write");
    }
    assert_eq!(
        host.take_held(),
        overspill_engine::budget::HELD_BY_BUDGET,
        "the busy VM was held below its 32 MiB target by the cap"
    );
    assert!(busy.stats().spill_segments_written.get() > 0, "and spilled");

    let seen = |vm: &Overlay, id, quiet| VmMemory {
        id,
        accounted_bytes: vm.memory_accounted_bytes(),
        target_bytes: vm.memory_target_bytes(),
        own_target_bytes: vm.memory_own_target_bytes(),
        quiet,
        can_spill: vm.can_spill(),
    };
    let given = plan(&[seen(&quiet, 1, true), seen(&busy, 2, false)], true, STEP_BYTES, STEP_BYTES);
    assert_eq!(given.len(), 1, "only the quiet VM gives back: {given:?}");
    assert_eq!(
        (given[0].id, given[0].limit_bytes),
        (1, SPILLING_MINIMUM_BYTES),
        "all it can: it holds less than a step"
    );
    let before = quiet.memory_accounted_bytes();
    let freed = quiet.give_back_memory(given[0].limit_bytes);
    host.note_given_back(freed);
    assert!(freed >= 24 * MIB, "{freed} of {before} bytes given back");
    assert_eq!(host.used_bytes(), quiet.memory_accounted_bytes() + busy.memory_accounted_bytes());
    assert!(quiet.memory_resident_bytes() <= quiet.memory_accounted_bytes(), "its pages left memory too");

    let (used_before, segments_before) = (busy.memory_used_bytes(), busy.stats().spill_segments_written.get());
    for i in 0..(8 * MIB / 4096) {
        busy.write((blocks + i) * 4096, &block(2, blocks + i)).expect("write");
    }
    assert_eq!(busy.stats().spill_segments_written.get(), segments_before, "no more of the busy VM's blocks spilled");
    assert!(busy.memory_used_bytes() >= used_before + 8 * MIB, "its RAM tier grew by what it wrote");
    assert_eq!(host.take_held(), 0, "and it was not held");
    let mut buf = vec![0u8; 4096];
    for i in 0..blocks {
        quiet.read(i * 4096, &mut buf).expect("read");
        assert_eq!(buf, block(1, i), "quiet VM block {i}");
        busy.read(i * 4096, &mut buf).expect("read");
        assert_eq!(buf, block(2, i), "busy VM block {i}");
    }
}
