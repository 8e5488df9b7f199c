//! The crash simulation of the image store's steps: a VM captured as a version, a checkpoint of
//! it, a checkpoint brought in from elsewhere, and forks made of one, each "killed" at every
//! crash point it reaches (each write of the layer file, its sealing, its linking or renaming
//! into place, each write of the forks' book). At every point the store is read as a server
//! started then would read it, and must be as before or as after: a version or checkpoint is
//! absent, or there whole with the bytes its VM had; a checkpoint brought in is never there
//! without the one it lies on; forks made together are all in the book or none.
//!
//! `cargo test -p overspill-server --features crash-points --test store_crash`.

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use overspill_engine::{crash, HostMemory, Overlay, OverlayConfig, VmStats, WriteCacheMode};
use overspill_images::open_image;
use overspill_images::qcow2_layer::write_overlay;
use overspill_server::checkpoints::{manifest_name, DirPlace};
use overspill_server::images::ImageStore;
use overspill_server::vms::{Lifecycle, VmRegistry};

const DISK: usize = 3 << 20;

/// A store with image `win` v1 (a raw file), and a VM's overlay over it that wrote, zeroed and
/// trimmed: the store, the overlay, and what the VM reads.
fn store_and_vm(dir: &Path) -> (ImageStore, Overlay, Vec<u8>) {
    let golden: Vec<u8> = (0..DISK).map(|i| (i as u64).wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect();
    let file = dir.join("golden.img");
    std::fs::write(&file, &golden).expect("golden");
    let store = ImageStore::new(&dir.join("images"));
    store.publish("win", &file, true).expect("publish");
    let v1 = store.version("win", "v1").expect("v1");
    let mut overlay = ram_overlay(&v1.path);
    let mut bytes = golden;
    for (at, len, byte) in [(4096usize, 8192usize, 0x5au8), (1 << 20, 600 << 10, 0x6b), ((3 << 20) - 4096, 4096, 0x7c)]
    {
        overlay.write(at as u64, &vec![byte; len]).expect("write");
        bytes[at..at + len].fill(byte);
    }
    overlay.write_zeroes(2 << 20, 64 << 10).expect("zeroes");
    bytes[2 << 20..(2 << 20) + (64 << 10)].fill(0);
    (store, overlay, bytes)
}

/// A VM's overlay, in RAM, over the image file at `path`.
fn ram_overlay(path: &Path) -> Overlay {
    let image = open_image(path).expect("the image opens");
    let config = OverlayConfig { mode: WriteCacheMode::Ram, ram_target_bytes: 64 << 20, spill_max_bytes: None };
    Overlay::new(image, config, None, HostMemory::unlimited(), Arc::new(VmStats::default())).expect("overlay")
}

/// Whether `path` opens as an image reading exactly `expected`.
fn reads_as(path: &Path, expected: &[u8]) -> bool {
    let Ok(image) = open_image(path) else { return false };
    let mut read = vec![0u8; expected.len()];
    image.read_at(&mut read, 0).is_ok() && read == expected
}

/// Runs `work` with `check` called at every crash point it reaches; returns how many.
fn at_every_point(work: impl FnOnce(), check: impl Fn(u32) + 'static) -> u32 {
    let points = Rc::new(Cell::new(0u32));
    let counted = points.clone();
    crash::set(move || {
        counted.set(counted.get() + 1);
        check(counted.get());
    });
    work();
    crash::clear();
    points.get()
}

#[test]
fn a_captured_version_is_absent_or_whole_at_every_crash_point() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, mut overlay, bytes) = store_and_vm(dir.path());
    let (seen, expected) = (store.clone(), bytes.clone());
    let points = at_every_point(
        || {
            let version = store
                .publish_layer("win", "v1", |path, backing, format| write_overlay(&mut overlay, path, backing, format))
                .expect("capture");
            assert_eq!(version, "v2");
        },
        move |point| {
            let image = seen.image("win").expect("the image reads");
            let names: Vec<&str> = image.versions.iter().map(|v| v.name.as_str()).collect();
            match names.as_slice() {
                ["v1"] => {}
                ["v1", "v2"] => assert!(reads_as(&image.versions[1].path, &expected), "point {point}: v2 half there"),
                other => panic!("point {point}: versions {other:?}"),
            }
            assert_eq!(image.current.as_deref(), Some("v1"), "point {point}: a capture gives no stage");
        },
    );
    assert!(points >= 8, "only {points} crash points");
    assert!(reads_as(&store.version("win", "v2").expect("v2").path, &bytes));
    // v2 (a layer over v1) compacted into one file, v3, killed at every point of it.
    store.activate("win", "v2").expect("activate");
    let seen = store.clone();
    let points = at_every_point(
        || assert_eq!(store.compact("win", "v2").expect("compact"), "v3"),
        move |point| {
            let image = seen.image("win").expect("the image reads");
            if let Some(v3) = image.versions.iter().find(|v| v.name == "v3") {
                assert!(reads_as(&v3.path, &bytes), "point {point}: v3 half there");
            } else {
                assert_eq!(image.current.as_deref(), Some("v2"), "point {point}: production on a missing v3");
            }
        },
    );
    assert!(points >= 3, "only {points} crash points");
    assert_eq!(store.image("win").expect("image").current.as_deref(), Some("v3"));
}

