//! The storage a fleet boots from, as a queueing model: devices with a latency curve, arrays of
//! them with their RAID write penalties, a controller cache (read-only or write-back), the
//! host's queue-depth limit, and VMs powered on a few at a time. A discrete-event simulation
//! plays every VM's boot requests through it, so boot times spread the way queues spread them.
//!
//! What a VM asks of the storage comes from the caller ([`VmBoot`]): guest requests straight
//! (no cache in front), or what the engine's overlay sent on (overspill in front). Golden-image
//! reads may pass through overspill's own read cache ([`overspill_engine::CachedImage`], the
//! code `serve` runs), in the order the simulated VMs ask, so whichever VM gets there first
//! pays for the fetch.
//!
//! The model, and what it leaves out:
//! - A device serves its queue in order; an operation takes `1/iops(q) + bytes/bandwidth`, with
//!   `q` the operations queued at the device when it starts. `iops(q)` is the device's curve of
//!   random IOPS by queue depth: a disk reorders a deeper queue into shorter seeks, an SSD works
//!   on more of it in parallel. At depth 1 that is a disk's textbook access time (the average
//!   seek and half a revolution, then the transfer); that a deeper queue shortens only the
//!   positioning is this model's own (docs/planning.md).
//! - Arrays stripe in 64 KiB units over every disk (parity rotates, so RAID 5/6 read from all);
//!   a write smaller than a full stripe costs RAID 1/10 two device writes, RAID 5 two reads and
//!   two writes, RAID 6 three and three. Full-stripe writes skip the reads.
//! - The controller cache keeps 4 KiB blocks, least recently used out first. A read whose blocks
//!   are all there completes in the array's own latency (its fabric and controller, added to
//!   every request); a write-back cache acknowledges writes as soon as they fit in its write
//!   part (by default half of it) and writes them to the disks behind the guest's back. It
//!   never reads ahead: the controllers of seed 003's internal arrays read ahead only after two
//!   sequential reads (adaptive read-ahead, their default), which the storms hardly ever give
//!   ([`BootEstimate::sequential_reads`]).
//! - The host keeps at most `queue_depth` requests at the array (the HBA's or LUN's queue
//!   depth); the rest wait in order.
//! - Two VMs missing the same read-cache chunk at once: the second is served as soon as the first
//!   asked (a real cache makes it wait for the fetch), so concurrent first reads look a little
//!   cheaper than they are.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use overspill_engine::read_cache::DEFAULT_CHUNK_BYTES;
use overspill_engine::{CachedImage, GoldenImage};
use serde::Serialize;

/// The array's own latency when nothing says otherwise: a cache hit over a short link.
pub const ARRAY_LATENCY_S: f64 = 0.000_2;
/// Width of the intervals the seeds counted in (ESXTOP's, in seed 003) and the charts use.
pub const INTERVAL_S: f64 = 15.0;
const STRIPE_BYTES: u64 = 64 * 1024;
const BLOCK: u64 = 4096;

mod spec;
pub use spec::*;

/// One storage request of a VM: a golden-image read (shared by all VMs, through the host's read
/// cache if there is one) or an operation on the VM's own space.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    pub write: bool,
    pub golden: bool,
    pub offset: u64,
    pub bytes: u32,
}

/// A VM's boot: guest operations in order, each at its time in the trace and with the storage
/// requests it waits for (none when the overlay's RAM served it).
#[derive(Debug, Clone, Default)]
pub struct VmBoot {
    /// `(seconds into the boot, requests[start..end])` per guest operation.
    pub ops: Vec<(f64, usize, usize)>,
    pub requests: Vec<Request>,
}

