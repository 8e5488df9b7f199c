//! The VHDX reader against files made and written by qemu's own tools (fixed and dynamic disks,
//! compared byte for byte with `qemu-img convert`'s raw output), and against differencing disks
//! that the builder in `common/vhdx_builder.rs` writes on qemu-made parents (qemu cannot make
//! them), compared with contents computed here from what each layer holds.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::vhdx_builder::{self as vb, Block, Spec, MIB};
use common::{assert_extents_agree, assert_reads_match, run, s};
use overspill_engine::{Allocation, EngineError, Extent, GoldenImage};
use overspill_images::vhdx::VhdxImage;
use overspill_images::{open_image, Format};

/// A raw disk of 41,000 KiB (not a whole number of VHDX blocks) with data, zeroes written, and
/// never-written holes.
fn make_raw(dir: &Path) -> PathBuf {
    let raw = dir.join("source.raw");
    run("qemu-img", &["create", "-q", "-f", "raw", s(&raw), "41000k"]);
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x11 0 100k",
            "-c",
            "write -P 0x22 1000k 3000k",
            "-c",
            "write -z 5m 1m",
            "-c",
            "write -P 0x33 20m 4k",
            "-c",
            "write -P 0x44 9m 1536k",
            "-c",
            "write -P 0x55 39m 1000k",
            s(&raw),
        ],
    );
    raw
}

fn to_raw(dir: &Path, image: &Path, format: &str) -> Vec<u8> {
    let raw = dir.join("expected.raw");
    run("qemu-img", &["convert", "-f", format, "-O", "raw", s(image), s(&raw)]);
    std::fs::read(&raw).expect("raw image")
}

#[test]
fn reads_fixed_and_dynamic_disks_qemu_img_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let raw = make_raw(d);
    let expected = std::fs::read(&raw).expect("raw");
    for options in [
        "subformat=dynamic",
        "subformat=fixed",
        "subformat=dynamic,block_size=1M",
        "subformat=dynamic,block_size=32M,log_size=2M",
        "subformat=fixed,block_size=2M",
        "subformat=fixed,block_state_zero=off",
    ] {
        let vhdx = d.join(format!("{}.vhdx", options.replace([',', '='], "_")));
        run("qemu-img", &["convert", "-f", "raw", "-O", "vhdx", "-o", options, s(&raw), s(&vhdx)]);
        assert_eq!(Format::probe(&vhdx).expect("probe"), Format::Vhdx, "{options}");
        let image = open_image(&vhdx).expect("VHDX opens");
        assert_eq!(image.describe(), format!("{} (vhdx)", vhdx.display()));
        assert!(image.identity().is_some_and(|id| id.contains("inode")), "{options}");
        assert_reads_match(image.as_ref(), &expected);
        let [data, zero, hole] = assert_extents_agree(image.as_ref(), &expected);
        assert!(data >= 6 * MIB, "{options}: the data is data ({data} bytes)");
        eprintln!("{options}: data {data}, zero {zero}, hole {hole}");
        if !options.contains("fixed") && !options.contains("32M") {
            assert!(zero + hole >= 8 * MIB, "{options}: unwritten blocks are not data ({zero} + {hole})");
        }
    }
}

#[test]
fn reads_what_qemu_io_wrote_into_a_dynamic_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let vhdx = d.join("written.vhdx");
    run("qemu-img", &["create", "-q", "-f", "vhdx", "-o", "block_size=1M", s(&vhdx), "24M"]);
    run(
        "qemu-io",
        &[
            "-f",
            "vhdx",
            "-c",
            "write -P 0x55 1000k 300k",
            "-c",
            "write -P 0x66 7m 512",
            "-c",
            "write -P 0x77 12m 3m",
            "-c",
            "write -z 13m 512k",
            "-c",
            "write -P 0x88 24575k 1k",
            s(&vhdx),
        ],
    );
    let expected = to_raw(d, &vhdx, "vhdx");
    assert!(expected[1000 * 1024..1300 * 1024].iter().all(|&b| b == 0x55));
    let image = VhdxImage::open(&vhdx).expect("opens");
    assert_eq!((image.logical_sector_size(), image.depth()), (512, 1));
    assert_reads_match(&image, &expected);
    assert_extents_agree(&image, &expected);

    // The file cut short under the reader: the read says the image changed, not that its
    // block lies past the end of a corrupt file.
    std::fs::OpenOptions::new().write(true).open(&vhdx).and_then(|f| f.set_len(2 * MIB)).expect("truncate");
    let err = image.read_at(&mut vec![0u8; 4096], 12 * MIB).expect_err("a read past the new end");
    assert!(err.to_string().contains("changed while served"), "{err}");
}

