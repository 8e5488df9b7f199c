//! Serving one request and writing its reply: reads (sliced, lent, with hole chunks), block
//! status, and the commands that return no data.

use overspill_block::{BlockDevice, DeviceError, ReadRequest};
use overspill_net::Transport;

use crate::connection::ConnectionError;
use crate::counters::command_name;
use crate::handshake::{Negotiated, ALLOCATION_CONTEXT_ID, DEPTH_CONTEXT_ID};
use crate::request::{errno_of, Command, RequestHeader};
use crate::stream::Wire;
use crate::wire::*;

/// Reads at least this long are sent from the device's own buffers ([`BlockDevice::read_shared`])
/// by the output's vectored write, not copied into the output first.
const SHARED_READ_BYTES: usize = 32 * 1024;
/// Flush the output early once this much is waiting, so large reads do not pile up.
pub(crate) const OUTPUT_HIGH_WATER: usize = 4 << 20;
/// Reads larger than this are answered in slices of at most this, ending on its multiples on
/// the disk (see [`read`]).
const READ_SLICE_BYTES: usize = 1 << 20;

pub(crate) fn execute(
    device: &mut dyn BlockDevice,
    command: Command,
    data: &[u8],
    max: u32,
) -> Result<(), DeviceError> {
    match command {
        Command::Write { offset, fua, .. } => device.write(offset, data, fua),
        Command::Flush => device.flush(),
        Command::Trim { offset, length, fua } => device.trim(offset, u64::from(length), fua),
        Command::WriteZeroes { offset, length, may_trim, fast_only, fua } => {
            device.write_zeroes(offset, u64::from(length), may_trim, fast_only, fua)
        }
        // A hint, which the spec lets a server follow in part: at most a payload's worth, so
        // that one 28-byte request cannot make the device fetch 4 GiB (its reply does not wait
        // for the client to take anything, as a read's would).
        Command::Cache { offset, length } => device.cache(offset, u64::from(length.min(max))),
        Command::Read { .. } | Command::BlockStatus { .. } | Command::Disconnect => {
            unreachable!("handled by the caller")
        }
    }
}

/// Replies to a command that returns no data. Structured replies are not needed for these
/// (the spec allows simple replies to anything but reads), but errors then carry a message.
pub(crate) fn reply_status<T>(
    wire: &mut Wire<T>,
    session: &Negotiated,
    header: &RequestHeader,
    result: Result<(), (Errno, String)>,
) {
    let cookie = header.cookie;
    if let Err((errno, _)) = &result {
        wire.counters.error_reply(command_name(header.kind), *errno);
    }
    match result {
        Ok(()) => simple_reply(&mut wire.output, cookie, 0),
        Err((errno, message)) if session.structured_replies => {
            structured_error(&mut wire.output, cookie, errno as u32, &message)
        }
        Err((errno, _)) => simple_reply(&mut wire.output, cookie, errno as u32),
    }
}

/// Descriptors in one block status reply at most, as the spec asks (2^20); a client asks again
/// from where the reply stopped.
const MAX_STATUS_DESCRIPTORS: usize = 1 << 20;
/// Of a block status request, what the device is asked about at most: the spec lets a server
/// answer for less than was asked "if looking up the information would be too
/// resource-intensive", and the client asks again from where the reply stopped. A device
/// walks its map block by block: 256 MiB is 65,536 blocks, at most 512 KiB of descriptors.
/// The same with REQ_ONE, which QEMU sends on every request: a smaller window would cut its
/// long extents (an empty disk) into many more round trips.
const STATUS_WINDOW_BYTES: u64 = 256 << 20;

