//! Decode-time state (docs/forward.md §8): per layer a raw KV ring, and for compressed layers the
//! compressed rows, the indexer rows and the compressor accumulators. All values are f32 in
//! backend buffers; nothing is rounded on store (docs/forward.md §9.4: f32 storage).
//!
//! A state can be serialised to bytes ([`Snapshot`]) and restored, giving bit-identical
//! continuations on the same backend; the on-disk KV cache and prefix reuse build on it.

use ds4_model::{AttnKind, HParams};

use crate::backend::{Backend, Buf, CompressorArgs, Slice};
use crate::error::{EngineError, Result};

/// One compressor's state: accumulator and the rows it has emitted.
#[derive(Debug, Clone, Copy)]
pub struct CompState {
    pub ratio: usize,
    pub width: usize,
    pub overlap: bool,
    /// `(u, z) × slots × proj_width` f32 (see [`CompressorArgs::acc_len`]).
    pub acc: Buf,
    /// `[cap, width]` emitted rows, row `w` for window `w`.
    pub rows: Buf,
    pub cap: usize,
}

impl CompState {
    /// Compressor arguments for a chunk of `n_tok` tokens starting at `pos0`.
    pub fn chunk_args(&self, pos0: usize, n_tok: usize) -> CompressorArgs {
        CompressorArgs {
            pos0,
            n_tok,
            ratio: self.ratio,
            width: self.width,
            overlap: self.overlap,
        }
    }

