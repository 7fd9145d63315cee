// ds-usp native op, CPU kernels.
//
// Parallelism: at::parallel_for over rows (torch's OpenMP pool, so torch.set_num_threads is honoured and no
// second OpenMP runtime competes with torch's); inner loops run over the unit-stride head_dim and carry
// `#pragma omp simd` so the compiler vectorizes them. The build uses -ffp-contract=off so that a*b + c*d
// rounds like PyTorch's separate mul/add kernels (the twin).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "usp_kernels.h"

namespace usp {
namespace {

template <typename T>
struct Elem;
template <>
struct Elem<float> {
    static inline float load(const float* p) { return *p; }
    static inline void store(float* p, float v) { *p = v; }
};
template <>
struct Elem<c10::BFloat16> {
    static inline float load(const c10::BFloat16* p) { return static_cast<float>(*p); }
    static inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }
};
template <>
struct Elem<c10::Half> {
    static inline float load(const c10::Half* p) { return static_cast<float>(*p); }
    static inline void store(c10::Half* p, float v) { *p = c10::Half(v); }
};

// Rows per parallel task: about 32 KiB of fp32 work, at least one row.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, row_elems)); }

// log(e^a + e^b) with PyTorch's scalar formula (equal -inf or +inf inputs return themselves).
inline float logaddexp(float a, float b) {
    if (std::isinf(a) && a == b) return a;
    const float m = std::max(a, b);
    return m + std::log1p(std::exp(-std::abs(a - b)));
}

template <typename T>
void merge_impl(View4 out, View3 lse, View4 bo, View3 blse, int64_t B, int64_t S, int64_t H, int64_t D) {
    float* o_base = static_cast<float*>(out.data);
    const T* x_base = static_cast<const T*>(bo.data);
    at::parallel_for(0, B * S, grain_rows(H * D), [&](int64_t begin, int64_t end) {
        for (int64_t bs = begin; bs < end; ++bs) {
            const int64_t b = bs / S, s = bs % S;
            for (int64_t h = 0; h < H; ++h) {
                float* l = lse.data + b * lse.stride[0] + h * lse.stride[1] + s * lse.stride[2];
                const float bl = blse.data[b * blse.stride[0] + h * blse.stride[1] + s * blse.stride[2]];
                const float a = *l;
                const float m = logaddexp(a, bl);
                const float ref = (m == -std::numeric_limits<float>::infinity()) ? 0.0f : m;
                const float w_old = std::exp(a - ref);
                const float w_new = std::exp(bl - ref);
                float* o = o_base + b * out.stride[0] + s * out.stride[1] + h * out.stride[2];
                const T* x = x_base + b * bo.stride[0] + s * bo.stride[1] + h * bo.stride[2];
#pragma omp simd
                for (int64_t e = 0; e < D; ++e) {
                    const float t_old = o[e] * w_old;
                    const float t_new = Elem<T>::load(x + e) * w_new;
                    o[e] = t_old + t_new;
                }
                *l = m;
            }
        }
    });
}

template <typename T>
void accumulate_impl(View4 acc, View4 x, int64_t B, int64_t S, int64_t H, int64_t D) {
    float* a_base = static_cast<float*>(acc.data);
    const T* x_base = static_cast<const T*>(x.data);
    at::parallel_for(0, B * S, grain_rows(H * D), [&](int64_t begin, int64_t end) {
        for (int64_t bs = begin; bs < end; ++bs) {
            const int64_t b = bs / S, s = bs % S;
            for (int64_t h = 0; h < H; ++h) {
                float* a = a_base + b * acc.stride[0] + s * acc.stride[1] + h * acc.stride[2];
                const T* v = x_base + b * x.stride[0] + s * x.stride[1] + h * x.stride[2];
#pragma omp simd
                for (int64_t e = 0; e < D; ++e) a[e] += Elem<T>::load(v + e);
            }
        }
    });
}

inline char* elem_ptr(const View4& t, int64_t b, int64_t s, int64_t h, int64_t es) {
    return static_cast<char*>(t.data) + (b * t.stride[0] + s * t.stride[1] + h * t.stride[2]) * es;
}

// Pure copies between the (U, b, s, Hp, d) buffer and the segments (every direction except reading
// replicated heads back, which sums).
void copy_rows(const PackGeom& g, char* buf, Side side, bool to_buffer) {
    const int64_t es = dtype_size(g.dtype), row = g.D * es;
    at::parallel_for(0, g.U * g.B * g.S, grain_rows(g.Hp * g.D), [&](int64_t begin, int64_t end) {
        for (int64_t idx = begin; idx < end; ++idx) {
            // Walk the segments' memory in order: (b, t, u) on the seq side (u's head groups of one token
            // are adjacent there), (u, b, t) on the head side (the buffer's own order).
            int64_t u, b, t;
            if (side == Side::kSeq) {
                u = idx % g.U; t = (idx / g.U) % g.S; b = idx / (g.U * g.S);
            } else {
                u = idx / (g.B * g.S); b = (idx / g.S) % g.B; t = idx % g.S;
            }
            char* brow = buf + ((u * g.B + b) * g.S + t) * g.Hp * row;  // buffer (u, b, t, :, :)
            for (int i = 0; i < g.nseg; ++i) {
                const Segment& sg = g.seg[i];
                const bool runs = sg.t.stride[2] == g.D && sg.rep == 1;  // heads adjacent: one memcpy
                for (int64_t j = 0; j < sg.heads; j += runs ? sg.heads : 1) {
                    char* tp = side == Side::kSeq ? elem_ptr(sg.t, b, t, (u * sg.heads + j) / sg.rep, es)
                                                  : elem_ptr(sg.t, b, u * g.S + t, j, es);
                    const int64_t n = runs ? sg.heads * row : row;
                    if (to_buffer) std::memcpy(brow + j * row, tp, n);
                    else std::memcpy(tp, brow + j * row, n);
                }
                brow += sg.heads * row;
            }
        }
    });
}

// Seq side, from the buffer, some segment with rep > 1: one pass over the tokens; segments with rep 1 are
// copied, replicated heads are summed (fp32 sum, one rounding): y[b, t, h] = sum_r buffer(u, b, t, j) over the
// replicas (u, j) of head h.
template <typename T>
void gather_seq_summing(const PackGeom& g, const T* buf) {
    at::parallel_for(0, g.B * g.S, grain_rows(g.U * g.Hp * g.D), [&](int64_t begin, int64_t end) {
        std::vector<float> acc(g.D);
        for (int64_t bt = begin; bt < end; ++bt) {
            const int64_t b = bt / g.S, t = bt % g.S;
            int64_t offset = 0;
            for (int i = 0; i < g.nseg; ++i) {
                const Segment& sg = g.seg[i];
                const int64_t H = g.U * sg.heads / sg.rep;
                for (int64_t h = 0; h < H; ++h) {
                    T* y = reinterpret_cast<T*>(elem_ptr(sg.t, b, t, h, sizeof(T)));
                    for (int64_t r = 0; r < sg.rep; ++r) {
                        const int64_t idx = h * sg.rep + r, u = idx / sg.heads, j = idx % sg.heads;
                        const T* x = buf + (((u * g.B + b) * g.S + t) * g.Hp + offset + j) * g.D;
                        if (sg.rep == 1) {
                            std::memcpy(y, x, g.D * sizeof(T));
                        } else if (r == 0) {
#pragma omp simd
                            for (int64_t e = 0; e < g.D; ++e) acc[e] = Elem<T>::load(x + e);
                        } else {
#pragma omp simd
                            for (int64_t e = 0; e < g.D; ++e) acc[e] += Elem<T>::load(x + e);
                        }
                    }
                    if (sg.rep > 1) {
                        for (int64_t e = 0; e < g.D; ++e) Elem<T>::store(y + e, acc[e]);
                    }
                }
                offset += sg.heads;
            }
        }
    });
}

}  // namespace

