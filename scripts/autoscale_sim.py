#!/usr/bin/env python3
"""Which signal should scale Rampart? A simulation of the Kubernetes HPA on each candidate.

The replicas are LLM servers as Rampart runs them: a continuous batch of up to `slots` sequences
whose throughput grows with the batch and saturates (`capacity`, requests/s at a full batch), an
admission queue (`max_waiting`) beyond which requests are shed (429), a time to first token that
is the queue wait plus the prefill. New pods serve `startup_s` after the HPA asks for them (image
pull, `rampart doctor`, model load: the chart's startup probe).

The load is a replay of a two-hour request-rate trace (`--trace FILE`: one `seconds,rate` line
per second; the default is the built-in trace: a working-day ramp, a lunch dip, a burst at 3x
for five minutes and a fall-off), with Poisson arrivals.

The autoscaler is the HPA's own algorithm (autoscaling/v2, Kubernetes 1.27+): every 15 s the
metric's average over the ready pods is compared with the target, a ratio within the 10 %
tolerance changes nothing, otherwise `desired = ceil(ready * value / target)`; scale-up follows
the chart's policy (at most +100 % or +4 pods per 30 s, whichever is more), scale-down its
stabilisation window (the highest recommendation of the last 600 s) and at most one pod per
120 s. The metric is what prometheus-adapter serves (deploy/helm/rampart/files/
prometheus-adapter-rules.yaml): Prometheus scrapes every 15 s, rates and quantiles look at the
last minute.

Signals compared (each with the target the chart ships):
  concurrency  requests in a pod, running or waiting: rampart_requests_in_flight +
             rampart_queue_depth (averaged over 1 m), target 16 (Little's law: the load a pod
             carries times its latency; proportional to the load below saturation, which is
             what the HPA's ratio assumes)
  queue      waiting requests per pod, rampart_queue_depth + rampart_engine_waiting_sequences
             (averaged over 1 m), target 4
  shed       requests refused 429 per pod per second, rate(rampart_rejected_requests_total
             {reason=~"queue_full|shedding|queue_timeout"}[1m]), target 0.05
  ttft       p99 time to first token over the objective, histogram_quantile(0.99, rate(
             rampart_time_to_first_token_seconds_bucket[1m])) / objective, target 0.8
  cpu        CPU utilisation, the HPA's default (target 70 %): an engine pass keeps every
             compute thread busy whatever the batch, so a replica is near 100 % from its
             first running sequence on

Usage: scripts/autoscale_sim.py [--trace FILE] [--csv OUT.csv] [--svg OUT.svg] [--seed N]
Prints one row per signal: seconds over the TTFT objective, share shed, pod-hours, peak pods,
scale events; with --csv, the per-second pods and load of every signal (to plot).
"""

import argparse
import collections
import math
import random

TICK_S = 1.0
HPA_PERIOD_S = 15
SCRAPE_S = 15
TOLERANCE = 0.10
SCALE_DOWN_WINDOW_S = 600
SCALE_DOWN_PODS = 1  # per SCALE_DOWN_PERIOD_S
SCALE_DOWN_PERIOD_S = 120
SCALE_UP_PERIOD_S = 30  # at most +100 % or +4 pods, the larger, per period
MIN_PODS, MAX_PODS = 2, 20

# One replica (2 cores, SmolLM2-135M Q4_1, ~64-token answers; docs/perf.md measured 8 req/s
# carried and 20 req/s not): `capacity` at a full batch, half of it at a batch of `half_batch`.
CAPACITY = 10.0
HALF_BATCH = 4.0
SLOTS = 64  # [admission] max_in_flight
MAX_WAITING = 128  # [admission] max_waiting
PREFILL_S = 0.15
TTFT_OBJECTIVE_S = 2.0
STARTUP_S = 45.0


