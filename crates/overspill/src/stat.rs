//! `overspill stat`: a live view of a server's `/metrics`, like top(1): the server (version,
//! uptime, VMs, cache memory against cap and floor, read cache, errors) above one line per VM
//! (IOPS per tier, cache memory and disk), sortable, redrawn in place on the terminal's
//! alternate screen. It rides through server restarts, and prints one view as text or JSON
//! with `--once`.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use crossterm::{cursor, execute, queue, style, terminal};
use serde::Serialize;

use crate::metrics::SCRAPE_TIMEOUT;

/// `--interval`: seconds from 0.1 to a day (`inf` or `1e20` panicked at the first refresh).
fn parse_interval(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(seconds) if (0.1..=86_400.0).contains(&seconds) => Ok(seconds),
        _ => Err(format!("{s:?}: a number of seconds from 0.1 to 86400")),
    }
}

#[derive(Debug, Args)]
pub struct StatArgs {
    /// The server's metrics endpoint (serve --metrics).
    #[arg(long, default_value = "http://127.0.0.1:10810/metrics")]
    url: String,
    /// Seconds between refreshes (0.1 to a day).
    #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
    interval: f64,
    /// Print one view (rates over one interval) and exit.
    #[arg(long)]
    once: bool,
    /// With --once: the view as JSON, for scripts.
    #[arg(long, requires = "once")]
    json: bool,
    /// The column VMs are sorted by (keys n r w g s m d switch it; again reverses).
    #[arg(long, value_enum, default_value_t = SortKey::Write)]
    sort: SortKey,
}

/// `(family, labels)` → value.
pub type Samples = BTreeMap<(String, BTreeMap<String, String>), f64>;

fn fetch(url: &str) -> anyhow::Result<String> {
    let rest = url.strip_prefix("http://").context("only http:// URLs")?;
    let (host, path) = rest.split_once('/').map_or((rest, "/"), |(h, p)| (h, p));
    let path = if path.starts_with('/') { path.to_owned() } else { format!("/{path}") };
    let mut stream = TcpStream::connect(host).with_context(|| format!("connecting to {host}"))?;
    stream.set_read_timeout(Some(SCRAPE_TIMEOUT))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").context("malformed HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("{url}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

/// Parses the Prometheus text format's sample lines (enough for the server's own output).
pub fn parse(text: &str) -> Samples {
    let mut samples = Samples::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, parse_labels(rest.trim_end_matches('}'))),
            None => (series, BTreeMap::new()),
        };
        samples.insert((name.to_owned(), labels), value);
    }
    samples
}

fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, other)) => value.push(other),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(key.trim_start_matches(',').to_owned(), value);
        rest = &after[end..];
    }
    labels
}

/// The sum of a family's series whose labels include `labels`.
fn get(samples: &Samples, family: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|((name, l), _)| {
            name == family && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| v)
        .sum()
}

fn label_of(samples: &Samples, family: &str, label: &str) -> Option<String> {
    samples.keys().find(|(name, _)| name == family).and_then(|(_, l)| l.get(label).cloned())
}

/// Two scrapes of the same server process, `seconds` apart; rates come from their difference.
struct Interval<'a> {
    before: &'a Samples,
    after: &'a Samples,
    seconds: f64,
}

impl Interval<'_> {
    fn rate(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        if self.seconds <= 0.0 {
            return 0.0;
        }
        ((get(self.after, family, labels) - get(self.before, family, labels)) / self.seconds).max(0.0)
    }

    fn level(&self, family: &str, labels: &[(&str, &str)]) -> u64 {
        get(self.after, family, labels) as u64
    }
}

/// One line of the table: a VM, or the whole server.
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    pub export: String,
    pub vm: String,
    pub reads_per_second: f64,
    pub writes_per_second: f64,
    pub golden_reads_per_second: f64,
    pub spill_reads_per_second: f64,
    pub spill_writes_per_second: f64,
    /// Reads and writes of cache files (local tier, shared differencing file).
    pub file_ops_per_second: f64,
    pub cache_memory_bytes: u64,
    pub cache_memory_target_bytes: u64,
    pub cache_disk_bytes: u64,
    pub cache_disk_size_bytes: u64,
    /// Time its requests waited for its limits (`vm limit`, `--limit-iops`), seconds a second:
    /// the requests waiting there on average.
    pub throttled_seconds_per_second: f64,
    /// Its requests waiting for its limits now.
    pub throttled_requests: u64,
}

