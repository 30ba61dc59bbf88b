// The CUDA emulator's runtime (see cuda_emulator.py): CUDA threads as fibers, the block
// scheduler, shared memory, and the tensor-core instructions (mma.sync, wgmma). Compiled once
// into a shared library that every emulated kernel links against.
//
// A fiber starts on its own stack (ucontext) once per launch and then runs every block of the
// grid in turn; it switches with _setjmp/_longjmp, which save no signal mask: a switch costs no
// system call (swapcontext makes one at every switch: 1.3 us a round trip here, against 0.05).
#undef _FORTIFY_SOURCE  // its longjmp check rejects a jump to another stack
#include "cuda_emulator.h"

#include <memory>
#include <setjmp.h>
#include <vector>
#include <ucontext.h>

namespace emu {
dim3 thread_idx, block_idx, block_dim, grid_dim;

static const size_t STACK_BYTES = 256 * 1024;
struct Fiber {
  std::unique_ptr<char[]> stack;  // kept from launch to launch (uninitialized: no 256 KB memset)
  ucontext_t entry;  // the start of fiber_main on that stack
  jmp_buf ctx;  // where it stopped, once started
  bool started = false;
  dim3 tid;
  bool done = false;
  bool at_barrier = false;
  bool at_warp_barrier = false;
  long wgmma_wait = -1;  // the wgmma group this thread waits for every thread of its warpgroup to commit
  size_t shared_index = 0;
};
static jmp_buf scheduler;
static std::vector<Fiber> fibers;
static size_t current = 0;
static void (*body)(void**) = nullptr;
static void** body_args = nullptr;
static const char* failure = nullptr;  // what the kernel did that the hardware would not allow

// This block's shared memory: one arena (as on the GPU, so that shared addresses are offsets),
// each `__shared__` array at a 128-byte boundary, NaN-filled when the block starts.
static const size_t SHARED_BYTES = 228 * 1024;
alignas(1024) static unsigned char smem[SHARED_BYTES];
static size_t smem_top = 0;
static std::vector<size_t> arena;  // offsets of this block's shared arrays, in declaration order
// Shared memory as the async proxy (wgmma's descriptor reads) sees it: [0, async_top) as of the
// last fence.proxy.async. A wgmma whose B tile differs from it reads stores the fence did not
// publish, which on an H200 gave NaN (the generic and async proxies are ordered only by the fence).
alignas(1024) static unsigned char async_view[SHARED_BYTES];
static size_t async_top = 0;
static size_t dynamic_shared_bytes = 0;  // the launch's dynamic shared memory (`extern __shared__`)

void fail(const char* why) {
  if (!failure) failure = why;
}

const char* failure_message() { return failure ? failure : ""; }

static void yield_to_scheduler() {
  if (!_setjmp(fibers[current].ctx)) _longjmp(scheduler, 1);
}

// A thread's life: the kernel once for each block of the grid, resumed by the scheduler for the next.
static void fiber_main() {
  for (;;) {
    body(body_args);
    fibers[current].done = true;
    yield_to_scheduler();
  }
}

// Runs thread i until it waits (or ends its block).
static void resume(size_t i) {
  Fiber& f = fibers[i];
  current = i;
  thread_idx = f.tid;
  if (_setjmp(scheduler)) return;
  if (f.started) _longjmp(f.ctx, 1);
  f.started = true;
  setcontext(&f.entry);
}

void* shared_array(size_t bytes) {
  Fiber& f = fibers[current];
  if (f.shared_index == arena.size()) {
    size_t at = (smem_top + 127) / 128 * 128;
    if (at + bytes > SHARED_BYTES) {
      fail("shared memory past 228 KB");
      at = 0;
    }
    arena.push_back(at);
    smem_top = at + bytes;
    std::memset(smem + at, 0xFF, bytes);  // NaN-filled
  }
  return smem + arena[f.shared_index++];
}

// The `extern __shared__` array: as many bytes as the launch gives (NaN-filled like the others).
void* dynamic_shared_array() {
  if (!dynamic_shared_bytes) fail("the kernel uses dynamic shared memory and is launched with none");
  return shared_array(dynamic_shared_bytes);
}

uint32_t shared_address(const void* p) {
  const unsigned char* at = static_cast<const unsigned char*>(p);
  if (at < smem || at >= smem + SHARED_BYTES) fail("__cvta_generic_to_shared: not shared memory");
  return (uint32_t)(at - smem);
}

void sync_threads() {
  fibers[current].at_barrier = true;
  yield_to_scheduler();
}

// A warp-collective operation's rendezvous: the lanes of the calling thread's warp only.
static void warp_sync() {
  fibers[current].at_warp_barrier = true;
  yield_to_scheduler();
}

static bool wgmma_idle(size_t threads);
static void wgmma_reset(size_t threads);
static bool wgmma_committed(size_t thread, long group);

int launch(void (*kernel)(void**), void** args, dim3 grid, dim3 block, size_t dynamic_shared) {
  body = kernel;
  body_args = args;
  dynamic_shared_bytes = dynamic_shared;
  grid_dim = grid;
  failure = nullptr;
  wgmma_reset(fibers.size());  // nothing left of a launch that failed
  block_dim = block;
  size_t n = (size_t)block.x * block.y * block.z;
  if (n == 0 || n > 1024) {
    fail("a block of no threads or of more than 1024");
    return 2;
  }
  if (fibers.size() < n) fibers.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    if (!f.stack) f.stack.reset(new char[STACK_BYTES]);
    f.started = false;
    getcontext(&f.entry);
    f.entry.uc_stack.ss_sp = f.stack.get();
    f.entry.uc_stack.ss_size = STACK_BYTES;
    f.entry.uc_link = nullptr;  // fiber_main never returns
    makecontext(&f.entry, fiber_main, 0);
  }
  for (unsigned bz = 0; bz < grid.z; ++bz)
  for (unsigned by = 0; by < grid.y; ++by)
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    block_idx = {bx, by, bz};
    arena.clear();
    smem_top = async_top = 0;
    for (size_t i = 0; i < n; ++i) {
      Fiber& f = fibers[i];
      f.tid = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / block.x / block.y)};
      f.done = f.at_barrier = f.at_warp_barrier = false;
      f.wgmma_wait = -1;
      f.shared_index = 0;
    }
    for (;;) {
      // Run every runnable thread to its next barrier (or its end), in thread order.
      for (size_t i = 0; i < n; ++i) {
        Fiber& f = fibers[i];
        if (!(f.done || f.at_barrier || f.at_warp_barrier || f.wgmma_wait >= 0)) resume(i);
      }
      size_t done = 0, waiting = 0;
      for (size_t i = 0; i < n; ++i) { done += fibers[i].done; waiting += fibers[i].at_barrier && !fibers[i].done; }
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
      for (size_t i = 0; i < n; ++i) fibers[i].at_barrier = false;
    }
    bool idle = wgmma_idle(n);
    wgmma_reset(n);
    if (!idle) fail("wgmma.mma_async issued and never waited for (wgmma.wait_group)");
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
void mma_m16n8(float* d0, float* d1, float* d2, float* d3, unsigned a0, unsigned a1, unsigned a2,
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
template void mma_m16n8<8, 1>(float*, float*, float*, float*, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, float, float, float, float);
template void mma_m16n8<16, 2>(float*, float*, float*, float*, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, float, float, float, float);

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

// Whether threads 0..threads-1 have waited for every wgmma they issued.
static bool wgmma_idle(size_t threads) {
  bool idle = true;
  for (size_t i = 0; i < threads; ++i)
    idle &= thread_wgmma[i].open.empty() && thread_wgmma[i].committed == thread_wgmma[i].retired;
  return idle;
}

static void wgmma_reset(size_t threads) {
  for (size_t i = 0; i < threads; ++i) thread_wgmma[i] = ThreadWgmma();
  for (auto& w : warpgroups) w = Warpgroup();
}

static bool wgmma_committed(size_t thread, long group) {
  const Warpgroup& w = warpgroups[thread / 128];
  return w.groups[group - w.first].committed == 128;
}

void wgmma_fence() {}

void fence_proxy_async() {
  std::memcpy(async_view, smem, smem_top);
  async_top = smem_top;
}

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
static uint64_t b_digest(int n, int k_extent, int per, uint64_t desc, bool async_proxy = false) {
  const unsigned char* memory = async_proxy ? async_view : smem;
  size_t top = async_proxy ? async_top : smem_top;
  uint64_t h = 1469598103934665603ull;
  for (int col = 0; col < n; ++col)
    for (int k = 0; k < k_extent; k += 4 * per) {  // a core matrix's row: 16 bytes, 4 PER values
      uint32_t at = b_address(desc, col, k, per);
      uint64_t u[2] = {0, 0};
      if (at + 16 <= top) std::memcpy(u, memory + at, 16);
      h = (h ^ u[0]) * 1099511628211ull;
      h = (h ^ u[1]) * 1099511628211ull;
    }
  return h;
}

void wgmma_mma(int n, int k, int per, float** d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                      uint64_t desc, bool scale_d, int scale_a, int scale_b) {
  if (block_dim.x * block_dim.y * block_dim.z % 128) fail("wgmma in a block that is not whole warpgroups");
  WgmmaOp op{n, k, per, {}, {a0, a1, a2, a3}, desc, scale_d, scale_a, scale_b, b_digest(n, k, per, desc)};
  if (op.b_at_issue != b_digest(n, k, per, desc, true))
    fail("a wgmma reads shared memory stored after the last fence.proxy.async (the tensor cores may "
         "see it as it was before the stores)");
  for (int i = 0; i < n / 2; ++i) op.d[i] = d[i];
  thread_wgmma[current].open.push_back(op);
}

void wgmma_commit() {
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

void wgmma_wait(int pending) {
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
