//! Boot pacing, PVS's "maximum devices booting": a VM is *booting* from its first request on a
//! fresh overlay until `boot_time` has passed or the operator says it booted (`vm booted`); with
//! a cap, a fresh VM's first request waits, in order of arrival, until fewer than the cap are
//! booting. An array serves N booting VMs worse than N/2 twice (seed 003: the first 17-19 VMs
//! booted within two minutes, the rest queued behind them), so the later ones lose less than the
//! earlier ones gain.
//!
//! Booting VMs also go first at the host's golden-image fetch budget (`golden_budget`): their
//! fetches never wait for it, the others wait out what they took.
//!
//! Only a fresh overlay boots: a VM that resumes (a reconnect, a restarted server) or moves here
//! from a peer is running already. A VM's boot ends with its boot time whether or not it stays
//! connected: a reconnect in the middle of a boot keeps the slot until then.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use overspill_block::limit::GiveUp;
use overspill_block::{BlockDevice, DeviceError, DeviceLayer, Payload, ReadRequest};

/// How long a VM counts as booting when nothing says otherwise: seed 000's Windows 7 VMs took
/// 2 minutes on a SATA disk, and 4 minutes is the acceptable boot its sizing example takes.
pub const DEFAULT_BOOT_TIME: Duration = Duration::from_secs(180);

/// A cap on VMs booting at once (none: no wait) and how long a boot counts at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacingSettings {
    pub max_booting: Option<usize>,
    pub boot_time: Duration,
}

impl Default for PacingSettings {
    fn default() -> Self {
        Self { max_booting: None, boot_time: DEFAULT_BOOT_TIME }
    }
}

/// What the metrics show of boots.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BootFigures {
    pub booting: usize,
    pub waiting: usize,
    /// Boots begun since the server started.
    pub started: u64,
    /// Time fresh VMs' first requests waited for a boot slot, summed.
    pub waited: Duration,
    pub max_booting: Option<usize>,
}

#[derive(Debug, Default)]
struct State {
    settings: PacingSettings,
    /// Fresh VMs whose boot has not begun: their first request has not come, or waits.
    to_boot: HashSet<String>,
    /// Fresh VMs whose first request waits for a slot, in order of arrival.
    queue: VecDeque<String>,
    /// VMs booting, with when their boot began.
    booting: HashMap<String, Instant>,
    started: u64,
    waited: Duration,
    /// The server stops: no one waits any more.
    stopping: bool,
}

impl State {
    /// Ends the boots that have lasted their boot time; whether any did.
    fn expire(&mut self, now: Instant) -> bool {
        let boot_time = self.settings.boot_time;
        let before = self.booting.len();
        self.booting.retain(|_, began| now.duration_since(*began) < boot_time);
        self.booting.len() != before
    }

    fn has_slot(&self) -> bool {
        self.settings.max_booting.is_none_or(|max| self.booting.len() < max)
    }

    /// How long a waiter may sleep before a boot ends by itself.
    fn next_expiry(&self, now: Instant) -> Duration {
        let boot_time = self.settings.boot_time;
        let soonest = self.booting.values().map(|began| (*began + boot_time).saturating_duration_since(now)).min();
        soonest.unwrap_or(boot_time).clamp(Duration::from_millis(1), Duration::from_secs(1))
    }
}

/// How often a waiting first request looks whether its VM was reset meanwhile.
const CANCEL_CHECK: Duration = Duration::from_millis(200);

#[derive(Debug, Default)]
pub struct BootPacing {
    state: Mutex<State>,
    changed: Condvar,
}

impl BootPacing {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn set(&self, settings: PacingSettings) {
        self.lock().settings = settings;
        self.changed.notify_all();
    }

    /// VM `vm` has a fresh overlay: it boots from its first request (see [`Self::start_boot`]).
    pub fn fresh(&self, vm: &str) {
        let mut state = self.lock();
        state.booting.remove(vm);
        state.to_boot.insert(vm.to_owned());
        drop(state);
        // A slot it may have held is free.
        self.changed.notify_all();
    }

    /// The server stops: every first request waiting for a slot goes now, and none waits from
    /// now on (the drain must not wait out boots, nor a vhost-user device stop hang on one).
    pub fn release_all(&self) {
        let mut state = self.lock();
        state.stopping = true;
        state.to_boot.clear();
        state.queue.clear();
        drop(state);
        self.changed.notify_all();
    }

