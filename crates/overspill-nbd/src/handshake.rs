//! The fixed-newstyle handshake as a state machine over bytes (sans-IO).
//!
//! States: the server has sent its greeting and waits for the **client flags**; then it reads
//! **options** until one of them ends the handshake: GO or EXPORT_NAME move the connection to
//! transmission with an opened device, ABORT (or a refused EXPORT_NAME) closes it. The socket
//! loop only moves bytes: [`Handshake::advance`] consumes whole messages from its input and
//! appends replies to its output, so it can be unit-tested and fuzzed without sockets.
//!
//! A malformed message is a [`HandshakeError`] and the caller closes the connection; a well-formed
//! option the server cannot honour gets an NBD_REP_ERR_* reply and negotiation goes on.

use std::sync::Arc;

use crate::counters::Refusal;
use crate::wire::*;
use overspill_block::{BlockDevice, Capabilities, DeviceErrorKind, ExportAccess, ExportInfo, ExportProvider};
use overspill_net::TlsMode;

/// Option payloads above this are never held in memory: export names are at most 4096 bytes and
/// nothing this server accepts needs more. Such an option's data is read and dropped as it
/// arrives (the option length exists so that a server can skip what it does not understand),
/// then the option is answered: UNSUP if unknown, TOO_BIG if known. The handshake deadline bounds
/// how long a client may keep the server skipping.
pub const MAX_OPTION_BYTES: u32 = 16 * 1024;

/// The longest string the spec allows (export names, queries).
const MAX_STRING_BYTES: usize = 4096;
/// Of a client's string, what logs and errors show.
pub const SHOWN_BYTES: usize = 200;

/// The ID of `base:allocation` in block status replies.
pub const ALLOCATION_CONTEXT_ID: u32 = 1;
/// The ID of `qemu:allocation-depth` in block status replies.
pub const DEPTH_CONTEXT_ID: u32 = 2;

/// The metadata contexts a client selected for the export it opened: what its block status
/// requests are answered with, a chunk each.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaContexts {
    /// `base:allocation`: holes and zeroes.
    pub allocation: bool,
    /// `qemu:allocation-depth`: which layer holds each range.
    pub depth: bool,
}

impl MetaContexts {
    pub fn any(self) -> bool {
        self.allocation || self.depth
    }
}

/// Error messages in option replies are cut to this, well within the spec's 4096-byte strings.
const MAX_MESSAGE_BYTES: usize = 1024;
/// Replies the handshake builds up before the caller must send them: a client may pipeline
/// thousands of options in one read (each LIST answered with every export), and what it is
/// owed should not grow with what it sent.
pub const OUTPUT_HIGH_WATER: usize = 256 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandshakeError {
    #[error("client flags {0:#x} include bits this server does not know")]
    UnknownClientFlags(u32),
    #[error("client does not speak fixed newstyle")]
    NotFixedNewstyle,
    #[error("option magic {0:#x} is not IHAVEOPT")]
    BadOptionMagic(u64),
    #[error("EXPORT_NAME carries {0} bytes, more than the {MAX_OPTION_BYTES} allowed (it has no error reply)")]
    ExportNameTooLarge(u32),
    /// With why, as the refusals are counted.
    #[error("export {0:?} cannot be served")]
    ExportRefused(String, Refusal),
    #[error("EXPORT_NAME before STARTTLS on a server that requires TLS")]
    TlsRequired,
}

/// What the handshake produced once it is over.
pub struct Negotiated {
    pub export: String,
    pub device: Box<dyn BlockDevice>,
    pub info: ExportInfo,
    pub structured_replies: bool,
    /// The contexts the client selected for this export: with any, it may ask for block status.
    pub contexts: MetaContexts,
}