def builtin_trace(seconds=7200):
    """Requests/s per second: ramp, plateau, lunch dip, burst, fall-off."""
    rates = []
    for t in range(seconds):
        m = t / 60.0
        if m < 20:
            r = 4 + 26 * (m / 20)  # the working day starts: 4 -> 30 req/s
        elif m < 50:
            r = 30 + 4 * math.sin(m / 3)
        elif m < 60:
            r = 30 - 14 * (m - 50) / 10  # lunch
        elif m < 75:
            r = 16 + 14 * (m - 60) / 15
        elif m < 80:
            r = 90  # a batch job starts: 3x for five minutes
        elif m < 100:
            r = 30 + 3 * math.sin(m / 2)
        else:
            r = max(3.0, 30 - 27 * (m - 100) / 20)  # the day ends
        rates.append(r)
    return rates


def read_trace(path):
    rates = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                rates.append(float(line.split(",")[1]))
    return rates


class Pod:
    def __init__(self, ready_at):
        self.ready_at = ready_at
        self.running = 0.0  # sequences in the batch
        self.waiting = 0.0  # admitted, waiting for a slot
        self.shed = 0.0
        self.ttfts = collections.deque()  # (time, ttft) of the last minute's first tokens

    def ready(self, now):
        return now >= self.ready_at

    def step(self, now, arrivals):
        room = SLOTS + MAX_WAITING - self.running - self.waiting
        admitted = min(arrivals, max(0.0, room))
        self.shed += arrivals - admitted
        self.waiting += admitted
        # Throughput grows with the batch and saturates.
        batch = self.running
        throughput = CAPACITY * batch / (batch + HALF_BATCH) if batch > 0 else 0.0
        done = min(self.running, throughput * TICK_S)
        self.running -= done
        moved = min(self.waiting, SLOTS - self.running)
        self.running += moved
        self.waiting -= moved
        # A request's first token comes after the queue ahead of it drains, then its prefill.
        drain = CAPACITY * (self.running / (self.running + HALF_BATCH)) if self.running else CAPACITY
        ttft = PREFILL_S + self.waiting / max(drain, 1e-9) + (self.running / SLOTS) * 0.2
        if admitted > 0:
            self.ttfts.append((now, ttft))
        while self.ttfts and self.ttfts[0][0] < now - 60:
            self.ttfts.popleft()
        return ttft, arrivals - admitted


def signal_value(kind, pods, now, history):
    """The metric prometheus-adapter serves now: the average over the ready pods, as scraped."""
    ready = [p for p in pods if p.ready(now)]
    if not ready:
        return None
    if kind == "concurrency":
        samples = [v for (t, v) in history["concurrency"] if t >= now - 60]
        return sum(samples) / len(samples) if samples else 0.0
    if kind == "queue":
        # avg_over_time over 1 m of the scraped gauge
        samples = [v for (t, v) in history["queue"] if t >= now - 60]
        return sum(samples) / len(samples) if samples else 0.0
    if kind == "shed":
        samples = [(t, v) for (t, v) in history["shed"] if t >= now - 60]
        if len(samples) < 2:
            return 0.0
        return (samples[-1][1] - samples[0][1]) / max(samples[-1][0] - samples[0][0], 1) / len(ready)
    if kind == "ttft":
        values = sorted(v for p in ready for (t, v) in p.ttfts)
        if not values:
            return 0.0
        return values[min(len(values) - 1, int(0.99 * len(values)))] / TTFT_OBJECTIVE_S
    if kind == "cpu":
        return sum(1.0 if (p.running + p.waiting) > 0.5 else 0.1 for p in ready) / len(ready)
    raise ValueError(kind)


TARGETS = {"concurrency": 16.0, "queue": 4.0, "shed": 0.05, "ttft": 0.8, "cpu": 0.7}


