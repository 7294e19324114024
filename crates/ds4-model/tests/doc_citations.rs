//! Code comments cite `docs/<file>.md §<section>`; this test keeps those citations honest.
//! It fails when a cited docs file or section does not exist (so renumbering a section
//! without updating its readers breaks the build), and when anything still cites the old
//! out-of-tree spec, which a newcomer cannot open.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Directories (under the repository root) whose text files may cite the docs.
const ROOTS: [&str; 6] = ["crates", "kernels", "tools", "fuzz", "docs", ".ci"];
const EXTS: [&str; 9] = ["rs", "cu", "h", "py", "sh", "md", "toml", "yml", "yaml"];
const SKIP_DIRS: [&str; 5] = ["target", ".git", "node_modules", "__pycache__", ".venv"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Section numbers of a docs file: `## 5. Attention`, `### 5.3 Compressor` give `5`, `5.3`.
fn headings(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let rest = l.trim_start_matches('#');
            if rest.len() == l.len() || !rest.starts_with(' ') {
                return None;
            }
            let word = rest.split_whitespace().next()?;
            let num = word.trim_end_matches('.');
            let ok = !num.is_empty()
                && num
                    .split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
            ok.then(|| num.to_string())
        })
        .collect()
}

fn docs_sections(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    let dir = root.join("docs");
    for e in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            out.insert(stem, headings(&fs::read_to_string(&p).unwrap()));
        }
    }
    out
}

fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if !SKIP_DIRS.contains(&name.as_str()) {
                text_files(&p, out);
            }
        } else if p
            .extension()
            .is_some_and(|x| EXTS.contains(&x.to_string_lossy().as_ref()))
        {
            out.push(p);
        }
    }
}

/// A section number at the start of `s` (`5`, `5.3`, `2.5` of `2.5a`), and its length.
fn number(s: &str) -> Option<(String, usize)> {
    let len = s
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_digit() || *c == '.'))
        .map_or(s.len(), |(i, _)| i);
    let num = s[..len].trim_end_matches('.');
    (!num.is_empty() && num.as_bytes()[0].is_ascii_digit()).then(|| (num.to_string(), len))
}

/// Characters allowed between the parts of one citation chain, e.g. the `, ` of
/// `§5.2, §5.6` or the ` steps 2–4, ` of `§9 steps 2–4, §8`.
fn gap_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c.is_whitespace() || "`,;:()-–—&.".contains(c)
}

/// Every `(docs file, section or None)` cited on one line.
fn citations(line: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = line[from..].find("docs/") {
        let at = from + i;
        from = at + 5;
        let before = line[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '/' || c == '.' || c == '_') {
            continue; // part of another path or a URL
        }
        let rest = &line[at + 5..];
        let stem_len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(rest.len());
        if stem_len == 0 || !rest[stem_len..].starts_with(".md") {
            continue;
        }
        let stem = rest[..stem_len].to_string();
        out.push((stem.clone(), None));
        // The chain of section references that follows.
        let mut tail = &rest[stem_len + 3..];
        while let Some(sign) = tail.find('§') {
            if tail[..sign].chars().count() > 16 || !tail[..sign].chars().all(gap_char) {
                break;
            }
            tail = &tail[sign + '§'.len_utf8()..];
            let Some((num, len)) = number(tail.trim_start()) else {
                break;
            };
            tail = &tail.trim_start()[len..];
            out.push((stem.clone(), Some(num)));
            // A range: `§3–§7`, `§5.2–5.3`.
            let t = tail.trim_start_matches(|c: char| c.is_ascii_lowercase());
            let t = t.trim_start();
            if let Some(r) = t.strip_prefix('–').or_else(|| t.strip_prefix('-')) {
                let r = r.trim_start();
                let r = r.strip_prefix('§').unwrap_or(r);
                if let Some((num2, len2)) = number(r) {
                    out.push((stem.clone(), Some(num2)));
                    tail = &r[len2..];
                }
            }
        }
    }
    out
}

#[test]
fn every_docs_citation_names_an_existing_section() {
    let root = repo_root();
    let sections = docs_sections(&root);
    assert!(
        sections.contains_key("forward") && sections["forward"].contains("5.3"),
        "docs/forward.md §5.3 must exist (is the heading parser broken?): {sections:?}"
    );
    let mut files = Vec::new();
    for r in ROOTS {
        text_files(&root.join(r), &mut files);
    }
    for f in [
        "README.md",
        "ARCHITECTURE.md",
        "BENCHMARKS.md",
        "STRIXHALO.md",
    ] {
        files.push(root.join(f));
    }
    let old_spec = ["spec", " §"].concat();
    let old_dir = ["shared", "/spec"].concat();
    let (mut problems, mut checked) = (Vec::new(), 0usize);
    for f in &files {
        let Ok(text) = fs::read_to_string(f) else {
            continue;
        };
        let rel = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        for (n, line) in text.lines().enumerate() {
            let where_ = format!("{rel}:{}", n + 1);
            if line.to_lowercase().contains(&old_spec) || line.contains(&old_dir) {
                problems.push(format!(
                    "{where_}: cites the out-of-tree spec: {}",
                    line.trim()
                ));
            }
            for (doc, sec) in citations(line) {
                checked += 1;
                match (sections.get(&doc), sec) {
                    (None, _) => problems.push(format!("{where_}: no file docs/{doc}.md")),
                    (Some(s), Some(sec)) if !s.contains(&sec) => {
                        problems.push(format!("{where_}: docs/{doc}.md has no section {sec}"))
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        checked > 100,
        "only {checked} citations found: is the scan looking in the right place?"
    );
}

#[test]
fn the_citation_parser_reads_chains_and_ranges() {
    let got = citations("x (docs/server.md §9 steps 2–4, §8 409) and `docs/gguf.md` §5.2–5.3.");
    let want: Vec<(String, Option<String>)> = [
        ("server", None),
        ("server", Some("9")),
        ("server", Some("8")),
        ("gguf", None),
        ("gguf", Some("5.2")),
        ("gguf", Some("5.3")),
    ]
    .iter()
    .map(|(d, s)| (d.to_string(), s.map(str::to_string)))
    .collect();
    assert_eq!(got, want);
    let got = citations("(docs/forward.md §3–§7), docs/chat.md §2.5a; https://x/docs/no.md §1");
    assert_eq!(
        got.iter()
            .filter_map(|(_, s)| s.clone())
            .collect::<Vec<_>>(),
        ["3", "7", "2.5"]
    );
    assert!(headings("## 5. Attention\n### 5.3 Compressor\n#### x\n").contains("5.3"));
}
