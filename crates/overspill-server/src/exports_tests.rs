use super::*;
use crate::vms::Ending;
use crate::vms::VmState;
use bytes::Bytes;
use overspill_block::{read_whole, ReadRequest};
use std::time::Duration;

#[test]
fn scratch_file_names_carry_the_pid_and_the_host() {
    use overspill_engine::store::{host_mark, scratch_file_name, scratch_file_owner, ScratchOwner};
    let pid = std::process::id();
    let made = scratch_file_name("7", "spill");
    assert_eq!(scratch_file_owner(&made), Some(ScratchOwner { pid, this_host: Some(true), kind: "spill" }));
    assert!(made.contains(host_mark()), "{made}");
    let another = format!("overspill-123-7-{}x.diff", host_mark());
    assert_eq!(scratch_file_owner(&another), Some(ScratchOwner { pid: 123, this_host: Some(false), kind: "diff" }));
    assert_eq!(scratch_file_owner("overspill-123-tier2.golden").map(|o| o.this_host), Some(None));
    // Renamed since (cloud-init, hostnamectl): the same machine id is still this host.
    if let Some((_, id)) = host_mark().rsplit_once('_').filter(|(_, id)| id.len() == 8) {
        let renamed = format!("overspill-123-7-renamed_{id}.spill");
        assert_eq!(scratch_file_owner(&renamed).map(|o| o.this_host), Some(Some(true)), "{renamed}");
    }
    assert_eq!(scratch_file_owner("overspill-123-7.txt").map(|o| o.kind), Some("txt"));
    assert_eq!(scratch_file_owner("overspill-x-7.spill"), None);
    assert_eq!(scratch_file_owner("golden.img"), None);
}

/// Files named `vm-NAME.*` in the memory and spill directories of a test.
fn files_of(vm: &str, dirs: &[&Path]) -> Vec<PathBuf> {
    let prefix = format!("{}.", state_file_stem(vm));
    let mut files: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|dir| std::fs::read_dir(dir).expect("read dir").flatten())
        .filter(|f| f.file_name().to_string_lossy().starts_with(&prefix))
        .map(|f| f.path())
        .collect();
    files.sort();
    files
}

/// Mode `ram+disk` with an 8 MiB target, spilling into `dir/spill` (made here).
fn settings_in(dir: &Path, read_cache_bytes: u64) -> CacheSettings {
    let spill_dir = dir.join("spill");
    std::fs::create_dir_all(&spill_dir).expect("spill dir");
    CacheSettings {
        mode: WriteCacheMode::RamDisk,
        ram_target_bytes: 8 << 20,
        spill_max_bytes: None,
        spill_direct: false,
        spill_writers: 0,
        spill_dir: spill_dir.clone(),
        shared_dir: spill_dir,
        read_cache_bytes,
    }
}

/// Exports of one 64 MiB image, `golden`, whose named VMs keep their state in `dir` and wait
/// a minute for a reconnect.
fn exports_in(dir: &Path) -> OverlayExports {
    let (state_dir, memory_dir) = (dir.join("state"), dir.join("memory"));
    let settings = settings_in(dir, 0);
    let golden: Arc<dyn GoldenImage> = Arc::new(overspill_engine::golden::ZeroImage { size: 64 << 20 });
    let images = BTreeMap::from([("golden".to_owned(), golden)]);
    let mut exports = OverlayExports::new(images, settings, HostMemory::unlimited()).expect("exports");
    exports
        .with_lifecycle(Lifecycle {
            reconnect_grace: Duration::from_secs(60),
            state_dir: Some(state_dir),
            memory_dir: Some(memory_dir),
        })
        .expect("lifecycle");
    exports
}

