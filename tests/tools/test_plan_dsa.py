#!/usr/bin/env python3
"""`laga plan` on a DSA config (docs/planning.md, "DSA"), end to end.

  test_plan_dsa.py LAGA TMPDIR SOURCE_DIR

- Each DSA preset and its shipped configs/*.json plan every DSA form, the
  preset and the file giving the same plans; the indexer's bytes of
  laga_indices and latent_gather equal the closed forms written out here
  ((P-1) L di e twice, and (P-1) L K 4 twice for the indices and the KL
  target), and the winner is the fastest form that fits.
- configs/kimi-k3-like.json (no index keys) plans the dense forms.
- `laga compare --count-only` on V3.2 at S 32768, P 8 counts latent_gather,
  laga_indices, laga_recompute and explicit without computing: each one's
  pool peak equals dsa_memory ("exact") and its ledger dsa_predict_comm.
- Refusals exit 2 with one "laga: error:" line naming what was wrong: a DSA
  preset or config given to what forward and compare do not run for DSA
  (--count-only for a form without a count-only run, ring_latent), V3.2's config to laga train at a --seq below its index_topk, --model with a DSA config (after its MoE keys parsed), a dense variant option, an unknown DSA form, a config
  with index_topk but no index_head_dim.
"""
import json
import os
import subprocess
import sys

laga, tmp, src = sys.argv[1], os.path.join(sys.argv[2], "plan_dsa"), sys.argv[3]
os.makedirs(tmp, exist_ok=True)
failures = []
FORMS = ["latent_gather", "laga_indices", "laga_recompute", "explicit", "ring_latent"]
# (config file, index_n_heads, index_head_dim, index_topk)
DSA = {"deepseek-v3.2": (64, 128, 2048), "glm-5-like": (32, 128, 2048)}


def run(args):
    return subprocess.run([laga] + args, capture_output=True, text=True, timeout=120)


