#!/usr/bin/python3
"""The invariant mode's cost in laga_torch (a benchmark, not a test: it
asserts nothing; docs/pytorch_invariant.md, "Cost").

    /usr/bin/python3 python/bench_invariant.py [--seq 512 --steps 7 --ranks 1,2]
                                               [--forms laga,explicit] [--attention eager]

Per form and P: forward + backward + sync_gradients (float32, gloo, ranks as
processes, one thread each) with invariant=False and invariant=True on the
same module weights and input, the two runs alternating step by step; the
median over the steps after the first (warm-up) of each, and their ratio,
in wall time and in rank 0's CPU time (on a shared machine the CPU time is
the less disturbed of the two); then one more step of each with a ledger:
the bytes rank 0 sends in backward and in the gradients' sync, off and on.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONFIG = {"dim": 512, "n_heads": 8, "q_lora_rank": 96, "kv_lora_rank": 128,
          "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "max_seq_len": 8192}


def rank_main(a):
    import torch
    import torch.distributed as dist
    import laga_torch as lt
    P, r = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = lt.MLAConfig.from_json(dict(CONFIG, dim=a.dim))
    pos = lt.SpLayout.even(a.seq, cfg.n_heads, P).positions(r)
    out = {}
    for form in a.forms.split(","):
        mods = {}
        for inv in (False, True):
            torch.manual_seed(0)
            mods[inv] = lt.MLA(cfg, form=form, attention=a.attention, invariant=inv)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(a.batch, a.seq, cfg.dim, generator=g)[:, pos].contiguous()
        times = {False: [], True: []}
        cpu = {False: [], True: []}
        for _ in range(a.steps):
            for inv in (False, True):  # alternating
                m = mods[inv]
                m.zero_grad(set_to_none=True)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                m(x, seq_len=a.seq).sum().backward()
                lt.sync_gradients(m)
                c1 = time.process_time()
                dist.barrier()
                times[inv].append(time.perf_counter() - t0)
                cpu[inv].append(c1 - c0)
        out[form] = {str(k): statistics.median(v[1:]) for k, v in times.items()}
        out[form].update({"cpu" + str(k): statistics.median(v[1:]) for k, v in cpu.items()})
        for inv in (False, True):
            m = mods[inv]
            m.zero_grad(set_to_none=True)
            m.ledger = led = lt.Ledger()
            m(x, seq_len=a.seq).sum().backward()
            lt.sync_gradients(m, ledger=led)
            out[form]["sent" + str(inv)] = sum(v["sent"] for (ph, _), v in led.rows.items()
                                               if ph != "forward")
    if r == 0:
        print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--forms", default="explicit,absorbed,laga,laga_fused,allgather_kv")
    ap.add_argument("--attention", default="eager")
    ap.add_argument("--rank-main", action="store_true")
    a = ap.parse_args()
    if a.rank_main:
        return rank_main(a)
    print(f"float32, D {a.dim}, S {a.seq}, B {a.batch}, attention {a.attention}, one thread a "
          f"rank, median of {a.steps - 1} steps after one warm-up, off and on alternating")
    print(f"{'form':12} {'P':>2} {'off ms':>9} {'on ms':>9} {'on/off':>7} {'off cpu':>9} "
          f"{'on cpu':>9} {'on/off':>7} {'off bwd B':>11} {'on bwd B':>11}")
    for P in map(int, a.ranks.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for r in range(P):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(P), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main"] + sys.argv[1:],
                                          env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate()[0] for p in procs]
        res = json.loads(outs[0].strip().splitlines()[-1])
        for form, t in res.items():
            off, on = t["False"] * 1e3, t["True"] * 1e3
            coff, con = t["cpuFalse"] * 1e3, t["cpuTrue"] * 1e3
            print(f"{form:12} {P:>2} {off:9.1f} {on:9.1f} {on / off:7.2f} {coff:9.1f} "
                  f"{con:9.1f} {con / coff:7.2f} {t['sentFalse']:11d} {t['sentTrue']:11d}")


if __name__ == "__main__":
    main()
