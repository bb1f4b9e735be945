#!/usr/bin/env python3
"""Plots of `laga plan` sweeps (docs/planning.md, "Plots"): every figure is
the planner's prediction, read from its --json output, never computed here.

  plot_plan.py LAGA --out PNG grid      [plan options] --seq S,S,... --sp P,P,...
  plot_plan.py LAGA --out PNG bandwidth [plan options] --seq S --sp P
                                        [--gbps LO,HI] [--points N] [--latency-us LAT]

grid: which form wins at each (S, P), and its predicted speed-up over
explicit, one cell per case (a form that does not fit is never a winner;
a case where none fits is marked so).
bandwidth: the predicted step time of each form against the link bandwidth
(every link overridden with --link BW[,LAT], log-spaced from LO to HI GB/s),
with the crossover bandwidth where laga starts to beat explicit as the
planner computes it (the case's crossover_bytes_per_s).

Everything after the mode goes to `laga plan` as it is (--preset, --config,
--profile, --dtype, --forms, --q-latent, --head-groups, --nodes, ...).
Needs matplotlib (Debian's python3-matplotlib, installed by scripts/setup.sh).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plan(laga, args):
    """Runs `laga plan ARGS --json FILE` and returns the parsed JSON."""
    with tempfile.TemporaryDirectory(prefix="laga_plot_plan_") as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [laga, "plan", "--quiet"] + args + ["--json", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"plot_plan.py: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
        with open(out) as f:
            return json.load(f)


def save(fig, out):
    """Writes the figure to `out` atomically (a temporary file beside it,
    then a rename), so a failed or interrupted run leaves `out` as it was.
    main() has refused an `out` that is not a regular file."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(out) + ".tmp.",
                               dir=os.path.dirname(os.path.abspath(out)))
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=120)
        os.replace(tmp, os.path.realpath(out))
    except BaseException:
        os.unlink(tmp)
        raise


