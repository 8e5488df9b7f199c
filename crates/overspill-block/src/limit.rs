//! Limits on what a VM (or a group of VMs) may ask per second, applied at the device seam so
//! that every frontend gets them: operations per second and bytes per second, each a token
//! bucket with a burst. A request is charged when it arrives and waits until its buckets are out
//! of debt, so over any time `t` a limiter lets through at most `rate × t + burst` (and one
//! request more, the one that went into debt). The clock is a parameter: tests run the
//! limiter on a clock of their own, deterministically.

use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::device::{BlockDevice, DeviceError, Payload};
use crate::layer::DeviceLayer;

/// A rate with its burst, in operations or bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_second: u64,
    /// What may go at once after a quiet spell; at least one request's worth is always let
    /// through (into debt).
    pub burst: u64,
}

/// What a limiter holds to: either, both or neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub ops: Option<Rate>,
    pub bytes: Option<Rate>,
}

impl Limits {
    pub fn is_none(&self) -> bool {
        self.ops.is_none() && self.bytes.is_none()
    }
}

impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rate = |r: Option<Rate>, unit: &str| match r {
            Some(r) => format!("{} {unit}/s (burst {})", r.per_second, r.burst),
            None => format!("no {unit} limit"),
        };
        write!(f, "{}, {}", rate(self.ops, "ops"), rate(self.bytes, "bytes"))
    }
}

/// Time as a limiter sees it.
pub trait Clock: Send + Sync {
    /// Time since a fixed start.
    fn now(&self) -> Duration;
    fn sleep(&self, wait: Duration);
}

/// The host's monotonic clock.
pub struct SystemClock(Instant);

impl SystemClock {
    pub fn shared() -> Arc<dyn Clock> {
        Arc::new(Self(Instant::now()))
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }

    fn sleep(&self, wait: Duration) {
        std::thread::sleep(wait)
    }
}

#[derive(Debug)]
struct Bucket {
    rate: Rate,
    /// May go below zero: the debt a request left, which the next ones wait out.
    tokens: f64,
    at: Duration,
}

impl Bucket {
    fn new(rate: Rate, now: Duration) -> Self {
        Self { rate, tokens: rate.burst as f64, at: now }
    }

    /// Charges `cost` at `now`; the wait until the bucket is out of debt.
    fn charge(&mut self, cost: u64, now: Duration) -> Duration {
        let per_second = self.rate.per_second.max(1) as f64;
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * per_second).min(self.rate.burst as f64);
        self.at = now;
        self.tokens -= cost as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / per_second)
        }
    }

    /// A new rate: the tokens saved so far stay, up to the new burst.
    fn set(&mut self, rate: Rate) {
        self.rate = rate;
        self.tokens = self.tokens.min(rate.burst as f64);
    }
}

#[derive(Debug, Default)]
struct State {
    ops: Option<Bucket>,
    bytes: Option<Bucket>,
    /// Time requests spent waiting here, summed.
    throttled: Duration,
    /// Requests waiting now.
    waiting: u64,
    /// Requests that went ahead of the limits (priority), counted.
    went_ahead: u64,
}

/// One VM's or one group's limits and buckets; shared by the connections it limits.
pub struct Limiter {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    /// Whether any limit is set: a VM without one (most) passes without taking the lock.
    active: AtomicBool,
    /// Counts [`Self::set`] calls, so that a request waiting looks again at what it owes.
    changes: AtomicU64,
}