/// What a chain of builder layers over a raw base reads as, sector by sector: the top-most layer
/// that holds a sector gives it. Independent of the reader on purpose.
fn model(layers: &[&Spec], base: &[u8], offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for (i, byte) in out.iter_mut().enumerate() {
        let pos = offset + i as u64;
        *byte = 'found: {
            for layer in layers {
                if pos >= layer.virtual_size {
                    break 'found 0;
                }
                let block_size = u64::from(layer.block_size);
                let (index, within) = ((pos / block_size) as usize, (pos % block_size) as usize);
                let from = |data: &Vec<u8>| data.get(within).copied().unwrap_or(0);
                match layer.blocks.get(index).unwrap_or(&Block::NotPresent) {
                    Block::Full(data) => break 'found from(data),
                    Block::Partial { data, present } => {
                        if present.get(within / layer.logical_sector as usize).copied().unwrap_or(false) {
                            break 'found from(data);
                        }
                    }
                    Block::NotPresent if layer.parent.is_some() => {}
                    _ => break 'found 0,
                }
            }
            base.get(pos as usize).copied().unwrap_or(0)
        };
    }
    out
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

/// Sector flags: `runs` of (first sector, count) set.
fn sectors(runs: &[(usize, usize)]) -> Vec<bool> {
    let mut flags = Vec::new();
    for &(first, count) in runs {
        if flags.len() < first + count {
            flags.resize(first + count, false);
        }
        flags[first..first + count].fill(true);
    }
    flags
}

/// base.vhdx (qemu-img, 8 MiB blocks) ← v1/v1.vhdx (1 MiB blocks, in a subdirectory) ← v2.vhdx
/// (2 MiB blocks), with every block state.
struct Chain {
    _dir: tempfile::TempDir,
    base: PathBuf,
    v1_path: PathBuf,
    v2_path: PathBuf,
    base_bytes: Vec<u8>,
    v1: Spec,
    v2: Spec,
}

const CHAIN_SIZE: u64 = 41000 * 1024;

fn chain() -> Chain {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let raw = make_raw(d);
    let base = d.join("base.vhdx");
    run("qemu-img", &["convert", "-f", "raw", "-O", "vhdx", s(&raw), s(&base)]);
    let base_bytes = std::fs::read(&raw).expect("raw");
    std::fs::create_dir(d.join("v1")).expect("mkdir");

    let v1 = Spec::new(CHAIN_SIZE, MIB as u32)
        .on_parent("..\\base.vhdx", &vb::data_write_guid(&base))
        .block(0, Block::Partial { data: pattern(MIB as usize, 1), present: sectors(&[(3, 5), (100, 1), (2047, 1)]) })
        .block(1, Block::Full(pattern(700 * 1024, 2)))
        .block(2, Block::Zero)
        .block(3, Block::Unmapped)
        .block(4, Block::Undefined)
        .block(9, Block::Partial { data: pattern(MIB as usize, 3), present: sectors(&[(0, 1024)]) })
        .block(20, Block::Full(pattern(4096, 4)))
        .block(40, Block::Partial { data: pattern(4096, 5), present: sectors(&[(1, 2)]) });
    let v1_path = d.join("v1").join("v1.vhdx");
    v1.write(&v1_path);

    let mut v2 = Spec::new(CHAIN_SIZE, 2 * MIB as u32)
        .on_parent(".\\v1\\v1.vhdx", &v1.data_write_guid)
        .block(0, Block::Partial { data: pattern(2 * MIB as usize, 6), present: sectors(&[(4, 2), (2048, 8)]) })
        .block(5, Block::Full(pattern(2 * MIB as usize, 7)))
        .block(10, Block::Zero)
        .block(19, Block::Partial { data: pattern(MIB as usize, 8), present: sectors(&[(0, 3)]) });
    v2.data_write_guid = vb::guid_from(0x2222);
    let v2_path = d.join("v2.vhdx");
    v2.write(&v2_path);
    Chain { base, v1_path, v2_path, base_bytes, v1, v2, _dir: dir }
}

