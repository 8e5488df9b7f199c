//! The link between peer servers: its messages (a JSON header and a binary payload, each with
//! its length), the runs of blocks they carry, and its two ends, over a Unix socket or TLS.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver};

use overspill_engine::{MovedRun, BLOCK_BYTES};
use overspill_net::{ListenAddr, PeerTls};
use serde::{Deserialize, Serialize};

use super::{Peers, ANSWER_TIMEOUT, SWITCH_TIMEOUT};
use crate::vms::{Asker, Holding, Offer};

/// The peer protocol's version: a peer that speaks another is refused.
pub(super) const PROTOCOL: u32 = 1;
pub(super) const MAX_HEADER_BYTES: u32 = 1 << 20;
pub(super) const MAX_PAYLOAD_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub(super) enum Message {
    Hello {
        server: String,
        protocol: u32,
    },
    Query {
        vm: String,
    },
    Holds {
        holding: Holding,
    },
    /// Sends VM `vm`, asked for over image `image` by a connection of `asker` (none from a
    /// peer of an earlier release, which checks the VM's owner only once offered it).
    Take {
        vm: String,
        image: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        asker: Option<Asker>,
    },
    Offer {
        offer: Offer,
    },
    Refuse {
        why: String,
    },
    Accept,
    /// Runs of blocks; the data runs' bytes are the payload, in order.
    Runs {
        runs: Vec<RunHeader>,
        round_done: bool,
        blocks_left: u64,
    },
    /// The receiver's guest runs: switch over now.
    Switch,
    /// The last runs are sent and the VM is fenced; `source_ended`: the sender's connection
    /// ended (the receiver, if its own connection is gone too, declines).
    Final {
        source_ended: bool,
        /// The VM had written at the sending end (its receiver's ledger must know).
        written: bool,
    },
    Ready,
    Committed,
    Done,
    Decline,
    Abort {
        why: String,
    },
    /// Ends VM `vm`'s overlay here unless it is connected (a fresh start of the VM at the
    /// asking server, whose boot must not take this server's copy): answered `Accept`, or
    /// `Refuse` saying why not. A peer of an earlier release closes the link instead.
    Reset {
        vm: String,
    },
    /// The VM moved here is this server's for good (a move left in doubt, settled since): the
    /// sending end may forget where it sent it. Answered `Accept`.
    Settled {
        vm: String,
    },
    /// Reads the VM's disk where it is current (a receiver's reads before the switchover).
    Read {
        vm: String,
        offset: u64,
        length: u32,
    },
    /// What a read read: the payload.
    Data,
    /// The VM is not here (any more) to be read.
    NotHere,
    /// The read failed here, as it would have for the VM.
    ReadFailed {
        why: String,
    },
}

