//! `serve --config FILE`: a TOML file whose keys are `serve`'s long flags (`ram = "256M"`,
//! `listen = "unix:/run/overspill.sock"`, `export = ["win7=/srv/win7.img"]`, `local-tier =
//! true`). It becomes flags placed before the command line's, so a value given on the command
//! line wins, and every value goes through the same parsing and checks as the flag.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context};
use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// Flags whose numbers are octal: a TOML integer for one written with a base (`0o660`) is
/// refused (see [`flags_from_file`]).
const OCTAL_FLAGS: &[&str] = &["socket-mode"];

/// Whether `key`'s value is written in the file `text` as a number with a base (`0o`, `0x`,
/// `0b`): TOML's value keeps none.
fn written_with_a_base(text: &str, key: &str) -> bool {
    text.lines().any(|line| {
        let value = line.trim_start().strip_prefix(key).map(str::trim_start).and_then(|rest| rest.strip_prefix('='));
        value.map(str::trim_start).is_some_and(|v| ["0o", "0x", "0b"].iter().any(|base| v.starts_with(base)))
    })
}

/// The flags FILE stands for, leaving out those `given` has from the command line. `serve` is
/// the subcommand's definition, for the names and kinds of its flags.
pub fn flags_from_file(path: &Path, serve: &Command, given: &ArgMatches) -> anyhow::Result<Vec<OsString>> {
    let file = std::fs::read_to_string(path).with_context(|| format!("--config {}", path.display()))?;
    let table: toml::Table = file.parse().with_context(|| format!("--config {}", path.display()))?;
    let mut flags = Vec::new();
    for (key, value) in &table {
        let Some(arg) = serve.get_arguments().find(|a| a.get_long() == Some(key.as_str())) else {
            bail!("--config {}: {key:?} is not a flag of serve (see overspill serve --help)", path.display());
        };
        if key == "config" {
            bail!("--config {}: a configuration file cannot name another", path.display());
        }
        if given.value_source(arg.get_id().as_str()) == Some(ValueSource::CommandLine) {
            continue;
        }
        let takes_value = arg.get_num_args().is_none_or(|n| n.takes_values());
        let values: Vec<&toml::Value> = match value {
            toml::Value::Array(items) => items.iter().collect(),
            single => vec![single],
        };
        for value in values {
            let text = match value {
                toml::Value::String(s) => s.clone(),
                // TOML keeps no base: `0o660` is 432, which the flag (octal) took for 0432, open
                // to every user; `660` is 660, which the flag takes for 0660 as meant.
                toml::Value::Integer(_) if OCTAL_FLAGS.contains(&key.as_str()) && written_with_a_base(&file, key) => {
                    bail!(
                        "--config {}: {key} = {value}: write the octal mode as a string, {key} = \"660\"",
                        path.display()
                    )
                }
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Float(x) => x.to_string(),
                toml::Value::Boolean(on) if !takes_value => {
                    if *on {
                        flags.push(OsString::from(format!("--{key}")));
                    }
                    continue;
                }
                other => bail!("--config {}: {key} = {other}: not a value this flag takes", path.display()),
            };
            if !takes_value {
                bail!("--config {}: {key} is a switch: write {key} = true", path.display());
            }
            flags.push(OsString::from(format!("--{key}={text}")));
        }
    }
    Ok(flags)
}
