#!/usr/bin/env python3
"""Time to roll back a worse candidate on the real server (docs/perf.md, "Releases").

Drives a running `rampart serve` whose repository holds MODEL at two versions: starts a release
of the candidate (default schedule unless --steps), makes the candidate worse with a fault drill
(`slow` by --factor, or `fail_fraction`), sends chat requests from many users at --rate requests
per second (open loop, --clients threads), and reports when the controller rolled it back: the
seconds from the start, the step's weight, the candidate and stable samples, the metric and its
e-value. With --factor 1 and no errors it measures an identical candidate (A/A): the phase it
reached in --limit seconds.

usage: bench_release.py URL ADMIN_KEY INFER_KEY MODEL CANDIDATE [--factor F] [--fraction P]
                        [--rate R] [--clients N] [--limit S] [--max-tokens T]
"""

import argparse
import sys
import os
import json
import threading
import time
import urllib.error
import urllib.request


def call(url, key, method="GET", body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("admin_key")
    p.add_argument("infer_key")
    p.add_argument("model")
    p.add_argument("candidate")
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--fraction", type=float, default=0.0)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--limit", type=float, default=180.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--images", help="a folder of images: KServe v2 requests to a tensor model instead of chats")
    a = p.parse_args()
    base = a.url.rstrip("/")

    status, body = call(f"{base}/admin/releases/{a.model}/start", a.admin_key, "POST", {"candidate": a.candidate})
    if status != 200:
        raise SystemExit(f"start: {status}: {body}")
    started = time.time()
    backend = f"{a.model}@{a.candidate}"
    if a.factor > 1.0:
        call(f"{base}/admin/faults", a.admin_key, "POST",
             {"backend": backend, "mode": "slow", "factor": a.factor, "duration_s": a.limit + 60})
    if a.fraction > 0.0:
        call(f"{base}/admin/faults", a.admin_key, "POST",
             {"backend": backend, "mode": "fail_fraction", "fraction": a.fraction, "duration_s": a.limit + 60})

    images = []
    if a.images:
        import os

        import numpy as np
        import tritonclient.http as httpclient

        for name in sorted(os.listdir(a.images)):
            with open(os.path.join(a.images, name), "rb") as f:
                images.append(f.read())
        host = base.split("://", 1)[-1]
        local = threading.local()

        def infer(n, user):
            if not hasattr(local, "client"):
                local.client = httpclient.InferenceServerClient(url=host, network_timeout=120)
            inp = httpclient.InferInput("x", [1], "BYTES")
            inp.set_data_from_numpy(np.array([images[n % len(images)]], dtype=np.object_))
            try:
                local.client.infer(a.model, [inp], headers={"Authorization": f"Bearer {a.infer_key}", "x-user-id": user})
            except Exception:
                pass  # an error is the judge's to count

    stop = threading.Event()
    sent = [0]
    lock = threading.Lock()

    def client(c):
        i = 0
        while not stop.is_set():
            with lock:
                n = sent[0]
                sent[0] += 1
            due = started + n / a.rate
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            if stop.is_set():
                break
            i += 1
            if images:
                infer(n, f"user-{c}-{i}")
                continue
            body = {"model": a.model, "max_tokens": a.max_tokens, "temperature": 0, "user": f"user-{c}-{i}",
                    "messages": [{"role": "user", "content": f"Say a word about the number {n}."}]}
            call(f"{base}/v1/chat/completions", a.infer_key, "POST", body)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(a.clients)]
    for t in threads:
        t.start()
    result = None
    while time.time() - started < a.limit:
        _, r = call(f"{base}/admin/releases/{a.model}", a.admin_key)
        phase = r["status"]["phase"]
        if phase in ("rolled_back", "promoted"):
            result = r
            break
        time.sleep(0.25)
    took = time.time() - started
    stop.set()
    if result is None:
        _, result = call(f"{base}/admin/releases/{a.model}", a.admin_key)
    s = result["status"]
    last = (result["plan"].get("history") or [{}])[-1]
    print(json.dumps({
        "factor": a.factor, "fraction": a.fraction, "rate": a.rate, "clients": a.clients,
        "phase": s["phase"], "seconds": round(took, 1), "step_weight": last.get("from_weight"),
        "metric": last.get("metric"), "statistic": last.get("statistic"), "e_value": last.get("e_value"),
        "samples_stable": last.get("samples_stable", s["samples_stable"]),
        "samples_candidate": last.get("samples_candidate", s["samples_candidate"]),
        "reference": s.get("reference"),
        "samples_control": ((s.get("last_verdict") or {}).get("summary") or {}).get("samples_control"),
        "reason": last.get("reason"),
        "judge": [[m["metric"], m["test"], round(m["stable"] or 0, 2), round(m["candidate"] or 0, 2), round(m["statistic"], 3),
                   round(m["e_value"], 3)]
                  for m in (((s.get("last_verdict") or {}).get("summary") or {}).get("metrics") or [])],
    }))
    call(f"{base}/admin/faults", a.admin_key, "DELETE")
    if s["phase"] not in ("rolled_back", "promoted"):
        call(f"{base}/admin/releases/{a.model}/rollback", a.admin_key, "POST", {"reason": "bench over"})


if __name__ == "__main__":
    main()
    # (The KServe client's connections, closed by the interpreter's exit under gevent, abort it.)
    sys.stdout.flush()
    os._exit(0)
