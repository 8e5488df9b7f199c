//! One VM's overlay behind the device seam, for one connection, and the layers it wears there:
//! recording (`serve --record`), timing, and the ledger's mark that the VM has writes.

use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use overspill_block::limit::GiveUp;
use overspill_block::{
    BlockDevice, Capabilities, DepthExtent, DeviceError, DeviceErrorKind, DeviceLayer, Extent, Limiter, Payload,
    ReadRequest, Recorded, Recorder, Throttled, Timed,
};
use overspill_engine::{Allocation, EngineError};

use crate::boot_pacing::BootGate;
use crate::error::device_error;
use crate::live::{Live, NotCurrent};
use crate::vms::{Ending, VmRegistry};

/// What a connection to a VM is served by: its overlay, timed, recorded if the server records,
/// and marked in the ledger before its first change. `may_boot`: the connection made the VM's
/// overlay fresh, or joins one that did (a VM that resumes or moves in is running already).
pub(crate) fn stack(
    live: Arc<Live>,
    capabilities: Capabilities,
    connection: Connection,
    registry: Arc<VmRegistry>,
    limiters: Vec<Arc<Limiter>>,
    may_boot: bool,
) -> Result<Box<dyn BlockDevice>, DeviceError> {
    let Connection { number, reset, hurry } = connection;
    let taken = {
        let vm = live.vm();
        vm.as_ref().map(|vm| {
            let recorder: Option<Arc<Mutex<Recorder>>> = vm.recorder.clone();
            (vm.overlay.stats().clone(), recorder, vm.overlay.size(), vm.vm.clone())
        })
    };
    // A connection joining a multi-conn VM waits for its lock, which a capture holds to the
    // overlay's end: by then there is nothing to join.
    let Some((stats, recorder, size, name)) = taken else {
        registry.leave(number);
        return Err(DeviceError::new(
            DeviceErrorKind::Refused,
            "the VM's overlay ended (captured or reset) as this connection joined it: connect again",
        ));
    };
    registry.attach_live(number, &live);
    let engine = EngineDevice {
        capabilities,
        idle_cut: false,
        live,
        size,
        name: name.clone(),
        number,
        reset: reset.clone(),
        clean: false,
        registry: registry.clone(),
        no_space: NoSpaceWarnings::default(),
    };
    let boots = registry.boots().clone();
    let stopping = registry.clone();
    let device =
        LedgerMarked { inner: Recorded::new(Timed::new(engine, stats), recorder), registry, number, marked: false };
    // Outside the timing: the time a request waits for its limits, or for a boot slot, is not
    // the device's service time. The gate is open from the start for all but a fresh VM's
    // connection: no lock for the others' requests.
    let open = !(may_boot && boots.to_boot(&name));
    // A wait for a boot slot or for limits ends when the VM is reset (the request then finds
    // its overlay gone) or the server drains: no request outlasts the drain by waiting. Its
    // frontend may call it off too (a VMM stopping the device waits for the request in hand).
    let give_up: GiveUp = Arc::new(move || reset.load(Ordering::SeqCst) || stopping.is_stopping() || hurry());
    Ok(if limiters.is_empty() {
        Box::new(BootGate::new(device, boots, name, give_up, open))
    } else {
        let throttled = Throttled::giving_up(device, limiters, give_up.clone());
        Box::new(BootGate::new(throttled, boots, name, give_up, open))
    })
}

/// The connection a device stack serves: its number in the registry, the flag an operator's
/// reset of its VM sets, and when its frontend needs the request in hand back at once
/// ([`overspill_block::ExportProvider::open_hurried`]).
pub(crate) struct Connection {
    pub number: u64,
    pub reset: Arc<AtomicBool>,
    pub hurry: GiveUp,
}

/// One VM's overlay behind the device trait, for one connection. Dropping it ends the
/// connection's hold on the VM: the registry then keeps the overlay for a reconnect or drops it,
/// depending on how the connection ended.
struct EngineDevice {
    capabilities: Capabilities,
    /// The connection was cut for idleness (`--idle-timeout`): the VM is not gone, only quiet.
    idle_cut: bool,
    /// Shared with a move of the VM to or from a peer; taken out when the connection ends, or
    /// when the VM has moved away.
    live: Arc<Live>,
    size: u64,
    name: String,
    number: u64,
    /// Set by an operator's reset: the connection closes at its next request, or at the next
    /// wake-up of its wait if the client sends none.
    reset: Arc<AtomicBool>,
    /// The client said it is done (NBD_CMD_DISC).
    clean: bool,
    registry: Arc<VmRegistry>,
    no_space: NoSpaceWarnings,
}