/// Answers NBD_CMD_BLOCK_STATUS: a chunk of (length, flags) descriptors for each context the
/// client selected (`base:allocation`, then `qemu:allocation-depth`), each never past the
/// request's end (so REQ_ONE's limit holds too) and merged where neighbours agree; the last
/// chunk carries DONE. A device error fails the whole request before any chunk.
pub(crate) fn block_status<T>(
    wire: &mut Wire<T>,
    session: &mut Negotiated,
    header: &RequestHeader,
    offset: u64,
    length: u32,
    req_one: bool,
) {
    if !session.contexts.any() {
        let why = "no metadata context was selected (NBD_OPT_SET_META_CONTEXT base:allocation)";
        reply_status(wire, session, header, Err((Errno::Inval, why.into())));
        return;
    }
    let window = u64::from(length).min(STATUS_WINDOW_BYTES);
    let mut chunks: Vec<(u32, Descriptors)> = Vec::with_capacity(2);
    if session.contexts.allocation {
        let flags = |hole: bool, zero: bool| if hole { STATE_HOLE } else { 0 } | if zero { STATE_ZERO } else { 0 };
        let answer = match session.device.block_status(offset, window) {
            Ok(extents) => descriptors(extents.iter().map(|e| (e.length, flags(e.hole, e.zero))), length, req_one),
            Err(error) => failed(error),
        };
        chunks.push((ALLOCATION_CONTEXT_ID, answer));
    }
    if session.contexts.depth {
        let answer = match session.device.allocation_depth(offset, window) {
            Ok(runs) => descriptors(runs.iter().map(|run| (run.length, run.depth)), length, req_one),
            Err(error) => failed(error),
        };
        chunks.push((DEPTH_CONTEXT_ID, answer));
    }
    let mut answered = Vec::with_capacity(chunks.len());
    for (id, result) in chunks {
        match result {
            Ok(descriptors) => answered.push((id, descriptors)),
            Err((errno, why)) => {
                reply_status(wire, session, header, Err((errno, why)));
                return;
            }
        }
    }
    let out = &mut wire.output;
    let last = answered.len() - 1;
    for (i, (id, descriptors)) in answered.into_iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        chunk_header(out, flags, REPLY_TYPE_BLOCK_STATUS, header.cookie, 4 + 8 * descriptors.len() as u32);
        put_u32(out, id);
        for (len, value) in descriptors {
            put_u32(out, len);
            put_u32(out, value);
        }
    }
}

type Descriptors = Result<Vec<(u32, u32)>, (Errno, String)>;

fn failed(error: DeviceError) -> Descriptors {
    Err((errno_of(error.kind), error.message))
}

/// A device's runs as one context's descriptors: cut at the request's `length`, merged where
/// neighbours agree, at most [`MAX_STATUS_DESCRIPTORS`], one with REQ_ONE.
fn descriptors(runs: impl Iterator<Item = (u64, u32)>, length: u32, req_one: bool) -> Descriptors {
    let mut descriptors: Vec<(u32, u32)> = Vec::new();
    let mut left = length;
    for (run, value) in runs {
        let len = run.min(u64::from(left)) as u32;
        if len == 0 {
            break;
        }
        let full = descriptors.len() == MAX_STATUS_DESCRIPTORS;
        match descriptors.last_mut() {
            Some((last_len, last_value)) if *last_value == value => *last_len += len,
            _ if full => break,
            _ => descriptors.push((len, value)),
        }
        left -= len;
        if req_one {
            break;
        }
    }
    if descriptors.is_empty() {
        return Err((Errno::Io, "the device reported no extents".into()));
    }
    Ok(descriptors)
}

/// Structured reads at least this long ask the device which parts read as zeroes, and send
/// those as hole chunks instead of data. Smaller reads are not worth the question: it costs an
/// index walk, and the 4-64 KiB reads of a running guest are almost never zero.
const SPARSE_READ_BYTES: usize = 256 * 1024;

/// Zero runs shorter than this travel as data: a hole chunk would save too little.
const MIN_HOLE_BYTES: u64 = 4096;