impl Limiter {
    pub fn new(limits: Limits, clock: Arc<dyn Clock>) -> Arc<Self> {
        let limiter = Arc::new(Self {
            state: Mutex::default(),
            clock,
            active: AtomicBool::new(false),
            changes: AtomicU64::new(0),
        });
        limiter.set(limits);
        limiter
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Changes the limits while requests flow: a bucket kept keeps its saved tokens (up to the
    /// new burst) and its debt, a new one starts full.
    pub fn set(&self, limits: Limits) {
        let now = self.clock.now();
        let mut state = self.lock();
        let update = |bucket: &mut Option<Bucket>, rate: Option<Rate>| match (bucket.as_mut(), rate) {
            (Some(kept), Some(rate)) => kept.set(rate),
            (_, rate) => *bucket = rate.map(|rate| Bucket::new(rate, now)),
        };
        update(&mut state.ops, limits.ops);
        update(&mut state.bytes, limits.bytes);
        self.active.store(!limits.is_none(), Ordering::Release);
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// How long until this limiter's buckets are out of the debt they hold now, at their rates
    /// now: at most what a request waiting here still has to wait, whatever it was told when
    /// it came, and what the next request would wait at least.
    pub fn owed(&self) -> Duration {
        self.charge(0, 0)
    }

    pub fn limits(&self) -> Limits {
        let state = self.lock();
        Limits { ops: state.ops.as_ref().map(|b| b.rate), bytes: state.bytes.as_ref().map(|b| b.rate) }
    }

    /// Time requests waited here, summed, and how many wait now.
    pub fn throttled(&self) -> (Duration, u64) {
        let state = self.lock();
        (state.throttled, state.waiting)
    }

    /// Whether any limit is set.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Charges `ops` operations of `bytes` in all and says how long they must wait.
    fn charge(&self, ops: u64, bytes: u64) -> Duration {
        if !self.is_active() {
            return Duration::ZERO;
        }
        let now = self.clock.now();
        let mut state = self.lock();
        let ops = state.ops.as_mut().map_or(Duration::ZERO, |b| b.charge(ops, now));
        let bytes = state.bytes.as_mut().map_or(Duration::ZERO, |b| b.charge(bytes, now));
        ops.max(bytes)
    }

    /// Charges `ops` operations of `bytes` in all that go ahead without waiting (a class of
    /// requests with priority): the debt they leave is waited out by the others, up to
    /// [`AHEAD_DEBT_SECONDS`] of each rate; what goes ahead beyond that is not charged, so that
    /// however many go ahead, the others never wait longer for them than that.
    pub fn charge_ahead(&self, ops: u64, bytes: u64) {
        if !self.is_active() {
            return;
        }
        let now = self.clock.now();
        let mut state = self.lock();
        let state = &mut *state;
        let mut held = false;
        for (bucket, cost) in [(state.ops.as_mut(), ops), (state.bytes.as_mut(), bytes)] {
            if let Some(bucket) = bucket {
                // The debt others left stays theirs: what goes ahead may deepen it down to the
                // floor, never lift it (one fetch that went ahead once cleared what running
                // VMs owed, and they overtook those already waiting).
                let before = bucket.tokens;
                held |= !bucket.charge(cost, now).is_zero();
                let floor = -(bucket.rate.per_second as f64) * AHEAD_DEBT_SECONDS;
                bucket.tokens = bucket.tokens.max(floor.min(before));
            }
        }
        if held {
            state.went_ahead += 1;
        }
    }

    /// How many requests went ahead ([`Self::charge_ahead`]) while the limits would have held
    /// them.
    pub fn went_ahead(&self) -> u64 {
        self.lock().went_ahead
    }

    fn begin_wait(&self) {
        self.lock().waiting += 1;
    }

    fn end_wait(&self, waited: Duration) {
        let mut state = self.lock();
        state.waiting = state.waiting.saturating_sub(1);
        state.throttled += waited;
    }
}

/// Lets one request of `bytes` through every limiter of `chain` (a VM's own, then its group's):
/// each is charged, and the request waits for the slowest. Returns the time it waited.
pub fn admit(chain: &[Arc<Limiter>], bytes: u64) -> Duration {
    admit_counted(chain, 1, bytes)
}

/// Like [`admit`], for `ops` operations of `bytes` in all, charged at once: what a read cache
/// fetched to answer one request, charged after the fetch (the wait then delays the request's
/// answer, and the next requests, rather than the fetch).
pub fn admit_counted(chain: &[Arc<Limiter>], ops: u64, bytes: u64) -> Duration {
    wait_out(chain, reserve(chain, ops, bytes))
}

/// Charges `ops` operations of `bytes` in all to every limiter of `chain` and says how long
/// they must wait, without waiting: for a caller that waits later ([`wait_out`]), out of a
/// lock it holds now.
pub fn reserve(chain: &[Arc<Limiter>], ops: u64, bytes: u64) -> Duration {
    // Every limiter is charged, whatever the others say (no allocation: this is every request).
    chain.iter().fold(Duration::ZERO, |wait, limiter| wait.max(limiter.charge(ops, bytes)))
}

/// The longest a waiter sleeps before it looks again whether its limits were lifted.
const WAKE_SLICE: Duration = Duration::from_millis(50);

/// How far below zero requests that go ahead ([`Limiter::charge_ahead`]) may take a bucket, in
/// seconds of its rate.
pub const AHEAD_DEBT_SECONDS: f64 = 2.0;

/// Waits `wait` (what [`reserve`] said), counted as throttled time at every limiter of `chain`,
/// or less if meanwhile its limits changed: a request held by a limit the operator took away
/// (`vm limit … off`) or raised goes as soon as the limits still set let it, within a
/// [`WAKE_SLICE`], whichever of the chain's limiters held it. Returns the time waited.
pub fn wait_out(chain: &[Arc<Limiter>], wait: Duration) -> Duration {
    wait_out_unless(chain, wait, &|| false)
}

/// [`wait_out`], given up within a [`WAKE_SLICE`] once `give_up` says so: the request's VM was
/// reset, or its server is stopping and drains its connections (a request held for minutes by
/// a low limit would outlast the drain, and its VM be handed over as after a crash).
pub fn wait_out_unless(chain: &[Arc<Limiter>], mut wait: Duration, give_up: &dyn Fn() -> bool) -> Duration {
    let Some(first) = chain.first() else { return Duration::ZERO };
    if wait.is_zero() {
        return wait;
    }
    chain.iter().for_each(|limiter| limiter.begin_wait());
    let changes = |chain: &[Arc<Limiter>]| chain.iter().map(|l| l.changes.load(Ordering::Acquire)).sum::<u64>();
    let mut seen = changes(chain);
    let mut waited = Duration::ZERO;
    // Every limit lifted (between the charge and this wait too): nothing left to wait for.
    while waited < wait && chain.iter().any(|limiter| limiter.is_active()) && !give_up() {
        let slice = (wait - waited).min(WAKE_SLICE);
        first.clock.sleep(slice);
        waited += slice;
        let now_seen = changes(chain);
        if now_seen != seen {
            seen = now_seen;
            // What the limits set now still hold against: less than was owed, never more (the
            // debt counted now may be later requests' too, and a lowered rate does not lengthen
            // a wait already begun).
            let owed = chain.iter().map(|limiter| limiter.owed()).max().unwrap_or(Duration::ZERO);
            wait = wait.min(waited + owed);
        }
    }
    chain.iter().for_each(|limiter| limiter.end_wait(waited));
    waited
}

/// A device whose requests pass a chain of limiters before they reach it. Reads are charged
/// when they are asked for (once, whatever the parts they are answered in), prefetches
/// (NBD_CMD_CACHE) as reads, writes, zeroes and trims when they arrive (zeroes and trims as
/// operations of no bytes: they move no data); flushes go free.
pub struct Throttled<D> {
    /// Dropped before the device under it: a device whose drop ends its VM finds the VM's
    /// limiter held by no connection, free to go with it.
    chain: Vec<Arc<Limiter>>,
    /// When a request stops waiting for its limits ([`wait_out_unless`]).
    give_up: GiveUp,
    inner: D,
}

/// Says when a wait is to be given up; shared by the layers of one connection.
pub type GiveUp = Arc<dyn Fn() -> bool + Send + Sync>;

impl<D: BlockDevice> Throttled<D> {
    pub fn new(inner: D, chain: Vec<Arc<Limiter>>) -> Self {
        Self::giving_up(inner, chain, Arc::new(|| false))
    }

    /// [`Self::new`], its requests' waits given up once `give_up` says so.
    pub fn giving_up(inner: D, chain: Vec<Arc<Limiter>>, give_up: GiveUp) -> Self {
        Self { chain, give_up, inner }
    }

    fn admit(&self, bytes: u64) {
        wait_out_unless(&self.chain, reserve(&self.chain, 1, bytes), &*self.give_up);
    }
}

impl<D: BlockDevice> DeviceLayer for Throttled<D> {
    type Below = D;

    fn below(&self) -> &D {
        &self.inner
    }

    fn below_mut(&mut self) -> &mut D {
        &mut self.inner
    }

    fn read_requested(&mut self, offset: u64, length: u64) {
        self.admit(length);
        self.inner.read_requested(offset, length)
    }

    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.admit(data.len() as u64);
        self.inner.write(offset, data, fua)
    }

    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        self.admit(length as u64);
        self.inner.write_from(offset, length, fua, payload)
    }

    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        self.admit(bufs.iter().map(|b| b.len() as u64).sum());
        self.inner.write_vectored(offset, bufs, fua)
    }

    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.admit(0);
        self.inner.write_zeroes(offset, length, may_trim, fast_only, fua)
    }

    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.admit(0);
        self.inner.trim(offset, length, fua)
    }

    /// A prefetch reads golden-image bytes as a read would: charged as one.
    fn cache(&mut self, offset: u64, length: u64) -> Result<(), DeviceError> {
        self.admit(length);
        self.inner.cache(offset, length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock that moves only when someone sleeps on it (or a test moves it).
    #[derive(Default)]
    struct FakeClock(Mutex<Duration>);

    impl FakeClock {
        fn advance(&self, by: Duration) {
            *self.0.lock().expect("clock") += by;
        }
    }

    impl Clock for FakeClock {
        fn now(&self) -> Duration {
            *self.0.lock().expect("clock")
        }

        fn sleep(&self, wait: Duration) {
            self.advance(wait);
        }
    }

    fn ops(per_second: u64, burst: u64) -> Limits {
        Limits { ops: Some(Rate { per_second, burst }), bytes: None }
    }

    /// Requests sent back to back for `for_s` seconds of the fake clock: how many went through.
    fn requests_in(chain: &[Arc<Limiter>], clock: &FakeClock, for_s: f64, bytes: u64) -> u64 {
        let end = clock.now() + Duration::from_secs_f64(for_s);
        let mut sent = 0;
        while clock.now() < end {
            admit(chain, bytes);
            sent += 1;
        }
        sent
    }

    #[test]
    fn a_rate_lets_through_its_burst_then_its_rate() {
        let clock = Arc::new(FakeClock::default());
        let limiter = Limiter::new(ops(1000, 100), clock.clone());
        // The burst goes at once.
        for _ in 0..100 {
            assert_eq!(admit(std::slice::from_ref(&limiter), 4096), Duration::ZERO);
        }
        // Then one request each millisecond.
        assert_eq!(admit(std::slice::from_ref(&limiter), 4096), Duration::from_millis(1));
        let sent = requests_in(std::slice::from_ref(&limiter), &clock, 10.0, 4096);
        assert!((9_999..=10_001).contains(&sent), "{sent} in 10 s at 1,000/s");
        let (throttled, waiting) = limiter.throttled();
        assert!((throttled.as_secs_f64() - 10.001).abs() < 0.01 && waiting == 0, "{throttled:?} {waiting}");
    }

    #[test]
    fn a_quiet_spell_saves_up_to_the_burst_and_no_more() {
        let clock = Arc::new(FakeClock::default());
        let limiter = Limiter::new(ops(100, 50), clock.clone());
        requests_in(std::slice::from_ref(&limiter), &clock, 1.0, 0);
        clock.advance(Duration::from_secs(60));
        let free = (0..200).take_while(|_| admit(std::slice::from_ref(&limiter), 0).is_zero()).count();
        assert_eq!(free, 50, "a minute's quiet saves the burst, not 6,000 requests");
    }

    #[test]
    fn bytes_are_limited_apart_from_operations() {
        let clock = Arc::new(FakeClock::default());
        let limits = Limits {
            ops: Some(Rate { per_second: 10_000, burst: 10_000 }),
            bytes: Some(Rate { per_second: 1 << 20, burst: 1 << 20 }),
        };
        let limiter = Limiter::new(limits, clock.clone());
        // 64 KiB requests: the byte rate (16 a second) binds long before the operation rate.
        let sent = requests_in(&[limiter], &clock, 10.0, 64 << 10);
        assert!(
            (16 * 10 + 16 - 1..=16 * 10 + 16 + 1).contains(&sent),
            "{sent} of 64 KiB in 10 s at 1 MiB/s, burst 1 MiB"
        );
    }

    #[test]
    fn a_group_shares_its_rate_between_its_vms_and_each_vm_keeps_its_own() {
        let clock = Arc::new(FakeClock::default());
        let group = Limiter::new(ops(1000, 10), clock.clone());
        let a = Limiter::new(Limits::default(), clock.clone());
        let b = Limiter::new(ops(200, 10), clock.clone());
        let (chain_a, chain_b) = ([a, group.clone()], [b, group]);
        // Taking turns for 10 s: together they hold to the group's 1,000 a second, and b's own
        // 200 a second paces both turns.
        let end = Duration::from_secs(10);
        let (mut sent_a, mut sent_b) = (0u64, 0u64);
        while clock.now() < end {
            admit(&chain_a, 0);
            sent_a += 1;
            admit(&chain_b, 0);
            sent_b += 1;
        }
        assert_eq!(sent_a, sent_b, "turns");
        assert!((2_000..=2_020).contains(&sent_b), "b at its own 200 a second: {sent_b}");
        // a alone: the group's rate, which b's turns no longer take.
        let alone = requests_in(&chain_a, &clock, 10.0, 0);
        assert!((9_990..=10_010).contains(&alone), "a alone at the group's 1,000 a second: {alone}");
    }

    #[test]
    fn two_groups_side_by_side_each_hold_their_own_rate_whatever_the_other_does() {
        let clock = Arc::new(FakeClock::default());
        let (office, kiosks) = (Limiter::new(ops(600, 10), clock.clone()), Limiter::new(ops(300, 10), clock.clone()));
        let vm = || Limiter::new(Limits::default(), clock.clone());
        // Two VMs in the office, one kiosk, taking turns for 10 s as requests arrive: each
        // request passes its VM's limiter and its group's, and waits only for its own group.
        let chains = [[vm(), office.clone()], [vm(), office.clone()], [vm(), kiosks.clone()]];
        let mut sent = [0u64; 3];
        let mut next_free = [Duration::ZERO; 3];
        while clock.now() < Duration::from_secs(10) {
            // The VM whose last request was let through longest ago goes next (one fake clock
            // serves them one at a time; the bursts cover what one's wait holds up another).
            let turn = (0..3).min_by_key(|&i| next_free[i]).expect("three");
            admit(&chains[turn], 0);
            sent[turn] += 1;
            next_free[turn] = clock.now();
        }
        let office_sent = sent[0] + sent[1];
        assert!((5_990..=6_020).contains(&office_sent), "the office's two VMs at 600 a second: {sent:?}");
        assert!((2_990..=3_020).contains(&sent[2]), "the kiosk at its group's 300 a second: {sent:?}");
        assert!(sent[0].abs_diff(sent[1]) <= 10, "the office's VMs share its rate: {sent:?}");
        // The kiosks' limit lifted live: the kiosk goes as fast as it asks, the office holds to
        // its own all the same.
        kiosks.set(Limits::default());
        let mut office_sent = 0u64;
        let end = clock.now() + Duration::from_secs(5);
        while clock.now() < end {
            admit(&chains[0], 0);
            office_sent += 1;
            for _ in 0..10 {
                assert!(admit(&chains[2], 0).is_zero(), "the kiosk waited with no limit");
            }
        }
        assert!((2_990..=3_010).contains(&office_sent), "the office after the kiosks' change: {office_sent}");
    }

    #[test]
    fn requests_that_go_ahead_never_wait_and_the_others_wait_out_their_debt() {
        let clock = Arc::new(FakeClock::default());
        let budget = Limiter::new(ops(100, 10), clock.clone());
        // 50 operations with priority at once: none waits, the bucket owes 40.
        budget.charge_ahead(50, 0);
        assert_eq!(budget.went_ahead(), 1, "one charge went ahead of the limits");
        // The next ordinary request waits out the debt and its own share: 41 operations at 100/s.
        let waited = admit_counted(std::slice::from_ref(&budget), 1, 0);
        assert_eq!(waited, Duration::from_millis(410));
        // Charged after the fact: 20 operations at once wait for what they took beyond the burst.
        clock.advance(Duration::from_secs(1));
        assert_eq!(admit_counted(std::slice::from_ref(&budget), 20, 0), Duration::from_millis(100));
        // However much goes ahead, the others wait at most AHEAD_DEBT_SECONDS for it.
        clock.advance(Duration::from_secs(1));
        budget.charge_ahead(1_000_000, 0);
        assert_eq!(admit_counted(std::slice::from_ref(&budget), 1, 0), Duration::from_millis(2010));
    }

    /// A clock that, at a waiter's first sleep, runs `hook` (an operator acting meanwhile).
    struct HookedClock {
        clock: FakeClock,
        hook: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }

    impl Clock for HookedClock {
        fn now(&self) -> Duration {
            self.clock.now()
        }

        fn sleep(&self, wait: Duration) {
            self.clock.advance(wait);
            if let Some(hook) = self.hook.lock().expect("hook").take() {
                hook();
            }
        }
    }

    #[test]
    fn a_request_waiting_for_a_limit_that_is_lifted_goes_at_once() {
        let clock = Arc::new(HookedClock { clock: FakeClock::default(), hook: Mutex::new(None) });
        let limiter = Limiter::new(ops(1, 1), clock.clone());
        admit(std::slice::from_ref(&limiter), 0);
        let lifted = Arc::downgrade(&limiter);
        *clock.hook.lock().expect("hook") = Some(Box::new(move || {
            if let Some(limiter) = lifted.upgrade() {
                limiter.set(Limits::default());
            }
        }));
        // Ten requests' debt at one a second, lifted during the first slice of the wait.
        admit_counted(std::slice::from_ref(&limiter), 10, 0);
        let waited = limiter.throttled().0;
        assert_eq!(waited, WAKE_SLICE, "the waiter went at its next look, not after 10 s");
        assert_eq!(limiter.throttled().1, 0, "nobody waits");
    }

    /// A VM's limit lifted while its group's stays, or raised: the waiting request goes as soon
    /// as the limits still set let it, not after the wait it was first told.
    #[test]
    fn a_request_waiting_for_a_limit_lifted_or_raised_goes_once_the_rest_allow() {
        for change in [Limits::default(), ops(1000, 1)] {
            let clock = Arc::new(HookedClock { clock: FakeClock::default(), hook: Mutex::new(None) });
            let vm = Limiter::new(ops(1, 1), clock.clone());
            let group = Limiter::new(ops(1000, 1000), clock.clone());
            let chain = [vm.clone(), group];
            admit(&chain, 0);
            let changed = Arc::downgrade(&vm);
            *clock.hook.lock().expect("hook") = Some(Box::new(move || {
                if let Some(vm) = changed.upgrade() {
                    vm.set(change);
                }
            }));
            // Ten requests' debt at one a second, the VM's limit changed during the first slice.
            let waited = admit_counted(&chain, 10, 0);
            assert!(waited <= 2 * WAKE_SLICE, "{change}: waited {waited:?}, not about 10 s");
        }
    }

    /// A limit lifted between a request's charge and its wait (a golden fetch waits its debt
    /// out after the fetch): nothing left to wait for.
    #[test]
    fn a_limit_lifted_before_the_wait_begins_is_not_waited_for() {
        let clock = Arc::new(FakeClock::default());
        let budget = Limiter::new(ops(1, 1), clock.clone());
        let chain = [budget.clone()];
        let owed = reserve(&chain, 10, 0);
        assert!(owed >= Duration::from_secs(9), "{owed:?}");
        budget.set(Limits::default());
        assert_eq!(wait_out(&chain, owed), Duration::ZERO);
    }

    /// A wait given up (its VM reset, its server stopping) ends within a wake-up slice, and
    /// counts only what was waited; its limits stay as they were.
    #[test]
    fn a_wait_given_up_ends_within_a_slice() {
        let clock = Arc::new(FakeClock::default());
        let limiter = Limiter::new(ops(1, 1), clock.clone());
        let chain = [limiter.clone()];
        let owed = reserve(&chain, 10, 0);
        let start = clock.now();
        let waited = wait_out_unless(&chain, owed, &|| clock.now() >= start + Duration::from_secs(1));
        assert!(waited >= Duration::from_secs(1) && waited <= Duration::from_secs(1) + WAKE_SLICE, "{waited:?}");
        assert_eq!(limiter.throttled(), (waited, 0));
        assert_eq!(limiter.limits(), ops(1, 1));
    }

    /// What goes ahead never lifts the debt ordinary requests left: those that come after still
    /// wait behind the ones already waiting.
    #[test]
    fn a_charge_ahead_leaves_the_others_debt_as_it_was() {
        let clock = Arc::new(FakeClock::default());
        let budget = Limiter::new(ops(100, 1), clock.clone());
        let first = reserve(std::slice::from_ref(&budget), 1000, 0);
        assert!(first >= Duration::from_secs(9), "{first:?}");
        budget.charge_ahead(1, 0);
        let next = reserve(std::slice::from_ref(&budget), 1, 0);
        assert!(next >= first, "a request after the charge ahead waits {next:?}, ahead of one waiting {first:?}");
    }

    /// A prefetch (NBD_CMD_CACHE) passes the limits as a read of its length does.
    #[test]
    fn a_prefetch_is_charged_as_a_read() {
        struct Nothing;
        impl BlockDevice for Nothing {
            fn size(&self) -> u64 {
                1 << 30
            }
            fn capabilities(&self) -> crate::device::Capabilities {
                crate::device::Capabilities::ALL
            }
            fn read(&mut self, _: &crate::ReadRequest, _: u64, _: &mut [u8]) -> Result<(), DeviceError> {
                Ok(())
            }
            fn write(&mut self, _: u64, _: &[u8], _: bool) -> Result<(), DeviceError> {
                Ok(())
            }
            fn write_zeroes(&mut self, _: u64, _: u64, _: bool, _: bool, _: bool) -> Result<(), DeviceError> {
                Ok(())
            }
            fn trim(&mut self, _: u64, _: u64, _: bool) -> Result<(), DeviceError> {
                Ok(())
            }
            fn flush(&mut self) -> Result<(), DeviceError> {
                Ok(())
            }
        }
        let clock = Arc::new(FakeClock::default());
        let limits = Limits { ops: None, bytes: Some(Rate { per_second: 1 << 20, burst: 1 << 20 }) };
        let mut device = Throttled::new(Nothing, vec![Limiter::new(limits, clock.clone())]);
        for _ in 0..10 {
            BlockDevice::cache(&mut device, 0, 1 << 20).expect("cache");
        }
        assert!(clock.now() >= Duration::from_secs(9), "10 MiB prefetched at 1 MiB/s in {:?}", clock.now());
    }

    #[test]
    fn limits_change_while_requests_flow() {
        let clock = Arc::new(FakeClock::default());
        let limiter = Limiter::new(ops(100, 1), clock.clone());
        let slow = requests_in(std::slice::from_ref(&limiter), &clock, 5.0, 0);
        limiter.set(ops(1000, 1));
        let fast = requests_in(std::slice::from_ref(&limiter), &clock, 5.0, 0);
        assert!((499..=501).contains(&slow) && (4_999..=5_001).contains(&fast), "{slow} then {fast}");
        limiter.set(Limits::default());
        assert!(limiter.limits().is_none());
        assert!((0..1000).all(|_| admit(std::slice::from_ref(&limiter), 0).is_zero()), "no limit: no wait");
    }
}
