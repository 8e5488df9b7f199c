//! `overspill storm`: runs a workload's phases on many VMs against an in-process server for each
//! write-cache configuration (or against outside NBD servers), or boots real guests from them
//! (`--guests qemu`, [`crate::guest_storm`]), and prints the seeds' tables.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use overspill_engine::{GoldenImage, HostMemory, VmStats, WriteCacheMode};
use overspill_images::open_image;
use overspill_nbd::client::{Endpoint, NbdUri};
use overspill_nbd::server::ShutdownHandle;
use overspill_nbd::{Server, ServerConfig};
use overspill_net::{ListenAddr, Listener, SocketAccess};
use overspill_storm::driver::{self, RemoteTarget, RunPlan, StormConfig, Target};
use overspill_storm::report::{self, StormReport};
use overspill_storm::Workload;

use crate::guest_storm::{self, GuestFrontend, GuestStorm};
use crate::guests::{self, Flavour, GuestKit, Kernel};
use crate::size::{format_bytes, parse_bytes};
use overspill_server::boot_pacing::PacingSettings;
use overspill_server::exports::{CacheSettings, OverlayExports, DEFAULT_SPILL_WRITERS};
use overspill_server::vms::VmRegistry;
use overspill_vhost::{VhostExport, VhostExports, VhostSettings};

#[derive(Debug, Args)]
pub struct StormArgs {
    /// Built-in workload: win7-vdi, win7-vdi-bloated-profile, xenapp-rds, linux-boot.
    #[arg(long, default_value = "win7-vdi")]
    workload: String,
    /// A workload file (TOML, as in crates/overspill-storm/workloads) instead of a built-in one.
    #[arg(long)]
    workload_file: Option<PathBuf>,
    /// VMs per configuration: 20 synthetic ones by default, 3 real guests with `--guests`.
    #[arg(long)]
    vms: Option<usize>,
    /// Write-cache modes to compare, side by side.
    #[arg(long, value_delimiter = ',', default_value = "shared,disk,ram,ram+disk")]
    modes: Vec<WriteCacheMode>,
    /// Cache memory per VM for modes ram and ram+disk; several sizes run one configuration each.
    #[arg(long, value_delimiter = ',', default_value = "32M,256M", value_parser = parse_bytes)]
    ram: Vec<u64>,
    /// Shared read cache in front of the golden image, as `serve --read-cache`; 0 turns it off.
    /// Mode `shared` never has one: it stands for MCS, whose VMs read the golden image from
    /// shared storage (the seeds' MCS figures include those reads).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    read_cache: u64,
    /// Seconds between VM boots (0: all at once, a boot storm).
    #[arg(long, default_value_t = 0.0, value_parser = parse_interval)]
    boot_interval: f64,
    /// Seconds between logons (the seeds used 8 to 30).
    #[arg(long, default_value_t = 15.0, value_parser = parse_interval)]
    logon_interval: f64,
    /// Pace requests at this many times real time; without it they run back to back.
    #[arg(long, value_parser = parse_speed)]
    speed: Option<f64>,
    /// Run against these NBD servers (nbd://…, nbd+unix://…) instead of in-process ones. `{n}`
    /// in the export name becomes each VM's number, so that each is a named VM of an overspill
    /// server (`nbd+unix:///@storm-{n}?socket=…`; without a name it serves VMs read-only).
    #[arg(long)]
    target: Vec<String>,
    /// Golden image to serve; by default a synthetic one is made in --work-dir. With `--guests`,
    /// the root filesystem they boot (by default built by scripts/build-guest-image and kept in
    /// `$XDG_CACHE_HOME/overspill`).
    #[arg(long)]
    golden: Option<PathBuf>,
    /// Boot real guests instead of synthetic VMs: QEMU (TCG) VMs that boot Debian's cloud kernel
    /// with their root filesystem on the in-process server's NBD export, log on (a user profile
    /// of about 5 MiB) and work (`--guest-steady` seconds), all at once or `--boot-interval` apart.
    #[arg(long, value_enum)]
    guests: Option<GuestKind>,
    /// How the guests reach their disk: nbd, vhost-user (virtio-blk over vhost-user-blk, the
    /// guest's memory shared with the server), or both, comma-separated: each configuration then
    /// runs once per frontend, side by side in the report.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "nbd")]
    frontend: Vec<GuestFrontend>,
    /// The guests' root filesystem: a Debian minbase with systemd, or busybox alone (faster to
    /// boot, fewer reads).
    #[arg(long, value_enum, default_value = "systemd")]
    guest_os: Flavour,
    /// Seconds of the guests' steady phase.
    #[arg(long, default_value_t = 30)]
    guest_steady: u64,
    /// A guest not done this many seconds after its start is stopped and reported failed.
    #[arg(long, default_value_t = 1800)]
    guest_timeout: u64,
    /// Scratch space: synthetic golden image, sockets, cache files.
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Record every VM's requests to DIR/vm-N.trace (for `overspill replay` and `overspill plan`).
    #[arg(long, value_name = "DIR")]
    record: Option<PathBuf>,
    /// Where report.json and report.html go.
    #[arg(long, default_value = "overspill-storm-report")]
    out: PathBuf,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Width of the IOPS-over-time buckets, in profile seconds (default 10; 2 for guests).
    #[arg(long)]
    bucket: Option<u64>,
    /// Also run each in-process configuration with at most N VMs booting at once (`serve
    /// --boot-max N`, a VM booting until its workload's first phase is done): the report's
    /// boot curve shows both, side by side.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    boot_max: Option<u64>,
    /// The fairness run: each in-process configuration runs again with K more VMs (`copy-N`)
    /// beside the storm, each copying its golden image to its own disk 1 MiB at a time, back
    /// to back, for as long as the storm runs; the report gives the booting VMs' boot times and
    /// read latency beside what the copiers moved.
    #[arg(long, value_name = "K", default_value_t = 0)]
    copiers: usize,
    /// With --copiers, a further run with each copier limited to this (`vm limit --bandwidth`):
    /// `20M` or `20M:40M`.
    #[arg(long, value_name = "SIZE[:BURST]", requires = "copiers", value_parser = crate::size::parse_bytes_rate)]
    copier_limit: Option<overspill_block::Rate>,
}

