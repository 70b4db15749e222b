#!/usr/bin/env python3
"""Closed-loop load on an OpenAI-compatible server with the official `openai` client.

Each of CLIENTS clients sends streaming completions one after another for DURATION seconds:
prompts of 50-400 words drawn from a fixed list (about one token per word), seeded, and
MAX_TOKENS output tokens with ignore_eos. A refused request (429) is retried after its
Retry-After (capped at --retry-cap seconds), as a polite client would.

With --long-clients M, M more clients send near-context prompts (--long-words) all the time
(the 28-page-document case); their numbers are reported apart ("long") and the others' ITL
shows whether the normal streams kept their pace.

Prints one JSON object: the admitted requests' TTFT and inter-token latency percentiles, the
output tokens per second over the run, the refusals (how many, how fast they came back, whether
they carried Retry-After) and any other errors.

With --official-retries N the client is the official one as users run it: it retries a 429 by
itself, up to N times, with the same request (openai-python waits `retry-after-ms`, else
`Retry-After` when at most 60 s, else its own backoff), and the numbers are the user's: TTFT
counted from the first attempt ("user_ttft_ms"), beside the admitted attempt's own ("ttft_ms"),
the attempts each request took, and the requests that never succeeded ("gave_up").

    python3 scripts/bench_slo.py --url http://127.0.0.1:8080/v1 --model smollm2-135m \
        --clients 48 --duration 120 --seed 1
"""
import argparse
import asyncio
import json
import random
import time

import openai

WORDS = (
    "the of and to in is was for on that with as by at from his her they this have are had "
    "not but be one all were which their an there been has more when will would who so no "
    "out up into about than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before "
    "must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    rank = max(1, min(len(values), int(-(-len(values) * p // 100))))
    return values[rank - 1]


def by_words(samples, args):
    span = max(1, args.max_words - args.min_words + 1)
    bins = {}
    for words, ttft in samples:
        q = min(3, (words - args.min_words) * 4 // span)
        lo = args.min_words + q * span // 4
        hi = args.min_words + (q + 1) * span // 4 - 1
        bins.setdefault(f"{lo}-{hi}", []).append(ttft)
    return {k: {"n": len(v), "p99": round(percentile(v, 99) * 1000, 1)}
            for k, v in sorted(bins.items(), key=lambda kv: int(kv[0].split("-")[0]))}


def official_client(args):
    """One client of its own (its hooks see only its own requests): the official retries, and
    the time each attempt was sent."""
    try:  # the HTTP client the installed openai package is built on
        import httpx2 as httpx
    except ImportError:
        import httpx

    sent = []
    refused = []

    async def on_request(request):
        sent.append(time.monotonic())

    async def on_response(response):
        if response.status_code == 429:
            refused.append(response.headers.get("retry-after-ms") or response.headers.get("retry-after"))

    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=4),
                             event_hooks={"request": [on_request], "response": [on_response]})
    client = openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key,
                                max_retries=args.official_retries, timeout=600, http_client=http)
    return client, sent, refused


