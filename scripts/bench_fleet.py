"""The fleet's numbers (docs/perf.md, docs/fleet.md): how long the judge takes to roll a slower
candidate back with N replicas behind HAProxy against one, on the same client traffic, and how
long the judge's lease takes to move when its holder is killed with SIGKILL.

Each round: a fresh PostgreSQL database, N `rampart serve` replicas of SmolLM2 (1.0.0 the
stable, 1.1.0 the candidate, the same weights) on one repository with a short plan (30 % then
100 %, judged against the stable, latency ratio 1.5), HAProxy in front (round robin, health
checks on /health/ready), a fleet fault making 1.1.0 three times as slow, the release started
through the balancer and four client threads of the official `openai` client (tests/e2e/
fleet_load.py) until the judge rolls it back. The decision time is the rollback's time minus
the start's, from the fleet's history. With N > 1, an identical candidate is then released and
its judge killed: the failover time is from the kill until `GET /admin/fleet` names another.

Run by scripts/bench-fleet.sh (which finds the binary, Python and PostgreSQL).
"""
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

BIN, PYTHON, PG_BIN, HAPROXY = sys.argv[1:5]
ROUNDS = int(sys.argv[5]) if len(sys.argv) > 5 else 3
COUNTS = [int(n) for n in (sys.argv[6] if len(sys.argv) > 6 else "1,3").split(",")]
CACHE = os.environ.get("RAMPART_MODEL_CACHE", os.path.expanduser("~/.cache/rampart/models"))
MODEL = "smollm2-135m"
GGUF = os.path.join(CACHE, "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "sk-bench-admin"
KEY = "sk-bench-infer"
FEEDBACK = "sk-bench-feedback"
TICK_MS = 250


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def call(port, method, path, body=None, key=ADMIN):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    req.add_header("Authorization", "Bearer " + key)
    if data:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, parse(r.read())
    except urllib.error.HTTPError as e:
        return e.code, parse(e.read())
    except OSError:
        return 0, None


def parse(body):
    """JSON, or None (the balancer's own 503 page is HTML)."""
    try:
        return json.loads(body or b"null")
    except ValueError:
        return None


def wait(what, limit, check, every=0.05):
    began = time.time()
    while time.time() - began < limit:
        v = check()
        if v:
            return v
        time.sleep(every)
    raise SystemExit(f"bench-fleet: {what}: not within {limit} s")


def as_postgres(*args, **kw):
    cmd = list(args)
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--"] + cmd
    return subprocess.run(cmd, check=True, **kw)


def start_postgres(work):
    data = os.path.join(work, "pg")
    os.makedirs(data)
    if os.geteuid() == 0:
        shutil.chown(data, "postgres", "postgres")
        os.chmod(data, 0o700)
    as_postgres(os.path.join(PG_BIN, "initdb"), "-D", data + "/d", "-A", "trust", "-U", "postgres",
                stdout=subprocess.DEVNULL)
    port = free_port()
    as_postgres(os.path.join(PG_BIN, "pg_ctl"), "-D", data + "/d", "-l", data + "/log", "-o",
                f"-c listen_addresses=127.0.0.1 -p {port} -k {data} -c fsync=off", "start",
                stdout=subprocess.DEVNULL)
    return data + "/d", port


def one_round(work, pg_port, n, round_no):
    db = f"bench_{n}_{round_no}"
    subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(pg_port), "-U", "postgres", "-qc",
                    f"CREATE DATABASE {db}"], check=True)
    url = f"postgresql://postgres@127.0.0.1:{pg_port}/{db}"
    here = os.path.join(work, f"n{n}-r{round_no}")
    repo = os.path.join(here, "models")
    os.makedirs(here)
    for version in ["1.0.0", "1.1.0"]:
        subprocess.run([BIN, "model", "import", GGUF, "--repo", repo, "--name", MODEL,
                        "--version", version], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(repo, MODEL, "release.toml"), "w") as f:
        f.write('stable = "1.0.0"\n\n[routing]\ncontrol = false\n\n[schedule]\nsteps = [30.0, 100.0]\n'
                'min_step_secs = 3\nmin_samples = 10\n\n[judge]\nlatency_ratio = 1.5\n')
    keys = os.path.join(here, "keys.txt")
    with open(keys, "w") as f:
        f.write(f"ops:{ADMIN} admin infer\nbench:{KEY}\nagents:{FEEDBACK} feedback tenant=bench\n")
    replicas = []
    for i in range(1, n + 1):
        d = os.path.join(here, f"r{i}")
        os.makedirs(d)
        port = free_port()
        with open(os.path.join(d, "rampart.toml"), "w") as f:
            f.write(f'listen = "127.0.0.1:{port}"\nthreads = {max(1, 2 // n)}\ndrain_delay_s = 1\n'
                    f'[grpc]\nenabled = false\n[faults]\nenabled = true\n[releases]\ntick_ms = {TICK_MS}\n'
                    f'[fleet]\npostgres_url = "{url}"\nreplica = "r{i}"\n'
                    f'[feedback]\npostgres_url = "{url}"\n'
                    f'[[models]]\nname = "{MODEL}"\ncontext = 512\nkv_cache_memory = "64MiB"\n')
        proc = subprocess.Popen([BIN, "serve", "--repo", repo, "--config", "rampart.toml",
                                 "--api-keys", keys], cwd=d, stdout=open(os.path.join(d, "log"), "w"),
                                stderr=subprocess.STDOUT)
        replicas.append({"name": f"r{i}", "port": port, "proc": proc})
    lb = free_port()
    servers = "".join(f"  server {r['name']} 127.0.0.1:{r['port']} check\n" for r in replicas)
    cfg = os.path.join(here, "haproxy.cfg")
    with open(cfg, "w") as f:
        f.write("global\n  maxconn 512\ndefaults\n  mode http\n  timeout connect 2s\n  timeout client 300s\n"
                "  timeout server 300s\n  retries 2\n  option redispatch\n  retry-on conn-failure\n"
                f"frontend fleet\n  bind 127.0.0.1:{lb}\n  default_backend replicas\n"
                "backend replicas\n  balance roundrobin\n  option httpchk GET /health/ready\n"
                "  http-check expect status 200\n  default-server inter 250ms fall 2 rise 2\n" + servers)
    haproxy = subprocess.Popen([HAPROXY, "-db", "-f", cfg], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    out = {"replicas": n, "round": round_no}
    try:
        wait("the balancer is ready", 120, lambda: call(lb, "GET", "/health/ready")[0] == 200)
        wait("every replica in the fleet", 30,
             lambda: len((call(lb, "GET", "/admin/fleet")[1] or {}).get("replicas", [])) == n)
        status, body = call(lb, "POST", f"/admin/releases/{MODEL}/start", {"candidate": "1.1.0"})
        assert status == 200, body

        def serving():
            v = call(lb, "GET", "/admin/fleet")[1] or {}
            return all(f"{MODEL}@1.1.0" in r.get("serving", []) for r in v.get("replicas", []))
        wait("every replica serves 1.1.0", 120, serving)
        status, body = call(lb, "POST", "/admin/faults", {"backend": f"{MODEL}@1.1.0", "mode": "slow",
                                                           "factor": 3.0, "duration_s": 900,
                                                           "scope": "fleet"})
        assert status == 201, body

        def applied():
            return all(len(call(r["port"], "GET", "/admin/faults")[1] or []) == 1 for r in replicas)
        wait("every replica applies the fault", 20, applied)
        load = start_load(here, lb, "slow")
        r = wait("the rollback", 600, lambda: decided(lb), every=0.1)
        stop_load(load)
        history = r["plan"]["history"]
        start = [d for d in history if d["action"] == "start"][-1]
        rollback = [d for d in history if d["action"] == "rollback"][-1]
        out["decision_s"] = (rollback["time_ms"] - start["time_ms"]) / 1000
        out["samples_stable"] = rollback["samples_stable"]
        out["samples_candidate"] = rollback["samples_candidate"]
        out["metric"] = rollback.get("metric")
        if n > 1:
            call(lb, "DELETE", "/admin/faults")
            status, body = call(lb, "POST", f"/admin/releases/{MODEL}/start", {"candidate": "1.1.0"})
            assert status == 200, body
            load = start_load(here, lb, "same")
            wait("candidate samples", 120,
                 lambda: ((call(lb, "GET", f"/admin/releases/{MODEL}")[1] or {}).get("status", {})
                          .get("samples_candidate", 0) >= 3))
            judge = call(lb, "GET", "/admin/fleet")[1]["judge"]
            victim = next(r for r in replicas if r["name"] == judge)
            killed = time.time()
            victim["proc"].send_signal(signal.SIGKILL)
            victim["proc"].wait()

            def moved():
                v = call(lb, "GET", "/admin/fleet")[1] or {}
                return v.get("judge") not in (None, judge)
            wait("another judge", 60, moved, every=0.01)
            out["failover_s"] = time.time() - killed
            stop_load(load)
    finally:
        haproxy.kill()
        for r in replicas:
            if r["proc"].poll() is None:
                r["proc"].send_signal(signal.SIGKILL)
                r["proc"].wait()
    return out


def decided(lb):
    status, r = call(lb, "GET", f"/admin/releases/{MODEL}")
    if status == 200 and r["plan"]["state"]["phase"] in ("rolled_back", "promoted"):
        return r
    return None


def start_load(here, lb, tag):
    stop = os.path.join(here, f"stop-{tag}")
    env = dict(os.environ, RAMPART_URL=f"http://127.0.0.1:{lb}", RAMPART_KEY=KEY,
               RAMPART_FEEDBACK_KEY=FEEDBACK, RAMPART_MODEL=MODEL, FLEET_STOP=stop,
               FLEET_OUT=os.path.join(here, f"load-{tag}.json"), FLEET_THREADS="4",
               FLEET_RATE_EVERY="0", FLEET_TAG=tag)
    script = os.path.join(ROOT, "crates/rampart/tests/e2e/fleet_load.py")
    return subprocess.Popen([PYTHON, script], env=env, stdout=subprocess.DEVNULL), stop


def stop_load(load):
    proc, stop = load
    open(stop, "w").close()
    proc.wait()


def main():
    work = tempfile.mkdtemp(prefix="bench-fleet-")
    if os.geteuid() == 0:
        shutil.chown(work, "postgres", "postgres")
    data, pg_port = start_postgres(work)
    rows = []
    try:
        for round_no in range(1, ROUNDS + 1):
            for n in COUNTS:
                row = one_round(work, pg_port, n, round_no)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        as_postgres(os.path.join(PG_BIN, "pg_ctl"), "-D", data, "stop", "-m", "immediate",
                    stdout=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'replicas':>8} {'decision s (median)':>20} {'per round':>30} {'failover s (median)':>20}")
    for n in COUNTS:
        mine = [r for r in rows if r["replicas"] == n]
        d = [r["decision_s"] for r in mine]
        f = [r["failover_s"] for r in mine if "failover_s" in r]
        print(f"{n:>8} {statistics.median(d):>20.2f} {' '.join(f'{x:.1f}' for x in d):>30} "
              f"{(f'{statistics.median(f):.2f}' if f else '-'):>20}")


main()
