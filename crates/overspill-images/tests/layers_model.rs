//! An exact model through checkpoints, captures and forks: VMs' overlays (spilling ones) over
//! qcow2 layers written from other VMs' overlays ([`write_overlay`]), over a raw golden image,
//! each VM diverging on its own. Every VM is a plain in-memory disk in the model, with the disk
//! its layer reads (what a TRIM of whole blocks reads again). A checkpoint forks the VM: new VMs
//! start from it while it goes on; a capture ends the VM's overlay and boots it again over its
//! own layer. After every operation a few ranges of every VM are read; at each seed's end every
//! VM is read whole, every layer is read whole through this crate's reader against what its VM
//! held when it was written, and `qemu-img compare` checks the deepest one.
//!
//! `LAYER_SEEDS=1,2 LAYER_OPS=600 cargo test --release -p overspill-images --test layers_model`
//! replays seeds; a failure names its seed and operation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use overspill_engine::{
    BackingFile, GoldenImage, HostMemory, Overlay, OverlayConfig, ScratchFile, VmStats, WriteCacheMode,
};
use overspill_images::qcow2_layer::write_overlay;
use overspill_images::{open_image, Format};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Not a multiple of 4 KiB: the last block is partial, as a disk of 512-byte sectors may be.
const DISK: u64 = (8 << 20) + 512;
const BLOCK: u64 = 4096;
/// VMs at once: a fork beyond it replaces a VM.
const MAX_VMS: usize = 6;

struct Vm {
    name: String,
    overlay: Overlay,
    /// What the guest reads.
    bytes: Vec<u8>,
    /// What the layer it runs over reads.
    below: Vec<u8>,
    /// That layer's file (the golden image for the first VM) and its depth.
    file: PathBuf,
    depth: usize,
    /// Per block: which layer of that image holds it (`qemu:allocation-depth` less one).
    below_layers: Vec<u32>,
    /// Per block: whether the VM's own overlay holds it (written or zeroed, not trimmed since).
    own: Vec<bool>,
    _spill: tempfile::TempDir,
}

impl Vm {
    /// Per block, the layer that holds it as the VM sees its disk: 1 its own overlay, 2 the
    /// image it runs over, and so on; 0 none.
    fn layers(&self) -> Vec<u32> {
        self.own
            .iter()
            .zip(&self.below_layers)
            .map(|(&own, &below)| {
                if own {
                    1
                } else if below == 0 {
                    0
                } else {
                    below + 1
                }
            })
            .collect()
    }
}

struct Layer {
    file: PathBuf,
    bytes: Vec<u8>,
    depth: usize,
    layers: Vec<u32>,
}

struct World {
    seed: u64,
    dir: PathBuf,
    vms: Vec<Vm>,
    layers: Vec<Layer>,
    next_name: usize,
}

fn overlay_over(image: Arc<dyn GoldenImage>, ram_target_bytes: u64) -> (Overlay, tempfile::TempDir) {
    let spill = tempfile::tempdir().expect("tempdir");
    let file = ScratchFile::create(spill.path(), "spill", 0).expect("scratch");
    let overlay = Overlay::new(
        image,
        OverlayConfig { mode: WriteCacheMode::RamDisk, ram_target_bytes, spill_max_bytes: None },
        Some(Box::new(file) as Box<dyn BackingFile>),
        HostMemory::unlimited(),
        Arc::new(VmStats::default()),
    )
    .expect("overlay");
    (overlay, spill)
}

fn pattern(offset: u64, len: u64, seed: u8) -> Vec<u8> {
    (offset..offset + len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) | 1).collect()
}

impl World {
    fn new(seed: u64, dir: &Path) -> Self {
        let golden: Vec<u8> = (0..DISK).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let file = dir.join("golden.raw");
        std::fs::write(&file, &golden).expect("golden");
        let mut world = Self { seed, dir: dir.to_owned(), vms: Vec::new(), layers: Vec::new(), next_name: 0 };
        // A raw file of data throughout: one layer that holds every block.
        world.boot(&file, golden, 0, vec![1; DISK.div_ceil(BLOCK) as usize], None);
        world
    }