impl VmBoot {
    pub fn push(&mut self, at_s: f64, requests: impl IntoIterator<Item = Request>) {
        let start = self.requests.len();
        self.requests.extend(requests);
        self.ops.push((at_s, start, self.requests.len()));
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BootEstimate {
    pub storage: String,
    pub vms: usize,
    /// From a VM's power-on command to the end of its boot.
    pub min_s: f64,
    pub avg_s: f64,
    pub max_s: f64,
    /// When the last power-on command was given.
    pub power_on_s: f64,
    /// Most requests the array served in one 15 s interval, per second.
    pub peak_iops: f64,
    /// Reads and writes the array served per second, on average over the 15 s intervals from
    /// the first power-on to the last it served a request in (as a host's 15 s counters average
    /// a storm: whole intervals, so the mean moves in steps of one).
    pub mean_read_iops: f64,
    pub mean_write_iops: f64,
    /// VMs whose boot ended in each 15 s interval.
    pub booted_per_interval: Vec<usize>,
    /// Each VM's boot, from its power-on command to its end, in the order the VMs were powered
    /// on (seed 003 speaks of "the first 17-19 VMs booted"; left out of `plan --json`: the
    /// figures above sum it up).
    #[serde(skip)]
    pub boots_s: Vec<f64>,
    /// The cap on VMs booting at once it was played with (overspill's `serve --boot-max`).
    pub max_booting: Option<usize>,
    /// Reads the controller took, and those among them that began where the read before them
    /// ended (in the same VM's space, or the shared image's). A controller's adaptive read-ahead,
    /// the default of seed 003's Dell PERC H710, reads ahead only after such a pair; the model
    /// has no read-ahead, which these show to be what adaptive read-ahead would do here.
    #[serde(skip)]
    pub controller_reads: u64,
    #[serde(skip)]
    pub sequential_reads: u64,
}

/// Plays the boots of `vms` VMs (VM `i` boots `boots[i % boots.len()]`) on `storage`, with
/// overspill's read cache of `read_cache_bytes` in front of golden-image reads (0: none).
pub fn simulate_boots(
    storage: &StorageSpec,
    boots: &[VmBoot],
    vms: usize,
    read_cache_bytes: u64,
) -> Option<BootEstimate> {
    simulate_paced_boots(storage, boots, vms, read_cache_bytes, None)
}

/// Like [`simulate_boots`], with at most `max_booting` VMs booting at once (none: no cap): a VM
/// powered on beyond it waits, in order, until a boot ends, as overspill's `serve --boot-max`
/// holds a fresh VM's first request. Its boot time counts from its power-on, the wait included.
pub fn simulate_paced_boots(
    storage: &StorageSpec,
    boots: &[VmBoot],
    vms: usize,
    read_cache_bytes: u64,
    max_booting: Option<usize>,
) -> Option<BootEstimate> {
    if boots.is_empty() || vms == 0 {
        return None;
    }
    let mut sim = Sim::new(storage, boots, vms, read_cache_bytes);
    sim.max_booting = max_booting.map(|max| max.max(1));
    sim.run();
    Some(sim.estimate())
}

/// Simulation time, ordered (never NaN: sums of finite, non-negative figures).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    PowerOnGroup,
    Wake(usize),
    Controller(usize),
    HostDone(usize),
    DeviceDone(usize),
}

/// Who waits for an array request.
#[derive(Debug, Clone, Copy)]
enum Owner {
    /// Guest operation `op` of VM `vm`.
    Guest {
        vm: usize,
        op: usize,
    },
    PowerOn {
        vm: usize,
    },
    /// A write-back cache writing `bytes` of dirty data to the disks.
    Destage {
        bytes: u64,
    },
}

#[derive(Debug, Clone, Copy)]
struct ArrayRequest {
    owner: Owner,
    write: bool,
    space: u64,
    offset: u64,
    bytes: u64,
    /// Device operations still to finish.
    pending: usize,
    /// A read to cache once the disks answered it.
    fill_cache: bool,
}

#[derive(Debug, Default, Clone)]
struct VmState {
    power_on_at: f64,
    boot_start: Option<f64>,
    next: usize,
    last_issue: f64,
    in_flight: usize,
    /// Requests each issued guest operation still waits for (indexed by op).
    waiting: Vec<u32>,
    completed: usize,
    done_at: Option<f64>,
    wake_at: Option<f64>,
    power_on_left: usize,
}

struct Sim<'a> {
    storage: &'a StorageSpec,
    boots: &'a [VmBoot],
    now: f64,
    seq: u64,
    events: BinaryHeap<Reverse<(Time, u64, Event)>>,
    vms: Vec<VmState>,
    requests: Vec<ArrayRequest>,
    free_requests: Vec<usize>,
    at_array: usize,
    host_queue: VecDeque<usize>,
    devices: Vec<Device>,
    cache: Option<lru::LruCache<u64, ()>>,
    /// Blocks the disks are reading into the cache, with the requests waiting for them.
    filling: HashMap<u64, Vec<usize>>,
    dirty_bytes: u64,
    controller_free_at: f64,
    read_cache: Option<FetchingCache>,
    /// Requests the array served in each 15 s interval, and the writes among them: a host's
    /// counters show reads and writes apart.
    served_per_interval: Vec<Served>,
    next_group: usize,
    group_left: usize,
    group_interval_over: bool,
    last_power_on: f64,
    buffer: Vec<u8>,
    max_booting: Option<usize>,
    booting: usize,
    /// VMs powered on and waiting for a boot slot, in order.
    paced: VecDeque<usize>,
    /// Where the controller's last read ended: `(space, offset)`.
    last_read_end: Option<(u64, u64)>,
    controller_reads: u64,
    sequential_reads: u64,
}

