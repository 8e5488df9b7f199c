//! Storms: many VMs booting, logging on and working at once over real NBD connections, with the
//! workload models that say what each VM does ([`profile`]), the driver that runs them
//! ([`driver`]), the same runs through the engine alone ([`model`]), the planner built on it
//! ([`plan`]) with its storage model ([`storage`]) and fleet plans ([`fleet`]), the accounting of
//! real guests that run by themselves ([`observed`]), replays of recorded traces (whose format is
//! `overspill_block::trace`) and the reports in the seeds' table format ([`report`], [`page`]).
//!
//! This crate knows no server: it connects to an NBD URI, and reads the engine's per-VM counters
//! only when the caller hands them over (a server in the same process); the model builds its own
//! overlays from the engine.

pub mod driver;
pub mod fleet;
pub mod model;
pub mod observed;
pub mod page;
pub mod plan;
pub mod profile;
pub mod report;
pub mod seeds;
pub mod storage;

pub use driver::{StormConfig, Target};
pub use profile::Workload;
