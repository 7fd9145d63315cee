"""The native op (ds_usp.native) against its PyTorch twins (ds_usp.native.twins.TorchOps), and USP attention with it on and off.

* Kernels, single process: the ring LSE merge (tolerance: the twin uses PyTorch's vectorized exp/log1p,
  the op glibc's, so they differ by a few ulp: atol = rtol = 1e-6 on fp32), the fp32 gradient
  accumulation and the Ulysses packing (bitwise: the same arithmetic or pure copies), on random shapes,
  strided views, -inf LSE rows, fp32/bf16/fp16.
* Selection: ``native_op=True`` with no compiler raises :class:`NativeOpUnavailable` naming the missing
  compiler. The missing compiler is simulated by pointing ``$CXX`` (what torch's extension build runs)
  at a nonexistent path, with the per-process load cache emptied and no prebuilt module visible.
* USP on a gloo world of 4: outputs and gradients with ``native_op=True`` and ``False`` for the splits
  (4,1), (2,2), (1,4), causal/non-causal, contiguous/zigzag, MHA/GQA/MQA, a padded length, batch 1 and 2.
  Tolerance fp32 atol = rtol = 1e-5, bf16/fp16 atol = rtol = 2e-2 (the merge's ulp-level differences).
* The CUDA kernels compile with nvcc for sm_80 and sm_90 (skipped without nvcc); the CUDA path runs
  against the twins only with a GPU (``gpu`` marker).

The first test that needs the op JIT-builds it (about a minute; cached in ~/.cache/torch_extensions).
"""
from __future__ import annotations

import itertools
import re
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import ds_usp.native as native
from dist_harness import get_topo
from ds_usp.native import NativeOps, NativeOpUnavailable, TorchOps, load_native_op, resolve_native_op

TWINS = TorchOps()
merge_block_ = TWINS.merge_block_

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NEG_INF = float("-inf")
CSRC = Path(__file__).resolve().parent.parent / "ops" / "csrc"


@pytest.fixture(scope="module")
def ops():
    """The CPU native op (JIT-built on first use); the module is skipped when it cannot be built."""
    try:
        op = load_native_op("cpu")
    except NativeOpUnavailable as e:  # e.g. no compiler on this machine
        pytest.skip(str(e))
    assert isinstance(op, NativeOps) and op.source in ("jit", "prebuilt")
    return op


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ merge


