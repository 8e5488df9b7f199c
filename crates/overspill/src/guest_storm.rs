//! `storm --guests qemu`: real QEMU guests boot from an in-process server's exports, all at once
//! or `--boot-interval` apart, log on and work by themselves. Their phases are read off their
//! consoles (the markers `scripts/build-guest-image` puts in the image) and their operations off
//! the engine's counters, sampled at each marker and between them (`overspill_storm::observed`),
//! so the report counts them as it counts synthetic VMs.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use overspill_block::trace::{Record, Trace, TraceHeader, TraceWriter};
use overspill_nbd::client::Endpoint;
use overspill_storm::driver::{RunPlan, Target, VmResult};
use overspill_storm::observed::{self, Observation};

use crate::guests::{nbd_disk, vhost_user_disk, BootOptions, ConsoleLine, Guest, GuestKit};

/// The guests' phases, each begun by `OVERSPILL PHASE <name>` on the console (boot by QEMU's
/// start).
pub const PHASES: [&str; 3] = ["boot", "logon", "steady"];
/// The guest printed this when it booted.
const BOOTED: &str = "OVERSPILL BOOTED";
/// The guest printed this when its workload was done; it powers off next.
const DONE: &str = "OVERSPILL DONE";
/// How often the counters are read between markers.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// How often to look for a connection or an ended overlay, when one is awaited.
const POLL_EVERY: Duration = Duration::from_millis(20);
/// How long an ended guest's overlay may take to go (its last segment written, its trace
/// finished) before its counters are read for the last time anyway.
const OVERLAY_GONE_WITHIN: Duration = Duration::from_secs(10);
/// Memory per guest.
pub const GUEST_MIB: u32 = 256;

/// How a guest reaches its disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GuestFrontend {
    /// QEMU's NBD client, on the server's socket.
    Nbd,
    /// vhost-user-blk: a virtio-blk device the server carries out in the guest's memory.
    VhostUser,
}

impl GuestFrontend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Nbd => "nbd",
            Self::VhostUser => "vhost-user",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Nbd => "NBD (QEMU's client)",
            Self::VhostUser => "vhost-user-blk (memory shared with the server)",
        }
    }
}

/// One configuration's guests.
pub struct GuestStorm<'a> {
    pub kit: &'a GuestKit,
    pub vms: usize,
    pub boot_interval_s: f64,
    /// Seconds of the guests' steady phase.
    pub steady_s: u64,
    /// A guest not done this long after its start is stopped and reported failed.
    pub timeout: Duration,
    pub bucket_s: u64,
    /// Consoles and QEMU's logs go to `dir/vm-N/`.
    pub dir: PathBuf,
    pub disk_bytes: u64,
    /// Where VM `vm-N`'s vhost-user socket is, `vm-N.sock`, if the guests reach their disk
    /// that way; over NBD otherwise.
    pub vhost_user_dir: Option<PathBuf>,
}

pub struct GuestOutcome {
    pub plan: RunPlan,
    pub results: Vec<VmResult>,
    /// Per VM: seconds from QEMU's start to the booted marker, and from the storm's start.
    pub boot_times_s: Vec<Option<f64>>,
    pub booted_at_s: Vec<Option<f64>>,
    pub observations: Vec<Observation>,
}

enum State {
    Waiting,
    Running(Box<Guest>),
    /// Its console closed: QEMU is ending, then the server drops its overlay.
    Closing(Box<Guest>, Instant),
    Ended,
}

struct Vm {
    state: State,
    observation: Option<Observation>,
    boot_s: Option<f64>,
    booted_at_s: Option<f64>,
    done: bool,
    started: Instant,
}

