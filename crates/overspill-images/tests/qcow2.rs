//! The qcow2 reader against images made and written by qemu's own tools, compared byte for byte
//! with `qemu-img convert`'s raw output.

mod common;

use std::path::Path;

use common::{assert_reads_match, run, s};
use overspill_engine::{Allocation, EngineError, GoldenImage};
use overspill_images::open_image;
use overspill_images::qcow2::Qcow2Image;

/// A qcow2 image with data, zeroed and unallocated regions, and its raw equivalent.
fn make_image(dir: &Path, options: &str) -> (std::path::PathBuf, Vec<u8>) {
    let qcow = dir.join(format!("golden-{}.qcow2", options.replace([',', '='], "_")));
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", options, s(&qcow), "40M"]);
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 0x11 0 100k",
            "-c",
            "write -P 0x22 1000k 3000k",
            "-c",
            "write -P 0x33 20m 4k",
            "-c",
            "write -z 1m 256k",
            "-c",
            "write -P 0x44 39m 1m",
            "-c",
            "discard 2m 64k",
            s(&qcow),
        ],
    );
    let raw = dir.join("expected.raw");
    run("qemu-img", &["convert", "-f", "qcow2", "-O", "raw", s(&qcow), s(&raw)]);
    (qcow, std::fs::read(&raw).expect("raw image"))
}

#[test]
fn reads_what_qemu_wrote_for_v2_v3_and_small_and_large_clusters() {
    let dir = tempfile::tempdir().expect("tempdir");
    for options in ["compat=1.1", "compat=0.10", "compat=1.1,cluster_size=4096", "compat=1.1,cluster_size=2M"] {
        let (qcow, expected) = make_image(dir.path(), options);
        let image = open_image(&qcow).expect("qcow2 opens");
        assert!(image.describe().contains("qcow2"), "{options}: sniffed as qcow2");
        assert_reads_match(image.as_ref(), &expected);
    }
}

/// [`common::extents_of`], and the `data` (offset, length) ranges are reported as data, and a
/// mostly empty image has holes.
fn assert_extents_truthful(image: &dyn GoldenImage, expected: &[u8], data: &[(u64, u64)]) {
    let states = common::extents_of(image, expected);
    for &(offset, len) in data {
        for &(at, n, state) in &states {
            if at < offset + len && offset < at + n {
                assert_eq!(state, Allocation::Data, "{offset}+{len} was written, {at}+{n} says {state:?}");
            }
        }
    }
    assert!(states.iter().any(|s| s.2 != Allocation::Data), "a mostly empty image has holes");
}

/// Where make_image's data is: its writes, less what it zeroed (1M+256k) and discarded (2M+64k).
const WRITTEN: [(u64, u64); 6] = [
    (0, 100 << 10),
    (1000 << 10, 24 << 10),
    (1280 << 10, 768 << 10),
    (2112 << 10, 1888 << 10),
    (20 << 20, 4096),
    (39 << 20, 1 << 20),
];

#[test]
fn reads_compressed_clusters_of_both_kinds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (qcow, expected) = make_image(d, "compat=1.1");
    for (name, options) in [("zlib.qcow2", "compression_type=zlib"), ("zstd.qcow2", "compression_type=zstd")] {
        let compressed = d.join(name);
        run("qemu-img", &["convert", "-c", "-f", "qcow2", "-O", "qcow2", "-o", options, s(&qcow), s(&compressed)]);
        let image = open_image(&compressed).expect("compressed qcow2 opens");
        assert_reads_match(image.as_ref(), &expected);
        assert_extents_truthful(image.as_ref(), &expected, &WRITTEN);
    }
    // Small clusters compress into descriptors with few sector bits, large ones with many.
    for cluster_size in ["4096", "2M"] {
        let compressed = d.join(format!("zstd-{cluster_size}.qcow2"));
        let options = format!("compression_type=zstd,cluster_size={cluster_size}");
        run("qemu-img", &["convert", "-c", "-f", "qcow2", "-O", "qcow2", "-o", &options, s(&qcow), s(&compressed)]);
        assert_reads_match(open_image(&compressed).expect("opens").as_ref(), &expected);
    }
}

