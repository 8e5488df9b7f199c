use super::*;
use crate::ledger::{boot_id, boot_time_s, process_start, state_file_stem, LedgerEntry, BOOT_MARKER, STATE_FORMAT};

#[test]
fn the_ledger_names_what_a_dead_server_of_this_boot_left_and_forgets_other_boots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(dir.path()).expect("ledger");
    ledger.mark_with("same-pid", "golden", None, None).expect("mark");
    let write = |vm: &str, pid: u32, boot: &str| {
        let entry = LedgerEntry {
            format: STATE_FORMAT,
            vm: vm.into(),
            image: "golden".into(),
            owner: None,
            pid,
            pid_start: None,
            boot_id: boot.into(),
            since_unix_s: 0,
            state: None,
            making: false,
            unwritten: false,
            lost: None,
            quiet: false,
            moved: None,
            incoming: None,
        };
        std::fs::write(ledger.path(vm), serde_json::to_vec(&entry).expect("json")).expect("write");
    };
    // A pid above the kernel's maximum (4194304) is never alive.
    write("crashed", 4_294_967, &ledger.boot_id);
    write("old-boot", 4_294_967, "another boot");
    std::fs::write(ledger.path("garbled"), b"{").expect("write");
    let LeftBehind { lost, .. } = ledger.left_behind();
    assert_eq!(lost.keys().map(String::as_str).collect::<Vec<_>>(), ["crashed", "garbled", "same-pid"]);
    assert!(!ledger.path("old-boot").exists(), "the earlier boot's file is removed");
    assert!(lost["crashed"].contains("4294967"), "{}", lost["crashed"]);
}

/// A ledger file left empty by a power loss (written without a sync) names a VM of an
/// earlier boot, which ended with the host: forgotten, with its files where this server
/// makes them, and the name free. One of this boot is still a lost VM.
#[test]
fn an_unreadable_ledger_file_of_an_earlier_boot_frees_its_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state_dir = dir.path().join("state");
    let (memory_dir, spill_dir) = (dir.path().join("memory"), dir.path().join("spill"));
    for d in [&state_dir, &memory_dir, &spill_dir] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let boot = boot_time_s().expect("btime");
    for vm in ["before-boot", "this-boot"] {
        let ledger_file = std::fs::File::create(state_dir.join(format!("vm-{vm}.json"))).expect("ledger file");
        if vm == "before-boot" {
            let an_hour_before = std::time::UNIX_EPOCH + Duration::from_secs(boot - 3600);
            ledger_file.set_modified(an_hour_before).expect("mtime");
        }
        std::fs::write(spill_dir.join(format!("vm-{vm}.spill")), b"spilled").expect("spill file");
    }
    let lifecycle = Lifecycle {
        reconnect_grace: Duration::from_secs(60),
        state_dir: Some(state_dir.clone()),
        memory_dir: Some(memory_dir.clone()),
    };
    let registry = VmRegistry::new(lifecycle.clone()).expect("registry");
    let places = StateRecord {
        image_label: String::new(),
        image_identity: None,
        mode: "ram+disk".into(),
        disk_bytes: 0,
        memory_dir,
        spill_dir: Some(spill_dir.clone()),
    };
    registry.set_state_places(places.clone());
    let lost: Vec<String> = registry.list().into_iter().map(|status| status.vm).collect();
    assert_eq!(lost, ["this-boot"]);
    assert!(!state_dir.join("vm-before-boot.json").exists(), "the earlier boot's file is removed");
    assert!(!spill_dir.join("vm-before-boot.spill").exists(), "and its VM's files");
    assert!(spill_dir.join("vm-this-boot.spill").exists(), "a lost VM's files wait for its reset");
    assert!(registry.claim(Some("before-boot"), "golden", None).is_ok(), "the name is free");
    drop(registry);

    // The state directory says which boot its last server started in: a file cut short
    // under another boot's record is that boot's, whatever its time says.
    let marker = std::fs::read_to_string(state_dir.join(BOOT_MARKER)).expect("this boot recorded");
    assert_eq!(marker.trim(), boot_id());
    std::fs::write(state_dir.join(BOOT_MARKER), "an earlier boot\n").expect("marker");
    std::fs::write(state_dir.join("vm-recorded.json"), b"{\"vm\":\"reco").expect("cut-short file");
    std::fs::write(spill_dir.join("vm-recorded.spill"), b"spilled").expect("spill file");
    let registry = VmRegistry::new(lifecycle.clone()).expect("registry");
    registry.set_state_places(places.clone());
    assert!(registry.list().is_empty(), "{:?}", registry.list());
    for vm in ["recorded", "this-boot"] {
        assert!(!state_dir.join(format!("vm-{vm}.json")).exists(), "{vm}: an earlier boot's, by the record");
        assert!(!spill_dir.join(format!("vm-{vm}.spill")).exists(), "{vm}'s files");
    }
}

