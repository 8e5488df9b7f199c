//! Real QEMU guests under TCG (KVM does not work on the machines this runs on): Debian's cloud
//! kernel (ext4 built in) with a small busybox initramfs that loads virtio-blk. The initramfs
//! either runs a job script itself (the tests' guests) or mounts the virtio disk as the root
//! filesystem and starts its init (`storm --guests qemu`, whose disk is an NBD export of an
//! in-process server). `scripts/install-guest-tools` installs what they need; the storm's root
//! filesystem comes from `scripts/build-guest-image` ([`root_image`]).

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The modules every initramfs loads, with what they depend on (read from modules.dep).
const MODULES: [&str; 2] = ["virtio_pci", "virtio_blk"];

/// The script that builds the storm's root filesystem, run from a copy so that the command
/// works outside the source tree too.
const BUILD_SCRIPT: &str = include_str!("../../../scripts/build-guest-image");

/// A kernel to boot and the modules that go with it.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub image: PathBuf,
    pub version: String,
    pub modules: PathBuf,
}

impl Kernel {
    /// The newest Debian cloud kernel in /boot.
    pub fn newest_cloud() -> anyhow::Result<Self> {
        let mut kernels: Vec<(String, PathBuf)> = fs::read_dir("/boot")
            .map(|dir| dir.filter_map(|e| e.ok().map(|e| e.path())).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|path| {
                let name = path.file_name()?.to_str()?;
                let version = name.strip_prefix("vmlinuz-").filter(|v| v.ends_with("-cloud-amd64"))?.to_owned();
                Some((version, path))
            })
            .collect();
        kernels.sort_by(|a, b| version_order(&a.0, &b.0));
        let Some((version, image)) = kernels.pop() else {
            bail!("no /boot/vmlinuz-*-cloud-amd64: install linux-image-cloud-amd64 (scripts/install-guest-tools does)")
        };
        let modules = PathBuf::from("/lib/modules").join(&version);
        if !modules.join("modules.dep").is_file() {
            bail!("{} has no modules.dep: reinstall linux-image-{version}", modules.display());
        }
        Ok(Self { image, version, modules })
    }
}

/// Orders versions like `6.1.0-9` before `6.1.0-10`: digit runs compare as numbers.
fn version_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn parts(s: &str) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        let mut rest = s;
        while !rest.is_empty() {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let (number, tail) = rest.split_at(digits);
            let text_len = tail.len() - tail.trim_start_matches(|c: char| !c.is_ascii_digit()).len();
            let (text, tail) = tail.split_at(text_len);
            out.push((number.parse().unwrap_or(0), text.to_owned()));
            rest = tail;
        }
        out
    }
    parts(a).cmp(&parts(b))
}

/// `wanted` and everything they need, each after what it needs (modules.dep lists a module's
/// dependencies, nearest first).
fn with_dependencies(modules: &Path, wanted: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let dep_file = modules.join("modules.dep");
    let deps = fs::read_to_string(&dep_file).with_context(|| format!("reading {}", dep_file.display()))?;
    let table: HashMap<&str, Vec<&str>> = deps
        .lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(module, needs)| (module, needs.split_whitespace().collect()))
        .collect();
    let mut order: Vec<&str> = Vec::new();
    for name in wanted {
        let file = format!("{name}.ko");
        let Some(module) = table.keys().copied().find(|path| path.rsplit('/').next() == Some(file.as_str())) else {
            bail!("module {name} is not in {}", modules.display())
        };
        let needs = table.get(module).map_or(&[][..], Vec::as_slice);
        for path in needs.iter().rev().chain(std::iter::once(&module)) {
            if !order.contains(path) {
                order.push(path);
            }
        }
    }
    Ok(order.into_iter().map(|path| modules.join(path)).collect())
}

/// `program` and the shared libraries `ldd` says it loads (the dynamic loader included).
fn with_libraries(program: &str) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(program).output().context("running ldd")?;
    if !out.status.success() {
        bail!("ldd {program}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut files = vec![PathBuf::from(program)];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split_once("=> ").map_or(line.trim(), |(_, rest)| rest).split(" (").next().unwrap_or("");
        if path.starts_with('/') {
            files.push(PathBuf::from(path));
        }
    }
    Ok(files)
}

/// What a job's guest needs beyond the virtio disk: more kernel modules, programs from the host
/// (with the shared libraries they load; each with the package that has it), and whether `init`
/// waits for `/dev/vda`.
pub struct Extras<'a> {
    pub modules: &'a [&'a str],
    pub programs: &'a [(&'a str, &'a str)],
    pub disk: bool,
}