impl Line {
    fn measure(interval: &Interval, prefix: &str, export: &str, vm: &str, labels: &[(&str, &str)]) -> Self {
        let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&str, &str)> {
            labels.iter().chain(extra).copied().collect()
        };
        let family = |name: &str| format!("{prefix}{name}");
        let rate = |name: &str, extra: &[(&'static str, &'static str)]| interval.rate(&family(name), &with(extra));
        let level = |name: &str| interval.level(&family(name), labels);
        Self {
            export: export.to_owned(),
            vm: vm.to_owned(),
            reads_per_second: rate("guest_requests_total", &[("op", "read")]),
            writes_per_second: rate("guest_requests_total", &[("op", "write")]),
            golden_reads_per_second: rate("storage_ops_total", &[("tier", "golden")]),
            spill_reads_per_second: rate("storage_ops_total", &[("tier", "spill"), ("direction", "read")]),
            spill_writes_per_second: rate("storage_ops_total", &[("tier", "spill"), ("direction", "write")]),
            file_ops_per_second: rate("storage_ops_total", &[("tier", "cache_file")])
                + rate("storage_ops_total", &[("tier", "shared")]),
            cache_memory_bytes: level("cache_memory_used_bytes"),
            cache_memory_target_bytes: level("cache_memory_target_bytes"),
            cache_disk_bytes: level("cache_disk_used_bytes"),
            cache_disk_size_bytes: level("cache_disk_size_bytes"),
            // Limits are kept by VM name, whatever the image.
            throttled_seconds_per_second: interval.rate("overspill_vm_throttled_seconds_total", &[("vm", vm)]),
            throttled_requests: interval.level("overspill_vm_throttled_requests", &[("vm", vm)]),
        }
    }

    fn title(&self) -> String {
        if self.vm.is_empty() {
            return self.export.clone();
        }
        format!("{}@{}", if self.export.is_empty() { "default" } else { &self.export }, self.vm)
    }
}

/// The server as a whole.
#[derive(Debug, Clone, Serialize)]
pub struct Server {
    pub version: String,
    pub commit: String,
    pub uptime_seconds: f64,
    pub vms_connected: u64,
    pub vms_in_grace: u64,
    pub vms_lost: u64,
    pub vms_booting: u64,
    pub vms_waiting_to_boot: u64,
    pub cache_memory_bytes: u64,
    pub cache_memory_cap_bytes: u64,
    pub memory_floor_bytes: u64,
    pub memory_available_bytes: Option<u64>,
    pub read_cache_bytes: u64,
    pub read_cache_capacity_bytes: u64,
    /// Lookups served from the read cache over the interval (over the server's life when
    /// there were none).
    pub read_cache_hit_ratio: Option<f64>,
    pub errors_total: u64,
    pub errors_per_second: f64,
    pub refused_total: u64,
}

/// Everything one view shows.
#[derive(Debug, Clone, Serialize)]
pub struct View {
    pub url: String,
    pub seconds: f64,
    pub server: Server,
    pub vms: Vec<Line>,
    pub total: Line,
}

