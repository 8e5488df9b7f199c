//! Writes the committed seed corpora (`fuzz/corpus/<target>/seed-*`): what real clients send,
//! so the fuzzers start from deep inside the protocol (and, for `engine`, the engine). Run from
//! fuzz/: `cargo run --example seeds`.

use overspill_fuzz::*;
use overspill_nbd::handshake::MAX_OPTION_BYTES;
use overspill_nbd::wire::*;

fn flags(no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::new();
    put_u32(&mut out, CLIENT_FIXED_NEWSTYLE | if no_zeroes { CLIENT_NO_ZEROES } else { 0 });
    out
}

/// qemu-nbd/qemu-img as a client: structured replies, a meta context, GO asking block sizes.
fn qemu(export: &str) -> Vec<u8> {
    qemu_with(export, &[BASE_ALLOCATION], false)
}

/// A client selecting `contexts`, after listing them all when `list` (`nbdinfo
/// --map=qemu:allocation-depth`; qemu-img map over a layered export asks both).
fn qemu_with(export: &str, contexts: &[&str], list: bool) -> Vec<u8> {
    let mut out = flags(true);
    option(&mut out, OPT_STRUCTURED_REPLY, &[]);
    if list {
        option(&mut out, OPT_LIST_META_CONTEXT, &meta_context_request(export, &[]));
    }
    option(&mut out, OPT_SET_META_CONTEXT, &meta_context_request(export, contexts));
    option(&mut out, OPT_GO, &go_data(export, &[INFO_BLOCK_SIZE]));
    out
}

/// `nbdinfo --list`: LIST, INFO on each export with name and description, then ABORT.
fn nbdinfo_list() -> Vec<u8> {
    let mut out = flags(true);
    option(&mut out, OPT_STRUCTURED_REPLY, &[]);
    option(&mut out, OPT_LIST, &[]);
    option(&mut out, OPT_INFO, &go_data(EXPORT_NAME, &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]));
    option(&mut out, OPT_ABORT, &[]);
    out
}

/// Everything the server must refuse without closing, then ABORT.
fn refusals() -> Vec<u8> {
    let mut out = flags(false);
    option(&mut out, OPT_GO, &go_data("nope", &[]));
    let mut bad = go_data(EXPORT_NAME, &[INFO_NAME]);
    bad.pop();
    option(&mut out, OPT_INFO, &bad);
    option(&mut out, OPT_LIST, b"x");
    option(&mut out, OPT_STRUCTURED_REPLY, b"x");
    option(&mut out, OPT_STARTTLS, &[]);
    option(&mut out, 42, b"whatever");
    option(&mut out, OPT_ABORT, &[]);
    out
}

/// Options whose data is over the server's limit, skipped and answered; the last one aborts.
fn oversized() -> Vec<u8> {
    let mut out = flags(false);
    let big = vec![0x5a; MAX_OPTION_BYTES as usize + 1];
    option(&mut out, 42, &big);
    option(&mut out, OPT_GO, &big);
    option(&mut out, OPT_ABORT, &big);
    out
}

/// A client of a TLS-only server: tries its luck in plain text, upgrades, lists and goes.
fn tls_client() -> Vec<u8> {
    let mut out = flags(true);
    option(&mut out, OPT_STRUCTURED_REPLY, &[]);
    option(&mut out, OPT_LIST, &[]);
    option(&mut out, OPT_STARTTLS, &[]);
    option(&mut out, OPT_STARTTLS, &[]);
    option(&mut out, OPT_LIST, &[]);
    option(&mut out, OPT_GO, &go_data(EXPORT_NAME, &[INFO_NAME]));
    out
}

fn old_client() -> Vec<u8> {
    let mut out = flags(false);
    option(&mut out, OPT_EXPORT_NAME, EXPORT_NAME.as_bytes());
    out
}