/// A golden read of 64 KiB is lent by the image's read cache (two reads of the same range
/// hand out the same bytes) whether the image is a `--base` file or a version in the image
/// store: a wrapper around a version once forwarded everything but the lending read, so
/// every large golden read through the store was copied.
#[test]
fn a_large_golden_read_is_lent_by_the_read_cache_from_the_image_store_as_from_a_base_image() {
    let dirs = tempfile::tempdir().expect("tempdir");
    let file = dirs.path().join("golden.raw");
    std::fs::write(&file, (0..4u32 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>()).expect("image");
    let store = ImageStore::new(&dirs.path().join("images"));
    store.publish("stored", &file, true).expect("publish");
    let settings = settings_in(dirs.path(), 16 << 20);
    let base: Arc<dyn GoldenImage> = Arc::new(overspill_engine::RawImage::open(&file).expect("raw"));
    let images = BTreeMap::from([("base".to_owned(), base)]);
    let mut exports = OverlayExports::new(images, settings, HostMemory::unlimited()).expect("exports");
    exports.with_image_store(&dirs.path().join("images"));
    for export in ["base@a", "stored@b"] {
        let mut device = exports.open(export, None).expect("open");
        let length = 64 << 10;
        let read = |device: &mut Box<dyn BlockDevice>| {
            let request = ReadRequest::begin(device.as_mut(), 1 << 20, length as u64);
            device.read_shared(&request, 1 << 20, length).expect("read")
        };
        let (first, second) = (read(&mut device), read(&mut device));
        let expected: Vec<u8> = (1u32 << 20..(1 << 20) + length as u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(first.concat(), expected, "{export}: the image's bytes");
        let pointers = |pieces: &[Bytes]| pieces.iter().map(|piece| piece.as_ptr()).collect::<Vec<_>>();
        assert_eq!(pointers(&first), pointers(&second), "{export}: the second read was copied, not lent");
    }
}

/// A VM that booted a version keeps it when another is made production: an INFO for its name
/// describes the version it will open (its size), as the GO after it does; a new VM's name
/// describes production.
#[test]
fn info_for_a_running_vm_describes_the_version_it_booted() {
    let dirs = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::new(&dirs.path().join("images"));
    for (name, mib) in [("small.raw", 4u64), ("large.raw", 8)] {
        let file = dirs.path().join(name);
        std::fs::write(&file, vec![0x11u8; (mib << 20) as usize]).expect("image");
        store.publish("win", &file, name == "small.raw").expect("publish");
    }
    let settings = settings_in(dirs.path(), 16 << 20);
    let mut exports = OverlayExports::new(BTreeMap::new(), settings, HostMemory::unlimited()).expect("exports");
    exports.with_image_store(&dirs.path().join("images"));
    let device = exports.open("win@a", None).expect("open");
    assert_eq!(device.size(), 4 << 20);
    store.activate("win", "v2").expect("activate v2");
    assert_eq!(exports.info("win@a").expect("info").size, 4 << 20, "the version VM a booted");
    assert_eq!(exports.info("win@b").expect("info").size, 8 << 20, "production, for a new VM");
    drop(device);
}

#[test]
fn an_ended_vms_files_go_with_its_name_and_its_late_drop_spares_the_next_vm_of_that_name() {
    let dirs = tempfile::tempdir().expect("tempdir");
    let (state_dir, memory_dir, spill_dir) =
        (dirs.path().join("state"), dirs.path().join("memory"), dirs.path().join("spill"));
    let exports = exports_in(dirs.path());
    let fresh = |exports: &OverlayExports| match exports.registry.claim(Some("x"), "golden", None).expect("claim") {
        Claim::Fresh { number, .. } => (number, exports.new_overlay("golden@x", number).expect("overlay")),
        Claim::Resume { .. } | Claim::Join { .. } | Claim::Connecting | Claim::Held => panic!("no overlay of x waits"),
    };
    let dirs = [memory_dir.as_path(), spill_dir.as_path()];
    let ledger_file = state_dir.join("vm-x.json");

    let (number, first) = fresh(&exports);
    let made = files_of("x", &dirs);
    assert!(made.len() >= 5 && ledger_file.exists(), "state files and ledger file made: {made:?}");
    // The overlay ends deliberately; its drop comes later (it may wait for a segment write).
    let ended = exports.registry.end(number, Ending::Deliberate, first).expect("ended overlays are handed back");
    assert_eq!(files_of("x", &dirs), Vec::<PathBuf>::new(), "state files outlive the end of the VM");
    assert!(!ledger_file.exists());

    let (number, second) = fresh(&exports);
    assert_eq!(files_of("x", &dirs), made, "the next VM of the name makes the same files");
    drop(ended);
    assert_eq!(files_of("x", &dirs), made, "the first overlay's drop removed the next VM's files");
    assert!(ledger_file.exists());

    drop(exports.registry.end(number, Ending::Deliberate, second));
    assert_eq!(files_of("x", &dirs), Vec::<PathBuf>::new());
    assert!(!ledger_file.exists());
}

/// A connection the stopping server's drain gave up on may end after the hand-over of the
/// VMs in grace: its VM is handed over then, not parked in a registry about to go, which
/// would take its files with it and leave the next server a ledger entry and no writes.
#[test]
fn a_vm_whose_connection_ends_after_the_hand_over_is_kept_for_the_next_server() {
    let dirs = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dirs.path());
    let mut device = exports.open("golden@x", None).expect("open");
    device.write(0, &[7; 4096], false).expect("write");
    exports.registry.hand_over_all_in_grace();
    drop(device);
    drop(exports);
    let exports = exports_in(dirs.path());
    let mut device = exports.open("golden@x", None).expect("the next server rebuilds the VM");
    let mut back = vec![0; 4096];
    read_whole(device.as_mut(), 0, &mut back).expect("read");
    assert_eq!(back, vec![7; 4096], "the VM's write after the next server's start");
}

/// A named VM is the TLS identity's that made it: another identity, or a client without one,
/// cannot open it, connected or in grace, nor once a next server has rebuilt it. A VM made
/// without an identity (no TLS) has no one to be told apart from.
#[test]
fn a_vm_is_opened_only_by_the_identity_that_made_it() {
    let dirs = tempfile::tempdir().expect("tempdir");
    let refused = |exports: &OverlayExports, identity: Option<&str>| {
        let Err(error) = exports.open("golden@desk", identity) else {
            panic!("{identity:?} opened alice's VM");
        };
        assert_eq!(error.kind, DeviceErrorKind::Refused);
        assert!(error.message.contains("another client identity"), "{error}");
    };
    let read_back = |device: &mut Box<dyn BlockDevice>| {
        let mut back = vec![0; 4096];
        read_whole(device.as_mut(), 0, &mut back).expect("read");
        assert_eq!(back, vec![7; 4096], "alice's write");
    };
    let exports = exports_in(dirs.path());
    let mut device = exports.open("golden@desk", Some("alice")).expect("open");
    device.write(0, &[7; 4096], false).expect("write");
    refused(&exports, Some("bob"));
    drop(device);
    let listed = exports.registry.list();
    assert_eq!((listed[0].state, listed[0].owner.as_deref()), (VmState::InGrace, Some("alice")));
    refused(&exports, Some("bob"));
    refused(&exports, None);
    let mut device = exports.open("golden@desk", Some("alice")).expect("alice resumes her VM");
    read_back(&mut device);

    exports.registry.hand_over_all_in_grace();
    drop(device);
    drop(exports);
    let exports = exports_in(dirs.path());
    refused(&exports, Some("bob"));
    let mut device = exports.open("golden@desk", Some("alice")).expect("the next server rebuilds it for alice");
    read_back(&mut device);

    let mut open = exports.open("golden@open", None).expect("open");
    open.write(0, &[1; 4096], false).expect("write");
    drop(open);
    exports.open("golden@open", Some("bob")).expect("a VM made without an identity is anyone's");
}

/// A VM is put on the move only for its owner: a peer asking for it for another client
/// identity is refused before the VM moves (its reconnects refused meanwhile, until session 52),
/// and only the peer it moves to reads its disk.
#[test]
fn a_vm_is_sent_only_for_its_owner_and_read_only_by_the_peer_it_moves_to() {
    use crate::vms::Asker;
    let dirs = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dirs.path());
    let mut device = exports.open("golden@desk", Some("alice")).expect("open");
    device.write(0, &[7; 4096], false).expect("write");
    let registry = &exports.registry;
    let mut buf = vec![0u8; 4096];
    let asker = |identity: &str| Asker { identity: Some(identity.to_owned()) };
    let refused = registry.start_outgoing("desk", "golden", "b", Some(&asker("bob"))).err().expect("bob's ask");
    assert!(refused.contains("another client identity"), "{refused}");
    assert_eq!(registry.read_for_peer("desk", "b", 0, &mut buf), Ok(false), "not moving");
    let out = registry.start_outgoing("desk", "golden", "b", Some(&asker("alice"))).expect("alice's ask");
    assert_eq!(registry.read_for_peer("desk", "c", 0, &mut buf), Ok(false), "c is not where it moves");
    assert_eq!(registry.read_for_peer("desk", "b", 0, &mut buf), Ok(true));
    assert_eq!(buf, vec![7; 4096], "alice's write, read by the peer it moves to");
    registry.finish_outgoing(out, None);
    drop(device);
}