def simulate(kind, rates, seed):
    rng = random.Random(seed)
    pods = [Pod(0.0) for _ in range(MIN_PODS)]
    history = {k: collections.deque() for k in ("concurrency", "queue", "shed")}
    recommendations = collections.deque()
    last_down = -1e9
    ups = collections.deque()  # (time, pods before) of the scale-ups in the last period
    shed_total = over_objective_s = arrivals_total = pod_seconds = 0.0
    events = 0
    series = []
    for second, rate in enumerate(rates):
        now = float(second)
        ready = [p for p in pods if p.ready(now)]
        arrivals = poisson(rng, rate)
        arrivals_total += arrivals
        ttft_worst = 0.0
        for i, p in enumerate(ready):
            share = arrivals // len(ready) + (1 if i < arrivals % len(ready) else 0)
            ttft, shed = p.step(now, share)
            shed_total += shed
            ttft_worst = max(ttft_worst, ttft)
        if ttft_worst > TTFT_OBJECTIVE_S:
            over_objective_s += 1
        pod_seconds += len(pods)
        if second % SCRAPE_S == 0 and ready:
            history["queue"].append((now, sum(p.waiting for p in ready) / len(ready)))
            history["concurrency"].append(
                (now, sum(p.running + p.waiting for p in ready) / len(ready))
            )
            history["shed"].append((now, sum(p.shed for p in pods)))
            for h in history.values():
                while h and h[0][0] < now - 120:
                    h.popleft()
        if second % HPA_PERIOD_S == 0 and second > 0:
            current = len(pods)
            n_ready = len(ready)
            # With several metrics the HPA takes the largest of their proposals.
            proposals = []
            for part in kind.split("+"):
                value = signal_value(part, pods, now, history)
                if value is None:
                    continue
                ratio = value / TARGETS[part]
                if abs(ratio - 1.0) <= TOLERANCE:
                    proposals.append(current)
                elif ratio > 1:
                    # Pods still starting count as they are when scaling up (no double ask).
                    proposals.append(max(math.ceil(n_ready * ratio), current))
                else:
                    proposals.append(math.ceil(n_ready * ratio))
            desired = max(proposals) if proposals else current
            desired = max(MIN_PODS, min(MAX_PODS, desired))
            recommendations.append((now, desired))
            while recommendations and recommendations[0][0] < now - SCALE_DOWN_WINDOW_S:
                recommendations.popleft()
            while ups and ups[0][0] <= now - SCALE_UP_PERIOD_S:
                ups.popleft()
            if desired > current:
                # The policy counts from the pods at the start of the period.
                base = ups[0][1] if ups else current
                new = min(desired, base + max(base, 4))
                if new > current:
                    ups.append((now, current) if not ups else (now, ups[0][1]))
                    pods.extend(Pod(now + STARTUP_S) for _ in range(new - current))
                    events += 1
            else:
                stabilised = max(d for (_, d) in recommendations)
                if stabilised < current and now - last_down >= SCALE_DOWN_PERIOD_S:
                    drop = min(SCALE_DOWN_PODS, current - stabilised)
                    # The newest pods go first (the ReplicaSet's choice: not ready, then youngest);
                    # a drained pod finishes its backlog before it leaves (the chart's grace), so
                    # nothing of it is shed.
                    pods.sort(key=lambda p: p.ready_at)
                    del pods[-drop:]
                    last_down = now
                    events += 1
        series.append((second, rate, len(pods), len([p for p in pods if p.ready(now)])))
    return {
        "over_objective_s": over_objective_s,
        "shed_pct": 100.0 * shed_total / max(arrivals_total, 1),
        "pod_hours": pod_seconds / 3600.0,
        "peak_pods": max(s[2] for s in series),
        "events": events,
        "series": series,
    }


