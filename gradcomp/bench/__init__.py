"""Benchmarks: ``python -m gradcomp bench`` (see ``gradcomp.cli``) and the capped-network step time.

* ``shapes``: the parameter shapes of ResNet-50 and BERT-base, and heavy-tailed fake gradients.
* ``methods``: what is compared, gradcomp compressors and PyTorch's own DDP hooks, by name.
* ``worker``: runs on every rank under ``mpiexec``; times whole steps (all buckets), counts bytes
  per rank, measures the error against the exact mean; rank 0 writes one JSON file.
* ``kernels``: single-process kernel throughput as a multiple of a memcpy of the same buffer.
* ``driver``: launches the workers for each number of ranks, shows progress, writes JSON/CSV.
* ``plots``: PNG figures (matplotlib, Agg backend).

Timings are ratios measured side by side in one run (medians of repeats): absolute times on a
shared machine mean little, the ratio to a plain fp32 allreduce or a memcpy measured in the same
run does.
"""
