//! The sans-IO handshake against a reference reading of the spec: arbitrary client bytes, fed in
//! arbitrary chunks the way a socket delivers them, under each TLS mode and with or without
//! per-identity access. Besides not panicking, `advance` must consume exactly the whole messages
//! a reference framer finds (so bytes pipelined after GO are left for transmission), fail with
//! exactly the error the first bad message calls for, and answer every option with well-formed
//! replies ending in one ACK or error: ACK exactly when the reference says the option succeeds.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use overspill_block::{Capabilities, ExportAccess, ExportProvider};
use overspill_fuzz::*;
use overspill_nbd::handshake::{
    transmission_flags, Handshake, HandshakeError, MetaContexts, Progress, MAX_OPTION_BYTES,
};
use overspill_nbd::memory::OneExport;
use overspill_nbd::wire::*;
use overspill_net::TlsMode;

/// How the reference expects one `advance` call to end.
#[derive(Debug, PartialEq)]
enum Outcome {
    NeedMore,
    Transmission,
    Close,
    StartTls,
    Error(HandshakeError),
}

struct OnlyAlice;

impl ExportAccess for OnlyAlice {
    fn allows(&self, identity: Option<&str>, _export: &str) -> bool {
        identity == Some("alice")
    }
}

/// What the client has negotiated so far, as the reference sees it.
struct Model {
    export: &'static str,
    tls: TlsMode,
    tls_active: bool,
    access: bool,
    alice: bool,
    flags_done: bool,
    no_zeroes: bool,
    structured: bool,
    /// The export the last successful SET_META_CONTEXT selected contexts for, and which.
    meta: Option<(String, MetaContexts)>,
    /// An option over MAX_OPTION_BYTES whose data is being skipped, and how much of it is left.
    skipping: Option<(u32, u32)>,
}

/// The options this server knows besides EXPORT_NAME and ABORT: too much data for one of them is
/// TOO_BIG, for any other option UNSUP.
const KNOWN: [u32; 7] =
    [OPT_LIST, OPT_STARTTLS, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY, OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT];

/// The export an INFO/GO names, if its data is well formed (name length, UTF-8 name, u16 count,
/// exactly that many u16 info requests).
fn info_target(data: &[u8]) -> Option<&str> {
    let len = be_u32(data.get(..4)?) as usize;
    let name = data.get(4..4usize.checked_add(len)?)?;
    let rest = &data[4 + len..];
    let count = be_u16(rest.get(..2)?) as usize;
    (rest.len() == 2 + 2 * count).then_some(())?;
    std::str::from_utf8(name).ok()
}

/// The export and queries of a LIST/SET_META_CONTEXT, if its data is well formed (u32 name
/// length, UTF-8 name, u32 count, exactly that many u32-length UTF-8 queries of at most 4096
/// bytes each).
fn meta_target(data: &[u8]) -> Option<(&str, Vec<&str>)> {
    let mut rest = data;
    let mut string = || -> Option<&str> {
        let len = be_u32(rest.get(..4)?) as usize;
        (len <= 4096).then_some(())?;
        let text = std::str::from_utf8(rest.get(4..4 + len)?).ok()?;
        rest = &rest[4 + len..];
        Some(text)
    };
    let name = string()?;
    let count = be_u32(rest.get(..4)?) as usize;
    rest = &rest[4..];
    let mut queries = Vec::new();
    for _ in 0..count {
        let len = be_u32(rest.get(..4)?) as usize;
        (len <= 4096).then_some(())?;
        queries.push(std::str::from_utf8(rest.get(4..4 + len)?).ok()?);
        rest = &rest[4 + len..];
    }
    rest.is_empty().then_some((name, queries))
}

/// The contexts a well-formed META_CONTEXT request finds, of the two this server has
/// (`base:allocation`, `qemu:allocation-depth`): SET takes whole names, LIST also a namespace
/// and, with no query, everything.
fn contexts_found(option: u32, queries: &[&str]) -> MetaContexts {
    let list = option == OPT_LIST_META_CONTEXT;
    let found =
        |name, namespace| queries.contains(&name) || (list && (queries.is_empty() || queries.contains(&namespace)));
    MetaContexts { allocation: found("base:allocation", "base:"), depth: found("qemu:allocation-depth", "qemu:") }
}

impl Model {
    /// FORCEDTLS before STARTTLS: only STARTTLS and ABORT are served.
    fn gated(&self) -> bool {
        self.tls == TlsMode::Require && !self.tls_active
    }

    /// Whether this client may see the export (a hidden one is as good as missing).
    fn visible(&self) -> bool {
        !self.access || (self.tls_active && self.alice)
    }