    /// Whether `vm`'s first request is still to pass [`Self::start_boot`].
    pub fn to_boot(&self, vm: &str) -> bool {
        self.lock().to_boot.contains(vm)
    }

    /// Begins `vm`'s boot, waiting for a slot under the cap first (in order of arrival).
    /// Returns how long it waited. A VM no longer to boot (a second connection of a VM whose
    /// boot began, or one the operator said booted or dropped meanwhile) passes at once, and so
    /// does one whose wait `cancelled` calls off (its VM was reset: the request then fails).
    pub fn start_boot(&self, vm: &str, cancelled: &dyn Fn() -> bool) -> Duration {
        let arrived = Instant::now();
        let mut state = self.lock();
        let (mut slept, mut counted) = (false, Duration::ZERO);
        loop {
            let now = Instant::now();
            if state.expire(now) {
                self.changed.notify_all();
            }
            let waited = if slept { now - arrived } else { Duration::ZERO };
            // Counted as it goes: a wait cut short (by `booted`, a reset, the server stopping)
            // counts too.
            state.waited += waited - counted;
            counted = waited;
            if !state.to_boot.contains(vm) || state.stopping || cancelled() {
                state.queue.retain(|queued| queued != vm);
                return waited;
            }
            if !state.queue.iter().any(|queued| queued == vm) {
                state.queue.push_back(vm.to_owned());
            }
            if state.has_slot() && state.queue.front().is_some_and(|first| first == vm) {
                state.queue.pop_front();
                state.to_boot.remove(vm);
                state.booting.insert(vm.to_owned(), now);
                state.started += 1;
                if !waited.is_zero() {
                    tracing::info!(vm, waited_ms = waited.as_millis() as u64, "VM boots: a boot slot is free");
                }
                // The next in line may have a slot too.
                self.changed.notify_all();
                return waited;
            }
            let sleep = state.next_expiry(now).min(CANCEL_CHECK);
            state = self.changed.wait_timeout(state, sleep).unwrap_or_else(PoisonError::into_inner).0;
            slept = true;
        }
    }

    /// Whether `vm` is booting now (its golden-image fetches go first).
    pub fn is_booting(&self, vm: &str) -> bool {
        let state = self.lock();
        state.booting.get(vm).is_some_and(|began| began.elapsed() < state.settings.boot_time)
    }

    /// The operator says `vm`'s boot is over (or the VM is gone): its slot goes to the next in
    /// line, and a first request of it still waiting passes. Whether it was booting or waiting.
    pub fn booted(&self, vm: &str) -> bool {
        let mut state = self.lock();
        let was = state.booting.remove(vm).is_some() | state.to_boot.remove(vm);
        state.queue.retain(|queued| queued != vm);
        drop(state);
        self.changed.notify_all();
        was
    }

    pub fn figures(&self) -> BootFigures {
        let mut state = self.lock();
        state.expire(Instant::now());
        BootFigures {
            booting: state.booting.len(),
            waiting: state.queue.len(),
            started: state.started,
            waited: state.waited,
            max_booting: state.settings.max_booting,
        }
    }
}

/// The outer layer of a VM's connection at the device seam, outside its overlay's lock: a fresh
/// VM's first request (any that reads or changes the disk) waits here for a boot slot
/// ([`BootPacing::start_boot`]), and every request, once served, waits out what its golden
/// reads owe the host's budget ([`crate::golden_budget::wait_owed`]) before it is answered.
pub struct BootGate<D> {
    inner: D,
    pacing: Arc<BootPacing>,
    vm: String,
    /// Whether the connection's waits are called off: its VM was reset, or its server stops.
    give_up: GiveUp,
    open: bool,
}

impl<D: BlockDevice> BootGate<D> {
    /// `open`: the VM is not to boot (it resumes, or moved here), and its requests pass.
    pub fn new(inner: D, pacing: Arc<BootPacing>, vm: String, give_up: GiveUp, open: bool) -> Self {
        Self { inner, pacing, vm, give_up, open }
    }

