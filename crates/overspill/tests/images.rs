//! Every golden image format over NBD, read by qemu's and libnbd's own tools: `qemu-img
//! compare` of each format against its raw equivalent, block status (`nbdinfo --map`, `qemu-img
//! map`) against what a VM really wrote, zeroed and trimmed, copies of a mostly empty disk that
//! read only what is stored, and NBD_CMD_CACHE filling the shared read cache.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use overspill_nbd::wire::CMD_CACHE;
use serde_json::Value;

mod common;
use common::{metrics_url, pseudo_random, run_ok, sample, scrape, Serve};

#[path = "../../overspill-images/tests/common/vhdx_builder.rs"]
#[allow(dead_code)] // The builder serves the images crate's tests too, which use all of it.
mod vhdx_builder;

const MIB: u64 = 1 << 20;

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

fn serve(dir: &Path, args: &[&str]) -> (Serve, PathBuf) {
    let socket = dir.join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let mut all = vec!["--listen", listen.as_str(), "--metrics", "tcp:127.0.0.1:0"];
    all.extend_from_slice(args);
    let ready = socket.clone();
    let server = Serve::start(dir, &all, &[], move || std::os::unix::net::UnixStream::connect(&ready).is_ok());
    (server, socket)
}

fn uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// A raw disk with data, zeroes and holes: what each format is made from.
fn raw_image(dir: &Path) -> PathBuf {
    let raw = dir.join("base.raw");
    run_ok(dir, "qemu-img", &["create", "-q", "-f", "raw", s(&raw), "40M"]);
    let writes = ["write -P 0x11 0 100k", "write -P 0x22 1000k 3000k", "write -P 0x33 20m 4k", "write -P 0x44 39m 1m"];
    let mut args = vec!["-f", "raw"];
    for write in &writes {
        args.extend(["-c", write]);
    }
    args.push(s(&raw));
    run_ok(dir, "qemu-io", &args);
    raw
}

