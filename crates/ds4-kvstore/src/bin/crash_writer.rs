//! Test helper: writes KV entries forever (deterministic content derived from each entry's
//! tokens) until killed. The crash-safety test SIGKILLs it at random points.
//! Usage: ds4-kvstore-crash-writer DIR BUDGET_BYTES SEED

use std::collections::BTreeMap;

use ds4_kvstore::{KvStore, Mode, StoreConfig};

/// Content every entry must have: a function of its tokens only.
fn expected_payload(tokens: &[u32]) -> Vec<u8> {
    let mut s = tokens.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &t| {
        (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3)
    }) | 1;
    let len = 4096 + (s % (1 << 20)) as usize;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: ds4-kvstore-crash-writer DIR BUDGET_BYTES SEED");
        std::process::exit(2);
    }
    let budget: u64 = args[2].parse().expect("budget");
    let mut seed: u64 = args[3].parse::<u64>().expect("seed") | 1;
    let cfg = StoreConfig {
        dir: args[1].clone().into(),
        budget_bytes: budget,
        model_id: [7; 32],
        mode: Mode::Official,
        ctx: 65536,
    };
    let (mut store, _) = KvStore::open(cfg).expect("open");
    loop {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let n = 1 + (seed % 64) as usize;
        let tokens: Vec<u32> = (0..n)
            .map(|i| ((seed >> (i % 48)) as u32) % 1000 + i as u32)
            .collect();
        let mut map = BTreeMap::new();
        if seed.is_multiple_of(3) {
            map.insert(format!("call_{}", seed % 97), format!("<dsml>{n}</dsml>"));
        }
        store
            .store(&tokens, &expected_payload(&tokens), &map)
            .expect("store");
    }
}
