// ds-usp native op: pybind frontend. Validates tensors, describes them to the kernels (pointer + strides) and
// dispatches to the CPU kernels, or to the CUDA kernels when built with USP_WITH_CUDA and given CUDA tensors.
// The PyTorch twins of these functions are ds_usp/native/twins.py (TorchOps), with the same signatures and numbers.
// Only the headers it uses (the tensor, at::empty, pybind11 with torch's tensor caster), not <torch/extension.h>:
// the whole C++ API made the compile 57 s instead of 25 (at -O3 on this 2-core machine).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "usp_kernels.h"

#ifdef USP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

using at::Tensor;

usp::DType to_dtype(const Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return usp::DType::kFloat32;
        case at::kBFloat16: return usp::DType::kBFloat16;
        case at::kHalf: return usp::DType::kFloat16;
        default: TORCH_CHECK(false, "usp op: ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
    }
}

// t with a unit-stride last dim (a copy only when it is not already).
Tensor unit_last(const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

usp::View4 view4(const Tensor& t) {  // (b, s, h, d), d unit-stride
    return usp::View4{t.data_ptr(), {t.stride(0), t.stride(1), t.stride(2)}};
}

usp::View3 view3(const Tensor& t) {  // (b, h, s) fp32
    return usp::View3{t.data_ptr<float>(), {t.stride(0), t.stride(1), t.stride(2)}};
}

#ifdef USP_WITH_CUDA
void* stream_of(const Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

void check_device(const Tensor& ref, std::initializer_list<Tensor> ts) {
    for (const auto& t : ts) TORCH_CHECK(t.device() == ref.device(), "usp op: tensors must be on one device");
#ifndef USP_WITH_CUDA
    TORCH_CHECK(ref.device().is_cpu(), "usp op: this build has CPU kernels only, got a ", ref.device(), " tensor");
#else
    TORCH_CHECK(ref.device().is_cpu() || ref.is_cuda(), "usp op: cpu or cuda tensors only, got ", ref.device());
#endif
}

// out (b, s, h, d) fp32, lse (b, h, s) fp32, block_out (b, s, h, d) any float, block_lse (b, h, s) fp32.
void merge_block_(Tensor out, Tensor lse, Tensor block_out, Tensor block_lse) {
    TORCH_CHECK(out.dim() == 4 && block_out.sizes() == out.sizes(), "usp merge: out and block_out must be (b, s, h, d)");
    TORCH_CHECK(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
                    block_lse.scalar_type() == at::kFloat,
                "usp merge: out, lse and block_lse must be float32");
    const int64_t B = out.size(0), S = out.size(1), H = out.size(2), D = out.size(3);
    TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == S &&
                    block_lse.sizes() == lse.sizes(),
                "usp merge: lse and block_lse must be (b, h, s)");
    check_device(out, {lse, block_out, block_lse});
    if (out.numel() == 0) return;
    const auto dt = to_dtype(block_out, "block_out");
    Tensor o = unit_last(out), x = unit_last(block_out);
#ifdef USP_WITH_CUDA
    if (out.is_cuda()) {
        const c10::cuda::CUDAGuard guard(out.device());
        usp::merge_block_cuda(view4(o), view3(lse), view4(x), dt, view3(block_lse), B, S, H, D, stream_of(out));
    } else
#endif
        usp::merge_block_cpu(view4(o), view3(lse), view4(x), dt, view3(block_lse), B, S, H, D);
    if (!o.is_same(out)) out.copy_(o);
}

// acc (b, s, h, d) fp32 += x (b, s, h, d) any float.
void accumulate_(Tensor acc, Tensor x) {
    TORCH_CHECK(acc.dim() == 4 && x.sizes() == acc.sizes(), "usp accumulate: acc and x must be (b, s, h, d) alike");
    TORCH_CHECK(acc.scalar_type() == at::kFloat, "usp accumulate: acc must be float32");
    check_device(acc, {x});
    if (acc.numel() == 0) return;
    const auto dt = to_dtype(x, "x");
    Tensor a = unit_last(acc), v = unit_last(x);
#ifdef USP_WITH_CUDA
    if (acc.is_cuda()) {
        const c10::cuda::CUDAGuard guard(acc.device());
        usp::accumulate_cuda(view4(a), view4(v), dt, acc.size(0), acc.size(1), acc.size(2), acc.size(3),
                             stream_of(acc));
    } else
#endif
        usp::accumulate_cpu(view4(a), view4(v), dt, acc.size(0), acc.size(1), acc.size(2), acc.size(3));
    if (!a.is_same(acc)) acc.copy_(a);
}

void run_transfer(usp::PackGeom& g, const Tensor& buffer, usp::Side side, bool to_buffer) {
    if (buffer.numel() == 0) return;
#ifdef USP_WITH_CUDA
    if (buffer.is_cuda()) {
        const c10::cuda::CUDAGuard guard(buffer.device());
        usp::transfer_cuda(g, buffer.data_ptr(), side, to_buffer, stream_of(buffer));
        return;
    }
#endif
    usp::transfer_cpu(g, buffer.data_ptr(), side, to_buffer);
}

usp::PackGeom geom(int64_t U, int64_t B, int64_t S, int64_t D, const Tensor& ref) {
    usp::PackGeom g{};
    g.U = U; g.B = B; g.S = S; g.D = D; g.Hp = 0; g.nseg = 0;
    g.dtype = to_dtype(ref, "tensor");
    return g;
}

void add_segment(usp::PackGeom& g, const Tensor& t, int64_t heads, int64_t rep) {
    TORCH_CHECK(g.nseg < usp::kMaxSegments, "usp pack: at most ", usp::kMaxSegments, " tensors");
    g.seg[g.nseg++] = usp::Segment{view4(t), heads, rep};
    g.Hp += heads;
}

// xs[i] (b, s, h_i, d) -> send buffer (U, b, s, sum_i h_i * reps_i / U, d).
Tensor pack_seq_to_head(std::vector<Tensor> xs, std::vector<int64_t> reps, int64_t U) {
    TORCH_CHECK(!xs.empty() && xs.size() == reps.size(), "usp pack: one rep per tensor");
    TORCH_CHECK(U >= 1, "usp pack: U must be positive");
    const Tensor& x0 = xs[0];
    TORCH_CHECK(x0.dim() == 4, "usp pack: tensors must be (b, s, h, d)");
    for (auto& x : xs) {
        x = unit_last(x);
        TORCH_CHECK(x.dim() == 4 && x.size(0) == x0.size(0) && x.size(1) == x0.size(1) && x.size(3) == x0.size(3) &&
                        x.scalar_type() == x0.scalar_type(),
                    "usp pack: tensors must agree in b, s, d and dtype");
        check_device(x0, {x});
    }
    auto g = geom(U, x0.size(0), x0.size(1), x0.size(3), x0);
    for (size_t i = 0; i < xs.size(); ++i) {
        const int64_t full = xs[i].size(2) * reps[i];
        TORCH_CHECK(reps[i] >= 1 && full % U == 0, "usp pack: heads x rep (", full, ") must divide by U (", U, ")");
        add_segment(g, xs[i], full / U, reps[i]);
    }
    // (b, s, h_i, d) x n -> (U, b, s, Hp, d)
    Tensor send = at::empty({U, g.B, g.S, g.Hp, g.D}, x0.options());
    run_transfer(g, send, usp::Side::kSeq, true);
    return send;
}

// recv (U, b, s, Hp, d) -> [(b, U*s, heads_i, d)], contiguous.
std::vector<Tensor> unpack_seq_to_head(Tensor recv, std::vector<int64_t> heads) {
    TORCH_CHECK(recv.dim() == 5 && recv.is_contiguous(), "usp unpack: recv must be a contiguous (U, b, s, Hp, d)");
    to_dtype(recv, "recv");
    auto g = geom(recv.size(0), recv.size(1), recv.size(2), recv.size(4), recv);
    std::vector<Tensor> outs;
    for (int64_t h : heads) {
        outs.push_back(at::empty({g.B, g.U * g.S, h, g.D}, recv.options()));  // (b, U*s, h_i, d)
        add_segment(g, outs.back(), h, 1);
    }
    TORCH_CHECK(g.Hp == recv.size(3), "usp unpack: heads sum to ", g.Hp, ", recv has ", recv.size(3));
    run_transfer(g, recv, usp::Side::kHead, false);
    return outs;
}

// xs[i] (b, U*s, h_i, d) -> send buffer (U, b, s, sum_i h_i, d).
Tensor pack_head_to_seq(std::vector<Tensor> xs, int64_t U) {
    TORCH_CHECK(!xs.empty() && U >= 1, "usp pack: need tensors and a positive U");
    const Tensor& x0 = xs[0];
    TORCH_CHECK(x0.dim() == 4 && x0.size(1) % U == 0, "usp pack: tensors must be (b, U*s, h, d)");
    for (auto& x : xs) {
        x = unit_last(x);
        TORCH_CHECK(x.dim() == 4 && x.size(0) == x0.size(0) && x.size(1) == x0.size(1) && x.size(3) == x0.size(3) &&
                        x.scalar_type() == x0.scalar_type(),
                    "usp pack: tensors must agree in b, s, d and dtype");
        check_device(x0, {x});
    }
    auto g = geom(U, x0.size(0), x0.size(1) / U, x0.size(3), x0);
    for (auto& x : xs) add_segment(g, x, x.size(2), 1);
    Tensor send = at::empty({U, g.B, g.S, g.Hp, g.D}, x0.options());  // (U, b, s, Hp, d)
    run_transfer(g, send, usp::Side::kHead, true);
    return send;
}

// recv (U, b, s, Hp, d) -> [(b, s, U*heads_i/reps_i, d)], replicas summed in fp32.
std::vector<Tensor> unpack_head_to_seq(Tensor recv, std::vector<int64_t> heads, std::vector<int64_t> reps) {
    TORCH_CHECK(recv.dim() == 5 && recv.is_contiguous(), "usp unpack: recv must be a contiguous (U, b, s, Hp, d)");
    TORCH_CHECK(heads.size() == reps.size(), "usp unpack: one rep per segment");
    to_dtype(recv, "recv");
    auto g = geom(recv.size(0), recv.size(1), recv.size(2), recv.size(4), recv);
    std::vector<Tensor> outs;
    for (size_t i = 0; i < heads.size(); ++i) {
        TORCH_CHECK(reps[i] >= 1 && (g.U * heads[i]) % reps[i] == 0, "usp unpack: bad replication");
        outs.push_back(at::empty({g.B, g.S, g.U * heads[i] / reps[i], g.D}, recv.options()));  // (b, s, h_i, d)
        add_segment(g, outs.back(), heads[i], reps[i]);
    }
    TORCH_CHECK(g.Hp == recv.size(3), "usp unpack: heads sum to ", g.Hp, ", recv has ", recv.size(3));
    run_transfer(g, recv, usp::Side::kSeq, false);
    return outs;
}

bool with_cuda() {
#ifdef USP_WITH_CUDA
    return true;
#else
    return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ds-usp native op: ring LSE merge, Ulysses all-to-all packing, fp32 gradient accumulation";
    m.def("merge_block_", &merge_block_, "fold (block_out, block_lse) into (out, lse) in place",
          py::arg("out"), py::arg("lse"), py::arg("block_out"), py::arg("block_lse"));
    m.def("accumulate_", &accumulate_, "acc += x in fp32, in place", py::arg("acc"), py::arg("x"));
    m.def("pack_seq_to_head", &pack_seq_to_head, "sequence shards -> all-to-all send buffer (with replication)",
          py::arg("xs"), py::arg("reps"), py::arg("U"));
    m.def("unpack_seq_to_head", &unpack_seq_to_head, "all-to-all recv buffer -> head shards", py::arg("recv"),
          py::arg("heads"));
    m.def("pack_head_to_seq", &pack_head_to_seq, "head shards -> all-to-all send buffer", py::arg("xs"),
          py::arg("U"));
    m.def("unpack_head_to_seq", &unpack_head_to_seq, "all-to-all recv buffer -> sequence shards (replicas summed)",
          py::arg("recv"), py::arg("heads"), py::arg("reps"));
    m.def("with_cuda", &with_cuda, "whether this build has the CUDA kernels");
}