impl View {
    /// The view between two scrapes of one server process (`seconds` 0: levels only).
    pub fn between(url: &str, before: &Samples, after: &Samples, seconds: f64) -> Self {
        let interval = Interval { before, after, seconds };
        let mut vms: Vec<(String, String)> = after
            .keys()
            .filter(|(name, _)| name == "overspill_vm_cache_memory_used_bytes")
            .filter_map(|(_, l)| Some((l.get("export")?.clone(), l.get("vm")?.clone())))
            .collect();
        vms.sort();
        vms.dedup();
        let lines: Vec<Line> = vms
            .iter()
            .map(|(e, v)| Line::measure(&interval, "overspill_vm_", e, v, &[("export", e), ("vm", v)]))
            .collect();
        let mut total = Line::measure(&interval, "overspill_", "total", "", &[]);
        total.throttled_seconds_per_second = lines.iter().map(|l| l.throttled_seconds_per_second).sum();
        total.throttled_requests = lines.iter().map(|l| l.throttled_requests).sum();
        let start = get(after, "process_start_time_seconds", &[]);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let (hits, misses) = ("overspill_read_cache_hits_total", "overspill_read_cache_misses_total");
        let lookups = interval.rate(hits, &[]) + interval.rate(misses, &[]);
        let hit_ratio = if lookups > 0.0 {
            Some(interval.rate(hits, &[]) / lookups)
        } else {
            let all = get(after, hits, &[]) + get(after, misses, &[]);
            (all > 0.0).then(|| get(after, hits, &[]) / all)
        };
        let available = after.keys().any(|(name, _)| name == "overspill_host_memory_available_bytes");
        let in_grace = interval.level("overspill_vms", &[("state", "in-grace")]);
        let server = Server {
            version: label_of(after, "overspill_build_info", "version").unwrap_or_default(),
            commit: label_of(after, "overspill_build_info", "commit").unwrap_or_default(),
            uptime_seconds: if start > 0.0 { (now - start).max(0.0) } else { 0.0 },
            // `overspill_connected_vms` counts every VM with an overlay, those in grace too.
            vms_connected: interval.level("overspill_connected_vms", &[]).saturating_sub(in_grace),
            vms_in_grace: in_grace,
            vms_lost: interval.level("overspill_vms", &[("state", "lost")]),
            vms_booting: interval.level("overspill_vms_booting", &[]),
            vms_waiting_to_boot: interval.level("overspill_vms_waiting_to_boot", &[]),
            cache_memory_bytes: interval.level("overspill_host_cache_memory_used_bytes", &[]),
            cache_memory_cap_bytes: interval.level("overspill_host_cache_memory_cap_bytes", &[]),
            memory_floor_bytes: interval.level("overspill_host_memory_floor_bytes", &[]),
            memory_available_bytes: available.then(|| interval.level("overspill_host_memory_available_bytes", &[])),
            read_cache_bytes: interval.level("overspill_read_cache_cached_bytes", &[]),
            read_cache_capacity_bytes: interval.level("overspill_read_cache_capacity_bytes", &[]),
            read_cache_hit_ratio: hit_ratio,
            errors_total: interval.level("overspill_nbd_error_replies_total", &[]),
            errors_per_second: interval.rate("overspill_nbd_error_replies_total", &[]),
            refused_total: interval.level("overspill_nbd_refused_connections_total", &[]),
        };
        Self { url: url.to_owned(), seconds, server, vms: lines, total }
    }
}

/// What the table is sorted by; every column but the name sorts largest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SortKey {
    Name,
    Read,
    Write,
    Golden,
    Spill,
    Memory,
    Disk,
}

impl SortKey {
    fn from_key(c: char) -> Option<Self> {
        Some(match c {
            'n' => Self::Name,
            'r' => Self::Read,
            'w' => Self::Write,
            'g' => Self::Golden,
            's' => Self::Spill,
            'm' => Self::Memory,
            'd' => Self::Disk,
            _ => return None,
        })
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Name => "name",
            Self::Read => "reads",
            Self::Write => "writes",
            Self::Golden => "golden reads",
            Self::Spill => "spill I/O",
            Self::Memory => "memory",
            Self::Disk => "disk",
        }
    }

    fn sort(self, lines: &mut [Line], reversed: bool) {
        let figure = |l: &Line| match self {
            Self::Name => 0.0,
            Self::Read => l.reads_per_second,
            Self::Write => l.writes_per_second,
            Self::Golden => l.golden_reads_per_second,
            Self::Spill => l.spill_reads_per_second + l.spill_writes_per_second,
            Self::Memory => l.cache_memory_bytes as f64,
            Self::Disk => l.cache_disk_bytes as f64,
        };
        lines.sort_by(|a, b| {
            let order = if self == Self::Name {
                a.title().cmp(&b.title())
            } else {
                figure(b).total_cmp(&figure(a)).then_with(|| a.title().cmp(&b.title()))
            };
            if reversed {
                order.reverse()
            } else {
                order
            }
        });
    }
}

/// How the table is laid out and what the screen says beside the view.
#[derive(Debug, Clone)]
pub struct Layout {
    pub width: usize,
    /// Lines available; `None` draws every VM.
    pub height: Option<usize>,
    pub sort: SortKey,
    pub reversed: bool,
    /// Keys and sort order at the bottom (the interactive view).
    pub footer: bool,
}

