"""A chaos drill against a running `rampart serve`, with the official `openai` client and faults
injected through the admin API.

The server serves smollm2-135m at 2.0.0 (primary) and 1.0.0, the rules model support-tickets,
and a canned answer, chained in that order (crates/rampart/tests/serve.rs writes the config).
Environment: RAMPART_URL, RAMPART_KEY (scope infer), RAMPART_ADMIN_KEY (scope admin),
RAMPART_MODEL, RAMPART_CANNED, RAMPART_FIRST_TOKEN_MS, RAMPART_HANDOFF_THRESHOLD.

Prints one line per check and, last, a JSON summary line (`drill: {...}`) the Rust test compares
with the records and the metrics. Any failed check raises.
"""
import json
import os
import time
import urllib.error
import urllib.request

import openai

BASE = os.environ["RAMPART_URL"]
KEY = os.environ["RAMPART_KEY"]
ADMIN = os.environ["RAMPART_ADMIN_KEY"]
MODEL = os.environ["RAMPART_MODEL"]
CANNED = os.environ["RAMPART_CANNED"]
FIRST_TOKEN_MS = int(os.environ["RAMPART_FIRST_TOKEN_MS"])
THRESHOLD = int(os.environ["RAMPART_HANDOFF_THRESHOLD"])

client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
statuses = []  # every response status the client saw
marked = []  # every x-rampart-fallback header the client saw
TICKET = "I was charged twice for my order and I want a refund of the second payment"
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "ticket",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "category": {"type": "string", "enum": ["logistics", "quality", "refund", "invoice", "service"]},
                "confidence": {"type": "number"},
                "reasons": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["category", "confidence", "reasons"],
        },
    },
}


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