#[test]
fn a_differencing_chain_reads_through_to_its_base() {
    let c = chain();
    let expected = model(&[&c.v2, &c.v1], &c.base_bytes, 0, CHAIN_SIZE as usize);
    // The model itself: v2's sectors, v1's under them, the base's where neither has any.
    assert_eq!(expected[4 * 512], pattern(4 * 512 + 1, 6)[4 * 512]);
    assert_eq!(expected[3 * 512], pattern(2048, 1)[3 * 512]);
    assert_eq!(expected[0], 0x11);
    assert!(expected[2 * MIB as usize..4 * MIB as usize].iter().all(|&b| b == 0), "v1's zero blocks hide the base");

    let image = open_image(&c.v2_path).expect("the chain opens");
    let canonical = |p: &Path| std::fs::canonicalize(p).expect("canonical");
    assert_eq!(
        image.describe(),
        format!(
            "{} (vhdx) on {} (vhdx) on {} (vhdx)",
            c.v2_path.display(),
            canonical(&c.v1_path).display(),
            canonical(&c.base).display()
        ),
    );
    let identity = image.identity().expect("identity");
    assert_eq!(identity.matches("inode").count(), 3, "{identity}");
    assert_reads_match(image.as_ref(), &expected);
    let [data, zero, hole] = assert_extents_agree(image.as_ref(), &expected);
    assert!(data > 0 && zero >= MIB && hole > 0, "{data} {zero} {hole}");

    // Each layer alone reads as its own part of the chain.
    let v1 = VhdxImage::open(&c.v1_path).expect("v1 opens");
    assert_eq!(v1.depth(), 2);
    assert_reads_match(&v1, &model(&[&c.v1], &c.base_bytes, 0, CHAIN_SIZE as usize));
    assert_eq!(VhdxImage::open(&c.v2_path).expect("v2").depth(), 3);
}

/// Which layer of a chain of builder layers over `base` holds byte `pos` (1 the top; 0 none,
/// where the byte reads as a hole): what `qemu:allocation-depth` answers. `base_holds` says
/// whether the base holds it.
fn model_depth(layers: &[&Spec], base_holds: &dyn Fn(u64) -> bool, pos: u64) -> u32 {
    for (i, layer) in layers.iter().enumerate() {
        if pos >= layer.virtual_size {
            return 0;
        }
        let block_size = u64::from(layer.block_size);
        let (index, within) = ((pos / block_size) as usize, (pos % block_size) as usize);
        match layer.blocks.get(index).unwrap_or(&Block::NotPresent) {
            Block::Full(_) | Block::Zero => return i as u32 + 1,
            Block::Partial { present, .. } => {
                if present.get(within / layer.logical_sector as usize).copied().unwrap_or(false) {
                    return i as u32 + 1;
                }
            }
            Block::NotPresent if layer.parent.is_some() => {}
            _ => return 0,
        }
    }
    if base_holds(pos) {
        layers.len() as u32 + 1
    } else {
        0
    }
}

/// A differencing disk's layers: its own sectors at depth 1, its parent's at 2, the base's at
/// 3 (`qemu:allocation-depth`); until session 52 every stored byte of the chain said 1.
#[test]
fn a_differencing_chain_says_which_layer_holds_each_sector() {
    let c = chain();
    let base = VhdxImage::open(&c.base).expect("base opens");
    let base_extents = base.extents(0, CHAIN_SIZE).expect("base extents");
    let base_holds = |pos: u64| {
        let mut at = 0;
        base_extents.iter().any(|e| {
            let holds = (at..at + e.len).contains(&pos) && e.state != Allocation::Hole;
            at += e.len;
            holds
        })
    };
    let image = open_image(&c.v2_path).expect("the chain opens");
    let mut depths = Vec::new();
    while (depths.len() as u64) * 512 < CHAIN_SIZE {
        let at = depths.len() as u64 * 512;
        for run in image.layer_runs(at, CHAIN_SIZE - at).expect("layer runs") {
            assert_eq!(run.len % 512, 0, "a run of whole sectors");
            depths.extend(std::iter::repeat_n(run.depth, (run.len / 512) as usize));
        }
    }
    let mut seen = [0u64; 4];
    for (sector, &depth) in depths.iter().enumerate() {
        let expected = model_depth(&[&c.v2, &c.v1], &base_holds, sector as u64 * 512);
        assert_eq!(depth, expected, "sector {sector}");
        seen[depth as usize] += 1;
    }
    assert!(seen.iter().all(|&n| n > 0), "every depth, 0 to 3, somewhere: {seen:?}");
}

