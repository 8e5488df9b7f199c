//! What the model tests' sensitivity studies share: each change's held figures, worked out two
//! changes at a time, printed as one markdown table.

/// A figure a test holds, under one change: what it is, its value, what the table's second row
/// shows for it (the seed's figure, or the bound the test holds it to), and whether the test's
/// tolerance holds it.
pub struct Held {
    pub what: String,
    pub here: f64,
    pub against: String,
    pub holds: bool,
}

/// Works out `figures` for each of `changes` (named by `name`), two at a time (two cores, and a
/// model run can hold many VMs' RAM tiers), and prints a markdown table: a row per change, a
/// column per figure, each cell with `decimals` digits and "out" where the test would not hold
/// it. `against` heads the second row.
pub fn print_study<C: Sync>(
    changes: &[C],
    name: fn(&C) -> &str,
    figures: fn(&C) -> Vec<Held>,
    against: &str,
    decimals: usize,
) {
    let rows: Vec<(&str, Vec<Held>)> = changes
        .chunks(2)
        .flat_map(|pair| {
            std::thread::scope(|scope| {
                let runs: Vec<_> =
                    pair.iter().map(|change| (name(change), scope.spawn(move || figures(change)))).collect();
                runs.into_iter().map(|(name, run)| (name, run.join().expect("a study run"))).collect::<Vec<_>>()
            })
        })
        .collect();
    let columns = &rows[0].1;
    let line = |cells: Vec<&str>| cells.join(" | ");
    println!("| change | {} |", line(columns.iter().map(|h| h.what.as_str()).collect()));
    println!("| --- |{}", " --- |".repeat(columns.len()));
    println!("| {against} | {} |", line(columns.iter().map(|h| h.against.as_str()).collect()));
    for (name, row) in &rows {
        let cells: Vec<String> =
            row.iter().map(|h| format!("{:.*}{}", decimals, h.here, if h.holds { "" } else { " out" })).collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
}

/// Grows a workload's system region to `system_mib`, moving its write areas up and growing its
/// disk to fit (areas lie above the system region).
pub fn grow_system_region(w: &mut overspill_storm::Workload, system_mib: u64) {
    let grown = system_mib - w.disk.system_mib;
    w.disk.system_mib = system_mib;
    w.disk.areas.iter_mut().for_each(|area| area.start_mib += grown);
    w.disk.size_mib += grown;
}
