//! The handshake's tests: options, TLS, meta contexts, refusals.

use super::*;
use crate::memory::OneExport;
use overspill_block::{BlockSizes, DeviceError, DeviceErrorKind};

#[test]
fn info_requests_round_trip() {
    assert_eq!(parse_info_request(&info_request("golden", &[1, 2])), Some(("golden".to_owned(), vec![1, 2])));
    assert_eq!(parse_info_request(&info_request("", &[])), Some((String::new(), vec![])));
}

/// Splits option replies into (option, type, payload).
fn replies(mut out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut all = Vec::new();
    while !out.is_empty() {
        assert_eq!(be_u64(out), OPTION_REPLY_MAGIC);
        let len = be_u32(&out[16..]) as usize;
        all.push((be_u32(&out[8..]), be_u32(&out[12..]), out[20..20 + len].to_vec()));
        out = &out[20 + len..];
    }
    all
}

/// Thousands of pipelined LISTs in one read are answered a high-water mark at a time: the
/// caller sends what is owed before more is built, and every option is answered once.
#[test]
fn pipelined_options_are_answered_a_bounded_batch_at_a_time() {
    let exports = OneExport::new("golden", 1 << 20);
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    const LISTS: usize = 20_000;
    for _ in 0..LISTS {
        put_option(&mut input, OPT_LIST, &[]);
    }
    let mut hs = Handshake::new();
    let (mut fed, mut answered, mut batches) = (0, 0, 0);
    loop {
        let mut out = Vec::new();
        let (used, progress) = hs.advance(&input[fed..], &mut out, &exports).expect("valid");
        fed += used;
        assert!(out.len() < OUTPUT_HIGH_WATER + 64, "{} bytes of replies built up", out.len());
        answered += replies(&out).iter().filter(|r| r.1 == REP_ACK).count();
        batches += 1;
        match progress {
            Progress::SendFirst => assert!(fed < input.len()),
            Progress::NeedMore => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((fed, answered), (input.len(), LISTS));
    assert!(batches > 2, "answered in {batches} batches");
}

#[test]
fn go_after_list_and_structured_reply_opens_the_device() {
    let exports = OneExport::new("golden", 1 << 20);
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    put_option(&mut input, OPT_LIST, &[]);
    put_option(&mut input, OPT_STRUCTURED_REPLY, &[]);
    put_option(&mut input, 42, b"whatever");
    put_option(&mut input, OPT_GO, &info_request("golden", &[INFO_NAME]));
    let mut hs = Handshake::new();
    // Byte by byte: partial messages must wait, not fail.
    let mut out = Vec::new();
    let mut pending = Vec::new();
    let mut result = None;
    for &b in &input {
        pending.push(b);
        let (used, progress) = hs.advance(&pending, &mut out, &exports).expect("valid");
        pending.drain(..used);
        if let Progress::Transmission(n) = progress {
            result = Some(n);
        }
    }
    let negotiated = result.expect("GO ends the handshake");
    assert!(negotiated.structured_replies);
    assert_eq!(negotiated.export, "golden");
    let r = replies(&out);
    assert_eq!(r[0].1, REP_SERVER);
    assert_eq!(&r[0].2[4..10], b"golden");
    assert_eq!((r[1].1, r[2].1, r[3].1), (REP_ACK, REP_ACK, REP_ERR_UNSUP));
    assert_eq!(r[4].1, REP_INFO);
    assert_eq!(be_u16(&r[4].2), INFO_EXPORT);
    assert_eq!(be_u64(&r[4].2[2..]), 1 << 20);
    let block = r.iter().find(|(_, t, p)| *t == REP_INFO && be_u16(p) == INFO_BLOCK_SIZE).expect("block size");
    assert_eq!((be_u32(&block.2[2..]), be_u32(&block.2[6..]), be_u32(&block.2[10..])), (1, 4096, 32 << 20));
    assert!(r.iter().any(|(_, t, p)| *t == REP_INFO && be_u16(p) == INFO_NAME && &p[2..] == b"golden"));
    assert_eq!(r.last().map(|x| x.1), Some(REP_ACK));
}

/// Export names are strings, at most 4096 bytes: a longer one in INFO/GO is invalid (and is
/// never echoed back in NBD_INFO_NAME), in EXPORT_NAME it closes the connection; a refusal
/// names it shortened.
#[test]
fn export_names_longer_than_a_string_may_be_are_refused() {
    let exports = OneExport::new("golden", 4096);
    let long = format!("golden@{}", "x".repeat(MAX_STRING_BYTES));
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_INFO, &info_request(&long, &[INFO_NAME]));
    put_option(&mut input, OPT_GO, &info_request(&long, &[]));
    let mut out = Vec::new();
    let (_, progress) = Handshake::new().advance(&input, &mut out, &exports).expect("well-framed");
    assert!(matches!(progress, Progress::NeedMore));
    let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
    assert_eq!(kinds, vec![REP_ERR_INVALID, REP_ERR_INVALID]);
    assert!(out.len() < 1024, "nothing of the name comes back: {} bytes", out.len());
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_EXPORT_NAME, long.as_bytes());
    let error = Handshake::new().advance(&input, &mut Vec::new(), &exports).err();
    let Some(HandshakeError::ExportRefused(shown, Refusal::UnknownExport)) = error else { panic!("{error:?}") };
    assert_eq!(shown.len(), SHOWN_BYTES);
}

