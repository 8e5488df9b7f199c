//! A vhost-user-blk load generator for `bench/run`: the few fio flags its cells use
//! (`--rw`, `--bs`, `--bssplit`, `--rwmixwrite`, `--iodepth`, `--runtime`, `--ramp_time`,
//! `--size`), a client that is not a
//! guest (libblkio's virtio-blk-vhost-user driver, the one QEMU's blkio driver and fio's libblkio
//! engine use), and fio's JSON (the fields `bench/run` reads), so that the bench treats a
//! vhost-user server as it treats an NBD one.
//!
//! Usage: vhost-load --socket=PATH --rw=randread|randwrite|randrw|read|write --bs=4k --iodepth=32
//!                   [--rwmixwrite=70 --bssplit=4k/70:64k/30,4k/100] [--runtime=3] [--ramp_time=1]
//!                   [--size=512m]

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
    /// Percent of requests that are writes: 0, 100, or `--rwmixwrite` for randrw.
    write_pct: u64,
    pattern: Pattern,
    /// Request sizes and their weights in percent, for reads and for writes (fio's `--bssplit`,
    /// or `--bs` alone).
    read_sizes: Vec<(usize, u64)>,
    write_sizes: Vec<(usize, u64)>,
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
        write_pct: 0,
        pattern: Pattern::Random,
        read_sizes: vec![(4096, 100)],
        write_sizes: vec![(4096, 100)],
        iodepth: 1,
        runtime: Duration::from_secs(3),
        ramp: Duration::ZERO,
        size: 512 << 20,
    };
    let mut mix = None;
    for arg in args {
        let (key, value) = arg.split_once('=').ok_or_else(|| format!("expected --key=value: {arg}"))?;
        match key {
            "--socket" => job.socket = value.to_owned(),
            "--rw" => {
                (job.write_pct, job.pattern) = match value {
                    "randread" => (0, Pattern::Random),
                    "randwrite" => (100, Pattern::Random),
                    "randrw" => (50, Pattern::Random),
                    "read" => (0, Pattern::Sequential),
                    "write" => (100, Pattern::Sequential),
                    other => {
                        return Err(format!("--rw={other} is not one of randread, randwrite, randrw, read, write"))
                    }
                }
            }
            "--rwmixwrite" => {
                mix = Some(value.parse::<u64>().ok().filter(|&p| p <= 100).ok_or(format!("--rwmixwrite={value}"))?)
            }
            "--bs" => {
                let bs = bytes(value)? as usize;
                (job.read_sizes, job.write_sizes) = (vec![(bs, 100)], vec![(bs, 100)]);
            }
            "--bssplit" => {
                let (reads, writes) = value.split_once(',').unwrap_or((value, value));
                (job.read_sizes, job.write_sizes) = (split(reads)?, split(writes)?);
            }
            "--iodepth" => job.iodepth = value.parse().map_err(|_| format!("--iodepth={value}"))?,
            "--runtime" => job.runtime = seconds(value)?,
            "--ramp_time" => job.ramp = seconds(value)?,
            "--size" => job.size = bytes(value)?,
            // fio's own switches that bench/run passes to every client: nothing to do.
            "--name"
            | "--time_based"
            | "--group_reporting"
            | "--unified_rw_reporting"
            | "--output-format"
            | "--numjobs" => {}
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if let Some(pct) = mix {
        if job.write_pct != 50 {
            return Err("--rwmixwrite goes with --rw=randrw".into());
        }
        job.write_pct = pct;
    }
    let sizes = job.read_sizes.iter().chain(&job.write_sizes);
    if job.socket.is_empty() || sizes.clone().any(|&(bs, _)| bs == 0) || job.iodepth == 0 {
        return Err("--socket, sizes above 0 and an --iodepth above 0 are needed".into());
    }
    Ok(job)
}

/// fio's `--bssplit` for one direction: `4k/70:64k/30`, weights summing to 100.
fn split(text: &str) -> Result<Vec<(usize, u64)>, String> {
    let sizes = text
        .split(':')
        .map(|part| {
            let (size, weight) = part.split_once('/').unwrap_or((part, "100"));
            Ok((bytes(size)? as usize, weight.parse::<u64>().map_err(|_| format!("--bssplit weight {weight}"))?))
        })
        .collect::<Result<Vec<_>, String>>()?;
    if sizes.iter().map(|&(_, weight)| weight).sum::<u64>() != 100 {
        return Err(format!("--bssplit {text}: the weights do not add up to 100"));
    }
    Ok(sizes)
}

/// What one side (reads or writes) of a run measured.
#[derive(Default)]
struct Side {
    latencies_ns: Vec<u32>,
    bytes: u64,
}

impl Side {
    /// fio's JSON for this side over `elapsed` seconds.
    fn json(&mut self, elapsed: f64) -> String {
        let ios = self.latencies_ns.len() as u64;
        if ios == 0 || elapsed <= 0.0 {
            return r#"{"total_ios":0,"iops":0,"bw":0}"#.to_owned();
        }
        self.latencies_ns.sort_unstable();
        let p99 = self.latencies_ns[(self.latencies_ns.len() * 99 / 100).min(self.latencies_ns.len() - 1)];
        format!(
            r#"{{"total_ios":{ios},"iops":{:.1},"bw":{:.1},"clat_ns":{{"percentile":{{"99.000000":{p99}}}}}}}"#,
            ios as f64 / elapsed,
            self.bytes as f64 / 1024.0 / elapsed
        )
    }
}

/// xorshift64*: offsets spread over the disk, the same run to run.
struct Offsets(u64);

impl Offsets {
    /// A number below `slots`.
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
    let largest = job.read_sizes.iter().chain(&job.write_sizes).map(|&(bs, _)| bs).max().unwrap_or(4096);
    let buffers_len = (job.iodepth * largest).div_ceil(alignment) * alignment;
    let region = blkio.alloc_mem_region(buffers_len).map_err(err("allocating buffers"))?;
    blkio.map_mem_region(&region).map_err(err("mapping buffers"))?;
    let base = region.addr as *mut u8;
    // SAFETY: libblkio allocated `buffers_len` bytes at `region.addr`, mapped and ours until the
    // region is freed when `blkio` is dropped at the end of this function.
    let buffers = unsafe { std::slice::from_raw_parts_mut(base, buffers_len) };
    for (i, byte) in buffers.iter_mut().enumerate() {
        *byte = (i * 131 % 251) as u8;
    }
    let span = job.size.min(capacity);
    let mut random = Offsets(0x9e37_79b9_7f4a_7c15);
    let mut sequential = 0u64;
    // The next request: whether it writes, its size, its offset (a multiple of its size).
    let mut next_request = || {
        let write = job.write_pct == 100 || (job.write_pct > 0 && random.next(100) < job.write_pct);
        let sizes = if write { &job.write_sizes } else { &job.read_sizes };
        let (mut pick, mut bs) = (random.next(100), sizes[0].0);
        for &(size, weight) in sizes {
            if pick < weight {
                bs = size;
                break;
            }
            pick -= weight;
        }
        let slots = (span / bs as u64).max(1);
        let offset = match job.pattern {
            Pattern::Random => random.next(slots) * bs as u64,
            Pattern::Sequential => {
                let at = sequential % span / bs as u64 * bs as u64;
                sequential += bs as u64;
                at
            }
        };
        (write, bs, offset)
    };
    let mut issued: Vec<(Instant, bool, usize)> = vec![(Instant::now(), false, 0); job.iodepth];
    let submit = |queue: &mut blkio::Blkioq, slot: usize, (write, bs, offset): (bool, usize, u64)| {
        // SAFETY: each slot's buffer is its own `largest` bytes of the mapped region, and a slot
        // is submitted again only once its last request completed.
        let buf = unsafe { base.add(slot * largest) };
        if write {
            queue.write(offset, buf, bs, slot, ReqFlags::empty());
        } else {
            queue.read(offset, buf, bs, slot, ReqFlags::empty());
        }
        (Instant::now(), write, bs)
    };
    let begin = Instant::now();
    let measure_from = begin + job.ramp;
    let end = measure_from + job.runtime;
    for (slot, issue) in issued.iter_mut().enumerate() {
        let request = next_request();
        *issue = submit(&mut queue, slot, request);
    }
    let mut completions: Vec<MaybeUninit<Completion>> = (0..job.iodepth).map(|_| MaybeUninit::uninit()).collect();
    let (mut reads, mut writes, mut mixed) = (Side::default(), Side::default(), Side::default());
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
            let (at, write, bs) = issued[slot];
            if now >= measure_from {
                measured_start.get_or_insert(now);
                let latency = now.duration_since(at).as_nanos().min(u128::from(u32::MAX)) as u32;
                for side in [if write { &mut writes } else { &mut reads }, &mut mixed] {
                    side.latencies_ns.push(latency);
                    side.bytes += bs as u64;
                }
            }
            if now < end {
                let request = next_request();
                issued[slot] = submit(&mut queue, slot, request);
            } else {
                in_flight -= 1;
            }
        }
    }
    let elapsed = measured_start.map_or(Duration::ZERO, |start| Instant::now().duration_since(start)).as_secs_f64();
    Ok(format!(
        r#"{{"jobs":[{{"read":{},"write":{},"mixed":{}}}]}}"#,
        reads.json(elapsed),
        writes.json(elapsed),
        mixed.json(elapsed)
    ))
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
