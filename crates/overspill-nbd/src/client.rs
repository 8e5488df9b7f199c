//! A small blocking NBD client: fixed-newstyle handshake with GO (falling back to EXPORT_NAME),
//! optional structured replies, and one request in flight at a time. It drives storms and tests
//! against overspill and against other servers (nbdkit, qemu-nbd), so it is written to the spec,
//! not to this crate's server.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::str::FromStr;

use crate::wire::*;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("server refused option {option}: reply {reply:#x} {message}")]
    Refused { option: u32, reply: u32, message: String },
    /// The server answered the request with an error; the connection goes on.
    #[error("server error {errno}{}", if .message.is_empty() { String::new() } else { format!(": {}", .message) })]
    Errno { errno: u32, message: String },
}

impl ClientError {
    pub fn errno(&self) -> Option<u32> {
        match self {
            Self::Errno { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

type Result<T, E = ClientError> = std::result::Result<T, E>;

fn protocol(message: impl Into<String>) -> ClientError {
    ClientError::Protocol(message.into())
}

/// Where an NBD server is: `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`
/// (the URI forms libnbd and qemu use), or this project's `unix:PATH` / `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub endpoint: Endpoint,
    pub export: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(std::path::PathBuf),
    Tcp(String),
}

impl FromStr for NbdUri {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path_part, query) = rest.split_once('?').ok_or("nbd+unix:// needs ?socket=PATH")?;
            let socket =
                query.split('&').find_map(|kv| kv.strip_prefix("socket=")).ok_or("nbd+unix:// needs ?socket=PATH")?;
            let export = path_part.strip_prefix('/').unwrap_or(path_part).to_owned();
            return Ok(Self { endpoint: Endpoint::Unix(socket.into()), export });
        }
        if let Some(rest) = s.strip_prefix("nbd://") {
            let (host, export) = rest.split_once('/').unwrap_or((rest, ""));
            let host = if host.contains(':') { host.to_owned() } else { format!("{host}:10809") };
            return Ok(Self { endpoint: Endpoint::Tcp(host), export: export.to_owned() });
        }
        match s.parse::<overspill_net::ListenAddr>()? {
            overspill_net::ListenAddr::Unix(path) => Ok(Self { endpoint: Endpoint::Unix(path), export: String::new() }),
            overspill_net::ListenAddr::Tcp(addr) => Ok(Self { endpoint: Endpoint::Tcp(addr), export: String::new() }),
        }
    }
}

/// A byte stream the client can use.
pub trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

pub struct Client {
    stream: Box<dyn Stream>,
    size: u64,
    flags: u16,
    structured: bool,
    cookie: u64,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("size", &self.size).field("flags", &self.flags).finish_non_exhaustive()
    }
}

