"""Multi-process jobs launched by tests/test_distributed.py and tests/test_faults.py (not a test module).

Each job is a real Gloo cluster on 127.0.0.1. The test writes a `Case` to `case.json`, launches the ranks and
reads back one `rank{r}.json` per rank; every assertion runs in the test process, none in the ranks.

    python tests/dist_cases.py rank  CASE_JSON OUT_DIR   # one rank; RANK/WORLD_SIZE/MASTER_* from the environment
                                                         # (started per rank by the test, or by torchrun)
    python tests/dist_cases.py spawn CASE_JSON OUT_DIR   # every rank, via torch.multiprocessing.spawn
    python tests/dist_cases.py interrupt                 # iterate a slow loader until SIGINT (Ctrl-C test)

The launching helpers (`run_job`, `free_port`, the /proc scans) live here too, so both test files share them.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
if str(TESTS_DIR) not in sys.path:  # `conftest` is importable in every launched process
    sys.path.insert(0, str(TESTS_DIR))

import torch  # noqa: E402
from torch.utils.data import get_worker_info  # noqa: E402

from conftest import LengthDataset  # noqa: E402

IGNORE_INDEX = -100
INIT_TIMEOUT_S = 60.0
EXIT_CODE_OF_DEAD_RANK = 17


# -- datasets ---------------------------------------------------------------------------------------------------
def rank_skewed_lengths(n: int, world_size: int) -> list[int]:
    """Index i lands on rank i % W under ODB's default sharding; rank r gets lengths near 12 + 150 r.

    With W=2 this alternates short (even index) and long (odd index) samples: rank 0 only short, rank 1 only long.
    """
    return [12 + 150 * (i % world_size) + (i * 7) % 40 for i in range(n)]


def mixed_lengths(n: int) -> list[int]:
    """Deterministic spread of lengths in [8, 400] with no rank pattern."""
    return [8 + (i * 7919) % 393 for i in range(n)]


class SlowDataset(LengthDataset):
    """A `LengthDataset` whose every fetch takes `delay_s` (keeps an epoch running for the interrupt test)."""

    def __init__(self, lengths: list[int], delay_s: float) -> None:
        super().__init__(lengths)
        self.delay_s = delay_s

    def __getitem__(self, index: int) -> dict:
        time.sleep(self.delay_s)
        return super().__getitem__(index)


class KillWorkerDataset(LengthDataset):
    """SIGKILLs the DataLoader worker process that fetches `kill_index` (never the main process)."""

    def __init__(self, lengths: list[int], kill_index: int) -> None:
        super().__init__(lengths)
        self.kill_index = kill_index

    def __getitem__(self, index: int) -> dict:
        if index == self.kill_index and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class RaisingDataset(LengthDataset):
    """`__getitem__(bad_index)` raises ValueError; every other index is an ordinary sample."""

    def __init__(self, lengths: list[int], bad_index: int) -> None:
        super().__init__(lengths)
        self.bad_index = bad_index

    def __getitem__(self, index: int) -> dict:
        if index == self.bad_index:
            raise ValueError(f"corrupt record {index}")
        return super().__getitem__(index)


class ImagesFromDataset(LengthDataset):
    """Samples from index `first_image` on carry an image (4 patch rows per text token, grid 1 x 2 x 2n), the
    ones before are text-only: a VLM mix whose first samples have no image."""

    def __init__(self, lengths: list[int], first_image: int, width: int = 6) -> None:
        super().__init__(lengths)
        self.first_image, self.width = first_image, width

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        if index >= self.first_image:
            n = len(sample["input_ids"])
            sample.update(pixel_values=torch.full((4 * n, self.width), float(index)),
                          image_grid_thw=torch.tensor([[1, 2, 2 * n]]))
        return sample


# -- the job description ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Case:
    """One launched job. `lengths` is the whole dataset; `sampler` is `odb` (ODB's own sharding) or `distributed`
    (a shuffling `DistributedSampler`, which pads with repeated indices when W does not divide the size).

    `fault` makes rank `fault_rank` leave after `fault_after` steps: `exit` kills it with os._exit, `stall` keeps it
    alive but no longer iterating, `error-then-close` has its dataset raise at the middle of its shard and its loop
    close the loader after the error (a `finally:`) and stay alive, `step-error-then-close` the same with the error
    raised by its own loop after `fault_after` steps (the training step, not the loader), `kill-rank` SIGKILLs it,
    `kill-worker-then-rank` SIGKILLs one of its DataLoader workers and then it, `freeze` stops it (SIGSTOP: alive,
    sockets open, silent) and kills it later. The other ranks then record the error they get instead of the epoch."""

    world_size: int
    lengths: list[int]
    token_budget: int = 2048
    join: bool = True
    num_workers: int = 0
    context: str | None = None
    persistent_workers: bool = False
    sampler: str = "odb"
    shuffle: bool = False
    accumulation_steps: int = 1
    window: int = 24
    prefetch_steps: int = 2
    epochs: int = 1
    sync_timeout_s: float = 60.0
    liveness_timeout_s: float = 30.0
    fault: str | None = None
    fault_rank: int = 1
    fault_after: int = 3
    stall_s: float = 30.0
    first_image: int | None = None  # an ImagesFromDataset from this index on (None: a plain LengthDataset)
    image_width: int = 6  # its pixel rows' width (4 rows per token)
    planning: str = "global"
    move: str = "auto"
    workers_by_rank: list[int] | None = None  # per-rank num_workers (overrides num_workers)
    break_after: int | None = None  # epoch 0 stops after this many steps (a `break`); the next epoch runs whole
    break_skew_s: float = 0.0  # rank 1 waits this long before it breaks
    options_by_rank: dict[str, dict[str, Any]] | None = None  # per-rank loader options over the case's ("1": {...})
    record_errors: bool = False  # every rank records the error its epoch ends with, as survivors do
    step_s_by_rank: list[float] | None = None  # per-rank seconds each step "trains" (a sleep after each batch)
    record_carried: bool = False  # each epoch records the tensors its workers' regions and files carried so far

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | Path) -> Case:
        return cls(**json.loads(Path(path).read_text()))


def build_loader(case: Case, rank: int) -> Any:
    from torch.utils.data import DistributedSampler

    from odb_core import ODBDataLoader

    if case.fault == "error-then-close" and rank == case.fault_rank:
        dataset = RaisingDataset(case.lengths, bad_index=-1)  # its index is set once the shard is known
    elif case.first_image is None:
        dataset = LengthDataset(case.lengths)
    else:
        dataset = ImagesFromDataset(case.lengths, case.first_image, case.image_width)
    sampler = None
    if case.sampler == "distributed":
        sampler = DistributedSampler(dataset, num_replicas=case.world_size, rank=rank, shuffle=True, seed=3)
    workers = case.workers_by_rank[rank] if case.workers_by_rank is not None else case.num_workers
    worker_options: dict[str, Any] = {}
    if workers > 0:
        worker_options = {"multiprocessing_context": case.context, "persistent_workers": case.persistent_workers}
    options = dict(token_budget=case.token_budget, join=case.join, num_workers=workers, move=case.move,
                   sampler=sampler, shuffle=case.shuffle, accumulation_steps=case.accumulation_steps,
                   window=case.window, prefetch_steps=case.prefetch_steps, planning=case.planning,
                   sync_timeout_s=case.sync_timeout_s, liveness_timeout_s=case.liveness_timeout_s, **worker_options)
    return ODBDataLoader(dataset, **{**options, **(case.options_by_rank or {}).get(str(rank), {})})


def step_record(batch: Any) -> dict[str, Any]:
    info = batch.info
    labels = batch["labels"]
    rows, width = batch["input_ids"].shape
    return {"step": info.step, "indices": list(info.indices), "is_idle": info.is_idle,
            "local_samples": info.local_samples, "global_samples": info.global_samples,
            "local_tokens": info.local_tokens, "global_tokens": info.global_tokens,
            "local_input_tokens": info.local_input_tokens, "global_input_tokens": info.global_input_tokens,
            "window_tokens": info.window_tokens, "rows": rows, "width": width,
            "pixel_rows": int(batch["pixel_values"].shape[0]) if "pixel_values" in batch else 0,
            "pixel_sum": float(batch["pixel_values"].double().sum()) if "pixel_values" in batch else 0.0,
            "local_patches": info.local_patches, "global_patches": info.global_patches,
            "labels_all_ignored": bool((labels == IGNORE_INDEX).all())}


# -- rank side ---------------------------------------------------------------------------------------------------
def _write(out_dir: Path, name: str, payload: dict[str, Any]) -> None:
    tmp = out_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(out_dir / name)  # atomic: the test never reads half a file


def _epochs(loader: Any, case: Case, rank: int) -> list[dict[str, Any]]:
    epochs = []
    for epoch in range(case.epochs):
        steps = []
        for batch in loader:
            steps.append(step_record(batch))
            if case.step_s_by_rank is not None:
                time.sleep(case.step_s_by_rank[rank])
            if epoch == 0 and len(steps) == case.break_after:
                time.sleep(case.break_skew_s if rank == 1 else 0.0)
                steps[-1]["planned_ahead_at_break"] = _planned_ahead(loader)
                break
        report = loader.last_report
        epochs.append({"steps": steps, "sampler": [int(i) for i in loader.sampler],
                       "not_emitted": list(report.not_emitted) if report else None,
                       "report_steps": report.steps if report else None,
                       "unread_chunks_remaining": report.unread_chunks_remaining if report else None,
                       "moved_samples": loader.metrics.moved_samples})
        if case.step_s_by_rank is not None:  # wall times: only where a test asks (records are compared whole)
            epochs[-1]["waits"] = {name: getattr(loader.metrics, name)  # cumulative over the epochs so far
                                   for name in ("wait_seconds", "read_seconds", "sync_seconds")}
            epochs[-1]["advice"] = dict(report.advice) if report else {}  # NOTE [ Which lever ]
        if case.record_carried:  # cumulative while the inbox lives (persistent workers: the whole run)
            inbox = loader._stream._watch.inbox
            epochs[-1]["carried"] = {"regions": inbox.regions.tensors, "files": inbox.files}
    return epochs


def _planned_ahead(loader: Any) -> bool:
    """Whether the epoch being left has run its next round ahead (NOTE [ Planning the next round ahead ]): a test
    that breaks at a round's last step checks that it covered that path (read from the loader's insides)."""
    run = getattr(loader._current, "run", None)
    return run is not None and run.round_ahead.pending


def _leave(loader: Any, case: Case, rank: int, out_dir: Path) -> None:
    """The faulty rank: take `fault_after` steps, note the time, then die, or stall (alive, not iterating; its
    producer thread stops once its prefetch queue is full) until the survivors have reported."""
    it = iter(loader)
    for _ in range(case.fault_after):
        next(it)
    workers = child_pids(os.getpid())
    _write(out_dir, f"rank{rank}.json", {"rank": rank, "left_at": time.time(), "fault": case.fault,
                                         "workers": workers, "pid": os.getpid()})
    if case.fault == "exit":
        os._exit(EXIT_CODE_OF_DEAD_RANK)
    if case.fault == "kill-worker-then-rank":  # one worker dies, then its rank; the other worker is an orphan
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(0.2)
    if case.fault in ("kill-rank", "kill-worker-then-rank"):
        os.kill(os.getpid(), signal.SIGKILL)
    if case.fault == "freeze":  # frozen with its sockets open (SIGSTOP), killed by a sidecar once every survivor
        # reported (each raised while it was still frozen), or once stall_s passed
        reported = " && ".join(f"[ -e {shlex.quote(str(out_dir / f'rank{r}.json'))} ]"
                               for r in range(case.world_size) if r != rank)
        subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; i=0; while [ $i -lt {int(case.stall_s * 10)} ] && "
                                      f"! ( {reported} ); do sleep 0.1; i=$((i+1)); done; kill -KILL {os.getpid()}"])
        time.sleep(case.stall_s + 5)
    _stay_until_reported(case, rank, out_dir)


def _stay_until_reported(case: Case, rank: int, out_dir: Path) -> None:
    """Stall, alive, until every survivor reported (or `stall_s` passed), then exit."""
    peers = [out_dir / f"rank{r}.json" for r in range(case.world_size) if r != rank]
    deadline = time.monotonic() + case.stall_s
    while time.monotonic() < deadline and not all(p.exists() for p in peers):
        time.sleep(0.1)
    os._exit(0)


class StepFailed(RuntimeError):
    """The training step's own error in `step-error-then-close`."""