/// VMs copying beside a configuration's storm (`--copiers`), each within `limit` if any.
#[derive(Debug, Clone, Copy)]
struct Copying {
    vms: usize,
    limit: Option<overspill_block::Rate>,
}

/// What `--guests` boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GuestKind {
    Qemu,
}

/// One configuration to run: an in-process server with a mode and RAM size, or an outside URI.
enum Run {
    /// `boot_max`: the server's cap on VMs booting at once; `copying`: VMs copying beside.
    Local {
        mode: WriteCacheMode,
        ram: u64,
        boot_max: Option<usize>,
        copying: Option<Copying>,
    },
    Remote(NbdUri),
}

impl Run {
    fn label(&self) -> String {
        let short = |bytes: u64| format_bytes(bytes).replace(".0 ", "").replace("iB", "");
        let beside = |mut label: String, boot_max: &Option<usize>, copying: &Option<Copying>| {
            if let Some(max) = boot_max {
                label = format!("{label}, boot-max {max}");
            }
            match copying {
                Some(Copying { vms, limit: Some(rate) }) => {
                    format!("{label}, {vms} copying at {}/s", short(rate.per_second))
                }
                Some(Copying { vms, limit: None }) => format!("{label}, {vms} copying"),
                None => label,
            }
        };
        match self {
            Run::Local { mode: mode @ (WriteCacheMode::Ram | WriteCacheMode::RamDisk), ram, boot_max, copying } => {
                beside(format!("{mode} {}", short(*ram)), boot_max, copying)
            }
            Run::Local { mode, boot_max, copying, .. } => beside(mode.to_string(), boot_max, copying),
            Run::Remote(uri) => match &uri.endpoint {
                Endpoint::Unix(path) => format!("unix:{}", path.display()),
                Endpoint::Tcp(addr) => format!("tcp:{addr}"),
            },
        }
    }
}

impl Run {
    /// An in-process server's mode, RAM size and read cache (`--read-cache`, none in mode
    /// shared) in its report.
    fn describe(&self, report: &mut report::ConfigReport, read_cache: u64) {
        if let Run::Local { mode, ram, .. } = self {
            report.mode = Some(mode.to_string());
            report.ram_bytes = matches!(mode, WriteCacheMode::Ram | WriteCacheMode::RamDisk).then_some(*ram);
            report.read_cache_bytes = Some(if *mode == WriteCacheMode::Shared { 0 } else { read_cache });
        }
    }
}

