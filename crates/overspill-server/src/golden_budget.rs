//! The host's budget for golden-image fetches: operations and bytes a second that all VMs'
//! reads of the golden images' storage share (what the read caches missed, or every golden
//! read without a cache), so that a storm of reads cannot take the whole array from the VMs
//! of other hosts sharing it, nor from this host's booting VMs.
//!
//! Each VM's overlay reads its image through a [`Budgeted`] view. A read is charged after it
//! returns, with what it cost the storage (a hit in the shared read cache costs nothing), and
//! the request it served waits out the debt before it is answered, once it has let go of its
//! VM's lock ([`wait_owed`], at the device seam's outer layer): over any time `t` the fetches
//! of VMs that are not booting stay within `rate × t + burst` and one request's more. A booting
//! VM's fetches go ahead without waiting (`boot_pacing`); the debt they leave, which the other
//! VMs wait out, is at most [`overspill_block::limit::AHEAD_DEBT_SECONDS`] of the rate (what goes ahead beyond it is
//! not charged): the budget bounds the running VMs, `--boot-max` the booting ones.

use std::cell::RefCell;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use overspill_block::limit::{reserve, wait_out_unless};
use overspill_block::Limiter;
use overspill_engine::golden::{Extent, SourceReads};
use overspill_engine::GoldenImage;

use crate::boot_pacing::BootPacing;

/// One VM's view of its golden image, charging what its reads fetch to the host's budget.
pub struct Budgeted {
    image: Arc<dyn GoldenImage>,
    budget: Arc<Limiter>,
    pacing: Arc<BootPacing>,
    /// The VM's name (none: an unnamed connection, which never boots).
    vm: Option<String>,
}

impl Budgeted {
    /// `image` as VM `vm` reads it.
    pub fn view(
        image: Arc<dyn GoldenImage>,
        budget: Arc<Limiter>,
        pacing: Arc<BootPacing>,
        vm: Option<String>,
    ) -> Arc<dyn GoldenImage> {
        Arc::new(Self { image, budget, pacing, vm })
    }

    fn charge(&self, reads: SourceReads) -> SourceReads {
        if reads.ops == 0 || !self.budget.is_active() {
            return reads;
        }
        let ahead =
            FOR_A_MOVE.with(|moving| moving.get()) || self.vm.as_deref().is_some_and(|vm| self.pacing.is_booting(vm));
        if ahead {
            self.budget.charge_ahead(reads.ops, reads.bytes);
        } else {
            let wait = reserve(std::slice::from_ref(&self.budget), reads.ops, reads.bytes);
            if !wait.is_zero() {
                // Each wait is until the budget is out of debt: a later one covers an earlier.
                OWED.with(|owed| {
                    let mut owed = owed.borrow_mut();
                    let longest = owed.as_ref().map_or(wait, |(_, earlier)| wait.max(*earlier));
                    *owed = Some((self.budget.clone(), longest));
                });
            }
        }
        reads
    }
}

thread_local! {
    /// What the golden reads of the request this thread serves owe the budget. Frontends serve
    /// a request's device calls on one thread; a move's reads go ahead ([`for_a_move`]).
    static OWED: RefCell<Option<(Arc<Limiter>, Duration)>> = const { RefCell::new(None) };
}

