//! Service times of a device's requests, measured around it: the engine keeps no clock (it runs
//! inside simulations), so the time each guest request took is taken here.

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::device::{BlockDevice, DeviceError, Payload, ReadRequest};
use crate::layer::DeviceLayer;
use crate::op::GuestOp;

/// Where service times go: one sample per guest request.
pub trait Latencies: Send + Sync {
    fn record(&self, op: GuestOp, spent: Duration);
}

/// A device whose requests are timed: writes, zeroes, trims and flushes per call, a read once
/// over all the calls that answer it. The time a write's data took to arrive from the client is
/// the client's, not the device's, and is left out.
pub struct Timed<D> {
    inner: D,
    latencies: Arc<dyn Latencies>,
    /// The read request being answered in parts: bytes not answered yet, and the time its parts
    /// took so far.
    read_left: u64,
    read_spent: Duration,
}

impl<D: BlockDevice> Timed<D> {
    pub fn new(inner: D, latencies: Arc<dyn Latencies>) -> Self {
        Self { inner, latencies, read_left: 0, read_spent: Duration::ZERO }
    }

    fn timed<R>(&mut self, op: GuestOp, call: impl FnOnce(&mut D) -> R) -> R {
        let start = Instant::now();
        let result = call(&mut self.inner);
        self.latencies.record(op, start.elapsed());
        result
    }

    /// A part of the read request answered, or failed (which ends the request): the request's
    /// latency is recorded once its last part is.
    fn read_part<R, E>(&mut self, length: u64, call: impl FnOnce(&mut D) -> Result<R, E>) -> Result<R, E> {
        let start = Instant::now();
        let result = call(&mut self.inner);
        self.part_done(length, start, result.is_err());
        result
    }

    fn part_done(&mut self, length: u64, start: Instant, failed: bool) {
        self.read_spent += start.elapsed();
        self.read_left = if failed { 0 } else { self.read_left.saturating_sub(length) };
        if self.read_left == 0 {
            self.latencies.record(GuestOp::Read, std::mem::take(&mut self.read_spent));
        }
    }
}

/// A write's data, with the time spent waiting for it.
struct TimedPayload<'a> {
    inner: &'a mut dyn Payload,
    receiving: Duration,
}

impl Payload for TimedPayload<'_> {
    fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> std::io::Result<()> {
        let start = Instant::now();
        let result = self.inner.receive(buffers);
        self.receiving += start.elapsed();
        result
    }
}

impl<D: BlockDevice> DeviceLayer for Timed<D> {
    type Below = D;

    fn below(&self) -> &D {
        &self.inner
    }
    fn below_mut(&mut self) -> &mut D {
        &mut self.inner
    }
    fn read_requested(&mut self, offset: u64, length: u64) {
        (self.read_left, self.read_spent) = (length, Duration::ZERO);
        self.inner.read_requested(offset, length);
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.read_part(buf.len() as u64, |inner| inner.read(request, offset, buf))
    }
    fn read_vectored(
        &mut self,
        request: &ReadRequest,
        offset: u64,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Result<(), DeviceError> {
        let length = bufs.iter().map(|buf| buf.len() as u64).sum();
        self.read_part(length, |inner| inner.read_vectored(request, offset, bufs))
    }
    fn read_sent_as_zeroes(&mut self, request: &ReadRequest, offset: u64, length: u64) {
        let start = Instant::now();
        self.inner.read_sent_as_zeroes(request, offset, length);
        self.part_done(length, start, false);
    }
    fn read_shared(&mut self, request: &ReadRequest, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        self.read_part(length as u64, |inner| inner.read_shared(request, offset, length))
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.timed(GuestOp::Write, |inner| inner.write(offset, data, fua))
    }
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        let start = Instant::now();
        let mut timed = TimedPayload { inner: payload, receiving: Duration::ZERO };
        let result = self.inner.write_from(offset, length, fua, &mut timed);
        self.latencies.record(GuestOp::Write, start.elapsed().saturating_sub(timed.receiving));
        result
    }
    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        self.timed(GuestOp::Write, |inner| inner.write_vectored(offset, bufs, fua))
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.timed(GuestOp::Zero, |inner| inner.write_zeroes(offset, length, may_trim, fast_only, fua))
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.timed(GuestOp::Trim, |inner| inner.trim(offset, length, fua))
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.timed(GuestOp::Flush, |inner| inner.flush())
    }
}
