//! A vhost-user frontend written for the test (the `vhost` crate's frontend side, the guest's
//! memory a memfd shared with the server, a split virtqueue laid out by hand as a driver would)
//! against the real server: reads, writes, flush, TRIM and get-id; requests in flight when the
//! frontend vanishes or the server is killed, carried out again after the reconnect as QEMU
//! hands them back; malformed requests and rings answered with an error status, or with the end
//! of that VM's connection, while another VM carries on; and `vm add`/`vm drop`, which make and
//! remove a VM's socket at run time.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

mod common;
use common::{pseudo_random, Serve};

const DISK: usize = 8 << 20;
const SECTOR: u64 = 512;
const MEMORY: u64 = 4 << 20;
const QUEUE: u16 = 64;
/// Descriptors per request slot: no request here has more.
const SLOT_DESCRIPTORS: u16 = 4;
const SLOTS: u16 = QUEUE / SLOT_DESCRIPTORS;
// The rings away from guest address 0 (virtio-queue takes an available ring there for unset).
const DESCRIPTORS: u64 = 0x1000;
const AVAILABLE: u64 = 0x2000;
const USED: u64 = 0x3000;
/// Each request slot's buffers: header, then data, then status, 8 KiB apart.
const BUFFERS: u64 = 0x10000;
const SLOT_BYTES: u64 = 0x6000;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
/// What a status byte holds before the device writes it.
const UNWRITTEN: u8 = 0xee;

/// The guest: its memory, shared through a memfd, and its side of one virtqueue.
struct Guest {
    memory: GuestMemoryMmap,
    /// Requests made available so far (the available ring's index).
    made_available: u16,
}

