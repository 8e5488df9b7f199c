//! What the tests of this crate share: a disk in memory.

use overspill_block::{BlockDevice, Capabilities, DeviceError, ReadRequest};

/// A disk in memory that says what it was asked.
pub(crate) struct Disk {
    pub(crate) bytes: Vec<u8>,
    pub(crate) calls: Vec<String>,
    /// Run before each write (a slow disk, a look at what the guest was told meanwhile).
    pub(crate) before_write: Option<Box<dyn FnMut() + Send>>,
}

impl BlockDevice for Disk {
    fn size(&self) -> u64 {
        self.bytes.len() as u64
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }
    fn read_requested(&mut self, offset: u64, length: u64) {
        self.calls.push(format!("begin {offset} {length}"));
    }
    fn read(&mut self, _request: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        buf.copy_from_slice(&self.bytes[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        if let Some(before_write) = self.before_write.as_mut() {
            before_write();
        }
        self.calls.push(format!("write {offset} {} fua={fua}", data.len()));
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn write_zeroes(
        &mut self,
        offset: u64,
        length: u64,
        may_trim: bool,
        _fast_only: bool,
        _fua: bool,
    ) -> Result<(), DeviceError> {
        self.calls.push(format!("zero {offset} {length} trim={may_trim}"));
        self.bytes[offset as usize..(offset + length) as usize].fill(0);
        Ok(())
    }
    fn trim(&mut self, offset: u64, length: u64, _fua: bool) -> Result<(), DeviceError> {
        self.calls.push(format!("trim {offset} {length}"));
        Ok(())
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.calls.push("flush".into());
        Ok(())
    }
}

impl Disk {
    /// `size` bytes of a pattern, so that reads show where they came from.
    pub(crate) fn new(size: usize) -> Self {
        Self { bytes: (0..size).map(|i| (i % 251) as u8).collect(), calls: Vec::new(), before_write: None }
    }
}