def admin(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(BASE + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {ADMIN}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def fault(backend, mode, **extra):
    status, body = admin("POST", "/admin/faults", {"backend": backend, "mode": mode, "duration_s": 120, **extra})
    check(f"fault {mode} on {backend} injected", status == 201, body)


def clear():
    status, _ = admin("DELETE", "/admin/faults")
    check("faults cleared", status == 200)


def chat(content="Say hello.", stream=False, **kwargs):
    """A chat through the raw-response wrapper: (status, fallback header, parsed completion)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 12),
        stream=stream,
        **kwargs,
    )
    statuses.append(raw.status_code)
    header = raw.headers.get("x-rampart-fallback")
    if header:
        marked.append(header)
    return raw.status_code, header, raw.parse()


def text_of(completion, stream):
    if not stream:
        return completion.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in completion if c.choices)


# Healthy: the primary answers, unmarked.
status, header, c = chat()
check("healthy: 200, unmarked, the primary answered", status == 200 and header is None
      and c.system_fingerprint == f"{MODEL}@2.0.0", (status, header, c.system_fingerprint))

# Level 1: the primary fails; the other version answers inside the same request.
fault(f"{MODEL}@2.0.0", "fail")
status, header, c = chat()
check("primary fails → 1.0.0 answers", status == 200
      and header == f"level=1; backend={MODEL}@1.0.0; reason=error"
      and c.system_fingerprint == f"{MODEL}@1.0.0", (status, header))

# Both versions fail: the rules engine answers the ticket schema with reasons from the text.
fault(f"{MODEL}@1.0.0", "fail")
status, header, c = chat(TICKET, response_format=SCHEMA)
answer = json.loads(c.choices[0].message.content)
check("both fail → the rules engine answers", status == 200
      and header.startswith("level=1; backend=support-tickets@") and header.endswith("reason=error"), header)
check("the rules answer follows the schema", answer["category"] == "refund"
      and 0 < answer["confidence"] <= 1 and answer["reasons"], answer)
check("every reason is a span of the ticket", all(r.lower() in TICKET.lower() for r in answer["reasons"]),
      answer["reasons"])

# The rules fail too: the canned answer, streamed, in the asked language, marked level 2.
fault("support-tickets", "fail")
status, header, stream = chat(TICKET, stream=True, extra_headers={"Accept-Language": "en-GB,en;q=0.8"})
check("rules fail → canned answer", status == 200
      and header == f"level=2; backend=canned:{MODEL}; reason=error"
      and text_of(stream, True) == CANNED, header)
status, header, c = chat(TICKET, extra_headers={"Accept-Language": "zh-CN"})
check("the canned answer speaks the asked language", status == 200 and "稍后" in c.choices[0].message.content,
      c.choices[0].message.content)

# The breaker of the primary opens after 5 failures in a row (4 so far): calls skip it at once.
def primary_breaker():
    _, body = admin("GET", "/admin/backends")
    return next(b for b in body["backends"] if b["id"] == f"{MODEL}@2.0.0")["breaker"]


check("4 failures in a row leave the breaker closed", primary_breaker()["state"] == "closed", primary_breaker())
chat()
check("the 5th opens it", primary_breaker()["state"] == "open", primary_breaker())
status, header, c = chat(TICKET, response_format=SCHEMA)
check("an open breaker is skipped (circuit_open)", header is not None and header.endswith("reason=circuit_open"),
      header)
clear()

# A hang before the first token: the fallback answers within the first-token timeout.
# (The primary's breaker is still open from the failures above: requests go on falling back
# until its open time is over and a probe closes it.)
deadline = time.time() + 60
while time.time() < deadline:
    _, header, _ = chat()
    if header is None:
        break
    time.sleep(0.5)
check("the recovered primary is served again", header is None, header)
fault(f"{MODEL}@2.0.0", "hang")
began = time.time()
status, header, stream = chat(stream=True)
text = text_of(stream, True)
hang_s = time.time() - began
check("a hang falls back to 1.0.0", status == 200 and header == f"level=1; backend={MODEL}@1.0.0; reason=first_token_timeout"
      and text, (header, text))
check(f"… within the first-token timeout ({FIRST_TOKEN_MS} ms) plus the fallback's own answer",
      FIRST_TOKEN_MS / 1e3 <= hang_s < FIRST_TOKEN_MS / 1e3 + 3, hang_s)
clear()

# A stall mid-stream: the text already sent cannot be taken back; the stream ends with a typed
# error event, which the client raises.
fault(f"{MODEL}@2.0.0", "stall", after_tokens=2)
raw = client.chat.completions.with_raw_response.create(
    model=MODEL, messages=[{"role": "user", "content": "Count from one to fifty."}],
    temperature=0, max_tokens=60, stream=True)
statuses.append(raw.status_code)
parts, raised = [], None
try:
    for chunk in raw.parse():
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            check("no clean stop after a stall", choice.finish_reason != "stop", choice.finish_reason)
except openai.APIError as e:
    raised = e
check("a mid-stream stall ends with a typed error the client raises", raised is not None and "stalled" in str(raised),
      (raised, parts))
check("… after the text that was already sent", "".join(parts) != "", parts)
clear()

# Hand-off: fallbacks beyond the threshold hand the model to people, then it resumes by itself.
fault(f"{MODEL}@2.0.0", "fail")
handed_off = None
for _ in range(THRESHOLD + 10):
    try:
        status, header, _ = chat()
    except openai.APIStatusError as e:
        statuses.append(e.status_code)
        handed_off = e
        break
check("fallbacks beyond the threshold → 503 human_handoff", handed_off is not None
      and handed_off.status_code == 503 and handed_off.body["code"] == "human_handoff"
      and handed_off.body["handoff_url"] == "https://support.example/handoff", handed_off and handed_off.body)
metrics = urllib.request.urlopen(BASE + "/metrics").read().decode()
check("rampart_handoff_active is raised", f'rampart_handoff_active{{model="{MODEL}"}} 1' in metrics,
      [l for l in metrics.splitlines() if "handoff_active" in l])
clear()
resumed = False
deadline = time.time() + 30
while time.time() < deadline and not resumed:
    time.sleep(0.5)
    try:
        status, header, _ = chat()
        resumed = status == 200
    except openai.APIStatusError as e:
        statuses.append(e.status_code)
        check("only the typed hand-off 503 while handed off", e.status_code == 503
              and e.body["code"] == "human_handoff", e.body)
check("the model resumes by itself after the cool-down", resumed)

five_xx = [s for s in statuses if s >= 500]
check("no 5xx reached the client but the hand-off's 503", all(s == 503 for s in five_xx), statuses)
print("drill: " + json.dumps({"statuses": statuses, "marked": marked, "hang_s": hang_s}))
print("all fallback drill checks passed")
