//! The vhost-user-blk frontend: a VMM (QEMU, cloud-hypervisor, Firecracker, crosvm) hands a
//! virtio-blk device's queues and its guest's memory to this process over a Unix socket, and each
//! request is carried out on the [`overspill_block::BlockDevice`] seam, as NBD's are. One socket
//! per VM, named for it; a connection opens the VM's device, and dropping it when the
//! connection ends is the VM's lost connection (or, when QEMU stopped the device first, its
//! deliberate end), with the same grace and reconnect rules as over NBD.

mod backend;
pub mod config;
pub mod request;
mod serve;
#[cfg(test)]
mod testing;

pub use config::{DeviceConfig, Limits};
pub use serve::{VhostExport, VhostExports, VhostSettings, WriteWhole};
