//! The `overspill` command's library half: the subcommands' flags and their wiring of the server,
//! engine and protocol crates, and small command-line helpers. It owns no storage, protocol or
//! VM-lifecycle logic.

pub mod config;
pub mod guest_storm;
pub mod guests;
pub mod image;
pub mod libvirt_hook;
pub mod libvirt_reboots;
pub mod manual;
pub mod metrics;
pub mod plan;
pub mod replay;
pub mod security;
pub mod serve;
pub mod size;
pub mod stat;
pub mod storm;
pub mod vm;

/// The version, the commit it was built from and its optional features (`overspill --version`,
/// `overspill_build_info`).
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("OVERSPILL_COMMIT"),
    ", features: ",
    env!("OVERSPILL_FEATURES"),
    ")"
);
