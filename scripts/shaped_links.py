#!/usr/bin/env python3
"""Real shaped links for `laga compare` and `laga plan` (issue 13,
docs/planning.md, "Real shaped links").

  python3 scripts/shaped_links.py [--laga build/laga] [--rates MBIT,...] [--steps N]
                                  [--quick] [--json OUT] [-- laga model options, e.g. --preset small --seq 1024]

Two MPI ranks, each one process on its own core, talk over TCP through the
loopback of a network namespace this script creates, rate-limited with
`tc tbf`: every byte between them queues in one token bucket of RATE Mbit/s.
mpirun itself runs inside the namespace, so its control traffic (PMIx)
never leaves it. At each rate it sets side by side, per form:

  shaped    `laga compare --comm mpi` over the shaped loopback (measured);
  model     `laga compare --link` with ranks as threads (the link model, measured);
  predicted `laga plan --profile FILE --link` (FILE measured once by `laga plan --measure`);
  comm      the time in collectives per step: shaped (measured, MPI over the
            bucket) beside the plan's exposed collective time: the one check
            of the link model's communication whose measured side does not
            run the link model (check_plan.py's comm split is circular).

It fails unless the traffic crossed the shaped queue: the bucket's byte
counter (tc -s) must hold at least the bytes both ranks' ledgers sent, and
at the lowest rate every form's fastest step must take at least half of
what the link model says its collectives take (load only adds time, so a
busy machine cannot fail it).

The loopback is one queue for both directions, and at P 2 every collective
sends the same bytes each way at once, so each direction gets half the
rate: the link model and the plan run at RATE / 2 per direction. tbf shapes
rate only; added latency needs netem, which this script detects and names
when absent; the links' latency is then the plan's measured one.

Needs root (network namespaces), ip, tc with tbf and mpirun; anything
missing is named and the script exits 77 ("skipped"). Only the namespace it
creates carries traffic; it is removed however the script ends (including
SIGINT/SIGTERM), and every run is bounded by a timeout. --quick: two rates
and a tiny model, for the test suite (tests/tools/CMakeLists.txt).
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

SKIP = 77
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--laga", default="build/laga")
ap.add_argument("--rates", default="", help="Mbit/s of the shaped loopback, comma-separated")
ap.add_argument("--steps", type=int, default=7)
ap.add_argument("--forms", default="explicit,laga,absorbed")
ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
ap.add_argument("--quick", action="store_true")
ap.add_argument("--json", default="", help="also write the table to this JSON file")
ap.add_argument("model", nargs="*", help="laga model options (after --)")
args = ap.parse_args()
model = args.model or (["--preset", "tiny", "--seq", "256"] if args.quick
                       else ["--preset", "small", "--seq", "1024"])
rates = [float(r) for r in args.rates.split(",")] if args.rates else (
    [100, 1600] if args.quick else [200, 800, 3200, 12800])
if args.json and os.path.lexists(args.json) and not os.path.isfile(args.json):
    sys.exit(f"shaped_links: --json {args.json} exists and is not a regular file; name a file")
if any(not r > 0 for r in rates):
    sys.exit(f"shaped_links: --rates {args.rates}: every rate must be a positive Mbit/s")
ns = f"laga_shaped_{os.getpid()}"
tmp = tempfile.mkdtemp(prefix="laga_shaped_")
made_ns = False


def cleanup():
    if made_ns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(tmp, ignore_errors=True)


atexit.register(cleanup)
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: sys.exit(130))


def skip(why):
    print(f"shaped_links: skipped: {why}")
    sys.exit(SKIP)


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


if os.geteuid() != 0:
    skip("needs root to create a network namespace")
for tool in ("ip", "tc", "mpirun"):
    if not shutil.which(tool):
        skip(f"{tool} is not installed")
if not os.access(args.laga, os.X_OK):
    skip(f"{args.laga} is not built (cmake --build build)")
if sh(["ip", "netns", "add", ns]).returncode != 0:
    skip("cannot create a network namespace (ip netns add)")
made_ns = True
inside = ["ip", "netns", "exec", ns]
# A 9000-byte MTU lets the bucket be small (it must hold one packet): a
# collective then gets at most 16 KB at line rate before the rate holds.
for cmd in (["ip", "-n", ns, "link", "set", "lo", "mtu", "9000"],
            ["ip", "-n", ns, "link", "set", "lo", "up"]):
    if sh(cmd).returncode != 0:
        skip(f"cannot set up the namespace's loopback ({' '.join(cmd)})")
netem = sh(inside + ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"]
           ).returncode == 0
if netem:
    sh(inside + ["tc", "qdisc", "del", "dev", "lo", "root"])
if sh(inside + ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1000mbit",
                "burst", "16kb", "latency", "1s"]).returncode != 0:
    skip("tc tbf is not available in this kernel")
print("shaped_links: netem " + ("is available (not used: tbf alone shapes the rate)" if netem
                                else "is absent in this kernel: rate shaping only (tbf), no added latency"))
cpu = sh(["lscpu"]).stdout
cpu = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
print(f"shaped_links: CPU {cpu}; P 2, one process (MPI) or thread (link model) per core; "
      f"model {' '.join(model)}")

common = ["--sp", "2", "--forms", args.forms, "--quiet"] + model


def laga(cmd, out, prefix=(), env=None):
    r = sh(list(prefix) + [args.laga] + cmd + ["--json", out], timeout=args.timeout, env=env)
    if r.returncode != 0:
        sys.exit(f"shaped_links: {' '.join(list(prefix) + [args.laga] + cmd)} exited "
                 f"{r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


profile = os.path.join(tmp, "this.json")
r = sh([args.laga, "plan", "--measure", profile, "--dtype", "fp32"] + common,
       timeout=args.timeout)
if r.returncode != 0:
    sys.exit(f"shaped_links: laga plan --measure exited {r.returncode}: {r.stderr}")
mpirun = inside + ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                   "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
                   "-x", "OMP_NUM_THREADS=1", "-x", "OPENBLAS_NUM_THREADS=1"]
steps = ["--steps", str(args.steps), "--warmup", "2"]


def qdisc_bytes():
    """Bytes the namespace's loopback qdisc (the token bucket) has sent."""
    out = sh(inside + ["tc", "-s", "qdisc", "show", "dev", "lo"]).stdout.split()
    return int(out[out.index("Sent") + 1]) if "Sent" in out else -1