/// Columns after the VM's name: READ/s WRITE/s GOLD/s SPL-R SPL-W MEMORY DISK WAIT.
const FIGURES_WIDTH: usize = 61;

/// A rate in at most `width` characters: one decimal while small, then k and M.
fn compact_rate(rate: f64) -> String {
    match rate {
        r if r < 10.0 && r.fract() != 0.0 => format!("{r:.1}"),
        r if r < 100_000.0 => format!("{r:.0}"),
        r if r < 100_000_000.0 => format!("{:.0}k", r / 1e3),
        r => format!("{:.0}M", r / 1e6),
    }
}

/// Bytes in at most 6 characters (binary units).
fn compact_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "K", "M", "G", "T", "P"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else if value < 10.0 {
        format!("{value:.1}{}", UNITS[unit])
    } else {
        format!("{value:.0}{}", UNITS[unit])
    }
}

fn uptime(seconds: f64) -> String {
    let s = seconds as u64;
    let (days, hours, minutes) = (s / 86_400, s / 3600 % 24, s / 60 % 60);
    if days > 0 {
        format!("{days}d {hours:02}:{minutes:02}")
    } else {
        format!("{hours:02}:{minutes:02}:{:02}", s % 60)
    }
}

/// Cuts `text` to `width` characters, ending in `…` when cut.
fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

fn table_row(name: &str, name_width: usize, cells: [String; 8]) -> String {
    let [read, write, golden, spill_r, spill_w, memory, disk, wait] = cells;
    format!(
        "{:<name_width$} {read:>7} {write:>7} {golden:>6} {spill_r:>6} {spill_w:>6} {memory:>8} {disk:>8} {wait:>5}",
        fit(name, name_width)
    )
}

fn line_cells(l: &Line) -> [String; 8] {
    [
        compact_rate(l.reads_per_second),
        compact_rate(l.writes_per_second),
        compact_rate(l.golden_reads_per_second),
        compact_rate(l.spill_reads_per_second),
        compact_rate(l.spill_writes_per_second),
        compact_bytes(l.cache_memory_bytes),
        compact_bytes(l.cache_disk_bytes),
        compact_rate(l.throttled_seconds_per_second),
    ]
}

/// The server's lines above the table.
fn header(view: &View, now: &str, width: usize) -> Vec<String> {
    let s = &view.server;
    let commit = if s.commit.is_empty() { String::new() } else { format!(" ({})", s.commit) };
    let available = s.memory_available_bytes.map_or(String::new(), |a| format!(", free {}", compact_bytes(a)));
    let hit = s.read_cache_hit_ratio.map_or("-".to_owned(), |r| format!("{:.1}%", r * 100.0));
    let booting = match (s.vms_booting, s.vms_waiting_to_boot) {
        (0, 0) => String::new(),
        (booting, 0) => format!(", {booting} booting"),
        (booting, waiting) => format!(", {booting} booting ({waiting} wait)"),
    };
    let cap = if s.cache_memory_cap_bytes >= u64::MAX / 2 {
        "no cap".to_owned()
    } else {
        format!("cap {}", compact_bytes(s.cache_memory_cap_bytes))
    };
    vec![
        format!("overspill {}{commit}  up {}  {now}", s.version, uptime(s.uptime_seconds)),
        format!(
            "VMs {} connected, {} in grace, {} lost{booting}   errors {} ({}/s)   refused {}",
            s.vms_connected,
            s.vms_in_grace,
            s.vms_lost,
            s.errors_total,
            compact_rate(s.errors_per_second),
            s.refused_total
        ),
        format!(
            "memory {} of {cap}   floor {}{available}",
            compact_bytes(s.cache_memory_bytes),
            compact_bytes(s.memory_floor_bytes)
        ),
        format!(
            "read cache {} of {}, hit {hit}   {}",
            compact_bytes(s.read_cache_bytes),
            compact_bytes(s.read_cache_capacity_bytes),
            view.url
        ),
    ]
    .into_iter()
    .map(|l| fit(&l, width))
    .collect()
}