/// FORCEDTLS: before TLS only STARTTLS and ABORT are served, EXPORT_NAME closes; after it,
/// options work, structured replies negotiated in plain text are forgotten, and a second
/// STARTTLS is invalid.
#[test]
fn require_refuses_options_until_starttls_and_forgets_plain_text_state() {
    let exports = OneExport::new("golden", 4096);
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_LIST, &[]);
    put_option(&mut input, OPT_GO, &info_request("golden", &[]));
    put_option(&mut input, OPT_STRUCTURED_REPLY, &[]);
    put_option(&mut input, OPT_STARTTLS, &[]);
    let mut hs = Handshake::with_tls(TlsMode::Require);
    let mut out = Vec::new();
    let (used, progress) = hs.advance(&input, &mut out, &exports).expect("well-framed");
    assert_eq!(used, input.len());
    assert!(matches!(progress, Progress::StartTls));
    let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
    assert_eq!(kinds, vec![REP_ERR_TLS_REQD, REP_ERR_TLS_REQD, REP_ERR_TLS_REQD, REP_ACK]);

    hs.tls_started(None);
    let mut input = Vec::new();
    put_option(&mut input, OPT_STARTTLS, &[]);
    put_option(&mut input, OPT_GO, &info_request("golden", &[]));
    out.clear();
    let (_, progress) = hs.advance(&input, &mut out, &exports).expect("well-framed");
    let Progress::Transmission(negotiated) = progress else { panic!("GO over TLS opens the export") };
    assert!(!negotiated.structured_replies, "negotiated before TLS, so forgotten");
    assert_eq!(replies(&out)[0].1, REP_ERR_INVALID, "STARTTLS twice");

    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_EXPORT_NAME, b"golden");
    let error = Handshake::with_tls(TlsMode::Require).advance(&input, &mut Vec::new(), &exports).err();
    assert_eq!(error, Some(HandshakeError::TlsRequired));
}

/// Two exports, for what depends on which one a client names.
struct TwoExports(OneExport, OneExport);

impl ExportProvider for TwoExports {
    fn list(&self) -> Vec<ExportInfo> {
        [self.0.list(), self.1.list()].concat()
    }
    fn info(&self, name: &str) -> Option<ExportInfo> {
        self.0.info(name).or_else(|| self.1.info(name))
    }
    fn open(&self, name: &str, identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        self.0.open(name, identity).or_else(|_| self.1.open(name, identity))
    }
}

