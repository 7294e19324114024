//! CUDA graphs: capture a sequence of launches once, replay it with one launch. The
//! decode step (43 layers × ~25 ops) is the candidate (docs/gpu.md §18).
//!
//! [`CudaDevice::with_graph`] keeps the capture closure (and everything it borrows or
//! owns) alive until the replays are done, so a replay never touches freed memory;
//! [`CudaDevice::begin_capture`] / [`CudaDevice::end_capture`] split the same steps for a
//! caller whose buffers outlive the graph anyway (the engine's forward pass). Capture uses
//! the global mode: allocation, free and synchronisation calls anywhere in the process fail
//! during capture instead of silently breaking it.

use cudarc::driver::sys;

use super::device::CudaDevice;
use super::driver::check;
use crate::error::Result;

/// An instantiated graph; dropping it waits for the stream, then destroys it.
pub struct GraphExec<'g> {
    exec: sys::CUgraphExec,
    dev: &'g CudaDevice,
}

impl GraphExec<'_> {
    /// Queue one replay of the captured work on the device's stream.
    pub fn launch(&self) -> Result<()> {
        self.dev.ctx.bind()?;
        // SAFETY: `exec` is instantiated and alive; the caller keeps every buffer the
        // captured work uses alive until the replays finished (`with_graph` does so).
        check(
            unsafe { sys::cuGraphLaunch(self.exec, self.dev.ctx.stream) },
            "cuGraphLaunch",
            || "replaying a captured graph".into(),
        )
    }
}

impl Drop for GraphExec<'_> {
    fn drop(&mut self) {
        // No replay may be in flight when the graph goes.
        let _ = self.dev.ctx.sync("graph replays");
        // SAFETY: instantiated by `end_capture`, destroyed once, nothing in flight.
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

impl CudaDevice {
    /// Starts recording the work queued on the stream (global capture mode).
    pub fn begin_capture(&self) -> Result<()> {
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
        )
    }

    /// Ends the recording [`CudaDevice::begin_capture`] started and instantiates it;
    /// returns the graph and its node count. Always ends the capture, even when the
    /// recording was invalidated (then the error says so).
    pub fn end_capture(&self) -> Result<(GraphExec<'_>, usize)> {
        let ctx = &self.ctx;
        ctx.bind()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: a capture was begun on this stream; the out-pointer is a local.
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
        if let Err(e) = ended {
            destroy_graph(graph);
            return Err(e);
        }
        let mut nodes = 0usize;
        // SAFETY: `graph` is a valid captured graph; a null node array asks for the count.
        let counted = check(
            unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) },
            "cuGraphGetNodes",
            || "counting a captured graph's nodes".into(),
        );
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is a valid captured graph; out-pointer is a local.
        let inst = counted.and_then(|()| {
            check(
                unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
                "cuGraphInstantiateWithFlags",
                || "instantiating a captured graph".into(),
            )
        });
        destroy_graph(graph);
        inst?;
        Ok((GraphExec { exec, dev: self }, nodes))
    }

    /// Capture the work `capture` queues (kernel launches, device copies, fills) into a
    /// graph, then run `replay` with the instantiated graph. The stream is drained before
    /// the graph is destroyed and before `capture` (with what it owns) is dropped.
    pub fn with_graph<C, U, R>(&self, mut capture: C, replay: U) -> Result<R>
    where
        C: FnMut() -> Result<()>,
        U: FnOnce(&GraphExec<'_>) -> Result<R>,
    {
        self.begin_capture()?;
        let queued = capture();
        let ended = self.end_capture();
        let (g, _) = match (queued, ended) {
            (Ok(()), Ok(g)) => g,
            (Err(e), _) | (Ok(()), Err(e)) => return Err(e),
        };
        let out = replay(&g);
        let drained = self.ctx.sync("graph replays");
        drop(g);
        drop(capture);
        let out = out?;
        drained?;
        Ok(out)
    }

    /// Ends the recording (see [`crate::api::GpuApi::end_capture_replay`]) and times
    /// `replays` replays of it with events.
    pub fn end_capture_replay(&self, replays: usize) -> Result<ds4_engine::GraphTiming> {
        let t0 = std::time::Instant::now();
        let (g, nodes) = self.end_capture()?;
        let instantiate_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut replay_ms = 0.0;
        if replays > 0 {
            g.launch()?;
            let (a, b) = (self.event()?, self.event()?);
            a.record()?;
            for _ in 0..replays {
                g.launch()?;
            }
            b.record()?;
            replay_ms = a.elapsed_ms(&b)? as f64 / replays as f64;
        }
        self.ctx.sync("graph replays")?;
        drop(g);
        Ok(ds4_engine::GraphTiming {
            nodes,
            instantiate_ms,
            replay_ms,
        })
    }
}
