//! The man pages' own sections (EXAMPLES, EXIT STATUS, SIGNALS, FILES): what clap cannot know
//! from the flags. `overspill man [SUBCOMMAND]` puts them between the options and the version.

/// Roff for the page of `subcommand` (`None`: the command's own page).
pub fn extra_sections(subcommand: Option<&str>) -> String {
    let mut roff = String::new();
    if let Some(examples) = examples(subcommand) {
        roff.push_str(".SH EXAMPLES\n");
        for (what, command) in examples {
            roff.push_str(&format!(".PP\n{}\n.PP\n.RS 4\n.nf\n{}\n.fi\n.RE\n", escape(what), escape(command)));
        }
    }
    roff.push_str(".SH \"EXIT STATUS\"\n");
    roff.push_str(&definitions(&exit_status(subcommand)));
    if matches!(subcommand, None | Some("serve")) {
        roff.push_str(".SH SIGNALS\n");
        roff.push_str(&definitions(SIGNALS));
    }
    if matches!(subcommand, None | Some("serve") | Some("vm") | Some("libvirt-hook")) {
        roff.push_str(".SH FILES\n");
        roff.push_str(&definitions(FILES));
    }
    roff.push_str(".SH \"SEE ALSO\"\n");
    roff.push_str(&escape(
        "overspill(1), overspill-serve(1), overspill-vm(1), overspill-image(1), overspill-storm(1), \
         nbdinfo(1), qemu-img(1), systemctl(1); /usr/share/doc/overspill/ (operations, lifecycle, \
         metrics, alert rules, Grafana dashboard).",
    ));
    roff.push('\n');
    roff
}

/// Each page's examples: what it does, then the command.
fn examples(subcommand: Option<&str>) -> Option<Vec<(&'static str, &'static str)>> {
    let examples = match subcommand {
        None | Some("serve") => vec![
            ("Serve one golden image to the VMs of this host, 256 MiB of RAM each before they spill:",
             "overspill serve --base /srv/golden/current.img --listen unix:/run/overspill.sock \\\n    --ram 256M --ram-total 8G --spill-dir /var/cache/overspill"),
            ("The packaged service: settings in the conffile, socket made by overspill.socket:",
             "systemctl enable --now overspill.socket\noverspill serve --config /etc/overspill/overspill.toml"),
            ("A VM connects by name (its overlay outlives the connection and the server):",
             "qemu-system-x86_64 ... -drive driver=nbd,server.type=unix,server.path=/run/overspill.sock,export=@vm1"),
        ],
        Some("vm") => vec![
            ("The named VMs of the server the unit started (found through the conffile's control):",
             "overspill vm list"),
            ("Start a VM over again from the golden image, or end its overlay for good:",
             "overspill vm reset vm1\noverspill vm drop vm1"),
            ("Give a vhost-user-blk VM its socket while the server runs:",
             "overspill vm add vm2 default"),
            ("Hold one VM to 500 operations and 20 MiB per second, live; lift it again:",
             "overspill vm limit vm1 --iops 500 --bandwidth 20M\noverspill vm limit vm1 --iops off --bandwidth off"),
        ],
        Some("image") => vec![
            ("Publish a new version and make it the one new VMs boot (running VMs keep theirs):",
             "overspill image --images /srv/golden/store publish win10 /tmp/win10-v7.qcow2\noverspill image --images /srv/golden/store activate win10 7"),
            ("What the store holds:", "overspill image list --images /srv/golden/store"),
        ],
        Some("storm") => vec![
            ("The seeds' comparison on the embedded default (20 Windows 7 VDI VMs, every mode), report.html in storm-report/:",
             "overspill storm --out storm-report"),
            ("Real QEMU guests (TCG) over NBD and vhost-user-blk:",
             "overspill storm --guests qemu --guest-os busybox --vms 2 --frontend nbd,vhost-user"),
        ],
        Some("stat") => vec![("A live view of the packaged server:", "overspill stat --url http://127.0.0.1:10810/metrics")],
        Some("plan") => vec![("RAM sizes for recorded traces:", "overspill plan --ram 64M,256M,1G traces/*")],
        Some("libvirt-hook") => vec![(
            "Installed by the package as /etc/libvirt/hooks/qemu.d/overspill; libvirtd runs it as:",
            "/etc/libvirt/hooks/qemu.d/overspill DOMAIN prepare begin - < domain.xml",
        )],
        Some("completions") => vec![("Completions for bash:", "overspill completions bash > /etc/bash_completion.d/overspill")],
        Some(_) => return None,
    };
    Some(examples)
}

