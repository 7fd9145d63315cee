// ds-usp native op: kernel interface shared by the pybind frontend, the CPU kernels and the CUDA kernels.
//
// Everything here is plain C++ (no torch types), so the .cu file compiles with nvcc alone.
// Tensors are described by a data pointer and element strides; the last (head_dim) dimension is
// always unit-stride (the frontend makes it so).
#pragma once

#include <cstdint>

namespace usp {

// Element type of a tensor.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline int64_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// A (b, s, h, d) tensor with unit-stride d.
struct View4 {
    void* data;
    int64_t stride[3];  // element strides of b, s, h
};

// A (b, h, s) fp32 tensor (the LSE layout).
struct View3 {
    float* data;
    int64_t stride[3];  // element strides of b, h, s
};

// One tensor taking part in an all-to-all packing (q, k or v; or a single tensor).
//
// The send/recv buffer is (U, b, s, Hp, d) contiguous with Hp = sum of every segment's ``heads``;
// segment i occupies the head columns [offset_i, offset_i + heads_i).
//   seq side  : the tensor is (b, s, U*heads/rep, d); buffer head (u, j) holds its head (u*heads + j) / rep
//               (rep > 1 is the GQA kv replication; reading back sums the replicas).
//   head side : the tensor is (b, U*s, heads, d); buffer (u, b, t, j) holds its (b, u*s + t, j).
struct Segment {
    View4 t;
    int64_t heads;  // head columns of this segment per destination rank
    int64_t rep;    // replication factor (seq side only; 1 = none)
};

constexpr int kMaxSegments = 3;

struct PackGeom {
    int64_t U, B, S, Hp, D;
    DType dtype;
    int nseg;
    Segment seg[kMaxSegments];
};

// Which side of the buffer the segments are on, and which way the data flows.
enum class Side : int { kSeq = 0, kHead = 1 };

// ---- CPU kernels (cpu/usp_cpu.cpp) ----
void merge_block_cpu(View4 out, View3 lse, View4 block_out, DType block_dtype, View3 block_lse, int64_t B, int64_t S,
                     int64_t H, int64_t D);
void accumulate_cpu(View4 acc, View4 x, DType x_dtype, int64_t B, int64_t S, int64_t H, int64_t D);
void transfer_cpu(const PackGeom& g, void* buffer, Side side, bool to_buffer);

// ---- CUDA kernels (cuda/usp_cuda.cu), stream is a cudaStream_t ----
void merge_block_cuda(View4 out, View3 lse, View4 block_out, DType block_dtype, View3 block_lse, int64_t B, int64_t S,
                      int64_t H, int64_t D, void* stream);
void accumulate_cuda(View4 acc, View4 x, DType x_dtype, int64_t B, int64_t S, int64_t H, int64_t D, void* stream);
void transfer_cuda(const PackGeom& g, void* buffer, Side side, bool to_buffer, void* stream);

}  // namespace usp
