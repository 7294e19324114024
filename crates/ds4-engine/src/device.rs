//! What a backend implements ([`Device`]), the one checked entry the engine reaches it
//! through ([`Backend`]), and the forwarding base of wrapper backends ([`Forward`]).
//!
//! Why three traits over one op list: the argument checks of [`crate::validate`] must run
//! before every op of every backend, and a check a backend has to remember to call is one
//! it can forget (the compiler would not notice). So a backend writes its ops as a
//! `Device`, and the only implementation of [`Backend`] is the blanket one below, which
//! runs the op's check and then the device's op; tests and tools that drive a backend
//! directly go through it too. A backend keeps only the checks that only it can make (a
//! live handle, its own capacity limits).
//!
//! A wrapper (the reference controls, the imatrix collector, test doubles) forwards nearly
//! every op to the backend it wraps and changes a few. It implements
//! [`Forward`], writes the ops it intercepts and nothing else, and is a `Device` (hence a
//! checked `Backend`) through the second blanket impl. Its fused ops run as their
//! sequences of [`crate::fused`] through the wrapper itself, so an op it intercepts is
//! seen wherever the engine uses it, inside a fused op or alone; everything else (memory,
//! weights, instrumentation, settings) goes straight to the wrapped backend. The op mirror
//! intercepts every op (it runs each on two backends), so it is a `Device` itself.
//!
//! Each method is the [`Backend`] method of the same name, documented there.

use std::sync::Arc;

use ds4_gguf::GgufFile;

use crate::backend::*;
use crate::validate;

/// The ops of a backend, unchecked: implement this, and the blanket impl makes the type a
/// [`Backend`] whose every op is checked first. The fused ops default to their sequences of
/// primitive ops ([`crate::fused`]); a backend overrides the ones it runs in fewer passes.
/// Call these only through [`Backend`] (the defaults do).
pub trait Device: Send {
    fn name(&self) -> String;
    fn warms_up(&self) -> bool {
        false
    }
    fn alloc(&mut self, len: usize) -> BResult<Buf>;
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf>;
    fn free(&mut self, buf: Buf);
    fn free_i32(&mut self, buf: IBuf);
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()>;
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()>;
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()>;
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()>;
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()>;
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()>;
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight>;
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        list.iter()
            .map(|(name, usage)| Backend::load_weight(self, file, name, *usage))
            .collect()
    }
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        let _ = info;
        Err(BackendError::Weight {
            name: name.to_string(),
            problem: format!(
                "backend {} cannot hold streamed experts",
                Backend::name(self)
            ),
        })
    }
    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        let _ = (w, mat, raw);
        Err(BackendError::Invalid {
            op: "write_weight_mat",
            problem: format!(
                "backend {} cannot hold streamed experts",
                Backend::name(self)
            ),
        })
    }
    fn alloc_host_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>> {
        Ok(Box::new(HeapSlab::zeroed(bytes)))
    }
    fn write_weight_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>> {
        let _ = tag;
        for m in mats {
            Backend::write_weight_mat(self, m.weight, m.mat, slab_mat_bytes(&*slab, m)?)?;
        }
        Ok(Some(slab))
    }
    fn reclaim_host_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs> {
        let _ = wait;
        Ok(Vec::new())
    }
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()>;
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()>;
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()>;
    fn rope(&mut self, x: Slice, args: RopeArgs) -> BResult<()>;
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()>;
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()>;
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()>;
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()>;
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()>;
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()>;
    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()>;
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
    ) -> BResult<()>;
    #[allow(clippy::too_many_arguments)]
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: CompressorArgs,
        rows: Slice,
    ) -> BResult<()>;
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: IndexerArgs,
        out: IBuf,
    ) -> BResult<()>;
    fn compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()> {
        crate::fused::compressor_batch(self, calls)
    }
    fn indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()> {
        crate::fused::indexer_topk_batch(self, calls)
    }
    fn attention(&mut self, args: AttnArgs) -> BResult<()>;
    fn attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        crate::fused::attention_batch(self, args)
    }
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()>;
    fn ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()> {
        crate::fused::ring_store_batch(self, calls)
    }
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()>;
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()>;
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        crate::fused::matmul_pair(self, wa, wb, x, n_tok, ya, yb)
    }
    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[MatmulPair],
    ) -> BResult<()> {
        crate::fused::matmul_set(self, x, n_tok, singles, pairs)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::hc_pre_norm(self, mix, x, base, scale, args, norm, y, post, comb, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::hc_mix_pre_norm(
            self, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::hc_post_mix_pre_norm(
            self, prev, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        crate::fused::norm_rope(self, x, w, eps, rope, fp8_dims)
    }
    fn compressor_pair(&mut self, a: CompressorCall, b: CompressorCall) -> BResult<()> {
        crate::fused::compressor_pair(self, a, b)
    }
    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()> {
        crate::fused::norm_rope_pair(self, a, b)
    }
    #[allow(clippy::too_many_arguments)]
    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        crate::fused::router_matmul(self, w, x, logits, routing, args, ids, weights)
    }
    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        crate::fused::rope_qat_hadamard_fp4(self, x, rope, rows, width)
    }
    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: RingStoreCall,
    ) -> BResult<()> {
        crate::fused::norm_rope_pair_store(self, a, b, store)
    }
    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        crate::fused::rope_matmul_grouped(self, x, rope, w, groups, n_tok, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::rms_norm_matmul(self, x, norm, eps, h, w, n_tok, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::swiglu_matmul(self, gate, up, clamp, h, w, n_tok, out)
    }
    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        crate::fused::hc_post_add(self, x, f, f2, post, comb, args)
    }
    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        crate::fused::argmax(self, x, out)
    }
    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()> {
        crate::fused::logit_band(self, x, span, exclude, out)
    }
    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        crate::fused::logit_bands(self, x, n, jobs)
    }
    fn annotate(&mut self, _tag: &'static str) {}
    fn set_profiling(&mut self, _on: bool) -> BResult<bool> {
        Ok(false)
    }
    fn take_profile(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>> {
        Ok(None)
    }
    fn begin_capture(&mut self) -> BResult<bool> {
        Ok(false)
    }
    fn end_capture_replay(&mut self, _replays: usize) -> BResult<GraphTiming> {
        Err(BackendError::Invalid {
            op: "end_capture_replay",
            problem: format!("the {} backend records no graphs", Backend::name(self)),
        })
    }
    fn counters(&self) -> Counters {
        Counters::default()
    }
    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        if on {
            return Err(BackendError::Invalid {
                op: "set_activation_q8",
                problem: "this backend has no int8-activation matmuls".into(),
            });
        }
        Ok(())
    }
    fn moe_joint_min_rows(
        &self,
        gate: Weight,
        up: Weight,
        down: Weight,
        k: usize,
    ) -> Option<usize> {
        let _ = (gate, up, down, k);
        None
    }
    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        if n > 1 {
            return Err(BackendError::Invalid {
                op: "set_decode_rows",
                problem: format!("this backend has no batched decode ({n} rows)"),
            });
        }
        Ok(())
    }
}