/// How often a VM's full spill disk (or memory) is said in the log, at most.
const NO_SPACE_WARNING_EVERY: Duration = Duration::from_secs(10);

/// The writes refused for want of room since the last warning, and when that was: a VM that
/// goes on writing to a full disk gets ENOSPC for each write, and the log one line now and then.
#[derive(Default)]
struct NoSpaceWarnings {
    last: Option<Instant>,
    since: u64,
}

impl Drop for EngineDevice {
    fn drop(&mut self) {
        // One of several connections (multi-conn): the VM's connection goes on in the others.
        if self.registry.leave(self.number) {
            return;
        }
        let ending = if self.clean || self.reset.load(Ordering::SeqCst) {
            Ending::Deliberate
        } else if self.idle_cut {
            Ending::Idle
        } else {
            Ending::Lost
        };
        if self.live.end_settled_by_move(ending) {
            return;
        }
        // Dropped here, outside the registry's lock, unless the registry keeps it for a reconnect.
        let vm = self.live.vm().take();
        if let Some(mut vm) = vm {
            // An overlay about to wait gives back the spill space it kept for writes; one about
            // to be dropped would only punch a file about to be removed.
            if self.registry.would_keep(self.number, ending) {
                vm.overlay.give_back_spare_disk();
            }
            drop(self.registry.end(self.number, ending, vm));
        }
    }
}

/// What a request does: a change asks for a moving VM's switchover, and one refused for want
/// of room is said in the log too.
enum Purpose {
    Read,
    Change,
}

impl EngineDevice {
    /// Runs `op` on the overlay: once the VM's state here is current (a VM moving in waits for
    /// it), and unless the VM has moved away (then the connection closes).
    fn serve<T>(
        &mut self,
        purpose: Purpose,
        op: impl FnOnce(&mut overspill_engine::Overlay) -> Result<T, EngineError>,
    ) -> Result<T, DeviceError> {
        if let Err(not_current) = self.live.wait_until_current(matches!(purpose, Purpose::Change)) {
            let why = match not_current {
                NotCurrent::MoveFailed(why) => {
                    self.reset.store(true, Ordering::SeqCst);
                    why
                }
                NotCurrent::StillMoving(why) => {
                    // One line per request that waited the whole wait (a switchover that slow is
                    // worth each).
                    tracing::warn!(vm = %self.name, %why, "a request failed waiting for the VM's move to switch over");
                    why
                }
            };
            return Err(DeviceError::new(DeviceErrorKind::Io, format!("VM {}: {why}", self.name)));
        }
        let result = match self.live.vm().as_mut() {
            Some(vm) => op(&mut vm.overlay),
            None => {
                self.reset.store(true, Ordering::SeqCst);
                return Err(DeviceError::new(
                    DeviceErrorKind::Io,
                    format!(
                        "VM {} is served here no more (moved to another server, or captured); this connection closes",
                        self.name
                    ),
                ));
            }
        };
        result.map_err(|error| match purpose {
            Purpose::Change => self.change_refused(error),
            Purpose::Read => device_error(error),
        })
    }

    /// A change refused: the client hears of it, and a refusal for want of room is said in the
    /// log too (the operator's only sign that a spill disk is full), naming the VM.
    fn change_refused(&mut self, error: EngineError) -> DeviceError {
        if let EngineError::NoSpace(why) = &error {
            let warnings = &mut self.no_space;
            warnings.since += 1;
            if warnings.last.is_none_or(|last| last.elapsed() >= NO_SPACE_WARNING_EVERY) {
                let vm = self.name.as_str();
                tracing::warn!(
                    vm,
                    refused = warnings.since,
                    "a write got ENOSPC: {why} (refused writes since the last warning; the VM keeps what it wrote)"
                );
                (warnings.last, warnings.since) = (Some(Instant::now()), 0);
            }
        }
        device_error(error)
    }
}

