"""OpenAI SDK: models, chat completions (plain, real sampler, reasoning, streaming with
usage, tool calls plain and streamed, a tool-result follow-up that reuses the live KV),
and typed errors."""

import openai
from openai import OpenAI

from common import (BASE, BASH_PARAMS, MODEL, PLAIN, THINK_CONTENT, THINK_REASONING, TOOL_ARGS,
                    args, check, eq, finish, ok)

client = OpenAI(base_url=BASE + "/v1", api_key="sk-local", max_retries=0, timeout=120)
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": BASH_PARAMS}}]
NOTHINK = {"thinking": {"type": "disabled"}}


@check("models.list / retrieve")
def _():
    ms = client.models.list()
    eq([m.id for m in ms.data], [MODEL], "model ids")
    eq(client.models.retrieve(MODEL).id, MODEL, "retrieve")
    try:
        client.models.retrieve("gpt-unknown")
        raise AssertionError("unknown model retrieved")
    except openai.NotFoundError:
        pass


@check("chat plain (forced output, thinking disabled)")
def _():
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[plain] hi"}], extra_body=NOTHINK)
    eq(r.object, "chat.completion", "object")
    eq(r.choices[0].message.role, "assistant", "role")
    eq(r.choices[0].message.content, PLAIN, "content")
    eq(r.choices[0].finish_reason, "stop", "finish")
    ok(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, "usage")
    eq(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens, "total")


@check("chat on the real sampler (greedy, max_tokens)")
def _():
    r = client.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=5, seed=1)
    ok(r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
    ok(r.usage.completion_tokens <= 5, r.usage)
    again = client.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=5, seed=1)
    eq(again.choices[0].message.content, r.choices[0].message.content, "greedy is deterministic")
    eq(again.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens, "repeat reuses the prompt")


@check("chat reasoning_content")
def _():
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[think] hi"}])
    m = r.choices[0].message
    eq(m.content, THINK_CONTENT, "content")
    eq((m.model_extra or {}).get("reasoning_content"), THINK_REASONING, "reasoning_content")


@check("chat streaming with include_usage")
def _():
    s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[think] hi"}], stream=True, stream_options={"include_usage": True})
    content, reasoning, finish_reason, usage = "", "", None, None
    for ch in s:
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        finish_reason = ch.choices[0].finish_reason or finish_reason
    eq(content, THINK_CONTENT, "content")
    eq(reasoning, THINK_REASONING, "reasoning")
    eq(finish_reason, "stop", "finish")
    ok(usage is not None and usage.completion_tokens > 0, f"usage chunk {usage}")


state = {}


@check("chat tool call (non-stream)")
def _():
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[tool] list"}], tools=TOOLS, extra_body=NOTHINK)
    c = r.choices[0]
    eq(c.finish_reason, "tool_calls", "finish")
    eq(c.message.content, "Sure.", "content")
    tc = c.message.tool_calls[0]
    eq(tc.type, "function", "type")
    eq(tc.function.name, "bash", "name")
    eq(args(tc.function.arguments), TOOL_ARGS, "arguments")
    ok(tc.id.startswith("call_"), tc.id)
    state.update(call=tc, usage=r.usage)


@check("chat tool call (streamed argument deltas)")
def _():
    s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[tool] again"}], tools=TOOLS, stream=True, extra_body=NOTHINK)
    calls, finish_reason = {}, None
    for ch in s:
        if not ch.choices:
            continue
        for d in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "args": ""})
            if d.id:
                c["id"] = d.id
            if d.function and d.function.name:
                c["name"] = d.function.name
            if d.function and d.function.arguments:
                c["args"] += d.function.arguments
        finish_reason = ch.choices[0].finish_reason or finish_reason
    eq(len(calls), 1, "one call")
    eq(calls[0]["name"], "bash", "name")
    eq(args(calls[0]["args"]), TOOL_ARGS, "arguments")
    eq(finish_reason, "tool_calls", "finish")


@check("chat tool result follow-up reuses the live KV (exact DSML replay)")
def _():
    call, u1 = state["call"], state["usage"]
    msgs = [
        {"role": "user", "content": "[tool] list"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "bash", "arguments": '{"timeout": 10, "command": "ls -la & pwd"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"},
        {"role": "user", "content": "[plain] thanks"},
    ]
    # The streamed call above replaced the live state; run the first turn again first.
    r1 = client.chat.completions.create(model=MODEL, messages=msgs[:1], tools=TOOLS, extra_body=NOTHINK)
    msgs[1]["tool_calls"][0]["id"] = r1.choices[0].message.tool_calls[0].id
    msgs[2]["tool_call_id"] = msgs[1]["tool_calls"][0]["id"]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, extra_body=NOTHINK)
    eq(r.choices[0].message.content, PLAIN, "content")
    eq(r.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens + r1.usage.completion_tokens, "cached tokens")
    ok(u1.prompt_tokens == r1.usage.prompt_tokens, "same first prompt")


@check("typed errors")
def _():
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=500)
        raise AssertionError("accepted temperature 500")
    except openai.BadRequestError as e:
        eq(e.status_code, 400, "status")
        eq(e.body["type"], "invalid_request_error", "type")
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 5000}])
        raise AssertionError("accepted an over-long prompt")
    except openai.BadRequestError as e:
        eq(e.code, "context_length_exceeded", "code")


finish("openai chat")