rows = []
fastest = {}  # (rate, form): the fastest measured step, for the slow-down check
crossed = []  # per rate: (bytes through the bucket, the ledger's bytes of both ranks)
for rate in rates:
    if sh(inside + ["tc", "qdisc", "change", "dev", "lo", "root", "tbf", "rate",
                    f"{rate:g}mbit", "burst", "16kb", "latency", "1s"]).returncode != 0:
        sys.exit(f"shaped_links: tc could not set {rate:g} Mbit/s")
    per_direction = rate / 2 / 8000  # GB/s each way: half the bucket (above)
    before = qdisc_bytes()
    shaped = laga(["compare", "--comm", "mpi"] + steps + common,
                  os.path.join(tmp, "shaped.json"), prefix=mpirun)
    # Every step, warm-up included, sends each form's ledger bytes from each
    # rank; TCP and MPI headers only add to what the bucket sees.
    ledger = sum(2 * f["bytes_sent_total"] * (args.steps + 2) for f in shaped["forms"])
    crossed.append((rate, qdisc_bytes() - before, ledger))
    modelled = laga(["compare", "--link", f"{per_direction:g}"] + steps + common,
                    os.path.join(tmp, "model.json"))
    plan = laga(["plan", "--profile", profile, "--dtype", "fp32", "--link",
                 f"{per_direction:g}"] + common, os.path.join(tmp, "plan.json"))
    pred = {p["form"]: p["predicted_step_s"] * 1e3 for p in plan["plans"]}
    # The link model's time in collectives per step: what the rate changes.
    wire = {p["form"]: 1e3 * sum(ph["comm_s"] for ph in p["phases"].values())
            for p in plan["plans"]}
    exposed = {p["form"]: wire[p["form"]] - 1e3 * p["hidden_comm_s"] for p in plan["plans"]}
    link = {f["form"]: f["step_ms"] for f in modelled["forms"]}
    for f in shaped["forms"]:
        rows.append((rate, per_direction, f["form"], f["step_ms"], link[f["form"]],
                     pred[f["form"]], wire[f["form"]], f["comm_ms"], exposed[f["form"]]))
        fastest[(rate, f["form"])] = min(f["step_ms_per_step"])