impl Default for Extras<'_> {
    fn default() -> Self {
        Self { modules: &[], programs: &[], disk: true }
    }
}

/// A kernel and an initramfs to boot it with.
pub struct GuestKit {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

impl GuestKit {
    /// Builds, in `dir`, an initramfs whose init mounts the usual filesystems, loads virtio-blk,
    /// waits for /dev/vda, runs `job` (a busybox shell script), prints `JOB EXIT <status>` and
    /// powers off.
    pub fn build(dir: &Path, job: &str) -> anyhow::Result<Self> {
        Self::build_with(dir, job, &Extras::default())
    }

    /// As [`Self::build`], with `extras` in the initramfs.
    pub fn build_with(dir: &Path, job: &str, extras: &Extras<'_>) -> anyhow::Result<Self> {
        let then = "echo GUEST UP\n\
                    sh /job.sh\n\
                    echo \"JOB EXIT $?\"\n\
                    sync\n\
                    poweroff -f\n";
        Self::assemble(dir, extras, then, Some(job))
    }

    /// Builds, in `dir`, an initramfs that mounts /dev/vda (ext4) read-write as the root
    /// filesystem and hands over to its `/sbin/init`, as a distribution's initramfs would. A
    /// disk it cannot mount prints `OVERSPILL ROOT FAILED` and powers off.
    pub fn root_on_disk(dir: &Path) -> anyhow::Result<Self> {
        let then = "mkdir -p /newroot\n\
                    if ! mount -t ext4 -o rw /dev/vda /newroot; then echo 'OVERSPILL ROOT FAILED'; poweroff -f; fi\n\
                    umount /proc /sys\n\
                    mount --move /dev /newroot/dev\n\
                    exec switch_root /newroot /sbin/init\n";
        Self::assemble(dir, &Extras::default(), then, None)
    }

