"""The feedback loop end to end: the official `openai` client asks a running `rampart serve` to
classify support tickets (a strict JSON schema whose `category` is the class the server reads),
then feedback comes back by API key and by signed link, corrections push one class's error
rate up, and the admin tables show it.

Environment: RAMPART_URL, RAMPART_KEY (infer), RAMPART_FEEDBACK_KEY (feedback, same tenant),
RAMPART_OUTSIDER_KEY (feedback, another tenant), RAMPART_ADMIN_KEY, RAMPART_MODEL,
RAMPART_LINK_TTL_S (the server's link lifetime). Every check prints one line; any failure
raises. The last line is a JSON summary for the Rust side.
"""
import json
import os
import random
import time
import urllib.error
import urllib.request

import openai

BASE = os.environ["RAMPART_URL"]
KEY = os.environ["RAMPART_KEY"]
FEEDBACK_KEY = os.environ["RAMPART_FEEDBACK_KEY"]
OUTSIDER_KEY = os.environ["RAMPART_OUTSIDER_KEY"]
ADMIN_KEY = os.environ["RAMPART_ADMIN_KEY"]
MODEL = os.environ["RAMPART_MODEL"]
LINK_TTL_S = int(os.environ["RAMPART_LINK_TTL_S"])

client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)

CATEGORIES = ["logistics", "refunds", "customs"]
FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "ticket",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"category": {"type": "string", "enum": CATEGORIES}},
            "required": ["category"],
            "additionalProperties": False,
        },
    },
}
TICKETS = [
    "My parcel is stuck at the border and customs wants a form I never got.",
    "I returned the shoes two weeks ago and still have no refund.",
    "The courier left my package at the wrong address.",
    "Import duties were charged twice on my order, please refund one.",
    "Where is my order? Tracking has not moved for ten days.",
    "Customs held my package, what documents do you need?",
]


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