/// A pace (`--speed`): a finite number above 0 (at 0 the profile's clock was divided by
/// nothing, and every VM's thread panicked).
pub(crate) fn parse_speed(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(speed) if speed.is_finite() && speed > 0.0 => Ok(speed),
        _ => Err(format!("{s:?} is no speed: a number above 0, such as 1 or 0.5")),
    }
}

/// Seconds between events: a finite number, 0 or more.
fn parse_interval(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds >= 0.0 => Ok(seconds),
        _ => Err(format!("{s:?} is no interval: a number of seconds, 0 or more")),
    }
}

struct LocalTarget {
    socket: PathBuf,
    registry: Arc<VmRegistry>,
    /// Not `shared` (MCS): the guests' event logs go to a disk of their own, as PVS's do.
    event_logs_apart: bool,
    /// The VMs' vhost-user sockets, when the guests reach their disk that way (removed with it).
    _vhost: Option<VhostExports>,
    /// The configuration's server, stopped with it: left running, each configuration kept its
    /// accept loop and its overlays' exports, read cache included, until the storm ended.
    stop: ShutdownHandle,
    serving: Option<std::thread::JoinHandle<()>>,
}

impl Drop for LocalTarget {
    /// The server and its socket go with the configuration: a storm left one behind for each.
    fn drop(&mut self) {
        self.stop.shutdown();
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Target for LocalTarget {
    fn uri(&self, vm: usize) -> NbdUri {
        NbdUri { endpoint: Endpoint::Unix(self.socket.clone()), export: format!("@vm-{vm}") }
    }

    fn booted(&self, vm: usize) {
        self.registry.boots().booted(&format!("vm-{vm}"));
    }

    fn stats(&self, vm: usize) -> Option<Arc<VmStats>> {
        let name = format!("vm-{vm}");
        self.registry.snapshot().into_iter().find(|h| h.vm == name).map(|h| h.stats)
    }

    fn event_logs_apart(&self) -> bool {
        self.event_logs_apart
    }
}

/// A sparse image of the workload's disk size whose first 64 MiB hold a deterministic pattern
/// (boot blocks and kernel, say). Contents do not change any figure: every read of the golden
/// image is counted whether it falls on data or on a hole.
fn synthetic_golden(dir: &Path, workload: &Workload) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("golden-{}.img", workload.name));
    let size = workload.disk_bytes();
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == size) {
        return Ok(path);
    }
    let tmp = dir.join(format!("golden-{}.img.partial", workload.name));
    let mut file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut block = vec![0u8; 1 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..(64u64 << 20).min(size) >> 20 {
        for chunk in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        file.write_all(&block)?;
    }
    file.set_len(size)?;
    drop(file);
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// What a configuration's in-process server serves, beside NBD: the vhost-user sockets of
/// `vms` VMs (`vm-N`) in a directory.
struct VhostUserVms {
    dir: PathBuf,
    vms: usize,
}

/// How often a storm whose standard error is no terminal says where it is.
const PLAIN_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Where a configuration's run is, as a plain line on standard error every few seconds, when
/// standard error is not a terminal: indicatif draws its bar only on one, and a CI log would
/// otherwise see nothing until a guest storm's twenty minutes were over.
struct PlainProgress {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PlainProgress {
    /// For configuration `number` of `of`, whose bar counts `what`; `None` on a terminal.
    fn start(bar: &indicatif::ProgressBar, number: usize, of: usize, what: &'static str) -> Option<Self> {
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return None;
        }
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let (bar, watching, started) = (bar.clone(), stop.clone(), Instant::now());
        let thread = std::thread::Builder::new()
            .name("storm-progress".into())
            .spawn(move || {
                let (stopped, wake) = &*watching;
                let mut done = stopped.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                loop {
                    let waited = wake.wait_timeout(done, PLAIN_PROGRESS_EVERY);
                    done = waited.unwrap_or_else(std::sync::PoisonError::into_inner).0;
                    if *done {
                        return;
                    }
                    eprintln!(
                        "storm: configuration {number} of {of} ({}): {} of {} {what} {}, {:.0} s",
                        bar.prefix(),
                        bar.position(),
                        bar.length().unwrap_or(0),
                        bar.message(),
                        started.elapsed().as_secs_f64()
                    );
                }
            })
            .ok()?;
        Some(Self { stop, thread: Some(thread) })
    }
}

impl Drop for PlainProgress {
    fn drop(&mut self) {
        let (stopped, wake) = &*self.stop;
        *stopped.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A configuration's write cache: its mode, RAM per VM and shared read cache.
struct Cache {
    mode: WriteCacheMode,
    ram: u64,
    read_cache: u64,
    boot_max: Option<usize>,
}

fn start_local_server(
    golden: &Arc<dyn GoldenImage>,
    Cache { mode, ram, read_cache, boot_max }: Cache,
    work: &Path,
    index: usize,
    record: Option<&Path>,
    vhost_user: Option<VhostUserVms>,
) -> anyhow::Result<LocalTarget> {
    let settings = CacheSettings {
        mode,
        ram_target_bytes: ram,
        spill_max_bytes: None,
        spill_direct: false,
        spill_writers: DEFAULT_SPILL_WRITERS,
        spill_dir: work.join("spill"),
        shared_dir: work.join("shared"),
        read_cache_bytes: read_cache,
    };
    let images = BTreeMap::from([(String::new(), golden.clone())]);
    // No free-memory floor: a storm's figures must not depend on what else the host is doing.
    let mut exports = OverlayExports::new(images, settings, HostMemory::new(u64::MAX, 0))?;
    if let Some(dir) = record {
        exports.record_to(dir.to_owned()).with_context(|| format!("recording to {}", dir.display()))?;
    }
    let registry = exports.registry();
    // A VM boots until its first phase is done (the driver says so), or for the default time.
    registry.boots().set(PacingSettings { max_booting: boot_max, ..PacingSettings::default() });
    let socket = work.join(format!("storm-{}-{index}.sock", std::process::id()));
    let listener = Listener::bind(&ListenAddr::Unix(socket.clone()))?;
    let exports = Arc::new(exports);
    let vhost = match vhost_user {
        Some(VhostUserVms { dir, vms }) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let declared: Vec<VhostExport> =
                (0..vms).map(|vm| VhostExport { vm: format!("vm-{vm}"), image: String::new() }).collect();
            let settings = VhostSettings {
                dir,
                access: SocketAccess::default(),
                queues: 1,
                poll: overspill_nbd::connection::DEFAULT_POLL_BEFORE_SLEEP,
                record: None,
            };
            Some(VhostExports::start(settings, &declared, exports.clone()).context("the vhost-user sockets")?)
        }
        None => None,
    };
    let server = Server::new(exports, ServerConfig::default());
    let stop = server.shutdown_handle();
    let serving = std::thread::Builder::new().name(format!("storm-server-{index}")).spawn(move || {
        if let Err(error) = server.run(&listener) {
            tracing::error!(%error, "storm server stopped");
        }
    })?;
    Ok(LocalTarget {
        socket,
        registry,
        event_logs_apart: mode != WriteCacheMode::Shared,
        _vhost: vhost,
        stop,
        serving: Some(serving),
    })
}

/// Prints the report's tables and writes its files.
fn publish(report: &StormReport, out: &Path) -> anyhow::Result<()> {
    println!("{}", report::text_tables(report));
    report::write_files(report, out).with_context(|| format!("writing the report to {}", out.display()))?;
    println!("Report: {} and {}", out.join("report.html").display(), out.join("report.json").display());
    Ok(())
}

/// The configurations to run: each mode (and RAM target) on an in-process server, or each
/// `--target`.
fn runs(args: &StormArgs) -> anyhow::Result<Vec<Run>> {
    let mut runs = Vec::new();
    if args.target.is_empty() {
        let paced = args.boot_max.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
        for &mode in &args.modes {
            let sizes = match mode {
                WriteCacheMode::Ram | WriteCacheMode::RamDisk => args.ram.clone(),
                _ => vec![0],
            };
            for ram in sizes {
                runs.push(Run::Local { mode, ram, boot_max: None, copying: None });
                if paced.is_some() {
                    runs.push(Run::Local { mode, ram, boot_max: paced, copying: None });
                }
                if args.copiers > 0 {
                    let copying = |limit| Some(Copying { vms: args.copiers, limit });
                    runs.push(Run::Local { mode, ram, boot_max: None, copying: copying(None) });
                    if args.copier_limit.is_some() {
                        runs.push(Run::Local { mode, ram, boot_max: None, copying: copying(args.copier_limit) });
                    }
                }
            }
        }
    } else {
        if args.boot_max.is_some() || args.copiers > 0 {
            bail!(
                "--boot-max and --copiers run with in-process servers (an outside server has its own serve --boot-max)"
            );
        }
        for uri in &args.target {
            runs.push(Run::Remote(uri.parse().map_err(|e| anyhow::anyhow!("--target {uri}: {e}"))?));
        }
    }
    Ok(runs)
}

pub fn run(args: StormArgs) -> anyhow::Result<()> {
    let workload = match &args.workload_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            Workload::parse(&path.display().to_string(), &text)?
        }
        None => Workload::built_in(&args.workload)?,
    };
    let vms = args.vms.unwrap_or(if args.guests.is_some() { 3 } else { 20 });
    if vms == 0 {
        bail!("--vms must be at least 1");
    }
    let work = args.work_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("overspill-storm"));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let runs = runs(&args)?;
    if args.guests.is_some() && args.copiers > 0 {
        bail!("--copiers run beside synthetic VMs (without --guests)");
    }
    if args.guests.is_some() {
        return run_guests(&args, vms, &work, &runs);
    }
    if args.frontend != [GuestFrontend::Nbd] {
        bail!("--frontend chooses how real guests reach their disk (--guests qemu): synthetic VMs are NBD clients");
    }
    let golden: Option<Arc<dyn GoldenImage>> = if args.target.is_empty() {
        let path = match &args.golden {
            Some(path) => path.clone(),
            None => synthetic_golden(&work, &workload)?,
        };
        let image = open_image(&path)?;
        if image.size() < workload.disk_bytes() {
            bail!(
                "golden image {} is smaller than the workload's {} disk",
                path.display(),
                format_bytes(workload.disk_bytes())
            );
        }
        Some(image)
    } else {
        None
    };

    let config = StormConfig {
        vms,
        boot_interval_s: args.boot_interval,
        logon_interval_s: args.logon_interval,
        speed: args.speed,
        workload_seed: args.seed,
        bucket_s: args.bucket.unwrap_or(10).max(1),
    };
    let plan = RunPlan::from_workload(&workload, &config);
    if let Some(dir) = &args.record {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut configs = Vec::new();
    for (index, run) in runs.iter().enumerate() {
        let label = run.label();
        let mut copiers = None;
        let target: Box<dyn Target> = match (run, &golden) {
            (Run::Local { mode, ram, boot_max, copying }, Some(golden)) => {
                let read_cache = if *mode == WriteCacheMode::Shared { 0 } else { args.read_cache };
                let cache = Cache { mode: *mode, ram: *ram, read_cache, boot_max: *boot_max };
                let server = start_local_server(golden, cache, &work, index, None, None)?;
                copiers = copying.map(|copying| Copiers::start(&server, copying));
                Box::new(server)
            }
            (Run::Remote(uri), _) => Box::new(RemoteTarget(uri.clone())),
            (Run::Local { .. }, None) => unreachable!("a golden image is opened for local runs"),
        };
        let bar = driver::progress_bar(plan.total_ops());
        bar.set_prefix(label.clone());
        let plain = PlainProgress::start(&bar, index + 1, runs.len(), "requests");
        let started = Instant::now();
        // Every configuration runs the same requests, so the first one's are recorded.
        let record = if index == 0 { args.record.as_deref() } else { None };
        let results = driver::run(&plan, &config, target.as_ref(), &bar, record);
        bar.finish();
        drop(plain);
        let wall_s = started.elapsed().as_secs_f64();
        let mut config_report = report::config_report(&label, &plan, &config, &results, wall_s);
        run.describe(&mut config_report, args.read_cache);
        config_report.copiers = copiers.take().map(Copiers::stop);
        configs.push(config_report);
    }
    let report = StormReport {
        run: report::RunInfo::here(),
        workload: workload.name.clone(),
        description: workload.description.clone(),
        seed_platform: workload.seed_platform.clone(),
        vms,
        boot_interval_s: args.boot_interval,
        logon_interval_s: args.logon_interval,
        paced: args.speed,
        bucket_s: config.bucket_s,
        phase_sources: workload.phases.iter().map(|p| (p.name.clone(), p.source.clone())).collect(),
        configs,
    };
    publish(&report, &args.out)
}