    /// The initramfs: busybox, the modules, an init that loads them and then runs `then`.
    fn assemble(dir: &Path, extras: &Extras<'_>, then: &str, job: Option<&str>) -> anyhow::Result<Self> {
        let kernel = Kernel::newest_cloud()?;
        let root = dir.join("initramfs");
        fs::create_dir_all(root.join("lib/modules")).with_context(|| format!("creating {}", root.display()))?;
        if !Path::new("/bin/busybox").exists() {
            bail!("/bin/busybox is missing: install busybox-static (scripts/install-guest-tools does)");
        }
        copy(Path::new("/bin/busybox"), &root.join("bin/busybox"))?;
        for &(program, package) in extras.programs {
            if !Path::new(program).exists() {
                bail!("{program} is missing: install {package} (scripts/install-guest-tools does)");
            }
            for file in with_libraries(program)? {
                let inside = file.strip_prefix("/").unwrap_or(&file);
                copy(&file, &root.join(inside))?;
            }
        }
        let mut loads = String::new();
        let wanted: Vec<&str> = MODULES.iter().chain(extras.modules).copied().collect();
        for module in with_dependencies(&kernel.modules, &wanted)? {
            let Some(name) = module.file_name().and_then(|n| n.to_str()) else { continue };
            copy(&module, &root.join("lib/modules").join(name))?;
            loads.push_str(&format!("insmod /lib/modules/{name}\n"));
        }
        let wait_for_disk =
            if extras.disk { "for i in $(seq 100); do [ -b /dev/vda ] && break; sleep 0.1; done\n" } else { "" };
        let init = format!(
            "#!/bin/busybox sh\n\
             /bin/busybox mkdir -p /proc /sys /dev /mnt /tmp /sbin /usr/bin /usr/sbin\n\
             /bin/busybox mount -t proc proc /proc\n\
             /bin/busybox mount -t sysfs sys /sys\n\
             /bin/busybox mount -t devtmpfs dev /dev\n\
             /bin/busybox --install -s\n\
             {loads}{wait_for_disk}{then}"
        );
        let executable = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        fs::write(root.join("init"), init).context("writing the initramfs's init")?;
        fs::set_permissions(root.join("init"), executable).context("making init executable")?;
        if let Some(job) = job {
            fs::write(root.join("job.sh"), job).context("writing the initramfs's job")?;
        }
        let initrd = dir.join("initrd.cpio");
        let archive = fs::File::create(&initrd).with_context(|| format!("creating {}", initrd.display()))?;
        let status = Command::new("sh")
            .args(["-c", "find . | cpio -o -H newc --quiet"])
            .current_dir(&root)
            .stdout(archive)
            .status()
            .context("running cpio")?;
        if !status.success() {
            bail!("cpio failed ({status}): install cpio (scripts/install-guest-tools does)");
        }
        Ok(Self { kernel: kernel.image, initrd })
    }
}

/// A guest job (for [`GuestKit::build`]): remounts `device` with the page cache dropped, so that
/// the files come from the disk, and checks them against the `sums` file written with them
/// ("CHECKSUMS OK n" or "CHECKSUMS FAILED").
pub fn check_sums_job(device: &str) -> String {
    format!(
        r#"umount /mnt
echo 3 > /proc/sys/vm/drop_caches
mount {device} /mnt || exit 1
if (cd /mnt && sha256sum -c sums > /tmp/check 2>&1); then
  echo "CHECKSUMS OK $(wc -l < /mnt/sums)"
else
  cat /tmp/check
  echo "CHECKSUMS FAILED"
fi
umount /mnt
"#
    )
}

/// A guest job: mounts /dev/vda (an [`ext4_image`] holding golden.txt, "golden file"), writes
/// `files` files of 1 MiB of random bytes, each followed by its checksum, a `sync` (so that
/// "WROTE n" means the server acknowledged files 1..n) and a pause of `pause_s` seconds (so that
/// what the test does at "WROTE n" lands while the guest writes on), then checks every checksum
/// against what the disk holds ([`check_sums_job`]).
pub fn checksummed_writes_job(files: u32, pause_s: &str) -> String {
    format!(
        r#"mount /dev/vda /mnt || exit 1
grep -q "golden file" /mnt/golden.txt || {{ echo "GOLDEN FILE WRONG"; exit 1; }}
i=1
while [ $i -le {files} ]; do
  dd if=/dev/urandom of=/mnt/f$i bs=64k count=16 2>/dev/null
  (cd /mnt && sha256sum f$i >> sums)
  sync
  echo "WROTE $i"
  sleep {pause_s}
  i=$((i+1))
done
{check}"#,
        check = check_sums_job("/dev/vda")
    )
}

/// An ext4 golden image of `mib` MiB with 4 KiB blocks holding `files` (name, contents), made
/// with mkfs.ext4.
pub fn ext4_image(dir: &Path, mib: u64, files: &[(&str, &[u8])]) -> anyhow::Result<PathBuf> {
    let content = dir.join("golden-content");
    fs::create_dir_all(&content).with_context(|| format!("creating {}", content.display()))?;
    for (name, bytes) in files {
        fs::write(content.join(name), bytes).with_context(|| format!("writing {name}"))?;
    }
    let image = dir.join("golden.img");
    fs::File::create(&image)
        .and_then(|f| f.set_len(mib << 20))
        .with_context(|| format!("creating {}", image.display()))?;
    let out = Command::new("mkfs.ext4")
        // 4 KiB blocks, as real images have (a small filesystem would get 1 KiB ones, which a
        // disk with 4 KiB sectors cannot mount).
        .args(["-q", "-F", "-b", "4096", "-d"])
        .arg(&content)
        .arg(&image)
        .output()
        .context("running mkfs.ext4: install e2fsprogs")?;
    if !out.status.success() {
        bail!("mkfs.ext4: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(image)
}

/// The root filesystems `scripts/build-guest-image` builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Flavour {
    /// A Debian minbase (debootstrap) with systemd and udev.
    Systemd,
    /// Debian's busybox-static as init and every program.
    Busybox,
}

impl Flavour {
    pub fn name(self) -> &'static str {
        match self {
            Flavour::Systemd => "systemd",
            Flavour::Busybox => "busybox",
        }
    }
}

/// The storm's golden image for `kernel`: a root filesystem of `flavour` built by
/// `scripts/build-guest-image` and kept in `cache` (named after the script's contents, so that a
/// changed script builds anew). Built here when missing; the script installs what it needs.
pub fn root_image(cache: &Path, flavour: Flavour, kernel: &Kernel) -> anyhow::Result<PathBuf> {
    // FNV-1a: a stable name for the script's contents, not a checksum anybody relies on.
    let hash =
        BUILD_SCRIPT.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let image = cache.join(format!("guest-{}-{}-{:08x}.img", flavour.name(), kernel.version, hash >> 32));
    if image.is_file() {
        return Ok(image);
    }
    fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    let script = cache.join(format!(".build-guest-image.{}", std::process::id()));
    fs::write(&script, BUILD_SCRIPT).with_context(|| format!("writing {}", script.display()))?;
    eprintln!("building the guests' root filesystem ({}) at {}", flavour.name(), image.display());
    let status = Command::new("bash")
        .arg(&script)
        .args(["--flavour", flavour.name(), "--kernel-version", &kernel.version, "--out"])
        .arg(&image)
        .stdin(Stdio::null())
        // Its progress goes to the terminal, not into the report on stdout.
        .stdout(Stdio::inherit())
        .status();
    let _ = fs::remove_file(&script);
    let status = status.context("running bash")?;
    if !status.success() || !image.is_file() {
        bail!("scripts/build-guest-image failed ({status})");
    }
    Ok(image)
}

/// Where built images are kept between runs: `$XDG_CACHE_HOME/overspill`, else
/// `~/.cache/overspill`.
pub fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map_or_else(std::env::temp_dir, |home| PathBuf::from(home).join(".cache"))
    });
    base.join("overspill")
}

