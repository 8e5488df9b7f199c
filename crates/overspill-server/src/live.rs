//! A VM's overlay while a connection serves it, shared with a move to or from a peer server
//! (see `migration`): the connection's device and the move take turns at it, request by request
//! and run by run, through one lock.
//!
//! A move adds two things to a plain connection. At the sending end, the move may hold the lock
//! through the switchover (the VM's requests wait: the fence), and the overlay may leave
//! (`vm` becomes `None`: every later request fails and the connection closes). At the receiving
//! end, the connection is *gated* until the VM's state here is the current one (the move
//! committed): its reads are read at the sender, which holds the current state (QEMU reads a
//! destination's first sector when it starts, long before its guest runs), and its first change
//! asks for the switchover and waits for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::vm_overlay::VmOverlay;
use crate::vms::Ending;

/// Reads of a VM that is still another server's, at that server.
pub(crate) trait ReadElsewhere: Send + Sync {
    /// Reads `buf` at `offset` there; `Ok(false)` when the VM is no longer there (it has moved
    /// here: the gate opens soon); `Err` when the read failed there or could not be made.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<bool, String>;
}

/// The overlay and the state of a move of it, if any.
pub(crate) struct Live {
    pub(crate) vm: Mutex<Option<VmOverlay>>,
    /// Where a gated connection's reads go meanwhile.
    elsewhere: Option<Box<dyn ReadElsewhere>>,
    /// Whether requests must pass [`Self::wait_until_current`] first (cleared once open).
    gated: AtomicBool,
    state: Mutex<LiveState>,
    changed: Condvar,
}

/// Where a receiving end's connection stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Requests are served.
    Open,
    /// The VM's state is still on its way: requests wait.
    Incoming,
    /// The move failed: requests fail, and the connection closes.
    Failed(String),
}

#[derive(Debug)]
pub(crate) struct LiveState {
    pub(crate) gate: Gate,
    /// A request is waiting at the gate: the receiving end asks the sender to switch over.
    pub(crate) switch_wanted: bool,
    /// A move is sending this overlay: the connection's end is the move's to settle.
    pub(crate) outgoing: bool,
    /// The connection ended (how), while a move had a say in what follows.
    pub(crate) ended: Option<Ending>,
}

/// How long a request waits at the gate before it is answered with an error: longer than any
/// switchover, shorter than a guest's own I/O timeout (30 s for Linux's SCSI and virtio disks).
const GATE_WAIT: Duration = Duration::from_secs(25);

/// [`GATE_WAIT`], or less with `OVERSPILL_TEST_GATE_WAIT_MS` in the environment: a test's way
/// to see a switchover outlast the wait without waiting 25 s (never longer than it).
fn gate_wait() -> Duration {
    static WAIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *WAIT.get_or_init(|| {
        let from_test = std::env::var("OVERSPILL_TEST_GATE_WAIT_MS").ok().and_then(|ms| ms.parse().ok());
        from_test.map_or(GATE_WAIT, Duration::from_millis).min(GATE_WAIT)
    })
}

/// Why a gated connection's request is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotCurrent {
    /// The move failed: the VM is not this server's, and the connection closes.
    MoveFailed(String),
    /// The switchover did not come within the wait: this request fails, and the connection
    /// stays, since the move may still commit and make the VM this server's. (Ending it then
    /// would end the VM too, and its next connection would find nothing of its writes.)
    StillMoving(String),
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Live {
    pub(crate) fn new(vm: VmOverlay) -> Self {
        Self::with_gate(vm, Gate::Open)
    }

    /// A receiving end's overlay, filled by the move before its connection is served; reads
    /// go `elsewhere` meanwhile.
    pub(crate) fn incoming(vm: VmOverlay, elsewhere: Box<dyn ReadElsewhere>) -> Self {
        Self { elsewhere: Some(elsewhere), ..Self::with_gate(vm, Gate::Incoming) }
    }

    fn with_gate(vm: VmOverlay, gate: Gate) -> Self {
        Self {
            vm: Mutex::new(Some(vm)),
            elsewhere: None,
            gated: AtomicBool::new(gate != Gate::Open),
            state: Mutex::new(LiveState { gate, switch_wanted: false, outgoing: false, ended: None }),
            changed: Condvar::new(),
        }
    }

    pub(crate) fn vm(&self) -> MutexGuard<'_, Option<VmOverlay>> {
        lock(&self.vm)
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, LiveState> {
        lock(&self.state)
    }

    /// Changes the state and wakes whoever waits on it.
    pub(crate) fn update<T>(&self, change: impl FnOnce(&mut LiveState) -> T) -> T {
        let result = change(&mut self.state());
        self.changed.notify_all();
        result
    }

    /// Waits up to `timeout` for the state to change; returns the guard again.
    pub(crate) fn wait<'a>(&self, guard: MutexGuard<'a, LiveState>, timeout: Duration) -> MutexGuard<'a, LiveState> {
        match self.changed.wait_timeout(guard, timeout) {
            Ok((guard, _)) => guard,
            Err(poisoned) => poisoned.into_inner().0,
        }
    }

    /// Whether the connection is still gated (the VM not this server's yet).
    pub(crate) fn gated(&self) -> bool {
        self.gated.load(Ordering::Acquire)
    }

    /// Opens or fails the gate.
    pub(crate) fn set_gate(&self, gate: Gate) {
        self.update(|state| state.gate = gate.clone());
        if gate == Gate::Open {
            self.gated.store(false, Ordering::Release);
        }
    }

    /// A read of a gated connection, answered where the VM's state is current: `Ok(true)` if
    /// it was (at the sender); `Ok(false)` when it is to be read here (the gate is open, or
    /// about to be: [`Self::wait_until_current`] without asking for the switchover). A read
    /// never asks for it: QEMU reads at a destination's start, before its guest runs.
    pub(crate) fn read_elsewhere(&self, offset: u64, buf: &mut [u8]) -> Result<bool, String> {
        if !self.gated.load(Ordering::Acquire) || self.state().gate != Gate::Incoming {
            return Ok(false);
        }
        let Some(elsewhere) = &self.elsewhere else { return Ok(false) };
        elsewhere.read(offset, buf)
    }

    /// Before a request: at a gated connection, waits until the VM's state here is current,
    /// asking for the switchover if `ask` (a change). `Err` says why it is not, yet or for good.
    pub(crate) fn wait_until_current(&self, ask: bool) -> Result<(), NotCurrent> {
        if !self.gated.load(Ordering::Acquire) {
            return Ok(());
        }
        let wait = gate_wait();
        let deadline = std::time::Instant::now() + wait;
        let mut state = self.state();
        if ask && state.gate == Gate::Incoming && !state.switch_wanted {
            state.switch_wanted = true;
            self.changed.notify_all();
        }
        loop {
            match &state.gate {
                Gate::Open => return Ok(()),
                Gate::Failed(why) => return Err(NotCurrent::MoveFailed(why.clone())),
                Gate::Incoming => {}
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(NotCurrent::StillMoving(format!(
                    "its state did not arrive from the peer within {:.1} s",
                    wait.as_secs_f64()
                )));
            }
            state = self.wait(state, left);
        }
    }

    /// Whether the connection's end is the move's to settle: a move is sending the overlay,
    /// or bringing it in. If so, the end is recorded for it.
    pub(crate) fn end_settled_by_move(&self, ending: Ending) -> bool {
        self.update(|state| {
            let moving = state.outgoing || state.gate == Gate::Incoming;
            state.ended = Some(ending);
            moving
        })
    }
}
