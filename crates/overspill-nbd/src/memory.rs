//! A plain in-memory device and a one-export provider: the protocol's own reference backend, used
//! by its tests, its fuzz targets and anyone who wants an NBD RAM disk.

use std::sync::{Arc, Mutex};

use overspill_block::{
    BlockDevice, Capabilities, DeviceError, DeviceErrorKind, ExportInfo, ExportProvider, ReadRequest,
    DEFAULT_BLOCK_SIZES,
};

const ALL: Capabilities = Capabilities::ALL;

/// A disk held in a byte vector; clones share the bytes (like connections to one nbdkit memory
/// disk).
#[derive(Debug, Clone)]
pub struct MemoryDevice {
    bytes: Arc<Mutex<Vec<u8>>>,
}

impl MemoryDevice {
    pub fn new(size: usize) -> Self {
        Self { bytes: Arc::new(Mutex::new(vec![0; size])) }
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.lock().clone()
    }

    /// The bytes at `offset`, as they are: not a guest's request (a test's reference copy).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        let range = self.range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.lock()[range]);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // A panic while holding the lock cannot leave the bytes half-updated in a way that
        // matters to a test disk, so a poisoned lock is still used.
        self.bytes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, DeviceError> {
        let size = self.lock().len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(DeviceError::new(DeviceErrorKind::Invalid, "out of range")),
        }
    }
}

impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.lock().len() as u64
    }

    fn capabilities(&self) -> Capabilities {
        ALL
    }

    fn read(&mut self, _: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.read_at(offset, buf)
    }

    fn write(&mut self, offset: u64, data: &[u8], _fua: bool) -> Result<(), DeviceError> {
        let range = self.range(offset, data.len() as u64)?;
        self.lock()[range].copy_from_slice(data);
        Ok(())
    }

    fn write_zeroes(&mut self, offset: u64, length: u64, _: bool, _: bool, _: bool) -> Result<(), DeviceError> {
        let range = self.range(offset, length)?;
        self.lock()[range].fill(0);
        Ok(())
    }

    fn trim(&mut self, offset: u64, length: u64, _fua: bool) -> Result<(), DeviceError> {
        self.range(offset, length).map(|_| ())
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// Serves one [`MemoryDevice`] under one name; every connection shares its bytes.
#[derive(Debug, Clone)]
pub struct OneExport {
    name: String,
    device: MemoryDevice,
}

impl OneExport {
    pub fn new(name: &str, size: usize) -> Self {
        Self { name: name.to_owned(), device: MemoryDevice::new(size) }
    }

    pub fn device(&self) -> &MemoryDevice {
        &self.device
    }
}

impl ExportProvider for OneExport {
    fn list(&self) -> Vec<ExportInfo> {
        self.info(&self.name).into_iter().collect()
    }

    fn info(&self, name: &str) -> Option<ExportInfo> {
        (name == self.name).then(|| ExportInfo {
            name: self.name.clone(),
            description: "in-memory disk".into(),
            size: self.device.size(),
            capabilities: ALL,
            block_sizes: DEFAULT_BLOCK_SIZES,
        })
    }

    fn open(&self, name: &str, _identity: Option<&str>) -> Result<Box<dyn BlockDevice>, DeviceError> {
        if name != self.name {
            return Err(DeviceError::new(DeviceErrorKind::Invalid, format!("no export {name:?}")));
        }
        Ok(Box::new(self.device.clone()))
    }
}
