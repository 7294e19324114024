//! `ds4 vectors`: compare this engine with DeepSeek's official API vectors (issue 12,
//! docs/chat.md §5).
//!
//! A vectors directory holds `manifest.json` (the cases), `prompts/*.txt` (one user prompt
//! each) and `official/*.official.json` (`usage.prompt_tokens` and per greedy step the chosen
//! token's bytes and the API's top-20 `(bytes, logprob)` list). Each prompt is rendered as one
//! non-thinking user turn (BOS, User, BPE(prompt), Assistant, `</think>`), its token count is
//! checked, then the engine decodes greedily for the official number of steps and every step
//! is compared.
//!
//! The API's temperature-0 answers carry a quirk the comparison must know about: log-probs
//! of tokens outside the sampling distribution are reported as the floor value `-9999`, and a
//! step whose chosen token is certain lists `0.0` for it and the floor for the other 19 (in
//! vocabulary order, not rank order). Such floor entries carry no information and are left
//! out of the top-20 and log-prob checks; a step where every other entry is at the floor is
//! "degenerate" and only its chosen token is checked.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context};
use ds4_chat::render::official_vector_tokens;
use ds4_chat::Tokenizer;
use serde::Serialize;
use serde_json::Value;

/// Entries at or below this are the API's "-9999" floor, not a log-probability.
pub const API_FLOOR: f64 = -9000.0;
/// Size of the top lists compared.
pub const TOP: usize = 20;

const MAX_MANIFEST_BYTES: u64 = 1 << 20;
const MAX_FILE_BYTES: u64 = 16 << 20;
const MAX_CASES: usize = 1000;
const MAX_STEPS: usize = 4096;
const MAX_TOP_ENTRIES: usize = 128;
const MAX_TOKEN_BYTES: usize = 1024;

/// Pass/fail limits; the defaults and their reasons are in the `--help` text
/// ([`THRESHOLDS_HELP`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Thresholds {
    /// Of a full list of 20 informative official entries, at least this many must be in our
    /// top-20 (fewer informative entries: proportionally fewer, `n - (20 - min_overlap)`).
    pub min_overlap: usize,
    /// Largest |our logprob − official logprob| over the official top-5 informative entries.
    pub max_top5_delta: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            min_overlap: 17,
            max_top5_delta: 0.5,
        }
    }
}

pub const THRESHOLDS_HELP: &str = "\
Verdict (per step; a case passes when its prompt token count matches and every step passes):
  * the chosen token's bytes equal the official ones at every step. Greedy decoding is what
    the API did; a correct engine reproduces the argmax unless two tokens are within the
    numeric noise of each other, which the official steps (chosen token at p ~ 1) are not.
  * top-20 overlap >= 17 (--min-overlap). The tail of a top-20 list holds tokens whose logits
    differ by hundredths; accumulation order and FP8 kernels of DeepSeek's serving stack can
    swap a few of them across the boundary, so 3 swaps are tolerated. A wrong model
    (tokenizer, RoPE, attention, routing) shares far fewer.
  * max |delta logprob| over the official top-5 <= 0.5 nats (--max-top5-delta): a factor of
    1.65 in probability. The QAT simulations of `official` mode reproduce the checkpoint's
    graph, so the remaining differences are rounding (a few hundredths of a nat); a structural
    error moves these log-probs by whole nats.
  Official entries at the API's floor (-9999) carry no value and are skipped; a step whose
  other 19 entries are all at the floor (the API's temperature-0 answer for a certain token)
  is checked on its chosen token only. The thresholds are meant for `official` mode (the
  default on real models); `exact` mode omits the FP8/FP4 simulations and may differ more.
Exit status: 0 pass, 1 a case disagrees, 2 the vectors or the model could not be read.";

/// One official step.
#[derive(Debug, Clone, PartialEq)]
pub struct OfficialStep {
    pub token: Vec<u8>,
    /// The API's top list, in its order.
    pub top: Vec<(Vec<u8>, f64)>,
}

/// One case, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub id: String,
    pub prompt: String,
    pub prompt_tokens: usize,
    pub steps: Vec<OfficialStep>,
}

