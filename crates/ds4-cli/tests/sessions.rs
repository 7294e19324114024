//! Sessions move between the two front ends through one `--kv-disk-dir`: a conversation
//! saved by the `ds4` chat (`/save`) is resumed by `ds4-server` with its tokens reported as
//! cached, a server checkpoint is resumed by the chat (`/load ENTRY`), and entries written
//! in the payload formats of older builds are migrated in place, never deleted.
//!
//! The chat runs as the real `ds4` binary; the server runs in-process (the same library the
//! `ds4-server` binary serves with), on the same tiny model file.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};

use common::{ds4_cmd, run_with_input, status_lines, text, tiny_gguf};
use ds4_chat::tokenizer::{ASSISTANT_TEXT, BOS_TEXT, EOS_TEXT, THINK_CLOSE_TEXT, USER_TEXT};
use ds4_kvstore::format::{self as kvformat, Header, HEADER_LEN};
use ds4_server::{DiskCacheConfig, LoadedModel, ModelOptions, Server, ServerConfig};
use serde_json::{json, Value};

const SYSTEM: &str = "You are a terse assistant.";
const QUESTION: &str = "hello there";

/// The chat on the tiny model with a disk store: greedy, no reasoning, one-token answers.
///
/// One token because the test must send the chat's answer back to the server as JSON text,
/// and the tiny model's random weights soon sample bytes that are not UTF-8; its greedy
/// first answer token is a whole marker (checked by [`answer_of`]).
fn chat(dir: &Path, script: &str) -> (String, String) {
    let m = tiny_gguf().to_str().unwrap().to_string();
    let args = [
        "-m",
        &m,
        "--backend",
        "cpu",
        "-c",
        "1024",
        "-n",
        "1",
        "--temp",
        "0",
        "--nothink",
        "-q",
        "--system",
        SYSTEM,
    ];
    let o = run_with_input(ds4_cmd().args(args).arg("--kv-disk-dir").arg(dir), script);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    (text(&o.stdout), err)
}

/// One store entry read straight from its file: tokens and payload.
struct Entry {
    path: PathBuf,
    header: Header,
    tokens: Vec<u32>,
    payload: Vec<u8>,
}

fn read_entry(path: &Path) -> Entry {
    let b = std::fs::read(path).unwrap();
    let header = Header::decode(&b[..HEADER_LEN]).unwrap();
    let n = header.n_tokens as usize;
    let tokens = kvformat::tokens_from_bytes(&b[HEADER_LEN..HEADER_LEN + 4 * n]);
    let at = HEADER_LEN + 4 * n;
    let payload = b[at..at + header.payload_len as usize].to_vec();
    Entry {
        path: path.to_path_buf(),
        header,
        tokens,
        payload,
    }
}

fn entries(dir: &Path) -> Vec<Entry> {
    let mut v: Vec<Entry> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| kvformat::is_entry_name(&e.file_name().to_string_lossy()))
        .map(|e| read_entry(&e.path()))
        .collect();
    v.sort_by_key(|e| e.tokens.len());
    v
}

/// The entry a named chat session points at.
fn named_entry(dir: &Path, name: &str) -> Entry {
    let idx: Value =
        serde_json::from_slice(&std::fs::read(dir.join("ds4-sessions.json")).unwrap()).unwrap();
    let file = idx["sessions"][name]["entry"].as_str().unwrap();
    read_entry(&dir.join(file))
}

fn is_current_payload(p: &[u8]) -> bool {
    p.starts_with(b"DS4CKPT\0")
}

fn tokenizer() -> ds4_chat::Tokenizer {
    let f = ds4_gguf::GgufFile::open(tiny_gguf()).unwrap();
    ds4_chat::Tokenizer::from_gguf_header(f.header()).unwrap()
}

/// The answer the chat's first turn holds: the transcript's text between the turn's opening
/// and its EOS.
fn answer_of(tokens: &[u32]) -> String {
    let bytes = tokenizer().decode(tokens).unwrap();
    let text = String::from_utf8(bytes).expect("the tiny model's answer is UTF-8");
    let head = format!("{BOS_TEXT}{SYSTEM}{USER_TEXT}{QUESTION}{ASSISTANT_TEXT}{THINK_CLOSE_TEXT}");
    let body = text
        .strip_prefix(&head)
        .unwrap_or_else(|| panic!("unexpected transcript {text:?}"));
    body.strip_suffix(EOS_TEXT)
        .unwrap_or_else(|| panic!("the transcript does not end with EOS: {text:?}"))
        .to_string()
}

/// A server on the tiny model with its disk cache in `dir`, in a runtime of its own.
struct Srv {
    rt: tokio::runtime::Runtime,
    running: ds4_server::Running,
}

fn serve(dir: &Path) -> Srv {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let model = LoadedModel::open(
        tiny_gguf(),
        &ModelOptions {
            ctx: 4096,
            threads: 1,
            prefill_chunk: 64,
            mode: None,
        },
    )
    .unwrap();
    let cfg = ServerConfig {
        disk: Some(DiskCacheConfig {
            min_tokens: 8,
            continued_interval_tokens: 0,
            boundary_trim_tokens: 0,
            boundary_align_tokens: 0,
            budget_bytes: 256 << 20,
            ..DiskCacheConfig::new(dir)
        }),
        snapshot_slots: 0,
        ..ServerConfig::default()
    };
    let running = rt.block_on(async {
        Server::bind(SocketAddr::from(([127, 0, 0, 1], 0)), cfg, model)
            .await
            .unwrap()
            .spawn()
    });
    Srv { rt, running }
}