#[test]
fn every_supported_format_reads_the_same_as_its_raw_image_over_nbd() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let raw = raw_image(d);
    let mut exports: Vec<(String, PathBuf, PathBuf)> = Vec::new();
    let mut convert = |name: &str, args: &[&str]| {
        let out = d.join(name);
        let mut all = vec!["convert", "-f", "raw"];
        all.extend_from_slice(args);
        all.extend([s(&raw), s(&out)]);
        run_ok(d, "qemu-img", &all);
        exports.push((name.replace('.', "-"), out, raw.clone()));
    };
    convert("plain.qcow2", &["-O", "qcow2"]);
    convert("zlib.qcow2", &["-c", "-O", "qcow2", "-o", "compression_type=zlib"]);
    convert("zstd.qcow2", &["-c", "-O", "qcow2", "-o", "compression_type=zstd"]);
    convert("dynamic.vhdx", &["-O", "vhdx"]);
    convert("fixed.vhdx", &["-O", "vhdx", "-o", "subformat=fixed"]);

    // A three-layer qcow2 chain, each layer writing over the one below, and its flattened form.
    let base = d.join("chain-base.qcow2");
    let v1 = d.join("chain-v1.qcow2");
    let v2 = d.join("chain-v2.qcow2");
    run_ok(d, "qemu-img", &["convert", "-c", "-f", "raw", "-O", "qcow2", s(&raw), s(&base)]);
    run_ok(d, "qemu-img", &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", "chain-base.qcow2", s(&v1)]);
    run_ok(d, "qemu-io", &["-f", "qcow2", "-c", "write -P 0x55 64k 128k", "-c", "write -z 1200k 64k", s(&v1)]);
    run_ok(d, "qemu-img", &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", "chain-v1.qcow2", s(&v2)]);
    run_ok(d, "qemu-io", &["-f", "qcow2", "-c", "write -P 0x66 3000k 8k", "-c", "discard 39m 64k", s(&v2)]);
    let chain_raw = d.join("chain.raw");
    run_ok(d, "qemu-img", &["convert", "-f", "qcow2", "-O", "raw", s(&v2), s(&chain_raw)]);
    exports.push(("chain".into(), v2, chain_raw));

    // A differencing VHDX (qemu cannot make one) on a dynamic one qemu made.
    let parent = d.join("dynamic.vhdx");
    let child = d.join("child.vhdx");
    let block = 2 * MIB as usize;
    let spec = vhdx_builder::Spec::new(40 * MIB, block as u32)
        .on_parent("dynamic.vhdx", &vhdx_builder::data_write_guid(&parent))
        .block(1, vhdx_builder::Block::Full(pseudo_random(block, 9)))
        .block(5, vhdx_builder::Block::Zero);
    spec.write(&child);
    let mut expected = std::fs::read(&raw).expect("raw");
    expected[block..2 * block].copy_from_slice(&pseudo_random(block, 9));
    expected[5 * block..6 * block].fill(0);
    let child_raw = d.join("child.raw");
    std::fs::write(&child_raw, &expected).expect("child raw");
    exports.push(("differencing".into(), child, child_raw));

    let export_args: Vec<String> =
        exports.iter().map(|(name, path, _)| format!("--export={name}={}", s(path))).collect();
    let args: Vec<&str> = export_args.iter().map(String::as_str).collect();
    let (server, socket) = serve(d, &args);
    for (name, _, raw) in &exports {
        let out = common::run_tool(d, "qemu-img", &["compare", "-f", "raw", "-F", "raw", s(raw), &uri(&socket, name)]);
        assert!(out.status.success(), "{name}: {}\n{}", out.all(), server.log_text());
    }
    let log = server.log_text();
    assert!(log.contains("chain-v1.qcow2"), "the chain is in the log:\n{log}");
    // And in the metrics: the top layer's series names every layer under it.
    let samples = scrape(&metrics_url(&server));
    let chain: Vec<&String> = samples
        .keys()
        .filter(|(name, labels)| {
            name == "overspill_golden_image_info" && labels.get("export").map(String::as_str) == Some("chain")
        })
        .filter_map(|(_, labels)| labels.get("source"))
        .collect();
    assert_eq!(chain.len(), 1, "{chain:?}");
    assert!(
        chain[0].contains("chain-v2.qcow2")
            && chain[0].contains("chain-v1.qcow2")
            && chain[0].contains("chain-base.qcow2"),
        "{}",
        chain[0]
    );
}

/// (offset, length, NBD flags) runs, neighbours with the same flags merged.
fn merged(runs: impl IntoIterator<Item = (u64, u64, u32)>) -> Vec<(u64, u64, u32)> {
    let mut out: Vec<(u64, u64, u32)> = Vec::new();
    for (offset, length, flags) in runs {
        match out.last_mut() {
            Some(last) if last.2 == flags && last.0 + last.1 == offset => last.1 += length,
            _ => out.push((offset, length, flags)),
        }
    }
    out
}

fn json(text: &str) -> Vec<Value> {
    let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    value.as_array().expect("an array").clone()
}

const HOLE: u32 = 1;
const ZERO: u32 = 2;

#[test]
fn block_status_shows_what_a_vm_wrote_zeroed_and_trimmed_over_the_golden_images_holes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // A sparse golden image: data at 1M..3M and 10M..10M+64K, holes elsewhere.
    let golden = d.join("golden.img");
    let file = std::fs::File::create(&golden).expect("golden");
    file.set_len(64 * MIB).expect("size");
    std::os::unix::fs::FileExt::write_all_at(&file, &pseudo_random(2 * MIB as usize, 1), MIB).expect("write");
    std::os::unix::fs::FileExt::write_all_at(&file, &pseudo_random(64 << 10, 2), 10 * MIB).expect("write");
    drop(file);
    let (server, socket) = serve(d, &["--base", s(&golden), "--reconnect-grace", "1m"]);
    let vm_uri: NbdUri = uri(&socket, "@vm1").parse().expect("uri");
    // What the VM does: writes over a hole, zeroes half the golden data, trims the rest of it
    // (which reads from the golden image again). Its connection then drops without a
    // disconnect, so its overlay waits in its grace for the tools below.
    let waiting = || server.log_text().matches("its overlay waits for it to reconnect").count();
    let prepare = || {
        let before = waiting();
        let mut client = Client::connect(&vm_uri).expect("connect");
        client.write(20 * MIB, &pseudo_random(8192, 3), false).expect("write");
        client.write_zeroes(MIB, MIB as u32, false).expect("zero");
        client.trim(10 * MIB, 64 << 10).expect("trim");
        drop(client);
        let deadline = Instant::now() + Duration::from_secs(10);
        while waiting() == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let expected = merged([
        (0, MIB, HOLE | ZERO),
        (MIB, MIB, ZERO),
        (2 * MIB, MIB, 0),
        (3 * MIB, 7 * MIB, HOLE | ZERO),
        (10 * MIB, 64 << 10, 0),
        (10 * MIB + (64 << 10), 10 * MIB - (64 << 10), HOLE | ZERO),
        (20 * MIB, 8192, 0),
        (20 * MIB + 8192, 44 * MIB - 8192, HOLE | ZERO),
    ]);

    prepare();
    let out = run_ok(d, "nbdinfo", &["--map", "--json", &uri(&socket, "@vm1")]);
    let map = json(&out.stdout);
    let seen = merged(map.iter().map(|e| {
        (
            e["offset"].as_u64().expect("offset"),
            e["length"].as_u64().expect("length"),
            e["type"].as_u64().expect("type") as u32,
        )
    }));
    assert_eq!(seen, expected, "nbdinfo --map\n{}", server.log_text());

    // qemu calls what is not a hole data, and keeps the zero flag.
    prepare();
    let out = run_ok(d, "qemu-img", &["map", "--output=json", "-f", "raw", &uri(&socket, "@vm1")]);
    let seen = merged(json(&out.stdout).iter().map(|e| {
        let data = e["data"].as_bool().expect("data");
        let zero = e["zero"].as_bool().expect("zero");
        (
            e["start"].as_u64().expect("start"),
            e["length"].as_u64().expect("length"),
            if data { 0 } else { HOLE } | if zero { ZERO } else { 0 },
        )
    }));
    assert_eq!(seen, expected, "qemu-img map");

    // qemu:allocation-depth: what the VM wrote or zeroed is its own (1), the golden image's data
    // is the layer below (2, the trimmed range again), its holes no layer's (0).
    let depths = merged([
        (0, MIB, 0),
        (MIB, MIB, 1),
        (2 * MIB, MIB, 2),
        (3 * MIB, 7 * MIB, 0),
        (10 * MIB, 64 << 10, 2),
        (10 * MIB + (64 << 10), 10 * MIB - (64 << 10), 0),
        (20 * MIB, 8192, 1),
        (20 * MIB + 8192, 44 * MIB - 8192, 0),
    ]);
    prepare();
    let out = run_ok(d, "nbdinfo", &["--map=qemu:allocation-depth", "--json", &uri(&socket, "@vm1")]);
    let seen = merged(json(&out.stdout).iter().map(|e| {
        let depth = e["type"].as_u64().expect("depth") as u32;
        (e["offset"].as_u64().expect("offset"), e["length"].as_u64().expect("length"), depth)
    }));
    assert_eq!(seen, depths, "nbdinfo --map=qemu:allocation-depth");
    // QEMU reads it through x-dirty-bitmap, folded into its map's flags (0: data, 1: neither,
    // 2 and deeper: data and zero; QEMU's docs/interop/nbd.rst).
    prepare();
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},export=@vm1,x-dirty-bitmap=qemu:allocation-depth",
        socket.display()
    );
    let out = run_ok(d, "qemu-img", &["map", "--output=json", "--image-opts", &opts]);
    let seen = merged(json(&out.stdout).iter().map(|e| {
        let depth = match (e["data"].as_bool().expect("data"), e["zero"].as_bool().expect("zero")) {
            (true, false) => 0,
            (false, false) => 1,
            (true, true) => 2,
            other => panic!("a map entry QEMU does not make of depths: {other:?}"),
        };
        (e["start"].as_u64().expect("start"), e["length"].as_u64().expect("length"), depth)
    }));
    assert_eq!(seen, depths, "qemu-img map with qemu:allocation-depth");

    // Large structured reads send what reads as zeroes as hole chunks: the whole 24 MiB read in
    // 1 MiB requests comes back right, counted whole as the guest's reads, while the golden
    // image is read for little more than its data.
    prepare();
    let mut golden_bytes = vec![0u8; 24 * MIB as usize];
    golden_bytes[MIB as usize..3 * MIB as usize].copy_from_slice(&pseudo_random(2 * MIB as usize, 1));
    golden_bytes[10 * MIB as usize..(10 * MIB + (64 << 10)) as usize].copy_from_slice(&pseudo_random(64 << 10, 2));
    let mut expected_bytes = golden_bytes;
    expected_bytes[MIB as usize..2 * MIB as usize].fill(0);
    expected_bytes[20 * MIB as usize..(20 * MIB + 8192) as usize].copy_from_slice(&pseudo_random(8192, 3));
    let read_bytes = || {
        let samples = scrape(&metrics_url(&server));
        let golden = [("tier", "golden"), ("direction", "read")];
        (
            sample(&samples, "overspill_guest_bytes_total", &[("op", "read")]),
            sample(&samples, "overspill_storage_bytes_total", &golden),
        )
    };
    let before = read_bytes();
    let mut client = Client::connect(&vm_uri).expect("connect");
    let mut got = vec![0u8; expected_bytes.len()];
    for (i, piece) in got.chunks_mut(MIB as usize).enumerate() {
        client.read(i as u64 * MIB, piece).expect("read");
    }
    assert!(got == expected_bytes, "24 MiB read in 1 MiB structured reads differ from the VM's disk");
    let after = read_bytes();
    let (guest_read, golden_read) = (after.0 - before.0, after.1 - before.1);
    eprintln!("24 MiB read in 1 MiB structured reads: {golden_read} bytes read from the golden image");
    assert_eq!(guest_read, (24 * MIB) as f64, "the guest's reads are counted whole, holes too");
    // Golden data left under the VM's writes: 2M..3M and 10M..10M+64K (trimmed, so golden again).
    let data = (MIB + (64 << 10)) as f64;
    assert!(golden_read <= data + MIB as f64, "{golden_read} bytes of the golden image read for {data} of data");
}

