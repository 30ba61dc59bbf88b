"""Run generated CUDA C on the CPU: numbers for CUDA kernels on a machine without a GPU.

The kernel source TVM emits is compiled with g++ against a small emulation header. Each thread of
a block is a fiber (ucontext) and the fibers run cooperatively, one at a time, each from one
`__syncthreads()` to the next; blocks run one after the other. That order is deterministic and
adversarial for the bugs a barrier exists to prevent: thread 0 runs ahead to its barrier before
any other thread has written its part of a shared tile, so a missing barrier reads data that is
not there yet, and a buffer overwritten before everyone has read it shows up as a wrong result.
Shared memory is a per-block arena filled with NaN when the block starts, so reading shared data
nobody wrote poisons the output instead of passing silently with a previous block's values.
Warp-collective tensor-core instructions (`mma.sync` m16n8k8 tf32 and m16n8k16 bf16, as TVM's
inline PTX) become a rendezvous of the calling warp's lanes (only theirs: a missing
`__syncthreads` still shows) and the PTX ISA's fragment layouts, with tf32 operands truncated as
the hardware reads them. Hopper's asynchronous `wgmma.mma_async` (m64nNk8 tf32 and m64nNk16
bf16, A from registers, B through a shared-memory matrix descriptor, K-major without swizzle) is
recorded when issued and carried out, for each thread, at the `wgmma.wait_group` that retires
its group, which blocks only
until every thread of the warpgroup has committed that group (the hardware's one guarantee: it
is no barrier for anything else). B is read from shared memory then, so a kernel that overwrites
the tile before waiting, reads its accumulators early, or never waits, gets wrong numbers or an
error; the tensor cores may read B at any time in between, so a B tile that changed between a
wgmma's issue and its wait (a digest taken at each) is reported as a race. Shared memory is
one arena per block, so the descriptors' 14-bit shared addresses (`__cvta_generic_to_shared`)
work; the dynamic `extern __shared__` array is as large as the launch says.

What it does not model: warps, timing, memory coalescing, out-of-bounds global accesses (they are
plain C++ accesses), a wgmma's A registers rewritten before its wait (they are taken at the issue;
ptxas serializes such a wgmma, with a warning, which the tests check for), and any CUDA feature
beyond what TVM's fp32 kernels use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

import numpy as np

from ..kernels.cuda.ptx import kernel_params

HEADER = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short

struct dim3 { unsigned int x, y, z; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
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
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 tid;
  bool done = false;
  bool at_barrier = false;
  bool at_warp_barrier = false;
  long wgmma_wait = -1;  // the wgmma group this thread waits for every thread of its warpgroup to commit
  size_t shared_index = 0;
};
static ucontext_t scheduler;
static std::vector<Fiber> fibers;
static size_t current = 0;
static dim3 thread_idx, block_idx, block_dim, grid_dim;
static std::function<void()> body;
static const char* failure = nullptr;  // what the kernel did that the hardware would not allow

// This block's shared memory: one arena (as on the GPU, so that shared addresses are offsets),
// each `__shared__` array at a 128-byte boundary, NaN-filled when the block starts.
static const size_t SHARED_BYTES = 228 * 1024;
alignas(1024) static unsigned char smem[SHARED_BYTES];
static size_t smem_top = 0;
static std::vector<size_t> arena;  // offsets of this block's shared arrays, in declaration order
static size_t dynamic_shared_bytes = 0;  // the launch's dynamic shared memory (`extern __shared__`)

static void fiber_main() {
  body();
  fibers[current].done = true;
}

static void fail(const char* why) {
  if (!failure) failure = why;
}

template <typename T>
static T* shared(size_t count) {
  Fiber& f = fibers[current];
  if (f.shared_index == arena.size()) {
    size_t at = (smem_top + 127) / 128 * 128;
    if (at + count * sizeof(T) > SHARED_BYTES) {
      fail("shared memory past 228 KB");
      at = 0;
    }
    arena.push_back(at);
    smem_top = at + count * sizeof(T);
    std::memset(smem + at, 0xFF, count * sizeof(T));  // NaN-filled
  }
  return reinterpret_cast<T*>(smem + arena[f.shared_index++]);
}

// The `extern __shared__` array: as many bytes as the launch gives (NaN-filled like the others).
template <typename T>
static T* dynamic_shared() {
  if (!dynamic_shared_bytes) fail("the kernel uses dynamic shared memory and is launched with none");
  return shared<T>(dynamic_shared_bytes / sizeof(T));
}

static void yield_to_scheduler() { swapcontext(&fibers[current].ctx, &scheduler); }

// A warp-collective operation's rendezvous: the lanes of the calling thread's warp only.
static void warp_sync() {
  fibers[current].at_warp_barrier = true;
  yield_to_scheduler();
}

static bool wgmma_idle();
static bool wgmma_committed(size_t thread, long group);

// Returns 0; 1 when the threads of a block did not all reach the same barrier; 2 when the kernel
// did something the hardware would not allow (`failure` says what).
static int run_grid(dim3 grid, dim3 block) {
  grid_dim = grid;
  failure = nullptr;
  block_dim = block;
  size_t n = (size_t)block.x * block.y * block.z;
  fibers.assign(n, Fiber());
  for (auto& f : fibers) f.stack.resize(256 * 1024);
  for (unsigned bz = 0; bz < grid.z; ++bz)
  for (unsigned by = 0; by < grid.y; ++by)
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    block_idx = {bx, by, bz};
    arena.clear();
    smem_top = 0;
    for (size_t i = 0; i < n; ++i) {
      Fiber& f = fibers[i];
      f.tid = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / block.x / block.y)};
      f.done = f.at_barrier = f.at_warp_barrier = false;
      f.wgmma_wait = -1;
      f.shared_index = 0;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &scheduler;
      makecontext(&f.ctx, fiber_main, 0);
    }
    for (;;) {
      // Run every runnable thread to its next barrier (or its end), in thread order.
      for (size_t i = 0; i < n; ++i) {
        Fiber& f = fibers[i];
        if (f.done || f.at_barrier || f.at_warp_barrier || f.wgmma_wait >= 0) continue;
        current = i;
        thread_idx = f.tid;
        swapcontext(&scheduler, &f.ctx);
      }
      size_t done = 0, waiting = 0;
      for (auto& f : fibers) { done += f.done; waiting += f.at_barrier && !f.done; }
      if (done == n) break;
      bool released = false;  // warps whose live lanes all wait at a rendezvous go on
      for (size_t w = 0; w < n; w += 32) {
        size_t end = w + 32 < n ? w + 32 : n, live = 0, at = 0;
        for (size_t i = w; i < end; ++i) { live += !fibers[i].done; at += fibers[i].at_warp_barrier; }
        if (at && at == live) {
          for (size_t i = w; i < end; ++i) fibers[i].at_warp_barrier = false;
          released = true;
        }
      }
      bool wgmma_waits = false;  // threads waiting for a wgmma group go on once it is all committed
      for (size_t i = 0; i < n; ++i) {
        Fiber& f = fibers[i];
        if (f.wgmma_wait < 0) continue;
        wgmma_waits = true;
        if (wgmma_committed(i, f.wgmma_wait)) {
          f.wgmma_wait = -1;
          released = true;
        }
      }
      if (released) continue;
      if (wgmma_waits) {
        fail("a wgmma.wait_group waits for a group that not every thread of the warpgroup commits");
        return 2;
      }
      if (done || waiting != n) return 1;  // some threads ended or wait elsewhere: divergent barriers
      for (auto& f : fibers) f.at_barrier = false;
    }
    if (!wgmma_idle()) fail("wgmma.mma_async issued and never waited for (wgmma.wait_group)");
    if (failure) return 2;
  }
  return 0;
}

// mma.sync.aligned.m16n8k{K}.row.col.f32.{tf32,bf16}.{..}.f32 over the calling warp, in the PTX
// ISA's fragment layouts: lane (g, t) = (lane / 4, lane % 4); register j, element e of A holds
// A[g + 8 (j % 2)][t * PER + e + K/2 (j / 2)], of B B[t * PER + e + K/2 j][g]; C[g + 8 (i / 2)][2t + i % 2].
// PER = 1: a tf32 in an fp32 register (its top 19 bits, as the tensor cores read them);
// PER = 2: two bf16 packed in a register, the lower k in the low half.
struct MmaSlot { float a[8], b[4]; };
static MmaSlot mma_slots[1024];

static float operand(unsigned bits, int per, int e) {
  unsigned u = per == 1 ? (bits & 0xffffe000u) : (e ? bits & 0xffff0000u : bits << 16);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int K, int PER>
static void mma_m16n8(float* d0, float* d1, float* d2, float* d3, unsigned a0, unsigned a1, unsigned a2,
                      unsigned a3, unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {
  size_t me = current, base = me - me % 32;
  unsigned ar[4] = {a0, a1, a2, a3}, br[2] = {b0, b1};
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < PER; ++e) mma_slots[me].a[j * PER + e] = operand(ar[j], PER, e);
  for (int j = 0; j < 2; ++j)
    for (int e = 0; e < PER; ++e) mma_slots[me].b[j * PER + e] = operand(br[j], PER, e);
  warp_sync();
  auto A = [&](int r, int k) {
    int kk = k % (K / 2);
    return mma_slots[base + (r % 8) * 4 + kk / PER].a[((r >= 8) + 2 * (k >= K / 2)) * PER + kk % PER];
  };
  auto B = [&](int k, int c) {
    int kk = k % (K / 2);
    return mma_slots[base + c * 4 + kk / PER].b[(k >= K / 2) * PER + kk % PER];
  };
  int g = (int)(me % 32) / 4, t = (int)(me % 32) % 4;
  float c[4] = {c0, c1, c2, c3};
  float* d[4] = {d0, d1, d2, d3};
  float out[4];
  for (int i = 0; i < 4; ++i) {
    int r = g + 8 * (i / 2), col = 2 * t + i % 2;
    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += (double)A(r, k) * (double)B(k, col);
    out[i] = (float)(sum + (double)c[i]);
  }
  warp_sync();  // every lane has read the slots before any lane's next mma overwrites them
  for (int i = 0; i < 4; ++i) *d[i] = out[i];
}

// wgmma.mma_async.sync.aligned.m64nNkK.f32.{tf32,bf16} with A in registers, over the calling
// warpgroup (PTX ISA 9.7.15.5.1): warp w, lane (g, t); A register j, element e holds
// A[16w + g + 8 (j % 2)][t * PER + e + K/2 (j / 2)] (PER values a register, as for mma.sync);
// D register 4c + 2h + b is D[16w + g + 8h][8c + 2t + b]; B[n][k] is read from shared memory
// through the descriptor (start, LBO, SBO in 16-byte units; bits 62-63 the swizzle, only 0 = none
// here), K-major, C = 4 PER values in 16 bytes: byte (n / 8) SBO + (n % 8) 16 + (k / C) LBO +
// (k % C) 4 / PER. tf32 is K = 8, PER = 1; bf16 K = 16, PER = 2.
// An mma is recorded when issued and its group closed by commit_group; each thread carries out
// its share (its accumulators) at the wait_group that retires the group, once every thread of
// the warpgroup has committed it: the accumulators change then, and B is read then.
struct WgmmaOp {
  int n, k, per;
  float* d[128];
  unsigned a[4];
  uint64_t desc;
  bool scale_d;
  int scale_a, scale_b;
  uint64_t b_at_issue;  // the B tile's bits when issued (b_digest): it may not change until the wait
};
struct WgmmaOperands {  // one wgmma's A (64 x K) and B (n x K) as read, shared by the warpgroup's threads
  bool ready = false;
  uint64_t b_digest = 0;  // the B tile they were read from
  std::vector<float> a, b;
};
struct WgmmaGroup {
  std::vector<WgmmaOp> ops[128];  // by thread of the warpgroup
  std::vector<WgmmaOperands> operands;  // by wgmma of the group, read by the first thread to retire it
  int committed = 0, retired = 0;
};
struct Warpgroup {
  std::vector<WgmmaGroup> groups;  // groups[i] is group number first + i
  long first = 0;
};
struct ThreadWgmma {
  std::vector<WgmmaOp> open;
  long committed = 0, retired = 0;
};
static Warpgroup warpgroups[8];
static ThreadWgmma thread_wgmma[1024];

static bool wgmma_idle() {
  bool idle = true;
  for (size_t i = 0; i < fibers.size(); ++i) {
    idle &= thread_wgmma[i].open.empty() && thread_wgmma[i].committed == thread_wgmma[i].retired;
    thread_wgmma[i] = ThreadWgmma();
  }
  for (auto& w : warpgroups) w = Warpgroup();
  return idle;
}

static bool wgmma_committed(size_t thread, long group) {
  const Warpgroup& w = warpgroups[thread / 128];
  return w.groups[group - w.first].committed == 128;
}

static void wgmma_fence() {}

// The shared-memory byte address of B[col][k] through descriptor `desc` (start, LBO and SBO in
// 16-byte units, K-major, no swizzle), PER values of k in 4 bytes.
static uint32_t b_address(uint64_t desc, int col, int k, int per) {
  uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, lbo = (uint32_t)(desc >> 16 & 0x3FFF) << 4,
           sbo = (uint32_t)(desc >> 32 & 0x3FFF) << 4;
  int c = 4 * per;
  return start + (col / 8) * sbo + (col % 8) * 16 + (k / c) * lbo + (k % c) * 4 / per;
}

// A digest of the bits of the B tile (n x K) that descriptor `desc` addresses. The hardware's
// tensor cores may read it at any time between the issue and the wait, so a tile that changes in
// between (a store before every thread has waited, a missing barrier before the issue) is a race.
static uint64_t b_digest(int n, int k_extent, int per, uint64_t desc) {
  uint64_t h = 1469598103934665603ull;
  for (int col = 0; col < n; ++col)
    for (int k = 0; k < k_extent; k += 4 * per) {  // a core matrix's row: 16 bytes, 4 PER values
      uint32_t at = b_address(desc, col, k, per);
      uint64_t u[2] = {0, 0};
      if (at + 16 <= smem_top) std::memcpy(u, smem + at, 16);
      h = (h ^ u[0]) * 1099511628211ull;
      h = (h ^ u[1]) * 1099511628211ull;
    }
  return h;
}

static void wgmma_mma(int n, int k, int per, float** d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                      uint64_t desc, bool scale_d, int scale_a, int scale_b) {
  if (block_dim.x * block_dim.y * block_dim.z % 128) fail("wgmma in a block that is not whole warpgroups");
  WgmmaOp op{n, k, per, {}, {a0, a1, a2, a3}, desc, scale_d, scale_a, scale_b, b_digest(n, k, per, desc)};
  for (int i = 0; i < n / 2; ++i) op.d[i] = d[i];
  thread_wgmma[current].open.push_back(op);
}

static void wgmma_commit() {
  ThreadWgmma& me = thread_wgmma[current];
  Warpgroup& w = warpgroups[current / 128];
  while ((long)w.groups.size() <= me.committed - w.first) w.groups.emplace_back();
  WgmmaGroup& group = w.groups[me.committed - w.first];
  group.ops[current % 128] = me.open;
  group.committed++;
  me.open.clear();
  me.committed++;
}

// A B value from shared memory as the tensor cores read it: a tf32 (4 bytes, truncated) or a
// bf16 (2 bytes).
static float shared_operand(uint32_t address, int per) {
  if (address + 4 / per > smem_top) {
    fail("a wgmma descriptor reads past the block's shared memory");
    return 0.0f;
  }
  unsigned u = 0;
  std::memcpy(&u, smem + address, 4 / per);
  return operand(u, per, 0);
}

static void wgmma_wait(int pending) {
  ThreadWgmma& me = thread_wgmma[current];
  size_t lane = current % 128;
  int w = (int)lane / 32, g = (int)(lane % 32) / 4, t = (int)lane % 4;
  while (me.committed - me.retired > pending) {
    Warpgroup& wg = warpgroups[current / 128];
    if (!wgmma_committed(current, me.retired)) {
      fibers[current].wgmma_wait = me.retired;
      yield_to_scheduler();  // until every thread of the warpgroup has committed the group
    }
    WgmmaGroup& group = wg.groups[me.retired - wg.first];
    const std::vector<WgmmaOp>& mine = group.ops[lane];
    if (group.operands.empty()) {  // the first thread to retire the group: every thread issued the same
      for (int i = 0; i < 128; ++i)
        if (group.ops[i].size() != mine.size()) fail("the threads of a warpgroup issued different wgmma groups");
      for (size_t q = 0; q < mine.size(); ++q)
        for (int i = 0; i < 128; ++i)
          if (group.ops[i][q].desc != mine[q].desc || group.ops[i][q].n != mine[q].n || group.ops[i][q].k != mine[q].k)
            fail("the threads of a warpgroup gave one wgmma different descriptors or shapes");
      if (failure) return;
      group.operands.resize(mine.size());
    }
    for (size_t q = 0; q < mine.size(); ++q) {
      const WgmmaOp& op = mine[q];
      if (op.desc >> 62) fail("the emulator reads only unswizzled wgmma descriptors");
      uint64_t digest = b_digest(op.n, op.k, op.per, op.desc);
      if (op.b_at_issue != digest)  // (each thread checks its own issue)
        fail("a wgmma's shared B tile changed between its issue and its wait (a race: a missing "
             "barrier, or a store before every thread has waited)");
      if (failure) return;
      int half = op.k / 2, per = op.per, K = op.k;
      WgmmaOperands& in = group.operands[q];
      if (!in.ready || in.b_digest != digest) {  // read once for the warpgroup (again if B differs)
        in.a.resize(64 * K);
        in.b.resize(op.n * K);
        for (int row = 0; row < 64; ++row)
          for (int k = 0; k < K; ++k) {
            int kk = k % half;
            const WgmmaOp& holder = group.ops[(row / 16) * 32 + (row % 8) * 4 + kk / per][q];
            in.a[row * K + k] = operand(holder.a[(row % 16 >= 8) + 2 * (k >= half)], per, kk % per);
          }
        for (int col = 0; col < op.n; ++col)
          for (int k = 0; k < K; ++k) in.b[col * K + k] = shared_operand(b_address(op.desc, col, k, per), per);
        in.ready = !failure;
        in.b_digest = digest;
      }
      for (int r = 0; r < op.n / 2; ++r) {
        int row = 16 * w + g + 8 * (r / 2 % 2), col = 8 * (r / 4) + 2 * t + r % 2;
        double sum = 0.0;
        for (int k = 0; k < K; ++k) sum += (double)in.a[row * K + k] * (double)in.b[col * K + k];
        sum *= op.scale_a * op.scale_b;
        *op.d[r] = (float)(op.scale_d ? sum + (double)*op.d[r] : sum);
      }
    }
    group.retired++;
    me.retired++;
    while (!wg.groups.empty() && wg.groups.front().retired == 128) {  // every thread is done with it
      wg.groups.erase(wg.groups.begin());
      wg.first++;
    }
  }
}
}  // namespace emu

static inline uint32_t __cvta_generic_to_shared(const void* p) {
  const unsigned char* at = static_cast<const unsigned char*>(p);
  if (at < emu::smem || at >= emu::smem + emu::SHARED_BYTES) emu::fail("__cvta_generic_to_shared: not shared memory");
  return (uint32_t)(at - emu::smem);
}

static inline void __syncthreads() {
  emu::Fiber& f = emu::fibers[emu::current];
  f.at_barrier = true;
  swapcontext(&f.ctx, &emu::scheduler);
}

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
"""


