// ds-usp native op, CUDA kernels. Torch-free on purpose: this file compiles with nvcc alone
// (`nvcc -c -I ops/csrc/includes ops/csrc/cuda/usp_cuda.cu`), the frontend passes raw pointers, strides and the stream.
//
// One thread per element; every kernel is memory-bound, so the index arithmetic is cheap next to the loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "usp_kernels.h"

namespace usp {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void from_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void from_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void from_f(__half* p, float v) { *p = __float2half_rn(v); }

inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

inline void check_launch(const char* what) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw std::runtime_error(std::string("usp ") + what + ": " + cudaGetErrorString(err));
}

__device__ __forceinline__ float logaddexp_f(float a, float b) {
    if (isinf(a) && a == b) return a;
    const float m = fmaxf(a, b);
    return m + log1pf(expf(-fabsf(a - b)));
}

template <typename T>
__global__ void merge_kernel(View4 out, View3 lse, View4 bo, View3 blse, int64_t S, int64_t H, int64_t D,
                             int64_t n) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    const int64_t e = i % D, h = (i / D) % H, s = (i / (D * H)) % S, b = i / (D * H * S);
    float* l = lse.data + b * lse.stride[0] + h * lse.stride[1] + s * lse.stride[2];
    const float a = *l;
    const float bl = blse.data[b * blse.stride[0] + h * blse.stride[1] + s * blse.stride[2]];
    const float m = logaddexp_f(a, bl);
    const float ref = isinf(m) && m < 0.0f ? 0.0f : m;
    float* o = static_cast<float*>(out.data) + b * out.stride[0] + s * out.stride[1] + h * out.stride[2] + e;
    const T* x = static_cast<const T*>(bo.data) + b * bo.stride[0] + s * bo.stride[1] + h * bo.stride[2] + e;
    *o = __fadd_rn(__fmul_rn(*o, expf(a - ref)), __fmul_rn(to_f(*x), expf(bl - ref)));
}

__global__ void merge_lse_kernel(View3 lse, View3 blse, int64_t S, int64_t H, int64_t n) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    const int64_t s = i % S, h = (i / S) % H, b = i / (S * H);
    float* l = lse.data + b * lse.stride[0] + h * lse.stride[1] + s * lse.stride[2];
    *l = logaddexp_f(*l, blse.data[b * blse.stride[0] + h * blse.stride[1] + s * blse.stride[2]]);
}

template <typename T>
__global__ void accumulate_kernel(View4 acc, View4 x, int64_t S, int64_t H, int64_t D, int64_t n) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    const int64_t e = i % D, h = (i / D) % H, s = (i / (D * H)) % S, b = i / (D * H * S);
    float* a = static_cast<float*>(acc.data) + b * acc.stride[0] + s * acc.stride[1] + h * acc.stride[2] + e;
    *a += to_f(static_cast<const T*>(x.data)[b * x.stride[0] + s * x.stride[1] + h * x.stride[2] + e]);
}

// Element i of the (U, b, s, Hp, d) buffer <-> its place in a segment (pure copy, element type W of the same size).
template <typename W>
__global__ void copy_kernel(PackGeom g, W* buf, Side side, bool to_buffer, int64_t n) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    const int64_t e = i % g.D, col = (i / g.D) % g.Hp, t = (i / (g.D * g.Hp)) % g.S;
    const int64_t b = (i / (g.D * g.Hp * g.S)) % g.B, u = i / (g.D * g.Hp * g.S * g.B);
    int k = 0;
    int64_t j = col;
    while (k + 1 < g.nseg && j >= g.seg[k].heads) j -= g.seg[k++].heads;
    const Segment& sg = g.seg[k];
    if (side == Side::kSeq && !to_buffer && sg.rep > 1) return;  // summed by sum_kernel
    const int64_t s_idx = side == Side::kSeq ? t : u * g.S + t;
    const int64_t h_idx = side == Side::kSeq ? (u * sg.heads + j) / sg.rep : j;
    W* p = static_cast<W*>(sg.t.data) + b * sg.t.stride[0] + s_idx * sg.t.stride[1] + h_idx * sg.t.stride[2] + e;
    if (to_buffer) buf[i] = *p;
    else *p = buf[i];
}

