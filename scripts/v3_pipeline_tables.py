#!/usr/bin/env python3
"""DeepSeek-V3's tables in docs/planning.md ("DeepSeek-V3 with pipeline
stages and EP over the replicas", "DeepSeek-V3's own recipe"), from `laga
plan --model`'s JSON: this script computes nothing but reads the plans and
the ratios between them.

  python3 scripts/v3_pipeline_tables.py [--laga build/laga] grid|recipe|extension

grid       `laga plan --search`: the fewest devices that fit at S 4K-128K on
           H100 and H200, with PP and EP over the replicas in the grid and
           DeepSeek-V3's global batch of 62.9M tokens (1F1B and DualPipe,
           without and with recompute)
recipe     `laga plan --recipe deepseek-v3`: the step's breakdown, GPU-hours
           per 10^12 tokens against the report's 180K, and the prediction's
           sensitivity to each assumed figure (one changed at a time)
extension  the recipe at the report's 32K and 128K extension stages (global
           batches of 1920 and 480 sequences, section 4.3) with each
           sequence-parallel form at each P that keeps 2048 devices
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--laga", default=os.path.join(HERE, "..", "build", "laga"))
ap.add_argument("what", choices=["grid", "recipe", "extension"])
ap.add_argument("--profiles", default="h100,h200", help="grid: the profiles")
ap.add_argument("--schedules", default="1f1b,dualpipe", help="grid: the schedules")
args = ap.parse_args()
tmp = tempfile.mkdtemp(prefix="laga_v3_tables_")
REPORT_K_GPU_HOURS = 180.0  # per 10^12 tokens: 2,664K H800 GPU-hours for 14.8T tokens


def plan(options, allow_fail=False):
    out = os.path.join(tmp, "plan.json")
    r = subprocess.run([args.laga, "plan", "--quiet", "--json", out] + options,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 and not (allow_fail and os.path.exists(out)):
        sys.exit(f"laga plan {' '.join(options)} exited {r.returncode}: {r.stderr}")
    with open(out) as f:
        j = json.load(f)
    os.remove(out)
    return j


def grid():
    seqs = "4096,8192,16384,32768,65536,131072"
    print("| profile | schedule | recompute | S | fewest devices (P x DP x PP) | EP | micro-batches "
          "a replica | form | tokens a device a micro-batch | tokens/s/device | MFU % | memory GB "
          "| the grid's most tokens/s/device: P x DP x PP, tokens/s/device, MFU % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for profile in args.profiles.split(","):
        for schedule in args.schedules.split(","):
            for recompute in [False, True]:
                j = plan(["--model", "deepseek-v3", "--profile", profile, "--seq", seqs,
                          "--search", "--schedule", schedule, "--forms", "all", "--q-latent"] +
                         (["--recompute"] if recompute else []), allow_fail=True)
                mb = {(c["seq"], c["sp"], c["dp"], c["pp"]): c["micro_batches"]
                      for c in j["cases"]}
                for d in j["min_devices"]:
                    head = f"| {profile} | {schedule} | {'on' if recompute else 'off'} | {d['seq']} |"
                    if d["devices"] is None:
                        print(head + " none of the grid fits | | | | | | | | |")
                        continue
                    p = next(p for p in j["plans"] if p["seq"] == d["seq"] and p["sp"] == d["sp"]
                             and p["dp"] == d["dp"] and p["pp"] == d["pp"]
                             and p["form"] == d["form"])
                    fit = [q for q in j["plans"] if q["seq"] == d["seq"] and q["fits"]]
                    top = max(fit, key=lambda q: q["predicted_tokens_per_s_per_device"])
                    print(f"{head} {d['devices']} ({d['sp']} x {d['dp']} x {d['pp']}) | {p['ep']} |"
                          f" {mb[(d['seq'], d['sp'], d['dp'], d['pp'])]} | {d['form']} |"
                          f" {d['seq'] // d['sp']} |"
                          f" {p['predicted_tokens_per_s_per_device']:.4g} | {100 * p['mfu']:.1f} |"
                          f" {p['memory']['total'] / 1e9:.1f} |"
                          f" {top['sp']} x {top['dp']} x {top['pp']},"
                          f" {top['predicted_tokens_per_s_per_device']:.4g},"
                          f" {100 * top['mfu']:.1f} |")


def recipe_row(name, options, profile_edit=None):
    opts = list(options)
    if profile_edit:
        with open(os.path.join(HERE, "..", "profiles", "h800.json")) as f:
            prof = json.load(f)
        profile_edit(prof)
        path = os.path.join(tmp, "h800-edit.json")
        with open(path, "w") as f:
            json.dump(prof, f)
        opts += ["--profile", path]
    j = plan(["--recipe", "deepseek-v3"] + opts, allow_fail=True)
    p = j["plans"][0]
    k = p["device_hours_per_1e12_tokens"] / 1e3
    return name, p, k


def recipe():
    base_name, base, k0 = recipe_row("the recipe", [])
    s = base["seconds"]
    print(f"recipe: step {base['predicted_step_s']:.4g} s, {base['predicted_tokens_per_s_per_device']:.4g}"
          f" tokens/s/GPU, MFU {100 * base['mfu']:.1f}% (of the bf16 peak), {k0:.1f}K GPU-hours per"
          f" 10^12 tokens ({100 * (k0 / REPORT_K_GPU_HOURS - 1):+.1f}% against the report's 180K);"
          f" fits: {base['fits']} ({base['memory']['total'] / 1e9:.1f} GB a device)")
    print("| part | seconds of the slowest device's step | share |")
    print("|---|---|---|")
    for key in ["attention", "ffn", "head", "moe_a2a", "elementwise", "p2p", "bubble",
                "comm_units", "hidden", "grad_sync", "optimizer"]:
        print(f"| {key} | {s[key]:.4g} | {100 * s[key] / base['predicted_step_s']:+.1f}% |")
    print()
    print("| changed (one at a time) | K GPU-hours / 10^12 tokens | against 180K | against the recipe |")
    print("|---|---|---|---|")

    def eff(key, v):
        return lambda p: p["device"]["efficiency"].__setitem__(key, v)

    def link(level, v):
        return lambda p: p[level].__setitem__("bytes_per_s", v)

    rows = [("the recipe", [], None)]
    for v in [0.5, 0.7, 0.72]:
        rows.append((f"GEMM efficiency {v} (recipe 0.6)", [], eff("gemm", v)))
    for v in [0.3, 0.5, 0.52]:
        rows.append((f"attention efficiency {v} (recipe 0.4)", [], eff("attention", v)))
    rows.append(("IB 40 GB/s a GPU (recipe 50)", [], link("inter_node", 40e9)))
    rows.append(("NVLink 160 GB/s (the report's achieved; recipe 200)", [],
                 link("intra_node", 160e9)))
    rows.append(("communication SMs 0/132 (recipe 20/132)", ["--comm-sms", "0/132"], None))
    rows.append(("communication SMs 32/132", ["--comm-sms", "32/132"], None))
    rows.append(("routing per copy, not node-limited", ["--node-limit", "0"], None))
    rows.append(("bf16 GEMMs (no --fp8)", ["--fp8=false"], None))
    rows.append(("1F1B in place of DualPipe", ["--schedule", "1f1b"], None))
    rows.append(("--recompute (every layer re-run)", ["--recompute"], None))
    rows.append(("no MTP module", ["--mtp=false"], None))
    rows.append(("stages 3,4,...,4,2 (+MTP): the head's stage lighter", ["--stage-layers",
                 ",".join(["3"] + ["4"] * 14 + ["2"])], None))
    for name, opts, edit in rows:
        _, p, k = recipe_row(name, opts, edit)
        print(f"| {name} | {k:.1f} | {100 * (k / REPORT_K_GPU_HOURS - 1):+.1f}% |"
              f" {100 * (k / k0 - 1):+.1f}% |")


def extension():
    print("| S | recompute | P x DP x PP | micro-batches | fastest form | its K GPU-hours / 10^12 "
          "tokens | MFU % | memory GB | fits | explicit's K GPU-hours | fastest / explicit | "
          "slowest form (its speed against explicit) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    per_form = []  # (S, recompute, P, dp, M, plans)
    for S, batch, sps in [(32768, 1920, [1, 2, 4, 8, 16]), (131072, 480, [4, 8, 16, 32])]:
        for recompute in [False, True]:
            for P in sps:
                dp = 128 // P
                M = batch // dp
                j = plan(["--recipe", "deepseek-v3", "--seq", str(S), "--sp", str(P), "--dp",
                          str(dp), "--micro-batches", str(M), "--forms", "all", "--q-latent"] +
                         (["--recompute"] if recompute else []), allow_fail=True)
                per_form.append((S, recompute, P, dp, M, j["plans"]))
                plans = sorted(j["plans"], key=lambda p: p["predicted_step_s"])
                ref = next(p for p in plans if p["form"] == "explicit")
                best, worst = plans[0], plans[-1]
                k = best["device_hours_per_1e12_tokens"] / 1e3
                print(f"| {S} | {'on' if recompute else 'off'} | {P} x {dp} x 16 | {M} |"
                      f" {best['form']} | {k:.1f} | {100 * best['mfu']:.1f} |"
                      f" {best['memory']['total'] / 1e9:.1f} | {'yes' if best['fits'] else 'NO'} |"
                      f" {ref['device_hours_per_1e12_tokens'] / 1e3:.1f} |"
                      f" {ref['predicted_step_s'] / best['predicted_step_s']:.3f}x |"
                      f" {worst['form']} ({ref['predicted_step_s'] / worst['predicted_step_s']:.3f}x) |")
    # Each sequence-parallel form, side by side: K GPU-hours / 10^12 tokens
    # (* where it does not fit 80 GB), the winner among those that fit and
    # its lead over the runner-up and over explicit.
    forms = [p["form"] for p in per_form[0][5]]
    print()
    print("| S | recompute | P | " + " | ".join(forms) +
          " | winner (fits) | its lead over the runner-up | over explicit |")
    print("|---|---|---|" + "---|" * len(forms) + "---|---|---|")
    for S, recompute, P, dp, M, plans in per_form:
        by = {p["form"]: p for p in plans}
        cells = [f"{by[f]['device_hours_per_1e12_tokens'] / 1e3:.1f}{'' if by[f]['fits'] else '*'}"
                 if f in by else "" for f in forms]
        fit = sorted([p for p in plans if p["fits"]], key=lambda p: p["predicted_step_s"])
        if not fit:
            tail = "none fits | | |"
        else:
            win = fit[0]
            ref = by["explicit"]
            lead = (f"{100 * (fit[1]['predicted_step_s'] / win['predicted_step_s'] - 1):.2f}%"
                    f" ({fit[1]['form']})" if len(fit) > 1 else "")
            tail = (f"{win['form']} | {lead} |"
                    f" {100 * (ref['predicted_step_s'] / win['predicted_step_s'] - 1):.2f}% |")
        print(f"| {S} | {'on' if recompute else 'off'} | {P} | " + " | ".join(cells) + f" | {tail}")


{"grid": grid, "recipe": recipe, "extension": extension}[args.what]()
