"""Structured output through the official `openai` Python client against a running `rampart serve`.

The seeds' ticket classification: category (five labels), confidence 0-1, reasons. Every ticket
is classified with a strict JSON schema, streaming and not, and through the client's own
`parse` helper (a pydantic model); json_object mode, the choice and regex extensions, a length
cut and a bad schema are checked too.

Environment: RAMPART_URL (base URL), RAMPART_KEY (a valid key), RAMPART_MODEL (model id).
Every check prints one line; any failure raises and exits non-zero.
"""
import json
import os
import re
from typing import List, Literal

import openai
import pydantic

URL = os.environ["RAMPART_URL"] + "/v1"
KEY = os.environ["RAMPART_KEY"]
MODEL = os.environ["RAMPART_MODEL"]

client = openai.OpenAI(base_url=URL, api_key=KEY, max_retries=0, timeout=120)

CATEGORIES = ["billing", "technical", "account", "shipping", "other"]
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": CATEGORIES},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reasons": {
            "type": "array",
            "items": {"type": "string", "maxLength": 80},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["category", "confidence", "reasons"],
    "additionalProperties": False,
}
TICKETS = [
    "I was charged twice for my subscription this month, please refund one payment.",
    "The app crashes every time I open the settings page on Android 14.",
    "I forgot my password and the reset email never arrives.",
    "My package has been stuck in transit for ten days, where is it?",
    "Can you change the invoice address on my last order to our new office?",
    "Do you have a dark mode? Just curious.",
]


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


def messages(ticket):
    return [
        {
            "role": "system",
            "content": "Classify the support ticket. Answer in JSON with category, confidence and reasons.",
        },
        {"role": "user", "content": ticket},
    ]


def valid_ticket(obj):
    return (
        set(obj) == {"category", "confidence", "reasons"}
        and obj["category"] in CATEGORIES
        and isinstance(obj["confidence"], (int, float))
        and 0 <= obj["confidence"] <= 1
        and isinstance(obj["reasons"], list)
        and 1 <= len(obj["reasons"]) <= 3
        and all(isinstance(r, str) and len(r) <= 80 for r in obj["reasons"])
    )


FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA, "strict": True},
}

# The schema bounds an answer (three reasons of at most 80 characters): at worst about 300
# tokens, so no answer is cut by max_tokens and every one must end with "stop". (200 was too
# tight: a greedy SmolLM2 can fill every reason with one- or two-character tokens.)
MAX_TOKENS = 320

# Non-streaming: every ticket gives a valid object.
for i, ticket in enumerate(TICKETS):
    r = client.chat.completions.create(
        model=MODEL, messages=messages(ticket), temperature=0, max_tokens=MAX_TOKENS, response_format=FORMAT
    )
    content = r.choices[0].message.content
    obj = json.loads(content)
    check(f"ticket {i} is a valid object ({obj['category']})", valid_ticket(obj), content)
    check(f"ticket {i} finish_reason stop", r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)

# Streaming, sampled: the concatenated deltas are a valid object.
for i, ticket in enumerate(TICKETS[:3]):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(ticket),
        temperature=0.8,
        seed=i,
        max_tokens=MAX_TOKENS,
        response_format=FORMAT,
        stream=True,
    )
    text, reason = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    obj = json.loads(text)
    check(f"streamed ticket {i} is a valid object", valid_ticket(obj) and reason == "stop", text)


# The client's own structured-output helper, with a pydantic model (strict schema).
class Ticket(pydantic.BaseModel):
    category: Literal["billing", "technical", "account", "shipping", "other"]
    confidence: float = pydantic.Field(ge=0, le=1)
    reasons: List[pydantic.constr(max_length=80)] = pydantic.Field(min_length=1, max_length=3)


parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
parsed = parse(model=MODEL, messages=messages(TICKETS[0]), temperature=0, max_tokens=MAX_TOKENS, response_format=Ticket)
ticket = parsed.choices[0].message.parsed
check("the client's parse helper gets a Ticket", isinstance(ticket, Ticket) and ticket.category in CATEGORIES, parsed)

# json_object: any JSON object.
r = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
    temperature=0,
    max_tokens=120,
    response_format={"type": "json_object"},
)
if r.choices[0].finish_reason == "stop":
    check("json_object gives an object", isinstance(json.loads(r.choices[0].message.content), dict), r)
else:
    check("json_object ran to the limit", r.choices[0].finish_reason == "length", r)

# Extensions: choice and regex.
r = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Is this review positive or negative? 'Great, it works!'"}],
    temperature=0,
    max_tokens=10,
    extra_body={"response_format": {"type": "choice", "choices": ["positive", "negative"]}},
)
check("choice picks one", r.choices[0].message.content in ("positive", "negative"), r)
r = client.completions.create(
    model=MODEL,
    prompt="The date of the first moon landing, as YYYY-MM-DD:",
    temperature=0,
    max_tokens=20,
    extra_body={"guided_regex": r" ?[0-9]{4}-[0-9]{2}-[0-9]{2}"},
)
check("completions follow a regex", re.fullmatch(r" ?[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text), r)

# A token limit inside the object: finish_reason length (the record says incomplete).
r = client.chat.completions.create(
    model=MODEL, messages=messages(TICKETS[1]), temperature=0, max_tokens=6, response_format=FORMAT
)
check("a cut object says length", r.choices[0].finish_reason == "length", r)

# A bad schema: 400 with the reason, naming response_format.
try:
    client.chat.completions.create(
        model=MODEL,
        messages=messages(TICKETS[0]),
        max_tokens=10,
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integr"}}},
    )
    raise AssertionError("a bad schema was accepted")
except openai.BadRequestError as e:
    body = e.body or {}
    check("bad schema is a 400 naming response_format", e.status_code == 400 and body.get("param") == "response_format", body)
    check("bad schema message says why", "not valid" in body.get("message", ""), body)

print("all structured output checks passed")
