//! What the engine's test files share.

use std::io::{self, IoSliceMut};

/// Fills `buffers` in order from `data`, as reading a socket would; fails after `cut` bytes.
pub fn receive_into(buffers: &mut [IoSliceMut<'_>], data: &[u8], cut: Option<usize>) -> io::Result<()> {
    let total: usize = buffers.iter().map(|buffer| buffer.len()).sum();
    assert_eq!(total, data.len(), "the buffers cover exactly the write");
    let mut pos = 0;
    for buffer in buffers.iter_mut() {
        let n = buffer.len().min(cut.unwrap_or(usize::MAX).saturating_sub(pos));
        buffer[..n].copy_from_slice(&data[pos..pos + n]);
        pos += n;
        if n < buffer.len() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "client went away"));
        }
    }
    Ok(())
}
