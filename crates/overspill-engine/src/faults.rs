//! Fault injection for simulations and tests: a [`BackingFile`] ([`FaultyFile`]) and a
//! [`GoldenImage`] ([`FaultyImage`]) that fail on a seeded plan, so that the engine's error paths
//! run the same code as the server's and every failure replays from its seed.
//!
//! # States
//!
//! A wrapper is **armed** (its plan applies) or **disarmed** (every call goes straight through);
//! [`FaultHandle`] switches it, so a test can run a faulty phase and then a clean one. While
//! armed, each call is matched against the plan's [`Rule`]s in order; the first rule that fires
//! decides the call's fate. A rule looks only at calls of its [`Op`] (and, if it has one, whose
//! byte range overlaps its range), and its [`Trigger`] is in one of these states:
//! - `Probability(p)`: stateless; each matching call fails with probability `p`, drawn from the
//!   wrapper's seeded generator, so the same seed and the same calls fail the same way;
//! - `Nth(n)`: **counting** its matching calls, then it **fires** on the nth (1-based) and is
//!   **spent**: it never fires again;
//! - `From(n)`: **counting**, then **failing** every matching call from the nth on (a disk that
//!   fills up and stays full, or a sector that has gone bad).
//!
//! A file can also share a [`SpaceLimit`] with other files, standing for one filesystem: writes
//! that would allocate past it fail like a full filesystem (see below) whether armed or not,
//! and punched holes give space back. The limit counts 4 KiB pages, which is what the spill log
//! and the cache files write.
//!
//! # What a failed call leaves behind
//!
//! | call  | [`Fault::NoSpace`]        | [`Fault::Io`]              | [`Fault::ShortWrite`]                           |
//! |-------|---------------------------|----------------------------|-------------------------------------------------|
//! | write | nothing written; ENOSPC   | nothing written; EIO       | a prefix of the data written, then ENOSPC       |
//! | read  | buffer filled with junk; ENOSPC | buffer filled with junk; EIO | a prefix read, the rest junk; EIO      |
//! | punch | nothing punched; ENOSPC   | nothing punched; EIO       | a prefix of the range punched; EIO              |
//!
//! A failed read scribbles over the caller's buffer on purpose: code that uses a buffer after an
//! error would serve junk, and a model comparison catches it. A full [`SpaceLimit`] behaves like
//! a short write: the pages that fit are written, then ENOSPC. Prefix lengths are drawn from the
//! seeded generator and are byte-granular, which is stricter than a real filesystem.
//!
//! Every injected fault is counted in the handle, so a test can tell an injected error from a
//! real one and check that its faults did fire.

use std::collections::HashSet;
use std::io;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::golden::{GoldenImage, SourceReads};
use crate::store::BackingFile;

/// What an injected fault does; see the module documentation for what each leaves behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// ENOSPC, nothing done.
    NoSpace,
    /// EIO, nothing done (a failed read leaves junk in the buffer).
    Io,
    /// A prefix done, then an error: ENOSPC for writes (the filesystem filled up mid-write),
    /// EIO for reads and punches.
    ShortWrite,
}

/// The kind of call a rule watches. Golden images only ever see reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Read,
    Write,
    Punch,
}

/// When a rule fires; see the module documentation for its states.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trigger {
    /// Each matching call, with this probability.
    Probability(f64),
    /// The nth matching call (1-based), once.
    Nth(u64),
    /// Every matching call from the nth (1-based) on; `From(1)` is always.
    From(u64),
}

/// One line of a fault plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub op: Op,
    pub fault: Fault,
    pub trigger: Trigger,
    /// Only calls whose byte range overlaps this one match; `None` matches every call.
    pub range: Option<Range<u64>>,
}

impl Rule {
    pub fn new(op: Op, fault: Fault, trigger: Trigger) -> Self {
        Self { op, fault, trigger, range: None }
    }

    /// Restricts the rule to calls overlapping `range` (a bad stretch of the disk).
    pub fn within(mut self, range: Range<u64>) -> Self {
        self.range = Some(range);
        self
    }

    fn matches(&self, op: Op, offset: u64, len: u64) -> bool {
        let overlaps = match &self.range {
            None => true,
            // A zero-length call still touches its offset.
            Some(r) => offset < r.end && r.start < offset.saturating_add(len.max(1)),
        };
        self.op == op && overlaps
    }
}

/// The rules and the seed of one wrapper.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultPlan {
    pub seed: u64,
    pub rules: Vec<Rule>,
}

