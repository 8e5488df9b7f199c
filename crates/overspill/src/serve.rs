//! `overspill serve`: open the golden images, bind the socket, serve until SIGTERM or SIGINT,
//! then drain: stop accepting, let each connection finish the request in hand, drop anonymous
//! VMs' overlays (and their cache files), hand named VMs to the next server (their state files
//! kept), remove the socket, and exit 0. SIGHUP does the same and then execs the binary in place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use overspill_engine::{BackingKind, GoldenImage, HostMemory, WriteCacheMode};
use overspill_nbd::counters::ProtocolCounters;
use overspill_nbd::{Limits, Security, Server, ServerConfig};
use overspill_net::{ListenAddr, Listener, SocketAccess, TlsMode};
use overspill_server::exports::SPILLING_VM_MINIMUM_BYTES;
use overspill_sources::{open_source, Source, SourceError, SourceSettings};
use sd_notify::NotifyState;

use crate::metrics;

mod memory;
mod signals;
mod socket;
use crate::security::SecurityArgs;
use crate::size::{format_bytes, parse_bytes};
use memory::{
    default_memory_dir, ram_total_within, spawn_memory_sampler, warn_unless_blocks_are_told_apart,
    warn_unless_in_memory,
};
use overspill_server::boot_pacing::PacingSettings;
use overspill_server::control;
use overspill_server::exports::{CacheSettings, OverlayExports, DEFAULT_SPILL_WRITERS};
use overspill_server::images::ImageStore;
use overspill_server::vm_limits::HostBudget;
use overspill_server::vms::Lifecycle;
use overspill_server::vms::VmRegistry;
use overspill_vhost::{VhostExport, VhostExports, VhostSettings};
pub use signals::{reload_refused, ReloadCheck, RunningPlaces};
use signals::{spawn_signal_handler, SignalTargets, RESTART};
use socket::{inherited_listener, listen, parse_socket_mode, socket_access, DEFAULT_LISTEN};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file of serve's flags (`ram = "256M"`, `listen = "unix:/run/overspill.sock"`,
    /// `export = ["win7=/srv/win7.img"]`); flags given on the command line win.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The default golden image (export name ""): a raw, qcow2 or VHDX file, s3://BUCKET/KEY,
    /// http(s)://HOST/PATH (a server that honours Range, or a presigned URL) or
    /// rbd:POOL/IMAGE@SNAPSHOT. Opened read-only, never written.
    #[arg(long, value_name = "SOURCE")]
    base: Option<String>,
    /// More golden images as NAME=SOURCE; clients pick one by export name (NAME or NAME@VM).
    #[arg(long = "export", value_name = "NAME=SOURCE")]
    exports: Vec<String>,
    /// Keep what remote golden images (S3, HTTP, RBD) fetch in a local sparse file in the spill
    /// directory, so each block crosses the network once per server.
    #[arg(long)]
    local_tier: bool,
    /// Ceph configuration for rbd: sources (default: CEPH_CONF, then /etc/ceph/ceph.conf).
    #[arg(long, value_name = "FILE")]
    ceph_conf: Option<PathBuf>,
    /// The chunk remote golden images (S3, HTTP, RBD) are fetched in: larger means fewer requests and
    /// more bytes for scattered reads.
    #[arg(long, default_value = "256K", value_parser = parse_bytes)]
    remote_chunk: u64,
    /// Ceph client id for rbd: sources, without "client." (default: admin).
    #[arg(long, value_name = "ID")]
    ceph_id: Option<String>,
    /// A versioned image store (see `overspill image`): each image in it is an export, and a VM
    /// gets the image's current version.
    #[arg(long, value_name = "DIR")]
    images: Option<PathBuf>,
    /// unix:PATH or tcp:HOST:PORT.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: ListenAddr,
    /// Permissions of a unix: socket, in octal (for example 660). A client needs write permission
    /// to connect; the default leaves what the umask gives.
    #[arg(long, value_name = "OCTAL", value_parser = parse_socket_mode)]
    socket_mode: Option<u32>,
    /// Group of a unix: socket, by name or number: the group QEMU runs as under libvirt
    /// (libvirt-qemu on Debian, qemu elsewhere), with --socket-mode 660.
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// Where each VM's writes go: ram+disk, ram, disk or shared.
    #[arg(long, default_value = "ram+disk")]
    mode: WriteCacheMode,
    /// Cache memory target per VM (RAM tier, open spill segment and index).
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    ram: u64,
    /// Cap on the cache memory of all VMs and the golden images' read caches together (the
    /// read caches take what the VMs leave). A spilling VM keeps 2.25 MiB of it at the least
    /// (its open segment and index), so it also bounds how many are served at once.
    #[arg(long, default_value = "8G", value_parser = parse_bytes)]
    ram_total: u64,
    /// Free memory the caches leave to the host (MemAvailable, or the room under the cgroup's
    /// memory limit when less): below it, VMs' targets shrink.
    #[arg(long, default_value = "512M", value_parser = parse_bytes)]
    ram_floor: u64,
    /// Directory of the spill files (ram+disk) and local cache files (disk).
    #[arg(long, default_value = "/var/tmp/overspill")]
    spill_dir: PathBuf,
    /// Directory standing for shared storage, for the differencing files of mode `shared`
    /// (default: SPILL_DIR/shared).
    #[arg(long)]
    shared_dir: Option<PathBuf>,
    /// Limit on each VM's spill file (one 2 MiB segment of it kept for compaction); beyond it
    /// the VM gets ENOSPC.
    #[arg(long, value_parser = parse_bytes)]
    spill_max: Option<u64>,
    /// Write spill segments with O_DIRECT: no dirty page-cache pages for spilled data, but each
    /// VM then waits for the disk itself once its last segment is still being written. Segments
    /// a VM writes itself (no writer free) still go through the page cache.
    #[arg(long)]
    spill_direct: bool,
    /// Spill segments written in the background at once, host-wide (each holds the 2 MiB of the
    /// segment it writes, and with --spill-direct an aligned 2 MiB buffer kept for reuse); a VM
    /// sealing a segment when all are busy writes it itself. 0 writes every segment in the
    /// VM's own request thread.
    #[arg(long, default_value_t = DEFAULT_SPILL_WRITERS)]
    spill_writers: usize,
    /// Connections served at once; more are refused.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections still in their handshake at once (counted in --max-connections): past it,
    /// new clients wait and the oldest handshake is cut off once it has had a second.
    #[arg(long, default_value_t = 128)]
    max_handshakes: usize,
    /// Shared read cache per golden image version (all its VMs read through it); 0 turns it
    /// off. The read caches hold within --ram-total beside the VMs: they take only memory the
    /// VMs leave, and give it back first when a VM needs it (down to --read-cache-floor).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    read_cache: u64,
    /// What the read caches together keep whatever the VMs need: a boot storm's golden reads
    /// still find the image's hot blocks. They may hold it beyond what --ram-total leaves.
    /// Default: a quarter of --ram-total, at most 256M.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    read_cache_floor: Option<u64>,
    /// Record every VM's requests (no data) to DIR/<vm>-<n>.trace, for `replay` and `plan`.
    #[arg(long, value_name = "DIR")]
    record: Option<PathBuf>,
    /// Serve Prometheus metrics (and /healthz) on tcp:HOST:PORT.
    #[arg(long, value_name = "tcp:HOST:PORT")]
    metrics: Option<String>,
    /// How long a named VM (export IMAGE@NAME) whose connection was lost without NBD_CMD_DISC
    /// (over vhost-user: closed without QEMU stopping the device first) keeps its overlay for it
    /// to reconnect (e.g. 30s, 5m). 0 drops it at once and keeps no state files, so a named VM
    /// with writes is refused after any server restart until reset.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    reconnect_grace: Duration,
    /// The ledger of named VMs with writes: the next server rebuilds them from it, and refuses
    /// the names whose writes it cannot recover instead of serving them golden data (default:
    /// SPILL_DIR/state; also the default control socket's place).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Where named VMs keep their pages, so that their overlays outlive this process (a restart,
    /// an upgrade, a crash): a memory-backed directory, wiped at reboot (default:
    /// /dev/shm/overspill-HASH, HASH naming the state directory).
    #[arg(long, value_name = "DIR")]
    memory_dir: Option<PathBuf>,
    /// The control socket of `overspill vm` (default: STATE_DIR/control.sock).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Write the server's process id to FILE once it listens; removed when it exits cleanly.
    #[arg(long, value_name = "FILE")]
    pidfile: Option<PathBuf>,
    /// Time a client has, from its connection, to finish the handshake (TLS included), however
    /// it spreads its bytes (e.g. 10s; a bare number is seconds).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    handshake_timeout: Duration,
    /// Microseconds a VM's connection polls its socket (over vhost-user: its queue) for the next
    /// request before it sleeps: waking a sleeping thread costs more than a 4 KiB request on
    /// virtual machines. 0 sleeps at once (less CPU for VMs that pause between requests).
    #[arg(long, default_value_t = overspill_nbd::connection::DEFAULT_POLL_BEFORE_SLEEP.as_micros() as u64)]
    poll_us: u64,
    /// Time a VM may send nothing before it is disconnected, as a lost connection (e.g. 10m; a
    /// bare number is seconds); 0 waits forever.
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    idle_timeout: Duration,
    /// Time a request has to arrive whole (header and payload) once its first byte has, however
    /// the client spreads its bytes, and time a client has to take replies the socket cannot
    /// hold; a VM that takes longer is disconnected (e.g. 60s).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    request_timeout: Duration,
    /// Let connections without a VM name (export IMAGE, not IMAGE@NAME) write, each to a
    /// private overlay that ends with its connection: any reconnect, however short, reverts
    /// such a disk to the golden image. For tests and benchmarks; without it they are served
    /// read-only (inspection and copying work as before).
    #[arg(long)]
    anonymous_writes: bool,
    /// Serve VM NAME over vhost-user-blk too, at VHOST_USER_DIR/NAME.sock, on golden image
    /// IMAGE (the default one without =IMAGE): for QEMU (`-chardev
    /// socket,id=c0,path=SOCKET,reconnect-ms=1000 -device vhost-user-blk-pci,chardev=c0` with
    /// its memory shared; other VMMs that speak vhost-user-blk are untested). The VM
    /// is the same one an NBD client naming IMAGE@NAME gets, one client at a time. Repeatable.
    #[arg(long = "vhost-user", value_name = "NAME[=IMAGE]")]
    vhost_user: Vec<String>,
    /// Directory of the vhost-user sockets (default: STATE_DIR/vhost-user); --socket-mode and
    /// --socket-group apply to them too.
    #[arg(long, value_name = "DIR")]
    vhost_user_dir: Option<PathBuf>,
    /// Queues each vhost-user device offers: QEMU's num-queues (by default its vCPU count) may
    /// be at most this. All of a VM's queues are served by one thread.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    vhost_user_queues: u16,
    /// VM names (shell patterns: `*`, `?`) whose clients may open several connections at once,
    /// all serving the VM's one overlay: NBD multi-conn, advertised to them (nbdcopy and
    /// libnbd open up to 4, the Linux nbd client one queue per connection). A flush on any
    /// connection covers the writes completed on all. Without it a second connection of a
    /// connected VM is refused: the server cannot tell it from a second QEMU. Repeatable;
    /// such a VM does not move to a peer while it has several connections.
    #[arg(long = "multi-conn", value_name = "GLOB")]
    multi_conn: Vec<String>,
    /// The test group: VM names (shell patterns), or `group:NAME` for a named group's VMs
    /// (--group). A new VM of it gets an image's test version while the image has one
    /// (`overspill image test IMAGE VERSION`; `image promote` makes it production for all).
    /// Images of the store (--images) only. `overspill vm test-group` changes it live.
    /// Repeatable.
    #[arg(long = "test-vms", value_name = "GLOB")]
    test_vms: Vec<String>,
    /// Each VM's operations per second (reads, writes, zeroes, trims), with a burst: `1000`
    /// (a burst of one second's worth) or `1000:5000`. Requests over it wait, over NBD and
    /// vhost-user alike. `overspill vm limit NAME` changes one VM's, live. Default: none.
    #[arg(long, value_name = "RATE[:BURST]", value_parser = crate::size::parse_ops_rate)]
    limit_iops: Option<overspill_block::Rate>,
    /// Each VM's bytes per second read and written, with a burst: `50M` or `50M:200M`.
    #[arg(long, value_name = "SIZE[:BURST]", value_parser = crate::size::parse_bytes_rate)]
    limit_bandwidth: Option<overspill_block::Rate>,
    /// One VM's operations per second, by its name, before it connects: `build-7=500:2000`.
    /// Over --limit-iops for that VM. Repeatable.
    #[arg(long = "vm-limit-iops", value_name = "VM=RATE[:BURST]", value_parser = parse_vm_ops)]
    vm_limit_iops: Vec<(String, overspill_block::Rate)>,
    /// One VM's bytes per second, by its name: `build-7=20M` or `build-7=20M:100M`. Repeatable.
    #[arg(long = "vm-limit-bandwidth", value_name = "VM=SIZE[:BURST]", value_parser = parse_vm_bytes)]
    vm_limit_bandwidth: Vec<(String, overspill_block::Rate)>,
    /// A named group of VMs: `office=desk-*,kiosk-?` (shell patterns of VM names). A VM is in
    /// the first group whose patterns match its name, else in its image's group (`image:NAME`,
    /// `image:` for the default image). Its requests pass its own limits and its group's,
    /// which the group's VMs share. Repeatable.
    #[arg(long = "group", value_name = "NAME=GLOB[,GLOB…]", value_parser = parse_group)]
    groups: Vec<(String, Vec<String>)>,
    /// A group's operations per second, shared by its VMs: `office=2000` or `office=2000:500`
    /// (`image:win10=…` for an image's). `overspill vm limit --group NAME` changes it live.
    /// Repeatable.
    #[arg(long = "group-limit-iops", value_name = "GROUP=RATE[:BURST]", value_parser = parse_group_ops)]
    group_limit_iops: Vec<(String, overspill_block::Rate)>,
    /// A group's bytes per second, shared by its VMs: `office=200M` or `office=200M:1G`.
    /// Repeatable.
    #[arg(long = "group-limit-bandwidth", value_name = "GROUP=SIZE[:BURST]", value_parser = parse_group_bytes)]
    group_limit_bandwidth: Vec<(String, overspill_block::Rate)>,
    /// The host's golden-image fetches per second, all VMs together: what the read caches
    /// miss (every golden read without one). A fetch is charged when it returns and its
    /// answer waits out what it took beyond the budget; a booting VM's fetches go first (they
    /// never wait, the others wait out their share). `overspill vm limit --host golden`
    /// changes it live. Default: none.
    #[arg(long, value_name = "RATE[:BURST]", value_parser = crate::size::parse_ops_rate)]
    golden_limit_iops: Option<overspill_block::Rate>,
    /// The host's golden-image fetch bytes per second, all VMs together: `200M` or `200M:1G`.
    #[arg(long, value_name = "SIZE[:BURST]", value_parser = crate::size::parse_bytes_rate)]
    golden_limit_bandwidth: Option<overspill_block::Rate>,
    /// The host's spill writes, bytes per second for all VMs' 2 MiB segment writes together:
    /// below what the spill disk sustains, so that a storm of spilling VMs leaves it room to
    /// answer reads of what they spilled. A VM's requests wait only when it seals a segment
    /// before its last one is written. Needs --spill-writers above 0. `overspill vm limit
    /// --host spill` changes it live. Default: none.
    #[arg(long, value_name = "SIZE[:BURST]", value_parser = crate::size::parse_bytes_rate)]
    spill_limit_bandwidth: Option<overspill_block::Rate>,
    /// Most VMs booting at once (PVS's "maximum devices booting"): a VM's first request on a
    /// fresh overlay waits, in order of arrival, until fewer are booting. A VM boots for
    /// --boot-time, or until `overspill vm booted NAME`. Default: no cap (boots are still
    /// known: their golden-image fetches go first at --golden-limit-iops).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    boot_max: Option<u64>,
    /// How long a VM counts as booting from its first request, unless told sooner.
    #[arg(long, default_value = "3m", value_parser = parse_duration)]
    boot_time: Duration,
    /// This server's socket for its peers (live migration; see --peer): unix:PATH, made mode
    /// 0600, or tcp:HOST:PORT, over TLS where both ends prove themselves with a certificate of
    /// the peer CA (--tls-cert, --tls-key, --peer-ca). A peer that connects may take any VM this
    /// server holds.
    #[arg(long, value_name = "ADDRESS")]
    peer_listen: Option<ListenAddr>,
    /// Another overspill server's peer socket (its --peer-listen): a named VM that connects here
    /// while that server holds it live is moved here, its writes with it (live migration);
    /// repeatable. While a peer cannot be asked, VMs this server does not hold are refused
    /// (one of them may be running there). A tcp:HOST:PORT peer's certificate must name HOST
    /// and chain to the peer CA.
    #[arg(long = "peer", value_name = "ADDRESS")]
    peers: Vec<ListenAddr>,
    #[command(flatten)]
    security: SecurityArgs,
}

