// EaaS expert-server kernels: grouped SwiGLU expert GEMM with kernel shrinking.
//
// Compiled at first use by NVRTC (eaas.runtime.cuda.nvrtc), never by nvcc; no host code here.
// One MoE layer call on an expert server is four launches with a FIXED launch shape (grid sizes
// depend only on the bucket size n_pairs = N * k and the number of hosted experts E, never on
// how the tokens were routed), so the whole sequence is CUDA-graph capturable:
//
//   1. eaas_moe_route       grid 1 x 1024 threads: per-pair local expert slot, token counts per
//                           hosted expert (read on device), offsets, the COMPACT list of active
//                           experts and of their row tiles, and each pair's row in the grouped
//                           buffer. Experts that got no tokens get no tiles: kernel shrinking
//                           (Expert-as-a-Service, arXiv:2509.17863, "kernel shrinking").
//   2. eaas_grouped_gate_up grid (max_tiles, ceil(I / BN)): act[row, i] = silu(x W_gate^T) *
//                           (x W_up^T) for the rows of one active expert's tile; blocks past the
//                           device-side tile count return at once.
//   3. eaas_grouped_down    grid (max_tiles, ceil(H / BN)): y[row, h] = act[row, :] W_down^T.
//   4. eaas_combine         grid N: out[t, h] = sum_j w[t, j] * y[pos[t, j], h] (fp32 sum).
//
// Shapes (row major, contiguous):
//   experts   [N * k] int32  logical expert ids, -1 = padding (a padded bucket is all -1 past N)
//   local_of  [L]     int32  logical expert id -> hosted slot 0..E-1, or -1 (not hosted)
//   w_gate_up [E, 2I, H] T   gate rows 0..I-1 then up rows I..2I-1 (transformers' fused layout)
//   w_down    [E, H, I]  T
//   hidden    [N, H] T, out [N, H] T, weights [N * k] float32
//   scratch: counts/offsets/cursor [E(+1)] int32, pos [N*k] int32, row_pair [N*k] int32,
//            tile_expert/tile_row0 [max_tiles] int32, meta [4] int32 (num_active, num_tiles,
//            rows, bad), act [N*k, I] float32, y [N*k, H] float32.
// T is float or __nv_bfloat16 (suffix _f32 / _bf16). Accumulation is fp32 throughout.

#include <cuda_bf16.h>

#define EAAS_BM 32  // rows (token-expert pairs) per tile
#define EAAS_BN 32  // output columns per tile
#define EAAS_BK 32  // reduction chunk
#define EAAS_ROUTE_THREADS 1024

__device__ __forceinline__ float eaas_to_f(float v) { return v; }
__device__ __forceinline__ float eaas_to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void eaas_from_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void eaas_from_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// ---- 1. routing metadata (one block, fixed shape) ---------------------------------------------
extern "C" __global__ void eaas_moe_route(const int* __restrict__ experts, int n_pairs,
                                          const int* __restrict__ local_of, int num_logical,
                                          int num_local, int max_tiles, int* counts, int* offsets,
                                          int* cursor, int* active, int* tile_expert,
                                          int* tile_row0, int* pos, int* row_pair, int* meta) {
  const int tid = threadIdx.x;
  for (int e = tid; e < num_local; e += blockDim.x) counts[e] = 0;
  if (tid == 0) meta[3] = 0;
  __syncthreads();
  // local slot per pair; token counts per hosted expert (on device: nothing read by the host)
  for (int i = tid; i < n_pairs; i += blockDim.x) {
    int e = experts[i];
    int l = -1;
    if (e >= 0) {
      if (e < num_logical) l = local_of[e];
      if (l < 0) atomicExch(&meta[3], 1);  // not hosted: reported, the pair is skipped
    }
    pos[i] = l;
    if (l >= 0) atomicAdd(&counts[l], 1);
  }
  __syncthreads();
  if (tid == 0) {  // serial scan over the hosted experts (E <= a few hundred): compact lists
    int off = 0, na = 0, nt = 0;
    for (int l = 0; l < num_local; ++l) {
      int c = counts[l];
      offsets[l] = off;
      cursor[l] = off;
      if (c > 0) {
        active[na++] = l;
        for (int r = 0; r < c && nt < max_tiles; r += EAAS_BM) {
          tile_expert[nt] = l;
          tile_row0[nt] = off + r;
          ++nt;
        }
      }
      off += c;
    }
    offsets[num_local] = off;
    meta[0] = na;
    meta[1] = nt;
    meta[2] = off;
  }
  __syncthreads();
  // each pair's row in the grouped buffer (order inside a group does not change any number:
  // rows are independent)
  for (int i = tid; i < n_pairs; i += blockDim.x) {
    int l = pos[i];
    if (l >= 0) {
      int r = atomicAdd(&cursor[l], 1);
      pos[i] = r;
      row_pair[r] = i;
    }
  }
}

