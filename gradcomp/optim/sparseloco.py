"""Sparse exchanges for local steps: ``gradcomp.optim.DiLoCo(..., compressor="sparseloco")``.

SparseLoCo (Sarfi et al. 2025) keeps DiLoCo's local steps but replaces the outer momentum with
each replica's own error-feedback accumulator, decayed by ``beta``, and sends only the top-k of
each chunk of it in 2 bits:

    e = beta * e + delta          (delta: the pseudo-gradient, synced parameters minus now)
    sent = chunked top-k of e     (``ChunkedTopK``: ``density`` of each ``chunk``, ``bits`` a value)
    e -= sent
    synced -= lr * mean over ranks of sent,   lr = 1

Chunks are cut per tensor, as the method's authors cut them: ``DiLoCo`` gives a sparse exchange
(named, or ``auto``'s choice) one bucket per tensor (``DiLoCo.plan``), since a chunk across
tensors of other scales sends the larger one's values only (on a GRU LM that cost 1.4% of the
loss at 1000 steps; BENCHMARKS.md section 12). A tensor's last chunk still sends ``density * chunk`` values, so small tensors (biases,
norms) go nearly whole: about 1080x fewer bytes than DDP on the repository's LM instead of 1405x.

In gradcomp that is ``ErrorFeedback(ChunkedTopK(...), decay=beta)`` as DiLoCo's exchange, with
the outer optimizer's defaults made what the method needs (``lr=1``, no momentum: the accumulator
is the momentum); an ``lr=``/``momentum=`` given to DiLoCo still wins. The name takes its options
as every name does: ``"sparseloco:density=0.03,bits=4"``.

These names are exchanges for local steps, not per-step gradient methods: ``gradcomp.make`` does
not know them (every registered name must train as shipped through the DDP hook, and a per-step
exchange this sparse has not been measured to). The exchange is not governed: the governor
compares one exchange's error with the replicas' spread, and a sparse exchange's error is, by
design, most of the pseudo-gradient (the accumulator carries it to later outer steps), so it
would always step down to 4- and 8-bit codes (docs/guides/local-steps.md has the measurement).
"""
from __future__ import annotations

from typing import Callable

from ..compressors.chunked_topk import BITS, CHUNK, ChunkedTopK
from ..compressors.contract import Compressor
from ..compressors.feedback import ErrorFeedback
from ..registry import parameters, parse_spec

#: SparseLoCo's accumulator decay and density (64 of each 4096 values), and the outer optimizer
#: its accumulator replaces the momentum of
BETA, DENSITY = 0.95, 1 / 64
OUTER = {"lr": 1.0, "momentum": 0.0}


def sparseloco(density: float = DENSITY, chunk: int = CHUNK, bits: int = BITS, beta: float = BETA) -> Compressor:
    """The chunked top-k exchange under a decaying accumulator (see the module docstring)."""
    return ErrorFeedback(ChunkedTopK(density=density, chunk=chunk, bits=bits), owner_feedback=False, decay=beta)


#: name -> (factory, the outer optimizer's defaults with it)
EXCHANGES: dict[str, tuple[Callable[..., Compressor], dict[str, float]]] = {"sparseloco": (sparseloco, OUTER)}


def exchange(spec: str) -> tuple[Compressor, dict[str, float]] | None:
    """The exchange ``spec`` names (``"sparseloco:density=0.03"``) and its outer defaults, or None
    where it names none of ``EXCHANGES`` (a registry name, then)."""
    name, kwargs = parse_spec(spec)
    if name not in EXCHANGES:
        return None
    factory, outer = EXCHANGES[name]
    accepted = parameters(factory) or []
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"exchange {name!r} does not take {unknown}; it takes {accepted}")
    return factory(**kwargs), dict(outer)