/// A line the guest printed on its serial console (without the line end), when it arrived;
/// `None` once the console closed (QEMU ended).
#[derive(Debug)]
pub struct ConsoleLine {
    pub guest: usize,
    pub at: Instant,
    pub line: Option<String>,
}

/// How to start a guest besides its kit and devices.
pub struct BootOptions {
    /// Appended to the kernel command line.
    pub append: String,
    pub memory_mib: u32,
    /// Each console line goes here too, as `ConsoleLine { guest: .0, .. }`.
    pub lines: Option<(usize, Sender<ConsoleLine>)>,
}

impl Default for BootOptions {
    fn default() -> Self {
        Self { append: String::new(), memory_mib: 256, lines: None }
    }
}

/// QEMU's arguments for a virtio disk that is the NBD export `export` at unix socket `socket`,
/// with discard passed down and QEMU's reconnect delay (seconds).
pub fn nbd_disk(socket: &Path, export: &str, reconnect_delay: u32) -> Vec<String> {
    let disk = serde_json::json!({
        "driver": "raw",
        "node-name": "disk0",
        "discard": "unmap",
        "file": {
            "driver": "nbd",
            "server": { "type": "unix", "path": socket },
            "export": export,
            "reconnect-delay": reconnect_delay,
        },
    });
    vec!["-blockdev".into(), disk.to_string(), "-device".into(), "virtio-blk-pci,drive=disk0".into()]
}

/// QEMU's arguments for a virtio disk served over vhost-user-blk at unix socket `socket`: the
/// guest's memory (`memory_mib`, as in [`BootOptions`]) shared with the backend, and QEMU
/// reconnecting a second after the backend goes.
pub fn vhost_user_disk(socket: &Path, memory_mib: u32) -> Vec<String> {
    [
        "-object",
        &format!("memory-backend-memfd,id=mem,size={memory_mib}M,share=on"),
        "-machine",
        "memory-backend=mem",
        "-chardev",
        &format!("socket,id=vhost0,path={},{}", socket.display(), reconnect_after_a_second()),
        "-device",
        "vhost-user-blk-pci,chardev=vhost0,num-queues=1",
    ]
    .map(String::from)
    .to_vec()
}

/// A chardev's reconnect option for one second: `reconnect-ms` since QEMU 9.2, which deprecated
/// `reconnect` (seconds); older QEMUs know only the latter.
fn reconnect_after_a_second() -> &'static str {
    let version = Command::new("qemu-system-x86_64").arg("--version").output().ok().and_then(|out| {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let number = text.split("version ").nth(1)?.split_whitespace().next()?.to_owned();
        let mut parts = number.split('.').map(|p| p.parse::<u32>().ok());
        Some((parts.next()??, parts.next()??))
    });
    match version {
        Some(version) if version < (9, 2) => "reconnect=1",
        _ => "reconnect-ms=1000",
    }
}

/// A running guest. Its serial console goes to a file as it comes, through a thread that also
/// hands the lines on when asked to.
pub struct Guest {
    child: Child,
    pub console: PathBuf,
    pub started: Instant,
    reader: Option<JoinHandle<()>>,
}

impl Guest {
    /// Boots `kit` with one virtio disk, the NBD export `export` at unix socket `socket`, with
    /// discard passed down and QEMU's reconnect delay (seconds).
    pub fn boot(kit: &GuestKit, dir: &Path, socket: &Path, export: &str, reconnect_delay: u32) -> anyhow::Result<Self> {
        Self::start(kit, dir, &nbd_disk(socket, export, reconnect_delay), BootOptions::default())
    }

    /// Boots `kit` with no disk and a virtio network card on QEMU's user network, where the
    /// host's loopback is 10.0.2.2 (the guest is to be 10.0.2.15).
    pub fn boot_networked(kit: &GuestKit, dir: &Path) -> anyhow::Result<Self> {
        let devices = ["-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0"].map(String::from);
        Self::start(kit, dir, &devices, BootOptions::default())
    }

