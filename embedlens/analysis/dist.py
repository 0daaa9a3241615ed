"""Runs split over processes under torchrun (`torch.distributed`): `lens --prompts` and `tune`.

Imported only when the environment says WORLD_SIZE > 1 (`runtime.world`): run alone, nothing here
runs and no process group exists.

A `Session` holds three things: the store torchrun's rendezvous serves (MASTER_ADDR:MASTER_PORT),
through which a failing process tells the others; a watchdog thread that polls it; and the
process group (gloo; with NCCL, CUDA tensors go through NCCL and the rest through gloo). Every
collective call waits polled, so that a process never sits in one while another has failed, and
gives up after EMBEDLENS_DIST_TIMEOUT seconds (600 by default) without an answer. So an object
a call carries is pickled into a byte tensor sent by the collectives' `async_op=True` form, not
by torch's object collectives (`all_gather_object`, `gather_object`, `broadcast_object_list`):
those block, and a process inside one could neither take up another's failure nor give up.

The failure protocol: the run's first failure is recorded in the store (`fail`: its rank,
message, hint and exit status). Rank 0 says it, on one `error:` line, then marks the store
`done`; the other processes say nothing and end once `done` is there, at most DONE_WAIT_S later
(torchrun stops every process as soon as one exits: none leaves before rank 0 has spoken). A
process learns of another's failure from its watchdog, at its next collective call or `check`;
on the command line, when the main thread is busy elsewhere (loading a model) for GRACE_S
seconds more, the watchdog ends the process itself (`on_stuck`).
"""

from __future__ import annotations

import _thread
import datetime
import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore

from embedlens.errors import (
    EmbedlensError,
    RankFailed,
    RankInterrupted,
    RankUsageError,
    UsageError,
)
from embedlens.runtime import world

TIMEOUT_VAR = "EMBEDLENS_DIST_TIMEOUT"
TIMEOUT_S = 600.0
"""How long a collective call (and joining the group) waits for every process."""
WATCH_S = 0.2
"""How often the watchdog reads the store."""
GRACE_S = 2.0
"""How long the main thread has to take up another process's failure before it is interrupted."""
DONE_WAIT_S = 10.0
"""How long a process other than rank 0 waits for rank 0 to have said the error."""
LOST_WAIT_S = 3.0
"""After a collective call broke: how long to wait for the failure behind it to be recorded."""
BACKENDS = ("auto", "gloo", "nccl")

Say = Callable[[], None]
_state: dict[str, Any] = {"session": None}
"""This process's session, once `connect` has made it (a process is one rank of one run)."""


def connect() -> Session:
    """This process's session: the store and the watchdog (made on the first call)."""
    if _state["session"] is None:
        rank, size = world()
        _state["session"] = Session(rank, size, timeout())
    session: Session = _state["session"]
    return session


def join(backend: str = "auto", device: str = "cpu") -> Session:
    """The session with its process group started (on the first call), for a new run."""
    session = connect()
    session.start_group(backend, device)
    session.runs += 1
    return session


def check_backend(backend: str) -> None:
    """--dist-backend names one of BACKENDS."""
    if backend not in BACKENDS:
        raise UsageError(
            f"unknown --dist-backend '{backend}'", hint="use one of: " + ", ".join(BACKENDS)
        )


def timeout() -> float:
    """EMBEDLENS_DIST_TIMEOUT in seconds, or TIMEOUT_S."""
    text = os.environ.get(TIMEOUT_VAR)
    if not text:
        return TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{TIMEOUT_VAR}={text!r}: give a number of seconds above 0")
    return value