/// A live process with a dead server's pid is not that server: its entries are handled as
/// the dead server's. One that is (same pid, same start) keeps them.
#[test]
fn a_dead_servers_pid_taken_by_another_process_does_not_hold_its_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(dir.path()).expect("ledger");
    // pid 1 is alive here, and not this process.
    let init_start = process_start(1).expect("pid 1 runs");
    assert!(process_start(std::process::id()).is_some_and(|start| start > 0));
    for (vm, start) in [("reused-pid", Some(init_start + 1)), ("live-server", Some(init_start)), ("old-entry", None)] {
        let entry = LedgerEntry {
            format: STATE_FORMAT,
            vm: vm.into(),
            image: "golden".into(),
            owner: None,
            pid: 1,
            pid_start: start,
            boot_id: ledger.boot_id.clone(),
            since_unix_s: 0,
            state: None,
            making: false,
            unwritten: false,
            lost: None,
            quiet: false,
            moved: None,
            incoming: None,
        };
        std::fs::write(ledger.path(vm), serde_json::to_vec(&entry).expect("json")).expect("write");
    }
    let LeftBehind { lost, .. } = ledger.left_behind();
    assert_eq!(lost.keys().map(String::as_str).collect::<Vec<_>>(), ["reused-pid"]);
    assert!(ledger.path("live-server").exists() && ledger.path("old-entry").exists());
}

/// The owner a VM's ledger file names comes back with it; a file an earlier version wrote,
/// without one, still reads, as a VM of no one's.
#[test]
fn the_owner_comes_back_from_the_ledger_and_older_files_without_one_still_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(dir.path()).expect("ledger");
    let state = StateRecord {
        image_label: "golden".into(),
        image_identity: None,
        mode: "ram".into(),
        disk_bytes: 1 << 20,
        memory_dir: dir.path().join("memory"),
        spill_dir: None,
    };
    for vm in ["owned", "older"] {
        ledger.mark_with(vm, "golden", Some("alice"), Some(state.clone())).expect("mark");
        let mut entry: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ledger.path(vm)).expect("read")).expect("json");
        assert_eq!(entry["owner"], "alice");
        // A dead server's entry (pid above the kernel's maximum).
        entry["pid"] = 4_294_967.into();
        if vm == "older" {
            entry.as_object_mut().expect("object").remove("owner");
        }
        std::fs::write(ledger.path(vm), serde_json::to_vec(&entry).expect("json")).expect("write");
    }
    let LeftBehind { lost, recoverable, .. } = ledger.left_behind();
    assert!(lost.is_empty(), "{lost:?}");
    let owners: Vec<(&str, Option<&str>)> = recoverable.iter().map(|r| (r.vm.as_str(), r.owner.as_deref())).collect();
    assert_eq!(owners.len(), 2);
    assert!(owners.contains(&("owned", Some("alice"))) && owners.contains(&("older", None)), "{owners:?}");
}

#[test]
fn a_retirement_cut_short_by_a_crash_is_finished_by_the_next_server_unless_the_name_is_in_use_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(&dir.path().join("state")).expect("ledger");
    let memory_dir = dir.path().join("memory");
    std::fs::create_dir_all(&memory_dir).expect("mkdir");
    let state = StateRecord {
        image_label: "golden".into(),
        image_identity: None,
        mode: "ram".into(),
        disk_bytes: 1 << 20,
        memory_dir: memory_dir.clone(),
        spill_dir: None,
    };
    let files_of = |vm: &str| -> Vec<PathBuf> {
        ["pages", "slots"].iter().map(|ext| memory_dir.join(format!("{}.{ext}", state_file_stem(vm)))).collect()
    };
    let stranger = memory_dir.join("not-ours.pages");
    for path in files_of("ended").iter().chain(&files_of("reused")).chain([&stranger]) {
        std::fs::write(path, b"x").expect("write");
    }
    // A dead server of this boot, stopped between moving each entry aside and removing its
    // files; "reused" then got a ledger entry again (its files are the new VM's).
    for vm in ["ended", "reused"] {
        ledger.mark_with(vm, "golden", None, Some(state.clone())).expect("mark");
        std::fs::rename(ledger.path(vm), ledger.retiring_path(vm)).expect("rename");
        let mut entry: LedgerEntry =
            serde_json::from_slice(&std::fs::read(ledger.retiring_path(vm)).expect("read")).expect("json");
        entry.pid = 4_294_967;
        std::fs::write(ledger.retiring_path(vm), serde_json::to_vec(&entry).expect("json")).expect("write");
    }
    ledger.mark_with("reused", "golden", None, Some(state.clone())).expect("mark");

    let LeftBehind { recoverable, .. } = ledger.left_behind();
    assert!(files_of("ended").iter().all(|f| !f.exists()), "the ended VM's files are removed");
    assert!(!ledger.retiring_path("ended").exists() && !ledger.retiring_path("reused").exists());
    assert!(files_of("reused").iter().all(|f| f.exists()), "the files of a name in use again stay");
    assert_eq!(recoverable.iter().map(|r| r.vm.as_str()).collect::<Vec<_>>(), ["reused"]);
    assert!(stranger.exists(), "a file overspill did not name is left alone");

    ledger.retire("reused", &state, remove_state_files);
    assert!(files_of("reused").iter().all(|f| !f.exists()));
    assert!(!ledger.path("reused").exists() && !ledger.retiring_path("reused").exists());
}

#[test]
fn multi_conn_patterns_match_names_as_a_shell_does() {
    for (pattern, name, matches) in [
        ("build-*", "build-7", true),
        ("build-*", "build-", true),
        ("build-*", "desk-build-7", false),
        ("*-ci", "nightly-ci", true),
        ("vm-??", "vm-17", true),
        ("vm-??", "vm-1", false),
        ("*", "anything", true),
        ("desk", "desk", true),
        ("desk", "desk2", false),
        ("a*b*c", "axxbyyc", true),
        ("a*b*c", "axxbyy", false),
    ] {
        assert_eq!(crate::multi_conn::glob_matches(pattern.as_bytes(), name.as_bytes()), matches, "{pattern} {name}");
    }
}