fn field<'a>(v: &'a Value, key: &str, what: &dyn Fn() -> String) -> anyhow::Result<&'a Value> {
    v.get(key)
        .with_context(|| format!("{}: missing \"{key}\"", what()))
}

fn read_capped(path: &Path, cap: u64, what: &str) -> anyhow::Result<Vec<u8>> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("{what} {} not found", path.display()))?;
    if !meta.is_file() {
        bail!("{what} {} is not a file", path.display());
    }
    if meta.len() > cap {
        bail!(
            "{what} {} is {} bytes, more than the {} allowed",
            path.display(),
            meta.len(),
            cap
        );
    }
    std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))
}

fn parse_json(bytes: &[u8], path: &Path) -> anyhow::Result<Value> {
    serde_json::from_slice(bytes).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// A path inside the vectors directory (no absolute paths, no `..`).
fn inside(dir: &Path, rel: &str, what: &dyn Fn() -> String) -> anyhow::Result<PathBuf> {
    let p = Path::new(rel);
    if rel.is_empty()
        || p.components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        bail!(
            "{}: {rel:?} must be a relative path inside the directory",
            what()
        );
    }
    Ok(dir.join(p))
}

fn token_bytes(v: &Value, what: &dyn Fn() -> String) -> anyhow::Result<Vec<u8>> {
    let arr = field(v, "bytes", what)?
        .as_array()
        .with_context(|| format!("{}.bytes: not an array", what()))?;
    if arr.len() > MAX_TOKEN_BYTES {
        bail!(
            "{}.bytes: {} bytes is too long for a token",
            what(),
            arr.len()
        );
    }
    arr.iter()
        .enumerate()
        .map(|(i, b)| {
            b.as_u64()
                .and_then(|x| u8::try_from(x).ok())
                .with_context(|| format!("{}.bytes[{i}] = {b} is not a byte", what()))
        })
        .collect()
}

/// Reads one official file.
fn read_official(path: &Path, id: &str) -> anyhow::Result<(usize, Vec<OfficialStep>)> {
    let v = parse_json(&read_capped(path, MAX_FILE_BYTES, "official file")?, path)?;
    let name = path.display().to_string();
    let here = || name.clone();
    if let Some(fid) = v.get("id").and_then(Value::as_str) {
        if fid != id {
            bail!("{name}: id {fid:?} does not match the manifest's {id:?}");
        }
    }
    let pt = field(field(&v, "usage", &here)?, "prompt_tokens", &|| {
        format!("{name}: usage")
    })?;
    let prompt_tokens = pt
        .as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .with_context(|| format!("{name}: usage.prompt_tokens = {pt} is not a count"))?;
    let steps_v = field(&v, "steps", &here)?
        .as_array()
        .with_context(|| format!("{name}: steps is not an array"))?;
    if steps_v.is_empty() || steps_v.len() > MAX_STEPS {
        bail!(
            "{name}: {} steps (expected 1 to {MAX_STEPS})",
            steps_v.len()
        );
    }
    let mut steps = Vec::with_capacity(steps_v.len());
    for (i, s) in steps_v.iter().enumerate() {
        let at = || format!("{name}: steps[{i}]");
        let token = token_bytes(field(s, "token", &at)?, &|| format!("{}.token", at()))?;
        let top_v = field(s, "top_logprobs", &at)?
            .as_array()
            .with_context(|| format!("{}.top_logprobs is not an array", at()))?;
        if top_v.is_empty() || top_v.len() > MAX_TOP_ENTRIES {
            bail!(
                "{}.top_logprobs has {} entries (expected 1 to {MAX_TOP_ENTRIES})",
                at(),
                top_v.len()
            );
        }
        let mut top = Vec::with_capacity(top_v.len());
        for (j, e) in top_v.iter().enumerate() {
            let eat = || format!("{}.top_logprobs[{j}]", at());
            let b = token_bytes(field(e, "token", &eat)?, &|| format!("{}.token", eat()))?;
            let lp = field(e, "logprob", &eat)?;
            let lp = lp
                .as_f64()
                .filter(|x| x.is_finite() && *x <= 1e-6)
                .with_context(|| format!("{}.logprob = {lp} is not a log-probability", eat()))?;
            top.push((b, lp));
        }
        steps.push(OfficialStep { token, top });
    }
    Ok((prompt_tokens, steps))
}