class Session:
    """One process's part in a split run: the store, the watchdog, the group's calls."""

    def __init__(self, rank: int, size: int, wait_s: float) -> None:
        self.rank, self.size, self.timeout = rank, size, wait_s
        self.backend: str | None = None
        self.runs = 0
        """Runs joined so far (keys of a run's counters carry its number)."""
        self.store = _store(rank, wait_s, master=rank == 0)
        self._watched = _store(rank, wait_s, master=False)
        self.failure: dict[str, Any] | None = None
        """Another process's failure, as the watchdog read it."""
        self.interrupt_when_stuck = False
        """Whether the watchdog interrupts the main thread when it has not taken up another
        process's failure within GRACE_S (the command line's choice)."""
        self._interrupted = False
        self._taken = False
        """Whether the main thread has raised another process's failure itself (`check`)."""
        self._lock = threading.Lock()
        self._ended = False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="embedlens-dist-watch", daemon=True).start()

    # --- the group and its calls ---------------------------------------------------------------

    def start_group(self, backend: str, device: str) -> None:
        """The process group, started once: gloo, or NCCL beside it for CUDA tensors."""
        if self.backend is not None:
            return
        chosen = _backend(backend, device)
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        if torch.cuda.is_available() and device in ("cuda", "auto"):
            torch.cuda.set_device(local % torch.cuda.device_count())
        if not dist.is_initialized():
            spec = "cpu:gloo,cuda:nccl" if chosen == "nccl" else "gloo"
            try:
                dist.init_process_group(
                    spec,
                    store=PrefixStore("group", self.store),
                    rank=self.rank,
                    world_size=self.size,
                    timeout=datetime.timedelta(seconds=self.timeout),
                )
            except RuntimeError as e:
                raise self.lost(e) from None
        self.backend = chosen

    def check(self) -> None:
        """Raise the failure of another process, once the watchdog has seen one (unless the
        watchdog has interrupted the main thread with it: that interrupt is on its way)."""
        if self.failure is None:
            return
        with self._lock:
            if self._interrupted:
                return
            self._taken = True
        raise _failed(self.failure)

    def stuck(self) -> RankFailed | None:
        """The failure the watchdog interrupted the main thread with (its KeyboardInterrupt is
        that failure, not Ctrl-C), else None."""
        if self._interrupted and self.failure is not None:
            return _failed(self.failure)
        return None

    def recorded(self) -> RankFailed | None:
        """Another process's failure, if one is recorded in the store now."""
        record = self.failure
        if record is None:
            with suppress(Exception):
                record = _read(self.store)
        if record is None or record["rank"] == self.rank:
            return None
        return _failed(record)

    def share(self, n: int) -> range:
        """This process's items of n: every size-th from its rank."""
        return range(self.rank, n, self.size)

    def part(self, n: int) -> tuple[int, int]:
        """This process's slice of n rows: a contiguous part, in rank order."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """The sum over processes, in place (through the CPU unless NCCL carries it)."""
        on_cpu = tensor.device.type == "cpu"
        via = tensor if on_cpu or self.backend == "nccl" else tensor.cpu()
        self._wait(dist.all_reduce(via, async_op=True))
        if via is not tensor:
            tensor.copy_(via)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Each value summed over processes (in float64)."""
        summed = torch.tensor(values, dtype=torch.float64)
        self.all_reduce_(summed)
        out: list[float] = summed.tolist()
        return out

    def gather(self, value: object) -> list[Any] | None:
        """Every process's value, in rank order, on rank 0 (None elsewhere)."""
        mine, sizes = self._packed(value)
        if self.rank != 0:
            self._wait(dist.gather(mine, None, dst=0, async_op=True))
            return None
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._wait(dist.gather(mine, parts, dst=0, async_op=True))
        return [_unpacked(p, n) for p, n in zip(parts, sizes, strict=True)]

    def all_gather(self, value: object) -> list[Any]:
        """Every process's value, in rank order, on every process."""
        mine, sizes = self._packed(value)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, mine, async_op=True))
        return [_unpacked(p, n) for p, n in zip(parts, sizes, strict=True)]

    def broadcast(self, value: object) -> Any:
        """Rank 0's value, on every process."""
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(dist.broadcast(size, src=0, async_op=True))
        buffer = torch.zeros(int(size), dtype=torch.uint8)
        if self.rank == 0:
            buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._wait(dist.broadcast(buffer, src=0, async_op=True))
        return _unpacked(buffer, int(size))

    def total(self, name: str, n: int) -> int:
        """Add n to the run's counter `name` (in the store) and return the sum so far, over
        every process: rank 0's progress covers them all."""
        return int(self.store.add(f"count/{self.runs}/{name}", n))

    def _packed(self, value: object) -> tuple[torch.Tensor, list[int]]:
        """value pickled into a byte tensor as long as the longest of every process's, and
        each process's length."""
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(dist.all_gather(sizes, torch.tensor([len(data)]), async_op=True))
        lengths = [int(s) for s in sizes]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return mine, lengths

    def _wait(self, work: dist.Work | None) -> None:
        """Wait for a collective call, polled: another process's failure is raised here, and
        no answer within the timeout is an error."""
        assert work is not None
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while not work.is_completed():
            self.check()
            if time.monotonic() > deadline:
                raise EmbedlensError(
                    f"the other processes did not answer within {self.timeout:g} s",
                    hint=f"a process may be stuck; {TIMEOUT_VAR} sets the wait in seconds",
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        try:
            work.wait()
        except RuntimeError as e:  # the group broke: a process went away
            raise self.lost(e) from None

    def lost(self, error: BaseException) -> EmbedlensError:
        """The error for a broken collective call: the failure behind it, once recorded."""
        deadline = time.monotonic() + LOST_WAIT_S
        while time.monotonic() < deadline:
            record = self.failure or _read(self.store)
            if record is not None and record["rank"] != self.rank:
                return _failed(record)
            time.sleep(WATCH_S)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return EmbedlensError(
            f"another process of the run stopped ({first})",
            hint="its own output says why (killed? out of memory?)",
        )

    # --- failures --------------------------------------------------------------------------

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """A failure inside is told to the other processes (then raised on)."""
        try:
            yield
        except RankFailed:
            raise
        except EmbedlensError as e:
            self.tell(e.message, e.hint, e.exit_code)
            raise
        except KeyboardInterrupt:
            stuck = self.stuck()
            if stuck is not None:
                raise stuck from None
            self.tell("interrupted (Ctrl-C)", None, 130)
            raise
        except Exception as e:
            self.tell(f"internal error: {type(e).__name__}: {e}", None, 1)
            raise

    def tell(self, message: str, hint: str | None, code: int) -> None:
        """Record this process's failure, unless another was recorded first."""
        record = {"rank": self.rank, "message": message, "hint": hint, "code": code}
        with suppress(Exception):  # the store is gone (the launcher is ending the run)
            self.store.compare_set("fail", "", json.dumps(record))

    def end(
        self, message: str, hint: str | None, code: int, *, theirs: bool, say: Say | None
    ) -> bool:
        """This process ends on an error (`theirs`: another process's): rank 0 says it (`say`)
        and marks the run done; another process waits for that, and says its own error only when
        rank 0 never does. False when the process had already ended."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
        self._stop.set()
        if not theirs:
            self.tell(message, hint, code)
        if self.rank == 0:
            if say is not None:
                say()
            with suppress(Exception):
                self.store.set("done", "1")
        elif not self._done_within(DONE_WAIT_S) and not theirs and say is not None:
            say()
        return True

    def _done_within(self, seconds: float) -> bool:
        try:
            self.store.wait(["done"], datetime.timedelta(seconds=seconds))
        except Exception:  # no answer in time, or the store is gone
            return False
        return True

    def _watch(self) -> None:
        """Read the store until another process's failure is there (or this one ends)."""
        while not self._stop.wait(WATCH_S):
            try:
                record = _read(self._watched)
            except Exception:  # the store is gone: the launcher is ending the run
                return
            if record is None:
                continue
            if record["rank"] == self.rank:
                return
            self.failure = record
            if self.interrupt_when_stuck and not self._stop.wait(GRACE_S):
                with self._lock:
                    if self._ended or self._taken:
                        return
                    self._interrupted = True
                _thread.interrupt_main()  # the main thread's own exit path takes it from here
            return


def _backend(asked: str, device: str) -> str:
    """gloo or nccl: auto is NCCL where the model is on CUDA and torch has NCCL, else gloo."""
    check_backend(asked)
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if asked == "auto":
        return "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if asked == "nccl" and not dist.is_nccl_available():
        raise UsageError(
            "--dist-backend nccl: this build of torch has no NCCL", hint="use --dist-backend gloo"
        )
    if asked == "nccl" and not cuda:
        raise UsageError(
            "--dist-backend nccl carries CUDA tensors: the model is not on CUDA",
            hint="add --device cuda, or use --dist-backend gloo",
        )
    return asked


def _store(rank: int, wait_s: float, *, master: bool) -> Store:
    """A client of the run's store (rank 0 serves it when torchrun's agent does not), under a
    prefix of this run's own (torchrun's run id and restart count)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        raise UsageError(
            "WORLD_SIZE is above 1 but MASTER_ADDR and MASTER_PORT do not say where the run's "
            "store is",
            hint="launch with torchrun (torchrun --nproc-per-node N -m embedlens ...)",
        )
    serve = master and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    serve = serve and not dist.is_initialized()
    store = TCPStore(
        host,
        int(port),
        is_master=serve,
        timeout=datetime.timedelta(seconds=wait_s),
        wait_for_workers=False,
    )
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"embedlens/{run}/{attempt}", store)


def _read(store: Store) -> dict[str, Any] | None:
    """The run's recorded failure, if any."""
    if not store.check(["fail"]):
        return None
    record: dict[str, Any] = json.loads(store.get("fail"))
    return record


def _failed(record: dict[str, Any]) -> RankFailed:
    """Another process's failure as this process raises it (with its exit status)."""
    kind = {2: RankUsageError, 130: RankInterrupted}.get(int(record["code"]), RankFailed)
    return kind(int(record["rank"]), str(record["message"]), hint=record.get("hint"))


def _unpacked(buffer: torch.Tensor, n: int) -> Any:
    return pickle.loads(buffer[:n].numpy().tobytes())