/// A session a VM would have: write, read it back, flush, trim, zero, disconnect.
fn session() -> Vec<u8> {
    let mut out = Vec::new();
    request(&mut out, CMD_WRITE, CMD_FLAG_FUA, 4096, 512, &[0xab; 512]);
    request(&mut out, CMD_READ, 0, 4096, 512, &[]);
    request(&mut out, CMD_FLUSH, 0, 0, 0, &[]);
    request(&mut out, CMD_TRIM, 0, 0, 4096, &[]);
    request(&mut out, CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 8192, 4096, &[]);
    request(&mut out, CMD_READ, 0, 0, 0, &[]);
    request(&mut out, CMD_CACHE, 0, 0, 65536, &[]);
    request(&mut out, CMD_BLOCK_STATUS, 0, 0, 1 << 20, &[]);
    request(&mut out, CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4096, 8192, &[]);
    request(&mut out, CMD_DISC, 0, 0, 0, &[]);
    out
}

/// Requests a server must refuse one by one without closing.
fn bad_requests() -> Vec<u8> {
    let end = EXPORT_SIZE as u64;
    let mut out = Vec::new();
    request(&mut out, CMD_READ, 0, end - 1, 2, &[]);
    request(&mut out, CMD_WRITE, 0, end, 1, &[0]);
    request(&mut out, CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, u64::MAX, 2, &[]);
    request(&mut out, 9, 0, 0, 0, &[]);
    request(&mut out, CMD_FLUSH, CMD_FLAG_FUA, 0, 0, &[]);
    request(&mut out, CMD_READ, 0, 0, u32::MAX, &[]);
    out
}

/// One 4 KiB write per block of `blocks`, every third with FUA.
fn block_writes(out: &mut Vec<u8>, blocks: std::ops::Range<u64>, byte: u8) {
    for block in blocks {
        let flags = if block % 3 == 0 { CMD_FLAG_FUA } else { 0 };
        request(out, CMD_WRITE, flags, block * 4096, 4096, &[byte ^ block as u8; 4096]);
    }
}

/// `engine`: a VM's session past its 16-block memory target, so it spills, then reads,
/// trims, zeroes and flushes; `disc` ends it with NBD_CMD_DISC, else the connection is lost.
fn spilling_session(disc: bool) -> Vec<u8> {
    let mut out = Vec::new();
    block_writes(&mut out, 0..20, 0x11);
    request(&mut out, CMD_READ, 0, 0, 20 * 4096, &[]);
    request(&mut out, CMD_TRIM, 0, 4096, 4 * 4096, &[]);
    request(&mut out, CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 8 * 4096, 2 * 4096, &[]);
    request(&mut out, CMD_FLUSH, 0, 0, 0, &[]);
    request(&mut out, CMD_READ, 0, 0, 24 * 4096, &[]);
    if disc {
        request(&mut out, CMD_DISC, 0, 0, 0, &[]);
    }
    out
}

/// `engine`: `@full` is 8 blocks short of its spill limit, its first segment on disk: of
/// `new` fresh blocks the 9th gets ENOSPC; overwriting and trimming sealed blocks makes
/// garbage that compaction turns into room for the next writes.
fn full_session(new: u64, disc: bool) -> Vec<u8> {
    let mut out = Vec::new();
    block_writes(&mut out, 1536..1536 + new, 0x22);
    block_writes(&mut out, 0..2, 0x33);
    request(&mut out, CMD_TRIM, 0, 64 * 4096, 256 * 4096, &[]);
    block_writes(&mut out, 1600..1600 + new, 0x44);
    request(&mut out, CMD_READ, 0, 60 * 4096, 8 * 4096, &[]);
    request(&mut out, CMD_READ, 0, 1530 * 4096, 80 * 4096, &[]);
    request(&mut out, CMD_FLUSH, 0, 0, 0, &[]);
    if disc {
        request(&mut out, CMD_DISC, 0, 0, 0, &[]);
    }
    out
}