/// The export a VM's client opens, as the serving line and systemd's status show it: a named
/// VM (`@NAME`), since an unnamed one is read-only (or, with --anonymous-writes, reverts at
/// any reconnect).
const EXAMPLE_EXPORT: &str = "@NAME";

fn open_images(args: &ServeArgs) -> anyhow::Result<BTreeMap<String, Arc<dyn GoldenImage>>> {
    let mut images: BTreeMap<String, Arc<dyn GoldenImage>> = BTreeMap::new();
    let settings = SourceSettings {
        ceph_conf: args.ceph_conf.clone(),
        ceph_id: args.ceph_id.clone(),
        local_tier_dir: args.local_tier.then(|| args.spill_dir.clone()),
        remote_fetch_bytes: Some(args.remote_chunk),
    };
    let mut add = |name: &str, spec: &str| -> anyhow::Result<()> {
        if name.contains('@') {
            bail!("export name {name:?} may not contain '@' (it separates the VM name)");
        }
        let source = Source::parse(spec)?;
        let image = match open_source(&source, &settings) {
            Ok(image) => image,
            // Named already, by the name a remote source shows (without credentials).
            Err(error @ SourceError::Remote { .. }) => bail!("golden image {error}"),
            // A URL's query may be a signature: the source as its Display redacts it.
            Err(error) => return Err(anyhow::Error::from(error).context(format!("golden image {source}"))),
        };
        tracing::info!(export = name, source = %image.describe(), size = image.size(), "golden image");
        if images.insert(name.to_owned(), image).is_some() {
            bail!("export {name:?} is given twice");
        }
        Ok(())
    };
    if let Some(base) = &args.base {
        add("", base)?;
    }
    for spec in &args.exports {
        // A URL given without NAME= splits at its query's first '=': no name holds "://".
        let (name, source) = spec
            .split_once('=')
            .filter(|(name, _)| !name.contains("://"))
            .with_context(|| format!("--export {:?}: use NAME=SOURCE", overspill_sources::redact(spec)))?;
        add(name, source)?;
    }
    if images.is_empty() && args.images.is_none() {
        bail!("nothing to serve: give --base IMAGE, --export NAME=IMAGE or --images DIR");
    }
    Ok(images)
}