def poisson(rng, lam):
    if lam <= 0:
        return 0
    if lam > 50:
        return max(0, int(round(rng.gauss(lam, math.sqrt(lam)))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace")
    ap.add_argument("--csv")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--svg", help="plot the load and each signal's pods (SVG, no dependency)")
    args = ap.parse_args()
    rates = read_trace(args.trace) if args.trace else builtin_trace()
    # The fewest pods that carry the trace at the TTFT objective, second by second (an oracle
    # that knows the load in advance and starts no pod late): the floor for pod-hours.
    per_pod = CAPACITY * 0.8
    oracle = sum(max(MIN_PODS, math.ceil(r / per_pod)) for r in rates) / 3600.0
    print(f"trace: {len(rates)} s, mean {sum(rates) / len(rates):.1f} req/s, peak {max(rates):.0f} req/s; "
          f"one pod carries {CAPACITY:.0f} req/s at a full batch, starts in {STARTUP_S:.0f} s; "
          f"TTFT objective {TTFT_OBJECTIVE_S:.1f} s; an oracle needs {oracle:.1f} pod-hours")
    print(f"{'signal':<17} {'target':>7} {'s over TTFT obj.':>17} {'shed %':>7} {'pod-hours':>10} {'peak pods':>10} {'scale events':>13}")
    results = {}
    for kind in ("concurrency", "concurrency+ttft", "queue", "shed", "ttft", "cpu"):
        r = simulate(kind, rates, args.seed)
        results[kind] = r
        target = "+".join(f"{TARGETS[k]:g}" for k in kind.split("+"))
        print(f"{kind:<17} {target:>7} {r['over_objective_s']:>17.0f} {r['shed_pct']:>7.2f} "
              f"{r['pod_hours']:>10.1f} {r['peak_pods']:>10} {r['events']:>13}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("second,rate," + ",".join(f"{k}_pods,{k}_ready" for k in results) + "\n")
            for i in range(len(rates)):
                row = [str(i), f"{rates[i]:.2f}"]
                for k in results:
                    s = results[k]["series"][i]
                    row += [str(s[2]), str(s[3])]
                f.write(",".join(row) + "\n")
    if args.svg:
        write_svg(args.svg, rates, results, per_pod)


def write_svg(path, rates, results, per_pod):
    """Pods over time per signal, with the pods the load needs (rate / what a pod carries)."""
    w, h, left, bottom = 900, 360, 50, 30
    # Pods (y) over minutes (x); the legend names the signal each line's HPA scaled on.
    n = len(rates)
    top_pods = MAX_PODS + 1
    x = lambda i: left + (w - left - 10) * i / max(n - 1, 1)
    y = lambda v: h - bottom - (h - bottom - 10) * min(v, top_pods) / top_pods
    def line(values, colour, width=1.5, dash=""):
        step = max(1, n // 900)
        points = " ".join(f"{x(i):.1f},{y(values[i]):.1f}" for i in range(0, n, step))
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline fill="none" stroke="{colour}" stroke-width="{width}"{extra} points="{points}"/>'
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{w}" height="{h}" fill="white"/>']
    for v in range(0, top_pods + 1, 5):
        parts.append(f'<line x1="{left}" x2="{w - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
    for m in range(0, n // 60 + 1, 15):
        anchor = "end" if m * 60 >= n - 60 else "middle"
        parts.append(f'<text x="{x(m * 60):.1f}" y="{h - 10}" text-anchor="{anchor}">{m} min</text>')
    needed = [max(MIN_PODS, math.ceil(r / per_pod)) for r in rates]
    parts.append(line(needed, "#999", 1, "4 3"))
    colours = {"concurrency": "#1b7837", "queue": "#2166ac", "ttft": "#b2182b", "cpu": "#e08214", "shed": "#762a83"}
    legend = [("pods needed", "#999")]
    for kind, colour in colours.items():
        if kind in results:
            parts.append(line([s[2] for s in results[kind]["series"]], colour))
            legend.append((f"HPA on {kind}", colour))
    for i, (label, colour) in enumerate(legend):
        parts.append(f'<rect x="{left + 10 + i * 135}" y="14" width="12" height="3" fill="{colour}"/>'
                     f'<text x="{left + 26 + i * 135}" y="19">{label}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
