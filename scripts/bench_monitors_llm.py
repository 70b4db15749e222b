"""The output-entropy monitor on a real LLM: varied ordinary chat prompts through the official
`openai` client to a running `rampart serve` (SmolLM2), then an entropy collapse (every request
forced through a strong logit bias), measuring false alarms and the delay to the alarm.

Usage: python scripts/bench_monitors_llm.py HTTP_PORT API_KEY ADMIN_KEY STATIONARY_REQUESTS
"""

import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

port, key, admin_key, stationary = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
MODEL = "smollm2-135m"
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=5)
TOPICS = ["the weather", "cooking rice", "a trip to Paris", "learning to swim", "the moon",
          "a broken bicycle", "saving money", "planting tomatoes", "a job interview", "cats",
          "the history of bridges", "writing a poem", "a football match", "sleep", "coffee",
          "a birthday party", "electric cars", "the ocean", "a lost key", "chess"]
FORMS = ["Tell me something about {}.", "Write one sentence about {}.", "What do you think of {}?",
         "Give me a tip about {}.", "Describe {} in a few words.", "Why do people like {}?",
         "Explain {} to a child.", "What is interesting about {}?"]


def ask(args):
    seed, bias = args
    rng = random.Random(seed)
    prompt = rng.choice(FORMS).format(rng.choice(TOPICS))
    extra = {"logit_bias": bias} if bias else {}
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}],
        max_tokens=12, temperature=0.8, seed=seed, **extra)


def admin(path):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {admin_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def state():
    return next(v for v in admin("/admin/monitors")["monitors"] if v["model"] == MODEL)


def entropy_monitor(s):
    return next((o for o in s["outputs"] if o["feature"] == "output.entropy_mean"), None)


out = {}
seed = 0
with ThreadPoolExecutor(8) as pool:
    while True:
        list(pool.map(ask, [(seed + i, None) for i in range(100)]))
        seed += 100
        m = entropy_monitor(state())
        if m and m["baseline_mean"] is not None:
            break
    s = state()
    m = entropy_monitor(s)
    out["baseline"] = {"mean": m["baseline_mean"], "std": m["baseline_std"], "requests": seed}
    start_alarms, start_tests = m["alarms"], m["tests"]
    drift_start = s["drift"]["alarms"]
    list(pool.map(ask, [(seed + i, None) for i in range(stationary)]))
    seed += stationary
    s = state()
    m = entropy_monitor(s)
    out["stationary"] = {"requests": stationary, "entropy_alarms": m["alarms"] - start_alarms,
                         "entropy_tests": m["tests"] - start_tests,
                         "window_mean": m["window_mean"], "window_std": m["window_std"],
                         "drift_alarms": s["drift"]["alarms"] - drift_start,
                         "drift_features": {f["feature"]: f["alarms"] for f in s["drift"]["features"] if f["alarms"]}}
    # The collapse: one token (id 28) forced on every step by a strong logit bias.
    sent, delay = 0, None
    while sent < 300:
        list(pool.map(ask, [(seed + i, {"28": 100}) for i in range(10)]))
        seed += 10
        sent += 10
        m = entropy_monitor(state())
        if m["alarm"] is not None:
            delay = sent
            break
    out["collapse"] = {"delay_requests": delay, "alarm": m["alarm"], "window_mean": m["window_mean"]}
print(json.dumps(out, indent=1))