impl FaultPlan {
    pub fn new(seed: u64) -> Self {
        Self { seed, rules: Vec::new() }
    }

    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Shorthand for a rule on every call of `op`.
    pub fn on(self, op: Op, fault: Fault, trigger: Trigger) -> Self {
        self.rule(Rule::new(op, fault, trigger))
    }

    /// The same rules with another seed, for the next of many wrappers.
    pub fn reseeded(&self, seed: u64) -> Self {
        Self { seed, rules: self.rules.clone() }
    }
}

/// Faults injected so far, by kind. `space` counts writes refused by a [`SpaceLimit`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub no_space: u64,
    pub io: u64,
    pub short_write: u64,
    pub space: u64,
}

impl FaultCounts {
    pub fn total(&self) -> u64 {
        self.no_space + self.io + self.short_write + self.space
    }

    /// Faults that surface as ENOSPC.
    pub fn enospc(&self) -> u64 {
        self.no_space + self.space + self.short_write
    }
}

#[derive(Debug)]
struct Shared {
    armed: AtomicBool,
    calls: AtomicU64,
    no_space: AtomicU64,
    io: AtomicU64,
    short_write: AtomicU64,
    space: AtomicU64,
}

/// Arms, disarms and observes one wrapper after it has been handed to an overlay.
#[derive(Debug, Clone)]
pub struct FaultHandle(Arc<Shared>);

impl FaultHandle {
    fn new() -> Self {
        Self(Arc::new(Shared {
            armed: AtomicBool::new(true),
            calls: AtomicU64::new(0),
            no_space: AtomicU64::new(0),
            io: AtomicU64::new(0),
            short_write: AtomicU64::new(0),
            space: AtomicU64::new(0),
        }))
    }

    pub fn arm(&self) {
        self.0.armed.store(true, Ordering::Relaxed);
    }

    pub fn disarm(&self) {
        self.0.armed.store(false, Ordering::Relaxed);
    }

    pub fn is_armed(&self) -> bool {
        self.0.armed.load(Ordering::Relaxed)
    }

    /// Calls that reached the wrapper, failed or not.
    pub fn calls(&self) -> u64 {
        self.0.calls.load(Ordering::Relaxed)
    }

    pub fn injected(&self) -> FaultCounts {
        let s = &self.0;
        FaultCounts {
            no_space: s.no_space.load(Ordering::Relaxed),
            io: s.io.load(Ordering::Relaxed),
            short_write: s.short_write.load(Ordering::Relaxed),
            space: s.space.load(Ordering::Relaxed),
        }
    }

    fn count(&self, fault: Fault) {
        let counter = match fault {
            Fault::NoSpace => &self.0.no_space,
            Fault::Io => &self.0.io,
            Fault::ShortWrite => &self.0.short_write,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// SplitMix64: tiny, and good enough to spread faults; the engine takes no `rand` dependency.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n`; 0 when `n` is 0.
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        // 53 random bits make a uniform f64 in [0, 1).
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// The plan's state: which rules are spent, how many calls each has seen, the generator.
#[derive(Debug)]
struct Injector {
    rules: Vec<(Rule, u64)>,
    rng: SplitMix,
    handle: FaultHandle,
}

impl Injector {
    fn new(plan: FaultPlan) -> Self {
        Self {
            rules: plan.rules.into_iter().map(|rule| (rule, 0)).collect(),
            rng: SplitMix(plan.seed),
            handle: FaultHandle::new(),
        }
    }

    /// The fault this call suffers, if any; counts it.
    fn decide(&mut self, op: Op, offset: u64, len: u64) -> Option<Fault> {
        self.handle.0.calls.fetch_add(1, Ordering::Relaxed);
        if !self.handle.is_armed() {
            return None;
        }
        for (rule, seen) in &mut self.rules {
            if !rule.matches(op, offset, len) {
                continue;
            }
            *seen += 1;
            let fires = match rule.trigger {
                Trigger::Probability(p) => self.rng.chance(p),
                Trigger::Nth(n) => *seen == n,
                Trigger::From(n) => *seen >= n,
            };
            if fires {
                self.handle.count(rule.fault);
                return Some(rule.fault);
            }
        }
        None
    }

    /// A prefix length for a short call: `0..len`, so something is always left undone.
    fn prefix(&mut self, len: usize) -> usize {
        self.rng.below(len as u64) as usize
    }

    fn junk(&mut self, buf: &mut [u8]) {
        let byte = (self.rng.next_u64() as u8) | 0x80;
        buf.fill(byte);
    }
}

fn errno(errno: rustix::io::Errno) -> io::Error {
    io::Error::from_raw_os_error(errno.raw_os_error())
}

fn enospc() -> io::Error {
    errno(rustix::io::Errno::NOSPC)
}

fn eio() -> io::Error {
    errno(rustix::io::Errno::IO)
}

/// Pages of a [`SpaceLimit`]: what its files have allocated.
const PAGE: u64 = 4096;

/// A filesystem of fixed size shared by several [`FaultyFile`]s: a write that would allocate
/// past it stores what fits and fails with ENOSPC; holes and dropped files give space back.
#[derive(Debug)]
pub struct SpaceLimit {
    capacity_pages: u64,
    used_pages: AtomicU64,
    /// Pages it refused: what [`BackingFile::space_shortages`] reports for its files.
    shortages: AtomicU64,
}

impl SpaceLimit {
    pub fn new(capacity_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            capacity_pages: capacity_bytes / PAGE,
            used_pages: AtomicU64::new(0),
            shortages: AtomicU64::new(0),
        })
    }

    pub fn shortages(&self) -> u64 {
        self.shortages.load(Ordering::Relaxed)
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_pages.load(Ordering::Relaxed) * PAGE
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_pages * PAGE
    }

    /// Takes one page if there is room; counts a shortage if not.
    fn take(&self) -> bool {
        let took = self
            .used_pages
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| (used < self.capacity_pages).then_some(used + 1))
            .is_ok();
        if !took {
            self.shortages.fetch_add(1, Ordering::Relaxed);
        }
        took
    }

