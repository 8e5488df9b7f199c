//! A snapshot of a Ceph RBD image as a golden image, read through librbd.
//!
//! Only snapshots are opened (`rbd_open_read_only` with a snapshot name): a snapshot cannot
//! change, so every VM of a version reads the same bytes for as long as it runs, and a new
//! version is a new snapshot (`rbd snap create pool/golden@v4`), published as any other.
//!
//! The bindings are a handful of librados/librbd C functions declared here by hand; no Rust
//! crate for librbd is kept well enough to depend on. Linking needs librbd and librados
//! (Debian: librbd-dev, librados-dev), which is why this module is a build feature.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::path::Path;
use std::ptr;
use std::sync::Mutex;

use overspill_engine::golden::{push_extent, Allocation, Extent};
use overspill_engine::GoldenImage;

use crate::SourceError;

type RadosCluster = *mut c_void;
type RadosIoctx = *mut c_void;
type RbdImageHandle = *mut c_void;

#[link(name = "rados")]
extern "C" {
    fn rados_create(cluster: *mut RadosCluster, id: *const c_char) -> c_int;
    fn rados_conf_read_file(cluster: RadosCluster, path: *const c_char) -> c_int;
    fn rados_conf_parse_env(cluster: RadosCluster, var: *const c_char) -> c_int;
    fn rados_conf_set(cluster: RadosCluster, option: *const c_char, value: *const c_char) -> c_int;
    fn rados_conf_get(cluster: RadosCluster, option: *const c_char, buf: *mut c_char, len: usize) -> c_int;
    fn rados_connect(cluster: RadosCluster) -> c_int;
    fn rados_shutdown(cluster: RadosCluster);
    fn rados_ioctx_create(cluster: RadosCluster, pool_name: *const c_char, ioctx: *mut RadosIoctx) -> c_int;
    fn rados_ioctx_destroy(ioctx: RadosIoctx);
}