/// Answers a read. Data is read straight into the output buffer behind the reply header, so it
/// is copied once, or lent by the device ([`SHARED_READ_BYTES`]). A read larger than
/// [`READ_SLICE_BYTES`] is answered slice by slice, sending the output whenever it passes its
/// high water: a client that asks for large reads and never reads the replies holds at most that
/// much of the server's memory, and the server stops reading its requests (it waits in the
/// write) instead of queueing more replies. With structured replies, a large read's zero runs
/// are hole chunks ([`SPARSE_READ_BYTES`]).
pub(crate) fn read<T: Transport>(
    wire: &mut Wire<T>,
    session: &mut Negotiated,
    cookie: u64,
    offset: u64,
    length: u32,
) -> Result<(), ConnectionError> {
    let structured = session.structured_replies;
    let request = ReadRequest::begin(session.device.as_mut(), offset, u64::from(length));
    if structured && length == 0 {
        chunk_header(&mut wire.output, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0);
        return Ok(());
    }
    let reply_start = wire.output.len();
    if !structured {
        simple_reply(&mut wire.output, cookie, 0);
    }
    let length = length as usize;
    let runs = if structured && length >= SPARSE_READ_BYTES {
        zero_runs(session.device.as_mut(), offset, length)
    } else {
        Vec::new()
    };
    let mut runs = runs.into_iter().peekable();
    let mut done = 0usize;
    loop {
        let at = offset + done as u64;
        // The next piece: a zero run starting here, or data up to the next run or slice end.
        // A read that needs slices has them end on multiples of their size on the disk, not of
        // the request: a device that counts what it reads block by block sees no block split
        // between two slices. A read that fits in one stays one.
        let to_slice_end = if length <= READ_SLICE_BYTES {
            length - done
        } else {
            READ_SLICE_BYTES - (at % READ_SLICE_BYTES as u64) as usize
        };
        let (piece, hole) = match runs.peek() {
            Some(&(start, len)) if start == at => {
                runs.next();
                (len as usize, true)
            }
            Some(&(start, _)) => (((start - at) as usize).min(to_slice_end), false),
            None => ((length - done).min(to_slice_end), false),
        };
        let last = done + piece == length;
        let flags = if last { REPLY_FLAG_DONE } else { 0 };
        let slice_start = wire.output.len();
        if hole {
            session.device.read_sent_as_zeroes(&request, at, piece as u64);
            chunk_header(&mut wire.output, flags, REPLY_TYPE_OFFSET_HOLE, cookie, 12);
            put_u64(&mut wire.output, at);
            put_u32(&mut wire.output, piece as u32);
        } else {
            if structured {
                chunk_header(&mut wire.output, flags, REPLY_TYPE_OFFSET_DATA, cookie, 8 + piece as u32);
                put_u64(&mut wire.output, at);
            }
            if let Err(error) = read_slice(wire, session.device.as_mut(), &request, at, piece) {
                tracing::debug!(%error, offset = at, length = piece, "read failed");
                let errno = errno_of(error.kind);
                wire.counters.error_reply("read", errno);
                if structured {
                    // After data chunks, an error chunk ends the reply.
                    wire.output.truncate(slice_start);
                    structured_error(&mut wire.output, cookie, errno as u32, &error.message);
                } else if done == 0 {
                    wire.output.truncate(reply_start);
                    simple_reply(&mut wire.output, cookie, errno as u32);
                } else {
                    // A simple reply said "no error" before its data: NBD's only way out is to close.
                    wire.output.truncate(slice_start);
                    wire.flush()?;
                    let why =
                        format!("a read failed after its reply began, so the connection closes: {}", error.message);
                    return Err(ConnectionError::Abandoned(why));
                }
                return Ok(());
            }
        }
        done += piece;
        if last {
            return Ok(());
        }
        if wire.unsent() >= OUTPUT_HIGH_WATER {
            wire.flush()?;
        }
    }
}

/// The runs of `[offset, offset + length)` the device says read as zeroes, as (offset, length),
/// in order, each at least [`MIN_HOLE_BYTES`]. A device that cannot tell, or fails to, has none:
/// the read then sends everything as data, which is never wrong.
fn zero_runs(device: &mut dyn BlockDevice, offset: u64, length: usize) -> Vec<(u64, u64)> {
    let extents = match device.block_status(offset, length as u64) {
        Ok(extents) => extents,
        Err(error) => {
            tracing::debug!(%error, offset, length, "block status for a sparse read failed: sending data");
            return Vec::new();
        }
    };
    let end = offset + length as u64;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut at = offset;
    for extent in extents {
        let len = extent.length.min(end - at);
        if len == 0 {
            break;
        }
        if extent.zero {
            match runs.last_mut() {
                Some((start, run)) if *start + *run == at => *run += len,
                _ => runs.push((at, len)),
            }
        }
        at += len;
    }
    runs.retain(|&(_, len)| len >= MIN_HOLE_BYTES);
    runs
}

/// Appends `length` bytes of the device at `offset` to the output: lent, or copied in.
fn read_slice<T: Transport>(
    wire: &mut Wire<T>,
    device: &mut dyn BlockDevice,
    request: &ReadRequest,
    offset: u64,
    length: usize,
) -> Result<(), DeviceError> {
    if length >= SHARED_READ_BYTES {
        wire.lend(device.read_shared(request, offset, length)?);
        return Ok(());
    }
    let data_start = wire.output.len();
    wire.output.resize(data_start + length, 0);
    device.read(request, offset, &mut wire.output[data_start..])
}