impl ServeArgs {
    /// The state directory: `--state-dir`, else SPILL_DIR/state.
    fn state_dir_in_use(&self) -> PathBuf {
        self.state_dir.clone().unwrap_or_else(|| self.spill_dir.join("state"))
    }

    /// The memory directory: `--memory-dir`, else one in /dev/shm named after the state directory.
    fn memory_dir_in_use(&self) -> PathBuf {
        self.memory_dir.clone().unwrap_or_else(|| default_memory_dir(&self.state_dir_in_use()))
    }

    /// Mode `shared`'s directory: `--shared-dir`, else SPILL_DIR/shared.
    fn shared_dir_in_use(&self) -> PathBuf {
        self.shared_dir.clone().unwrap_or_else(|| self.spill_dir.join("shared"))
    }
}

/// How `serve` ended.
pub enum ServeEnd {
    /// SIGTERM or SIGINT: every VM handed over, the process exits.
    Stopped,
    /// SIGHUP: every VM handed over, the process is to become a new server (the binary now at
    /// its path, with the same arguments), keeping this listening socket when systemd passed it.
    Restart(Option<std::os::fd::OwnedFd>),
}

pub fn run(args: ServeArgs, reload_check: ReloadCheck) -> anyhow::Result<ServeEnd> {
    // From the start: a SIGTERM while the images open and the VMs of the last server are
    // rebuilt stops the start at once (as its default action did), and a SIGHUP then waits for
    // the server to serve (its default action ended the process).
    let signal_targets = spawn_signal_handler()?;
    check_sizes_and_limits(&args)?;
    // The socket group's lookup and membership, before anything starts.
    let access = socket_access(&args)?;
    // First of all the work of starting: a service manager's setup gone wrong is reported at
    // once, not after the images are opened and every VM of the last server is rebuilt.
    let inherited = inherited_listener()?;
    raise_open_file_limit();
    let images = open_images(&args)?;
    let security = args.security.security().context("TLS and access settings")?;
    let (state_dir, memory_dir) = (args.state_dir_in_use(), args.memory_dir_in_use());
    let ram_total = ram_total_within(&memory_dir, args.ram_total);
    // Declared before everything that puts files in it, so dropped after them all.
    let mut litter =
        args.memory_dir.is_none().then(|| EmptyDirRemoved { dir: memory_dir.clone(), armed: !memory_dir.exists() });
    let host = HostMemory::new(ram_total, args.ram_floor);
    // The read caches' chunks are anonymous memory: bounded by --ram-total as given, not by
    // the memory directory's size, which holds the VMs' pages only.
    host.set_read_caches(args.ram_total, args.read_cache_floor.unwrap_or((args.ram_total / 4).min(256 << 20)));
    if args.read_cache > args.ram_total {
        tracing::info!(
            read_cache = %format_bytes(args.read_cache),
            ram_total = %format_bytes(args.ram_total),
            "a read cache may hold only what --ram-total leaves it beside the VMs"
        );
    }
    let (mut exports, cache_dirs) = overlay_exports(&args, images, host.clone(), &state_dir, &memory_dir)?;
    let registry = exports.registry();
    registry.limits().set_default(overspill_block::Limits { ops: args.limit_iops, bytes: args.limit_bandwidth });
    registry.limits().set_groups(args.groups.clone());
    for (vm, rate) in &args.vm_limit_iops {
        registry.limits().set(vm, Some(Some(*rate)), None);
    }
    for (vm, rate) in &args.vm_limit_bandwidth {
        registry.limits().set(vm, None, Some(Some(*rate)));
    }
    for (group, rate) in &args.group_limit_iops {
        registry.limits().set_group(group, Some(Some(*rate)), None);
    }
    for (group, rate) in &args.group_limit_bandwidth {
        registry.limits().set_group(group, None, Some(Some(*rate)));
    }
    for (group, _) in args.group_limit_iops.iter().chain(&args.group_limit_bandwidth) {
        if !registry.limits().group_known(group) {
            tracing::warn!(
                group,
                "a group limit names a group no --group gives: no VM is in it (an image's group is image:NAME)"
            );
        }
    }
    let limits = registry.limits();
    if args.golden_limit_iops.is_some() || args.golden_limit_bandwidth.is_some() {
        limits.set_host(HostBudget::Golden, Some(args.golden_limit_iops), Some(args.golden_limit_bandwidth));
    }
    if args.spill_limit_bandwidth.is_some() {
        limits.set_host(HostBudget::Spill, None, Some(args.spill_limit_bandwidth));
    }
    registry.boots().set(PacingSettings {
        max_booting: args.boot_max.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        boot_time: args.boot_time,
    });
    registry.allow_multi_conn(args.multi_conn.clone());
    registry.set_test_vms(args.test_vms.clone());
    if !args.test_vms.is_empty() && args.images.is_none() {
        tracing::warn!("--test-vms names the VMs that get an image store's test versions, and there is no --images");
    }
    let control_path = args.control.clone().unwrap_or_else(|| state_dir.join("control.sock"));
    let control = control::spawn(&control_path, registry.clone())?;
    let _peer_listener = serve_peers(&args, &mut exports, &registry, &control)?;
    exports.settle_in_doubt();
    if let Some(dir) = &args.record {
        exports.record_to(dir.clone()).with_context(|| format!("recording to {}", dir.display()))?;
    }
    let protocol_counters = Arc::new(ProtocolCounters::default());
    if let Some(addr) = &args.metrics {
        let bound = metrics::spawn_endpoint(
            addr.strip_prefix("tcp:").unwrap_or(addr),
            exports.registry(),
            exports.read_caches(),
            host.clone(),
            protocol_counters.clone(),
            cache_dirs,
        )?;
        tracing::info!(metrics = %format!("http://{bound}/metrics"), "metrics endpoint up");
    }
    let config = server_config(&args, security, protocol_counters);
    // Where the VMs' pages are files: a memory directory that other users fill after the start
    // must make VMs spill, not refuse their writes.
    let pages_dir = (!args.reconnect_grace.is_zero()).then(|| memory_dir.clone());
    spawn_memory_sampler(
        host,
        Arc::downgrade(&registry),
        exports.read_caches(),
        pages_dir,
        u64::from(config.limits.max_payload_bytes),
    );
    let config_tls_mode = config.security.tls.as_ref().map_or(TlsMode::Off, |tls| tls.mode());
    let exports = Arc::new(exports);
    spawn_image_watch(Arc::downgrade(&exports));
    let server = Server::new(exports.clone(), config);
    // Before the socket exists: a signal once clients can connect always drains.
    let places =
        RunningPlaces { state_dir: state_dir.clone(), memory_dir: memory_dir.clone(), mode: args.mode.to_string() };
    signal_targets.serve(SignalTargets {
        shutdown: server.shutdown_handle(),
        registry: registry.clone(),
        reload_check: Box::new(move || reload_check(&places)),
    });
    let vhost = serve_vhost_user(&args, access, &state_dir, exports)?;
    control.serve_sockets(vhost.clone());
    let listener = listen(&args, access, inherited)?;
    // Absolute, as a hook comparing a domain's socket with it resolves paths from elsewhere.
    let nbd_listen = match listener.local_addr() {
        ListenAddr::Unix(path) => ListenAddr::Unix(std::path::absolute(&path).unwrap_or(path)),
        tcp => tcp,
    };
    control.serve_nbd_listen(vec![nbd_listen.to_string()]);
    tracing::info!(
        uri = %listener.local_addr().nbd_uri(EXAMPLE_EXPORT, config_tls_mode != TlsMode::Off),
        anonymous = if args.anonymous_writes { "writable, reverted at any reconnect" } else { "read-only" },
        listen = %listener.local_addr(),
        mode = %args.mode,
        ram_per_vm = %format_bytes(args.ram),
        ram_total = %format_bytes(ram_total),
        tls = ?config_tls_mode,
        reconnect_grace = %humantime::format_duration(args.reconnect_grace),
        control = %control_path.display(),
        spill_dir = %args.spill_dir.display(),
        state_dir = %state_dir.display(),
        memory_dir = %memory_dir.display(),
        "serving"
    );
    let _pidfile = args.pidfile.as_deref().map(PidFile::write).transpose()?;
    if let Some(litter) = &mut litter {
        litter.armed = true;
    }
    let uri = listener.local_addr().nbd_uri(EXAMPLE_EXPORT, config_tls_mode != TlsMode::Off);
    notify_service_manager(&[NotifyState::Ready, NotifyState::Status(&format!("serving {uri}"))]);
    server.run(&listener).context("accepting connections")?;
    let end = drain(&server, vhost, &registry, &listener)?;
    // Removes the Unix sockets this server made.
    drop(listener);
    drop(control);
    Ok(end)
}