#[link(name = "rbd")]
extern "C" {
    fn rbd_open_read_only(
        ioctx: RadosIoctx,
        name: *const c_char,
        image: *mut RbdImageHandle,
        snap_name: *const c_char,
    ) -> c_int;
    fn rbd_close(image: RbdImageHandle) -> c_int;
    fn rbd_get_size(image: RbdImageHandle, size: *mut u64) -> c_int;
    fn rbd_get_id(image: RbdImageHandle, id: *mut c_char, id_len: usize) -> c_int;
    fn rbd_snap_get_id(image: RbdImageHandle, snap_name: *const c_char, snap_id: *mut u64) -> c_int;
    fn rbd_read(image: RbdImageHandle, offset: u64, len: usize, buf: *mut c_char) -> isize;
    fn rbd_diff_iterate2(
        image: RbdImageHandle,
        from_snapshot: *const c_char,
        offset: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        callback: Option<extern "C" fn(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int>,
        arg: *mut c_void,
    ) -> c_int;
}

/// Allocation is asked of librbd a window at a time and kept: a snapshot never changes, and
/// each question costs a round trip to the cluster per object in it.
const EXTENT_WINDOW: u64 = 4 << 20;

/// librbd's callback for `rbd_diff_iterate2`: collects the ranges that hold data.
extern "C" fn collect_data(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Mutex` that `window_data` passes to `rbd_diff_iterate2`, alive
    // until that call returns, which it does only after its last callback. librbd may call back
    // from its own threads (its completions), more than one at once with `rbd_op_threads` above
    // 1: a shared reference and the lock are all each callback takes.
    let ranges = unsafe { &*arg.cast::<Mutex<Vec<(u64, u64)>>>() };
    if exists != 0 {
        ranges.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push((offset, len as u64));
    }
    0
}

/// How long a request to an OSD or a monitor may take before it fails, in seconds: the HTTP
/// source's bound on one read.
const OP_TIMEOUTS: [(&str, &str); 2] = [("rados_osd_op_timeout", "30"), ("rados_mon_op_timeout", "30")];

/// Linux's EINVAL, which librbd returns negated.
const EINVAL: c_int = 22;

/// librados/librbd return negative errno values.
fn check(what: &str, code: c_int) -> Result<(), SourceError> {
    if code < 0 {
        let error = io::Error::from_raw_os_error(-code);
        return Err(SourceError::Remote { what: what.to_owned(), message: error.to_string() });
    }
    Ok(())
}

fn c_string(what: &str, s: &str) -> Result<CString, SourceError> {
    CString::new(s).map_err(|_| SourceError::Remote { what: what.to_owned(), message: "contains a NUL byte".into() })
}

/// The connection, pool context and image handle, released in reverse order.
pub struct RbdImage {
    cluster: RadosCluster,
    ioctx: RadosIoctx,
    image: RbdImageHandle,
    size: u64,
    name: String,
    /// The image's id and the snapshot's (see [`GoldenImage::identity`]).
    ids: String,
    fetch_bytes: u64,
    /// The ranges holding data in each [`EXTENT_WINDOW`] asked about so far, sorted; about 50
    /// bytes a window (13 MB for a 1 TiB image asked about everywhere).
    allocated: Mutex<HashMap<u64, Vec<(u64, u64)>>>,
}

// SAFETY: the handles are plain pointers to librados/librbd objects that those libraries
// synchronise internally (librbd serves one image from many threads, as qemu's iothreads do);
// this type never hands them out, and only `drop`, which has exclusive access, closes them.
unsafe impl Send for RbdImage {}
// SAFETY: as above: concurrent `rbd_read` calls on one open image are supported by librbd.
unsafe impl Sync for RbdImage {}

impl RbdImage {
    /// Connects as `client.<id>` with `conf` (or librados' default search and `CEPH_ARGS`), and
    /// opens `pool/image@snapshot` read-only.
    pub fn open(
        conf: Option<&Path>,
        id: &str,
        pool: &str,
        image: &str,
        snapshot: &str,
        fetch_bytes: u64,
    ) -> Result<Self, SourceError> {
        let name = format!("rbd:{pool}/{image}@{snapshot}");
        let mut this = Self {
            cluster: ptr::null_mut(),
            ioctx: ptr::null_mut(),
            image: ptr::null_mut(),
            size: 0,
            name,
            ids: String::new(),
            fetch_bytes,
            allocated: Mutex::default(),
        };
        let id = c_string("ceph client id", id)?;
        // SAFETY: `this.cluster` is a valid out-pointer; `id` is a NUL-terminated string that
        // outlives the call. On failure the handle stays null and `drop` skips it.
        check("creating the rados handle", unsafe { rados_create(&mut this.cluster, id.as_ptr()) })?;
        match conf {
            Some(path) => {
                let path = c_string("ceph.conf path", &path.to_string_lossy())?;
                // SAFETY: the cluster handle was created above; `path` is NUL-terminated.
                check("reading ceph.conf", unsafe { rados_conf_read_file(this.cluster, path.as_ptr()) })?;
            }
            // SAFETY: a null path asks librados for its default search (CEPH_CONF, /etc/ceph).
            None => check("reading ceph.conf", unsafe { rados_conf_read_file(this.cluster, ptr::null()) })?,
        }
        // SAFETY: a null variable name means CEPH_ARGS, which may be unset.
        check("parsing CEPH_ARGS", unsafe { rados_conf_parse_env(this.cluster, ptr::null()) })?;
        // librados waits for ever by default on an OSD or monitor that does not answer (PGs
        // inactive, `ceph osd pause`), and every VM reading the chunk being fetched with it: a
        // read fails with EIO after a while instead, unless ceph.conf or CEPH_ARGS chose (a value
        // set here would outrank theirs).
        for (option, value) in OP_TIMEOUTS {
            let option = c_string("a librados option", option)?;
            let mut current = [0u8; 32];
            // SAFETY: a configured cluster handle; `option` NUL-terminated; `current` a writable
            // buffer of the length given, which librados fills with a NUL-terminated value.
            let got =
                unsafe { rados_conf_get(this.cluster, option.as_ptr(), current.as_mut_ptr().cast(), current.len()) };
            // "0", however it is written ("0", "0.000000", "0s"): no timeout.
            let said = std::ffi::CStr::from_bytes_until_nul(&current).ok().and_then(|v| v.to_str().ok());
            let unset = got == 0 && said.and_then(|v| v.trim_end_matches('s').parse::<f64>().ok()) == Some(0.0);
            if unset {
                let value = c_string("its value", value)?;
                // SAFETY: as above, the cluster not yet connected; both strings NUL-terminated
                // and alive for the call.
                check("setting a librados timeout", unsafe {
                    rados_conf_set(this.cluster, option.as_ptr(), value.as_ptr())
                })?;
            }
        }
        // SAFETY: a configured, not yet connected cluster handle.
        check("connecting to the Ceph cluster", unsafe { rados_connect(this.cluster) })?;
        let pool_c = c_string("pool name", pool)?;
        // SAFETY: connected cluster; `pool_c` NUL-terminated; `this.ioctx` a valid out-pointer.
        check(&format!("opening pool {pool}"), unsafe {
            rados_ioctx_create(this.cluster, pool_c.as_ptr(), &mut this.ioctx)
        })?;
        let image_c = c_string("image name", image)?;
        let snapshot_c = c_string("snapshot name", snapshot)?;
        // SAFETY: valid pool context; names NUL-terminated and alive for the call; out-pointer valid.
        check(&format!("opening {}", this.name), unsafe {
            rbd_open_read_only(this.ioctx, image_c.as_ptr(), &mut this.image, snapshot_c.as_ptr())
        })?;
        let mut size = 0u64;
        // SAFETY: an open image handle and a valid out-pointer.
        check(&format!("sizing {}", this.name), unsafe { rbd_get_size(this.image, &mut size) })?;
        this.size = size;
        // Ids are made once, at creation: a snapshot deleted and made again under its name (or
        // an image under its name) gets new ones, and must not pass for the old.
        let mut image_id = [0u8; 64];
        // SAFETY: an open image handle; `image_id` is a writable buffer of the length given,
        // which librbd fills with a NUL-terminated id (ERANGE if it does not fit).
        let code = unsafe { rbd_get_id(this.image, image_id.as_mut_ptr().cast::<c_char>(), image_id.len()) };
        let image_id = if code == -EINVAL {
            // A format 1 image has no id; its snapshot's id still tells a remade snapshot apart.
            "none".to_owned()
        } else {
            check(&format!("the id of {}", this.name), code)?;
            std::ffi::CStr::from_bytes_until_nul(&image_id).map_or_else(
                |_| String::from_utf8_lossy(&image_id).into_owned(),
                |id| id.to_string_lossy().into_owned(),
            )
        };
        let mut snapshot_id = 0u64;
        // SAFETY: an open image handle, a NUL-terminated name alive for the call, a valid out-pointer.
        check(&format!("the snapshot id of {}", this.name), unsafe {
            rbd_snap_get_id(this.image, snapshot_c.as_ptr(), &mut snapshot_id)
        })?;
        this.ids = format!("image id {image_id} snap id {snapshot_id}");
        tracing::info!(image = %this.name, size, ids = %this.ids, "RBD golden image opened");
        Ok(this)
    }
}

/// Whether `recorded` names snapshot `name` with `ids`: servers before the ids recorded the
/// name alone, which is still taken for what it promised then (the snapshot of that name).
fn identity_matches(name: &str, ids: &str, recorded: &str) -> bool {
    recorded == name || recorded.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')) == Some(ids)
}

impl RbdImage {
    /// The ranges of window `window` that hold data (parents included for a clone), sorted and
    /// merged, from librbd the first time.
    fn window_data(&self, window: u64) -> io::Result<Vec<(u64, u64)>> {
        let known = self.allocated.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&window).cloned();
        if let Some(ranges) = known {
            return Ok(ranges);
        }
        let start = window * EXTENT_WINDOW;
        let len = EXTENT_WINDOW.min(self.size.saturating_sub(start));
        let found: Mutex<Vec<(u64, u64)>> = Mutex::default();
        // SAFETY: the image is open for the life of `self`; a null snapshot name asks for
        // everything allocated; `found` outlives the call, and `collect_data` only locks it.
        let code = unsafe {
            rbd_diff_iterate2(
                self.image,
                ptr::null(),
                start,
                len,
                1,
                0,
                Some(collect_data),
                (&found as *const Mutex<Vec<(u64, u64)>>).cast_mut().cast::<c_void>(),
            )
        };
        if code < 0 {
            let error = io::Error::from_raw_os_error(-code);
            return Err(io::Error::new(error.kind(), format!("{}: allocation at {start}: {error}", self.name)));
        }
        let mut found = found.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
        found.sort_unstable();
        let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(found.len());
        for (offset, len) in found {
            match ranges.last_mut() {
                Some((last, last_len)) if *last + *last_len >= offset => {
                    *last_len = (*last_len).max(offset + len - *last);
                }
                _ => ranges.push((offset, len)),
            }
        }
        self.allocated.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(window, ranges.clone());
        Ok(ranges)
    }
}

impl GoldenImage for RbdImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = crate::within_image(buf, offset, self.size);
        let mut done = 0usize;
        while done < len {
            // SAFETY: the image is open for the life of `self`; the destination is the
            // `len - done` bytes of `buf` after `done`, all within `buf`.
            let n = unsafe {
                rbd_read(self.image, offset + done as u64, len - done, buf[done..].as_mut_ptr().cast::<c_char>())
            };
            if n < 0 {
                let error = io::Error::from_raw_os_error(-n as i32);
                return Err(io::Error::new(error.kind(), format!("{}: read at {offset}: {error}", self.name)));
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("{}: short read", self.name)));
            }
            done += n as usize;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn identity(&self) -> Option<String> {
        Some(format!("{} {}", self.name, self.ids))
    }

    fn matches_identity(&self, recorded: &str) -> bool {
        identity_matches(&self.name, &self.ids, recorded)
    }

    fn preferred_fetch_bytes(&self) -> Option<u64> {
        Some(self.fetch_bytes)
    }

    /// What librbd says is allocated is data; the rest of the snapshot (never written, or
    /// discarded) is a hole and reads as zeroes.
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.size);
        let mut extents = Vec::new();
        let mut at = offset;
        while at < end {
            let window = at / EXTENT_WINDOW;
            let window_end = ((window + 1) * EXTENT_WINDOW).min(end);
            for (start, length) in self.window_data(window)? {
                let (from, to) = (start.max(at), (start + length).min(window_end));
                if from >= to {
                    continue;
                }
                push_extent(&mut extents, from - at, Allocation::Hole);
                push_extent(&mut extents, to - from, Allocation::Data);
                at = to;
            }
            push_extent(&mut extents, window_end - at, Allocation::Hole);
            at = window_end;
        }
        Ok(extents)
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        // SAFETY: each handle is closed at most once, in reverse order of opening, and only if
        // it was opened; nothing else holds them (`&mut self`).
        unsafe {
            if !self.image.is_null() {
                rbd_close(self.image);
            }
            if !self.ioctx.is_null() {
                rados_ioctx_destroy(self.ioctx);
            }
            if !self.cluster.is_null() {
                rados_shutdown(self.cluster);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_made_again_under_its_name_is_another() {
        let name = "rbd:rbd/golden@v1";
        let ids = "image id 10a2b3c4d5e6 snap id 4";
        assert!(identity_matches(name, ids, &format!("{name} {ids}")));
        assert!(identity_matches(name, ids, name), "recorded by a server before the ids");
        assert!(!identity_matches(name, ids, &format!("{name} image id 10a2b3c4d5e6 snap id 5")));
        assert!(!identity_matches(name, ids, &format!("{name} image id 99 snap id 4")));
        assert!(!identity_matches(name, ids, "rbd:rbd/golden@v2"));
        assert!(!identity_matches(name, ids, &format!("{name}x {ids}")));
    }
}