# 'comm' columns: the time in collectives per step, measured on the shaped
# MPI link (compare's comm_ms, the slowest rank) and the plan's exposed
# collective time. This is the check of the link model's communication that
# does not use the link model on the measured side (check_plan.py's does:
# `compare --link` holds each call for collective_seconds, as the plan does).
print(f"{'Mbit/s':>8} {'GB/s/dir':>9} {'form':>10} {'shaped ms':>10} {'model ms':>9} "
      f"{'predicted':>10} {'pred/shaped':>11} {'comm shaped':>12} {'comm pred':>10}")
worst = 0.0
for rate, gbps, form, s, m, p, _, cs, cp in rows:
    err = 100 * (p - s) / s
    worst = max(worst, abs(err))
    print(f"{rate:8g} {gbps:9.4g} {form:>10} {s:10.2f} {m:9.2f} {p:10.2f} {err:+10.1f}% "
          f"{cs:12.2f} {cp:10.2f}")
print(f"largest |predicted - shaped| / shaped: {worst:.1f}%")
# The bytes must have crossed the shaped queue: the bucket's own counter
# holds at least what the ledgers say both ranks sent (a bypass such as
# shared memory leaves it near zero).
for rate, through, ledger in crossed:
    print(f"shaped_links: {rate:g} Mbit/s: {through} bytes through the bucket, ledgers "
          f"{ledger} bytes")
    if not through >= ledger:
        sys.exit(f"shaped_links: FAILED: at {rate:g} Mbit/s only {through} bytes passed the "
                 f"shaped loopback, fewer than the {ledger} the ranks' ledgers sent: the traffic "
                 f"did not cross the shaped link")
# And the rate must show in the step: at the lowest rate, where the bucket
# holds every byte, even the fastest measured step must take at least half
# of what the link model says its collectives take there (a bypass leaves
# only compute: a few ms against the 13-15 ms the model gives --quick).
# Load from elsewhere only adds time, so this cannot fail for a busy
# machine, as a comparison between two rates did (a build on the other core
# made one high-rate median 9.5 ms where the rest of the run took 2).
low = min(rates)
slow = []
for rate, _, form, _, _, _, w, _, _ in rows:
    if rate != low:
        continue
    s_lo = fastest[(rate, form)]
    hi = [fastest[(r, f)] for (r, f) in fastest if f == form and r == max(rates)]
    print(f"shaped_links: {form}: at {low:g} Mbit/s the fastest step took {s_lo:.2f} ms, the "
          f"link model's collectives {w:.2f} ms" +
          (f" (at {max(rates):g} Mbit/s: {hi[0]:.2f} ms)" if hi else ""))
    if not s_lo >= 0.5 * w:
        slow.append(form)
if slow:
    sys.exit(f"shaped_links: FAILED: for {', '.join(slow)} the fastest step at {low:g} Mbit/s "
             f"took less than half the modelled wire time: the traffic did not cross the shaped "
             f"link")
if args.json:
    # Written beside its final name and renamed over it: a crash leaves the
    # old file whole.
    part = args.json + f".part{os.getpid()}"
    with open(part, "w") as f:
        json.dump({"cpu": cpu, "model": model, "netem": netem,
                   "rows": [dict(zip(("mbit_s", "gb_s_per_direction", "form", "shaped_ms",
                                      "model_ms", "predicted_ms", "wire_ms", "comm_shaped_ms",
                                      "comm_predicted_ms"), r)) for r in rows],
                   "crossed": [dict(zip(("mbit_s", "qdisc_bytes", "ledger_bytes"), c))
                               for c in crossed]}, f, indent=1)
    os.replace(part, args.json)
