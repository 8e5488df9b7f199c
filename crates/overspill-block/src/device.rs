//! The seam between a frontend and whatever serves the blocks.
//!
//! A frontend (NBD, vhost-user-blk) knows nothing of caching: it sees a [`BlockDevice`] per
//! connection and an [`ExportProvider`] that opens one by name. What it advertises (NBD's
//! transmission flags, virtio's feature bits) follows from [`Capabilities`].

use std::fmt;
use std::io::{self, IoSlice, IoSliceMut};
use std::path::PathBuf;

use bytes::Bytes;

/// A write's data, still to be read from the connection.
pub trait Payload {
    /// Fills `buffers`, in order, with the next bytes of the write's data; together they may not
    /// ask for more than the write carries. What a device does not take is dropped by the
    /// connection after the device returns.
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> io::Result<()>;
}

/// What a device can do; a frontend's flags and feature bits follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    pub read_only: bool,
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// WRITE_ZEROES with NBD_CMD_FLAG_FAST_ZERO can be honoured (zeroing is never slower than a write).
    pub can_fast_zero: bool,
    /// Several connections to the export serve one disk, and a flush on any of them covers the
    /// writes completed on all (NBD_FLAG_CAN_MULTI_CONN).
    pub can_multi_conn: bool,
}

impl Capabilities {
    /// A writable device that does every command (one connection's: multi-conn is a property of
    /// an export's connections together, not of a device).
    pub const ALL: Capabilities = Capabilities {
        read_only: false,
        can_flush: true,
        can_fua: true,
        can_trim: true,
        can_zero: true,
        can_fast_zero: true,
        can_multi_conn: false,
    };
}

/// The request sizes a device takes (NBD_INFO_BLOCK_SIZE; virtio-blk's block size and limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

/// Any request size from one byte, 4 KiB preferred, up to 32 MiB (NBD's usual payload cap).
pub const DEFAULT_BLOCK_SIZES: BlockSizes = BlockSizes { minimum: 1, preferred: 4096, maximum: 32 << 20 };

/// A guest's read request being answered, perhaps in parts. [`ReadRequest::begin`] is the only
/// way to make one, and every read call of a [`BlockDevice`] takes one: a frontend cannot read
/// without the device having been told of the request (which is where it counts it).
#[derive(Debug)]
pub struct ReadRequest {
    offset: u64,
    length: u64,
}