// Seq side, from the buffer, one segment with rep > 1: y[b, t, h, e] = sum of the rep replicas (fp32 sum).
template <typename T>
__global__ void sum_kernel(PackGeom g, const T* buf, Segment sg, int64_t offset, int64_t H, int64_t n) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i >= n) return;
    const int64_t e = i % g.D, h = (i / g.D) % H, t = (i / (g.D * H)) % g.S, b = i / (g.D * H * g.S);
    float acc = 0.0f;
    for (int64_t r = 0; r < sg.rep; ++r) {
        const int64_t idx = h * sg.rep + r, u = idx / sg.heads, j = idx % sg.heads;
        acc += to_f(buf[(((u * g.B + b) * g.S + t) * g.Hp + offset + j) * g.D + e]);
    }
    from_f(static_cast<T*>(sg.t.data) + b * sg.t.stride[0] + t * sg.t.stride[1] + h * sg.t.stride[2] + e, acc);
}

template <typename T>
void sum_segments(const PackGeom& g, const void* buffer, cudaStream_t st) {
    int64_t offset = 0;
    for (int k = 0; k < g.nseg; ++k) {
        const Segment& sg = g.seg[k];
        if (sg.rep > 1) {
            const int64_t H = g.U * sg.heads / sg.rep, n = g.B * g.S * H * g.D;
            sum_kernel<T><<<blocks_for(n), kThreads, 0, st>>>(g, static_cast<const T*>(buffer), sg, offset, H, n);
            check_launch("sum_kernel");
        }
        offset += sg.heads;
    }
}

}  // namespace

void merge_block_cuda(View4 out, View3 lse, View4 block_out, DType block_dtype, View3 block_lse, int64_t B, int64_t S,
                      int64_t H, int64_t D, void* stream) {
    auto st = static_cast<cudaStream_t>(stream);
    const int64_t n = B * S * H * D;
    // Pass 1 updates out reading the old lse; pass 2 updates lse. Stream order makes this race-free.
    switch (block_dtype) {
        case DType::kFloat32:
            merge_kernel<float><<<blocks_for(n), kThreads, 0, st>>>(out, lse, block_out, block_lse, S, H, D, n);
            break;
        case DType::kBFloat16:
            merge_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, st>>>(out, lse, block_out, block_lse, S, H, D, n);
            break;
        case DType::kFloat16:
            merge_kernel<__half><<<blocks_for(n), kThreads, 0, st>>>(out, lse, block_out, block_lse, S, H, D, n);
            break;
    }
    check_launch("merge_kernel");
    const int64_t rows = B * H * S;
    merge_lse_kernel<<<blocks_for(rows), kThreads, 0, st>>>(lse, block_lse, S, H, rows);
    check_launch("merge_lse_kernel");
}

void accumulate_cuda(View4 acc, View4 x, DType x_dtype, int64_t B, int64_t S, int64_t H, int64_t D, void* stream) {
    auto st = static_cast<cudaStream_t>(stream);
    const int64_t n = B * S * H * D;
    switch (x_dtype) {
        case DType::kFloat32: accumulate_kernel<float><<<blocks_for(n), kThreads, 0, st>>>(acc, x, S, H, D, n); break;
        case DType::kBFloat16:
            accumulate_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, st>>>(acc, x, S, H, D, n);
            break;
        case DType::kFloat16: accumulate_kernel<__half><<<blocks_for(n), kThreads, 0, st>>>(acc, x, S, H, D, n); break;
    }
    check_launch("accumulate_kernel");
}

void transfer_cuda(const PackGeom& g, void* buffer, Side side, bool to_buffer, void* stream) {
    auto st = static_cast<cudaStream_t>(stream);
    const int64_t n = g.U * g.B * g.S * g.Hp * g.D;
    if (dtype_size(g.dtype) == 4) {
        copy_kernel<uint32_t><<<blocks_for(n), kThreads, 0, st>>>(g, static_cast<uint32_t*>(buffer), side, to_buffer, n);
    } else {
        copy_kernel<uint16_t><<<blocks_for(n), kThreads, 0, st>>>(g, static_cast<uint16_t*>(buffer), side, to_buffer, n);
    }
    check_launch("copy_kernel");
    if (side == Side::kSeq && !to_buffer) {
        switch (g.dtype) {
            case DType::kFloat32: sum_segments<float>(g, buffer, st); break;
            case DType::kBFloat16: sum_segments<__nv_bfloat16>(g, buffer, st); break;
            case DType::kFloat16: sum_segments<__half>(g, buffer, st); break;
        }
    }
}

}  // namespace usp
