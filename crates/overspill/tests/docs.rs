//! What the docs ship, checked by the tools that will read it: the Grafana dashboard's queries
//! and the alert rules are valid PromQL over metric families the server really exports (promtool,
//! and the server's own exposition code); docs/libvirt-domain.xml is a domain libvirt's schema and
//! parser accept, and docs/operations.md shows its disk; the QEMU command line and the Proxmox VE
//! `args:` line in docs/operations.md, run by a real QEMU against a real `overspill serve`, open
//! the VM's disk.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::qmp::Qmp;
use common::{pseudo_random, Serve};
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

/// The socket every recipe in the docs names; the tests put their own in its place.
const DOC_SOCKET: &str = "/run/overspill.sock";

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
    let shown: Vec<String> = vm_recipes()
        .into_iter()
        .filter(|(lang, text)| lang == "xml" && text.contains("protocol='nbd'"))
        .map(|(_, t)| t)
        .collect();
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

/// The value of `key=` in a comma-separated QEMU option among `args`, in the option that also holds
/// `having` (e.g. the `export=` of the argument with `driver=nbd`).
fn option_value(args: &[String], having: &str, key: &str) -> String {
    args.iter()
        .filter(|a| a.split(',').any(|kv| kv == having))
        .flat_map(|a| a.split(','))
        .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= beside {having} in {args:?}"))
        .to_owned()
}

/// Runs QEMU with a VM disk's arguments as the docs give them (`doc_args`, naming [`DOC_SOCKET`])
/// against a real `overspill serve`, and checks what the docs promise: QEMU opens the export over
/// NBD, a virtio-blk device uses it with zero detection on, the guest's drive reads the golden
/// image, the server sees the VM by its name, and QEMU's quit ends the VM's overlay.
fn assert_qemu_serves_the_vm_with(doc_args: &[String], recipe: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let golden_bytes = pseudo_random(1 << 20, 17);
    let golden = dir.path().join("golden.img");
    std::fs::write(&golden, &golden_bytes).expect("golden image");
    let socket = dir.path().join("overspill.sock");
    let listen = format!("unix:{}", socket.display());
    let ready = socket.clone();
    let server = Serve::start(
        dir.path(),
        &["--base", golden.to_str().expect("utf-8 temp path"), "--listen", &listen],
        &[],
        move || std::os::unix::net::UnixStream::connect(&ready).is_ok(),
    );

    assert!(doc_args.iter().any(|a| a.contains(DOC_SOCKET)), "{recipe} does not name {DOC_SOCKET}: {doc_args:?}");
    let args: Vec<String> = doc_args.iter().map(|a| a.replace(DOC_SOCKET, &socket.to_string_lossy())).collect();
    let export = option_value(&args, "driver=nbd", "export");
    let vm = export.split_once('@').map(|(_, vm)| vm.to_owned()).unwrap_or_else(|| panic!("{export} names no VM"));
    let drive = option_value(&args, "virtio-blk-pci", "drive");

    let mut qemu = Qmp::start(dir.path(), &args);
    let nodes = qemu.execute(serde_json::json!({"execute": "query-named-block-nodes", "arguments": {"flat": true}}));
    let nodes = nodes.as_array().expect("block nodes");
    let node = |name: &str| nodes.iter().find(|n| n["node-name"] == name);
    let nbd = nodes.iter().find(|n| n["drv"] == "nbd").unwrap_or_else(|| panic!("{recipe}: no nbd node: {nodes:?}"));
    let uri = nbd["file"].as_str().unwrap_or_default();
    assert!(uri.contains(&format!("/{export}?socket={}", socket.display())), "{recipe}: nbd node on {uri}");
    let disk = node(&drive).unwrap_or_else(|| panic!("{recipe}: no node {drive}: {nodes:?}"));
    assert_eq!(disk["detect_zeroes"], "unmap", "{recipe}: {disk}");
    assert_eq!(disk["image"]["virtual-size"], golden_bytes.len(), "{recipe}: {disk}");

    let backends = qemu.execute(serde_json::json!({"execute": "query-block"}));
    assert!(
        backends.as_array().expect("block backends").iter().any(|b| b["inserted"]["node-name"] == drive.as_str()
            && b["qdev"].as_str().is_some_and(|q| q.contains("virtio"))),
        "{recipe}: no virtio device on {drive}: {backends}"
    );

    // The guest's drive, read through the whole chain (virtio-blk's node, raw, NBD, the server).
    let hmp = format!("qemu-io {drive} \"read -v 0 16\"");
    qemu.execute(serde_json::json!({"execute": "human-monitor-command", "arguments": {"command-line": hmp}}));

    wait_for_log(&server, &format!("VM connected export=\"\" vm=\"{vm}\""), recipe);
    let printed = qemu.quit();
    wait_for_log(&server, &format!("VM disconnected; its cache is dropped vm={vm}"), recipe);

    // qemu-io's dump: "00000000:  e2 b7 bf ...  ................"
    let dump = printed.iter().find(|l| l.starts_with("00000000:")).unwrap_or_else(|| panic!("{recipe}: {printed:?}"));
    let bytes: Vec<u8> = dump
        .split_whitespace()
        .skip(1)
        .take(16)
        .map(|h| u8::from_str_radix(h, 16).unwrap_or_else(|_| panic!("{recipe}: qemu-io printed {dump}")))
        .collect();
    assert_eq!(bytes, golden_bytes[..16], "{recipe}: the drive's first bytes are not the golden image's");
}

