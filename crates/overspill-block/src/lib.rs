//! The floor under every frontend. A frontend (NBD, vhost-user-blk) turns its protocol into
//! calls of a [`BlockDevice`] opened by an [`ExportProvider`]; the server adapts an engine
//! overlay to that trait. Between the two sit layers any device can wear ([`DeviceLayer`]: a
//! layer overrides what it adds and passes every other call on), each on its own:
//! [`Recorded`] writes every request to a trace ([`trace`], the format the storm replays and the
//! planner sizes from), [`Timed`] measures service times and [`Throttled`] holds a VM to its
//! limits ([`limit`]). One list of guest operations
//! ([`GuestOp`]) serves the whole workspace.

pub mod device;
pub mod layer;
pub mod limit;
pub mod op;
pub mod recorded;
pub mod timed;
pub mod trace;

pub use device::{
    read_whole, BlockDevice, BlockSizes, Capabilities, DepthExtent, DeviceError, DeviceErrorKind, ExportAccess,
    ExportInfo, ExportProvider, Extent, Payload, ReadRequest, SlicesPayload, VmSockets, DEFAULT_BLOCK_SIZES,
};
pub use layer::DeviceLayer;
pub use limit::{Limiter, Limits, Rate, Throttled};
pub use op::GuestOp;
pub use recorded::{Recorded, Recorder};
pub use timed::{Latencies, Timed};
