//! A vhost-user-blk load generator for `bench/run`: the few fio flags its cells use
//! (`--rw`, `--bs`, `--iodepth`, `--runtime`, `--ramp_time`, `--size`), a client that is not a
//! guest (libblkio's virtio-blk-vhost-user driver, the one QEMU's blkio driver and fio's libblkio
//! engine use), and fio's JSON (the fields `bench/run` reads), so that the bench treats a
//! vhost-user server as it treats an NBD one.
//!
//! Usage: vhost-load --socket=PATH --rw=randread|randwrite|read|write --bs=4k --iodepth=32
//!                   [--runtime=3] [--ramp_time=1] [--size=512m]

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Completion, ReqFlags};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pattern {
    Random,
    Sequential,
}

struct Job {
    socket: String,
    write: bool,
    pattern: Pattern,
    bs: usize,
    iodepth: usize,
    runtime: Duration,
    ramp: Duration,
    size: u64,
}

fn bytes(text: &str) -> Result<u64, String> {
    let text = text.to_ascii_lowercase();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text.as_str(), ""),
    };
    let n: u64 = digits.parse().map_err(|_| format!("not a size: {text}"))?;
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        _ => return Err(format!("not a size: {text}")),
    };
    Ok(n << shift)
}

fn seconds(text: &str) -> Result<Duration, String> {
    text.trim_end_matches('s').parse::<f64>().map(Duration::from_secs_f64).map_err(|_| format!("not seconds: {text}"))
}

