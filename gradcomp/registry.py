"""One registry of compressors by name: ``gradcomp.make(NAME)``, every ``--compressor NAME``
option, the benchmarks and the conformance suite all read it.

Third-party compressors join with ``gradcomp.register(name, factory)`` at import time, or without
any import through the entry-point group ``gradcomp.compressors`` in their package metadata:

    [project.entry-points."gradcomp.compressors"]
    my-topk = "my_package.topk:make_topk"      # a factory: () -> gradcomp.Compressor

Entry points are loaded the first time the registry is read.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from .compressors.contract import Compressor

if TYPE_CHECKING:
    from _collections_abc import dict_items, dict_keys, dict_values
    from importlib.metadata import EntryPoint

ENTRY_POINT_GROUP = "gradcomp.compressors"

#: What ``register`` takes: called with the keyword overrides of ``make``, returns a fresh compressor.
Factory = Callable[..., "Compressor"]


class Registry(dict[str, Factory]):
    """name -> factory building a compressor with the defaults a user would start from."""

    _loaded = False

    def _ensure(self) -> None:
        if Registry._loaded:
            return
        Registry._loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in self:
                dict.__setitem__(self, ep.name, _lazy(ep))

    def __getitem__(self, name: str) -> Factory:
        self._ensure()
        return dict.__getitem__(self, name)

    def __contains__(self, name: object) -> bool:
        self._ensure()
        return dict.__contains__(self, name)

    def __iter__(self) -> Iterator[str]:
        self._ensure()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._ensure()
        return dict.__len__(self)

    def keys(self) -> dict_keys[str, Factory]:
        self._ensure()
        return dict.keys(self)

    def items(self) -> dict_items[str, Factory]:
        self._ensure()
        return dict.items(self)

    def values(self) -> dict_values[str, Factory]:
        self._ensure()
        return dict.values(self)


def _lazy(ep: EntryPoint) -> Factory:
    def factory() -> Compressor:
        return ep.load()()
    factory.__qualname__ = f"entry point {ep.value}"
    return factory


REGISTRY: Registry = Registry()


def register(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``gradcomp.make(name)`` return ``factory()``. ``replace=True`` overrides a name."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"a compressor name must be a non-empty string without spaces, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register({name!r}, ...): the factory must be callable, got {factory!r}")
    if dict.__contains__(REGISTRY, name) and not replace:
        raise ValueError(f"compressor name {name!r} is already registered (pass replace=True to override)")
    dict.__setitem__(REGISTRY, name, factory)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"powersgd:rank=4,start_iter=2"`` -> ``("powersgd", {"rank": 4, "start_iter": 2})``
    (values are Python literals; a bare word is a string)."""
    import ast

    name, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    items: list[str] = []
    for item in filter(None, (part.strip() for part in split_items(rest))):
        if "=" not in item and items:  # a list value: auto:allowed=fp16,int8,int4
            items[-1] += "," + item
        else:
            items.append(item)
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"compressor spec {spec!r}: expected name:key=value,..., got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = text.strip()
    return name.strip(), kwargs


def split_items(text: str) -> list[str]:
    """``text`` split at the commas outside quotes and brackets: a value may itself be a quoted
    spec (``compressor='powersgd:rank=2,start_iter=2'``) or a tuple (``betas=(0.9, 0.95)``).
    What ``parse_spec`` splits a spec's ``key=value`` list with; public so that a command line
    that takes a comma-separated list of specs splits it the same way (``benchmarks/methods.py``'s
    ``--methods``). Items are not stripped; an empty text gives ``[""]``."""
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def compressor_spec(text: str) -> str:
    """An ``argparse`` type for ``--compressor`` options: a registry name or ``name:key=value,...``
    whose name is registered (so a typo fails at once, naming the known names)."""
    import argparse

    try:
        name, _ = parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if name != "none" and name not in REGISTRY:
        raise argparse.ArgumentTypeError(unknown_name(name))
    return text