/// The whole screen, one string per line, none wider than `layout.width`.
pub fn render(view: &View, layout: &Layout, now: &str) -> Vec<String> {
    let width = layout.width.max(40);
    let name_width = width.saturating_sub(FIGURES_WIDTH).clamp(12, 48);
    let mut out = header(view, now, width);
    out.push(String::new());
    let columns = ["READ/s", "WRITE/s", "GOLD/s", "SPL-R", "SPL-W", "MEMORY", "DISK", "WAIT"].map(str::to_owned);
    out.push(fit(&table_row("VM", name_width, columns), width));
    let mut lines = view.vms.clone();
    layout.sort.sort(&mut lines, layout.reversed);
    let fixed = out.len() + 1 + usize::from(layout.footer);
    let room = layout.height.map_or(usize::MAX, |h| h.saturating_sub(fixed));
    let shown = if lines.len() > room { room.saturating_sub(1) } else { lines.len() };
    for line in &lines[..shown] {
        out.push(fit(&table_row(&line.title(), name_width, line_cells(line)), width));
    }
    if shown < lines.len() {
        out.push(format!("… {} more VMs", lines.len() - shown));
    }
    out.push(fit(&table_row("total", name_width, line_cells(&view.total)), width));
    if layout.footer {
        let order = if layout.reversed { "reversed" } else { "" };
        let footer = format!("q quit   sort: n r w g s m d (again: reverse)   by {} {order}", layout.sort.describe());
        out.push(fit(footer.trim_end(), width));
    }
    out
}

fn clock() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("{:02}:{:02}:{:02} UTC", secs / 3600 % 24, secs / 60 % 60, secs % 60)
}

/// A scrape and when it was taken.
struct Scrape {
    samples: Samples,
    taken: Instant,
}

impl Scrape {
    fn take(url: &str) -> anyhow::Result<Self> {
        Ok(Self { samples: parse(&fetch(url)?), taken: Instant::now() })
    }

    fn start_time(&self) -> f64 {
        get(&self.samples, "process_start_time_seconds", &[])
    }

    /// The view since `earlier`, unless the server restarted in between (its counters began
    /// again): then levels only, rates from the next refresh.
    fn view_since(&self, url: &str, earlier: Option<&Scrape>) -> View {
        match earlier.filter(|e| e.start_time() == self.start_time()) {
            Some(e) => View::between(url, &e.samples, &self.samples, self.taken.duration_since(e.taken).as_secs_f64()),
            None => View::between(url, &self.samples, &self.samples, 0.0),
        }
    }
}