def plan(args):
    r = run(["plan", "--profile", "h100", "--seq", "8192,32768", "--sp", "2,8", "--json", "-"]
            + args)
    if r.returncode != 0:
        sys.exit(f"FAILED: laga plan {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return json.loads(r.stdout)


for name, (Hi, di, K) in DSA.items():
    by_preset = plan(["--preset", name])
    by_file = plan(["--config", os.path.join(src, "configs", name + ".json")])
    if by_preset["plans"] != by_file["plans"]:
        failures.append(f"{name}: the preset and configs/{name}.json plan differently")
    if by_preset["dsa"] != {"index_n_heads": Hi, "index_head_dim": di, "index_topk": K}:
        failures.append(f"{name}: dsa block {by_preset['dsa']}")
    forms = {}
    for p in by_preset["plans"]:
        forms.setdefault((p["seq"], p["sp"]), {})[p["form"]] = p
    for (S, P), f in forms.items():
        if sorted(f) != sorted(FORMS):
            failures.append(f"{name} S {S} P {P}: forms {sorted(f)}")
            continue
        L, e = S // P, 2  # even shards, bf16 activations; indices and the target at 4
        want = {"latent_gather": 2 * (P - 1) * L * di * e,
                "laga_indices": 2 * (P - 1) * L * di * e + 2 * (P - 1) * L * K * 4}
        for form, bytes_ in want.items():
            if f[form]["index_bytes_sent"] != bytes_:
                failures.append(f"{name} S {S} P {P} {form}: index_bytes_sent "
                                f"{f[form]['index_bytes_sent']}, closed form {bytes_}")
        for p in f.values():
            if not p["bytes_sent_forward"] + p["bytes_sent_backward"] <= p["bytes_sent_per_rank"]:
                failures.append(f"{name} {p['form']}: phases exceed the total")
            if abs(p["compute_s"] + p["comm_s"] - p["predicted_step_s"]) > 1e-12 * p["predicted_step_s"]:
                failures.append(f"{name} {p['form']}: compute + comm != step")
        # The indexer recomputed for every query: P times the owner's own
        # queries' forward scores, so more indexer FLOPs at P > 1.
        if not f["laga_recompute"]["indexer_flops"] > f["laga_indices"]["indexer_flops"]:
            failures.append(f"{name} S {S} P {P}: recompute's indexer FLOPs not above")
    for c in by_preset["cases"]:
        fits = [p for p in forms[(c["seq"], c["sp"])].values() if p["fits"]]
        best = min(fits, key=lambda p: p["predicted_step_s"])["form"] if fits else None
        if c["winner"] != best:
            failures.append(f"{name} S {c['seq']} P {c['sp']}: winner {c['winner']}, fastest {best}")

kimi = plan(["--config", os.path.join(src, "configs", "kimi-k3-like.json"), "--forms",
             "laga,explicit"])
if sorted({p["form"] for p in kimi["plans"]}) != ["explicit", "laga"] or "dsa" in kimi:
    failures.append("kimi-k3-like: not a dense plan")

r = run(["compare", "--preset", "deepseek-v3.2", "--count-only", "--seq", "32768", "--sp", "8",
         "--forms", "latent_gather,laga_indices,laga_recompute,explicit", "--json", "-"])
if r.returncode != 0:
    failures.append(f"compare --count-only on deepseek-v3.2: exit {r.returncode}: {r.stderr}")
else:
    rows = json.loads(r.stdout)["dsa_forms"]
    if [x["form"] for x in rows] != ["latent_gather", "laga_indices", "laga_recompute",
                                     "explicit"] or not all(
            x["memory_peak_exact"] and x["memory_peak_pool"] == x["memory_peak_closed_form"]
            and x["memory_peak_pool"] > 0 and x["ledger_equals_closed_form"] for x in rows):
        failures.append(f"compare --count-only on deepseek-v3.2: {rows}")

half = os.path.join(tmp, "half.json")
with open(half, "w") as f:
    json.dump({"dim": 7168, "n_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "index_topk": 2048, "index_n_heads": 64}, f)
v32 = os.path.join(src, "configs", "deepseek-v3.2.json")
for args, words in [
        # forward and compare run the DSA forms the engine has (tools/dsa_job.hpp)
        (["compare", "--preset", "deepseek-v3.2", "--count-only", "--forms", "ring_latent"],
         "--form ring_latent: a DSA form costed from its closed form only"),
        (["forward", "--config", v32, "--form", "ring_latent"],
         "--form ring_latent: a DSA form costed from its closed form only"),
        (["plan", "--model", v32, "--profile", "h100"], "--model plans dense MLA layers"),
        (["plan", "--model", os.path.join(src, "configs", "glm-5-like.json"), "--profile",
          "h100"], "--model plans dense MLA layers"),
        # laga train runs DSA (model/dsa_layer.hpp); V3.2's top-2048 is above its --seq
        (["train", "--config", v32], "index_topk 2048 is above --seq 512"),
        (["plan", "--preset", "glm-5-like", "--profile", "h100", "--q-latent"],
         "--q-latent, --head-groups, --overlap and --attention"),
        (["plan", "--preset", "glm-5-like", "--profile", "h100", "--forms", "laga"],
         "unknown DSA form 'laga'"),
        # (the message names the key; the config reader and DsaConfig word it apart)
        (["plan", "--config", half, "--profile", "h100"], "index_head_dim"),
        (["plan", "--preset", "deepseek-v3.2", "--measure", os.path.join(tmp, "m.json")],
         "--measure, --list-shapes and --profile this")]:
    r = run(args)
    lines = [l for l in r.stderr.splitlines() if l.startswith("laga: error:")]
    if r.returncode != 2 or len(lines) != 1 or words not in lines[0]:
        failures.append(f"laga {' '.join(args)}: exit {r.returncode}, stderr {r.stderr!r}")

if failures:
    print("\n".join("FAILED: " + f for f in failures))
    sys.exit(1)
print("plan DSA: presets, configs and refusals as expected")