async def client_loop(client, args, rng, deadline, out, long=False, counted_from=None, warm=None):
    """Requests until `deadline`; those that start before `counted_from` go to `warm`."""
    sent = refused = None
    if args.official_retries is not None:
        client, sent, refused = official_client(args)
    while time.monotonic() < deadline:
        words = args.long_words if long else rng.randint(args.min_words, args.max_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        start = time.monotonic()
        tally = warm if counted_from is not None and start < counted_from else out
        if sent is not None:
            sent.clear()
            refused.clear()
        first = None
        last = None
        gaps = []
        tokens = 0
        try:
            stream = await client.completions.create(
                model=args.model,
                prompt=prompt,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.monotonic()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                tokens += 1
            end = time.monotonic()
            if first is not None and end <= deadline + args.grace:
                # The admitted attempt's own TTFT; the user's counts from the first attempt.
                admitted_at = sent[-1] if sent else start
                tally["ttft"].append(first - admitted_at)
                tally["user_ttft"].append(first - start)
                tally["attempts"].append(len(sent) if sent else 1)
                tally["refused"] += len(refused) if refused else 0
                tally["ttft_words"].append((words, first - admitted_at))
                if sent:
                    tally["trace"].append({"words": words, "start": round(start, 3),
                                         "user_ttft": round(first - start, 3),
                                         "ttft": round(first - admitted_at, 3),
                                         "sent": [round(t - start, 3) for t in sent],
                                         "waits": list(refused)})
                tally["itl"].extend(gaps)
                tally["tokens"] += tokens
                tally["done"] += 1
        except openai.RateLimitError as e:
            if sent is not None:
                # The official client gave up after its retries.
                if time.monotonic() <= deadline + args.grace:
                    tally["gave_up"] += 1
                    tally["refused"] += len(refused)
                continue
            took = time.monotonic() - start
            retry = e.response.headers.get("retry-after")
            tally["refused"] += 1
            tally["refusal_seconds"].append(took)
            tally["with_retry_after"] += retry is not None
            pause = min(float(retry or 1), args.retry_cap)
            await asyncio.sleep(pause)
        except Exception as e:  # noqa: BLE001 - every other failure is counted by kind
            key = type(e).__name__
            tally["errors"][key] = tally["errors"].get(key, 0) + 1
            await asyncio.sleep(0.1)


async def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default="none")
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--duration", type=float, default=120)
    p.add_argument("--warmup", type=float, default=10, help="seconds of load not counted")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-words", type=int, default=50)
    p.add_argument("--max-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--retry-cap", type=float, default=1.0)
    p.add_argument("--grace", type=float, default=0.0)
    p.add_argument("--long-clients", type=int, default=0)
    p.add_argument("--long-words", type=int, default=3500)
    p.add_argument("--official-retries", type=int, default=None,
                   help="let the official client retry 429s itself, up to N times (user TTFT)")
    p.add_argument("--drain-warmup", action="store_true",
                   help="finish the warm-up before the counted clients start (they then all "
                        "start at once: a burst of CLIENTS on an idle server)")
    p.add_argument("--trace", default=None,
                   help="write each answered request's attempts (JSON lines) to this file")
    args = p.parse_args()
    client = openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    def tally():
        return {"ttft": [], "itl": [], "tokens": 0, "done": 0, "refused": 0,
                "refusal_seconds": [], "with_retry_after": 0, "errors": {}, "ttft_words": [],
                "user_ttft": [], "attempts": [], "gave_up": 0, "trace": []}
    warm, out, long_out = tally(), tally(), tally()
    if args.drain_warmup:
        # The old way: every warm-up request finishes before the counted clients start, so
        # the counted window opens with all CLIENTS arriving at once on an idle server.
        if args.warmup > 0:
            deadline = time.monotonic() + args.warmup
            await asyncio.gather(*(client_loop(client, args,
                                               random.Random(args.seed * 1000 + 500 + i),
                                               deadline, warm) for i in range(args.clients)))
        counted_from = None
        start = time.monotonic()
    else:
        # The clients run through the warm-up into the counted window: requests that start
        # after the warm-up are counted (steady state, no synchronized start).
        start = time.monotonic() + args.warmup
        counted_from = start
    deadline = start + args.duration
    await asyncio.gather(
        *(client_loop(client, args, random.Random(args.seed * 1000 + i), deadline, out,
                      counted_from=counted_from, warm=warm)
          for i in range(args.clients)),
        *(client_loop(client, args, random.Random(args.seed * 1000 + 900 + i), deadline, long_out,
                      long=True, counted_from=counted_from, warm=warm)
          for i in range(args.long_clients)))
    elapsed = time.monotonic() - start
    if args.trace:
        # One line per answered request: its attempts (sent, seconds after the first) and the
        # waits the server asked for, to see what the tail is made of.
        with open(args.trace, "w") as f:
            for t in sorted(out["trace"], key=lambda t: t["start"]):
                f.write(json.dumps(t) + "\n")
    ms = lambda v: None if v is None else round(v * 1000, 1)
    print(json.dumps({
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "completed": out["done"],
        "output_tokens_per_second": round(out["tokens"] / elapsed, 1),
        "ttft_ms": {"p50": ms(percentile(out["ttft"], 50)), "p90": ms(percentile(out["ttft"], 90)),
                     "p99": ms(percentile(out["ttft"], 99)),
                     "max": ms(max(out["ttft"]) if out["ttft"] else None)},
        # The admitted requests' TTFT p99 by prompt length (quarters of the word range): a
        # first-token gate that predicts in arrival order but reads in fair-queueing order
        # misjudges the long ones.
        "ttft_ms_p99_by_words": by_words(out["ttft_words"], args),
        "itl_ms": {"p50": ms(percentile(out["itl"], 50)), "p99": ms(percentile(out["itl"], 99))},
        "refused": out["refused"],
        "refused_with_retry_after": out["with_retry_after"],
        "refusal_ms": {"p50": ms(percentile(out["refusal_seconds"], 50)),
                        "p99": ms(percentile(out["refusal_seconds"], 99))},
        "errors": out["errors"],
        "mean_prompt_words": (args.min_words + args.max_words) / 2,
        "long": None if not args.long_clients else {
            "clients": args.long_clients, "words": args.long_words, "completed": long_out["done"],
            "ttft_ms_max": ms(max(long_out["ttft"]) if long_out["ttft"] else None),
            "refused": long_out["refused"], "errors": long_out["errors"]},
        "itl_ms_max": ms(max(out["itl"]) if out["itl"] else None),
        "official_retries": args.official_retries,
        "user_ttft_ms": None if args.official_retries is None else {
            "p50": ms(percentile(out["user_ttft"], 50)), "p90": ms(percentile(out["user_ttft"], 90)),
            "p99": ms(percentile(out["user_ttft"], 99)),
            "max": ms(max(out["user_ttft"]) if out["user_ttft"] else None)},
        "gave_up": out["gave_up"],
        "gave_up_share": round(out["gave_up"] / max(1, out["gave_up"] + out["done"]), 4),
        "attempts": None if not out["attempts"] else {
            "mean": round(sum(out["attempts"]) / len(out["attempts"]), 2),
            "p99": percentile(out["attempts"], 99), "max": max(out["attempts"])},
    }))


if __name__ == "__main__":
    asyncio.run(main())
