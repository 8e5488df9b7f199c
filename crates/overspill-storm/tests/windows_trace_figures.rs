//! `scripts/windows-trace-figures`, which docs/planning.md and the Windows workloads quote, on a
//! small export written the way Windows Performance Analyzer writes one (semicolons, a pt-BR
//! locale's decimal commas and thousands dots): each figure it prints is worked out by hand
//! here from the rows below.

use std::process::Command;

const HEADER: &str = "IO Type;Priority;Process (Name);Init Time (s);Complete Time (s);IO Time (µs);\
Disk Service Time (µs);Size (B);Min Offset;Max Offset;QD/I - Queue Depth at Init Time;\
QD/C - Queue Depth at Complete Time;Disk;Count";

/// One request: kind, process, issue time, size in bytes, offset, queue depth at issue.
fn row(kind: &str, process: &str, at: &str, size: &str, offset: u64, depth: u32) -> String {
    format!("{kind};Normal;{process};{at};{at};10,0;10,0;{size};0x{offset:016X};0x{offset:016X};{depth};0;1;1")
}

#[test]
fn the_trace_script_bins_splits_and_counts_as_the_profiles_need() {
    let rows = [
        // Boot: two reads back to back (the second starts where the first ended), a 1 MiB read
        // (thousands dot) over both again, a write, a flush.
        row("Read", "System", "1,000", "4.096", 0, 0),
        row("Read", "System", "1,100", "4.096", 4096, 2),
        row("Read", "svchost.exe", "1,200", "1.048.576", 0, 4),
        row("Write", "System", "1,300", "16.384", 1 << 20, 6),
        row("Flush", "System", "1,400", "0", 0, 0),
        // Logon, from userinit.exe's first request: two reads, the first over the last 16 KiB of
        // the boot's 1 MiB read and the 16 KiB of its write, the second of a block of that write
        // and of the first read; three writes, the second over that boot write; and a process to
        // leave out.
        row("Read", "userinit.exe", "6,500", "32.768", (1 << 20) - 16384, 1),
        row("Write", "explorer.exe", "7,000", "4.096", 1 << 26, 1),
        row("Write", "explorer.exe", "7,100", "4.096", 1 << 20, 1),
        row("Read", "explorer.exe", "7,200", "4.096", (1 << 20) + 4096, 2),
        row("Write", "explorer.exe", "7,250", "200.704", 1 << 27, 3),
        row("Read", "sync.exe", "8,000", "4.096", 1 << 28, 9),
    ];
    let dir = tempfile::tempdir().expect("a temporary directory");
    let trace = dir.path().join("trace.csv");
    std::fs::write(&trace, format!("{HEADER}\n{}\n", rows.join("\n"))).expect("the trace");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/windows-trace-figures");
    let out = Command::new("python3")
        .arg(script)
        .arg(&trace)
        .args(["--without", "sync.exe"])
        .output()
        .unwrap_or_else(|e| panic!("python3 {script}: {e}"));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{script} failed: {}{printed}", String::from_utf8_lossy(&out.stderr));
    let line = |phase: &str| {
        printed
            .lines()
            .find(|l| l.starts_with(&format!("| {phase} |")))
            .unwrap_or_else(|| panic!("no {phase} row in:\n{printed}"))
            .to_owned()
    };
    assert!(printed.contains("boot before userinit.exe's first request (6.5 s)"), "{printed}");
    // Boot: 3 reads and 1 write (0.75 reads); reads 4K twice and one larger at 1,024 KiB
    // (mean (4 + 4 + 1024) / 3 = 344 KiB); one flush per write; depths 0, 2, 4, 6 (median 3,
    // mean 3.0, p90 6); 1 of 3 reads starts where the last ended; nothing was written before;
    // 1,032 KiB read, 256 distinct blocks (1.00 MiB), of the 258 blocks read 2 read before;
    // the reads touch 64 chunks of 16 KiB and 4 of 256 KiB, 1 MiB each: 1.00 of the distinct.
    assert_eq!(
        line("boot"),
        "| boot | 4 in 0.4 s | 0.75 | 4K 0.667, >64K 0.333 at 1024K (mean 344.0 KiB) | 16K 1.000 (mean 16.0 KiB) \
         | 1.000 | 3 / 3.0 / 6 | 0.33 | 0.000 | 0.000 | 1.01 (1.00 distinct) | 0.008 | 1.00 / 1.00 |"
    );
    // Logon: the sync client left out; reads of 32K and 4K (mean 18 KiB), writes of 4K, 4K and
    // 196 KiB (mean 68 KiB); no flush; depths 1, 2, 1, 1, 3 (median 1, mean 1.6, p90 3); no
    // read where the last ended; 1 of 3 writes over the boot's write, both reads of it; 36 KiB
    // read (0.04 MiB), 8 distinct blocks (0.03 MiB), of the 9 blocks read 5 read before (4 by
    // the boot, 1 by the logon's first read); they touch 16 KiB chunks 63 and 64 (32 KiB, 1.00
    // of the distinct) and 256 KiB chunks 3 and 4 (512 KiB, 16.00).
    assert_eq!(
        line("logon"),
        "| logon | 5 in 0.8 s | 0.40 | 4K 0.500, 32K 0.500 (mean 18.0 KiB) | 4K 0.667, >64K 0.333 at 196K (mean 68.0 KiB) \
         | 0.000 | 1 / 1.6 / 3 | 0.00 | 0.333 | 1.000 | 0.04 (0.03 distinct) | 0.556 | 1.00 / 16.00 |"
    );
    // The same requests exported in the other locale give the same figures.
    let en_us: Vec<String> = rows
        .iter()
        .map(|r| {
            // Times, service times and sizes; names and hex offsets stay as they are.
            let numeric = |i: usize| matches!(i, 3..=7);
            let f: Vec<String> = r
                .split(';')
                .enumerate()
                .map(|(i, c)| if numeric(i) { c.replace('.', "").replace(',', ".") } else { c.to_owned() })
                .collect();
            f.join(";")
        })
        .collect();
    let other = dir.path().join("en-us.csv");
    std::fs::write(&other, format!("{HEADER}\n{}\n", en_us.join("\n"))).expect("the trace");
    let out =
        Command::new("python3").arg(script).arg(&other).args(["--without", "sync.exe"]).output().expect("python3");
    let again = String::from_utf8_lossy(&out.stdout);
    assert!(again.contains(&line("boot")) && again.contains(&line("logon")), "{again}");
    // A row that stands for several requests is refused: the figures would be wrong.
    let aggregated = dir.path().join("aggregated.csv");
    let counted = rows[0].replace(";1;1", ";1;2");
    std::fs::write(&aggregated, format!("{HEADER}\n{counted}\n")).expect("the trace");
    let out = Command::new("python3").arg(script).arg(&aggregated).output().expect("python3");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("a row of 2 requests"), "{out:?}");
    // A trace without the process that starts the logon is refused, by name.
    let out = Command::new("python3")
        .arg(script)
        .arg(&trace)
        .args(["--logon-process", "nosuch.exe"])
        .output()
        .expect("python3");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no request of nosuch.exe"));
}
