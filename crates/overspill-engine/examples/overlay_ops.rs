//! The cost of one overlay request with nothing around it (no socket, no server): random 4 KiB
//! writes received into the RAM tier, or random 4 KiB reads from it, over 512 MiB already
//! written, on one core. For A/Bs of the engine's own code: build this example at two commits
//! and run them in turn (`taskset -c 0 target/release/examples/overlay_ops write`); the figure
//! moves with memory latency, so compare medians of several runs.

use std::io::IoSliceMut;
use std::sync::Arc;
use std::time::Instant;

use overspill_engine::{HostMemory, MemImage, Overlay, OverlayConfig, VmStats, WriteCacheMode};

const DISK_BYTES: u64 = 1 << 30;
const WORKING_SET_BYTES: u64 = 512 << 20;
const OPS_PER_ROUND: u64 = 2_000_000;
const ROUNDS: usize = 5;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let op = std::env::args().nth(1).unwrap_or_else(|| "write".into());
    if op != "write" && op != "read" {
        return Err(format!("usage: overlay_ops write|read (not {op})").into());
    }
    let golden = Arc::new(MemImage::new(vec![7u8; DISK_BYTES as usize]));
    let config = OverlayConfig { mode: WriteCacheMode::Ram, ram_target_bytes: 1 << 30, spill_max_bytes: None };
    let mut overlay = Overlay::new(golden, config, None, HostMemory::new(16 << 30, 0), Arc::new(VmStats::default()))?;
    let blocks = WORKING_SET_BYTES / 4096;
    let payload = vec![0x5au8; 4096];
    for block in 0..blocks {
        overlay.write(block * 4096, &payload)?;
    }
    // xorshift64*: the same offsets every run.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next_offset = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d) % blocks * 4096
    };
    let mut buf = vec![0u8; 4096];
    for round in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..OPS_PER_ROUND {
            let at = next_offset();
            if op == "write" {
                overlay.write_received(at, 4096, |buffers: &mut [IoSliceMut<'_>]| {
                    let mut from = 0;
                    for buffer in buffers.iter_mut() {
                        let len = buffer.len();
                        buffer.copy_from_slice(&payload[from..from + len]);
                        from += len;
                    }
                    Ok(())
                })?;
            } else {
                overlay.read(at, &mut buf)?;
            }
        }
        let ns = start.elapsed().as_nanos() as f64 / OPS_PER_ROUND as f64;
        println!("{op} round {round}: {ns:.1} ns per request");
    }
    Ok(())
}
