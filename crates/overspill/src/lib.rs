//! The `overspill` command's library half: the wiring of engine and protocol (exports), the
//! subcommands, and small command-line helpers. It owns no storage or protocol logic.

pub mod control;
pub mod exports;
pub mod images;
pub mod metrics;
pub mod plan;
pub mod replay;
pub mod security;
pub mod serve;
pub mod size;
pub mod stat;
pub mod storm;
pub mod vms;
