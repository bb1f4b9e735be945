"""The package tests' torch.distributed ranks, started the one way they all
use: P processes of the test's own script with `--worker [WHAT] --rank r
--world P --port PORT` appended (gloo on a free loopback port), waited for
within one time budget, the survivors killed on the way out, and one
message (through the test's `fail`) naming what ran past its time or
exited non-zero."""
import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time

import torch.distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script, argv, P, timeout, fail, what="ranks", hang_hint=""):
    """Runs `script argv --worker ... --rank r --world P --port PORT` for r
    in 0..P-1 (argv ends with "--worker" and its value, if any) with
    OMP_NUM_THREADS=1, and returns when all exited 0; else calls fail.
    PYTHONFAULTHANDLER=1: a rank killed by a signal (SIGABRT from a C++
    std::terminate inside torch or gloo) prints every thread's Python stack,
    so the log says whether it died computing or tearing down."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script] + list(argv) +
                              ["--rank", str(r), "--world", str(P), "--port", str(port)],
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"))
             for r in range(P)]
    t0 = time.time()
    try:
        for p in procs:
            p.wait(timeout=max(1, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        fail(f"{what} at P {P} ran past {timeout} s{hang_hint}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        fail(f"{what} at P {P} exited {[exit_name(p.returncode) for p in procs]}")


def exit_name(code):
    """A rank's exit status as a reader wants it: 0, 1, or the signal's name
    (Popen gives -6 for SIGABRT)."""
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return code


def end_ranks():
    """A worker's last step, after its results are written: a barrier, so
    that no rank shuts its gloo process group down (closing its sockets)
    while another still has a transfer of the last collective to finish;
    destroy_process_group; then the process ends at once (os._exit, after
    flushing stdout and stderr), without the interpreter's finalization.
    Why: one CI run (2026-12-07, torch 2.15) lost rank 0 of a torch 2 test
    to "terminate called without an active exception" (SIGABRT) after the
    other rank had exited 0, so after its last collective; torch's own
    tracker (pytorch PR 179291) describes that abort: gloo's C++ threads
    releasing tensors that hold Python references while the interpreter is
    finalizing. Not reproduced here in 78 runs of that test (10 of them
    beside two busy loops). gloo's monitored barrier names, within 120 s, a
    rank that failed before reaching it, rather than leaving the others
    waiting for gloo's 30-minute default."""
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_counts(text):
    """--ps's value: a comma-separated list of rank counts, each >= 1."""
    try:
        ps = tuple(int(v) for v in text.split(","))
    except ValueError:
        ps = ()
    if not ps or min(ps) < 1 or list(ps) != sorted(set(ps)):
        raise argparse.ArgumentTypeError(
            f"--ps {text!r}: give rank counts >= 1, comma-separated, ascending, e.g. 1,3")
    return ps


def parse_rank_args(worker_takes_value=False):
    """The command line run_ranks gives a worker, and the test's own: LAGA
    DIR, then --worker (a flag, or with worker_takes_value the part to run)
    --rank r --world P --port PORT. --ps P,P,...: the rank counts to run, for
    a test that takes them (None when not given: the test's own list); a
    torch 2 twin runs fewer where its torch 1.13 run covers the rest
    (TORCH2_ARGS, tests/CMakeLists.txt)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ps", type=rank_counts)
    ap.add_argument("laga", nargs="?")
    ap.add_argument("dir", nargs="?")
    if worker_takes_value:
        ap.add_argument("--worker")
    else:
        ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    return ap.parse_args()
