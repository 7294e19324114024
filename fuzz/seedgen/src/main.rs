//! Writes the seed corpus of the `kvstore_load` fuzz target with ds4-kvstore's own writer:
//! `cargo run --manifest-path fuzz/Cargo.toml -p ds4-fuzz-seedgen -- fuzz/corpus_seeds/kvstore_load`.
//!
//! Entries are made through `KvStore::store`, so they are exactly what the store writes
//! (checksum, name, header); only their timestamps differ between runs.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ds4_kvstore::{KvStore, Mode, StoreConfig, StoreOutcome};

/// A payload in the server's checkpoint layout (`ds4_server::diskcache::encode_payload`):
/// magic, logit count, f32 logits, then the engine snapshot bytes.
fn server_payload(logits: &[f32], snapshot: &[u8]) -> Vec<u8> {
    let mut out = b"DS4SRV1\0".to_vec();
    out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    for v in logits {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(snapshot);
    out
}

fn main() {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: ds4-fuzz-seedgen <output directory>"),
    );
    std::fs::create_dir_all(&out).expect("output directory");
    let scratch = std::env::temp_dir().join(format!("ds4-fuzz-seedgen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);

    let mut tool_map = BTreeMap::new();
    tool_map.insert(
        "call_abc123".to_string(),
        "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>".to_string(),
    );
    tool_map.insert(
        "toolu_01".to_string(),
        "<｜DSML｜function_calls></｜DSML｜function_calls>".to_string(),
    );

    let seeds: Vec<(&str, Mode, Vec<u32>, Vec<u8>, BTreeMap<String, String>)> = vec![
        (
            "plain_exact",
            Mode::Exact,
            vec![0, 128803, 19923, 128804],
            vec![1, 2, 3, 4, 5, 6, 7, 8],
            BTreeMap::new(),
        ),
        (
            "tool_map_official",
            Mode::Official,
            (0..40).collect(),
            vec![0xab; 64],
            tool_map.clone(),
        ),
        (
            "server_payload",
            Mode::Exact,
            vec![0, 1, 2],
            server_payload(&[0.5, -1.25, 3.0, f32::MIN_POSITIVE], b"snapshot"),
            tool_map,
        ),
        (
            "one_token_empty_payload",
            Mode::Exact,
            vec![7],
            Vec::new(),
            BTreeMap::new(),
        ),
    ];
    for (i, (label, mode, tokens, payload, map)) in seeds.into_iter().enumerate() {
        let cfg = StoreConfig {
            dir: scratch.join(label),
            budget_bytes: 1 << 30,
            model_id: [i as u8 + 1; 32],
            mode,
            ctx: 4096,
        };
        let (mut store, _) = KvStore::open(cfg.clone()).expect("open scratch store");
        let StoreOutcome::Stored { name, .. } =
            store.store(&tokens, &payload, &map).expect("store seed")
        else {
            panic!("seed {label} skipped");
        };
        let dest = out.join(format!("{label}.kv"));
        std::fs::copy(cfg.dir.join(&name), &dest).expect("copy seed");
        println!("{}", dest.display());
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