#[test]
fn reads_a_three_layer_chain_and_its_zero_clusters_hide_the_layers_below() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // The bottom layer: golden-compat_1.1.qcow2, which v1 names by its file name.
    make_image(d, "compat=1.1");
    let v1 = d.join("v1.qcow2");
    let v2 = d.join("v2.qcow2");
    // v1 names its backing file relative to its own directory, as qemu-img writes it.
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", "golden-compat_1.1.qcow2", s(&v1)]);
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x66 64k 128k", "-c", "write -z 1200k 64k", s(&v1)]);
    // The top layer compressed, on a layer of a different cluster size, and longer than it.
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", "-F", "qcow2", "-b", s(&v1), s(&v2), "48M"],
    );
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 0x77 3000k 8k",
            "-c",
            "write -c -P 0x78 0 64k",
            "-c",
            "write -P 0x79 47m 4k",
            s(&v2),
        ],
    );
    let raw = d.join("chain.raw");
    run("qemu-img", &["convert", "-f", "qcow2", "-O", "raw", s(&v2), s(&raw)]);
    let expected = std::fs::read(&raw).expect("raw");
    let image = open_image(&v2).expect("chain opens");
    let described = image.describe();
    assert!(
        described.contains("v2.qcow2") && described.contains("v1.qcow2") && described.contains("golden"),
        "{described}"
    );
    assert_reads_match(image.as_ref(), &expected);
    assert_extents_truthful(image.as_ref(), &expected, &[(64 << 10, 128 << 10), (47 << 20, 4096), (3000 << 10, 8192)]);
    assert_eq!(expected[1200 << 10], 0, "v1's zero cluster hides base's 0x22");
    // A raw bottom layer, named raw by the backing format extension.
    let on_raw = d.join("on-raw.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "raw", "-b", s(&raw), s(&on_raw)]);
    assert_reads_match(open_image(&on_raw).expect("opens").as_ref(), &expected);
    // The identity changes when a layer below changes.
    let before = image.identity();
    drop(image);
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x12 30m 4k", s(&v1)]);
    assert_ne!(open_image(&v2).expect("opens").identity(), before, "a changed layer changes the identity");
}