    /// Whether the spec has the option succeed (ACK), given the state so far; `None` is data
    /// too large to hold, skipped.
    fn acks(&self, option: u32, data: Option<&[u8]>) -> bool {
        let Some(data) = data else { return option == OPT_ABORT };
        match option {
            OPT_ABORT => true,
            OPT_STARTTLS => self.tls != TlsMode::Off && !self.tls_active && data.is_empty(),
            _ if self.gated() => false,
            OPT_LIST | OPT_STRUCTURED_REPLY => data.is_empty(),
            OPT_INFO | OPT_GO => self.visible() && info_target(data) == Some(self.export),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.structured
                    && self.visible()
                    && meta_target(data).is_some_and(|(name, queries)| {
                        name == self.export && queries.iter().all(|query| query.contains(':'))
                    })
            }
            _ => false,
        }
    }

    /// Frames `input` as the spec does: the options it holds (up to the one that ends the call),
    /// the bytes they take, and how the call must end.
    fn walk<'a>(&mut self, input: &'a [u8]) -> (Vec<(u32, Option<&'a [u8]>)>, usize, Outcome) {
        let (mut pos, mut options) = (0, Vec::new());
        let ended = |options, pos, outcome| (options, pos, outcome);
        loop {
            let rest = &input[pos..];
            if !self.flags_done {
                if rest.len() < 4 {
                    return ended(options, pos, Outcome::NeedMore);
                }
                let flags = be_u32(rest);
                if flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
                    return ended(options, pos, Outcome::Error(HandshakeError::UnknownClientFlags(flags)));
                }
                if flags & CLIENT_FIXED_NEWSTYLE == 0 {
                    return ended(options, pos, Outcome::Error(HandshakeError::NotFixedNewstyle));
                }
                (self.flags_done, self.no_zeroes, pos) = (true, flags & CLIENT_NO_ZEROES != 0, pos + 4);
                continue;
            }
            if let Some((option, remaining)) = self.skipping {
                if rest.is_empty() {
                    return ended(options, pos, Outcome::NeedMore);
                }
                let dropped = rest.len().min(remaining as usize);
                pos += dropped;
                self.skipping = Some((option, remaining - dropped as u32)).filter(|&(_, left)| left > 0);
                if self.skipping.is_none() {
                    options.push((option, None));
                    if option == OPT_ABORT {
                        return ended(options, pos, Outcome::Close);
                    }
                }
                continue;
            }
            if rest.len() < 16 {
                return ended(options, pos, Outcome::NeedMore);
            }
            let (magic, option, length) = (be_u64(rest), be_u32(&rest[8..]), be_u32(&rest[12..]));
            if magic != IHAVEOPT {
                return ended(options, pos, Outcome::Error(HandshakeError::BadOptionMagic(magic)));
            }
            if length > MAX_OPTION_BYTES {
                if option == OPT_EXPORT_NAME {
                    return ended(options, pos, Outcome::Error(HandshakeError::ExportNameTooLarge(length)));
                }
                (pos, self.skipping) = (pos + 16, Some((option, length)));
                continue;
            }
            let Some(data) = rest.get(16..16 + length as usize) else {
                return ended(options, pos, Outcome::NeedMore);
            };
            // EXPORT_NAME has no error reply: what it cannot do closes the connection.
            if option == OPT_EXPORT_NAME && self.gated() {
                return ended(options, pos, Outcome::Error(HandshakeError::TlsRequired));
            }
            if option == OPT_EXPORT_NAME && (String::from_utf8_lossy(data) != self.export || !self.visible()) {
                let name = String::from_utf8_lossy(data);
                // Named in the error as logs show it: cut short.
                let shown = overspill_nbd::wire::truncate_utf8(&name, overspill_nbd::handshake::SHOWN_BYTES).to_owned();
                let unknown = overspill_nbd::counters::Refusal::UnknownExport;
                return ended(options, pos, Outcome::Error(HandshakeError::ExportRefused(shown, unknown)));
            }
            pos += 16 + data.len();
            options.push((option, Some(data)));
            let outcome = match option {
                OPT_EXPORT_NAME => Outcome::Transmission,
                OPT_ABORT => Outcome::Close,
                OPT_GO if self.acks(option, Some(data)) => Outcome::Transmission,
                OPT_STARTTLS if self.acks(option, Some(data)) => Outcome::StartTls,
                _ => continue,
            };
            return ended(options, pos, outcome);
        }
    }

    /// Checks the output of one call: per option, INFO/SERVER replies then one ACK or error,
    /// all carrying that option's number; EXPORT_NAME's reply is the bare size and flags.
    fn check_replies(&mut self, options: &[(u32, Option<&[u8]>)], out: &[u8], caps: Capabilities) {
        let (replies, mut tail) = option_replies(out);
        let mut replies = replies.into_iter();
        for &(option, data) in options {
            if option == OPT_EXPORT_NAME {
                assert_eq!(tail.len(), if self.no_zeroes { 10 } else { 134 }, "EXPORT_NAME reply");
                assert_eq!(be_u64(tail), EXPORT_SIZE as u64);
                assert_eq!(be_u16(&tail[8..]), transmission_flags(caps));
                assert!(tail[10..].iter().all(|&b| b == 0), "padding is zeroes");
                tail = &[];
                continue;
            }
            let (mut servers, mut infos, mut contexts) = (0, 0, 0);
            let (mut named, mut ids) = (MetaContexts::default(), Vec::new());
            let (acked, kind) = loop {
                let (o, kind, payload) = replies.next().expect("every option is answered");
                assert_eq!(o, option, "reply for another option");
                match kind {
                    REP_SERVER => {
                        assert_eq!(option, OPT_LIST);
                        let len = be_u32(payload.get(..4).expect("REP_SERVER has a name length")) as usize;
                        assert_eq!(payload.get(4..4 + len), Some(self.export.as_bytes()), "listed name");
                        servers += 1;
                    }
                    REP_INFO => {
                        check_info(option, payload, caps);
                        infos += 1;
                    }
                    REP_META_CONTEXT => {
                        assert!(option == OPT_LIST_META_CONTEXT || option == OPT_SET_META_CONTEXT);
                        let seen = match payload.get(4..) {
                            Some(b"base:allocation") => &mut named.allocation,
                            Some(b"qemu:allocation-depth") => &mut named.depth,
                            other => panic!("unknown context name {other:?}"),
                        };
                        assert!(!std::mem::replace(seen, true), "a context named twice");
                        let id = be_u32(payload);
                        assert_eq!(id == 0, option == OPT_LIST_META_CONTEXT, "LIST's IDs are zero, SET's not");
                        assert!(id == 0 || !ids.contains(&id), "two contexts share ID {id}");
                        ids.push(id);
                        contexts += 1;
                    }
                    REP_ACK => break (true, kind),
                    _ => {
                        assert_ne!(kind & (1 << 31), 0, "reply type {kind:#x} is neither ACK, INFO, SERVER nor error");
                        assert!(std::str::from_utf8(payload).is_ok(), "error message is not UTF-8");
                        break (false, kind);
                    }
                }
            };
            let should = self.acks(option, data);
            assert_eq!(acked, should, "option {option} answered {kind:#x}");
            assert!(acked || infos + servers + contexts == 0, "INFO/SERVER/META_CONTEXT replies before an error");
            if option == OPT_SET_META_CONTEXT && !self.gated() {
                // SET replaces the selection, even when it fails.
                self.meta = None;
            }
            if acked && (option == OPT_LIST_META_CONTEXT || option == OPT_SET_META_CONTEXT) {
                let (_, queries) = data.and_then(meta_target).expect("acknowledged, so well formed");
                assert_eq!(named, contexts_found(option, &queries), "contexts for {queries:?}");
                if option == OPT_SET_META_CONTEXT && named.any() {
                    self.meta = Some((self.export.to_owned(), named));
                }
            }
            if self.gated() && !acked && option != OPT_STARTTLS {
                assert_eq!(kind, REP_ERR_TLS_REQD, "option {option} before STARTTLS on a TLS-only server");
            } else if data.is_none() && !acked {
                let expected = if KNOWN.contains(&option) { REP_ERR_TOO_BIG } else { REP_ERR_UNSUP };
                assert_eq!(kind, expected, "option {option} with too much data");
            }
            if option == OPT_LIST && acked {
                assert_eq!(servers, usize::from(self.visible()), "LIST shows exactly the visible export");
            }
            self.structured |= option == OPT_STRUCTURED_REPLY && acked;
        }
        assert!(replies.next().is_none(), "replies to no option");
        assert!(tail.is_empty(), "{} bytes after the option replies", tail.len());
    }
}