impl ReadRequest {
    /// Tells `device` of a guest read of `length` bytes at `offset`: once per request, however
    /// many calls answer it.
    pub fn begin<D: BlockDevice + ?Sized>(device: &mut D, offset: u64, length: u64) -> Self {
        device.read_requested(offset, length);
        Self { offset, length }
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn length(&self) -> u64 {
        self.length
    }
}

/// A guest read answered by one call: the request begun and read into `buf`.
pub fn read_whole<D: BlockDevice + ?Sized>(device: &mut D, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
    let request = ReadRequest::begin(device, offset, buf.len() as u64);
    device.read(&request, offset, buf)
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

/// A run of a device's bytes by the layer that holds them, as `qemu:allocation-depth` reports
/// it: 0 no layer (reads as zeroes nobody stored), 1 the device's own (a VM's overlay), 2 the
/// image below it, and so on down a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DepthExtent {
    pub length: u64,
    pub depth: u32,
}

/// Why a device refused or failed a command; each frontend maps it to its own error in one place
/// (NBD: `overspill_nbd::request::errno_of`).
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
    /// A guest read request begins: [`ReadRequest::begin`] calls this, and the frontend then
    /// answers the request with calls of the read methods below (slices of a large read, the
    /// data between holes, `read_sent_as_zeroes` for holes), all within its range. A device that
    /// counts requests counts this one here, once. The default does nothing.
    fn read_requested(&mut self, offset: u64, length: u64) {
        let _ = (offset, length);
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError>;
    /// Like `read` of one buffer as long as all of `bufs`, filled in order: a virtio request's
    /// scatter list. The default reads each buffer in turn.
    fn read_vectored(
        &mut self,
        request: &ReadRequest,
        offset: u64,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Result<(), DeviceError> {
        let mut at = offset;
        for buf in bufs.iter_mut() {
            self.read(request, at, buf)?;
            at += buf.len() as u64;
        }
        Ok(())
    }
    /// A run of the request sent as zeroes its block status reported (an NBD hole chunk)
    /// without being read: for a device's accounting of what was read. The default does nothing.
    fn read_sent_as_zeroes(&mut self, request: &ReadRequest, offset: u64, length: u64) {
        let _ = (request, offset, length);
    }
    /// Reads `length` bytes at `offset` as pieces the frontend sends in order, with no copy of
    /// its own: a device whose blocks are already in shared buffers lends them. The default
    /// reads into one new buffer.
    fn read_shared(&mut self, request: &ReadRequest, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        let mut buf = vec![0u8; length];
        self.read(request, offset, &mut buf)?;
        Ok(vec![Bytes::from(buf)])
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError>;
    /// A write whose `length` bytes are still to come (in a socket, or in guest memory): the
    /// device hands `payload` the buffers they should land in, so a device that keeps blocks in
    /// memory can have them copied once, from where they are. The default receives them into one
    /// buffer and calls `write`. If `payload` fails the request fails (over NBD the connection
    /// ends), whatever this returns.
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
    /// Writes `bufs`, in order, as one write at `offset`: a virtio request's scatter list. The
    /// default hands them to `write_from`, so a device that receives writes into its own
    /// buffers copies them once.
    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        let length = bufs.iter().map(|buf| buf.len()).sum();
        self.write_from(offset, length, fua, &mut SlicesPayload::new(bufs))
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
    /// Which layer holds each part of `[offset, offset + length)`, in order from `offset`: at
    /// least one extent, which may cover less than asked but never more. The default calls it
    /// all the device's own (depth 1), which is true of a device with no image below it.
    fn allocation_depth(&mut self, offset: u64, length: u64) -> Result<Vec<DepthExtent>, DeviceError> {
        let _ = offset;
        Ok(vec![DepthExtent { length, depth: 1 }])
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
    /// The client has sent nothing for a while (the frontend's quiet time; called once per
    /// quiet spell) and its connection goes on waiting for the next request. A device may give
    /// back what it keeps only to serve the next requests faster; briefly, since the call runs on
    /// the connection's thread and a request arriving meanwhile waits. Doing nothing is the
    /// default.
    fn idle(&mut self) {}
    /// The connection is about to be closed because its client sent nothing for the idle
    /// timeout (`--idle-timeout`): the client is quiet (a paused or suspended
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
    /// [`Self::open`] for a frontend that may need the request in hand back at short notice
    /// (vhost-user: the VMM stops the device, and waits for that request before it goes on):
    /// once `hurry` says so, a request waiting for its limits or a boot slot waits no more and
    /// is served. The default ignores `hurry`, for a device that never waits.
    fn open_hurried(
        &self,
        name: &str,
        identity: Option<&str>,
        hurry: crate::limit::GiveUp,
    ) -> Result<Box<dyn BlockDevice>, DeviceError> {
        let _ = hurry;
        self.open(name, identity)
    }
}

/// A frontend whose VMs each listen on a socket of their own, made before their VMM starts
/// (vhost-user: a socket serves one device, and the VMM connects to it when it starts). The
/// control socket declares and withdraws them at run time; a declaration outlives restarts of
/// the server until it is withdrawn.
pub trait VmSockets: Send + Sync + 'static {
    /// Makes VM `vm`'s socket, serving golden image `image` (`None`: the image it is declared
    /// with already, or the default one), or keeps the one it has; returns its path. A VM
    /// declared on another image, or an image that does not exist, is refused.
    fn declare(&self, vm: &str, image: Option<&str>) -> io::Result<PathBuf>;
    /// Removes VM `vm`'s socket: `false` if it has none. Refused while a VMM is connected to it.
    fn withdraw(&self, vm: &str) -> io::Result<bool>;
    /// Each declared VM with its image and socket, by name.
    fn declared(&self) -> Vec<(String, String, PathBuf)>;
    /// Where the sockets are made.
    fn directory(&self) -> PathBuf;
}

/// Which exports a client may list and open, by the identity TLS proved: its certificate's
/// common name or its PSK identity (`None` for a client without one). Exports it may not open
/// are hidden from it, as if they did not exist.
pub trait ExportAccess: Send + Sync + 'static {
    fn allows(&self, identity: Option<&str>, export: &str) -> bool;
}

/// A write's data already in memory, as a [`Payload`]: what it gives out is copied from these
/// slices, in order.
pub struct SlicesPayload<'a> {
    slices: &'a [IoSlice<'a>],
    /// How far into `slices[0]` has been given out.
    taken: usize,
}

impl<'a> SlicesPayload<'a> {
    pub fn new(slices: &'a [IoSlice<'a>]) -> Self {
        Self { slices, taken: 0 }
    }
}

impl Payload for SlicesPayload<'_> {
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        for buffer in buffers.iter_mut() {
            let mut filled = 0;
            while filled < buffer.len() {
                let Some((first, rest)) = self.slices.split_first() else {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "asked for more than the write carries"));
                };
                let source = &first[self.taken..];
                let n = source.len().min(buffer.len() - filled);
                buffer[filled..filled + n].copy_from_slice(&source[..n]);
                filled += n;
                self.taken += n;
                if self.taken == first.len() {
                    (self.slices, self.taken) = (rest, 0);
                }
            }
        }
        Ok(())
    }
}
