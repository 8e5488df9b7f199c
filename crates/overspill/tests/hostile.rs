//! A hostile mix against one real server: slow and dribbled handshakes, silent clients, floods
//! of large reads whose replies are never read, bad VM names, malformed requests and dribbled
//! requests, all at once, while well-behaved VMs run fio with verification and TRIM. The good
//! VMs see no error, every probe connects within the handshake deadline, the server's memory
//! stays under a bound computed from its flags and returns near its idle level afterwards.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use overspill_nbd::client::{Client, NbdUri};
use overspill_nbd::request::RequestHeader;
use overspill_nbd::wire::*;
use tempfile::TempDir;

mod common;
use common::{metrics_url, pseudo_random, sample, scrape, spawn_tool, Serve};

const MIB: u64 = 1 << 20;
const GOLDEN_BYTES: usize = 64 << 20;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const RAM_TOTAL: u64 = 64 * MIB;
const READ_CACHE: u64 = 16 * MIB;
/// What a connection may hold at most (docs/security.md): replies waiting to be read (4 MiB high
/// water plus a 1 MiB slice) and its input buffer.
const PER_CONNECTION: u64 = 5 * MIB + INPUT_BUFFER;
/// A connection's input buffer.
const INPUT_BUFFER: u64 = MIB / 4;
const FLOODS: u64 = 4;

fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    line.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).expect("kB") * 1024
}

fn uri(socket: &Path, export: &str) -> NbdUri {
    format!("nbd+unix:///{export}?socket={}", socket.display()).parse().expect("uri")
}

/// A raw connection through the handshake (structured replies, GO on `export`).
fn handshaken(socket: &Path, export: &str) -> Option<UnixStream> {
    let mut s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).ok()?;
    let mut msg = Vec::new();
    put_u32(&mut msg, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    put_option(&mut msg, OPT_STRUCTURED_REPLY, &[]);
    put_option(&mut msg, OPT_GO, &info_request(export, &[]));
    s.write_all(&msg).ok()?;
    // Replies to STRUCTURED_REPLY, then INFO(s) and the ACK of GO: read until the ACK.
    loop {
        let mut head = [0u8; 20];
        s.read_exact(&mut head).ok()?;
        let (option, kind, len) = (
            u32::from_be_bytes(head[8..12].try_into().ok()?),
            u32::from_be_bytes(head[12..16].try_into().ok()?),
            u32::from_be_bytes(head[16..20].try_into().ok()?),
        );
        std::io::copy(&mut (&mut s).take(u64::from(len)), &mut std::io::sink()).ok()?;
        if kind & (1 << 31) != 0 {
            return None;
        }
        if option == OPT_GO && kind == REP_ACK {
            return Some(s);
        }
    }
}

fn request(kind: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut msg = Vec::new();
    RequestHeader { flags: 0, kind, cookie, offset, length }.encode(&mut msg);
    msg
}

