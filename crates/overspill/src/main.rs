//! The `overspill` command: parses arguments and wires the engine to the NBD server. No storage
//! or protocol logic lives here.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use overspill::{image, libvirt_hook, libvirt_reboots, plan, replay, serve, stat, storm, vm};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(name = "overspill", version, long_version = overspill::LONG_VERSION, about = "RAM write cache with overflow to disk for fleets of VMs, over NBD")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter (tracing's env-filter syntax, e.g. warn or overspill=debug). Wins over
    /// RUST_LOG, which is used when this is not given. Default: info for serve, warn for the
    /// others (storm's output is its tables).
    #[arg(long, global = true)]
    log: Option<String>,
    /// Only says whether a server keeping its VMs as this says may restart in place into this
    /// program with the rest of the command line (see `answer_reload_check`): for the server.
    #[arg(long, global = true, hide = true, value_name = "RUNNING")]
    reload_check: Option<String>,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true)]
    log_json: bool,
}

// Parsed once at start: the size of the largest set of flags costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve golden images over NBD, one copy-on-write overlay per connection (VM).
    Serve(serve::ServeArgs),
    /// Boot, log on and run many VMs at once and print the seeds' IOPS tables, per phase, tier
    /// and write-cache mode. With no arguments: 20 Windows 7 VDI VMs, all four modes.
    Storm(storm::StormArgs),
    /// Live view of a server's metrics: IOPS per tier and VM, cache memory and disk use.
    Stat(stat::StatArgs),
    /// Replay recorded traces against any NBD server.
    Replay(replay::ReplayArgs),
    /// Size RAM from recorded traces: storage figures per RAM size, replayed through the engine
    /// alone, with a lower bound and boot-time estimates.
    Plan(plan::PlanArgs),
    /// Golden images with versions: list, publish, choose the one new VMs get.
    Image(image::ImageArgs),
    /// A running server's named VMs: list them, reset or drop one (through its control socket).
    Vm(vm::VmArgs),
    /// libvirt's qemu hook (install as /etc/libvirt/hooks/qemu.d/overspill): refuses migrations
    /// and restores that would run a guest on golden data, and starts every power-on of a domain
    /// from the golden image.
    LibvirtHook(libvirt_hook::LibvirtHookArgs),
    /// Starts libvirt domains with overspill disks again after their guest rebooted under
    /// `<on_reboot>destroy</on_reboot>`, so that every boot begins from the golden image (a
    /// service beside libvirtd).
    LibvirtReboots(libvirt_reboots::LibvirtRebootsArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) to standard output.
    Completions { shell: clap_complete::Shell },
    /// Print a manual page (roff) to standard output: `overspill man > overspill.1`, `overspill
    /// man serve > overspill-serve.1`.
    Man {
        /// A subcommand's page instead of the command's.
        subcommand: Option<String>,
    },
}

/// The command line, with `serve --config FILE`'s flags put in before the command line's own.
fn parse_cli() -> anyhow::Result<Cli> {
    use clap::{CommandFactory, FromArgMatches};
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let mut command = Cli::command();
    // Built, so that each flag says how many values it takes.
    command.build();
    let matches = match command.clone().try_get_matches_from(&args) {
        Ok(matches) => matches,
        // Help and version are printed as asked; errors go out as every fatal error does (a
        // JSON line under --log-json).
        Err(error) if !error.use_stderr() => error.exit(),
        Err(error) => return Err(error.into()),
    };
    if let Some(("serve", serve)) = matches.subcommand() {
        if let Some(path) = serve.get_one::<std::path::PathBuf>("config") {
            let definition = command.find_subcommand("serve").expect("serve is a subcommand");
            let flags = overspill::config::flags_from_file(path, definition, serve)?;
            let at = args.iter().position(|a| a == "serve").expect("serve was parsed") + 1;
            args.splice(at..at, flags);
            return Ok(Cli::try_parse_from(&args)?);
        }
    }
    Ok(Cli::from_arg_matches(&matches)?)
}