impl Client {
    pub fn connect(uri: &NbdUri) -> Result<Self> {
        let stream: Box<dyn Stream> = match &uri.endpoint {
            Endpoint::Unix(path) => Box::new(UnixStream::connect(path)?),
            Endpoint::Tcp(addr) => {
                let s = TcpStream::connect(addr.as_str())?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
        };
        Self::handshake(stream, &uri.export, true)
    }

    /// Negotiates `export` on an open stream, asking for structured replies if `structured`.
    pub fn handshake(mut stream: Box<dyn Stream>, export: &str, structured: bool) -> Result<Self> {
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting)?;
        if be_u64(&greeting) != NBDMAGIC || be_u64(&greeting[8..]) != IHAVEOPT {
            return Err(protocol("not a newstyle NBD server"));
        }
        let server_flags = be_u16(&greeting[16..]);
        if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(protocol("server is not fixed newstyle"));
        }
        let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
        let client_flags = CLIENT_FIXED_NEWSTYLE | if no_zeroes { CLIENT_NO_ZEROES } else { 0 };
        stream.write_all(&client_flags.to_be_bytes())?;
        let mut client = Self { stream, size: 0, flags: 0, structured: false, cookie: 0, scratch: Vec::new() };
        if structured {
            client.send_option(OPT_STRUCTURED_REPLY, &[])?;
            let (reply, _) = client.option_reply(OPT_STRUCTURED_REPLY)?;
            client.structured = reply == REP_ACK;
        }
        client.send_option(OPT_GO, &info_request(export, &[INFO_BLOCK_SIZE]))?;
        loop {
            let (reply, payload) = client.option_reply(OPT_GO)?;
            match reply {
                REP_ACK => return Ok(client),
                REP_INFO if payload.len() >= 12 && be_u16(&payload) == INFO_EXPORT => {
                    client.size = be_u64(&payload[2..]);
                    client.flags = be_u16(&payload[10..]);
                }
                REP_INFO => {}
                REP_ERR_UNSUP => {
                    // An old server without GO: EXPORT_NAME, whose answer has no reply header.
                    client.send_option(OPT_EXPORT_NAME, export.as_bytes())?;
                    let mut answer = vec![0u8; if no_zeroes { 10 } else { 134 }];
                    client.stream.read_exact(&mut answer)?;
                    client.size = be_u64(&answer);
                    client.flags = be_u16(&answer[8..]);
                    return Ok(client);
                }
                _ => {
                    return Err(ClientError::Refused {
                        option: OPT_GO,
                        reply,
                        message: String::from_utf8_lossy(&payload).into_owned(),
                    })
                }
            }
        }
    }

    fn send_option(&mut self, option: u32, data: &[u8]) -> Result<()> {
        let mut msg = Vec::with_capacity(16 + data.len());
        put_option(&mut msg, option, data);
        self.stream.write_all(&msg)?;
        Ok(())
    }

    fn option_reply(&mut self, option: u32) -> Result<(u32, Vec<u8>)> {
        let mut header = [0u8; 20];
        self.stream.read_exact(&mut header)?;
        if be_u64(&header) != OPTION_REPLY_MAGIC || be_u32(&header[8..]) != option {
            return Err(protocol("bad option reply header"));
        }
        let len = be_u32(&header[16..]);
        if len > 1 << 20 {
            return Err(protocol(format!("option reply of {len} bytes")));
        }
        let mut payload = vec![0u8; len as usize];
        self.stream.read_exact(&mut payload)?;
        Ok((be_u32(&header[12..]), payload))
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn transmission_flags(&self) -> u16 {
        self.flags
    }

    pub fn structured_replies(&self) -> bool {
        self.structured
    }

    pub fn can_trim(&self) -> bool {
        self.flags & TFLAG_SEND_TRIM != 0
    }

    pub fn can_zero(&self) -> bool {
        self.flags & TFLAG_SEND_WRITE_ZEROES != 0
    }

    pub fn can_flush(&self) -> bool {
        self.flags & TFLAG_SEND_FLUSH != 0
    }

    /// Sends a raw request, for tests that need to say what a well-behaved client would not.
    pub fn send_request(&mut self, kind: u16, flags: u16, offset: u64, length: u32, data: &[u8]) -> Result<u64> {
        self.cookie += 1;
        let header = crate::request::RequestHeader { flags, kind, cookie: self.cookie, offset, length };
        self.scratch.clear();
        header.encode(&mut self.scratch);
        self.scratch.extend_from_slice(data);
        self.stream.write_all(&self.scratch)?;
        Ok(self.cookie)
    }

    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let length = u32::try_from(buf.len()).map_err(|_| protocol("read above 4 GiB"))?;
        let cookie = self.send_request(CMD_READ, 0, offset, length, &[])?;
        self.reply(cookie, Some((offset, buf)))
    }

    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let length = u32::try_from(data.len()).map_err(|_| protocol("write above 4 GiB"))?;
        let cookie = self.send_request(CMD_WRITE, if fua { CMD_FLAG_FUA } else { 0 }, offset, length, data)?;
        self.reply(cookie, None)
    }

    pub fn trim(&mut self, offset: u64, length: u32) -> Result<()> {
        let cookie = self.send_request(CMD_TRIM, 0, offset, length, &[])?;
        self.reply(cookie, None)
    }

    pub fn write_zeroes(&mut self, offset: u64, length: u32, no_hole: bool) -> Result<()> {
        let flags = if no_hole { CMD_FLAG_NO_HOLE } else { 0 };
        let cookie = self.send_request(CMD_WRITE_ZEROES, flags, offset, length, &[])?;
        self.reply(cookie, None)
    }

    pub fn flush(&mut self) -> Result<()> {
        let cookie = self.send_request(CMD_FLUSH, 0, 0, 0, &[])?;
        self.reply(cookie, None)
    }

    /// Sends NBD_CMD_DISC and waits for the server to close the connection: only then has it
    /// let go of the export, so that connecting again at once under the same VM name is not
    /// refused as a second connection.
    pub fn disconnect(mut self) -> Result<()> {
        self.send_request(CMD_DISC, 0, 0, 0, &[])?;
        let mut rest = [0u8; 512];
        // The server sends nothing after DISC; a reset instead of an orderly close is an end too.
        while matches!(self.stream.read(&mut rest), Ok(n) if n > 0) {}
        Ok(())
    }

    /// Waits for the reply to `cookie`; a read's data lands in `read.1` (which starts at
    /// `read.0` on the disk).
    pub fn reply(&mut self, cookie: u64, mut read: Option<(u64, &mut [u8])>) -> Result<()> {
        let mut magic = [0u8; 4];
        self.stream.read_exact(&mut magic)?;
        match be_u32(&magic) {
            SIMPLE_REPLY_MAGIC => {
                let mut rest = [0u8; 12];
                self.stream.read_exact(&mut rest)?;
                check_cookie(cookie, be_u64(&rest[4..]))?;
                let errno = be_u32(&rest);
                if errno != 0 {
                    return Err(ClientError::Errno { errno, message: String::new() });
                }
                if let Some((_, buf)) = read {
                    self.stream.read_exact(buf)?;
                }
                Ok(())
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut first = true;
                let mut error = None;
                // Bytes of the read the data and hole chunks covered: all of it, once.
                let mut covered = 0usize;
                loop {
                    if !first {
                        self.stream.read_exact(&mut magic)?;
                        if be_u32(&magic) != STRUCTURED_REPLY_MAGIC {
                            return Err(protocol("structured reply chunk with bad magic"));
                        }
                    }
                    first = false;
                    let mut rest = [0u8; 16];
                    self.stream.read_exact(&mut rest)?;
                    let (flags, kind, length) = (be_u16(&rest), be_u16(&rest[2..]), be_u32(&rest[12..]));
                    check_cookie(cookie, be_u64(&rest[4..]))?;
                    match self.chunk(kind, length, read.as_mut().map(|(o, b)| (*o, &mut **b)))? {
                        Chunk::Error(e) => error = Some(e),
                        Chunk::Covered(bytes) => covered = covered.saturating_add(bytes),
                    }
                    if flags & REPLY_FLAG_DONE != 0 {
                        let wanted = read.as_ref().map_or(0, |(_, buf)| buf.len());
                        return match error {
                            Some(error) => Err(error),
                            None if covered != wanted => {
                                Err(protocol(format!("the reply covered {covered} of the {wanted} bytes read")))
                            }
                            None => Ok(()),
                        };
                    }
                }
            }
            other => Err(protocol(format!("reply magic {other:#x}"))),
        }
    }

    /// Reads one structured chunk's payload: the error it carries, or the bytes of the read it
    /// covered.
    fn chunk(&mut self, kind: u16, length: u32, read: Option<(u64, &mut [u8])>) -> Result<Chunk> {
        match kind {
            REPLY_TYPE_NONE => Ok(Chunk::Covered(0)),
            REPLY_TYPE_OFFSET_DATA => {
                let (base, buf) = read.ok_or_else(|| protocol("data chunk for a request that reads nothing"))?;
                let mut offset = [0u8; 8];
                self.stream.read_exact(&mut offset)?;
                let start = be_u64(&offset)
                    .checked_sub(base)
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or_else(|| protocol("data chunk before the requested range"))?;
                let len = (length as usize).checked_sub(8).ok_or_else(|| protocol("short data chunk"))?;
                let target = start
                    .checked_add(len)
                    .and_then(|end| buf.get_mut(start..end))
                    .ok_or_else(|| protocol("data chunk past the range"))?;
                self.stream.read_exact(target)?;
                Ok(Chunk::Covered(len))
            }
            REPLY_TYPE_OFFSET_HOLE => {
                // Offset and length of zeroes.
                let (base, buf) = read.ok_or_else(|| protocol("hole chunk for a request that reads nothing"))?;
                if length != 12 {
                    return Err(protocol(format!("hole chunk of {length} bytes")));
                }
                let mut payload = [0u8; 12];
                self.stream.read_exact(&mut payload)?;
                let start = be_u64(&payload)
                    .checked_sub(base)
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or_else(|| protocol("hole chunk before the requested range"))?;
                let len = be_u32(&payload[8..]) as usize;
                buf.get_mut(start..start.saturating_add(len))
                    .ok_or_else(|| protocol("hole chunk past the range"))?
                    .fill(0);
                Ok(Chunk::Covered(len))
            }
            k if k & (1 << 15) != 0 => {
                if !(6..=1 << 20).contains(&length) {
                    return Err(protocol(format!("error chunk of {length} bytes")));
                }
                let mut payload = vec![0u8; length as usize];
                self.stream.read_exact(&mut payload)?;
                let errno = be_u32(&payload);
                let msg_len = (be_u16(&payload[4..]) as usize).min(payload.len() - 6);
                let message = String::from_utf8_lossy(&payload[6..6 + msg_len]).into_owned();
                Ok(Chunk::Error(ClientError::Errno { errno, message }))
            }
            other => {
                // Unknown non-error chunk types must be skipped.
                io::copy(&mut (&mut self.stream).take(u64::from(length)), &mut io::sink())?;
                tracing::debug!(kind = other, "skipped unknown reply chunk");
                Ok(Chunk::Covered(0))
            }
        }
    }
}