pub fn progress_bar(vms: usize) -> ProgressBar {
    let bar = ProgressBar::new(vms as u64 * 3);
    if let Ok(style) = ProgressStyle::with_template("{prefix:>18} [{bar:40}] {pos}/{len} guest milestones {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Boots the guests, follows them to the end, and counts what they did.
pub fn run(storm: &GuestStorm, target: &dyn Target, progress: &ProgressBar) -> anyhow::Result<GuestOutcome> {
    let start = Instant::now();
    let ms = |at: Instant| at.saturating_duration_since(start).as_millis() as u64;
    let (tx, rx) = mpsc::channel::<ConsoleLine>();
    let mut vms: Vec<Vm> = (0..storm.vms)
        .map(|_| Vm {
            state: State::Waiting,
            observation: None,
            boot_s: None,
            booted_at_s: None,
            done: false,
            started: start,
        })
        .collect();
    let due = |vm: usize| start + Duration::from_secs_f64(storm.boot_interval_s.max(0.0) * vm as f64);
    let mut next_sample = start + SAMPLE_EVERY;
    loop {
        let now = Instant::now();
        for (i, vm) in vms.iter_mut().enumerate() {
            if matches!(vm.state, State::Waiting) && now >= due(i) {
                start_guest(storm, target, i, vm, &tx, ms(Instant::now()));
            }
            advance(storm, target, i, vm, now, start);
        }
        let ended = vms.iter().filter(|vm| matches!(vm.state, State::Ended)).count();
        progress.set_message(phases_text(&vms, ended, start));
        if ended == storm.vms {
            break;
        }
        let awaiting = vms.iter().any(|vm| match &vm.state {
            State::Closing(..) => true,
            State::Running(_) => vm.observation.as_ref().is_some_and(|o| !o.is_connected()),
            _ => false,
        });
        let mut wait = if awaiting { POLL_EVERY } else { SAMPLE_EVERY };
        wait = wait.min(next_sample.saturating_duration_since(Instant::now()));
        if let Some(next) =
            vms.iter().enumerate().find(|(_, vm)| matches!(vm.state, State::Waiting)).map(|(i, _)| due(i))
        {
            wait = wait.min(next.saturating_duration_since(Instant::now()));
        }
        match rx.recv_timeout(wait) {
            Ok(line) => {
                let at_ms = ms(line.at);
                console_line(&mut vms, line, at_ms, start, progress, target);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the guests' console channel closed"),
        }
        // On a clock of its own: guests that talk a lot on their consoles must not hold it up.
        if Instant::now() >= next_sample {
            let at = ms(Instant::now());
            for vm in &mut vms {
                if let (State::Running(_), Some(o)) = (&vm.state, vm.observation.as_mut()) {
                    o.sample(at);
                }
            }
            next_sample = Instant::now() + SAMPLE_EVERY;
        }
    }
    let boot_times_s = vms.iter().map(|vm| vm.boot_s).collect();
    let booted_at_s = vms.iter().map(|vm| vm.booted_at_s).collect();
    let observations: Vec<Observation> =
        vms.into_iter().map(|vm| vm.observation.unwrap_or_else(|| Observation::new(PHASES.len(), 0))).collect();
    let names: Vec<String> = PHASES.map(String::from).to_vec();
    let (plan, results) = observed::results(&names, storm.disk_bytes, &observations, storm.bucket_s);
    Ok(GuestOutcome { plan, results, boot_times_s, booted_at_s, observations })
}

/// One guest's step at `now`: its server connection noticed, a guest past its time killed, a
/// closing one followed until QEMU exited and its overlay is gone.
fn advance(storm: &GuestStorm, target: &dyn Target, i: usize, vm: &mut Vm, now: Instant, start: Instant) {
    let ms = |at: Instant| at.saturating_duration_since(start).as_millis() as u64;
    let Some(observation) = vm.observation.as_mut() else { return };
    if !observation.is_connected() && matches!(vm.state, State::Running(_) | State::Closing(..)) {
        if let Some(stats) = target.stats(i) {
            observation.connected(ms(Instant::now()), stats);
        }
    }
    let timed_out = now.duration_since(vm.started) > storm.timeout;
    match std::mem::replace(&mut vm.state, State::Ended) {
        State::Running(mut guest) if timed_out => {
            guest.kill();
            observation.fail(format!(
                "not done in {:?} (console {}):\n{}",
                storm.timeout,
                guest.console.display(),
                guest.console_tail(20)
            ));
            vm.state = State::Closing(guest, now);
        }
        State::Closing(mut guest, since) => {
            let exited = guest.try_wait().ok().flatten();
            // Only this storm holds the counters once the server has dropped the overlay:
            // its last spill segment is written and its trace finished by then.
            let gone = observation.stats().is_none_or(|s| Arc::strong_count(s) == 1);
            if exited.is_some() && (gone || now.duration_since(since) > OVERLAY_GONE_WITHIN) {
                observation.sample(ms(now));
                if let Some(status) = exited.filter(|s| !s.success()) {
                    observation.fail(format!("QEMU exited with {status}:\n{}", guest.console_tail(20)));
                } else if !vm.done {
                    observation.fail(format!(
                        "powered off before it was done (console {}):\n{}",
                        guest.console.display(),
                        guest.console_tail(20)
                    ));
                }
            } else {
                vm.state = State::Closing(guest, since);
            }
        }
        other => vm.state = other,
    }
}

fn start_guest(
    storm: &GuestStorm,
    target: &dyn Target,
    i: usize,
    vm: &mut Vm,
    tx: &mpsc::Sender<ConsoleLine>,
    at_ms: u64,
) {
    let mut observation = Observation::new(PHASES.len(), at_ms);
    let uri = target.uri(i);
    let socket = match &uri.endpoint {
        Endpoint::Unix(path) => path.clone(),
        Endpoint::Tcp(addr) => {
            observation.fail(format!("guests boot from a Unix socket, not tcp:{addr}"));
            vm.observation = Some(observation);
            vm.state = State::Ended;
            return;
        }
    };
    let options = BootOptions {
        append: format!("overspill.steady={}", storm.steady_s),
        memory_mib: GUEST_MIB,
        lines: Some((i, tx.clone())),
    };
    let dir = storm.dir.join(format!("vm-{i}"));
    let disk = match &storm.vhost_user_dir {
        Some(sockets) => vhost_user_disk(&sockets.join(format!("vm-{i}.sock")), GUEST_MIB),
        None => nbd_disk(&socket, &uri.export, 0),
    };
    match Guest::start(storm.kit, &dir, &disk, options) {
        Ok(guest) => {
            vm.started = guest.started;
            vm.state = State::Running(Box::new(guest));
        }
        Err(e) => {
            observation.fail(format!("{e:#}"));
            vm.state = State::Ended;
        }
    }
    vm.observation = Some(observation);
}

/// Where the guests are, for the progress line: "boot 1, logon 2, steady 0, ended 0 of 3 at
/// 41 s" (a guest not started yet counts in none; the clock is the storm's own).
fn phases_text(vms: &[Vm], ended: usize, start: Instant) -> String {
    let mut in_phase = [0usize; PHASES.len()];
    for vm in vms.iter().filter(|vm| !matches!(vm.state, State::Ended | State::Waiting)) {
        if let Some(observation) = &vm.observation {
            in_phase[observation.phase().min(PHASES.len() - 1)] += 1;
        }
    }
    let phases: Vec<String> = PHASES.iter().zip(in_phase).map(|(name, n)| format!("{name} {n}")).collect();
    format!("{}, ended {ended} of {} at {:.0} s", phases.join(", "), vms.len(), start.elapsed().as_secs_f64())
}

/// A console line: a marker moves the VM on (its counters read at once), the console's end
/// starts its closing.
fn console_line(
    vms: &mut [Vm],
    line: ConsoleLine,
    at_ms: u64,
    start: Instant,
    progress: &ProgressBar,
    target: &dyn Target,
) {
    let Some(vm) = vms.get_mut(line.guest) else { return };
    let Some(observation) = vm.observation.as_mut() else { return };
    let Some(text) = line.line else {
        vm.state = match std::mem::replace(&mut vm.state, State::Ended) {
            State::Running(guest) => State::Closing(guest, line.at),
            other => other,
        };
        return;
    };
    let Some(marker) = text.find("OVERSPILL ").map(|at| text[at..].trim_end()) else { return };
    if marker == BOOTED {
        if vm.boot_s.is_none() {
            vm.boot_s = Some(line.at.saturating_duration_since(vm.started).as_secs_f64());
            vm.booted_at_s = Some(line.at.saturating_duration_since(start).as_secs_f64());
            // Its boot slot (`storm --boot-max`) goes to the next guest.
            target.booted(line.guest);
            progress.inc(1);
        }
    } else if marker == DONE {
        if !vm.done {
            vm.done = true;
            observation.sample(at_ms);
            progress.inc(1);
        }
    } else if let Some(name) = marker.strip_prefix("OVERSPILL PHASE ") {
        if let Some(phase) = PHASES.iter().position(|p| *p == name) {
            if observation.enter(phase, at_ms) && phase + 1 == PHASES.len() {
                progress.inc(1);
            }
        }
    } else if marker == "OVERSPILL ROOT FAILED" {
        observation.fail("the guest could not mount its root filesystem from the NBD disk");
    }
}

/// The server's traces of the VMs (named `vm-N-<connection>.trace` in `staging`) rewritten to
/// `out/vm-N.trace` with the phases the guests went through: times from the storm's start, each
/// request in the phase its VM was in then. The number of traces written.
pub fn phase_traces(staging: &Path, out: &Path, observations: &[Observation]) -> anyhow::Result<usize> {
    let mut written = 0;
    for (vm, observation) in observations.iter().enumerate() {
        let prefix = format!("vm-{vm}-");
        let mut found: Vec<PathBuf> = std::fs::read_dir(staging)
            .with_context(|| format!("reading {}", staging.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.strip_prefix(&prefix)
                        .and_then(|rest| rest.strip_suffix(".trace"))
                        .is_some_and(|number| number.bytes().all(|b| b.is_ascii_digit()))
                })
            })
            .collect();
        found.sort();
        let Some(path) = found.first() else { continue };
        let trace = Trace::read(path).with_context(|| format!("reading {}", path.display()))?;
        // The server's clock for a trace starts with the VM's connection.
        let offset_us = observation.connected_ms().or(observation.phase_start_ms(0)).unwrap_or(0) * 1000;
        let header = TraceHeader {
            disk_bytes: trace.header.disk_bytes,
            vm: format!("vm-{vm}"),
            phases: PHASES.map(String::from).to_vec(),
        };
        let target = out.join(format!("vm-{vm}.trace"));
        let mut writer =
            TraceWriter::create(&target, &header).with_context(|| format!("creating {}", target.display()))?;
        for record in &trace.records {
            let time_us = record.time_us + offset_us;
            let phase = (0..PHASES.len())
                .rev()
                .find(|&p| observation.phase_start_ms(p).is_some_and(|start| start * 1000 <= time_us))
                .unwrap_or(0);
            writer
                .record(&Record { time_us, phase: phase as u16, ..*record })
                .with_context(|| format!("writing {}", target.display()))?;
        }
        writer.finish().with_context(|| format!("writing {}", target.display()))?;
        written += 1;
    }
    Ok(written)
}
