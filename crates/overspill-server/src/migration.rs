//! Moving a running VM's overlay to another server (live migration), over a link between peer
//! servers.
//!
//! NBD has no handover points: QEMU's destination connects at its start (`-incoming`), long
//! before the guest runs there, and the source's connection ends when libvirt stops it, which
//! may be before or after the destination's first request. So the switchover is found here:
//!
//! 1. A connection for a named VM this server does not hold asks every peer; one that holds it
//!    live sends it (`Take`). The receiving end makes an overlay over the very image version
//!    the VM runs on (or refuses it) and serves the connection's handshake; its requests wait.
//! 2. Pre-copy: the sending end sends every block that is not the golden image's, then, round
//!    after round, the blocks the VM changed meanwhile, for as long as the move lasts.
//! 3. Switchover, at whichever comes first: the receiving end's first request (its guest runs,
//!    so QEMU has stopped the source's), or the clean end (NBD_CMD_DISC) of the sending end's
//!    connection, which QEMU sends as it quits (a lost one may be the source's guest about to
//!    reconnect: it hands nothing over). The sender takes the VM's lock and keeps it (the
//!    fence: the source's requests wait), sends the last changes, and the receiver records that it holds the whole state ("in doubt") and says
//!    `Ready`. The sender records "moved to peer" in its ledger, says `Committed`, and gives
//!    up its copy: its connection fails its requests and closes. The receiver records the VM
//!    as its own and serves it.
//!
//! Exactly one server accepts the VM's writes at any moment: the sender until its ledger says
//! moved (its requests wait from the fence on), the receiver only after `Committed`. A move
//! given up before `Ready` (the receiver's connection ended, the link dropped, a peer died)
//! leaves the VM where it was; one given up after it leaves the receiver not knowing, and it
//! asks the sender; a sender that cannot be asked makes the name lost here (refused until
//! `vm reset`), never golden data. The peer link is a Unix socket on one host and TLS over TCP
//! between hosts, where each end proves itself with a certificate of the fleet's CA and is
//! known by its common name (`overspill_net::peer_tls`).
//!
//! The link itself, its messages and its ends are in `migration/link.rs`.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use overspill_engine::{MovedRun, BLOCK_BYTES};
use overspill_net::{ListenAddr, PeerTls};

use crate::live::{Gate, Live};

mod link;
mod listener;
use crate::vms::{Asker, Ending, Holding, MoveProgress, Offer, Outgoing, VmRegistry};
use link::*;
pub use listener::{listen, PeerListener};

/// Data blocks per message: 2 MiB, a spill segment's worth.
const RUN_BLOCKS: u64 = 512;
/// How long a peer may take to answer a question (a query, an offer).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the switchover may take at either end (the sender's VM fenced meanwhile).
const SWITCH_TIMEOUT: Duration = Duration::from_secs(15);
/// How often an idle move looks for changes, and a receiver for its first request.
const POLL: Duration = Duration::from_millis(5);
/// How long a receiver whose move failed before the switchover (the link dropped, the sender
/// died and restarts) tries it again from scratch, while its connection lives.
const RETRY_FOR: Duration = Duration::from_secs(30);
/// How long a receiver's read before the switchover tries to reach the sender again.
const READ_RETRY_FOR: Duration = Duration::from_secs(5);
/// How long a receiver in doubt keeps asking the sender how the move ended.
const IN_DOUBT_ASKING: Duration = Duration::from_secs(20);

/// This server's peers: the servers it may take VMs from, and its own name among them.
#[derive(Debug, Clone)]
pub struct Peers {
    /// How this server is named to its peers: its certificate's common name with TLS, else its
    /// peer socket's absolute path.
    pub name: String,
    pub addresses: Vec<ListenAddr>,
    /// This server's credentials, for `tcp:` peers (which are refused without).
    pub tls: Option<Arc<PeerTls>>,
}

/// Where a VM that connects here is, as its peers say.
pub enum Located {
    /// No peer holds it.
    Nowhere,
    /// This peer holds it live: it is to be taken from there.
    Live(ListenAddr),
    /// A peer refuses it, or cannot be asked: so is it here.
    Refused(String),
}