#[test]
fn reads_are_safe_from_many_threads() {
    let c = chain();
    let expected = model(&[&c.v2, &c.v1], &c.base_bytes, 0, CHAIN_SIZE as usize);
    let image = VhdxImage::open(&c.v2_path).expect("opens");
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (image, expected) = (&image, &expected);
            scope.spawn(move || {
                let mut at = t * 4099;
                while at < CHAIN_SIZE {
                    let len = (65_537 + t as usize * 1000).min((CHAIN_SIZE - at) as usize);
                    let mut buf = vec![0u8; len];
                    image.read_at(&mut buf, at).expect("read");
                    assert!(buf == expected[at as usize..at as usize + len], "thread {t} at {at}");
                    at += 3 * 65_537;
                }
            });
        }
    });
}

#[test]
fn chunks_interleave_with_sector_bitmaps_and_4k_sectors_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // 256 MiB blocks of 512-byte sectors: 16 blocks a chunk, so a 5 GiB disk has two chunks and
    // a sector bitmap entry in the middle of its BAT. Then 4 KiB sectors (1,024 blocks a chunk
    // of 32 MiB blocks).
    for (sector, block, size) in [(512u32, 256 * MIB, 5u64 << 30), (4096, 32 * MIB, 5 << 30)] {
        let mut base = Spec::new(size, block as u32);
        base.logical_sector = sector;
        base.physical_sector = sector;
        let last = (size / block) as usize - 1;
        let base = base
            .block(0, Block::Full(pattern(8192, 9)))
            .block(14, Block::Full(pattern(8192, 10)))
            .block(17, Block::Zero)
            .block(last, Block::Full(pattern(8192, 11)));
        let base_path = d.join(format!("base-{sector}.vhdx"));
        base.write(&base_path);
        let mut child = Spec::new(size, block as u32).on_parent(&format!("base-{sector}.vhdx"), &base.data_write_guid);
        child.logical_sector = sector;
        child.data_write_guid = vb::guid_from(u64::from(sector));
        let sector = sector as usize;
        let child = child
            .block(0, Block::Partial { data: pattern(4 * sector, 12), present: sectors(&[(1, 1), (3, 1)]) })
            .block(15, Block::Full(pattern(4096, 13)))
            .block(16, Block::Partial { data: pattern(8 * sector, 14), present: sectors(&[(0, 2), (5, 1)]) })
            .block(last, Block::Partial { data: vec![0xab; 8 * sector], present: sectors(&[(7, 1)]) });
        let child_path = d.join(format!("child-{sector}.vhdx"));
        child.write(&child_path);

        let image = VhdxImage::open(&child_path).expect("opens");
        assert_eq!((image.size(), image.logical_sector_size()), (size, sector as u32));
        // The operator is told (the export's description): the VM's disk must use the same.
        assert_eq!(image.describe().contains("4096-byte logical sectors"), sector == 4096, "{}", image.describe());
        for at in [0, 15 * block - 10_000, 16 * block - 100, 17 * block - 5000, size - block, size - 9000] {
            let len = 70_000.min((size - at) as usize);
            let mut buf = vec![0xee; len];
            image.read_at(&mut buf, at).expect("read");
            assert!(buf == model(&[&child, &base], &[], at, len), "sector {sector} at {at}");
        }
        // Extents across the chunk boundary: the child's sectors over the parent's data.
        let (at, len) = (16 * block - 8192, 8192 + 16 * sector as u64 + 8192);
        let extents = image.extents(at, len).expect("extents");
        assert_eq!(extents.iter().map(|e| e.len).sum::<u64>(), len);
        let expected = model(&[&child, &base], &[], at, len as usize);
        let mut done = 0usize;
        for e in &extents {
            if e.state != Allocation::Data {
                assert!(expected[done..done + e.len as usize].iter().all(|&b| b == 0), "{e:?} at {done}: {extents:?}");
            }
            done += e.len as usize;
        }
        let sector = sector as u64;
        let states: Vec<(u64, Allocation)> = extents.iter().map(|e| (e.len, e.state)).collect();
        assert_eq!(
            states,
            [
                (8192 + 2 * sector, Allocation::Data),
                (3 * sector, Allocation::Hole),
                (sector, Allocation::Data),
                (8192 + 10 * sector, Allocation::Hole)
            ],
            "block 15 and sectors 0-1 and 5 of block 16 are the child's, the rest of block 16 nobody's"
        );
        // The parent's zero block, and a block neither holds.
        assert_eq!(
            image.extents(17 * block, block).expect("extents"),
            [Extent { len: block, state: Allocation::Zero }]
        );
        assert_eq!(
            image.extents(18 * block, block).expect("extents"),
            [Extent { len: block, state: Allocation::Hole }]
        );
    }
}

