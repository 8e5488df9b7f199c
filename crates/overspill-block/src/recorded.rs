//! Recording a device's requests as a trace ([`crate::trace`]): what `serve --record` writes and
//! the storm and the planner replay.

use std::io::{IoSlice, IoSliceMut};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::device::{BlockDevice, DeviceError, Payload};
use crate::layer::DeviceLayer;
use crate::op::GuestOp;
use crate::trace::{Record, TraceError, TraceHeader, TraceWriter};

/// One VM's trace being written: every request, timed from when the trace began. A VM's
/// connections (it may reconnect) share one, so it is kept behind a lock.
pub struct Recorder {
    writer: Option<TraceWriter>,
    started: Instant,
    vm: String,
}

impl Recorder {
    /// A trace at `dir/<vm>-<number>.trace`, the VM's name kept to characters safe in a file
    /// name (names come from clients).
    pub fn create(dir: &Path, vm: &str, number: u64, disk_bytes: u64) -> Result<Arc<Mutex<Self>>, TraceError> {
        let safe: String =
            vm.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
        let header = TraceHeader { disk_bytes, vm: vm.to_owned(), phases: vec!["recorded".into()] };
        let writer = TraceWriter::create(&dir.join(format!("{safe}-{number}.trace")), &header)?;
        Ok(Arc::new(Mutex::new(Self { writer: Some(writer), started: Instant::now(), vm: vm.to_owned() })))
    }

    fn record(&mut self, kind: GuestOp, offset: u64, length: u64) {
        let Some(writer) = self.writer.as_mut() else { return };
        let record = Record {
            time_us: u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            offset,
            length: u32::try_from(length).unwrap_or(u32::MAX),
            kind,
            flags: 0,
            phase: 0,
        };
        if let Err(error) = writer.record(&record) {
            // A full disk must not take the VM down with it: recording stops, serving goes on.
            tracing::warn!(vm = %self.vm, %error, "trace recording stopped");
            self.writer = None;
        }
    }
}

impl Recorder {
    /// Writes out what is buffered and stops recording: the trace is whole on disk when this
    /// returns (a reader may be waiting for the VM to go to read it).
    pub fn finish(&mut self) {
        if let Some(Err(error)) = self.writer.take().map(TraceWriter::finish) {
            tracing::warn!(vm = %self.vm, %error, "could not finish the trace");
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A device whose every request is recorded, as the guest asked it (a read once, however it is
/// answered), before it is served. A write whose data never arrived (its client went) was never
/// made and is not recorded.
/// Without a recorder (`None`: the server records nothing) it only passes requests on.
pub struct Recorded<D> {
    inner: D,
    recorder: Option<Arc<Mutex<Recorder>>>,
}

impl<D: BlockDevice> Recorded<D> {
    pub fn new(inner: D, recorder: Option<Arc<Mutex<Recorder>>>) -> Self {
        Self { inner, recorder }
    }

    fn record(&self, kind: GuestOp, offset: u64, length: u64) {
        if let Some(recorder) = &self.recorder {
            lock(recorder).record(kind, offset, length);
        }
    }
}

fn lock(recorder: &Mutex<Recorder>) -> MutexGuard<'_, Recorder> {
    // A panic mid-record leaves at worst a partial record, which readers skip.
    recorder.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The write's data, recorded once it has all arrived.
struct RecordedPayload<'a> {
    inner: &'a mut dyn Payload,
    recorder: &'a Mutex<Recorder>,
    offset: u64,
    length: usize,
}

impl Payload for RecordedPayload<'_> {
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> std::io::Result<()> {
        self.inner.receive(buffers)?;
        lock(self.recorder).record(GuestOp::Write, self.offset, self.length as u64);
        Ok(())
    }
}

impl<D: BlockDevice> DeviceLayer for Recorded<D> {
    type Below = D;

    fn below(&self) -> &D {
        &self.inner
    }
    fn below_mut(&mut self) -> &mut D {
        &mut self.inner
    }
    fn read_requested(&mut self, offset: u64, length: u64) {
        self.record(GuestOp::Read, offset, length);
        self.inner.read_requested(offset, length);
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.record(GuestOp::Write, offset, data.len() as u64);
        self.inner.write(offset, data, fua)
    }
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        let Some(recorder) = &self.recorder else { return self.inner.write_from(offset, length, fua, payload) };
        let mut recorded = RecordedPayload { inner: payload, recorder, offset, length };
        self.inner.write_from(offset, length, fua, &mut recorded)
    }
    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        self.record(GuestOp::Write, offset, bufs.iter().map(|buf| buf.len() as u64).sum());
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
        self.record(GuestOp::Zero, offset, length);
        self.inner.write_zeroes(offset, length, may_trim, fast_only, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.record(GuestOp::Trim, offset, length);
        self.inner.trim(offset, length, fua)
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.record(GuestOp::Flush, 0, 0);
        self.inner.flush()
    }
}
