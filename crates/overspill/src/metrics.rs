//! The engine's figures in the Prometheus text format (and OpenMetrics when asked), per VM and for
//! the whole server, served on `/metrics` with `/healthz` beside it.
//!
//! Per-VM families are `overspill_vm_*` with `export` and `vm` labels; they exist while the VM is
//! connected, so label cardinality follows the VMs connected now. Server families are
//! `overspill_*` without those labels: counters include every VM that ever connected (departed
//! VMs' counters are folded into the registry's totals when they leave), gauges sum the VMs
//! connected now. The MCSIO counter names map onto these in `docs/metrics.md`.
//!
//! The exposition is written here rather than through a client library: the figures already live
//! in the engine's atomics, so all that is needed is a formatter over them (prometheus-client
//! speaks only OpenMetrics, and promtool checks the Prometheus text format).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Full;

use overspill_engine::read_cache::ReadCacheStats;
use overspill_engine::stats::{GuestOp, LatencyHistogram, OpCounter, SizeHistogram};
use overspill_engine::{HostMemory, StorageTier, VmStats};

use overspill_nbd::counters::ProtocolCounters;
use overspill_server::images::{CacheEntry, ReadCacheList};
use overspill_server::vms::{VmHandle, VmRegistry};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Prometheus,
    OpenMetrics,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// OpenMetrics if the scraper's Accept header asks for it.
    pub fn from_accept(accept: Option<&str>) -> Self {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

type Getter = Box<dyn Fn(&VmStats) -> u64 + Send + Sync>;

/// One engine figure: family (without prefix), help, kind, extra labels, and where to read it.
struct Figure {
    family: &'static str,
    help: &'static str,
    kind: Kind,
    labels: Vec<(&'static str, &'static str)>,
    get: Getter,
}

macro_rules! figure {
    ($family:literal, $help:literal, $kind:ident, [$(($k:literal, $v:literal)),*], $get:expr) => {
        Figure { family: $family, help: $help, kind: Kind::$kind, labels: vec![$(($k, $v)),*], get: Box::new($get) }
    };
}

/// Operations and bytes per storage tier and direction, one figure each.
fn storage_figures() -> Vec<Figure> {
    type Measure = fn(&OpCounter) -> u64;
    let families: [(&'static str, &'static str, Measure); 2] = [
        (
            "storage_ops_total",
            "Operations issued to storage: golden image, spill file, local cache file, shared differencing file.",
            |c| c.ops.get(),
        ),
        ("storage_bytes_total", "Bytes moved to and from storage, by tier.", |c| c.bytes.get()),
    ];
    let mut figures = Vec::new();
    for (family, help, measure) in families {
        for tier in StorageTier::ALL {
            let help = if figures.iter().any(|f: &Figure| f.family == family) { "" } else { help };
            let figure = |direction, get: Getter| Figure {
                family,
                help,
                kind: Kind::Counter,
                labels: vec![("tier", tier.label()), ("direction", direction)],
                get,
            };
            figures.push(figure("read", Box::new(move |s| measure(tier.reads(s)))));
            if tier.is_written() {
                figures.push(figure("write", Box::new(move |s| tier.writes(s).map_or(0, measure))));
            }
        }
    }
    figures
}

static FIGURES: std::sync::LazyLock<Vec<Figure>> = std::sync::LazyLock::new(|| {
    let mut figures = fixed_figures();
    let at = figures.iter().position(|f| f.family == "spill_segments_written_total").unwrap_or(figures.len());
    figures.splice(at..at, storage_figures());
    figures
});

fn fixed_figures() -> Vec<Figure> {
    vec![
        figure!("guest_requests_total", "Guest requests by command.", Counter, [("op", "read")], |s| s
            .guest_read
            .ops
            .get()),
        figure!("guest_requests_total", "", Counter, [("op", "write")], |s| s.guest_write.ops.get()),
        figure!("guest_requests_total", "", Counter, [("op", "trim")], |s| s.guest_trim.ops.get()),
        figure!("guest_requests_total", "", Counter, [("op", "write_zeroes")], |s| s.guest_zero.ops.get()),
        figure!("guest_requests_total", "", Counter, [("op", "flush")], |s| s.guest_flush.ops.get()),
        figure!("guest_bytes_total", "Bytes guest requests covered, by command.", Counter, [("op", "read")], |s| s
            .guest_read
            .bytes
            .get()),
        figure!("guest_bytes_total", "", Counter, [("op", "write")], |s| s.guest_write.bytes.get()),
        figure!("guest_bytes_total", "", Counter, [("op", "trim")], |s| s.guest_trim.bytes.get()),
        figure!("guest_bytes_total", "", Counter, [("op", "write_zeroes")], |s| s.guest_zero.bytes.get()),
        figure!(
            "guest_read_blocks_total",
            "4 KiB blocks of guest reads by the tier that served them.",
            Counter,
            [("served_by", "ram")],
            |s| s.read_blocks_ram.get()
        ),
        figure!("guest_read_blocks_total", "", Counter, [("served_by", "spill")], |s| s.read_blocks_spill.get()),
        figure!("guest_read_blocks_total", "", Counter, [("served_by", "golden")], |s| s.read_blocks_golden.get()),
        figure!("guest_read_blocks_total", "", Counter, [("served_by", "zero")], |s| s.read_blocks_zero.get()),
        figure!("guest_read_blocks_total", "", Counter, [("served_by", "cache_file")], |s| s
            .read_blocks_cache_file
            .get()),
        figure!(
            "guest_write_blocks_total",
            "4 KiB blocks of guest writes by the tier they landed in.",
            Counter,
            [("landed_in", "ram")],
            |s| s.write_blocks_ram.get()
        ),
        figure!("guest_write_blocks_total", "", Counter, [("landed_in", "spill")], |s| s.write_blocks_spill.get()),
        figure!("guest_write_blocks_total", "", Counter, [("landed_in", "cache_file")], |s| s
            .write_blocks_cache_file
            .get()),
        figure!("guest_zeroed_blocks_total", "Whole 4 KiB blocks zeroed without storing data.", Counter, [], |s| s
            .zero_blocks
            .get()),
        figure!(
            "golden_requests_total",
            "Reads asked of the golden image (its shared read cache, when there is one).",
            Counter,
            [],
            |s| s.golden_request.ops.get()
        ),
        figure!("spill_segments_written_total", "2 MiB segments written to spill files.", Counter, [], |s| s
            .spill_segments_written
            .get()),
        figure!("spill_segments_punched_total", "Dead spill segments whose space was given back.", Counter, [], |s| s
            .spill_segments_punched
            .get()),
        figure!(
            "spill_compaction_moved_bytes_total",
            "Live bytes compaction moved between spill segments.",
            Counter,
            [],
            |s| s.compaction_bytes_moved.get()
        ),
        figure!(
            "cache_memory_used_bytes",
            "Cache memory in use: RAM tier, open spill segment, index.",
            Gauge,
            [],
            |s| s.cache_memory_used_bytes.get()
        ),
        figure!("cache_memory_target_bytes", "Cache memory target now in force.", Gauge, [], |s| s
            .cache_memory_target_bytes
            .get()),
        figure!("cache_memory_peak_bytes", "Highest cache memory used.", Gauge, [], |s| s
            .cache_memory_peak_bytes
            .get()),
        figure!("cache_disk_used_bytes", "Bytes of cache files holding data.", Gauge, [], |s| s
            .cache_disk_used_bytes
            .get()),
        figure!("cache_disk_size_bytes", "Size of the cache files (or the spill limit).", Gauge, [], |s| s
            .cache_disk_size_bytes
            .get()),
        figure!("cache_disk_peak_bytes", "Highest cache disk used.", Gauge, [], |s| s.cache_disk_peak_bytes.get()),
    ]
}

struct Writer {
    out: String,
    format: Format,
    last_family: String,
}

fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn label_text(labels: &[(&str, String)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    format!("{{{}}}", inner.join(","))
}

impl Writer {
    /// Writes HELP and TYPE once per family.
    fn header(&mut self, family: &str, help: &str, kind: &str) {
        if self.last_family == family {
            return;
        }
        self.last_family = family.to_owned();
        // OpenMetrics names a counter family without its `_total` suffix.
        let name = match (self.format, kind) {
            (Format::OpenMetrics, "counter") => family.strip_suffix("_total").unwrap_or(family),
            _ => family,
        };
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, String)], value: f64) {
        let _ = writeln!(self.out, "{name}{} {value}", label_text(labels));
    }

    /// A histogram from per-bucket counts with upper bounds (the last count is unbounded).
    fn histogram(&mut self, name: &str, labels: &[(&str, String)], bounds: &[f64], counts: &[u64], sum: f64) {
        let mut cumulative = 0u64;
        for (i, count) in counts.iter().enumerate() {
            cumulative += count;
            let le = bounds.get(i).map_or("+Inf".to_owned(), |b| b.to_string());
            let mut with_le = labels.to_vec();
            with_le.push(("le", le));
            self.sample(&format!("{name}_bucket"), &with_le, cumulative as f64);
        }
        self.sample(&format!("{name}_sum"), labels, sum);
        self.sample(&format!("{name}_count"), labels, cumulative as f64);
    }
}