impl Peers {
    /// Asks every peer whether it holds VM `vm`; `held_here`: this server holds it (in grace).
    pub fn locate(&self, vm: &str, held_here: bool) -> Located {
        // The peers' names as they said hello, and the servers peers say they moved it to.
        let mut names = Vec::new();
        let mut moved_elsewhere = Vec::new();
        for address in &self.addresses {
            let answer = query(address, self, vm).map(|(name, holding)| {
                names.push(name);
                holding
            });
            match answer {
                Ok(Holding::Live) => return Located::Live(address.clone()),
                Ok(Holding::Moving) => {
                    return Located::Refused(format!(
                        "VM {vm} is moving from peer {} to another server; try again",
                        address
                    ))
                }
                // Handed here, and this server has nothing of it (it was lost with a crash):
                // never a fresh VM in its place.
                Ok(Holding::Moved { to }) if to == self.name && !held_here => {
                    return Located::Refused(format!(
                        "VM {vm} was moved here from peer {}, and this server holds nothing of it",
                        address
                    ))
                }
                // Handed here, and here it is.
                Ok(Holding::Moved { to }) if to == self.name => {}
                // Asked for at that server, if it is a peer of this one (below).
                Ok(Holding::Moved { to }) => moved_elsewhere.push((address, to)),
                Ok(Holding::Lost { why }) => {
                    return Located::Refused(format!(
                        "peer {} lost VM {vm}'s writes ({why}); run `overspill vm reset {vm}` there",
                        address
                    ))
                }
                Ok(Holding::Nothing) => {}
                // A VM this server holds (in grace: its client reconnecting) is no other
                // server's: a peer takes it only from here, in a move this server would know of.
                // One peer down must not refuse every reconnect of the fleet.
                Err(error) if held_here => {
                    tracing::debug!(vm, peer = %address, %error, "a peer cannot be asked; the VM is held here");
                }
                Err(error) => {
                    return Located::Refused(format!(
                        "peer {} cannot be asked whether VM {vm} runs there ({error}); if that server is gone \
                         for good, take it out of --peer",
                        address
                    ))
                }
            }
        }
        // Moved somewhere no peer of this server is (each answer counts: an old "moved to B" at
        // one peer must not hide B's "moved to Y"): it cannot be asked for there.
        match moved_elsewhere.into_iter().find(|(_, to)| !names.contains(to)) {
            Some((address, to)) => Located::Refused(format!(
                "VM {vm} was moved from peer {address} to {to}, which is not a peer of this server"
            )),
            None => Located::Nowhere,
        }
    }
}

/// Tells the peer at `address`, which moved VM `vm` here, that the move is settled: its record
/// of where it sent the VM goes (while it stands, a VM of that name is refused everywhere once
/// it ends here). Best effort: a peer that cannot be told keeps it, as before.
pub(crate) fn tell_settled(peers: &Peers, address: &ListenAddr, vm: &str) {
    let told =
        Link::connect(address, peers).and_then(|mut link| match link.ask(&Message::Settled { vm: vm.to_owned() })? {
            Message::Accept => Ok(()),
            other => Err(unexpected(&other)),
        });
    if let Err(error) = told {
        tracing::info!(vm, peer = %address, %error, "could not tell the peer the VM's move is settled");
    }
}

/// Why a VM cannot start afresh while a peer holds it.
#[derive(Debug)]
pub struct HeldAtPeer(pub String);

impl Peers {
    /// Ends VM `vm`'s overlay at every peer that holds it and has no connection for it (the VM's
    /// last run there, in grace): a fresh start of the VM here, as the libvirt hook's, would
    /// otherwise take that copy and boot into the last session's writes. Refused, naming the
    /// peer, where the VM is connected or moving, or where a peer cannot say it holds nothing.
    pub fn reset_everywhere(&self, vm: &str) -> Result<(), HeldAtPeer> {
        for address in &self.addresses {
            let cannot_ask = |error: &dyn std::fmt::Display| {
                HeldAtPeer(format!(
                    "peer {address} cannot be asked whether it holds VM {vm} ({error}); if that server is \
                     gone for good, take it out of --peer"
                ))
            };
            let mut link = Link::connect(address, self).map_err(|error| cannot_ask(&error))?;
            match link.ask(&Message::Reset { vm: vm.to_owned() }) {
                Ok(Message::Accept) => {}
                Ok(Message::Refuse { why }) => return Err(HeldAtPeer(format!("peer {address} keeps VM {vm}: {why}"))),
                // Reached, and no answer: a peer of an earlier release, which knows no reset, is
                // fine if it holds nothing live. (One that cannot be reached is not asked twice.)
                other => match query(address, self, vm) {
                    Ok((_, Holding::Nothing | Holding::Moved { .. })) => {}
                    Ok((_, holding)) => {
                        let why =
                            other.map_or_else(|error| error.to_string(), |answer| unexpected(&answer).to_string());
                        return Err(HeldAtPeer(format!(
                            "peer {address} holds VM {vm} ({holding:?}) and cannot be asked to end it ({why}); run \
                             `overspill vm reset {vm}` there"
                        )));
                    }
                    Err(error) => return Err(cannot_ask(&error)),
                },
            }
        }
        Ok(())
    }
}

/// How a server records a peer's address (in its ledger): as `unix:PATH` or `tcp:HOST:PORT`, or,
/// before tcp: peers, as a bare socket path.
pub(crate) fn recorded_address(recorded: &str) -> ListenAddr {
    recorded.parse().unwrap_or_else(|_| ListenAddr::Unix(recorded.into()))
}