def _merge_inputs(seed: int, b: int, s: int, h: int, d: int, dtype: torch.dtype):
    """Running (out, lse) over 2s rows and a block for rows [s, 2s) with some -inf LSE rows in both."""
    g = _gen(seed)
    out = torch.randn(b, 2 * s, h, d, generator=g)
    lse = torch.randn(b, h, 2 * s, generator=g)
    block_out = torch.randn(b, s, h, d, generator=g).to(dtype)
    block_lse = torch.randn(b, h, s, generator=g)
    lse[:, :, s:s + s // 3] = NEG_INF  # rows that saw no key yet
    block_lse[:, :, s // 4:s // 2] = NEG_INF  # rows that see no key of this block (overlaps: both -inf)
    out[:, s:s + s // 3] = 0.0  # a row with lse -inf has out 0
    return out, lse, block_out, block_lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed,b,s,h,d", [(0, 1, 64, 8, 64), (1, 2, 37, 3, 16), (2, 3, 5, 1, 80)])
def test_merge_matches_twin_on_strided_views(ops, dtype, seed, b, s, h, d):
    out, lse, block_out, block_lse = _merge_inputs(seed, b, s, h, d, dtype)
    o_twin, l_twin, o_nat, l_nat = out.clone(), lse.clone(), out.clone(), lse.clone()
    merge_block_(o_twin[:, s:], l_twin[:, :, s:], block_out, block_lse)  # strided views, as in the ring
    ops.merge_block_(o_nat[:, s:], l_nat[:, :, s:], block_out, block_lse)
    assert not torch.isnan(o_nat).any() and not torch.isnan(l_nat).any()
    torch.testing.assert_close(o_nat, o_twin, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l_nat, l_twin, atol=1e-6, rtol=1e-6)  # -inf rows must match exactly
    assert torch.equal(o_nat[:, :s], out[:, :s]) and torch.equal(l_nat[:, :, :s], lse[:, :, :s])  # untouched


def test_merge_non_unit_last_stride_and_transposed_block(ops):
    out, lse, block_out, block_lse = _merge_inputs(3, 2, 16, 4, 8, torch.float32)
    block_t = block_out.transpose(2, 3).contiguous().transpose(2, 3)  # same values, d not unit-stride
    out_t = out.transpose(2, 3).contiguous().transpose(2, 3)
    o_twin, l_twin, l_nat = out.clone(), lse.clone(), lse.clone()
    merge_block_(o_twin[:, 16:], l_twin[:, :, 16:], block_out, block_lse)
    ops.merge_block_(out_t[:, 16:], l_nat[:, :, 16:], block_t, block_lse)
    torch.testing.assert_close(out_t, o_twin, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l_nat, l_twin, atol=1e-6, rtol=1e-6)


def test_merge_all_inf_rows_stay_zero(ops):
    out = torch.zeros(1, 4, 2, 8)
    lse = torch.full((1, 2, 4), NEG_INF)
    ops.merge_block_(out, lse, torch.randn(1, 4, 2, 8), torch.full((1, 2, 4), NEG_INF))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_merge_rejects_bad_inputs(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.merge_block_(torch.zeros(1, 2, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, 4),
                         torch.zeros(1, 2, 2))
    with pytest.raises(RuntimeError, match=r"\(b, h, s\)"):
        ops.merge_block_(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 3), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 3))


# ------------------------------------------------------------------------------------ accumulation


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_bitwise(ops, dtype):
    g = _gen(7)
    acc = torch.randn(2, 40, 3, 24, generator=g)
    x = torch.randn(2, 20, 3, 24, generator=g).to(dtype)
    twin, nat = acc.clone(), acc.clone()
    twin[:, 10:30] += x  # the ring's `dq[:, qs] += dq_b`
    ops.accumulate_(nat[:, 10:30], x)
    assert torch.equal(nat, twin)
    x_strided = torch.randn(2, 3, 20, 24, generator=g).to(dtype).transpose(1, 2)  # (b, s, h, d) view of bhsd
    twin[:, :20] += x_strided
    ops.accumulate_(nat[:, :20], x_strided)
    assert torch.equal(nat, twin)


# ------------------------------------------------------------------------------------------ packing


def _twin_pack(q, k, v, u):
    """The twin's send buffer for q, k, v (kv heads replicated when U does not divide them)."""
    rep = 1 if k.shape[2] % u == 0 else u // k.shape[2]
    return TWINS.pack_seq_to_head([q, k, v], [1, rep, rep], u)


def test_twin_packing_matches_a_hand_written_layout():
    """The twin itself against the layout spelled out index by index: chunk u, tensor after tensor, heads in order."""
    b, s, d, u, hq, hkv = 2, 3, 4, 4, 8, 2
    g = _gen(5)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    send = _twin_pack(q, k, v, u)
    rep = u // hkv
    for dst in range(u):
        want = torch.cat([q[:, :, dst * 2:(dst + 1) * 2], k[:, :, dst // rep:dst // rep + 1],
                          v[:, :, dst // rep:dst // rep + 1]], dim=2)
        assert torch.equal(send[dst], want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,u,hq,hkv", [(1, 4, 8, 8), (2, 4, 8, 2), (2, 4, 8, 1), (3, 2, 6, 2), (1, 4, 4, 1),
                                         (2, 1, 4, 2)])
def test_qkv_packing_bitwise(ops, dtype, b, u, hq, hkv):
    g = _gen(b * 100 + u * 10 + hkv)
    s, d = 6, 16
    q = torch.randn(b, s, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    rep = 1 if hkv % u == 0 else u // hkv
    send = ops.pack_seq_to_head([q, k, v], [1, rep, rep], u)
    assert send.is_contiguous() and torch.equal(send, _twin_pack(q, k, v, u))
    # after the all-to-all the receiver unpacks; a stand-in recv buffer exercises the layout
    heads = [hq // u, hkv * rep // u, hkv * rep // u]
    recv = torch.randn(send.shape, generator=g).to(dtype)
    got = ops.unpack_seq_to_head(recv)
    assert torch.equal(got, TWINS.unpack_seq_to_head(recv))
    want = got.split(heads, dim=2)
    # backward direction: head shards -> send buffer -> sequence shards, replicas summed
    back = ops.pack_head_to_seq(list(want), u)
    assert torch.equal(back, recv)
    assert torch.equal(TWINS.pack_head_to_seq(list(want), u), recv)
    dq, dk, dv = ops.unpack_head_to_seq(back, heads, [1, rep, rep])
    ref = TWINS.unpack_head_to_seq(back, heads, [1, rep, rep])
    assert torch.equal(dq, ref[0])
    tol = {} if rep <= 2 else dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for x, y in zip((dk, dv), ref[1:]):
        if tol:
            torch.testing.assert_close(x, y, **tol)
        else:
            assert torch.equal(x, y)


def test_single_tensor_packing_roundtrip(ops):
    g = _gen(11)
    for b in (1, 2):
        x = torch.randn(b, 5, 8, 4, generator=g)
        send = ops.pack_seq_to_head([x], [1], 4)  # (b, s, h, d) -> (U, b, s, h/U, d)
        twin = x.reshape(b, 5, 4, 2, 4).permute(2, 0, 1, 3, 4).contiguous()
        assert torch.equal(send, twin) and torch.equal(TWINS.pack_seq_to_head([x], [1], 4), twin)
        heads = ops.unpack_seq_to_head(send)
        back = ops.pack_head_to_seq([heads], 4)
        (seq,) = ops.unpack_head_to_seq(back, [2], [1])
        assert torch.equal(seq, x)


def test_random_shapes_all_kernels(ops):
    """30 random shapes/dtypes/strides (seeded): merge (ulp tolerance), accumulate and packing (bitwise)."""
    rng = torch.Generator().manual_seed(2024)

    def pick(*xs):
        return xs[int(torch.randint(len(xs), (1,), generator=rng))]

    for _ in range(30):
        dtype = pick(*DTYPES)
        b, s, h, d = pick(1, 2, 3), pick(1, 7, 33), pick(1, 2, 4, 8), pick(8, 16, 40, 128)
        out, lse, block_out, block_lse = _merge_inputs(int(torch.randint(1 << 30, (1,), generator=rng)), b, s, h, d,
                                                       dtype)
        o_twin, l_twin, o_nat, l_nat = out.clone(), lse.clone(), out.clone(), lse.clone()
        merge_block_(o_twin[:, s:], l_twin[:, :, s:], block_out, block_lse)
        ops.merge_block_(o_nat[:, s:], l_nat[:, :, s:], block_out, block_lse)
        torch.testing.assert_close(o_nat, o_twin, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(l_nat, l_twin, atol=1e-6, rtol=1e-6)
        twin, nat = out.clone(), out.clone()
        twin[:, :s] += block_out
        ops.accumulate_(nat[:, :s], block_out)
        assert torch.equal(nat, twin)
        u = pick(*[x for x in (1, 2, 4, 8) if h % x == 0])
        hkv = pick(*[x for x in (1, 2, 4, 8) if h % x == 0 and (x % u == 0 or u % x == 0)])
        q = torch.randn(b, s, h, d, generator=rng).to(dtype)
        k, v = (torch.randn(b, s, hkv, d, generator=rng).to(dtype) for _ in range(2))
        rep = 1 if hkv % u == 0 else u // hkv
        send = ops.pack_seq_to_head([q, k, v], [1, rep, rep], u)
        assert torch.equal(send, _twin_pack(q, k, v, u))
        parts = ops.unpack_seq_to_head(send).split([h // u, hkv * rep // u, hkv * rep // u], dim=2)
        assert torch.equal(ops.pack_head_to_seq(parts, u), send)


# ------------------------------------------------------------------------------------------ selection


@pytest.fixture()
def no_compiler(monkeypatch):
    """A process where no prebuilt op exists, nothing was loaded yet and $CXX names a missing compiler."""
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setattr(native, "_import_prebuilt", lambda device_type: None)
    monkeypatch.setenv("CXX", "/nonexistent/bin/c++")
    return "/nonexistent/bin/c++"


def test_native_op_true_without_compiler_is_an_error(no_compiler):
    with pytest.raises(NativeOpUnavailable, match=r"usp.native_op=True but cannot build .*no C\+\+ compiler: "
                                                  r"'/nonexistent/bin/c\+\+'"):
        resolve_native_op(True, "cpu")


def test_native_op_auto_without_compiler_warns_once(no_compiler):
    with pytest.warns(RuntimeWarning, match=r"usp.native_op='auto': cannot build .*no C\+\+ compiler.*falling back"):
        assert type(resolve_native_op("auto", "cpu")) is TorchOps  # the twins
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(resolve_native_op("auto", "cpu")) is TorchOps  # no second warning


def test_native_op_false_never_builds(monkeypatch):
    monkeypatch.setattr(native, "load_native_op", lambda *a, **k: pytest.fail("native_op=False must not load"))
    assert type(resolve_native_op(False, "cpu")) is TorchOps


@pytest.mark.parametrize("bad", ["yes", 1, None, "true"])
def test_native_op_bad_setting(bad):
    with pytest.raises(ValueError, match="usp.native_op"):
        resolve_native_op(bad, "cpu")


def test_unsupported_device_type(monkeypatch):
    monkeypatch.setattr(native, "_LOADED", {})
    with pytest.raises(NativeOpUnavailable, match="no kernels for device type 'meta'"):
        load_native_op("meta")


# ------------------------------------------------------------------------------------- USP, 4 ranks

def compare_native_split(u: int, r: int, cases: list[tuple]) -> int:
    """On every rank: USP forward+backward with native_op True and False for each case; returns cases run."""
    import ds_usp

    topo = get_topo(u, r)
    for causal, layout, hkv, seq, dtype, b in cases:
        g = torch.Generator().manual_seed(seq + 7 * hkv + b)
        h, d = 8, 16
        full = [torch.randn(b, seq, hh, d, generator=g).to(dtype) for hh in (h, hkv, hkv, h)]  # q, k, v, dout
        local = [ds_usp.shard_sequence(x, topo, dim=1, layout=layout) for x in full]
        results = []
        for flag in (True, False):
            q, k, v = (x.clone().requires_grad_() for x in local[:3])
            out = ds_usp.usp_attention(q, k, v, topo, causal=causal, layout=layout, seq_len=seq, native_op=flag)
            out.backward(local[3])
            results.append([out.detach(), q.grad, k.grad, v.grad])
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        for name, x, y in zip(("out", "dq", "dk", "dv"), *results):
            assert torch.isfinite(x).all(), name
            torch.testing.assert_close(x, y, **tol, msg=lambda m: f"{name} {causal=} {layout} {hkv=} {seq=} "
                                                                  f"{dtype} {b=}: {m}")
    return len(cases)


def _cases() -> list[tuple]:
    cases = []
    for i, (causal, layout) in enumerate(itertools.product((True, False), ("contiguous", "zigzag"))):
        for j, hkv in enumerate((8, 2, 1)):
            seq = (256, 250)[(i + j) % 2]  # 250: padded for every split and layout
            cases.append((causal, layout, hkv, seq, torch.float32, 1))
    cases += [(True, "zigzag", 2, 128, torch.bfloat16, 1), (False, "contiguous", 1, 120, torch.float16, 1),
              (True, "zigzag", 2, 128, torch.float32, 2), (False, "zigzag", 8, 120, torch.bfloat16, 2)]
    return cases


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4)])
def test_usp_native_on_off_agree(world4, ops, u, r):
    assert world4.run(compare_native_split, u, r, _cases()) == [len(_cases())] * 4


# --------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_sources_compile(tmp_path):
    """The .cu kernels are torch-free and compile with nvcc alone, here for sm_80 and sm_90."""
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", f"-I{CSRC / 'includes'}", "-gencode", "arch=compute_80,code=sm_80",
           "-gencode", "arch=compute_90,code=sm_90", str(CSRC / "cuda" / "usp_cuda.cu"), "-o",
           str(tmp_path / "usp_cuda.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "usp_cuda.o").stat().st_size > 0


def test_cuda_builder_takes_arch_specific_entries(monkeypatch):
    """An H100 image sets TORCH_CUDA_ARCH_LIST=9.0a; DeepSpeed 0.19.8 fails on it, ours builds for 9.0."""
    from ds_usp.native.op_builder import USPCUDABuilder, plain_arch_list

    assert plain_arch_list("8.0 9.0a+PTX;10.0f") == "8.0 9.0+PTX;10.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    builder = USPCUDABuilder()
    builder.jit_mode = True
    assert builder.compute_capability_args() == []  # JIT: torch derives -gencode from the list it leaves
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    builder.jit_mode = False
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert "-gencode=arch=compute_90,code=sm_90" in builder.compute_capability_args()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernels_match_twins(dtype):
    cuda_ops = load_native_op("cuda")
    out, lse, block_out, block_lse = (x.cuda() for x in _merge_inputs(5, 2, 64, 8, 64, dtype))
    o_twin, l_twin, o_nat, l_nat = out.clone(), lse.clone(), out.clone(), lse.clone()
    merge_block_(o_twin[:, 64:], l_twin[:, :, 64:], block_out, block_lse)
    cuda_ops.merge_block_(o_nat[:, 64:], l_nat[:, :, 64:], block_out, block_lse)
    torch.testing.assert_close(o_nat, o_twin, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l_nat, l_twin, atol=1e-6, rtol=1e-6)
    acc = torch.randn(2, 40, 3, 24, device="cuda")
    x = torch.randn(2, 20, 3, 24, device="cuda").to(dtype)
    twin, nat = acc.clone(), acc.clone()
    twin[:, 10:30] += x
    cuda_ops.accumulate_(nat[:, 10:30], x)
    assert torch.equal(nat, twin)
    q, k, v = (torch.randn(2, 6, h, 16, device="cuda").to(dtype) for h in (8, 1, 1))
    send = cuda_ops.pack_seq_to_head([q, k, v], [1, 4, 4], 4)
    assert torch.equal(send, _twin_pack(q, k, v, 4))
    parts = cuda_ops.unpack_seq_to_head(send).split([2, 1, 1], dim=2)
    back = cuda_ops.pack_head_to_seq(parts, 4)
    assert torch.equal(back, send)
    dq, dk, _ = cuda_ops.unpack_head_to_seq(back, [2, 1, 1], [1, 4, 4])
    assert torch.equal(dq, q)
    torch.testing.assert_close(dk.float(), 4 * k.float(), atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------- report


def test_report_lists_backends_and_native_op_state(ops, capsys):
    from ds_usp import report

    report.main([])
    text = capsys.readouterr().out
    assert "attention backend 'torch' on cpu" in text and "usable" in text
    cpu_line = next(line for line in text.splitlines() if line.startswith("native op (cpu)"))
    assert any(state in cpu_line for state in ("prebuilt", "jit-built")), cpu_line  # the ops fixture built it
    assert "native op (cuda)" in text


def _source_checkout_python(root: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh python that finds ds_usp in ``root`` (a copy of the sources, not installed) and the
    site-packages, without the installed ds-usp's mapping of ops/ (``-S``: no .pth files)."""
    import site

    boot = f"import sys; sys.path[:0] = {[str(root), *site.getsitepackages()]!r}\n"
    return subprocess.run([os.sys.executable, "-S", "-c", boot + code], capture_output=True, text=True, timeout=120,
                          cwd=root)


def test_builders_load_from_a_source_checkout(tmp_path):
    """Run from a checkout with PYTHONPATH at it (no pip install), the op builders are the checkout's ops/ (the GPU
    session found ``ModuleNotFoundError: ds_usp.native.op_builder`` there, even with native_op "auto")."""
    repo = Path(__file__).resolve().parents[1]
    shutil.copytree(repo / "ds_usp", tmp_path / "ds_usp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo / "ops", tmp_path / "ops", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo / "_ds_usp_auto.py", tmp_path)  # the JSON key's gates, top-level beside the package in a checkout
    code = "import ds_usp.native as n; print(n._op_builders().CSRC); print(type(n._builder('cpu')).__name__)"
    done = _source_checkout_python(tmp_path, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == [str(tmp_path / "ops" / "csrc"), "USPCPUBuilder"]
    shutil.rmtree(tmp_path / "ops")  # neither installed nor beside the package: named, not a ModuleNotFoundError
    done = _source_checkout_python(tmp_path, "import ds_usp.native as n\ntry:\n    n._op_builders()\nexcept "
                                             "n.NativeOpUnavailable as e:\n    print('unavailable:', e)")
    assert done.returncode == 0 and "unavailable: ds_usp.native.op_builder is not installed" in done.stdout, \
        done.stdout + done.stderr[-2000:]


def test_the_cpu_flags_are_probed_once_per_process(monkeypatch):
    """DeepSpeed's -march and SIMD probes each run py-cpuinfo (a Python subprocess, about 1.3 s of CPU): the builder
    asks each once per process, however often its flags are read (loading a built op read them 4 times)."""
    import cpuinfo

    import ds_usp.native as native

    builders = native._op_builders()
    real, calls = cpuinfo.get_cpu_info, []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or real())
    monkeypatch.setattr(builders, "_PROBED", {})
    builder = builders.USPCPUBuilder()
    first = builder.cxx_args()
    for _ in range(3):
        assert builder.cxx_args() == first
        builder.build_name()
    assert len(calls) == 2, len(calls)


# ---- two nodes sharing TORCH_EXTENSIONS_DIR (issue 63 item 10): locks record their host, names their CUDA arch ----

def _free_pid() -> int:
    """A process id that no process of this host has."""
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def _lock_with_owner(folder: Path, host: str, pid: int) -> Path:
    import json
    import time

    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    time.sleep(0.01)
    (folder / "lock.owner").write_text(json.dumps({"host": host, "pid": pid}))
    return lock


def test_a_build_lock_another_host_holds_is_never_stale_here(tmp_path):
    """A lock recorded by another host, for a pid no process here has (what this host's /proc called stale before):
    reported as held there, never as stale; one recorded by this host for a pid that is gone is stale."""
    import socket

    from ds_usp.native.build_locks import held_elsewhere, lock_state, report, unheld_locks, watch_build_locks

    pid = _free_pid()
    theirs = _lock_with_owner(tmp_path / "op_a", "other-node-" + socket.gethostname(), pid)
    mine = _lock_with_owner(tmp_path / "op_b", socket.gethostname(), pid)
    assert lock_state(theirs) == "elsewhere" and lock_state(mine) == "stale"
    assert unheld_locks(tmp_path) == [mine]
    assert list(held_elsewhere(tmp_path)) == [theirs]
    seen: list[str] = []
    watch_build_locks(tmp_path, interval=0.1, duration=1.0, emit=seen.append, once=False).join()
    assert report(mine) in seen and len(seen) == 2, seen  # each named once
    (elsewhere,) = [m for m in seen if m != report(mine)]
    assert "held by no live build" not in elsewhere and f"process {pid} on host other-node-" in elsewhere
    assert f"rm {theirs}" in elsewhere


def test_a_record_older_than_its_lock_is_ignored(tmp_path):
    import os as _os

    from ds_usp.native.build_locks import lock_state, owner_of

    lock = _lock_with_owner(tmp_path / "op", "other-node", _free_pid())
    _os.utime(lock.with_name("lock.owner"), ns=(1, 1))  # left by an earlier build
    assert owner_of(lock) is None and lock_state(lock) == "stale"  # the /proc look again: no build here


def test_the_process_holding_a_lock_is_recorded_with_this_host(tmp_path):
    """A process that holds a build lock open (torch's baton does while it builds) is recorded (host, pid); while it
    lives its lock is held, once it is killed (the lock left behind) the lock is stale."""
    import socket
    import sys
    import time

    from ds_usp.native.build_locks import Owner, lock_state, owner_of, recording_holder, unheld_locks

    folder = tmp_path / "op"
    folder.mkdir()
    lock = folder / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)"
                               "; print(flush=True); time.sleep(60)", str(lock)], stdout=subprocess.PIPE,
                              cwd=tmp_path)
    try:
        holder.stdout.readline()
        assert lock_state(lock) == "held" and unheld_locks(tmp_path) == []
        assert owner_of(lock) == Owner(socket.gethostname(), holder.pid)
    finally:
        holder.kill()
        holder.wait()
    assert lock_state(lock) == "stale" and unheld_locks(tmp_path) == [lock]
    lock.unlink()
    with recording_holder(lock, every=0.01):  # this process's own build: recorded while it holds the lock
        fd = os.open(lock, os.O_CREAT | os.O_EXCL)
        deadline = time.monotonic() + 60  # once missed 10 s: the suite beside a 4-rank benchmark
        while owner_of(lock) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert owner_of(lock) == Owner(socket.gethostname(), os.getpid()) and lock_state(lock) == "held"
        os.close(fd)
    assert not lock.with_name("lock.owner").exists()  # its record removed after the build


def test_the_cuda_build_name_holds_the_arch_and_the_cpu_name_does_not(monkeypatch):
    """Two nodes with different GPUs never share a CUDA build folder; the CPU build's name is what it was."""
    builders = native._op_builders()
    assert builders.cuda_arch_tag("8.0;9.0a+PTX") == "sm80_90ptx" == builders.cuda_arch_tag("9.0+PTX 8.0")
    assert builders.cuda_arch_tag("10.0f 8.6") == "sm86_100"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    cpu = builders.USPCPUBuilder().build_name()
    assert builders.cuda_arch_tag() == "smnone"
    names = {}
    for archs in ("8.0", "9.0", "8.0;9.0"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
        names[archs] = builders.USPCUDABuilder().build_name()
        assert builders.USPCPUBuilder().build_name() == cpu  # the CPU name ignores the CUDA arch
    assert names["8.0"].startswith("ds_usp_cuda_sm80_") and names["8.0;9.0"].startswith("ds_usp_cuda_sm80_90_")
    assert len(set(names.values())) == 3 and all(n.isidentifier() for n in names.values())
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0) if i else (8, 0))
    assert builders.USPCUDABuilder().build_name().startswith("ds_usp_cuda_sm80_90_")  # the GPUs' capabilities
    assert re.fullmatch(r"ds_usp_cpu_[0-9a-f]{10}", cpu)