/// What one structured reply chunk said.
enum Chunk {
    Error(ClientError),
    Covered(usize),
}

fn check_cookie(expected: u64, got: u64) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(protocol(format!("reply for cookie {got}, expected {expected}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_as_libnbd_writes_them() {
        let u: NbdUri = "nbd+unix:///golden@vm-1?socket=/tmp/s.sock".parse().expect("valid");
        assert_eq!(u, NbdUri { endpoint: Endpoint::Unix("/tmp/s.sock".into()), export: "golden@vm-1".into() });
        let u: NbdUri = "nbd://127.0.0.1/x".parse().expect("valid");
        assert_eq!(u.endpoint, Endpoint::Tcp("127.0.0.1:10809".into()));
        let u: NbdUri = "tcp:localhost:1234".parse().expect("valid");
        assert_eq!((u.endpoint, u.export), (Endpoint::Tcp("localhost:1234".into()), String::new()));
        assert!("nbd+unix:///x".parse::<NbdUri>().is_err());
        assert!("http://x".parse::<NbdUri>().is_err());
    }

    /// A client over bytes a server is supposed to have sent.
    fn client_reading(reply: Vec<u8>) -> Client {
        let stream = std::io::Cursor::new(reply);
        Client { stream: Box::new(stream), size: 1 << 20, flags: 0, structured: true, cookie: 0, scratch: Vec::new() }
    }

    fn chunk(reply: &mut Vec<u8>, flags: u16, kind: u16, payload: &[u8]) {
        reply.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        reply.extend_from_slice(&flags.to_be_bytes());
        reply.extend_from_slice(&kind.to_be_bytes());
        reply.extend_from_slice(&7u64.to_be_bytes());
        reply.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        reply.extend_from_slice(payload);
    }

    /// A structured read reply that ends without covering the whole read is a protocol error,
    /// not a read whose buffer keeps what it held; one that covers it is a read.
    #[test]
    fn a_read_reply_must_cover_the_whole_read() {
        let data = |offset: u64, bytes: &[u8]| [&offset.to_be_bytes()[..], bytes].concat();
        let mut short = Vec::new();
        chunk(&mut short, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, &data(4096, &[0x5a; 512]));
        let mut buf = vec![0xeeu8; 1024];
        let error = client_reading(short).reply(7, Some((4096, &mut buf))).expect_err("half a read");
        assert!(error.to_string().contains("covered 512 of the 1024"), "{error}");

        let mut whole = Vec::new();
        chunk(&mut whole, 0, REPLY_TYPE_OFFSET_DATA, &data(4096, &[0x5a; 512]));
        let hole = [&4608u64.to_be_bytes()[..], &512u32.to_be_bytes()[..]].concat();
        chunk(&mut whole, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, &hole);
        client_reading(whole).reply(7, Some((4096, &mut buf))).expect("a whole read");
        assert!(buf[..512].iter().all(|&b| b == 0x5a) && buf[512..].iter().all(|&b| b == 0));
    }

    /// A data chunk whose offset and length overflow past the buffer is refused, not a panic.
    #[test]
    fn a_data_chunk_whose_end_overflows_is_refused() {
        let mut reply = Vec::new();
        // Length 8 + (2^32 - 9) bytes at offset base + (usize::MAX - 100): its end overflows.
        reply.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        reply.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
        reply.extend_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
        reply.extend_from_slice(&7u64.to_be_bytes());
        reply.extend_from_slice(&u32::MAX.to_be_bytes());
        reply.extend_from_slice(&(usize::MAX as u64 - 100).to_be_bytes());
        let mut buf = vec![0u8; 1024];
        let error = client_reading(reply).reply(7, Some((0, &mut buf))).expect_err("past the range");
        assert!(error.to_string().contains("past the range"), "{error}");
    }
}