impl std::fmt::Debug for Negotiated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Negotiated")
            .field("export", &self.export)
            .field("info", &self.info)
            .field("structured_replies", &self.structured_replies)
            .field("contexts", &self.contexts)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub enum Progress {
    /// More input is needed; everything consumed so far has been answered.
    NeedMore,
    Transmission(Negotiated),
    /// The client aborted; close after sending the output.
    Close,
    /// STARTTLS was acknowledged: send the output, run the TLS handshake, then call
    /// [`Handshake::tls_started`] and go on with options over TLS.
    StartTls,
    /// The output has passed [`OUTPUT_HIGH_WATER`]: send it, then call again with the input
    /// not consumed.
    SendFirst,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    ClientFlags,
    Options,
    /// Dropping the data of an option over [`MAX_OPTION_BYTES`]; `remaining` bytes are still to come.
    Skipping {
        option: u32,
        remaining: u32,
    },
}

pub struct Handshake {
    phase: Phase,
    no_zeroes: bool,
    structured_replies: bool,
    /// The export the last NBD_OPT_SET_META_CONTEXT selected contexts for, and which.
    meta: Option<(String, MetaContexts)>,
    tls: TlsMode,
    tls_active: bool,
    access: Option<Arc<dyn ExportAccess>>,
    /// Who TLS proved the client to be.
    identity: Option<String>,
    /// The largest payload the connection accepts: never advertise a larger maximum block size.
    max_payload: u32,
    /// Why the last NBD_OPT_GO was refused, until the connection counts it.
    refusal: Option<Refusal>,
    /// A GO for a missing export, and one whose export would not open, have been logged at
    /// warn on this connection: the next of each kind go to debug.
    missing_logged: bool,
    open_failure_logged: bool,
    /// The server is shutting down: options get NBD_REP_ERR_SHUTDOWN, and the client ABORTs.
    shutting_down: bool,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handshake")
            .field("phase", &self.phase)
            .field("tls", &self.tls)
            .field("tls_active", &self.tls_active)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Default for Handshake {
    fn default() -> Self {
        Self::new()
    }
}

/// The transmission flags that follow from what a device can do.
pub fn transmission_flags(caps: Capabilities) -> u16 {
    // CACHE is always understood: a device that cannot prefetch answers it by doing nothing,
    // which the spec allows.
    let mut flags = TFLAG_HAS_FLAGS | TFLAG_SEND_FUA | TFLAG_SEND_CACHE;
    for (on, flag) in [
        (caps.read_only, TFLAG_READ_ONLY),
        (caps.can_flush, TFLAG_SEND_FLUSH),
        (caps.can_trim, TFLAG_SEND_TRIM),
        (caps.can_zero, TFLAG_SEND_WRITE_ZEROES),
        (caps.can_zero && caps.can_fast_zero, TFLAG_SEND_FAST_ZERO),
        (caps.can_multi_conn, TFLAG_CAN_MULTI_CONN),
    ] {
        if on {
            flags |= flag;
        }
    }
    if !caps.can_fua {
        flags &= !TFLAG_SEND_FUA;
    }
    flags
}

impl Handshake {
    pub fn new() -> Self {
        Self::with_tls(TlsMode::Off)
    }

    pub fn with_tls(tls: TlsMode) -> Self {
        Self {
            phase: Phase::ClientFlags,
            no_zeroes: false,
            structured_replies: false,
            meta: None,
            tls,
            tls_active: false,
            access: None,
            identity: None,
            max_payload: u32::MAX,
            refusal: None,
            missing_logged: false,
            open_failure_logged: false,
            shutting_down: false,
        }
    }

    /// Caps the advertised maximum block size at what the connection will accept, so a client
    /// that keeps to it is never cut off for a request too large.
    pub fn with_max_payload(mut self, max_payload: u32) -> Self {
        self.max_payload = max_payload;
        self
    }

    /// Hides and refuses the exports `access` does not allow this client.
    /// Why the last NBD_OPT_GO was refused, once: the connection counts it for the metrics.
    pub fn take_refusal(&mut self) -> Option<Refusal> {
        self.refusal.take()
    }

    pub fn with_access(mut self, access: Option<Arc<dyn ExportAccess>>) -> Self {
        self.access = access;
        self
    }