/// Reads and checks a whole vectors directory; `only` keeps the named cases, `skip` drops
/// the named cases (both must name cases that exist).
pub fn read_dir(dir: &Path, only: &[String], skip: &[String]) -> anyhow::Result<Vec<Case>> {
    let mpath = dir.join("manifest.json");
    if !dir.is_dir() {
        bail!("vectors directory {} not found", dir.display());
    }
    if !mpath.is_file() {
        bail!(
            "{} not found: is {} a test-vector directory (manifest.json, prompts/, official/)?",
            mpath.display(),
            dir.display()
        );
    }
    let m = parse_json(
        &read_capped(&mpath, MAX_MANIFEST_BYTES, "manifest")?,
        &mpath,
    )?;
    let mname = mpath.display().to_string();
    let list = field(&m, "prompts", &|| mname.clone())?
        .as_array()
        .with_context(|| format!("{mname}: prompts is not an array"))?;
    if list.is_empty() || list.len() > MAX_CASES {
        bail!("{mname}: {} cases (expected 1 to {MAX_CASES})", list.len());
    }
    let mut seen = HashSet::new();
    let mut cases = Vec::new();
    for (i, c) in list.iter().enumerate() {
        let at = || format!("{mname}: prompts[{i}]");
        let str_of = |k: &str| -> anyhow::Result<String> {
            field(c, k, &at)?
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("{}.{k} is not a string", at()))
        };
        let id = str_of("id")?;
        if !seen.insert(id.clone()) {
            bail!("{}: case id {id:?} appears twice", at());
        }
        if (!only.is_empty() && !only.contains(&id)) || skip.contains(&id) {
            continue;
        }
        let prompt_path = inside(dir, &str_of("prompt_file")?, &at)?;
        let official_path = inside(dir, &str_of("official_file")?, &at)?;
        let steps_m = field(c, "steps", &at)?
            .as_u64()
            .with_context(|| format!("{}.steps is not a count", at()))?;
        let prompt = String::from_utf8(read_capped(&prompt_path, MAX_FILE_BYTES, "prompt file")?)
            .map_err(|_| {
            anyhow::anyhow!("prompt file {} is not UTF-8", prompt_path.display())
        })?;
        let (prompt_tokens, steps) = read_official(&official_path, &id)?;
        if steps.len() as u64 != steps_m {
            bail!(
                "{}: the manifest says {steps_m} steps, {} has {}",
                at(),
                official_path.display(),
                steps.len()
            );
        }
        cases.push(Case {
            id,
            prompt,
            prompt_tokens,
            steps,
        });
    }
    for want in only.iter().chain(skip) {
        if !seen.contains(want) {
            bail!("{mname}: no case named {want:?}");
        }
    }
    Ok(cases)
}

/// The API spells EOS with doubled bars (`<｜｜end▁of▁sentence｜｜>`); map such a token to
/// the vocabulary's spelling so it compares equal.
pub fn normalize_official(bytes: &[u8]) -> Vec<u8> {
    const BAR2: &str = "｜｜";
    if let Ok(s) = std::str::from_utf8(bytes) {
        if let Some(inner) = s
            .strip_prefix(&format!("<{BAR2}"))
            .and_then(|r| r.strip_suffix(&format!("{BAR2}>")))
        {
            return format!("<｜{inner}｜>").into_bytes();
        }
    }
    bytes.to_vec()
}

/// Our side of one step.
#[derive(Debug, Clone)]
pub struct OurStep {
    pub chosen: Vec<u8>,
    /// Our top-20 `(bytes, logprob)`, by logit (lower id first on ties).
    pub top: Vec<(Vec<u8>, f64)>,
}

/// The comparison of one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    pub step: usize,
    pub official: String,
    pub ours: String,
    pub chosen_match: bool,
    /// Official entries above the API floor.
    pub informative: usize,
    /// Every other official entry is at the floor: only the chosen token is checked.
    pub degenerate: bool,
    /// Official top-list tokens (all of them) found in our top-20.
    pub overlap: usize,
    /// Informative official tokens found in our top-20, and how many were needed.
    pub overlap_informative: usize,
    pub overlap_needed: usize,
    /// Over the official top-5 informative entries; `None` when none could be compared.
    pub max_delta_top5: Option<f64>,
    /// Over all informative entries.
    pub max_delta_all: Option<f64>,
    pub pass: bool,
    /// Why it failed, if it did.
    pub problems: Vec<String>,
}