def _fail_then_close(loader: Any, case: Case, rank: int, out_dir: Path) -> None:
    """The faulty rank of `error-then-close` (its epoch raises mid-shard) and `step-error-then-close` (its own loop
    raises after `fault_after` steps): the loop closes the loader while the error propagates (a `finally:`), and
    the rank stays alive until the survivors have reported (or `stall_s` passed)."""
    if case.fault == "error-then-close":
        order = [int(i) for i in loader.sampler]
        loader.dataset.bad_index = order[len(order) // 2]
    outcome: dict[str, Any] = {"rank": rank, "fault": case.fault}
    try:
        try:
            for steps, _ in enumerate(loader, start=1):
                if case.fault == "step-error-then-close" and steps == case.fault_after:
                    raise StepFailed(f"the training step failed at step {steps}")
        finally:
            outcome.update(left_at=time.time())
            loader.close()
    except Exception as exc:  # noqa: BLE001 - recorded; the peers must now get an error too
        outcome.update(error_type=type(exc).__name__)
    _write(out_dir, f"rank{rank}.json", outcome)
    _stay_until_reported(case, rank, out_dir)


def _survive(loader: Any, rank: int, out_dir: Path) -> None:
    """A healthy rank next to a faulty one: record how the epoch ended and how long the failing next() took."""
    from odb_core import PeerError

    steps, last = 0, time.monotonic()
    outcome: dict[str, Any] = {"rank": rank, "error_type": None, "pid": os.getpid()}
    try:
        for _ in loader:
            steps, last = steps + 1, time.monotonic()
    except Exception as exc:  # noqa: BLE001 - the test asserts on what was raised
        outcome.update(error_type=type(exc).__name__, is_peer_error=isinstance(exc, PeerError), message=str(exc),
                       raised_at=time.time(), blocked_s=time.monotonic() - last)
    outcome["steps"] = steps
    _write(out_dir, f"rank{rank}.json", outcome)
    os._exit(0)  # a clean destroy_process_group would wait on the dead peer


def run_rank(rank: int, case: Case, out_dir: Path) -> None:
    """Body of one rank; the default group comes from MASTER_ADDR/MASTER_PORT (env://)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=case.world_size,
                            timeout=timedelta(seconds=INIT_TIMEOUT_S))
    loader = build_loader(case, rank)
    if case.fault in ("error-then-close", "step-error-then-close") and rank == case.fault_rank:
        _fail_then_close(loader, case, rank, out_dir)
    if case.fault is not None and rank == case.fault_rank:
        _leave(loader, case, rank, out_dir)
    if case.fault is not None or case.record_errors:
        _survive(loader, rank, out_dir)
    epochs = _epochs(loader, case, rank)
    lane = getattr(loader, "_lane", None)  # the move lane's own bytes (frames, or their descriptors)
    lane_bytes = lane.transport.stats.bytes_sent if lane is not None and lane.transport is not None else None
    _write(out_dir, f"rank{rank}.json", {"rank": rank, "epochs": epochs, "pid": os.getpid(),
                                         "lane_bytes_sent": lane_bytes})
    loader.close()
    dist.destroy_process_group()


def _spawn_entry(rank: int, case: Case, out_dir: str) -> None:
    run_rank(rank, case, Path(out_dir))


def run_interrupt() -> None:
    """Iterate a slow loader (2 workers, background producer) and report the worker pids, until SIGINT."""
    from odb_core import ODBDataLoader

    # Python's own Ctrl-C handler, whatever this process inherited: a shell without job control starts background
    # jobs with SIGINT ignored, and a test suite run as one (`make test &`) passed that on to this child
    signal.signal(signal.SIGINT, signal.default_int_handler)
    loader = ODBDataLoader(SlowDataset(mixed_lengths(4000), delay_s=0.01), token_budget=1024, num_workers=2,
                           prefetch_steps=2, window=16, multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    print("WORKERS", *child_pids(os.getpid()), flush=True)
    for _ in it:
        pass
    print("EPOCH ENDED BEFORE SIGINT", flush=True)


# -- launch side (used by the tests) -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@dataclass(frozen=True)
class JobResult:
    """What came back from a job: per-rank JSON records (by rank), exit codes and the captured output."""

    records: dict[int, dict[str, Any]]
    returncodes: list[int | None]
    output: str
    wall_s: float
    timed_out: bool


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for every process; on timeout SIGKILL each one's process group. Returns whether it timed out."""
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc in procs:
        _kill_group(proc)  # also reaps anything a rank left behind (DataLoader workers of a killed rank)
        proc.wait()
    return timed_out


def _commands(case: Case, launcher: str, case_path: Path, out_dir: Path, port: int) -> list[tuple[list[str], dict]]:
    script = str(TESTS_DIR / "dist_cases.py")
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if launcher == "spawn":
        return [([sys.executable, script, "spawn", str(case_path), str(out_dir)], child_env(**master))]
    if launcher == "torchrun":
        return [([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={case.world_size}",
                  "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}", script, "rank",
                  str(case_path), str(out_dir)], child_env())]
    assert launcher == "env", launcher
    w = str(case.world_size)
    return [([sys.executable, script, "rank", str(case_path), str(out_dir)],
             child_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=w, LOCAL_WORLD_SIZE=w, **master))
            for r in range(case.world_size)]


