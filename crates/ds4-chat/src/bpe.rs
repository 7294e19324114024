//! Byte-level BPE: the merge loop of HF `tokenizers`' BPE model (no dropout, no unk, no
//! continuing-subword prefix), over token ids instead of strings.
//!
//! Per word: start from one symbol per byte (the GPT-2 byte char's id), then repeatedly merge
//! the adjacent pair with the lowest merge rank, leftmost on ties, until no pair has a merge.
//! Implemented like HF's `Word::merge_all` (a heap of candidate merges with lazy invalidation),
//! so it is `O(n log n)` in the word length; CJK pre-tokens can be hundreds of chars long.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use crate::error::ChatError;

/// Multiply-rotate hasher for the integer and short byte-string keys used here. Not
/// DoS-resistant, which is fine: keys are merge pairs fixed at load time and pre-token bytes of
/// bounded size whose worst case is a slower cache, not unbounded work.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type Fx = BuildHasherDefault<FxHasher>;
/// Pre-token bytes → ids.
type WordCache = HashMap<Box<[u8]>, Box<[u32]>, Fx>;

/// Cached words at most this long (bytes); longer ones are rare and cheap relative to their size.
const CACHE_MAX_WORD: usize = 256;
/// Cache entries before the cache is cleared (bounded memory whatever the input).
const CACHE_MAX_ENTRIES: usize = 1 << 17;

pub(crate) struct Bpe {
    /// (left id, right id) packed → (rank, merged id).
    merges: HashMap<u64, (u32, u32), Fx>,
    /// Id of the single-byte token of each byte (GPT-2 byte char), if the vocabulary has it.
    byte_id: [Option<u32>; 256],
    cache: Mutex<WordCache>,
}

#[inline]
fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

impl Bpe {
    /// `vocab`: token text → id; `merges`: (left, right) texts in rank order; `byte_char`:
    /// GPT-2 byte → char.
    pub(crate) fn new(
        vocab: &HashMap<&str, u32>,
        merges: &[(&str, &str)],
        byte_char: &[char; 256],
    ) -> Result<Self, ChatError> {
        let mut map: HashMap<u64, (u32, u32), Fx> =
            HashMap::with_capacity_and_hasher(merges.len(), Fx::default());
        let mut joined = String::new();
        for (rank, (a, b)) in merges.iter().enumerate() {
            let id = |t: &str| {
                vocab.get(t).copied().ok_or_else(|| {
                    ChatError::Vocab(format!(
                        "merge {rank} ({a} {b}): token {t:?} is not in the vocabulary"
                    ))
                })
            };
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let (ia, ib, inew) = (id(a)?, id(b)?, id(&joined)?);
            // A repeated pair keeps its last rank, as HF's merge map does.
            map.insert(pair(ia, ib), (rank as u32, inew));
        }
        let mut byte_id = [None; 256];
        let mut buf = [0u8; 4];
        for (b, slot) in byte_id.iter_mut().enumerate() {
            *slot = vocab.get(&*byte_char[b].encode_utf8(&mut buf)).copied();
        }
        Ok(Self {
            merges: map,
            byte_id,
            cache: Mutex::new(HashMap::default()),
        })
    }

    pub(crate) fn clear_cache(&self) {
        if let Ok(mut c) = self.cache.lock() {
            c.clear();
        }
    }

    fn byte(&self, b: u8) -> Result<u32, ChatError> {
        self.byte_id[b as usize].ok_or_else(|| {
            ChatError::Vocab(format!("the vocabulary has no token for byte 0x{b:02x}"))
        })
    }

    /// Appends the ids of one pre-token (raw bytes) to `out`.
    pub(crate) fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) -> Result<(), ChatError> {
        match word.len() {
            0 => return Ok(()),
            1 => {
                out.push(self.byte(word[0])?);
                return Ok(());
            }
            _ => {}
        }
        let cacheable = word.len() <= CACHE_MAX_WORD;
        if cacheable {
            if let Ok(cache) = self.cache.lock() {
                if let Some(ids) = cache.get(word) {
                    out.extend_from_slice(ids);
                    return Ok(());
                }
            }
        }
        let start = out.len();
        self.merge_into(word, out)?;
        if cacheable {
            if let Ok(mut cache) = self.cache.lock() {
                if cache.len() >= CACHE_MAX_ENTRIES {
                    cache.clear();
                }
                cache.insert(word.into(), out[start..].into());
            }
        }
        Ok(())
    }

    fn merge_into(&self, word: &[u8], out: &mut Vec<u32>) -> Result<(), ChatError> {
        let n = word.len();
        let mut syms: Vec<Sym> = Vec::with_capacity(n);
        for (i, &b) in word.iter().enumerate() {
            syms.push(Sym {
                id: self.byte(b)?,
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: if i + 1 == n { NONE } else { i as u32 + 1 },
                alive: true,
            });
        }
        // Min-heap on (rank, left position): lowest rank first, leftmost on ties.
        let mut heap: BinaryHeap<std::cmp::Reverse<(u32, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some(&(rank, _)) = self.merges.get(&pair(syms[i].id, syms[i + 1].id)) {
                heap.push(std::cmp::Reverse((rank, i as u32)));
            }
        }
        while let Some(std::cmp::Reverse((rank, pos))) = heap.pop() {
            let pos = pos as usize;
            let left = syms[pos];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right_pos = left.next as usize;
            let right = syms[right_pos];
            // Stale entry: the pair at `pos` changed since it was queued.
            let Some(&(cur_rank, new_id)) = self.merges.get(&pair(left.id, right.id)) else {
                continue;
            };
            if cur_rank != rank {
                continue;
            }
            syms[pos].id = new_id;
            syms[pos].next = right.next;
            syms[right_pos].alive = false;
            if right.next != NONE {
                syms[right.next as usize].prev = pos as u32;
            }
            if left.prev != NONE {
                if let Some(&(r, _)) = self.merges.get(&pair(syms[left.prev as usize].id, new_id)) {
                    heap.push(std::cmp::Reverse((r, left.prev)));
                }
            }
            if right.next != NONE {
                if let Some(&(r, _)) = self.merges.get(&pair(new_id, syms[right.next as usize].id))
                {
                    heap.push(std::cmp::Reverse((r, pos as u32)));
                }
            }
        }
        let mut i = 0u32;
        while i != NONE {
            out.push(syms[i as usize].id);
            i = syms[i as usize].next;
        }
        Ok(())
    }
}
