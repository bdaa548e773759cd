"""The built-in registry names, each a recipe that trains as shipped (``recipes``).

Every default below was measured (BENCHMARKS.md, section 6); ``gradcomp.make("NAME:key=value")``
changes any of them, and the codec-only definitions of earlier releases are one parameter away
(``warmup=0``, ``feedback='both'``).
"""
from __future__ import annotations

import inspect
from typing import Any

from ..compressors import (BF16, FP16, Allgather, Allreduce, OneBit, QuantizedAllreduce,
                           QuantizePerChannel, QuantizePerTensor, RandomK, ReducedTopK, TopK)
from ..compressors.quantize.twostage import CHUNK
from ..params import check_choice
from ..powersgd import PowerSGD
from ..registry import register
from .governor import BUDGET, Governed
from .recipes import WARMUP_BITS, check_warmup_bits, codec_recipe, sparse_recipe, warmed


def governed(method: Any, budget: float | None) -> Any:
    """``method`` under the governor (``planning.governor``: it measures what compression costs
    and backs off to 8-bit codes where that is over ``budget``); ``budget=None``: the method alone."""
    return method if budget is None else Governed(method, budget=budget)


def _half(wrapper: Any, inner: Any) -> Any:
    def factory(**kwargs: Any) -> Any:
        return wrapper(inner(**kwargs))
    factory.__signature__ = _passing_on(factory, inner)  # type: ignore[attr-defined]
    return factory


