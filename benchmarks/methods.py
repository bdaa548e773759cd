"""What the benchmarks compare, by name: gradcomp compressors (from ``gradcomp.REGISTRY``) and
PyTorch's own DDP hooks.

**gradcomp methods are compressor specs**, the strings ``gradcomp.make`` takes: a registry name or
``name:key=value,...`` (``powersgd:rank=4,start_iter=2``). The list behind ``--methods all`` is
derived from the registry each time it is read, so registering a name (``gradcomp.register`` or
an entry point) adds it to the benchmark with no edit here:

* every registered name, in registration order, in steady state (``steady``): a name whose
  factory takes ``start_iter`` (the PowerSGD family) is benchmarked as ``NAME:start_iter=2``, a
  recipe with a warm-up or ramp as ``NAME:warmup=0`` (and ``ramp=0``), so that the worker's 3
  warm-up steps take it past its uncompressed start and every timed step runs the method
  (``start_iter=2`` is the smallest PyTorch's PowerSGD hook accepts with error feedback; the
  timed steps then match what a long run gets after its warm-up);
* ``EXTRA_SPECS``: the specs the issue's targets name (PowerSGD rank 4 and rank 1 beside the
  registered rank 2);
* ``GLOO_SPECS`` with a ``gloo-`` prefix: the same compressor over ``TorchCommunicator`` (gloo),
  PyTorch's transport, so that the comparison with PyTorch's hooks isolates the compressor from
  MPI-versus-gloo (needs torch). Any spec may be named with the prefix.
* ``hier-SPEC`` and ``flat-SPEC`` (by name only): the compressor with ``hierarchical=True``
  (exact inside each host, the method across hosts) and ``False`` (one flat schedule), where
  ``SPEC`` alone gets the default (``Compressor.hierarchical_pays``): the two
  schedules compared in one run, on a topology of several hosts of several ranks.

Method names (what ``--methods`` takes and what result rows carry) are the specs with their
``key=value`` items in sorted order. In a ``--methods`` list, items are separated by commas; an
item ``key=value`` with no ``:`` continues the spec before it, so
``allreduce,powersgd:rank=4,start_iter=2,torch-fp16`` is three methods.

**PyTorch's hooks** (``TORCH_HOOKS``) stay specific to the benchmark: each is keyed by the gradcomp
spec it corresponds to (``same_as``), so reports put "fp16" next to "torch-fp16". Hooks that fail
in this PyTorch version carry the reason (``broken``) and are left out of ``all``.

``mpi-allreduce`` (by name only): gradcomp's ``Allreduce`` over an ``MPICommunicator`` that hands
every bucket to one ``MPI_Allreduce`` (MPICH's own algorithm choice, or the one
``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` selects) instead of gradcomp's reduce-scatter + allgather:
the comparison row for "no slower than MPICH's best algorithm for the same bytes".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gradcomp.registry import REGISTRY, make, parse_spec

#: Specs benchmarked beside the registered names: the issue's targets.
EXTRA_SPECS = ("powersgd:rank=4,start_iter=2", "powersgd:rank=1,start_iter=2",
               "fp16-powersgd:rank=4,start_iter=2")
#: Specs also run over gloo (``gloo-`` + spec) in ``all``.
GLOO_SPECS = ("allreduce", "fp16", "powersgd:rank=4,start_iter=2")
#: What a spec is called in reports; other specs are labelled by ``Compressor.describe()``.
LABELS = {
    "allreduce": "fp32 allreduce",
    "fp16": "fp16 allreduce",
    "bf16": "bf16 allreduce",
    "allgather": "fp32 allgather",
    "quantize-tensor": "int8 per tensor",
    "quantize-channel": "int8 per 512-channel",
    "powersgd:start_iter=2": "PowerSGD rank 2 (registered default)",
    "powersgd:rank=1,start_iter=2": "PowerSGD rank 1",
    "powersgd:rank=4,start_iter=2": "PowerSGD rank 4",
    "fp16-powersgd:rank=4,start_iter=2": "fp16 PowerSGD rank 4",
}
#: Names of earlier versions of the benchmark (BENCHMARKS.md's commands use them).
ALIASES = {
    "powersgd-r1": "powersgd:rank=1,start_iter=2",
    "powersgd-r4": "powersgd:rank=4,start_iter=2",
    "fp16-powersgd-r4": "fp16-powersgd:rank=4,start_iter=2",
    "gloo-powersgd-r4": "gloo-powersgd:rank=4,start_iter=2",
}
#: The one ``MPI_Allreduce`` per bucket row (see the module docstring).
MPI_ALLREDUCE = "mpi-allreduce"
#: Buffers below this many bytes go to ``MPI_Allreduce`` in ``MPICommunicator``: with it, all do.
_NEVER_SPLIT = 1 << 62


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "gradcomp" or "torch"
    spec: str | None = None  # gradcomp: the compressor spec for gradcomp.make
    same_as: str | None = None  # the method of the other kind that does the same thing
    label: str = ""
    broken: str = ""  # why it is left out of "all" (it still runs when named)
    broken_paths: tuple = ()  # ((worker path, why), ...): left out of "all" on that path only
    transport: str = "mpi"  # gradcomp: "mpi", "gloo" (TorchCommunicator) or "mpi-allreduce"
    hierarchical: bool | None = None  # gradcomp: None the default, True ``hier-``, False ``flat-``
    hook: Callable | None = field(default=None, repr=False)  # torch: (world_size) -> (state, hook)

    def build(self, world_size: int | None = None) -> Any:
        """gradcomp: a fresh compressor; torch: ``(state, hook)`` for ``register_comm_hook``."""
        if self.kind == "gradcomp":
            assert self.spec is not None  # every gradcomp method has one
            return make(self.spec)
        assert self.hook is not None  # every torch method has one
        return self.hook(world_size)

    def communicator(self, shared: dict) -> Any:
        """The communicator a gradcomp method runs on (one of each kind per process, in
        ``shared``); None for the default MPI one (what ``gradcomp.torch.register`` picks)."""
        if self.transport == "gloo":
            if "gloo" not in shared:
                from gradcomp.torch import TorchCommunicator

                shared["gloo"] = TorchCommunicator()
            return shared["gloo"]
        if self.transport == MPI_ALLREDUCE:
            if MPI_ALLREDUCE not in shared:
                from gradcomp.comm import MPICommunicator

                shared[MPI_ALLREDUCE] = MPICommunicator(large_allreduce_bytes=_NEVER_SPLIT)
            return shared[MPI_ALLREDUCE]
        return None

    def broken_for(self, path: str | None) -> str:
        """Why this method is left out of ``all`` on ``path`` ("" when it is not)."""
        return self.broken or dict(self.broken_paths).get(path, "")

    def needs_torch(self) -> bool:
        return self.kind == "torch" or self.transport == "gloo"


def canonical(spec: str) -> str:
    """``name:k=v,...`` with the items in sorted order (one name per compressor configuration);
    ValueError on a malformed spec."""
    name, _ = parse_spec(spec)  # checks the syntax
    _, _, rest = spec.partition(":")
    items = sorted(part.strip() for part in rest.split(",") if part.strip())
    items = [k.strip() + "=" + v.strip() for k, _, v in (i.partition("=") for i in items)]
    return name + (":" + ",".join(items) if items else "")


def registered_specs() -> list[str]:
    """The registry's names as benchmarked: in steady state (``gradcomp.registry.steady``:
    ``NAME:start_iter=2`` for PowerSGD, ``NAME:warmup=0`` and ``ramp=0`` for the recipes)."""
    from gradcomp.registry import steady

    return [steady(name) for name in REGISTRY]


def gradcomp_specs() -> list[str]:
    """Every gradcomp spec in ``all`` (over MPI), registry first, without duplicates."""
    out: list[str] = []
    for spec in registered_specs() + list(EXTRA_SPECS):
        spec = canonical(spec)
        if spec not in out and parse_spec(spec)[0] in REGISTRY:
            out.append(spec)
    return out


# -- PyTorch's own hooks -------------------------------------------------------------------------
def _torch_hook(name: str, rank: int | None = None) -> Callable[[int | None], tuple[Any, Callable[..., Any]]]:
    def build(world_size: int | None) -> tuple[Any, Callable[..., Any]]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
        from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh
        if name == "allreduce":
            return None, dh.allreduce_hook
        if name == "fp16":
            return None, dh.fp16_compress_hook
        if name == "bf16":
            return None, dh.bf16_compress_hook
        if name == "quantize-tensor":
            return None, qh.quantization_pertensor_hook
        if name == "quantize-channel":
            return None, qh.quantization_perchannel_hook
        if name in ("powersgd", "fp16-powersgd"):
            state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                     start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                     random_seed=0)
            hook: Callable[..., Any] = ph.powerSGD_hook
            if name == "fp16-powersgd":
                hook = dh.fp16_compress_wrapper(hook)
            return state, _one_bucket_at_a_time(hook)
        raise ValueError(name)
    return build


def _one_bucket_at_a_time(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` with each bucket's future waited for before the next bucket's hook starts.

    PyTorch's PowerSGD hook issues its second allreduce (of Q) from a callback of the first
    one's future, which runs on whichever thread completes it, or at once when it is already
    done: under DDP, with several buckets in flight, the ranks then enqueue bucket k's second
    allreduce and bucket k+1's first in different orders. Over gloo on the capped link that hung
    DDP or aborted the process ("Received data size doesn't match expected size"). In sequence,
    every rank issues the same collectives in the same order; the bucket-level overlap the hook
    loses is what gradcomp's communicator keeps by ordering its collectives on one thread."""
    previous: list[Any] = []

    def ordered(state, bucket):  # unannotated: DDP refuses the strings postponed annotations give
        if previous:
            previous.pop().wait()
        future = hook(state, bucket)
        previous.append(future)
        return future

    return ordered


