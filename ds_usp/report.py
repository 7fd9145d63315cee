"""``python -m ds_usp.report``: what ds-usp can use on this machine (like DeepSpeed's ``ds_report``).

Prints the torch/DeepSpeed/ds-usp versions, the attention backends usable per device
(:func:`ds_usp.kernels.available_backends`) and the native op's state per device type: prebuilt
(``DS_BUILD_USP=1 pip install``), JIT-built (in torch's extension cache), JIT-buildable (builds on
first use) or not buildable and why. Nothing is built unless ``--build`` is given.
"""
from __future__ import annotations

import argparse
import shutil
from typing import Optional, Sequence

import torch


def _deepspeed_version() -> str:
    try:
        import deepspeed
        return deepspeed.__version__
    except Exception as e:  # noqa: BLE001 - the report must print whatever is broken
        return f"not importable ({type(e).__name__}: {e})"


def collect(build: bool = False) -> list[tuple[str, str]]:
    """The report's rows.

    Args:
        build: load (and if needed JIT-build) the native op for each device type before reporting.

    Returns:
        ``(label, value)`` pairs in print order.
    """
    import ds_usp
    from ds_usp.kernels import available_backends
    from ds_usp.native import NativeOpUnavailable, load_native_op, native_op_state

    rows = [("torch", f"{torch.__version__} (cuda {torch.version.cuda or 'none'}, "
                      f"cuda available: {torch.cuda.is_available()})"),
            ("deepspeed", _deepspeed_version()),
            ("ds_usp", f"{ds_usp.__version__} ({ds_usp.__file__})"),
            ("compilers", f"c++: {shutil.which('c++') or 'not found'}, nvcc: {shutil.which('nvcc') or 'not found'}, "
                          f"ninja: {shutil.which('ninja') or 'not found'}")]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for name, reason in available_backends(dev).items():
            rows.append((f"attention backend {name!r} on {dev}", "usable" if reason is None else f"no: {reason}"))
    for dev in ("cpu", "cuda"):
        if build and dev in devices:
            try:
                load_native_op(dev)
            except NativeOpUnavailable as e:
                rows.append((f"native op ({dev}) build", f"failed: {e}"))
        state = native_op_state(dev)
        note = "" if dev in devices else " (no CUDA device here: used only on a GPU machine)"
        rows.append((f"native op ({dev})", f"{state.state}: {state.detail}{note}"))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Print the report.

    Args:
        argv: command-line arguments (``--build``); ``None`` reads ``sys.argv``.
    """
    p = argparse.ArgumentParser(prog="python -m ds_usp.report", description=__doc__.split("\n")[0])
    p.add_argument("--build", action="store_true", help="JIT-build the native op now if it is not built yet")
    args = p.parse_args(argv)
    rows = collect(build=args.build)
    width = max(len(k) for k, _ in rows)
    print("-" * 60)
    print("ds-usp report")
    print("-" * 60)
    for k, v in rows:
        print(f"{k:<{width}} : {v}")


if __name__ == "__main__":
    main()
