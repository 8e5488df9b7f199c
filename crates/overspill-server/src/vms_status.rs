//! How the registry's VMs show: their states and the lines of `vm list`.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use overspill_engine::VmStats;
use serde::{Deserialize, Serialize};

use super::{lock, moves, Entry, Registered, VmRegistry};

/// A VM's state, as `vm list` and the metrics show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VmState {
    Connected,
    /// Reset asked while connected: the connection closes at its next request (or, if its
    /// client sends none, at the next wake-up of its wait, at most 20 s).
    Resetting,
    InGrace,
    Lost,
    /// Declared for a frontend that listens per VM (vhost-user), with no overlay yet: its
    /// socket waits for its VMM. The control socket knows these, not the registry.
    Declared,
    /// Being sent to a peer server (live migration): still this server's until the switchover.
    Outgoing,
    /// Being taken from a peer server: its requests here wait until the switchover.
    Incoming,
    /// A fork (`vm fork`) with no overlay yet: it starts from its checkpoint when it connects.
    Fork,
    /// A fork dropped by `vm drop`: its name is refused until `vm reset`.
    Dropped,
}

impl VmState {
    pub const ALL: [VmState; 8] = [
        Self::Connected,
        Self::Resetting,
        Self::InGrace,
        Self::Lost,
        Self::Outgoing,
        Self::Incoming,
        Self::Fork,
        Self::Dropped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connected => "connected",
            Self::Resetting => "resetting",
            Self::InGrace => "in-grace",
            Self::Lost => "lost",
            Self::Declared => "declared",
            Self::Outgoing => "outgoing",
            Self::Incoming => "incoming",
            Self::Fork => "fork",
            Self::Dropped => "dropped",
        }
    }
}

impl fmt::Display for VmState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A VM with an overlay, for metrics and status views.
#[derive(Debug, Clone)]
pub struct VmHandle {
    pub export: String,
    pub vm: String,
    pub stats: Arc<VmStats>,
}

/// One line of `vm list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    pub vm: String,
    pub image: String,
    /// The TLS identity that made it, the only one that may open it (none: made without TLS).
    /// Always written, `null` when there is none, so that `vm list --json` has the same keys
    /// for every VM.
    #[serde(default)]
    pub owner: Option<String>,
    pub state: VmState,
    pub memory_bytes: u64,
    pub spill_bytes: u64,
    pub age_s: u64,
    /// Seconds of grace left (in grace), or why the VM is lost.
    pub detail: String,
    /// Its vhost-user socket, if it is declared for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
}

/// What `vm list` says of a VM in grace with no end.
const WAITS_FOR_ITS_CLIENT: &str = "cut for idleness: waits for its client";

impl VmRegistry {
    /// Named VMs and their states (anonymous connections are not listed).
    pub fn list(&self) -> Vec<VmStatus> {
        let inner = lock(&self.inner);
        let now = Instant::now();
        let mut out: Vec<VmStatus> = inner
            .vms
            .values()
            .filter(|e| e.named)
            .map(|e| {
                let state = entry_state(e);
                let detail = match (e.grace.as_ref().map(|g| g.until), &e.moving) {
                    (_, Some(moving)) => Self::move_detail(moving),
                    (Some(Some(until)), _) => {
                        format!("{}s of grace left", until.saturating_duration_since(now).as_secs())
                    }
                    (Some(None), _) => WAITS_FOR_ITS_CLIENT.to_owned(),
                    (None, _) => String::new(),
                };
                VmStatus {
                    vm: e.handle.vm.clone(),
                    image: e.handle.export.clone(),
                    owner: e.owner.clone(),
                    state,
                    memory_bytes: e.handle.stats.cache_memory_used_bytes.get(),
                    spill_bytes: e.handle.stats.cache_disk_used_bytes.get(),
                    age_s: now.duration_since(e.created).as_secs(),
                    detail,
                    socket: None,
                }
            })
            .collect();
        out.extend(inner.lost.iter().map(|(vm, why)| VmStatus {
            vm: vm.clone(),
            image: String::new(),
            owner: None,
            state: VmState::Lost,
            memory_bytes: 0,
            spill_bytes: 0,
            age_s: 0,
            detail: why.clone(),
            socket: None,
        }));
        out.extend(Self::waiting_forks(&inner).map(|(vm, fork)| VmStatus {
            vm: vm.clone(),
            image: format!("{}:{}", fork.image, fork.checkpoint),
            owner: None,
            state: if fork.dropped { VmState::Dropped } else { VmState::Fork },
            memory_bytes: 0,
            spill_bytes: 0,
            age_s: 0,
            detail: if fork.dropped {
                "refused until `vm reset`".to_owned()
            } else {
                "waits for its first connection".to_owned()
            },
            socket: None,
        }));
        drop(inner);
        // Told apart outside the registry's lock: it reads the image store.
        for status in out.iter_mut().filter(|status| status.detail == WAITS_FOR_ITS_CLIENT) {
            let image = status.image.split_once(':').map_or(status.image.as_str(), |(image, _)| image);
            if self.maintains(image, &status.vm, &status.image) {
                status.detail = "maintenance VM: waits for its next boot".to_owned();
            }
        }
        out.sort_by(|a, b| a.vm.cmp(&b.vm));
        out
    }

    /// Forks with no overlay here (and not lost): waiting for their first connection, or dropped.
    fn waiting_forks(inner: &Registered) -> impl Iterator<Item = (&String, &crate::forks::Fork)> {
        inner.forks.iter().filter(|(vm, _)| !inner.names.contains_key(*vm) && !inner.lost.contains_key(*vm))
    }

    /// How many VMs are in each state.
    pub fn state_counts(&self) -> Vec<(VmState, u64)> {
        let inner = lock(&self.inner);
        VmState::ALL
            .into_iter()
            .map(|state| {
                let count = match state {
                    VmState::Lost => inner.lost.len() as u64,
                    VmState::Fork | VmState::Dropped => Self::waiting_forks(&inner)
                        .filter(|(_, fork)| fork.dropped == (state == VmState::Dropped))
                        .count() as u64,
                    _ => inner.vms.values().filter(|e| e.named && entry_state(e) == state).count() as u64,
                };
                (state, count)
            })
            .collect()
    }
}

fn entry_state(entry: &Entry) -> VmState {
    match &entry.moving {
        Some(moving) if moving.direction == moves::Direction::Outgoing => return VmState::Outgoing,
        Some(_) => return VmState::Incoming,
        None => {}
    }
    match (&entry.grace, entry.reset.load(Ordering::Relaxed)) {
        (Some(_), _) => VmState::InGrace,
        (None, true) => VmState::Resetting,
        (None, false) => VmState::Connected,
    }
}