/// A receiving server killed between saying it had a moving VM's whole state and hearing
/// the move was done leaves the VM in doubt: its next start asks the sending peer, and keeps
/// the VM if the peer's ledger says it moved here, drops its copy if the peer kept the VM,
/// and refuses the name (never golden data) if the peer cannot tell.
#[test]
fn a_vm_left_in_doubt_is_settled_by_asking_the_peer_it_was_moving_from() {
    use crate::ledger::{Ledger, Marks};
    use crate::migration::{self, Peers};
    for peer_says in ["moved here", "kept it", "nothing"] {
        let dirs = tempfile::tempdir().expect("tempdir");
        let (here, there) = (dirs.path().join("here"), dirs.path().join("there"));
        let peer_socket = dirs.path().join("peer.sock");
        // What the receiver left: a VM with a write, its ledger entry marked in doubt.
        let exports = exports_in(&here);
        let mut device = exports.open("golden@x", None).expect("open");
        device.write(0, &[7; 4096], false).expect("write");
        exports.registry.hand_over_all_in_grace();
        drop(device);
        drop(exports);
        let ledger = Ledger::open(&here.join("state")).expect("ledger");
        let state = ledger.state_of("x").expect("the VM's state");
        let marks = Marks { incoming: Some(peer_socket.display().to_string()), ..Marks::default() };
        ledger.write_entry("x", "golden", None, Some(state), marks).expect("in doubt");
        // The sending peer, as its ledger and registry stand.
        let sender = VmRegistry::new(Lifecycle {
            reconnect_grace: Duration::from_secs(60),
            state_dir: Some(there.join("state")),
            memory_dir: None,
        })
        .expect("sender registry");
        match peer_says {
            "moved here" => {
                let marks = Marks { moved: Some("receiver".into()), ..Marks::default() };
                Ledger::open(&there.join("state")).expect("ledger").write_entry("x", "golden", None, None, marks)
            }
            "kept it" => sender.claim(Some("x"), "golden", None).map(drop).map_err(std::io::Error::other),
            _ => Ok(()),
        }
        .expect("the sender's side");
        let address = overspill_net::ListenAddr::Unix(peer_socket.clone());
        let _listener = migration::listen(&address, "sender".into(), None, sender.clone()).expect("peer socket");

        let mut exports = exports_in(&here);
        assert_eq!(exports.registry.list()[0].state, VmState::Incoming, "{peer_says}: refused until settled");
        exports.with_peers(Peers { name: "receiver".into(), addresses: vec![address], tls: None });
        exports.settle_in_doubt();
        let listed = exports.registry.list();
        match peer_says {
            "moved here" => {
                assert_eq!(listed[0].state, VmState::InGrace, "{listed:?}");
                let mut device = exports.open("golden@x", None).expect("the VM, settled here");
                let mut back = vec![0; 4096];
                read_whole(device.as_mut(), 0, &mut back).expect("read");
                assert_eq!(back, vec![7; 4096], "the VM's write");
            }
            "kept it" => {
                assert!(listed.is_empty(), "the copy here stayed: {listed:?}");
                assert!(files_of("x", &[&here.join("memory"), &here.join("spill")]).is_empty());
            }
            _ => {
                assert_eq!(listed[0].state, VmState::Lost, "{listed:?}");
                assert!(listed[0].detail.contains("keeps no record"), "{listed:?}");
                assert!(exports.open("golden@x", None).is_err(), "a VM in doubt was served");
            }
        }
    }
}

