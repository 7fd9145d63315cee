"""The step and layer meters where the issues name them (``benchmarks/work_meter.py``): they live in the package, as
:mod:`ds_usp.instruments.work_meter` (installed with ds-usp, imported by the tests and benchmarks by that name); this
file only re-exports them for scripts run from ``benchmarks/``."""
from ds_usp.instruments.work_meter import (Counts, LayerHostReads, Site, StepMeter, ZeroCompute,  # noqa: F401
                                           matmul_flops, short_path)
