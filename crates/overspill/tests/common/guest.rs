//! Real QEMU guests for the tests: Debian's cloud kernel (ext4 built in) with a busybox
//! initramfs that loads virtio-blk and runs a job script, under TCG (KVM does not work on these
//! machines), its disk an NBD export of `overspill serve`. `scripts/test` installs the packages
//! (qemu-system-x86, linux-image-cloud-amd64, busybox-static, cpio, e2fsprogs).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Modules the initramfs loads, with what they depend on (read from the kernel's modules.dep).
const MODULES: [&str; 2] = ["virtio_pci", "virtio_blk"];

/// A kernel and an initramfs that runs one job.
pub struct GuestKit {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// The newest cloud kernel in /boot and its modules directory.
fn cloud_kernel() -> (PathBuf, PathBuf) {
    let mut kernels: Vec<PathBuf> =
        fs::read_dir("/boot").map(|dir| dir.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    kernels.retain(|path| {
        path.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("vmlinuz-") && n.ends_with("-cloud-amd64"))
    });
    kernels.sort();
    let kernel = kernels.pop().unwrap_or_else(|| {
        panic!("no /boot/vmlinuz-*-cloud-amd64: install linux-image-cloud-amd64 (scripts/test does)")
    });
    let version = kernel.file_name().and_then(|n| n.to_str()).expect("utf-8")["vmlinuz-".len()..].to_string();
    (kernel, PathBuf::from("/lib/modules").join(version))
}

/// `wanted` and everything they need, each after what it needs (modules.dep lists a module's
/// dependencies, nearest first).
fn with_dependencies(modules: &Path, wanted: &[&str]) -> Vec<PathBuf> {
    let deps = fs::read_to_string(modules.join("modules.dep")).expect("modules.dep");
    let table: HashMap<String, Vec<String>> = deps
        .lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(module, needs)| (module.to_string(), needs.split_whitespace().map(str::to_string).collect()))
        .collect();
    let by_name = |name: &str| -> String {
        table
            .keys()
            .find(|path| path.rsplit('/').next() == Some(&format!("{name}.ko")))
            .unwrap_or_else(|| panic!("module {name} is not in {}", modules.display()))
            .clone()
    };
    let mut order: Vec<String> = Vec::new();
    for name in wanted {
        let module = by_name(name);
        let needs = table.get(&module).cloned().unwrap_or_default();
        for path in needs.iter().rev().chain(std::iter::once(&module)) {
            if !order.contains(path) {
                order.push(path.clone());
            }
        }
    }
    order.into_iter().map(|path| modules.join(path)).collect()
}

/// What a guest needs beyond the virtio disk: more kernel modules, programs from the host (with
/// the shared libraries they load; each with the package that has it), and whether `init` waits
/// for `/dev/vda`.
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

/// `program` and the shared libraries `ldd` says it loads (the dynamic loader included).
fn with_libraries(program: &str) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(program).output().expect("ldd");
    assert!(out.status.success(), "ldd {program}: {}", String::from_utf8_lossy(&out.stderr));
    let mut files = vec![PathBuf::from(program)];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split_once("=> ").map_or(line.trim(), |(_, rest)| rest).split(" (").next().unwrap_or("");
        if path.starts_with('/') {
            files.push(PathBuf::from(path));
        }
    }
    files
}

impl GuestKit {
    /// Builds, in `dir`, an initramfs whose init mounts the usual filesystems, loads virtio-blk,
    /// waits for /dev/vda, runs `job` (a busybox shell script), prints `JOB EXIT <status>` and
    /// powers off.
    pub fn build(dir: &Path, job: &str) -> Self {
        Self::build_with(dir, job, &Extras::default())
    }

    /// As [`Self::build`], with `extras` in the initramfs.
    pub fn build_with(dir: &Path, job: &str, extras: &Extras<'_>) -> Self {
        let (kernel, modules) = cloud_kernel();
        let root = dir.join("initramfs");
        for sub in ["bin", "lib/modules"] {
            fs::create_dir_all(root.join(sub)).expect("initramfs dirs");
        }
        fs::copy("/bin/busybox", root.join("bin/busybox"))
            .expect("/bin/busybox: install busybox-static (scripts/test does)");
        for &(program, package) in extras.programs {
            assert!(Path::new(program).exists(), "{program} is missing: install {package} (scripts/test does)");
            for file in with_libraries(program) {
                let target = root.join(file.strip_prefix("/").expect("absolute path"));
                fs::create_dir_all(target.parent().expect("a parent")).expect("initramfs dirs");
                fs::copy(&file, &target).unwrap_or_else(|e| panic!("copying {}: {e}", file.display()));
            }
        }
        let mut loads = String::new();
        let wanted: Vec<&str> = MODULES.iter().chain(extras.modules).copied().collect();
        for module in with_dependencies(&modules, &wanted) {
            let name = module.file_name().expect("module file").to_owned();
            fs::copy(&module, root.join("lib/modules").join(&name)).expect("copying a module");
            loads.push_str(&format!("insmod /lib/modules/{}\n", name.to_string_lossy()));
        }
        let wait_for_disk =
            if extras.disk { "for i in $(seq 50); do [ -b /dev/vda ] && break; sleep 0.2; done\n" } else { "" };
        let init = format!(
            "#!/bin/busybox sh\n\
             /bin/busybox mkdir -p /proc /sys /dev /mnt /tmp /sbin /usr/bin /usr/sbin\n\
             /bin/busybox mount -t proc proc /proc\n\
             /bin/busybox mount -t sysfs sys /sys\n\
             /bin/busybox mount -t devtmpfs dev /dev\n\
             /bin/busybox --install -s\n\
             {loads}\
             {wait_for_disk}\
             echo GUEST UP\n\
             sh /job.sh\n\
             echo \"JOB EXIT $?\"\n\
             sync\n\
             poweroff -f\n"
        );
        fs::write(root.join("init"), init).expect("init");
        fs::write(root.join("job.sh"), job).expect("job");
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        fs::set_permissions(root.join("init"), mode).expect("chmod init");
        let initrd = dir.join("initrd.cpio");
        let archive = fs::File::create(&initrd).expect("initrd");
        let status = Command::new("sh")
            .args(["-c", "find . | cpio -o -H newc --quiet"])
            .current_dir(&root)
            .stdout(archive)
            .status()
            .expect("cpio: install cpio (scripts/test does)");
        assert!(status.success(), "cpio failed");
        Self { kernel, initrd }
    }
}