#[test]
fn stale_files_of_dead_servers_go_and_live_ones_stay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |name: &str| dir.path().join(name);
    // A pid above the kernel's maximum (4194304) is never alive here; held, it is a live
    // server's in another PID namespace.
    let (dead, elsewhere) = (path("overspill-4294967-1.spill"), path("overspill-4294967-2.spill"));
    let pid = std::process::id();
    let (ours, left_by_our_program) =
        (path(&format!("overspill-{pid}-1.spill")), path(&format!("overspill-{pid}-2.spill")));
    let other = path("keep.img");
    // A dead pid's file made by another host sharing the directory (an NFS `--shared-dir`
    // without working locks): not held as this host sees it, and its pid means nothing here.
    let mark = overspill_engine::store::host_mark();
    let another_hosts = path(&format!("overspill-4294967-3-{mark}x.diff"));
    let this_hosts_dead = path(&format!("overspill-4294967-4-{mark}.diff"));
    for f in [&dead, &elsewhere, &ours, &left_by_our_program, &other, &another_hosts, &this_hosts_dead] {
        std::fs::write(f, b"x").expect("write");
    }
    let holders: Vec<std::fs::File> = [&elsewhere, &ours]
        .iter()
        .map(|f| {
            let file = std::fs::File::open(f).expect("open");
            overspill_engine::store::hold(&file, f).expect("hold");
            file
        })
        .collect();
    remove_stale_cache_files(dir.path(), false);
    assert!(!dead.exists() && !this_hosts_dead.exists());
    assert!(elsewhere.exists() && ours.exists() && left_by_our_program.exists() && other.exists());
    assert!(another_hosts.exists(), "another host's file was judged by this host's pids");
    remove_stale_cache_files(dir.path(), true);
    assert!(!left_by_our_program.exists(), "a file our pid's earlier program left");
    assert!(elsewhere.exists() && ours.exists() && other.exists());
    drop(holders);
}

