#!/usr/bin/python3
"""Plot the loss curves of `laga train` JSONL logs on one figure.

    plot_loss.py --out loss.png explicit=runs/explicit.jsonl laga=runs/laga.jsonl ...

Each positional argument is LABEL=FILE (or just FILE: the label is the file's
stem). The top panel shows the losses (log scale); the bottom one |loss - the
first curve's loss| per step, the paper's Figure 6(b). Also prints a table of
first/last loss and the largest difference from the first curve.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_log(path):
    steps, losses = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not a JSON line ({e}); is it a `laga train --log` file?")
            steps.append(rec["step"])
            losses.append(rec["loss"])
    if not steps:
        sys.exit(f"{path}: no steps logged")
    return steps, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="LABEL=FILE.jsonl")
    ap.add_argument("--out", required=True, help="image to write (.png, .svg, ...)")
    ap.add_argument("--title", default="MLA LM, 4 layers, d 512, 16 heads, seq 512: loss under each form")
    args = ap.parse_args()

    curves = []
    for item in args.logs:
        label, _, path = item.rpartition("=")
        label = label or os.path.splitext(os.path.basename(path))[0]
        curves.append((label, *read_log(path)))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    styles = ["-", "--", ":", "-."]
    for i, (label, steps, losses) in enumerate(curves):
        top.plot(steps, losses, styles[i % len(styles)], label=label, linewidth=1.6)
    top.set_yscale("log")
    top.set_ylabel("training loss")
    top.set_title(args.title, fontsize=10)
    top.grid(True, which="both", alpha=0.3)
    top.legend()

    ref_label, ref_steps, ref_losses = curves[0]
    ref = dict(zip(ref_steps, ref_losses))
    print(f"{'form':<10} {'steps':>5} {'first':>10} {'last':>12} {'max |d| vs ' + ref_label:>20}")
    for i, (label, steps, losses) in enumerate(curves):
        d = [abs(l - ref[s]) for s, l in zip(steps, losses) if s in ref]
        print(f"{label:<10} {len(steps):>5} {losses[0]:>10.4f} {losses[-1]:>12.6f} {max(d) if d else 0:>20.3g}")
        if i == 0:
            continue
        xs = [s for s in steps if s in ref]
        # Exact zeros cannot go on a log axis: draw them at the floor.
        bottom.plot(xs, [max(v, 1e-12) for v in d], styles[i % len(styles)],
                    label=f"|{label} - {ref_label}|", linewidth=1.4)
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"|loss - {ref_label}|")
    bottom.grid(True, which="both", alpha=0.3)
    if len(curves) > 1:
        bottom.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
