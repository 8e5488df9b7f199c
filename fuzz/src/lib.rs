//! The fuzz crate of overspill: libFuzzer targets for the NBD protocol crate and the engine-backed
//! server, and what they share.
//!
//! It owns the targets in `fuzz_targets/` (`handshake`, `request`, `server`, `engine` for the
//! NBD side, `vhdx` and `qcow2` for the golden image readers), the layout of their inputs (defined here, so that `examples/seeds.rs` writes the committed seed
//! corpora in the same layout), and a reference reading of the wire that the targets check the
//! server against. It is a workspace of its own, built only by `cargo fuzz`: see docs/fuzzing.md.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use overspill_nbd::handshake::Handshake;
use overspill_nbd::wire::*;

/// The export every target serves: small, so that reads the fuzzer asks for stay cheap, and
/// a power of two that the fuzzer's "interesting" integers hit at the edge.
pub const EXPORT_SIZE: usize = 256 * 1024;
pub const EXPORT_NAME: &str = "disk";

// The client's side of the option encoding is the protocol crate's own.
pub use overspill_nbd::wire::{info_request as go_data, put_option as option};

/// A transmission request with its payload.
pub fn request(out: &mut Vec<u8>, kind: u16, flags: u16, offset: u64, length: u32, data: &[u8]) {
    overspill_nbd::request::RequestHeader { flags, kind, cookie: out.len() as u64, offset, length }.encode(out);
    out.extend_from_slice(data);
}

/// `server` input: the first byte picks a client-side prefix, so that the fuzzer spends its time
/// on transmission requests instead of rediscovering a valid handshake each time.
pub fn server_prefix(mode: u8) -> Vec<u8> {
    let mut out = Vec::new();
    match mode % 4 {
        0 => {}
        1 => {
            put_u32(&mut out, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
            option(&mut out, OPT_GO, &go_data(EXPORT_NAME, &[]));
        }
        2 => {
            put_u32(&mut out, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
            option(&mut out, OPT_STRUCTURED_REPLY, &[]);
            option(&mut out, OPT_GO, &go_data(EXPORT_NAME, &[INFO_BLOCK_SIZE]));
        }
        _ => {
            // The oldest fixed-newstyle client: 124 zero bytes of padding, no GO.
            put_u32(&mut out, CLIENT_FIXED_NEWSTYLE);
            option(&mut out, OPT_EXPORT_NAME, EXPORT_NAME.as_bytes());
        }
    }
    out
}

/// `request` input: a raw 28-byte header, then export size (u64), maximum payload (u32) and a
/// capability bit set (u8, in [`overspill_block::Capabilities`] field order); missing bytes read as zero.
pub const REQUEST_INPUT_BYTES: usize = REQUEST_HEADER_BYTES + 8 + 4 + 1;

/// `handshake` input: a head byte, `n` chunk sizes the client stream is fed in (cycled; 0 means
/// "call again with nothing new"; `n == 0` feeds it whole), then the stream. The head byte holds
/// `n` in its low 3 bits and the `HS_*` bits below.
pub fn handshake_input(chunks: &[u8], head_bits: u8, stream: &[u8]) -> Vec<u8> {
    assert!(chunks.len() < 8 && head_bits & 7 == 0);
    let mut out = vec![chunks.len() as u8 | head_bits];
    out.extend_from_slice(chunks);
    out.extend_from_slice(stream);
    out
}

/// Head bits 3-4, the TLS mode: off, on, require (2 and 3). STARTTLS acknowledged, the target
/// carries on as if the TLS handshake had succeeded.
pub const HS_TLS_ON: u8 = 1 << 3;
pub const HS_TLS_REQUIRE: u8 = 2 << 3;
/// Access control: only the TLS identity "alice" may see the export.
pub const HS_ACCESS: u8 = 1 << 5;
/// The identity TLS proves is "alice" (else "mallory").
pub const HS_ALICE: u8 = 1 << 6;
/// The export is the default one, "", instead of [`EXPORT_NAME`].
pub const HS_DEFAULT_EXPORT: u8 = 1 << 7;

/// One option reply: (option, reply type, payload).
pub type Reply<'a> = (u32, u32, &'a [u8]);

/// Splits server output into option replies, stopping at the first bytes that are not one;
/// returns the replies and what is left.
pub fn option_replies(mut out: &[u8]) -> (Vec<Reply<'_>>, &[u8]) {
    let mut all = Vec::new();
    while out.len() >= 20 && be_u64(out) == OPTION_REPLY_MAGIC {
        let len = be_u32(&out[16..]) as usize;
        let Some(payload) = out.get(20..20 + len) else { break };
        all.push((be_u32(&out[8..]), be_u32(&out[12..]), payload));
        out = &out[20 + len..];
    }
    (all, out)
}

/// `engine` input: a mode byte, then, when its export bits are [`ENGINE_NAME_FROM_INPUT`], a
/// length byte and that many bytes of export name (sent as they are: not always UTF-8, nor
/// always `IMAGE@VM`), then the client's stream. The mode's low two bits pick the handshake the
/// target sends before the stream, as for `server`, but naming the chosen export: none (the
/// stream has its own), GO, structured replies and GO, or EXPORT_NAME.
pub fn engine_input(mode: u8, name: &[u8], stream: &[u8]) -> Vec<u8> {
    let mut out = vec![mode];
    if mode & ENGINE_EXPORT_BITS == ENGINE_NAME_FROM_INPUT {
        let len = u8::try_from(name.len()).expect("a name from the input is at most 255 bytes");
        out.push(len);
        out.extend_from_slice(name);
    }
    out.extend_from_slice(stream);
    out
}

/// Splits an `engine` input into mode, export name and client stream; `None` for an empty one.
/// A name cut short by the input's end is what there is of it.
pub fn engine_split(data: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&mode, rest) = data.split_first()?;
    Some(match mode & ENGINE_EXPORT_BITS {
        ENGINE_NAME_FROM_INPUT => {
            let (&len, rest) = rest.split_first().unwrap_or((&0, &[]));
            let (name, rest) = rest.split_at(usize::from(len).min(rest.len()));
            (mode, name, rest)
        }
        bits => (mode, ENGINE_EXPORTS[usize::from(bits >> 2)].as_bytes(), rest),
    })
}