#[test]
fn copying_a_mostly_empty_disk_reads_only_what_is_stored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let golden = d.join("golden.img");
    let file = std::fs::File::create(&golden).expect("golden");
    file.set_len(8 << 30).expect("8 GiB");
    let stored: [u64; 3] = [0, 3 << 30, (8 << 30) - MIB];
    for (i, &at) in stored.iter().enumerate() {
        std::os::unix::fs::FileExt::write_all_at(&file, &pseudo_random(MIB as usize, i as u64), at).expect("write");
    }
    drop(file);
    let (server, socket) = serve(d, &["--base", s(&golden)]);
    let read_bytes = || sample(&scrape(&metrics_url(&server)), "overspill_guest_bytes_total", &[("op", "read")]);

    let before = read_bytes();
    run_ok(d, "nbdcopy", &[&uri(&socket, ""), "null:"]);
    let nbdcopy = read_bytes() - before;
    let copy = d.join("copy.img");
    let before = read_bytes();
    run_ok(d, "qemu-img", &["convert", "-f", "raw", "-O", "raw", &uri(&socket, ""), s(&copy)]);
    let qemu = read_bytes() - before;
    eprintln!("an 8 GiB disk holding 3 MiB: nbdcopy read {nbdcopy} bytes, qemu-img convert {qemu}");
    // 3 MiB stored; a tool may read a little around it (qemu probes the first sectors).
    let bound = 16.0 * MIB as f64;
    assert!(nbdcopy <= bound, "nbdcopy read {nbdcopy} bytes of an 8 GiB disk holding 3 MiB");
    assert!(qemu <= bound, "qemu-img convert read {qemu} bytes of an 8 GiB disk holding 3 MiB");
    assert!(nbdcopy >= 3.0 * MIB as f64 && qemu >= 3.0 * MIB as f64, "both read the data: {nbdcopy}, {qemu}");
    let same = common::run_tool(d, "cmp", &[s(&golden), s(&copy)]);
    assert!(same.status.success(), "the copy is the disk: {}", same.all());
}