_GLOO_QUANTIZE = ("PyTorch 2.13 over gloo: the hook raises IndexError in quantize_and_allgather (it "
                  "indexes the all_gather future's value as NCCL returns it), on small buckets and "
                  "on ResNet-50's (4 ranks, loopback); on the capped link gloo aborted the process "
                  "('Received data size doesn't match expected size')")

TORCH_HOOKS = [
    Method("torch-allreduce", "torch", transport="gloo", same_as="allreduce", label="torch allreduce_hook",
           hook=_torch_hook("allreduce")),
    Method("torch-fp16", "torch", transport="gloo", same_as="fp16", label="torch fp16_compress_hook",
           hook=_torch_hook("fp16")),
    Method("torch-bf16", "torch", transport="gloo", same_as="bf16", label="torch bf16_compress_hook",
           hook=_torch_hook("bf16"),
           broken_paths=(("ddp", "PyTorch 2.13: DistributedDataParallel.register_comm_hook refuses "
                                 "bf16_compress_hook without CUDA 11+ and NCCL 2.10+ (or XPU and XCCL); "
                                 "called outside DDP (reducer path) it runs over gloo"),)),
    Method("torch-quantize-tensor", "torch", transport="gloo", same_as="quantize-tensor",
           label="torch quantization_pertensor_hook", broken=_GLOO_QUANTIZE,
           hook=_torch_hook("quantize-tensor")),
    Method("torch-quantize-channel", "torch", transport="gloo", same_as="quantize-channel",
           label="torch quantization_perchannel_hook", broken=_GLOO_QUANTIZE,
           hook=_torch_hook("quantize-channel")),
    Method("torch-powersgd-r1", "torch", transport="gloo", same_as="powersgd:rank=1,start_iter=2",
           label="torch powerSGD_hook rank 1", hook=_torch_hook("powersgd", rank=1)),
    Method("torch-powersgd-r4", "torch", transport="gloo", same_as="powersgd:rank=4,start_iter=2",
           label="torch powerSGD_hook rank 4", hook=_torch_hook("powersgd", rank=4)),
    Method("torch-fp16-powersgd-r4", "torch", transport="gloo", same_as="fp16-powersgd:rank=4,start_iter=2",
           label="torch fp16_compress_wrapper(powerSGD_hook) rank 4",
           broken="PyTorch 2.13 on the CPU: torch.bmm of a float and a half tensor raises "
                  "'expected m1 and m2 to have the same dtype' once compression starts",
           hook=_torch_hook("fp16-powersgd", rank=4)),
]
TORCH = {m.name: m for m in TORCH_HOOKS}


