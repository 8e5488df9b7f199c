//! `overspill stat`: a live terminal view of a server's `/metrics`: IOPS per tier, per VM and in
//! total, cache memory used against target, spill used against size.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

use crate::metrics::SCRAPE_TIMEOUT;
use crate::size::format_bytes;

#[derive(Debug, Args)]
pub struct StatArgs {
    /// The server's metrics endpoint (serve --metrics).
    #[arg(long, default_value = "http://127.0.0.1:9100/metrics")]
    url: String,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Print one view (rates over one interval) and exit.
    #[arg(long)]
    once: bool,
}

/// `(family, labels)` → value.
pub type Samples = BTreeMap<(String, BTreeMap<String, String>), f64>;

/// A line of the view: its title, the labels that select its series, the family prefix.
struct Row<'a> {
    title: String,
    labels: Vec<(&'a str, &'a str)>,
    prefix: &'static str,
}

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

fn get(samples: &Samples, family: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|((name, l), _)| {
            name == family && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| v)
        .sum()
}

/// One line per VM and a total line, with rates between two scrapes.
pub fn view(before: &Samples, after: &Samples, seconds: f64) -> String {
    let mut vms: Vec<(String, String)> = after
        .keys()
        .filter(|(name, _)| name == "overspill_vm_cache_memory_used_bytes")
        .filter_map(|(_, l)| Some((l.get("export")?.clone(), l.get("vm")?.clone())))
        .collect();
    vms.sort();
    let mut out = format!(
        "{:<24} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>23} {:>23}\n",
        "export@vm",
        "guest r/s",
        "guest w/s",
        "golden/s",
        "spill r/s",
        "spill w/s",
        "file io/s",
        "cache memory",
        "cache disk"
    );
    let rows: Vec<Row> = vms
        .iter()
        .map(|(e, v)| Row {
            title: format!("{}@{v}", if e.is_empty() { "default" } else { e }),
            labels: vec![("export", e.as_str()), ("vm", v.as_str())],
            prefix: "overspill_vm_",
        })
        .chain(std::iter::once(Row { title: "total".to_owned(), labels: Vec::new(), prefix: "overspill_" }))
        .collect();
    for Row { title, labels, prefix } in rows {
        let rate = |family: &str, extra: &[(&str, &str)]| {
            let mut all = labels.clone();
            all.extend_from_slice(extra);
            let family = format!("{prefix}{family}");
            ((get(after, &family, &all) - get(before, &family, &all)) / seconds).max(0.0)
        };
        let level = |family: &str| get(after, &format!("{prefix}{family}"), &labels) as u64;
        let file =
            rate("storage_ops_total", &[("tier", "cache_file")]) + rate("storage_ops_total", &[("tier", "shared")]);
        out.push_str(&format!(
            "{:<24} {:>9.0} {:>9.0} {:>9.0} {:>9.1} {:>9.1} {:>9.0} {:>23} {:>23}\n",
            title,
            rate("guest_requests_total", &[("op", "read")]),
            rate("guest_requests_total", &[("op", "write")]),
            rate("storage_ops_total", &[("tier", "golden")]),
            rate("storage_ops_total", &[("tier", "spill"), ("direction", "read")]),
            rate("storage_ops_total", &[("tier", "spill"), ("direction", "write")]),
            file,
            format!(
                "{} / {}",
                format_bytes(level("cache_memory_used_bytes")),
                format_bytes(level("cache_memory_target_bytes"))
            ),
            format!(
                "{} / {}",
                format_bytes(level("cache_disk_used_bytes")),
                format_bytes(level("cache_disk_size_bytes"))
            ),
        ));
    }
    out
}

pub fn run(args: StatArgs) -> anyhow::Result<()> {
    let interval = Duration::from_secs_f64(args.interval.max(0.1));
    let mut before = parse(&fetch(&args.url)?);
    let mut taken = Instant::now();
    loop {
        std::thread::sleep(interval);
        let after = parse(&fetch(&args.url)?);
        let now = Instant::now();
        let text = view(&before, &after, now.duration_since(taken).as_secs_f64());
        if args.once {
            print!("{text}");
            return Ok(());
        }
        // Clear the screen and draw from the top, like top(1).
        print!("\x1b[2J\x1b[H{} — {}\n\n{text}", args.url, chrono_free_time());
        std::io::stdout().flush()?;
        before = after;
        taken = now;
    }
}

fn chrono_free_time() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("{:02}:{:02}:{:02} UTC", secs / 3600 % 24, secs / 60 % 60, secs % 60)
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
}
