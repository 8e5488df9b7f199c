//! What the docs ship, checked by the tools that will read it: the Grafana dashboard's queries
//! and the alert rules are valid PromQL over metric families the server really exports (promtool,
//! and the server's own exposition code); docs/libvirt-domain.xml is a domain libvirt's schema and
//! parser accept, and docs/operations.md shows its disk.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[test]
fn dashboard_queries_parse_and_name_real_families() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(exprs.len() >= 8);
    // Several hosts scraped at once: every query keeps to the chosen hosts, and none reduces a
    // vector to one number (scalar() is NaN once there are two series).
    for expr in &exprs {
        assert!(!expr.contains("scalar("), "{expr}");
        assert!(expr.contains(r#"instance=~"$instance""#), "{expr} ignores the host variable");
    }
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(variables.contains(&"instance") && variables.contains(&"export"), "{variables:?}");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        rules.push_str(&format!("      - record: dashboard:q{i}\n        expr: '{}'\n", expr.replace('\'', "''")));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rules.yml");
    std::fs::write(&file, rules).expect("write rules");
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("promtool is not installed (apt-get install prometheus): {e}"));
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    assert_real_families(&exprs);
}

/// Every overspill_* name in these queries is a family the exposition writes.
fn assert_real_families(exprs: &[String]) {
    let source = include_str!("../src/metrics.rs");
    for expr in exprs {
        for word in expr.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if let Some(name) = word.strip_prefix("overspill_") {
                let base = name.trim_end_matches("_bucket");
                let family = base.strip_prefix("vm_").unwrap_or(base);
                assert!(
                    source.contains(&format!("\"{family}\"")) || source.contains(&format!("overspill_{base}")),
                    "{word} in {expr}"
                );
            }
        }
    }
}

/// The shipped alert rules load in Prometheus and watch families the server exports.
#[test]
fn alert_rules_check_and_name_real_families() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/overspill-alerts.yml");
    let out = Command::new("promtool")
        .args(["check", "rules", path])
        .output()
        .unwrap_or_else(|e| panic!("promtool is not installed (apt-get install prometheus): {e}"));
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(path).expect("rules");
    let exprs: Vec<String> = text.lines().filter_map(|l| l.trim().strip_prefix("expr: ").map(str::to_owned)).collect();
    assert!(exprs.len() >= 5, "{exprs:?}");
    assert_real_families(&exprs);
}

fn doc_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs").join(name)
}

fn read_doc(name: &str) -> String {
    std::fs::read_to_string(doc_path(name)).unwrap_or_else(|e| panic!("docs/{name}: {e}"))
}

/// The text of the markdown section whose heading starts with `heading`, up to the next heading of
/// the same level.
fn section<'a>(markdown: &'a str, heading: &str) -> &'a str {
    let start = markdown.find(&format!("\n{heading}")).unwrap_or_else(|| panic!("no section {heading:?}")) + 1;
    let rest = &markdown[start..];
    let level = heading.split(' ').next().expect("a heading's #s");
    let end = rest[1..].find(&format!("\n{level} ")).map_or(rest.len(), |i| i + 2);
    &rest[..end]
}

