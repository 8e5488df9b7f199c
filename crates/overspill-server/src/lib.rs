//! Serving VMs' disks: what sits between a frontend's connection and an engine overlay. It owns
//! the adapter from exports to overlays (`exports`), each connection's device and the layers it
//! wears (`device`), a VM's overlay as it waits between connections (`vm_overlay`), the registry
//! of named VMs with their reconnect grace (`vms`), their I/O limits (`vm_limits`) and which
//! may take several connections (`multi_conn`), the ledger that lets their state outlive the
//! process and the naming of state files (`ledger`), the moving of a running VM's overlay to a
//! peer server (`migration`, over the overlay a connection shares with a move: `live`), the
//! files it writes whole (`files`), the versioned golden-image store (`images`), checkpoints
//! of it taken out and brought in (`checkpoints`), forks pinned to them (`forks`) and the
//! control socket (`control`). It knows neither the command line, nor a frontend's protocol, nor how the
//! engine caches; the `overspill` command parses flags and wires these parts together.

pub mod boot_pacing;
pub mod checkpoints;
pub mod control;
mod device;
pub mod error;
pub mod exports;
pub mod files;
pub mod forks;
pub mod golden_budget;
pub mod image_digest;
pub mod images;
pub mod ledger;
mod live;
pub mod migration;
mod multi_conn;
pub mod vm_limits;
pub mod vm_overlay;
pub mod vms;

pub use error::{check_name, ServerError};
