#!/usr/bin/python3
"""Real English text as byte-level tokens for `laga train` (vocab 256).

    python3 scripts/text_data.py OUT_DIR [SOURCE ...]

SOURCE (default /usr/share/games/fortunes, Debian's `fortunes` package:
about 2.4 MB of English quotations) is a file or a directory whose regular
files are read in name order (links and the `.dat` indexes of fortune(6)
skipped). The bytes are concatenated; the last 5% are the held-out split.
Writes OUT_DIR/train.u16 and OUT_DIR/val.u16 (one uint16 id per byte, what
`--data-dtype u16` reads) and OUT_DIR/text_data.json: the sources, the sizes
and the unigram baseline, the bits per byte of the validation split under
the training split's byte frequencies (add-one smoothed): what a model that
knows nothing of context achieves, the bar docs/convergence.md compares to.
"""
import json
import math
import os
import struct
import sys


def sources(paths):
    for p in paths:
        if os.path.isdir(p):
            for name in sorted(os.listdir(p)):
                f = os.path.join(p, name)
                if os.path.isfile(f) and not os.path.islink(f) and not name.endswith(".dat"):
                    yield f
        elif os.path.isfile(p):
            yield p
        else:
            sys.exit(f"text_data.py: '{p}' is neither a file nor a directory")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    paths = sys.argv[2:] or ["/usr/share/games/fortunes"]
    files = list(sources(paths))
    if not files:
        sys.exit(f"text_data.py: no text in {paths} (Debian: apt-get install fortunes)")
    data = b"".join(open(f, "rb").read() for f in files)
    cut = len(data) - len(data) // 20
    train, val = data[:cut], data[cut:]
    os.makedirs(out, exist_ok=True)
    for name, part in (("train.u16", train), ("val.u16", val)):
        with open(os.path.join(out, name), "wb") as f:
            f.write(struct.pack(f"<{len(part)}H", *part))
    counts = [1] * 256
    for b in train:
        counts[b] += 1
    total = sum(counts)
    bits = -sum(math.log2(counts[b] / total) for b in val) / len(val)
    info = {"sources": files, "bytes": len(data), "train_bytes": len(train),
            "val_bytes": len(val), "unigram_val_bits_per_byte": bits}
    with open(os.path.join(out, "text_data.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps({k: v for k, v in info.items() if k != "sources"}))


if __name__ == "__main__":
    main()