#[test]
fn a_checkpoint_and_one_brought_in_are_absent_or_whole_at_every_crash_point() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, mut overlay, bytes) = store_and_vm(dir.path());
    let (seen, expected) = (store.clone(), bytes.clone());
    let points = at_every_point(
        || {
            store
                .write_checkpoint("win", "v1", "c1", |path, backing, format| {
                    write_overlay(&mut overlay, path, backing, format)
                })
                .expect("checkpoint");
        },
        move |point| {
            if let Ok(c1) = seen.checkpoint("win", "c1") {
                assert!(reads_as(&c1.path, &expected), "point {point}: c1 half there");
            }
        },
    );
    assert!(points >= 8, "only {points} crash points");
    // A fork of c1 writes and is checkpointed over it; both are taken out and brought into a
    // store with the same v1, killed at every point of the import.
    let mut fork = ram_overlay(&store.checkpoint("win", "c1").expect("c1").path);
    fork.write(0, &[0x99; 4096]).expect("write");
    let mut newer = bytes.clone();
    newer[..4096].fill(0x99);
    store
        .write_checkpoint("win", "@c1", "c2", |path, backing, format| write_overlay(&mut fork, path, backing, format))
        .expect("c2");
    let out = DirPlace(dir.path().join("out"));
    store.export_checkpoint("win", "c2", &out).expect("export");
    let there = ImageStore::new(&dir.path().join("there"));
    there.publish("win", &dir.path().join("golden.img"), true).expect("publish");
    let seen = there.clone();
    let points = at_every_point(
        || {
            there.import_checkpoint(&out, &manifest_name("win", "c2")).expect("import");
        },
        move |point| {
            let c1 = seen.checkpoint("win", "c1");
            if let Ok(c1) = &c1 {
                assert!(reads_as(&c1.path, &bytes), "point {point}: c1 half there");
            }
            if let Ok(c2) = seen.checkpoint("win", "c2") {
                assert!(c1.is_ok(), "point {point}: c2 there without c1 under it");
                assert!(reads_as(&c2.path, &newer), "point {point}: c2 half there");
            }
        },
    );
    assert!(points >= 4, "only {points} crash points");
}

#[test]
fn forks_made_together_are_all_in_the_book_or_none_at_every_crash_point() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, mut overlay, _) = store_and_vm(dir.path());
    store
        .write_checkpoint("win", "v1", "c1", |path, backing, format| write_overlay(&mut overlay, path, backing, format))
        .expect("checkpoint");
    let state = dir.path().join("state");
    let registry =
        VmRegistry::new(Lifecycle { state_dir: Some(state.clone()), ..Lifecycle::default() }).expect("registry");
    let names: Vec<String> = (0..50).map(|n| format!("f{n}")).collect();
    let book = state.join("forks.json");
    let counts = Rc::new(RefCell::new(Vec::new()));
    let seen = counts.clone();
    let points = at_every_point(
        || registry.fork("win:@c1", &names, &store).expect("fork"),
        move |point| {
            let forks = match std::fs::read(&book) {
                Ok(text) => {
                    let book: serde_json::Value = serde_json::from_slice(&text).expect("the book is whole");
                    book["forks"].as_object().map_or(0, |forks| forks.len())
                }
                Err(_) => 0,
            };
            assert!(forks == 0 || forks == 50, "point {point}: {forks} of 50 forks in the book");
            seen.borrow_mut().push(forks);
        },
    );
    assert!(points >= 2, "only {points} crash points");
    assert_eq!(counts.borrow().first(), Some(&0), "the first point finds no fork yet");
    assert!(registry.fork_of("f49").is_some());
}