    fn pass(&mut self) {
        if !self.open {
            self.pacing.start_boot(&self.vm, &*self.give_up);
            // A wait called off is no boot slot: the request in hand passes (a reset VM's then
            // fails; a VMM stopping the device has it back), and the next one waits again.
            self.open = !self.pacing.to_boot(&self.vm);
        }
    }

    /// Passes the gate, serves the request below, then waits out what it owes.
    fn served<R>(&mut self, call: impl FnOnce(&mut D) -> R) -> R {
        self.pass();
        let result = call(&mut self.inner);
        crate::golden_budget::wait_owed(&*self.give_up);
        result
    }
}

impl<D: BlockDevice> DeviceLayer for BootGate<D> {
    type Below = D;

    fn below(&self) -> &D {
        &self.inner
    }

    fn below_mut(&mut self) -> &mut D {
        &mut self.inner
    }

    fn read_requested(&mut self, offset: u64, length: u64) {
        self.pass();
        self.inner.read_requested(offset, length)
    }

    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.served(|inner| inner.read(request, offset, buf))
    }

    fn read_vectored(
        &mut self,
        request: &ReadRequest,
        offset: u64,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Result<(), DeviceError> {
        self.served(|inner| inner.read_vectored(request, offset, bufs))
    }

    fn read_shared(&mut self, request: &ReadRequest, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        self.served(|inner| inner.read_shared(request, offset, length))
    }

    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.served(|inner| inner.write(offset, data, fua))
    }

    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        self.served(|inner| inner.write_from(offset, length, fua, payload))
    }

    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        self.served(|inner| inner.write_vectored(offset, bufs, fua))
    }

    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.served(|inner| inner.write_zeroes(offset, length, may_trim, fast_only, fua))
    }

    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.served(|inner| inner.trim(offset, length, fua))
    }

    fn cache(&mut self, offset: u64, length: u64) -> Result<(), DeviceError> {
        self.served(|inner| inner.cache(offset, length))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn never() -> bool {
        false
    }

    fn paced(max: usize, boot_time: Duration) -> Arc<BootPacing> {
        let pacing = Arc::new(BootPacing::default());
        pacing.set(PacingSettings { max_booting: Some(max), boot_time });
        pacing
    }

    /// Starts `vm`'s boot on a thread of its own; the handle says how long it waited.
    fn boot_in_background(pacing: &Arc<BootPacing>, vm: &str) -> std::thread::JoinHandle<Duration> {
        let (pacing, vm) = (pacing.clone(), vm.to_owned());
        std::thread::spawn(move || pacing.start_boot(&vm, &never))
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < until, "{what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn beyond_the_cap_fresh_vms_wait_in_order_until_a_boot_ends() {
        let pacing = paced(2, Duration::from_secs(3600));
        for vm in ["a", "b", "c", "d"] {
            pacing.fresh(vm);
        }
        assert_eq!(pacing.start_boot("a", &never), Duration::ZERO);
        assert_eq!(pacing.start_boot("b", &never), Duration::ZERO);
        let c = boot_in_background(&pacing, "c");
        wait_until("c queued", || pacing.figures().waiting == 1);
        let d = boot_in_background(&pacing, "d");
        wait_until("d queued", || pacing.figures().waiting == 2);
        assert!(pacing.is_booting("a") && !pacing.is_booting("c"));
        assert!(!pacing.is_booting("d") && pacing.to_boot("d"), "d waits to boot");
        // a's boot is said over: c, first in line, takes its slot; d still waits.
        assert!(pacing.booted("a"));
        c.join().expect("c");
        assert!(pacing.is_booting("c") && !pacing.is_booting("a"));
        assert_eq!(pacing.figures().waiting, 1);
        assert!(pacing.booted("b"));
        assert!(d.join().expect("d") > Duration::ZERO);
        let figures = pacing.figures();
        assert_eq!((figures.booting, figures.waiting, figures.started), (2, 0, 4));
        // A second connection of a VM whose boot began passes at once; so does a resumed VM.
        assert_eq!(pacing.start_boot("c", &never), Duration::ZERO);
        assert_eq!(pacing.start_boot("never-fresh", &never), Duration::ZERO);
    }

    #[test]
    fn a_boot_ends_by_itself_after_the_boot_time() {
        let pacing = paced(1, Duration::from_millis(200));
        pacing.fresh("a");
        pacing.fresh("b");
        pacing.start_boot("a", &never);
        // b waits for a's boot time to pass, nothing else.
        let waited = pacing.start_boot("b", &never);
        assert!(waited > Duration::from_millis(100), "b waited {waited:?}");
        assert!(!pacing.is_booting("a") && pacing.is_booting("b"));
    }

    #[test]
    fn without_a_cap_no_one_waits_and_boots_are_still_known() {
        let pacing = Arc::new(BootPacing::default());
        for vm in 0..50 {
            pacing.fresh(&vm.to_string());
            assert_eq!(pacing.start_boot(&vm.to_string(), &never), Duration::ZERO);
        }
        assert_eq!(pacing.figures().booting, 50);
        assert!(pacing.is_booting("7"));
        // A fresh overlay again (a reset): booting again from its first request.
        pacing.fresh("7");
        assert!(!pacing.is_booting("7") && pacing.to_boot("7"));
    }

    #[test]
    fn a_reset_or_the_server_stopping_calls_the_waits_off() {
        let pacing = paced(1, Duration::from_secs(3600));
        for vm in ["a", "b", "c"] {
            pacing.fresh(vm);
        }
        pacing.start_boot("a", &never);
        let reset = Arc::new(AtomicBool::new(false));
        let b = {
            let (pacing, reset) = (pacing.clone(), reset.clone());
            std::thread::spawn(move || pacing.start_boot("b", &|| reset.load(Ordering::SeqCst)))
        };
        wait_until("b queued", || pacing.figures().waiting == 1);
        reset.store(true, Ordering::SeqCst);
        assert!(b.join().expect("b") > Duration::ZERO, "b's wait was called off by its reset");
        assert_eq!(pacing.figures().waiting, 0, "and b left the line");
        let c = boot_in_background(&pacing, "c");
        wait_until("c queued", || pacing.figures().waiting == 1);
        pacing.release_all();
        c.join().expect("c");
        pacing.fresh("d");
        assert_eq!(pacing.start_boot("d", &never), Duration::ZERO, "a stopping server makes no one wait");
        assert!(pacing.figures().waited > Duration::ZERO, "the waits cut short are counted");
    }

    /// A request whose wait for a boot slot is called off (a VMM stopping the device wants it
    /// back at once) passes without a slot, and the VM's next request waits for one again.
    #[test]
    fn a_wait_called_off_is_no_boot_slot() {
        use overspill_block::BlockDevice;
        let pacing = paced(1, Duration::from_secs(3600));
        pacing.fresh("a");
        pacing.fresh("b");
        assert_eq!(pacing.start_boot("a", &never), Duration::ZERO);
        let hurry = Arc::new(AtomicBool::new(true));
        let called_off = hurry.clone();
        let disk = crate::device::tests::Counted { bytes: vec![0; 4096], writes: 0 };
        let give_up: GiveUp = Arc::new(move || called_off.load(Ordering::SeqCst));
        let mut gate = BootGate::new(disk, pacing.clone(), "b".into(), give_up, false);
        BlockDevice::write(&mut gate, 0, &[1; 512], false).expect("the write in hand passes");
        assert!(pacing.to_boot("b") && !pacing.is_booting("b"), "b passed without a slot");
        hurry.store(false, Ordering::SeqCst);
        let next = std::thread::spawn(move || BlockDevice::write(&mut gate, 512, &[2; 512], false).map(|()| gate));
        wait_until("b's next request waits for a slot", || pacing.figures().waiting == 1);
        assert!(pacing.booted("a"));
        let gate = next.join().expect("b's next request").expect("written");
        assert!(pacing.is_booting("b"), "b boots in a's slot");
        assert_eq!(gate.inner.writes, 2);
    }

    #[test]
    fn a_vm_dropped_while_waiting_lets_its_request_go_and_leaves_the_line() {
        let pacing = paced(1, Duration::from_secs(3600));
        pacing.fresh("a");
        pacing.fresh("b");
        pacing.start_boot("a", &never);
        let b = boot_in_background(&pacing, "b");
        wait_until("b queued", || pacing.figures().waiting == 1);
        assert!(pacing.booted("b"));
        b.join().expect("b");
        assert!(!pacing.is_booting("b") && pacing.is_booting("a"));
        assert_eq!(pacing.figures().waiting, 0);
    }
}
