"""OpenAI SDK: Responses API — plain, the streaming event lifecycle (raw events and the
SDK's accumulating stream helper), reasoning summaries, function calls, a replayed follow-up
and a previous_response_id follow-up that sends only the tool output."""

import openai
from openai import OpenAI

from common import BASE, BASH_PARAMS, MODEL, THINK_CONTENT, TOOL_ARGS, args, check, eq, finish, ok

client = OpenAI(base_url=BASE + "/v1", api_key="sk-local", max_retries=0, timeout=120)
TOOLS = [{"type": "function", "name": "bash", "description": "Run a shell command", "parameters": BASH_PARAMS}]


@check("responses plain")
def _():
    r = client.responses.create(model=MODEL, input="[think] hi")
    eq(r.status, "completed", "status")
    eq(r.output_text, THINK_CONTENT, "output_text")
    ok(r.usage.input_tokens > 0 and r.usage.output_tokens > 0, "usage")
    eq(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens, "total")


@check("responses max_output_tokens → incomplete")
def _():
    r = client.responses.create(model=MODEL, input="[plain]", max_output_tokens=2, reasoning={"effort": "none"})
    eq(r.status, "incomplete", "status")


@check("responses raw stream events")
def _():
    types, text, seqs = [], "", []
    for ev in client.responses.create(model=MODEL, input="[think] hi", stream=True):
        types.append(ev.type)
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            text += ev.delta
    eq(seqs, list(range(len(seqs))), "sequence numbers")
    eq(types[0], "response.created", "first")
    eq(types[-1], "response.completed", "last")
    eq(text, THINK_CONTENT, "text")


@check("responses stream helper with reasoning summary and a function call")
def _():
    with client.responses.stream(model=MODEL, input=[{"role": "user", "content": "[thinktool] go"}], tools=TOOLS,
                                 reasoning={"effort": "high", "summary": "auto"}) as s:
        for _ev in s:
            pass
        r = s.get_final_response()
    u1 = r.usage
    kinds = [o.type for o in r.output]
    eq(kinds, ["reasoning", "message", "function_call"], "items")
    eq(r.output[0].summary[0].text, "I should run ls.", "summary")
    fc = r.output[2]
    eq(fc.name, "bash", "name")
    eq(args(fc.arguments), TOOL_ARGS, "arguments")
    ok(fc.call_id.startswith("call_"), fc.call_id)
    # Codex-style follow-up: replay the items plus the tool output.
    follow = [{"role": "user", "content": "[thinktool] go"},
              {"type": "reasoning", "summary": [{"type": "summary_text", "text": "I should run ls."}]},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
              {"type": "function_call", "call_id": fc.call_id, "name": "bash", "arguments": fc.arguments},
              {"type": "function_call_output", "call_id": fc.call_id, "output": "a.txt"},
              {"role": "user", "content": "[think] thanks"}]
    r2 = client.responses.create(model=MODEL, input=follow, tools=TOOLS, reasoning={"effort": "high"})
    eq(r2.status, "completed", "status")
    eq(r2.output_text, THINK_CONTENT, "follow-up text")
    # The replayed items render the sampled DSML exactly: the whole first turn is reused.
    eq(r2.usage.input_tokens_details.cached_tokens, u1.input_tokens + u1.output_tokens, "cached tokens")


@check("responses previous_response_id with only the function_call_output (live state)")
def _():
    # OpenAI-SDK style tool loop: send only the output and name the response it answers.
    r1 = client.responses.create(model=MODEL, input="[thinktool] go", tools=TOOLS, reasoning={"effort": "high"})
    fc = [o for o in r1.output if o.type == "function_call"][0]
    r2 = client.responses.create(model=MODEL, previous_response_id=r1.id, tools=TOOLS, reasoning={"effort": "high"},
                                 input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "[think] a.txt"}])
    eq(r2.status, "completed", "status")
    eq(r2.output_text, THINK_CONTENT, "text")
    # Nothing of turn 1 is evaluated again: its prompt and sampled output are the cache.
    eq(r2.usage.input_tokens_details.cached_tokens, r1.usage.input_tokens + r1.usage.output_tokens, "cached tokens")
    # r1 is no longer what the live state ends with.
    try:
        client.responses.create(model=MODEL, previous_response_id=r1.id, input="[plain]")
        raise AssertionError("accepted a stale previous_response_id")
    except openai.BadRequestError as e:
        ok(r1.id in str(e), str(e))


@check("responses errors")
def _():
    try:
        client.responses.create(model=MODEL, input="x", tool_choice="required", tools=TOOLS)
        raise AssertionError("forced tool choice accepted")
    except openai.BadRequestError as e:
        ok("not supported" in str(e), str(e))


finish("openai responses")