fn parse(args: impl Iterator<Item = String>) -> Result<Job, String> {
    let mut job = Job {
        socket: String::new(),
        write: false,
        pattern: Pattern::Random,
        bs: 4096,
        iodepth: 1,
        runtime: Duration::from_secs(3),
        ramp: Duration::ZERO,
        size: 512 << 20,
    };
    for arg in args {
        let (key, value) = arg.split_once('=').ok_or_else(|| format!("expected --key=value: {arg}"))?;
        match key {
            "--socket" => job.socket = value.to_owned(),
            "--rw" => {
                (job.write, job.pattern) = match value {
                    "randread" => (false, Pattern::Random),
                    "randwrite" => (true, Pattern::Random),
                    "read" => (false, Pattern::Sequential),
                    "write" => (true, Pattern::Sequential),
                    other => return Err(format!("--rw={other} is not one of randread, randwrite, read, write")),
                }
            }
            "--bs" => job.bs = bytes(value)? as usize,
            "--iodepth" => job.iodepth = value.parse().map_err(|_| format!("--iodepth={value}"))?,
            "--runtime" => job.runtime = seconds(value)?,
            "--ramp_time" => job.ramp = seconds(value)?,
            "--size" => job.size = bytes(value)?,
            // fio's own switches that bench/run passes to every client: nothing to do.
            "--name" | "--time_based" | "--group_reporting" | "--unified_rw_reporting" | "--output-format"
            | "--numjobs" => {}
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if job.socket.is_empty() || job.bs == 0 || job.iodepth == 0 {
        return Err("--socket, a --bs above 0 and an --iodepth above 0 are needed".into());
    }
    Ok(job)
}

/// xorshift64*: offsets spread over the disk, the same run to run.
struct Offsets(u64);

impl Offsets {
    fn next(&mut self, slots: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % slots
    }
}

fn run(job: &Job) -> Result<String, String> {
    fn err(what: &'static str) -> impl Fn(blkio::Error) -> String {
        move |e| format!("{what}: {}", e.message())
    }
    let mut blkio = Blkio::new("virtio-blk-vhost-user").map_err(err("libblkio"))?;
    blkio.set_str("path", &job.socket).map_err(err("path"))?;
    blkio.connect().map_err(err("connecting"))?;
    blkio.set_i32("num-queues", 1).map_err(err("num-queues"))?;
    let mut started = blkio.start().map_err(err("starting"))?;
    let mut queue = started.queues.pop().ok_or("no queue")?;
    let capacity = blkio.get_u64("capacity").map_err(err("capacity"))?;
    let alignment = blkio.get_u64("mem-region-alignment").map_err(err("mem-region-alignment"))?.max(1) as usize;
    let buffers_len = (job.iodepth * job.bs).div_ceil(alignment) * alignment;
    let region = blkio.alloc_mem_region(buffers_len).map_err(err("allocating buffers"))?;
    blkio.map_mem_region(&region).map_err(err("mapping buffers"))?;
    let base = region.addr as *mut u8;
    // SAFETY: libblkio allocated `buffers_len` bytes at `region.addr`, mapped and ours until the
    // region is freed when `blkio` is dropped at the end of this function.
    let buffers = unsafe { std::slice::from_raw_parts_mut(base, buffers_len) };
    for (i, byte) in buffers.iter_mut().enumerate() {
        *byte = (i * 131 % 251) as u8;
    }
    let slots = (job.size.min(capacity) / job.bs as u64).max(1);
    let mut offsets = Offsets(0x9e37_79b9_7f4a_7c15);
    let mut sequential = 0u64;
    let mut next_offset = |pattern: Pattern| match pattern {
        Pattern::Random => offsets.next(slots) * job.bs as u64,
        Pattern::Sequential => {
            let at = sequential % slots * job.bs as u64;
            sequential += 1;
            at
        }
    };
    let mut issued_at = vec![Instant::now(); job.iodepth];
    let submit = |queue: &mut blkio::Blkioq, slot: usize, offset: u64| {
        // SAFETY: each slot's buffer is its own `bs` bytes of the mapped region, and a slot is
        // submitted again only once its last request completed.
        let buf = unsafe { base.add(slot * job.bs) };
        if job.write {
            queue.write(offset, buf, job.bs, slot, ReqFlags::empty());
        } else {
            queue.read(offset, buf, job.bs, slot, ReqFlags::empty());
        }
    };
    let begin = Instant::now();
    let measure_from = begin + job.ramp;
    let end = measure_from + job.runtime;
    for (slot, at) in issued_at.iter_mut().enumerate() {
        *at = Instant::now();
        submit(&mut queue, slot, next_offset(job.pattern));
    }
    let mut completions: Vec<MaybeUninit<Completion>> = (0..job.iodepth).map(|_| MaybeUninit::uninit()).collect();
    let mut latencies_ns: Vec<u32> = Vec::with_capacity(1 << 20);
    let mut in_flight = job.iodepth;
    let mut measured_start = None;
    while in_flight > 0 {
        let done = queue.do_io(&mut completions, 1, None, None).map_err(err("do_io"))?;
        let now = Instant::now();
        for completion in &completions[..done] {
            // SAFETY: do_io initialised the first `done` completions.
            let completion = unsafe { completion.assume_init_ref() };
            if completion.ret != 0 {
                return Err(format!("a request failed: {}", completion.ret));
            }
            let slot = completion.user_data;
            if now >= measure_from {
                measured_start.get_or_insert(now);
                latencies_ns.push(now.duration_since(issued_at[slot]).as_nanos().min(u128::from(u32::MAX)) as u32);
            }
            if now < end {
                issued_at[slot] = now;
                submit(&mut queue, slot, next_offset(job.pattern));
            } else {
                in_flight -= 1;
            }
        }
    }
    let elapsed = measured_start.map_or(Duration::ZERO, |start| Instant::now().duration_since(start)).as_secs_f64();
    let ios = latencies_ns.len() as u64;
    latencies_ns.sort_unstable();
    let p99 = latencies_ns.get((latencies_ns.len() * 99 / 100).min(latencies_ns.len().saturating_sub(1))).copied();
    let iops = if elapsed > 0.0 { ios as f64 / elapsed } else { 0.0 };
    let side = |active: bool| {
        if !active {
            return r#"{"total_ios":0,"iops":0,"bw":0}"#.to_owned();
        }
        format!(
            r#"{{"total_ios":{ios},"iops":{iops:.1},"bw":{bw:.1},"clat_ns":{{"percentile":{{"99.000000":{p99}}}}}}}"#,
            bw = iops * job.bs as f64 / 1024.0,
            p99 = p99.unwrap_or(0)
        )
    };
    Ok(format!(r#"{{"jobs":[{{"read":{},"write":{}}}]}}"#, side(!job.write), side(job.write)))
}

fn main() {
    let result = parse(std::env::args().skip(1)).and_then(|job| run(&job));
    match result {
        Ok(json) => println!("{json}"),
        Err(message) => {
            eprintln!("vhost-load: {message}");
            std::process::exit(1);
        }
    }
}
