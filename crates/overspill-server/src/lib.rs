//! Serving VMs' disks: what sits between an NBD connection and an engine overlay. It owns the
//! adapter from exports to overlays (`exports`), the registry of named VMs with their reconnect
//! grace and the ledger that lets their state outlive the process (`vms`), the naming of cache
//! and state files, the files it writes whole (`files`), the versioned golden-image store (`images`) and the control socket
//! (`control`). It knows neither the command line nor how the engine caches; the `overspill`
//! command parses flags and wires these parts together.

pub mod control;
mod device;
pub mod error;
pub mod exports;
pub mod files;
pub mod images;
pub mod vms;

pub use error::{check_name, ServerError};
