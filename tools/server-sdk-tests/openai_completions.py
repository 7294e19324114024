"""OpenAI SDK: legacy completions, plain and streamed with usage."""

from openai import OpenAI

from common import BASE, MODEL, PLAIN, check, eq, finish, ok

client = OpenAI(base_url=BASE + "/v1", api_key="sk-local", max_retries=0, timeout=120)


@check("completions plain")
def _():
    r = client.completions.create(model=MODEL, prompt="[plain] once upon a time", max_tokens=64)
    eq(r.object, "text_completion", "object")
    ok(r.id.startswith("cmpl-"), r.id)
    eq(r.choices[0].text, PLAIN, "text")
    eq(r.choices[0].finish_reason, "stop", "finish")
    ok(r.usage.prompt_tokens > 0, "usage")


@check("completions stream with include_usage and max_tokens")
def _():
    s = client.completions.create(model=MODEL, prompt="[plain]", max_tokens=3, stream=True, stream_options={"include_usage": True})
    text, finish_reason, usage = "", None, None
    for ch in s:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices:
            text += ch.choices[0].text
            finish_reason = ch.choices[0].finish_reason or finish_reason
    ok(text and PLAIN.startswith(text), repr(text))
    eq(finish_reason, "length", "finish")
    eq(usage.completion_tokens, 3, "usage")


finish("openai completions")