impl Message {
    /// The VM a peer's question or request names, if it names one.
    pub(super) fn vm(&self) -> Option<&str> {
        match self {
            Self::Query { vm }
            | Self::Take { vm, .. }
            | Self::Reset { vm }
            | Self::Settled { vm }
            | Self::Read { vm, .. } => Some(vm),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "run", rename_all = "kebab-case")]
pub(super) enum RunHeader {
    Golden { first: u64, end: u64 },
    Zero { first: u64, end: u64 },
    Data { first: u64, blocks: u64 },
}

/// What the other end of a link sends, as its reader thread passes it on.
pub(super) type Replies = Receiver<io::Result<(Message, Vec<u8>)>>;

/// A stream to the peer at `address`, and the name its certificate proves (over TCP).
pub(super) fn open(address: &ListenAddr, tls: Option<&PeerTls>) -> io::Result<(UnixStream, Option<String>)> {
    let host_port = match address {
        ListenAddr::Unix(path) => return Ok((UnixStream::connect(path)?, None)),
        ListenAddr::Tcp(host_port) => host_port,
    };
    let tls = tls.ok_or_else(|| io::Error::other("a tcp: peer needs this server's TLS credentials"))?;
    let host = host_port.rsplit_once(':').map_or(host_port.as_str(), |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, format!("{host_port}: no address"));
    for socket in host_port.to_socket_addrs()? {
        match TcpStream::connect_timeout(&socket, ANSWER_TIMEOUT) {
            Ok(tcp) => {
                tcp.set_read_timeout(Some(ANSWER_TIMEOUT))?;
                tcp.set_write_timeout(Some(ANSWER_TIMEOUT))?;
                let peer = tls.connect(tcp, host)?;
                return Ok((peer.stream, Some(peer.identity)));
            }
            Err(error) => last_error = error,
        }
    }
    Err(last_error)
}

/// Refuses a peer whose hello names another server than its certificate does, or this server
/// itself (two servers sharing a certificate, or one named its own peer): "moved to NAME" in a
/// ledger must name one server.
pub(super) fn check_name(said: &str, proven: Option<&str>, ours: &str) -> io::Result<()> {
    let refused = |why: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
    match proven {
        Some(proven) if proven != said => {
            refused(format!("a peer says it is {said:?}, and its certificate says {proven:?}"))
        }
        _ if said == ours => refused(format!("a peer has this server's own name {ours:?}: give each server its own")),
        _ => Ok(()),
    }
}

/// One end of a link to a peer.
pub(super) struct Link {
    pub(super) stream: UnixStream,
    /// The peer's name as it said hello (its certificate's common name over TCP).
    pub(super) peer: String,
}

impl Link {
    pub(super) fn connect(address: &ListenAddr, peers: &Peers) -> io::Result<Self> {
        let (stream, proven) = open(address, peers.tls.as_deref())?;
        stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
        stream.set_write_timeout(Some(SWITCH_TIMEOUT))?;
        let mut link = Self { stream, peer: address.to_string() };
        link.send(&Message::Hello { server: peers.name.clone(), protocol: PROTOCOL }, &[])?;
        match link.receive()?.0 {
            Message::Hello { server, protocol: PROTOCOL } => {
                check_name(&server, proven.as_deref(), &peers.name)?;
                link.peer = server;
                Ok(link)
            }
            Message::Hello { protocol, .. } => Err(io::Error::other(format!("the peer speaks protocol {protocol}"))),
            Message::Refuse { why } => {
                Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("the peer refuses this server: {why}")))
            }
            other => Err(unexpected(&other)),
        }
    }

    /// The accepting end: says hello back to a peer that said hello (as the server its
    /// certificate proves it is, over TCP).
    pub(super) fn accept(stream: UnixStream, our_name: &str, proven: Option<&str>) -> io::Result<Self> {
        stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
        stream.set_write_timeout(Some(SWITCH_TIMEOUT))?;
        let mut link = Self { stream, peer: String::new() };
        match link.receive()?.0 {
            Message::Hello { server, protocol: PROTOCOL } => {
                if let Err(error) = check_name(&server, proven, our_name) {
                    let _ = link.send(&Message::Refuse { why: error.to_string() }, &[]);
                    return Err(error);
                }
                link.peer = server;
            }
            Message::Hello { protocol, .. } => {
                return Err(io::Error::other(format!("a peer speaks protocol {protocol}")))
            }
            other => return Err(unexpected(&other)),
        }
        link.send(&Message::Hello { server: our_name.to_owned(), protocol: PROTOCOL }, &[])?;
        Ok(link)
    }

    pub(super) fn send(&mut self, message: &Message, payload: &[u8]) -> io::Result<()> {
        let header = serde_json::to_vec(message).map_err(io::Error::other)?;
        let mut frame = Vec::with_capacity(12 + header.len());
        frame.extend_from_slice(&(header.len() as u32).to_be_bytes());
        frame.extend_from_slice(&header);
        frame.extend_from_slice(&(payload.len() as u64).to_be_bytes());
        self.stream.write_all(&frame)?;
        self.stream.write_all(payload)
    }

    pub(super) fn receive(&mut self) -> io::Result<(Message, Vec<u8>)> {
        receive_from(&mut self.stream)
    }

    /// Sends a question without payload and receives the answer's message.
    pub(super) fn ask(&mut self, question: &Message) -> io::Result<Message> {
        self.send(question, &[])?;
        Ok(self.receive()?.0)
    }

    /// Hands the reading to a thread of its own, so that the move can send while it waits;
    /// the thread ends with the link.
    pub(super) fn spawn_reader(&self) -> io::Result<Replies> {
        let mut stream = self.stream.try_clone()?;
        stream.set_read_timeout(None)?;
        // Bounded: a receiver that applies slower than the link delivers holds back the link,
        // not the whole overlay in memory.
        let (send, receive) = mpsc::sync_channel(4);
        std::thread::Builder::new().name("peer-reader".into()).spawn(move || loop {
            let message = receive_from(&mut stream);
            let failed = message.is_err();
            if send.send(message).is_err() || failed {
                return;
            }
        })?;
        Ok(receive)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // The reader thread holds a clone of the socket: shut down, it sees the end.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

pub(super) fn receive_from(stream: &mut UnixStream) -> io::Result<(Message, Vec<u8>)> {
    let mut length = [0u8; 4];
    stream.read_exact(&mut length)?;
    let header_len = u32::from_be_bytes(length);
    if header_len > MAX_HEADER_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a peer message header of {header_len} bytes")));
    }
    let mut header = vec![0u8; header_len as usize];
    stream.read_exact(&mut header)?;
    let message: Message = serde_json::from_slice(&header)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("a peer message that does not parse: {e}")))?;
    let mut length = [0u8; 8];
    stream.read_exact(&mut length)?;
    let payload_len = u64::from_be_bytes(length);
    if payload_len > MAX_PAYLOAD_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a peer payload of {payload_len} bytes")));
    }
    let mut payload = vec![0u8; payload_len as usize];
    stream.read_exact(&mut payload)?;
    Ok((message, payload))
}