/// Where peers' ledgers disagree: peer A says it moved the VM to B (its acknowledgement lost),
/// and B says it moved it on to Y, which is no peer of this server. Every such answer counts:
/// the VM is refused by name, never started here from the golden image while it runs at Y.
#[test]
fn a_vm_moved_on_to_a_server_that_is_no_peer_is_refused_whatever_the_order_of_the_answers() {
    use crate::ledger::{Ledger, Marks};
    use crate::migration::{self, Located, Peers};
    let dirs = tempfile::tempdir().expect("tempdir");
    let mut listeners = Vec::new();
    let mut addresses = Vec::new();
    for (name, moved_to) in [("server-a", "server-b"), ("server-b", "server-y")] {
        let state = dirs.path().join(name);
        let registry = VmRegistry::new(Lifecycle {
            reconnect_grace: Duration::from_secs(60),
            state_dir: Some(state.clone()),
            memory_dir: None,
        })
        .expect("registry");
        let marks = Marks { moved: Some(moved_to.into()), ..Marks::default() };
        Ledger::open(&state).expect("ledger").write_entry("x", "golden", None, None, marks).expect("moved");
        let address = overspill_net::ListenAddr::Unix(dirs.path().join(format!("{name}.sock")));
        listeners.push(migration::listen(&address, name.into(), None, registry).expect("peer socket"));
        addresses.push(address);
    }
    for order in [addresses.clone(), addresses.iter().rev().cloned().collect()] {
        let peers = Peers { name: "here".into(), addresses: order, tls: None };
        match peers.locate("x", false) {
            Located::Refused(why) => assert!(why.contains("server-y"), "{why}"),
            Located::Nowhere => panic!("a VM running at a server that is no peer would start here afresh"),
            Located::Live(at) => panic!("located live at {at}"),
        }
    }
    // With Y among the peers, it is asked in its turn: it holds nothing, so the VM is nowhere.
    let registry = VmRegistry::new(Lifecycle {
        reconnect_grace: Duration::from_secs(60),
        state_dir: Some(dirs.path().join("server-y")),
        memory_dir: None,
    })
    .expect("registry");
    let address = overspill_net::ListenAddr::Unix(dirs.path().join("server-y.sock"));
    listeners.push(migration::listen(&address, "server-y".into(), None, registry).expect("peer socket"));
    addresses.push(address);
    let first = addresses[0].clone();
    let peers = Peers { name: "here".into(), addresses, tls: None };
    assert!(matches!(peers.locate("x", false), Located::Nowhere));
    // A peer with this server's own name is no peer: "moved to NAME" must name one server.
    let peers = Peers { name: "server-a".into(), addresses: vec![first], tls: None };
    match peers.locate("x", false) {
        Located::Refused(why) => assert!(why.contains("own name"), "{why}"),
        _ => panic!("a peer of this server's own name was asked"),
    }
}