class EmulationError(RuntimeError):
    """The kernel could not be compiled or did something the emulator cannot run."""


def have_compiler() -> bool:
    """Whether g++ (which the emulator compiles with) is installed."""
    return shutil.which("g++") is not None


_SHARED = re.compile(r"__shared__\s+(?:alignas\(\d+\)\s+)?(\w+)\s+(\w+)\[(\d+)\];")
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[\];")
_MMA = re.compile(r'__asm__ __volatile__\(\s*"mma\.sync\.aligned\.([\w.]+)"\s*"[^"]*"\s*:(.*?)\);', re.S)
_SUPPORTED_MMA = {"m16n8k8.row.col.f32.tf32.tf32.f32": "mma_m16n8<8, 1>",
                  "m16n8k16.row.col.f32.bf16.bf16.f32": "mma_m16n8<16, 2>"}
# TVM's wgmma helpers (`T.ptx["wgmma..."]`): one inline-PTX statement each, in the preamble
_WGMMA_ASM = re.compile(r'asm volatile\("((?:[^"\\]|\\.)*)"\s*:(.*?)\);', re.S)
# (A from registers; the 16-bit types' B-transpose immediate last, only 0 = K-major emulated)
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k(\d+)\.f32\.(tf32|bf16)\.\3 \{[^}]*\}, "
                    r"\{[^}]*\}, %\d+, ps0, (-?1), (-?1)(?:, (\d))?;")