/// Sends `bytes` a byte at a time until done, stopped or cut off.
fn dribble(mut s: UnixStream, bytes: &[u8], stop: &AtomicBool) {
    for byte in bytes {
        if stop.load(Ordering::Relaxed) || s.write_all(std::slice::from_ref(byte)).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn fio(dir: &Path, socket: &Path, vm: &str) -> std::process::Child {
    let uri = format!("--uri=nbd+unix:///@{vm}?socket={}", socket.display());
    spawn_tool(
        dir,
        "fio",
        &[
            "--name=good",
            "--ioengine=nbd",
            &uri,
            "--rw=randtrimwrite",
            "--bs=4k",
            "--size=32m",
            "--loops=3",
            "--iodepth=8",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    )
}

#[test]
fn a_hostile_mix_costs_the_good_vms_nothing() {
    let tmp = TempDir::new().expect("tempdir");
    let golden: PathBuf = tmp.path().join("golden.img");
    let golden_bytes = pseudo_random(GOLDEN_BYTES, 11);
    std::fs::write(&golden, &golden_bytes).expect("golden image");
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let (ram_total, read_cache) = (format!("{}M", RAM_TOTAL / MIB), format!("{}M", READ_CACHE / MIB));
    let args = [
        "--base",
        golden.to_str().expect("utf-8"),
        "--listen",
        &listen,
        "--metrics",
        "tcp:127.0.0.1:0",
        "--ram",
        "8M",
        "--ram-total",
        &ram_total,
        "--read-cache",
        &read_cache,
        "--max-connections",
        "96",
        "--max-handshakes",
        "8",
        "--handshake-timeout",
        "5s",
        "--request-timeout",
        "2s",
        "--reconnect-grace",
        "0",
    ];
    let server = Serve::start(tmp.path(), &args, &[], || UnixStream::connect(&socket).is_ok());
    let url = metrics_url(&server);
    let pid = server.child.id();
    let idle = rss(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let mut hostile: Vec<std::thread::JoinHandle<()>> = Vec::new();
    let mut held: Vec<UnixStream> = Vec::new();

    // Slowloris: connect and say nothing (twelve, for eight handshake slots).
    for _ in 0..12 {
        held.extend(UnixStream::connect(&socket).ok());
    }
    // Handshakes and requests dribbled a byte every 300 ms.
    for i in 0..4u64 {
        let (path, halt) = (socket.clone(), stop.clone());
        hostile.push(std::thread::spawn(move || {
            let Ok(s) = UnixStream::connect(&path) else { return };
            let mut hello = Vec::new();
            put_u32(&mut hello, CLIENT_FIXED_NEWSTYLE);
            put_option(&mut hello, OPT_GO, &info_request(&format!("@dribble-{i}"), &[]));
            dribble(s, &hello, &halt);
        }));
        let (path, halt) = (socket.clone(), stop.clone());
        hostile.push(std::thread::spawn(move || {
            let Some(s) = handshaken(&path, &format!("@slow-request-{i}")) else { return };
            dribble(s, &request(CMD_READ, 1, 0, 4096), &halt);
        }));
    }
    // Floods of 32 MiB reads whose replies are never read.
    for i in 0..FLOODS {
        let Some(mut s) = handshaken(&socket, &format!("@flood-{i}")) else { panic!("flood {i} not connected") };
        s.set_nonblocking(true).expect("nonblocking");
        for cookie in 0..64u64 {
            let offset = cookie % 2 * (32 * MIB);
            if s.write_all(&request(CMD_READ, cookie, offset, 32 << 20)).is_err() {
                break;
            }
        }
        held.push(s);
    }
    // Silent VMs: connected, never asking anything.
    for i in 0..8 {
        held.extend(handshaken(&socket, &format!("@silent-{i}")));
    }
    // Bad names and malformed requests, over and over while the good VMs run.
    {
        let (socket, stop) = (socket.clone(), stop.clone());
        hostile.push(std::thread::spawn(move || {
            let bad = ["@../../etc/passwd", "@a\nb", "@x y", "@.hidden", "no-such-image", "@\"{}\""];
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let name = bad[round as usize % bad.len()];
                assert!(Client::connect(&uri(&socket, name)).is_err(), "{name:?} was served");
                if let Some(mut s) = handshaken(&socket, &format!("@garbage-{}", round % 4)) {
                    let mut junk = request(CMD_WRITE, round, 0, 4096);
                    junk[..4].copy_from_slice(b"EVIL");
                    let _ = s.write_all(&junk);
                    let mut sink = [0u8; 64];
                    assert!(matches!(s.read(&mut sink), Ok(0) | Err(_)), "bad magic did not close the connection");
                }
                round += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }

    // The good VMs, and a probe that keeps connecting as a new VM would.
    let good: Vec<std::process::Child> = (0..3).map(|i| fio(tmp.path(), &socket, &format!("good-{i}"))).collect();
    let mut peak = rss(pid);
    let mut slowest = Duration::ZERO;
    let mut probes = 0;
    let mut good: Vec<(std::process::Child, Option<std::process::ExitStatus>)> =
        good.into_iter().map(|child| (child, None)).collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    while good.iter().any(|(_, status)| status.is_none()) {
        assert!(Instant::now() < deadline, "the good VMs did not finish in 4 minutes");
        let started = Instant::now();
        let mut probe = Client::connect(&uri(&socket, &format!("@probe-{}", probes % 2)))
            .unwrap_or_else(|e| panic!("a probe could not connect: {e}\n{}", server.log_text()));
        slowest = slowest.max(started.elapsed());
        probe.write(0, &[probes as u8; 4096], false).expect("probe write");
        probe.disconnect().expect("probe disconnect");
        probes += 1;
        peak = peak.max(rss(pid));
        for (child, status) in &mut good {
            if status.is_none() {
                *status = child.try_wait().expect("try_wait");
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    for (mut child, status) in good {
        let mut out = String::new();
        child.stdout.take().expect("stdout").read_to_string(&mut out).expect("fio output");
        let mut err = String::new();
        child.stderr.take().expect("stderr").read_to_string(&mut err).expect("fio errors");
        let status = status.expect("finished");
        assert!(status.success() && out.contains("err= 0"), "a good VM saw errors ({status}):\n{out}\n{err}");
        assert!(!out.contains("verify:") || !out.contains("bad"), "fio verify failed:\n{out}");
    }
    assert!(slowest < HANDSHAKE_TIMEOUT, "a probe took {slowest:?} to connect (deadline {HANDSHAKE_TIMEOUT:?})");
    assert!(probes >= 5, "only {probes} probes");

    // The dribbled requests began only once their handshakes found a slot, so on a fast machine
    // the good VMs can finish before a 2 s request timeout has run out: wait for it, bounded.
    let refused_for =
        |samples: &_, reason: &str| sample(samples, "overspill_nbd_refused_connections_total", &[("reason", reason)]);
    let cut_off_by = Instant::now() + Duration::from_secs(15);
    let samples = loop {
        let samples = scrape(&url);
        if refused_for(&samples, "request-timeout") >= 1.0 || Instant::now() > cut_off_by {
            break samples;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let refused = |reason: &str| refused_for(&samples, reason);
    assert!(refused("request-timeout") >= 1.0, "dribbled requests were not cut off in 15 s after the good VMs");
    assert!(refused("handshake-shed") + refused("handshake-timeout") >= 1.0, "slow handshakes were never cut");
    // The bound: idle, every VM's cache memory (--ram-total), the read cache, the most each
    // flood may hold, an input buffer for every other connection, and 32 MiB for the allocator
    // and thread stacks. (Before replies were sliced, each flood held ~40 MiB.)
    let others = 12 + 4 + 4 + 8 + 3 + 2;
    let bound = idle + RAM_TOTAL + READ_CACHE + FLOODS * PER_CONNECTION + others * INPUT_BUFFER + 32 * MIB;
    assert!(peak < bound, "RSS peaked at {} MiB, over the bound of {} MiB", peak / MIB, bound / MIB);

    // Everyone leaves: memory comes back near idle (the read cache stays warm).
    stop.store(true, Ordering::Relaxed);
    drop(held);
    for thread in hostile {
        thread.join().expect("a hostile client's own assertion failed");
    }
    let settle = Instant::now() + Duration::from_secs(20);
    let near_idle = idle + READ_CACHE + 24 * MIB;
    while rss(pid) > near_idle {
        assert!(
            Instant::now() < settle,
            "RSS {} MiB after everyone left (idle {} MiB, peak {} MiB)",
            rss(pid) / MIB,
            idle / MIB,
            peak / MIB
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "hostile mix: idle {} MiB, peak {} MiB (bound {} MiB), after {} MiB; {probes} probes, slowest {slowest:?}",
        idle / MIB,
        peak / MIB,
        bound / MIB,
        rss(pid) / MIB
    );
    assert!(std::fs::read(&golden).expect("golden") == golden_bytes, "the golden image was written");
}

/// A client asking again and again for exports that do not exist, or for VM names the server
/// refuses, each name as long as a string may be (and some longer), costs the log a line or two
/// per connection, each a few hundred bytes: not a line per question, nor the names whole (a
/// flood of those once filled the log queue faster than it drained, gigabytes of it).
#[test]
fn refused_exports_asked_for_again_and_again_cost_the_log_little() {
    let tmp = TempDir::new().expect("tempdir");
    let golden = tmp.path().join("golden.img");
    std::fs::write(&golden, vec![7u8; 1 << 20]).expect("golden image");
    let socket = tmp.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let ready = socket.clone();
    let server = Serve::start(
        tmp.path(),
        &["--base", golden.to_str().expect("utf-8"), "--listen", &listen],
        &[("RUST_LOG", "info")],
        move || UnixStream::connect(&ready).is_ok(),
    );
    let before = server.log_text().len();
    const ASKS: usize = 500;
    for export in [format!("nosuch{}", "\u{1}".repeat(4090)), format!("@{}", "\u{1}".repeat(4095)), "x".repeat(5000)] {
        let mut s = UnixStream::connect(&socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).expect("greeting");
        let mut msg = Vec::new();
        put_u32(&mut msg, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
        for _ in 0..ASKS {
            put_option(&mut msg, OPT_GO, &info_request(&export, &[]));
        }
        let mut writer = s.try_clone().expect("clone");
        let sending = std::thread::spawn(move || writer.write_all(&msg));
        let mut errors = 0;
        while errors < ASKS {
            let mut head = [0u8; 20];
            s.read_exact(&mut head).expect("an option reply");
            let (kind, len) = (
                u32::from_be_bytes(head[12..16].try_into().expect("4")),
                u32::from_be_bytes(head[16..20].try_into().expect("4")),
            );
            std::io::copy(&mut (&mut s).take(u64::from(len)), &mut std::io::sink()).expect("reply data");
            assert!(kind & (1 << 31) != 0, "each is refused");
            errors += 1;
        }
        sending.join().expect("sender").expect("sent");
    }
    std::thread::sleep(Duration::from_millis(300));
    let grown = server.log_text().len() - before;
    eprintln!("{} refused asks over 3 connections: {grown} bytes of log", 3 * ASKS);
    assert!(grown < 8 << 10, "{grown} bytes of log:\n{}", &server.log_text()[before..]);
}
