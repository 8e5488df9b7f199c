//! The vhost-user backend of one connection: virtqueues served on one worker thread, each
//! request carried out in the order it was made available and returned in that order.
//!
//! That order is what makes a restart safe without in-flight tracking (which the backend crate
//! does not offer): when the connection drops, QEMU rewinds each queue to the guest's used index
//! and the next backend is handed every request not yet returned, which it carries out again.
//! Reads and writes of the same bytes are idempotent, and no later request was returned before
//! an earlier one, so nothing a guest was told is done is lost or undone.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use overspill_block::limit::GiveUp;
use overspill_block::{BlockDevice, DeviceError};
use rustix::fs::SealFlags;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::config::{DeviceConfig, Limits, WRITEBACK_OFFSET};
use crate::request::{self, Buffers, GuestBytes, Segment};

pub(crate) type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

/// Descriptors a queue may hold; QEMU's largest.
const MAX_QUEUE_SIZE: usize = 1024;

/// How long a completion may wait for the rest of its batch before the guest hears of it:
/// requests served from memory (a few microseconds each) are signalled together, a slow one
/// (a spill-disk read, a remote golden image's fetch) at once, not after the whole batch (in a
/// batch of 32 reads of 5 ms each, the first completion waited for the other 31).
const SIGNAL_WITHIN: Duration = Duration::from_micros(200);

/// Opens the VM's device for a connection; its requests' waits (for limits, a boot slot) end
/// once the [`GiveUp`] it is given says so.
pub(crate) type Opener = Box<dyn FnOnce(GiveUp) -> Result<Box<dyn BlockDevice>, DeviceError> + Send>;

/// One connection's device and what the driver set.
pub(crate) struct Blk {
    /// Until the VMM first speaks vhost-user (GET_FEATURES): a connection that never does (a
    /// probe of the socket) opens nothing, so it neither claims the VM nor ends it.
    opener: Mutex<Option<Opener>>,
    /// `None` until opened, and once the connection is over and the device handed back.
    device: Mutex<Option<Box<dyn BlockDevice>>>,
    memory: Memory,
    /// The export's size and capabilities before the device is open, the device's after.
    config: Mutex<DeviceConfig>,
    /// `config.limits`, which never change: read per request without the lock.
    limits: Limits,
    /// What GET_ID answers: the VM's name.
    id: Vec<u8>,
    write_back: AtomicBool,
    event_idx: AtomicBool,
    /// Set when the server stops serving this connection: no request is taken any more, so
    /// that those left are replayed to the next server.
    closing: AtomicBool,
    /// Set while QEMU stops the device (or the connection closes): QEMU waits for the request
    /// in hand before it goes on, under its big lock (the guest, its monitor, libvirt), so that
    /// request waits for its limits or a boot slot no more. Cleared when the device starts.
    hurry: Arc<AtomicBool>,
    /// Queues that carried requests, and queues QEMU stopped, since the device was last
    /// started (bit per queue): when every one used has been stopped before the socket closes,
    /// QEMU stopped the device on purpose (the VM powered off or QEMU quit).
    used_queues: AtomicU64,
    stopped_queues: AtomicU64,
    shutdown: Mutex<Option<vhost_user_backend::ShutdownHandle>>,
    /// Reads land here before they are copied to the guest (see `request::serve`).
    scratch: Mutex<Vec<u8>>,
    /// How long a queue is watched for the next request before its worker sleeps.
    poll: Duration,
    /// Whether the log was told this connection's guest memory may shrink (once is enough).
    unsealed_memory_told: AtomicBool,
    /// Requests a queue is served at a time before the VM's other queues get their turn.
    pub(crate) turn_requests: usize,
    /// Queues whose guest is owed an interrupt at their next serving, whatever EVENT_IDX says:
    /// every queue once the device starts (see [`Self::serve_queue`]).
    signal_owed: AtomicU64,
    /// The exit events' consumers handed to the workers, which never close them (see
    /// [`VhostUserBackend::exit_event`] below): closed when this connection's backend goes.
    exit_consumers: Mutex<Vec<std::os::fd::RawFd>>,
}

