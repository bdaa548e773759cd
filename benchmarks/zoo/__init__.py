"""The workload zoo: every lossy compression method on workloads unlike the repository's own.

    python -m benchmarks zoo --list
    python -m benchmarks zoo --half tuning --steps 400 --methods none int8 onebit topk powersgd dgc onebitadam
    python -m benchmarks zoo --report --out results/zoo

Why it exists (issue 57): a method tuned on the repository's digits MLP and stdlib LM may hold
there and fail on a user's model. The zoo trains small models of several families (MLP on
tabular data, 2-D and 1-D CNNs, GRU and LSTM, transformers) under the optimizers users pick
(momentum SGD with a cosine schedule, AdamW, Adam, RMSprop), with data that ships with installed
packages or is generated, never downloaded. It is split in two halves: defaults and constants are
chosen on ``half="tuning"`` and the figures that are published come from ``half="validation"``.

Modules:

* ``data``: the data sets (sklearn's generators, synthetic images, waveforms, Markov chains,
  sorting, bytes of installed files), each a ``Data`` with a training sampler and a fixed held-out set;
* ``models``: the small networks;
* ``workloads``: the ``Workload`` table (family, optimizer, learning rate, batch, metric, half);
* ``methods``: a method spec (``none``, a registry spec, ``dgc[:...]``, ``onebitadam[:...]``,
  ``diloco[:...]``) -> the model wrapper and optimizer a user would build;
* ``worker``: runs inside ``mpiexec``: one workload, length and seed, every method in turn;
* ``runner``: launches the workers (``gradcomp.launcher.run``), skipping results already there;
* ``report``: the table of gap and compression ratio, and the heatmap;
* ``cli``: ``python -m benchmarks zoo``.
"""