/// Block status is negotiated for the export SET_META_CONTEXT named, only if GO opens that
/// same export, and not across STARTTLS; a later SET replaces an earlier one.
#[test]
fn block_status_holds_only_for_the_export_selected_and_not_across_starttls() {
    let exports = TwoExports(OneExport::new("a", 4096), OneExport::new("b", 4096));
    let negotiate = |tls: TlsMode, options: &[(u32, Vec<u8>)], after_tls: &[(u32, Vec<u8>)]| -> bool {
        let mut hs = Handshake::with_tls(tls);
        let mut input = Vec::new();
        put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
        put_option(&mut input, OPT_STRUCTURED_REPLY, &[]);
        for (option, data) in options {
            put_option(&mut input, *option, data);
        }
        let mut out = Vec::new();
        let (_, mut progress) = hs.advance(&input, &mut out, &exports).expect("well-framed");
        if matches!(progress, Progress::StartTls) {
            hs.tls_started(None);
            let mut input = Vec::new();
            put_option(&mut input, OPT_STRUCTURED_REPLY, &[]);
            for (option, data) in after_tls {
                put_option(&mut input, *option, data);
            }
            progress = hs.advance(&input, &mut out, &exports).expect("well-framed").1;
        }
        match progress {
            Progress::Transmission(negotiated) => negotiated.contexts.allocation,
            other => panic!("GO should open the export: {other:?}"),
        }
    };
    let set = |export: &str, queries: &[&str]| (OPT_SET_META_CONTEXT, meta_context_request(export, queries));
    let go = |export: &str| (OPT_GO, info_request(export, &[]));
    assert!(negotiate(TlsMode::Off, &[set("a", &[BASE_ALLOCATION]), go("a")], &[]));
    assert!(!negotiate(TlsMode::Off, &[set("a", &[BASE_ALLOCATION]), go("b")], &[]), "another export");
    assert!(!negotiate(TlsMode::Off, &[set("a", &[BASE_ALLOCATION]), set("a", &[]), go("a")], &[]), "replaced");
    assert!(!negotiate(TlsMode::Off, &[go("a")], &[]), "never selected");
    let export_name = (OPT_EXPORT_NAME, b"a".to_vec());
    assert!(negotiate(TlsMode::Off, &[set("a", &[BASE_ALLOCATION]), export_name], &[]), "EXPORT_NAME too");
    let starttls = (OPT_STARTTLS, Vec::new());
    assert!(!negotiate(TlsMode::On, &[set("a", &[BASE_ALLOCATION]), starttls.clone()], &[go("a")]), "before TLS");
    assert!(negotiate(TlsMode::On, &[starttls], &[set("a", &[BASE_ALLOCATION]), go("a")]), "after TLS");
}

/// A connection that accepts at most 64 KiB never advertises the export's 32 MiB maximum.
#[test]
fn the_advertised_maximum_block_size_is_what_the_connection_accepts() {
    let exports = OneExport::new("golden", 1 << 20);
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_INFO, &info_request("golden", &[INFO_BLOCK_SIZE]));
    let mut out = Vec::new();
    Handshake::new().with_max_payload(64 * 1024).advance(&input, &mut out, &exports).expect("well-framed");
    let r = replies(&out);
    let block = r.iter().find(|(_, t, p)| *t == REP_INFO && be_u16(p) == INFO_BLOCK_SIZE).expect("block size");
    assert_eq!(be_u32(&block.2[10..]), 64 * 1024);
}

/// An export the client's identity does not allow is neither listed nor opened, and looks
/// like one that does not exist (before TLS, INFO asks for TLS, as the spec's SELECTIVETLS
/// wants for an export only TLS opens); after TLS proves the identity, it is.
#[test]
fn exports_are_hidden_from_identities_not_allowed_them() {
    struct OnlyAlice;
    impl ExportAccess for OnlyAlice {
        fn allows(&self, identity: Option<&str>, _: &str) -> bool {
            identity == Some("alice")
        }
    }
    let exports = OneExport::new("golden", 4096);
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_LIST, &[]);
    put_option(&mut input, OPT_INFO, &info_request("golden", &[]));
    put_option(&mut input, OPT_STARTTLS, &[]);
    let mut hs = Handshake::with_tls(TlsMode::On).with_access(Some(Arc::new(OnlyAlice)));
    let mut out = Vec::new();
    hs.advance(&input, &mut out, &exports).expect("well-framed");
    let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
    assert_eq!(kinds, vec![REP_ACK, REP_ERR_TLS_REQD, REP_ACK], "an empty list, TLS required, STARTTLS");

    hs.tls_started(Some("alice".into()));
    let mut input = Vec::new();
    put_option(&mut input, OPT_LIST, &[]);
    put_option(&mut input, OPT_GO, &info_request("golden", &[]));
    out.clear();
    let (_, progress) = hs.advance(&input, &mut out, &exports).expect("well-framed");
    assert!(matches!(progress, Progress::Transmission(_)));
    assert_eq!(replies(&out)[0].1, REP_SERVER, "alice sees the export");
}

