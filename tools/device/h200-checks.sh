#!/usr/bin/env bash
# One device session's checks and measurements, in priority order, for a machine with an
# NVIDIA GPU and no Rust: run it from the repository root with the stripped binaries
# (ds4, ds4-bench, ds4-engine-check, ds4-convert, ds4-server; ds4-gpu-check for step mxfp4) in
# $BIN (default ./bin) and an output
# directory in $OUT (default ./out). Each step logs to $OUT/<step>.log and prints its
# summary lines; a failing step does not stop the later ones.
#
# Build the binaries on a machine with Rust:
#   cargo build --release -p ds4-cli -p ds4-check -p ds4-convert -p ds4-server -p ds4-gpu --bins
#   for b in ds4 ds4-bench ds4-engine-check ds4-convert ds4-server ds4-gpu-check; do strip -o bin/$b target/release/$b; done
#
# Steps (skip any with SKIP="name name"):
#   ops        op mirror on the fixtures + random tiny models, f32 and int8 activations
#   tiles      op mirror with prefill tiles (experts, all), tiny and 4-layer real dims
#   attn       tensor-core prefill attention and indexer scores (docs/gpu.md §14, §15): the
#              op mirror with --attn-mma on the 4-layer real-dimension model, then the
#              4-layer prefill profile of the default
#   fuse       decode launch fusions (docs/gpu.md §17): the op mirror on the 4-layer
#              real-dimension model (decode-sized chunks, so the fused kernels run), f32 and
#              int8 activations
#   reference  official-mode reference bound on the fixtures (GPU and CPU)
#   parity     whole-model CUDA vs CPU logits (exact 1e-4, official: reordered bound), on
#              the tiny models and a 4-layer real-dimension synthetic model; decode repeatable
#   prefill    prefill tiles off / experts / all on a 4-layer model with the prefill
#              attribution, then this build against an earlier one (PREFILL_AB="new oldbin":
#              the ds4-bench in $OLD_BIN; 4 layers and full size)
#   bench      the full-size synthetic bench at 2k/8k/32k with the default and with tiles
#   batch      batched decode rows against decoding alone (ds4-engine-check batch), then
#              the aggregate tok/s at 1, 2, 4, 8, 16 sequences, then each of 1, 8, 16, 32, 64
#              against its own bandwidth bound, uniform and skewed router (BOUND_SIZES)
#   server     ds4-server --parallel 16 on a sparse full-size q2 file: aggregate tok/s and
#              inter-token latency for 1..16 streaming clients (tools/server-sdk-tests/throughput.py),
#              then a ~16k-token prompt arriving while 7 streams decode (prefill interference)
#   userpath   what users run beside the bench, on one sparse file (USER_LAYERS layers,
#              default 43; 36 fits an 80 GB H100 without host-resident experts): the bench
#              on the file, `ds4-bench --e2e` (the CLI's path) with and without the warm-up,
#              ds4-server answering tools/server-sdk-tests/gen_speed.py with and without the
#              turn snapshot (its "request done" lines:
#              prefill_ms, decode_ms, decode_wait_ms, snapshot_ms, total_ms); the bench's
#              --snapshot line (the turn snapshot's size and time at 2k)
#   ncu        per-kernel device time of a 2-layer model's load, 2048-token prefill and one
#              decode step under ncu (by kernel name; cuBLAS
#              kernels included, tools/device/ncu-by-kernel.py): the prefill attribution
#   ncudeep    ncu sections (speed of light, occupancy, warp stalls, memory, pipes) of the
#              prefill expert tiles and the decode GEMVs on a 2-layer model: why they run
#              at the speed they do (the next kernel work's starting point)
#   stream     streamed routed experts (issue 23), uniform and skewed routers (STREAM_SKEWS):
#              a sparse full-size q2 file, resident against STREAM_CACHES GiB expert caches
#              (engine overheads: holes read as zeros), then a dense STREAM_DENSE_LAYERS-layer
#              file after dropping the page cache (disk reads, STREAM_DENSE_CACHES GiB); hit
#              rate, GB read, GB/s and page-locked host buffers per run
#   numeric    logits of the fast paths (tiles off/experts/all) against --quality, on a
#              4-layer real-dimension synthetic q2 file and the q2 tiny-quant conversion
#   ncubatch   ncu of the batched (8-sequence) step's GEMVs on a 2-layer model: duration, DRAM,
#              L1, issue and the stall reasons per issued instruction of each launch of the
#              several-column Q8_0 / F16 and the grouped IQ2_XXS kernels (the `--profile`
#              split synchronizes around every launch and misplaces waiting; plan with these)
#   check      the short set after a kernel change: batched rows against rows alone (bit for
#              bit, bands as defined) on a 4-layer model of the real dimensions, the op mirror
#              at 40- and 2-token chunks, the tiny models' parity
#   mxfp4      native MXFP4 routed experts (issue 54, docs/gpu.md §41): the op mirror on a
#              4-layer real-dimension MXFP4 file (prefill tiles + int8 GEMVs, f32 panels +
#              f32 GEMVs, 2-token pieces as decode rows), whole-model parity on it, the
#              MXFP4 rows of `ds4-gpu-check run`, and `ds4-bench --synthetic mxfp4` at 2k on
#              MXL resident layers (default 18 on an 80 GB card, 34 on an H200: 3.57 GB per
#              MXFP4 layer + 1.62 GB, against q2's 1.96 GB per layer at 36 layers)
#   cache      the same greedy answer whatever the caches hold (docs/server.md §9 "Prefill
#              boundaries", tools/device/cache-check.py): ds4-server on the 4-layer real-
#              dimension model, a ~600-token system prefix, cold without and with an empty
#              disk cache, resumed from another conversation's disk checkpoint and from a turn
#              snapshot; tokens and log-probabilities bit for bit, official and exact mode, at
#              the default prefill chunk and at 64 (short pieces run as decode rows)
#   quality    the trained demo model's held-out perplexity and KL divergence of each CUDA path
#              (--quality, default, tiles off/all, decode steps) against the CPU engine on
#              the same file, f32/q4/q2, with a bound per path (ds4-engine-check quality;
#              needs tests/fixtures/kjv)
#   spec       speculative decoding on the GPU (docs/speculative.md): greedy output with
#              --draft lookup against --draft off, token for token, on the demo model's q2
#              file (a prompt that repeats, so drafts are accepted) and the 4-layer real-
#              dimension file; the rate lines (drafted, accepted, tokens per step); then the
#              CLI's loop on the sparse full-size file with drafts off, lookup and auto; the
#              verify cost curve (1..8 rows against a decode step, 2k and 32k) with the
#              predicted speed-up table; --draft mtp with a synthetic MTP block on the 4-layer
#              file (greedy identity: every step a 4-row verify)
#   imatrix    `ds4 imatrix` on the GPU (issue 54): the demo model's q2 file (held-out text,
#              4 chunks of 256) and the 4-layer real-dimension file (2 chunks of 64) collected
#              with --backend cuda (--quality, then the default) and --backend cpu, and the
#              .dat files compared (tools/device/imatrix-compare.py: max difference relative
#              to each entry's largest value; bound 1e-3 for --quality, 1e-2 for the default)
#   logits     whole-model logits of a 4-layer real-dimension q2 file (280 prefilled + 21
#              decoded positions, default and --quality) into $OUT/logits-*.npy; with BIN2 (a
#              second build) the same from it and a cmp of the two (a refactor must be
#              bit-identical)
#   decode     ds4-bench --synthetic q2 at 2k and 32k (DECODE_FRONTIERS) on the card's
#              resident layers (36 on an 80 GB card, 43 on an H200)
#   profile    the bench's --profile 4 at 2k: device time by layer kind and by kernel
#   roofline   ncu of one decoded token on a 2-layer model at 2k: time and DRAM bytes per
#              kernel against the copy bandwidth (tools/device/roofline.py); the time shares
#              of the full model come from step profile
#   user8      ds4-bench on a sparse full-size file beside the CLI's loop on it (greedy), then
#              ds4-server --parallel 8 on it: 1 client, 8 clients, 8 greedy ones
#
# STEPS="a b c" runs only those steps (in this file's order); SKIP="a b" skips steps.
set -uo pipefail
BIN="${BIN:-$PWD/bin}"
OUT="${OUT:-$PWD/out}"
SKIP="${SKIP:-}"
R="$PWD"
export PATH="$BIN:$PATH"
mkdir -p "$OUT"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
skip() { [[ " $SKIP " == *" $1 "* ]] || { [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $1 "* ]]; }; }
step() { echo "== $1"; }
G=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); echo "GPU: $G"
# Resident layers: the 43-layer model fits an H200; 36 is the limit for an 80 GB card.
L=36; echo "$G" | grep -q H200 && L=43
V=tests/fixtures/vocab/deepseek-v4-vocab.gguf
T="$work"
TP="$R/tools/server-sdk-tests/throughput.py"
s4() {
    [ -f "$work/s4.gguf" ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf "$R/$V" "$work/s4.gguf" > /dev/null
}

check() {
    s4
    echo "== batch bit-exact + bands (4-layer real dims)"
    timeout 100 ds4-engine-check batch "$work/s4.gguf" --tiny 0 --tokens 20 --act-q8 --seqs 16 --gpu-only > "$OUT/batch.log" 2>&1
    grep -E "cuda|PASSED|FAIL|rror" "$OUT/batch.log" | cut -c1-300 | tail -4
    echo "== op mirror + parity"; date +%T
    timeout 120 ds4-engine-check ops "$work/s4.gguf" --tiny 0 --flash-layers 4 --tokens 40 --chunk 40 --act-q8 > "$OUT/ops_c40.log" 2>&1; tail -1 "$OUT/ops_c40.log"
    timeout 120 ds4-engine-check ops "$work/s4.gguf" --tiny 0 --flash-layers 4 --tokens 12 --chunk 2 --act-q8 > "$OUT/ops_c2.log" 2>&1; tail -1 "$OUT/ops_c2.log"
    for f in tiny-hca16 tiny-hca128; do ds4-convert hf --quiet "$R/tests/fixtures/$f" "$work/m-$f.gguf" > /dev/null; done
    timeout 120 ds4-engine-check parity "$work"/m-*.gguf --tiny 2 > "$OUT/parity.log" 2>&1; grep -E "PASSED|FAIL|failed" "$OUT/parity.log" | head -3
}

mxfp4() {
    local f="$work/mx4.gguf" ml=${MXL:-18}
    echo "$G" | grep -q H200 && ml=${MXL:-34}
    [ -f "$f" ] || ds4-convert synthetic --quiet --layout mxfp4 --layers 4 --vocab-gguf "$R/$V" "$f" > /dev/null
    echo "== op mirror, 4-layer real-dimension MXFP4 file"; date +%T
    timeout 200 ds4-engine-check ops "$f" --tiny 0 --tokens 40 --chunk 40 --act-q8 --tiles experts > "$OUT/mx_ops_tiles.log" 2>&1
    grep -E "moe|FAIL" "$OUT/mx_ops_tiles.log" | head -4; tail -1 "$OUT/mx_ops_tiles.log"
    timeout 200 ds4-engine-check ops "$f" --tiny 0 --tokens 40 --chunk 40 > "$OUT/mx_ops_f32.log" 2>&1
    grep -E "moe|FAIL" "$OUT/mx_ops_f32.log" | head -4; tail -1 "$OUT/mx_ops_f32.log"
    timeout 200 ds4-engine-check ops "$f" --tiny 0 --tokens 12 --chunk 2 --act-q8 > "$OUT/mx_ops_c2.log" 2>&1
    grep -E "moe|FAIL" "$OUT/mx_ops_c2.log" | head -4; tail -1 "$OUT/mx_ops_c2.log"
    echo "== parity, 4-layer MXFP4 file"; date +%T
    timeout 200 ds4-engine-check parity "$f" --tokens 12 > "$OUT/mx_parity.log" 2>&1
    grep -E "max rel|PASSED|FAIL|failed" "$OUT/mx_parity.log" | head -8
    echo "== ds4-gpu-check run: MXFP4 rows"; date +%T
    timeout 300 ds4-gpu-check run > "$OUT/mx_gpucheck.log" 2>&1
    grep -iE "mxfp4|FAIL" "$OUT/mx_gpucheck.log" | cut -c1-200 | head -24; tail -1 "$OUT/mx_gpucheck.log"
    echo "== bench --synthetic mxfp4, $ml layers, 2k"; date +%T
    timeout 300 ds4-bench --synthetic mxfp4 --layers $ml --frontiers 2048 --decode 32 > "$OUT/mx_bench.log" 2>&1
    grep -E "^(frontier|2048),|bandwidth limit|launches|rror" "$OUT/mx_bench.log" | cut -c1-220 | head -8
    rm -f "$f"
}

cache() {
    s4
    echo "== the same greedy answer whatever the caches hold (4-layer real dims)"
    for mode in official exact; do
        for chunk in 2048 64; do
            echo "mode $mode, prefill chunk $chunk:"
            timeout 600 python3 "$R/tools/device/cache-check.py" --server "$BIN/ds4-server" \
                --model "$work/s4.gguf" --backend cuda --mode $mode --prefill-chunk $chunk \
                --log "$OUT/cache_${mode}_$chunk.log" 2>&1 | tail -n 6
        done
    done
}

quality() {
    echo "== quality yardstick on the demo model (ds4-engine-check quality)"; date +%T
    timeout 500 ds4-engine-check quality "$R/tests/fixtures/kjv" --ds4 "$BIN/ds4" > "$OUT/quality.log" 2>&1
    grep -vE "^\* " "$OUT/quality.log" | tail -24
}

spec() {
    s4
    echo "== speculative decoding: greedy with and without drafts"; date +%T
    local k="$R/tests/fixtures/kjv" p
    p="$(head -c 1500 "$k/heldout.txt")"
    p="$p $p"
    for m in "$k/ds4-kjv-q2.gguf" "$work/s4.gguf"; do
        for d in off lookup; do
            timeout 120 ds4 -m "$m" -p "$p" --nothink --temp 0 -n 160 -c 4096 --backend cuda --draft $d \
                > "$OUT/spec_$d.txt" 2> "$OUT/spec_$d.log" || tail -2 "$OUT/spec_$d.log"
            echo "$(basename "$m") --draft $d: $(tail -1 "$OUT/spec_$d.log" | cut -c1-200)"
        done
        cmp -s "$OUT/spec_off.txt" "$OUT/spec_lookup.txt" && echo "$(basename "$m"): identical" \
            || echo "$(basename "$m"): DIFFERENT"
    done
    echo "== MTP drafts (synthetic block, 4-layer real dims): greedy with and without"
    local m4="$work/m4.gguf"
    [ -f "$m4" ] || ds4-convert synthetic --quiet --layout q2 --layers 4 --vocab-gguf "$R/$V" \
        --mtp "$work/m4-mtp.gguf" "$m4" > /dev/null
    for d in off mtp; do
        timeout 120 ds4 -m "$m4" --mtp "$work/m4-mtp.gguf" -p "$p" --nothink --temp 0 -n 160 -c 4096 \
            --backend cuda --draft $d > "$OUT/spec_mtp_$d.txt" 2> "$OUT/spec_mtp_$d.log" || tail -2 "$OUT/spec_mtp_$d.log"
        echo "m4 --draft $d: $(tail -1 "$OUT/spec_mtp_$d.log" | cut -c1-200)"
    done
    cmp -s "$OUT/spec_mtp_off.txt" "$OUT/spec_mtp_mtp.txt" && echo "m4 mtp: identical" || echo "m4 mtp: DIFFERENT"
    rm -f "$m4" "$work/m4-mtp.gguf"
    echo "== verify cost curve (ds4-bench --verify 8) at 2k and 32k"
    timeout 300 ds4-bench --synthetic q2 --layers $L --frontiers 2048,32768 --decode 16 --verify 8 \
        > "$OUT/verify_curve.log" 2>&1 || tail -2 "$OUT/verify_curve.log"
    grep -E "^\||^verify|^predicted" "$OUT/verify_curve.log"
    sparse
    for d in off lookup auto; do
        timeout 100 ds4-bench --e2e -m "$work/q.gguf" --backend cuda --ctx 4096 -n 100 --prompt-words 2000 \
            --temp 0 --draft $d 2>&1 | tail -1 | cut -c1-220
    done
}

imatrix() {
    s4
    echo "== ds4 imatrix: CUDA against the CPU"; date +%T
    local k="$R/tests/fixtures/kjv" m tag a
    head -c 20000 "$k/heldout.txt" > "$work/im.txt"
    for m in "$k/ds4-kjv-q2.gguf" "$work/s4.gguf"; do
        tag=$(basename "$m" .gguf)
        if [ "$m" = "$work/s4.gguf" ]; then a=(--ctx 64 --chunks 2); else a=(--ctx 256 --chunks 4); fi
        for b in cpu cuda-quality cuda; do
            local e=(); [ $b = cuda-quality ] && e=(--quality)
            timeout 300 ds4 imatrix -m "$m" -f "$work/im.txt" -o "$work/im-$tag-$b.dat" "${a[@]}" \
                --backend "${b%-quality}" ${e[@]+"${e[@]}"} > "$OUT/imatrix_${tag}_$b.log" 2>&1 \
                || { echo "$tag $b: FAILED"; tail -3 "$OUT/imatrix_${tag}_$b.log"; }
            echo "$tag $b: $(tail -1 "$OUT/imatrix_${tag}_$b.log" | cut -c1-160)"
        done
        for b in cuda-quality cuda; do
            local bound=1e-3; [ $b = cuda ] && bound=1e-2
            [ -f "$work/im-$tag-$b.dat" ] && [ -f "$work/im-$tag-cpu.dat" ] || continue
            echo "$tag: $b against cpu"
            python3 "$R/tools/device/imatrix-compare.py" "$work/im-$tag-$b.dat" "$work/im-$tag-cpu.dat" \
                --bound $bound > "$OUT/imatrix_cmp_${tag}_$b.log" 2>&1
            tail -1 "$OUT/imatrix_cmp_${tag}_$b.log"
        done
    done
}

# logits_of DIR TAG: ds4 logits of the 4-layer file from the build in DIR.
logits_of() {
    local b=$1 tag=$2 ids
    ids=$(seq -s, 1000 1300)
    for q in fast quality; do
        local e=""; [ $q = quality ] && e=DS4_QUALITY=1
        env ${e:+"$e"} timeout 100 "$b/ds4" logits -m "$work/s4.gguf" --backend cuda --tokens "$ids" \
            --decode-from 280 --out "$OUT/logits-$tag-$q.npy" > /dev/null 2> "$OUT/logits-$tag-$q.log" \
            || tail -2 "$OUT/logits-$tag-$q.log"
    done
}

logits() {
    s4
    echo "== logits (4-layer real dims, 280 prefilled + 21 decoded positions)"
    logits_of "$BIN" a
    if [ -n "${BIN2:-}" ]; then
        logits_of "$BIN2" b
        for q in fast quality; do
            cmp -s "$OUT/logits-a-$q.npy" "$OUT/logits-b-$q.npy" && echo "$q: identical" || echo "$q: DIFFERENT"
        done
    fi
    ls -la "$OUT"/logits-*.npy | awk '{print $5, $9}'
}

decode() {
    local fr="${DECODE_FRONTIERS:-2048,32768}"
    echo "== bench --synthetic q2, $L layers, frontiers $fr"; date +%T
    timeout 300 ds4-bench --synthetic q2 --layers $L --frontiers "$fr" --decode 32 > "$OUT/bench.log" 2>&1
    grep -E "^(frontier|2048|32768),|bandwidth limit|launches" "$OUT/bench.log" | cut -c1-220 | head -8
}

profile() {
    echo "== decode attribution at 2k (--profile 4)"; date +%T
    timeout 200 ds4-bench --synthetic q2 --layers $L --frontiers 2048 --decode 16 --profile 4 > "$OUT/profile.log" 2>&1
    grep -A40 "profile" "$OUT/profile.log" | head -60
}

roofline() {
    echo "== roofline of one decoded token (ncu, 2-layer model at 2k)"; date +%T
    timeout 100 ds4-bench --synthetic q2 --layers 2 --frontiers 2048 --decode 4 > "$OUT/roofline_bench.log" 2>&1
    local n bw
    # "decode @2048: 52.0 launches, ..." and "device copy bandwidth 3025 GB/s · ..."
    n=$(grep -oE "decode @[0-9]+: [0-9]+" "$OUT/roofline_bench.log" | head -1 | awk '{print $3}')
    bw=$(grep -oE "device copy bandwidth [0-9]+" "$OUT/roofline_bench.log" | head -1 | awk '{print $4}')
    echo "launches per token: ${n:-?}; copy bandwidth: ${bw:-?} GB/s"
    grep -E "launches|bandwidth" "$OUT/roofline_bench.log" | head -4 | cut -c1-200
    timeout 400 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        --csv --page raw ds4-bench --synthetic q2 --layers 2 --frontiers 2048 --decode 1 --warmup 0 \
        > "$OUT/roofline_ncu.csv" 2> "$OUT/roofline_ncu.err"
    echo "ncu rows: $(grep -c '^"' "$OUT/roofline_ncu.csv")"; tail -2 "$OUT/roofline_ncu.err"
    [ -n "$n" ] && [ -n "$bw" ] && python3 "$R/tools/device/roofline.py" "$OUT/roofline_ncu.csv" "$n" "$bw"
}

batch_quick() {
    echo "== batched step, --batch 1,8,16"; date +%T
    timeout 200 ds4-bench --synthetic q2 --layers $L --frontiers 512 --decode 16 --batch 1,8,16 > "$OUT/batch_bench.log" 2>&1
    grep -E "^batch " "$OUT/batch_bench.log" | cut -c1-200
}

sparse() {
    [ -f "$work/q.gguf" ] || timeout 100 ds4-convert synthetic --quiet --layout q2 --layers $L --sparse-experts --vocab-gguf "$R/$V" "$work/q.gguf" > /dev/null
}

userpath() {
    sparse
    echo "== user path"; date +%T
    timeout 100 ds4-bench -m "$work/q.gguf" --frontiers 2009 --decode 64 > "$OUT/user_bench.log" 2>&1
    grep -E "^2009|bandwidth limit" "$OUT/user_bench.log" | head -2 | cut -c1-200
    timeout 100 ds4-bench --e2e -m "$work/q.gguf" --backend cuda --ctx 4096 -n 100 --prompt-words 2000 --temp 0 2>&1 | tail -1 | cut -c1-200
}

# up: wait (at most 90 s) until the server on port 8090 answers /v1/models.
up() { for i in $(seq 1 90); do python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:8090/v1/models',timeout=2)" 2>/dev/null && break; sleep 1; done; echo "ready after ${i}s"; }

server8() {
    sparse
    echo "== server --parallel 8"; date +%T
    ds4-server -m "$work/q.gguf" -c 4096 --backend cuda --parallel 8 --port 8090 > "$OUT/server.log" 2>&1 &
    local sp=$!; up
    timeout 40 python3 $TP http://127.0.0.1:8090 1 64
    timeout 40 python3 $TP http://127.0.0.1:8090 8 64
    timeout 40 python3 $TP http://127.0.0.1:8090 8 64 --no-think
    kill $sp; wait $sp 2>/dev/null
}


for s in check mxfp4 cache quality spec imatrix logits decode profile roofline; do
    skip $s || { step $s; "$s"; }
done
if ! skip user8; then
    step user8; userpath; server8
fi

models() {
    [ -f "$work/m-q2.gguf" ] && return
    for f in tiny-hca16 tiny-hca128 tiny-quant; do
        ds4-convert hf --quiet "$R/tests/fixtures/$f" "$work/m-$f.gguf" >/dev/null
    done
    ds4-convert hf --quiet --types q2 "$R/tests/fixtures/tiny-quant" "$work/m-q2.gguf" >/dev/null
    ds4-convert hf --quiet --types q4 "$R/tests/fixtures/tiny-quant" "$work/m-q4.gguf" >/dev/null
}

if ! skip ops; then
    step ops; models
    ds4-engine-check ops "$work"/m-*.gguf --tiny 2 --tokens 40 > "$OUT/ops.log" 2>&1; tail -1 "$OUT/ops.log"
    ds4-engine-check ops "$work"/m-*.gguf --tiny 2 --tokens 40 --act-q8 > "$OUT/ops_q8.log" 2>&1; tail -1 "$OUT/ops_q8.log"
fi
if ! skip tiles; then
    step tiles; models
    ds4-engine-check ops "$work"/m-*.gguf --tiny 2 --tokens 40 --chunk 40 --tiles experts > "$OUT/tiles_e.log" 2>&1; tail -1 "$OUT/tiles_e.log"
    ds4-engine-check ops "$work"/m-*.gguf --tiny 2 --tokens 40 --chunk 40 --tiles all > "$OUT/tiles_a.log" 2>&1; tail -1 "$OUT/tiles_a.log"
    ds4-engine-check ops --tiny 0 --flash-layers 4 --tokens 100 --chunk 100 --tiles all > "$OUT/tiles_4l.log" 2>&1
    grep -E "moe|matmul|FAIL" "$OUT/tiles_4l.log" | head -8; tail -1 "$OUT/tiles_4l.log"
fi
if ! skip attn; then
    step attn
    ds4-engine-check ops --tiny 0 --flash-layers 4 --tokens 100 --chunk 100 --attn-mma \
        > "$OUT/attn_ops.log" 2>&1
    grep -E "attention|FAIL" "$OUT/attn_ops.log" | head -6; tail -1 "$OUT/attn_ops.log"
    # The tensor-core indexer scores once more than 512 rows are compressed (> 2048 tokens);
    # layer 2 is the first CSA layer.
    ds4-engine-check ops --tiny 0 --flash-layers 3 --tokens 2300 --chunk 2300 --attn-mma \
        > "$OUT/idx_ops.log" 2>&1
    grep -E "indexer|FAIL" "$OUT/idx_ops.log" | head -6; tail -1 "$OUT/idx_ops.log"
    timeout 200 ds4-bench --synthetic q2 --layers 4 --frontiers 2048 --decode 4 \
        --profile-prefill 2048 > "$OUT/attn_prefill.log" 2>&1
    grep -E "^2048,|profile prefill" "$OUT/attn_prefill.log"
    grep -A12 "by kernel" "$OUT/attn_prefill.log" | head -12
fi
if ! skip fuse; then
    step fuse
    timeout 200 ds4-engine-check ops --tiny 0 --flash-layers 4 --tokens 40 --chunk 8 \
        > "$OUT/fuse_ops.log" 2>&1
    grep -E "hc_post_mix|norm_rope_pair|_matmul|compressor_pair|logit_band|FAIL|ALL PASSED" "$OUT/fuse_ops.log" | tail -11
    timeout 200 ds4-engine-check ops --tiny 0 --flash-layers 4 --tokens 40 --chunk 8 --act-q8 \
        > "$OUT/fuse_ops_q8.log" 2>&1
    grep -E "hc_post_mix|norm_rope_pair|_matmul|compressor_pair|logit_band|FAIL|ALL PASSED" "$OUT/fuse_ops_q8.log" | tail -11
fi
if ! skip reference; then
    step reference
    timeout 300 ds4-engine-check reference tests/fixtures > "$OUT/reference.log" 2>&1; tail -3 "$OUT/reference.log"
fi
if ! skip parity; then
    step parity; models
    ds4-engine-check parity "$work"/m-*.gguf --tiny 2 > "$OUT/parity.log" 2>&1; grep -E "PASSED|FAIL|failed" "$OUT/parity.log" | head -5
    # Real dimensions (multi-block grids, overlapped launches): the tiny models missed a
    # launch-overlap race that only full-width GEMVs showed (docs/gpu.md §6). Then the
    # default decode path twice: overlapped decode must be bit-for-bit repeatable.
    ds4-convert synthetic --quiet --layout q2 --layers 4 \
        --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$work/syn4.gguf" >/dev/null
    ds4-engine-check parity "$work/syn4.gguf" --tokens 12 > "$OUT/parity_syn4.log" 2>&1
    grep -E "max rel|PASSED|FAIL|failed" "$OUT/parity_syn4.log" | head -8
    p="$(head -c 200 "$R/README.md")"
    for i in 1 2; do
        ds4 logits -m "$work/syn4.gguf" --backend cuda --prompt "$p" --prefill-chunk 1 \
            --out "$work/det$i.npy" > /dev/null 2>> "$OUT/parity_syn4.log"
    done
    cmp -s "$work/det1.npy" "$work/det2.npy" && echo "DECODE DETERMINISTIC" || echo "DECODE NOT DETERMINISTIC (FAIL)"
fi
if ! skip prefill; then
    step prefill
    for t in ${PREFILL_MODES-off experts all}; do
        timeout 200 ds4-bench --synthetic q2 --layers 4 --frontiers 2048 --decode 4 --tiles $t \
            --profile-prefill 2048 > "$OUT/prefill_$t.log" 2>&1
        echo "tiles $t:"; grep -E "^2048,|profile prefill" "$OUT/prefill_$t.log"
        grep -A12 "by kernel" "$OUT/prefill_$t.log" | head -12
    done
    # This build against an earlier build's ds4-bench in $OLD_BIN (PREFILL_AB="new oldbin"),
    # alternating: 4-layer profile, then the full-size 2k prefill. PREFILL_REPS (default
    # "1 2"); PREFILL_FULL: the builds that also run the full-size model (default both).
    for rep in ${PREFILL_REPS:-1 2}; do
        for n in ${PREFILL_AB:-new}; do
            bench=ds4-bench
            [ "$n" = oldbin ] && bench="$OLD_BIN/ds4-bench"
            timeout 200 $bench --synthetic q2 \
                --layers 4 --frontiers 2048 --decode 4 --profile-prefill 2048 \
                > "$OUT/prefill_$n.$rep.log" 2>&1
            echo "tiles $n (4 layers, run $rep): $(grep -E '^2048,' "$OUT/prefill_$n.$rep.log")"
            grep -E "ds4_mm_r?tiles" "$OUT/prefill_$n.$rep.log" | head -3
            [[ " ${PREFILL_FULL:-${PREFILL_AB:-new}} " == *" $n "* ]] || continue
            timeout 300 $bench --synthetic q2 \
                --frontiers 2048 --decode 8 > "$OUT/prefill_full_$n.$rep.log" 2>&1
            echo "tiles $n (full size, run $rep): $(grep -E '^2048,' "$OUT/prefill_full_$n.$rep.log")"
        done
    done
fi
if ! skip bench; then
    step bench
    timeout 400 ds4-bench --synthetic q2 --frontiers 2048,8192,32768 --decode 16 > "$OUT/bench.log" 2>&1
    grep -E "^[0-9]+,|rror" "$OUT/bench.log"
    timeout 400 ds4-bench --synthetic q2 --frontiers 2048,8192,32768 --decode 16 --tiles experts > "$OUT/bench_tiles.log" 2>&1
    grep -E "^[0-9]+,|rror" "$OUT/bench_tiles.log"
fi
if ! skip batch; then
    step batch; models
    # Correctness first: batched rows against the same rows decoded alone (tiny models and,
    # with int8 activations, a 4-layer real-dimension model where the several-column GEMVs run).
    ds4-engine-check batch "$work"/m-*.gguf --tiny 2 --act-q8 > "$OUT/batch_check.log" 2>&1
    ds4-convert synthetic --quiet --layout q2 --layers 4 \
        --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$work/syn4b.gguf" >/dev/null
    ds4-engine-check batch "$work/syn4b.gguf" --tiny 0 --tokens 20 --act-q8 >> "$OUT/batch_check.log" 2>&1
    # Longer prompts: every query sees more than one 32-key split, so the batched attention
    # launches (ds4_attention_split_seqs) run; 16 sequences also cross the 8-token GEMV groups.
    ds4-engine-check batch "$work/syn4b.gguf" --tiny 0 --tokens 200 --act-q8 --seqs 16 --gpu-only >> "$OUT/batch_check.log" 2>&1
    grep -E "cuda|PASSED|FAIL|failed" "$OUT/batch_check.log" | head -12
    # --profile: each batch size's device time per step by section and kernel (what an
    # added sequence costs).
    timeout 400 ds4-bench --synthetic q2 --layers ${BATCH_LAYERS:-43} --frontiers 512 --decode 16 --batch ${BATCH_SIZES:-1,2,4,8,16} \
        --profile ${BATCH_PROFILE:-2} > "$OUT/batch.log" 2>&1
    grep -E "^batch|^profile batch|rror" "$OUT/batch.log"
    # Issue 51's table: each batch size against its own bandwidth bound (the distinct experts
    # its tokens chose, counted by the routing census), for the uniform router and the
    # skewed one (docs/server.md §12; the CSV rows are at the end of each log).
    for skew in 0 0.05; do
        timeout 500 ds4-bench --synthetic q2 --layers ${BATCH_LAYERS:-43} --frontiers 512 --decode 16 \
            --batch ${BOUND_SIZES:-1,8,16,32,64} --router-skew $skew > "$OUT/batch_bound_$skew.log" 2>&1
        grep -E "^batch [0-9]+ bound|rror" "$OUT/batch_bound_$skew.log"
    done
fi
if ! skip server; then
    step server
    timeout 200 ds4-convert synthetic --quiet --layout q2 --sparse-experts \
        --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$work/q2.gguf" > "$OUT/server_conv.log" 2>&1
    ds4-server -m "$work/q2.gguf" -c 20480 --backend cuda --parallel 16 --port 8090 > "$OUT/server.log" 2>&1 &
    sp=$!
    for i in $(seq 1 120); do
        python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:8090/v1/models',timeout=2)" 2>/dev/null && break
        sleep 1
    done
    echo "server ready after ${i}s"
    # The OpenAI SDK's clients when a wheelhouse came along (tools/device/sdk-wheels.sh: the
    # GPU machine has no network), else the stdlib client (the same requests).
    py=python3
    sdk=""
    if [ -d "$R/.dev/wh" ] && python3 -m venv "$work/sdk" > /dev/null 2>&1 &&
        "$work/sdk/bin/pip" install -q --no-index --find-links "$R/.dev/wh" \
            -r "$R/tools/server-sdk-tests/requirements.txt" > "$OUT/sdk_pip.log" 2>&1; then
        py="$work/sdk/bin/python"
        sdk=--sdk
    fi
    echo "clients: ${sdk:-stdlib}"
    for c in 1 2 4 8 16; do
        timeout 90 "$py" "$R/tools/server-sdk-tests/throughput.py" http://127.0.0.1:8090 $c 64 $sdk >> "$OUT/throughput.log" 2>&1
    done
    # Prefill interference: a ~16k-token prompt arriving while 7 streams decode.
    timeout 240 "$py" "$R/tools/server-sdk-tests/throughput.py" http://127.0.0.1:8090 7 128 20 \
        --long-prompt-words 8000 --long-after 1 $sdk >> "$OUT/throughput.log" 2>&1
    cat "$OUT/throughput.log"
    kill $sp; wait $sp 2>/dev/null
    rm -f "$work/q2.gguf"
fi
if ! skip userpath; then
    step userpath
    f="$work/user.gguf"
    timeout 200 ds4-convert synthetic --quiet --layout q2 --layers "${USER_LAYERS:-43}" --sparse-experts \
        --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$f" > "$OUT/userpath.log" 2>&1
    timeout 120 ds4-bench -m "$f" --frontiers 2048 --decode 64 --snapshot >> "$OUT/userpath.log" 2>&1
    grep "^snapshot @" "$OUT/userpath.log"
    echo "bench: $(grep -E '^2048,' "$OUT/userpath.log" | head -1)"
    # The CLI's path with its warm-up at load (default) and without it.
    for warm in 1 0; do
        DS4_WARMUP=$warm timeout 120 ds4-bench --e2e -m "$f" --backend cuda \
            --ctx 4096 -n 100 --prompt-words 1500 > "$OUT/userpath_e2e$warm.log" 2>&1
        echo "e2e (warm-up $warm): $(grep -E 'warm-up' "$OUT/userpath_e2e$warm.log" | tail -n 1)"
        echo "    $(tail -n 1 "$OUT/userpath_e2e$warm.log")"
    done
    # Greedy (the bench's own decode): a synthetic model's flat logits overflow the default
    # sampler's device band every token, so the sampled rate above is not a trained model's.
    timeout 120 ds4-bench --e2e -m "$f" --backend cuda --ctx 4096 -n 100 --prompt-words 1500 --temp 0 \
        > "$OUT/userpath_e2e_greedy.log" 2>&1
    echo "e2e greedy (--temp 0): $(tail -n 1 "$OUT/userpath_e2e_greedy.log")"
    # The default turn snapshot, then none (--snapshot-slots 0); USER_SERVER_RUNS="1" runs
    # the default alone.
    for snaps in ${USER_SERVER_RUNS:-1 0}; do
        ds4-server -m "$f" --backend cuda --ctx 4096 --port 8094 \
            --snapshot-slots "$snaps" > "$OUT/userpath_srv$snaps.log" 2>&1 &
        sp=$!
        for i in $(seq 1 150); do
            python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:8094/v1/models',timeout=2)" 2>/dev/null && break
            sleep 1
        done
        timeout 200 python3 "$R/tools/server-sdk-tests/gen_speed.py" http://127.0.0.1:8094 4 750 100
        kill $sp; wait $sp 2>/dev/null
        echo "server (snapshot slots $snaps):"
        sed 's/\x1b\[[0-9;]*m//g' "$OUT/userpath_srv$snaps.log" | grep 'request done' \
            | grep -oE 'prompt=[0-9]+|generated=[0-9]+|prefill_ms=[0-9]+|decode_ms=[0-9]+|decode_wait_ms=[0-9]+|snapshot_ms=[0-9]+|total_ms=[0-9]+' | paste -sd' '
    done
    rm -f "$f"
fi
if ! skip ncu; then
    step ncu
    timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        ds4-bench --synthetic q2 --layers 2 --frontiers 2048 --decode 1 \
        > "$OUT/ncu_prefill.csv" 2> "$OUT/ncu_prefill.err"
    python3 "$R/tools/device/ncu-by-kernel.py" "$OUT/ncu_prefill.csv" 25
fi
if ! skip ncudeep; then
    step ncudeep
    # Why the two largest kernel families run where they do (issue 21: the routed-expert
    # tiles, 50 % of a 2k prefill window; issue 20: the grouped int8 GEMVs at 28-33 % of
    # bandwidth): speed of light, occupancy, warp stall reasons, memory and pipe use of the
    # first launches of each, on a 2-layer model (one 2048-token prefill, 2 decode steps).
    # NCUDEEP_ONLY=tiles: the tiles alone; =moe: the routed experts' decode GEMVs.
    ks=('regex:^ds4_mm_tiles' 'regex:^ds4_gemv_grouped_swiglu_q_|^ds4_gemv_grouped_q_'
        'regex:^ds4_gemv_q_q8_0$|^ds4_gemv_rmsnorm_q_q8_0$')
    [ "${NCUDEEP_ONLY:-}" = tiles ] && ks=("regex:^ds4_mm_r?tiles")
    # NCUDEEP_ONLY=moe: the routed experts' decode GEMVs alone.
    [ "${NCUDEEP_ONLY:-}" = moe ] && ks=('regex:^ds4_gemv_grouped_swiglu_q_|^ds4_gemv_grouped_q_')
    for k in "${ks[@]}"; do
        n=$(echo "$k" | tr -dc 'a-z0-9_' | cut -c1-24)
        timeout 300 ncu --clock-control none --kernel-name "$k" --launch-count 6 \
            --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
            --section InstructionStats --csv --page details \
            ds4-bench --synthetic q2 --layers 2 --frontiers 2048 --decode 2 --warmup 0 \
            > "$OUT/ncudeep_$n.csv" 2> "$OUT/ncudeep_$n.err"
        echo "$k: $(grep -c . "$OUT/ncudeep_$n.csv") lines"
        grep -E '"(Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Memory Throughput|Compute \(SM\) Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Block Limit Registers|Block Limit Shared Mem|L1/TEX Cache Throughput|Warp Cycles Per Issued Instruction|Executed Ipc Active)"' \
            "$OUT/ncudeep_$n.csv" | awk -F'","' '{print $5 " | " $(NF-2) " = " $NF}' | head -40
    done
fi
if ! skip stream; then
    step stream
    # Issue 23's table: decode at 2k with capped expert caches, for uniform and skewed
    # routing (STREAM_SKEWS, default "0 0.3": the synthetic router's Zipf-like bias), on a
    # sparse full-size file (resident, then STREAM_CACHES GiB; holes read as zeros, so these
    # rows are the engine's overheads and the PCIe copies, no disk), then a dense
    # STREAM_DENSE_LAYERS-layer file (default 12) after dropping the page cache: real disk
    # reads, STREAM_DENSE_CACHES GiB, read-ahead on and off at the first size.
    for skew in ${STREAM_SKEWS-0 0.3}; do
        f="$work/q2s.gguf"
        timeout 200 ds4-convert synthetic --quiet --layout q2 --sparse-experts --router-skew $skew \
            --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$f" >> "$OUT/stream.log" 2>&1
        for c in resident ${STREAM_CACHES-8 16 32}; do
            if [ $c = resident ]; then a=(--experts resident); else a=(--experts stream --expert-cache-gib $c); fi
            echo "sparse full size, router skew $skew, cache $c:" | tee -a "$OUT/stream.log"
            timeout 300 ds4-bench -m "$f" "${a[@]}" --frontiers 2048 --decode 32 --checksum >> "$OUT/stream.log" 2>&1
            tail -n 4 "$OUT/stream.log"
        done
        rm -f "$f"
    done
    # Real disk reads: a dense file (routed experts written), page cache dropped.
    for skew in ${STREAM_SKEWS-0 0.3}; do
        f="$work/q2d.gguf"
        timeout 400 ds4-convert synthetic --quiet --layout q2 --layers ${STREAM_DENSE_LAYERS:-12} \
            --router-skew $skew --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$f" >> "$OUT/stream.log" 2>&1
        first=1
        for c in ${STREAM_DENSE_CACHES-4 8 16}; do
            for ra in 1 0; do
                [ $ra = 0 ] && [ $first = 0 ] && continue
                sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped)"
                echo "dense ${STREAM_DENSE_LAYERS:-12} layers, router skew $skew, cache $c GiB, cold, DS4_EXPERT_READAHEAD=$ra:" | tee -a "$OUT/stream.log"
                DS4_EXPERT_READAHEAD=$ra timeout 300 ds4-bench -m "$f" --experts stream --expert-cache-gib $c \
                    --frontiers 2048 --decode 32 >> "$OUT/stream.log" 2>&1
                tail -n 4 "$OUT/stream.log"
            done
            first=0
        done
        rm -f "$f"
    done
fi
if ! skip ncubatch; then
    step ncubatch
    m=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    m=$m,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active
    m=$m,launch__grid_size,launch__registers_per_thread
    for r in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle wait math_pipe_throttle; do
        m=$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
    done
    for k in ds4_gemv_cols_q_q8_0 ds4_gemv_cols_f16 ds4_gemv_grouped_q_iq2_xxs ds4_gemv_grouped_swiglu_q_q2_k; do
        timeout 200 ncu --clock-control none --kernel-name "regex:^$k\$" --launch-count 40 --metrics "$m" \
            --csv --page raw ds4-bench --synthetic q2 --layers 2 --frontiers 512 --decode 2 --batch 8 \
            --warmup 0 > "$OUT/ncubatch_$k.csv" 2> "$OUT/ncubatch_$k.err"
        echo "$k: $(($(wc -l < "$OUT/ncubatch_$k.csv") - 2)) launches profiled"
    done
fi
if ! skip numeric; then
    step numeric; models
    ds4-convert synthetic --quiet --layout q2 --layers 4 \
        --vocab-gguf "$R/tests/fixtures/vocab/deepseek-v4-vocab.gguf" "$work/syn4.gguf" >/dev/null
    head -c 1800 "$R/README.md" > "$work/prompt.txt"
    toks="$(python3 -c 'import random; r=random.Random(7); print(",".join(str(r.randrange(256)) for _ in range(300)))')"
    for m in syn4 q2; do
        if [ $m = syn4 ]; then f="$work/syn4.gguf"; in=(--prompt "$(cat "$work/prompt.txt")");
        else f="$work/m-q2.gguf"; in=(--tokens "$toks"); fi
        ds4 logits -m "$f" --backend cuda "${in[@]}" --quality --out "$work/$m-quality.npy" > /dev/null 2>> "$OUT/numeric.log"
        for t in off experts all; do
            DS4_PREFILL_TILES=$t ds4 logits -m "$f" --backend cuda "${in[@]}" --out "$work/$m-$t.npy" > /dev/null 2>> "$OUT/numeric.log"
            python3 "$R/tools/logits/compare_logits.py" "$work/$m-$t.npy" "$work/$m-quality.npy" | tee -a "$OUT/numeric.log"
        done
    done
fi