    /// A VM with a new overlay over layer `file` (reading `bytes`), in place of VM `replacing`.
    fn boot(&mut self, file: &Path, bytes: Vec<u8>, depth: usize, layers: Vec<u32>, replacing: Option<usize>) {
        let image = open_image(file).unwrap_or_else(|e| panic!("seed {}: opening {}: {e}", self.seed, file.display()));
        assert_eq!(image.size(), DISK, "seed {}: {} is the disk's size", self.seed, file.display());
        // RAM targets from none to all of it: some VMs spill, some do not.
        let ram = [0, 64 << 10, 16 << 20][self.next_name % 3];
        let (overlay, spill) = overlay_over(image, ram);
        let vm = Vm {
            name: format!("vm{}", self.next_name),
            overlay,
            below: bytes.clone(),
            bytes,
            file: file.to_owned(),
            depth,
            own: vec![false; layers.len()],
            below_layers: layers,
            _spill: spill,
        };
        self.next_name += 1;
        match replacing {
            Some(index) => self.vms[index] = vm,
            None => self.vms.push(vm),
        }
    }

    /// Writes VM `index`'s changes as a layer over the one it runs over: the new layer's file.
    fn write_layer(&mut self, index: usize) -> PathBuf {
        let file = self.dir.join(format!("layer-{}.qcow2", self.layers.len()));
        let vm = &mut self.vms[index];
        let backing = vm.file.file_name().and_then(|n| n.to_str()).expect("a file name").to_owned();
        let format = Format::probe(&vm.file).expect("probe");
        write_overlay(&mut vm.overlay, &file, &backing, format)
            .unwrap_or_else(|e| panic!("seed {}: writing {}'s layer: {e}", self.seed, vm.name));
        self.layers.push(Layer {
            file: file.clone(),
            bytes: vm.bytes.clone(),
            depth: vm.depth + 1,
            layers: vm.layers(),
        });
        file
    }

    fn step(&mut self, rng: &mut SmallRng, op: usize) {
        let index = rng.gen_range(0..self.vms.len());
        let deep = self.vms[index].depth >= overspill_images::qcow2::MAX_CHAIN_DEPTH - 2;
        let offset = rng.gen_range(0..DISK / 512) * 512;
        let len = rng.gen_range(1..=(DISK - offset).min(384 << 10) / 512) * 512;
        let vm = &mut self.vms[index];
        let range = offset as usize..(offset + len) as usize;
        let what = match rng.gen_range(0..100) {
            0..=54 => {
                let data = pattern(offset, len, rng.gen());
                vm.overlay.write(offset, &data).expect("write");
                vm.bytes[range].copy_from_slice(&data);
                vm.own[(offset / BLOCK) as usize..(offset + len).div_ceil(BLOCK) as usize].fill(true);
                "write"
            }
            55..=69 => {
                vm.overlay.write_zeroes(offset, len).expect("zeroes");
                vm.bytes[range].fill(0);
                vm.own[(offset / BLOCK) as usize..(offset + len).div_ceil(BLOCK) as usize].fill(true);
                "zero"
            }
            70..=86 => {
                vm.overlay.trim(offset, len).expect("trim");
                // Whole blocks read the layer below again; partial ones keep what they held.
                let (first, end) = (offset.div_ceil(BLOCK) * BLOCK, ((offset + len) / BLOCK * BLOCK).min(DISK));
                if first < end {
                    let whole = first as usize..end as usize;
                    vm.bytes[whole.clone()].copy_from_slice(&vm.below[whole]);
                    vm.own[(first / BLOCK) as usize..(end / BLOCK) as usize].fill(false);
                }
                "trim"
            }
            87..=94 if !deep => {
                // A checkpoint, and forks of it; the VM goes on.
                let file = self.write_layer(index);
                let (bytes, depth) = (self.vms[index].bytes.clone(), self.vms[index].depth + 1);
                let layers = self.vms[index].layers();
                for _ in 0..rng.gen_range(1..=2) {
                    let replacing = (self.vms.len() >= MAX_VMS).then(|| rng.gen_range(0..self.vms.len()));
                    // The source is not replaced by its own fork.
                    let replacing = replacing.filter(|&r| r != index);
                    if self.vms.len() >= MAX_VMS && replacing.is_none() {
                        continue;
                    }
                    self.boot(&file, bytes.clone(), depth, layers.clone(), replacing);
                }
                "checkpoint and fork"
            }
            95..=99 if !deep => {
                // A capture: the VM's overlay ends, and it boots again over its own layer.
                let file = self.write_layer(index);
                let (bytes, depth) = (self.vms[index].bytes.clone(), self.vms[index].depth + 1);
                let layers = self.vms[index].layers();
                self.boot(&file, bytes, depth, layers, Some(index));
                "capture"
            }
            _ => "nothing",
        };
        for vm in &mut self.vms {
            for _ in 0..2 {
                let offset = rng.gen_range(0..DISK / 512) * 512;
                let len = rng.gen_range(1..=(DISK - offset).min(64 << 10) / 512) * 512;
                check(vm, offset, len, &format!("seed {} op {op} ({what} on vm {index})", self.seed));
            }
        }
    }