#[test]
fn a_loop_or_a_missing_layer_is_refused_at_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let a = d.join("a.qcow2");
    let b = d.join("b.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&b), "8M"]);
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", s(&b), s(&a)]);
    // Unsafe rebase: b now names a as its backing file, and a names b.
    run("qemu-img", &["rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", s(&a), s(&b)]);
    let err = open_image(&a).err().expect("a loop is refused").to_string();
    // Found where it closes, not 64 layers down (each holding its L1 table meanwhile).
    assert!(err.contains("the chain loops"), "{err}");
    let own = d.join("own.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&own), "8M"]);
    run("qemu-img", &["rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", s(&own), s(&own)]);
    let err = open_image(&own).err().expect("an image that is its own backing file is refused").to_string();
    assert!(err.contains("the chain loops"), "{err}");
    let c = d.join("c.qcow2");
    let orphan = d.join("orphan.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&c), "8M"]);
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", s(&c), s(&orphan)]);
    std::fs::remove_file(&c).expect("remove the backing file");
    let err = open_image(&orphan).err().expect("a missing layer is refused").to_string();
    assert!(err.contains("c.qcow2"), "names the missing file: {err}");
}

/// An L1 entry that does not point at the start of a cluster inside the file is corruption, as
/// qemu says: reading through it is an error, not a table read from wherever it points.
/// A qcow2 image of 8 MiB with its first 4 KiB written by qemu-io, whose table entry `at`
/// returns (given the file and the L1 table's offset) is moved 512 bytes on; the error of a
/// read of its first 4 KiB.
fn read_with_an_entry_moved(at: impl FnOnce(&std::fs::File, u64) -> u64) -> std::io::Error {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("bad.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&image), "8M"]);
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x33 0 4k", s(&image)]);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&image).expect("open");
    let mut header = [0u8; 48];
    file.read_exact_at(&mut header, 0).expect("header");
    let entry_at = at(&file, u64::from_be_bytes(header[40..48].try_into().expect("8 bytes")));
    let mut entry = [0u8; 8];
    file.read_exact_at(&mut entry, entry_at).expect("table entry");
    let moved = u64::from_be_bytes(entry) + 512;
    file.write_all_at(&moved.to_be_bytes(), entry_at).expect("patch");
    drop(file);
    let opened = open_image(&image).expect("the header is fine");
    opened.read_at(&mut vec![0u8; 4096], 0).expect_err("a read through a misplaced table entry")
}

#[test]
fn an_l1_entry_off_a_cluster_boundary_is_refused_when_read() {
    let err = read_with_an_entry_moved(|_, l1_offset| l1_offset);
    assert!(err.to_string().contains("not an L2 table"), "{err}");
}

/// The same for a data cluster: an L2 entry that points off a cluster boundary would serve bytes
/// shifted into the next cluster; the read fails instead, as qemu calls it corruption.
#[test]
fn a_data_cluster_off_a_cluster_boundary_is_refused_when_read() {
    let err = read_with_an_entry_moved(|file, l1_offset| {
        use std::os::unix::fs::FileExt;
        let mut entry = [0u8; 8];
        file.read_exact_at(&mut entry, l1_offset).expect("L1 entry");
        u64::from_be_bytes(entry) & 0x00ff_ffff_ffff_fe00
    });
    assert!(err.to_string().contains("unaligned"), "{err}");
}

/// A version 2 image whose L2 entry has the zero bit set, which version 2 reserves: the read
/// fails, as qemu's does, instead of serving zeroes in place of the cluster's data.
#[test]
fn a_zero_bit_in_a_version_2_image_is_corruption_not_zeroes() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("v2.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "compat=0.10", s(&image), "8M"]);
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x33 0 64k", s(&image)]);
    open_image(&image).expect("opens").read_at(&mut vec![0u8; 4096], 0).expect("a read before the change");
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&image).expect("open");
    let mut header = [0u8; 48];
    file.read_exact_at(&mut header, 0).expect("header");
    let mut entry = [0u8; 8];
    file.read_exact_at(&mut entry, u64::from_be_bytes(header[40..48].try_into().expect("8 bytes"))).expect("L1");
    let l2 = u64::from_be_bytes(entry) & 0x00ff_ffff_ffff_fe00;
    file.read_exact_at(&mut entry, l2).expect("L2 entry");
    file.write_all_at(&(u64::from_be_bytes(entry) | 1).to_be_bytes(), l2).expect("patch");
    drop(file);
    let err = open_image(&image).expect("the header is fine").read_at(&mut vec![0u8; 4096], 0).expect_err("a zero bit");
    assert!(err.to_string().contains("version 2"), "{err}");
}

/// An L1 table larger than qemu opens (32 MiB: 4 Mi entries) is refused at open, where it would
/// be kept for as long as the layer is served (here 4 Mi + 1 entries for a disk that needs them
/// all, the table's space in a sparse file).
#[test]
fn an_l1_table_larger_than_qemus_is_refused() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("huge.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&image), "8M"]);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&image).expect("open");
    let mut header = [0u8; 48];
    file.read_exact_at(&mut header, 0).expect("header");
    let cluster = 1u64 << u32::from_be_bytes(header[20..24].try_into().expect("4 bytes"));
    let entries = (4u64 << 20) + 1;
    let l1_offset = u64::from_be_bytes(header[40..48].try_into().expect("8 bytes"));
    file.write_all_at(&(entries * cluster * (cluster / 8)).to_be_bytes(), 24).expect("size");
    file.write_all_at(&(entries as u32).to_be_bytes(), 36).expect("L1 size");
    file.set_len(l1_offset + entries * 8).expect("room for the table");
    drop(file);
    let err = Qcow2Image::open(&image).err().expect("refused").to_string();
    assert!(err.contains("32 MiB"), "{err}");
}

/// A file changed under the reader (here cut short, its last data cluster gone) fails the read
/// in whatever way its new bytes lead to: the error says the image changed, not that a read
/// ran past the end of a corrupt file.
#[test]
fn a_file_changed_under_the_reader_is_reported_as_changed_not_corrupt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("changing.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", s(&image), "8M"]);
    run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x33 0 64k", "-c", "write -P 0x44 4m 64k", s(&image)]);
    let opened = open_image(&image).expect("opens");
    opened.read_at(&mut vec![0u8; 4096], 4 << 20).expect("a read before the change");
    let len = std::fs::metadata(&image).expect("size").len();
    std::fs::OpenOptions::new().write(true).open(&image).and_then(|f| f.set_len(len - (64 << 10))).expect("cut");
    let err = opened.read_at(&mut vec![0u8; 4096], 4 << 20).expect_err("a read of the cluster cut off");
    assert!(err.to_string().contains("changed while served"), "{err}");
}

