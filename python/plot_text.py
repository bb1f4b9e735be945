#!/usr/bin/python3
"""The real-text run's curves (python/train_text.sh) in bits per byte.

    plot_text.py --out text.png --data text_data.json LABEL=FILE.jsonl ...

Top: training and validation loss of each log in bits per byte (loss / ln 2:
one token is one byte), with the unigram baseline of text_data.json. Bottom:
|val - the first log's val| per validation. Prints a table: last train and
validation bits per byte, the margin below the unigram baseline, and the
largest validation difference from the first log.
"""
import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    train, val = {}, {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                train[r["step"]] = r["loss"] / math.log(2)
                if "val_loss" in r:
                    val[r["step"]] = r["val_loss"] / math.log(2)
    return train, val


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", required=True, help="text_data.json of scripts/text_data.py")
    a = ap.parse_args()
    with open(a.data) as f:
        unigram = json.load(f)["unigram_val_bits_per_byte"]
    curves = []
    for item in a.logs:
        label, _, path = item.rpartition("=")
        curves.append((label or os.path.basename(path), *read(path)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ref_val = curves[0][2]
    print(f"unigram baseline (validation): {unigram:.4f} bits/byte")
    print(f"{'run':<16} {'train b/B':>10} {'val b/B':>10} {'below unigram':>14} {'max |dval|':>11}")
    for label, train, val in curves:
        s = sorted(train)
        top.plot(s, [train[k] for k in s], lw=0.8, alpha=0.6, label=f"{label} train")
        v = sorted(val)
        top.plot(v, [val[k] for k in v], marker="o", ms=3, label=f"{label} validation")
        diffs = [abs(val[k] - ref_val[k]) for k in v if k in ref_val]
        if label != curves[0][0]:
            bottom.semilogy(v, [max(abs(val[k] - ref_val.get(k, val[k])), 1e-12) for k in v],
                            marker="o", ms=3, label=label)
        last = v[-1]
        print(f"{label:<16} {train[s[-1]]:>10.4f} {val[last]:>10.4f} {unigram - val[last]:>14.4f} "
              f"{max(diffs) if diffs else 0:>11.2e}")
    top.axhline(unigram, color="k", ls="--", lw=0.8, label="unigram baseline")
    top.set_ylabel("bits per byte")
    top.set_title("MLA LM on Debian's fortunes (bytes): train and held-out loss per form")
    top.legend(fontsize=7, ncol=2)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"|val - {curves[0][0]}| (bits/byte)")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