// ---- 2. gate/up GEMM + SwiGLU -------------------------------------------------------------------
template <typename T>
__device__ void grouped_gate_up(const T* __restrict__ hidden, const T* __restrict__ w_gate_up,
                                const int* __restrict__ offsets, const int* __restrict__ row_pair,
                                const int* __restrict__ tile_expert,
                                const int* __restrict__ tile_row0, const int* __restrict__ meta,
                                int k, int H, int I, float* __restrict__ act) {
  const int tile = blockIdx.x;
  if (tile >= meta[1]) return;  // kernel shrinking: only tiles of active experts work
  const int l = tile_expert[tile];
  const int row0 = tile_row0[tile];
  const int row_end = offsets[l + 1];
  const int col0 = blockIdx.y * EAAS_BN;
  __shared__ float xs[EAAS_BM][EAAS_BK + 1];
  __shared__ float gs[EAAS_BN][EAAS_BK + 1];
  __shared__ float us[EAAS_BN][EAAS_BK + 1];
  __shared__ int tok[EAAS_BM];
  const int tx = threadIdx.x, ty = threadIdx.y;  // block (32, 8)
  const int lin = ty * 32 + tx;
  if (lin < EAAS_BM) {
    int r = row0 + lin;
    tok[lin] = r < row_end ? row_pair[r] / k : -1;
  }
  const T* wg = w_gate_up + (size_t)l * 2 * I * H;
  const T* wu = wg + (size_t)I * H;
  float g[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
  __syncthreads();
  for (int k0 = 0; k0 < H; k0 += EAAS_BK) {
    for (int r = ty; r < EAAS_BM; r += 8) {  // x tile (rows gathered by token)
      int t = tok[r], c = k0 + tx;
      xs[r][tx] = (t >= 0 && c < H) ? eaas_to_f(hidden[(size_t)t * H + c]) : 0.f;
    }
    for (int j = ty; j < EAAS_BN; j += 8) {  // weight tiles
      int col = col0 + j, c = k0 + tx;
      bool ok = col < I && c < H;
      gs[j][tx] = ok ? eaas_to_f(wg[(size_t)col * H + c]) : 0.f;
      us[j][tx] = ok ? eaas_to_f(wu[(size_t)col * H + c]) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < EAAS_BK; ++kk) {
      float gw = gs[tx][kk], uw = us[tx][kk];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float xv = xs[ty + 8 * q][kk];
        g[q] += xv * gw;
        u[q] += xv * uw;
      }
    }
    __syncthreads();
  }
  const int col = col0 + tx;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    int r = row0 + ty + 8 * q;
    if (r < row_end && col < I) {
      float s = g[q] / (1.f + __expf(-g[q]));  // silu
      act[(size_t)r * I + col] = s * u[q];
    }
  }
}

// ---- 3. down GEMM ------------------------------------------------------------------------------
template <typename T>
__device__ void grouped_down(const float* __restrict__ act, const T* __restrict__ w_down,
                             const int* __restrict__ offsets, const int* __restrict__ tile_expert,
                             const int* __restrict__ tile_row0, const int* __restrict__ meta,
                             int H, int I, float* __restrict__ y) {
  const int tile = blockIdx.x;
  if (tile >= meta[1]) return;
  const int l = tile_expert[tile];
  const int row0 = tile_row0[tile];
  const int row_end = offsets[l + 1];
  const int col0 = blockIdx.y * EAAS_BN;
  __shared__ float as[EAAS_BM][EAAS_BK + 1];
  __shared__ float ds[EAAS_BN][EAAS_BK + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const T* wd = w_down + (size_t)l * H * I;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < I; k0 += EAAS_BK) {
    for (int r = ty; r < EAAS_BM; r += 8) {
      int row = row0 + r, c = k0 + tx;
      as[r][tx] = (row < row_end && c < I) ? act[(size_t)row * I + c] : 0.f;
    }
    for (int j = ty; j < EAAS_BN; j += 8) {
      int col = col0 + j, c = k0 + tx;
      ds[j][tx] = (col < H && c < I) ? eaas_to_f(wd[(size_t)col * I + c]) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < EAAS_BK; ++kk) {
      float dw = ds[tx][kk];
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] += as[ty + 8 * q][kk] * dw;
    }
    __syncthreads();
  }
  const int col = col0 + tx;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    int r = row0 + ty + 8 * q;
    if (r < row_end && col < H) y[(size_t)r * H + col] = acc[q];
  }
}

// ---- 4. combine: weighted sum of each token's expert rows --------------------------------------
template <typename T>
__device__ void combine(const float* __restrict__ y, const int* __restrict__ pos,
                        const float* __restrict__ weights, int k, int H, T* __restrict__ out) {
  const int t = blockIdx.x;
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) {
      int r = pos[t * k + j];
      if (r >= 0) s += weights[t * k + j] * y[(size_t)r * H + h];
    }
    eaas_from_f(out + (size_t)t * H + h, s);
  }
}

#define EAAS_INSTANTIATE(SUFFIX, T)                                                              \
  extern "C" __global__ void eaas_grouped_gate_up_##SUFFIX(                                      \
      const T* hidden, const T* w_gate_up, const int* offsets, const int* row_pair,             \
      const int* tile_expert, const int* tile_row0, const int* meta, int k, int H, int I,        \
      float* act) {                                                                              \
    grouped_gate_up<T>(hidden, w_gate_up, offsets, row_pair, tile_expert, tile_row0, meta, k, H, \
                       I, act);                                                                  \
  }                                                                                              \
  extern "C" __global__ void eaas_grouped_down_##SUFFIX(                                         \
      const float* act, const T* w_down, const int* offsets, const int* tile_expert,             \
      const int* tile_row0, const int* meta, int H, int I, float* y) {                           \
    grouped_down<T>(act, w_down, offsets, tile_expert, tile_row0, meta, H, I, y);                \
  }                                                                                              \
  extern "C" __global__ void eaas_combine_##SUFFIX(const float* y, const int* pos,              \
                                                   const float* weights, int k, int H, T* out) { \
    combine<T>(y, pos, weights, k, H, out);                                                      \
  }

EAAS_INSTANTIATE(f32, float)
EAAS_INSTANTIATE(bf16, __nv_bfloat16)