impl Guest {
    fn new() -> Self {
        let fd = rustix::fs::memfd_create("overspill-test-guest", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
        let file = File::from(fd);
        file.set_len(MEMORY).expect("sizing the memfd");
        let memory = GuestMemoryMmap::from_ranges_with_files([(
            GuestAddress(0),
            MEMORY as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .expect("guest memory");
        Self { memory, made_available: 0 }
    }

    fn region(&self) -> VhostUserMemoryRegionInfo {
        let region = self.memory.find_region(GuestAddress(0)).expect("region");
        let file = region.file_offset().expect("a file-backed region").file();
        VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEMORY,
            userspace_addr: self.host_address(0),
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        }
    }

    /// Where guest address `addr` is mapped in this process: what vhost-user's ring addresses
    /// are given in.
    fn host_address(&self, addr: u64) -> u64 {
        self.memory.get_host_address(GuestAddress(addr)).expect("mapped") as u64
    }

    fn used_index(&self) -> u16 {
        u16::from_le(self.memory.load(GuestAddress(USED + 2), Ordering::Acquire).expect("used index"))
    }

    /// The used ring's entry `i` (modulo the queue): the head returned and the bytes written.
    fn used_entry(&self, i: u16) -> (u32, u32) {
        let at = USED + 4 + 8 * u64::from(i % QUEUE);
        let id: u32 = self.memory.read_obj(GuestAddress(at)).expect("used id");
        let len: u32 = self.memory.read_obj(GuestAddress(at + 4)).expect("used len");
        (u32::from_le(id), u32::from_le(len))
    }

    /// Lays a chain of (address, length, device-writable) buffers in the next slot's
    /// descriptors and makes it available; returns its head.
    fn make_available(&mut self, buffers: &[(u64, u32, bool)]) -> u16 {
        assert!(buffers.len() <= usize::from(SLOT_DESCRIPTORS));
        let head = (self.made_available % SLOTS) * SLOT_DESCRIPTORS;
        for (i, &(addr, len, writable)) in buffers.iter().enumerate() {
            let index = head + i as u16;
            let last = i + 1 == buffers.len();
            let flags = if writable { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT };
            self.descriptor(index, addr, len, flags, index + 1);
        }
        self.publish(head);
        head
    }

    fn descriptor(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = DESCRIPTORS + 16 * u64::from(index);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&addr.to_le_bytes());
        bytes[8..12].copy_from_slice(&len.to_le_bytes());
        bytes[12..14].copy_from_slice(&flags.to_le_bytes());
        bytes[14..].copy_from_slice(&next.to_le_bytes());
        self.memory.write_slice(&bytes, GuestAddress(at)).expect("descriptor");
    }

    /// Puts `head` in the available ring and moves its index on (after the entry, as a driver's
    /// barrier orders them).
    fn publish(&mut self, head: u16) {
        let at = AVAILABLE + 4 + 2 * u64::from(self.made_available % QUEUE);
        self.memory.write_obj(head.to_le(), GuestAddress(at)).expect("available entry");
        self.made_available = self.made_available.wrapping_add(1);
        self.set_available_index(self.made_available);
    }

    fn set_available_index(&self, index: u16) {
        self.memory.store(index.to_le(), GuestAddress(AVAILABLE + 2), Ordering::Release).expect("available index");
    }

    /// Slot `slot`'s header, data and status addresses.
    fn slot(slot: u16) -> (u64, u64, u64) {
        let base = BUFFERS + SLOT_BYTES * u64::from(slot % SLOTS);
        (base, base + 0x1000, base + 0x5000)
    }

    /// A request of kind `kind` at `sector` in the next slot: its header and `data` readable,
    /// then `writable` bytes for the device and the status. Returns the slot's addresses.
    fn request(&mut self, kind: u32, sector: u64, data: &[u8], writable: u32) -> (u64, u64, u64) {
        let (header, buffer, status) = Self::slot(self.made_available);
        let mut bytes = [0u8; 16];
        bytes[..4].copy_from_slice(&kind.to_le_bytes());
        bytes[8..].copy_from_slice(&sector.to_le_bytes());
        self.memory.write_slice(&bytes, GuestAddress(header)).expect("header");
        self.memory.write_obj(UNWRITTEN, GuestAddress(status)).expect("status");
        let mut chain = vec![(header, 16, false)];
        if !data.is_empty() {
            self.memory.write_slice(data, GuestAddress(buffer)).expect("data");
            chain.push((buffer, data.len() as u32, false));
        }
        if writable > 0 {
            chain.push((buffer, writable, true));
        }
        chain.push((status, 1, true));
        self.make_available(&chain);
        (header, buffer, status)
    }

    fn status(&self, status: u64) -> u8 {
        self.memory.read_obj(GuestAddress(status)).expect("status")
    }

    fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut bytes = vec![0; len];
        self.memory.read_slice(&mut bytes, GuestAddress(addr)).expect("guest bytes");
        bytes
    }
}

/// One connection to a VM's socket, set up as QEMU sets up a vhost-user-blk device with one
/// queue.
struct Connection {
    frontend: Frontend,
    kick: EventFd,
    _call: EventFd,
    capacity_sectors: u64,
}

impl Connection {
    /// Connects and starts the device, its queue taking requests from `base` on (QEMU gives
    /// the guest's used index after a reconnect: what was not returned is carried out again).
    fn open(socket: &Path, guest: &Guest, base: u16) -> Self {
        let (mut frontend, capacity_sectors) = Self::negotiate(socket);
        frontend.set_mem_table(&[guest.region()]).expect("SET_MEM_TABLE");
        let (kick, call) = Self::start(&mut frontend, guest, base);
        Self { frontend, kick, _call: call, capacity_sectors }
    }

    /// Starts the device's queue at `base` (again, after a stop: QEMU resuming a paused VM).
    fn restart(&mut self, guest: &Guest, base: u16) {
        let features = self.frontend.get_features().expect("GET_FEATURES");
        let protocol = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        self.frontend.set_features(features & ((1 << 32) | protocol)).expect("SET_FEATURES");
        (self.kick, self._call) = Self::start(&mut self.frontend, guest, base);
    }

