//! Exact-DSML tool replay memory (docs/server.md §10): tool-call id → the DSML block the model
//! actually sampled. Clients send tool calls back as JSON; re-rendering them canonically
//! would not byte-match the live KV and would break prefix reuse, so an assistant message
//! whose call ids all map to one stored block is rendered with that block verbatim.
//!
//! Bounded by id count and bytes; least recently used ids go first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ds4_chat::render::Message;

#[derive(Debug)]
struct Entry {
    block: Arc<str>,
    tick: u64,
}

/// Id → block map with LRU eviction.
#[derive(Debug)]
pub struct ToolMemory {
    map: HashMap<String, Entry>,
    by_tick: BTreeMap<u64, String>,
    bytes: usize,
    tick: u64,
    max_ids: usize,
    max_bytes: usize,
}

fn cost(id: &str, block: &str) -> usize {
    id.len() + block.len() + 64
}

/// Locks the shared tool memory; a panic elsewhere while it was held leaves it usable
/// (its maps stay consistent between single inserts).
pub(crate) fn lock(m: &std::sync::Mutex<ToolMemory>) -> std::sync::MutexGuard<'_, ToolMemory> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ToolMemory {
    pub fn new(max_ids: usize, max_bytes: usize) -> ToolMemory {
        ToolMemory {
            map: HashMap::new(),
            by_tick: BTreeMap::new(),
            bytes: 0,
            tick: 0,
            max_ids,
            max_bytes,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Remembers `id` → `block` (replacing an older mapping of the id).
    pub fn insert(&mut self, id: &str, block: Arc<str>) {
        if id.is_empty() || self.max_ids == 0 {
            return;
        }
        self.remove(id);
        let c = cost(id, &block);
        if c > self.max_bytes {
            return;
        }
        let tick = self.next_tick();
        self.bytes += c;
        self.by_tick.insert(tick, id.to_string());
        self.map.insert(id.to_string(), Entry { block, tick });
        while self.map.len() > self.max_ids || self.bytes > self.max_bytes {
            let Some((_, oldest)) = self.by_tick.pop_first() else {
                break;
            };
            if let Some(e) = self.map.remove(&oldest) {
                self.bytes -= cost(&oldest, &e.block);
            }
        }
    }

    fn remove(&mut self, id: &str) {
        if let Some(e) = self.map.remove(id) {
            self.by_tick.remove(&e.tick);
            self.bytes -= cost(id, &e.block);
        }
    }

    /// The block of `id`, marking it used.
    pub fn get(&mut self, id: &str) -> Option<Arc<str>> {
        let tick = self.next_tick();
        let e = self.map.get_mut(id)?;
        self.by_tick.remove(&e.tick);
        e.tick = tick;
        self.by_tick.insert(tick, id.to_string());
        Some(e.block.clone())
    }

    pub fn contains(&self, id: &str) -> bool {
        self.map.contains_key(id)
    }

    /// The one block all `ids` map to, if they all resolve to the same block.
    pub fn resolve(&mut self, ids: &[&str]) -> Option<Arc<str>> {
        let mut found: Option<Arc<str>> = None;
        for id in ids {
            let b = self.get(id)?;
            match &found {
                Some(f) if **f != *b => return None,
                Some(_) => {}
                None => found = Some(b),
            }
        }
        found
    }

    /// Sets `exact_dsml` on every assistant message whose calls all resolve to one block.
    /// Returns (messages replayed exactly, messages rendered canonically).
    pub fn apply(&mut self, messages: &mut [Message]) -> (usize, usize) {
        let (mut exact, mut canonical) = (0, 0);
        for m in messages.iter_mut() {
            if m.tool_calls.is_empty() {
                continue;
            }
            let ids: Vec<&str> = m.tool_calls.iter().map(|c| c.id.as_str()).collect();
            if ids.iter().any(|i| i.is_empty()) {
                canonical += 1;
                continue;
            }
            match self.resolve(&ids) {
                Some(b) => {
                    m.exact_dsml = Some(b.to_string());
                    exact += 1;
                }
                None => canonical += 1,
            }
        }
        (exact, canonical)
    }

    /// The mappings whose block occurs in `text` (saved with a disk checkpoint of it).
    pub fn blocks_in(&self, text: &str) -> BTreeMap<String, String> {
        let mut seen: HashMap<*const u8, bool> = HashMap::new();
        let mut out = BTreeMap::new();
        for (id, e) in &self.map {
            let key = e.block.as_ptr();
            let hit = *seen.entry(key).or_insert_with(|| text.contains(&*e.block));
            if hit {
                out.insert(id.clone(), e.block.to_string());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_chat::render::ToolCall;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "f".into(),
            arguments: "{}".into(),
        }
    }

    #[test]
    fn lru_by_ids_and_bytes() {
        let mut m = ToolMemory::new(2, 1 << 20);
        let b: Arc<str> = Arc::from("B");
        m.insert("a", b.clone());
        m.insert("b", b.clone());
        assert!(m.get("a").is_some()); // a is now newer than b
        m.insert("c", b.clone());
        assert!(m.contains("a") && m.contains("c") && !m.contains("b"));
        let mut small = ToolMemory::new(10, 200);
        small.insert("x", Arc::from("y".repeat(100).as_str()));
        small.insert("z", Arc::from("y".repeat(100).as_str()));
        assert_eq!(small.len(), 1);
        assert!(small.contains("z"));
        small.insert("huge", Arc::from("y".repeat(1000).as_str()));
        assert!(!small.contains("huge"));
    }

    #[test]
    fn apply_needs_one_shared_block() {
        let mut m = ToolMemory::new(10, 1 << 20);
        let blk: Arc<str> = Arc::from("\n\n<｜DSML｜tool_calls>X</｜DSML｜tool_calls>");
        m.insert("c1", blk.clone());
        m.insert("c2", blk.clone());
        m.insert("c3", Arc::from("other"));
        let mut msgs = vec![
            Message {
                role: "assistant".into(),
                tool_calls: vec![call("c1"), call("c2")],
                ..Message::default()
            },
            Message {
                role: "assistant".into(),
                tool_calls: vec![call("c1"), call("c3")],
                ..Message::default()
            },
            Message {
                role: "assistant".into(),
                tool_calls: vec![call("unknown")],
                ..Message::default()
            },
        ];
        assert_eq!(m.apply(&mut msgs), (1, 2));
        assert_eq!(msgs[0].exact_dsml.as_deref(), Some(&*blk));
        assert!(msgs[1].exact_dsml.is_none() && msgs[2].exact_dsml.is_none());
        let found = m.blocks_in("prefix \n\n<｜DSML｜tool_calls>X</｜DSML｜tool_calls> tail");
        assert_eq!(found.keys().collect::<Vec<_>>(), ["c1", "c2"]);
    }
}
