"""The timeline: where a step's time goes, as one Chrome trace event file per rank.

``GRADCOMP_TIMELINE=path`` (read once, at import) or ``start(path)`` / ``stop()`` (or ``with
recording(path):``) turn it on; Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open the files.
Like Horovod's ``HOROVOD_TIMELINE`` a path names where the trace goes, but every rank writes its
own, as each rank's threads do their own work (``file_for``): ``trace.json`` becomes
``trace.0.json``, ``trace.1.json``, ...; a path holding ``{rank}`` is formatted; any other path is
a folder, holding ``timeline.<rank>.json``. ``python -m gradcomp.report RUN --trace all.json``
merges them into one file for a single viewer tab.

What is written (the JSON array form of the trace event format): ``pid`` is the rank, ``tid`` a
thread (named by "M" metadata events: the training thread, each pipeline's compute and wire
threads), "X" complete events for spans (``span``, ``task``, ``complete``) and "i" instant events
for decisions (``instant``), each with its arguments. Timestamps are the wall clock in
microseconds, so the ranks of one host line up.

Cheap enough to leave on, and safe to crash with: an event is a tuple put on a queue (no
formatting, no lock, on the thread that records it); a writer thread formats and appends them to
the file in whole lines, when a step ends (``step_done``) or every half second, and at ``stop`` or
exit. So a process that dies keeps its trace up to its last step or half second, and a file that
was never closed ends after a whole event, without the closing bracket, which the trace viewers
and ``read`` accept. Off, every entry point is one test of a module global (``enabled``).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Iterator

#: whether a timeline is recording (read it as ``timeline.enabled``, never ``from ... import``)
enabled = False
#: the writer wakes at least this often (seconds) to append what was recorded
FLUSH_S = 0.5
#: the file of a path that names a folder, per rank
FOLDER_FILE = "timeline.{rank}.json"

_trace: _Trace | None = None
_control = threading.Lock()  # start / stop
_local = threading.local()   # per thread: the arguments of the ``task`` it is in


def file_for(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for ``path`` (see the module docstring)."""
    if "{rank}" in path:
        return path.format(rank=rank)
    if path.endswith(".json"):
        return f"{path[:-len('.json')]}.{rank}.json"
    return os.path.join(path, FOLDER_FILE.format(rank=rank))


