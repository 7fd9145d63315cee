"""Measuring instruments for the tests and the benchmarks, not used by the library itself: what they measure is
ds-usp (and DeepSpeed's ALST beside it), so they sit above every layer they measure and nothing of the package
imports them. Importing this package imports none of its modules.

* :mod:`ds_usp.instruments.meters`: the bytes a rank sends through ``torch.distributed`` (``CommCounter``,
  ``measure_attention``), a training step's peak in live bytes and the planner's figure for it (``step_peak``,
  ``predicted_peak``), a function's resident growth (``peak_growth``);
* :mod:`ds_usp.instruments.work_meter`: a deterministic count of a training step's work on CPU (``StepMeter``: aten
  ops, kernels, matmuls, FLOPs, host syncs, big allocations), ``ZeroCompute`` for warm-up steps at no compute, and
  the host's reads of tensor values inside decoder layers (``LayerHostReads``).
"""
