"""Load on a fleet through its load balancer, with the official `openai` client.

Threads send short chat completions, each request its own user (so that the sticky split sees
many), until the file FLEET_STOP exists; every FLEET_RATE_EVERY-th answer is rated (helpful or
not, alternately) through the balancer with the feedback key, by response id. No retries: what
a client of the balancer would see is what is counted.

Environment: RAMPART_URL (the balancer), RAMPART_KEY (scope infer), RAMPART_FEEDBACK_KEY,
RAMPART_MODEL, FLEET_STOP, FLEET_OUT (the summary's JSON file), FLEET_THREADS, FLEET_RATE_EVERY
(0: no ratings), FLEET_TAG (names the users of this run).
"""
import json
import os
import threading
import time
import urllib.error
import urllib.request

import openai

BASE = os.environ["RAMPART_URL"]
KEY = os.environ["RAMPART_KEY"]
FEEDBACK_KEY = os.environ["RAMPART_FEEDBACK_KEY"]
MODEL = os.environ["RAMPART_MODEL"]
STOP = os.environ["FLEET_STOP"]
OUT = os.environ["FLEET_OUT"]
THREADS = int(os.environ.get("FLEET_THREADS", "4"))
RATE_EVERY = int(os.environ.get("FLEET_RATE_EVERY", "0"))
TAG = os.environ.get("FLEET_TAG", "run")

client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
lock = threading.Lock()
statuses = {}  # status (or "connection") -> count
failures = []  # (time, status, message) of every answer that was not a 200
acknowledged = []  # audit ids of the answers received
ratings = {}  # feedback status -> count


def count(table, key):
    with lock:
        table[key] = table.get(key, 0) + 1


def rate(response_id, helpful):
    body = json.dumps({"response_id": response_id, "rating": "helpful" if helpful else "not_helpful"}).encode()
    request = urllib.request.Request(
        BASE + "/v1/feedback",
        data=body,
        headers={"Authorization": "Bearer " + FEEDBACK_KEY, "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            count(ratings, str(r.status))
    except urllib.error.HTTPError as e:
        count(ratings, str(e.code))
    except Exception:
        count(ratings, "connection")


def worker(t):
    i = 0
    while not os.path.exists(STOP):
        i += 1
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Say a word about the number {i}."}],
                max_tokens=6,
                temperature=0,
                user=f"{TAG}-{t}-{i}",
            )
            completion = raw.parse()
            count(statuses, "200")
            with lock:
                acknowledged.append(raw.headers.get("x-rampart-audit-id"))
            if RATE_EVERY and i % RATE_EVERY == 0:
                rate(completion.id, (i // RATE_EVERY) % 2 == 0)
        except openai.APIStatusError as e:
            count(statuses, str(e.status_code))
            with lock:
                failures.append((time.time(), e.status_code, str(e)[:200]))
        except openai.APIConnectionError as e:
            count(statuses, "connection")
            with lock:
                failures.append((time.time(), "connection", str(e)[:200]))
            time.sleep(0.05)  # nobody listens: no spinning
        if os.getppid() == 1:
            break  # the test that started this one is gone


threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with open(OUT, "w") as f:
    json.dump(
        {"statuses": statuses, "failures": failures, "acknowledged": acknowledged, "ratings": ratings},
        f,
    )
print("fleet load:", json.dumps({"statuses": statuses, "ratings": ratings}))