void merge_block_cpu(View4 out, View3 lse, View4 block_out, DType block_dtype, View3 block_lse, int64_t B, int64_t S,
                     int64_t H, int64_t D) {
    switch (block_dtype) {
        case DType::kFloat32: merge_impl<float>(out, lse, block_out, block_lse, B, S, H, D); break;
        case DType::kBFloat16: merge_impl<c10::BFloat16>(out, lse, block_out, block_lse, B, S, H, D); break;
        case DType::kFloat16: merge_impl<c10::Half>(out, lse, block_out, block_lse, B, S, H, D); break;
    }
}

void accumulate_cpu(View4 acc, View4 x, DType x_dtype, int64_t B, int64_t S, int64_t H, int64_t D) {
    switch (x_dtype) {
        case DType::kFloat32: accumulate_impl<float>(acc, x, B, S, H, D); break;
        case DType::kBFloat16: accumulate_impl<c10::BFloat16>(acc, x, B, S, H, D); break;
        case DType::kFloat16: accumulate_impl<c10::Half>(acc, x, B, S, H, D); break;
    }
}

void transfer_cpu(const PackGeom& g, void* buffer, Side side, bool to_buffer) {
    bool summing = false;
    for (int i = 0; i < g.nseg; ++i) summing |= g.seg[i].rep > 1;
    if (to_buffer || side == Side::kHead || !summing) {
        copy_rows(g, static_cast<char*>(buffer), side, to_buffer);
        return;
    }
    switch (g.dtype) {
        case DType::kFloat32: gather_seq_summing<float>(g, static_cast<const float*>(buffer)); break;
        case DType::kBFloat16: gather_seq_summing<c10::BFloat16>(g, static_cast<const c10::BFloat16*>(buffer)); break;
        case DType::kFloat16: gather_seq_summing<c10::Half>(g, static_cast<const c10::Half*>(buffer)); break;
    }
}

}  // namespace usp
