//! Page-locked host memory for streamed experts (docs/placement.md §9, "Host tier and
//! read-ahead"): the host tier's reader threads `pread` a unit straight into a
//! [`PinnedSlab`], and [`GpuBackend::write_slab_mats`] queues its matrices' copies to the
//! slot pools on the kernels' stream. Compared with `write_weight_mat` (a host wait, then
//! a synchronous copy out of pageable memory, which the driver stages through a pinned
//! bounce buffer), nothing waits and the copy engine reads the bytes where they are.
//!
//! Ownership is the safety argument: while its copies may be in flight the backend holds
//! the slab (`GpuBackend::lent_slabs`, stamped with the count of host waits so far) and
//! gives it back only after a later host wait for the stream
//! ([`GpuBackend::reclaim_slabs`]), so no reader refills memory the device still reads.

use std::any::Any;
use std::ptr::NonNull;

use ds4_engine::backend::{
    slab_mat_bytes, BResult, BackendError, HeapSlab, HostSlab, SlabMat, TaggedSlabs,
};
use ds4_engine::validate;
use ds4_gguf::GgmlType;
use ds4_placement::MemKind;

use super::{gerr, GpuBackend, Storage};
use crate::api::{DeviceBuffer, GpuApi};

/// One page-locked host allocation and its host mapping.
pub(crate) struct PinnedSlab<B> {
    buf: B,
    ptr: NonNull<u8>,
    len: usize,
}

/// A slab the backend holds while copies out of it may be in flight.
pub(crate) struct LentSlab<B> {
    /// Host waits for the stream when it was stored: free once the count has passed it.
    waits: u64,
    /// The caller's tag, given back with it.
    tag: u64,
    slab: Box<PinnedSlab<B>>,
}

// SAFETY: `ptr` is the host mapping of `buf`, which the slab owns and frees with itself;
// the bytes are touched only through the slab (its owner) or by copies the backend queued
// while it held the slab, and it keeps the slab until those have completed.
unsafe impl<B: Send> Send for PinnedSlab<B> {}

impl<B: DeviceBuffer + 'static> HostSlab for PinnedSlab<B> {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is the live host mapping of `buf` (see the Send note);
        // `&self` excludes a writer through `bytes_mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only access, and no device
        // copy reads the range while anyone but the backend holds the slab.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
    fn pinned(&self) -> bool {
        true
    }
}

impl<D: GpuApi> GpuBackend<D> {
    /// Page-locked memory of `bytes` (zeroed), or heap memory once the system has refused
    /// page-locked memory (then writes copy and wait, as before).
    pub(crate) fn alloc_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>> {
        const OP: &str = "alloc_host_slab";
        if self.slabs_pinned && bytes > 0 {
            match self.dev.alloc(MemKind::PinnedHost, bytes) {
                Ok(mut buf) if buf.kind() == MemKind::PinnedHost => {
                    // SAFETY: a fresh allocation: no queued or running work touches it.
                    let host = unsafe { buf.host_range_unsynced(0, bytes) }.map_err(gerr(OP))?;
                    if let Some(h) = host {
                        h.fill(0);
                        if let Some(ptr) = NonNull::new(h.as_mut_ptr()) {
                            return Ok(Box::new(PinnedSlab {
                                buf,
                                ptr,
                                len: bytes,
                            }));
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::info!(
                    "streamed experts: page-locked host memory refused ({e}); the host tier \
                     uses ordinary memory"
                ),
            }
            self.slabs_pinned = false;
        }
        Ok(Box::new(HeapSlab::zeroed(bytes)))
    }

    /// [`ds4_engine::Backend::write_weight_mats`]: a pinned slab's matrices as queued
    /// copies (the slab stays here until they have completed); any other slab through
    /// `write_weight_mat`'s waiting copies.
    pub(crate) fn write_slab_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>> {
        const OP: &str = "write_weight_mats";
        if !(&*slab as &dyn Any).is::<PinnedSlab<D::Buffer>>() {
            for m in mats {
                self.write_pool_mat(m.weight, m.mat, slab_mat_bytes(&*slab, m)?)?;
            }
            return Ok(Some(slab));
        }
        let slab: Box<PinnedSlab<D::Buffer>> =
            (slab as Box<dyn Any>)
                .downcast()
                .map_err(|_| BackendError::Invalid {
                    op: OP,
                    problem: "a pinned slab of another runtime".into(),
                })?;
        // Every check before the first copy: a refused call queues nothing and returns
        // the slab's memory to the allocator at once.
        let mut copies = Vec::with_capacity(mats.len());
        for m in mats {
            let raw = slab_mat_bytes(&*slab, m)?;
            let bytes = validate::write_weight_mat(m.weight, m.mat, raw.len())?;
            let gw = self.weight(m.weight, OP)?;
            if !matches!(gw.storage, Some(Storage::Own(_))) {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!("weight {} is not a slot pool", gw.name),
                });
            }
            copies.push((m.weight, m.mat * bytes, m.range.clone()));
        }
        let queued = self.queue_slab_copies(&slab, &copies);
        // Held until a host wait, also after a failed copy (an earlier one may be queued).
        self.lent_slabs.push(LentSlab {
            waits: self.host_waits,
            tag,
            slab,
        });
        queued?;
        Ok(None)
    }

    fn queue_slab_copies(
        &mut self,
        slab: &PinnedSlab<D::Buffer>,
        copies: &[(ds4_engine::Weight, usize, std::ops::Range<usize>)],
    ) -> BResult<()> {
        const OP: &str = "write_weight_mats";
        for (w, offset, range) in copies {
            let Some(Storage::Own(dst)) = &self.weights[w.id() as usize].storage else {
                return Err(BackendError::Invalid {
                    op: OP,
                    problem: format!("weight #{} is not a slot pool", w.id()),
                });
            };
            // SAFETY: `slab` is pushed to `lent_slabs` right after this call and handed
            // back only after a later host wait for the stream, so its range stays
            // allocated and unmodified until the queued copy has read it.
            unsafe {
                self.dev
                    .queue_upload(&slab.buf, range.start, dst, *offset, range.len())
            }
            .map_err(gerr(OP))?;
            if w.info.ty == GgmlType::Q8_0 {
                let ptr = dst.device_address() + *offset as u64;
                self.split_q8_0_rows(ptr, w.info.rows(), w.info.cols())?;
            }
        }
        Ok(())
    }

    /// [`ds4_engine::Backend::reclaim_host_slabs`]: the held slabs stored before the last
    /// host wait (all of them, after waiting, with `wait`).
    pub(crate) fn reclaim_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs> {
        if wait && self.lent_slabs.iter().any(|l| l.waits >= self.host_waits) {
            self.sync()?;
        }
        let now = self.host_waits;
        let (done, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.lent_slabs)
            .into_iter()
            .partition(|l| l.waits < now);
        self.lent_slabs = kept;
        Ok(done
            .into_iter()
            .map(|l| (l.tag, l.slab as Box<dyn HostSlab>))
            .collect())
    }
}