/// Shows token bytes readably: lossy UTF-8, escaped, shortened.
pub fn show(bytes: &[u8]) -> String {
    let s = format!("{:?}", String::from_utf8_lossy(bytes));
    if s.chars().count() > 16 {
        let cut: String = s.chars().take(14).collect();
        format!("{cut}…\"")
    } else {
        s
    }
}

/// Compares one step. `our_logprob(bytes)` gives our log-probability of any token by its
/// bytes (`None` if no vocabulary token has those bytes).
pub fn compare_step(
    step: usize,
    off: &OfficialStep,
    ours: &OurStep,
    our_logprob: &dyn Fn(&[u8]) -> Option<f64>,
    th: &Thresholds,
) -> StepReport {
    let official_token = normalize_official(&off.token);
    let chosen_match = official_token == ours.chosen;
    let ours_set: HashSet<&[u8]> = ours
        .top
        .iter()
        .take(TOP)
        .map(|(b, _)| b.as_slice())
        .collect();
    let top: Vec<(Vec<u8>, f64)> = off
        .top
        .iter()
        .take(TOP)
        .map(|(b, lp)| (normalize_official(b), *lp))
        .collect();
    let overlap = top
        .iter()
        .filter(|(b, _)| ours_set.contains(b.as_slice()))
        .count();
    let informative: Vec<&(Vec<u8>, f64)> = top.iter().filter(|(_, lp)| *lp > API_FLOOR).collect();
    let degenerate = informative.len() <= 1;
    let mut problems = Vec::new();
    if !chosen_match {
        problems.push(format!(
            "chose {} where the official answer is {}",
            show(&ours.chosen),
            show(&official_token)
        ));
    }
    let overlap_informative = informative
        .iter()
        .filter(|(b, _)| ours_set.contains(b.as_slice()))
        .count();
    let overlap_needed = if degenerate {
        0
    } else {
        informative
            .len()
            .saturating_sub(TOP.saturating_sub(th.min_overlap))
    };
    let deltas = |n: usize| -> Option<f64> {
        informative
            .iter()
            .take(n)
            .filter_map(|(b, lp)| our_logprob(b).map(|ours| (ours - lp).abs()))
            .reduce(f64::max)
    };
    let (max_delta_top5, max_delta_all) = if degenerate {
        (None, None)
    } else {
        (deltas(5), deltas(TOP))
    };
    if overlap_informative < overlap_needed {
        problems.push(format!(
            "top-20 overlap {overlap_informative} of {} informative entries, needed {overlap_needed}",
            informative.len()
        ));
    }
    if let Some(d) = max_delta_top5 {
        if d > th.max_top5_delta {
            problems.push(format!(
                "|delta logprob| {d:.3} on the official top-5 exceeds {}",
                th.max_top5_delta
            ));
        }
    }
    StepReport {
        step,
        official: show(&official_token),
        ours: show(&ours.chosen),
        chosen_match,
        informative: informative.len(),
        degenerate,
        overlap,
        overlap_informative,
        overlap_needed,
        max_delta_top5,
        max_delta_all,
        pass: problems.is_empty(),
        problems,
    }
}

/// One case's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseReport {
    pub id: String,
    pub prompt_tokens: usize,
    pub official_prompt_tokens: usize,
    pub count_match: bool,
    pub steps: Vec<StepReport>,
    pub pass: bool,
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub dir: String,
    pub model: String,
    /// `None` in counts-only mode (no engine ran).
    pub mode: Option<String>,
    pub backend: Option<String>,
    pub counts_only: bool,
    pub thresholds: Thresholds,
    pub cases: Vec<CaseReport>,
    pub pass: bool,
}

/// The rendered prompt of a case.
pub fn prompt_tokens(tok: &Tokenizer, case: &Case) -> anyhow::Result<Vec<u32>> {
    official_vector_tokens(tok, &case.prompt)
        .with_context(|| format!("{}: tokenizing the prompt", case.id))
}