impl BlockDevice for EngineDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    // A request is counted once, here; the calls that answer it count their bytes and blocks.
    fn read_requested(&mut self, _offset: u64, _length: u64) {
        if let Some(vm) = self.live.vm().as_ref() {
            vm.overlay.count_read_request();
        }
    }

    fn read_sent_as_zeroes(&mut self, _: &ReadRequest, offset: u64, length: u64) {
        if self.live.gated() {
            return;
        }
        if let Err(error) = self.serve(Purpose::Read, |overlay| overlay.count_unread(offset, length)) {
            tracing::debug!(%error, offset, length, "a read sent as a hole could not be counted");
        }
    }

    fn read(&mut self, _: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        if self.live.read_elsewhere(offset, buf).map_err(|why| DeviceError::new(DeviceErrorKind::Io, why))? {
            return Ok(());
        }
        self.serve(Purpose::Read, |overlay| overlay.read_part(offset, buf))
    }

    fn read_shared(&mut self, _: &ReadRequest, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        let mut elsewhere = vec![0u8; length];
        if self.live.read_elsewhere(offset, &mut elsewhere).map_err(|why| DeviceError::new(DeviceErrorKind::Io, why))? {
            return Ok(vec![Bytes::from(elsewhere)]);
        }
        self.serve(Purpose::Read, |overlay| overlay.read_shared_part(offset, length))
    }

    fn write(&mut self, offset: u64, data: &[u8], _fua: bool) -> Result<(), DeviceError> {
        self.serve(Purpose::Change, |overlay| overlay.write(offset, data))
    }

    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        _fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        self.serve(Purpose::Change, |overlay| {
            overlay.write_received(offset, length, |buffers| payload.receive(buffers))
        })
    }

    fn write_zeroes(&mut self, offset: u64, length: u64, _: bool, _: bool, _: bool) -> Result<(), DeviceError> {
        self.serve(Purpose::Change, |overlay| overlay.write_zeroes(offset, length))
    }

    fn trim(&mut self, offset: u64, length: u64, _fua: bool) -> Result<(), DeviceError> {
        self.serve(Purpose::Change, |overlay| overlay.trim(offset, length))
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        if self.live.gated() {
            // Nothing was written here yet: the sender's writes are its own to keep.
            return Ok(());
        }
        self.serve(Purpose::Read, |overlay| overlay.flush())
    }

    fn block_status(&mut self, offset: u64, length: u64) -> Result<Vec<Extent>, DeviceError> {
        if self.live.gated() {
            // Still the sender's: all data, which is always true (a client then reads it).
            return Ok(vec![Extent { length, hole: false, zero: false }]);
        }
        let extents = self.serve(Purpose::Read, |overlay| overlay.extents(offset, length))?;
        Ok(extents
            .into_iter()
            .map(|extent| Extent {
                length: extent.len,
                hole: extent.state == Allocation::Hole,
                zero: extent.state != Allocation::Data,
            })
            .collect())
    }

    fn allocation_depth(&mut self, offset: u64, length: u64) -> Result<Vec<DepthExtent>, DeviceError> {
        if self.live.gated() {
            // Still the sender's: its own, which is always true of a VM moving here.
            return Ok(vec![DepthExtent { length, depth: overspill_engine::DEPTH_OVERLAY }]);
        }
        let runs = self.serve(Purpose::Read, |overlay| overlay.allocation_depth(offset, length))?;
        Ok(runs.into_iter().map(|run| DepthExtent { length: run.len, depth: run.depth }).collect())
    }

    fn idle_timed_out(&mut self) {
        self.idle_cut = true;
    }

    fn cache(&mut self, offset: u64, length: u64) -> Result<(), DeviceError> {
        if self.live.gated() {
            return Ok(());
        }
        self.serve(Purpose::Read, |overlay| overlay.prefetch(offset, length).map(drop))
    }

    fn disconnect(&mut self) {
        self.clean = true;
    }

    /// A VM that sends nothing has no use for the dead spill segments it kept for its next
    /// writes; another VM on the filesystem may.
    fn idle(&mut self) {
        if let Some(vm) = self.live.vm().as_mut() {
            vm.overlay.give_back_idle_disk();
        }
    }

    fn closing(&self) -> bool {
        self.reset.load(Ordering::Relaxed)
    }
}