fn latency_bounds_s() -> Vec<f64> {
    LatencyHistogram::BOUNDS_US.iter().map(|&us| us as f64 / 1e6).collect()
}

fn size_bounds() -> Vec<f64> {
    (0..SizeHistogram::BUCKETS).filter_map(SizeHistogram::bucket_upper_bytes).map(|b| b as f64).collect()
}

/// Renders every family: per VM (`overspill_vm_*`) and server-wide (`overspill_*`).
pub fn render(
    registry: &VmRegistry,
    read_caches: &[CacheEntry],
    host: &HostMemory,
    protocol: &ProtocolCounters,
    cache_dirs: &[std::path::PathBuf],
    format: Format,
) -> String {
    let (vms, departed) = registry.snapshot_with_departed();
    let mut w = Writer { out: String::new(), format, last_family: String::new() };
    counter_figures(&mut w, &vms, &departed);
    histogram_figures(&mut w, &vms, &departed);
    read_cache_figures(&mut w, read_caches);
    host_figures(&mut w, registry, vms.len(), host);
    protocol_figures(&mut w, protocol);
    filesystem_figures(&mut w, cache_dirs);
    w.header("overspill_build_info", "The server's version, commit and optional features (always 1).", "gauge");
    w.sample(
        "overspill_build_info",
        &[
            ("version", env!("CARGO_PKG_VERSION").to_owned()),
            ("commit", env!("OVERSPILL_COMMIT").to_owned()),
            ("features", env!("OVERSPILL_FEATURES").to_owned()),
        ],
        1.0,
    );
    process_figures(&mut w);
    if format == Format::OpenMetrics {
        w.out.push_str("# EOF\n");
    }
    w.out
}