impl Drop for Blk {
    fn drop(&mut self) {
        for fd in lock(&self.exit_consumers).drain(..) {
            // SAFETY: each fd is an exit event's consumer that vhost-user-backend 0.24.0 (pinned
            // in Cargo.toml for this) took with `into_raw_fd` into its worker's epoll and never
            // closes; it is used by nothing else, and the worker is gone: it holds this backend
            // until its epoll handler, whose epoll drops first, is dropped.
            drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
    }
}

impl Blk {
    pub(crate) fn new(opener: Opener, memory: Memory, config: DeviceConfig, id: Vec<u8>, poll: Duration) -> Self {
        Self {
            opener: Mutex::new(Some(opener)),
            device: Mutex::new(None),
            memory,
            limits: config.limits,
            config: Mutex::new(config),
            id,
            write_back: AtomicBool::new(true),
            event_idx: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            hurry: Arc::new(AtomicBool::new(false)),
            used_queues: AtomicU64::new(0),
            stopped_queues: AtomicU64::new(0),
            shutdown: Mutex::new(None),
            scratch: Mutex::new(Vec::new()),
            poll,
            unsealed_memory_told: AtomicBool::new(false),
            turn_requests: TURN_REQUESTS,
            signal_owed: AtomicU64::new(u64::MAX),
            exit_consumers: Mutex::new(Vec::new()),
        }
    }

    /// How to close the connection. One refused before this was known is closed now.
    pub(crate) fn set_shutdown(&self, handle: Option<vhost_user_backend::ShutdownHandle>) {
        let mut shutdown = lock(&self.shutdown);
        *shutdown = handle;
        if self.closing.load(Ordering::SeqCst) {
            if let Some(handle) = shutdown.as_ref() {
                handle.shutdown();
            }
        }
    }

    /// Opens the device the first time the VMM asks about it; a refusal (the VM connected
    /// elsewhere, its writes lost) closes the connection, and the VMM tries again later.
    fn open_device(&self) {
        let Some(open) = lock(&self.opener).take() else { return };
        let hurry = self.hurry.clone();
        match open(Arc::new(move || hurry.load(Ordering::SeqCst))) {
            Ok(device) => {
                let mut config = lock(&self.config);
                config.size = device.size();
                config.capabilities = device.capabilities();
                *lock(&self.device) = Some(device);
            }
            Err(error) => {
                tracing::warn!(%error, "vhost-user connection refused");
                self.close_unlocked();
            }
        }
    }

    /// Stops taking requests and waits for the one being carried out, then closes the
    /// connection: every request returned to the guest by then is done, every other one will be
    /// sent to the next server.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.hurry.store(true, Ordering::SeqCst);
        drop(lock(&self.device));
        self.close_unlocked();
    }

    /// Whether the VMM has said anything yet: its first question, the device's features, opens
    /// the device.
    pub(crate) fn greeted(&self) -> bool {
        lock(&self.opener).is_none()
    }

    /// Whether the connection is to close: closing already, or its VM reset by an operator. The
    /// device is not waited for: a request in hand checks the reset itself.
    pub(crate) fn to_close(&self) -> bool {
        if self.closing.load(Ordering::SeqCst) {
            return true;
        }
        match self.device.try_lock() {
            Ok(device) => device.as_ref().is_some_and(|device| device.closing()),
            Err(std::sync::TryLockError::Poisoned(device)) => device.into_inner().as_ref().is_some_and(|d| d.closing()),
            Err(std::sync::TryLockError::WouldBlock) => false,
        }
    }

    /// The device back, once the connection is over; told of a deliberate end when QEMU stopped
    /// every queue it used before it closed the socket.
    pub(crate) fn take_device(&self) -> Option<Box<dyn BlockDevice>> {
        let mut device = lock(&self.device).take()?;
        let used = self.used_queues.load(Ordering::SeqCst);
        let stopped = self.stopped_queues.load(Ordering::SeqCst);
        if stopped != 0 && used & !stopped == 0 && !self.closing.load(Ordering::SeqCst) {
            device.disconnect();
        }
        Some(device)
    }

