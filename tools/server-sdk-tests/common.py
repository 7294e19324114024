"""Shared helpers for the SDK checks: the server URL, the forced outputs of script.json,
and a tiny check runner (no pytest) that exits non-zero if any check failed."""

import json
import os
import sys
import traceback

BASE = os.environ.get("DS4_SERVER_URL", "http://127.0.0.1:8000")
MODEL = "deepseek-v4-flash"

# What the server's test script makes the tiny model "say" (see script.json).
THINK_REASONING = "Let me think."
THINK_CONTENT = "Hello there."
PLAIN = "The answer is 42."
TOOL_ARGS = {"command": "ls -la & pwd", "timeout": 10}

BASH_PARAMS = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"],
}

_results = []


def check(name):
    """Decorator: runs the check immediately, records PASS/FAIL, never raises."""

    def run(fn):
        try:
            fn()
            _results.append((name, None))
            print(f"PASS {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            _results.append((name, e))
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        return fn

    return run


def eq(got, want, what=""):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def ok(cond, what):
    if not cond:
        raise AssertionError(what)


def args(s):
    return json.loads(s)


def finish(suite):
    failed = [n for n, e in _results if e is not None]
    print(f"{suite}: {len(_results) - len(failed)}/{len(_results)} passed", flush=True)
    sys.exit(1 if failed or not _results else 0)