fn vm_labels(export: &str, vm: &str) -> Vec<(&'static str, String)> {
    vec![("export", export.to_owned()), ("vm", vm.to_owned())]
}

/// VMs moved to and from peer servers (live migration).
fn move_figures(w: &mut Writer, moves: &overspill_server::vms::MoveCounters) {
    use std::sync::atomic::Ordering::Relaxed;
    w.header(
        "overspill_vm_moves_total",
        "VMs moved to (out) or from (in) a peer server, and moves given up (aborted, at either end).",
        "counter",
    );
    for (outcome, count) in [("out", &moves.moved_out), ("in", &moves.moved_in), ("aborted", &moves.aborted)] {
        w.sample("overspill_vm_moves_total", &[("outcome", outcome.to_owned())], count.load(Relaxed) as f64);
    }
    w.header("overspill_vm_move_bytes_total", "Block data sent to and received from peer servers by moves.", "counter");
    for (direction, bytes) in [("sent", &moves.bytes_sent), ("received", &moves.bytes_received)] {
        w.sample("overspill_vm_move_bytes_total", &[("direction", direction.to_owned())], bytes.load(Relaxed) as f64);
    }
    w.header(
        "overspill_vm_move_rounds_total",
        "Pre-copy rounds sent: each ends when every changed block was sent once.",
        "counter",
    );
    w.sample("overspill_vm_move_rounds_total", &[], moves.rounds.load(Relaxed) as f64);
    w.header(
        "overspill_vm_switchover_seconds",
        "Switchovers of VMs moved here: from the first change that asked for it (or the sender's end) to the VM served here.",
        "summary",
    );
    w.sample("overspill_vm_switchover_seconds_count", &[], moves.switchovers.load(Relaxed) as f64);
    w.sample("overspill_vm_switchover_seconds_sum", &[], moves.switchover_micros_sum.load(Relaxed) as f64 / 1e6);
    w.header("overspill_vm_switchover_max_seconds", "The longest switchover of a VM moved here.", "gauge");
    w.sample("overspill_vm_switchover_max_seconds", &[], moves.switchover_micros_max.load(Relaxed) as f64 / 1e6);
}

