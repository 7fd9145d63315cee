"""Run axolotl's training entry point on a CPU-only machine: two GPU assumptions of axolotl are bridged, nothing else.

    python examples/axolotl/cpu_launch.py CONFIG.yaml                       # one process
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 29712 \
        examples/axolotl/cpu_launch.py CONFIG.yaml                          # 2 ranks (torchrun under accelerate)

Both forms run what ``python -m axolotl.cli.train CONFIG.yaml`` runs (``axolotl train CONFIG.yaml`` with its default
``accelerate`` launcher is ``accelerate launch -m axolotl.cli.train CONFIG.yaml``), after two changes that matter
only where torch has no CUDA:

1. axolotl (0.19) starts torch.distributed itself for a one-process DeepSpeed run with a hard-coded ``nccl``
   (``axolotl.utils.trainer.setup_deepspeed_env``: ``deepspeed.comm.init_distributed(dist_backend="nccl")`` when
   ``WORLD_SIZE`` is 1), which a CPU build of torch lacks ("Distributed package doesn't have NCCL built in"): a
   request for ``nccl`` is given ``gloo`` where NCCL is missing. (With several ranks accelerate starts
   torch.distributed first, with gloo on CPU, and axolotl does not.)
2. With several ranks axolotl sets ``device_map = {"": LOCAL_RANK}`` (``axolotl.utils.config.normalize_config``), a
   CUDA device index, which transformers' loader refuses on CPU ("Cannot access accelerator device when none is
   available"; ZeRO-3 drops the device map and is not affected): an integer device in the model loader's
   ``device_map`` becomes ``"cpu"`` where CUDA is missing.

Everything else (the config, the trainer class, DeepSpeed, ds-usp's ``.pth`` hook) is axolotl's and the
installation's own. On a GPU machine the wrapper changes nothing and ``axolotl train`` can be used directly.

Left as it is, and to be known when reading a CPU run: with DeepSpeed and without ``use_cpu`` (axolotl has no such
key; ``ACCELERATE_USE_CPU=true`` would make transformers 5.16 / accelerate 1.13 drop DeepSpeed altogether), accelerate
names no backend on a host without accelerators and so counts one process on every rank (``num_processes`` 1,
``process_index`` 0): every rank prints the logs and writes TensorBoard events and the final model, and only runs with
one data-parallel replica work (sequence parallelism over all ranks; a plain 2-rank data-parallel run stops at
DeepSpeed's batch check, ``4 != 2 * 2 * 2``).
"""
from __future__ import annotations

import os


def _patch() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        original = dist.init_process_group

        def init_process_group(backend=None, *args, **kwargs):
            if isinstance(backend, str) and backend.lower() == "nccl":
                backend = "gloo"
            return original(backend, *args, **kwargs)

        dist.init_process_group = init_process_group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29711")

    if not torch.cuda.is_available():
        from axolotl.loaders.model import ModelLoader

        original_set = ModelLoader._set_device_map_config

        def _set_device_map_config(self):
            original_set(self)
            device_map = self.model_kwargs.get("device_map")
            if isinstance(device_map, int):
                self.model_kwargs["device_map"] = "cpu"
            elif isinstance(device_map, dict) and any(isinstance(v, int) for v in device_map.values()):
                self.model_kwargs["device_map"] = {k: "cpu" if isinstance(v, int) else v
                                                   for k, v in device_map.items()}

        ModelLoader._set_device_map_config = _set_device_map_config


def main() -> None:
    _patch()
    import fire
    from axolotl.cli.train import do_cli

    fire.Fire(do_cli)  # what `python -m axolotl.cli.train` runs


if __name__ == "__main__":
    main()
