//! Devices that wrap another: a layer says what it adds, and every call it does not override
//! goes to the device below through the one forwarding impl here, so a layer cannot lose a
//! call (a fast path, a lifecycle hook) by forgetting to pass it on.

use std::io::{IoSlice, IoSliceMut};

use bytes::Bytes;

use crate::device::{BlockDevice, Capabilities, DepthExtent, DeviceError, Extent, Payload, ReadRequest};

/// A [`BlockDevice`] made of another one and something added to some of its calls. Each method
/// here is the device method of the same name, passed to [`Self::below`] unless overridden. A
/// method added to [`BlockDevice`] is added here and to the impl below it.
pub trait DeviceLayer: Send {
    type Below: BlockDevice;

    fn below(&self) -> &Self::Below;
    fn below_mut(&mut self) -> &mut Self::Below;

    fn size(&self) -> u64 {
        self.below().size()
    }
    fn capabilities(&self) -> Capabilities {
        self.below().capabilities()
    }
    fn read_requested(&mut self, offset: u64, length: u64) {
        self.below_mut().read_requested(offset, length)
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.below_mut().read(request, offset, buf)
    }
    fn read_vectored(
        &mut self,
        request: &ReadRequest,
        offset: u64,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Result<(), DeviceError> {
        self.below_mut().read_vectored(request, offset, bufs)
    }
    fn read_sent_as_zeroes(&mut self, request: &ReadRequest, offset: u64, length: u64) {
        self.below_mut().read_sent_as_zeroes(request, offset, length)
    }
    fn read_shared(&mut self, request: &ReadRequest, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        self.below_mut().read_shared(request, offset, length)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.below_mut().write(offset, data, fua)
    }
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        self.below_mut().write_from(offset, length, fua, payload)
    }
    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        self.below_mut().write_vectored(offset, bufs, fua)
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        self.below_mut().write_zeroes(offset, length, may_trim, fast_only, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        self.below_mut().trim(offset, length, fua)
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.below_mut().flush()
    }
    fn block_status(&mut self, offset: u64, length: u64) -> Result<Vec<Extent>, DeviceError> {
        self.below_mut().block_status(offset, length)
    }
    fn allocation_depth(&mut self, offset: u64, length: u64) -> Result<Vec<DepthExtent>, DeviceError> {
        self.below_mut().allocation_depth(offset, length)
    }
    fn cache(&mut self, offset: u64, length: u64) -> Result<(), DeviceError> {
        self.below_mut().cache(offset, length)
    }
    fn disconnect(&mut self) {
        self.below_mut().disconnect()
    }
    fn idle(&mut self) {
        self.below_mut().idle()
    }
    fn idle_timed_out(&mut self) {
        self.below_mut().idle_timed_out()
    }
    fn closing(&self) -> bool {
        self.below().closing()
    }
}

impl<L: DeviceLayer> BlockDevice for L {
    fn size(&self) -> u64 {
        DeviceLayer::size(self)
    }
    fn capabilities(&self) -> Capabilities {
        DeviceLayer::capabilities(self)
    }
    fn read_requested(&mut self, offset: u64, length: u64) {
        DeviceLayer::read_requested(self, offset, length)
    }
    fn read(&mut self, request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        DeviceLayer::read(self, request, offset, buf)
    }
    fn read_vectored(
        &mut self,
        request: &ReadRequest,
        offset: u64,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Result<(), DeviceError> {
        DeviceLayer::read_vectored(self, request, offset, bufs)
    }
    fn read_sent_as_zeroes(&mut self, request: &ReadRequest, offset: u64, length: u64) {
        DeviceLayer::read_sent_as_zeroes(self, request, offset, length)
    }
    fn read_shared(&mut self, request: &ReadRequest, offset: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        DeviceLayer::read_shared(self, request, offset, length)
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        DeviceLayer::write(self, offset, data, fua)
    }
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        fua: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        DeviceLayer::write_from(self, offset, length, fua, payload)
    }
    fn write_vectored(&mut self, offset: u64, bufs: &[IoSlice<'_>], fua: bool) -> Result<(), DeviceError> {
        DeviceLayer::write_vectored(self, offset, bufs, fua)
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        DeviceLayer::write_zeroes(self, offset, length, may_trim, fast_only, fua)
    }
    fn trim(&mut self, offset: u64, length: u64, fua: bool) -> Result<(), DeviceError> {
        DeviceLayer::trim(self, offset, length, fua)
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        DeviceLayer::flush(self)
    }
    fn block_status(&mut self, offset: u64, length: u64) -> Result<Vec<Extent>, DeviceError> {
        DeviceLayer::block_status(self, offset, length)
    }
    fn allocation_depth(&mut self, offset: u64, length: u64) -> Result<Vec<DepthExtent>, DeviceError> {
        DeviceLayer::allocation_depth(self, offset, length)
    }
    fn cache(&mut self, offset: u64, length: u64) -> Result<(), DeviceError> {
        DeviceLayer::cache(self, offset, length)
    }
    fn disconnect(&mut self) {
        DeviceLayer::disconnect(self)
    }
    fn idle(&mut self) {
        DeviceLayer::idle(self)
    }
    fn idle_timed_out(&mut self) {
        DeviceLayer::idle_timed_out(self)
    }
    fn closing(&self) -> bool {
        DeviceLayer::closing(self)
    }
}