fn message(err: EngineError) -> String {
    match err {
        EngineError::Config(m) => m,
        other => panic!("expected a refusal, got {other}"),
    }
}

#[test]
fn refuses_a_parent_that_changed_a_missing_parent_and_a_loop() {
    let c = chain();
    // The base written since v1 was made: a new DataWriteGuid.
    vb::edit_headers(&c.base, |h| h[32] ^= 0xff);
    let err = message(VhdxImage::open(&c.v2_path).expect_err("stale parent"));
    assert!(err.contains("DataWriteGuid") && err.contains("base.vhdx"), "{err}");

    std::fs::remove_file(&c.base).expect("rm");
    let err = message(VhdxImage::open(&c.v1_path).expect_err("missing parent"));
    assert!(
        err.contains("not found") && err.contains(&format!("{}", c.v1_path.with_file_name("../base.vhdx").display())),
        "{err}"
    );

    // a.vhdx on b.vhdx on a.vhdx.
    let d = c.v2_path.parent().expect("dir");
    let a = Spec::new(8 * MIB, MIB as u32).on_parent("b.vhdx", &vb::guid_from(2));
    let mut b = Spec::new(8 * MIB, MIB as u32).on_parent("a.vhdx", &vb::guid_from(1));
    b.data_write_guid = vb::guid_from(2);
    a.write(&d.join("a.vhdx"));
    b.write(&d.join("b.vhdx"));
    let err = message(VhdxImage::open(&d.join("a.vhdx")).expect_err("loop"));
    assert!(err.contains("loops"), "{err}");

    // A parent that is not a file (a FIFO would block the open): refused before it is opened.
    run("mkfifo", &[s(&d.join("fifo.vhdx"))]);
    Spec::new(8 * MIB, MIB as u32).on_parent("fifo.vhdx", &vb::guid_from(2)).write(&d.join("on-fifo.vhdx"));
    let err = message(VhdxImage::open(&d.join("on-fifo.vhdx")).expect_err("FIFO parent"));
    assert!(err.contains("not a regular file"), "{err}");

    // An absolute path is tried when the relative one finds nothing.
    let mut spec = Spec::new(CHAIN_SIZE, MIB as u32).on_parent("gone\\v2.vhdx", &c.v2.data_write_guid);
    if let Some(pairs) = spec.parent.as_mut() {
        pairs.push(("absolute_win32_path".into(), format!("\\\\?\\{}", c.v2_path.display())));
        pairs.push(("volume_path".into(), "\\\\?\\Volume{26a21bda-a627-11d7-9931-806e6f6e6963}\\v2.vhdx".into()));
    }
    let v3 = d.join("v3.vhdx");
    spec.write(&v3);
    // v2's parents are gone, so the refusal comes from further down: v2 itself was found.
    let err = message(VhdxImage::open(&v3).expect_err("base missing"));
    assert!(err.contains("v1.vhdx") && err.contains("not found"), "{err}");

    // Past the depth limit: 70 layers, each on the one before.
    let mut parent = Spec::new(4 * MIB, MIB as u32);
    parent.data_write_guid = vb::guid_from(1000);
    parent.write(&d.join("layer-0.vhdx"));
    for n in 1..70u64 {
        let mut layer =
            Spec::new(4 * MIB, MIB as u32).on_parent(&format!("layer-{}.vhdx", n - 1), &parent.data_write_guid);
        layer.data_write_guid = vb::guid_from(1000 + n);
        layer.write(&d.join(format!("layer-{n}.vhdx")));
        parent = layer;
    }
    let err = message(VhdxImage::open(&d.join("layer-69.vhdx")).expect_err("too deep"));
    assert!(err.contains("deeper than 64"), "{err}");
    assert_eq!(VhdxImage::open(&d.join("layer-60.vhdx")).expect("61 layers open").depth(), 61);
}