/// The peer socket (`--peer-listen`) and the peers asked for VMs (`--peer`).
fn serve_peers(
    args: &ServeArgs,
    exports: &mut OverlayExports,
    registry: &Arc<VmRegistry>,
    control: &control::Control,
) -> anyhow::Result<Option<overspill_server::migration::PeerListener>> {
    let tcp = args.peer_listen.iter().chain(&args.peers).find(|addr| matches!(addr, ListenAddr::Tcp(_)));
    let tls = match tcp {
        Some(addr) => Some(Arc::new(args.security.peer_tls().context("peer TLS")?.with_context(|| {
            format!(
                "{addr}: a peer link over TCP is TLS with a certificate at each end: give --tls-cert, --tls-key \
                 and --peer-ca, the CA that signed every peer's certificate (pre-shared keys are for NBD \
                 clients only)"
            )
        })?)),
        None => None,
    };
    // With TLS the name is proven by the certificate; else it is the peer socket's path.
    let name = match (&tls, &args.peer_listen) {
        (Some(tls), _) => tls.name().to_owned(),
        (None, Some(ListenAddr::Unix(path))) => {
            std::path::absolute(path).unwrap_or_else(|_| path.clone()).display().to_string()
        }
        (None, _) => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}:{}", host.trim(), std::process::id())
        }
    };
    if !args.peers.is_empty() {
        tracing::info!(peers = args.peers.len(), name, "named VMs that connect are asked for at the peers first");
        let peers =
            overspill_server::migration::Peers { name: name.clone(), addresses: args.peers.clone(), tls: tls.clone() };
        control.serve_peers(peers.clone());
        exports.with_peers(peers);
    }
    let Some(address) = &args.peer_listen else { return Ok(None) };
    // A source only (no --peer) still sends VMs to other hosts: its images' digests are needed.
    exports.with_image_digests();
    let listener = overspill_server::migration::listen(address, name, tls, registry.clone())
        .with_context(|| format!("--peer-listen {address}"))?;
    tracing::info!(peer_listen = %address, "peer socket up");
    Ok(Some(listener))
}