/// The counters and gauges of [`FIGURES`], per VM and summed over the server (counters of VMs
/// that left included).
fn counter_figures(w: &mut Writer, vms: &[VmHandle], departed: &VmStats) {
    for figure in FIGURES.iter() {
        let kind = if figure.kind == Kind::Counter { "counter" } else { "gauge" };
        let extra: Vec<(&str, String)> = figure.labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        let vm_family = format!("overspill_vm_{}", figure.family);
        w.header(&vm_family, help_of(figure.family), kind);
        for handle in vms {
            let mut labels = vm_labels(&handle.export, &handle.vm);
            labels.extend(extra.iter().cloned());
            w.sample(&vm_family, &labels, (figure.get)(&handle.stats) as f64);
        }
    }
    for figure in FIGURES.iter() {
        let kind = if figure.kind == Kind::Counter { "counter" } else { "gauge" };
        let extra: Vec<(&str, String)> = figure.labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        let family = format!("overspill_{}", figure.family);
        w.header(&family, help_of(figure.family), kind);
        let live: u64 = vms.iter().map(|h| (figure.get)(&h.stats)).sum();
        let total = if figure.kind == Kind::Counter { live + (figure.get)(departed) } else { live };
        w.sample(&family, &extra, total as f64);
    }
}

/// Request latencies per VM and server-wide, and spill write sizes per VM.
fn histogram_figures(w: &mut Writer, vms: &[VmHandle], departed: &VmStats) {
    let bounds = latency_bounds_s();
    let help = "Time to serve a guest request, by command.";
    w.header("overspill_vm_request_duration_seconds", help, "histogram");
    for handle in vms {
        for op in GuestOp::ALL {
            let h = handle.stats.latency(op);
            let mut labels = vm_labels(&handle.export, &handle.vm);
            labels.push(("op", op.name().to_owned()));
            w.histogram(
                "overspill_vm_request_duration_seconds",
                &labels,
                &bounds,
                &h.counts(),
                h.sum_ns() as f64 / 1e9,
            );
        }
    }
    w.header("overspill_request_duration_seconds", help, "histogram");
    for op in GuestOp::ALL {
        let all: Vec<&VmStats> = vms.iter().map(|h| h.stats.as_ref()).chain([departed]).collect();
        let counts = all.iter().map(|s| s.latency(op).counts()).fold(
            [0u64; LatencyHistogram::BOUNDS_US.len() + 1],
            |mut acc, c| {
                acc.iter_mut().zip(c).for_each(|(a, b)| *a += b);
                acc
            },
        );
        let sum: u64 = all.iter().map(|s| s.latency(op).sum_ns()).sum();
        w.histogram(
            "overspill_request_duration_seconds",
            &[("op", op.name().to_owned())],
            &bounds,
            &counts,
            sum as f64 / 1e9,
        );
    }

    let sizes = size_bounds();
    let help = "Sizes of spill writes (every one should be a whole 2 MiB segment).";
    w.header("overspill_vm_spill_write_size_bytes", help, "histogram");
    for handle in vms {
        let s = &handle.stats;
        let labels = vm_labels(&handle.export, &handle.vm);
        w.histogram(
            "overspill_vm_spill_write_size_bytes",
            &labels,
            &sizes,
            &s.spill_write_sizes.counts(),
            s.spill_write.bytes.get() as f64,
        );
    }
}

/// `overspill_{kind}_throttled_seconds_total` and `…_requests` with a `{kind}` label, one series
/// per VM or group that is or was limited (none at all when none is).
fn throttling_figures(
    w: &mut Writer,
    kind: &str,
    throttling: &[(String, Duration, u64)],
    waited_help: &str,
    waiting_help: &str,
) {
    if throttling.is_empty() {
        return;
    }
    let (waited_family, waiting_family) =
        (format!("overspill_{kind}_throttled_seconds_total"), format!("overspill_{kind}_throttled_requests"));
    w.header(&waited_family, waited_help, "counter");
    for (name, waited, _) in throttling {
        w.sample(&waited_family, &[(kind, name.clone())], waited.as_secs_f64());
    }
    w.header(&waiting_family, waiting_help, "gauge");
    for (name, _, waiting) in throttling {
        w.sample(&waiting_family, &[(kind, name.clone())], *waiting as f64);
    }
}