/// `--reload-check RUNNING`: says whether a server keeping its VMs where RUNNING says (JSON of
/// [`serve::RunningPlaces`]) may restart in place into this program with `command` (serve's
/// command line and configuration file as they are now): exit status 0 if so, else 1 and why
/// on stdout. A running server asks the program its restart would run, so that a new release
/// judges its own flags (one that does not know `--reload-check` refuses it without serving).
fn answer_reload_check(running: &str, command: Command) -> ExitCode {
    let refused = match (serde_json::from_str::<serve::RunningPlaces>(running), command) {
        (Err(error), _) => Some(format!("--reload-check does not parse: {error}")),
        (Ok(running), Command::Serve(next)) => serve::reload_refused(&next, &running),
        (Ok(_), _) => Some("the command line is no longer `serve`".to_owned()),
    };
    match refused {
        Some(why) => {
            println!("{why}");
            ExitCode::FAILURE
        }
        None => ExitCode::SUCCESS,
    }
}

/// The running server's reload check: asks `executable` (what a restart in place runs) with
/// this process's command line.
fn reload_check_by(executable: std::path::PathBuf) -> serve::ReloadCheck {
    Box::new(move |running| {
        let running = match serde_json::to_string(running) {
            Ok(running) => running,
            Err(error) => return Some(format!("the running server's places: {error}")),
        };
        let asked = std::process::Command::new(&executable)
            .args(
                [std::ffi::OsString::from("--reload-check"), running.into()]
                    .into_iter()
                    .chain(std::env::args_os().skip(1)),
            )
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .env_remove("LISTEN_FDNAMES")
            .env_remove("NOTIFY_SOCKET")
            .stdin(std::process::Stdio::null())
            .output();
        match asked {
            Err(error) => Some(format!("{} could not be run: {error}", executable.display())),
            Ok(out) if out.status.success() => None,
            Ok(out) => {
                let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
                let said = said.trim();
                Some(if said.is_empty() {
                    format!("{} answered the reload check with {}", executable.display(), out.status)
                } else {
                    said.to_owned()
                })
            }
        }
    })
}

/// The error that ends the process, on standard error: a JSON line shaped as the log's are
/// (`--log-json`: a collector that parses every line must not meet plain text, last of all in
/// the line that says why the server stopped), or `overspill: MESSAGE`.
fn fatal(json: bool, message: &str) {
    if json {
        let line = serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "ERROR",
            "fields": { "message": message },
            "target": "overspill",
        });
        eprintln!("{line}");
    } else {
        eprintln!("overspill: {message}");
    }
}