/// The vhost-user sockets of the VMs `--vhost-user` declares and of those declared at run time
/// (`vm add`, kept in STATE_DIR/vhost-user-vms), made before the server says it is ready (QEMU
/// connects at its start).
fn serve_vhost_user(
    args: &ServeArgs,
    access: SocketAccess,
    state_dir: &Path,
    exports: Arc<dyn overspill_block::ExportProvider>,
) -> anyhow::Result<Arc<VhostExports>> {
    let declared = args
        .vhost_user
        .iter()
        .map(|spec| {
            let (vm, image) = spec.split_once('=').unwrap_or((spec.as_str(), ""));
            overspill_server::error::check_name("VM", vm).with_context(|| format!("--vhost-user {spec}"))?;
            Ok(VhostExport { vm: vm.to_owned(), image: image.to_owned() })
        })
        .collect::<anyhow::Result<Vec<VhostExport>>>()?;
    let dir = args.vhost_user_dir.clone().unwrap_or_else(|| state_dir.join("vhost-user"));
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir).with_context(|| format!("--vhost-user-dir {}", dir.display()))?;
        // QEMU, running as another user, reaches its socket through it whatever the umask
        // (the packaged unit's 0077 made it 0700): the sockets' own mode and group say who
        // may connect.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("--vhost-user-dir {}", dir.display()))?;
    }
    let settings = VhostSettings {
        dir: dir.clone(),
        access,
        queues: args.vhost_user_queues,
        poll: Duration::from_micros(args.poll_us),
        record: Some((state_dir.join("vhost-user-vms"), write_vhost_user_record)),
    };
    let vhost = VhostExports::start(settings, &declared, exports)
        .with_context(|| format!("--vhost-user sockets in {}", dir.display()))?;
    let sockets = vhost.sockets().len();
    if sockets > 0 {
        tracing::info!(dir = %dir.display(), vms = sockets, "vhost-user sockets up");
    }
    Ok(Arc::new(vhost))
}