/// Boots: how many now, how many wait for a slot (serve --boot-max), and how long they waited.
fn boot_figures(w: &mut Writer, boots: &overspill_server::boot_pacing::BootFigures) {
    w.header(
        "overspill_vms_booting",
        "VMs in their boot phase: from the first request on a fresh overlay, for --boot-time or until vm booted.",
        "gauge",
    );
    w.sample("overspill_vms_booting", &[], boots.booting as f64);
    w.header(
        "overspill_vms_waiting_to_boot",
        "Fresh VMs whose first request waits for a boot slot (serve --boot-max).",
        "gauge",
    );
    w.sample("overspill_vms_waiting_to_boot", &[], boots.waiting as f64);
    w.header("overspill_boots_total", "Boots begun since the server started.", "counter");
    w.sample("overspill_boots_total", &[], boots.started as f64);
    w.header(
        "overspill_boot_wait_seconds_total",
        "Time fresh VMs' first requests waited for a boot slot, summed.",
        "counter",
    );
    w.sample("overspill_boot_wait_seconds_total", &[], boots.waited.as_secs_f64());
    if let Some(max) = boots.max_booting {
        w.header("overspill_boot_max", "The cap on VMs booting at once (serve --boot-max).", "gauge");
        w.sample("overspill_boot_max", &[], max as f64);
    }
}

/// VMs by state and the host's cache memory.
fn host_figures(w: &mut Writer, registry: &VmRegistry, vms_with_overlay: usize, host: &HostMemory) {
    w.header(
        "overspill_vms",
        "Named VMs by state: connected, resetting, in-grace (waiting to reconnect), lost (refused until reset), \
         outgoing, incoming (moving between servers), fork (waiting for its first connection), dropped (a fork, \
         refused until reset).",
        "gauge",
    );
    for (state, count) in registry.state_counts() {
        w.sample("overspill_vms", &[("state", state.as_str().to_owned())], count as f64);
    }
    w.header(
        "overspill_connected_vms",
        "VMs with an overlay now (connected, or in grace waiting to reconnect).",
        "gauge",
    );
    w.sample("overspill_connected_vms", &[], vms_with_overlay as f64);
    w.header(
        "overspill_golden_image_changes_total",
        "Golden images found changed (written, cut or grown) while VMs were served over them; each one's VMs were lost.",
        "counter",
    );
    w.sample("overspill_golden_image_changes_total", &[], registry.golden_image_changes() as f64);
    move_figures(w, registry.move_counters());
    throttling_figures(
        w,
        "vm",
        &registry.limits().throttling(),
        "Time the VM's requests waited for its limits (vm limit, serve --limit-iops/--limit-bandwidth), summed.",
        "The VM's requests waiting for its limits now.",
    );
    throttling_figures(
        w,
        "group",
        &registry.limits().group_throttling(),
        "Time requests of the group's VMs waited while the group's limits held them (serve --group-limit-iops/--group-limit-bandwidth, vm limit --group), summed over requests.",
        "Requests of the group's VMs waiting now.",
    );
    throttling_figures(
        w,
        "budget",
        &registry.limits().host_throttling(),
        "Time requests waited at a host budget (golden: golden-image fetches, serve --golden-limit-iops/--golden-limit-bandwidth; spill: segment writes, --spill-limit-bandwidth; vm limit --host), summed.",
        "Requests (golden-image fetches, segment writes) waiting at the host budget now.",
    );
    w.header(
        "overspill_budget_golden_went_ahead_total",
        "Reads of booting VMs whose golden-image fetches went ahead of the host's golden budget when it would have held them (the other VMs wait out their debt, up to two seconds of the budget).",
        "counter",
    );
    let golden = registry.limits().host_budget(overspill_server::vm_limits::HostBudget::Golden);
    w.sample("overspill_budget_golden_went_ahead_total", &[], golden.went_ahead() as f64);
    boot_figures(w, &registry.boots().figures());
    w.header(
        "overspill_host_cache_memory_used_bytes",
        "Cache memory of all VMs together, with the free pages they keep for their next writes.",
        "gauge",
    );
    w.sample("overspill_host_cache_memory_used_bytes", &[], host.used_bytes() as f64);
    w.header(
        "overspill_host_cache_memory_cap_bytes",
        "The host cap on cache memory: --ram-total, or less while the memory directory is short of room.",
        "gauge",
    );
    w.sample("overspill_host_cache_memory_cap_bytes", &[], host.total_cap_bytes() as f64);
    w.header(
        "overspill_host_read_cache_bytes",
        "What the golden images' read caches hold together, within --ram-total beside the VMs.",
        "gauge",
    );
    w.sample("overspill_host_read_cache_bytes", &[], host.read_cache_bytes() as f64);
    w.header(
        "overspill_host_read_cache_floor_bytes",
        "What the read caches together keep whatever the VMs need (--read-cache-floor).",
        "gauge",
    );
    w.sample("overspill_host_read_cache_floor_bytes", &[], host.read_cache_floor_bytes() as f64);
    w.header(
        "overspill_host_memory_given_back_bytes_total",
        "Cache memory given back without a write to make it: read caches and quiet or waiting VMs for VMs held below their targets, and VMs above targets cut by pressure.",
        "counter",
    );
    w.sample("overspill_host_memory_given_back_bytes_total", &[], host.given_back_bytes() as f64);
    w.header("overspill_host_memory_floor_bytes", "Free memory the caches leave to the host (--ram-floor).", "gauge");
    w.sample("overspill_host_memory_floor_bytes", &[], host.floor_bytes() as f64);
    let per_vm_cap = host.per_vm_cap_bytes();
    if per_vm_cap != u64::MAX {
        w.header(
            "overspill_host_cache_memory_per_vm_cap_bytes",
            "The most one VM's cache may hold now: set while free memory is below the floor, the memory directory short of room, or the VMs over --ram-total.",
            "gauge",
        );
        w.sample("overspill_host_cache_memory_per_vm_cap_bytes", &[], per_vm_cap as f64);
    }
    if let Some(available) = host.available_bytes() {
        w.header(
            "overspill_host_memory_available_bytes",
            "Free memory at the last sample (MemAvailable, or the cgroup's room when less); below the floor, VMs' targets shrink.",
            "gauge",
        );
        w.sample("overspill_host_memory_available_bytes", &[], available as f64);
    }
}

