//! Where the built-in disks' middle queue depths come from: a disk that reorders its queue,
//! simulated from data-sheet mechanics.
//!
//! A disk with `q` random reads queued serves next the one it can reach soonest (seek plus
//! rotational wait: shortest positioning time first, which disks' firmware approximates). Its
//! seeks follow the curve disks are known to have: short seeks grow with the square root of the
//! distance (the arm accelerates, then brakes), long ones linearly (it coasts) (Ruemmler and
//! Wilkes, "An introduction to disk drive modeling", IEEE Computer, 1994, who join the two
//! piecewise), here in one formula, `track_to_track + a·√d + b·d` over a fraction `d` of the
//! stroke, `a` and `b` set so the curve meets the data sheet's average (over random pairs of
//! tracks) and full-stroke seeks (three figures set the curve: on the 7K320's proportions its
//! linear term comes out negative). Each command also pays the drive's controller overhead,
//! where its sheet states one, which no reordering shortens.
//!
//! What it gives: how far up from depth 1 to depth 32 a disk's rate has climbed at depths 4 and
//! 16 (0.27-0.30 and 0.71-0.72 of the way, nearly the same for every class). The built-in curves
//! keep their depth-1 points (data sheets) and depth-32 points (about twice depth 1, loosely
//! sourced) and put their middle points there. They do not take the simulation's own depth-32
//! rate: an ideal reorderer climbs to 2.4-2.8× depth 1, and with a first sketch's curve climbing
//! 2.72× one of seed 003's own arrays, in the held-out test, booted in half the seed's time
//! (docs/planning.md, "Every parameter and its source").

use overspill_storm::storage::DeviceSpec;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A disk's mechanics as its data sheet states them, in milliseconds (reads).
struct Mechanics {
    class: &'static str,
    rpm: f64,
    track_to_track_ms: f64,
    average_seek_ms: f64,
    full_stroke_ms: f64,
    controller_overhead_ms: f64,
}

/// Seagate Savvio 10K.4 SAS product manual (100539221 Rev. A, 2009), reads, typical, without
/// controller overhead: single track 0.30 ms, average 3.8 ms, full stroke 7.81 ms (600 GB);
/// controller overhead 0.2 ms ("access time = controller overhead + average seek time", 4.0 ms).
const SAVVIO_10K4: Mechanics = Mechanics {
    class: "hdd10k",
    rpm: 10_000.0,
    track_to_track_ms: 0.30,
    average_seek_ms: 3.8,
    full_stroke_ms: 7.81,
    controller_overhead_ms: 0.2,
};

/// Hitachi's 7,200 rpm desktop disks of the 7K320's generation (7K320 OEM specification, reads,
/// typical, without command overhead): single track 1.0 ms, average 12 ms, full stroke 20.0 ms.
/// The 7K1000.C's own specification was found only as far as its average seeks.
const HITACHI_7K320: Mechanics = Mechanics {
    class: "hdd7200",
    rpm: 7_200.0,
    track_to_track_ms: 1.0,
    average_seek_ms: 12.0,
    full_stroke_ms: 20.0,
    controller_overhead_ms: 0.0,
};

/// A disk of `class` whose data sheet was found only as far as its average read seek: its
/// single-track and full-stroke seeks in the proportions of `like`, a disk whose sheet has all
/// three.
const fn scaled(
    class: &'static str,
    like: Mechanics,
    rpm: f64,
    average_seek_ms: f64,
    controller_overhead_ms: f64,
) -> Mechanics {
    let by = average_seek_ms / like.average_seek_ms;
    Mechanics {
        class,
        rpm,
        track_to_track_ms: like.track_to_track_ms * by,
        average_seek_ms,
        full_stroke_ms: like.full_stroke_ms * by,
        controller_overhead_ms,
    }
}

/// The built-in HDD classes, from the sheets their depth-1 points come from: `hdd7200` the
/// Deskstar 7K1000.C (two-disk model, 8.5 ms average read seek, no overhead stated) in the
/// 7K320's proportions; `hdd10k` the Savvio 10K.4; `hdd15k` the Ultrastar 15K450 (300 GB,
/// 3.1 ms, no overhead stated) in the Savvio's, the enterprise disk at hand with all three seeks.
const DISKS: [Mechanics; 3] = [
    scaled("hdd7200", HITACHI_7K320, 7_200.0, 8.5, 0.0),
    SAVVIO_10K4,
    scaled("hdd15k", SAVVIO_10K4, 15_000.0, 3.1, 0.0),
];

/// Requests served per simulated depth, after as many again to fill the queue's pattern: enough
/// to put the rates within a few tenths of a percent of their limit.
const SERVED: usize = 100_000;

/// The depths the built-in curves have points at.
const DEPTHS: [usize; 4] = [1, 4, 16, 32];

/// The seek over a fraction `d` of the stroke. Over random pairs of tracks `E[√d] = 8/15` and
/// `E[d] = 1/3`, so `a/5 + (full − t2t)/3 = average − t2t` sets `a`, and `b` is what is left of
/// the full stroke.
fn seek_ms(disk: &Mechanics, d: f64) -> f64 {
    let (t2t, full) = (disk.track_to_track_ms, disk.full_stroke_ms);
    let a = 5.0 * ((disk.average_seek_ms - t2t) - (full - t2t) / 3.0);
    let b = full - t2t - a;
    t2t + a * d.sqrt() + b * d
}