/// SELECTIVETLS and NOTLS: plain-text clients are served; STARTTLS is offered or refused.
#[test]
fn on_offers_tls_and_off_refuses_it() {
    let exports = OneExport::new("golden", 4096);
    for (mode, junk, starttls) in
        [(TlsMode::On, REP_ERR_INVALID, REP_ACK), (TlsMode::Off, REP_ERR_UNSUP, REP_ERR_UNSUP)]
    {
        let mut input = Vec::new();
        put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
        put_option(&mut input, OPT_LIST, &[]);
        put_option(&mut input, OPT_STARTTLS, b"junk");
        put_option(&mut input, OPT_STARTTLS, &[]);
        let mut out = Vec::new();
        let (_, progress) = Handshake::with_tls(mode).advance(&input, &mut out, &exports).expect("well-framed");
        let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
        assert_eq!(kinds, vec![REP_SERVER, REP_ACK, junk, starttls], "{mode:?}");
        assert_eq!(matches!(progress, Progress::StartTls), mode == TlsMode::On);
    }
}

#[test]
fn unknown_export_and_malformed_go_get_errors_and_negotiation_goes_on() {
    let exports = OneExport::new("golden", 4096);
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_GO, &info_request("nope", &[]));
    let mut bad = info_request("golden", &[1, 2]);
    bad.pop();
    put_option(&mut input, OPT_INFO, &bad);
    put_option(&mut input, OPT_LIST, b"x");
    put_option(&mut input, OPT_ABORT, &[]);
    let mut out = Vec::new();
    let (used, progress) = Handshake::new().advance(&input, &mut out, &exports).expect("well-framed");
    assert_eq!(used, input.len());
    assert!(matches!(progress, Progress::Close));
    let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
    assert_eq!(kinds, vec![REP_ERR_UNKNOWN, REP_ERR_INVALID, REP_ERR_INVALID, REP_ACK]);
}

#[test]
fn export_name_sends_size_flags_and_padding_unless_no_zeroes() {
    for (client_flags, expected_len) in [(CLIENT_FIXED_NEWSTYLE, 134), (CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES, 10)] {
        let exports = OneExport::new("", 8192);
        let mut input = Vec::new();
        put_u32(&mut input, client_flags);
        put_option(&mut input, OPT_EXPORT_NAME, b"");
        let mut out = Vec::new();
        let (_, progress) = Handshake::new().advance(&input, &mut out, &exports).expect("valid");
        assert!(matches!(progress, Progress::Transmission(_)));
        assert_eq!(out.len(), expected_len);
        assert_eq!(be_u64(&out), 8192);
        assert_ne!(be_u16(&out[8..]) & TFLAG_SEND_TRIM, 0);
    }
}

#[test]
fn framing_errors_close() {
    let exports = OneExport::new("", 4096);
    let cases: Vec<(Vec<u8>, HandshakeError)> = vec![
        (vec![0, 0, 0, 0x10], HandshakeError::UnknownClientFlags(0x10)),
        (vec![0, 0, 0, 0], HandshakeError::NotFixedNewstyle),
        ([vec![0, 0, 0, 1], vec![0xff; 16]].concat(), HandshakeError::BadOptionMagic(u64::MAX)),
    ];
    for (input, expected) in cases {
        let err = Handshake::new().advance(&input, &mut Vec::new(), &exports).expect_err("must close");
        assert_eq!(err, expected);
    }
    // EXPORT_NAME has no error reply, and no name is that long.
    let mut big = vec![0, 0, 0, 1];
    put_u64(&mut big, IHAVEOPT);
    put_u32(&mut big, OPT_EXPORT_NAME);
    put_u32(&mut big, MAX_OPTION_BYTES + 1);
    let err = Handshake::new().advance(&big, &mut Vec::new(), &exports).expect_err("must close");
    assert_eq!(err, HandshakeError::ExportNameTooLarge(MAX_OPTION_BYTES + 1));
}