    /// Serves queue `index` (its `vring`) until the guest has nothing more for it. The guest is
    /// signalled for what was returned, and at the first serving after the device started
    /// whatever EVENT_IDX says: a server killed mid-batch published completions it never
    /// signalled, the next server starts past them, and the guest's `used_event` stays behind,
    /// so that no later completion would interrupt it (the guest's I/O hung for good). An error
    /// still signals what was returned before it.
    fn serve_queue(&self, vring: &VringRwLock, index: u16) -> io::Result<()> {
        let bit = 1u64 << (index % 64);
        let first = self.signal_owed.fetch_and(!bit, Ordering::SeqCst) & bit != 0;
        let mut device = lock(&self.device);
        let Some(device) = device.as_mut() else { return Ok(()) };
        let mut unsignalled = false;
        let served = self.serve_batches(device.as_mut(), vring, &mut unsignalled);
        if first || (served.is_err() && unsignalled) {
            if let Err(error) = vring.signal_used_queue() {
                tracing::debug!(%error, queue = index, "vhost-user: could not signal the guest");
            }
        }
        let state = vring.get_ref();
        if let (Ok(true), Some(kick)) = (&served, state.get_kick()) {
            // Its turn is over with requests left: kicked again, it is served after the other
            // queues' waiting kicks (the worker's epoll takes them in turn).
            // SAFETY: the descriptor is the queue's kick eventfd, which the vring owns and
            // keeps open while its state is locked here; writing 1 only adds to its count.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(std::os::fd::AsRawFd::as_raw_fd(kick)) };
            if let Err(error) = rustix::io::write(fd, &1u64.to_ne_bytes()) {
                tracing::debug!(%error, queue = index, "vhost-user: could not kick the queue again");
            }
        }
        served.map(drop)
    }

    /// The loop of [`Self::serve_queue`]; `unsignalled` says whether requests were returned
    /// since the guest was last signalled. Whether the queue's turn ended with requests left.
    ///
    /// The vring's lock is held only to take a request and to return it, never while the
    /// device carries it out: QEMU's messages about the queue take that lock, and its stop of
    /// the device (GET_VRING_BASE, at a pause, a migration, a shutdown) takes it first, then
    /// asks [`VhostUserBackend::stop_vring`], which calls off the request's waits and waits for
    /// it. Held through a request waiting for a boot slot, it stalled QEMU for that long.
    fn serve_batches(
        &self,
        device: &mut dyn BlockDevice,
        vring: &VringRwLock,
        unsignalled: &mut bool,
    ) -> io::Result<bool> {
        let memory = self.memory.memory();
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        let write_back = self.write_back.load(Ordering::Relaxed);
        let mut scratch = lock(&self.scratch);
        let mut buffers = Buffers::default();
        let mut taken = 0;
        loop {
            if event_idx {
                vring.disable_notification().map_err(queue_error)?;
            }
            let mut served = false;
            let mut unsignalled_since: Option<Instant> = None;
            // When the request in hand began: one clock read per request (at its end).
            let mut began = Instant::now();
            while !self.closing.load(Ordering::Relaxed) && taken < self.turn_requests {
                if device.closing() {
                    // An operator reset the VM: the connection ends, the requests not yet
                    // returned unanswered (QEMU sends them again to the next connection).
                    self.close_unlocked();
                    break;
                }
                let Some(head) = take_request(vring, &memory, &mut buffers)? else { break };
                let outcome =
                    request::serve(device, &*memory, &buffers, &self.limits, &self.id, write_back, &mut scratch);
                vring.add_used(head, outcome.written).map_err(queue_error)?;
                served = true;
                taken += 1;
                *unsignalled = true;
                // A slow request is told at once (the next may be as slow), and fast ones once
                // the first of them has waited long enough.
                let now = Instant::now();
                let tell_now =
                    now - began >= SIGNAL_WITHIN || now - *unsignalled_since.get_or_insert(now) >= SIGNAL_WITHIN;
                began = now;
                if tell_now && vring.needs_notification().map_err(queue_error)? {
                    vring.signal_used_queue()?;
                    (*unsignalled, unsignalled_since) = (false, None);
                }
            }
            // The guest hears of what is done before this waits for more (unless a slow request
            // was told of already: a second interrupt would find nothing new).
            if served && *unsignalled && vring.needs_notification().map_err(queue_error)? {
                vring.signal_used_queue()?;
                *unsignalled = false;
            }
            // Closing: the requests left are the next connection's (looked for here, they
            // would be found again and again, with this connection's locks held for ever).
            if self.closing.load(Ordering::Relaxed) || !vring.get_ref().get_queue().ready() {
                break;
            }
            if taken >= self.turn_requests {
                return Ok(true);
            }
            // A guest at a low queue depth sends its next request a few microseconds after the
            // last reply: looked for here for `--poll-us`, it is taken without a kick, a wake-up
            // of this thread or a sleep (as an NBD connection polls its socket).
            let next = vring.queue_next_avail();
            let deadline = Instant::now() + self.poll;
            let more = loop {
                let available = vring.get_ref().get_queue().avail_idx(&*memory, Ordering::Acquire);
                if available.map_err(queue_error)?.0 != next {
                    break true;
                }
                if Instant::now() >= deadline || self.closing.load(Ordering::Relaxed) {
                    break false;
                }
                std::hint::spin_loop();
            };
            if more {
                continue;
            }
            if !event_idx
                || self.closing.load(Ordering::Relaxed)
                || !vring.enable_notification().map_err(queue_error)?
            {
                break;
            }
        }
        Ok(false)
    }

