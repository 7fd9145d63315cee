"""ds-usp: Unified Sequence Parallelism (Ulysses x Ring attention) for DeepSpeed.

The native op lives at the repository top, as DeepSpeed keeps ``op_builder/`` and ``csrc/``: ``ops/`` holds
its DeepSpeed op builders (``ops/__init__.py``) and its C++/CUDA sources (``ops/csrc``). Installing maps that
folder into the package as ``ds_usp.native.op_builder`` (sources as package data), so the op is JIT-built on
first use, also after a plain ``pip install .``. ``DS_BUILD_USP=1`` prebuilds them at install time instead
(DeepSpeed's ``DS_BUILD_<OP>`` convention); torch and deepspeed must then be importable by the build:

    DS_BUILD_USP=1 pip install --no-build-isolation .

The install also puts ``ds_usp_auto.pth`` (and ``ds_usp_auto.start``, its PEP 829 form for Python 3.15) at the top of
site-packages, beside the top-level module ``_ds_usp_auto``: at interpreter start it installs the gates that make a
DeepSpeed config with ``"sequence_parallel"`` honoured or refused by name in programs that never import ds-usp
(``_ds_usp_auto``'s docstring; ``DS_USP_AUTO=0`` turns the automatic part off). Both the plain install (the wheel's
RECORD lists the files, so ``pip uninstall`` removes them) and the editable one (``pip install -e .``, whose wheel
gets them appended: setuptools' editable strategies ship only the package mapping) carry them.
"""
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

OP_PACKAGE = "ds_usp.native.op_builder"
HOOK_MODULE = "_ds_usp_auto"
# site-packages' start-up files: a .pth line (imports run by site.py) and the PEP 829 entry point with the same stem
START_FILES = {"ds_usp_auto.pth": f"import {HOOK_MODULE}; {HOOK_MODULE}.install()\n",
               "ds_usp_auto.start": f"{HOOK_MODULE}:install\n"}


