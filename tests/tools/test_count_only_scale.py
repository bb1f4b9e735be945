#!/usr/bin/env python3
"""`laga compare --count-only` at scales no machine could run for real
(issue 10 item 6): its memory does not grow with the sequence, and byte
counts beyond 2^53 stay exact integers in the JSON; nor, beyond a few bytes
per rank, with P (issue 26 item 14); nor, for any form, with the batch, and
`laga plan` neither (issue 54 item N).

  test_count_only_scale.py LAGA TMPDIR
"""
import json
import os
import resource
import subprocess
import sys

laga, tmp = sys.argv[1], sys.argv[2]
# tiny's dims with q_lora_rank 20, for --q-latent.
q_latent_config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration",
                               "tiny_q_latent.json")
os.makedirs(tmp, exist_ok=True)


def limit_address_space():
    # An old binary that ran every rank as a thread took the whole machine at
    # P 4096: under this limit it fails instead (a real count-only run needs a
    # small fraction of it).
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def compare(args, name):
    out = os.path.join(tmp, name + ".json")
    r = subprocess.run([laga, "compare", "--quiet", "--count-only", "--json", out] + args,
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=limit_address_space)
    if r.returncode != 0:
        sys.exit(f"FAILED: laga compare {' '.join(args)} exited {r.returncode}: {r.stderr}")
    with open(out) as f:
        return json.load(f)


failures = []

# DeepSeek-V3 at S = 2^20 over 64 ranks: every rank counted in this process.
before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
d = compare(["--preset", "deepseek-v3", "--seq", "1048576", "--sp", "64"], "v3_1m")
rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
if rss_kb > 200 * 1024:
    failures.append(f"V3 S=2^20 P=64 count-only peaked at {rss_kb / 1024:.0f} MB RSS (limit 200 MB)")
for f in d["forms"]:
    if not f["bytes_match"]:
        failures.append(f"{f['form']}: ledger != closed form at S=2^20 P=64")

# S = 10^8 + 1 (odd), eager: rank 0 holds H_r = 2 heads' probabilities,
# 2 * S^2 * 4 bytes, ~8e16: above 2^53 and not a multiple of 16, so a count
# that passed through a double would be off.
S = 100_000_001
d = compare(["--preset", "deepseek-v3", "--seq", str(S), "--sp", "64", "--attention", "eager",
             "--forms", "laga"], "v3_1e8")
f = d["forms"][0]
probs = [t for t in f["predicted_live_at_peak"] if "probs" in t["name"]]
if not probs or probs[0]["bytes"] != 2 * S * S * 4:
    failures.append(f"eager probs at S={S}: {probs[:1]} != {2 * S * S * 4}")
total = sum(t["bytes"] for t in f["predicted_live_at_peak"])
if total != f["predicted_peak_activation_bytes"] or f["peak_activation_bytes"] != total:
    failures.append(f"peak {f['peak_activation_bytes']} / predicted "
                    f"{f['predicted_peak_activation_bytes']} != sum of live terms {total}")
if not f["bytes_match"]:
    failures.append("ledger != closed form at S=1e8+1")

# Issue 26 item 14: count-only costs what plan and --rank-only cost, one
# dry run per class of identical ranks (rank_classes), not P ranks as threads
# with O(P) collectives each: the tiny preset at S 512 over P 512 took over
# 60 s and 3.3 GB, P 1000 19 GB, P >= 2000 the whole machine. Bounded by
# memory (the house rule: speed is a benchmark's, not a unit test's); every
# form, even and uneven shards, packed, eager. laga2d only to P 1000: with
# many context groups nearly every rank is a class of its own (its query
# chunks differ), so its count-only cost is O(P) dry runs of O(P) each, as
# in `laga plan` (about a minute at P 4096 here: not what this test bounds).
# The ring forms' count-only cost is O(P^2) when the shards are uneven (each
# rank a class of its own, P steps each): at P 1000 uneven and packed they
# took 150 of this case's 155 s of CPU (ring_kv 65 s, ring_latent 85 s,
# every other form under 3 s, loaded machine, 2026-12-07), so they run that
# case at P 250 and every other form at P 1000.
no_laga2d = ["--forms", "explicit,absorbed,laga"]
no_rings = ["--forms", "explicit,absorbed,laga,laga_fused,laga2d,allgather_kv,a2a_p2p"]
for args, name in [(["--seq", "512", "--sp", "512"], "tiny_p512"),
                   (["--seq", "1500", "--sp", "1000", "--doc-lens", "300,1000,200"] + no_rings,
                    "tiny_p1000_uneven_packed"),
                   (["--seq", "375", "--sp", "250", "--doc-lens", "75,250,50", "--forms",
                     "ring_kv,ring_latent"], "tiny_p250_uneven_packed_rings"),
                   (["--seq", "4096", "--sp", "4096"] + no_laga2d, "tiny_p4096"),
                   (["--seq", "5000", "--sp", "4096", "--doc-lens", "1000,3000,1000"] + no_laga2d,
                    "tiny_p4096_uneven_packed"),
                   (["--seq", "4096", "--sp", "4096", "--attention", "eager", "--q-latent",
                     "--config", q_latent_config] + no_laga2d, "tiny_q_latent_p4096_eager"),
                   # bf16: the flash workspace follows a rank's OpenMP threads, which
                   # the dry runs must take as run_group gives them (until 2026-12-05
                   # they took the process's, and every form but laga_fused missed
                   # the model at P 4 on 2 cores)
                   (["--seq", "512", "--sp", "4", "--dtype", "bf16"], "tiny_bf16_p4")]:
    d = compare((["--preset", "tiny"] if "--config" not in args else []) + args, name)
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if rss_kb > 200 * 1024:
        failures.append(f"{name}: count-only peaked at {rss_kb / 1024:.0f} MB RSS (limit 200 MB)")
    if len(d["measured_ranks"]) != int(args[3]):
        failures.append(f"{name}: {len(d['measured_ranks'])} measured ranks, not {args[3]}")
    for f in d["forms"]:
        if not f["bytes_match"] or not f["memory_match"]:
            failures.append(f"{name} {f['form']}: bytes_match {f['bytes_match']}, "
                            f"memory_match {f['memory_match']}")