#[test]
fn refuses_a_dirty_log_bad_headers_and_truncation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let raw = make_raw(d);
    let good = d.join("good.vhdx");
    run("qemu-img", &["convert", "-f", "raw", "-O", "vhdx", "-o", "block_size=1M", s(&raw), s(&good)]);
    let copy = |name: &str| {
        let path = d.join(name);
        std::fs::copy(&good, &path).expect("copy");
        path
    };

    let dirty = copy("dirty.vhdx");
    vb::edit_headers(&dirty, |h| h[48..64].copy_from_slice(&vb::guid_from(7)));
    let err = message(VhdxImage::open(&dirty).expect_err("dirty log"));
    assert!(err.contains("log is not empty") && err.contains("qemu-img check -r all"), "{err}");

    // One bad header: the other is used. Both bad: refused.
    let file = |path: &Path| std::fs::OpenOptions::new().write(true).open(path).expect("open");
    let one = copy("one-bad-header.vhdx");
    file(&one).write_all_at(b"X", vb::HEADER_OFFSETS[1] + 100).expect("write");
    assert_reads_match(&VhdxImage::open(&one).expect("the other header"), &std::fs::read(&raw).expect("raw"));
    let both = copy("bad-headers.vhdx");
    for offset in vb::HEADER_OFFSETS {
        file(&both).write_all_at(b"X", offset + 100).expect("write");
    }
    let err = message(VhdxImage::open(&both).expect_err("bad checksums"));
    assert!(err.contains("neither VHDX header is valid"), "{err}");

    // A required region this reader does not know.
    let region = copy("unknown-region.vhdx");
    {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&region).expect("open");
        for offset in vb::REGION_TABLE_OFFSETS {
            let mut rt = vec![0u8; vb::REGION_TABLE_BYTES];
            f.read_exact_at(&mut rt, offset).expect("read");
            rt[8] += 1;
            let at = 16 + 2 * 32;
            rt[at..at + 16].copy_from_slice(&vb::guid_from(99));
            rt[at + 16..at + 24].copy_from_slice(&(64 * MIB).to_le_bytes());
            rt[at + 24..at + 28].copy_from_slice(&(MIB as u32).to_le_bytes());
            rt[at + 28] = 1;
            vb::set_checksum(&mut rt, 4);
            f.write_all_at(&rt, offset).expect("write");
        }
    }
    let err = message(VhdxImage::open(&region).expect_err("unknown region"));
    assert!(err.contains("marked required"), "{err}");

    // Truncated anywhere: an error naming the file, never a panic.
    let len = std::fs::metadata(&good).expect("stat").len();
    for cut in [0, 7, 8, 70_000, 200_000, 300_000, MIB + 5, 2 * MIB + 100, 3 * MIB + 4, 4 * MIB, len - MIB, len - 1] {
        let short = copy("short.vhdx");
        file(&short).set_len(cut).expect("truncate");
        match VhdxImage::open(&short) {
            Err(EngineError::Config(m)) => assert!(m.contains("short.vhdx"), "{cut}: {m}"),
            Err(other) => panic!("{cut}: {other}"),
            Ok(_) => panic!("a file cut at {cut} of {len} bytes opened"),
        }
    }
}

#[test]
fn a_bat_entry_past_the_end_or_in_a_wrong_state_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let spec = Spec::new(8 * MIB, MIB as u32).block(1, Block::Full(pattern(4096, 1))).block(2, Block::Zero);
    let path = d.join("bat.vhdx");
    let expected = model(&[&spec], &[], 0, 8 * MIB as usize);
    for (entry, what) in [
        ((1u64 << 40) | 6, "past the end"),
        (6, "header section"),
        (vb::BAT_OFFSET | 6, "over the BAT"),
        (vb::METADATA_OFFSET | 6, "over the metadata"),
        (4, "reserved state 4"),
        ((5 * MIB) | 7, "partially present"),
    ] {
        spec.write(&path);
        let f = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
        f.write_all_at(&entry.to_le_bytes(), vb::BAT_OFFSET + 3 * 8).expect("write");
        let err = message(VhdxImage::open(&path).expect_err(what));
        assert!(err.contains(what) && err.contains("block 3"), "{what}: {err}");
    }
    spec.write(&path);
    assert_reads_match(&VhdxImage::open(&path).expect("intact"), &expected);
}