fn exit_status(subcommand: Option<&str>) -> Vec<(&'static str, &'static str)> {
    let mut status = vec![
        ("0", "Success. For serve: stopped by SIGTERM or SIGINT after every VM was handed over."),
        ("1", "An error, said on standard error (one JSON line under --log-json): a file, image, socket or server that could not be used, a request the server refused. For serve also: a second SIGTERM or SIGINT, which exits without waiting for connections."),
        ("2", "A usage error: an unknown flag, a value a flag does not take (a size without its unit, a bad duration), an unknown subcommand or man page."),
    ];
    if subcommand == Some("libvirt-hook") {
        status[1] = ("1", "The operation must not go on (libvirt then refuses the migration, restore or start), with the reason on standard error, which libvirt shows.");
    }
    status
}

const SIGNALS: &[(&str, &str)] = &[
    ("SIGTERM, SIGINT", "serve drains: each connection finishes the request in hand (10 s at most), every named VM is handed over to the next server (its pages stay in the memory directory, its spill file and ledger entry in the spill directory), the socket is removed, and the process exits 0. A second one exits at once with status 1."),
    ("SIGHUP", "serve drains as for SIGTERM, then executes the binary now at the path it was started by (links followed anew) with the same arguments and the same pid (systemctl reload: an upgrade or new settings); systemd's socket is passed on. VMs stall for a moment and lose nothing."),
    ("SIGKILL, a crash", "Nothing acknowledged is lost: the next server finds each named VM through the ledger and serves it again, or refuses it by name (state lost) until overspill vm reset; it never serves golden data where a VM wrote."),
];

const FILES: &[(&str, &str)] = &[
    ("/etc/overspill/overspill.toml", "The packaged service's settings (serve --config): one key per serve flag. overspill vm and the libvirt hook read its control key to find the server."),
    ("/run/overspill.sock", "The VMs' NBD socket, made by overspill.socket (group libvirt-qemu, mode 0660)."),
    ("/run/overspill/control.sock", "The control socket of the packaged server (overspill vm; root only)."),
    ("/run/overspill/memory/", "Named VMs' RAM pages (tmpfs), so that a restart or an upgrade keeps them."),
    ("/var/cache/overspill/", "Spill files (2 MiB segments per VM) and state/, the ledger of named VMs (one vm-NAME.json each) and the record of VMs added with vm add."),
    ("/etc/libvirt/hooks/qemu.d/overspill", "The libvirt hook: refuses migrations and restores that would run a guest on golden data, and starts every power-on from the golden image."),
    ("/run/overspill-libvirt-hook/", "The libvirt hook's note of a migration it let through (VM.migrating), for the start that follows it."),
    ("/usr/lib/systemd/system/overspill.service, overspill.socket, overspill-libvirt-reboots.service", "The packaged units."),
];

fn definitions(items: &[(&str, &str)]) -> String {
    items.iter().map(|(term, text)| format!(".TP\n\\fB{}\\fR\n{}\n", escape(term), escape(text))).collect()
}

/// Text as roff shows it: backslashes doubled, and lines that would start with a control
/// character (`.` or `'`) kept as text.
fn escape(text: &str) -> String {
    text.replace('\\', "\\e")
        .lines()
        .map(|line| if line.starts_with(['.', '\'']) { format!("\\&{line}") } else { line.to_owned() })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_has_an_exit_status_and_serve_its_signals_and_files() {
        let serve = extra_sections(Some("serve"));
        for section in [".SH EXAMPLES", ".SH \"EXIT STATUS\"", ".SH SIGNALS", ".SH FILES"] {
            assert!(serve.contains(section), "{section} missing:\n{serve}");
        }
        let plan = extra_sections(Some("plan"));
        assert!(plan.contains(".SH \"EXIT STATUS\"") && !plan.contains(".SH SIGNALS"));
    }

    #[test]
    fn text_cannot_become_a_roff_request() {
        assert_eq!(escape(".hidden\nback\\slash"), "\\&.hidden\nback\\eslash");
    }
}
