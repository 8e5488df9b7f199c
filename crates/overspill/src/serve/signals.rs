//! `serve`'s signals: SIGTERM and SIGINT drain the server, SIGHUP drains it and restarts it in
//! place, once the program the restart would run says the command line and configuration file
//! as they are now may (see [`reload_refused`]).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use overspill_nbd::server::ShutdownHandle;
use overspill_server::vms::VmRegistry;
use sd_notify::NotifyState;

use super::socket::socket_access;
use super::{check_sizes_and_limits, notify_service_manager, ServeArgs};

/// Set by SIGHUP: the drain that follows ends in a restart in place.
pub(super) static RESTART: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Where a running server keeps what its VMs need across a restart in place: a SIGHUP whose
/// configuration would put it elsewhere is refused (see [`reload_refused`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunningPlaces {
    pub state_dir: PathBuf,
    pub memory_dir: PathBuf,
    pub mode: String,
}

/// Why a SIGHUP must not restart the server now (`None`: it may): asked of the program the
/// restart would run, with the command line and configuration file as they are then.
pub type ReloadCheck = Box<dyn Fn(&RunningPlaces) -> Option<String> + Send + Sync>;

/// Why a SIGHUP must not restart a server that keeps its VMs at `running` with `next`, the
/// arguments its command line and configuration file give now: they cannot start (a typo: the
/// restarted program would exit, and every VM's reconnect fail until someone came), or they
/// would keep the VMs' state or memory elsewhere (the restarted server would find no VM, and
/// each running guest reconnecting would get a fresh overlay over the golden image) or their
/// write caches in another mode (every VM refused). Run by the program the restart would run
/// (`main`'s reload check), so that a new release's flags are its own to judge.
pub fn reload_refused(next: &ServeArgs, running: &RunningPlaces) -> Option<String> {
    if let Err(error) = check_sizes_and_limits(next)
        .and_then(|()| socket_access(next).map(drop))
        .and_then(|()| next.security.security().map(drop).context("TLS and access settings"))
    {
        return Some(format!("the configuration as it is now does not start: {error:#}"));
    }
    let (state_dir, memory_dir) = (next.state_dir_in_use(), next.memory_dir_in_use());
    if (&state_dir, &memory_dir) != (&running.state_dir, &running.memory_dir) {
        return Some(format!(
            "the configuration now keeps the VMs' state in {} and their memory in {} (the running server: {} and \
             {}): a restart in place would not find the running VMs and would start them afresh from the golden \
             image; move the state while the VMs are stopped, with a stop and a start",
            state_dir.display(),
            memory_dir.display(),
            running.state_dir.display(),
            running.memory_dir.display()
        ));
    }
    if next.mode.to_string() != running.mode {
        return Some(format!(
            "the configuration now asks mode {} (the running VMs' write caches are in mode {}): a restart in place \
             would refuse every VM; change the mode while the VMs are stopped",
            next.mode, running.mode
        ));
    }
    None
}

/// What the signal thread acts on once the server serves.
pub(super) struct SignalTargets {
    pub(super) shutdown: ShutdownHandle,
    pub(super) registry: Arc<VmRegistry>,
    pub(super) reload_check: Box<dyn Fn() -> Option<String> + Send + Sync>,
}

/// The signal thread's targets, set once the server serves.
pub(super) struct SignalTargetsSlot {
    targets: Arc<std::sync::OnceLock<SignalTargets>>,
    reload_asked: Arc<std::sync::atomic::AtomicBool>,
}

impl SignalTargetsSlot {
    /// The server serves: signals drain it from now on, and a SIGHUP that came during the
    /// start is acted on now.
    pub(super) fn serve(self, targets: SignalTargets) {
        if self.targets.set(targets).is_err() {
            return;
        }
        if self.reload_asked.swap(false, std::sync::atomic::Ordering::SeqCst) {
            if let Err(error) = signal_hook::low_level::raise(signal_hook::consts::SIGHUP) {
                tracing::warn!(%error, "the reload asked for during the start could not be made");
            }
        }
    }
}

/// Takes SIGTERM, SIGINT and SIGHUP from now on. While the server starts, SIGTERM or SIGINT
/// ends the process as its default action would, and a SIGHUP waits for the server to serve.
/// Then SIGTERM or SIGINT drains the server, and SIGHUP drains it and restarts it in place
/// unless the targets' reload check says why not (then it goes on serving); a second SIGTERM or
/// SIGINT exits at once, a second SIGHUP is already under way.
pub(super) fn spawn_signal_handler() -> anyhow::Result<SignalTargetsSlot> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP]).context("installing signal handlers")?;
    let slot = SignalTargetsSlot { targets: Arc::default(), reload_asked: Arc::default() };
    let (targets, reload_asked) = (slot.targets.clone(), slot.reload_asked.clone());
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut stopping = false;
            for signal in signals.forever() {
                let Some(targets) = targets.get() else {
                    if signal == SIGHUP {
                        tracing::info!("SIGHUP while starting: the server reloads once it serves");
                        reload_asked.store(true, std::sync::atomic::Ordering::SeqCst);
                        continue;
                    }
                    tracing::warn!(signal, "signal received while starting: the start ends here");
                    let _ = signal_hook::low_level::emulate_default_handler(signal);
                    std::process::exit(1);
                };
                if stopping {
                    if signal == SIGHUP {
                        tracing::info!("SIGHUP while stopping: the drain under way goes on");
                        continue;
                    }
                    tracing::warn!(signal, "second signal: exiting without waiting for connections");
                    std::process::exit(1);
                }
                if signal == SIGHUP {
                    if let Some(why) = (targets.reload_check)() {
                        tracing::error!("SIGHUP: not restarting, the server goes on as it is: {why}");
                        notify_service_manager(&[NotifyState::Status("reload refused: see the log")]);
                        continue;
                    }
                    // A restart is cheap now that VMs outlive the process: reloading means
                    // becoming a new server, which reads every flag, credential and image again.
                    RESTART.store(true, std::sync::atomic::Ordering::SeqCst);
                    tracing::info!("SIGHUP: draining connections, then restarting in place");
                    notify_service_manager(&[NotifyState::Reloading, NotifyState::Status("restarting in place")]);
                } else {
                    tracing::info!(signal, "signal received: draining connections");
                }
                targets.registry.server_stopping();
                targets.shutdown.shutdown();
                stopping = true;
            }
        })
        .context("starting the signal thread")?;
    Ok(slot)
}