/// The handshake an `engine` mode sends before the fuzzed stream.
pub fn engine_prefix(mode: u8, name: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match mode & 3 {
        0 => {}
        1 => {
            put_u32(&mut out, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
            option(&mut out, OPT_GO, &go_data_bytes(name, &[]));
        }
        2 => {
            put_u32(&mut out, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
            option(&mut out, OPT_STRUCTURED_REPLY, &[]);
            option(&mut out, OPT_GO, &go_data_bytes(name, &[INFO_BLOCK_SIZE]));
        }
        _ => {
            put_u32(&mut out, CLIENT_FIXED_NEWSTYLE);
            option(&mut out, OPT_EXPORT_NAME, name);
        }
    }
    out
}

/// GO or INFO data for a name of any bytes ([`go_data`] takes a `&str`).
pub fn go_data_bytes(name: &[u8], requests: &[u16]) -> Vec<u8> {
    let mut data = Vec::new();
    put_u32(&mut data, name.len() as u32);
    data.extend_from_slice(name);
    put_u16(&mut data, requests.len() as u16);
    for &r in requests {
        put_u16(&mut data, r);
    }
    data
}

/// `engine` mode bits 2-3: the export the handshake names, an index into [`ENGINE_EXPORTS`]
/// or a name from the input.
pub const ENGINE_EXPORT_BITS: u8 = 3 << 2;
/// The golden image's default export: an anonymous VM, its overlay ending with its connection.
pub const ENGINE_DEFAULT: u8 = 0;
/// A named VM, `@vm-1`: its overlay is kept (state files and all) when its connection is lost.
pub const ENGINE_NAMED: u8 = 1 << 2;
/// `@full`, a named VM the target fills before the input, to a few blocks short of its spill
/// limit: its first segment sealed and on disk, so the input's writes hit ENOSPC, overwrite
/// spilled blocks and make compaction run.
pub const ENGINE_FULL: u8 = 2 << 2;
pub const ENGINE_NAME_FROM_INPUT: u8 = 3 << 2;
pub const ENGINE_EXPORTS: [&str; 3] = ["", "@vm-1", "@full"];
/// After the input's connection: the server stops, handing its VMs in grace over to the next
/// one (their state in files), and a new server rebuilds them; each must read back the same.
pub const ENGINE_RESTART: u8 = 1 << 4;
/// The same handshake and stream once more on a new connection (after the restart, if there
/// is one): a named VM whose connection was lost resumes its overlay.
pub const ENGINE_AGAIN: u8 = 1 << 5;

/// Plays a fuzz input as a client: `input` is written from another thread (the server may answer
/// a large read before it reads on, and both sides blocking on write would be our deadlock, not
/// the server's), then the client half-closes; reads until the server closes. Panics if the
/// server neither answers nor closes within `patience`, or never greeted.
pub fn play(client: UnixStream, input: Vec<u8>, patience: Duration) {
    client.set_read_timeout(Some(patience)).expect("read timeout");
    let mut writer = client.try_clone().expect("clone");
    let feeder = std::thread::spawn(move || {
        // The server may close first (bad magic, say): EPIPE is an answer, not a failure.
        let _ = writer.write_all(&input);
        let _ = writer.shutdown(Shutdown::Write);
    });
    let mut client = client;
    let (mut heard, mut buf) = (Vec::new(), vec![0u8; 64 * 1024]);
    loop {
        match client.read(&mut buf) {
            Ok(0) => break,
            Ok(n) if heard.len() < 18 => heard.extend_from_slice(&buf[..n]),
            Ok(_) => {}
            // Closing with our bytes unread resets the connection: that is closing too.
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("server neither answered nor closed within {patience:?}: {e}"),
        }
    }
    feeder.join().expect("feeder");
    assert!(heard.starts_with(&Handshake::greeting()), "no greeting: {heard:02x?}");
}

/// Removes `dir` when libFuzzer exits (it calls `exit`, so statics are never dropped); a run
/// that crashes leaves it for a look. One directory a process.
pub fn remove_at_exit(dir: &Path) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    extern "C" fn remove() {
        if let Some(dir) = DIR.get() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    if DIR.set(dir.to_owned()).is_ok() {
        // SAFETY: `remove` is an `extern "C" fn()` that lives as long as the process and does
        // not unwind (it ignores the one error it can meet).
        unsafe { libc::atexit(remove) };
    }
}

/// A work directory for an image target's files, made once per process (in /dev/shm where there
/// is one: inputs are written there thousands of times a second) and removed when libFuzzer
/// exits; `prepare` writes what the target keeps beside its inputs (a parent disk).
pub fn image_work_dir(target: &str, prepare: impl FnOnce(&Path)) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let parent = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
    let dir = parent.join(format!("overspill-fuzz-{target}-{}", std::process::id()));
    // A directory of a process with this pid that died without cleaning up.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating the work directory");
    remove_at_exit(&dir);
    prepare(&dir);
    dir
}

/// What every image that opened must do, whatever its file held: read anywhere without
/// panicking (`reads`: offset and length of each, past the end included, which must read as
/// zeroes), and describe the extents of its first `span` bytes so that they tile no more than
/// that, none is empty, and what they call a hole or zeroes reads as zeroes.
pub fn check_image(image: &dyn overspill_engine::GoldenImage, reads: &[(u64, usize)], span: u64) {
    use overspill_engine::Allocation;
    let size = image.size();
    let _ = image.describe();
    let _ = image.identity();
    for &(at, len) in reads {
        let mut buf = vec![0xeeu8; len];
        if image.read_at(&mut buf, at).is_ok() && at >= size {
            assert!(buf.iter().all(|&b| b == 0), "bytes past the end read as zero");
        }
    }
    let span = size.min(span);
    let Ok(extents) = image.extents(0, span) else { return };
    let total: u64 = extents.iter().map(|e| e.len).sum();
    assert!(total > 0 || span == 0, "no extent for {span} bytes");
    assert!(total <= span, "extents of {total} bytes for {span}");
    assert!(extents.iter().all(|e| e.len > 0), "an empty extent");
    let mut at = 0u64;
    for extent in extents.iter().take(64) {
        if extent.state != Allocation::Data {
            let mut buf = vec![0xeeu8; extent.len.min(1 << 20) as usize];
            if image.read_at(&mut buf, at).is_ok() {
                assert!(buf.iter().all(|&b| b == 0), "{extent:?} at {at} reads as data");
            }
        }
        at += extent.len;
    }
}

/// The VHDX file writer of overspill-images' tests, shared so that the `vhdx` target's parent
/// disk and seeds are files written to the spec.
#[path = "../../crates/overspill-images/tests/common/vhdx_builder.rs"]
pub mod vhdx_builder;

/// The largest file a `vhdx` input makes: room for the header section, log, metadata, BAT and
/// a dozen 1 MiB blocks, which is all the reader's structures need.
pub const VHDX_MAX_FILE: u64 = 16 << 20;

/// `vhdx` input: a sparse file, so that an input of a few kilobytes can place structures at the
/// 1 MiB-aligned offsets the format puts them at. A little-endian u32 file length (taken modulo
/// [`VHDX_MAX_FILE`] + 1), then records: a u32 offset, a u16 length and that many bytes, written
/// at the offset (what falls past the file's end is dropped); the rest of the file is zeroes.
/// The target reads each input twice: as it is, and with the header and region table checksums
/// recomputed, so that the fuzzer's changes get past them.
pub fn vhdx_file(data: &[u8]) -> Vec<u8> {
    let Some((len, mut rest)) = data.split_first_chunk::<4>() else { return Vec::new() };
    let len = u64::from(u32::from_le_bytes(*len)) % (VHDX_MAX_FILE + 1);
    let mut file = vec![0u8; len as usize];
    while let Some((head, tail)) = rest.split_first_chunk::<6>() {
        let offset = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let n = usize::from(u16::from_le_bytes([head[4], head[5]])).min(tail.len());
        let (bytes, next) = tail.split_at(n);
        if let Some(dest) = file.get_mut(offset..) {
            let fit = dest.len().min(n);
            dest[..fit].copy_from_slice(&bytes[..fit]);
        }
        rest = next;
    }
    file
}

/// A `vhdx` input for a file of `len` bytes whose bytes that are not zero are `pieces`: a record
/// for each run of them (runs less than 32 zero bytes apart are one), so that a table of mostly
/// zero entries makes a short input.
pub fn vhdx_input(len: u64, pieces: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut out = (len as u32).to_le_bytes().to_vec();
    for (offset, bytes) in pieces {
        let mut at = 0;
        while let Some(start) = bytes[at..].iter().position(|&b| b != 0).map(|p| at + p) {
            let mut end = start + 1;
            while end < bytes.len() && end - start < usize::from(u16::MAX) {
                match bytes[end..].iter().take(32).position(|&b| b != 0) {
                    Some(p) => end += p + 1,
                    None => break,
                }
            }
            let end = end.min(start + usize::from(u16::MAX));
            out.extend(((*offset as usize + start) as u32).to_le_bytes());
            out.extend(((end - start) as u16).to_le_bytes());
            out.extend(&bytes[start..end]);
            at = end;
        }
    }
    out
}

/// The `vhdx` target's parent disk, in its directory as `parent.vhdx`: 8 MiB in 1 MiB blocks, a
/// block of data, a zero block, the rest not present. Seeds' differencing disks name it.
pub fn vhdx_parent() -> vhdx_builder::Spec {
    use vhdx_builder::{guid_from, Block, Spec, MIB};
    let mut parent = Spec::new(8 * MIB, MIB as u32)
        .block(0, Block::Full((0..5000u32).map(|i| (i % 251) as u8 | 1).collect()))
        .block(3, Block::Zero)
        .block(5, Block::Full(vec![0x5a; 4096]));
    parent.data_write_guid = guid_from(0xfa7e);
    parent
}