/// The record of VMs declared at run time, written as the ledger's files are: through a
/// partial file of our own (a planted link is replaced, not followed), synced, renamed.
fn write_vhost_user_record(record: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let partial = record.with_file_name(".vhost-user-vms.partial");
    overspill_server::files::replace_whole_durably(record, &partial, bytes, 0o600)
}

/// Flags that contradict each other or cannot work, refused before anything starts.
fn check_sizes_and_limits(args: &ServeArgs) -> anyhow::Result<()> {
    // Unlike --idle-timeout, these cannot be off: 0 would cut every client at once.
    for (flag, limit) in [("--handshake-timeout", args.handshake_timeout), ("--request-timeout", args.request_timeout)]
    {
        if limit.is_zero() {
            bail!("{flag} must be above 0 (it bounds how long a client may take; there is no \"off\")");
        }
    }
    if args.ram > args.ram_total {
        bail!(
            "--ram {} is above --ram-total {}: no VM could reach its target",
            format_bytes(args.ram),
            format_bytes(args.ram_total)
        );
    }
    if args.spill_limit_bandwidth.is_some() && args.spill_writers == 0 {
        bail!("--spill-limit-bandwidth paces the spill writers: --spill-writers 0 has none");
    }
    if args.spill_limit_bandwidth.is_some() && args.mode.backing_file() != Some(BackingKind::SpillLog) {
        bail!("--spill-limit-bandwidth paces spill segment writes: mode {} has no spill log", args.mode);
    }
    // Checked here, naming the flag: found later, each VM that spills (or each remote image)
    // would be refused instead, and recovered VMs lost.
    let segment = overspill_engine::SEGMENT_BYTES as u64;
    if let Some(max) = args.spill_max.filter(|&max| max < 2 * segment) {
        bail!(
            "--spill-max {} holds fewer than two 2 MiB segments (one is kept for compaction): give at least 4M, \
             or leave it out for no limit",
            format_bytes(max)
        );
    }
    if !args.remote_chunk.is_power_of_two() || args.remote_chunk < 4096 {
        bail!("--remote-chunk {} must be a power of two of at least 4K", format_bytes(args.remote_chunk));
    }
    if args.boot_time.is_zero() {
        bail!("--boot-time must be above 0 (without --boot-max, boots only give golden-image fetches priority)");
    }
    if args.mode.backing_file() == Some(BackingKind::SpillLog) && args.ram_total < SPILLING_VM_MINIMUM_BYTES {
        bail!(
            "--ram-total {} cannot hold one VM: a spilling VM keeps {} (its open segment and index) in memory",
            format_bytes(args.ram_total),
            format_bytes(SPILLING_VM_MINIMUM_BYTES)
        );
    }
    Ok(())
}