/// Whose copy of VM `vm` is the VM's, for a server that recovered it in doubt from `address`:
/// `Ok(true)` this server's (the peer's ledger says moved here), `Ok(false)` the peer's (it holds
/// it live, or moved it elsewhere since), `Err` why nobody can tell.
pub(crate) fn settle_in_doubt(peers: Option<&Peers>, address: &ListenAddr, vm: &str) -> Result<bool, String> {
    let shown = address;
    let Some(peers) = peers else {
        return Err(format!("this server has no peers to ask peer {shown} with"));
    };
    // "Moving": between this server's `Ready` and the peer's commit (a moment, unless the peer
    // is held up), or moving the VM on to another server. Asked again, as the live path asks;
    // still moving when time is up, it is the peer's to move.
    let until = Instant::now() + IN_DOUBT_ASKING;
    let holding = loop {
        let answer = query(address, peers, vm).map(|(_, holding)| holding);
        if !matches!(answer, Ok(Holding::Moving)) || Instant::now() >= until {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    match holding {
        Ok(Holding::Moved { to }) => Ok(to == peers.name),
        Ok(Holding::Live) => Ok(false),
        // Still between this server's `Ready` and the peer's commit (or moving it on): the
        // peer may yet commit to this server, whose copy is then the only one. Kept and
        // refused, never dropped on a guess (the VM's writes were lost everywhere when it was).
        Ok(Holding::Moving) => Err(format!(
            "peer {shown} was still moving it after {} s (if it moved it here after all, this copy is the VM's: \
             its files are kept, the name refused)",
            IN_DOUBT_ASKING.as_secs()
        )),
        Ok(Holding::Nothing) => Err(format!("peer {shown} keeps no record of it")),
        Ok(Holding::Lost { why }) => Err(format!("peer {shown} lost it ({why})")),
        Err(error) => Err(format!("peer {shown} cannot be asked ({error})")),
    }
}

/// Asks the peer at `address` what it holds of VM `vm`: its name, and that.
fn query(address: &ListenAddr, peers: &Peers, vm: &str) -> io::Result<(String, Holding)> {
    let mut link = Link::connect(address, peers)?;
    match link.ask(&Message::Query { vm: vm.to_owned() })? {
        Message::Holds { holding } => Ok((std::mem::take(&mut link.peer), holding)),
        other => Err(unexpected(&other)),
    }
}

/// A test's hold on a handover: with `OVERSPILL_TEST_MOVE_PAUSE=STEP` in its environment, a
/// server stops for 3 s (or `OVERSPILL_TEST_MOVE_PAUSE_SECS`) at STEP and says so in its log,
/// so that a test can SIGKILL it at that
/// very moment. Steps: `final` (the sender has sent the last changes and `Final`), `readied`
/// (the sender has the receiver's `Ready`; its ledger does not say moved yet), `committed`
/// (the sender's ledger says moved; the receiver is not told yet), `ready` (the receiver's
/// ledger says in doubt; the sender is not told yet).
fn test_pause(step: &str) {
    static PAUSE_AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if PAUSE_AT.get_or_init(|| std::env::var("OVERSPILL_TEST_MOVE_PAUSE").ok()).as_deref() == Some(step) {
        let seconds = std::env::var("OVERSPILL_TEST_MOVE_PAUSE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
        tracing::warn!(step, seconds, "move paused for a test (OVERSPILL_TEST_MOVE_PAUSE)");
        std::thread::sleep(Duration::from_secs(seconds));
    }
}

fn serve_peer(stream: UnixStream, name: &str, proven: Option<&str>, registry: &Arc<VmRegistry>) -> io::Result<()> {
    let mut link = Link::accept(stream, name, proven)?;
    loop {
        let message = link.receive()?.0;
        // A name no VM can have (a path, say: it becomes a ledger file's) ends the link.
        if let Some(Err(error)) = message.vm().map(|vm| crate::check_name("VM", vm)) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, error.to_string()));
        }
        match message {
            Message::Query { vm } => link.send(&Message::Holds { holding: registry.holding(&vm) }, &[])?,
            Message::Take { vm, image, asker } => return send_vm(link, registry, &vm, &image, asker.as_ref()),
            Message::Settled { vm } => {
                registry.moved_acknowledged_by(&vm, &link.peer);
                link.send(&Message::Accept, &[])?;
            }
            Message::Reset { vm } => {
                let answer = match registry.reset_with(&vm, false) {
                    Ok(done) => {
                        tracing::info!(vm, peer = %link.peer, %done, "VM reset for a fresh start at a peer");
                        Message::Accept
                    }
                    Err(crate::ServerError::NoSuchVm(_)) => Message::Accept,
                    Err(error) => Message::Refuse { why: error.to_string() },
                };
                link.send(&answer, &[])?;
            }
            Message::Read { vm, offset, length } => {
                if u64::from(length) > MAX_PAYLOAD_BYTES {
                    link.send(&Message::ReadFailed { why: format!("a read of {length} bytes") }, &[])?;
                    continue;
                }
                let mut buf = vec![0u8; length as usize];
                match crate::golden_budget::for_a_move(|| registry.read_for_peer(&vm, &link.peer, offset, &mut buf)) {
                    Ok(true) => link.send(&Message::Data, &buf)?,
                    Ok(false) => link.send(&Message::NotHere, &[])?,
                    Err(why) => link.send(&Message::ReadFailed { why }, &[])?,
                }
            }
            Message::Done => {}
            other => return Err(unexpected(&other)),
        }
    }
}