fn check_info(option: u32, payload: &[u8], caps: Capabilities) {
    assert!(option == OPT_INFO || option == OPT_GO, "REP_INFO for option {option}");
    match be_u16(payload.get(..2).expect("REP_INFO has a type")) {
        INFO_EXPORT => {
            assert_eq!(payload.len(), 12);
            assert_eq!(be_u64(&payload[2..]), EXPORT_SIZE as u64);
            assert_eq!(be_u16(&payload[10..]), transmission_flags(caps));
        }
        INFO_BLOCK_SIZE => {
            assert_eq!(payload.len(), 14);
            let (min, pref, max) = (be_u32(&payload[2..]), be_u32(&payload[6..]), be_u32(&payload[10..]));
            assert!(min.is_power_of_two() && min <= pref && pref <= max, "block sizes {min} {pref} {max}");
        }
        INFO_NAME | INFO_DESCRIPTION => assert!(std::str::from_utf8(&payload[2..]).is_ok()),
        other => panic!("info type {other} is not one this server sends"),
    }
}

fuzz_target!(|data: &[u8]| {
    static EXPORTS: OnceLock<[OneExport; 2]> = OnceLock::new();
    let [named, default] =
        EXPORTS.get_or_init(|| [OneExport::new(EXPORT_NAME, EXPORT_SIZE), OneExport::new("", EXPORT_SIZE)]);
    // The layout is overspill_fuzz::handshake_input's.
    let Some((&head, rest)) = data.split_first() else { return };
    let (chunks, stream) = rest.split_at(((head & 7) as usize).min(rest.len()));
    // All-zero chunk sizes would never feed anything.
    let chunks = if chunks.iter().all(|&c| c == 0) { &[u8::MAX][..] } else { chunks };
    let (exports, export) = if head & HS_DEFAULT_EXPORT != 0 { (default, "") } else { (named, EXPORT_NAME) };
    let tls = [TlsMode::Off, TlsMode::On, TlsMode::Require, TlsMode::Require][usize::from(head >> 3 & 3)];
    let caps = exports.info(export).expect("the export exists").capabilities;

    let mut model = Model {
        export,
        tls,
        tls_active: false,
        access: head & HS_ACCESS != 0,
        alice: head & HS_ALICE != 0,
        flags_done: false,
        no_zeroes: false,
        structured: false,
        meta: None,
        skipping: None,
    };
    let access: Option<Arc<dyn ExportAccess>> = model.access.then(|| Arc::new(OnlyAlice) as _);
    let mut hs = Handshake::with_tls(tls).with_access(access);
    let (mut pending, mut fed, mut out) = (Vec::new(), 0, Vec::new());
    for step in 0.. {
        let take = (chunks[step % chunks.len()] as usize).min(stream.len() - fed);
        pending.extend_from_slice(&stream[fed..fed + take]);
        fed += take;
        let mark = out.len();
        let result = hs.advance(&pending, &mut out, exports);
        let (options, framed, expected) = model.walk(&pending);
        let mut negotiated = None;
        let outcome = match result {
            Err(error) => Outcome::Error(error),
            Ok((used, progress)) => {
                assert!(used <= pending.len(), "consumed {used} of {} bytes", pending.len());
                assert_eq!(used, framed, "consumed other than the whole messages there");
                match progress {
                    Progress::NeedMore => Outcome::NeedMore,
                    Progress::Transmission(n) => {
                        negotiated = Some(n);
                        Outcome::Transmission
                    }
                    Progress::Close => Outcome::Close,
                    Progress::StartTls => Outcome::StartTls,
                    // The output is sent (cleared) after every step, so only one step's replies
                    // could pass the mark: far more than a fuzz input can ask for.
                    Progress::SendFirst => {
                        panic!("{} bytes of replies to {} bytes of options", out.len() - mark, pending.len())
                    }
                }
            }
        };
        assert_eq!(outcome, expected);
        model.check_replies(&options, &out[mark..], caps);
        // The socket loop sends the replies before it reads again.
        out.clear();
        if let Some(n) = negotiated {
            let sizes = (n.info.size, n.device.size());
            assert_eq!((n.export.as_str(), sizes), (export, (EXPORT_SIZE as u64, EXPORT_SIZE as u64)));
            assert_eq!(n.structured_replies, model.structured, "structured replies as acknowledged");
            let selected = match &model.meta {
                Some((name, contexts)) if name == export => *contexts,
                _ => MetaContexts::default(),
            };
            assert_eq!(n.contexts, selected, "contexts as selected");
        }
        match outcome {
            Outcome::NeedMore if fed < stream.len() => {}
            // The socket loop runs the TLS handshake here; what follows arrives over TLS.
            Outcome::StartTls => {
                hs.tls_started(Some(if model.alice { "alice" } else { "mallory" }.into()));
                // What was negotiated in plain text could have been tampered with.
                (model.tls_active, model.structured, model.meta) = (true, false, None);
            }
            // Over (or broken, or out of input): the socket loop stops calling it.
            _ => break,
        }
        pending.drain(..framed);
    }
});