pub(super) fn unexpected(message: &Message) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("unexpected peer message {message:?}"))
}

pub(super) fn encode_runs(runs: Vec<MovedRun>) -> (Vec<RunHeader>, Vec<u8>) {
    let mut payload = Vec::new();
    let headers = runs
        .into_iter()
        .map(|run| match run {
            MovedRun::Golden { first, end } => RunHeader::Golden { first, end },
            MovedRun::Zero { first, end } => RunHeader::Zero { first, end },
            MovedRun::Data { first, data } => {
                let blocks = data.len() as u64 / BLOCK_BYTES;
                payload.extend_from_slice(&data);
                RunHeader::Data { first, blocks }
            }
        })
        .collect();
    (headers, payload)
}

pub(super) fn decode_runs(headers: Vec<RunHeader>, payload: &[u8]) -> io::Result<Vec<MovedRun>> {
    let mut at = 0usize;
    let runs = headers
        .into_iter()
        .map(|header| {
            Ok(match header {
                RunHeader::Golden { first, end } => MovedRun::Golden { first, end },
                RunHeader::Zero { first, end } => MovedRun::Zero { first, end },
                RunHeader::Data { first, blocks } => {
                    if first.checked_add(blocks).is_none() {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "a run past the last block"));
                    }
                    let longer = || io::Error::new(io::ErrorKind::InvalidData, "runs longer than their payload");
                    // A peer's count: checked, not trusted to fit.
                    let len =
                        blocks.checked_mul(BLOCK_BYTES).and_then(|len| usize::try_from(len).ok()).ok_or_else(longer)?;
                    let end = at.checked_add(len).ok_or_else(longer)?;
                    let data = payload.get(at..end).ok_or_else(longer)?;
                    at = end;
                    MovedRun::Data { first, data: data.to_vec() }
                }
            })
        })
        .collect::<io::Result<Vec<MovedRun>>>()?;
    if at != payload.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a payload longer than its runs"));
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_run_whose_length_overflows_is_refused_not_wrapped() {
        // 2^52 blocks of 4 KiB is 2^64 bytes: wrapped, it would be an empty run taken as data.
        let run = RunHeader::Data { first: 7, blocks: 1 << 52 };
        let refused = decode_runs(vec![run], &[]).expect_err("refused");
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData, "{refused}");
        let past_the_end = RunHeader::Data { first: u64::MAX, blocks: 1 };
        let refused = decode_runs(vec![past_the_end], &[5; 4096]).expect_err("refused");
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData, "{refused}");
        let whole = decode_runs(vec![RunHeader::Data { first: 7, blocks: 1 }], &[5; 4096]).expect("one block");
        assert!(matches!(&whole[..], [MovedRun::Data { first: 7, data }] if data.len() == 4096));
    }
}