/// A VM that `--multi-conn` allows takes several connections at once, all one disk, advertised
/// as multi-conn; it waits in its grace only when the last of them is lost, and ends only with
/// the last. A VM not allowed refuses a second connection.
#[test]
fn several_connections_of_a_multi_conn_vm_share_its_overlay_and_it_ends_with_the_last() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dir.path());
    exports.registry.allow_multi_conn(vec!["build-*".into()]);
    assert!(exports.info("golden@build-7").expect("info").capabilities.can_multi_conn);
    assert!(!exports.info("golden@desk").expect("info").capabilities.can_multi_conn);
    assert!(!exports.info("golden").expect("info").capabilities.can_multi_conn, "anonymous, read-only");

    let mut first = exports.open("golden@build-7", None).expect("first connection");
    let mut second = exports.open("golden@build-7", None).expect("second connection");
    let mut third = exports.open("golden@build-7", None).expect("third connection");
    first.write(0, &[5; 4096], false).expect("write on the first");
    second.flush().expect("a flush on the second");
    let mut back = vec![0; 4096];
    read_whole(third.as_mut(), 0, &mut back).expect("read on the third");
    assert_eq!(back, vec![5; 4096], "one disk under every connection");
    let state =
        |exports: &OverlayExports| exports.registry.list().into_iter().find(|s| s.vm == "build-7").map(|s| s.state);

    // The first lost, the second ended cleanly: the VM goes on in the third.
    drop(first);
    second.disconnect();
    drop(second);
    assert_eq!(state(&exports), Some(VmState::Connected));
    third.write(8192, &[6; 4096], false).expect("the last connection writes on");
    drop(third);
    assert_eq!(state(&exports), Some(VmState::InGrace), "lost with its last connection");
    let mut again = exports.open("golden@build-7", None).expect("it resumes");
    read_whole(again.as_mut(), 0, &mut back).expect("read");
    assert_eq!(back, vec![5; 4096]);
    again.disconnect();
    drop(again);
    assert_eq!(state(&exports), None, "ended cleanly by its last connection");

    let _desk = exports.open("golden@desk", None).expect("desk");
    let refused = exports.open("golden@desk", None).err().expect("a second connection of a VM not allowed");
    assert!(refused.message.contains("--multi-conn"), "{}", refused.message);
}

/// The last connection of a multi-conn VM ending: from the moment it leaves, a new connection
/// does not join its overlay on its way to grace, but waits and then resumes it there.
#[test]
fn a_connection_arriving_as_the_last_one_leaves_resumes_the_vm_rather_than_join_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dir.path());
    exports.registry.allow_multi_conn(vec!["build-*".into()]);
    let registry = &exports.registry;
    let Claim::Fresh { number, .. } = registry.claim(Some("build-1"), "golden", None).expect("claim") else {
        panic!("a fresh VM");
    };
    let live = Arc::new(Live::new(exports.new_overlay("golden@build-1", number).expect("overlay")));
    registry.attach_live(number, &live);
    assert!(matches!(registry.claim(Some("build-1"), "golden", None), Ok(Claim::Join { .. })));
    assert!(registry.leave(number), "the joined connection leaves; the first goes on");
    assert!(!registry.leave(number), "the first, the last, leaves");
    assert!(matches!(registry.claim(Some("build-1"), "golden", None), Ok(Claim::Connecting)), "no join now");
    let overlay = live.vm().take().expect("the overlay");
    assert!(registry.end(number, Ending::Lost, overlay).is_none(), "kept in grace");
    assert!(matches!(registry.claim(Some("build-1"), "golden", None), Ok(Claim::Resume { .. })));
}