    fn check_all(&mut self) {
        let seed = self.seed;
        for vm in &mut self.vms {
            check(vm, 0, DISK, &format!("seed {seed} at the end"));
            // qemu:allocation-depth as the server answers it: each block's layer.
            let mut seen = Vec::new();
            for run in vm.overlay.allocation_depth(0, DISK).expect("allocation depth") {
                seen.extend(std::iter::repeat_n(run.depth, run.len.div_ceil(BLOCK) as usize));
            }
            let expected = vm.layers();
            if let Some(block) = (0..expected.len()).find(|&b| seen.get(b) != Some(&expected[b])) {
                panic!(
                    "seed {seed}: {} (over {}) block {block} is held by layer {:?}, the model says {}",
                    vm.name,
                    vm.file.display(),
                    seen.get(block),
                    expected[block]
                );
            }
        }
        for layer in &self.layers {
            let image = open_image(&layer.file).expect("a layer opens");
            let mut read = vec![0u8; DISK as usize];
            image.read_at(&mut read, 0).expect("read the layer");
            assert!(read == layer.bytes, "seed {seed}: {} reads other than its VM did", layer.file.display());
            let mut layers = Vec::new();
            while (layers.len() as u64) * BLOCK < DISK {
                let at = layers.len() as u64 * BLOCK;
                for run in image.layer_runs(at, DISK - at).expect("layer runs") {
                    layers.extend(std::iter::repeat_n(run.depth, run.len.div_ceil(BLOCK) as usize));
                }
            }
            assert!(layers == layer.layers, "seed {seed}: {}'s layers are not its VM's", layer.file.display());
        }
        if let Some(deepest) = self.layers.iter().max_by_key(|layer| layer.depth) {
            let expected = self.dir.join("expected.raw");
            std::fs::write(&expected, &deepest.bytes).expect("expected");
            let compare = std::process::Command::new("qemu-img")
                .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
                .arg(&deepest.file)
                .arg(&expected)
                .output()
                .expect("qemu-img compare (apt-get install qemu-utils)");
            assert!(
                compare.status.success(),
                "seed {seed}: qemu-img finds {} (depth {}) other than its VM: {}",
                deepest.file.display(),
                deepest.depth,
                String::from_utf8_lossy(&compare.stdout)
            );
        }
    }
}

fn check(vm: &mut Vm, offset: u64, len: u64, when: &str) {
    let mut buf = vec![0u8; len as usize];
    vm.overlay.read(offset, &mut buf).unwrap_or_else(|e| panic!("{when}: {} reads: {e}", vm.name));
    if let Some(at) = buf.iter().zip(&vm.bytes[offset as usize..(offset + len) as usize]).position(|(a, b)| a != b) {
        panic!(
            "{when}: {} (over {}) byte {} reads {:#x}, the model has {:#x}",
            vm.name,
            vm.file.display(),
            offset + at as u64,
            buf[at],
            vm.bytes[offset as usize + at]
        );
    }
}

fn seeds_and_ops() -> (Vec<u64>, usize) {
    let seeds = std::env::var("LAYER_SEEDS")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| (1..=24).collect());
    let ops = std::env::var("LAYER_OPS").ok().and_then(|n| n.parse().ok()).unwrap_or(250);
    (seeds, ops)
}

#[test]
fn checkpoints_captures_and_forks_read_as_the_model_over_many_seeds() {
    let (seeds, ops) = seeds_and_ops();
    let (mut layers, mut deepest, mut spilled) = (0, 0, 0u64);
    for seed in seeds {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut world = World::new(seed, dir.path());
        for op in 0..ops {
            world.step(&mut rng, op);
        }
        world.check_all();
        layers += world.layers.len();
        deepest = deepest.max(world.layers.iter().map(|layer| layer.depth).max().unwrap_or(0));
        spilled += world.vms.iter().map(|vm| vm.overlay.stats().spill_segments_written.get()).sum::<u64>();
    }
    eprintln!("{layers} layers written, the deepest {deepest} layers over the golden image; {spilled} spill segments written by the VMs at the ends");
    assert!(layers > 0 && deepest > 1, "no layer over a layer was written: the test tested little");
}