/// An option carrying more than MAX_OPTION_BYTES is skipped as its bytes arrive, never held
/// whole, and answered: UNSUP when unknown, TOO_BIG when known; negotiation goes on, and an
/// oversized ABORT still aborts.
#[test]
fn oversized_options_are_skipped_and_answered() {
    let exports = OneExport::new("golden", 4096);
    let big = vec![0x41; MAX_OPTION_BYTES as usize * 3 + 7];
    for tls in [TlsMode::Off, TlsMode::Require] {
        let mut input = Vec::new();
        put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
        put_option(&mut input, 42, &big);
        put_option(&mut input, OPT_GO, &big);
        put_option(&mut input, OPT_STRUCTURED_REPLY, &[]);
        put_option(&mut input, OPT_ABORT, &big);
        let mut hs = Handshake::with_tls(tls);
        let (mut out, mut pending, mut closed) = (Vec::new(), Vec::new(), false);
        for chunk in input.chunks(1000) {
            pending.extend_from_slice(chunk);
            let (used, progress) = hs.advance(&pending, &mut out, &exports).expect("well framed");
            pending.drain(..used);
            assert!(pending.len() < 1016, "{} bytes held", pending.len());
            closed = matches!(progress, Progress::Close);
        }
        assert!(closed, "ABORT ends the handshake");
        let kinds: Vec<(u32, u32)> = replies(&out).iter().map(|r| (r.0, r.1)).collect();
        let expected = match tls {
            TlsMode::Off => [(42, REP_ERR_UNSUP), (OPT_GO, REP_ERR_TOO_BIG), (OPT_STRUCTURED_REPLY, REP_ACK)],
            _ => [(42, REP_ERR_TLS_REQD), (OPT_GO, REP_ERR_TLS_REQD), (OPT_STRUCTURED_REPLY, REP_ERR_TLS_REQD)],
        };
        assert_eq!(kinds, [&expected[..], &[(OPT_ABORT, REP_ACK)]].concat(), "{tls:?}");
    }
}

#[test]
fn a_device_that_fails_to_open_is_reported_not_fatal() {
    struct Failing;
    impl ExportProvider for Failing {
        fn list(&self) -> Vec<ExportInfo> {
            Vec::new()
        }
        fn info(&self, name: &str) -> Option<ExportInfo> {
            Some(ExportInfo {
                name: name.into(),
                description: String::new(),
                size: 4096,
                capabilities: Capabilities::default(),
                block_sizes: BlockSizes { minimum: 1, preferred: 4096, maximum: 4096 },
            })
        }
        fn open(&self, _: &str, _: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
            Err(DeviceError::new(DeviceErrorKind::NoSpace, "spill dir full"))
        }
    }
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_GO, &info_request("", &[]));
    let mut out = Vec::new();
    let (_, progress) = Handshake::new().advance(&input, &mut out, &Failing).expect("framing ok");
    assert!(matches!(progress, Progress::NeedMore));
    assert_eq!(replies(&out)[0].1, REP_ERR_UNKNOWN);
    // EXPORT_NAME has no error reply, only a close: still counted as an open that failed, not
    // as a name that does not exist.
    let mut input = Vec::new();
    put_u32(&mut input, CLIENT_FIXED_NEWSTYLE);
    put_option(&mut input, OPT_EXPORT_NAME, b"disk");
    let error = Handshake::new().advance(&input, &mut Vec::new(), &Failing).err();
    assert!(matches!(error, Some(HandshakeError::ExportRefused(_, Refusal::CannotOpen))), "{error:?}");
}