fn main() -> ExitCode {
    let executable = started_as();
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(error) => {
            fatal(std::env::args_os().any(|arg| arg == "--log-json"), &one_line(&error));
            return ExitCode::from(2);
        }
    };
    if let Some(running) = &cli.reload_check {
        return answer_reload_check(running, cli.command);
    }
    let json = cli.log_json;
    let default_level = match cli.command {
        Command::Serve(_) | Command::LibvirtReboots(_) => "info",
        Command::Storm(_)
        | Command::Stat(_)
        | Command::Replay(_)
        | Command::Plan(_)
        | Command::Image(_)
        | Command::Vm(_)
        | Command::LibvirtHook(_)
        | Command::Completions { .. }
        | Command::Man { .. } => "warn",
    };
    let filter = match (&cli.log, std::env::var("RUST_LOG")) {
        (Some(flag), _) => EnvFilter::try_new(flag),
        (None, Ok(env)) if !env.is_empty() => EnvFilter::try_new(env),
        _ => EnvFilter::try_new(default_level),
    };
    let filter = match filter {
        Ok(filter) => filter,
        Err(error) => {
            fatal(json, &format!("log filter: {error}"));
            return ExitCode::from(2);
        }
    };
    // Colour codes only for a terminal: a log file or journald gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // Log lines go through a bounded queue to a thread of their own, which drops what it cannot
    // write: a stalled or dead reader of stderr (`serve | tee log`, tee killed) must not block
    // a VM's requests or panic the thread that logs. 16,384 lines, not the crate's 128,000: a
    // queue that clients can fill faster than journald drains it is memory they spend.
    let (writer, flush_at_exit) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(16_384)
        .lossy(true)
        .finish(ErrorlessStderr);
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi)
        .log_internal_errors(false);
    if cli.log_json {
        logs.json().init();
    } else {
        logs.init();
    }
    if matches!(
        cli.command,
        Command::Image(_) | Command::Stat(_) | Command::Plan(_) | Command::Completions { .. } | Command::Man { .. }
    ) {
        end_quietly_on_a_closed_pipe();
    }
    let result = match cli.command {
        Command::Serve(args) => match serve::run(args, reload_check_by(executable.clone())) {
            Ok(serve::ServeEnd::Restart(listener)) => {
                // The log lines queued before it come first.
                drop(flush_at_exit);
                let error = restart_in_place(&executable, listener);
                fatal(json, &format!("restarting in place: {error}"));
                return ExitCode::FAILURE;
            }
            other => other.map(|_| ()),
        },
        Command::Storm(args) => storm::run(args),
        Command::Stat(args) => stat::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Image(args) => image::run(args),
        Command::Vm(args) => vm::run(args),
        Command::LibvirtHook(args) => libvirt_hook::run(args),
        Command::LibvirtReboots(args) => libvirt_reboots::run(args),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "overspill", &mut std::io::stdout());
            Ok(())
        }
        Command::Man { subcommand } => match man_page(subcommand) {
            Some(result) => result,
            None => return ExitCode::from(2),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // The log lines queued before it come first.
            drop(flush_at_exit);
            fatal(json, &one_line(&error));
            ExitCode::FAILURE
        }
    }
}

/// Writes the man page of the command or of one subcommand; `None` for a subcommand that does
/// not exist (said on stderr).
fn man_page(subcommand: Option<String>) -> Option<anyhow::Result<()>> {
    use clap::CommandFactory;
    let mut command = Cli::command();
    command.build();
    let page = match &subcommand {
        None => clap_mangen::Man::new(command),
        Some(name) => match command.find_subcommand(name) {
            Some(sub) => clap_mangen::Man::new(sub.clone())
                .title(format!("overspill-{name}"))
                .source(format!("overspill {}", env!("CARGO_PKG_VERSION"))),
            None => {
                eprintln!("overspill: no subcommand {name:?}");
                return None;
            }
        },
    };
    let mut roff = Vec::new();
    let rendered = (|| {
        page.render_title(&mut roff)?;
        page.render_name_section(&mut roff)?;
        page.render_synopsis_section(&mut roff)?;
        page.render_description_section(&mut roff)?;
        page.render_options_section(&mut roff)?;
        if page_has_subcommands(&subcommand) {
            page.render_subcommands_section(&mut roff)?;
        }
        roff.extend_from_slice(overspill::manual::extra_sections(subcommand.as_deref()).as_bytes());
        // Subcommands carry no version of their own (clap_mangen would panic): theirs is in the
        // page's footer (`source`).
        match subcommand {
            None => page.render_version_section(&mut roff),
            Some(_) => Ok(()),
        }
    })();
    Some(match rendered.and_then(|()| std::io::Write::write_all(&mut std::io::stdout(), &roff)) {
        // `overspill man | head`: the reader had what it wanted.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.map_err(anyhow::Error::from),
    })
}

/// Whether the page's command has subcommands of its own (`image`, `vm`), listed on its page.
fn page_has_subcommands(subcommand: &Option<String>) -> bool {
    use clap::CommandFactory;
    let command = Cli::command();
    match subcommand {
        None => true,
        Some(name) => command.find_subcommand(name).is_some_and(|sub| sub.get_subcommands().next().is_some()),
    }
}