# Issue 54 item N: nor with --batch. allgather_kv's and a2a_p2p's dry runs
# issued one attention call per batch row (and the ring forms one per row
# of a step's rectangle, laga2d with the query latent one RoPE call per
# row, the work model one sum per row): B 10^7 took 24 s and 2.4 GB, B 10^9
# asked for 30 GB, `plan` at B 10^6 24 s. Now a count-only run issues row
# 0's calls once for all B (ops::RepeatCounts) and costs what B 1 costs:
# every form, each layout, kernel, precision and variant at B 10^8, bounded
# by the address space and by CPU time (the old binary needed hours here),
# with the ledger equal to the closed form and, per collective, B times the
# bytes of B 1 (the gradient all-reduce's, which B does not change, alike).
BIG_B = 100_000_000


def limit_cpu_and_address_space():
    limit_address_space()
    resource.setrlimit(resource.RLIMIT_CPU, (30, 30))


def run_limited(args, name):
    out = os.path.join(tmp, name + ".json")
    r = subprocess.run([laga] + args + ["--quiet", "--json", out], capture_output=True, text=True,
                       timeout=120, preexec_fn=limit_cpu_and_address_space)
    if r.returncode != 0:
        why = " (killed at the CPU-time limit)" if r.returncode == -24 else ""
        failures.append(f"{name}: laga {' '.join(args)} exited {r.returncode}{why}: "
                        f"{r.stderr.strip()[-300:]}")
        return None
    with open(out) as f:
        return json.load(f)


def labels(form):
    return {(b["phase"], b["label"]): b["bytes_sent"] for b in form["by_label"]}


batch_cases = [
    ([], "contiguous"),
    (["--seq-layout", "zigzag"], "zigzag"),
    (["--attention", "eager"], "eager"),
    (["--attention", "eager", "--seq-layout", "zigzag"], "eager_zigzag"),
    (["--dtype", "bf16"], "bf16"),
    (["--dtype", "bf16", "--seq-layout", "zigzag"], "bf16_zigzag"),
    (["--overlap", "on"], "overlap"),
    (["--doc-lens", "40,24"], "packed"),
    (["--forms", "laga2d,a2a_p2p", "--head-groups", "2"], "head_groups"),
    (["--forms", "laga,laga_fused,laga2d", "--q-latent", "--config", q_latent_config],
     "q_latent"),
    (["--forms", "laga,laga_fused,laga2d", "--q-latent", "--config", q_latent_config,
      "--seq-layout", "zigzag", "--attention", "eager"], "q_latent_zigzag_eager"),
]
for extra, name in batch_cases:
    base = ["compare", "--count-only", "--seq", "64", "--sp", "4"]
    base += ["--preset", "tiny"] if "--config" not in extra else []
    small = run_limited(base + ["--batch", "1"] + extra, f"b1_{name}")
    big = run_limited(base + ["--batch", str(BIG_B)] + extra, f"b1e8_{name}")
    if small is None or big is None:
        continue
    if [f["form"] for f in small["forms"]] != [f["form"] for f in big["forms"]]:
        failures.append(f"{name}: different forms at B 1 and B {BIG_B}")
        continue
    if "--forms" not in extra and len(big["forms"]) < 9:
        failures.append(f"{name}: only {[f['form'] for f in big['forms']]}: not every form")
    for f1, fb in zip(small["forms"], big["forms"]):
        if not fb["bytes_match"] or not fb["memory_match"]:
            failures.append(f"B {BIG_B} {name} {fb['form']}: bytes_match {fb['bytes_match']}, "
                            f"memory_match {fb['memory_match']}")
        one, many = labels(f1), labels(fb)
        for key, sent in one.items():
            want = sent if key[1] == "grad_allreduce" else BIG_B * sent
            if many.get(key) != want:
                failures.append(f"B {BIG_B} {name} {fb['form']} {key}: {many.get(key)} bytes, "
                                f"not {want}")
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if rss_kb > 200 * 1024:
        failures.append(f"B {BIG_B} {name}: peaked at {rss_kb / 1024:.0f} MB RSS (limit 200 MB)")

# `laga plan` runs the same dry runs (and the work model, which summed every
# row's pairs): every form, both layouts and kernels, overlap, at B 10^8.
for extra, name in [([], "plan"), (["--seq-layout", "zigzag", "--attention", "eager"],
                                   "plan_zigzag_eager"), (["--overlap", "both"], "plan_overlap")]:
    # Nothing fits an h100 at this batch: the refusal (exit 2) still plans
    # every form first, so its cost is what is bounded here.
    t = subprocess.run([laga, "plan", "--quiet", "--preset", "tiny", "--seq", "64,96", "--sp",
                        "2,4,6", "--batch", str(BIG_B), "--profile", "h100"] + extra,
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=limit_cpu_and_address_space)
    if t.returncode not in (0, 2) or "fits no form" not in t.stderr:
        failures.append(f"{name} at B {BIG_B}: exit {t.returncode}: {t.stderr.strip()[-300:]}")

for m in failures:
    print("FAILED:", m)
sys.exit(1 if failures else 0)