    /// The TLS handshake that [`Progress::StartTls`] asked for has succeeded; `identity` is who
    /// the client proved to be, if anyone.
    pub fn tls_started(&mut self, identity: Option<String>) {
        self.tls_active = true;
        self.identity = identity;
        // What was negotiated in plain text could have been tampered with: start afresh, as
        // qemu and nbdkit do.
        self.structured_replies = false;
        self.meta = None;
    }

    /// The server is shutting down: from now on every option but ABORT gets
    /// NBD_REP_ERR_SHUTDOWN (the spec's SHOULD), so the client knows why and ABORTs, and an
    /// EXPORT_NAME, which has no error reply, closes the connection.
    pub fn shut_down(&mut self) {
        self.shutting_down = true;
    }

    /// The answer to an option the server will not serve now, whatever its data: every option
    /// but ABORT during shutdown (NBD_REP_ERR_SHUTDOWN), and every option but STARTTLS and ABORT
    /// before TLS on a server that requires it (NBD_REP_ERR_TLS_REQD). EXPORT_NAME has no error
    /// reply: the spec's answer is to close. `None`: the option goes on to be served.
    fn refused_now(&self, option: u32, out: &mut Vec<u8>) -> Option<Result<Progress, HandshakeError>> {
        if self.shutting_down && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                return Some(Ok(Progress::Close));
            }
            option_reply(out, option, REP_ERR_SHUTDOWN, b"the server is shutting down");
            return Some(Ok(Progress::NeedMore));
        }
        if self.tls == TlsMode::Require && !self.tls_active && option != OPT_STARTTLS && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                return Some(Err(HandshakeError::TlsRequired));
            }
            option_reply(out, option, REP_ERR_TLS_REQD, b"this server requires TLS: send STARTTLS first");
            return Some(Ok(Progress::NeedMore));
        }
        None
    }

    /// The contexts the client selected for the export it is now opening.
    fn contexts_for(&self, export: &str) -> MetaContexts {
        match &self.meta {
            Some((name, contexts)) if name == export => *contexts,
            _ => MetaContexts::default(),
        }
    }

    fn allowed(&self, export: &str) -> bool {
        match &self.access {
            None => true,
            Some(access) => access.allows(self.identity.as_deref(), export),
        }
    }

    /// The export, if it exists and this client may see it.
    fn visible(&self, exports: &dyn ExportProvider, name: &str) -> Option<ExportInfo> {
        exports.info(name).filter(|_| self.allowed(name))
    }

    /// The server's first message.
    pub fn greeting() -> Vec<u8> {
        let mut out = Vec::with_capacity(18);
        put_u64(&mut out, NBDMAGIC);
        put_u64(&mut out, IHAVEOPT);
        put_u16(&mut out, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        out
    }

    /// Consumes whole messages from `input`, appending replies to `output`. Returns how many bytes
    /// were consumed (the caller drops them) and where the handshake stands.
    pub fn advance(
        &mut self,
        input: &[u8],
        output: &mut Vec<u8>,
        exports: &dyn ExportProvider,
    ) -> Result<(usize, Progress), HandshakeError> {
        let mut consumed = 0;
        loop {
            let rest = &input[consumed..];
            match self.phase {
                Phase::ClientFlags => {
                    if rest.len() < 4 {
                        return Ok((consumed, Progress::NeedMore));
                    }
                    let flags = be_u32(rest);
                    consumed += 4;
                    if flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
                        return Err(HandshakeError::UnknownClientFlags(flags));
                    }
                    if flags & CLIENT_FIXED_NEWSTYLE == 0 {
                        return Err(HandshakeError::NotFixedNewstyle);
                    }
                    self.no_zeroes = flags & CLIENT_NO_ZEROES != 0;
                    self.phase = Phase::Options;
                }
                Phase::Options => {
                    if rest.len() < 16 {
                        return Ok((consumed, Progress::NeedMore));
                    }
                    if output.len() >= OUTPUT_HIGH_WATER {
                        return Ok((consumed, Progress::SendFirst));
                    }
                    let magic = be_u64(rest);
                    if magic != IHAVEOPT {
                        return Err(HandshakeError::BadOptionMagic(magic));
                    }
                    let option = be_u32(&rest[8..]);
                    let length = be_u32(&rest[12..]);
                    if length > MAX_OPTION_BYTES {
                        if option == OPT_EXPORT_NAME {
                            return Err(HandshakeError::ExportNameTooLarge(length));
                        }
                        consumed += 16;
                        self.phase = Phase::Skipping { option, remaining: length };
                        continue;
                    }
                    let total = 16 + length as usize;
                    if rest.len() < total {
                        return Ok((consumed, Progress::NeedMore));
                    }
                    consumed += total;
                    match self.option(option, &rest[16..total], output, exports)? {
                        Progress::NeedMore => {}
                        done => return Ok((consumed, done)),
                    }
                }
                Phase::Skipping { option, remaining } => {
                    if rest.is_empty() {
                        return Ok((consumed, Progress::NeedMore));
                    }
                    let dropped = rest.len().min(remaining as usize);
                    consumed += dropped;
                    let remaining = remaining - dropped as u32;
                    if remaining > 0 {
                        self.phase = Phase::Skipping { option, remaining };
                        continue;
                    }
                    self.phase = Phase::Options;
                    match self.oversized_option(option, output)? {
                        Progress::NeedMore => {}
                        done => return Ok((consumed, done)),
                    }
                }
            }
        }
    }

    fn option(
        &mut self,
        option: u32,
        data: &[u8],
        out: &mut Vec<u8>,
        exports: &dyn ExportProvider,
    ) -> Result<Progress, HandshakeError> {
        if let Some(refused) = self.refused_now(option, out) {
            return refused;
        }
        match option {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(data).into_owned();
                // This option has no error reply: the spec's answer to a bad name is to close.
                let refused = |why| HandshakeError::ExportRefused(shown(&name).to_owned(), why);
                if name.len() > MAX_STRING_BYTES {
                    return Err(refused(Refusal::UnknownExport));
                }
                let mut info = self.visible(exports, &name).ok_or_else(|| refused(Refusal::UnknownExport))?;
                let device = exports
                    .open(&name, self.identity.as_deref())
                    .map_err(|error| refused(open_refusal(error.kind).1))?;
                // The opened device's size, as for GO (see `info_or_go`).
                info.size = device.size();
                put_u64(out, info.size);
                put_u16(out, transmission_flags(info.capabilities));
                if !self.no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                let contexts = self.contexts_for(&name);
                Ok(Progress::Transmission(Negotiated {
                    export: name,
                    device,
                    info,
                    structured_replies: self.structured_replies,
                    contexts,
                }))
            }
            OPT_ABORT => {
                option_reply(out, option, REP_ACK, &[]);
                Ok(Progress::Close)
            }
            OPT_LIST => {
                if !data.is_empty() {
                    option_reply(out, option, REP_ERR_INVALID, b"LIST takes no data");
                    return Ok(Progress::NeedMore);
                }
                for export in exports.list().into_iter().filter(|e| self.allowed(&e.name)) {
                    let mut payload = Vec::with_capacity(4 + export.name.len() + export.description.len());
                    put_u32(&mut payload, export.name.len() as u32);
                    payload.extend_from_slice(export.name.as_bytes());
                    payload.extend_from_slice(export.description.as_bytes());
                    option_reply(out, option, REP_SERVER, &payload);
                }
                option_reply(out, option, REP_ACK, &[]);
                Ok(Progress::NeedMore)
            }
            OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    self.structured_replies = true;
                    option_reply(out, option, REP_ACK, &[]);
                } else {
                    option_reply(out, option, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data");
                }
                Ok(Progress::NeedMore)
            }
            OPT_INFO | OPT_GO => Ok(self.info_or_go(option, data, out, exports)),
            OPT_STARTTLS => Ok(self.start_tls(data, out)),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(option, data, out, exports);
                Ok(Progress::NeedMore)
            }
            _ => {
                option_reply(out, option, REP_ERR_UNSUP, b"option not supported");
                Ok(Progress::NeedMore)
            }
        }
    }

    /// The answer to an option whose data was skipped: as to any option the server will not
    /// serve now ([`Self::refused_now`]); ABORT ignores its data, as ever; otherwise UNSUP for an
    /// option this server does not know and TOO_BIG for one it does, nothing of which needs that
    /// much. (EXPORT_NAME never gets here: too long a name closes at once.)
    fn oversized_option(&mut self, option: u32, out: &mut Vec<u8>) -> Result<Progress, HandshakeError> {
        const KNOWN: [u32; 7] = [
            OPT_LIST,
            OPT_STARTTLS,
            OPT_INFO,
            OPT_GO,
            OPT_STRUCTURED_REPLY,
            OPT_LIST_META_CONTEXT,
            OPT_SET_META_CONTEXT,
        ];
        if let Some(refused) = self.refused_now(option, out) {
            return refused;
        }
        if option == OPT_ABORT {
            option_reply(out, option, REP_ACK, &[]);
            return Ok(Progress::Close);
        }
        if KNOWN.contains(&option) {
            if option == OPT_SET_META_CONTEXT {
                self.meta = None;
            }
            let message = format!("option data over {MAX_OPTION_BYTES} bytes");
            option_reply(out, option, REP_ERR_TOO_BIG, message.as_bytes());
        } else {
            option_reply(out, option, REP_ERR_UNSUP, b"option not supported");
        }
        Ok(Progress::NeedMore)
    }

    fn start_tls(&mut self, data: &[u8], out: &mut Vec<u8>) -> Progress {
        if self.tls == TlsMode::Off {
            option_reply(out, OPT_STARTTLS, REP_ERR_UNSUP, b"TLS is not configured on this server");
        } else if self.tls_active {
            option_reply(out, OPT_STARTTLS, REP_ERR_INVALID, b"TLS is already on");
        } else if !data.is_empty() {
            option_reply(out, OPT_STARTTLS, REP_ERR_INVALID, b"STARTTLS takes no data");
        } else {
            option_reply(out, OPT_STARTTLS, REP_ACK, &[]);
            return Progress::StartTls;
        }
        Progress::NeedMore
    }

    /// LIST_META_CONTEXT and SET_META_CONTEXT. The contexts are `base:allocation` and
    /// `qemu:allocation-depth`; queries for anything else are ignored, as the spec asks, and a
    /// namespace alone (`base:`, `qemu:`) or no query lists what it holds. SET forgets the
    /// earlier selection even when it fails.
    fn meta_context(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>, exports: &dyn ExportProvider) {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            self.meta = None;
        }
        // Block status replies are structured: without them there is nothing to select (SET
        // SHOULD be refused; LIST MAY be, and nbdkit and qemu-nbd refuse both).
        if !self.structured_replies {
            option_reply(out, option, REP_ERR_INVALID, b"negotiate structured replies first");
            return;
        }
        let Some((name, queries)) = parse_meta_context_request(data) else {
            option_reply(out, option, REP_ERR_INVALID, b"malformed metadata context request");
            return;
        };
        if queries.iter().any(|query| !query.contains(':')) {
            option_reply(
                out,
                option,
                REP_ERR_INVALID,
                b"a metadata context query must start with a namespace and a colon",
            );
            return;
        }
        if self.visible(exports, &name).is_none() {
            let message = format!("no export named {name:?}");
            option_reply(out, option, REP_ERR_UNKNOWN, truncate_utf8(&message, MAX_MESSAGE_BYTES).as_bytes());
            return;
        }
        // LIST takes a namespace for all it holds; SET takes whole names only.
        let asked = |context: &str, namespace: &str| {
            queries.contains(&context) || (!set && (queries.is_empty() || queries.contains(&namespace)))
        };
        let selected =
            MetaContexts { allocation: asked(BASE_ALLOCATION, "base:"), depth: asked(ALLOCATION_DEPTH, "qemu:") };
        for (on, context, id) in [
            (selected.allocation, BASE_ALLOCATION, ALLOCATION_CONTEXT_ID),
            (selected.depth, ALLOCATION_DEPTH, DEPTH_CONTEXT_ID),
        ] {
            if on {
                let mut payload = Vec::with_capacity(4 + context.len());
                // LIST's IDs are reserved (zero); SET's name the context in block status replies.
                put_u32(&mut payload, if set { id } else { 0 });
                payload.extend_from_slice(context.as_bytes());
                option_reply(out, option, REP_META_CONTEXT, &payload);
            }
        }
        if set && selected.any() {
            self.meta = Some((name, selected));
        }
        option_reply(out, option, REP_ACK, &[]);
    }

    /// Refuses INFO or GO of an export that does not exist or is hidden from this client.
    fn unknown_export(&mut self, option: u32, name: &str, out: &mut Vec<u8>) {
        // Asking is how clients look for exports (INFO); connecting to one that is not there
        // (GO) is a misconfigured VM the operator wants to hear about.
        if option == OPT_GO {
            let export = shown(name);
            // Once per connection at warn: a client asking again and again must not flood the log.
            self.refusal = Some(Refusal::UnknownExport);
            if !std::mem::replace(&mut self.missing_logged, true) {
                tracing::warn!(export = ?export, "a client asked for an export that does not exist (or is hidden from it)");
            } else {
                tracing::debug!(export = ?export, "a client asked again for an export that does not exist");
            }
        } else {
            tracing::debug!(export = ?shown(name), "INFO for an unknown export");
        }
        // SELECTIVETLS: a hidden export may be one only a TLS identity opens, and for such an
        // export the spec wants TLS_REQD before TLS; a missing one may get it too, so hidden
        // and missing exports still look alike.
        let reply = if self.tls == TlsMode::On && !self.tls_active && self.access.is_some() {
            REP_ERR_TLS_REQD
        } else {
            REP_ERR_UNKNOWN
        };
        let message = format!("no export named {name:?}");
        option_reply(out, option, reply, truncate_utf8(&message, MAX_MESSAGE_BYTES).as_bytes());
    }

    fn info_or_go(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>, exports: &dyn ExportProvider) -> Progress {
        let Some((name, requests)) = parse_info_request(data) else {
            option_reply(out, option, REP_ERR_INVALID, b"malformed INFO/GO request");
            return Progress::NeedMore;
        };
        let Some(mut info) = self.visible(exports, &name) else {
            self.unknown_export(option, &name, out);
            return Progress::NeedMore;
        };
        let device = if option == OPT_GO {
            match exports.open(&name, self.identity.as_deref()) {
                Ok(device) => Some(device),
                Err(error) => {
                    let export = shown(&name);
                    if !std::mem::replace(&mut self.open_failure_logged, true) {
                        tracing::warn!(export = ?export, error = ?shown(&error.message), "could not open export");
                    } else {
                        tracing::debug!(export = ?export, error = ?shown(&error.message), "could not open export, again");
                    }
                    // NBD has no "try later" reply: an export that cannot be opened now is
                    // unavailable (as nbdkit answers); the message and the count say why.
                    let (reply, refusal) = open_refusal(error.kind);
                    self.refusal = Some(refusal);
                    let message = format!("cannot open export: {}", error.message);
                    option_reply(out, option, reply, truncate_utf8(&message, MAX_MESSAGE_BYTES).as_bytes());
                    return Progress::NeedMore;
                }
            }
        } else {
            None
        };
        // The size is the opened device's: a name may open something else than it describes
        // (a VM that resumes keeps the image version it booted, whatever version is current),
        // and every request of the session is held to the size sent here.
        if let Some(device) = &device {
            info.size = device.size();
        }
        let mut payload = Vec::with_capacity(32);
        put_u16(&mut payload, INFO_EXPORT);
        put_u64(&mut payload, info.size);
        put_u16(&mut payload, transmission_flags(info.capabilities));
        option_reply(out, option, REP_INFO, &payload);
        // Block sizes are sent whether asked for or not: the minimum is what the device really
        // handles, so a client that ignores them loses nothing.
        payload.clear();
        put_u16(&mut payload, INFO_BLOCK_SIZE);
        put_u32(&mut payload, info.block_sizes.minimum);
        put_u32(&mut payload, info.block_sizes.preferred);
        put_u32(&mut payload, info.block_sizes.maximum.min(self.max_payload));
        option_reply(out, option, REP_INFO, &payload);
        if requests.contains(&INFO_NAME) {
            payload.clear();
            put_u16(&mut payload, INFO_NAME);
            payload.extend_from_slice(info.name.as_bytes());
            option_reply(out, option, REP_INFO, &payload);
        }
        if requests.contains(&INFO_DESCRIPTION) && !info.description.is_empty() {
            payload.clear();
            put_u16(&mut payload, INFO_DESCRIPTION);
            payload.extend_from_slice(info.description.as_bytes());
            option_reply(out, option, REP_INFO, &payload);
        }
        option_reply(out, option, REP_ACK, &[]);
        match device {
            Some(device) => Progress::Transmission(Negotiated {
                contexts: self.contexts_for(&name),
                export: name,
                device,
                info,
                structured_replies: self.structured_replies,
            }),
            None => Progress::NeedMore,
        }
    }
}

