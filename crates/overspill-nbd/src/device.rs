//! The seam between the protocol and whatever serves the blocks.
//!
//! The protocol crate knows nothing of caching: it sees a [`BlockDevice`] per connection and an
//! [`ExportProvider`] that opens one by name. Transmission flags are derived from
//! [`Capabilities`], never hard-coded by the server loop.

use std::fmt;
use std::io::{self, IoSliceMut};

use bytes::Bytes;

/// A write's data, still to be read from the connection.
pub trait Payload {
    /// Fills `buffers`, in order, with the next bytes of the write's data; together they may not
    /// ask for more than the write carries. What a device does not take is dropped by the
    /// connection after the device returns.
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> io::Result<()>;
}

/// What a device can do; the NBD transmission flags follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    pub read_only: bool,
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// WRITE_ZEROES with NBD_CMD_FLAG_FAST_ZERO can be honoured (zeroing is never slower than a write).
    pub can_fast_zero: bool,
}

impl Capabilities {
    /// A writable device that does everything.
    pub const ALL: Capabilities = Capabilities {
        read_only: false,
        can_flush: true,
        can_fua: true,
        can_trim: true,
        can_zero: true,
        can_fast_zero: true,
    };
}

/// Block sizes advertised with NBD_INFO_BLOCK_SIZE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

/// A run of a device's bytes stored one way, as `base:allocation` block status reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// Not stored (NBD_STATE_HOLE).
    pub hole: bool,
    /// Reads as zeroes (NBD_STATE_ZERO).
    pub zero: bool,
}

/// Why a device refused or failed a command; mapped to an NBD errno in exactly one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceErrorKind {
    /// EIO: the storage behind the device failed.
    Io,
    /// ENOSPC: the device has no room for the write.
    NoSpace,
    /// EINVAL: the request makes no sense for this device.
    Invalid,
    /// ENOTSUP: the device cannot do this (e.g. FAST_ZERO that would be slow).
    NotSupported,
    /// EPERM: the device is read-only.
    ReadOnly,
    /// The export exists but this client may not open it now (a VM name already connected,
    /// or whose state was lost); NBD_REP_ERR_POLICY at the handshake.
    Refused,
    /// ENOMEM: the server lacks a resource to do this now (file descriptors at its limit); it
    /// may work later, and nothing is wrong with the export or the request.
    Exhausted,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError {
    pub kind: DeviceErrorKind,
    pub message: String,
}