/// `request` input: header, export size, maximum payload, capability bits.
fn request_seed(kind: u16, flags: u16, offset: u64, length: u32, size: u64, max: u32, caps: u8) -> Vec<u8> {
    let mut out = Vec::new();
    request(&mut out, kind, flags, offset, length, &[]);
    put_u64(&mut out, size);
    put_u32(&mut out, max);
    out.push(caps);
    out
}

/// VHDX files as `vhdx` inputs: the target's parent disk itself, a dynamic disk with every
/// block state, a fixed one, one with 4 KiB sectors, and differencing disks on the parent (one
/// with a stale parent_linkage, one whose parent is missing, one on itself).
/// Small qcow2 files qemu-img makes (512-byte and 4 KiB clusters keep them a few KiB): data, zero
/// clusters and holes, compressed with zlib and zstd, version 2, and one on `parent.img` (the raw
/// backing file the target keeps beside its input). Needs qemu-img and qemu-io.
fn qcow2_seeds() -> std::io::Result<Vec<(&'static str, Vec<u8>)>> {
    use std::process::Command;
    let dir = std::env::temp_dir().join(format!("overspill-qcow2-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let run = |program: &str, args: &[&str]| -> std::io::Result<()> {
        let status = Command::new(program).args(args).current_dir(&dir).stdout(std::process::Stdio::null()).status()?;
        if status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!("{program} {args:?}: {status}")))
        }
    };
    let writes = ["write -P 0x11 0 3k", "write -P 0x22 64k 8k", "write -z 8k 4k", "write -P 0x33 900k 4k"];
    let mut seeds = Vec::new();
    for (name, options, compress, backing) in [
        ("v3-512", "compat=1.1,cluster_size=512", false, false),
        ("v2-4k", "compat=0.10,cluster_size=4096", false, false),
        ("zlib-4k", "cluster_size=4096,compression_type=zlib", true, false),
        ("zstd-4k", "cluster_size=4096,compression_type=zstd", true, false),
        ("on-parent", "cluster_size=4096", false, true),
    ] {
        let file = format!("{name}.qcow2");
        let plain = format!("{name}.plain.qcow2");
        let mut create = vec!["create", "-q", "-f", "qcow2", "-o", options];
        if backing {
            create.extend(["-F", "raw", "-b", "parent.img"]);
            std::fs::write(dir.join("parent.img"), vec![7u8; 1 << 20])?;
        }
        create.extend([plain.as_str(), "1M"]);
        run("qemu-img", &create)?;
        let mut io = vec!["-f", "qcow2"];
        for write in writes {
            io.extend(["-c", write]);
        }
        io.push(&plain);
        run("qemu-io", &io)?;
        if compress {
            run("qemu-img", &["convert", "-c", "-f", "qcow2", "-O", "qcow2", "-o", options, &plain, &file])?;
        } else {
            std::fs::rename(dir.join(&plain), dir.join(&file))?;
        }
        seeds.push((name, std::fs::read(dir.join(&file))?));
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(seeds)
}