/// Log-softmax in f64 (the API's log-probs are natural logs over the whole vocabulary).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// Ids of the `k` largest logits, largest first, lower id first on ties.
pub fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

/// Byte string → first token id with those bytes.
pub fn bytes_index(tok: &Tokenizer) -> HashMap<Vec<u8>, u32> {
    let mut m = HashMap::with_capacity(tok.vocab_size());
    for id in 0..tok.vocab_size() as u32 {
        if let Ok(b) = tok.token_bytes(id) {
            m.entry(b.to_vec()).or_insert(id);
        }
    }
    m
}

/// Greedy-decodes a case on `session` (reset first) and compares every step.
pub fn run_case(
    session: &mut ds4_engine::Session,
    tok: &Tokenizer,
    index: &HashMap<Vec<u8>, u32>,
    case: &Case,
    th: &Thresholds,
) -> anyhow::Result<CaseReport> {
    let ids = prompt_tokens(tok, case)?;
    let count_match = ids.len() == case.prompt_tokens;
    session.reset()?;
    let need = ids.len() + case.steps.len();
    if need > session.ctx() {
        bail!(
            "{}: {need} tokens do not fit the context of {} (give --ctx)",
            case.id,
            session.ctx()
        );
    }
    let mut logits = session
        .prefill(&ids)
        .with_context(|| format!("{}: prefill", case.id))?;
    let mut steps = Vec::with_capacity(case.steps.len());
    for (i, off) in case.steps.iter().enumerate() {
        let lp = log_softmax(&logits);
        let top = top_k(&logits, TOP);
        let chosen = top[0];
        let bytes = |id: u32| tok.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
        let ours = OurStep {
            chosen: bytes(chosen),
            top: top.iter().map(|&t| (bytes(t), lp[t as usize])).collect(),
        };
        let our_lp = |b: &[u8]| index.get(b).map(|&id| lp[id as usize]);
        steps.push(compare_step(i, off, &ours, &our_lp, th));
        if i + 1 < case.steps.len() {
            logits = session
                .decode(chosen)
                .with_context(|| format!("{}: decode step {i}", case.id))?;
        }
    }
    let pass = count_match && steps.iter().all(|s| s.pass);
    Ok(CaseReport {
        id: case.id.clone(),
        prompt_tokens: ids.len(),
        official_prompt_tokens: case.prompt_tokens,
        count_match,
        steps,
        pass,
    })
}

/// Counts only (no engine): the rendered prompt's token count against `usage.prompt_tokens`.
pub fn count_case(tok: &Tokenizer, case: &Case) -> anyhow::Result<CaseReport> {
    let n = prompt_tokens(tok, case)?.len();
    Ok(CaseReport {
        id: case.id.clone(),
        prompt_tokens: n,
        official_prompt_tokens: case.prompt_tokens,
        count_match: n == case.prompt_tokens,
        steps: Vec::new(),
        pass: n == case.prompt_tokens,
    })
}

fn fmt_delta(d: Option<f64>) -> String {
    d.map(|d| format!("{d:.3}")).unwrap_or_else(|| "-".into())
}