def run_job(case: Case, launcher: str, tmp_dir: Path, timeout_s: float = 90.0) -> JobResult:
    """Launch `case` with `launcher` (`env`: one process per rank with torchrun's variables; `torchrun`:
    `python -m torch.distributed.run`; `spawn`: `torch.multiprocessing.spawn`) and collect the rank records.
    Every process gets its own session, so a timeout kills it and everything it started."""
    out_dir = tmp_dir / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    case_path = tmp_dir / "case.json"
    case.save(case_path)
    logs = [tmp_dir / f"launch{k}.log" for k in range(case.world_size)]
    start = time.monotonic()
    procs = []
    for (cmd, env), log in zip(_commands(case, launcher, case_path, out_dir, free_port()), logs):
        with log.open("wb") as sink:
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    timed_out = _wait_all(procs, timeout_s)
    output = "\n".join(log.read_text(errors="replace") for log in logs if log.exists())
    records = {}
    for path in out_dir.glob("rank*.json"):
        record = json.loads(path.read_text())
        records[record["rank"]] = record
    return JobResult(records=records, returncodes=[p.returncode for p in procs], output=output,
                     wall_s=time.monotonic() - start, timed_out=timed_out)


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses
    return fields[0], int(fields[1])


def is_alive(pid: int) -> bool:
    """Running or sleeping (a zombie has exited and only waits to be reaped)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def child_pids(pid: int) -> list[int]:
    """Live direct children of `pid` (scans /proc; psutil is not a dependency)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
                children.append(int(entry.name))
    return sorted(children)


def wait_until(predicate: Any, timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "interrupt":
        run_interrupt()
        return
    case, out_dir = Case.load(argv[1]), Path(argv[2])
    if mode == "rank":
        run_rank(int(os.environ["RANK"]), case, out_dir)
    elif mode == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawn_entry, args=(case, str(out_dir)), nprocs=case.world_size, join=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}; use rank, spawn or interrupt")


if __name__ == "__main__":
    main(sys.argv[1:])


def image_runs(tmp_dir: Path, settings: dict[str, dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Two real Gloo ranks, each with 2 forked workers reading 1 MiB images under global planning, once per named
    loader `settings` (both ranks alike): each run's rank records."""
    runs = {}
    for name, options in settings.items():
        case = Case(world_size=2, lengths=mixed_lengths(160), window=32, shuffle=True, first_image=40, epochs=2,
                    num_workers=2, context="fork", image_width=512, options_by_rank={"0": options, "1": options})
        result = run_job(case, "env", tmp_dir / name, timeout_s=300)
        assert not result.timed_out and result.returncodes == [0, 0], result.output[-4000:]
        assert sorted(result.records) == [0, 1], result.output[-4000:]
        runs[name] = result.records
    return runs
