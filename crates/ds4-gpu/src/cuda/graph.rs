//! CUDA graphs: capture a sequence of launches once, replay it with one launch. The
//! decode step (43 layers × ~30 ops) needs this to hide per-launch overhead.
//!
//! The graph only exists inside [`CudaDevice::with_graph`], which keeps the capture
//! closure (and everything it borrows or owns) alive until the replays are done, so a
//! replay never touches freed memory. Capture uses the global mode: allocation, free and
//! synchronisation calls anywhere in the process fail during capture instead of silently
//! breaking it.

use cudarc::driver::sys;

use super::device::CudaDevice;
use super::driver::check;
use crate::error::Result;

/// An instantiated graph, valid for the duration of the `with_graph` call.
pub struct GraphExec<'g> {
    exec: sys::CUgraphExec,
    dev: &'g CudaDevice,
}

impl GraphExec<'_> {
    /// Queue one replay of the captured work on the device's stream.
    pub fn launch(&self) -> Result<()> {
        self.dev.ctx.bind()?;
        // SAFETY: `exec` is instantiated and alive; every buffer the captured work uses is
        // kept alive by `with_graph` until after the last replay finished.
        check(
            unsafe { sys::cuGraphLaunch(self.exec, self.dev.ctx.stream) },
            "cuGraphLaunch",
            || "replaying a captured graph".into(),
        )
    }
}

impl CudaDevice {
    /// Capture the work `capture` queues (kernel launches, device copies, fills) into a
    /// graph, then run `replay` with the instantiated graph. The stream is drained before
    /// the graph is destroyed and before `capture` (with what it owns) is dropped.
    pub fn with_graph<C, U, R>(&self, mut capture: C, replay: U) -> Result<R>
    where
        C: FnMut() -> Result<()>,
        U: FnOnce(&GraphExec<'_>) -> Result<R>,
    {
        let ctx = &self.ctx;
        ctx.bind()?;
        // SAFETY: the stream belongs to the bound context.
        check(
            unsafe {
                sys::cuStreamBeginCapture_v2(
                    ctx.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
                )
            },
            "cuStreamBeginCapture",
            || "starting a graph capture".into(),
        )?;
        let queued = capture();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: capture was begun on this stream above; always ended, even on error.
        let ended = check(
            unsafe { sys::cuStreamEndCapture(ctx.stream, &mut graph) },
            "cuStreamEndCapture",
            || "ending a graph capture".into(),
        );
        let destroy_graph = |g: sys::CUgraph| {
            if !g.is_null() {
                // SAFETY: created by cuStreamEndCapture, destroyed once.
                unsafe { sys::cuGraphDestroy(g) };
            }
        };
        if let Err(e) = queued.and(ended) {
            destroy_graph(graph);
            return Err(e);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is a valid captured graph; out-pointer is a local.
        let inst = check(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "cuGraphInstantiateWithFlags",
            || "instantiating a captured graph".into(),
        );
        destroy_graph(graph);
        inst?;
        let g = GraphExec { exec, dev: self };
        let out = replay(&g);
        let drained = ctx.sync("graph replays");
        // SAFETY: no replay is in flight (stream drained); destroyed once.
        unsafe { sys::cuGraphExecDestroy(exec) };
        drop(capture);
        let out = out?;
        drained?;
        Ok(out)
    }
}