/// Why a sending end's pre-copy stopped.
enum PreCopyEnd {
    SwitchAsked,
    SourceEnded,
    Failed(String),
}

/// The sending end of a move.
fn send_vm(mut link: Link, registry: &Arc<VmRegistry>, vm: &str, image: &str, asker: Option<&Asker>) -> io::Result<()> {
    let peer = link.peer.clone();
    let out = match registry.start_outgoing(vm, image, &peer, asker) {
        Ok(out) => out,
        Err(why) => return link.send(&Message::Refuse { why }, &[]),
    };
    let accepted = link.send(&Message::Offer { offer: out.offer.clone() }, &[]).and_then(|()| link.receive());
    let replies = match accepted {
        Ok((Message::Accept, _)) => link.spawn_reader(),
        Ok((Message::Abort { why }, _)) => Err(io::Error::other(format!("the peer refused it: {why}"))),
        Ok((other, _)) => Err(unexpected(&other)),
        Err(error) => Err(error),
    };
    let outcome = match &replies {
        Ok(replies) => send_vm_to(&mut link, replies, registry, &out),
        Err(error) => Err(format!("offering the VM: {error}")),
    };
    let moved = match outcome {
        Ok(moved) => Some(moved),
        Err(why) => {
            tracing::warn!(vm, peer, why, "move to a peer given up: the VM goes on here");
            let _ = link.send(&Message::Abort { why }, &[]);
            None
        }
    };
    let done = moved.is_some();
    registry.finish_outgoing(out, moved);
    if let (true, Ok(replies)) = (done, replies) {
        // The receiver acknowledges; until then the ledger keeps where the VM went.
        if matches!(replies.recv_timeout(ANSWER_TIMEOUT), Ok(Ok((Message::Done, _)))) {
            registry.moved_acknowledged(vm);
        }
    }
    Ok(())
}

/// Sends the VM; `Ok(overlay)` once the peer holds it (the overlay taken out of the shared
/// slot), `Err` why the move failed.
fn send_vm_to(
    link: &mut Link,
    replies: &Replies,
    registry: &VmRegistry,
    out: &Outgoing,
) -> Result<crate::vm_overlay::VmOverlay, String> {
    let failed = |what: &str, error: io::Error| format!("{what}: {error}");
    if let Some(vm) = out.live.vm().as_mut() {
        vm.overlay.start_moving();
    }
    let end = pre_copy(link, replies, out, registry);
    let source_ended = match end {
        PreCopyEnd::SwitchAsked => false,
        PreCopyEnd::SourceEnded => true,
        PreCopyEnd::Failed(why) => return Err(why),
    };
    // The fence: from here the VM's requests wait for this lock, until it has moved or not.
    let mut fenced = out.live.vm();
    let Some(vm) = fenced.as_mut() else { return Err("the VM's overlay is gone".into()) };
    loop {
        let runs = vm.overlay.take_moved(RUN_BLOCKS).map_err(|e| format!("reading the VM's blocks: {e}"))?;
        if runs.is_empty() {
            break;
        }
        send_runs(link, runs, &out.progress, registry, false, 0).map_err(|e| failed("sending the last changes", e))?;
    }
    let written = registry.has_written(out.number);
    link.send(&Message::Final { source_ended, written }, &[]).map_err(|e| failed("sending the switchover", e))?;
    test_pause("final");
    match replies.recv_timeout(SWITCH_TIMEOUT) {
        Ok(Ok((Message::Ready, _))) => {}
        Ok(Ok((Message::Decline, _))) => return Err("the peer has no guest for it any more".into()),
        Ok(Ok((Message::Abort { why }, _))) => return Err(format!("the peer gave up: {why}")),
        Ok(Ok((other, _))) => return Err(unexpected(&other).to_string()),
        Ok(Err(error)) => return Err(failed("waiting for the peer to be ready", error)),
        Err(_) => return Err("the peer was not ready in time".into()),
    }
    test_pause("readied");
    // The commit point: the ledger says the VM is the peer's before the peer serves it.
    registry.outgoing_committed(out, &link.peer).map_err(|e| failed("recording the move in the ledger", e))?;
    test_pause("committed");
    if let Err(error) = link.send(&Message::Committed, &[]) {
        // The peer asks, and the ledger answers: moved.
        tracing::warn!(vm = out.vm, %error, "could not tell the peer the move is done; it will ask");
    }
    fenced.take().ok_or_else(|| "the VM's overlay is gone".to_owned())
}