/// A cheap fuzzer: bytes of a small differencing disk's structures changed one or a few at a
/// time, checksums recomputed half the time so that the changes get past them; opening and
/// reading must give an answer or an error, never a panic (the cargo-fuzz target `vhdx` does the
/// same at length).
#[test]
fn mutated_files_give_errors_never_panics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let mut parent = Spec::new(6 * MIB, MIB as u32).block(0, Block::Full(pattern(5000, 1))).block(2, Block::Zero);
    parent.data_write_guid = vb::guid_from(5);
    parent.write(&d.join("parent.vhdx"));
    let child = Spec::new(6 * MIB, MIB as u32)
        .on_parent("parent.vhdx", &parent.data_write_guid)
        .block(0, Block::Partial { data: pattern(8192, 2), present: sectors(&[(1, 3), (9, 1)]) })
        .block(1, Block::Full(pattern(3000, 3)))
        .block(3, Block::Unmapped)
        .block(5, Block::Partial { data: pattern(512, 4), present: sectors(&[(0, 1)]) });
    let layout = child.layout();
    let path = d.join("child.vhdx");
    child.write(&path);
    let original = VhdxImage::open(&path).expect("the unmutated file opens");
    let expected = model(&[&child, &parent], &[], 0, 6 * MIB as usize);
    assert_reads_match(&original, &expected);

    // What is worth changing, as (offset, bytes): the fields of the headers and region tables,
    // the metadata table and its items, the BAT and the sector bitmaps (256 bytes a 1 MiB block).
    let metadata = &layout.pieces.iter().find(|(offset, _)| *offset == vb::METADATA_OFFSET).expect("metadata").1;
    let mut windows = vec![
        (0, 64),
        (vb::METADATA_OFFSET, 32 + 6 * 32),
        (vb::METADATA_OFFSET + 0x1_0000, metadata.len() as u64 - 0x1_0000),
        (vb::BAT_OFFSET, 7 * 8),
    ];
    windows.extend(vb::HEADER_OFFSETS.into_iter().chain(vb::REGION_TABLE_OFFSETS).map(|offset| (offset, 80)));
    windows.extend(layout.pieces.iter().filter(|(_, bytes)| bytes.len() == 256).map(|(offset, _)| (*offset, 256)));
    let contents = std::fs::read(&path).expect("read");
    let targets: Vec<(u64, Vec<u8>)> = windows
        .into_iter()
        .map(|(offset, len)| (offset, contents[offset as usize..(offset + len) as usize].to_vec()))
        .collect();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open");
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut opened, mut refused) = (0, 0);
    for _ in 0..4000 {
        let (offset, bytes) = &targets[(next() % targets.len() as u64) as usize];
        let mut mutated = bytes.clone();
        for _ in 0..1 + next() % 3 {
            let at = (next() % mutated.len() as u64) as usize;
            mutated[at] = match next() % 4 {
                0 => 0,
                1 => 0xff,
                2 => mutated[at] ^ (1 << (next() % 8)),
                _ => next() as u8,
            };
        }
        let sealable = vb::HEADER_OFFSETS.contains(offset) || vb::REGION_TABLE_OFFSETS.contains(offset);
        let resealed = sealable && next() % 2 == 0;
        if resealed {
            // A region table's checksum covers 64 KiB, of which the piece is the start.
            let mut whole =
                vec![0u8; if vb::HEADER_OFFSETS.contains(offset) { vb::HEADER_BYTES } else { vb::REGION_TABLE_BYTES }];
            f.read_exact_at(&mut whole, *offset).expect("read");
            whole[..mutated.len()].copy_from_slice(&mutated);
            vb::set_checksum(&mut whole, 4);
            mutated = whole[..mutated.len()].to_vec();
        }
        f.write_all_at(&mutated, *offset).expect("mutate");
        match VhdxImage::open(&path) {
            Ok(image) => {
                opened += 1;
                let size = image.size();
                for at in [0, MIB - 700, 5 * MIB, size.saturating_sub(3000)] {
                    let mut buf = vec![0u8; 9000];
                    let _ = image.read_at(&mut buf, at);
                }
                let _ = image.extents(0, size.min(64 * MIB));
            }
            Err(EngineError::Config(_)) => refused += 1,
            Err(other) => panic!("a malformed file should be refused, not fail with {other}"),
        }
        f.write_all_at(bytes, *offset).expect("restore");
    }
    eprintln!("mutations: {opened} opened, {refused} refused");
    assert!(opened > 100 && refused > 300, "opened {opened}, refused {refused}");
}