    /// Sets up and enables the queue as QEMU does when it starts the device; its kick and call.
    fn start(frontend: &mut Frontend, guest: &Guest, base: u16) -> (EventFd, EventFd) {
        frontend.set_vring_num(0, QUEUE).expect("SET_VRING_NUM");
        let rings = VringConfigData {
            queue_max_size: QUEUE,
            queue_size: QUEUE,
            flags: 0,
            desc_table_addr: guest.host_address(DESCRIPTORS),
            used_ring_addr: guest.host_address(USED),
            avail_ring_addr: guest.host_address(AVAILABLE),
            log_addr: None,
        };
        frontend.set_vring_addr(0, &rings).expect("SET_VRING_ADDR");
        frontend.set_vring_base(0, base).expect("SET_VRING_BASE");
        let (kick, call) = (EventFd::new(0).expect("kick"), EventFd::new(0).expect("call"));
        frontend.set_vring_call(0, &call).expect("SET_VRING_CALL");
        frontend.set_vring_kick(0, &kick).expect("SET_VRING_KICK");
        frontend.set_vring_enable(0, true).expect("SET_VRING_ENABLE");
        (kick, call)
    }

    /// The features, as QEMU agrees them, up to the guest's memory; returns the frontend and
    /// the disk's capacity in sectors.
    fn negotiate(socket: &Path) -> (Frontend, u64) {
        let mut frontend =
            Frontend::connect(socket, 1).unwrap_or_else(|e| panic!("connecting {}: {e}", socket.display()));
        frontend.set_owner().expect("SET_OWNER");
        let features = frontend.get_features().expect("GET_FEATURES");
        let protocol = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        assert!(features & protocol != 0, "the device offers no protocol features: {features:#x}");
        // virtio 1.0 and the protocol features; no event index: this driver kicks every time.
        frontend.set_features(features & ((1 << 32) | protocol)).expect("SET_FEATURES");
        let offered = frontend.get_protocol_features().expect("GET_PROTOCOL_FEATURES");
        frontend.set_protocol_features(offered & VhostUserProtocolFeatures::CONFIG).expect("SET_PROTOCOL_FEATURES");
        let (_, config) = frontend.get_config(0, 8, VhostUserConfigFlags::empty(), &[0; 8]).expect("GET_CONFIG");
        (frontend, u64::from_le_bytes(config[..8].try_into().expect("8 bytes")))
    }

    fn kick(&self) {
        self.kick.write(1).expect("kick");
    }