/// Random reads a second with `depth` queued, the queue kept full: each served request (at a
/// uniformly random track and angle) replaced by a new one. What the disk spends positioning
/// and on overhead is counted; the transfer is not (the model adds bytes over bandwidth to
/// `1/IOPS(q)`), but the platter turns under it, which moves where the next wait starts.
fn reordered_iops(disk: &Mechanics, depth: usize) -> f64 {
    let revolution_ms = 60_000.0 / disk.rpm;
    // The Savvio 10K.4 manual's 677,557 bytes a track (its average over the zones).
    let transfer_revs = 4096.0 / 677_557.0;
    let mut rng = SmallRng::seed_from_u64(0x0d15_c0de);
    let request = |rng: &mut SmallRng| (rng.gen::<f64>(), rng.gen::<f64>());
    let mut queue: Vec<(f64, f64)> = (0..depth).map(|_| request(&mut rng)).collect();
    let (mut track, mut angle) = request(&mut rng);
    let mut busy_ms = 0.0;
    for served in 0..2 * SERVED {
        let positioning_ms = |&(to_track, to_angle): &(f64, f64)| {
            let seek = seek_ms(disk, (to_track - track).abs());
            // The platter turns during the seek: the wait is from where the head arrives.
            let wait_revs = (to_angle - angle - seek / revolution_ms).rem_euclid(1.0);
            seek + wait_revs * revolution_ms
        };
        let (next, soonest_ms) = queue
            .iter()
            .map(positioning_ms)
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("the queue is never empty");
        (track, angle) = queue[next];
        angle = (angle + transfer_revs + disk.controller_overhead_ms / revolution_ms).rem_euclid(1.0);
        queue[next] = request(&mut rng);
        if served >= SERVED {
            busy_ms += soonest_ms + disk.controller_overhead_ms;
        }
    }
    1000.0 * SERVED as f64 / busy_ms
}

/// A disk's simulated rate at each of `DEPTHS`.
struct Climb([f64; 4]);

impl Climb {
    fn of(disk: &Mechanics) -> Self {
        Self(DEPTHS.map(|depth| reordered_iops(disk, depth)))
    }

    fn at(&self, depth: usize) -> f64 {
        self.0[DEPTHS.iter().position(|&d| d == depth).expect("a simulated depth")]
    }

    /// How far up from depth 1 to depth 32 the rate has climbed at `depth`.
    fn share_at(&self, depth: usize) -> f64 {
        (self.at(depth) - self.at(1)) / (self.at(32) - self.at(1))
    }
}

#[test]
fn one_request_at_a_time_costs_the_data_sheets_access_time() {
    // A check of the seek curve's fit and of the overhead's count; at depth 1 nothing is
    // reordered, so it says nothing of the reordering.
    for disk in &DISKS {
        let access_ms = disk.controller_overhead_ms + disk.average_seek_ms + 30_000.0 / disk.rpm;
        let rate = reordered_iops(disk, 1);
        let sheet = 1000.0 / access_ms;
        println!("{}: depth 1 {rate:.1} IOPS, data sheet {sheet:.1}", disk.class);
        assert!((rate / sheet - 1.0).abs() < 0.01, "{}: {rate:.1} against {sheet:.1}", disk.class);
    }
}

#[test]
fn built_in_disks_middle_depths_lie_where_a_reordering_disk_puts_them() {
    let mut misplaced = Vec::new();
    for disk in &DISKS {
        let climb = Climb::of(disk);
        let built_in = DeviceSpec::built_in(disk.class).expect("a built-in class");
        let (depth1_iops, depth32_iops) = (built_in.iops_at(1), built_in.iops_at(32));
        let ideal_over_depth1 = climb.at(32) / climb.at(1);
        let built_in_over_depth1 = depth32_iops / depth1_iops;
        println!(
            "{}: simulated {:.0?} IOPS at depths {DEPTHS:?} (32 over 1: {ideal_over_depth1:.2}×; built in {built_in_over_depth1:.2}×)",
            disk.class, climb.0
        );
        // A disk that reorders its whole queue is the most a disk gains from it: the built-in
        // depth 32 stays under it.
        assert!(
            built_in_over_depth1 < ideal_over_depth1,
            "{}: {built_in_over_depth1:.2}× over depth 1 beats ideal reordering",
            disk.class
        );
        for depth in [4, 16] {
            let share = climb.share_at(depth);
            let derived = depth1_iops + share * (depth32_iops - depth1_iops);
            let built = built_in.iops_at(depth);
            println!("  depth {depth}: {share:.3} of the way up, {derived:.1} IOPS; built in {built:.0}");
            if (built / derived - 1.0).abs() >= 0.01 {
                misplaced.push(format!("{} at depth {depth}: {built} against {derived:.1}", disk.class));
            }
        }
    }
    assert!(misplaced.is_empty(), "built-in middle points 1% or more off the derived ones: {misplaced:?}");
}

#[test]
fn the_climbs_shape_hardly_depends_on_the_class_nor_on_whose_seeks_it_borrows() {
    // One shape for all three classes is what lets the 15K and 7.2K disks borrow another
    // disk's seek proportions: if the shape moved with them, the borrowing would matter. So
    // each class is also simulated on the other sheet's proportions.
    let borrowed_otherwise = [
        scaled("hdd7200", SAVVIO_10K4, 7_200.0, 8.5, 0.0),
        scaled("hdd10k", HITACHI_7K320, 10_000.0, 3.8, 0.2),
        scaled("hdd15k", HITACHI_7K320, 15_000.0, 3.1, 0.0),
    ];
    let shares: Vec<[f64; 2]> =
        DISKS.iter().chain(&borrowed_otherwise).map(Climb::of).map(|c| [c.share_at(4), c.share_at(16)]).collect();
    for depth in 0..2 {
        let (low, high) = shares.iter().map(|s| s[depth]).fold((f64::MAX, f64::MIN), |(l, h), s| (l.min(s), h.max(s)));
        assert!(high - low < 0.03, "shares of the climb at depths 4 and 16, by class and proportions: {shares:.3?}");
    }
}
