"""ds-usp: Unified Sequence Parallelism (Ulysses x Ring attention) for DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="ds-usp",
    version="0.1.0",
    description="Unified Sequence Parallelism (DeepSpeed-Ulysses x Ring-Attention) as a DeepSpeed extension",
    packages=find_packages(include=["ds_usp", "ds_usp.*"]),
    python_requires=">=3.10",
    # torch is pinned by the install command on CPU machines (torch==2.13.0); any torch>=2.3 works.
    install_requires=["torch>=2.3", "deepspeed>=0.16", "pydantic>=2"],
    extras_require={
        "dev": ["pytest>=7", "hypothesis>=6"],
        "gpu": ["flash-attn>=2.5", "triton>=3.0"],
    },
)
