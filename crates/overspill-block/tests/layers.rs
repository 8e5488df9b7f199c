//! The layers a device wears: each passes every call on (a layer that forgot one would silently
//! drop a device's fast path or its lifecycle), and does its own part alone.

use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use overspill_block::trace::Trace;
use overspill_block::{
    read_whole, BlockDevice, Capabilities, DepthExtent, DeviceError, Extent, GuestOp, Latencies, Payload, ReadRequest,
    Recorded, Recorder, SlicesPayload, Timed,
};

/// A disk in memory that notes every call it gets.
#[derive(Default)]
struct Probe {
    bytes: Vec<u8>,
    calls: Arc<Mutex<Vec<&'static str>>>,
}

impl Probe {
    fn new(size: usize) -> (Self, Arc<Mutex<Vec<&'static str>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        (Self { bytes: vec![0; size], calls: calls.clone() }, calls)
    }
    fn note(&self, call: &'static str) {
        self.calls.lock().expect("calls").push(call);
    }
}

impl BlockDevice for Probe {
    fn size(&self) -> u64 {
        self.note("size");
        self.bytes.len() as u64
    }
    fn capabilities(&self) -> Capabilities {
        self.note("capabilities");
        Capabilities::ALL
    }
    fn read_requested(&mut self, _: u64, _: u64) {
        self.note("read_requested");
    }
    fn read(&mut self, _: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.note("read");
        buf.copy_from_slice(&self.bytes[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn read_vectored(&mut self, _: &ReadRequest, _: u64, _: &mut [IoSliceMut<'_>]) -> Result<(), DeviceError> {
        self.note("read_vectored");
        Ok(())
    }
    fn read_sent_as_zeroes(&mut self, _: &ReadRequest, _: u64, _: u64) {
        self.note("read_sent_as_zeroes");
    }
    fn read_shared(&mut self, _: &ReadRequest, _: u64, length: usize) -> Result<Vec<Bytes>, DeviceError> {
        self.note("read_shared");
        Ok(vec![Bytes::from(vec![0; length])])
    }
    fn write(&mut self, offset: u64, data: &[u8], _: bool) -> Result<(), DeviceError> {
        self.note("write");
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn write_from(
        &mut self,
        offset: u64,
        length: usize,
        _: bool,
        payload: &mut dyn Payload,
    ) -> Result<(), DeviceError> {
        self.note("write_from");
        let at = offset as usize;
        payload
            .receive(&mut [IoSliceMut::new(&mut self.bytes[at..at + length])])
            .map_err(|e| DeviceError::new(overspill_block::DeviceErrorKind::Io, e.to_string()))
    }
    fn write_vectored(&mut self, _: u64, _: &[IoSlice<'_>], _: bool) -> Result<(), DeviceError> {
        self.note("write_vectored");
        Ok(())
    }
    fn write_zeroes(&mut self, _: u64, _: u64, _: bool, _: bool, _: bool) -> Result<(), DeviceError> {
        self.note("write_zeroes");
        Ok(())
    }
    fn trim(&mut self, _: u64, _: u64, _: bool) -> Result<(), DeviceError> {
        self.note("trim");
        Ok(())
    }
    fn flush(&mut self) -> Result<(), DeviceError> {
        self.note("flush");
        Ok(())
    }
    fn block_status(&mut self, _: u64, length: u64) -> Result<Vec<Extent>, DeviceError> {
        self.note("block_status");
        Ok(vec![Extent { length, hole: false, zero: false }])
    }
    fn allocation_depth(&mut self, _: u64, length: u64) -> Result<Vec<DepthExtent>, DeviceError> {
        self.note("allocation_depth");
        Ok(vec![DepthExtent { length, depth: 2 }])
    }
    fn cache(&mut self, _: u64, _: u64) -> Result<(), DeviceError> {
        self.note("cache");
        Ok(())
    }
    fn disconnect(&mut self) {
        self.note("disconnect");
    }
    fn idle(&mut self) {
        self.note("idle");
    }
    fn idle_timed_out(&mut self) {
        self.note("idle_timed_out");
    }
    fn closing(&self) -> bool {
        self.note("closing");
        false
    }
}

const EVERY_CALL: [&str; 20] = [
    "size",
    "capabilities",
    "read_requested",
    "read",
    "read_vectored",
    "read_sent_as_zeroes",
    "read_shared",
    "write",
    "write_from",
    "write_vectored",
    "write_zeroes",
    "trim",
    "flush",
    "block_status",
    "allocation_depth",
    "cache",
    "disconnect",
    "idle",
    "idle_timed_out",
    "closing",
];

/// Calls every method of the trait once.
fn call_everything(device: &mut dyn BlockDevice) {
    device.size();
    device.capabilities();
    let request = ReadRequest::begin(device, 0, 8192);
    device.read(&request, 0, &mut [0; 512]).expect("read");
    device.read_vectored(&request, 512, &mut [IoSliceMut::new(&mut [0; 512])]).expect("read_vectored");
    device.read_sent_as_zeroes(&request, 1024, 4096);
    device.read_shared(&request, 5120, 3072).expect("read_shared");
    device.write(0, &[1; 512], false).expect("write");
    let data = [2u8; 512];
    device.write_from(512, 512, false, &mut SlicesPayload::new(&[IoSlice::new(&data)])).expect("write_from");
    device.write_vectored(1024, &[IoSlice::new(&data)], false).expect("write_vectored");
    device.write_zeroes(0, 4096, true, false, false).expect("write_zeroes");
    device.trim(0, 4096, false).expect("trim");
    device.flush().expect("flush");
    device.block_status(0, 4096).expect("block_status");
    device.allocation_depth(0, 4096).expect("allocation_depth");
    device.cache(0, 4096).expect("cache");
    device.disconnect();
    device.idle();
    device.idle_timed_out();
    device.closing();
}

#[derive(Default)]
struct Samples(Mutex<Vec<(GuestOp, Duration)>>);

impl Latencies for Samples {
    fn record(&self, op: GuestOp, spent: Duration) {
        self.0.lock().expect("samples").push((op, spent));
    }
}

#[test]
fn every_layer_passes_every_call_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let recorder = Recorder::create(dir.path(), "vm", 1, 1 << 20).expect("recorder");
    let (probe, calls) = Probe::new(1 << 20);
    let mut timed = Timed::new(probe, Arc::new(Samples::default()));
    call_everything(&mut timed);
    let (probe, recorded_calls) = Probe::new(1 << 20);
    let mut recorded = Recorded::new(probe, Some(recorder));
    call_everything(&mut recorded);
    for calls in [calls, recorded_calls] {
        let seen = calls.lock().expect("calls").clone();
        for call in EVERY_CALL {
            assert!(seen.contains(&call), "{call} did not reach the device: {seen:?}");
        }
    }
}

#[test]
fn a_recorded_read_is_one_record_however_it_is_answered_and_an_unarrived_write_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let recorder = Recorder::create(dir.path(), "desk/1", 7, 1 << 20).expect("recorder");
    let (probe, _) = Probe::new(1 << 20);
    let mut device = Recorded::new(probe, Some(recorder.clone()));
    let request = ReadRequest::begin(&mut device, 4096, 8192);
    device.read(&request, 4096, &mut [0; 4096]).expect("first part");
    device.read_sent_as_zeroes(&request, 8192, 4096);
    device.write(0, &[1; 512], false).expect("write");
    struct Gone;
    impl Payload for Gone {
        fn receive(&mut self, _: &mut [IoSliceMut<'_>]) -> std::io::Result<()> {
            Err(std::io::ErrorKind::UnexpectedEof.into())
        }
    }
    assert!(device.write_from(4096, 512, false, &mut Gone).is_err());
    device.trim(8192, 4096, false).expect("trim");
    drop(device);
    drop(recorder);
    let trace = Trace::read(&dir.path().join("desk_1-7.trace")).expect("the trace, under a safe name");
    let kinds: Vec<(GuestOp, u64, u32)> = trace.records.iter().map(|r| (r.kind, r.offset, r.length)).collect();
    assert_eq!(kinds, vec![(GuestOp::Read, 4096, 8192), (GuestOp::Write, 0, 512), (GuestOp::Trim, 8192, 4096)]);
    assert_eq!(trace.header.vm, "desk/1");
}

#[test]
fn a_read_in_parts_is_one_sample_and_a_slow_clients_data_is_not_the_devices_time() {
    let samples = Arc::new(Samples::default());
    let (probe, _) = Probe::new(1 << 20);
    let mut device = Timed::new(probe, samples.clone());
    let request = ReadRequest::begin(&mut device, 0, 12288);
    device.read(&request, 0, &mut [0; 4096]).expect("read");
    assert!(samples.0.lock().expect("samples").is_empty(), "no sample before the last part");
    device.read_sent_as_zeroes(&request, 4096, 4096);
    device.read_shared(&request, 8192, 4096).expect("read_shared");
    // The client takes 200 ms to send the data; the device takes microseconds.
    struct Slow<'a>(SlicesPayload<'a>);
    impl Payload for Slow<'_> {
        fn receive(&mut self, buffers: &mut [IoSliceMut<'_>]) -> std::io::Result<()> {
            std::thread::sleep(Duration::from_millis(200));
            self.0.receive(buffers)
        }
    }
    let data = [3u8; 4096];
    let slices = [IoSlice::new(&data)];
    device.write_from(0, 4096, false, &mut Slow(SlicesPayload::new(&slices))).expect("write_from");
    let samples = samples.0.lock().expect("samples").clone();
    let ops: Vec<GuestOp> = samples.iter().map(|(op, _)| *op).collect();
    assert_eq!(ops, vec![GuestOp::Read, GuestOp::Write]);
    assert!(samples[1].1 < Duration::from_millis(200), "the client's 200 ms counted: {:?}", samples[1].1);
}

#[test]
fn vectored_writes_and_reads_by_default_land_where_one_buffer_would() {
    /// A device that implements only the required methods.
    struct Plain(Vec<u8>);
    impl BlockDevice for Plain {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::ALL
        }
        fn read(&mut self, _: &ReadRequest, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
            buf.copy_from_slice(&self.0[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write(&mut self, offset: u64, data: &[u8], _: bool) -> Result<(), DeviceError> {
            self.0[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
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
    let mut device = Plain(vec![0; 64]);
    let (a, b, c) = ([1u8; 3], [2u8; 10], [3u8; 5]);
    device.write_vectored(7, &[IoSlice::new(&a), IoSlice::new(&b), IoSlice::new(&c)], false).expect("write");
    let mut expected = vec![0u8; 64];
    expected[7..10].fill(1);
    expected[10..20].fill(2);
    expected[20..25].fill(3);
    assert_eq!(device.0, expected);
    let (mut x, mut y) = ([0u8; 6], [0u8; 14]);
    let request = ReadRequest::begin(&mut device, 5, 20);
    device.read_vectored(&request, 5, &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)]).expect("read");
    assert_eq!([&x[..], &y[..]].concat(), expected[5..25]);
    let mut whole = [0u8; 18];
    read_whole(&mut device, 7, &mut whole).expect("read_whole");
    assert_eq!(whole[..], expected[7..25]);
}