/// Error replies and refused connections, counted by the protocol.
fn protocol_figures(w: &mut Writer, protocol: &ProtocolCounters) {
    w.header(
        "overspill_nbd_error_replies_total",
        "Requests answered with an error, by command and errno (ENOSPC: a VM's cache is full).",
        "counter",
    );
    for ((command, errno), count) in protocol.error_replies() {
        w.sample(
            "overspill_nbd_error_replies_total",
            &[("command", command.to_owned()), ("errno", errno.to_owned())],
            count as f64,
        );
    }
    w.header(
        "overspill_nbd_refused_connections_total",
        "Connections turned away or cut off before serving an export, by reason.",
        "counter",
    );
    for (reason, count) in protocol.refusals() {
        w.sample("overspill_nbd_refused_connections_total", &[("reason", reason.as_str().to_owned())], count as f64);
    }
}

/// Room on the filesystems of the cache directories (spill, shared), for alerts before a VM is
/// refused space: read at each scrape.
fn filesystem_figures(w: &mut Writer, dirs: &[std::path::PathBuf]) {
    let found: Vec<(String, nix::sys::statvfs::Statvfs)> = dirs
        .iter()
        .filter_map(|dir| Some((dir.display().to_string(), nix::sys::statvfs::statvfs(dir).ok()?)))
        .collect();
    let bytes = |blocks: u64, fs: &nix::sys::statvfs::Statvfs| (blocks * fs.fragment_size()) as f64;
    w.header("overspill_cache_filesystem_size_bytes", "Size of the filesystem of a cache directory.", "gauge");
    for (dir, fs) in &found {
        w.sample("overspill_cache_filesystem_size_bytes", &[("dir", dir.clone())], bytes(fs.blocks(), fs));
    }
    w.header(
        "overspill_cache_filesystem_avail_bytes",
        "Room left to the server on the filesystem of a cache directory.",
        "gauge",
    );
    for (dir, fs) in &found {
        w.sample("overspill_cache_filesystem_avail_bytes", &[("dir", dir.clone())], bytes(fs.blocks_available(), fs));
    }
}