_WGMMA_TYPES = {("tf32", 8): 1, ("bf16", 16): 2}  # (type, K): values a register


def _operands(text: str) -> list[str]:
    """The C expressions of an inline-asm operand list: `"=f"(expr), "r"(expr), ...`."""
    exprs, i = [], 0
    while True:
        i = text.find('"(', i)
        if i < 0:
            return exprs
        depth, j = 0, i + 1
        while True:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        exprs.append(text[i + 2:j])
        i = j


def _emulate_mma(match: re.Match) -> str:
    kind = match.group(1)
    if kind not in _SUPPORTED_MMA:
        raise EmulationError(f"the emulator has no mma.sync.aligned.{kind}")
    outputs, _, inputs = match.group(2).partition(":")
    args = [f"&({e})" for e in _operands(outputs)] + _operands(inputs)
    return f"emu::{_SUPPORTED_MMA[kind]}({', '.join(args)});"


def _emulate_wgmma(match: re.Match) -> str:
    """One of TVM's wgmma helper statements -> its emulation (see the header)."""
    text, operands = match.group(1), match.group(2)
    if text.startswith("wgmma.fence.sync.aligned"):
        return "emu::wgmma_fence();"
    if text.startswith("wgmma.commit_group.sync.aligned"):
        return "emu::wgmma_commit();"
    if text.startswith("wgmma.wait_group.sync.aligned"):
        return f"emu::wgmma_wait({int(text.split()[1].rstrip(';'))});"
    mma = _WGMMA.search(text)
    if mma is None or (mma.group(3), int(mma.group(2))) not in _WGMMA_TYPES:
        raise EmulationError(f"the emulator has no {text.split(';')[-2].strip().split()[0]!r}")
    if (mma.group(6) or "0") != "0":
        raise EmulationError("the emulator reads a wgmma's B tile K-major only (its transpose immediate 0)")
    n, k, scale_a, scale_b = int(mma.group(1)), int(mma.group(2)), mma.group(4), mma.group(5)
    per = _WGMMA_TYPES[mma.group(3), k]
    outputs, _, inputs = operands.partition(":")
    d, rest = _operands(outputs), _operands(inputs)
    if len(d) != n // 2 or len(rest) != 6:
        raise EmulationError(f"wgmma m64n{n}k{k}: {len(d)} accumulators and {len(rest)} inputs, expected "
                             f"{n // 2} and 6")
    a, desc, scale_d = rest[:4], rest[4], rest[5]
    return (f"{{ float* d_[] = {{{', '.join(f'&({e})' for e in d)}}}; "
            f"emu::wgmma_mma({n}, {k}, {per}, d_, {', '.join(a)}, {desc}, ({scale_d}) != 0, {scale_a}, {scale_b}); }}")