/// META_CONTEXT data: u32 name length, name, u32 query count, then each query as a u32 length
/// and a string. `None` if the lengths do not add up or a string is not UTF-8 or too long.
fn parse_meta_context_request(data: &[u8]) -> Option<(String, Vec<&str>)> {
    fn string(data: &[u8]) -> Option<(&str, &[u8])> {
        let len = be_u32(data.get(..4)?) as usize;
        if len > MAX_STRING_BYTES {
            return None;
        }
        let text = std::str::from_utf8(data.get(4..4 + len)?).ok()?;
        Some((text, &data[4 + len..]))
    }
    let (name, mut rest) = string(data)?;
    let count = be_u32(rest.get(..4)?) as usize;
    rest = &rest[4..];
    // Each query takes at least its length: a count the data cannot hold is a lie.
    if count > rest.len() / 4 {
        return None;
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        let (query, tail) = string(rest)?;
        queries.push(query);
        rest = tail;
    }
    rest.is_empty().then(|| (name.to_owned(), queries))
}

/// A client's string as logs show it: at most [`SHOWN_BYTES`] of it (logged with `?`, which
/// escapes control characters); a name of 4096 bytes a client sends a thousand times a second
/// must not become that much log.
fn shown(text: &str) -> &str {
    truncate_utf8(text, SHOWN_BYTES)
}

/// INFO/GO data: u32 name length, name, u16 request count, u16 requests. `None` if the lengths
/// do not add up, the name is longer than a string may be, or it is not UTF-8.
fn parse_info_request(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let name_len = be_u32(data.get(..4)?) as usize;
    // The spec's strings are at most 4096 bytes, export names included.
    if name_len > MAX_STRING_BYTES {
        return None;
    }
    let name = data.get(4..4usize.checked_add(name_len)?)?;
    let rest = &data[4 + name_len..];
    let count = be_u16(rest.get(..2)?) as usize;
    let list = &rest[2..];
    if list.len() != count * 2 {
        return None;
    }
    let requests = list.chunks_exact(2).map(be_u16).collect();
    Some((std::str::from_utf8(name).ok()?.to_owned(), requests))
}

/// The reply to an open that failed, and how the refusal is counted.
fn open_refusal(kind: DeviceErrorKind) -> (u32, Refusal) {
    match kind {
        DeviceErrorKind::Refused => (REP_ERR_POLICY, Refusal::Policy),
        DeviceErrorKind::Exhausted => (REP_ERR_UNKNOWN, Refusal::OutOfResources),
        _ => (REP_ERR_UNKNOWN, Refusal::CannotOpen),
    }
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
