//! The fuzz crate of overspill: libFuzzer targets for the NBD protocol crate and what they share.
//!
//! It owns the three targets in `fuzz_targets/` (`handshake`, `request`, `server`), the layout of
//! their inputs (defined here, so that `examples/seeds.rs` writes the committed seed corpora in
//! the same layout), and a reference reading of the wire that the targets check the server
//! against. It is a workspace of its own, built only by `cargo fuzz`: see docs/fuzzing.md.

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
/// capability bit set (u8, in [`overspill_nbd::Capabilities`] field order); missing bytes read as zero.
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
