// What a kernel compiled by the CUDA emulator (cuda_emulator.py) sees: CUDA's types and built-ins
// as far as TVM's fp32/tf32/bf16 kernels use them. It only declares the emulator's runtime
// (cuda_emulator.cc, one shared library compiled once), so each kernel compiles quickly.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
// math_constants.h, which TVM includes for infinities and NaNs (max pooling starts at -inf)
#define CUDART_INF_F __builtin_huge_valf()
#define CUDART_NAN_F __builtin_nanf("")

struct dim3 { unsigned int x, y, z; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct ushort4 { unsigned short x, y, z, w; };  // a vector compare's lanes (selects)
struct ushort2 { unsigned short x, y; };
// what TVM's casts need: construction from float as __float2bfloat16 does it (round to nearest
// even; a NaN becomes 0x7fff), the bits
struct nv_bfloat16 {
  unsigned short bits;
  nv_bfloat16() = default;
  nv_bfloat16(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? (unsigned short)0x7fffu : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float max(float a, float b) { return a > b ? a : b; }
static inline float min(float a, float b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline float __fdividef(float a, float b) { return a / b; }

namespace emu {
extern dim3 thread_idx, block_idx, block_dim, grid_dim;  // the running thread's

// A `__shared__` array of this block (the i-th call of a thread gives the block's i-th array);
// the `extern __shared__` array, as large as the launch's dynamic shared memory.
void* shared_array(size_t bytes);
void* dynamic_shared_array();
template <typename T>
static inline T* shared(size_t count) { return static_cast<T*>(shared_array(count * sizeof(T))); }
template <typename T>
static inline T* dynamic_shared() { return static_cast<T*>(dynamic_shared_array()); }

void sync_threads();
uint32_t shared_address(const void* p);
void fail(const char* why);

// mma.sync.aligned.m16n8k{K} over the calling warp; PER values a register (tf32: 1, bf16: 2)
template <int K, int PER>
void mma_m16n8(float* d0, float* d1, float* d2, float* d3, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
               unsigned b0, unsigned b1, float c0, float c1, float c2, float c3);

// wgmma.mma_async m64nNkK (A in registers, B through a shared-memory descriptor) and its fences
void wgmma_fence();
// fence.proxy.async.shared::cta: the shared stores before it become visible to the tensor cores
void fence_proxy_async();
void wgmma_mma(int n, int k, int per, float** d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
               uint64_t desc, bool scale_d, int scale_a, int scale_b);
void wgmma_commit();
void wgmma_wait(int pending);

// Runs `body(args)` as every thread of `grid` x `block`. Returns 0; 1 when the threads of a block
// did not all reach the same barrier; 2 when the kernel did something the hardware would not
// allow (failure_message says what).
int launch(void (*body)(void**), void** args, dim3 grid, dim3 block, size_t dynamic_shared_bytes);
const char* failure_message();
}  // namespace emu

static inline uint32_t __cvta_generic_to_shared(const void* p) { return emu::shared_address(p); }
static inline void __syncthreads() { emu::sync_threads(); }

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