/// Rounds of changes until the switchover is asked for or the VM's connection here ends.
fn pre_copy(link: &mut Link, replies: &Replies, out: &Outgoing, registry: &VmRegistry) -> PreCopyEnd {
    let mut idle = false;
    let mut round_open = true;
    loop {
        let message = if idle {
            match replies.recv_timeout(POLL) {
                Ok(message) => Some(message),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return PreCopyEnd::Failed("the peer link closed".into()),
            }
        } else {
            match replies.try_recv() {
                Ok(message) => Some(message),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return PreCopyEnd::Failed("the peer link closed".into()),
            }
        };
        match message {
            None => {}
            Some(Ok((Message::Switch, _))) => return PreCopyEnd::SwitchAsked,
            Some(Ok((Message::Abort { why }, _))) => return PreCopyEnd::Failed(format!("the peer gave up: {why}")),
            Some(Ok((other, _))) => return PreCopyEnd::Failed(unexpected(&other).to_string()),
            Some(Err(error)) => return PreCopyEnd::Failed(format!("the peer link failed: {error}")),
        }
        // Only a clean end (NBD_CMD_DISC: the source QEMU quit, its guest running at the
        // destination) hands the VM over now. A connection lost or cut for idleness may be the
        // source's guest about to reconnect here (a network blip, the migration then cancelled):
        // the move goes on until the destination's first change asks for the switchover, or
        // fails and leaves the VM here for that reconnect.
        if out.live.state().ended == Some(Ending::Deliberate) {
            return PreCopyEnd::SourceEnded;
        }
        let (runs, left) = {
            let mut vm = out.live.vm();
            let Some(vm) = vm.as_mut() else { return PreCopyEnd::Failed("the VM's overlay is gone".into()) };
            match vm.overlay.take_moved(RUN_BLOCKS) {
                Ok(runs) => (runs, vm.overlay.blocks_to_move()),
                Err(error) => return PreCopyEnd::Failed(format!("reading the VM's blocks: {error}")),
            }
        };
        idle = runs.is_empty();
        if idle && !round_open {
            continue;
        }
        // A round ends when nothing is left to send: the receiver counts it.
        let round_done = left == 0;
        if let Err(error) = send_runs(link, runs, &out.progress, registry, round_done, left) {
            return PreCopyEnd::Failed(format!("sending to the peer: {error}"));
        }
        round_open = !round_done;
        if round_done && out.had_no_connection() {
            // No connection here changes it: one round sent it all, unfenced, and the final
            // delta is empty.
            return PreCopyEnd::SourceEnded;
        }
    }
}

