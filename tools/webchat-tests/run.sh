#!/usr/bin/env bash
# Browser tests of the chat page ds4-server serves at / (issue 55): Debian's chromium,
# headless, driven by the puppeteer-core pinned in web/package-lock.json (no browser
# download), against a live ds4-server on the committed demo model with --api-key,
# --parallel 1, --queue 1 and a forced-output script (the demo model's weights are random,
# so reasoning, Markdown and tool calls are scripted; the engine still evaluates every
# token). Also runs the page's unit tests (node:test). Exits non-zero on any failure.
#
# Screenshots of each state, the page's console log, the server log and the results go to
# $WEBCHAT_OUT (default: $CARGO_TARGET_DIR/webchat-tests, or target/webchat-tests).
#
# Needs node (>= 20) and npm; installs chromium with apt-get when it is missing (skips
# with a message, exit 0, only where there is no apt-get and no chromium).
# Env: CARGO_TARGET_DIR, PROFILE (release|debug, default release), DS4_SERVER_BIN (skip the
# cargo build), CHROMIUM (browser binary), WEBCHAT_OUT, KEEP_SERVER_LOG.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PROFILE="${PROFILE:-release}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
OUT="${WEBCHAT_OUT:-$TARGET/webchat-tests}"
SERVER_PID=""

cleanup() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT
step() { echo "== $*"; }

CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if [[ -z "$CHROMIUM" ]]; then
    if command -v apt-get >/dev/null; then
        step "installing Debian's chromium with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends chromium >/dev/null
        CHROMIUM="$(command -v chromium)"
    else
        echo "webchat-tests: no chromium and no apt-get on this machine: browser tests SKIPPED" >&2
        exit 0
    fi
fi
for tool in node npm; do
    command -v "$tool" >/dev/null || { echo "webchat-tests: $tool not found (install Node.js >= 20)" >&2; exit 1; }
done
echo "   $("$CHROMIUM" --version 2>/dev/null | head -1) | node $(node --version)"

step "npm ci (web/, pinned by package-lock.json)"
(cd "$ROOT/web" && npm ci --no-audit --no-fund --loglevel=error)

step "unit tests of the page's state logic (node --test)"
(cd "$ROOT/web" && node --test test/)

step "the committed bundle is the build of web/ (npm run build reproduces it)"
if ! git -C "$ROOT" diff --quiet -- crates/ds4-server/webchat 2>/dev/null; then
    echo "crates/ds4-server/webchat has uncommitted changes before the check" >&2
fi
(cd "$ROOT/web" && npm run -s build >/dev/null)
if ! git -C "$ROOT" diff --exit-code --stat -- crates/ds4-server/webchat; then
    echo "webchat-tests: the committed bundle differs from a fresh build of web/: run 'npm run build' in web/ and commit crates/ds4-server/webchat" >&2
    exit 1
fi

if [[ -z "${DS4_SERVER_BIN:-}" ]]; then
    step "building ds4-server ($PROFILE)"
    flag=(); [[ "$PROFILE" == release ]] && flag=(--release)
    (cd "$ROOT" && cargo build -q "${flag[@]}" -p ds4-server --bin ds4-server)
fi
SERVER_BIN="${DS4_SERVER_BIN:-$TARGET/$PROFILE/ds4-server}"

rm -rf "$OUT"
mkdir -p "$OUT"
KEY="webchat-test-$RANDOM$RANDOM"
step "starting ds4-server on the demo model (--api-key, --parallel 1, --queue 1, --max-body-bytes 200000)"
DS4_API_KEY="$KEY" "$SERVER_BIN" -m "$ROOT/tests/fixtures/demo/ds4-demo.gguf" -c 4096 \
    --host 127.0.0.1 --port 0 -t 2 --parallel 1 --queue 1 --max-body-bytes 200000 \
    --test-script "$HERE/script.json" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
URL=""
for _ in $(seq 1 600); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        cat "$OUT/server.log"; echo "server exited during startup"; exit 1
    fi
    URL="$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$OUT/server.log" | head -1)"
    [[ -n "$URL" ]] && break
    sleep 0.1
done
[[ -n "$URL" ]] || { cat "$OUT/server.log"; echo "server did not start"; exit 1; }
echo "   $URL (pid $SERVER_PID)"

step "browser tests (headless chromium, puppeteer-core)"
fail=0
DS4_URL="$URL" DS4_KEY="$KEY" SERVER_LOG="$OUT/server.log" OUT_DIR="$OUT" CHROMIUM="$CHROMIUM" \
    timeout 900 node "$ROOT/web/browser-test/chat.mjs" || fail=1

kill -TERM "$SERVER_PID"
rc=0
wait "$SERVER_PID" || rc=$?
SERVER_PID=""
if [[ $rc -ne 0 ]]; then echo "server exited with $rc"; fail=1; fi
echo "   screenshots and logs: $OUT"
if [[ $fail -ne 0 ]]; then
    echo "== server log (tail)"; tail -30 "$OUT/server.log"
    echo "WEBCHAT TESTS FAILED"; exit 1
fi
echo "WEBCHAT TESTS PASSED"