    fn give_back(&self, pages: u64) {
        self.used_pages.fetch_sub(pages, Ordering::Relaxed);
    }
}

/// The pages one file holds of its [`SpaceLimit`].
#[derive(Debug)]
struct Allocation {
    limit: Arc<SpaceLimit>,
    pages: HashSet<u64>,
}

impl Allocation {
    /// Allocates the pages `[offset, offset + len)` touches, in order, and returns how many bytes
    /// from `offset` are covered by pages it holds: all of them unless the limit ran out.
    fn allocate(&mut self, offset: u64, len: u64) -> u64 {
        let end = offset + len;
        let mut page = offset / PAGE;
        while page * PAGE < end {
            if !self.pages.contains(&page) {
                if !self.limit.take() {
                    return (page * PAGE).saturating_sub(offset);
                }
                self.pages.insert(page);
            }
            page += 1;
        }
        len
    }

    /// Gives back the pages wholly inside the hole, as a filesystem would.
    fn punch(&mut self, offset: u64, len: u64) {
        let first = offset.div_ceil(PAGE);
        let end = (offset + len) / PAGE;
        let before = self.pages.len();
        if end.saturating_sub(first) < before as u64 {
            for page in first..end {
                self.pages.remove(&page);
            }
        } else {
            self.pages.retain(|&p| p < first || p >= end);
        }
        self.limit.give_back((before - self.pages.len()) as u64);
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.limit.give_back(self.pages.len() as u64);
    }
}

/// A [`BackingFile`] that fails on a seeded plan and, optionally, runs out of shared space.
pub struct FaultyFile {
    inner: Box<dyn BackingFile>,
    injector: Injector,
    space: Option<Allocation>,
}

impl FaultyFile {
    pub fn new(inner: Box<dyn BackingFile>, plan: FaultPlan) -> Self {
        Self { inner, injector: Injector::new(plan), space: None }
    }

    /// Counts this file's pages against `limit`.
    pub fn with_space_limit(mut self, limit: Arc<SpaceLimit>) -> Self {
        self.space = Some(Allocation { limit, pages: HashSet::new() });
        self
    }

    /// Keep this before handing the file to an overlay, to arm, disarm and count.
    pub fn handle(&self) -> FaultHandle {
        self.injector.handle.clone()
    }

    /// Writes `data[..n]` with the space limit applied; `Ok(false)` if the limit cut it short.
    fn write_limited(&mut self, data: &[u8], offset: u64) -> io::Result<bool> {
        let fits = match &mut self.space {
            Some(space) => space.allocate(offset, data.len() as u64) as usize,
            None => data.len(),
        };
        if fits > 0 {
            self.inner.write_at(&data[..fits], offset)?;
        }
        Ok(fits == data.len())
    }
}

