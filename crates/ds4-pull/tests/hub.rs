//! `pull` against a local stand-in for the hub: two listeners on 127.0.0.1 (the hub and its
//! CDN, different origins as in production). The hub answers the resolve URL with a 302 and
//! the `X-Linked-*` headers; the CDN serves bytes with `Range` support and can be told to
//! cut connections after K bytes. No network beyond loopback.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ds4_pull::{part_path, pull, FreeSpace, NoProgress, Options, PullError, Pulled, Source};
use sha2::{Digest, Sha256};

#[derive(Debug, Clone)]
struct Req {
    cdn: bool,
    method: String,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

#[derive(Default)]
struct Cfg {
    /// Resolve path (`/o/r/resolve/main/f`) → (bytes, advertised SHA-256).
    files: HashMap<String, (Vec<u8>, String)>,
    /// For each successive CDN GET: cut the connection after this many body bytes.
    cuts: VecDeque<u64>,
    /// Answer 200 with the whole file even to a Range request.
    ignore_range: bool,
    /// Token the hub requires (401 without it).
    token: Option<String>,
}

struct Hub {
    endpoint: String,
    cdn: String,
    log: Arc<Mutex<Vec<Req>>>,
    cfg: Arc<Mutex<Cfg>>,
}

impl Hub {
    fn start() -> Hub {
        let log = Arc::new(Mutex::new(Vec::new()));
        let cfg = Arc::new(Mutex::new(Cfg::default()));
        let hub = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", hub.local_addr().unwrap());
        let cdn_base = format!("http://{}", cdn.local_addr().unwrap());
        for (listener, is_cdn) in [(hub, false), (cdn, true)] {
            let (log, cfg, cdn_base) = (log.clone(), cfg.clone(), cdn_base.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    serve(stream, is_cdn, &cdn_base, &log, &cfg);
                }
            });
        }
        Hub {
            endpoint,
            cdn: cdn_base,
            log,
            cfg,
        }
    }

    fn add(&self, repo: &str, file: &str, data: Vec<u8>, sha: Option<String>) {
        let sha = sha.unwrap_or_else(|| sha256(&data));
        self.cfg
            .lock()
            .unwrap()
            .files
            .insert(format!("/{repo}/resolve/main/{file}"), (data, sha));
    }

    fn log(&self) -> Vec<Req> {
        self.log.lock().unwrap().clone()
    }

    fn cdn_gets(&self) -> Vec<Req> {
        self.log()
            .into_iter()
            .filter(|r| r.cdn && r.method == "GET")
            .collect()
    }

    fn source(&self, repo: &str, file: &str) -> Source {
        Source::new(&self.endpoint, repo, "main", file).unwrap()
    }
}

fn serve(
    mut stream: TcpStream,
    is_cdn: bool,
    cdn_base: &str,
    log: &Mutex<Vec<Req>>,
    cfg: &Mutex<Cfg>,
) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut first = String::new();
    if reader.read_line(&mut first).is_err() {
        return;
    }
    let mut it = first.split_whitespace();
    let method = it.next().unwrap_or("").to_string();
    let path = it.next().unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let req = Req {
        cdn: is_cdn,
        method: method.clone(),
        path: path.clone(),
        range: headers.get("range").cloned(),
        auth: headers.get("authorization").cloned(),
    };
    log.lock().unwrap().push(req.clone());
    let mut cfg = cfg.lock().unwrap();

    if !is_cdn {
        if let Some(t) = &cfg.token {
            if req.auth.as_deref() != Some(&format!("Bearer {t}")) {
                return respond(&mut stream, "401 Unauthorized", &[], &[], None);
            }
        }
        let Some((data, sha)) = cfg.files.get(&path) else {
            return respond(
                &mut stream,
                "404 Not Found",
                &[("X-Error-Code", "EntryNotFound".into())],
                b"Entry not found",
                None,
            );
        };
        let loc = format!("{cdn_base}/cdn{path}");
        return respond(
            &mut stream,
            "302 Found",
            &[
                ("Location", loc),
                ("X-Linked-Etag", format!("\"{sha}\"")),
                ("X-Linked-Size", data.len().to_string()),
                ("ETag", "\"0123abcd\"".into()),
                ("X-Repo-Commit", "c0ffee".into()),
            ],
            &[],
            None,
        );
    }

    let key = path.strip_prefix("/cdn").unwrap_or("");
    let Some((data, _)) = cfg.files.get(key).cloned() else {
        return respond(&mut stream, "404 Not Found", &[], b"no such object", None);
    };
    let cut = cfg.cuts.pop_front();
    let start = match (&req.range, cfg.ignore_range) {
        (Some(r), false) => r
            .strip_prefix("bytes=")
            .and_then(|r| r.strip_suffix('-'))
            .and_then(|n| n.parse::<usize>().ok()),
        _ => None,
    };
    drop(cfg);
    match start {
        Some(s) => {
            let range = format!("bytes {s}-{}/{}", data.len() - 1, data.len());
            respond(
                &mut stream,
                "206 Partial Content",
                &[("Content-Range", range), ("Accept-Ranges", "bytes".into())],
                &data[s..],
                cut,
            )
        }
        None => respond(
            &mut stream,
            "200 OK",
            &[("Accept-Ranges", "bytes".into())],
            &data,
            cut,
        ),
    }
}