pub fn run(args: StatArgs) -> anyhow::Result<()> {
    let interval = Duration::from_secs_f64(args.interval);
    let layout = Layout { width: 80, height: None, sort: args.sort, reversed: false, footer: false };
    if args.once {
        let first = Scrape::take(&args.url)?;
        std::thread::sleep(interval);
        let view = Scrape::take(&args.url)?.view_since(&args.url, Some(&first));
        if args.json {
            println!("{}", serde_json::to_string_pretty(&view)?);
        } else {
            println!("{}", render(&view, &layout, &clock()).join("\n"));
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        return batch(&args.url, interval, &layout);
    }
    Screen::enter()?.run(&args.url, interval, Layout { footer: true, ..layout })
}

/// Not on a terminal: one view after another, like `top -b`.
fn batch(url: &str, interval: Duration, layout: &Layout) -> anyhow::Result<()> {
    let mut last: Option<Scrape> = None;
    loop {
        match Scrape::take(url) {
            Ok(scrape) => {
                let view = scrape.view_since(url, last.as_ref());
                println!("{}\n", render(&view, layout, &clock()).join("\n"));
                last = Some(scrape);
            }
            Err(error) => println!("{} {url}: unreachable ({error:#}); trying again\n", clock()),
        }
        std::io::stdout().flush()?;
        std::thread::sleep(interval);
    }
}

/// The terminal in full-screen mode for as long as this lives; restored however `run` ends.
struct Screen {
    out: std::io::Stdout,
}

impl Screen {
    fn enter() -> anyhow::Result<Self> {
        let mut out = std::io::stdout();
        terminal::enable_raw_mode().context("putting the terminal in raw mode")?;
        execute!(out, terminal::EnterAlternateScreen, cursor::Hide)?;
        Ok(Self { out })
    }

    fn run(mut self, url: &str, interval: Duration, mut layout: Layout) -> anyhow::Result<()> {
        let mut last: Option<Scrape> = None;
        loop {
            let shown = match Scrape::take(url) {
                Ok(scrape) => {
                    let view = scrape.view_since(url, last.as_ref());
                    last = Some(scrape);
                    Ok(view)
                }
                Err(error) => {
                    // A server that comes back is a new process: no rates across the gap.
                    last = None;
                    Err(format!("{url}: unreachable ({error:#}); trying again every {interval:?}"))
                }
            };
            let next = Instant::now() + interval;
            self.draw(&shown, &layout)?;
            while let Some(wait) = next.checked_duration_since(Instant::now()) {
                if !event::poll(wait)? {
                    break;
                }
                match event::read()? {
                    Event::Key(key) => match Self::key(key) {
                        Some(Key::Quit) => return Ok(()),
                        Some(Key::Sort(sort)) => {
                            layout.reversed = layout.sort == sort && !layout.reversed;
                            layout.sort = sort;
                        }
                        None => continue,
                    },
                    Event::Resize(..) => {}
                    _ => continue,
                }
                self.draw(&shown, &layout)?;
            }
        }
    }

    fn key(key: KeyEvent) -> Option<Key> {
        if key.kind == KeyEventKind::Release {
            return None;
        }
        match key.code {
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Some(Key::Quit),
            KeyCode::Char('q' | 'Q') | KeyCode::Esc => Some(Key::Quit),
            KeyCode::Char(c) => SortKey::from_key(c.to_ascii_lowercase()).map(Key::Sort),
            _ => None,
        }
    }

    fn draw(&mut self, shown: &Result<View, String>, layout: &Layout) -> anyhow::Result<()> {
        let (columns, rows) = terminal::size().unwrap_or((80, 24));
        let layout = Layout { width: usize::from(columns), height: Some(usize::from(rows)), ..layout.clone() };
        let lines = match shown {
            Ok(view) => render(view, &layout, &clock()),
            Err(message) => vec![
                fit(&format!("overspill stat  {}", clock()), layout.width),
                String::new(),
                fit(message, layout.width),
            ],
        };
        queue!(self.out, cursor::MoveTo(0, 0))?;
        for (row, line) in lines.iter().take(usize::from(rows)).enumerate() {
            queue!(
                self.out,
                cursor::MoveTo(0, row as u16),
                style::Print(line),
                terminal::Clear(terminal::ClearType::UntilNewLine)
            )?;
        }
        queue!(self.out, terminal::Clear(terminal::ClearType::FromCursorDown))?;
        self.out.flush()?;
        Ok(())
    }
}

enum Key {
    Quit,
    Sort(SortKey),
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = execute!(self.out, cursor::Show, terminal::LeaveAlternateScreen);
        let _ = terminal::disable_raw_mode();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_with_escapes() {
        let s = parse("# HELP x y\nx{a=\"1\",b=\"q\\\"uo\\\\te\"} 3\ny 4.5\n");
        let labels: BTreeMap<String, String> =
            [("a".to_owned(), "1".to_owned()), ("b".to_owned(), "q\"uo\\te".to_owned())].into();
        assert_eq!(s.get(&("x".to_owned(), labels)), Some(&3.0));
        assert_eq!(s.get(&("y".to_owned(), BTreeMap::new())), Some(&4.5));
    }

    fn vm_samples(vm: &str, writes: f64, memory: f64) -> String {
        format!(
            "overspill_vm_guest_requests_total{{export=\"\",vm=\"{vm}\",op=\"write\"}} {writes}\n\
             overspill_vm_cache_memory_used_bytes{{export=\"\",vm=\"{vm}\"}} {memory}\n"
        )
    }

    fn two_vms(long_name: &str) -> (Samples, Samples) {
        let before = parse(&(vm_samples("a", 0.0, 0.0) + &vm_samples(long_name, 0.0, 0.0)));
        let after = parse(
            &(vm_samples("a", 10.0, 1e9)
                + &vm_samples(long_name, 12_345_678.0, 5e12)
                + "overspill_vm_throttled_seconds_total{vm=\"a\"} 2.5\n\
                   overspill_vms_booting 3\n\
                   overspill_vms_waiting_to_boot 2\n\
                   overspill_build_info{version=\"1.2.3\",commit=\"abcdef0\",features=\"s3\"} 1\n\
                   overspill_guest_requests_total{op=\"write\"} 12345688\n\
                   overspill_host_cache_memory_cap_bytes 1.8446744073709552e19\n\
                   overspill_nbd_error_replies_total{command=\"write\",errno=\"ENOSPC\"} 7\n"),
        );
        (before, after)
    }

    #[test]
    fn every_line_fits_80_columns_whatever_the_names_and_figures() {
        let long = "x".repeat(64);
        let (before, after) = two_vms(&long);
        let view = View::between("http://127.0.0.1:10810/metrics", &before, &after, 1.0);
        let layout = Layout { width: 80, height: Some(24), sort: SortKey::Write, reversed: false, footer: true };
        let lines = render(&view, &layout, "12:00:00 UTC");
        for line in &lines {
            assert!(line.chars().count() <= 80, "{} columns: {line}", line.chars().count());
        }
        let text = lines.join("\n");
        assert!(text.contains("overspill 1.2.3 (abcdef0)") && text.contains("errors 7"), "{text}");
        assert!(text.contains("no cap"), "an unlimited cap is said so: {text}");
        // Sorted by writes: the busy VM first, then the quiet one, then the total.
        let busy = lines.iter().position(|l| l.starts_with("default@xxx")).expect("busy VM");
        let quiet = lines.iter().position(|l| l.starts_with("default@a ")).expect("quiet VM");
        assert!(busy < quiet, "{text}");
        assert!(lines[busy].contains("12346k"), "{}", lines[busy]);
        assert!(lines[quiet + 1].starts_with("total"), "{text}");
        // The quiet VM waited 2.5 s a second for its limits; 3 VMs boot, 2 wait to.
        assert!(lines[quiet].ends_with(" 2.5") && lines[quiet + 1].ends_with(" 2.5"), "{text}");
        assert!(text.contains("3 booting (2 wait)"), "{text}");
    }

    #[test]
    fn sorting_by_name_and_reversing() {
        let (before, after) = two_vms("zz");
        let view = View::between("u", &before, &after, 1.0);
        let layout = Layout { width: 80, height: None, sort: SortKey::Name, reversed: false, footer: false };
        let order = |layout: &Layout| {
            render(&view, layout, "")
                .into_iter()
                .filter(|l| l.starts_with("default@"))
                .map(|l| l.split_whitespace().next().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&layout), ["default@a", "default@zz"]);
        assert_eq!(order(&Layout { reversed: true, ..layout.clone() }), ["default@zz", "default@a"]);
        assert_eq!(order(&Layout { sort: SortKey::Memory, ..layout }), ["default@zz", "default@a"]);
    }

    /// `overspill_connected_vms` counts VMs in grace too: the view tells them apart.
    #[test]
    fn vms_in_grace_are_not_shown_as_connected() {
        let samples = parse(
            "overspill_connected_vms 3\n\
             overspill_vms{state=\"connected\"} 1\n\
             overspill_vms{state=\"in-grace\"} 2\n\
             overspill_vms{state=\"lost\"} 0\n",
        );
        let view = View::between("u", &samples, &samples, 0.0);
        assert_eq!((view.server.vms_connected, view.server.vms_in_grace), (1, 2));
    }

    #[test]
    fn a_short_screen_says_how_many_vms_it_cannot_show() {
        let text: String = (0..30).map(|i| vm_samples(&format!("vm-{i:02}"), 0.0, 0.0)).collect();
        let samples = parse(&text);
        let view = View::between("u", &samples, &samples, 0.0);
        let layout = Layout { width: 80, height: Some(24), sort: SortKey::Name, reversed: false, footer: true };
        let lines = render(&view, &layout, "");
        assert_eq!(lines.len(), 24, "{lines:#?}");
        assert!(lines.iter().any(|l| l.contains("more VMs")), "{lines:#?}");
        assert!(lines[22].starts_with("total") && lines[23].starts_with("q quit"), "{lines:#?}");
    }

    #[test]
    fn compact_figures() {
        assert_eq!(compact_rate(0.5), "0.5");
        assert_eq!(compact_rate(3.0), "3");
        assert_eq!(compact_rate(99_999.0), "99999");
        assert_eq!(compact_rate(184_600.0), "185k");
        assert_eq!(compact_bytes(0), "0B");
        assert_eq!(compact_bytes(2 << 20), "2.0M");
        assert_eq!(compact_bytes(1000 << 30), "1.0T");
        assert_eq!(uptime(90_061.0), "1d 01:01");
    }
}