/// The path this program was started by, for a restart in place to run what is at that path
/// then: the new release after an upgrade. Symbolic links are kept (a link flipped to a new
/// version's directory, `update-alternatives`, a Nix profile): the resolved file is the old
/// release, or gone. A bare name is looked up in `PATH` now, as the shell did; a name that finds
/// nothing (`exec -a`) falls back to the file running, resolved.
fn started_as() -> std::path::PathBuf {
    use std::path::{Path, PathBuf};
    let running = || std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
    let Some(name) = std::env::args_os().next().map(PathBuf::from) else {
        return running();
    };
    let candidates: Vec<PathBuf> = if name.components().count() > 1 {
        // Relative to where it was started: the server may not stay there.
        vec![std::env::current_dir().map(|cwd| cwd.join(&name)).unwrap_or(name)]
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path).filter(|dir| dir.is_absolute()).map(|dir| dir.join(&name)).collect()
    };
    let is_program = |path: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    candidates.into_iter().find(|path| is_program(path)).unwrap_or_else(running)
}

/// Becomes the program at `executable` with this process's arguments: same pid, so systemd
/// and the VMs' ledger see the same server. A listening socket systemd passed goes along as
/// fd 3 (`LISTEN_FDS=1`, `LISTEN_PID` this pid). Returns only if the exec failed.
fn restart_in_place(executable: &std::path::Path, listener: Option<std::os::fd::OwnedFd>) -> std::io::Error {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new(executable);
    command.args(std::env::args_os().skip(1));
    command.env_remove("LISTEN_FDS").env_remove("LISTEN_PID").env_remove("LISTEN_FDNAMES");
    if let Some(listener) = listener {
        command.env("LISTEN_FDS", "1").env("LISTEN_PID", std::process::id().to_string());
        let fd = listener.as_raw_fd();
        // The descriptor must outlive this function until exec: leaked on purpose.
        std::mem::forget(listener);
        // SAFETY: runs in this process just before exec (no fork: CommandExt::exec), and calls
        // only dup2 and fcntl, which touch no memory. `fd` stays open (forgotten above). Should
        // another thread hold a descriptor 3, it is replaced an instant before exec ends every
        // thread; if exec fails the process exits. dup2 gives fd 3 without FD_CLOEXEC; if the
        // socket is fd 3 already, the flag is cleared instead.
        unsafe {
            command.pre_exec(move || {
                if fd == 3 {
                    if libc::fcntl(3, libc::F_SETFD, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 3) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    // A reload asked for while the new program starts would end the process (SIGHUP's default
    // action): ignored instead, which exec keeps, until the new program's handler takes over (any
    // version's: a blocked mask would stay blocked under a binary that never unblocks it). A
    // SIGTERM in that moment ends the process, as the stop it asks for: every VM is handed over.
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: SIG_IGN installs no handler code, so nothing can run in a signal context; the old
    // handler's state (signal-hook's) is no longer used, since this thread's next step is exec.
    let ignored = unsafe { signal(Signal::SIGHUP, SigHandler::SigIgn) };
    if let Err(error) = ignored {
        eprintln!("overspill: could not ignore SIGHUP across the restart: {error}");
    }
    command.exec()
}

/// A command that only prints (`overspill image list | head -1`) ends quietly when its reader
/// goes, as other tools do: Rust ignores SIGPIPE, and `println!` then panicked. Not for the
/// commands that write sockets (a peer gone is an error they report).
fn end_quietly_on_a_closed_pipe() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: SIG_DFL installs no handler code, so nothing runs in a signal context; the
    // commands that take this write no socket that relies on SIGPIPE being ignored.
    if let Err(error) = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) } {
        tracing::debug!(%error, "SIGPIPE's default action could not be restored");
    }
}

/// An error and its causes on one line, each cause once: many error types print their source
/// in their own message too, and an operator should not read the same cause three times.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

/// Standard error that reports every write as done: a log line that cannot be written is lost,
/// and nothing else happens (the queue in front of it would otherwise print about it to the same
/// broken stream).
struct ErrorlessStderr;

impl std::io::Write for ErrorlessStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