    /// Rows emitted once `n_pos` tokens have been processed.
    pub fn rows_at(&self, n_pos: usize) -> usize {
        n_pos / self.ratio
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LayerState {
    /// `[window, head_dim]`; position `p` lives in slot `p % window`.
    pub ring: Buf,
    /// Attention compressor (CSA and HCA layers).
    pub comp: Option<CompState>,
    /// Indexer compressor (CSA layers).
    pub index: Option<CompState>,
}

/// The whole decode state of one sequence.
#[derive(Debug)]
pub struct KvState {
    pub(crate) layers: Vec<LayerState>,
    pub(crate) ctx: usize,
    /// Every token processed so far, in order (position = index).
    pub(crate) tokens: Vec<u32>,
    pub(crate) fingerprint: u64,
}

impl KvState {
    /// Allocates a zeroed state for up to `ctx` tokens.
    pub(crate) fn new(
        be: &mut dyn Backend,
        hp: &HParams,
        ctx: usize,
        fingerprint: u64,
    ) -> Result<KvState> {
        if ctx == 0 {
            return Err(EngineError::Config(
                "context length must be positive".into(),
            ));
        }
        let mut layers = Vec::with_capacity(hp.n_layer);
        let alloc = |be: &mut dyn Backend| -> Result<LayerState> {
            Ok(LayerState {
                ring: be.alloc(hp.sliding_window * hp.head_dim)?,
                comp: None,
                index: None,
            })
        };
        for il in 0..hp.n_layer {
            let mut l = alloc(be)?;
            let mk = |be: &mut dyn Backend, ratio: usize, width: usize, overlap: bool| {
                let cap = ctx / ratio;
                let a = CompressorArgs {
                    pos0: 0,
                    n_tok: 0,
                    ratio,
                    width,
                    overlap,
                };
                Ok::<CompState, EngineError>(CompState {
                    ratio,
                    width,
                    overlap,
                    acc: be.alloc(a.acc_len())?,
                    rows: be.alloc(cap.max(1) * width)?,
                    cap,
                })
            };
            match hp.attn_kind(il) {
                AttnKind::Sliding => {}
                AttnKind::Csa => {
                    l.comp = Some(mk(be, 4, hp.head_dim, true)?);
                    l.index = Some(mk(be, 4, hp.indexer_head_dim, true)?);
                }
                AttnKind::Hca(r) => {
                    l.comp = Some(mk(be, r as usize, hp.head_dim, false)?);
                }
            }
            layers.push(l);
        }
        Ok(KvState {
            layers,
            ctx,
            tokens: Vec::new(),
            fingerprint,
        })
    }

    /// Releases the backend buffers.
    pub(crate) fn free(self, be: &mut dyn Backend) {
        for l in self.layers {
            be.free(l.ring);
            for c in [l.comp, l.index].into_iter().flatten() {
                be.free(c.acc);
                be.free(c.rows);
            }
        }
    }

    /// Tokens processed so far (the next position).
    pub fn pos(&self) -> usize {
        self.tokens.len()
    }

    pub fn ctx(&self) -> usize {
        self.ctx
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn layers(&self) -> &[LayerState] {
        &self.layers
    }

    /// Forgets every token (buffers are zeroed so a reused state equals a fresh one).
    pub(crate) fn reset(&mut self, be: &mut dyn Backend) -> Result<()> {
        for l in &self.layers {
            be.fill(l.ring.all(), 0.0)?;
            for c in [l.comp, l.index].into_iter().flatten() {
                be.fill(c.acc.all(), 0.0)?;
                be.fill(c.rows.all(), 0.0)?;
            }
        }
        self.tokens.clear();
        Ok(())
    }

    /// The device ranges a snapshot holds, in the order it writes them: per layer the ring,
    /// then each compressor's accumulator and the compressed rows in use.
    fn snapshot_slices(&self) -> Vec<Slice> {
        let pos = self.pos();
        let mut slices = Vec::new();
        for l in &self.layers {
            slices.push(l.ring.all());
            for c in [l.comp, l.index].into_iter().flatten() {
                slices.push(c.acc.all());
                slices.push(c.rows.rows(0, c.rows_at(pos), c.width));
            }
        }
        slices
    }

    /// The bytes [`KvState::snapshot`] would write now, known without reading the device
    /// (the server uses it to tell which of a step's turn snapshots it will keep).
    pub(crate) fn snapshot_len(&self) -> usize {
        let values: usize = self.snapshot_slices().iter().map(|s| s.len).sum();
        SNAPSHOT_HEAD + 4 * (self.tokens.len() + values) + 4
    }

    /// Serialises the state (only the rows in use). The size is known before anything is
    /// downloaded, so the bytes are written once into one allocation; values are copied in
    /// bulk and the checksum is CRC-32 (the server snapshots every prompt before its first
    /// decoded token, so this sits on the time to the first token: docs/forward.md §8.3).
    /// `buf`'s allocation is reused (a snapshot about to be dropped: its pages are already
    /// mapped, which saves faulting in tens of MB again).
    pub(crate) fn snapshot(&self, be: &mut dyn Backend, buf: Vec<u8>) -> Result<Snapshot> {
        let slices = self.snapshot_slices();
        let mut w = buf;
        w.clear();
        w.reserve(self.snapshot_len());
        w.extend_from_slice(SNAPSHOT_MAGIC);
        w.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        w.extend_from_slice(&self.fingerprint.to_le_bytes());
        w.extend_from_slice(&(self.tokens.len() as u64).to_le_bytes());
        w.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        for t in &self.tokens {
            w.extend_from_slice(&t.to_le_bytes());
        }
        let mut tmp = Vec::new();
        for s in slices {
            tmp.resize(s.len, 0f32);
            be.download(s, &mut tmp)?;
            let at = w.len();
            w.resize(at + 4 * tmp.len(), 0);
            for (b, v) in w[at..].chunks_exact_mut(4).zip(&tmp) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        let sum = crc32fast::hash(&w);
        w.extend_from_slice(&sum.to_le_bytes());
        Ok(Snapshot { bytes: w })
    }

    /// Replaces this state with `snap`. Everything is validated before the state changes.
    pub(crate) fn restore(&mut self, be: &mut dyn Backend, snap: &Snapshot) -> Result<()> {
        let b = &snap.bytes;
        let bad = |m: String| EngineError::Snapshot(m);
        if b.len() < SNAPSHOT_HEAD + 4 {
            return Err(bad(format!("{} bytes is too short", b.len())));
        }
        if &b[..SNAPSHOT_MAGIC.len()] != SNAPSHOT_MAGIC {
            return Err(bad("not a ds4 KV snapshot (bad magic)".into()));
        }
        let at = SNAPSHOT_MAGIC.len();
        let version = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        // Version 1 (FNV-1a 64 trailer) is still read: snapshots and checkpoints on disk
        // from older builds keep working.
        let body = match version {
            1 if b.len() >= SNAPSHOT_HEAD + 8 => {
                let (body, sum) = b.split_at(b.len() - 8);
                (fnv1a(body) == u64::from_le_bytes(sum.try_into().expect("8 bytes")))
                    .then_some(body)
            }
            SNAPSHOT_VERSION => {
                let (body, sum) = b.split_at(b.len() - 4);
                (crc32fast::hash(body) == u32::from_le_bytes(sum.try_into().expect("4 bytes")))
                    .then_some(body)
            }
            1 => return Err(bad(format!("{} bytes is too short", b.len()))),
            _ => {
                return Err(bad(format!(
                    "version {version}, this build reads 1 and {SNAPSHOT_VERSION}"
                )))
            }
        }
        .ok_or_else(|| bad("checksum mismatch (corrupted snapshot)".into()))?;
        let mut r = Reader {
            b: body,
            at: at + 4,
        };
        let fp = r.u64()?;
        if fp != self.fingerprint {
            return Err(bad(format!(
                "made for another model or numeric mode (fingerprint {fp:016x}, engine {:016x})",
                self.fingerprint
            )));
        }
        let n_tok = r.u64()?;
        let n_layer = r.u32()? as usize;
        if n_layer != self.layers.len() {
            return Err(bad(format!(
                "{n_layer} layers, model has {}",
                self.layers.len()
            )));
        }
        if n_tok > self.ctx as u64 {
            return Err(bad(format!(
                "holds {n_tok} tokens, this state's context is {}",
                self.ctx
            )));
        }
        let pos = n_tok as usize;
        // Exact expected size, computed from our own dims, before reading anything large.
        let mut want = r.at + 4 * pos;
        for l in &self.layers {
            want += 4 * l.ring.len();
            for c in [l.comp, l.index].into_iter().flatten() {
                want += 4 * (c.acc.len() + c.rows_at(pos) * c.width);
            }
        }
        if body.len() != want {
            return Err(bad(format!(
                "{} payload bytes, expected {want} for {pos} tokens",
                body.len()
            )));
        }
        let mut tokens = Vec::with_capacity(pos);
        for _ in 0..pos {
            tokens.push(r.u32()?);
        }
        let mut tmp = Vec::new();
        for l in &self.layers {
            r.f32s(l.ring.len(), &mut tmp)?;
            be.upload(l.ring.all(), &tmp)?;
            for c in [l.comp, l.index].into_iter().flatten() {
                r.f32s(c.acc.len(), &mut tmp)?;
                be.upload(c.acc.all(), &tmp)?;
                let n = c.rows_at(pos) * c.width;
                r.f32s(n, &mut tmp)?;
                be.upload(c.rows.slice(0, n), &tmp)?;
                be.fill(c.rows.slice(n, c.rows.len() - n), 0.0)?;
            }
        }
        self.tokens = tokens;
        Ok(())
    }
}

const SNAPSHOT_MAGIC: &[u8; 8] = b"DS4KVST\0";
/// The version [`KvState::snapshot`] writes; version 1 differs only in its trailer.
const SNAPSHOT_VERSION: u32 = 2;
/// Magic, version, fingerprint, token count, layer count.
const SNAPSHOT_HEAD: usize = 8 + 4 + 8 + 8 + 4;

/// A serialised [`KvState`]: `magic, version, model fingerprint, token count, layer count,
/// tokens, then per layer the ring, and per compressor its accumulator and used rows (all
/// little-endian f32), then a checksum of everything before it` — CRC-32 (IEEE, 4 bytes)
/// in version 2, FNV-1a 64 (8 bytes) in version 1, which restore still accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    bytes: Vec<u8>,
}

impl Snapshot {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
    /// Wraps bytes read from disk; they are validated by restore.
    pub fn from_bytes(bytes: Vec<u8>) -> Snapshot {
        Snapshot { bytes }
    }
    /// Token count recorded in the snapshot, if the header is readable.
    pub fn n_tokens(&self) -> Option<u64> {
        let at = SNAPSHOT_MAGIC.len() + 4 + 8;
        self.bytes
            .get(at..at + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let s = self
            .b
            .get(self.at..self.at + n)
            .ok_or_else(|| EngineError::Snapshot("truncated".into()))?;
        self.at += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn f32s(&mut self, n: usize, out: &mut Vec<f32>) -> Result<()> {
        let s = self.take(4 * n)?;
        out.clear();
        out.extend(
            s.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4"))),
        );
        Ok(())
    }
}

/// FNV-1a 64-bit hash (checksums and fingerprints; not cryptographic).
pub fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