impl DeviceError {
    pub fn new(kind: DeviceErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for DeviceError {}

/// One connection's view of an export. Requests reach it already validated: offset + length lie
/// within `size()`, lengths are within the advertised maximum, and commands the capabilities do
/// not allow never arrive.
///
/// Calls are synchronous and may block briefly on local file I/O.
pub trait BlockDevice: Send {
    fn size(&self) -> u64;
    fn capabilities(&self) -> Capabilities;
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError>;
    /// A read request begins: the connection answers it with one or more calls of `read` or
    /// `read_shared` (slices of a large read, the data between holes) and of
    /// `read_sent_as_zeroes`, all for this request's range. A device that counts requests counts
    /// this one here, once. The default does nothing.
    fn read_request(&mut self, offset: u64, length: u64) {
        let _ = (offset, length);
    }
    /// A run of the current read request sent as a hole chunk (zeroes the device's block status
    /// reported) without being read: for a device's accounting of what was read. The default does
    /// nothing.
    fn read_sent_as_zeroes(&mut self, offset: u64, length: u64) {
        let _ = (offset, length);
    }
    /// Reads `length` bytes at `offset` as pieces the connection sends in order, with no copy
    /// of its own: a device whose blocks are already in shared buffers lends them. The default
    /// reads into one new buffer.
    fn read_shared(&mut self, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        let mut buf = vec![0u8; length];
        self.read(offset, &mut buf)?;
        Ok(vec![Bytes::from(buf)])
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError>;
    /// A write whose `length` bytes are still in the socket: the device hands `payload` the
    /// buffers they should land in, so a device that keeps blocks in memory can have them copied
    /// once, from the socket. The default receives them into one buffer and calls `write`.
    /// If `payload` fails the connection ends, whatever this returns.
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        let mut data = vec![0; length];
        payload
            .receive(&mut [IoSliceMut::new(&mut data)])
            .map_err(|e| DeviceError::new(DeviceErrorKind::Io, format!("receiving the data: {e}")))?;
        self.write(offset, &data, fua)
    }
    /// `may_trim`: the client did not set NO_HOLE. `fast_only`: FAST_ZERO was set; fail with
    /// `NotSupported` rather than zeroing slowly.
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError>;
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError>;
    fn flush(&mut self) -> Result<(), DeviceError>;
    /// How `[offset, offset + length)` is stored, in order from `offset`: at least one extent,
    /// which may cover less than asked (the client asks again) but never more. The default calls
    /// it all data, which is always true.
    fn block_status(&mut self, offset: u64, length: u64) -> Result<Vec<Extent>, DeviceError> {
        let _ = offset;
        Ok(vec![Extent { length, hole: false, zero: false }])
    }
    /// The client will read this range soon (NBD_CMD_CACHE): a device may fetch it. Doing
    /// nothing is a correct answer, and the default.
    fn cache(&mut self, offset: u64, length: u64) -> Result<(), DeviceError> {
        let _ = (offset, length);
        Ok(())
    }
    /// The client sent NBD_CMD_DISC: it is done with the device (a VM powered off or its QEMU
    /// quit). Any other end of a connection (reset, EOF, error, timeout) comes without this call,
    /// so a device can tell a deliberate end from a lost connection when it is dropped.
    fn disconnect(&mut self) {}
    /// The client has sent nothing for a while ([`crate::Limits::quiet_after`]; called once per
    /// quiet spell) and its connection goes on waiting for the next request. A device may give
    /// back what it keeps only to serve the next requests faster; briefly, since the call runs on
    /// the connection's thread and a request arriving meanwhile waits. Doing nothing is the
    /// default.
    fn idle(&mut self) {}
    /// The connection is about to be closed because its client sent nothing for the idle
    /// timeout ([`crate::Limits::idle_timeout`]): the client is quiet (a paused or suspended
    /// VM), not gone. Called once, just before the device is dropped. Doing nothing is the
    /// default.
    fn idle_timed_out(&mut self) {}
    /// Whether the connection should end now, before serving the request it has just read (or,
    /// while its client sends nothing, at the next wake-up of its wait): the device was taken
    /// away (an operator reset it). The request stays unanswered, so a client that reconnects
    /// sends it again.
    fn closing(&self) -> bool {
        false
    }
}

/// One export as listed by NBD_OPT_LIST and described by NBD_OPT_INFO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size: u64,
    pub capabilities: Capabilities,
    pub block_sizes: BlockSizes,
}

/// Opens a device per connection. Shared by all connections of a server.
pub trait ExportProvider: Send + Sync + 'static {
    fn list(&self) -> Vec<ExportInfo>;
    /// Describes an export without opening it (NBD_OPT_INFO). `None` if unknown.
    /// The empty name means the default export.
    fn info(&self, name: &str) -> Option<ExportInfo>;
    /// Opens a fresh device for one connection (NBD_OPT_GO / NBD_OPT_EXPORT_NAME). Dropping the
    /// device ends that connection's state. `identity` is who TLS proved the client to be (see
    /// [`ExportAccess`]), `None` without one: a provider may keep what a client made for that
    /// identity alone.
    fn open(&self, name: &str, identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError>;
}

/// Which exports a client may list and open, by the identity TLS proved: its certificate's
/// common name or its PSK identity (`None` for a client without one). Exports it may not open
/// are hidden from it, as if they did not exist.
pub trait ExportAccess: Send + Sync + 'static {
    fn allows(&self, identity: Option<&str>, export: &str) -> bool;
}