#[test]
fn refuses_what_it_does_not_support() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // Subclusters.
    let extended = d.join("extended.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "extended_l2=on", s(&extended), "8M"]);
    assert!(matches!(Qcow2Image::open(&extended), Err(EngineError::Config(m)) if m.contains("subclusters")));
    // An external data file.
    let external = d.join("external.qcow2");
    let data = d.join("external.data");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", &format!("data_file={}", s(&data)), s(&external), "8M"]);
    let err = open_image(&external).err().expect("data file refused").to_string();
    assert!(err.contains("external data file"), "{err}");
    // Not qcow2 at all: opened as raw.
    let raw = d.join("plain.img");
    std::fs::write(&raw, vec![5u8; 8192]).expect("write");
    assert!(!open_image(&raw).expect("raw").describe().contains("qcow2"));
    // A truncated header.
    let short = d.join("short.qcow2");
    std::fs::write(&short, [0x51, 0x46, 0x49, 0xfb, 0, 0, 0, 3]).expect("write");
    assert!(open_image(&short).is_err());
}

#[test]
fn a_sparse_raw_file_reports_its_holes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (qcow, expected) = make_image(dir.path(), "compat=1.1");
    let raw = dir.path().join("sparse.raw");
    // qemu-img writes a sparse raw file: the zeroes it was never told of are holes.
    run("qemu-img", &["convert", "-f", "qcow2", "-O", "raw", s(&qcow), s(&raw)]);
    let image = open_image(&raw).expect("raw");
    assert_extents_truthful(image.as_ref(), &expected, &WRITTEN);
}

/// With 4 KiB clusters one L2 table maps 2 MiB: a reader walking a large image keeps only the
/// most recent 32 MiB of tables (a 1 TiB image's would be 2 GiB), and reads right all along.
#[test]
fn l2_tables_kept_stay_within_their_bound_on_a_full_walk() {
    use overspill_images::qcow2::L2_CACHE_BYTES;
    use std::io::Write;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("walk.qcow2");
    // 4 KiB tables, 8 KiB past the bound: one written cluster in each table's 2 MiB.
    let tables = (L2_CACHE_BYTES / 4096 + 2) as usize;
    let size = format!("{}M", tables * 2);
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", s(&image), &size]);
    let mut qemu_io = Command::new("qemu-io")
        .args(["-f", "qcow2", s(&image)])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("qemu-io");
    let mut commands = String::new();
    for table in 0..tables {
        commands.push_str(&format!("write -P {} {}M 512\n", table % 251 + 1, table * 2));
    }
    commands.push_str("quit\n");
    qemu_io.stdin.take().expect("stdin").write_all(commands.as_bytes()).expect("commands");
    assert!(qemu_io.wait().expect("qemu-io").success(), "qemu-io failed");

    let qcow = Qcow2Image::open(&image).expect("open");
    let mut block = [0u8; 512];
    for table in 0..tables {
        qcow.read_at(&mut block, table as u64 * (2 << 20)).expect("read");
        assert!(block.iter().all(|&b| b == (table % 251 + 1) as u8), "table {table}'s cluster");
        assert!(qcow.l2_cache_bytes() <= L2_CACHE_BYTES, "{} bytes of tables kept", qcow.l2_cache_bytes());
    }
    assert_eq!(qcow.l2_cache_bytes(), L2_CACHE_BYTES, "a walk fills the cache to its bound");
    // The first tables were let go; read again, they come back from the file.
    qcow.read_at(&mut block, 0).expect("read");
    assert!(block.iter().all(|&b| b == 1), "table 0's cluster after its table was let go");
}

/// The figure behind performance.md's "qcow2 block status over a backing file": block status of
/// a whole 8 GiB qcow2 over a sparse raw backing file, one 64 KiB cluster written every 512 MiB
/// (all 16 L2 tables exist, almost empty). A measurement, not a check:
/// `cargo test --release -p overspill-images --test qcow2 -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_block_status_of_a_layer_over_a_backing_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (base, top) = (dir.path().join("base.raw"), dir.path().join("top.qcow2"));
    std::fs::File::create(&base).and_then(|f| f.set_len(8 << 30)).expect("sparse base");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "raw", "-b", s(&base), s(&top)]);
    let mut args = vec!["-f".to_owned(), "qcow2".to_owned()];
    for i in 0..16 {
        args.extend(["-c".to_owned(), format!("write -P 0x55 {}m 64k", i * 512 + 100)]);
    }
    args.push(s(&top).to_owned());
    run("qemu-io", &args.iter().map(String::as_str).collect::<Vec<_>>());
    let image = open_image(&top).expect("opens");
    let started = std::time::Instant::now();
    let (mut at, mut extents) = (0, 0);
    while at < image.size() {
        for extent in image.extents(at, image.size() - at).expect("extents") {
            at += extent.len;
            extents += 1;
        }
    }
    eprintln!("block status of 8 GiB over a backing file: {:?}, {extents} extents", started.elapsed());
}