/// The human-readable report.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let n = r.cases.len();
    let _ = writeln!(
        s,
        "ds4 vectors · {} · {n} case(s) · model {}",
        r.dir, r.model
    );
    if r.counts_only {
        let _ = writeln!(s, "counts only: prompt token counts (no engine ran)\n");
        let _ = writeln!(s, "{:<28} {:>8} {:>9}  result", "case", "ours", "official");
        for c in &r.cases {
            let _ = writeln!(
                s,
                "{:<28} {:>8} {:>9}  {}",
                c.id,
                c.prompt_tokens,
                c.official_prompt_tokens,
                if c.count_match { "ok" } else { "MISMATCH" }
            );
        }
    } else {
        let _ = writeln!(
            s,
            "mode {} · backend {}",
            r.mode.as_deref().unwrap_or("?"),
            r.backend.as_deref().unwrap_or("?")
        );
        let _ = writeln!(
            s,
            "thresholds: chosen token equal at every step · top-20 overlap >= {} · max |delta logprob| on the official top-5 <= {}\n",
            r.thresholds.min_overlap, r.thresholds.max_top5_delta
        );
        let _ = writeln!(
            s,
            "{:<24} {:<14} {:>4}  {:<18} {:<18} {:>7} {:>8}  result",
            "case", "prompt tokens", "step", "official", "ours", "top-20", "|d|top5"
        );
        for c in &r.cases {
            let count = format!(
                "{} {} {}",
                c.prompt_tokens,
                if c.count_match { "=" } else { "!=" },
                c.official_prompt_tokens
            );
            if c.steps.is_empty() {
                let _ = writeln!(s, "{:<24} {:<14}", c.id, count);
            }
            for (k, st) in c.steps.iter().enumerate() {
                let (id, cnt) = if k == 0 {
                    (c.id.as_str(), count.as_str())
                } else {
                    ("", "")
                };
                let top = if st.degenerate {
                    "(cert.)".to_string()
                } else {
                    format!("{}/{}", st.overlap_informative, st.informative)
                };
                let _ = writeln!(
                    s,
                    "{:<24} {:<14} {:>4}  {:<18} {:<18} {:>7} {:>8}  {}",
                    id,
                    cnt,
                    st.step,
                    st.official,
                    st.ours,
                    top,
                    fmt_delta(st.max_delta_top5),
                    if st.pass { "ok" } else { "FAIL" }
                );
                for p in &st.problems {
                    let _ = writeln!(s, "{:<24} {:<14} {:>4}  ^ {p}", "", "", "");
                }
            }
        }
        if r.cases
            .iter()
            .flat_map(|c| &c.steps)
            .any(|st| st.degenerate)
        {
            let _ = writeln!(
                s,
                "\n(cert.) = the API reported the chosen token as certain and every other entry at its -9999 floor: only the chosen token is compared"
            );
        }
    }
    let passed = r.cases.iter().filter(|c| c.pass).count();
    let what = if r.counts_only {
        "prompt token counts match"
    } else {
        "cases agree"
    };
    let _ = writeln!(
        s,
        "\nverdict: {} — {passed} of {n} {what}{}",
        if r.pass { "PASS" } else { "FAIL" },
        match (&r.mode, &r.backend) {
            (Some(m), Some(b)) => format!(" (mode {m}, backend {b})"),
            _ => String::new(),
        }
    );
    for c in r.cases.iter().filter(|c| !c.count_match) {
        let _ = writeln!(
            s,
            "  {}: the rendered prompt has {} tokens, the API counted {} (tokenizer or rendering differs)",
            c.id, c.prompt_tokens, c.official_prompt_tokens
        );
    }
    s
}

/// What `ds4 vectors` was asked to do.
pub struct VectorsRun {
    pub dir: PathBuf,
    /// How to load the model; `ctx` 0 = just large enough for the longest case.
    pub load: crate::load::LoadOptions,
    pub counts_only: bool,
    pub thresholds: Thresholds,
    pub only: Vec<String>,
    pub skip: Vec<String>,
}

