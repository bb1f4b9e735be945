#!/usr/bin/env python3
"""`laga compare --count-only` at scales no machine could run for real
(issue 10 item 6): its memory does not grow with the sequence, and byte
counts beyond 2^53 stay exact integers in the JSON.

  test_count_only_scale.py LAGA TMPDIR
"""
import json
import os
import resource
import subprocess
import sys

laga, tmp = sys.argv[1], sys.argv[2]
os.makedirs(tmp, exist_ok=True)


def compare(args, name):
    out = os.path.join(tmp, name + ".json")
    r = subprocess.run([laga, "compare", "--quiet", "--count-only", "--json", out] + args,
                       capture_output=True, text=True, timeout=120)
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

for m in failures:
    print("FAILED:", m)
sys.exit(1 if failures else 0)