def _gradcomp(spec: str, transport: str = "mpi") -> Method:
    spec = canonical(spec)
    twin = next((t.name for t in TORCH_HOOKS if t.same_as == spec), None)
    label = LABELS.get(spec, "")
    if transport == "gloo":
        return Method("gloo-" + spec, "gradcomp", spec, twin, label and label + " over gloo",
                      transport="gloo")
    if transport in ("hier", "flat"):
        return Method(f"{transport}-{spec}", "gradcomp", spec, None,
                      label and f"{label}, {'hierarchical' if transport == 'hier' else 'flat'}",
                      hierarchical=transport == "hier")
    if transport == MPI_ALLREDUCE:
        return Method(MPI_ALLREDUCE, "gradcomp", "allreduce", None,
                      "fp32 allreduce, one MPI_Allreduce per bucket (MPICH's algorithm)",
                      transport=MPI_ALLREDUCE)
    return Method(spec, "gradcomp", spec, twin, label)


def all_methods(with_torch: bool = True, broken: bool = False, path: str | None = None) -> list[Method]:
    """``all`` (``broken=True``: ``everything``) on worker path ``path``, read from the registry now."""
    out = [_gradcomp(s) for s in gradcomp_specs()]
    if with_torch:
        out += [_gradcomp(s, "gloo") for s in GLOO_SPECS if parse_spec(s)[0] in REGISTRY]
        out += [m for m in TORCH_HOOKS if broken or not m.broken_for(path)]
    return out