impl BackingFile for FaultyFile {
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        match self.injector.decide(Op::Write, offset, data.len() as u64) {
            None => {
                if self.write_limited(data, offset)? {
                    Ok(())
                } else {
                    self.injector.handle.0.space.fetch_add(1, Ordering::Relaxed);
                    Err(enospc())
                }
            }
            Some(Fault::NoSpace) => Err(enospc()),
            Some(Fault::Io) => Err(eio()),
            Some(Fault::ShortWrite) => {
                let n = self.injector.prefix(data.len());
                // Whether the limit also cut it makes no difference: ENOSPC either way.
                self.write_limited(&data[..n], offset)?;
                Err(enospc())
            }
        }
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self.injector.decide(Op::Read, offset, buf.len() as u64) {
            None => self.inner.read_at(buf, offset),
            Some(fault) => {
                let n = if fault == Fault::ShortWrite { self.injector.prefix(buf.len()) } else { 0 };
                let read = if n > 0 { self.inner.read_at(&mut buf[..n], offset) } else { Ok(()) };
                self.injector.junk(&mut buf[n..]);
                read?;
                Err(if fault == Fault::NoSpace { enospc() } else { eio() })
            }
        }
    }

    fn punch_hole(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let (done, error) = match self.injector.decide(Op::Punch, offset, len) {
            None => (len, None),
            Some(Fault::NoSpace) => (0, Some(enospc())),
            Some(Fault::Io) => (0, Some(eio())),
            Some(Fault::ShortWrite) => (self.injector.rng.below(len / PAGE) * PAGE, Some(eio())),
        };
        if done > 0 {
            self.inner.punch_hole(offset, done)?;
            if let Some(space) = &mut self.space {
                space.punch(offset, done);
            }
        }
        error.map_or(Ok(()), Err)
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        self.inner.allocated_bytes()
    }

    fn keep(&mut self) {
        self.inner.keep();
    }

    fn own(&mut self) {
        self.inner.own();
    }

    fn path(&self) -> Option<&Path> {
        self.inner.path()
    }

    fn space_shortages(&self) -> u64 {
        self.space.as_ref().map_or_else(|| self.inner.space_shortages(), |space| space.limit.shortages())
    }
}

/// A [`GoldenImage`] whose reads fail on a seeded plan (rules on [`Op::Read`]; others never
/// match). Shared by every VM of the image like the real one, so a fault hits whichever VM's
/// read it falls on.
pub struct FaultyImage {
    inner: Arc<dyn GoldenImage>,
    injector: Mutex<Injector>,
    handle: FaultHandle,
}

impl FaultyImage {
    pub fn new(inner: Arc<dyn GoldenImage>, plan: FaultPlan) -> Self {
        let injector = Injector::new(plan);
        let handle = injector.handle.clone();
        Self { inner, injector: Mutex::new(injector), handle }
    }

    pub fn handle(&self) -> FaultHandle {
        self.handle.clone()
    }

    /// Runs `read` unless the plan fails this call; a failed read leaves junk (after a prefix
    /// for a short one).
    fn read_with<T>(
        &self,
        buf: &mut [u8],
        offset: u64,
        read: impl FnOnce(&mut [u8]) -> io::Result<T>,
    ) -> io::Result<T> {
        // The injector holds only counters and a generator: a panic elsewhere leaves it usable.
        let mut injector = self.injector.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(fault) = injector.decide(Op::Read, offset, buf.len() as u64) else {
            drop(injector);
            return read(buf);
        };
        let n = if fault == Fault::ShortWrite { injector.prefix(buf.len()) } else { 0 };
        injector.junk(&mut buf[n..]);
        drop(injector);
        if n > 0 {
            self.inner.read_at(&mut buf[..n], offset)?;
        }
        Err(if fault == Fault::NoSpace { enospc() } else { eio() })
    }
}

