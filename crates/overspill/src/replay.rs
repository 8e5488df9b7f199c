//! `overspill replay`: plays recorded traces against any NBD server, one connection per trace,
//! at the recorded pace or as fast as possible, and prints the storm tables for what it did.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use overspill_block::trace::Trace;
use overspill_nbd::client::NbdUri;
use overspill_storm::driver::{self, RemoteTarget, RunPlan, StormConfig};
use overspill_storm::report::{self, StormReport};

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Traces recorded by `storm --record` or `serve --record`, one VM each.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// The NBD server to replay against (nbd://…, nbd+unix://…, unix:PATH, tcp:HOST:PORT); `{n}`
    /// in the export name becomes each trace's number, so that each is a named VM of an
    /// overspill server (`nbd+unix:///@replay-{n}?socket=…`; without a name it serves VMs read-only).
    #[arg(long)]
    target: String,
    /// Send requests back to back instead of at the recorded pace.
    #[arg(long)]
    fast: bool,
    /// Pace at this many times the recorded speed (default 1: as recorded).
    #[arg(long, default_value_t = 1.0, value_parser = crate::storm::parse_speed)]
    speed: f64,
    /// Where report.json and report.html go.
    #[arg(long, default_value = "overspill-replay-report")]
    out: PathBuf,
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let uri: NbdUri = args.target.parse().map_err(|e| anyhow::anyhow!("--target {}: {e}", args.target))?;
    let traces = args
        .traces
        .iter()
        .map(|p| Trace::read(p).with_context(|| format!("reading trace {}", p.display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let plan = RunPlan::from_traces(&traces).map_err(anyhow::Error::msg)?;
    let config = StormConfig {
        vms: plan.vms(),
        boot_interval_s: 0.0,
        logon_interval_s: 0.0,
        speed: (!args.fast).then_some(args.speed),
        workload_seed: 0,
        bucket_s: 10,
    };
    let bar = driver::progress_bar(plan.total_ops());
    bar.set_prefix("replay");
    let started = Instant::now();
    let results = driver::run(&plan, &config, &RemoteTarget(uri), &bar, None);
    bar.finish();
    let label = args.target.clone();
    let config_report = report::config_report(&label, &plan, &config, &results, started.elapsed().as_secs_f64());
    let failed = config_report.failed_vms.clone();
    let report = StormReport {
        run: report::RunInfo::here(),
        seed_platform: None,
        workload: format!("replay of {} traces", traces.len()),
        description: args.traces.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        vms: plan.vms(),
        boot_interval_s: 0.0,
        logon_interval_s: 0.0,
        paced: config.speed,
        bucket_s: config.bucket_s,
        phase_sources: plan.phase_names.iter().map(|p| (p.clone(), "recorded".to_owned())).collect(),
        configs: vec![config_report],
    };
    println!("{}", report::text_tables(&report));
    report::write_files(&report, &args.out)?;
    println!("Report: {} and {}", args.out.join("report.html").display(), args.out.join("report.json").display());
    if !failed.is_empty() {
        anyhow::bail!("{} VMs failed: {}", failed.len(), failed.join("; "));
    }
    Ok(())
}