/// The one implementation of [`Backend`]: the op's check of [`crate::validate`], then the
/// device's op. Fused ops check their whole argument list up front (the checks of the ops
/// they fuse), so a fused device kernel never sees a call its sequence would refuse.
impl<D: Device + ?Sized> Backend for D {
    fn name(&self) -> String {
        Device::name(self)
    }
    fn warms_up(&self) -> bool {
        Device::warms_up(self)
    }
    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        Device::alloc(self, len)
    }
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        Device::alloc_i32(self, len)
    }
    fn free(&mut self, buf: Buf) {
        Device::free(self, buf)
    }
    fn free_i32(&mut self, buf: IBuf) {
        Device::free_i32(self, buf)
    }
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        validate::upload(dst, src.len())?;
        Device::upload(self, dst, src)
    }
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        validate::download(src, dst.len())?;
        Device::download(self, src, dst)
    }
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        validate::upload_i32(dst, off, src.len())?;
        Device::upload_i32(self, dst, off, src)
    }
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        validate::download_i32(src, off, dst.len())?;
        Device::download_i32(self, src, off, dst)
    }
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        validate::copy(src, dst)?;
        Device::copy(self, src, dst)
    }
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        validate::fill(dst)?;
        Device::fill(self, dst, value)
    }
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        Device::load_weight(self, file, name, usage)
    }
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        Device::load_weights(self, file, list)
    }
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        Device::alloc_weight(self, name, info)
    }
    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        Device::write_weight_mat(self, w, mat, raw)
    }
    fn alloc_host_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>> {
        Device::alloc_host_slab(self, bytes)
    }
    fn write_weight_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>> {
        Device::write_weight_mats(self, slab, tag, mats)
    }
    fn reclaim_host_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs> {
        Device::reclaim_host_slabs(self, wait)
    }
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        validate::matmul(w, mat, x, n_tok, y)?;
        Device::matmul(self, w, mat, x, n_tok, y)
    }
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        validate::matmul_grouped(w, groups, x, n_tok, y)?;
        Device::matmul_grouped(self, w, groups, x, n_tok, y)
    }
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        validate::rms_norm(x, w, rows, width, out)?;
        Device::rms_norm(self, x, w, rows, width, eps, out)
    }
    fn rope(&mut self, x: Slice, args: RopeArgs) -> BResult<()> {
        validate::rope(x, &args)?;
        Device::rope(self, x, args)
    }
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        validate::add(acc, x)?;
        Device::add(self, acc, x)
    }
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        validate::swiglu(gate, up, out)?;
        Device::swiglu(self, gate, up, clamp, out)
    }
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        validate::qat_fp8(x, rows, width, n_dims)?;
        Device::qat_fp8(self, x, rows, width, n_dims)
    }
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        validate::qat_hadamard_fp4(x, rows, width)?;
        Device::qat_hadamard_fp4(self, x, rows, width)
    }
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        validate::embed(table, tokens, n_tok, n_streams, out)?;
        Device::embed(self, table, tokens, n_tok, n_streams, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()> {
        validate::hc_pre(mix, x, base, scale, &args, y, post, comb)?;
        Device::hc_pre(self, mix, x, base, scale, args, y, post, comb)
    }
    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        validate::hc_post(x, f, post, comb, &args)?;
        Device::hc_post(self, x, f, post, comb, args)
    }
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
    ) -> BResult<()> {
        validate::hc_head(mix, x, base, scale, &args, y)?;
        Device::hc_head(self, mix, x, base, scale, args, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        validate::compressor(acc, u, z, ape, &args, rows)?;
        Device::compressor(self, acc, u, z, ape, args, rows)
    }
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        validate::indexer_topk(q, w, rows, &args, out)?;
        Device::indexer_topk(self, q, w, rows, args, out)
    }
    fn compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()> {
        validate::compressor_batch(calls)?;
        Device::compressor_batch(self, calls)
    }
    fn indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()> {
        validate::indexer_topk_batch(calls)?;
        Device::indexer_topk_batch(self, calls)
    }
    fn attention(&mut self, args: AttnArgs) -> BResult<()> {
        validate::attention(&args)?;
        Device::attention(self, args)
    }
    fn attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        validate::attention_batch(args)?;
        Device::attention_batch(self, args)
    }
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        validate::ring_store(ring, kv, n_tok, window)?;
        Device::ring_store(self, ring, kv, pos0, n_tok, window)
    }
    fn ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()> {
        validate::ring_store_batch(calls)?;
        Device::ring_store_batch(self, calls)
    }
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        validate::router(logits, &routing, &args, ids, weights)?;
        Device::router(self, logits, routing, args, ids, weights)
    }
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        validate::moe(x, ids, weights, gate, up, down, &args, out)?;
        Device::moe(self, x, ids, weights, gate, up, down, args, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        validate::matmul_pair(wa, wb, x, n_tok, ya, yb)?;
        Device::matmul_pair(self, wa, wb, x, n_tok, ya, yb)
    }
    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[MatmulPair],
    ) -> BResult<()> {
        validate::matmul_set(x, n_tok, singles, pairs)?;
        Device::matmul_set(self, x, n_tok, singles, pairs)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        validate::hc_pre_norm(mix, x, base, scale, &args, norm, y, post, comb, out)?;
        Device::hc_pre_norm(self, mix, x, base, scale, args, norm, y, post, comb, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        validate::hc_mix_pre_norm(fn_, x, mix, base, scale, &args, norm, y, post, comb, out)?;
        Device::hc_mix_pre_norm(
            self, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        validate::hc_post_mix_pre_norm(
            &prev, fn_, x, mix, base, scale, &args, norm, y, post, comb, out,
        )?;
        Device::hc_post_mix_pre_norm(
            self, prev, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        validate::norm_rope(x, w, &rope, fp8_dims)?;
        Device::norm_rope(self, x, w, eps, rope, fp8_dims)
    }
    fn compressor_pair(&mut self, a: CompressorCall, b: CompressorCall) -> BResult<()> {
        validate::compressor_pair(&a, &b)?;
        Device::compressor_pair(self, a, b)
    }
    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()> {
        validate::norm_rope_pair(&a, &b)?;
        Device::norm_rope_pair(self, a, b)
    }
    #[allow(clippy::too_many_arguments)]
    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        validate::router_matmul(w, x, logits, &routing, &args, ids, weights)?;
        Device::router_matmul(self, w, x, logits, routing, args, ids, weights)
    }
    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        validate::rope_qat_hadamard_fp4(x, &rope, rows, width)?;
        Device::rope_qat_hadamard_fp4(self, x, rope, rows, width)
    }
    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: RingStoreCall,
    ) -> BResult<()> {
        validate::norm_rope_pair_store(&a, &b, &store)?;
        Device::norm_rope_pair_store(self, a, b, store)
    }
    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        validate::rope_matmul_grouped(x, &rope, w, groups, n_tok, y)?;
        Device::rope_matmul_grouped(self, x, rope, w, groups, n_tok, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        validate::rms_norm_matmul(x, norm, h, w, n_tok, out)?;
        Device::rms_norm_matmul(self, x, norm, eps, h, w, n_tok, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        validate::swiglu_matmul(gate, up, h, w, n_tok, out)?;
        Device::swiglu_matmul(self, gate, up, clamp, h, w, n_tok, out)
    }
    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        validate::hc_post_add(x, f, f2, post, comb, &args)?;
        Device::hc_post_add(self, x, f, f2, post, comb, args)
    }
    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        validate::argmax(x, out)?;
        Device::argmax(self, x, out)
    }
    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()> {
        validate::logit_band(x, span, out)?;
        Device::logit_band(self, x, span, exclude, out)
    }
    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        validate::logit_bands(x, n, jobs)?;
        Device::logit_bands(self, x, n, jobs)
    }
    fn annotate(&mut self, tag: &'static str) {
        Device::annotate(self, tag)
    }
    fn set_profiling(&mut self, on: bool) -> BResult<bool> {
        Device::set_profiling(self, on)
    }
    fn take_profile(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>> {
        Device::take_profile(self)
    }
    fn begin_capture(&mut self) -> BResult<bool> {
        Device::begin_capture(self)
    }
    fn end_capture_replay(&mut self, replays: usize) -> BResult<GraphTiming> {
        Device::end_capture_replay(self, replays)
    }
    fn counters(&self) -> Counters {
        Device::counters(self)
    }
    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        Device::set_activation_q8(self, on)
    }
    fn moe_joint_min_rows(
        &self,
        gate: Weight,
        up: Weight,
        down: Weight,
        k: usize,
    ) -> Option<usize> {
        Device::moe_joint_min_rows(self, gate, up, down, k)
    }
    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        Device::set_decode_rows(self, n)
    }
}