/// What the array served in one 15 s interval.
#[derive(Debug, Clone, Copy, Default)]
struct Served {
    requests: u64,
    writes: u64,
}

/// overspill's read cache over a source that logs its fetches.
type FetchingCache = (CachedImage, Arc<Mutex<Vec<(u64, u64)>>>);

/// One disk: the host's operations in order, then the cache's writes to disk when it has none
/// (a write-back cache destages when the disk would otherwise idle, until it runs out of room).
#[derive(Debug, Clone, Default)]
struct Device {
    host: VecDeque<(usize, u64)>,
    background: VecDeque<(usize, u64)>,
    busy: Option<(usize, u64)>,
}

impl Device {
    fn depth(&self) -> usize {
        self.host.len() + self.background.len() + usize::from(self.busy.is_some())
    }
}

/// A golden image of zeroes that writes down what was read from it: the read cache's fetches.
struct FetchLog {
    size: u64,
    fetches: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl GoldenImage for FetchLog {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        buf.fill(0);
        self.fetches.lock().unwrap_or_else(|p| p.into_inner()).push((offset, buf.len() as u64));
        Ok(())
    }

    fn describe(&self) -> String {
        "fetch log".into()
    }
}

impl<'a> Sim<'a> {
    fn new(storage: &'a StorageSpec, boots: &'a [VmBoot], vms: usize, read_cache_bytes: u64) -> Self {
        let golden_end = boots
            .iter()
            .flat_map(|b| b.requests.iter().filter(|r| r.golden).map(|r| r.offset + u64::from(r.bytes)))
            .max()
            .unwrap_or(0);
        let read_cache = (read_cache_bytes > 0).then(|| {
            let fetches = Arc::new(Mutex::new(Vec::new()));
            let source = Arc::new(FetchLog { size: golden_end.max(1), fetches: fetches.clone() });
            (CachedImage::new(source, read_cache_bytes, DEFAULT_CHUNK_BYTES), fetches)
        });
        let largest = boots.iter().flat_map(|b| b.requests.iter().map(|r| r.bytes)).max().unwrap_or(0);
        let blocks = (storage.cache_bytes / BLOCK) as usize;
        Self {
            storage,
            boots,
            now: 0.0,
            seq: 0,
            events: BinaryHeap::new(),
            vms: (0..vms)
                .map(|vm| VmState { waiting: vec![0; boots[vm % boots.len()].ops.len()], ..VmState::default() })
                .collect(),
            requests: Vec::new(),
            free_requests: Vec::new(),
            at_array: 0,
            host_queue: VecDeque::new(),
            devices: vec![Device::default(); storage.disks],
            filling: HashMap::new(),
            cache: NonZeroUsize::new(blocks).map(lru::LruCache::new),
            dirty_bytes: 0,
            controller_free_at: 0.0,
            read_cache,
            served_per_interval: Vec::new(),
            next_group: 0,
            group_left: 0,
            group_interval_over: false,
            last_power_on: 0.0,
            buffer: vec![0; largest as usize],
            max_booting: None,
            booting: 0,
            paced: VecDeque::new(),
            last_read_end: None,
            controller_reads: 0,
            sequential_reads: 0,
        }
    }