def _helpers(source: str, start: int) -> str:
    """TVM's device helpers the kernels call when they issue wgmma (the descriptor type and
    encoder, one function per instruction), from the preamble, their inline PTX emulated."""
    if "wgmma" not in source[start:]:
        return ""
    begin = source.find("#ifndef HOST_DEVICE")
    if begin < 0 or begin > start:
        raise EmulationError("the kernel calls wgmma helpers the source does not define")
    return _WGMMA_ASM.sub(_emulate_wgmma, source[begin:start])


def _device_code(source: str) -> str:
    """The kernels without TVM's CUDA preamble (but with the wgmma helpers they call): shared
    arrays turned into per-block arenas, tensor-core instructions (inline PTX) into calls of
    their emulation."""
    start = source.find('extern "C" __global__')
    if start < 0:
        raise EmulationError("the source has no __global__ kernel")
    code = _SHARED.sub(r"\1* \2 = emu::shared<\1>(\3);", source[start:])
    code = _DYNAMIC_SHARED.sub(r"\1* \2 = emu::dynamic_shared<\1>();", code)
    code = _helpers(source, start) + _MMA.sub(_emulate_mma, code)
    if "__asm__" in code or "asm volatile" in code:
        raise EmulationError("the kernel has inline PTX the emulator does not know")
    return code