/// Reads the vectors, loads the model (only its vocabulary with `counts_only`) and compares.
pub fn run(args: &VectorsRun, log: &mut dyn std::io::Write) -> anyhow::Result<Report> {
    let cases = read_dir(&args.dir, &args.only, &args.skip)?;
    if cases.is_empty() {
        bail!("no case left to run after --only/--skip");
    }
    let file = crate::load::open_gguf(&args.load.model)?;
    let tok = crate::load::tokenizer_from_gguf(&file)
        .with_context(|| format!("{}: no usable vocabulary", args.load.model.display()))?;
    let model = args.load.model.display().to_string();
    let dir = args.dir.display().to_string();
    if args.counts_only {
        let reports = cases
            .iter()
            .map(|c| count_case(&tok, c))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let pass = reports.iter().all(|c| c.pass);
        return Ok(Report {
            dir,
            model,
            mode: None,
            backend: None,
            counts_only: true,
            thresholds: args.thresholds,
            cases: reports,
            pass,
        });
    }
    if file.header().tensors.is_empty() {
        bail!(
            "{model} holds a vocabulary but no model weights: use --counts-only for the prompt \
             token counts, or give the real model with -m"
        );
    }
    let mut load = args.load.clone();
    if load.ctx == 0 {
        let mut longest = 0;
        for c in &cases {
            longest = longest.max(prompt_tokens(&tok, c)?.len() + c.steps.len());
        }
        load.ctx = longest + 1;
    }
    let loaded = crate::load::load(&load, log)?;
    let mode = loaded.engine.mode().to_string();
    let backend = loaded.engine.backend_name();
    let mut session = ds4_engine::Session::new(loaded.engine)?;
    let index = bytes_index(&tok);
    let mut reports = Vec::with_capacity(cases.len());
    for c in &cases {
        let _ = writeln!(log, "ds4 vectors: {} ({} steps)", c.id, c.steps.len());
        reports.push(run_case(&mut session, &tok, &index, c, &args.thresholds)?);
    }
    let pass = reports.iter().all(|c| c.pass);
    Ok(Report {
        dir,
        model,
        mode: Some(mode),
        backend: Some(backend),
        counts_only: false,
        thresholds: args.thresholds,
        cases: reports,
        pass,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn step(token: &str, top: &[(&str, f64)]) -> OfficialStep {
        OfficialStep {
            token: b(token),
            top: top.iter().map(|(t, l)| (b(t), *l)).collect(),
        }
    }

    fn ours(top: &[(&str, f64)]) -> OurStep {
        OurStep {
            chosen: b(top[0].0),
            top: top.iter().map(|(t, l)| (b(t), *l)).collect(),
        }
    }

    fn lp_of<'a>(o: &'a OurStep) -> impl Fn(&[u8]) -> Option<f64> + 'a {
        move |x: &[u8]| o.top.iter().find(|(b, _)| b == x).map(|(_, l)| *l)
    }

    #[test]
    fn informative_steps_check_overlap_and_deltas() {
        let names: Vec<String> = (0..20).map(|i| format!("t{i}")).collect();
        let off_top: Vec<(&str, f64)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), -0.1 - i as f64))
            .collect();
        let off = step("t0", &off_top);
        let th = Thresholds::default();
        // Identical: pass, overlap 20/20, delta 0.
        let o = ours(&off_top);
        let r = compare_step(0, &off, &o, &lp_of(&o), &th);
        assert!(r.pass, "{r:?}");
        assert_eq!(
            (r.overlap_informative, r.overlap_needed, r.informative),
            (20, 17, 20)
        );
        assert_eq!(r.max_delta_top5, Some(0.0));
        // Three tail swaps are tolerated, four are not.
        let swap = |k: usize| {
            let mut t = off_top.clone();
            for (j, e) in t.iter_mut().rev().take(k).enumerate() {
                e.0 = ["x1", "x2", "x3", "x4", "x5"][j];
            }
            ours(&t)
        };
        let o3 = swap(3);
        assert!(compare_step(0, &off, &o3, &lp_of(&o3), &th).pass);
        let o4 = swap(4);
        let r = compare_step(0, &off, &o4, &lp_of(&o4), &th);
        assert!(!r.pass && r.problems[0].contains("overlap 16"), "{r:?}");
        // A top-5 log-prob off by 0.6 fails, by 0.4 passes.
        for (d, ok) in [(0.4, true), (0.6, false)] {
            let mut t = off_top.clone();
            t[3].1 += d;
            let o = ours(&t);
            let r = compare_step(0, &off, &o, &lp_of(&o), &th);
            assert_eq!(r.pass, ok, "{r:?}");
        }
        // Another chosen token fails.
        let mut t = off_top.clone();
        t.swap(0, 1);
        let o = ours(&t);
        let r = compare_step(0, &off, &o, &lp_of(&o), &th);
        assert!(!r.chosen_match && !r.pass);
    }

    #[test]
    fn api_floor_entries_are_ignored_and_certain_steps_check_the_token_only() {
        let mut top = vec![("Ada", 0.0)];
        let fillers: Vec<String> = (0..19).map(|i| format!("f{i}")).collect();
        top.extend(fillers.iter().map(|f| (f.as_str(), -9999.0)));
        let off = step("Ada", &top);
        // Our distribution shares none of the filler tokens and puts Ada at p = 0.5.
        let o = ours(&[("Ada", -0.69), ("B", -1.0), ("C", -3.0)]);
        let r = compare_step(0, &off, &o, &lp_of(&o), &Thresholds::default());
        assert!(r.degenerate && r.pass, "{r:?}");
        assert_eq!(r.max_delta_top5, None);
        assert_eq!(r.overlap, 1);
        let o = ours(&[("B", -0.5), ("Ada", -1.0)]);
        assert!(!compare_step(0, &off, &o, &lp_of(&o), &Thresholds::default()).pass);
    }

    #[test]
    fn doubled_bar_eos_is_normalised() {
        assert_eq!(
            normalize_official("<｜｜end▁of▁sentence｜｜>".as_bytes()),
            "<｜end▁of▁sentence｜>".as_bytes()
        );
        assert_eq!(normalize_official(b"plain"), b"plain");
        assert_eq!(normalize_official(&[0xff, 0x00]), vec![0xff, 0x00]);
    }

    #[test]
    fn top_k_and_log_softmax() {
        let l = [1.0f32, 3.0, 3.0, -1.0, 2.0];
        assert_eq!(top_k(&l, 3), vec![1, 2, 4]);
        assert_eq!(top_k(&l, 9), vec![1, 2, 4, 0, 3]);
        let lp = log_softmax(&l);
        let total: f64 = lp.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!((lp[1] - lp[0] - 2.0).abs() < 1e-12);
    }

    #[test]
    fn malformed_directories_give_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let err = |d: &Path| format!("{:#}", read_dir(d, &[], &[]).unwrap_err());
        assert!(err(&d.join("nope")).contains("not found"));
        assert!(err(d).contains("manifest.json not found"));
        std::fs::write(d.join("manifest.json"), "{").unwrap();
        assert!(err(d).contains("not valid JSON"));
        std::fs::write(d.join("manifest.json"), r#"{"prompts": []}"#).unwrap();
        assert!(err(d).contains("0 cases"));
        let manifest = |prompt: &str, steps: u32| {
            format!(
                r#"{{"prompts":[{{"id":"a","prompt_file":"{prompt}","official_file":"o.json","steps":{steps}}}]}}"#
            )
        };
        std::fs::write(d.join("manifest.json"), manifest("../etc/passwd", 1)).unwrap();
        assert!(err(d).contains("relative path inside"));
        std::fs::write(d.join("manifest.json"), manifest("p.txt", 1)).unwrap();
        assert!(err(d).contains("prompt file") && err(d).contains("not found"));
        std::fs::write(d.join("p.txt"), "hello").unwrap();
        assert!(err(d).contains("official file") && err(d).contains("not found"));
        let official = |tok: &str, lp: &str| {
            format!(
                r#"{{"id":"a","usage":{{"prompt_tokens":5}},"steps":[{{"token":{{"bytes":{tok}}},"top_logprobs":[{{"token":{{"bytes":[104]}},"logprob":{lp}}}]}}]}}"#
            )
        };
        std::fs::write(d.join("o.json"), official("[104, 300]", "0.0")).unwrap();
        assert!(
            err(d).contains("steps[0].token.bytes[1] = 300 is not a byte"),
            "{}",
            err(d)
        );
        std::fs::write(d.join("o.json"), official("[104]", "\"x\"")).unwrap();
        assert!(
            err(d).contains("logprob = \"x\" is not a log-probability"),
            "{}",
            err(d)
        );
        std::fs::write(d.join("o.json"), official("[104]", "-0.5")).unwrap();
        std::fs::write(d.join("manifest.json"), manifest("p.txt", 2)).unwrap();
        assert!(err(d).contains("says 2 steps"), "{}", err(d));
        std::fs::write(d.join("manifest.json"), manifest("p.txt", 1)).unwrap();
        let cases = read_dir(d, &[], &[]).unwrap();
        assert_eq!(cases.len(), 1);
        assert_eq!(cases[0].prompt_tokens, 5);
        assert_eq!(cases[0].steps[0].top, vec![(b("h"), -0.5)]);
        let named = |only: &[String], skip: &[String]| {
            format!("{:#}", read_dir(d, only, skip).unwrap_err())
        };
        assert!(named(&["zzz".into()], &[]).contains("no case named"));
        assert!(named(&[], &["zzz".into()]).contains("no case named"));
        assert!(read_dir(d, &[], &["a".into()]).unwrap().is_empty());
    }
}