impl Srv {
    fn chat(&self, body: &Value) -> Value {
        post(self.running.addr, "/v1/chat/completions", body)
    }

    fn disk_hits(&self) -> u64 {
        self.running
            .stats
            .disk_hits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Graceful stop: the worker saves its `shutdown` checkpoint.
    fn stop(self) {
        self.rt.block_on(self.running.shutdown()).unwrap();
    }
}

/// A blocking HTTP/1.1 POST (the server answers a non-streaming request with a
/// Content-Length body and closes).
fn post(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{resp}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached tokens in {v}"))
}

/// The chat request that continues the chat's first turn.
fn follow_up(answer: &str) -> Value {
    json!({"think": false, "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"}]})
}

#[test]
fn a_chat_session_resumes_in_the_server() {
    let kv = tempfile::tempdir().unwrap();
    let (_, err) = chat(kv.path(), &format!("{QUESTION}\n/save s1\n/quit\n"));
    assert!(err.contains("saved session s1"), "{err}");
    let saved = named_entry(kv.path(), "s1");
    assert!(
        is_current_payload(&saved.payload),
        "the chat saves the shared payload"
    );
    let answer = answer_of(&saved.tokens);

    let srv = serve(kv.path());
    let v = srv.chat(&follow_up(&answer));
    assert_eq!(cached(&v), saved.tokens.len() as u64, "{v}");
    assert_eq!(srv.disk_hits(), 1);
    srv.stop();
    // The chat's entry is still there, untouched by the server's own checkpoints.
    assert!(saved.path.exists());
}

#[test]
fn a_server_checkpoint_resumes_in_the_chat() {
    let kv = tempfile::tempdir().unwrap();
    let srv = serve(kv.path());
    let v = srv.chat(
        &json!({"think": false, "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]}),
    );
    assert_eq!(cached(&v), 0);
    srv.stop();
    // The longest entry is the shutdown checkpoint: the whole conversation so far.
    let e = entries(kv.path()).pop().expect("a server checkpoint");
    assert!(is_current_payload(&e.payload));
    let name = e.path.file_name().unwrap().to_str().unwrap().to_string();

    let (_, err) = chat(
        kv.path(),
        &format!("/list\n/load {name}\nnext question\n/quit\n"),
    );
    assert!(
        err.contains(&format!("{name} ")),
        "/list shows the checkpoint: {err}"
    );
    assert!(
        err.contains(&format!("loaded session {name} ({} tokens", e.tokens.len())),
        "{err}"
    );
    let st = status_lines(&err);
    assert_eq!(st.len(), 1, "{err}");
    assert_eq!(
        st[0].1,
        e.tokens.len(),
        "the checkpoint's tokens are reused: {err}"
    );
}

/// Rewrites an entry in place with another payload (what an older build wrote).
fn rewrite(e: &Entry, payload: &[u8]) {
    let f = ds4_gguf::GgufFile::open(tiny_gguf()).unwrap();
    let (mut store, _) = ds4_kvstore::KvStore::open(ds4_kvstore::StoreConfig {
        dir: e.path.parent().unwrap().to_path_buf(),
        budget_bytes: 256 << 20,
        model_id: ds4_kvstore::header_identity(f.header()).unwrap(),
        mode: e.header.mode,
        ctx: e.header.ctx,
    })
    .unwrap();
    store
        .store(&e.tokens, payload, &Default::default())
        .unwrap();
    assert_eq!(read_entry(&e.path).payload, payload);
}

#[test]
fn legacy_entries_are_migrated_not_deleted() {
    let kv = tempfile::tempdir().unwrap();
    chat(kv.path(), &format!("{QUESTION}\n/save s1\n/quit\n"));
    let saved = named_entry(kv.path(), "s1");
    let n_vocab = tokenizer().vocab_size();
    let cur = ds4_runtime::checkpoint::decode(&saved.payload, n_vocab).unwrap();
    let logits = cur.logits.clone().expect("the chat saves its logits");

    // The chat's old `/save` payload: the bare engine snapshot. The server restores it,
    // reports its tokens as cached and rewrites it in the current format.
    rewrite(&saved, &cur.snapshot);
    let srv = serve(kv.path());
    let v = srv.chat(&follow_up(&answer_of(&saved.tokens)));
    assert_eq!(cached(&v), saved.tokens.len() as u64, "{v}");
    srv.stop();
    let migrated = read_entry(&saved.path);
    assert!(is_current_payload(&migrated.payload), "migrated in place");
    assert_eq!(migrated.tokens, saved.tokens);

    // The server's old payload (DS4SRV1 + logits + snapshot), loaded by the chat.
    let mut v1 = b"DS4SRV1\0".to_vec();
    v1.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    for x in &logits {
        v1.extend_from_slice(&x.to_le_bytes());
    }
    v1.extend_from_slice(&cur.snapshot);
    rewrite(&saved, &v1);
    let (_, err) = chat(kv.path(), "/load s1\nnext question\n/quit\n");
    assert!(
        err.contains("session s1 migrated from the ds4-server v1 format"),
        "{err}"
    );
    assert_eq!(status_lines(&err)[0].1, saved.tokens.len(), "{err}");
    let migrated = read_entry(&saved.path);
    assert!(is_current_payload(&migrated.payload));
    let back = ds4_runtime::checkpoint::decode(&migrated.payload, n_vocab).unwrap();
    assert_eq!(
        back.logits,
        Some(logits),
        "the v1 logits survive the migration"
    );
    assert_eq!(back.snapshot, cur.snapshot);
}