    /// [`Self::close`] from the worker, which holds the device already.
    fn close_unlocked(&self) {
        self.closing.store(true, Ordering::SeqCst);
        if let Some(handle) = lock(&self.shutdown).as_ref() {
            handle.shutdown();
        }
    }
}

fn queue_error(error: virtio_queue::Error) -> io::Error {
    io::Error::other(format!("virtqueue: {error}"))
}

/// Takes the queue's next request, its buffers into `buffers`: its head, or `None` if the guest
/// has made none available or QEMU stopped the queue.
fn take_request(vring: &VringRwLock, memory: &GuestMemoryMmap, buffers: &mut Buffers) -> io::Result<Option<u16>> {
    let mut state = vring.get_mut();
    let queue = state.get_queue_mut();
    if !queue.ready() {
        return Ok(None);
    }
    let next = queue.next_avail();
    let available = queue.avail_idx(memory, Ordering::Acquire).map_err(queue_error)?.0;
    if available == next {
        return Ok(None);
    }
    // The guest says requests are there, and none can be taken (its ring claims more than it
    // holds, or lies outside its memory): waiting for them would spin here for ever.
    let Some(chain) = queue.pop_descriptor_chain(memory) else {
        return Err(io::Error::other(format!(
            "the available ring is malformed: index {available}, {} past the next request, in a queue of {}",
            available.wrapping_sub(next),
            queue.size()
        )));
    };
    let head = chain.head_index();
    buffers.readable.clear();
    buffers.writable.clear();
    for descriptor in chain {
        let segment = Segment { addr: descriptor.addr().0, len: descriptor.len() };
        if descriptor.is_write_only() {
            buffers.writable.push(segment);
        } else {
            buffers.readable.push(segment);
        }
    }
    Ok(Some(head))
}

/// Checks that every region of `memory` lies within the file it maps; `Ok(Some(start))` names
/// a region whose file may still shrink (not a memfd sealed against it).
fn backing_checked(memory: &GuestMemoryMmap) -> io::Result<Option<String>> {
    let mut unsealed = None;
    for region in memory.iter() {
        let start = region.start_addr().0;
        let Some(backing) = region.file_offset() else {
            // Memory the backend mapped itself, not the VMM's: nothing can take it away.
            continue;
        };
        let file_bytes = backing.file().metadata()?.len();
        let end = backing.start().checked_add(region.len());
        if end.is_none_or(|end| end > file_bytes) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "guest memory at {start:#x}: {} bytes from offset {} of a file of {file_bytes} bytes",
                    region.len(),
                    backing.start()
                ),
            ));
        }
        let sealed = rustix::fs::fcntl_get_seals(backing.file()).is_ok_and(|seals| seals.contains(SealFlags::SHRINK));
        if !sealed && unsealed.is_none() {
            unsealed = Some(format!("{start:#x}"));
        }
    }
    Ok(unsealed)
}

impl GuestBytes for GuestMemoryMmap {
    fn read_at(&self, addr: u64, buf: &mut [u8]) -> bool {
        self.read_slice(buf, GuestAddress(addr)).is_ok()
    }

    fn write_at(&self, addr: u64, data: &[u8]) -> bool {
        self.write_slice(data, GuestAddress(addr)).is_ok()
    }
}