/// A connection joining a multi-conn VM whose overlay a capture ended meanwhile (it waited for
/// the VM's lock, which the capture held) is refused, not a panic, and leaves no count behind.
#[test]
fn a_connection_joining_an_overlay_that_ended_meanwhile_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dir.path());
    exports.registry.allow_multi_conn(vec!["build-*".into()]);
    let registry = &exports.registry;
    let Claim::Fresh { number, .. } = registry.claim(Some("build-2"), "golden", None).expect("claim") else {
        panic!("a fresh VM");
    };
    let live = Arc::new(Live::new(exports.new_overlay("golden@build-2", number).expect("overlay")));
    registry.attach_live(number, &live);
    let Ok(Claim::Join { number: joined, reset, live: shared }) = registry.claim(Some("build-2"), "golden", None)
    else {
        panic!("a second connection joins");
    };
    drop(live.vm().take().expect("the overlay, taken as a capture takes it"));
    let connection = crate::device::Connection { number: joined, reset, hurry: Arc::new(|| false) };
    let refused = crate::device::stack(shared, Capabilities::ALL, connection, registry.clone(), Vec::new(), true)
        .err()
        .expect("nothing to join");
    assert!(refused.message.contains("connect again"), "{}", refused.message);
    assert!(!registry.leave(number), "the joining connection's count went with its refusal");
}

/// The libvirt hook's reset at a domain's start is refused while the VM is connected (another
/// QEMU's disk), checked under the registry's lock as it resets: a VM that reconnected after
/// the hook's `list` keeps its writes. The operator's reset ends it all the same.
#[test]
fn a_reset_unless_connected_spares_a_connected_vm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dir.path());
    let mut device = exports.open("golden@desk-4", None).expect("open");
    device.write(0, &[7; 4096], false).expect("write");
    let refused = exports.registry.reset_with("desk-4", false).expect_err("connected");
    assert!(matches!(refused, ServerError::VmConnected(_)), "{refused}");
    let mut back = vec![0; 4096];
    read_whole(device.as_mut(), 0, &mut back).expect("read");
    assert_eq!(back, vec![7; 4096], "its writes stay");
    exports.registry.reset("desk-4").expect("the operator's reset");
    drop(device);
}

/// Under default limits (`serve --limit-iops`), a VM that ends cleanly takes its limiter, and
/// with it its metrics series, along: names served once do not pile up.
#[test]
fn an_ended_vm_leaves_no_limiter_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exports = exports_in(dir.path());
    let limits = exports.registry.limits();
    limits.set_default(overspill_block::Limits {
        ops: Some(overspill_block::Rate { per_second: 1000, burst: 1000 }),
        bytes: None,
    });
    for vm in ["ci-1", "ci-2"] {
        let mut device = exports.open(&format!("golden@{vm}"), None).expect("open");
        device.write(0, &[1; 4096], false).expect("write");
        assert!(limits.throttling().iter().any(|(name, ..)| name == vm), "{vm} is limited while it runs");
        device.disconnect();
        drop(device);
    }
    assert!(limits.throttling().is_empty(), "{:?}", limits.throttling());
}

/// The peer socket is made where nothing lies, or over a dead server's socket; any other file,
/// and a live server's socket, is left as it is and the listener refused.
#[test]
fn a_peer_socket_replaces_only_a_dead_servers_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = || {
        let lifecycle = Lifecycle { reconnect_grace: Duration::from_secs(60), state_dir: None, memory_dir: None };
        VmRegistry::new(lifecycle).expect("registry")
    };
    let listen =
        |path: PathBuf| migration::listen(&overspill_net::ListenAddr::Unix(path), "x".into(), None, registry());

    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "mine").expect("a file");
    let refused = listen(notes.clone()).err().expect("a file that is no socket");
    assert_eq!(refused.kind(), std::io::ErrorKind::AlreadyExists, "{refused}");
    assert_eq!(std::fs::read_to_string(&notes).expect("still there"), "mine");

    let live = dir.path().join("live.sock");
    let _first = listen(live.clone()).expect("a peer socket");
    let refused = listen(live.clone()).err().expect("a live server's socket");
    assert_eq!(refused.kind(), std::io::ErrorKind::AddrInUse, "{refused}");

    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("a socket nobody listens on"));
    let _second = listen(stale).expect("a peer socket over a dead server's");
}