fn vhdx_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use overspill_fuzz::vhdx_builder::{guid_from, Block, Spec, MIB};
    let input = |spec: &Spec| {
        let layout = spec.layout();
        vhdx_input(layout.len, &layout.pieces)
    };
    let parent = vhdx_parent();
    let mut dynamic = Spec::new(6 * MIB, MIB as u32)
        .block(0, Block::Full(vec![0x11; 700]))
        .block(1, Block::Zero)
        .block(2, Block::Unmapped)
        .block(3, Block::Undefined)
        .block(5, Block::Full(vec![0x22; 512]));
    let mut fixed = Spec::new(3 * MIB + 512, MIB as u32);
    fixed.fixed = true;
    for i in 0..4 {
        fixed = fixed.block(i, Block::Full(vec![i as u8 + 1; 64]));
    }
    let mut big_sectors = Spec::new(4 * MIB, MIB as u32).block(2, Block::Full(vec![0x33; 4096]));
    big_sectors.logical_sector = 4096;
    dynamic.data_write_guid = guid_from(1);
    big_sectors.data_write_guid = guid_from(2);
    let child = |linkage: &[u8; 16], path: &str| {
        Spec::new(8 * MIB, MIB as u32)
            .on_parent(path, linkage)
            .block(0, Block::Partial { data: vec![0x44; 4096], present: vec![false, true, true, false, false, true] })
            .block(1, Block::Full(vec![0x55; 100]))
            .block(3, Block::Partial { data: vec![0x66; 512], present: vec![true] })
            .block(6, Block::Zero)
    };
    vec![
        ("parent", input(&parent)),
        ("dynamic", input(&dynamic)),
        ("fixed", input(&fixed)),
        ("4k-sectors", input(&big_sectors)),
        ("differencing", input(&child(&parent.data_write_guid, "parent.vhdx"))),
        ("differencing-stale-parent", input(&child(&guid_from(9), ".\\parent.vhdx"))),
        ("differencing-missing-parent", input(&child(&parent.data_write_guid, "..\\gone\\parent.vhdx"))),
        ("differencing-on-itself", input(&child(&guid_from(3), "disk.vhdx"))),
    ]
}

