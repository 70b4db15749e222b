"""The reasons' deletion check over a ticket set: each ticket classified by a running server
(guided_choice over the labels, greedy) with `explain: {"reasons": {}}`; checks that every reason
is a verbatim span of the ticket and reports, averaged over the tickets, how much the answer's
log-probability drops without its three reasons and without three random spans of the same
lengths.

    python3 scripts/eval_reasons.py --url http://127.0.0.1:8080 --model smollm2-135m \
        --tickets examples/rules/tickets.jsonl [--key KEY] [--out results.jsonl]
"""

import argparse
import json
import math
import statistics
import time
import urllib.request

LABELS = ["logistics", "quality", "refund", "invoice", "service"]
SYSTEM = (
    "You sort customer support tickets. Answer with one word: logistics (delivery, shipping), "
    "quality (broken or faulty goods), refund (money back), invoice (billing documents) or "
    "service (how staff or support treated the customer)."
)


def ask(url, key, model, text):
    body = json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": text},
            ],
            "guided_choice": LABELS,
            "temperature": 0,
            "seed": 1,
            "explain": {"reasons": {}},
        }
    ).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    began = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    return answer, time.monotonic() - began


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tickets", required=True)
    p.add_argument("--key", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tickets = [json.loads(line) for line in open(a.tickets, encoding="utf-8") if line.strip()]
    rows = []
    for t in tickets:
        answer, seconds = ask(a.url, a.key, a.model, t["text"])
        choice = answer["choices"][0]
        r = choice["explain"]["reasons"]
        raw = t["text"].encode("utf-8")
        verbatim = all(
            raw[x["start"] : x["end"]].decode("utf-8") == x["text"] for x in r["reasons"]
        )
        d = r["deletion"]
        lp = math.log(max(d["probability"], 1e-300))
        rows.append(
            {
                "id": t["id"],
                "label": t["label"],
                "answer": choice["message"]["content"],
                "segments": r["segments"],
                "reasons": len(r["reasons"]),
                "verbatim": verbatim,
                "drop_reasons": lp - math.log(max(d["without_reasons"], 1e-300)),
                "drop_random": lp - math.log(max(d["without_random"], 1e-300)),
                "p": d["probability"],
                "p_without_reasons": d["without_reasons"],
                "p_without_random": d["without_random"],
                "seconds": seconds,
            }
        )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    n = len(rows)
    summary = {
        "tickets": n,
        "accuracy": sum(r["answer"] == r["label"] for r in rows) / n,
        "all_verbatim": all(r["verbatim"] for r in rows),
        "three_reasons": sum(r["reasons"] == 3 for r in rows),
        "mean_drop_reasons_nats": statistics.mean(r["drop_reasons"] for r in rows),
        "mean_drop_random_nats": statistics.mean(r["drop_random"] for r in rows),
        "mean_p_drop_reasons": statistics.mean(r["p"] - r["p_without_reasons"] for r in rows),
        "mean_p_drop_random": statistics.mean(r["p"] - r["p_without_random"] for r in rows),
        "reasons_beat_random": sum(r["drop_reasons"] > r["drop_random"] for r in rows) / n,
        "mean_segments": statistics.mean(r["segments"] for r in rows),
        "median_seconds": statistics.median(r["seconds"] for r in rows),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