def _passing_on(factory: Any, inner: Any) -> inspect.Signature:
    """``factory``'s own parameters and those of ``inner``, which its ``**kwargs`` go to: the
    keys ``make`` lists when one is misspelt (a factory's signature is all it can read)."""
    own = [p for p in inspect.signature(factory).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in own}
    passed = [p.replace(kind=p.KEYWORD_ONLY) for p in inspect.signature(inner).parameters.values()
              if p.name not in names and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return inspect.Signature([p.replace(kind=p.KEYWORD_ONLY) for p in own] + passed)


def _quantized(name: str, bits: int, warmup: int, feedback: str, chunk: int, exact_zero: bool,
               default_zero: bool) -> Any:
    """int8 / int4: the name fixes the bits; a chunk or grid other than the name's default is shown."""
    extra = {**({"chunk": chunk} if chunk != CHUNK else {}),
             **({"exact_zero": exact_zero} if exact_zero != default_zero else {})}
    return codec_recipe(name, QuantizedAllreduce, warmup, feedback, shown=False, extra=extra or None,
                        bits=bits, chunk=chunk, exact_zero=exact_zero)


#: the exact warm-up of the 8-bit codes (``int8``, ``quantize-tensor``). Without it their final
#: loss spread over seeds far more than fp32 summed in another order: the codes' error, set, we
#: think, in the first steps, when AdamW's second moment rests on a few gradients. 50 exact steps
#: closed most of that spread for a few percent more bytes. ``int4`` gained nothing from it (its
#: steady rounding is its loss).
WARMUP_8BIT = 50


def int8(warmup: int = WARMUP_8BIT, feedback: str = "both", chunk: int = CHUNK, exact_zero: bool = False) -> Any:
    """8-bit two-stage codes per ``chunk`` values after an exact warm-up (``WARMUP_8BIT``); error
    feedback at both stages (the workers' alone trained worse)."""
    return _quantized("int8", 8, warmup, feedback, chunk, exact_zero, False)


def int4(warmup: int = 0, feedback: str = "both", chunk: int = CHUNK, exact_zero: bool = True) -> Any:
    """4-bit two-stage codes per ``chunk`` values on a grid that holds zero; error feedback at
    both stages. A 4-bit step spans its chunk's range, which a heavy-tailed gradient's few largest
    values set, so most values are within a step of zero. With zero on the grid they go out as
    exact zeros until their residual reaches a step; on the min-max grid (``exact_zero=False``,
    the earlier definition) each went out as a rounding error every step (noise that, we think,
    inflates Adam's second moment): zero on the grid gets as far sooner, for the same bytes.
    ``int4:chunk=128`` rounds finer for more bytes and compute, and did not reliably train
    better."""
    return _quantized("int4", 4, warmup, feedback, chunk, exact_zero, True)


def _allgathered(name: str, codec_factory: Any, default_warmup: int) -> Any:
    """quantize-tensor / -channel: the codec after ``default_warmup`` exact steps, without error
    feedback (the workers' feedback, the only kind an allgathered code has, trained worse);
    ``warmup=0``: the codec alone."""
    def factory(warmup: int = default_warmup, feedback: str = "none", **kwargs: Any) -> Any:
        feedback = check_choice(f"{name} feedback", feedback, ("none", "worker"))
        if not warmup and feedback == "none":
            return codec_factory(**kwargs)
        return codec_recipe(name, codec_factory, warmup, feedback, **kwargs)
    factory.__signature__ = _passing_on(factory, codec_factory)  # type: ignore[attr-defined]
    return factory


def onebit(warmup: int | str = "auto", feedback: str = "none", warmup_bits: int = WARMUP_BITS,
           budget: float | None = BUDGET) -> Any:
    """Signs and a scale per 512 values, two stages, after a warm-up: 8-bit codes until the
    gradients' scale settles (``"auto"``, ``recipes.warmed``; ``warmup_bits=4``: 4-bit after its
    first 30 steps), or ``warmup`` exact steps. Without error
    feedback: under momentum SGD and AdamW both residuals, or the workers' alone, trained worse.
    With Adam, prefer
    ``gradcomp.optim.OneBitAdam``, where the feedback works on the frozen-variance momentum.
    ``budget``: the governor's (``governed``; None: off)."""
    return governed(codec_recipe("onebit", OneBit, warmup, feedback, warmup_bits=warmup_bits), budget)


def topk(ratio: float = 0.01, warmup: int | str = "auto", ramp: int = 0, feedback: str | None = None,
         stages: int = 1, warmup_bits: int = WARMUP_BITS, budget: float | None = BUDGET) -> Any:
    """The largest ``ratio`` of each bucket after a warm-up (as ``onebit``'s): allgathered (``stages=1``,
    the workers' residual), or reduced in two stages (``stages=2``: ``ReducedTopK``, bytes flat in
    the number of ranks, both residuals). ``budget``: the governor's (``governed``; None: off)."""
    stages = check_choice("topk stages", stages, (1, 2))
    if feedback is None:
        feedback = "worker" if stages == 1 else "both"
    return governed(sparse_recipe("topk", TopK if stages == 1 else ReducedTopK, ratio, warmup, ramp, feedback,
                                  extra={"stages": 2} if stages == 2 else None, warmup_bits=warmup_bits), budget)


def randomk(ratio: float = 0.01, warmup: int = 100, ramp: int = 0, feedback: str = "none", seed: int = 0,
            budget: float | None = BUDGET) -> Any:
    """The same random ``ratio`` of coordinates on every rank, summed. Not recommended: with
    error feedback a coordinate waits about ``1 / ratio`` steps and then lands all at once, which
    diverged on every workload at its learning rate; without, 99% of each gradient is dropped and
    only the exact warm-up trains the model. It warns so at construction."""
    import warnings

    warnings.warn("gradcomp: randomk is not recommended (with error feedback it diverges; without, "
                  "it drops most of each gradient); use topk, onebit or int4 instead",
                  RuntimeWarning, stacklevel=3)
    return governed(sparse_recipe("randomk", RandomK, ratio, warmup, ramp, feedback, seed=seed), budget)


def powersgd(rank: int = 4, start_iter: int | str = "auto", warmup_bits: int = WARMUP_BITS,
             budget: float | None = BUDGET, **kwargs: Any) -> Any:
    """PowerSGD after a warm-up on 8-bit two-stage codes (``warmup_bits``) that ends when the
    gradients' scale settles (``start_iter="auto"``, ``recipes.warmed``; PowerSGD then takes its own 2 exact steps,
    which its error feedback and warm start need), or after ``start_iter`` exact steps (PyTorch's
    ``start_powerSGD_iter``; 100 was the earlier default). The other keys are ``PowerSGD``'s.
    Auto is the default as measured (docs/convergence.md). ``budget``: the governor's, for the auto
    recipe; a fixed ``start_iter`` is PyTorch's PowerSGD exactly and runs ungoverned unless given
    another budget."""
    check_warmup_bits("powersgd", start_iter, warmup_bits)
    if start_iter == "auto":
        return governed(warmed("powersgd", {"rank": rank, "start_iter": "auto", **kwargs}, "auto",
                               [(0, PowerSGD(rank=rank, start_iter=2, **kwargs))], warmup_bits), budget)
    # a fixed start_iter is PyTorch's PowerSGD, exactly (its parity and benchmarks): governed only
    # when a budget other than the default is asked for
    return governed(PowerSGD(rank=rank, start_iter=start_iter, **kwargs),  # type: ignore[arg-type]
                    None if budget == BUDGET else budget)


powersgd.__signature__ = _passing_on(powersgd, PowerSGD)  # type: ignore[attr-defined]


def register_builtins() -> None:
    register("allreduce", Allreduce)
    register("allgather", Allgather)
    register("fp16", _half(FP16, Allreduce))
    register("bf16", _half(BF16, Allreduce))
    register("quantize-tensor", _allgathered("quantize-tensor", QuantizePerTensor, WARMUP_8BIT))
    register("quantize-channel", _allgathered("quantize-channel", QuantizePerChannel, 0))
    register("powersgd", powersgd)
    register("fp16-powersgd", _half(FP16, powersgd))
    # (PowerSGD's one-round variant, powersgd:rounds=1, and gradcomp.BatchedPowerSGD, which mixes
    # layers in one square, are not names of their own: every name must train as shipped, and the
    # batched square was the worst method on the language model.)
    register("int8", int8)
    register("int4", int4)
    register("onebit", onebit)
    register("topk", topk)
    register("randomk", randomk)
    from .auto import Auto

    _auto.__signature__ = inspect.signature(Auto)  # type: ignore[attr-defined]
    register("auto", _auto)


def _auto(**kwargs: Any) -> Any:
    from .auto import Auto

    return Auto(**kwargs)
