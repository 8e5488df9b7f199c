//! A VM's overlay with what goes with it (its name, its trace), as the registry keeps it between
//! connections and a connection's device serves it.

use std::sync::{Arc, Mutex};

use overspill_block::Recorder;
use overspill_engine::Overlay;

/// A VM's overlay and what goes with it; it outlives the connection while the VM is in grace.
pub struct VmOverlay {
    pub(crate) overlay: Overlay,
    pub(crate) vm: String,
    pub(crate) recorder: Option<Arc<Mutex<Recorder>>>,
    /// Its state waits for the next server (see [`Self::hand_over`]).
    pub(crate) handed_over: bool,
}

impl VmOverlay {
    /// The overlay's files are left alone when this is dropped (they may have been removed by
    /// name already).
    pub fn keep_state(&mut self) {
        self.overlay.keep_state();
    }

    /// The server stops and the VM lives on: its state stays for the next server.
    pub fn hand_over(&mut self) {
        self.overlay.keep_state();
        self.handed_over = true;
    }
}

impl Drop for VmOverlay {
    fn drop(&mut self) {
        // Finished before the overlay's counters are let go: a storm that sees the counters free
        // takes the VM for gone and reads its trace.
        if let Some(recorder) = &self.recorder {
            recorder.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).finish();
        }
        let s = self.overlay.stats();
        tracing::info!(
            vm = %self.vm,
            guest_reads = s.guest_read.ops.get(),
            guest_writes = s.guest_write.ops.get(),
            golden_reads = s.golden_read.ops.get(),
            spill_segments = s.spill_segments_written.get(),
            spill_write_ops = s.spill_write.ops.get(),
            spill_write_bytes = s.spill_write.bytes.get(),
            cache_memory_peak_bytes = s.cache_memory_peak_bytes.get(),
            cache_disk_peak_bytes = s.cache_disk_peak_bytes.get(),
            "{}",
            if self.handed_over {
                "VM overlay closed; its state waits for the next server"
            } else {
                "VM disconnected; its cache is dropped"
            }
        );
    }
}
