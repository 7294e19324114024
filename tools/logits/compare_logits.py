#!/usr/bin/env python3
"""Compare two [positions, vocab] float32 .npy logit files (from `ds4 logits --out`): max |a-b|
over the row maximum |b|, top-1 agreement, KL(b || a). Pure Python (no numpy needed).

Usage: compare_logits.py TEST.npy REFERENCE.npy
"""
import array, ast, math, re, struct, sys
def load(p):
    b = open(p, 'rb').read()
    hl = struct.unpack('<H', b[8:10])[0]
    h = b[10:10 + hl].decode()
    sh = ast.literal_eval(re.search(r"'shape': (\(.*?\))", h).group(1))
    a = array.array('f'); a.frombytes(b[10 + hl:])
    return sh, a
try:
    import numpy as np
except ImportError:
    np = None
if np is not None:
    # The same statistics, vectorized (the pure-Python loop takes minutes at full vocab).
    a = np.load(sys.argv[1]).astype(np.float64); b = np.load(sys.argv[2]).astype(np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    bad = np.isnan(a).any(axis=1)
    a, b = a[~bad], b[~bad]
    mx = np.abs(b).max(axis=1); mx[mx == 0] = 1.0
    worst = float((np.abs(a - b).max(axis=1) / mx).max()) if len(a) else 0.0
    top = int((a.argmax(axis=1) == b.argmax(axis=1)).sum())
    la = a - a.max(axis=1, keepdims=True); la -= np.log(np.exp(la).sum(axis=1, keepdims=True))
    lb = b - b.max(axis=1, keepdims=True); lb -= np.log(np.exp(lb).sum(axis=1, keepdims=True))
    kls = (np.exp(lb) * (lb - la)).sum(axis=1)
    R = a.shape[0] + int(bad.sum())
    print(f"{sys.argv[1].split('/')[-1]} vs {sys.argv[2].split('/')[-1]}: rows {R} max rel (to row max|ref|) {worst:.3e}, top-1 agree {top}/{len(a)}, KL mean {kls.mean() if len(kls) else float('nan'):.3e} max {kls.max() if len(kls) else float('nan'):.3e}, NaN rows {int(bad.sum())}")
    sys.exit(0)
sa, a = load(sys.argv[1]); sb, b = load(sys.argv[2])
assert sa == sb, (sa, sb)
R, V = sa
worst = 0.0; top = 0; kls = []; nan = 0
for r in range(R):
    x = a[r*V:(r+1)*V]; y = b[r*V:(r+1)*V]
    if any(v != v for v in x): nan += 1; continue
    mx = max(abs(v) for v in y) or 1.0
    d = max(abs(p - q) for p, q in zip(x, y)) / mx
    worst = max(worst, d)
    ix = max(range(V), key=x.__getitem__); iy = max(range(V), key=y.__getitem__)
    top += ix == iy
    # KL(ref || test), ref = argv[2]
    my = max(y); mxx = max(x)
    zy = sum(math.exp(v - my) for v in y); zx = sum(math.exp(v - mxx) for v in x)
    kl = 0.0
    for p_, q_ in zip(y, x):
        lp = p_ - my - math.log(zy); lq = q_ - mxx - math.log(zx)
        kl += math.exp(lp) * (lp - lq)
    kls.append(kl)
kls.sort()
print(f"{sys.argv[1].split('/')[-1]} vs {sys.argv[2].split('/')[-1]}: rows {R} max rel (to row max|ref|) {worst:.3e}, top-1 agree {top}/{R}, KL mean {sum(kls)/max(1,len(kls)):.3e} max {kls[-1] if kls else float('nan'):.3e}, NaN rows {nan}")