impl GoldenImage for FaultyImage {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_with(buf, offset, |buf| self.inner.read_at(buf, offset))
    }

    fn read_counted(&self, buf: &mut [u8], offset: u64) -> io::Result<SourceReads> {
        self.read_with(buf, offset, |buf| self.inner.read_counted(buf, offset))
    }

    fn describe(&self) -> String {
        format!("{} with injected faults", self.inner.describe())
    }

    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }

    fn matches_identity(&self, recorded: &str) -> bool {
        self.inner.matches_identity(recorded)
    }

    fn unchanged(&self) -> io::Result<()> {
        self.inner.unchanged()
    }

    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<crate::golden::Extent>> {
        self.inner.extents(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::golden::MemImage;
    use crate::store::MemFile;

    fn file(plan: FaultPlan) -> (FaultyFile, FaultHandle) {
        let file = FaultyFile::new(Box::<MemFile>::default(), plan);
        let handle = file.handle();
        (file, handle)
    }

    #[test]
    fn nth_fires_once_and_from_keeps_failing() {
        let plan =
            FaultPlan::new(1).on(Op::Write, Fault::Io, Trigger::Nth(3)).on(Op::Read, Fault::Io, Trigger::From(2));
        let (mut f, handle) = file(plan);
        let results: Vec<bool> = (0..5).map(|i| f.write_at(&[i as u8; 8], i * 8).is_ok()).collect();
        assert_eq!(results, [true, true, false, true, true]);
        let mut buf = [0u8; 8];
        f.read_at(&mut buf, 0).expect("first read passes");
        assert_eq!(buf, [0; 8]);
        for _ in 0..3 {
            let err = f.read_at(&mut buf, 8).expect_err("every read from the second fails");
            assert_eq!(err.raw_os_error(), Some(rustix::io::Errno::IO.raw_os_error()));
            assert!(buf.iter().all(|&b| b >= 0x80), "a failed read leaves junk, not data: {buf:?}");
        }
        assert_eq!(handle.injected(), FaultCounts { io: 4, ..FaultCounts::default() });
        handle.disarm();
        f.read_at(&mut buf, 8).expect("disarmed");
        assert_eq!(buf, [1; 8]);
    }

    #[test]
    fn short_writes_store_a_prefix_then_report_enospc() {
        let (mut f, handle) = file(FaultPlan::new(7).on(Op::Write, Fault::ShortWrite, Trigger::From(1)));
        let data: Vec<u8> = (1..=200).collect();
        let err = f.write_at(&data, 100).expect_err("short");
        assert_eq!(err.raw_os_error(), Some(rustix::io::Errno::NOSPC.raw_os_error()));
        handle.disarm();
        let mut back = vec![0u8; 200];
        f.read_at(&mut back, 100).expect("read");
        let n = back.iter().position(|&b| b == 0).expect("something was left unwritten");
        assert_eq!(back[..n], data[..n], "what was written is a prefix");
        assert!(back[n..].iter().all(|&b| b == 0));
        assert_eq!(handle.injected().short_write, 1);
    }

    #[test]
    fn probability_is_deterministic_per_seed() {
        let run = |seed| {
            let (mut f, _) = file(FaultPlan::new(seed).on(Op::Write, Fault::NoSpace, Trigger::Probability(0.3)));
            (0..200).map(|i| f.write_at(&[1], i).is_ok()).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
        let failures = run(5).iter().filter(|ok| !**ok).count();
        assert!((30..90).contains(&failures), "about 30% of 200 fail, got {failures}");
    }

    #[test]
    fn a_space_limit_is_shared_and_holes_give_it_back() {
        let limit = SpaceLimit::new(4 * PAGE);
        let mut a = FaultyFile::new(Box::<MemFile>::default(), FaultPlan::new(0)).with_space_limit(limit.clone());
        let mut b = FaultyFile::new(Box::<MemFile>::default(), FaultPlan::new(0)).with_space_limit(limit.clone());
        a.write_at(&[1; 3 * PAGE as usize], 0).expect("fits");
        let err = b.write_at(&[2; 2 * PAGE as usize], 0).expect_err("only one page left");
        assert_eq!(err.raw_os_error(), Some(rustix::io::Errno::NOSPC.raw_os_error()));
        assert_eq!(limit.used_bytes(), 4 * PAGE);
        let mut page = [0u8; PAGE as usize];
        b.read_at(&mut page, 0).expect("read");
        assert_eq!(page, [2; PAGE as usize], "the page that fitted was written");
        a.write_at(&[3; PAGE as usize], PAGE).expect("overwriting allocated pages needs no room");
        a.punch_hole(0, 2 * PAGE).expect("punch");
        assert_eq!(limit.used_bytes(), 2 * PAGE);
        b.write_at(&[2; 2 * PAGE as usize], 0).expect("room again");
        drop(a);
        assert_eq!(limit.used_bytes(), 2 * PAGE, "a dropped file gives its pages back");
        assert_eq!(b.handle().injected().space, 1);
    }

    #[test]
    fn golden_faults_hit_only_their_range() {
        let image = FaultyImage::new(
            Arc::new(MemImage::new(vec![7; 1 << 16])),
            FaultPlan::new(0).rule(Rule::new(Op::Read, Fault::Io, Trigger::From(1)).within(8192..12288)),
        );
        let mut buf = vec![0u8; 4096];
        image.read_at(&mut buf, 0).expect("before the range");
        assert_eq!(buf, vec![7; 4096]);
        image.read_at(&mut buf, 12288).expect("after the range");
        let err = image.read_counted(&mut buf, 10000).expect_err("overlaps the range");
        assert_eq!(err.raw_os_error(), Some(rustix::io::Errno::IO.raw_os_error()));
        assert_eq!(image.handle().injected().io, 1);
        assert_eq!(image.handle().calls(), 3);
    }
}