/// What `--guests` cannot be combined with, and QEMU's presence: checked before anything is
/// built, rather than found out once per guest.
fn check_guest_flags(args: &StormArgs) -> anyhow::Result<()> {
    if !args.target.is_empty() {
        bail!("--guests reads the engine's counters of in-process servers: it cannot run against --target");
    }
    if args.speed.is_some() {
        bail!("--speed paces synthetic requests: real guests run in real time");
    }
    if args.frontend.is_empty() {
        bail!("--frontend names no frontend");
    }
    let qemu = std::process::Command::new("qemu-system-x86_64").arg("--version").output();
    if !qemu.is_ok_and(|out| out.status.success()) {
        bail!("qemu-system-x86_64 does not run: install qemu-system-x86 (scripts/install-guest-tools does)");
    }
    Ok(())
}

/// `--guests qemu`: each configuration's in-process server serves the guests' root filesystem,
/// and the guests boot from it, log on and work (`crate::guest_storm`).
fn run_guests(args: &StormArgs, vms: usize, work: &Path, runs: &[Run]) -> anyhow::Result<()> {
    check_guest_flags(args)?;
    let kernel = Kernel::newest_cloud()?;
    let image = match &args.golden {
        Some(path) => path.clone(),
        None => guests::root_image(&guests::cache_dir(), args.guest_os, &kernel)?,
    };
    let golden = open_image(&image).with_context(|| format!("opening {}", image.display()))?;
    let kit = GuestKit::root_on_disk(&work.join("guest-kit"))?;
    let bucket_s = args.bucket.unwrap_or(2).max(1);
    let config = StormConfig {
        vms,
        boot_interval_s: args.boot_interval,
        logon_interval_s: 0.0,
        speed: Some(1.0),
        workload_seed: args.seed,
        bucket_s,
    };
    if let Some(dir) = &args.record {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut configs = Vec::new();
    let side_by_side = args.frontend != [GuestFrontend::Nbd];
    let configurations = runs.iter().flat_map(|run| args.frontend.iter().map(move |frontend| (run, *frontend)));
    for (index, (run, frontend)) in configurations.enumerate() {
        let Run::Local { mode, ram, boot_max, .. } = run else { bail!("--guests runs in-process servers only") };
        let mut label = run.label();
        if side_by_side {
            label = format!("{label} {}", frontend.name());
        }
        // The first configuration's requests are recorded, as for synthetic VMs: the server
        // writes a trace per connection, rewritten with the guests' phases once they are done.
        let staging =
            (index == 0 && args.record.is_some()).then(|| work.join(format!("record-{}", std::process::id())));
        if let Some(dir) = &staging {
            let _ = std::fs::remove_dir_all(dir);
        }
        let read_cache = if *mode == WriteCacheMode::Shared { 0 } else { args.read_cache };
        let vhost_user_dir = (frontend == GuestFrontend::VhostUser)
            .then(|| work.join(format!("vhost-user-{}-{index}", std::process::id())));
        let vhost_user = vhost_user_dir.clone().map(|dir| VhostUserVms { dir, vms });
        let cache = Cache { mode: *mode, ram: *ram, read_cache, boot_max: *boot_max };
        let target = start_local_server(&golden, cache, work, index, staging.as_deref(), vhost_user)?;
        let bar = guest_storm::progress_bar(vms);
        bar.set_prefix(label.clone());
        let plain = PlainProgress::start(&bar, index + 1, runs.len() * args.frontend.len(), "guest milestones");
        let storm = GuestStorm {
            kit: &kit,
            vms,
            boot_interval_s: args.boot_interval,
            steady_s: args.guest_steady,
            timeout: std::time::Duration::from_secs(args.guest_timeout),
            bucket_s,
            dir: work.join(format!("guests-{index}")),
            disk_bytes: golden.size(),
            vhost_user_dir,
        };
        let started = Instant::now();
        let outcome = guest_storm::run(&storm, &target, &bar)?;
        bar.finish();
        drop(plain);
        let wall_s = started.elapsed().as_secs_f64();
        drop(target);
        let mut config_report = report::config_report(&label, &outcome.plan, &config, &outcome.results, wall_s);
        run.describe(&mut config_report, args.read_cache);
        config_report.boot_times_s = Some(outcome.boot_times_s);
        config_report.booted_at_s = Some(outcome.booted_at_s);
        if let (Some(staging), Some(dir)) = (&staging, &args.record) {
            let written = guest_storm::phase_traces(staging, dir, &outcome.observations)?;
            if written < vms {
                tracing::warn!(written, vms, "not every guest left a trace");
            }
            let _ = std::fs::remove_dir_all(staging);
        }
        configs.push(config_report);
    }
    let os = match args.guest_os {
        Flavour::Systemd => "a Debian minbase with systemd and udev",
        Flavour::Busybox => "busybox as init and every program",
    };
    let report = StormReport {
        run: report::RunInfo::here(),
        workload: format!("qemu-{}", args.guest_os.name()),
        description: format!(
            "real QEMU guests (TCG, 1 CPU, {} MiB): Debian's cloud kernel {} with its root filesystem, {os}, on a virtio disk over {}",
            guest_storm::GUEST_MIB,
            kernel.version,
            args.frontend.iter().map(|f| f.describe()).collect::<Vec<_>>().join(" or ")
        ),
        seed_platform: None,
        vms,
        boot_interval_s: args.boot_interval,
        logon_interval_s: 0.0,
        paced: Some(1.0),
        bucket_s,
        phase_sources: vec![
            ("boot".into(), "measured: from QEMU's start to the guest's \"booted\" marker (kernel, initramfs, root filesystem and init from the server's disk)".into()),
            ("logon".into(), "measured: the guest reads 120 kernel modules and writes a user profile of about 5 MiB in 210 files".into()),
            ("steady".into(), format!("measured: {} s of temporary files written, read back and deleted every second, synced; then fstrim and power off", args.guest_steady)),
        ],
        configs,
    };
    publish(&report, &args.out)
}

/// The copying VMs of a fairness run, on threads of their own until stopped.
struct Copiers {
    copying: Copying,
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
    started: Instant,
}

/// What a copier moves at a time.
const COPY_BYTES: usize = 1 << 20;

impl Copiers {
    fn start(server: &LocalTarget, copying: Copying) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..copying.vms)
            .map(|n| {
                let vm = format!("copy-{n}");
                if let Some(rate) = copying.limit {
                    server.registry.limits().set(&vm, None, Some(Some(rate)));
                }
                let uri = NbdUri { endpoint: Endpoint::Unix(server.socket.clone()), export: format!("@{vm}") };
                let (stop, registry) = (stop.clone(), server.registry.clone());
                // A copier is no booting VM: its fetches do not go first, it takes no boot slot.
                let connected = move || {
                    registry.boots().booted(&vm);
                };
                std::thread::spawn(move || copy_until(&uri, &stop, connected))
            })
            .collect();
        Self { copying, stop, threads, started: Instant::now() }
    }

    /// Stops the copiers; what they moved while they ran.
    fn stop(self) -> report::CopierFigures {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let bytes: u64 = self.threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
        let wall_s = self.started.elapsed().as_secs_f64();
        report::CopierFigures {
            vms: self.copying.vms,
            limit_bytes_per_s: self.copying.limit.map(|rate| rate.per_second),
            bytes_copied: bytes,
            mib_per_s: bytes as f64 / wall_s.max(1e-9) / 1048576.0,
        }
    }
}

/// Copies the first half of the disk into the second, 1 MiB at a time, round and round, until
/// `stop`: bytes copied. A copier that cannot connect or is refused copies nothing.
fn copy_until(uri: &NbdUri, stop: &std::sync::atomic::AtomicBool, connected: impl FnOnce()) -> u64 {
    let Ok(mut client) = overspill_nbd::client::Client::connect(uri) else { return 0 };
    connected();
    let half = (client.size() / 2 / COPY_BYTES as u64) * COPY_BYTES as u64;
    let mut buffer = vec![0u8; COPY_BYTES];
    let (mut at, mut copied) = (0u64, 0u64);
    while half > 0 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if client.read(at, &mut buffer).is_err() || client.write(half + at, &buffer, false).is_err() {
            break;
        }
        copied += COPY_BYTES as u64;
        at = (at + COPY_BYTES as u64) % half;
    }
    let _ = client.disconnect();
    copied
}
