"""The Triton backend against exact fp32 attention with an explicit mask (ds_usp.kernels.band).

On CPU the kernels run in Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``), so the
shapes are small: lengths 48..160 that are not multiples of the 16-row tiles, 2..4 heads, GQA and
MQA, head dims 16..64 and one padded (24). Each case checks the forward (out, LSE), the in-place
merge into a strided view of a larger running result (rows that saw nothing yet, and rows with a
running result), and the backward given the final out/LSE: causal and not, sq != sk, windows,
zigzag-like half bands, documents, documents with a window, and rows that see no key (zero output,
-inf LSE, zero gradients, nothing NaN). The same cases at real sizes run on a GPU (marked ``gpu``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_usp.kernels import band, triton_attn
from ds_usp.native.twins import TorchOps

pytest.importorskip("triton", reason="triton is installed with the dev extra")

FP32 = dict(atol=2e-5, rtol=2e-5)
LOW = dict(atol=3e-2, rtol=3e-2)

# (b, sq, sk, hq, hkv, d, lo, hi, docs: (q lengths, k lengths) or None)
CASES = [
    (1, 64, 64, 2, 2, 16, None, 0, None),  # causal
    (2, 48, 80, 4, 2, 16, None, None, None),  # full, sq != sk, GQA
    (1, 70, 70, 4, 1, 24, -31, 0, None),  # window of 32, MQA, padded head dim
    (1, 64, 64, 2, 2, 32, None, -5, None),  # zigzag-like: keys strictly before, a gap of 5
    (1, 50, 96, 2, 2, 16, 3, None, None),  # keys from 3 after the query on
    (1, 64, 64, 4, 2, 16, None, 0, ([10, 1, 30, 23], [10, 1, 30, 23])),  # causal documents, a 1-token one
    (1, 64, 64, 2, 2, 16, -7, 0, ([40, 24], [40, 24])),  # documents with a window
    (1, 40, 72, 2, 1, 16, None, None, ([25, 15], [30, 42])),  # documents, non-causal, sq != sk
    (1, 64, 48, 2, 2, 16, 20, None, None),  # rows 28.. see no key
    (1, 160, 160, 2, 2, 64, None, 0, None),  # d = 64, several tiles
]


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _keep(sq: int, sk: int, lo, hi, q_doc, k_doc) -> torch.Tensor:
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if lo is not None:
        keep &= j - i >= lo
    if hi is not None:
        keep &= j - i <= hi
    if q_doc is not None:
        keep &= q_doc[:, None].cpu() == k_doc[None, :].cpu()
    return keep


def _check_case(case, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    b, sq, sk, hq, hkv, d, lo, hi, docs = case
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, sq, hq, d, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    q_doc, k_doc = (None, None) if docs is None else (_doc_ids(docs[0]).to(device), _doc_ids(docs[1]).to(device))
    keep = _keep(sq, sk, lo, hi, q_doc, k_doc).to(device)
    scale = d ** -0.5
    tol = FP32 if dtype == torch.float32 else LOW
    want_out, want_lse = band.masked_forward(q, k, v, keep, scale)
    out, lse = triton_attn.band_forward(q, k, v, lo, hi, scale, q_doc, k_doc)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    blind = ~keep.any(1)  # rows that see no key
    assert (lse[:, :, blind] == float("-inf")).all() and (out[:, blind] == 0).all()

    grads = triton_attn.band_backward(dout, q, k, v, out, lse, lo, hi, scale, q_doc, k_doc)
    want = band.masked_backward(dout, q, k, v, want_out, want_lse, keep, scale)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        torch.testing.assert_close(got.float(), ref.float(), **tol, msg=lambda m: f"{name}: {m}")
    assert (grads[0][:, blind] == 0).all()

    # merge in place into rows 5.. of a larger running result; its first 3 rows have seen nothing yet
    run_out = torch.randn(b, sq + 5, hq, d, generator=g).to(device)
    run_lse = torch.randn(b, hq, sq + 5, generator=g).to(device)
    run_out[:, 5:8], run_lse[:, :, 5:8] = 0.0, float("-inf")
    want_run_out, want_run_lse = run_out[:, 5:].clone(), run_lse[:, :, 5:].clone()
    TorchOps().merge_block_(want_run_out, want_run_lse, want_out, want_lse)
    head_out, head_lse = run_out[:, :5].clone(), run_lse[:, :, :5].clone()
    triton_attn.band_forward_merge_(q, k, v, lo, hi, scale, run_out[:, 5:], run_lse[:, :, 5:], q_doc, k_doc)
    torch.testing.assert_close(run_out[:, 5:], want_run_out, **tol)
    torch.testing.assert_close(run_lse[:, :, 5:], want_run_lse, **tol)
    assert torch.equal(run_out[:, :5], head_out) and torch.equal(run_lse[:, :, :5], head_lse)  # untouched
    assert not torch.isnan(run_out).any()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}x{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-band{c[6]},{c[7]}"
                                             f"{'-docs' if c[8] else ''}" for c in CASES])
def test_matches_exact_attention_cpu(case):
    _check_case(case, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cpu(dtype):
    _check_case(CASES[5], dtype, "cpu")  # causal documents, GQA


def test_plain_entries_are_the_causal_and_full_bands():
    case = CASES[1]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 48, 4, 16, generator=g)
    k, v = (torch.randn(1, 48, 2, 16, generator=g) for _ in range(2))
    for causal, hi in ((True, 0), (False, None)):
        out, lse = triton_attn.attention_forward(q, k, v, causal, 0.25)
        ref = triton_attn.band_forward(q, k, v, None, hi, 0.25)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), case


def test_unavailable_reason_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in triton_attn.unavailable_reason(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_attn.unavailable_reason(torch.device("cpu")) is None


# Compiles each kernel to Triton IR for an H100 (sm_90), in a process without TRITON_INTERPRET (under the
# interpreter @triton.jit gives interpreted functions). Uses triton's compiler entry points (ASTSource,
# make_backend, make_ir), which are not public API: the dev extra pins triton's minor versions for this.
_COMPILE_SCRIPT = textwrap.dedent("""
    import itertools
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ds_usp.kernels import _triton_kernels as kernels

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": 4, "num_stages": 3})
    halves = {"Q", "K", "V", "O", "DO"}
    for name, flags in itertools.product(("fwd", "bwd_dkdv", "bwd_dq"), itertools.product((False, True), repeat=2)):
        fn = getattr(kernels, name)
        consts = dict(HAS_DOC=flags[0], IEEE=flags[1], BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)
        if name == "fwd":
            consts["MERGE"] = flags[0]
        signature = {}
        for arg in fn.arg_names:
            if arg in consts:
                signature[arg] = "constexpr"
            elif arg.isupper():  # pointers
                signature[arg] = "*bf16" if arg in halves else "*i32" if arg in ("QD", "KD") else "*fp32"
            else:
                signature[arg] = "fp32" if arg == "scale_log2" else "i32"
        src = ASTSource(fn=fn, signature=signature,
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                    context)
        print("compiled", name, flags)