/// The fenced code blocks of `markdown`: (language, text).
fn code_blocks(markdown: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in markdown.lines() {
        match (&mut open, line.trim_start().strip_prefix("```")) {
            (None, Some(lang)) => open = Some((lang.trim().to_owned(), String::new())),
            (Some(_), Some(_)) => blocks.extend(open.take()),
            (Some((_, text)), None) => {
                text.push_str(line);
                text.push('\n');
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "a code block is never closed");
    blocks
}

/// The code blocks of docs/operations.md section 4 ("A VM").
fn vm_recipes() -> Vec<(String, String)> {
    code_blocks(section(&read_doc("operations.md"), "## 4."))
}

/// Lines `first..=last` (by content) of `text`, with the indentation they share removed.
fn dedented_lines(text: &str, first: &str, last: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().position(|l| l.trim_start().starts_with(first)).unwrap_or_else(|| panic!("no {first}"));
    let end = start + lines[start..].iter().position(|l| l.trim() == last).unwrap_or_else(|| panic!("no {last}"));
    let indent =
        lines[start..=end].iter().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min();
    lines[start..=end].iter().map(|l| format!("{}\n", l.get(indent.unwrap_or(0)..).unwrap_or(""))).collect()
}

/// `virt-xml-validate FILE domain`: whether libvirt's schema accepts it, and what it said.
fn virt_xml_validate(file: &Path) -> (bool, String) {
    // virt-xml-validate is a shell script around xmllint: without it every file "fails".
    Command::new("xmllint")
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("xmllint is not installed (apt-get install libxml2-utils; scripts/test does): {e}"));
    let out = Command::new("virt-xml-validate").arg(file).arg("domain").output().unwrap_or_else(|e| {
        panic!("virt-xml-validate is not installed (apt-get install libvirt-clients; scripts/test does): {e}")
    });
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The installed libvirt's version (major, minor), as `virsh --version` reports it.
fn libvirt_version() -> Option<(u32, u32)> {
    let out = Command::new("virsh").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text.trim().split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

/// docs/libvirt-domain.xml is a domain libvirt accepts, keeping every setting of the overspill disk,
/// and docs/operations.md shows exactly its <disk>.
#[test]
fn the_libvirt_domain_validates_and_operations_md_shows_its_disk() {
    let shipped = read_doc("libvirt-domain.xml");
    let disk = dedented_lines(&shipped, "<disk ", "</disk>");
    let shown: Vec<String> = vm_recipes().into_iter().filter(|(lang, _)| lang == "xml").map(|(_, t)| t).collect();
    assert_eq!(
        shown,
        std::slice::from_ref(&disk),
        "docs/operations.md section 4 must show docs/libvirt-domain.xml's <disk>"
    );

    let (valid, said) = virt_xml_validate(&doc_path("libvirt-domain.xml"));
    if !valid {
        if let Some((major, minor)) = libvirt_version().filter(|&v| v < (9, 2)) {
            panic!(
                "libvirt {major}.{minor} predates <reconnect delay=…/> in an NBD source (9.2): install \
                 libvirt-clients from backports (scripts/test does):\n{said}"
            );
        }
    }
    assert!(valid, "virt-xml-validate rejects docs/libvirt-domain.xml:\n{said}");

    // The schema does look at the disk: a wrong value or an unknown attribute in it is refused.
    let dir = tempfile::tempdir().expect("tempdir");
    for (from, to) in [
        ("<reconnect delay='30'/>", "<reconnect delay='x'/>"),
        ("detect_zeroes='unmap'/>", "detect_zeroes='unmap' overspill='yes'/>"),
    ] {
        assert!(shipped.contains(from), "{from} is not in docs/libvirt-domain.xml");
        let broken = dir.path().join("broken.xml");
        std::fs::write(&broken, shipped.replace(from, to)).expect("broken copy");
        let (valid, said) = virt_xml_validate(&broken);
        assert!(!valid, "virt-xml-validate accepts {to} in place of {from}:\n{said}");
    }

    // libvirt's parser (the test driver's, in virsh itself) keeps what the schema allows: a libvirt
    // that silently dropped <reconnect> would give VMs I/O errors on every server restart.
    let out = Command::new("virsh")
        .args(["-c", "test:///default"])
        .arg(format!("define {}; dumpxml vm-17", doc_path("libvirt-domain.xml").display()))
        .output()
        .unwrap_or_else(|e| panic!("virsh is not installed (apt-get install libvirt-clients; scripts/test does): {e}"));
    let dumped = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "virsh define: {dumped}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(dedented_lines(&dumped, "<disk ", "</disk>"), disk, "libvirt's definition of the disk differs");
}