    fn at(&mut self, time: f64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((Time(time), self.seq, event)));
    }

    fn run(&mut self) {
        self.at(0.0, Event::PowerOnGroup);
        while let Some(Reverse((Time(time), _, event))) = self.events.pop() {
            self.now = time;
            match event {
                Event::PowerOnGroup => {
                    self.group_interval_over = true;
                    self.maybe_next_group();
                }
                Event::Wake(vm) => {
                    if self.vms[vm].wake_at == Some(time) {
                        self.vms[vm].wake_at = None;
                        self.issue(vm);
                    }
                }
                Event::Controller(id) => self.control(id),
                Event::HostDone(id) => self.host_done(id),
                Event::DeviceDone(disk) => self.device_done(disk),
            }
        }
    }

    /// Powers on the next group once the interval has passed and the last group's power-on
    /// reads are answered.
    fn maybe_next_group(&mut self) {
        let vms = self.vms.len();
        if !self.group_interval_over || self.group_left > 0 || self.next_group >= vms {
            return;
        }
        let group = self.storage.power_on_group.min(vms - self.next_group);
        let first = self.next_group;
        self.next_group += group;
        self.group_interval_over = false;
        self.last_power_on = self.now;
        if self.next_group < vms {
            self.at(self.now + self.storage.power_on_interval_s, Event::PowerOnGroup);
        }
        for vm in first..first + group {
            self.vms[vm].power_on_at = self.now;
            self.vms[vm].power_on_left = self.storage.power_on_ios;
            if self.storage.power_on_ios == 0 {
                self.start_boot(vm);
            } else {
                self.group_left += 1;
                self.power_on_read(vm);
            }
        }
    }

    /// Power-on reads are the VM's own, beyond its disk, one at a time.
    fn power_on_read(&mut self, vm: usize) {
        let k = self.storage.power_on_ios - self.vms[vm].power_on_left;
        let offset = (1u64 << 40) + k as u64 * BLOCK;
        let id = self.new_request(Owner::PowerOn { vm }, false, vm as u64 + 1, offset, BLOCK);
        self.submit(id);
    }

    /// A VM is powered on: it boots now, or once a slot is free under the cap.
    fn start_boot(&mut self, vm: usize) {
        if self.max_booting.is_some_and(|max| self.booting >= max) {
            self.paced.push_back(vm);
        } else {
            self.begin_boot(vm);
        }
    }

    fn begin_boot(&mut self, vm: usize) {
        self.booting += 1;
        let state = &mut self.vms[vm];
        state.boot_start = Some(self.now);
        state.last_issue = self.now;
        if self.boots[vm % self.boots.len()].ops.is_empty() {
            self.boot_done(vm);
        }
        self.issue(vm);
    }

    /// A VM's boot ended: the next in line, if any, takes its slot.
    fn boot_done(&mut self, vm: usize) {
        self.vms[vm].done_at = Some(self.now);
        self.booting -= 1;
        if let Some(next) = self.paced.pop_front() {
            self.begin_boot(next);
        }
    }

    /// Issues the VM's next operations as far as its queue depth and the trace's pace allow: an
    /// operation comes its trace gap after the one before was issued, so a VM held up by the
    /// storage stays behind (a boot is one program, not a timetable).
    fn issue(&mut self, vm: usize) {
        let boots = self.boots;
        let boot = &boots[vm % boots.len()];
        loop {
            let state = &self.vms[vm];
            if state.boot_start.is_none()
                || state.next >= boot.ops.len()
                || state.in_flight >= self.storage.vm_queue_depth
            {
                return;
            }
            let i = state.next;
            let gap = if i == 0 { 0.0 } else { (boot.ops[i].0 - boot.ops[i - 1].0).max(0.0) };
            let due = state.last_issue + gap;
            if due > self.now {
                if state.wake_at.is_none_or(|w| w > due) {
                    self.vms[vm].wake_at = Some(due);
                    self.at(due, Event::Wake(vm));
                }
                return;
            }
            let state = &mut self.vms[vm];
            state.next += 1;
            state.last_issue = due;
            state.in_flight += 1;
            let (_, start, end) = boot.ops[i];
            let mut sent = 0u32;
            for r in &boot.requests[start..end] {
                sent += self.send(vm, i, r);
            }
            self.vms[vm].waiting[i] = sent;
            if sent == 0 {
                // Done as soon as issued (served from RAM): counted here, and the loop issues
                // the next (calling back into `issue` went one frame deeper per such operation,
                // and a long run of them overflowed the stack).
                self.op_completed(vm);
            }
        }
    }

    /// Sends one guest request on to the array; returns how many array requests it became.
    fn send(&mut self, vm: usize, op: usize, r: &Request) -> u32 {
        let owner = Owner::Guest { vm, op };
        if r.golden {
            if let Some((cache, fetches)) = &self.read_cache {
                let len = r.bytes as usize;
                // A zero source cannot fail; a failure would only mean one fetch less modelled.
                let _ = cache.read_at(&mut self.buffer[..len], r.offset);
                let fetched: Vec<(u64, u64)> = std::mem::take(&mut *fetches.lock().unwrap_or_else(|p| p.into_inner()));
                for &(offset, bytes) in &fetched {
                    let id = self.new_request(owner, false, 0, offset, bytes);
                    self.submit(id);
                }
                return fetched.len() as u32;
            }
        }
        let space = if r.golden && self.storage.clones == Clones::Linked { 0 } else { vm as u64 + 1 };
        let id = self.new_request(owner, r.write, space, r.offset, u64::from(r.bytes));
        self.submit(id);
        1
    }

    fn new_request(&mut self, owner: Owner, write: bool, space: u64, offset: u64, bytes: u64) -> usize {
        let request = ArrayRequest { owner, write, space, offset, bytes, pending: 0, fill_cache: false };
        match self.free_requests.pop() {
            Some(id) => {
                self.requests[id] = request;
                id
            }
            None => {
                self.requests.push(request);
                self.requests.len() - 1
            }
        }
    }

    fn submit(&mut self, id: usize) {
        if self.storage.queue_depth.is_some_and(|q| self.at_array >= q) {
            self.host_queue.push_back(id);
        } else {
            self.dispatch(id);
        }
    }

    fn blocks(space: u64, offset: u64, bytes: u64) -> impl Iterator<Item = u64> {
        (offset / BLOCK..(offset + bytes).div_ceil(BLOCK)).map(move |b| (space << 40) ^ b)
    }

    /// The array takes a request from the host: its controller handles one request at a time,
    /// each in `1/controller_iops` (none of that without a limit).
    fn dispatch(&mut self, id: usize) {
        self.at_array += 1;
        match self.storage.controller_iops {
            Some(iops) => {
                let start = self.controller_free_at.max(self.now);
                self.controller_free_at = start + 1.0 / iops;
                self.at(self.controller_free_at, Event::Controller(id));
            }
            None => self.control(id),
        }
    }

    /// The controller's part: the cache, or the disks.
    fn control(&mut self, id: usize) {
        let ArrayRequest { write, space, offset, bytes, .. } = self.requests[id];
        if !write {
            self.controller_reads += 1;
            self.sequential_reads += u64::from(self.last_read_end == Some((space, offset)));
            self.last_read_end = Some((space, offset + bytes));
        }
        if let Some(cache) = &mut self.cache {
            if !write {
                let hit = Self::blocks(space, offset, bytes).all(|b| cache.contains(&b));
                if hit {
                    for b in Self::blocks(space, offset, bytes) {
                        cache.get(&b);
                    }
                    self.at(self.now + self.storage.array_latency_s, Event::HostDone(id));
                    return;
                }
                // Blocks on their way from the disks are not read twice: wait for them.
                let filling = &self.filling;
                let coming = Self::blocks(space, offset, bytes).find(|b| filling.contains_key(b));
                let covered =
                    Self::blocks(space, offset, bytes).all(|b| cache.contains(&b) || filling.contains_key(&b));
                if let (Some(block), true) = (coming, covered) {
                    self.filling.entry(block).or_default().push(id);
                    return;
                }
                for b in Self::blocks(space, offset, bytes) {
                    if !cache.contains(&b) {
                        self.filling.entry(b).or_default();
                    }
                }
                self.requests[id].fill_cache = true;
            } else {
                for b in Self::blocks(space, offset, bytes) {
                    cache.put(b, ());
                }
                let dirty_limit = self.storage.write_cache_bytes.unwrap_or(self.storage.cache_bytes / 2);
                if self.storage.cache_mode == CacheMode::WriteBack && self.dirty_bytes + bytes <= dirty_limit {
                    self.dirty_bytes += bytes;
                    self.at(self.now + self.storage.array_latency_s, Event::HostDone(id));
                    let destage = self.new_request(Owner::Destage { bytes }, true, space, offset, bytes);
                    self.send_to_disks(destage, true);
                    return;
                }
            }
        }
        self.send_to_disks(id, false);
    }

    /// Splits a request into device operations by the array's layout.
    fn send_to_disks(&mut self, id: usize, background: bool) {
        let ArrayRequest { write, space, offset, bytes, .. } = self.requests[id];
        let disks = self.storage.disks;
        let raid = self.storage.raid;
        let data = raid.data_disks(disks);
        // Each VM's space starts on a different disk, as separate files would.
        let base = space.wrapping_mul(0x9e37_79b9);
        let first = offset / STRIPE_BYTES;
        let last = (offset + bytes.max(1) - 1) / STRIPE_BYTES;
        let units = last - first + 1;
        let mut ops: Vec<(usize, u64)> = Vec::new();
        if write && units >= data as u64 && matches!(raid, Raid::R5 | Raid::R6) {
            // Full stripes: every disk written once, parity computed from the new data.
            let per_disk = bytes.div_ceil(data as u64);
            ops.extend((0..disks).map(|d| (d, per_disk)));
        } else {
            for unit in first..=last {
                let unit_bytes = (offset + bytes).min((unit + 1) * STRIPE_BYTES) - offset.max(unit * STRIPE_BYTES);
                let stripe = base.wrapping_add(unit);
                match raid {
                    Raid::R0 => ops.push(((stripe % disks as u64) as usize, unit_bytes)),
                    Raid::R1 | Raid::R10 => {
                        let pair = (stripe % (disks as u64 / 2)) as usize * 2;
                        if write {
                            ops.push((pair, unit_bytes));
                            ops.push((pair + 1, unit_bytes));
                        } else {
                            let shorter = if self.devices[pair + 1].depth() < self.devices[pair].depth() {
                                pair + 1
                            } else {
                                pair
                            };
                            ops.push((shorter, unit_bytes));
                        }
                    }
                    Raid::R5 | Raid::R6 => {
                        let disk = (stripe % disks as u64) as usize;
                        if write {
                            // Read old data and parity, write new data and parity.
                            for k in 0..raid.small_write_disks() {
                                let d = (disk + k) % disks;
                                ops.push((d, unit_bytes));
                                ops.push((d, unit_bytes));
                            }
                        } else {
                            ops.push((disk, unit_bytes));
                        }
                    }
                }
            }
        }
        self.requests[id].pending = ops.len();
        for (disk, op_bytes) in ops {
            let device = &mut self.devices[disk];
            if background { &mut device.background } else { &mut device.host }.push_back((id, op_bytes));
            if device.busy.is_none() {
                self.start_device(disk);
            }
        }
    }

    fn start_device(&mut self, disk: usize) {
        let device = &mut self.devices[disk];
        let depth = device.depth();
        device.busy = device.host.pop_front().or_else(|| device.background.pop_front());
        if let Some((_, bytes)) = device.busy {
            let service =
                1.0 / self.storage.device.iops_at(depth) + bytes as f64 / (self.storage.device.mb_per_s * 1e6);
            self.at(self.now + service, Event::DeviceDone(disk));
        }
    }

    fn device_done(&mut self, disk: usize) {
        let Some((id, _)) = self.devices[disk].busy.take() else { return };
        self.start_device(disk);
        let request = &mut self.requests[id];
        request.pending -= 1;
        if request.pending > 0 {
            return;
        }
        if let Owner::Destage { bytes } = request.owner {
            self.dirty_bytes -= bytes;
            self.free_requests.push(id);
            return;
        }
        if request.fill_cache {
            let ArrayRequest { space, offset, bytes, .. } = *request;
            if let Some(cache) = &mut self.cache {
                for b in Self::blocks(space, offset, bytes) {
                    cache.put(b, ());
                }
            }
            for b in Self::blocks(space, offset, bytes) {
                for waiting in self.filling.remove(&b).unwrap_or_default() {
                    self.at(self.now + self.storage.array_latency_s, Event::HostDone(waiting));
                }
            }
        }
        self.at(self.now + self.storage.array_latency_s, Event::HostDone(id));
    }

    /// The array answered request `id`.
    fn host_done(&mut self, id: usize) {
        self.at_array -= 1;
        let interval = (self.now / INTERVAL_S) as usize;
        if self.served_per_interval.len() <= interval {
            self.served_per_interval.resize(interval + 1, Served::default());
        }
        let served = &mut self.served_per_interval[interval];
        served.requests += 1;
        served.writes += u64::from(self.requests[id].write);
        if let Some(next) = self.host_queue.pop_front() {
            self.dispatch(next);
        }
        let owner = self.requests[id].owner;
        self.free_requests.push(id);
        match owner {
            Owner::Guest { vm, op } => {
                let waiting = &mut self.vms[vm].waiting[op];
                *waiting -= 1;
                if *waiting == 0 {
                    self.guest_op_done(vm);
                }
            }
            Owner::PowerOn { vm } => {
                self.vms[vm].power_on_left -= 1;
                if self.vms[vm].power_on_left > 0 {
                    self.power_on_read(vm);
                } else {
                    self.group_left -= 1;
                    self.start_boot(vm);
                    self.maybe_next_group();
                }
            }
            Owner::Destage { .. } => {}
        }
    }

    fn guest_op_done(&mut self, vm: usize) {
        self.op_completed(vm);
        self.issue(vm);
    }

    /// One of the VM's operations is done; the last ends its boot.
    fn op_completed(&mut self, vm: usize) {
        let total = self.boots[vm % self.boots.len()].ops.len();
        let state = &mut self.vms[vm];
        state.in_flight -= 1;
        state.completed += 1;
        if state.completed == total {
            self.boot_done(vm);
        }
    }

    fn estimate(&self) -> BootEstimate {
        let in_power_on_order: Vec<f64> =
            self.vms.iter().map(|v| v.done_at.unwrap_or(self.now) - v.power_on_at).collect();
        let mut times = in_power_on_order.clone();
        times.sort_by(f64::total_cmp);
        let n = times.len();
        let intervals =
            self.vms.iter().map(|v| (v.done_at.unwrap_or(self.now) / INTERVAL_S) as usize).max().unwrap_or(0) + 1;
        let mut booted = vec![0; intervals];
        for v in &self.vms {
            booted[(v.done_at.unwrap_or(self.now) / INTERVAL_S) as usize] += 1;
        }
        let storm_s = self.served_per_interval.len().max(1) as f64 * INTERVAL_S;
        let writes: u64 = self.served_per_interval.iter().map(|s| s.writes).sum();
        let reads = self.served_per_interval.iter().map(|s| s.requests).sum::<u64>() - writes;
        BootEstimate {
            storage: self.storage.describe(),
            vms: n,
            min_s: times[0],
            avg_s: times.iter().sum::<f64>() / n as f64,
            max_s: times[n - 1],
            power_on_s: self.last_power_on,
            peak_iops: self.served_per_interval.iter().map(|s| s.requests).max().unwrap_or(0) as f64 / INTERVAL_S,
            mean_read_iops: reads as f64 / storm_s,
            mean_write_iops: writes as f64 / storm_s,
            booted_per_interval: booted,
            boots_s: in_power_on_order,
            max_booting: self.max_booting,
            controller_reads: self.controller_reads,
            sequential_reads: self.sequential_reads,
        }
    }
}

#[cfg(test)]
#[path = "storage_tests.rs"]
mod tests;