fn send_runs(
    link: &mut Link,
    runs: Vec<MovedRun>,
    progress: &MoveProgress,
    registry: &VmRegistry,
    round_done: bool,
    blocks_left: u64,
) -> io::Result<()> {
    let (runs, payload) = encode_runs(runs);
    link.send(&Message::Runs { runs, round_done, blocks_left }, &payload)?;
    progress.bytes.fetch_add(payload.len() as u64, Ordering::Relaxed);
    progress.blocks_left.store(blocks_left, Ordering::Relaxed);
    let counters = registry.move_counters();
    counters.bytes_sent.fetch_add(payload.len() as u64, Ordering::Relaxed);
    if round_done {
        progress.rounds.fetch_add(1, Ordering::Relaxed);
        counters.rounds.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// The receiving end of a move, from the peer's offer on.
pub(crate) struct Incoming {
    pub(crate) number: u64,
    pub(crate) live: Arc<Live>,
    pub(crate) progress: Arc<MoveProgress>,
    pub(crate) registry: Arc<VmRegistry>,
    pub(crate) peers: Peers,
    pub(crate) peer: ListenAddr,
    pub(crate) vm: String,
    /// The image name the VM's connection asked for, and the offer first taken: a move tried
    /// again must be of the same image version and disk.
    pub(crate) image: String,
    pub(crate) offer: Offer,
}

/// Asks peer `address` to send VM `vm` (over image `image`) for a connection of client
/// `identity`: its offer, and the link to take it on.
pub(crate) fn ask_for(
    peers: &Peers,
    address: &ListenAddr,
    vm: &str,
    image: &str,
    identity: Option<&str>,
) -> Result<(Offer, PeerLink), String> {
    let shown = address;
    let mut link = Link::connect(address, peers).map_err(|e| format!("peer {shown}: {e}"))?;
    let asker = Some(Asker { identity: identity.map(str::to_owned) });
    link.send(&Message::Take { vm: vm.to_owned(), image: image.to_owned(), asker }, &[])
        .map_err(|e| format!("peer {shown}: {e}"))?;
    match link.receive().map_err(|e| format!("peer {shown}: {e}"))?.0 {
        Message::Offer { offer } => Ok((offer, PeerLink(link))),
        Message::Refuse { why } => Err(format!("peer {shown} does not send it: {why}")),
        other => Err(format!("peer {shown}: {}", unexpected(&other))),
    }
}

/// Reads of a VM moving here, at the peer that sends it, until the switchover.
pub(crate) struct ReadAtSender {
    peers: Peers,
    address: ListenAddr,
    vm: String,
    link: std::sync::Mutex<Option<Link>>,
}

impl ReadAtSender {
    pub(crate) fn new(peers: &Peers, address: &ListenAddr, vm: &str) -> Self {
        Self { peers: peers.clone(), address: address.clone(), vm: vm.to_owned(), link: Default::default() }
    }
}

impl crate::live::ReadElsewhere for ReadAtSender {
    /// A link that fails is made again for [`READ_RETRY_FOR`]; after that the read waits at the
    /// gate like a change (the move, tried again, makes the state here current or fails).
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<bool, String> {
        let until = Instant::now() + READ_RETRY_FOR;
        loop {
            match self.read_there(offset, buf) {
                Ok(answer) => return answer,
                Err(error) => {
                    *self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
                    if Instant::now() >= until {
                        tracing::warn!(vm = self.vm, peer = %self.address, %error, "the VM's reads wait for its move");
                        return Ok(false);
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

impl ReadAtSender {
    /// The sender's answer (`Err` inside: the read failed there, as it would have for the VM),
    /// or why the link failed.
    fn read_there(&self, offset: u64, buf: &mut [u8]) -> io::Result<Result<bool, String>> {
        let mut link = self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if link.is_none() {
            let connected = Link::connect(&self.address, &self.peers)?;
            // The sender's fence may hold a read for its whole switchover.
            connected.stream.set_read_timeout(Some(SWITCH_TIMEOUT + ANSWER_TIMEOUT))?;
            *link = Some(connected);
        }
        let Some(connected) = link.as_mut() else { return Err(io::Error::other("no link")) };
        let length = u32::try_from(buf.len()).map_err(io::Error::other)?;
        connected.send(&Message::Read { vm: self.vm.clone(), offset, length }, &[])?;
        Ok(match connected.receive()? {
            (Message::Data, payload) if payload.len() == buf.len() => {
                buf.copy_from_slice(&payload);
                Ok(true)
            }
            (Message::NotHere, _) => Ok(false),
            (Message::ReadFailed { why }, _) => Err(format!("the read failed at peer {}: {why}", self.address)),
            (other, _) => return Err(unexpected(&other)),
        })
    }
}

/// A link on which a peer offered a VM.
pub(crate) struct PeerLink(Link);

impl PeerLink {
    /// Declines the offer.
    pub(crate) fn refuse(mut self, why: &str) {
        let _ = self.0.send(&Message::Abort { why: why.to_owned() }, &[]);
    }
}

impl Incoming {
    /// Accepts the offer and takes the VM in, in a thread of its own; the connection's requests
    /// wait at its gate meanwhile.
    pub(crate) fn start(self, link: PeerLink) -> io::Result<()> {
        let mut link = link.0;
        link.send(&Message::Accept, &[])?;
        let replies = link.spawn_reader()?;
        std::thread::Builder::new().name("vm-incoming".into()).spawn(move || self.run(link, replies))?;
        Ok(())
    }

    /// Takes the VM in; a move that fails before the switchover is tried again from scratch
    /// (the sender's copy is still the VM's) for [`RETRY_FOR`], while the connection here lives.
    fn run(self, mut link: Link, mut replies: Replies) {
        let mut retrying_until: Option<Instant> = None;
        loop {
            let outcome = self.take_in(&mut link, &replies);
            let Outcome::Failed(why) = &outcome else { return self.settle(outcome, &mut link) };
            if self.live.state().ended.is_some() {
                return self.settle(outcome, &mut link);
            }
            let _ = link.send(&Message::Abort { why: why.clone() }, &[]);
            let until = *retrying_until.get_or_insert_with(|| Instant::now() + RETRY_FOR);
            tracing::warn!(vm = self.vm, peer = %self.peer, why, "VM move from a peer failed before the switchover: trying it again");
            match self.again(until) {
                Some((next_link, next_replies)) => (link, replies) = (next_link, next_replies),
                None => return self.settle(outcome, &mut link),
            }
        }
    }

    /// Asks the peer for the VM again until `until`, while the connection here lives: the copy
    /// here starts over (every block back to the golden image) and a new link takes it in.
    fn again(&self, until: Instant) -> Option<(Link, Replies)> {
        while Instant::now() < until && self.live.state().ended.is_none() {
            std::thread::sleep(Duration::from_millis(300));
            // The connection here was let in as the VM's owner, if it has one.
            let asking = self.offer.owner.as_deref();
            let Ok((offer, link)) = ask_for(&self.peers, &self.peer, &self.vm, &self.image, asking) else { continue };
            if offer.image_label != self.offer.image_label || offer.disk_bytes != self.offer.disk_bytes {
                link.refuse("the VM's image changed since its move began");
                return None;
            }
            // A VM of that name made since by another client identity (or forked since) is not
            // the one this connection was let in for.
            if offer.owner != self.offer.owner || offer.fork != self.offer.fork {
                link.refuse("the VM's owner or fork pin changed since its move began");
                return None;
            }
            let digests_differ =
                matches!((&offer.image_digest, &self.offer.image_digest), (Some(now), Some(then)) if now != then);
            if offer.image_identity != self.offer.image_identity || digests_differ {
                link.refuse("the VM's image changed since its move began");
                return None;
            }
            {
                let mut vm = self.live.vm();
                let vm = vm.as_mut()?;
                let blocks = vm.overlay.size().div_ceil(BLOCK_BYTES);
                vm.overlay.apply_moved(&MovedRun::Golden { first: 0, end: blocks }).ok()?;
            }
            self.progress.bytes.store(0, Ordering::Relaxed);
            self.progress.rounds.store(0, Ordering::Relaxed);
            let mut link = link.0;
            link.send(&Message::Accept, &[]).ok()?;
            let replies = link.spawn_reader().ok()?;
            tracing::info!(vm = self.vm, peer = %self.peer, "VM move from a peer begins again");
            return Some((link, replies));
        }
        None
    }

    fn take_in(&self, link: &mut Link, replies: &Replies) -> Outcome {
        let mut switch_asked: Option<Instant> = None;
        // Once the switchover is asked for, the sender sends its last changes and `Final`: a
        // sender that goes quiet meanwhile (stopped, its link still open) fails the move, which
        // leaves the VM with it, rather than holding the VM's requests here for ever.
        let mut last_heard = Instant::now();
        let written = loop {
            match replies.recv_timeout(POLL) {
                Ok(Ok((Message::Runs { runs, round_done, blocks_left }, payload))) => {
                    last_heard = Instant::now();
                    if let Err(error) = self.apply(runs, &payload, round_done, blocks_left) {
                        return Outcome::Failed(format!("applying what the peer sent: {error}"));
                    }
                }
                Ok(Ok((Message::Final { written, .. }, _))) => break written,
                Ok(Ok((Message::Abort { why }, _))) => return Outcome::Failed(format!("the peer gave up: {why}")),
                Ok(Ok((other, _))) => return Outcome::Failed(unexpected(&other).to_string()),
                Ok(Err(error)) => return Outcome::Failed(format!("the peer link failed: {error}")),
                Err(RecvTimeoutError::Disconnected) => return Outcome::Failed("the peer link closed".into()),
                Err(RecvTimeoutError::Timeout) => {}
            }
            let (ended, wanted) = {
                let state = self.live.state();
                (state.ended.is_some(), state.switch_wanted)
            };
            if ended {
                return Outcome::Failed("the VM's connection here ended before the switchover".into());
            }
            if wanted && switch_asked.is_none() {
                switch_asked = Some(Instant::now());
                last_heard = Instant::now();
                if let Err(error) = link.send(&Message::Switch, &[]) {
                    return Outcome::Failed(format!("asking the peer to switch over: {error}"));
                }
            }
            if switch_asked.is_some() && last_heard.elapsed() > SWITCH_TIMEOUT {
                return Outcome::Failed(format!(
                    "the peer sent nothing for {} s after it was asked to switch over",
                    SWITCH_TIMEOUT.as_secs()
                ));
            }
        };
        let started = switch_asked.unwrap_or_else(Instant::now);
        if self.live.state().ended.is_some() {
            let _ = link.send(&Message::Decline, &[]);
            return Outcome::Failed("the VM's connection here ended before the switchover".into());
        }
        if let Err(error) = self.registry.incoming_ready(self.number, written) {
            return Outcome::Failed(format!("recording the VM in the ledger: {error}"));
        }
        test_pause("ready");
        if let Err(error) = link.send(&Message::Ready, &[]) {
            return self.in_doubt(format!("saying ready to the peer: {error}"), started);
        }
        match replies.recv_timeout(SWITCH_TIMEOUT) {
            Ok(Ok((Message::Committed, _))) => Outcome::Moved(started, false),
            Ok(Ok((Message::Abort { why }, _))) => Outcome::Failed(format!("the peer gave up: {why}")),
            Ok(Ok((other, _))) => self.in_doubt(unexpected(&other).to_string(), started),
            Ok(Err(error)) => self.in_doubt(error.to_string(), started),
            Err(_) => self.in_doubt("the peer did not answer".into(), started),
        }
    }

    fn apply(&self, runs: Vec<RunHeader>, payload: &[u8], round_done: bool, blocks_left: u64) -> io::Result<()> {
        let runs = decode_runs(runs, payload)?;
        {
            let mut vm = self.live.vm();
            let vm = vm.as_mut().ok_or_else(|| io::Error::other("the VM's overlay is gone"))?;
            for run in &runs {
                vm.overlay.apply_moved(run).map_err(io::Error::other)?;
            }
        }
        let bytes = payload.len() as u64;
        self.progress.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.progress.blocks_left.store(blocks_left, Ordering::Relaxed);
        self.registry.move_counters().bytes_received.fetch_add(bytes, Ordering::Relaxed);
        if round_done {
            self.progress.rounds.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The link failed after `Ready`: the sender may have committed or not. Asks it, for a while.
    fn in_doubt(&self, why: String, started: Instant) -> Outcome {
        tracing::warn!(vm = self.vm, peer = %self.peer, why, "VM move in doubt: asking the peer how it ended");
        let until = Instant::now() + IN_DOUBT_ASKING;
        while Instant::now() < until {
            match query(&self.peer, &self.peers, &self.vm).map(|(_, holding)| holding) {
                // Its ledger says moved to this server: this copy is the VM's.
                Ok(Holding::Moved { to }) if to == self.peers.name => return Outcome::Moved(started, true),
                // Moved on to another server since it gave this move up: that one's, not ours.
                Ok(Holding::Moved { to }) => return Outcome::Failed(format!("the peer moved the VM to {to}")),
                Ok(Holding::Live) => return Outcome::Failed("the peer kept the VM".into()),
                Ok(Holding::Lost { why }) => return Outcome::Failed(format!("the peer lost the VM: {why}")),
                // Still deciding; or no record (its ledger gone with its host?), which cannot
                // tell a move done from one given up: asked again, and in doubt in the end.
                Ok(Holding::Moving | Holding::Nothing) | Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        Outcome::InDoubt(why)
    }

    /// Makes the outcome so: the VM served here, or its copy here dropped (or its name lost).
    fn settle(self, outcome: Outcome, link: &mut Link) {
        match outcome {
            Outcome::Moved(started, in_doubt) => {
                match self.registry.incoming_committed(self.number) {
                    // The peer may forget where it sent the VM: this server's ledger says so now.
                    Ok(()) => {
                        let _ = link.send(&Message::Done, &[]);
                        // Settled in doubt: the link failed once already, and a write on it may
                        // still succeed and go nowhere (between hosts the TLS relay half-closes
                        // it). The peer is told on a new link too, else it refuses the name for
                        // good once the VM ends here.
                        if in_doubt {
                            tell_settled(&self.peers, &self.peer, &self.vm);
                        }
                    }
                    // The ledger still says in doubt: a next server asks the peer, which must
                    // still say moved here (no Done), or refuses the name; never golden data.
                    Err(error) => {
                        tracing::warn!(vm = self.vm, %error, "could not record the moved VM as this server's")
                    }
                }
                if let Some(vm) = self.live.vm().as_mut() {
                    vm.overlay.stop_moving();
                }
                self.registry.move_counters().switchover(started.elapsed());
                tracing::info!(
                    vm = self.vm,
                    peer = %self.peer,
                    switchover_ms = started.elapsed().as_secs_f64() * 1000.0,
                    "VM moved here from its peer: served from now on"
                );
                self.live.set_gate(Gate::Open);
                // A connection that ended meanwhile left its end to the move. (The state's lock
                // is let go first: ending takes the registry's.)
                let ended = self.live.state().ended;
                if let Some(ending) = ended {
                    let vm = self.live.vm().take();
                    if let Some(vm) = vm {
                        drop(self.registry.end(self.number, ending, vm));
                    }
                }
            }
            Outcome::Failed(why) => {
                tracing::warn!(vm = self.vm, peer = %self.peer, why, "VM move from a peer failed: its copy here is dropped");
                let _ = link.send(&Message::Abort { why: why.clone() }, &[]);
                self.live.set_gate(Gate::Failed(format!("its move from peer {} failed: {why}", self.peer)));
                let vm = self.live.vm().take();
                self.registry.incoming_failed(self.number, vm, None);
            }
            Outcome::InDoubt(why) => {
                let why = format!(
                    "its move from peer {} was interrupted at the switchover ({why}) and the peer cannot be asked \
                     how it ended",
                    self.peer
                );
                self.live.set_gate(Gate::Failed(why.clone()));
                let vm = self.live.vm().take();
                self.registry.incoming_failed(self.number, vm, Some(&why));
            }
        }
    }
}

enum Outcome {
    /// The VM is this server's; the switchover began then; it was settled in doubt (the link
    /// failed after `Ready`).
    Moved(Instant, bool),
    Failed(String),
    InDoubt(String),
}
