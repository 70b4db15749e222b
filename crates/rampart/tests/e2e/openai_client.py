"""Drives a running `rampart serve` with the official `openai` Python client.

Environment: RAMPART_URL (base URL), RAMPART_KEY (a valid key), RAMPART_MODEL (model id).
Every check prints one line; any failure raises and exits non-zero.
"""
import os
import sys

import openai

URL = os.environ["RAMPART_URL"] + "/v1"
KEY = os.environ["RAMPART_KEY"]
MODEL = os.environ["RAMPART_MODEL"]

client = openai.OpenAI(base_url=URL, api_key=KEY, max_retries=0, timeout=120)
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


# Chat, non-streaming: the demo answer, exact usage and finish reason.
chat = client.chat.completions.create(
    model=MODEL,
    messages=[SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    temperature=0,
    max_tokens=20,
)
answer = chat.choices[0].message.content
check("chat answers Paris", "Paris" in answer, answer)
check("chat finish_reason stop", chat.choices[0].finish_reason == "stop", chat.choices[0].finish_reason)
u = chat.usage
check("chat usage adds up", u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0, u)

# Chat with content parts and max_completion_tokens: length.
chat = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": [{"type": "text", "text": "Count from one to twenty."}]}],
    temperature=0,
    max_completion_tokens=5,
)
check("max_completion_tokens → length", chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5,
      (chat.choices[0].finish_reason, chat.usage))

# Streaming chat with usage: the streamed text equals the non-streamed one.
messages = [SYSTEM, {"role": "user", "content": "Name three colours."}]
full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
stream = client.chat.completions.create(
    model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
    stream_options={"include_usage": True},
)
parts, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
streamed = "".join(parts)
check("stream equals non-stream", streamed == full.choices[0].message.content, (streamed, full.choices[0].message.content))
check("stream usage chunk", usage is not None and usage.completion_tokens == full.usage.completion_tokens, usage)
check("stream finish reason", finish == full.choices[0].finish_reason, finish)

# Logprobs with alternatives and the entropy extension.
chat = client.chat.completions.create(
    model=MODEL, messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3,
)
content = chat.choices[0].logprobs.content
check("logprobs per token", len(content) == chat.usage.completion_tokens, len(content))
check("top_logprobs count", all(len(t.top_logprobs) == 3 for t in content))
extra = content[0].model_extra or {}
check("entropy extension", "entropy" in extra and extra["entropy"] >= 0, extra)
check("greedy token is the most likely", content[0].logprob >= max(t.logprob for t in content[0].top_logprobs) - 1e-5)

# Completions: stop strings cut the text and report stop.
comp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
text = comp.choices[0].text
check("stop string", " 7" not in text and comp.choices[0].finish_reason == "stop", repr(text))

# Completions with logprobs (legacy format) and n.
comp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2, n=2)
check("n choices", len(comp.choices) == 2 and comp.choices[0].text == comp.choices[1].text)
lp = comp.choices[0].logprobs
check("completion logprobs", len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 2, lp)

# Seeds: same seed, same text; sampling at temperature 1.
def sample(seed):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed)
    return r.choices[0].text
a, b = sample(1234), sample(1234)
check("seed determinism", a == b, (a, b))
check("different seeds differ", any(sample(s) != a for s in (1, 2, 3)))

# Streaming completions.
parts = [c.choices[0].text for c in client.completions.create(
    model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices]
whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
check("completion stream equals non-stream", "".join(parts) == whole.choices[0].text, (parts, whole.choices[0].text))

# Models.
ids = [m.id for m in client.models.list().data]
check("models list", MODEL in ids, ids)

# Errors map to the client's exception types.
def raises(exc, fn, name):
    try:
        fn()
    except exc as e:
        check(name, True)
        return e
    raise AssertionError(f"{name}: no {exc.__name__}")

e = raises(openai.NotFoundError, lambda: client.chat.completions.create(
    model="no-such-model", messages=[{"role": "user", "content": "hi"}]), "unknown model → NotFoundError")
check("404 lists available models", MODEL in str(e), str(e))
raises(openai.BadRequestError, lambda: client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5), "temperature 5 → BadRequestError")
e = raises(openai.BadRequestError, lambda: client.completions.create(
    model=MODEL, prompt="word " * 5000, max_tokens=10), "prompt too long → BadRequestError")
check("prompt too long says the numbers", "maximum context length" in str(e), str(e))
raises(openai.BadRequestError, lambda: client.chat.completions.create(
    model=MODEL, messages=[], max_tokens=3), "empty messages → BadRequestError")
bad = openai.OpenAI(base_url=URL, api_key="sk-wrong-key-123", max_retries=0)
raises(openai.AuthenticationError, lambda: bad.models.list(), "wrong key → AuthenticationError")

print("all openai client checks passed")
sys.exit(0)
