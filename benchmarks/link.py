"""Is the emulated link running at its rate? fp32 allreduce's goodput against the cap.

``benchmarks/capped.sh`` caps each emulated host's link with ``tc tbf`` and exports the rate as
``GRADCOMP_NETWORK``. A token bucket too small for the rate (the old 64 KB at 1 Gbit/s) lets
the link run at about half its rate, which flatters every ratio to fp32. So every capped run
measures what fp32 allreduce actually moved: the bytes one rank puts on the wire per step (the
bandwidth-optimal ``2(N-1)/N`` of the gradient, per host link ``2(H-1)/H``... of what crosses it),
over the step time, against the cap. Below ``MINIMUM`` the run is not reported as a result.
"""
from __future__ import annotations

import re
from typing import Any

#: the least fraction of the cap fp32 allreduce must reach for a capped run's ratios to count
MINIMUM = 0.85
#: below this many bytes per rank per step fp32 is latency-bound, and its goodput says nothing of
#: the link's rate (the tests' tiny model): not checked
CHECKED_FROM = 8 * 2**20

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def rate_bits(text: str) -> float:
    """tc's rate ``text`` (``1gbit``, ``500mbit``, ``125mbps``: bytes) in bits per second."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text or "")
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the rate {text!r} (tc units: 1gbit, 500mbit, 125mbps)")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def _flat_fp32(job: dict[str, Any]) -> dict[str, Any] | None:
    """The job's timed flat fp32 allreduce row: ``flat-allreduce`` where the job has one (on
    several hosts of several ranks plain ``allreduce`` is hierarchical by default, and leaves the
    link idle during its stages inside the host), else ``allreduce``."""
    rows = {r.get("method"): r for r in job.get("results", []) if "time_s" in r}
    return rows.get("flat-allreduce") or rows.get("allreduce")


def goodput(job: dict[str, Any]) -> float | None:
    """fp32 allreduce's bits per second on one host's link, as a fraction of the cap; None when
    the job was not capped or timed no fp32 allreduce. The bytes are the host's own counter where
    the worker read it (``host_link_bytes_per_step``), else the bandwidth-optimal formula (ranks
    of one host share its link: what they send to other hosts crosses it together)."""
    network = job.get("network")
    row = _flat_fp32(job)
    if int(job.get("ranks_per_host") or 1) >= int(job.get("ranks") or 1) > 1:
        return None  # one host: nothing crosses its link
    if not network or row is None or not row["time_s"] or not row.get("bytes_per_rank"):
        return None
    per_host = int(job.get("ranks_per_host") or 1)
    sent = row.get("host_link_bytes_per_step") or per_host * row["bytes_per_rank"]
    return sent * 8 / row["time_s"] / rate_bits(network)


def problem(job: dict[str, Any]) -> str | None:
    """Why this capped job's ratios must not be reported, or None."""
    fraction = goodput(job)
    row = _flat_fp32(job) or {}
    if fraction is None or fraction >= MINIMUM or row.get("bytes_per_rank", 0) < CHECKED_FROM:
        return None
    return (f"the emulated link ran below its rate: fp32 allreduce moved {fraction:.1%} of the "
            f"{job['network']} cap (at least {MINIMUM:.0%} needed): no ratios from this run. Check the "
            "tbf burst (benchmarks/capped.sh) and what else the machine is running.")
