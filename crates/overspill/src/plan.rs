//! `overspill plan`: reads recorded traces and hands them to the planner
//! ([`overspill_storm::plan`]), then prints and writes what it found.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use overspill_engine::WriteCacheMode;
use overspill_storm::plan::{self, PlanOptions, DEVICES};
use overspill_storm::trace::Trace;

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
    /// Estimate boot times on this storage: hdd7200, sas15k, ssd, nvme.
    #[arg(long)]
    storage: Option<String>,
    /// VMs booting at once for the estimate (traces are reused round-robin).
    #[arg(long, default_value_t = 90)]
    vms: usize,
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
    let device = match &args.storage {
        Some(name) => Some(
            *DEVICES
                .iter()
                .find(|d| d.name == name)
                .with_context(|| format!("unknown storage {name}: use {}", DEVICES.map(|d| d.name).join(", ")))?,
        ),
        None => None,
    };
    if args.ram.is_empty() {
        bail!("--ram needs at least one size");
    }
    let options =
        PlanOptions { ram: args.ram, mode: args.mode, read_cache_bytes: args.read_cache, device, vms: args.vms };
    let names = args.traces.iter().map(|p| p.display().to_string()).collect();
    let report = plan::plan(&traces, names, &options)?;
    print!("{}", plan::text(&report));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("plan.json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(args.out.join("plan.html"), plan::html(&report).map_err(|e| anyhow::anyhow!("chart: {e}"))?)?;
    println!("\nReport: {} and {}", args.out.join("plan.html").display(), args.out.join("plan.json").display());
    Ok(())
}