/// Before the first request that changes the disk is served, the ledger learns that this VM has
/// writes a server's end would lose; later ones need not ask it (no lock per request).
struct LedgerMarked<D> {
    inner: D,
    registry: Arc<VmRegistry>,
    number: u64,
    marked: bool,
}

impl<D: BlockDevice> LedgerMarked<D> {
    fn about_to_change(&mut self) -> Result<&mut D, DeviceError> {
        if !self.marked {
            self.marked = self.registry.mark_written(self.number).map_err(|e| {
                DeviceError::new(
                    DeviceErrorKind::Io,
                    format!("cannot record in the state directory that this VM has writes: {e}"),
                )
            })?;
        }
        Ok(&mut self.inner)
    }
}

impl<D: BlockDevice> DeviceLayer for LedgerMarked<D> {
    type Below = D;

    fn below(&self) -> &D {
        &self.inner
    }
    fn below_mut(&mut self) -> &mut D {
        &mut self.inner
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.about_to_change()?.write(offset, data, fua)
    }
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        self.about_to_change()?.write_from(offset, length, fua, payload)
    }
    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        self.about_to_change()?.write_vectored(offset, bufs, fua)
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.about_to_change()?.write_zeroes(offset, length, may_trim, fast_only, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.about_to_change()?.trim(offset, length, fua)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use overspill_block::read_whole;

    use super::*;
    use crate::vms::{Claim, Lifecycle};

    /// A disk in memory that counts the writes that reach it.
    pub(crate) struct Counted {
        pub bytes: Vec<u8>,
        pub writes: usize,
    }

    impl BlockDevice for Counted {
        fn size(&self) -> u64 {
            self.bytes.len() as u64
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::ALL
        }
        fn read(&mut self, _: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
            buf.copy_from_slice(&self.bytes[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write(&mut self, offset: u64, data: &[u8], _: bool) -> Result<(), DeviceError> {
            self.writes += 1;
            self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
        fn write_zeroes(&mut self, _: u64, _: u64, _: bool, _: bool, _: bool) -> Result<(), DeviceError> {
            self.writes += 1;
            Ok(())
        }
        fn trim(&mut self, _: u64, _: u64, _: bool) -> Result<(), DeviceError> {
            self.writes += 1;
            Ok(())
        }
        fn flush(&mut self) -> Result<(), DeviceError> {
            Ok(())
        }
    }

    /// The ledger learns of a VM's writes before the first reaches its overlay; a ledger that
    /// cannot be written refuses the write (the device never sees it), and reads never ask it.
    #[test]
    fn a_vms_first_change_waits_for_the_ledger_and_fails_without_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state_dir = dir.path().join("state");
        let lifecycle = Lifecycle {
            reconnect_grace: Duration::from_secs(60),
            state_dir: Some(state_dir.clone()),
            memory_dir: None,
        };
        let registry = VmRegistry::new(lifecycle).expect("registry");
        let Claim::Fresh { number, .. } = registry.claim(Some("desk"), "golden", None).expect("claim") else {
            panic!("a fresh VM");
        };
        let entry = state_dir.join("vm-desk.json");
        let mut device = LedgerMarked {
            inner: Counted { bytes: vec![0; 1 << 20], writes: 0 },
            registry: registry.clone(),
            number,
            marked: false,
        };
        read_whole(&mut device, 0, &mut [0; 4096]).expect("read");
        assert!(!entry.exists(), "a read marked the VM as having writes");
        // Something in the entry's place that it cannot replace: the ledger cannot be written.
        std::fs::create_dir_all(entry.join("in-the-way")).expect("blocker");
        let error =
            BlockDevice::write(&mut device, 0, &[1; 4096], false).expect_err("a write the ledger does not know of");
        assert_eq!(error.kind, DeviceErrorKind::Io);
        assert!(error.message.contains("state directory"), "{error}");
        assert_eq!(device.inner.writes, 0, "the write reached the overlay before the ledger knew");
        std::fs::remove_dir_all(&entry).expect("blocker gone");
        BlockDevice::trim(&mut device, 0, 4096, false).expect("trim");
        assert!(entry.is_file(), "the ledger has the VM once it changed its disk");
        BlockDevice::write(&mut device, 4096, &[2; 4096], false).expect("write");
        assert_eq!(device.inner.writes, 2);
    }
}