/// A layer written by `LayerWriter` over a raw base: `qemu-img check` finds it sound, `qemu-img
/// compare` finds it the base with the changes, and this crate's reader reads the same, zeroed
/// blocks as zeroes (a zero cluster) and untouched ones from the base.
#[test]
fn a_written_layer_is_its_base_with_the_changes_for_qemu_img_and_this_reader() {
    use overspill_images::qcow2_layer::LayerWriter;
    use overspill_images::Format;
    let dir = tempfile::tempdir().expect("tempdir");
    const DISK: usize = 8 << 20;
    let base: Vec<u8> = (0..DISK).map(|i| (i as u64).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    std::fs::write(dir.path().join("base.raw"), &base).expect("base");
    let mut expected = base.clone();
    let layer = dir.path().join("layer.qcow2");
    let mut writer = LayerWriter::create(&layer, DISK as u64, "base.raw", Format::Raw).expect("create");
    let put = |writer: &mut LayerWriter, expected: &mut Vec<u8>, first: usize, blocks: usize, byte: u8| {
        writer.data(first as u64, &vec![byte; blocks * 4096]).expect("data");
        expected[first * 4096..(first + blocks) * 4096].fill(byte);
    };
    put(&mut writer, &mut expected, 0, 3, 0xaa);
    put(&mut writer, &mut expected, 100, 1, 0xbb);
    // Across the first L2 table's end (512 blocks each).
    put(&mut writer, &mut expected, 510, 5, 0xcc);
    writer.zeroes(1000, 1010).expect("zeroes");
    expected[1000 * 4096..1010 * 4096].fill(0);
    // Zeroed then written; written then zeroed; written twice; the disk's last block.
    put(&mut writer, &mut expected, 1005, 1, 0xdd);
    put(&mut writer, &mut expected, 1500, 2, 0x77);
    writer.zeroes(1500, 1501).expect("zeroes");
    expected[1500 * 4096..1501 * 4096].fill(0);
    put(&mut writer, &mut expected, 100, 1, 0xee);
    put(&mut writer, &mut expected, DISK / 4096 - 1, 1, 0xff);
    assert!(writer.data((DISK / 4096) as u64, &[0; 4096]).is_err(), "a block past the disk is refused");
    writer.finish().expect("finish");
    let expected_raw = dir.path().join("expected.raw");
    std::fs::write(&expected_raw, &expected).expect("expected");

    let check = std::process::Command::new("qemu-img")
        .args(["check", "-f", "qcow2", s(&layer)])
        .output()
        .expect("qemu-img check (apt-get install qemu-utils)");
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && said.contains("No errors were found"),
        "{said}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    run("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", s(&layer), s(&expected_raw)]);

    let image = open_image(&layer).expect("this reader opens the layer");
    assert_reads_match(image.as_ref(), &expected);
    let zeroed = image.extents(1000 * 4096, 4096).expect("extents");
    assert!(
        matches!(zeroed[0].state, Allocation::Zero | Allocation::Hole),
        "a zeroed block stores nothing and reads zeroes: {zeroed:?}"
    );
    let untouched = image.extents(2000 * 4096, 4096).expect("extents");
    assert_eq!(untouched[0].state, Allocation::Data, "an untouched block is the base's data: {untouched:?}");
}

/// A version 2 header with no extension end marker and its backing file's name straight after
/// it, as tools other than qemu-img write it: the extensions end where the name begins (as
/// qemu reads them), and the image is read through its backing file. The name was read as an
/// extension of some hundred megabytes and the image refused.
#[test]
fn extensions_end_where_the_backing_files_name_begins() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().join("base.raw");
    let expected: Vec<u8> = (0..1u32 << 20).map(|i| (i % 241) as u8).collect();
    std::fs::write(&base, &expected).expect("base");
    let top = dir.path().join("top.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "compat=0.10", "-b", "base.raw", "-F", "raw", s(&top)]);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&top).expect("open");
    let name = b"base.raw";
    file.write_all_at(&vec![0u8; 4096 - 72], 72).expect("no extensions");
    file.write_all_at(name, 72).expect("the name after the header");
    file.write_all_at(&72u64.to_be_bytes(), 8).expect("backing_file_offset");
    file.write_all_at(&(name.len() as u32).to_be_bytes(), 16).expect("backing_file_size");
    drop(file);
    run("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", s(&top), s(&base)]);
    let image = open_image(&top).expect("opens as qemu opens it");
    assert_reads_match(image.as_ref(), &expected);
}