/// One family per shared read-cache figure, a series per golden image.
fn read_cache_figures(w: &mut Writer, caches: &[CacheEntry]) {
    type CacheGetter = fn(&ReadCacheStats) -> u64;
    let figures: [(&str, &str, &str, CacheGetter); 9] = [
        ("overspill_read_cache_hits_total", "Chunk lookups served from the shared read cache.", "counter", |c| {
            c.hits.get()
        }),
        (
            "overspill_read_cache_misses_total",
            "Chunk lookups that went to the golden image's storage.",
            "counter",
            |c| c.misses.get(),
        ),
        (
            "overspill_read_cache_coalesced_total",
            "Misses that waited for another VM's fetch of the same chunk.",
            "counter",
            |c| c.coalesced.get(),
        ),
        (
            "overspill_read_cache_fetched_bytes_total",
            "Bytes fetched from the golden image's storage.",
            "counter",
            |c| c.fetched_bytes.get(),
        ),
        ("overspill_read_cache_fetches_total", "Chunks fetched from the golden image's storage.", "counter", |c| {
            c.fetched_chunks.get()
        }),
        ("overspill_read_cache_evictions_total", "Chunks evicted from the shared read cache.", "counter", |c| {
            c.evictions.get()
        }),
        ("overspill_read_cache_cached_bytes", "Bytes held by the shared read cache.", "gauge", |c| {
            c.cached_bytes.get()
        }),
        ("overspill_read_cache_capacity_bytes", "Capacity of the shared read cache.", "gauge", |c| {
            c.capacity_bytes.get()
        }),
        (
            "overspill_read_cache_resident_bytes",
            "Memory mapped for the shared read cache's chunks: cached, being copied out, free slots and the slab made ready.",
            "gauge",
            |c| c.resident_bytes.get(),
        ),
    ];
    let labels = unique_labels(caches);
    for (family, help, kind, get) in figures {
        w.header(family, help, kind);
        for (export, (_, _, stats)) in labels.iter().zip(caches) {
            w.sample(family, &[("export", export.clone())], get(stats) as f64);
        }
    }
    // What each export reads from, the whole chain of a layered image included: which file a
    // VM's blocks come from should not need the log.
    let family = "overspill_golden_image_info";
    w.header(family, "The golden image behind each shared read cache (file, format and the layers under it).", "gauge");
    for (export, (_, source, _)) in labels.iter().zip(caches) {
        w.sample(family, &[("export", export.clone()), ("source", source.clone())], 1.0);
    }
}

/// The caches' export labels, each once: a version whose file was replaced under the same name
/// (a number given again by hand) has two caches while VMs still use the old one, and a series
/// twice in one scrape is refused by Prometheus. Later ones get `#2`, `#3`.
fn unique_labels(caches: &[CacheEntry]) -> Vec<String> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    caches
        .iter()
        .map(|(export, _, _)| {
            let times = seen.entry(export.as_str()).or_insert(0);
            *times += 1;
            if *times == 1 {
                export.clone()
            } else {
                format!("{export} #{times}")
            }
        })
        .collect()
}

fn help_of(family: &str) -> &'static str {
    FIGURES.iter().find(|f| f.family == family && !f.help.is_empty()).map_or("", |f| f.help)
}

/// The standard process_* figures, from /proc/self.
fn process_figures(w: &mut Writer) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = 100.0; // USER_HZ on Linux
    let cpu =
        fields.get(11).zip(fields.get(12)).and_then(|(u, s)| Some(u.parse::<f64>().ok()? + s.parse::<f64>().ok()?));
    if let Some(cpu) = cpu {
        w.header("process_cpu_seconds_total", "User and system CPU time spent, in seconds.", "counter");
        w.sample("process_cpu_seconds_total", &[], cpu / ticks);
    }
    if let Some(rss_pages) = fields.get(21).and_then(|v| v.parse::<f64>().ok()) {
        w.header("process_resident_memory_bytes", "Resident memory size in bytes.", "gauge");
        w.sample("process_resident_memory_bytes", &[], rss_pages * 4096.0);
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        w.header("process_open_fds", "Number of open file descriptors.", "gauge");
        w.sample("process_open_fds", &[], fds.count() as f64);
    }
    let uptime = START.get_or_init(SystemTime::now);
    if let Ok(since_epoch) = uptime.duration_since(UNIX_EPOCH) {
        w.header("process_start_time_seconds", "Start time of the process since the Unix epoch, in seconds.", "gauge");
        w.sample("process_start_time_seconds", &[], since_epoch.as_secs_f64());
    }
}

