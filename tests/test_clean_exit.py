"""ODB's helper threads and Gloo group end before the interpreter does (issue 31, item 5; NOTE [ Threads at
interpreter exit ] in odb_core/ranks/sync.py). A Gloo work thread or an ODB thread that returns into Python while
the interpreter finalizes aborts the process ("terminate called without an active exception", SIGABRT) after a
successful run. The 20-launch measurement is `python -m benchmarks.exit_teardown` (docs/benchmarks.md, "Clean
exits"); these tests check the part ODB owns on every run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.lib.exit_runs import launch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GROUP_THREADS = 2  # Gloo work threads of the model's own process group (two per group)


@pytest.mark.slow
@pytest.mark.parametrize("max_steps", [4, -1], ids=["left-mid-epoch", "whole-epoch"])
def test_two_rank_hf_run_ends_with_no_odb_thread_or_gloo_group_and_exits_0(max_steps):
    """torchrun, 2 CPU ranks, ODBCallback, ended as the guides say (barrier, destroy_process_group): after train()
    no `odb-*` thread is alive and only the model's process group has Gloo work threads (the old code left the
    heartbeat, the courier and ODB's group running into interpreter teardown); the launch exits 0. max_steps=4
    stops inside ODB's epoch, so `close()` first leaves it: an ODB collective right before the end."""
    run = launch(odb=True, end="barrier-destroy", max_steps=max_steps)
    assert [fact["steps"] for fact in run.facts] == [4 if max_steps > 0 else 6] * 2, run.tail
    for fact in run.facts:
        assert fact["odb_threads"] == [] and fact["gloo_work_threads"] == DEFAULT_GROUP_THREADS, run.facts
    assert run.clean, run.tail
    assert run.ignored_errors == 0, run.tail  # before: the loader's finalizer closed the move lane again at exit


EXIT_PROBE = textwrap.dedent("""
    import atexit, os, threading

    def gloo_work_threads():
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{task}/comm").read().strip())
            except OSError:
                pass
        return names.count("pt_gloo_runloop")

    # registered before odb_core is imported, so it runs after ODB's own exit hooks
    atexit.register(lambda: print("at exit:", sorted(t.name for t in threading.enumerate() if t.name != "MainThread"),
                                  gloo_work_threads(), flush=True))

    import torch.distributed as dist
    from odb_core import GlooTransport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    closed = GlooTransport(timeout_s=30)
    assert closed.all_gather([7]) == [[7]]
    closed.close()
    try:
        closed.all_gather([7])
    except RuntimeError as exc:
        print("after close:", exc, flush=True)
    left_open = GlooTransport(timeout_s=30)
    assert left_open.all_reduce_sum([1, 2]) == [1, 2]
    print("before exit:", sorted(t.name for t in threading.enumerate() if t.name != "MainThread"), gloo_work_threads(),
          flush=True)
""")


def test_a_transport_left_open_is_closed_by_odbs_exit_hook_and_a_closed_one_refuses_collectives(tmp_path):
    """One process (gloo, world size 1): a closed transport's next collective names the cause; a transport never
    closed has its courier thread and its Gloo group ended by the atexit hook, before the interpreter finalizes
    (the old code left both, and a closed transport's group, to interpreter teardown)."""
    from resume_launch import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in done.stdout.splitlines()}
    assert "ODB's transport is closed (ODBDataLoader.close())" in lines["after close"]
    threads, work_threads = lines["before exit"].rsplit(" ", 1)
    assert threads == "['odb-collective']" and int(work_threads) > DEFAULT_GROUP_THREADS  # the open transport's
    assert lines["at exit"] == f"[] {DEFAULT_GROUP_THREADS}"  # only the default group's (new_group started them)


CLOSED_THEN_KEPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from conftest import LengthDataset
    from odb_core import ODBDataLoader

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # a module global, as in a script: the loader lives into interpreter teardown, where its finalizer runs
    loader = ODBDataLoader(LengthDataset([20 + (i * 37) % 200 for i in range(120)]), token_budget=512, window=16)
    if sum(1 for _ in loader) > 0 and loader._lane is not None:  # the premise, one file per rank
        open(f"lane{rank}", "w").close()
    loader.close()
    dist.destroy_process_group()
""")


def test_a_closed_loader_kept_to_interpreter_exit_ends_without_an_ignored_error(tmp_path):
    """Two torchrun ranks under global planning (a move lane): the loader is closed, then kept as a module global
    until the interpreter ends. Its finalizer closes again, and the lane shut down its thread a second time while
    the interpreter tore its modules down: "Exception ignored in ODBDataLoader.__del__ ... AttributeError:
    'NoneType' object has no attribute 'Empty'" on every rank of a review's runs. A closed lane has no thread."""
    script = tmp_path / "closed_then_kept.py"
    script.write_text(CLOSED_THEN_KEPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert sorted(path.name for path in tmp_path.glob("lane*")) == ["lane0", "lane1"], output[-3000:]  # premise
    assert "Exception ignored" not in output, output[-3000:]