def _cache_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"tvm_ext_cuda_emu_{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _params(source: str, kernel: str) -> list[tuple[str, str]]:
    try:
        return kernel_params(source, kernel)
    except ValueError as err:
        raise EmulationError(str(err)) from None


@functools.cache
def compile_kernel(source: str, kernel: str) -> ctypes.CDLL:
    """Compile `kernel` of `source` for the CPU and load it (cached on disk by content, and in
    this process: a network's emulation launches each kernel many times)."""
    params = _params(source, kernel)
    args = ", ".join(f"({ty}*)args[{i}]" for i, (ty, _) in enumerate(params))
    text = (HEADER + _device_code(source) + f"""
extern "C" int emu_launch(void** args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, size_t dynamic_shared_bytes) {{
  emu::body = [args]() {{ {kernel}({args}); }};
  emu::dynamic_shared_bytes = dynamic_shared_bytes;
  return emu::run_grid({{gx, gy, gz}}, {{bx, by, bz}});
}}
extern "C" const char* emu_failure() {{ return emu::failure ? emu::failure : ""; }}
""")
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    lib = os.path.join(_cache_dir(), f"{kernel}_{digest}.so")
    if not os.path.exists(lib):
        # files of this process, renamed into place: pytest-xdist's workers may build the same
        # kernel at once, and a file replaced while another process writes it would be truncated
        src, tmp = f"{lib[:-3]}.{os.getpid()}.cc", f"{lib}.{os.getpid()}.tmp"
        with open(src, "w") as f:
            f.write(text)
        cmd = ["g++", "-std=c++17", "-O1", "-w", "-shared", "-fPIC", src, "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise EmulationError(f"g++ failed on {kernel}:\n{result.stderr[-4000:]}")
        os.replace(src, lib[:-3] + ".cc")  # kept beside the library, to read
        os.replace(tmp, lib)
    return ctypes.CDLL(lib)


def run_kernel(source: str, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               arrays: Mapping[str, np.ndarray], shared_bytes: int = 0) -> None:
    """Run `kernel` over `grid` x `block` on the CPU, on `arrays` named as its parameters, with
    `shared_bytes` of dynamic shared memory (its `extern __shared__` array).

    A parameter `X_ptr` takes `arrays["X"]` (or `arrays["X_ptr"]`); arrays must be C-contiguous
    and of the parameter's element type. Outputs are written in place.
    """
    params = _params(source, kernel)
    ctype = {"float": np.float32, "double": np.float64, "int": np.int32, "float4": np.float32}
    pointers = []
    for ty, name in params:
        key = name if name in arrays else name.removesuffix("_ptr")
        if key not in arrays:
            raise EmulationError(f"{kernel}: no array for parameter {name}")
        arr = arrays[key]
        if not arr.flags.c_contiguous or arr.dtype != ctype.get(ty, None):
            raise EmulationError(f"{kernel}: {name} needs a C-contiguous {ty} array, got {arr.dtype}")
        pointers.append(arr.ctypes.data_as(ctypes.c_void_p))
    lib = compile_kernel(source, kernel)
    argv = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
    status = lib.emu_launch(argv, *(ctypes.c_uint(v) for v in (*grid, *block)), ctypes.c_size_t(shared_bytes))
    if status == 1:
        raise EmulationError(f"{kernel}: the threads of a block did not all reach the same __syncthreads()")
    if status:
        lib.emu_failure.restype = ctypes.c_char_p
        raise EmulationError(f"{kernel}: {lib.emu_failure().decode()}")
