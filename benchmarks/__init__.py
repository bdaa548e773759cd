"""Benchmarks: ``python -m benchmarks bench`` (see ``benchmarks.__main__``) and the capped-network
step time. Not part of the installed package (setup.cfg ships ``gradcomp*`` only): run from the
repository root, where ``benchmarks`` imports; they use gradcomp's public API only.

The capped-network shell scripts (``capped.sh``, ``capped_steps.sh``, ``fsdp_steps.sh``), the
one-off measurement scripts (``scripts/``), the committed figures (``figures/``) and the tests of
the benchmark code (``tests/``, run by ``make test``) sit here too.

* ``shapes``: the parameter shapes of ResNet-50 and BERT-base, and heavy-tailed fake gradients.
* ``methods``: what is compared: every compressor in ``gradcomp.REGISTRY`` by spec (a registered
  name joins ``--methods all`` with no edit here) and PyTorch's own DDP hooks.
* ``worker``: runs on every rank under ``mpiexec``; on one of two paths, ``reducer`` (the README's
  ``GradientReducer`` on NumPy arrays) or ``ddp`` (real DistributedDataParallel, each method its
  comm hook), times whole steps, counts page faults and bytes per rank, measures the error against
  the exact mean; rank 0 writes one JSON file.
* ``paths``: what the worker steps: the two paths and one case per method on each.
* ``hookbucket``: a GradBucket stand-in for calling PyTorch's hooks outside DDP.
* ``kernels``: single-process kernel throughput as a multiple of a memcpy of the same buffer.
* ``driver``: launches the workers for each number of ranks, shows progress, writes JSON/CSV.
* ``plots``: PNG figures (matplotlib, Agg backend); ``labels``: their non-overlapping labels.

Timings are ratios measured side by side in one run (medians of repeats): absolute times on a
shared machine mean little, the ratio to a plain fp32 allreduce or a memcpy measured in the same
run does.
"""
