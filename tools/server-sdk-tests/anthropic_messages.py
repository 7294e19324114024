"""Anthropic SDK: messages plain (thinking + text), thinking disabled, the streaming helper,
streamed tool_use with input_json deltas, tool_result follow-ups reusing the live KV (history
replayed, and the result alone), and typed errors."""

import anthropic
from anthropic import Anthropic

from common import BASE, BASH_PARAMS, PLAIN, THINK_CONTENT, THINK_REASONING, TOOL_ARGS, check, eq, finish, ok

client = Anthropic(base_url=BASE, api_key="sk-local", max_retries=0, timeout=120)
MODEL = "claude-sonnet-4-5"  # any name is accepted and echoed
TOOLS = [{"name": "bash", "description": "Run a shell command", "input_schema": BASH_PARAMS}]


@check("messages plain (thinking + text)")
def _():
    r = client.messages.create(model=MODEL, max_tokens=200, system="Be brief.", messages=[{"role": "user", "content": "[think] hi"}])
    eq(r.type, "message", "type")
    eq(r.model, MODEL, "model echo")
    eq([b.type for b in r.content], ["thinking", "text"], "blocks")
    eq(r.content[0].thinking, THINK_REASONING, "thinking")
    eq(r.content[1].text, THINK_CONTENT, "text")
    eq(r.stop_reason, "end_turn", "stop_reason")
    ok(r.usage.cache_creation_input_tokens > 0 and r.usage.output_tokens > 0, r.usage)


@check("messages thinking disabled, max_tokens")
def _():
    r = client.messages.create(model=MODEL, max_tokens=200, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "[plain]"}])
    eq([b.type for b in r.content], ["text"], "blocks")
    eq(r.content[0].text, PLAIN, "text")
    r = client.messages.create(model=MODEL, max_tokens=2, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "[plain]"}])
    eq(r.stop_reason, "max_tokens", "stop_reason")


@check("messages stream helper")
def _():
    with client.messages.stream(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "[think] hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    eq(text, THINK_CONTENT, "text_stream")
    eq(final.content[0].type, "thinking", "first block")
    eq(final.content[0].thinking, THINK_REASONING, "thinking")


state = {}


@check("messages streamed tool_use")
def _():
    events = []
    with client.messages.stream(model=MODEL, max_tokens=400, tools=TOOLS, messages=[{"role": "user", "content": "[thinktool] go"}]) as s:
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
    ok("input_json" in events, f"no input_json events in {events}")
    eq(final.stop_reason, "tool_use", "stop_reason")
    eq([b.type for b in final.content], ["thinking", "text", "tool_use"], "blocks")
    tu = final.content[2]
    eq(tu.name, "bash", "name")
    eq(tu.input, TOOL_ARGS, "input")
    ok(tu.id.startswith("toolu_"), tu.id)
    state.update(final=final)


@check("messages tool_result follow-up reuses the live KV")
def _():
    final = state["final"]
    tu = final.content[2]
    u = final.usage
    msgs = [{"role": "user", "content": "[thinktool] go"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "a.txt"}, {"type": "text", "text": "[think]"}]}]
    r = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=msgs)
    eq(r.content[-1].text, THINK_CONTENT, "text")
    eq(r.usage.cache_read_input_tokens, u.cache_read_input_tokens + u.cache_creation_input_tokens + u.output_tokens, "cache read")


@check("messages tool_result-only follow-up on the live state")
def _():
    r1 = client.messages.create(model=MODEL, max_tokens=400, tools=TOOLS, messages=[{"role": "user", "content": "[thinktool] go"}])
    tu = [b for b in r1.content if b.type == "tool_use"][0]
    # Only the result: the server continues the turn it remembers.
    r2 = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "[think] a.txt"}]}])
    eq(r2.content[-1].text, THINK_CONTENT, "text")
    u = r1.usage
    eq(r2.usage.cache_read_input_tokens, u.cache_read_input_tokens + u.cache_creation_input_tokens + u.output_tokens, "cache read")


@check("messages typed errors")
def _():
    try:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}], extra_body={"top_k": -1})
        raise AssertionError("accepted top_k -1")
    except anthropic.BadRequestError as e:
        eq(e.status_code, 400, "status")
        eq(e.body["error"]["type"], "invalid_request_error", "type")
    try:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_gone", "content": "x"}]}])
        raise AssertionError("accepted an orphan tool_result")
    except anthropic.BadRequestError as e:
        ok("toolu_gone" in str(e), str(e))


finish("anthropic messages")