/// Writes an answer with the full Content-Length, then maybe only `cut` bytes of the body
/// before closing: an interrupted transfer as the client sees it.
fn respond(
    stream: &mut TcpStream,
    status: &str,
    headers: &[(&str, String)],
    body: &[u8],
    cut: Option<u64>,
) {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let n = cut.map_or(body.len(), |c| (c as usize).min(body.len()));
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(&body[..n]);
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Both);
}

fn sha256(d: &[u8]) -> String {
    Sha256::digest(d)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Deterministic bytes that are not a repeating pattern (a wrong offset changes the hash).
fn data(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn opts() -> Options {
    Options {
        retries: 3,
        retry_delay: Duration::ZERO,
        connect_timeout: Duration::from_secs(5),
        read_timeout: Duration::from_secs(5),
        ..Options::default()
    }
}

struct Plenty;
impl FreeSpace for Plenty {
    fn available(&self, _: &Path) -> std::io::Result<u64> {
        Ok(u64::MAX)
    }
}

struct Only(u64);
impl FreeSpace for Only {
    fn available(&self, _: &Path) -> std::io::Result<u64> {
        Ok(self.0)
    }
}

fn run(hub: &Hub, file: &str, dir: &Path, o: &Options) -> Result<Pulled, PullError> {
    pull(&hub.source("o/r", file), dir, o, &Plenty, &mut NoProgress)
}

#[test]
fn full_download_is_verified_and_renamed() {
    let hub = Hub::start();
    let d = data(3_000_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    let tmp = tempfile::tempdir().unwrap();
    let got = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap();
    assert_eq!(got.path, tmp.path().join("m.gguf"));
    assert_eq!(got.size, d.len() as u64);
    assert_eq!(got.fetched, d.len() as u64);
    assert_eq!(got.sha256.as_deref(), Some(sha256(&d).as_str()));
    assert!(!got.already_present);
    assert_eq!(std::fs::read(&got.path).unwrap(), d);
    assert!(!part_path(&got.path).exists());
    let log = hub.log();
    assert_eq!(log[0].method, "HEAD");
    assert_eq!(log[0].path, "/o/r/resolve/main/m.gguf");
    let gets = hub.cdn_gets();
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].range, None);

    // A second run finds the file and fetches nothing.
    let again = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap();
    assert!(again.already_present);
    assert_eq!(hub.cdn_gets().len(), 1);
}

#[test]
fn a_file_in_a_folder_lands_in_the_same_folder() {
    let hub = Hub::start();
    let d = data(10_000);
    hub.add("o/r", "sub/m.gguf", d.clone(), None);
    let tmp = tempfile::tempdir().unwrap();
    let got = run(&hub, "sub/m.gguf", tmp.path(), &opts()).unwrap();
    assert_eq!(got.path, tmp.path().join("sub").join("m.gguf"));
    assert_eq!(std::fs::read(&got.path).unwrap(), d);
}

#[test]
fn resume_from_part_asks_for_the_rest() {
    let hub = Hub::start();
    let d = data(2_000_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("m.gguf.part"), &d[..777_777]).unwrap();
    let got = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap();
    assert_eq!(got.fetched, (d.len() - 777_777) as u64);
    assert_eq!(std::fs::read(&got.path).unwrap(), d);
    let gets = hub.cdn_gets();
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].range.as_deref(), Some("bytes=777777-"));
}