/// An ext4 golden image of `mib` MiB with 4 KiB blocks holding `files` (name, contents), made
/// with mkfs.ext4.
pub fn ext4_image(dir: &Path, mib: u64, files: &[(&str, &[u8])]) -> PathBuf {
    let content = dir.join("golden-content");
    fs::create_dir_all(&content).expect("content dir");
    for (name, bytes) in files {
        fs::write(content.join(name), bytes).expect("golden file");
    }
    let image = dir.join("golden.img");
    fs::File::create(&image).and_then(|f| f.set_len(mib << 20)).expect("image file");
    let out = Command::new("mkfs.ext4")
        // 4 KiB blocks, as real images have (a small filesystem would get 1 KiB ones, which a
        // disk with 4 KiB sectors cannot mount).
        .args(["-q", "-F", "-b", "4096", "-d"])
        .arg(&content)
        .arg(&image)
        .output()
        .expect("mkfs.ext4: install e2fsprogs");
    assert!(out.status.success(), "mkfs.ext4: {}", String::from_utf8_lossy(&out.stderr));
    image
}

/// A running guest; its serial console goes to a file.
pub struct Guest {
    child: Child,
    pub console: PathBuf,
}

impl Guest {
    /// Boots `kit` with one virtio disk, the NBD export `export` at unix socket `socket`, with
    /// discard passed down and QEMU's reconnect delay (seconds).
    pub fn boot(kit: &GuestKit, dir: &Path, socket: &Path, export: &str, reconnect_delay: u32) -> Self {
        let disk = format!(
            r#"{{"driver":"raw","node-name":"disk0","discard":"unmap","file":{{"driver":"nbd","server":{{"type":"unix","path":"{}"}},"export":"{export}","reconnect-delay":{reconnect_delay}}}}}"#,
            socket.display()
        );
        Self::start(kit, dir, &["-blockdev", &disk, "-device", "virtio-blk-pci,drive=disk0"])
    }

    /// Boots `kit` with no disk and a virtio network card on QEMU's user network, where the
    /// host's loopback is 10.0.2.2 (the guest is to be 10.0.2.15).
    pub fn boot_networked(kit: &GuestKit, dir: &Path) -> Self {
        Self::start(kit, dir, &["-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0"])
    }

    fn start(kit: &GuestKit, dir: &Path, devices: &[&str]) -> Self {
        let console = dir.join("console.log");
        let child = Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-m", "256", "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-no-reboot", "-serial", &format!("file:{}", console.display())])
            .arg("-kernel")
            .arg(&kit.kernel)
            .arg("-initrd")
            .arg(&kit.initrd)
            .args(["-append", "console=ttyS0 panic=-1 quiet"])
            .args(devices)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("qemu.log")).expect("qemu log"))
            .spawn()
            .expect("qemu-system-x86_64: install qemu-system-x86 (scripts/test does)");
        Self { child, console }
    }

    /// What the guest printed so far, with Unix line ends.
    pub fn console_text(&self) -> String {
        fs::read_to_string(&self.console).unwrap_or_default().replace("\r\n", "\n")
    }

    /// Waits until the console shows `text`; panics with the console after `limit`.
    #[track_caller]
    pub fn wait_for(&mut self, text: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while !self.console_text().contains(text) {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("the guest ended ({status}) before printing {text:?}:\n{}", self.console_text());
            }
            assert!(Instant::now() < deadline, "no {text:?} from the guest in {limit:?}:\n{}", self.console_text());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for QEMU to exit (the guest powered off); its console.
    #[track_caller]
    pub fn wait_exit(&mut self, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                assert!(status.success(), "QEMU exited with {status}:\n{}", self.console_text());
                return self.console_text();
            }
            assert!(Instant::now() < deadline, "the guest did not power off in {limit:?}:\n{}", self.console_text());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