#[test]
fn cache_requests_fill_the_shared_read_cache_ahead_of_the_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let golden = d.join("golden.img");
    std::fs::write(&golden, pseudo_random(16 * MIB as usize, 5)).expect("golden");
    let (server, socket) = serve(d, &["--base", s(&golden)]);
    let fetched = || sample(&scrape(&metrics_url(&server)), "overspill_read_cache_fetched_bytes_total", &[]);
    let mut client = Client::connect(&uri(&socket, "").parse().expect("uri")).expect("connect");
    assert_eq!(
        client.transmission_flags() & overspill_nbd::wire::TFLAG_SEND_CACHE,
        overspill_nbd::wire::TFLAG_SEND_CACHE
    );
    let cookie = client.send_request(CMD_CACHE, 0, 4 * MIB, 4 * MIB as u32, &[]).expect("cache");
    client.reply(cookie, None).expect("cache answered without error");
    let after_cache = fetched();
    assert!(after_cache >= 4.0 * MIB as f64, "CACHE fetched {after_cache} bytes");
    let mut buf = vec![0u8; 4 * MIB as usize];
    client.read(4 * MIB, &mut buf).expect("read");
    assert_eq!(fetched(), after_cache, "the read found everything in the cache");
    assert!(buf == pseudo_random(16 * MIB as usize, 5)[4 * MIB as usize..8 * MIB as usize]);
    client.disconnect().expect("disconnect");
}