/// The exports of the golden images (and the image store), with the VMs' lifecycle; with the
/// directories their cache files go in.
fn overlay_exports(
    args: &ServeArgs,
    images: BTreeMap<String, Arc<dyn GoldenImage>>,
    host: Arc<HostMemory>,
    state_dir: &Path,
    memory_dir: &Path,
) -> anyhow::Result<(OverlayExports, Vec<PathBuf>)> {
    let settings = CacheSettings {
        mode: args.mode,
        ram_target_bytes: args.ram,
        spill_max_bytes: args.spill_max,
        spill_direct: args.spill_direct,
        spill_writers: args.spill_writers,
        spill_dir: args.spill_dir.clone(),
        shared_dir: args.shared_dir_in_use(),
        read_cache_bytes: args.read_cache,
    };
    let cache_dirs: Vec<PathBuf> = settings.cache_dir().map(|(_, dir)| dir.clone()).into_iter().collect();
    let mut exports = OverlayExports::new(images, settings, host)?;
    if args.anonymous_writes {
        exports.allow_anonymous_writes();
    }
    if let Some(dir) = &args.images {
        let found = ImageStore::new(dir).images().with_context(|| format!("--images {}", dir.display()))?;
        if found.is_empty() {
            tracing::warn!(dir = %dir.display(), "the image store has no images yet (see `overspill image publish`)");
        }
        exports.with_image_store(dir);
    }
    exports
        .with_lifecycle(Lifecycle {
            reconnect_grace: args.reconnect_grace,
            state_dir: Some(state_dir.to_owned()),
            memory_dir: Some(memory_dir.to_owned()),
        })
        .with_context(|| format!("state directory {}", state_dir.display()))?;
    if let Some(dir) = &args.memory_dir {
        warn_unless_in_memory(dir);
    } else if !args.reconnect_grace.is_zero() && std::env::var_os("INVOCATION_ID").is_some() {
        // systemd sets INVOCATION_ID for the processes of a unit.
        tracing::warn!(
            dir = %memory_dir.display(),
            "started by systemd with the VMs' pages in /dev/shm: a unit with DynamicUser= or RemoveIPC= (and a \
             user other than root) has its files there removed when it stops, and then no VM would outlive a \
             restart. Give --memory-dir a directory under RuntimeDirectory= with RuntimeDirectoryPreserve=yes, as \
             docs/overspill.service does"
        );
    }
    if !args.reconnect_grace.is_zero() && std::env::var_os("INVOCATION_ID").is_some() {
        warn_of_private_tmp(args, state_dir);
    }
    if !args.reconnect_grace.is_zero() && args.mode.backing_file() != Some(BackingKind::SpillLog) {
        if let Some(dir) = cache_dirs.first() {
            warn_unless_blocks_are_told_apart(dir, args.mode);
        }
    }
    Ok((exports, cache_dirs))
}

fn server_config(args: &ServeArgs, security: Security, counters: Arc<ProtocolCounters>) -> ServerConfig {
    ServerConfig {
        limits: Limits {
            handshake_timeout: args.handshake_timeout,
            idle_timeout: (!args.idle_timeout.is_zero()).then_some(args.idle_timeout),
            request_timeout: args.request_timeout,
            poll_before_sleep: Duration::from_micros(args.poll_us),
            ..Limits::default()
        },
        max_connections: args.max_connections,
        max_handshakes: args.max_handshakes.max(1),
        security,
        counters,
    }
}

/// After the accept loop returned: connections finish the request in hand, VMs in grace are
/// handed to the next server, and the end says whether this process becomes that server.
fn drain(
    server: &Server,
    vhost: Arc<VhostExports>,
    registry: &VmRegistry,
    listener: &Listener,
) -> anyhow::Result<ServeEnd> {
    if !RESTART.load(std::sync::atomic::Ordering::SeqCst) {
        notify_service_manager(&[NotifyState::Stopping, NotifyState::Status("draining connections")]);
    }
    // Connections close after the request in hand; anonymous VMs' overlays drop, removing their
    // cache files, and named VMs go into grace.
    if !server.wait_idle(DRAIN_TIMEOUT) {
        tracing::warn!(
            connections = server.active_connections(),
            "connections still busy after {DRAIN_TIMEOUT:?}; exiting anyway (the next server removes their files)"
        );
    }
    // Each vhost-user connection finishes the request in hand and closes; QEMU sends the
    // others again to the next server.
    vhost.stop();
    // Overlays kept for VMs to reconnect go with the server; their names stay in the ledger.
    registry.hand_over_all_in_grace();
    Ok(if RESTART.load(std::sync::atomic::Ordering::SeqCst) {
        // A socket systemd passed is kept open for the next program; one bound here is made
        // again by it (clients retry meanwhile).
        let keep = if listener.is_inherited() { Some(listener.duplicate_fd()?) } else { None };
        tracing::info!("restarting in place: every VM is handed to the next server");
        ServeEnd::Restart(keep)
    } else {
        tracing::info!("shut down");
        ServeEnd::Stopped
    })
}

/// Each VM holds a few descriptors (its socket, its files): the usual soft limit of 1024 would
/// stop a host at a few hundred VMs while the hard limit allows far more, so take it all, and
/// say what it allows.
fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    // A named VM holds its socket twice (reader, and the handle that stops it), four state files
    // and its spill file.
    const DESCRIPTORS_PER_VM: u64 = 7;
    let limit = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(error) => {
                tracing::warn!(soft, hard, %error, "could not raise the open-file limit");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(error) => {
            tracing::warn!(%error, "could not read the open-file limit");
            return;
        }
    };
    tracing::info!(limit, vms = limit / DESCRIPTORS_PER_VM, "open-file limit (about this many VMs fit)");
}