def post(body, key=None, token=None, raw=None):
    """POST /v1/feedback; returns (status, parsed body)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if token:
        headers["X-Rampart-Feedback-Token"] = token
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + "/v1/feedback", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"raw": text.decode(errors="replace")}


def get(path, key):
    req = urllib.request.Request(BASE + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


# 1. Answers, each with its ids and its signed feedback link.
answers = []
for i in range(36):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Route the support ticket. Answer in JSON with its category."},
            {"role": "user", "content": TICKETS[i % len(TICKETS)] + f" (ticket {i})"},
        ],
        temperature=0,
        max_tokens=24,
        response_format=FORMAT,
    )
    completion = raw.parse()
    category = json.loads(completion.choices[0].message.content)["category"]
    answers.append(
        {
            "id": completion.id,
            "category": category,
            "audit_id": raw.headers["x-rampart-audit-id"],
            "request_id": raw.headers["x-request-id"],
            "token": raw.headers["x-rampart-feedback-token"],
            "at": time.time(),
        }
    )
check("36 answers, each with an audit id and a feedback link", all(a["token"].startswith("v1.") for a in answers))
counts = {c: sum(a["category"] == c for a in answers) for c in CATEGORIES}
print("classes:", counts)
target = max(counts, key=counts.get)
other = [c for c in CATEGORIES if c != target][0]

# 2. By signed link, without a key: the end user's thumbs.
a = answers[-1]
status, body = post({"rating": "helpful", "comment": "quick and right"}, token=a["token"])
check("a signed link rates without a key (201)", status == 201, f"{status} {body}")
check("the link's feedback names its response", body["response_id"] == a["id"] and body["via"] == "link", body)
check("the class is the answer's category", body["class"] == a["category"], body)
link_id = body["id"]
status, again = post({"rating": "helpful", "rater": "someone-else"}, token=a["token"])
check("the same link again replaces its rating, whoever it claims to be (200, same id, rater link)",
      status == 200 and again["status"] == "updated" and again["id"] == link_id and again["rater"] == "link", f"{status} {again}")
forged = a["token"][:-2] + ("AA" if not a["token"].endswith("AA") else "BB")
status, body = post({"rating": "not_helpful"}, token=forged)
check("a forged link is refused (401 feedback_token_forged)", status == 401 and body["error"]["code"] == "feedback_token_forged", f"{status} {body}")
status, body = post({"rating": 1, "response_id": answers[0]["id"]}, token=a["token"])
check("a link rates its own response only (403)", status == 403 and body["error"]["code"] == "other_tenant", f"{status} {body}")

# 3. By API key: the agents' corrections, idempotent per rater.
first = answers[0]
status, body = post({"response_id": first["id"], "rating": "helpful", "rater": "agent-7"}, key=FEEDBACK_KEY)
check("a feedback key rates by response id (201)", status == 201 and body["status"] == "created", f"{status} {body}")
status, again = post({"response_id": first["id"], "rating": "not_helpful", "rater": "agent-7"}, key=FEEDBACK_KEY)
check("the same rater again replaces it (200 updated, same id)", status == 200 and again["status"] == "updated" and again["id"] == body["id"], f"{status} {again}")
status, body = post({"request_id": first["request_id"], "rating": 4, "rater": "agent-8"}, key=FEEDBACK_KEY)
check("by request id, another rater (201)", status == 201, f"{status} {body}")
status, body = post({"audit_id": first["audit_id"], "rating": 5}, key=OUTSIDER_KEY)
check("another tenant's key is refused (403 other_tenant)", status == 403 and body["error"]["code"] == "other_tenant", f"{status} {body}")
status, body = post({"audit_id": first["audit_id"], "rating": 5}, key=KEY)
check("an infer-only key is refused (403)", status == 403, f"{status} {body}")
status, body = post({"audit_id": first["audit_id"], "rating": 5})
check("no key and no link is refused (401)", status == 401, f"{status} {body}")
status, body = post({"response_id": "chatcmpl-unknown", "rating": 5}, key=FEEDBACK_KEY)
check("an unknown response is 404 response_not_found", status == 404 and body["error"]["code"] == "response_not_found", f"{status} {body}")
status, body = post({"response_id": first["id"], "rating": 9}, key=FEEDBACK_KEY)
check("a bad rating is 400 naming the field", status == 400 and body["error"]["param"] == "rating", f"{status} {body}")

# 4. Corrections push one class above 5 %: the agents relabel most of its answers.
wrong = [x for x in answers[1:-1] if x["category"] == target]
for i, x in enumerate(wrong):
    if i % 4 == 3:
        body = {"response_id": x["id"], "rating": "helpful", "rater": "agent-9"}
    else:
        body = {
            "response_id": x["id"],
            "rating": "not_helpful",
            "label": other,
            "correction": json.dumps({"category": other}),
            "rater": "agent-9",
        }
    status, r = post(body, key=FEEDBACK_KEY)
    assert status == 201, (status, r)
check(f"{len(wrong)} corrections on class {target}", len(wrong) >= 10, counts)

# 5. Bad input: 1,000 malformed bodies, only 4xx.
rng = random.Random(7)
pieces = [b"{", b"}", b"\"rating\"", b":", b"5", b",", b"\"label\"", b"null", b"[", b"]", b"\xff", b"\"response_id\"", b"\"x\"", b"1e999", b"-1"]
statuses = set()
for i in range(1000):
    if i % 2:
        raw = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        status, _ = post(None, key=FEEDBACK_KEY, raw=raw)
    else:
        field = rng.choice(["rating", "label", "item", "correction", "comment", "rater", "response_id", "bogus"])
        value = rng.choice([None, -1, 6, 2.5, "", "x" * 70000, [], {}, {"messages": []}, True])
        status, _ = post({"response_id": first["id"], field: value}, key=FEEDBACK_KEY)
    statuses.add(status)
check("1,000 malformed bodies: 4xx only", all(400 <= s < 500 for s in statuses), statuses)

# 6. Expired links are refused.
wait = answers[1]["at"] + LINK_TTL_S + 1.5 - time.time()
if wait > 0:
    time.sleep(wait)
status, body = post({"rating": "helpful"}, token=answers[1]["token"])
check("an expired link is refused (401 feedback_token_expired)", status == 401 and body["error"]["code"] == "feedback_token_expired", f"{status} {body}")

# 7. The admin tables.
table = get(f"/admin/feedback/classes?model={MODEL}", ADMIN_KEY)
row = [c for c in table["classes"] if c["class"] == target][0]
check(f"class {target}: error rate above 5 % with confidence", row["error_rate_lower"] > 0.05 and row["enough"], row)
calibration = get(f"/admin/feedback/calibration?model={MODEL}&buckets=5", ADMIN_KEY)
check("the calibration table has its buckets", len(calibration["buckets"]) == 5, calibration)

print(json.dumps({"summary": {"target": target, "other": other, "corrections": len(wrong), "feedback_rows": row["feedback"], "error_rate_lower": row["error_rate_lower"]}}))
print("all feedback checks passed")
