//! `overspill storm`: runs a workload's phases on many VMs against an in-process server for each
//! write-cache configuration (or against outside NBD servers), and prints the seeds' tables.

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
use overspill_nbd::{ListenAddr, Listener, Server, ServerConfig};
use overspill_storm::driver::{self, RemoteTarget, RunPlan, StormConfig, Target};
use overspill_storm::report::{self, StormReport};
use overspill_storm::Workload;

use crate::size::{format_bytes, parse_bytes};
use overspill_server::exports::{CacheSettings, OverlayExports, DEFAULT_SPILL_WRITERS};
use overspill_server::vms::VmRegistry;

#[derive(Debug, Args)]
pub struct StormArgs {
    /// Built-in workload: win7-vdi, win7-vdi-bloated-profile, xenapp-rds, linux-boot.
    #[arg(long, default_value = "win7-vdi")]
    workload: String,
    /// A workload file (TOML, as in crates/overspill-storm/workloads) instead of a built-in one.
    #[arg(long)]
    workload_file: Option<PathBuf>,
    #[arg(long, default_value_t = 20)]
    vms: usize,
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
    #[arg(long, default_value_t = 0.0)]
    boot_interval: f64,
    /// Seconds between logons (the seeds used 8 to 30).
    #[arg(long, default_value_t = 15.0)]
    logon_interval: f64,
    /// Pace requests at this many times real time; without it they run back to back.
    #[arg(long)]
    speed: Option<f64>,
    /// Run against these NBD servers (nbd://…, nbd+unix://…) instead of in-process ones.
    #[arg(long)]
    target: Vec<String>,
    /// Golden image to serve; by default a synthetic one is made in --work-dir.
    #[arg(long)]
    golden: Option<PathBuf>,
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
    /// Width of the IOPS-over-time buckets, in profile seconds.
    #[arg(long, default_value_t = 10)]
    bucket: u64,
}

/// One configuration to run: an in-process server with a mode and RAM size, or an outside URI.
enum Run {
    Local { mode: WriteCacheMode, ram: u64 },
    Remote(NbdUri),
}

impl Run {
    fn label(&self) -> String {
        match self {
            Run::Local { mode: mode @ (WriteCacheMode::Ram | WriteCacheMode::RamDisk), ram } => {
                format!("{mode} {}", format_bytes(*ram).replace(".0 ", "").replace("iB", ""))
            }
            Run::Local { mode, .. } => mode.to_string(),
            Run::Remote(uri) => match &uri.endpoint {
                Endpoint::Unix(path) => format!("unix:{}", path.display()),
                Endpoint::Tcp(addr) => format!("tcp:{addr}"),
            },
        }
    }
}

struct LocalTarget {
    socket: PathBuf,
    registry: Arc<VmRegistry>,
}

impl Target for LocalTarget {
    fn uri(&self, vm: usize) -> NbdUri {
        NbdUri { endpoint: Endpoint::Unix(self.socket.clone()), export: format!("@vm-{vm}") }
    }

    fn stats(&self, vm: usize) -> Option<Arc<VmStats>> {
        let name = format!("vm-{vm}");
        self.registry.snapshot().into_iter().find(|h| h.vm == name).map(|h| h.stats)
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

fn start_local_server(
    golden: &Arc<dyn GoldenImage>,
    mode: WriteCacheMode,
    ram: u64,
    read_cache: u64,
    work: &Path,
    index: usize,
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
    let exports = OverlayExports::new(images, settings, HostMemory::new(u64::MAX, 0))?;
    let registry = exports.registry();
    let socket = work.join(format!("storm-{}-{index}.sock", std::process::id()));
    let listener = Listener::bind(&ListenAddr::Unix(socket.clone()))?;
    let server = Server::new(Arc::new(exports), ServerConfig::default());
    std::thread::Builder::new().name(format!("storm-server-{index}")).spawn(move || {
        if let Err(error) = server.run(&listener) {
            tracing::error!(%error, "storm server stopped");
        }
    })?;
    Ok(LocalTarget { socket, registry })
}

pub fn run(args: StormArgs) -> anyhow::Result<()> {
    let workload = match &args.workload_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            Workload::parse(&path.display().to_string(), &text)?
        }
        None => Workload::built_in(&args.workload)?,
    };
    if args.vms == 0 {
        bail!("--vms must be at least 1");
    }
    let work = args.work_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("overspill-storm"));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let mut runs = Vec::new();
    if args.target.is_empty() {
        for &mode in &args.modes {
            match mode {
                WriteCacheMode::Ram | WriteCacheMode::RamDisk => {
                    runs.extend(args.ram.iter().map(|&ram| Run::Local { mode, ram }))
                }
                _ => runs.push(Run::Local { mode, ram: 0 }),
            }
        }
    } else {
        for uri in &args.target {
            runs.push(Run::Remote(uri.parse().map_err(|e| anyhow::anyhow!("--target {uri}: {e}"))?));
        }
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
        vms: args.vms,
        boot_interval_s: args.boot_interval,
        logon_interval_s: args.logon_interval,
        speed: args.speed,
        workload_seed: args.seed,
        bucket_s: args.bucket.max(1),
    };
    let plan = RunPlan::from_workload(&workload, &config);
    if let Some(dir) = &args.record {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut configs = Vec::new();
    for (index, run) in runs.iter().enumerate() {
        let label = run.label();
        let target: Box<dyn Target> = match (run, &golden) {
            (Run::Local { mode, ram }, Some(golden)) => {
                let read_cache = if *mode == WriteCacheMode::Shared { 0 } else { args.read_cache };
                Box::new(start_local_server(golden, *mode, *ram, read_cache, &work, index)?)
            }
            (Run::Remote(uri), _) => Box::new(RemoteTarget(uri.clone())),
            (Run::Local { .. }, None) => unreachable!("a golden image is opened for local runs"),
        };
        let bar = driver::progress_bar(plan.total_ops());
        bar.set_prefix(label.clone());
        let started = Instant::now();
        // Every configuration runs the same requests, so the first one's are recorded.
        let record = if index == 0 { args.record.as_deref() } else { None };
        let results = driver::run(&plan, &config, target.as_ref(), &bar, record);
        bar.finish();
        let wall_s = started.elapsed().as_secs_f64();
        let mut config_report = report::config_report(&label, &plan, &config, &results, wall_s);
        if let Run::Local { mode, ram } = run {
            config_report.mode = Some(mode.to_string());
            config_report.ram_bytes = matches!(mode, WriteCacheMode::Ram | WriteCacheMode::RamDisk).then_some(*ram);
            config_report.read_cache_bytes = Some(if *mode == WriteCacheMode::Shared { 0 } else { args.read_cache });
        }
        configs.push(config_report);
    }
    let report = StormReport {
        run: report::RunInfo::here(),
        workload: workload.name.clone(),
        description: workload.description.clone(),
        seed_platform: workload.seed_platform.clone(),
        vms: args.vms,
        boot_interval_s: args.boot_interval,
        logon_interval_s: args.logon_interval,
        paced: args.speed,
        bucket_s: config.bucket_s,
        phase_sources: workload.phases.iter().map(|p| (p.name.clone(), p.source.clone())).collect(),
        configs,
    };
    println!("{}", report::text_tables(&report));
    report::write_files(&report, &args.out).with_context(|| format!("writing the report to {}", args.out.display()))?;
    println!("Report: {} and {}", args.out.join("report.html").display(), args.out.join("report.json").display());
    Ok(())
}