def _known(name: str) -> bool:
    try:
        return parse_spec(name)[0] in REGISTRY
    except ValueError:
        return False


def resolve(name: str) -> Method:
    """One method by name (a spec, ``gloo-``, ``hier-`` or ``flat-`` + spec, a PyTorch hook,
    ``mpi-allreduce``, or an alias of an earlier version); ValueError when unknown."""
    name = ALIASES.get(name.strip(), name.strip())
    if name in TORCH:
        return TORCH[name]
    if name == MPI_ALLREDUCE:
        return _gradcomp("allreduce", MPI_ALLREDUCE)
    if _known(name):
        return _gradcomp(name)
    for prefix in ("gloo", "hier", "flat"):
        if name.startswith(prefix + "-") and _known(name[len(prefix) + 1:]):
            return _gradcomp(name[len(prefix) + 1:], prefix)
    raise ValueError(f"unknown method {name!r}; known: all, gradcomp, torch, everything, "
                     f"{', '.join(m.name for m in all_methods(True, True))}, {MPI_ALLREDUCE}, "
                     "or any compressor spec NAME[:key=value,...] with NAME from gradcomp.REGISTRY "
                     "(optionally prefixed gloo-, hier- or flat-)")


def split_methods(text: str) -> list[str]:
    """A ``--methods`` list as items: ``a,powersgd:rank=4,start_iter=2,b`` -> 3 items (an item
    ``key=value`` without ``:`` continues the spec before it; commas inside quotes or brackets
    stay in their item: ``auto:allowed='int8,powersgd:start_iter=2'``)."""
    from gradcomp.registry import split_items

    items: list[str] = []
    for part in (p.strip() for p in split_items(text)):
        if not part:
            continue
        if "=" in part and ":" not in part and items and ":" in items[-1]:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def select(spec: str, with_torch: bool | None = None, path: str | None = None) -> list[Method]:
    """Methods named in ``spec`` (see ``split_methods``; ``all`` = every available one that works
    on worker path ``path``; ``gradcomp`` / ``torch`` = those of one kind; ``everything`` adds the
    PyTorch hooks that fail in this PyTorch version, see ``Method.broken_for``). Methods that need
    torch, where it is missing, are dropped from ``all`` and rejected when named explicitly."""
    if with_torch is None:
        with_torch = torch_available()
    out = []
    for part in split_methods(spec):
        if part in ("all", "gradcomp", "torch", "everything"):
            out += [m for m in all_methods(with_torch, broken=part == "everything", path=path)
                    if part in ("all", "everything", m.kind)]
            continue
        m = resolve(part)
        if m.needs_torch() and not with_torch:
            raise ValueError(f"method {part!r} is not available here (needs torch)")
        out.append(m)
    seen, unique = set(), []
    for m in out:
        if m.name not in seen:
            seen.add(m.name)
            unique.append(m)
    return unique