/// A backend that wraps another ([`Self::inner`]) and forwards every op to it but the ones
/// it overrides. Fused ops default to their sequences through `self` (see the module doc),
/// so overriding a primitive op changes it inside the fused ops too.
pub trait Forward: Send {
    /// The wrapped backend.
    fn inner(&self) -> &dyn Backend;
    /// The wrapped backend, for the ops.
    fn inner_mut(&mut self) -> &mut dyn Backend;

    fn name(&self) -> String {
        self.inner().name()
    }
    fn warms_up(&self) -> bool {
        self.inner().warms_up()
    }
    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        self.inner_mut().alloc(len)
    }
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        self.inner_mut().alloc_i32(len)
    }
    fn free(&mut self, buf: Buf) {
        self.inner_mut().free(buf)
    }
    fn free_i32(&mut self, buf: IBuf) {
        self.inner_mut().free_i32(buf)
    }
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        self.inner_mut().upload(dst, src)
    }
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        self.inner_mut().download(src, dst)
    }
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        self.inner_mut().upload_i32(dst, off, src)
    }
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        self.inner_mut().download_i32(src, off, dst)
    }
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        self.inner_mut().copy(src, dst)
    }
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        self.inner_mut().fill(dst, value)
    }
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        self.inner_mut().load_weight(file, name, usage)
    }
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        self.inner_mut().load_weights(file, list)
    }
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        self.inner_mut().alloc_weight(name, info)
    }
    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        self.inner_mut().write_weight_mat(w, mat, raw)
    }
    fn alloc_host_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>> {
        self.inner_mut().alloc_host_slab(bytes)
    }
    fn write_weight_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>> {
        self.inner_mut().write_weight_mats(slab, tag, mats)
    }
    fn reclaim_host_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs> {
        self.inner_mut().reclaim_host_slabs(wait)
    }
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        self.inner_mut().matmul(w, mat, x, n_tok, y)
    }
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        self.inner_mut().matmul_grouped(w, groups, x, n_tok, y)
    }
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        self.inner_mut().rms_norm(x, w, rows, width, eps, out)
    }
    fn rope(&mut self, x: Slice, args: RopeArgs) -> BResult<()> {
        self.inner_mut().rope(x, args)
    }
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        self.inner_mut().add(acc, x)
    }
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        self.inner_mut().swiglu(gate, up, clamp, out)
    }
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        self.inner_mut().qat_fp8(x, rows, width, n_dims)
    }
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        self.inner_mut().qat_hadamard_fp4(x, rows, width)
    }
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        self.inner_mut().embed(table, tokens, n_tok, n_streams, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()> {
        self.inner_mut()
            .hc_pre(mix, x, base, scale, args, y, post, comb)
    }
    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        self.inner_mut().hc_post(x, f, post, comb, args)
    }
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
    ) -> BResult<()> {
        self.inner_mut().hc_head(mix, x, base, scale, args, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        self.inner_mut().compressor(acc, u, z, ape, args, rows)
    }
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        self.inner_mut().indexer_topk(q, w, rows, args, out)
    }
    fn compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()> {
        crate::fused::compressor_batch(self, calls)
    }
    fn indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()> {
        crate::fused::indexer_topk_batch(self, calls)
    }
    fn attention(&mut self, args: AttnArgs) -> BResult<()> {
        self.inner_mut().attention(args)
    }
    fn attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        crate::fused::attention_batch(self, args)
    }
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        self.inner_mut().ring_store(ring, kv, pos0, n_tok, window)
    }
    fn ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()> {
        crate::fused::ring_store_batch(self, calls)
    }
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        self.inner_mut().router(logits, routing, args, ids, weights)
    }
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        self.inner_mut()
            .moe(x, ids, weights, gate, up, down, args, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        crate::fused::matmul_pair(self, wa, wb, x, n_tok, ya, yb)
    }
    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[MatmulPair],
    ) -> BResult<()> {
        crate::fused::matmul_set(self, x, n_tok, singles, pairs)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::hc_pre_norm(self, mix, x, base, scale, args, norm, y, post, comb, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::hc_mix_pre_norm(
            self, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::hc_post_mix_pre_norm(
            self, prev, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        crate::fused::norm_rope(self, x, w, eps, rope, fp8_dims)
    }
    fn compressor_pair(&mut self, a: CompressorCall, b: CompressorCall) -> BResult<()> {
        crate::fused::compressor_pair(self, a, b)
    }
    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()> {
        crate::fused::norm_rope_pair(self, a, b)
    }
    #[allow(clippy::too_many_arguments)]
    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        crate::fused::router_matmul(self, w, x, logits, routing, args, ids, weights)
    }
    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        crate::fused::rope_qat_hadamard_fp4(self, x, rope, rows, width)
    }
    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: RingStoreCall,
    ) -> BResult<()> {
        crate::fused::norm_rope_pair_store(self, a, b, store)
    }
    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        crate::fused::rope_matmul_grouped(self, x, rope, w, groups, n_tok, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::rms_norm_matmul(self, x, norm, eps, h, w, n_tok, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        crate::fused::swiglu_matmul(self, gate, up, clamp, h, w, n_tok, out)
    }
    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        crate::fused::hc_post_add(self, x, f, f2, post, comb, args)
    }
    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        crate::fused::argmax(self, x, out)
    }
    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()> {
        crate::fused::logit_band(self, x, span, exclude, out)
    }
    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        crate::fused::logit_bands(self, x, n, jobs)
    }
    fn annotate(&mut self, tag: &'static str) {
        self.inner_mut().annotate(tag)
    }
    fn set_profiling(&mut self, on: bool) -> BResult<bool> {
        self.inner_mut().set_profiling(on)
    }
    fn take_profile(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>> {
        self.inner_mut().take_profile()
    }
    fn begin_capture(&mut self) -> BResult<bool> {
        self.inner_mut().begin_capture()
    }
    fn end_capture_replay(&mut self, replays: usize) -> BResult<GraphTiming> {
        self.inner_mut().end_capture_replay(replays)
    }
    fn counters(&self) -> Counters {
        self.inner().counters()
    }
    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        self.inner_mut().set_activation_q8(on)
    }
    fn moe_joint_min_rows(
        &self,
        gate: Weight,
        up: Weight,
        down: Weight,
        k: usize,
    ) -> Option<usize> {
        self.inner().moe_joint_min_rows(gate, up, down, k)
    }
    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        self.inner_mut().set_decode_rows(n)
    }
}

