//! `overspill plan`: reads recorded traces and hands them to the planner
//! ([`overspill_storm::plan`]), then prints and writes what it found.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use overspill_block::trace::Trace;
use overspill_engine::WriteCacheMode;
use overspill_storm::fleet::{self, FleetOptions, GoldenStore};
use overspill_storm::plan::{self, PlanOptions};
use overspill_storm::storage::{CacheMode, Clones, DeviceSpec, Raid, StorageSpec};

use crate::size::parse_bytes;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Traces recorded by `storm --record` or `serve --record`, one VM each.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// RAM sizes per VM to compare.
    #[arg(long, value_delimiter = ',', default_value = "64M,128M,256M,512M,1G,4G", value_parser = parse_bytes)]
    ram: Vec<u64>,
    #[arg(long, default_value = "ram+disk")]
    mode: WriteCacheMode,
    /// Shared read cache in front of the golden image, as `serve --read-cache`.
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    read_cache: u64,
    /// Estimate boot times on this storage: a device class (hdd7200, hdd10k, hdd15k, ssd, nvme)
    /// or a TOML file describing the device, the array, its cache and the power-ons
    /// (docs/planning.md); the flags below override the file.
    #[arg(long)]
    storage: Option<String>,
    /// Disks in the array.
    #[arg(long)]
    disks: Option<usize>,
    /// RAID level of the array: 0, 1, 10, 5 or 6.
    #[arg(long)]
    raid: Option<Raid>,
    /// The array controller's cache (0 for none).
    #[arg(long, value_parser = parse_bytes)]
    controller_cache: Option<u64>,
    /// Requests per second the array's controller handles, cache hits included.
    #[arg(long)]
    controller_iops: Option<f64>,
    /// The array's own latency per request in milliseconds (fabric and controller; what a cache
    /// hit takes).
    #[arg(long)]
    array_latency_ms: Option<f64>,
    /// read-only or write-back.
    #[arg(long)]
    cache_mode: Option<CacheMode>,
    /// How much of a write-back controller cache may hold writes not yet on the disks (default:
    /// half of it; reads still use the whole cache).
    #[arg(long, value_parser = parse_bytes)]
    write_cache: Option<u64>,
    /// Requests the host keeps at the array at once (the HBA's or LUN's queue depth).
    #[arg(long)]
    queue_depth: Option<usize>,
    /// Power VMs on K at a time, INTERVAL apart: `1/1.3s`, `5/10s`.
    #[arg(long, value_parser = parse_power_on)]
    power_on: Option<(usize, f64)>,
    /// Storage reads each power-on waits for before the next group is powered on.
    #[arg(long)]
    power_on_ios: Option<usize>,
    /// Requests a booting guest keeps in flight.
    #[arg(long)]
    vm_queue_depth: Option<usize>,
    /// Without overspill, the VMs are linked clones of one golden image (reads of blocks a VM
    /// never wrote share the array's cache) or full clones (each VM's own copy).
    #[arg(long)]
    clones: Option<Clones>,
    /// VMs booting for the estimate (traces are reused round-robin).
    #[arg(long, default_value_t = 90)]
    vms: usize,
    /// Estimate the boots also with at most N VMs booting at once (`serve --boot-max N`): the
    /// boot-completion curve with and without pacing, side by side.
    #[arg(long, value_name = "N", requires = "storage", value_parser = clap::value_parser!(u64).range(1..))]
    boot_max: Option<u64>,
    /// Plan a fleet of this many hosts (each its own overspill), with the first --ram size.
    #[arg(long, requires = "vms_per_host")]
    hosts: Option<usize>,
    /// VMs on each host of the fleet.
    #[arg(long, requires = "hosts")]
    vms_per_host: Option<usize>,
    /// Where the fleet's golden images live: rbd, s3 or file.
    #[arg(long, default_value = "rbd")]
    golden: GoldenStore,
    /// Time between power-ons on a host, for the fleet's staggered storm.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    stagger: std::time::Duration,
    /// Where plan.json and plan.html go.
    #[arg(long, default_value = "overspill-plan")]
    out: PathBuf,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let traces = args
        .traces
        .iter()
        .map(|p| Trace::read(p).with_context(|| format!("reading trace {}", p.display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for (t, path) in traces.iter().zip(&args.traces) {
        if t.truncated_bytes > 0 {
            tracing::warn!(trace = %path.display(), bytes = t.truncated_bytes, "ignored a partial last record");
        }
    }
    let storage = match &args.storage {
        Some(name) => Some(storage_spec(name, &args)?),
        None => None,
    };
    if args.ram.is_empty() {
        bail!("--ram needs at least one size");
    }
    let options = PlanOptions {
        ram: args.ram,
        mode: args.mode,
        read_cache_bytes: args.read_cache,
        storage,
        vms: args.vms,
        boot_max: args.boot_max.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
    };
    let names = args.traces.iter().map(|p| p.display().to_string()).collect();
    let report = plan::plan(&traces, names, &options)?;
    print!("{}", plan::text(&report));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("plan.json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(args.out.join("plan.html"), plan::html(&report).map_err(|e| anyhow::anyhow!("chart: {e}"))?)?;
    println!("\nReport: {} and {}", args.out.join("plan.html").display(), args.out.join("plan.json").display());
    if let (Some(hosts), Some(vms_per_host)) = (args.hosts, args.vms_per_host) {
        let fleet_options = FleetOptions {
            hosts,
            vms_per_host,
            golden: args.golden,
            mode: options.mode,
            ram_bytes: options.ram[0],
            read_cache_bytes: options.read_cache_bytes,
            stagger_s: args.stagger.as_secs_f64(),
            interval_s: 10,
        };
        let boots = overspill_storm::driver::RunPlan::from_traces(&traces).map_err(anyhow::Error::msg)?;
        let fleet = fleet::plan_fleet(&boots, &fleet_options)?;
        let markdown = fleet::markdown(&fleet);
        println!("\nFleet plan (each trace's first phase as the boot storm):\n\n{markdown}");
        std::fs::write(args.out.join("fleet.md"), &markdown)?;
        std::fs::write(args.out.join("fleet.json"), serde_json::to_string_pretty(&fleet)?)?;
    }
    Ok(())
}

/// A device class by name, or a storage file, with the flags laid over it.
fn storage_spec(name: &str, args: &PlanArgs) -> anyhow::Result<StorageSpec> {
    let mut spec = match DeviceSpec::built_in(name) {
        Some(device) => StorageSpec::single(device),
        None if std::path::Path::new(name).exists() => {
            let text = std::fs::read_to_string(name).with_context(|| format!("reading {name}"))?;
            StorageSpec::from_toml(&text).map_err(|e| anyhow::anyhow!("{name}: {e}"))?
        }
        None => bail!("unknown storage {name}: use {} or a TOML file", DeviceSpec::built_in_names().join(", ")),
    };
    spec.disks = args.disks.unwrap_or(spec.disks);
    spec.raid = args.raid.unwrap_or(spec.raid);
    spec.cache_bytes = args.controller_cache.unwrap_or(spec.cache_bytes);
    spec.cache_mode = args.cache_mode.unwrap_or(spec.cache_mode);
    spec.write_cache_bytes = args.write_cache.or(spec.write_cache_bytes);
    spec.queue_depth = args.queue_depth.or(spec.queue_depth);
    spec.controller_iops = args.controller_iops.or(spec.controller_iops);
    spec.array_latency_s = args.array_latency_ms.map_or(spec.array_latency_s, |ms| ms / 1e3);
    if let Some((group, interval)) = args.power_on {
        (spec.power_on_group, spec.power_on_interval_s) = (group, interval);
    }
    spec.power_on_ios = args.power_on_ios.unwrap_or(spec.power_on_ios);
    spec.vm_queue_depth = args.vm_queue_depth.unwrap_or(spec.vm_queue_depth);
    spec.clones = args.clones.unwrap_or(spec.clones);
    spec.check().map_err(|e| anyhow::anyhow!("--storage: {e}"))?;
    Ok(spec)
}

fn parse_power_on(s: &str) -> Result<(usize, f64), String> {
    let (group, interval) = s.split_once('/').ok_or("expected K/INTERVAL, such as 1/1.3s")?;
    let group: usize = group.trim().parse().map_err(|_| format!("{group}: not a number of VMs"))?;
    let interval = humantime::parse_duration(interval.trim()).map_err(|e| format!("{interval}: {e}"))?;
    Ok((group, interval.as_secs_f64()))
}
