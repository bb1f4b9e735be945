#!/usr/bin/env python3
"""A whole model's step per sequence length (docs/planning.md, "A whole
DeepSeek-V3 step"): `laga plan --model` on each profile, and at each S the
fewest devices that fit (the planner's min_devices), the form that wins
there, and its predicted speed-up over explicit at full depth against the
same at one block (each plan's block_step_s). Every figure is the planner's
prediction read from its --json; the script only picks and divides.

  plot_model_plan.py LAGA --out PNG [--table MD] [--profiles h100,h200] \
      [laga plan --model options: --model, --seq, --sp, --dp, --zero1, ...]

A profile where some S fits nowhere (laga plan exits 2 after writing its
JSON) is plotted for the S that fit.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plot_plan import save  # noqa: E402


def model_plan(laga, profile, args):
    with tempfile.TemporaryDirectory(prefix="laga_plot_model_") as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [laga, "plan", "--quiet", "--profile", profile] + args + ["--json", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        # 2 with the JSON written: some S fits nowhere (the error says which).
        if r.returncode not in (0, 2) or not os.path.exists(out):
            sys.exit(f"plot_model_plan.py: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
        with open(out) as f:
            return json.load(f), r.stderr.strip()


def rows(j):
    """Per S that fits: the fewest-devices case's winner and explicit."""
    out = []
    for d in j["min_devices"]:
        if d["devices"] is None:
            out.append({"seq": d["seq"], "devices": None})
            continue
        case = [p for p in j["plans"] if (p["seq"], p["sp"], p["dp"]) == (d["seq"], d["sp"], d["dp"])]
        win = next(p for p in case if p["form"] == d["form"])
        ref = next(p for p in case if p["form"] == "explicit")
        # The fastest fitting form other than explicit: laga's family at its best.
        other = min((p for p in case if p["form"] != "explicit" and p["fits"]),
                    key=lambda p: p["predicted_step_s"], default=None)
        out.append({"seq": d["seq"], "devices": d["devices"], "sp": d["sp"], "dp": d["dp"],
                    "win": win, "ref": ref, "other": other})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("laga")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", help="also write the markdown table here")
    ap.add_argument("--profiles", default="h100,h200")
    a, rest = ap.parse_known_args()
    profiles = a.profiles.split(",")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    lines = ["| profile | S | fewest devices (P x DP) | winner there | step s | tokens/s/device "
             "| MFU % | attention % | fastest other form | its speed-up over explicit: one block "
             "(`laga plan`) | the attention at full depth | the whole step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, profile in enumerate(profiles):
        color = f"C{i}"  # one color per profile in both panels
        j, err = model_plan(a.laga, profile, rest)
        rs = rows(j)
        fit = [r for r in rs if r["devices"] is not None]
        xs = [r["seq"] for r in fit]
        # A profile on which no S fits draws nothing, and says so in its label.
        left.plot(xs, [r["devices"] for r in fit], "o-", color=color,
                  label=profile if fit else f"{profile}: no S fits")
        for r in fit:
            left.annotate(r["win"]["form"], (r["seq"], r["devices"]), fontsize=7,
                          textcoords="offset points", xytext=(3, 4))
        with_other = [r for r in fit if r["other"]]
        full = [r["ref"]["predicted_step_s"] / r["other"]["predicted_step_s"] for r in with_other]
        block = [r["ref"]["block_step_s"] / r["other"]["block_step_s"] for r in with_other]
        if with_other:
            right.plot([r["seq"] for r in with_other], full, "o-", color=color,
                       label=f"{profile}: full depth")
            right.plot([r["seq"] for r in with_other], block, "s--", color=color,
                       label=f"{profile}: one block")
        for r in rs:
            if r["devices"] is None:
                lines.append(f"| {profile} | {r['seq']} | none of the grid fits | | | | | | | | | |")
                continue
            w, o = r["win"], r["other"]
            ref = r["ref"]
            name = o["form"] if o else "—"
            vb = f"{ref['block_step_s'] / o['block_step_s']:.3f}x" if o else "—"
            va = (f"{ref['seconds']['attention'] / o['seconds']['attention']:.3f}x" if o else "—")
            vs = f"{ref['predicted_step_s'] / o['predicted_step_s']:.3f}x" if o else "—"
            lines.append(f"| {profile} | {r['seq']} | {r['devices']} ({r['sp']} x {r['dp']}) | "
                         f"{w['form']} | {w['predicted_step_s']:.3g} | "
                         f"{w['predicted_tokens_per_s_per_device']:.4g} | {100 * w['mfu']:.1f} | "
                         f"{100 * w['attention_share']:.1f} | {name} | {vb} | {va} | {vs} |")
        if err:
            print(f"{profile}: {err}", file=sys.stderr)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    left.set_yscale("log", base=2)
    left.set_ylabel("fewest devices that fit (P x DP)")
    left.set_title("predicted: devices needed, and the winning form there", fontsize=9)
    right.set_ylabel("explicit's step / fastest other form's step")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_title("predicted speed-up over explicit at the fewest devices", fontsize=9)
    fig.suptitle(f"laga plan {' '.join(rest)} (predicted, not measured)", fontsize=8)
    fig.tight_layout()
    save(fig, a.out)
    table = "\n".join(lines) + "\n"
    if a.table:
        with open(a.table, "w") as f:
            f.write(table)
    print(table, end="")


if __name__ == "__main__":
    main()