def _rank() -> int:
    """This process's rank, read without importing anything and without calling MPI from the
    writer thread where it can be avoided: an MPI launcher's variables, torch.distributed once
    started, torchrun's ``RANK``, MPI itself once initialized; else 0."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # a half-imported or odd torch: fall through
            pass
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return int(mpi.COMM_WORLD.Get_rank())
    return 0


class _Trace:
    """One recording: the queue of events, the writer thread and the file (opened at the first
    write, when the job's rank is known)."""

    def __init__(self, path: str, rank: int | None):
        self.path, self.rank = path, rank
        self.file: str | None = None
        self.events: collections.deque = collections.deque()
        self.tids: dict[int, int] = {}
        self.fd = -1
        self.first = True
        self.write_lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.writer = threading.Thread(target=self._loop, name="gradcomp-timeline", daemon=True)
        self.writer.start()

    def tid(self) -> int:
        ident = threading.get_ident()
        tid = self.tids.get(ident)
        if tid is None:
            with self.write_lock:
                tid = self.tids.setdefault(ident, len(self.tids) + 1)
            name = threading.current_thread().name
            if threading.current_thread() is threading.main_thread():
                name = f"training ({name})"
            self.events.append(("M", "thread_name", "", 0.0, 0.0, tid, {"name": name}, None))
            self.events.append(("M", "thread_sort_index", "", 0.0, 0.0, tid, {"sort_index": tid}, None))
        return tid

    def _loop(self) -> None:
        while not self.stopping:
            self.wake.wait(FLUSH_S)
            self.wake.clear()
            self.write()

    def write(self) -> None:
        """Append every queued event to the file, as whole lines in one ``os.write``."""
        with self.write_lock:
            if not self.events:
                return
            if self.fd < 0:
                self._open()
            lines = []
            known: dict[int, tuple[Any, str]] = {}  # names, the tasks' shared arguments: encoded once a batch
            pid = self.rank
            pop = self.events.popleft
            for _ in range(len(self.events)):
                ph, name, cat, ts, dur, tid, args, context = pop()
                head = "[\n" if self.first else ",\n"
                self.first = False
                where = f'"pid":{pid},"tid":{tid}'
                if ph == "X":
                    where += f',"cat":{_encoded(known, cat)},"ts":{ts:.3f},"dur":{dur:.3f}'
                elif ph == "i":  # an instant on its thread's track
                    where += f',"cat":{_encoded(known, cat)},"ts":{ts:.3f},"s":"t"'
                inside = _encoded(known, context)
                if args is not None:
                    inside = f"{inside},{_json(args)}" if inside else _json(args)
                lines.append(f'{head}{{"ph":"{ph}","name":{_encoded(known, name)},{where},"args":{{{inside}}}}}')
            os.write(self.fd, "".join(lines).encode())

    def _open(self) -> None:
        if self.rank is None:
            self.rank = _rank()
        self.file = file_for(self.path, self.rank)
        folder = os.path.dirname(self.file)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self.fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.events.appendleft(("M", "process_name", "", 0.0, 0.0, 0, {"name": f"rank {self.rank}"}, None))
        self.events.appendleft(("M", "process_sort_index", "", 0.0, 0.0, 0, {"sort_index": self.rank}, None))

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        if threading.current_thread() is not self.writer:
            self.writer.join(5.0)
        self.write()
        with self.write_lock:
            if self.fd >= 0:
                os.write(self.fd, b"\n]\n")
                os.close(self.fd)
                self.fd = -1


def _encoded(cache: dict[Any, tuple[Any, str]], value: Any) -> str:
    """``value`` as JSON (a mapping: its members without the braces), kept in ``cache`` by id
    with the value itself (alive, so that no other object takes its id while the batch lasts):
    a task's arguments are shared by every span inside it, names by many events."""
    if value is None:
        return ""
    found = cache.get(id(value))
    if found is None:
        found = cache[id(value)] = (value, _json(value))
    return found[1]


def _json(value: Any) -> str:
    text = json.dumps(value, default=_plain, separators=(",", ":"))
    return text[1:-1] if isinstance(value, dict) else text


def _plain(value: Any) -> Any:
    """What ``json`` cannot write as it is: NumPy scalars and arrays, tuples of them, others as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _finite(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with non-finite floats as text: JSON has no NaN, and the viewers refuse it."""
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in args.items()}


# -- switching it on and off --------------------------------------------------------------------------
def start(path: str, rank: int | None = None) -> None:
    """Record a timeline into ``path`` (``file_for``: one file per rank) until ``stop``; one that
    is recording is stopped first. ``rank``: this process's (default: torch.distributed's or
    MPI's once the job has started them, else the launcher's variables)."""
    global _trace, enabled
    with _control:
        if _trace is not None:
            _stop_locked()
        _trace = _Trace(os.fspath(path), rank)
        enabled = True


def stop() -> str | None:
    """Stop recording: everything recorded is written and the file closed (a complete JSON
    array). Returns this rank's file (None: nothing was recorded, or nothing is recording)."""
    with _control:
        return _stop_locked()


def _stop_locked() -> str | None:
    global _trace, enabled
    trace, _trace, enabled = _trace, None, False
    if trace is None:
        return None
    trace.close()
    return trace.file


@contextlib.contextmanager
def recording(path: str, rank: int | None = None) -> Iterator[None]:
    """``with recording(path): ...``: ``start`` before the block, ``stop`` after it."""
    start(path, rank)
    try:
        yield
    finally:
        stop()


def current_file() -> str | None:
    """This rank's file, once the first events are written (None before, or when off)."""
    trace = _trace
    return trace.file if trace is not None else None