thread_local! {
    /// This thread reads for a VM's move to a peer ([`for_a_move`]).
    static FOR_A_MOVE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `read` (a read a peer asked for, moving a VM) with its golden fetches going ahead, as a
/// booting VM's do: a move is not held up, and the debt it leaves the other VMs is bounded
/// (charged as ordinary fetches, which nobody waited out on this thread, it was unbounded).
pub fn for_a_move<T>(read: impl FnOnce() -> T) -> T {
    FOR_A_MOVE.with(|moving| moving.set(true));
    let done = read();
    FOR_A_MOVE.with(|moving| moving.set(false));
    done
}

/// Waits out what the request this thread served owes the golden budget, unless `give_up` says
/// to stop: called by the device seam's outer layer after each request, out of the VM's lock.
pub fn wait_owed(give_up: &dyn Fn() -> bool) {
    if let Some((budget, wait)) = OWED.with(|owed| owed.borrow_mut().take()) {
        wait_out_unless(std::slice::from_ref(&budget), wait, give_up);
    }
}

// Not an `ImageLayer`: the reads are what this view is for. Every other method is forwarded.
impl GoldenImage for Budgeted {
    fn size(&self) -> u64 {
        self.image.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_counted(buf, offset).map(drop)
    }
    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        self.image.read_counted(buf, offset).map(|reads| self.charge(reads))
    }
    fn read_vectored_counted(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<SourceReads> {
        self.image.read_vectored_counted(bufs, offset).map(|reads| self.charge(reads))
    }
    fn read_shared(&self, offset: u64, len: usize) -> io::Result<(Vec<Bytes>, SourceReads)> {
        self.image.read_shared(offset, len).map(|(pieces, reads)| (pieces, self.charge(reads)))
    }
    fn describe(&self) -> String {
        self.image.describe()
    }
    fn identity(&self) -> Option<String> {
        self.image.identity()
    }
    fn matches_identity(&self, recorded: &str) -> bool {
        self.image.matches_identity(recorded)
    }
    fn unchanged(&self) -> io::Result<()> {
        self.image.unchanged()
    }
    fn preferred_fetch_bytes(&self) -> Option<u64> {
        self.image.preferred_fetch_bytes()
    }
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        self.image.extents(offset, len)
    }
    fn layer_runs(&self, offset: u64, len: u64) -> io::Result<Vec<overspill_engine::LayerRun>> {
        self.image.layer_runs(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use overspill_block::limit::SystemClock;
    use overspill_block::{Limits, Rate};
    use overspill_engine::{CachedImage, MemImage};

    use super::*;
    use crate::boot_pacing::PacingSettings;

    /// A move's golden fetches go ahead: they never wait, and the debt they leave the other VMs
    /// is bounded by the budget's floor however much the move reads.
    #[test]
    fn a_moves_fetches_go_ahead_and_leave_a_bounded_debt() {
        let image: Arc<dyn GoldenImage> = Arc::new(MemImage::new(vec![7u8; 8 << 20]));
        let budget =
            Limiter::new(Limits { ops: Some(Rate { per_second: 20, burst: 1 }), bytes: None }, SystemClock::shared());
        let view = Budgeted::view(image, budget.clone(), Arc::new(BootPacing::default()), Some("moving".into()));
        let mut buf = vec![0u8; 4096];
        for_a_move(|| {
            for chunk in 0..200u64 {
                view.read_at(&mut buf, chunk * 4096).expect("read");
            }
        });
        assert!(OWED.with(|owed| owed.borrow().is_none()), "nothing left owed on the peer's thread");
        let next = reserve(std::slice::from_ref(&budget), 1, 0);
        assert!(next <= Duration::from_millis(2100), "the others owe {next:?} for 200 fetches at 20 a second");
    }

    #[test]
    fn fetches_wait_for_the_budget_hits_and_booting_vms_do_not() {
        let image: Arc<dyn GoldenImage> = Arc::new(MemImage::new(vec![7u8; 8 << 20]));
        let cached: Arc<dyn GoldenImage> = Arc::new(CachedImage::new(image, 8 << 20, 64 << 10));
        let budget =
            Limiter::new(Limits { ops: Some(Rate { per_second: 20, burst: 1 }), bytes: None }, SystemClock::shared());
        let pacing = Arc::new(BootPacing::default());
        pacing.set(PacingSettings { max_booting: None, boot_time: Duration::from_secs(3600) });
        pacing.fresh("booting");
        pacing.start_boot("booting", &|| false);
        let view = |vm: &str| Budgeted::view(cached.clone(), budget.clone(), pacing.clone(), Some(vm.to_owned()));
        let (booting, running) = (view("booting"), view("running"));
        let mut buf = vec![0u8; 4096];
        // Ten fetches of a booting VM: none waits, the budget owes nine.
        for chunk in 0..10u64 {
            booting.read_at(&mut buf, chunk * (64 << 10)).expect("read");
        }
        assert_eq!(budget.throttled().0, Duration::ZERO, "a booting VM's fetches went ahead");
        assert!(budget.went_ahead() > 0);
        // A running VM's fetch waits out the debt (about half a second at 20 a second), once
        // its request is done.
        running.read_at(&mut buf, 20 * (64 << 10)).expect("read");
        assert_eq!(budget.throttled().0, Duration::ZERO, "no wait inside the read (the VM's lock is held)");
        wait_owed(&|| false);
        let waited = budget.throttled().0;
        assert!(waited >= Duration::from_millis(400), "the running VM waited {waited:?}");
        // What the cache holds costs the storage nothing: no charge, no wait.
        running.read_at(&mut buf, 0).expect("read");
        assert_eq!(budget.throttled().0, waited, "a hit waits for nothing");
        assert!(buf.iter().all(|&b| b == 7));
    }
}