/// Tells systemd (Type=notify) how the server is doing; nothing without NOTIFY_SOCKET.
fn notify_service_manager(states: &[NotifyState<'_>]) {
    if let Err(error) = sd_notify::notify(false, states) {
        tracing::debug!(%error, "could not notify the service manager");
    }
}

/// `--pidfile`: made whole (a temporary file renamed into place), removed at a clean exit if it
/// still names this process.
struct PidFile(PathBuf);

impl PidFile {
    fn write(path: &Path) -> anyhow::Result<Self> {
        // `.NAME.partial` beside it, a name of overspill's own: `NAME.partial` may be anyone's
        // (`--pidfile /run/x.pid` would have removed `/run/x.partial`).
        let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let partial = path.with_file_name(format!(".{file_name}.partial"));
        let text = format!("{}\n", std::process::id());
        overspill_server::files::replace_whole(path, &partial, text.as_bytes(), 0o644)
            .with_context(|| format!("--pidfile {}", path.display()))?;
        Ok(Self(path.to_owned()))
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.0).is_ok_and(|text| text.trim() == std::process::id().to_string());
        if ours {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Longest duration a flag takes: deadlines are `Instant::now() + duration`, which panics when
/// the sum leaves the clock's range (`--request-timeout 18446744073709551615` did).
const LONGEST_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A duration with its unit (`30s`, `5m`, `1h`); a bare number is seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text).map_err(|e| format!("{text:?}: {e} (for example 30s, 5m, 1h)"))?,
    };
    if duration > LONGEST_DURATION {
        return Err(format!("{text:?}: at most 100 years"));
    }
    Ok(duration)
}

/// Under systemd, what the server keeps across restarts in /tmp or /var/tmp, which a unit with
/// PrivateTmp= (docs/overspill.service has it) has of its own and loses when it stops.
fn warn_of_private_tmp(args: &ServeArgs, state_dir: &Path) {
    let shared = args.shared_dir_in_use();
    let kept = [
        ("--state-dir", Some(state_dir)),
        ("--spill-dir", Some(args.spill_dir.as_path())),
        ("--shared-dir", (args.mode == WriteCacheMode::Shared).then_some(shared.as_path())),
    ];
    for (flag, dir) in kept {
        let Some(dir) = dir.filter(|dir| dir.starts_with("/tmp") || dir.starts_with("/var/tmp")) else { continue };
        tracing::warn!(
            dir = %dir.display(),
            "started by systemd with {flag} under /tmp or /var/tmp: a unit with PrivateTmp= loses it when it \
             stops, and no VM outlives a restart; use CacheDirectory= (docs/overspill.service keeps \
             /var/cache/overspill)"
        );
    }
}

/// The default memory directory, in /dev/shm, named after the state directory: once no VM's
/// pages are left in it, it is litter there (removing fails unless it is empty), once this server
/// has served, or if it made it and failed to start. One that was there before a failed start
/// may be a live server's (a second start of the same command, refused its socket). A next
/// server makes it again.
struct EmptyDirRemoved {
    dir: PathBuf,
    armed: bool,
}

impl Drop for EmptyDirRemoved {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// How long SIGTERM waits for connections to finish the request in hand.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// `NAME=GLOB[,GLOB…]`: a named group of VMs and the patterns of its members' names.
fn parse_group(s: &str) -> Result<(String, Vec<String>), String> {
    let (name, patterns) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAME=GLOB[,GLOB…]"))?;
    if name.starts_with(overspill_server::vm_limits::IMAGE_GROUP_PREFIX) {
        return Err(format!("{name:?}: image groups are made by the server; name yours otherwise"));
    }
    overspill_server::vm_limits::check_group(name).map_err(|e| e.to_string())?;
    let patterns: Vec<String> = patterns.split(',').filter(|p| !p.is_empty()).map(str::to_owned).collect();
    if patterns.is_empty() {
        return Err(format!("{s:?}: group {name} has no VM name patterns"));
    }
    Ok((name.to_owned(), patterns))
}

/// `GROUP=RATE[:BURST]`, the rate read by `rate`.
fn parse_group_rate(
    s: &str,
    rate: fn(&str) -> Result<overspill_block::Rate, String>,
) -> Result<(String, overspill_block::Rate), String> {
    // The rate holds no `=`; an image group's name may hold a `:`.
    let (group, value) = s.rsplit_once('=').ok_or_else(|| format!("{s:?}: expected GROUP=RATE[:BURST]"))?;
    overspill_server::vm_limits::check_group(group).map_err(|e| e.to_string())?;
    Ok((group.to_owned(), rate(value)?))
}

/// `VM=RATE[:BURST]`, the rate read by `rate`.
fn parse_vm_rate(
    s: &str,
    rate: fn(&str) -> Result<overspill_block::Rate, String>,
) -> Result<(String, overspill_block::Rate), String> {
    let (vm, value) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected VM=RATE[:BURST]"))?;
    overspill_server::check_name("VM", vm).map_err(|e| e.to_string())?;
    Ok((vm.to_owned(), rate(value)?))
}

fn parse_vm_ops(s: &str) -> Result<(String, overspill_block::Rate), String> {
    parse_vm_rate(s, crate::size::parse_ops_rate)
}

fn parse_vm_bytes(s: &str) -> Result<(String, overspill_block::Rate), String> {
    parse_vm_rate(s, crate::size::parse_bytes_rate)
}

fn parse_group_ops(s: &str) -> Result<(String, overspill_block::Rate), String> {
    parse_group_rate(s, crate::size::parse_ops_rate)
}

fn parse_group_bytes(s: &str) -> Result<(String, overspill_block::Rate), String> {
    parse_group_rate(s, crate::size::parse_bytes_rate)
}

/// Once a second, the golden images VMs are served over are checked for changes made under them
/// (see [`OverlayExports::watch_images`]), until the exports go.
fn spawn_image_watch(exports: std::sync::Weak<OverlayExports>) {
    let spawned = std::thread::Builder::new().name("image-watch".into()).spawn(move || loop {
        std::thread::sleep(Duration::from_secs(1));
        match exports.upgrade() {
            Some(exports) => exports.watch_images(),
            None => return,
        }
    });
    if let Err(error) = spawned {
        tracing::warn!(%error, "could not start the golden image watch: a change under running VMs is caught by their reads only");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units_and_bare_seconds() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("18446744073709551615").is_err());
        assert!(parse_duration("200years").is_err());
        assert!(parse_duration("50years").is_ok());
    }
}