#[test]
fn an_interrupted_transfer_is_retried_from_the_bytes_written() {
    let hub = Hub::start();
    let d = data(3_000_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    hub.cfg.lock().unwrap().cuts = VecDeque::from([500_000, 1_200_000]);
    let tmp = tempfile::tempdir().unwrap();
    let got = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap();
    assert_eq!(std::fs::read(&got.path).unwrap(), d);
    assert_eq!(got.fetched, d.len() as u64);
    let ranges: Vec<_> = hub.cdn_gets().into_iter().map(|r| r.range).collect();
    assert_eq!(
        ranges,
        [
            None,
            Some("bytes=500000-".to_string()),
            Some("bytes=1700000-".to_string())
        ]
    );
    // Each retry asked the hub again (a fresh CDN location, and the same SHA-256).
    let heads = hub.log().iter().filter(|r| r.method == "HEAD").count();
    assert_eq!(heads, 3);
}

#[test]
fn retries_are_bounded_and_the_part_is_kept() {
    let hub = Hub::start();
    let d = data(100_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    // The first connection gives 1000 bytes, every later one nothing.
    hub.cfg.lock().unwrap().cuts = VecDeque::from([1000, 0, 0, 0, 0, 0, 0]);
    let tmp = tempfile::tempdir().unwrap();
    let e = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap_err();
    match &e {
        PullError::RetriesExhausted { attempts, have, .. } => {
            assert_eq!(*attempts, 4);
            assert_eq!(*have, 1000);
        }
        other => panic!("expected RetriesExhausted, got {other}"),
    }
    assert!(e.to_string().contains("run again to resume"), "{e}");
    assert!(!tmp.path().join("m.gguf").exists());
    assert_eq!(
        std::fs::read(tmp.path().join("m.gguf.part")).unwrap(),
        &d[..1000]
    );
    // The attempt that broke off after 1000 bytes, then the 3 retries allowed.
    assert_eq!(hub.cdn_gets().len(), 4);
}

#[test]
fn a_wrong_sha256_leaves_no_file_and_says_so() {
    let hub = Hub::start();
    let d = data(50_000);
    let wrong = sha256(b"something else");
    hub.add("o/r", "m.gguf", d, Some(wrong.clone()));
    let tmp = tempfile::tempdir().unwrap();
    let e = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap_err();
    assert!(matches!(e, PullError::Mismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("SHA-256 mismatch for m.gguf"), "{msg}");
    assert!(msg.contains(&wrong), "{msg}");
    assert!(msg.contains("was deleted"), "{msg}");
    assert!(!tmp.path().join("m.gguf").exists());
    assert!(!tmp.path().join("m.gguf.part").exists());
}

#[test]
fn a_missing_file_is_named() {
    let hub = Hub::start();
    let tmp = tempfile::tempdir().unwrap();
    let e = run(&hub, "nope.gguf", tmp.path(), &opts()).unwrap_err();
    assert!(matches!(e, PullError::NoSuchFile { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("no file nope.gguf in repository o/r at revision main"),
        "{e}"
    );
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none());
}

#[test]
fn too_little_disk_space_is_refused_before_downloading() {
    let hub = Hub::start();
    let d = data(100_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    let tmp = tempfile::tempdir().unwrap();
    // 40,000 bytes already there: 60,000 still needed, 59,999 free.
    std::fs::write(tmp.path().join("m.gguf.part"), &d[..40_000]).unwrap();
    let e = pull(
        &hub.source("o/r", "m.gguf"),
        tmp.path(),
        &opts(),
        &Only(59_999),
        &mut NoProgress,
    )
    .unwrap_err();
    match &e {
        PullError::NoSpace {
            needed, available, ..
        } => assert_eq!((*needed, *available), (60_000, 59_999)),
        other => panic!("expected NoSpace, got {other}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("60000 bytes") && msg.contains("59999 bytes"),
        "{msg}"
    );
    assert!(hub.cdn_gets().is_empty());
    // Exactly enough is enough.
    let got = pull(
        &hub.source("o/r", "m.gguf"),
        tmp.path(),
        &opts(),
        &Only(60_000),
        &mut NoProgress,
    )
    .unwrap();
    assert_eq!(std::fs::read(got.path).unwrap(), d);
}

#[test]
fn the_token_goes_to_the_hub_and_not_to_the_cdn() {
    let hub = Hub::start();
    let d = data(10_000);
    hub.add("o/r", "m.gguf", d, None);
    hub.cfg.lock().unwrap().token = Some("sekrit".into());
    let tmp = tempfile::tempdir().unwrap();

    let e = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap_err();
    assert!(
        matches!(e, PullError::NeedsToken { status: 401, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("HF_TOKEN"), "{e}");

    let o = Options {
        token: Some("sekrit".into()),
        ..opts()
    };
    run(&hub, "m.gguf", tmp.path(), &o).unwrap();
    let hub_reqs: Vec<Req> = hub.log().into_iter().filter(|r| !r.cdn).collect();
    assert_eq!(
        hub_reqs.last().unwrap().auth.as_deref(),
        Some("Bearer sekrit")
    );
    let gets = hub.cdn_gets();
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0].auth, None, "the CDN ({}) got the token", hub.cdn);
}

#[test]
fn a_server_that_ignores_ranges_gets_a_fresh_start() {
    let hub = Hub::start();
    let d = data(200_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    hub.cfg.lock().unwrap().ignore_range = true;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("m.gguf.part"), &d[..1234]).unwrap();
    let got = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap();
    assert_eq!(std::fs::read(&got.path).unwrap(), d);
    assert_eq!(got.fetched, d.len() as u64);
}

#[test]
fn a_different_file_under_the_final_name_is_not_overwritten() {
    let hub = Hub::start();
    hub.add("o/r", "m.gguf", data(1000), None);
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("m.gguf"), b"mine").unwrap();
    let e = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap_err();
    assert!(
        matches!(e, PullError::ExistingDiffers { size: 4, .. }),
        "{e}"
    );
    assert_eq!(std::fs::read(tmp.path().join("m.gguf")).unwrap(), b"mine");
}

#[test]
fn a_complete_part_is_verified_and_renamed_without_fetching() {
    let hub = Hub::start();
    let d = data(70_000);
    hub.add("o/r", "m.gguf", d.clone(), None);
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("m.gguf.part"), &d).unwrap();
    let got = run(&hub, "m.gguf", tmp.path(), &opts()).unwrap();
    assert_eq!(got.fetched, 0);
    assert!(!got.already_present);
    assert_eq!(std::fs::read(&got.path).unwrap(), d);
    assert!(hub.cdn_gets().is_empty());
}