""")


def test_kernels_compile_for_a_gpu_target():
    """The interpreter runs code the GPU compiler refuses (e.g. a global annotated ``tl.constexpr`` instead
    of made one); this compiles every kernel variant for sm_90 on a machine without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("compiled") == 12, res.stdout


def test_bad_inputs_are_refused():
    q = torch.randn(1, 16, 2, 16)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        triton_attn.band_forward(q.double(), q.double(), q.double(), None, 0, 0.25)
    with pytest.raises(ValueError, match="head dims up to 256"):
        big = torch.randn(1, 16, 1, 320)
        triton_attn.band_forward(big, big, big, None, 0, 0.25)
    with pytest.raises(ValueError, match="give both or neither"):
        triton_attn.band_forward(q, q, q, None, 0, 0.25, q_doc=torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="must be float32"):
        triton_attn.band_forward_merge_(q, q, q, None, 0, 0.25, q.clone().half(), torch.zeros(1, 2, 16))


GPU_CASES = [
    (1, 2048, 2048, 8, 2, 128, None, 0, None),
    (2, 1024, 3072, 8, 8, 64, None, None, None),
    (1, 4096, 4096, 8, 1, 128, -1023, 0, ([1000, 24, 3072], [1000, 24, 3072])),
    (1, 2048, 2048, 4, 4, 64, None, -100, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_matches_exact_attention_cuda(case, dtype):
    _check_case(case, dtype, "cuda")


def test_interpreter_is_chosen_per_tensor_not_per_process():
    """Under TRITON_INTERPRET=1 (set by conftest, also on a GPU host) CPU tensors get interpreted kernels and CUDA
    tensors compiled ones: the interpreter never silently runs a GPU's attention, and one pytest process on a GPU
    host runs both kinds of test. The environment is left as it was."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    before = os.environ.get("TRITON_INTERPRET")
    interpreted, compiled = triton_attn._kernels(True), triton_attn._kernels(False)
    assert isinstance(interpreted.fwd, InterpretedFunction)
    assert isinstance(compiled.fwd, JITFunction)
    assert not isinstance(compiled.fwd, InterpretedFunction)
    assert os.environ.get("TRITON_INTERPRET") == before
    # the interpreted copy's helpers are the interpreter's plain functions (no re-patching of triton.language at each
    # call from a kernel); the compiled copy keeps them as @triton.jit functions for the compiler to inline
    for name in ("_dot", "_scores", "_keep", "_tile_docs", "_query_tile"):
        assert not isinstance(getattr(interpreted, name), InterpretedFunction), name
        assert isinstance(getattr(compiled, name), JITFunction), name