fn main() -> std::io::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let all = 0b11_1110; // every capability, writable
    let seeds: Vec<(&str, &str, Vec<u8>)> = vec![
        ("handshake", "qemu", handshake_input(&[], 0, &qemu(EXPORT_NAME))),
        ("handshake", "qemu-bytewise", handshake_input(&[1], 0, &qemu(EXPORT_NAME))),
        ("handshake", "qemu-default-export", handshake_input(&[3, 0, 17], HS_DEFAULT_EXPORT, &qemu(""))),
        (
            "handshake",
            "qemu-depth",
            handshake_input(&[], 0, &qemu_with(EXPORT_NAME, &[BASE_ALLOCATION, ALLOCATION_DEPTH], true)),
        ),
        ("handshake", "nbdinfo-list", handshake_input(&[7, 20], 0, &nbdinfo_list())),
        ("handshake", "refusals", handshake_input(&[], 0, &refusals())),
        ("handshake", "oversized", handshake_input(&[200, 0, 97], 0, &oversized())),
        ("handshake", "export-name", handshake_input(&[2], 0, &[old_client(), session()].concat())),
        ("handshake", "tls-require", handshake_input(&[5], HS_TLS_REQUIRE | HS_ACCESS | HS_ALICE, &tls_client())),
        ("handshake", "tls-on-mallory", handshake_input(&[], HS_TLS_ON | HS_ACCESS, &tls_client())),
        ("request", "read", request_seed(CMD_READ, 0, 0, 4096, 1 << 20, 1 << 16, all)),
        ("request", "write-fua", request_seed(CMD_WRITE, CMD_FLAG_FUA, 4096, 4096, 1 << 20, 1 << 16, all)),
        ("request", "trim-at-end", request_seed(CMD_TRIM, 0, (1 << 20) - 512, 512, 1 << 20, 1 << 16, all)),
        (
            "request",
            "zeroes-fast",
            request_seed(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO, 0, 1 << 20, 1 << 20, 4096, 0b11_1111),
        ),
        ("request", "flush", request_seed(CMD_FLUSH, 0, 0, 0, 1 << 20, 4096, all)),
        ("request", "cache", request_seed(CMD_CACHE, 0, 0, 1 << 20, 1 << 20, 4096, all)),
        (
            "request",
            "block-status-one",
            request_seed(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4096, 8192, 1 << 20, 4096, all),
        ),
        ("request", "disc", request_seed(CMD_DISC, 0, u64::MAX, u32::MAX, 0, 0, 0)),
        ("request", "read-overflow", request_seed(CMD_READ, 0, u64::MAX - 1, 4096, u64::MAX, u32::MAX, all)),
        ("server", "qemu-session", [vec![0], qemu(EXPORT_NAME), session()].concat()),
        (
            "server",
            "depth-session",
            [vec![0], qemu_with(EXPORT_NAME, &[ALLOCATION_DEPTH, BASE_ALLOCATION], true), session()].concat(),
        ),
        ("server", "go-session", [vec![1], session()].concat()),
        ("server", "structured-bad-requests", [vec![2], bad_requests(), session()].concat()),
        ("server", "export-name-session", [vec![3], session()].concat()),
        ("server", "refusals", [vec![0], refusals()].concat()),
        ("server", "nbdinfo-list", [vec![0], nbdinfo_list()].concat()),
    ];
    let (go, sgo, raw, export_name) = (1, 2, 0, 3);
    let engine = [
        ("go-spill-session", engine_input(go | ENGINE_DEFAULT, b"", &spilling_session(true))),
        ("export-name-spill-lost", engine_input(export_name | ENGINE_DEFAULT, b"", &spilling_session(false))),
        ("vm-lost-again", engine_input(go | ENGINE_NAMED | ENGINE_AGAIN, b"", &spilling_session(false))),
        (
            "vm-restart-again",
            engine_input(sgo | ENGINE_NAMED | ENGINE_RESTART | ENGINE_AGAIN, b"", &spilling_session(false)),
        ),
        ("full-enospc", engine_input(sgo | ENGINE_FULL, b"", &full_session(10, true))),
        ("full-restart", engine_input(go | ENGINE_FULL | ENGINE_RESTART, b"", &full_session(3, false))),
        ("raw-qemu-full", engine_input(raw | ENGINE_FULL, b"", &[qemu("@full"), full_session(3, true)].concat())),
        ("raw-nbdinfo-list", engine_input(raw | ENGINE_DEFAULT, b"", &nbdinfo_list())),
        ("name-ok-restart", engine_input(sgo | ENGINE_NAME_FROM_INPUT | ENGINE_RESTART, b"@Win7.pool_3", &session())),
        ("bad-name-dotdot", engine_input(go | ENGINE_NAME_FROM_INPUT, b"@../x", &session())),
        ("bad-name-newline", engine_input(export_name | ENGINE_NAME_FROM_INPUT, b"@a\nb", &session())),
        ("bad-name-slash", engine_input(go | ENGINE_NAME_FROM_INPUT, b"@a/../../b", &session())),
        ("bad-name-not-utf8", engine_input(go | ENGINE_NAME_FROM_INPUT, b"@\xff\xfe", &session())),
        (
            "bad-name-too-long",
            engine_input(sgo | ENGINE_NAME_FROM_INPUT, format!("@{}", "x".repeat(65)).as_bytes(), &session()),
        ),
        ("unknown-image", engine_input(go | ENGINE_NAME_FROM_INPUT, b"nope@vm-1", &session())),
    ];
    let seeds = seeds.into_iter().chain(engine.into_iter().map(|(name, bytes)| ("engine", name, bytes)));
    // A write whose payload never comes: the client goes away mid-message.
    let mut truncated = vec![1];
    request(&mut truncated, CMD_WRITE, 0, 0, 4096, &[1; 100]);
    let seeds = seeds.into_iter().chain([("server", "truncated-write", truncated)]);
    let seeds = seeds.into_iter().chain(vhdx_seeds().into_iter().map(|(name, bytes)| ("vhdx", name, bytes)));
    let seeds = seeds.into_iter().chain(qcow2_seeds()?.into_iter().map(|(name, bytes)| ("qcow2", name, bytes)));
    for (target, name, bytes) in seeds {
        std::fs::create_dir_all(dir.join(target))?;
        std::fs::write(dir.join(target).join(format!("seed-{name}")), bytes)?;
    }
    Ok(())
}