    /// Starts QEMU (TCG, one CPU) on `kit` with `devices`; its console goes to
    /// `dir/console.log`, its own messages to `dir/qemu.log`.
    pub fn start(kit: &GuestKit, dir: &Path, devices: &[String], options: BootOptions) -> anyhow::Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let console = dir.join("console.log");
        let mut log = fs::File::create(&console).with_context(|| format!("creating {}", console.display()))?;
        let qemu_log = dir.join("qemu.log");
        let stderr = fs::File::create(&qemu_log).with_context(|| format!("creating {}", qemu_log.display()))?;
        // no_timer_check: with more guests than cores, a vCPU can wait so long for its turn that
        // the kernel's early check of the IO-APIC timer sees no ticks and panics (KVM guests
        // skip that check by themselves).
        let append = format!("console=ttyS0 panic=-1 quiet no_timer_check {}", options.append);
        let started = Instant::now();
        let mut child = Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-m", &options.memory_mib.to_string(), "-no-reboot", "-serial", "stdio"])
            .arg("-kernel")
            .arg(&kit.kernel)
            .arg("-initrd")
            .arg(&kit.initrd)
            .args(["-append", append.trim_end()])
            .args(devices)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => anyhow::anyhow!(
                    "qemu-system-x86_64 is not installed: install qemu-system-x86 (scripts/install-guest-tools does)"
                ),
                _ => anyhow::Error::new(e).context("starting qemu-system-x86_64"),
            })?;
        let Some(mut out) = child.stdout.take() else { bail!("QEMU's console is not a pipe") };
        let lines = options.lines;
        let reader = std::thread::Builder::new().name("guest-console".into()).spawn(move || {
            let mut buf = [0u8; 4096];
            let mut pending = Vec::new();
            loop {
                let n = match out.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let at = Instant::now();
                // The file is for people and the tests; losing it must not stop the guest.
                let _ = log.write_all(&buf[..n]);
                let Some((guest, tx)) = &lines else { continue };
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    let text = String::from_utf8_lossy(&line).trim_end_matches(['\r', '\n']).to_owned();
                    let _ = tx.send(ConsoleLine { guest: *guest, at, line: Some(text) });
                }
            }
            if let Some((guest, tx)) = &lines {
                let _ = tx.send(ConsoleLine { guest: *guest, at: Instant::now(), line: None });
            }
        });
        let reader = match reader {
            Ok(reader) => reader,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(anyhow::Error::new(e).context("starting the console thread"));
            }
        };
        Ok(Self { child, console, started, reader: Some(reader) })
    }

    /// What the guest printed so far, with Unix line ends.
    pub fn console_text(&self) -> String {
        fs::read_to_string(&self.console).unwrap_or_default().replace("\r\n", "\n")
    }

    /// The last `lines` lines of the console, for error messages.
    pub fn console_tail(&self, lines: usize) -> String {
        let text = self.console_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// QEMU's exit status, if it has ended.
    pub fn try_wait(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        self.child.try_wait().context("waiting for QEMU")
    }

    /// Waits until the console shows `text`; fails with the console if the guest ends first or
    /// `limit` passes.
    pub fn wait_for(&mut self, text: &str, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        while !self.console_text().contains(text) {
            if let Some(status) = self.try_wait()? {
                bail!("the guest ended ({status}) before printing {text:?}:\n{}", self.console_text());
            }
            if Instant::now() >= deadline {
                bail!("no {text:?} from the guest in {limit:?}:\n{}", self.console_text());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Waits for QEMU to exit with success (the guest powered off); its console.
    pub fn wait_exit(&mut self, limit: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.try_wait()? {
                self.join_reader();
                if !status.success() {
                    bail!("QEMU exited with {status}:\n{}", self.console_text());
                }
                return Ok(self.console_text());
            }
            if Instant::now() >= deadline {
                bail!("the guest did not power off in {limit:?}:\n{}", self.console_text());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops QEMU at once.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.join_reader();
    }

    fn join_reader(&mut self) {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_order_numerically() {
        let mut v = ["6.1.0-10-cloud-amd64", "6.1.0-9-cloud-amd64", "6.12.1-1-cloud-amd64", "6.1.0-56-cloud-amd64"];
        v.sort_by(|a, b| version_order(a, b));
        assert_eq!(v, ["6.1.0-9-cloud-amd64", "6.1.0-10-cloud-amd64", "6.1.0-56-cloud-amd64", "6.12.1-1-cloud-amd64"]);
    }
}