#[track_caller]
fn wait_for_log(server: &Serve, line: &str, recipe: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server.log_text().contains(line) {
        assert!(Instant::now() < deadline, "{recipe}: the server never logged {line:?}:\n{}", server.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// docs/operations.md section 4's QEMU command line, as QEMU runs it.
#[test]
fn the_qemu_command_line_in_operations_md_opens_the_vm_disk() {
    let command = vm_recipes()
        .into_iter()
        .map(|(_, text)| text)
        .find(|text| text.starts_with("qemu-system-x86_64 "))
        .expect("a qemu-system-x86_64 command in section 4");
    let joined = command.replace("\\\n", " ");
    let words: Vec<String> = joined.split_whitespace().map(str::to_owned).collect();
    // "qemu-system-x86_64 ..." then the disk's arguments, complete.
    assert_eq!(words[..2], ["qemu-system-x86_64", "..."], "{command}");
    assert_qemu_serves_the_vm_with(&words[2..], "the QEMU command line");
}

/// docs/operations.md's Proxmox VE `args:` line, as QEMU runs it. Proxmox splits the value into
/// words as a shell would (PVE::Tools::split_args) and appends them to its own QEMU command line.
#[test]
fn the_proxmox_args_line_in_operations_md_opens_the_vm_disk() {
    let lines: Vec<String> = vm_recipes()
        .into_iter()
        .flat_map(|(_, text)| {
            text.lines().filter_map(|l| l.strip_prefix("args: ").map(str::to_owned)).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(lines.len(), 1, "one args: line in section 4: {lines:?}");
    // Without quotes or escapes, shell words are the whitespace-separated ones.
    assert!(!lines[0].contains(['\'', '"', '\\']), "{}", lines[0]);
    let words: Vec<String> = lines[0].split_whitespace().map(str::to_owned).collect();
    assert_qemu_serves_the_vm_with(&words, "the Proxmox args: line");
}

/// docs/libvirt-domain-vhost-user.xml is a domain libvirt accepts, its vhost-user disk and shared
/// memory kept as written, and docs/operations.md shows exactly its <memoryBacking> and <disk>.
#[test]
fn the_vhost_user_domain_validates_and_operations_md_shows_it() {
    let shipped = read_doc("libvirt-domain-vhost-user.xml");
    let memory = dedented_lines(&shipped, "<memoryBacking>", "</memoryBacking>");
    let disk = dedented_lines(&shipped, "<disk ", "</disk>");
    let shown: Vec<String> = vm_recipes()
        .into_iter()
        .filter(|(lang, text)| lang == "xml" && text.contains("vhostuser"))
        .map(|(_, t)| t)
        .collect();
    assert_eq!(
        shown,
        [format!("{memory}...\n{disk}")],
        "docs/operations.md section 4 must show the vhost-user domain's"
    );

    let (valid, said) = virt_xml_validate(&doc_path("libvirt-domain-vhost-user.xml"));
    assert!(valid, "virt-xml-validate rejects docs/libvirt-domain-vhost-user.xml:\n{said}");
    let dir = tempfile::tempdir().expect("tempdir");
    let broken = dir.path().join("broken.xml");
    std::fs::write(&broken, shipped.replace("type='memfd'", "type='overspill'")).expect("broken copy");
    assert!(!virt_xml_validate(&broken).0, "the schema does not look at <memoryBacking>");

    let out = Command::new("virsh")
        .args(["-c", "test:///default"])
        .arg(format!("define {}; dumpxml vm-17", doc_path("libvirt-domain-vhost-user.xml").display()))
        .output()
        .unwrap_or_else(|e| panic!("virsh is not installed (apt-get install libvirt-clients; scripts/test does): {e}"));
    let dumped = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "virsh define: {dumped}{}", String::from_utf8_lossy(&out.stderr));
    // libvirt adds that a vhost-user disk takes no snapshots (it cannot).
    let dumped = dumped.replace(" snapshot='no'", "");
    assert_eq!(dedented_lines(&dumped, "<disk ", "</disk>"), disk, "libvirt's definition of the disk differs");
    assert_eq!(dedented_lines(&dumped, "<memoryBacking>", "</memoryBacking>"), memory);
}