    /// A deliberate end, as QEMU stops a device: the queue's base asked for (the server stops
    /// the queue), then the socket closed.
    fn end(self) {
        self.frontend.get_vring_base(0).expect("GET_VRING_BASE");
    }
}

/// Waits until the device has returned `count` requests in all.
#[track_caller]
fn wait_used(guest: &Guest, count: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while guest.used_index() != count {
        assert!(Instant::now() < deadline, "{} of {count} requests returned", guest.used_index());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Carries out one request and returns its status and the bytes it says it wrote.
fn one(
    connection: &Connection,
    guest: &mut Guest,
    kind: u32,
    sector: u64,
    data: &[u8],
    writable: u32,
) -> (u8, Vec<u8>) {
    let (_, buffer, status) = guest.request(kind, sector, data, writable);
    let head = (guest.made_available.wrapping_sub(1) % SLOTS) * SLOT_DESCRIPTORS;
    connection.kick();
    wait_used(guest, guest.made_available);
    let (id, written) = guest.used_entry(guest.made_available.wrapping_sub(1));
    assert_eq!(id, u32::from(head), "the used ring returned another request");
    (guest.status(status), guest.bytes(buffer, written.saturating_sub(1) as usize))
}

fn read(connection: &Connection, guest: &mut Guest, sector: u64, len: u32) -> Vec<u8> {
    let (status, data) = one(connection, guest, T_IN, sector, &[], len);
    assert_eq!(status, S_OK, "read at sector {sector}");
    data
}

fn write(connection: &Connection, guest: &mut Guest, sector: u64, data: &[u8]) {
    assert_eq!(one(connection, guest, T_OUT, sector, data, 0).0, S_OK, "write at sector {sector}");
}

struct Host {
    dir: TempDir,
    golden: Vec<u8>,
    nbd_socket: PathBuf,
}

impl Host {
    fn new() -> Self {
        let dir = TempDir::new().expect("tempdir");
        let golden = pseudo_random(DISK, 48);
        std::fs::write(dir.path().join("golden.img"), &golden).expect("golden image");
        let nbd_socket = dir.path().join("nbd.sock");
        Self { dir, golden, nbd_socket }
    }

    /// A server serving VMs `a` and `b` over vhost-user, with a grace for lost connections.
    fn serve(&self) -> Serve {
        self.serve_with(&["--vhost-user", "a", "--vhost-user", "b"])
    }

    fn serve_with(&self, more: &[&str]) -> Serve {
        let path = |name: &str| self.dir.path().join(name).to_str().expect("utf-8").to_owned();
        let mut args = vec!["--base".to_owned(), path("golden.img")];
        args.extend(["--listen".to_owned(), format!("unix:{}", self.nbd_socket.display())]);
        args.extend(["--vhost-user-dir".to_owned(), path("vhost"), "--reconnect-grace".to_owned(), "1m".to_owned()]);
        args.extend(["--ram", "1M"].into_iter().chain(more.iter().copied()).map(str::to_owned));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The vhost-user sockets are made before the NBD one.
        let ready = self.nbd_socket.clone();
        Serve::start_named_only(self.dir.path(), &args, &[], move || {
            std::os::unix::net::UnixStream::connect(&ready).is_ok()
        })
    }

    /// `overspill vm ARGS` against this host's server.
    fn vm_command(&self, args: &[&str]) -> (bool, String) {
        let control = self.dir.path().join("spill/state/control.sock");
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .arg("vm")
            .arg("--control")
            .arg(control)
            .args(args)
            .output()
            .expect("overspill vm");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    /// Every VM `vm list` shows, with its state, by name.
    fn states(&self) -> Vec<(String, String)> {
        let (_, text) = self.vm_command(&["list", "--json"]);
        let vms: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let vms = vms.as_array().cloned().unwrap_or_default();
        let state = |v: &serde_json::Value| {
            (v["vm"].as_str().unwrap_or("").to_owned(), v["state"].as_str().unwrap_or("").to_owned())
        };
        vms.iter().map(state).collect()
    }

    #[track_caller]
    fn wait_for_states(&self, expected: &[(&str, &str)]) {
        let expected: Vec<(String, String)> =
            expected.iter().map(|(v, s)| ((*v).to_owned(), (*s).to_owned())).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.states() != expected {
            assert!(Instant::now() < deadline, "VM states {:?}, expected {expected:?}", self.states());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn socket(&self, vm: &str) -> PathBuf {
        self.dir.path().join("vhost").join(format!("{vm}.sock"))
    }

    fn state_of(&self, vm: &str) -> String {
        let control = self.dir.path().join("spill/state/control.sock");
        let out = Command::new(env!("CARGO_BIN_EXE_overspill"))
            .args(["vm", "--control", control.to_str().expect("utf-8"), "list", "--json"])
            .output()
            .expect("overspill vm list");
        let vms: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let states = vms.as_array().cloned().unwrap_or_default();
        let state = states.iter().find(|v| v["vm"] == vm).and_then(|v| v["state"].as_str()).unwrap_or("absent");
        state.to_owned()
    }

    #[track_caller]
    fn wait_for_state(&self, vm: &str, state: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.state_of(vm) != state {
            assert!(Instant::now() < deadline, "VM {vm} is {}, not {state}", self.state_of(vm));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn golden_sectors(&self, sector: u64, len: usize) -> &[u8] {
        &self.golden[(sector * SECTOR) as usize..][..len]
    }
}

#[test]
fn a_frontend_reads_writes_flushes_trims_and_reads_the_vm_name() {
    let host = Host::new();
    let server = host.serve();
    // The directory it made is QEMU's way to the socket whatever the server's umask (0077 in
    // the packaged unit); the socket's own mode says who may connect.
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(host.dir.path().join("vhost")).expect("vhost dir").permissions(),
    );
    assert_eq!(mode & 0o777, 0o711);
    let mut guest = Guest::new();
    let connection = Connection::open(&host.socket("a"), &guest, 0);
    assert_eq!(connection.capacity_sectors, DISK as u64 / SECTOR, "the capacity in the config space");
    assert_eq!(read(&connection, &mut guest, 0, 8192), host.golden_sectors(0, 8192), "golden data");

    let data = pseudo_random(12288, 1);
    write(&connection, &mut guest, 64, &data);
    assert_eq!(read(&connection, &mut guest, 64, 12288), data, "a write read back");
    assert_eq!(one(&connection, &mut guest, T_FLUSH, 0, &[], 0).0, S_OK, "flush");
    let (status, id) = one(&connection, &mut guest, T_GET_ID, 0, &[], 20);
    assert_eq!(status, S_OK);
    assert_eq!(id, b"a\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", "get-id answers the VM's name");
    // TRIM of the middle 4 KiB block: it reads from the golden image again.
    let mut segment = [0u8; 16];
    segment[..8].copy_from_slice(&72u64.to_le_bytes());
    segment[8..12].copy_from_slice(&8u32.to_le_bytes());
    assert_eq!(one(&connection, &mut guest, T_DISCARD, 0, &segment, 0).0, S_OK, "discard");
    let back = read(&connection, &mut guest, 64, 12288);
    assert_eq!(back[..4096], data[..4096]);
    assert_eq!(back[4096..8192], *host.golden_sectors(72, 4096), "a trimmed block reads golden data");
    assert_eq!(back[8192..], data[8192..]);
    host.wait_for_state("a", "connected");

    // QEMU stops the device, then closes the socket: the VM ends, and its socket waits.
    connection.end();
    host.wait_for_state("a", "declared");
    let mut guest = Guest::new();
    let connection = Connection::open(&host.socket("a"), &guest, 0);
    assert_eq!(read(&connection, &mut guest, 64, 4096), host.golden_sectors(64, 4096), "a new session's data");
    drop((connection, server));
}

/// Requests made available but not returned when the connection goes are returned by no one:
/// QEMU hands them to the next connection from the guest's used index, and they are carried
/// out then. Whether the frontend vanished (QEMU killed, its VM in its grace, the guest making
/// requests meanwhile) or the server was killed with requests in hand, every write reads back.
#[test]
fn requests_in_flight_when_the_frontend_vanishes_or_the_server_dies_are_carried_out_after_the_reconnect() {
    let host = Host::new();
    let mut server = host.serve();
    let mut guest = Guest::new();
    let mut written = Vec::new();
    let mut writes = |guest: &mut Guest, round: u64| {
        for i in 0..u64::from(SLOTS) {
            let sector = (round * u64::from(SLOTS) + i) * 64;
            let data = pseudo_random(16384, 100 + sector);
            guest.request(T_OUT, sector, &data, 0);
            written.push((sector, data));
        }
    };
    // The frontend vanishes (no GET_VRING_BASE before the socket closes) and the guest goes on
    // making requests, a queue's worth, while no one serves it.
    let connection = Connection::open(&host.socket("a"), &guest, 0);
    write(&connection, &mut guest, 4096, &[0x5a; 4096]);
    drop(connection);
    host.wait_for_state("a", "in-grace");
    writes(&mut guest, 0);
    assert_eq!(guest.used_index(), 1, "requests served with no connection");
    let connection = Connection::open(&host.socket("a"), &guest, guest.used_index());
    connection.kick();
    wait_used(&guest, guest.made_available);
    // The server is killed with a queue's worth of requests kicked, some in hand.
    writes(&mut guest, 1);
    connection.kick();
    server.kill();
    drop(connection);
    eprintln!("{} of {} returned before the server died", guest.used_index(), guest.made_available);
    server = host.serve();
    host.wait_for_state("a", "in-grace");
    let connection = Connection::open(&host.socket("a"), &guest, guest.used_index());
    connection.kick();
    wait_used(&guest, guest.made_available);
    for i in 1..guest.made_available {
        let (_, _, status) = Guest::slot(i);
        assert_eq!(guest.status(status), S_OK, "request {i}");
    }
    assert_eq!(read(&connection, &mut guest, 4096, 4096), [0x5a; 4096], "the write before the vanishing");
    for (sector, data) in &written {
        assert_eq!(&read(&connection, &mut guest, *sector, 16384), data, "the write at sector {sector}");
    }
    drop((connection, server));
}

/// Requests with a buffer outside the guest's memory, past the disk's end, of an unknown kind or
/// with no room for a status get an error status (or none, returned as writing nothing) and the
/// next request is served; a ring that claims more requests than it can hold ends that VM's
/// connection (the VM waits in its grace, and a new connection serves it). VM b, on the same
/// server, is served throughout.
#[test]
fn malformed_requests_fail_alone_and_another_vm_carries_on() {
    let host = Host::new();
    let server = host.serve();
    let (mut guest, mut other) = (Guest::new(), Guest::new());
    let connection = Connection::open(&host.socket("a"), &guest, 0);
    let other_connection = Connection::open(&host.socket("b"), &other, 0);
    let mut b_serves = |round: u64| {
        let data = pseudo_random(4096, 900 + round);
        write(&other_connection, &mut other, round * 8, &data);
        assert_eq!(read(&other_connection, &mut other, round * 8, 4096), data, "VM b, round {round}");
    };
    b_serves(0);

    // A header outside the guest's memory.
    let (_, _, status) = Guest::slot(guest.made_available);
    guest.make_available(&[(MEMORY + 0x1000, 16, false), (status, 1, true)]);
    connection.kick();
    wait_used(&guest, guest.made_available);
    assert_eq!(guest.status(status), S_IOERR, "a header outside memory");
    // A read past the end of the disk, and one that straddles it.
    let end = connection.capacity_sectors;
    assert_eq!(one(&connection, &mut guest, T_IN, end, &[], 512).0, S_IOERR, "a read past the end");
    assert_eq!(one(&connection, &mut guest, T_IN, end - 1, &[], 1024).0, S_IOERR, "a read across the end");
    assert_eq!(one(&connection, &mut guest, 99, 0, &[], 0).0, S_UNSUPP, "an unknown request");
    // A status buffer the device may not write: returned, having written nothing.
    let (header, _, status) = guest.request(T_IN, 0, &[], 0);
    let head = guest.made_available.wrapping_sub(1) % SLOTS * SLOT_DESCRIPTORS;
    guest.descriptor(head, header, 16, F_NEXT, head + 1);
    guest.descriptor(head + 1, status, 1, 0, 0);
    connection.kick();
    wait_used(&guest, guest.made_available);
    assert_eq!(guest.used_entry(guest.made_available - 1), (u32::from(head), 0));
    assert_eq!(guest.status(status), UNWRITTEN, "a read-only status was written");
    // A chain that loops on itself.
    let (header, _, _) = Guest::slot(guest.made_available);
    let head = guest.made_available % SLOTS * SLOT_DESCRIPTORS;
    guest.descriptor(head, header, 16, F_NEXT, head);
    guest.publish(head);
    connection.kick();
    wait_used(&guest, guest.made_available);
    b_serves(1);
    assert_eq!(read(&connection, &mut guest, 8, 4096), host.golden_sectors(8, 4096), "VM a after bad requests");

    // An available index 100 past the last request taken: the connection ends.
    let taken = guest.made_available;
    guest.set_available_index(taken.wrapping_add(100));
    connection.kick();
    host.wait_for_state("a", "in-grace");
    let log = server.log_text();
    assert!(log.contains("the available ring is malformed"), "{log}");
    b_serves(2);
    // The VMM starts the device again, ring mended: the VM is served.
    guest.set_available_index(taken);
    drop(connection);
    let connection = Connection::open(&host.socket("a"), &guest, guest.used_index());
    assert_eq!(read(&connection, &mut guest, 8, 4096), host.golden_sectors(8, 4096), "VM a after its reconnect");
    b_serves(3);

    // Guest memory said to be twice the file behind it: the server would fault (SIGBUS, every
    // VM with it) at the first request reaching past the file's end. The map is refused and
    // the connection ends; VM a keeps its writes for its next connection.
    write(&connection, &mut guest, 16, &pseudo_random(4096, 77));
    drop(connection);
    let (frontend, _) = Connection::negotiate(&host.socket("a"));
    let too_long = VhostUserMemoryRegionInfo { memory_size: 2 * MEMORY, ..guest.region() };
    // Without a reply asked for, the refusal shows as the connection's end, not an error here.
    let _ = frontend.set_mem_table(&[too_long]);
    server.wait_log("the VMM's memory map is refused");
    assert!(server.log_text().contains("of a file of 4194304 bytes"), "{}", server.log_text());
    host.wait_for_state("a", "in-grace");
    drop(frontend);
    b_serves(4);
    let connection = Connection::open(&host.socket("a"), &guest, guest.used_index());
    assert_eq!(read(&connection, &mut guest, 16, 4096), pseudo_random(4096, 77), "VM a after the refused map");
    drop((connection, other_connection, server));
}

/// `vm add` declares a vhost-user VM at run time: its socket is made at once, with the server's
/// socket mode, `vm list` shows it declared, a killed server's successor makes it again, and
/// `vm drop` removes it for good (one `--vhost-user` declares comes back with the flag). A
/// second image for a declared VM, an unknown image and a name that is no file name are
/// refused, and nothing is made for them.
#[test]
fn vm_add_declares_a_vhost_user_socket_that_outlives_restarts_until_vm_drop() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let host = Host::new();
    let vhost_dir = host.dir.path().join("vhost");
    let flags = ["--socket-mode", "0660", "--vhost-user", "fixed"];
    let server = host.serve_with(&flags);
    let socket = vhost_dir.join("desk.sock");
    let (ok, text) = host.vm_command(&["add", "desk"]);
    assert!(ok && text.contains(&socket.display().to_string()), "{text}");
    let metadata = std::fs::metadata(&socket).expect("the declared VM's socket");
    assert!(metadata.file_type().is_socket());
    assert_eq!(metadata.permissions().mode() & 0o777, 0o660, "--socket-mode on a socket made at run time");
    host.wait_for_states(&[("desk", "declared"), ("fixed", "declared")]);
    let (ok, text) = host.vm_command(&["add", "desk"]);
    assert!(ok, "declaring a VM again on its image: {text}");
    for (args, refused) in [
        (&["add", "desk", "other"][..], "declared on image"),
        (&["add", "d2", "nosuch"][..], "no golden image"),
        (&["add", "../d3"][..], "VM name"),
    ] {
        let (ok, text) = host.vm_command(args);
        assert!(!ok && text.contains(refused), "vm {args:?}: {text}");
    }
    let made: Vec<_> = std::fs::read_dir(&vhost_dir).expect("vhost dir").flatten().map(|e| e.file_name()).collect();
    assert_eq!(made.len(), 2, "sockets made: {made:?}");

    // A crash: the next server makes both sockets again before it says it is ready.
    server.kill();
    let mut server = host.serve_with(&flags);
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_ok(), "no socket for desk after a restart");
    host.wait_for_states(&[("desk", "declared"), ("fixed", "declared")]);

    for vm in ["desk", "fixed"] {
        let (ok, text) = host.vm_command(&["drop", vm]);
        assert!(ok && text.contains("socket is removed"), "vm drop {vm}: {text}");
        assert!(!vhost_dir.join(format!("{vm}.sock")).exists(), "{vm}'s socket after vm drop");
    }
    host.wait_for_states(&[]);
    server.stop();
    drop(server);
    let _server = host.serve_with(&flags);
    host.wait_for_states(&[("fixed", "declared")]);
    assert!(!socket.exists(), "a dropped VM's socket came back after a restart");
}

/// Limits are applied at the device seam: a vhost-user VM limited by name at `serve` waits out
/// its rate as an NBD one does. At 50 requests per second with a burst of 5, 30 reads cannot be
/// done in less than half a second: a bound the limiter sets, however fast the machine.
#[test]
fn a_vhost_user_vm_limited_by_name_waits_out_its_rate() {
    let host = Host::new();
    let _server = host.serve_with(&["--vhost-user", "limited", "--vm-limit-iops", "limited=50:5"]);
    let mut guest = Guest::new();
    let connection = Connection::open(&host.socket("limited"), &guest, 0);
    let started = Instant::now();
    for i in 0..30u64 {
        assert_eq!(read(&connection, &mut guest, i * 8, 4096), host.golden_sectors(i * 8, 4096), "read {i}");
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(500), "30 reads at 50/s (burst 5) in {took:?}");
    let (ok, said) = host.vm_command(&["limit", "limited"]);
    assert!(ok && said.contains("limited: 50 ops/s (burst 5)"), "{said}");
    drop(connection);
}

/// QEMU stops a device (a pause, a migration, a shutdown) with GET_VRING_BASE under its big
/// lock, and the server answers once the request in hand is returned: a request waiting for
/// its limits waits no more then, and is served. At 100 B/s a 4 KiB write waits 40 s; until
/// session 52 the stop waited as long (the queue's lock held through the wait), and QEMU, its
/// monitor and libvirt with it, were stalled.
#[test]
fn a_device_stopped_under_a_request_waiting_for_its_limits_stops_at_once() {
    let host = Host::new();
    let _server = host.serve_with(&["--vhost-user", "slow", "--vm-limit-bandwidth", "slow=100B:100B"]);
    let mut guest = Guest::new();
    let mut connection = Connection::open(&host.socket("slow"), &guest, 0);
    let (_, _, status) = guest.request(T_OUT, 0, &[0x3c; 4096], 0);
    connection.kick();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(guest.used_index(), 0, "the write did not wait for its limit");
    let started = Instant::now();
    let base = connection.frontend.get_vring_base(0).expect("GET_VRING_BASE");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "the stop waited {took:?} for the write's limit");
    assert_eq!((base, guest.used_index(), guest.status(status)), (1, 1, S_OK), "the write in hand, returned");
    let (ok, said) = host.vm_command(&["limit", "slow", "--bandwidth", "off"]);
    assert!(ok, "{said}");
    connection.restart(&guest, 1);
    assert_eq!(read(&connection, &mut guest, 0, 4096), vec![0x3c; 4096], "the write returned at the stop is done");
}

/// A connection costs the server no descriptor once it is over: vhost-user-backend never
/// closes the exit event each connection's worker is given, so a VMM reconnecting once a second
/// to a refused VM (or any local client connecting) ran the server out of descriptors in a day.
#[test]
fn connections_that_come_and_go_leave_no_descriptor_behind() {
    let host = Host::new();
    let server = host.serve();
    let descriptors = || std::fs::read_dir(format!("/proc/{}/fd", server.child.id())).expect("/proc/PID/fd").count();
    let connect_and_go = || {
        let stream = std::os::unix::net::UnixStream::connect(host.socket("a")).expect("connect");
        drop(stream);
    };
    // The first connections' lazily made state (threads, logs) counted before.
    for _ in 0..5 {
        connect_and_go();
    }
    std::thread::sleep(Duration::from_millis(300));
    let before = descriptors();
    for _ in 0..60 {
        connect_and_go();
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = descriptors();
    assert!(after < before + 10, "60 connections left {} descriptors more ({before} -> {after})", after - before);
    drop(server);
}

/// `vm reset` of a VM whose guest sends nothing closes its vhost-user connection within
/// seconds (its worker sleeps until a kick: until session 51 the old overlay waited for the
/// guest's next request, hours later), and a client that connects and says nothing is cut
/// after 10 s, so that the VM's QEMU, next in the socket's backlog, gets in.
#[test]
fn a_reset_closes_an_idle_connection_and_a_silent_client_is_cut() {
    use std::io::Read;
    let host = Host::new();
    let _server = host.serve();
    let mut guest = Guest::new();
    let connection = Connection::open(&host.socket("a"), &guest, 0);
    write(&connection, &mut guest, 0, &[0x5a; 4096]);
    let (ok, said) = host.vm_command(&["reset", "a"]);
    assert!(ok, "{said}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while connection.frontend.get_features().is_ok() {
        assert!(Instant::now() < deadline, "the reset VM's idle connection is still open");
        std::thread::sleep(Duration::from_millis(200));
    }

    let mut silent = std::os::unix::net::UnixStream::connect(host.socket("b")).expect("connect");
    silent.set_read_timeout(Some(Duration::from_secs(40))).expect("timeout");
    let started = Instant::now();
    let ended = silent.read(&mut [0u8; 1]);
    assert!(matches!(ended, Ok(0)), "the silent client's connection: {ended:?}");
    assert!(started.elapsed() < Duration::from_secs(30), "cut after {:?}", started.elapsed());
    let mut guest = Guest::new();
    let next = Connection::open(&host.socket("b"), &guest, 0);
    assert_eq!(read(&next, &mut guest, 0, 4096), host.golden_sectors(0, 4096));
}