class BuildPyWithStartFiles(build_py):
    """``build_py`` that also writes the start-up files at the top of ``build_lib`` (a wheel's purelib root is
    site-packages) and lists them among its outputs, so the wheel's RECORD, and so ``pip uninstall``, know them."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable wheel gets them from EditableWheelWithStartFiles
            for name, text in START_FILES.items():
                with open(os.path.join(self.build_lib, name), "w") as f:
                    f.write(text)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        extra = [] if self.editable_mode else [os.path.join(self.build_lib, name) for name in START_FILES]
        return super().get_outputs(include_bytecode) + extra


class _WithStartFiles:
    """An editable-install strategy of setuptools that also writes the start-up files into the wheel it fills (before
    the wheel is closed, so its RECORD lists them)."""

    def __init__(self, strategy: object) -> None:
        self.strategy = strategy

    def __call__(self, wheel: object, files: list, mapping: dict) -> None:
        self.strategy(wheel, files, mapping)
        for name, text in START_FILES.items():
            wheel.writestr(name, text)

    def __enter__(self) -> object:
        return self.strategy.__enter__()

    def __exit__(self, *exc: object) -> object:
        return self.strategy.__exit__(*exc)


class EditableWheelWithStartFiles(editable_wheel):
    """PEP 660 (``pip install -e .``): the editable wheel gets the start-up files too (setuptools' editable
    strategies ship only the packages' mapping, not files written beside them); ``_ds_usp_auto`` itself is imported
    from the source tree through that mapping (``__editable__.ds_usp-*.pth`` sorts, and so runs, before ours)."""

    def _select_strategy(self, name: str, tag: str, build_lib: str) -> _WithStartFiles:
        return _WithStartFiles(super()._select_strategy(name, tag, build_lib))


def _prebuilt_native_op() -> dict:
    """The native op's extensions and build command when DS_BUILD_USP=1 (``ext_modules``, ``build_ext``); none
    otherwise."""
    if os.environ.get("DS_BUILD_USP", "0") != "1":
        return {}
    import importlib.util

    from torch.utils.cpp_extension import BuildExtension

    # by path: ds_usp itself is not importable before it is installed
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops", "__init__.py")
    spec = importlib.util.spec_from_file_location("ds_usp_op_builder", path)
    builders = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builders)
    cpu, cuda = builders.USPCPUBuilder(), builders.USPCUDABuilder()
    if not cpu.is_compatible():
        raise RuntimeError(f"DS_BUILD_USP=1 but the ds-usp native op cannot be built: {cpu.error_log}")
    exts = [cpu.builder()]
    if cuda.is_compatible():  # a CUDA torch and nvcc: also build the CUDA variant
        exts.append(cuda.builder())
    else:
        print(f"DS_BUILD_USP=1: building the CPU variant only ({cuda.error_log})")
    return {"ext_modules": exts, "build_ext": BuildExtension}


_NATIVE = _prebuilt_native_op()
_COMMANDS = {"build_py": BuildPyWithStartFiles, "editable_wheel": EditableWheelWithStartFiles}
if "build_ext" in _NATIVE:
    _COMMANDS["build_ext"] = _NATIVE.pop("build_ext")

setup(
    name="ds-usp",
    version="0.1.0",
    description="Unified Sequence Parallelism (DeepSpeed-Ulysses x Ring-Attention) as a DeepSpeed extension",
    # the top-level ops/ (builders + sources) is installed as ds_usp.native.op_builder, DeepSpeed's op_builder/ layout
    packages=find_packages(include=["ds_usp", "ds_usp.*"]) + [OP_PACKAGE],
    py_modules=[HOOK_MODULE],  # the gates the start-up files install (stdlib only: nothing else at start)
    package_dir={OP_PACKAGE: "ops"},
    package_data={OP_PACKAGE: ["csrc/*.cpp", "csrc/*/*.cpp", "csrc/*/*.cu", "csrc/*/*.h"]},
    python_requires=">=3.11",  # exception notes (BaseException.add_note) name the rank and step of a failure
    # The floors of torch, deepspeed, transformers, accelerate and trl are the versions CI runs (the dev extra pins
    # the newest, tests/test_oldest.py runs a subset at the oldest; tests/test_docs.py fails when a floor is neither). Older releases are not tested: the custom
    # ops need torch>=2.4 (torch.library.custom_op) and the ZeRO-3 correction calls a private method of DeepSpeed's
    # stage-3 optimizer (ds_usp/integration/engine/initialize.py). pydantic, hjson, matplotlib, datasets and
    # diffusers: CI runs the release pip resolves; their floors are the versions whose API is used, not tested as such.
    # The README's install command pins torch==2.13.0; on GPU machines install the torch for your CUDA first.
    install_requires=["torch>=2.13", "deepspeed>=0.19.8", "pydantic>=2", "hjson"],
    extras_require={
        "hf": ["transformers>=5.6"],  # attn_implementation="usp" (5.6: tests/test_oldest.py's subset)
        "demo": ["transformers>=5.23", "matplotlib>=3.7"],  # examples/train_llama.py with its loss.png
        "dit": ["diffusers>=0.42", "matplotlib>=3.7"],  # diffusion transformers, examples/train_dit.py
        # ds_usp.USPTrainer, USPSFTTrainer: later releases are accepted when they have every hook the integration uses
        # (ds_usp.integration.trainers.trainer.check_hooks checks transformers' and accelerate's, not the versions).
        # The floors are LLaMA-Factory 0.9.5's pins, which tests/test_oldest.py runs a subset at; the SFT and RL
        # trainers need TRL's fused LM head (TRL 1.x, the dev pin) and refuse an older TRL by name
        "trainer": ["transformers>=5.6", "accelerate>=1.11", "trl>=0.24", "datasets>=3"],
        # the versions CI runs: torch and deepspeed exactly (README: pip install torch==2.13.0 first), the HF stack
        # within its minor version
        "dev": ["torch==2.13.0", "deepspeed==0.19.8", "pytest>=7", "hypothesis>=6", "transformers>=5.23,<5.24",
                "accelerate>=1.15,<1.16", "trl>=1.16,<1.17",
                # triton: its kernels run on CPU under TRITON_INTERPRET=1 in the tests, and one test compiles them
                # for sm_90 through triton's non-public compiler entry points, hence the pinned minor version
                "datasets>=3", "triton>=3.9,<3.10",
                # tests/test_dit.py: the diffusers models ds-usp shards (its attention dispatch is patched: minor pinned)
                "diffusers>=0.42,<0.43"],
        # not run by CI (no GPU): the Triton kernels ran on an H100 with triton 3.6 (before soft-capping and sinks);
        # flash-attn is supported but has not run on a GPU yet
        "gpu": ["flash-attn>=2.5", "triton>=3.6"],
        # usp.attn_backend "flash_attn_4" (Hopper/Blackwell; also taken by "auto" where it checks equal on the device):
        # FlashAttention-4 exists only as pre-releases; the adapter was read against 4.0.0b0 to b36 and has not run on a
        # GPU yet. It pulls nvidia-cutlass-dsl (its libs wheels are about 92 MB), quack-kernels and apache-tvm-ffi
        "fa4": ["flash-attn-4>=4.0.0b3"],
    },
    cmdclass=_COMMANDS,
    **_NATIVE,
)