static START: std::sync::OnceLock<SystemTime> = std::sync::OnceLock::new();

/// HTTP connections served at once; more are closed as they come until some end.
const MAX_HTTP_CLIENTS: usize = 128;
/// The longest an HTTP connection lives, however it behaves: a client that sends requests and
/// never reads the answers holds its slot no longer than this (Prometheus's scrape timeout
/// defaults to 10 s).
const HTTP_CLIENT_LIFETIME: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's header.
const HTTP_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// What the endpoint answers from.
struct Endpoint {
    registry: Arc<VmRegistry>,
    read_caches: Arc<ReadCacheList>,
    host: Arc<HostMemory>,
    protocol: Arc<ProtocolCounters>,
    cache_dirs: Vec<std::path::PathBuf>,
}

impl Endpoint {
    fn answer(&self, request: &hyper::Request<hyper::body::Incoming>) -> hyper::Response<Full<Bytes>> {
        let accept = request.headers().get(hyper::header::ACCEPT).and_then(|value| value.to_str().ok());
        let (status, body, content_type) = match request.uri().path() {
            "/metrics" => {
                let format = Format::from_accept(accept);
                let body = render(
                    &self.registry,
                    &self.read_caches.live(),
                    &self.host,
                    &self.protocol,
                    &self.cache_dirs,
                    format,
                );
                (hyper::StatusCode::OK, body, format.content_type())
            }
            "/healthz" => (hyper::StatusCode::OK, "ok\n".to_owned(), "text/plain; charset=utf-8"),
            _ => (
                hyper::StatusCode::NOT_FOUND,
                "not found: try /metrics or /healthz\n".to_owned(),
                "text/plain; charset=utf-8",
            ),
        };
        let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
        response
    }
}

/// Serves `/metrics` and `/healthz` on `addr` from a thread of its own, each HTTP connection a
/// task of that thread's event loop: a client that never reads its answers (1,000 pipelined
/// requests, say) stalls only its own connection, for at most [`HTTP_CLIENT_LIFETIME`], and no
/// health check waits behind it.
pub fn spawn_endpoint(
    addr: &str,
    registry: Arc<VmRegistry>,
    read_caches: Arc<ReadCacheList>,
    host: Arc<HostMemory>,
    protocol: Arc<ProtocolCounters>,
    cache_dirs: Vec<std::path::PathBuf>,
) -> anyhow::Result<String> {
    START.get_or_init(SystemTime::now);
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("metrics endpoint on {addr}"))?;
    listener.set_nonblocking(true).with_context(|| format!("metrics endpoint on {addr}"))?;
    let bound = listener.local_addr().with_context(|| format!("metrics endpoint on {addr}"))?.to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .context("starting the metrics endpoint's event loop")?;
    let endpoint = Arc::new(Endpoint { registry, read_caches, host, protocol, cache_dirs });
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        runtime.block_on(async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => serve_http(listener, endpoint).await,
                Err(error) => tracing::error!(%error, "metrics endpoint stopped"),
            }
        })
    })?;
    Ok(bound)
}

async fn serve_http(listener: tokio::net::TcpListener, endpoint: Arc<Endpoint>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CLIENTS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of descriptors, most likely: the NBD side needs them more; try again soon.
                tracing::debug!(%error, "metrics endpoint could not accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!("metrics endpoint full: a connection closed unanswered");
            continue;
        };
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let response = endpoint.answer(&request);
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HTTP_HEADER_TIMEOUT);
            let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            match tokio::time::timeout(HTTP_CLIENT_LIFETIME, connection).await {
                Ok(Err(error)) => tracing::debug!(%error, "metrics client went away"),
                Err(_) => tracing::debug!("metrics client held its connection too long: closed"),
                Ok(Ok(())) => {}
            }
            drop(slot);
        });
    }
}

/// How long `overspill stat` waits for the endpoint.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_two_caches_share_is_told_apart() {
        let stats = Arc::new(ReadCacheStats::default());
        let cache = |label: &str| (label.to_owned(), "source".to_owned(), stats.clone());
        let caches = [cache("win7:v2"), cache("win7:v3"), cache("win7:v2"), cache("win7:v2")];
        assert_eq!(unique_labels(&caches), ["win7:v2", "win7:v3", "win7:v2 #2", "win7:v2 #3"]);
    }
}