/// A wrapper is a device like any other, so its calls are checked by the one [`Backend`]
/// impl before it sees them (and again by the wrapped backend's).
impl<F: Forward + ?Sized> Device for F {
    fn name(&self) -> String {
        Forward::name(self)
    }
    fn warms_up(&self) -> bool {
        Forward::warms_up(self)
    }
    fn alloc(&mut self, len: usize) -> BResult<Buf> {
        Forward::alloc(self, len)
    }
    fn alloc_i32(&mut self, len: usize) -> BResult<IBuf> {
        Forward::alloc_i32(self, len)
    }
    fn free(&mut self, buf: Buf) {
        Forward::free(self, buf)
    }
    fn free_i32(&mut self, buf: IBuf) {
        Forward::free_i32(self, buf)
    }
    fn upload(&mut self, dst: Slice, src: &[f32]) -> BResult<()> {
        Forward::upload(self, dst, src)
    }
    fn download(&mut self, src: Slice, dst: &mut [f32]) -> BResult<()> {
        Forward::download(self, src, dst)
    }
    fn upload_i32(&mut self, dst: IBuf, off: usize, src: &[i32]) -> BResult<()> {
        Forward::upload_i32(self, dst, off, src)
    }
    fn download_i32(&mut self, src: IBuf, off: usize, dst: &mut [i32]) -> BResult<()> {
        Forward::download_i32(self, src, off, dst)
    }
    fn copy(&mut self, src: Slice, dst: Slice) -> BResult<()> {
        Forward::copy(self, src, dst)
    }
    fn fill(&mut self, dst: Slice, value: f32) -> BResult<()> {
        Forward::fill(self, dst, value)
    }
    fn load_weight(
        &mut self,
        file: &Arc<GgufFile>,
        name: &str,
        usage: WeightUse,
    ) -> BResult<Weight> {
        Forward::load_weight(self, file, name, usage)
    }
    fn load_weights(
        &mut self,
        file: &Arc<GgufFile>,
        list: &[(String, WeightUse)],
    ) -> BResult<Vec<Weight>> {
        Forward::load_weights(self, file, list)
    }
    fn alloc_weight(&mut self, name: &str, info: WeightInfo) -> BResult<Weight> {
        Forward::alloc_weight(self, name, info)
    }
    fn write_weight_mat(&mut self, w: Weight, mat: usize, raw: &[u8]) -> BResult<()> {
        Forward::write_weight_mat(self, w, mat, raw)
    }
    fn alloc_host_slab(&mut self, bytes: usize) -> BResult<Box<dyn HostSlab>> {
        Forward::alloc_host_slab(self, bytes)
    }
    fn write_weight_mats(
        &mut self,
        slab: Box<dyn HostSlab>,
        tag: u64,
        mats: &[SlabMat],
    ) -> BResult<Option<Box<dyn HostSlab>>> {
        Forward::write_weight_mats(self, slab, tag, mats)
    }
    fn reclaim_host_slabs(&mut self, wait: bool) -> BResult<TaggedSlabs> {
        Forward::reclaim_host_slabs(self, wait)
    }
    fn matmul(&mut self, w: Weight, mat: usize, x: Slice, n_tok: usize, y: Slice) -> BResult<()> {
        Forward::matmul(self, w, mat, x, n_tok, y)
    }
    fn matmul_grouped(
        &mut self,
        w: Weight,
        groups: usize,
        x: Slice,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        Forward::matmul_grouped(self, w, groups, x, n_tok, y)
    }
    fn rms_norm(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        rows: usize,
        width: usize,
        eps: f32,
        out: Slice,
    ) -> BResult<()> {
        Forward::rms_norm(self, x, w, rows, width, eps, out)
    }
    fn rope(&mut self, x: Slice, args: RopeArgs) -> BResult<()> {
        Forward::rope(self, x, args)
    }
    fn add(&mut self, acc: Slice, x: Slice) -> BResult<()> {
        Forward::add(self, acc, x)
    }
    fn swiglu(&mut self, gate: Slice, up: Slice, clamp: f32, out: Slice) -> BResult<()> {
        Forward::swiglu(self, gate, up, clamp, out)
    }
    fn qat_fp8(&mut self, x: Slice, rows: usize, width: usize, n_dims: usize) -> BResult<()> {
        Forward::qat_fp8(self, x, rows, width, n_dims)
    }
    fn qat_hadamard_fp4(&mut self, x: Slice, rows: usize, width: usize) -> BResult<()> {
        Forward::qat_hadamard_fp4(self, x, rows, width)
    }
    fn embed(
        &mut self,
        table: Weight,
        tokens: IBuf,
        n_tok: usize,
        n_streams: usize,
        out: Slice,
    ) -> BResult<()> {
        Forward::embed(self, table, tokens, n_tok, n_streams, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
        post: Slice,
        comb: Slice,
    ) -> BResult<()> {
        Forward::hc_pre(self, mix, x, base, scale, args, y, post, comb)
    }
    fn hc_post(
        &mut self,
        x: Slice,
        f: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        Forward::hc_post(self, x, f, post, comb, args)
    }
    fn hc_head(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        y: Slice,
    ) -> BResult<()> {
        Forward::hc_head(self, mix, x, base, scale, args, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn compressor(
        &mut self,
        acc: Slice,
        u: Slice,
        z: Slice,
        ape: Weight,
        args: CompressorArgs,
        rows: Slice,
    ) -> BResult<()> {
        Forward::compressor(self, acc, u, z, ape, args, rows)
    }
    fn indexer_topk(
        &mut self,
        q: Slice,
        w: Slice,
        rows: Slice,
        args: IndexerArgs,
        out: IBuf,
    ) -> BResult<()> {
        Forward::indexer_topk(self, q, w, rows, args, out)
    }
    fn compressor_batch(&mut self, calls: &[CompressorCall]) -> BResult<()> {
        Forward::compressor_batch(self, calls)
    }
    fn indexer_topk_batch(&mut self, calls: &[IndexerCall]) -> BResult<()> {
        Forward::indexer_topk_batch(self, calls)
    }
    fn attention(&mut self, args: AttnArgs) -> BResult<()> {
        Forward::attention(self, args)
    }
    fn attention_batch(&mut self, args: &[AttnArgs]) -> BResult<()> {
        Forward::attention_batch(self, args)
    }
    fn ring_store(
        &mut self,
        ring: Slice,
        kv: Slice,
        pos0: usize,
        n_tok: usize,
        window: usize,
    ) -> BResult<()> {
        Forward::ring_store(self, ring, kv, pos0, n_tok, window)
    }
    fn ring_store_batch(&mut self, calls: &[RingStoreCall]) -> BResult<()> {
        Forward::ring_store_batch(self, calls)
    }
    fn router(
        &mut self,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        Forward::router(self, logits, routing, args, ids, weights)
    }
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        x: Slice,
        ids: IBuf,
        weights: Slice,
        gate: Weight,
        up: Weight,
        down: Weight,
        args: MoeArgs,
        out: Slice,
    ) -> BResult<()> {
        Forward::moe(self, x, ids, weights, gate, up, down, args, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair(
        &mut self,
        wa: Weight,
        wb: Weight,
        x: Slice,
        n_tok: usize,
        ya: Slice,
        yb: Slice,
    ) -> BResult<()> {
        Forward::matmul_pair(self, wa, wb, x, n_tok, ya, yb)
    }
    fn matmul_set(
        &mut self,
        x: Slice,
        n_tok: usize,
        singles: &[(Weight, Slice)],
        pairs: &[MatmulPair],
    ) -> BResult<()> {
        Forward::matmul_set(self, x, n_tok, singles, pairs)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_pre_norm(
        &mut self,
        mix: Slice,
        x: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        Forward::hc_pre_norm(self, mix, x, base, scale, args, norm, y, post, comb, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_mix_pre_norm(
        &mut self,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        Forward::hc_mix_pre_norm(
            self, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn hc_post_mix_pre_norm(
        &mut self,
        prev: HcPost,
        fn_: Weight,
        x: Slice,
        mix: Slice,
        base: Weight,
        scale: Weight,
        args: HcArgs,
        norm: Weight,
        y: Slice,
        post: Slice,
        comb: Slice,
        out: Slice,
    ) -> BResult<()> {
        Forward::hc_post_mix_pre_norm(
            self, prev, fn_, x, mix, base, scale, args, norm, y, post, comb, out,
        )
    }
    fn norm_rope(
        &mut self,
        x: Slice,
        w: Option<Weight>,
        eps: f32,
        rope: RopeArgs,
        fp8_dims: Option<usize>,
    ) -> BResult<()> {
        Forward::norm_rope(self, x, w, eps, rope, fp8_dims)
    }
    fn compressor_pair(&mut self, a: CompressorCall, b: CompressorCall) -> BResult<()> {
        Forward::compressor_pair(self, a, b)
    }
    fn norm_rope_pair(&mut self, a: NormRopeCall, b: NormRopeCall) -> BResult<()> {
        Forward::norm_rope_pair(self, a, b)
    }
    #[allow(clippy::too_many_arguments)]
    fn router_matmul(
        &mut self,
        w: Weight,
        x: Slice,
        logits: Slice,
        routing: Routing,
        args: RouterArgs,
        ids: IBuf,
        weights: Slice,
    ) -> BResult<()> {
        Forward::router_matmul(self, w, x, logits, routing, args, ids, weights)
    }
    fn rope_qat_hadamard_fp4(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        rows: usize,
        width: usize,
    ) -> BResult<()> {
        Forward::rope_qat_hadamard_fp4(self, x, rope, rows, width)
    }
    fn norm_rope_pair_store(
        &mut self,
        a: NormRopeCall,
        b: NormRopeCall,
        store: RingStoreCall,
    ) -> BResult<()> {
        Forward::norm_rope_pair_store(self, a, b, store)
    }
    fn rope_matmul_grouped(
        &mut self,
        x: Slice,
        rope: RopeArgs,
        w: Weight,
        groups: usize,
        n_tok: usize,
        y: Slice,
    ) -> BResult<()> {
        Forward::rope_matmul_grouped(self, x, rope, w, groups, n_tok, y)
    }
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &mut self,
        x: Slice,
        norm: Weight,
        eps: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        Forward::rms_norm_matmul(self, x, norm, eps, h, w, n_tok, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn swiglu_matmul(
        &mut self,
        gate: Slice,
        up: Slice,
        clamp: f32,
        h: Slice,
        w: Weight,
        n_tok: usize,
        out: Slice,
    ) -> BResult<()> {
        Forward::swiglu_matmul(self, gate, up, clamp, h, w, n_tok, out)
    }
    fn hc_post_add(
        &mut self,
        x: Slice,
        f: Slice,
        f2: Slice,
        post: Slice,
        comb: Slice,
        args: HcArgs,
    ) -> BResult<()> {
        Forward::hc_post_add(self, x, f, f2, post, comb, args)
    }
    fn argmax(&mut self, x: Slice, out: IBuf) -> BResult<()> {
        Forward::argmax(self, x, out)
    }
    fn logit_band(&mut self, x: Slice, span: f32, exclude: Option<u32>, out: IBuf) -> BResult<()> {
        Forward::logit_band(self, x, span, exclude, out)
    }
    fn logit_bands(&mut self, x: Slice, n: usize, jobs: &[BandJob]) -> BResult<()> {
        Forward::logit_bands(self, x, n, jobs)
    }
    fn annotate(&mut self, tag: &'static str) {
        Forward::annotate(self, tag)
    }
    fn set_profiling(&mut self, on: bool) -> BResult<bool> {
        Forward::set_profiling(self, on)
    }
    fn take_profile(&mut self) -> BResult<Option<(Vec<ProfileRow>, f64)>> {
        Forward::take_profile(self)
    }
    fn begin_capture(&mut self) -> BResult<bool> {
        Forward::begin_capture(self)
    }
    fn end_capture_replay(&mut self, replays: usize) -> BResult<GraphTiming> {
        Forward::end_capture_replay(self, replays)
    }
    fn counters(&self) -> Counters {
        Forward::counters(self)
    }
    fn set_activation_q8(&mut self, on: bool) -> BResult<()> {
        Forward::set_activation_q8(self, on)
    }
    fn moe_joint_min_rows(
        &self,
        gate: Weight,
        up: Weight,
        down: Weight,
        k: usize,
    ) -> Option<usize> {
        Forward::moe_joint_min_rows(self, gate, up, down, k)
    }
    fn set_decode_rows(&mut self, n: usize) -> BResult<()> {
        Forward::set_decode_rows(self, n)
    }
}