def option(args, name):
    """The value of `name` in a plan argument list, or None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def grid(laga, out, args):
    doc = plan(laga, args)
    seqs = sorted({c["seq"] for c in doc["cases"]})
    sps = sorted({c["sp"] for c in doc["cases"]})
    forms = sorted({p["form"] for p in doc["plans"]})
    colour = {f: plt.cm.tab10(i) for i, f in enumerate(forms)}
    fig, ax = plt.subplots(figsize=(1.6 * len(sps) + 2.5, 0.9 * len(seqs) + 1.8))
    for case in doc["cases"]:
        x, y = sps.index(case["sp"]), seqs.index(case["seq"])
        rows = [p for p in doc["plans"] if p["seq"] == case["seq"] and p["sp"] == case["sp"]]
        fits = [p for p in rows if p["fits"]]
        if not fits:
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color="0.85"))
            ax.text(x, y, "nothing fits", ha="center", va="center", fontsize=8)
            continue
        best = min(fits, key=lambda p: p["predicted_step_s"])
        explicit = [p for p in rows if p["form"] == "explicit"]
        label = best["form"]
        if explicit:
            label += f"\n{explicit[0]['predicted_step_s'] / best['predicted_step_s']:.2f}x explicit"
            if not explicit[0]["fits"]:
                label += " (does not fit)"
        ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=colour[best["form"]],
                                   alpha=0.45))
        ax.text(x, y, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.5, len(sps) - 0.5)
    ax.set_ylim(-0.5, len(seqs) - 0.5)
    ax.set_xticks(range(len(sps)), [str(p) for p in sps])
    ax.set_yticks(range(len(seqs)), [str(s) for s in seqs])
    ax.set_xlabel("sequence-parallel ranks P")
    ax.set_ylabel("sequence length S")
    ax.set_title(f"predicted winner per (S, P): profile {doc['profile']}, {doc['dtype']}, "
                 f"{doc['attention']}", fontsize=9)
    fig.tight_layout()
    save(fig, out)
    print(f"wrote {out}: {len(doc['cases'])} cases, forms {', '.join(forms)}")


def bandwidth(laga, out, args, gbps, points, latency_us):
    if "," in (option(args, "--seq") or "") or "," in (option(args, "--sp") or ""):
        sys.exit("plot_plan.py bandwidth: give one --seq and one --sp")
    if option(args, "--link") is not None:
        sys.exit("plot_plan.py bandwidth: the sweep sets --link itself; drop it")
    lo, hi = gbps
    if not (0 < lo < hi) or not all(map(math.isfinite, gbps)):
        sys.exit(f"plot_plan.py: --gbps {lo},{hi}: give 0 < LO < HI")
    if points < 2:
        sys.exit("plot_plan.py: --points must be at least 2")
    bws = [lo * (hi / lo) ** (i / (points - 1)) for i in range(points)]
    link = lambda bw: f"{bw:g}" + ("" if latency_us is None else f",{latency_us:g}")  # noqa: E731
    curves, crossover, profile = {}, None, None
    for i, bw in enumerate(bws):
        doc = plan(laga, args + ["--link", link(bw)])
        profile = doc["profile"]
        for p in doc["plans"]:
            curves.setdefault(p["form"], []).append(p["predicted_step_s"])
        if crossover is None:
            crossover = doc["cases"][0].get("crossover_bytes_per_s"), doc["cases"][0]["crossover"]
        print(f"  {i + 1}/{len(bws)}: {bw:.4g} GB/s", file=sys.stderr)
    # Above: each form's step time; below: explicit's over each form's (the
    # predicted speed-up), where the forms' differences are visible.
    fig, (ax, rel) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    cross_bps, cross_text = crossover
    for form, ys in curves.items():
        ax.plot(bws, ys, marker=".", label=form)
        if "explicit" in curves:
            rel.plot(bws, [e / y for e, y in zip(curves["explicit"], ys)], marker=".", label=form)
    for a in (ax, rel):
        if cross_bps:
            a.axvline(cross_bps / 1e9, color="0.4", linestyle="--",
                      label=f"crossover {cross_bps / 1e9:.3g} GB/s" if a is ax else None)
        a.set_xscale("log")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("predicted step time [s]")
    rel.set_ylabel("explicit's step / the form's")
    rel.set_xlabel("link bandwidth per direction [GB/s]" +
                   ("" if latency_us is None else f", latency {latency_us:g} us"))
    ax.set_title(f"S {option(args, '--seq')}, P {option(args, '--sp')}, profile {profile} "
                 f"(every link overridden)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out)
    print(f"wrote {out}: {len(bws)} bandwidths; {cross_text}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("laga", help="the laga binary")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--gbps", default="0.1,1000", help="bandwidth mode: LO,HI GB/s")
    ap.add_argument("--points", type=int, default=13, help="bandwidth mode: how many")
    ap.add_argument("--latency-us", type=float, default=None,
                    help="bandwidth mode: the links' latency (default: the profile's)")
    ap.add_argument("mode", choices=["grid", "bandwidth"])
    ns, plan_args = ap.parse_known_args()
    # Before any planning: replacing a directory, a device or a FIFO would
    # destroy it (a symlink is written through to its file).
    if os.path.lexists(ns.out) and not os.path.isfile(ns.out):
        sys.exit(f"plot_plan.py: --out {ns.out}: exists and is not a regular file; "
                 "give a file path")
    if ns.mode == "grid":
        grid(ns.laga, ns.out, plan_args)
    else:
        try:
            lo, hi = (float(v) for v in ns.gbps.split(","))
        except ValueError:
            sys.exit(f"plot_plan.py: --gbps '{ns.gbps}': give LO,HI in GB/s")
        bandwidth(ns.laga, ns.out, plan_args, (lo, hi), ns.points, ns.latency_us)


if __name__ == "__main__":
    main()