/// Requests a queue is served at a time (a ring's worth of the largest queue) before the VM's
/// other queues get their turn: a queue kept busy by one vCPU's writer starved the others (a
/// database's flushes on another vCPU waited as long as the writer ran).
const TURN_REQUESTS: usize = 1024;

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker that panicked left the device as it was: serving on is no worse than refusing.
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl VhostUserBackend for Blk {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(lock(&self.config).queues)
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.open_device();
        lock(&self.config).features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, _features: u64) {
        // The device is being started (again): what was stopped before no longer counts, and
        // each queue's guest is signalled at its first serving (see `serve_queue`).
        self.hurry.store(false, Ordering::SeqCst);
        // A close between the two would otherwise wait out the request's limits.
        if self.closing.load(Ordering::SeqCst) {
            self.hurry.store(true, Ordering::SeqCst);
        }
        self.used_queues.store(0, Ordering::SeqCst);
        self.stopped_queues.store(0, Ordering::SeqCst);
        self.signal_owed.store(u64::MAX, Ordering::SeqCst);
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // One worker for every queue: the crate's default mask covers the first 32 only, and a
        // queue outside it is never served (its guest's I/O hangs).
        let queues = self.num_queues();
        vec![if queues >= 64 { u64::MAX } else { (1u64 << queues) - 1 }]
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // No INFLIGHT_SHMFD: requests in flight are replayed by QEMU instead (see the module).
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = lock(&self.config).space(self.write_back.load(Ordering::Relaxed));
        // Exactly `size` bytes, or vhost answers with nothing: zeroes past the end.
        (offset..offset.saturating_add(size)).map(|i| space.get(i as usize).copied().unwrap_or(0)).collect()
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        // Only the write-cache setting is the driver's to change.
        match (offset as usize, buf) {
            (WRITEBACK_OFFSET, [value]) => {
                self.write_back.store(*value != 0, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("config write at {offset}"))),
        }
    }

    fn update_memory(&self, memory: Memory) -> io::Result<()> {
        // The same atomic this backend holds a clone of: it sees the new map already. A region
        // longer than the file behind it would fault (SIGBUS, the whole server with every VM)
        // at the first request touching its end: such a map ends this connection instead.
        let unsealed = match backing_checked(&memory.memory()) {
            Ok(unsealed) => unsealed,
            Err(error) => {
                tracing::warn!(%error, "vhost-user: the VMM's memory map is refused, the connection closed");
                self.close_unlocked();
                return Err(error);
            }
        };
        if let Some(region) = unsealed {
            if !self.unsealed_memory_told.swap(true, Ordering::Relaxed) {
                // hugetlbfs files cannot be sealed: said once, as information.
                tracing::info!(
                    region,
                    "vhost-user: guest memory may shrink under the server (its file is not sealed against it, as \
                     QEMU's memfd backend seals by default): a VMM that shrank it would take the server down"
                );
            }
        }
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // Without one, dropping the daemon would wait forever for its worker.
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok(pair) => {
                lock(&self.exit_consumers).push(std::os::fd::AsRawFd::as_raw_fd(&pair.0));
                Some(pair)
            }
            Err(error) => {
                tracing::error!(%error, "vhost-user: no exit event for a worker");
                None
            }
        }
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // The request being carried out is returned before QEMU reads where the queue stands,
        // at once: QEMU waits for it under its big lock.
        self.hurry.store(true, Ordering::SeqCst);
        drop(lock(&self.device));
        self.stopped_queues.fetch_or(1u64 << (queue_index % 64), Ordering::SeqCst);
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        _thread: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        let Some(vring) = vrings.get(usize::from(device_event)) else { return Ok(()) };
        self.used_queues.fetch_or(1u64 << (device_event % 64), Ordering::SeqCst);
        // Returning an error, or unwinding, would end the worker with the queue dead, the
        // socket open and no word: the guest's I/O would hang. The connection is closed instead,
        // and QEMU reconnects and sends the requests not returned again (as an NBD connection's
        // thread that panicked closes its socket).
        let serving = std::panic::AssertUnwindSafe(|| self.serve_queue(vring, device_event));
        match std::panic::catch_unwind(serving) {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, queue = device_event, "vhost-user queue failed; closing the connection");
                self.close_unlocked();
            }
            Err(_) => {
                tracing::error!(queue = device_event, "vhost-user request panicked; closing the connection");
                self.close_unlocked();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use overspill_block::Capabilities;
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;

    use super::*;
    use crate::config::Limits;
    use crate::testing::Disk;

    fn header(kind: u32, sector: u64) -> [u8; 16] {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        h
    }

    /// A chain of (address, length, device-writable) descriptors from table index `first`.
    fn chain(first: u16, parts: &[(u64, u32, bool)]) -> Vec<RawDescriptor> {
        parts
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, writable))| {
                let last = i + 1 == parts.len();
                let flags = if writable { VRING_DESC_F_WRITE } else { 0 } | if last { 0 } else { VRING_DESC_F_NEXT };
                RawDescriptor::from(Descriptor::new(addr, len, flags as u16, first + i as u16 + 1))
            })
            .collect()
    }

    /// A device over a 1 MiB disk in memory, its one queue the mock's.
    fn device_on(memory: &GuestMemoryMmap, queue: &MockSplitQueue<'_, GuestMemoryMmap>) -> (Blk, VringRwLock) {
        let atomic = GuestMemoryAtomic::new(memory.clone());
        let vring = VringRwLock::new(atomic.clone(), 16).expect("vring");
        vring.set_queue_size(16);
        vring
            .set_queue_info(queue.desc_table_addr().0, queue.avail_addr().0, queue.used_addr().0)
            .expect("queue addresses");
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        let config =
            DeviceConfig { size: 1 << 20, capabilities: Capabilities::ALL, queues: 1, limits: Limits::default() };
        let opener: Opener = Box::new(|_| Ok(Box::new(Disk::new(1 << 20)) as Box<dyn BlockDevice>));
        let blk = Blk::new(opener, atomic, config, b"vm".to_vec(), Duration::from_micros(20));
        blk.open_device();
        (blk, vring)
    }

    /// A guest whose available index runs further ahead than its queue holds cannot be served:
    /// the queue fails (and its connection is closed) instead of waiting for ever, at full
    /// speed, for requests that cannot be taken.
    #[test]
    fn an_available_index_past_the_queue_size_fails_the_queue() {
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        queue.avail().idx().store(u16::to_le(100));
        let (blk, vring) = device_on(&memory, &queue);
        let error = blk.serve_queue(&vring, 0).expect_err("a malformed available ring");
        assert!(error.to_string().contains("100 past the next request"), "{error}");
    }

    /// An eventfd, and a file of it for the vring (the VMM's kick or call).
    fn eventfd() -> (std::os::fd::OwnedFd, std::fs::File) {
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).expect("eventfd");
        let file = std::fs::File::from(fd.try_clone().expect("clone"));
        (fd, file)
    }

    /// Whether the eventfd was written to since it was last looked at.
    fn fired(fd: &std::os::fd::OwnedFd) -> bool {
        rustix::io::read(fd, &mut [0u8; 8]).is_ok()
    }

    /// Two 4 KiB writes at sectors 8 and 16, their headers and data from 0x1_0000 on, their
    /// descriptors from table index `first`.
    fn two_writes(memory: &GuestMemoryMmap, first: u16) -> Vec<RawDescriptor> {
        let base = 0x1_0000 + u64::from(first) * 0x1_0000;
        let mut descriptors = Vec::new();
        for (i, sector) in [8u64, 16].into_iter().enumerate() {
            let at = base + i as u64 * 0x4000;
            memory.write_slice(&header(VIRTIO_BLK_T_OUT, sector), GuestAddress(at)).expect("header");
            descriptors.extend(chain(
                first + 3 * i as u16,
                &[(at, 16, false), (at + 0x1000, 4096, false), (at + 0x2000, 1, true)],
            ));
        }
        descriptors
    }

    /// A connection closing (a stopping server, a refused memory map) while its guest has
    /// requests queued leaves them for the next connection and returns: it looked for them
    /// again and again, its locks held, and the server's stop waited for it for ever.
    #[test]
    fn a_closing_connection_leaves_the_queued_requests_and_returns() {
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        queue.add_desc_chains(&two_writes(&memory, 0), 0).expect("chains");
        let (blk, vring) = device_on(&memory, &queue);
        blk.closing.store(true, Ordering::SeqCst);
        let (done, returned) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let served = blk.serve_queue(&vring, 0);
                let _ = done.send(served.is_ok());
            });
            let returned = returned.recv_timeout(Duration::from_secs(5));
            if returned.is_err() {
                // The spinning worker never ends: end the test process with the failure.
                eprintln!("serve_queue still running 5 s after the connection began closing");
                std::process::exit(101);
            }
        });
        assert_eq!(queue.used().idx().load(), 0, "requests served by a closing connection");
    }

    /// With EVENT_IDX, the first serving of a queue after the device starts signals the guest
    /// even where its `used_event` says not to (it stays behind completions a killed server
    /// published and never signalled: without this, no completion would interrupt the guest
    /// again); later servings signal as the guest asks.
    #[test]
    fn the_first_serving_after_a_start_signals_the_guest_whatever_event_idx_says() {
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        let (blk, vring) = device_on(&memory, &queue);
        // The mock puts its used ring where a 16-entry available ring's used_event is: the used
        // ring goes elsewhere here.
        let used_ring = GuestAddress(0x8000);
        vring.set_queue_info(queue.desc_table_addr().0, queue.avail_addr().0, used_ring.0).expect("queue addresses");
        let used_index = || u16::from_le(memory.read_obj::<u16>(GuestAddress(used_ring.0 + 2)).expect("used index"));
        blk.set_event_idx(true);
        vring.set_queue_event_idx(true);
        let (call, call_file) = eventfd();
        vring.set_call(Some(call_file));
        // The guest's used_event far ahead of what will be returned: it asks for no interrupt.
        let used_event = GuestAddress(queue.avail_addr().0 + 4 + 2 * 16);
        memory.write_obj(u16::to_le(100), used_event).expect("used_event");
        let signalled = || fired(&call);

        queue.add_desc_chains(&two_writes(&memory, 0)[..3], 0).expect("chain");
        blk.serve_queue(&vring, 0).expect("served");
        assert_eq!(used_index(), 1);
        assert!(signalled(), "the first serving after the start did not signal the guest");

        queue.add_desc_chains(&two_writes(&memory, 0)[3..], 3).expect("chain");
        blk.serve_queue(&vring, 0).expect("served");
        assert_eq!(used_index(), 2);
        assert!(!signalled(), "a later serving signalled against the guest's used_event");

        // A start again (a reconnect's SET_FEATURES): owed again.
        blk.acked_features(0);
        blk.serve_queue(&vring, 0).expect("served");
        assert!(signalled(), "the first serving after a restart did not signal the guest");
    }

    /// A request that panics below the seam closes its connection (QEMU reconnects and sends
    /// it again) and leaves the worker serving: the worker ended and the guest's I/O hung.
    #[test]
    fn a_request_that_panics_closes_its_connection_and_the_worker_lives() {
        struct Panicking;
        impl BlockDevice for Panicking {
            fn size(&self) -> u64 {
                1 << 20
            }
            fn capabilities(&self) -> Capabilities {
                Capabilities::ALL
            }
            fn read(&mut self, _: &overspill_block::ReadRequest, _: u64, _: &mut [u8]) -> Result<(), DeviceError> {
                Ok(())
            }
            fn write(&mut self, _: u64, _: &[u8], _: bool) -> Result<(), DeviceError> {
                panic!("a bug below the seam")
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
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        queue.add_desc_chains(&two_writes(&memory, 0)[..3], 0).expect("chain");
        let (blk, vring) = device_on(&memory, &queue);
        *lock(&blk.device) = Some(Box::new(Panicking));
        let handled = blk.handle_event(0, EventSet::IN, std::slice::from_ref(&vring), 0);
        assert!(handled.is_ok(), "the worker was told to end: {handled:?}");
        assert!(blk.closing.load(Ordering::SeqCst), "the connection stays open with its request unanswered");
        assert_eq!(queue.used().idx().load(), 0);
    }

    /// A slow request is signalled as soon as it is done, not with the rest of its batch: the
    /// guest hears of the first of two slow writes before the second begins.
    #[test]
    fn a_slow_request_is_signalled_before_the_next_one_begins() {
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        queue.add_desc_chains(&two_writes(&memory, 0), 0).expect("chains");
        let (blk, vring) = device_on(&memory, &queue);
        let (call, call_file) = eventfd();
        vring.set_call(Some(call_file));
        let told = Arc::new(Mutex::new(Vec::new()));
        let mut disk = Disk::new(1 << 20);
        let seen = told.clone();
        disk.before_write = Some(Box::new(move || {
            lock(&seen).push(fired(&call));
            std::thread::sleep(SIGNAL_WITHIN * 10);
        }));
        *lock(&blk.device) = Some(Box::new(disk));
        blk.signal_owed.store(0, Ordering::SeqCst);
        blk.serve_queue(&vring, 0).expect("served");
        assert_eq!(queue.used().idx().load(), 2);
        assert_eq!(*lock(&told), [false, true], "whether the guest had heard of a write as each began");
    }

    /// A queue is served a turn's worth of requests at a time, then kicked again to be served
    /// after the VM's other queues' waiting kicks: one busy queue starved the others.
    #[test]
    fn a_busy_queue_yields_after_its_turn_and_is_kicked_again() {
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        queue.add_desc_chains(&two_writes(&memory, 0), 0).expect("chains");
        let (mut blk, vring) = device_on(&memory, &queue);
        blk.turn_requests = 1;
        let (kick, kick_file) = eventfd();
        vring.set_kick(Some(kick_file));
        blk.serve_queue(&vring, 0).expect("served");
        assert_eq!(queue.used().idx().load(), 1, "one turn, one request");
        assert!(fired(&kick), "the queue was not kicked again with a request left");
        blk.serve_queue(&vring, 0).expect("served");
        assert_eq!(queue.used().idx().load(), 2);
    }

    /// Every queue is served: the crate's default mask of queues per worker covers 32.
    #[test]
    fn every_queue_is_in_a_workers_mask() {
        for queues in [1u16, 4, 32, 40, 64] {
            let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
            let config =
                DeviceConfig { size: 1 << 20, capabilities: Capabilities::ALL, queues, limits: Limits::default() };
            let opener: Opener = Box::new(|_| Ok(Box::new(Disk::new(1 << 20)) as Box<dyn BlockDevice>));
            let blk = Blk::new(opener, GuestMemoryAtomic::new(memory), config, b"vm".to_vec(), Duration::ZERO);
            let covered = blk.queues_per_thread().iter().fold(0u64, |all, mask| all | mask);
            assert_eq!(covered.count_ones(), u32::from(queues), "{queues} queues");
        }
    }

    /// Three requests made available at once, served through a real split virtqueue: a write, a
    /// read of what it wrote, and one of a kind the device does not know. Each comes back in the
    /// used ring in the order it was made available (what makes a replay after a restart safe),
    /// with the bytes it wrote and the status virtio expects.
    #[test]
    fn requests_come_back_in_the_order_they_were_made_available_with_their_status() {
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory");
        let queue = MockSplitQueue::new(&memory, 16);
        let data: Vec<u8> = (0..4096).map(|i| (i * 7 % 256) as u8).collect();
        memory.write_slice(&header(VIRTIO_BLK_T_OUT, 8), GuestAddress(0x1_0000)).expect("header");
        memory.write_slice(&data, GuestAddress(0x1_1000)).expect("data");
        memory.write_slice(&header(VIRTIO_BLK_T_IN, 8), GuestAddress(0x2_0000)).expect("header");
        memory.write_slice(&header(99, 0), GuestAddress(0x3_0000)).expect("header");
        let mut descriptors = chain(0, &[(0x1_0000, 16, false), (0x1_1000, 4096, false), (0x1_2000, 1, true)]);
        descriptors.extend(chain(3, &[(0x2_0000, 16, false), (0x2_1000, 4096, true), (0x2_2000, 1, true)]));
        descriptors.extend(chain(6, &[(0x3_0000, 16, false), (0x3_2000, 1, true)]));
        queue.add_desc_chains(&descriptors, 0).expect("chains");

        let (blk, vring) = device_on(&memory, &queue);
        blk.serve_queue(&vring, 0).expect("served");

        let used = queue.used();
        assert_eq!(used.idx().load(), 3, "three requests returned");
        let returned: Vec<(u32, u32)> = (0..3)
            .map(|i| used.ring().ref_at(i).expect("used entry").load())
            .map(|entry| (entry.id(), entry.len()))
            .collect();
        assert_eq!(returned, [(0, 1), (3, 4097), (6, 1)]);
        let status = |addr: u64| memory.read_obj::<u8>(GuestAddress(addr)).expect("status");
        assert_eq!(status(0x1_2000), VIRTIO_BLK_S_OK as u8);
        assert_eq!(status(0x2_2000), VIRTIO_BLK_S_OK as u8);
        assert_eq!(status(0x3_2000), VIRTIO_BLK_S_UNSUPP as u8);
        let mut read_back = vec![0u8; 4096];
        memory.read_slice(&mut read_back, GuestAddress(0x2_1000)).expect("read data");
        assert_eq!(read_back, data);
    }
}