def parameters(factory: Factory) -> list[str] | None:
    """The keyword parameters ``factory`` takes, in its order, or None when it takes any (a bare
    ``**kwargs``) or its signature cannot be read: then only calling it can tell."""
    import inspect

    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return [p.name for p in sig.parameters.values() if p.kind in kinds]


def unknown_name(name: str) -> str:
    """The message for a name that is not registered: the closest registered names (``difflib``,
    ignoring case), then every one."""
    import difflib

    names = {n.lower(): n for n in REGISTRY}
    low = name.lower().replace("_", "-")
    close = [names[low]] if low in names else [
        names[n] for n in difflib.get_close_matches(low, list(names), n=2, cutoff=0.6)]
    guess = f" (did you mean {' or '.join(repr(n) for n in close)}?)" if close else ""
    if low.replace("-", "") in ("onebitadam", "dgc", "diloco"):  # an optimizer, not a hook's method
        guess = (f" ({name} is an optimizer, not a compressor: gradcomp.optim, gradcomp.torch and "
                 "gradcomp.jax have it)")
    return f"unknown compressor {name!r}{guess}; known: {', '.join(REGISTRY)}"


def _listed(unknown: list[str], accepted: list[str]) -> str:
    """``unknown`` keys, the closest accepted name to each, and every accepted one."""
    import difflib

    guesses = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, accepted, 1))
               else repr(k) for k in unknown]
    takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no parameters"
    return f"{', '.join(guesses)}; {takes}"


def make(spec: str, **overrides: Any) -> Compressor:
    """A fresh compressor by registry name (``gradcomp.REGISTRY`` lists the names), with the
    factory's defaults overridden by keyword: ``make("powersgd", rank=4)``, or in one string,
    as the ``--compressor`` options take it: ``make("powersgd:rank=4,start_iter=100")``."""
    name, kwargs = parse_spec(spec)
    kwargs.update(overrides)
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(unknown_name(name)) from None
    accepted = parameters(factory)
    unknown = sorted(set(kwargs) - set(accepted)) if accepted is not None else []
    if accepted is not None and unknown:
        raise ValueError(f"compressor {name!r} does not take {_listed(unknown, accepted)}")
    try:
        comp = factory(**kwargs)
    except TypeError as exc:
        if not kwargs:
            raise
        raise ValueError(f"compressor {name!r} does not take {sorted(kwargs)}: {exc}") from None
    if not isinstance(comp, Compressor):
        raise TypeError(f"the factory registered as {name!r} returned {type(comp).__name__}, "
                        "not a gradcomp Compressor")
    return comp


#: The parameters that shorten a registered name's warm-up to nothing (a recipe's exact warm-up
#: and sparsity ramp; PowerSGD's ``start_iter``, 2 being the least it takes with error feedback).
STEADY = ({"warmup": 0, "ramp": 0, "budget": None}, {"warmup": 0, "budget": None}, {"start_iter": 2, "budget": None},
          {"warmup": 0, "ramp": 0}, {"warmup": 0}, {"start_iter": 2})


def steady(spec: str, keep_given: bool = False) -> str:
    """``spec`` with its warm-up shortened to nothing, and without its governor, where its factory
    takes such parameters: what the benchmarks time and the tests check (the method itself, from
    the first step).
    ``keep_given``: only where ``spec`` does not set the parameter itself (an optimizer that runs
    its own warm-up before the method, e.g. ``OneBitAdam(compressor="topk:stages=2")``)."""
    name, given = parse_spec(spec)
    as_given = make(spec).describe()
    for overrides in STEADY:
        items = {**overrides, **given} if keep_given else {**given, **overrides}
        try:
            shortened = make(name, **items)
        except ValueError:
            continue
        if shortened.describe() == as_given:  # no warm-up to shorten (quantize-channel)
            return spec
        if "budget" in items and "budget" not in given:
            rest = {k: v for k, v in items.items() if k != "budget"}
            if make(name, **rest).describe() == shortened.describe():
                items = rest  # not governed without it either (powersgd's fixed start_iter)
        return name + (":" + ",".join(f"{k}={v!r}" for k, v in items.items()) if items else "")
    return spec