def step_done() -> None:
    """A step has ended: have the writer append what was recorded (at once, on its thread)."""
    trace = _trace
    if trace is not None:
        trace.wake.set()


def flush() -> None:
    """Write what was recorded now, on this thread (before a process ends itself)."""
    trace = _trace
    if trace is not None:
        trace.write()


# -- recording ------------------------------------------------------------------------------------------
def now() -> float:
    """The timeline's clock: the wall clock in microseconds."""
    return time.time_ns() / 1000.0


class _Span:
    __slots__ = ("name", "cat", "args", "scope", "start", "outer")

    def __init__(self, name: str, cat: str, args: dict[str, Any], scope: bool):
        self.name, self.cat, self.args, self.scope = name, cat, args, scope

    def __enter__(self) -> _Span:
        if self.scope:
            self.outer = getattr(_local, "args", None)
            _local.args = self.args
        self.start = time.time_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = time.time_ns()
        if self.scope:
            _local.args = self.outer
        trace = _trace
        if trace is not None:  # (the task's arguments are merged in by the writer)
            context = None if self.scope else getattr(_local, "args", None)
            trace.events.append(("X", self.name, self.cat, self.start / 1000.0, (end - self.start) / 1000.0,
                                 trace.tid(), self.args or None, context))


class _Off:
    """What ``span`` and ``task`` return when no timeline records: does nothing."""
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _Off()


def span(name: str, cat: str = "gradcomp", **args: Any) -> Any:
    """``with span(name, cat, **args):``: a complete event on this thread around the block,
    tagged with the arguments of the ``task`` it is in. Nothing when off."""
    if not enabled:
        return _OFF
    return _Span(name, cat, args, False)


def task(name: str, cat: str = "gradcomp", **args: Any) -> Any:
    """A ``span`` whose ``args`` (a bucket's index, bytes, step, method) also tag every span
    recorded inside it on this thread: what the collectives and the decode belong to."""
    if not enabled:
        return _OFF
    return _Span(name, cat, args, True)


def complete(name: str, cat: str, start_us: float, end_us: float, thread: int | None = None,
             **args: Any) -> None:
    """A span recorded after the fact (``now()`` readings), on the track of the thread whose
    ``tid`` is ``thread`` (default: this one): the training thread's wait, seen from the wire
    thread that ended it."""
    trace = _trace
    if trace is not None:
        trace.events.append(("X", name, cat, start_us, end_us - start_us,
                             trace.tid() if thread is None else thread, args or None, None))


def thread_id() -> int | None:
    """This thread's ``tid`` in the timeline (None when off), for ``complete``."""
    trace = _trace
    return trace.tid() if trace is not None else None


def instant(name: str, category: str = "gradcomp", **args: Any) -> None:
    """An instant event now, on this thread, with ``args`` (a decision: a rung change, an audit,
    a warm-up's end, a quorum). Nothing when off."""
    trace = _trace
    if trace is not None:
        trace.events.append(("i", name, category, now(), 0.0, trace.tid(), _finite(args) or None, None))


# -- reading ---------------------------------------------------------------------------------------------
def read(path: str) -> list[dict[str, Any]]:
    """The events of a trace file: a complete JSON array, or one a process that died left
    unclosed (no closing bracket, even a last event cut short, which is dropped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        events = json.loads(text)
    except ValueError:
        events = []
        for line in text.splitlines():
            line = line.strip().lstrip("[").strip().rstrip(",").strip()
            if line.startswith(","):
                line = line[1:]
            if not line or line == "]":
                continue
            try:
                events.append(json.loads(line))
            except ValueError:
                break  # cut short where the process died: what follows is not there
    if isinstance(events, dict):  # the object form ({"traceEvents": [...]}), for files of others
        events = events.get("traceEvents", [])
    return list(events)


@atexit.register
def _at_exit() -> None:
    stop()


_from_env = os.environ.get("GRADCOMP_TIMELINE", "")
if _from_env:
    start(_from_env)
