// The CPU emulation runtime: runs a kernel launch block by block, each CUDA thread of a block as
// a cooperative fiber on this one OS thread, with __syncthreads() and the warp collectives as
// rendezvous points (see cuda_emulation.h for the contract).
//
// Scheduling. A block's fibers run in thread order, each until it reaches a rendezvous or
// leaves the kernel (a "sweep"). Then the waiting threads are matched: a warp collective
// completes when every lane its mask names waits at the same call site with the same mask; a
// barrier completes when every thread of the block waits at the same __syncthreads(). Anything
// else is a programming error (the GPU would hang or compute garbage) and is reported with the
// kernel, the block, the threads and the source lines, and the process exits with status 3.
//
// This file is compiled without sanitizer instrumentation even in the sanitizer builds: its own
// bookkeeping is not the program under test. It tells the sanitizers about the fibers:
//   * AddressSanitizer: __sanitizer_start/finish_switch_fiber around every switch;
//   * ThreadSanitizer: one TSan fiber per CUDA thread, switched with "no sync", so the only
//     happens-before edges between CUDA threads are the ones this file adds with
//     __tsan_release / __tsan_acquire: at a barrier (all threads of the block), at a warp
//     collective (its lanes), and at the start and end of a launch (the host). Creating a TSan
//     fiber costs about a millisecond, so there are two sets, used by even and odd blocks:
//     consecutive blocks are never ordered with each other, as on a GPU, but thread t of block
//     b + 2 runs after thread t of block b in the same TSan fiber (a race between those two
//     blocks can go unseen).
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext functions only with it
#define _DARWIN_C_SOURCE 1
#endif
#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_emulation.h"
#include "runtime.h"

#if defined(MINI_VLLM_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(MINI_VLLM_EMU_TSAN)
#include <sanitizer/common_interface_defs.h>
#include <sanitizer/tsan_interface.h>
// Exported by the ThreadSanitizer runtime but not declared in its public header: while the
// count is positive, the current thread's memory accesses are not recorded (and an allocation
// resets the shadow of its memory instead of counting as a write).
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

// The context switch: a few instructions of assembly on x86-64 ELF systems (Linux), the C
// library's ucontext elsewhere (slower: it saves the signal mask with a system call).
#if defined(__x86_64__) && defined(__ELF__) && !defined(MINI_VLLM_EMU_UCONTEXT)
#define MINI_VLLM_EMU_ASM_SWITCH 1
#endif
#include <ucontext.h>

namespace mini_vllm_emu {

ThreadIndex* g_thread = nullptr;
uint3 g_block_idx = {0, 0, 0};
dim3 g_block_dim;
dim3 g_grid_dim;

namespace {

// ---- the modelled device ------------------------------------------------------------------------

struct DeviceModel {
  const char* key;
  const char* name;
  int cc_major, cc_minor;
  int smem_optin;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int smem_per_sm;
  int num_sms;
};
constexpr int kDefaultSmem = 48 * 1024;  // what a block gets without opting in
const DeviceModel kDevices[] = {
    {"default", "a generic GPU with 48 KB of shared memory per block", 8, 0, 48 * 1024, 48 * 1024, 1},
    {"t4", "a T4 (sm_75)", 7, 5, 64 * 1024, 64 * 1024, 40},
    {"a100", "an A100 (sm_80)", 8, 0, 163 * 1024, 164 * 1024, 108},
    {"h100", "an H100 (sm_90)", 9, 0, 227 * 1024, 228 * 1024, 132},
};

const DeviceModel& device() {
  static const DeviceModel* model = [] {
    const char* want = getenv("MINI_VLLM_EMU_DEVICE");
    if (want == nullptr || *want == '\0') return &kDevices[0];
    for (const auto& d : kDevices) {
      if (strcasecmp(d.key, want) == 0) return &d;
    }
    fprintf(stderr, "MINI_VLLM_EMU_DEVICE=%s is not a modelled device (default, t4, a100, h100)\n",
            want);
    _exit(2);
  }();
  return *model;
}

// ---- errors -------------------------------------------------------------------------------------

cudaError_t g_last_error = cudaSuccess;

struct KernelInfo {
  int max_dynamic_smem = -1;  // set by cudaFuncSetAttribute; -1: the default
  size_t static_smem_seen = 0;
};
std::unordered_map<const void*, KernelInfo>& kernels() {
  static std::unordered_map<const void*, KernelInfo> map;
  return map;
}

// A named memory region, so that reports can say "key_cache" instead of an address.
struct Region {
  std::string name;
  uintptr_t begin;
  size_t bytes;
};
std::vector<Region>& regions() {
  static std::vector<Region> r;
  return r;
}

uintptr_t image_base() {
  static uintptr_t base = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&image_base), &info) == 0) return uintptr_t{0};
    return reinterpret_cast<uintptr_t>(info.dli_fbase);
  }();
  return base;
}

// Offsets in the executable, which the Python side symbolizes (addr2line -i) into the chain of
// source lines, innermost first: {{site:OFFSET|FILE|LINE}} and {{func:OFFSET|FALLBACK}}.
std::string site_token(const void* ret, const char* file, int line) {
  char buf[64];
  // A return address points after the call; the call itself is one byte before.
  snprintf(buf, sizeof buf, "{{site:0x%zx|", reinterpret_cast<uintptr_t>(ret) - 1 - image_base());
  return std::string(buf) + file + "|" + std::to_string(line) + "}}";
}
std::string func_token(const void* fn, const char* fallback) {
  char buf[64];
  snprintf(buf, sizeof buf, "{{func:0x%zx|", reinterpret_cast<uintptr_t>(fn) - image_base());
  return std::string(buf) + fallback + "}}";
}

void write_all(const std::string& s) {
  const char* p = s.data();
  size_t left = s.size();
  while (left > 0) {
    const ssize_t n = write(2, p, left);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// ---- fibers -------------------------------------------------------------------------------------

#if defined(MINI_VLLM_EMU_ASM_SWITCH)
// switch_context(save, load): saves the callee-saved registers, the SSE control word and the x87
// control word on the current stack, stores the stack pointer in *save, and resumes the context
// whose stack pointer is `load`.
extern "C" void mini_vllm_emu_switch_context(void** save, void* load);
asm(R"(
.text
.globl mini_vllm_emu_switch_context
.type mini_vllm_emu_switch_context,@function
mini_vllm_emu_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size mini_vllm_emu_switch_context,.-mini_vllm_emu_switch_context
.section .note.GNU-stack,"",@progbits
.text
)");
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

enum class State { kRunnable, kBarrier, kWarp, kDone };

struct Fiber {
  ThreadIndex index;  // what threadIdx reads
  unsigned tid = 0;   // linear thread index in the block
  Context ctx;
  char* stack = nullptr;  // lowest usable address (a guard page lies below it)
  size_t stack_bytes = 0;
  State state = State::kRunnable;
  // The rendezvous this fiber waits at.
  Op op = Op::kSyncThreads;
  unsigned mask = 0;
  uint64_t bits = 0;
  int bytes = 0;
  int arg = 0;
  int width = 32;
  const char* file = "";
  int line = 0;
  const void* ret = nullptr;
  uint64_t result = 0;
  void* tsan_fiber = nullptr;
};

struct Launch {
  const void* kernel;
  const char* kernel_expr;
  const char* launch_file;
  int launch_line;
  dim3 grid, block;
  size_t dynamic_smem;
  int smem_limit;  // static + dynamic bytes a block may use
  void (*run)(void*);
  void* closure;
};

// The block being run: its fibers, shared memory and (for ThreadSanitizer) sync objects.
// A page-guarded allocation: the data ends (16-byte aligned) where an inaccessible page begins.
struct Guarded {
  char* reserve = nullptr;
  size_t total = 0;
  void* data = nullptr;
};
struct SharedAlloc {
  const void* key;
  Guarded mem;
};
struct BlockState {
  std::vector<SharedAlloc> shared;
  Guarded dynamic;
  size_t static_bytes = 0;
  // Addresses whose only use is as ThreadSanitizer sync objects; fresh for every block, so
  // blocks never synchronise with each other.
  char* sync = nullptr;  // [0]: the barrier, [1 + w]: warp w
};

Launch* g_launch = nullptr;
std::vector<Fiber> g_fibers;
// The values the lanes of each warp passed to that warp's last completed collective. It stays
// valid until every lane has left that collective: the next one completes only when all are back.
uint64_t g_lane_bits[32][32];
Fiber* g_current = nullptr;  // null while the scheduler itself runs
BlockState g_block;
Context g_scheduler;
const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
#if defined(MINI_VLLM_EMU_ASAN) || defined(MINI_VLLM_EMU_TSAN)
const size_t kStackBytes = 1024 * 1024;  // instrumented frames are larger
#else
const size_t kStackBytes = 256 * 1024;
#endif
#if defined(MINI_VLLM_EMU_ASAN)
const void* g_main_stack_bottom = nullptr;
size_t g_main_stack_size = 0;
#endif
#if defined(MINI_VLLM_EMU_TSAN)
void* g_tsan_main = nullptr;
char g_tsan_launch_start, g_tsan_launch_end;  // sync objects for the host's edges
// TSan fibers and their stacks, kept for the whole process: g_tsan_pool[b % 2][tid].
struct PooledFiber {
  void* tsan_fiber;
  char* stack;
  size_t stack_bytes;
};
std::vector<PooledFiber> g_tsan_pool[2];
#endif

// Allocations the runtime makes for the program under test are not accesses of that program.
struct NotAnAccess {
  NotAnAccess() {
#if defined(MINI_VLLM_EMU_TSAN)
    __tsan_ignore_thread_begin();
#endif
  }
  ~NotAnAccess() {
#if defined(MINI_VLLM_EMU_TSAN)
    __tsan_ignore_thread_end();
#endif
  }
};

std::string thread_name(const Fiber& f) {
  const dim3 b = g_launch ? g_launch->block : dim3();
  if (b.y == 1 && b.z == 1) return format("thread %u", f.tid);
  return format("thread (%u,%u,%u)", f.index.thread_idx.x, f.index.thread_idx.y,
                f.index.thread_idx.z);
}

std::string where() {
  std::string s = "in " + (g_launch ? func_token(g_launch->kernel, g_launch->kernel_expr)
                                    : std::string("host code"));
  if (g_launch) {
    s += format(", block (%u,%u,%u)", g_block_idx.x, g_block_idx.y, g_block_idx.z);
  }
  return s;
}

void print_regions() {
  for (const Region& r : regions()) {
    write_all(format("MINI_VLLM_EMU_REGION 0x%zx %zu ", r.begin, r.bytes) + r.name + "\n");
  }
}

void print_context() {
  std::string s = "MINI_VLLM_EMU_CONTEXT ";
  if (g_launch) {
    s += func_token(g_launch->kernel, g_launch->kernel_expr);
    s += format(" block (%u,%u,%u)", g_block_idx.x, g_block_idx.y, g_block_idx.z);
    if (g_current) s += " " + thread_name(*g_current);
  } else {
    s += "host";
  }
  s += format(" device %s", device().key);
  write_all(s + "\n");
  print_regions();
}

[[noreturn]] void fail(const std::string& message) {
  write_all("MINI_VLLM_EMU_ERROR " + message + "\n");
  print_context();
  _exit(3);
}

// "0-4", "1, 3, ..., 31", "0-3, 8, 12-15": a compact list of thread numbers.
std::string ranges(std::vector<unsigned> ids) {
  std::sort(ids.begin(), ids.end());
  std::string out;
  size_t i = 0;
  auto sep = [&] {
    if (!out.empty()) out += ", ";
  };
  while (i < ids.size()) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (j > i) {
      sep();
      out += format("%u-%u", ids[i], ids[j]);
      i = j + 1;
      continue;
    }
    // An arithmetic run with a step > 1 (every other lane, say).
    j = i;
    if (i + 2 < ids.size()) {
      const unsigned step = ids[i + 1] - ids[i];
      while (j + 1 < ids.size() && ids[j + 1] - ids[j] == step) ++j;
      if (j - i >= 3) {
        sep();
        out += format("%u, %u, ..., %u", ids[i], ids[i + 1], ids[j]);
        i = j + 1;
        continue;
      }
    }
    sep();
    out += format("%u", ids[i]);
    ++i;
  }
  return out;
}

std::string who(const std::vector<const Fiber*>& fs) {
  std::vector<unsigned> ids;
  for (const Fiber* f : fs) ids.push_back(f->tid);
  const dim3 b = g_launch->block;
  if (b.y == 1 && b.z == 1) {
    return (fs.size() == 1 ? "thread " : "threads ") + ranges(ids);
  }
  return (fs.size() == 1 ? "thread (linear) " : "threads (linear) ") + ranges(ids);
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kSyncThreads: return "__syncthreads()";
    case Op::kSyncThreadsCount: return "__syncthreads_count()";
    case Op::kSyncThreadsAnd: return "__syncthreads_and()";
    case Op::kSyncThreadsOr: return "__syncthreads_or()";
    case Op::kSyncWarp: return "__syncwarp()";
    case Op::kShflIdx: return "__shfl_sync()";
    case Op::kShflUp: return "__shfl_up_sync()";
    case Op::kShflDown: return "__shfl_down_sync()";
    case Op::kShflXor: return "__shfl_xor_sync()";
    case Op::kBallot: return "__ballot_sync()";
    case Op::kAny: return "__any_sync()";
    case Op::kAll: return "__all_sync()";
    case Op::kWmmaLoad: return "wmma::load_matrix_sync()";
    case Op::kWmmaStore: return "wmma::store_matrix_sync()";
    case Op::kWmmaMma: return "wmma::mma_sync()";
  }
  return "a collective";
}

bool same_site(const Fiber& a, const Fiber& b) {
  return a.op == b.op && a.line == b.line && strcmp(a.file, b.file) == 0;
}

// "the barrier at {{site}}" / "__shfl_xor_sync() at {{site}}" for one waiting fiber.
std::string what(const Fiber& f) {
  const std::string site = site_token(f.ret, f.file, f.line);
  if (f.state == State::kDone) return "left the kernel";
  if (f.op == Op::kSyncThreads) return "the barrier at " + site;
  return std::string(op_name(f.op)) + " at " + site;
}

void switch_to_fiber(Fiber& f);
void switch_to_scheduler(bool finished);

[[noreturn]] void fiber_main() {
#if defined(MINI_VLLM_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &g_main_stack_bottom, &g_main_stack_size);
#endif
#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_acquire(&g_tsan_launch_start);
#endif
  g_launch->run(g_launch->closure);
#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_release(&g_tsan_launch_end);
#endif
  g_current->state = State::kDone;
  switch_to_scheduler(true);
  __builtin_unreachable();
}

// Maps a fresh stack (with a guard page below it) for `f`.
void map_stack(Fiber& f) {
  const size_t total = kStackBytes + kPage;
  void* mem;
  {
    NotAnAccess quiet;
    mem = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (mem == MAP_FAILED) fail("could not map a fiber stack (out of memory?)");
  mprotect(mem, kPage, PROT_NONE);
  f.stack = static_cast<char*>(mem) + kPage;
  f.stack_bytes = kStackBytes;
}

void unmap_stack(Fiber& f) {
  if (f.stack == nullptr) return;
  NotAnAccess quiet;
  munmap(f.stack - kPage, f.stack_bytes + kPage);
  f.stack = nullptr;
}

// Prepares `f` to start at fiber_main on its own stack.
void reset_context(Fiber& f) {
#if defined(MINI_VLLM_EMU_ASM_SWITCH)
  auto top = reinterpret_cast<uintptr_t>(f.stack + f.stack_bytes) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                              // fiber_main's (absent) return address
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);        // where the switch "returns" to
  for (int i = 0; i < 6; ++i) *--sp = 0;                  // rbp rbx r12 r13 r14 r15
  uint32_t csr[2];
  asm volatile("stmxcsr %0; fnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  *--sp = (static_cast<uint64_t>(csr[1] & 0xffff) << 32) | csr[0];
  f.ctx.sp = sp;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = f.stack_bytes;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
}

void raw_switch(Context& from, Context& to) {
#if defined(MINI_VLLM_EMU_ASM_SWITCH)
  mini_vllm_emu_switch_context(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

void switch_to_fiber(Fiber& f) {
  g_current = &f;
  g_thread = &f.index;
#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_switch_to_fiber(f.tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(MINI_VLLM_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, f.stack_bytes);
#endif
  raw_switch(g_scheduler, f.ctx);
#if defined(MINI_VLLM_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  g_current = nullptr;
}

void switch_to_scheduler(bool finished) {
  Fiber& f = *g_current;
#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_switch_to_fiber(g_tsan_main, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(MINI_VLLM_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, g_main_stack_bottom,
                                 g_main_stack_size);
#endif
  (void)finished;
  raw_switch(f.ctx, g_scheduler);
#if defined(MINI_VLLM_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// ---- matching waiting threads -------------------------------------------------------------------

int warp_count() { return static_cast<int>((g_fibers.size() + 31) / 32); }

unsigned existing_lanes(int warp) {
  const size_t n = std::min<size_t>(32, g_fibers.size() - static_cast<size_t>(warp) * 32);
  return n == 32 ? 0xffffffffu : ((1u << n) - 1u);
}

Fiber& lane(int warp, int l) { return g_fibers[static_cast<size_t>(warp) * 32 + l]; }

// The lane a shuffle reads from, following PTX's shfl.sync: out-of-segment sources read the
// calling lane itself.
int shuffle_source(Op op, int l, int arg, int width) {
  const int seg_start = l & ~(width - 1);
  const int seg_last = seg_start + width - 1;
  int j = l;
  switch (op) {
    case Op::kShflIdx: j = seg_start + (arg & (width - 1)); break;
    case Op::kShflUp: j = l - arg; if (j < seg_start) j = l; break;
    case Op::kShflDown: j = l + arg; if (j > seg_last) j = l; break;
    case Op::kShflXor: j = l ^ arg; if (j > seg_last || j < seg_start) j = l; break;
    default: break;
  }
  return j;
}

[[noreturn]] void mismatch(const std::vector<const Fiber*>& waiting, const Fiber& first,
                           const std::vector<const Fiber*>& others, const std::string& tail) {
  // Group the others by where they are, so each place is named once.
  std::vector<std::vector<const Fiber*>> groups;
  for (const Fiber* o : others) {
    bool placed = false;
    for (auto& g : groups) {
      const Fiber& r = *g.front();
      if (r.state == o->state &&
          (o->state == State::kDone || same_site(r, *o))) {
        g.push_back(o);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({o});
  }
  std::string msg;
  for (size_t i = 0; i < groups.size(); ++i) {
    const Fiber& r = *groups[i].front();
    if (i > 0) msg += (i + 1 == groups.size()) ? " and " : ", ";
    if (r.state == State::kDone) {
      msg += who(groups[i]) + " left the kernel";
    } else {
      msg += who(groups[i]) + (groups[i].size() == 1 ? " waits" : " wait") + " at " + what(r);
    }
  }
  msg += " while " + who(waiting) + (waiting.size() == 1 ? " waits" : " wait") + " at " +
         what(first) + tail + " (" + where() + ")";
  fail(msg);
}

// Completes every warp collective whose lanes have all arrived; reports a mismatch.
bool resolve_warps() {
  bool progressed = false;
  for (int w = 0; w < warp_count(); ++w) {
    const unsigned exists = existing_lanes(w);
    for (int l = 0; l < 32; ++l) {
      if (!(exists >> l & 1u)) break;
      Fiber& f = lane(w, l);
      if (f.state != State::kWarp) continue;
      if (!(f.mask >> l & 1u)) {
        fail(format("%s calls ", thread_name(f).c_str()) + what(f) +
             format(" with mask 0x%08x, which leaves out its own lane %d (", f.mask, l) + where() +
             ")");
      }
      const unsigned group = f.mask & exists;
      std::vector<const Fiber*> waiting, elsewhere;
      bool ready = true;
      for (int j = 0; j < 32; ++j) {
        if (!(group >> j & 1u)) continue;
        Fiber& o = lane(w, j);
        if (o.state == State::kRunnable) {
          ready = false;
        } else if (o.state == State::kWarp && same_site(o, f)) {
          if (o.mask != f.mask) {
            fail(format("the lanes of warp %d disagree on the mask of ", w) + what(f) +
                 format(": %s passes 0x%08x, %s passes 0x%08x (", thread_name(f).c_str(), f.mask,
                        thread_name(o).c_str(), o.mask) +
                 where() + ")");
          }
          waiting.push_back(&o);
        } else {
          elsewhere.push_back(&o);
        }
      }
      if (!elsewhere.empty()) {
        mismatch(waiting, f, elsewhere,
                 format(" with mask 0x%08x", f.mask) +
                     (elsewhere.front()->state == State::kDone
                          ? ""
                          : ": the lanes of a warp collective must reach the same call"));
      }
      if (!ready) continue;
      // Everyone is here: compute each lane's result.
      unsigned vote = 0;
      for (const Fiber* o : waiting) {
        if (o->bits != 0) vote |= 1u << (o->tid % 32);
      }
      for (const Fiber* o : waiting) {
        Fiber& me = lane(w, static_cast<int>(o->tid % 32));
        switch (f.op) {
          case Op::kShflIdx:
          case Op::kShflUp:
          case Op::kShflDown:
          case Op::kShflXor: {
            if (me.width < 1 || me.width > 32 || (me.width & (me.width - 1))) {
              fail(format("%s passes width %d to ", thread_name(me).c_str(), me.width) +
                   what(me) + ": it must be a power of two from 1 to 32 (" + where() + ")");
            }
            const int src = shuffle_source(f.op, static_cast<int>(me.tid % 32), me.arg, me.width);
            if (!(group >> src & 1u)) {
              fail(format("%s reads lane %d through ", thread_name(me).c_str(), src) + what(me) +
                   format(", but lane %d is not in the mask 0x%08x (", src, f.mask) + where() +
                   ")");
            }
            me.result = lane(w, src).bits;
            break;
          }
          case Op::kBallot: me.result = vote; break;
          case Op::kAny: me.result = vote != 0; break;
          case Op::kAll: me.result = vote == (group); break;
          default: me.result = 0; break;
        }
        g_lane_bits[w][o->tid % 32] = o->bits;  // what every lane passed, for warp_lane_bits
      }
#if defined(MINI_VLLM_EMU_TSAN)
      // Lanes leave after every lane arrived: each acquires what all of them released.
      for (const Fiber* o : waiting) {
        Fiber& me = lane(w, static_cast<int>(o->tid % 32));
        __tsan_switch_to_fiber(me.tsan_fiber, __tsan_switch_to_fiber_no_sync);
        __tsan_acquire(&g_block.sync[1 + w]);
      }
      __tsan_switch_to_fiber(g_tsan_main, __tsan_switch_to_fiber_no_sync);
#endif
      for (const Fiber* o : waiting) lane(w, static_cast<int>(o->tid % 32)).state = State::kRunnable;
      progressed = true;
    }
  }
  return progressed;
}

// Completes a barrier that every thread of the block waits at; reports a mismatch.
void resolve_barrier() {
  const Fiber* first = nullptr;
  for (const Fiber& f : g_fibers) {
    if (f.state == State::kBarrier) {
      first = &f;
      break;
    }
  }
  if (first == nullptr) {
    // Nobody waits at a barrier and nothing can run: threads wait at warp collectives that can
    // never complete (resolve_warps normally reports this first, with more detail).
    std::vector<const Fiber*> stuck;
    for (const Fiber& f : g_fibers) {
      if (f.state == State::kWarp) stuck.push_back(&f);
    }
    if (stuck.empty()) return;
    fail(who(stuck) + " wait at " + what(*stuck.front()) + " forever (" + where() + ")");
  }
  std::vector<const Fiber*> at_barrier, other;
  for (const Fiber& f : g_fibers) {
    (f.state == State::kBarrier && same_site(f, *first) ? at_barrier : other).push_back(&f);
  }
  if (!other.empty()) {
    mismatch(at_barrier, *first, other,
             other.front()->state == State::kDone
                 ? ""
                 : ": every thread of a block must reach the same __syncthreads()");
  }
  int count = 0;
  for (const Fiber* f : at_barrier) count += f->bits != 0;
  const int n = static_cast<int>(at_barrier.size());
  int result = 0;
  switch (first->op) {
    case Op::kSyncThreadsCount: result = count; break;
    case Op::kSyncThreadsAnd: result = count == n; break;
    case Op::kSyncThreadsOr: result = count != 0; break;
    default: break;
  }
#if defined(MINI_VLLM_EMU_TSAN)
  for (Fiber& f : g_fibers) {
    __tsan_switch_to_fiber(f.tsan_fiber, __tsan_switch_to_fiber_no_sync);
    __tsan_acquire(&g_block.sync[0]);
  }
  __tsan_switch_to_fiber(g_tsan_main, __tsan_switch_to_fiber_no_sync);
#endif
  for (Fiber& f : g_fibers) {
    f.result = static_cast<uint64_t>(result);
    f.state = State::kRunnable;
  }
}

// Called on the fiber: record the rendezvous and give control back until it completes.
uint64_t arrive(State state, Op op, unsigned mask, uint64_t bits, int bytes, int arg, int width,
                const char* file, int line, const void* ret) {
  if (g_current == nullptr) {
    fail(std::string(op_name(op)) + " called outside a kernel, at " + file + ":" +
         std::to_string(line));
  }
  Fiber& f = *g_current;
  f.state = state;
  f.op = op;
  f.mask = mask;
  f.bits = bits;
  f.bytes = bytes;
  f.arg = arg;
  f.width = width;
  f.file = file;
  f.line = line;
  f.ret = ret;
#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_release(&g_block.sync[state == State::kBarrier ? 0 : 1 + f.tid / 32]);
#endif
  switch_to_scheduler(false);
  return f.result;
}

// ---- shared memory ------------------------------------------------------------------------------

// The byte that fills a block's fresh shared memory, by $MINI_VLLM_EMU_SHARED_FILL. "nan" (the
// default, 0xff): NaN in every floating-point type, so a sum or a product over entries nobody
// wrote shows in the result. "huge" (0x7f): 3.4e38 in fp32 and bf16 (NaN in fp16), so a max over
// such entries shows too, which "nan" hides: fmaxf returns its other argument when one is NaN.
unsigned char shared_fill_byte() {
  static const unsigned char byte = [] {
    const char* want = getenv("MINI_VLLM_EMU_SHARED_FILL");
    if (want == nullptr || *want == '\0' || strcasecmp(want, "nan") == 0) return 0xff;
    if (strcasecmp(want, "huge") == 0) return 0x7f;
    fprintf(stderr, "MINI_VLLM_EMU_SHARED_FILL=%s is not a fill pattern (nan, huge)\n", want);
    _exit(2);
  }();
  return byte;
}

// Shared memory lives between inaccessible pages (and, under AddressSanitizer, poisoned bytes),
// so that an index past a shared array faults at once instead of corrupting the heap.
Guarded fresh_shared(size_t bytes, size_t align, const std::string& name) {
  if (align > 128) fail("shared memory aligned to more than 128 bytes is not emulated: " + name);
  // The data ends at the guard page when it can; a stricter alignment moves it down a little.
  const size_t step = std::max<size_t>(align, 16);
  const size_t padded = (std::max<size_t>(bytes, 1) + step - 1) / step * step;
  const size_t span = (padded + kPage - 1) / kPage * kPage;
  Guarded g;
  {
    NotAnAccess quiet;
    g.total = span + 2 * kPage;
    void* mem = mmap(nullptr, g.total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (mem == MAP_FAILED) fail("out of memory for shared memory");
    g.reserve = static_cast<char*>(mem);
    mprotect(g.reserve + kPage, span, PROT_READ | PROT_WRITE);
    g.data = g.reserve + kPage + span - padded;
    memset(g.data, shared_fill_byte(), bytes);
  }
#if defined(MINI_VLLM_EMU_ASAN)
  __asan_poison_memory_region(g.reserve, g.total);
  __asan_unpoison_memory_region(g.data, bytes);
#endif
  regions().push_back({name, reinterpret_cast<uintptr_t>(g.data), bytes});
  return g;
}

void release(Guarded& g) {
  if (g.reserve == nullptr) return;
#if defined(MINI_VLLM_EMU_ASAN)
  __asan_unpoison_memory_region(g.reserve, g.total);  // the addresses may be mapped again
#endif
  NotAnAccess quiet;
  munmap(g.reserve, g.total);
  g = Guarded{};
}

const char* basename(const char* path) {
  const char* slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

void check_smem_budget(const char* name, const char* file, int line) {
  const size_t total = g_block.static_bytes + g_launch->dynamic_smem;
  if (g_block.static_bytes > static_cast<size_t>(kDefaultSmem)) {
    fail(format("the kernel declares %zu bytes of static shared memory (the last, ",
                g_block.static_bytes) +
         name + " at " + basename(file) + ":" + std::to_string(line) +
         format(", takes it past %d): nvcc refuses more than 48 KB of static __shared__ data; "
                "use dynamic shared memory (",
                kDefaultSmem) +
         where() + ")");
  }
  if (total > static_cast<size_t>(g_launch->smem_limit)) {
    fail(format("the block needs %zu bytes of shared memory (%zu static, up to ",
                total, g_block.static_bytes) +
         name + " at " + basename(file) + ":" + std::to_string(line) +
         format(", plus %zu dynamic), more than the %d bytes it may use on %s; a GPU refuses "
                "this launch ('invalid argument'), and the launcher must check it first (",
                g_launch->dynamic_smem, g_launch->smem_limit, device().name) +
         where() + ")");
  }
}

void free_block_memory() {
  for (SharedAlloc& a : g_block.shared) release(a.mem);
  g_block.shared.clear();
  release(g_block.dynamic);
  g_block.static_bytes = 0;
  auto& r = regions();
  r.erase(std::remove_if(r.begin(), r.end(),
                         [](const Region& x) { return x.name.rfind("shared ", 0) == 0; }),
          r.end());
}

// ---- crash reports ------------------------------------------------------------------------------

void on_fatal_signal(int sig, siginfo_t* info, void* uctx) {
  uintptr_t pc = 0;
  int write = -1;  // unknown
#if defined(__x86_64__) && defined(__linux__)
  const auto* mc = &static_cast<ucontext_t*>(uctx)->uc_mcontext;
  pc = static_cast<uintptr_t>(mc->gregs[REG_RIP]);
  if (sig == SIGSEGV) write = (mc->gregs[REG_ERR] & 2) ? 1 : 0;  // page-fault error code
#else
  (void)uctx;
#endif
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  std::string s = format("MINI_VLLM_EMU_SIGNAL %d addr=0x%zx pc=0x%zx write=%d", sig, addr,
                         pc ? pc - image_base() : 0, write);
  if (g_current && addr >= reinterpret_cast<uintptr_t>(g_current->stack) - kPage &&
      addr < reinterpret_cast<uintptr_t>(g_current->stack)) {
    s += format(" stack-overflow=%zu", g_current->stack_bytes);
  }
  write_all(s + "\n");
  print_context();
  _exit(4);
}

#if defined(MINI_VLLM_EMU_ASAN) || defined(MINI_VLLM_EMU_TSAN)
void on_sanitizer_death() {
#if defined(MINI_VLLM_EMU_ASAN)
  if (__asan_report_present()) {
    write_all(format("MINI_VLLM_EMU_ASAN addr=0x%zx write=%d size=%zu kind=",
                     reinterpret_cast<uintptr_t>(__asan_get_report_address()),
                     __asan_get_report_access_type(), __asan_get_report_access_size()) +
              __asan_get_report_description() + "\n");
  }
#endif
  print_context();
}
#endif

}  // namespace

// ---- the interface of runtime.h -----------------------------------------------------------------

void initialize() {
  static bool done = false;
  if (done) return;
  done = true;
  setvbuf(stderr, nullptr, _IONBF, 0);
#if defined(MINI_VLLM_EMU_ASAN) || defined(MINI_VLLM_EMU_TSAN)
  __sanitizer_set_death_callback(&on_sanitizer_death);
  // GCC links UBSan as a library of its own, with its own copy of that callback.
  if (void* ubsan = dlopen("libubsan.so.1", RTLD_NOW | RTLD_NOLOAD)) {
    using SetCallback = void (*)(void (*)());
    if (auto set = reinterpret_cast<SetCallback>(dlsym(ubsan, "__sanitizer_set_death_callback"))) {
      set(&on_sanitizer_death);
    }
  }
#endif
#if defined(MINI_VLLM_EMU_TSAN)
  g_tsan_main = __tsan_get_current_fiber();
#endif
#if !defined(MINI_VLLM_EMU_ASAN)
  // Crashes of the program under test: say which kernel, block and thread, then exit. (ASan
  // reports them itself and then calls the death callback.)
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = &on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(sig, &sa, nullptr);
#endif
}

void register_region(const std::string& name, const void* begin, size_t bytes) {
  regions().push_back({name, reinterpret_cast<uintptr_t>(begin), bytes});
}

const char* device_key() { return device().key; }

[[noreturn]] void fatal(const std::string& message) { fail(message); }

int block_barrier(Op op, int predicate, const char* file, int line) {
  const void* ret = __builtin_return_address(0);
  return static_cast<int>(arrive(State::kBarrier, op, 0, predicate != 0, 0, 0, 0, file, line, ret));
}

const uint64_t* warp_lane_bits() {
  if (g_current == nullptr) fail("a warp collective's values were read outside a kernel");
  return g_lane_bits[g_current->tid / 32];
}

[[noreturn]] void usage_error(const std::string& message) {
  fail(message + " (" + where() + ")");
}

uint64_t warp_collective(Op op, unsigned mask, uint64_t bits, int bytes, int arg, int width,
                         const char* file, int line) {
  const void* ret = __builtin_return_address(0);
  return arrive(State::kWarp, op, mask, bits, bytes, arg, width, file, line, ret);
}

void* shared_array(const void* key, size_t bytes, size_t align, const char* name, const char* file,
                   int line) {
  if (g_launch == nullptr) fail(std::string("shared memory used outside a kernel: ") + name);
  NotAnAccess quiet;  // the bookkeeping below is the emulator's, not the kernel's
  for (const SharedAlloc& a : g_block.shared) {
    if (a.key == key) return a.mem.data;
  }
  const Guarded mem = fresh_shared(bytes, align, std::string("shared ") + name);
  void* p = mem.data;
  g_block.shared.push_back({key, mem});
  g_block.static_bytes += bytes;
  KernelInfo& info = kernels()[g_launch->kernel];
  info.static_smem_seen = std::max(info.static_smem_seen, g_block.static_bytes);
  check_smem_budget(name, file, line);
  return p;
}

void* dynamic_shared(size_t align, const char* name, const char* file, int line) {
  if (g_launch == nullptr) fail(std::string("shared memory used outside a kernel: ") + name);
  NotAnAccess quiet;
  if (g_block.dynamic.data == nullptr) {
    // nvcc may read the last elements of a shared array with one 16-byte load (LDS.128), which
    // runs past an end that is not on a 16-byte boundary: compute-sanitizer reported exactly
    // that for the partition merge on an H200. The emulation runs the source, not the SASS, so
    // it asks for the size that makes such a load safe.
    if (g_launch->dynamic_smem % 16 != 0) {
      fail(format("the launch gives %zu bytes of dynamic shared memory (", g_launch->dynamic_smem) +
           name + " at " + basename(file) + ":" + std::to_string(line) +
           "), not a whole number of 16-byte groups: nvcc may read the end of a shared array "
           "with one 16-byte load, past such a size; round the launch's size up, e.g. "
           "float_smem_bytes(n) from common.cuh (" + where() + ")");
    }
    g_block.dynamic = fresh_shared(g_launch->dynamic_smem, align, std::string("shared ") + name);
    check_smem_budget(name, file, line);
  }
  return g_block.dynamic.data;
}

cudaError_t func_get_attributes(cudaFuncAttributes* attr, const void* kernel) {
  if (attr == nullptr || kernel == nullptr) return g_last_error = cudaErrorInvalidValue;
  const KernelInfo& info = kernels()[kernel];
  *attr = cudaFuncAttributes{};
  attr->sharedSizeBytes = info.static_smem_seen;
  attr->maxThreadsPerBlock = 1024;
  attr->maxDynamicSharedSizeBytes =
      info.max_dynamic_smem >= 0 ? info.max_dynamic_smem
                                 : kDefaultSmem - static_cast<int>(info.static_smem_seen);
  return cudaSuccess;
}

cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (kernel == nullptr) return g_last_error = cudaErrorInvalidDeviceFunction;
  KernelInfo& info = kernels()[kernel];
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 ||
        static_cast<size_t>(value) + info.static_smem_seen > static_cast<size_t>(device().smem_optin)) {
      return g_last_error = cudaErrorInvalidValue;
    }
    info.max_dynamic_smem = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  return g_last_error = cudaErrorInvalidValue;
}

cudaError_t launch(const void* kernel, const char* kernel_expr, dim3 grid, dim3 block,
                   size_t dynamic_smem, void (*run)(void*), void* closure, const char* file,
                   int line) {
  initialize();
  if (g_launch != nullptr) {
    fail(std::string("a kernel launched another kernel (dynamic parallelism is not emulated), at ") +
         file + ":" + std::to_string(line));
  }
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 ||
      block.x > 1024 || block.y > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535 ||
      grid.x > 2147483647u) {
    return g_last_error = cudaErrorInvalidConfiguration;
  }
  const KernelInfo& info = kernels()[kernel];
  const int max_dynamic = info.max_dynamic_smem >= 0
                              ? info.max_dynamic_smem
                              : kDefaultSmem - static_cast<int>(info.static_smem_seen);
  if (dynamic_smem > static_cast<size_t>(std::max(max_dynamic, 0))) {
    return g_last_error = cudaErrorInvalidValue;  // what a GPU says: "invalid argument"
  }

  Launch l{kernel, kernel_expr, file, line, grid, block, dynamic_smem,
           info.max_dynamic_smem >= 0 ? device().smem_optin : kDefaultSmem, run, closure};
  g_launch = &l;
  g_block_dim = block;
  g_grid_dim = grid;
  g_fibers.assign(threads, Fiber{});
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = g_fibers[t];
    f.tid = t;
    f.index.thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
#if !defined(MINI_VLLM_EMU_TSAN)
    map_stack(f);  // reused by every block
#endif
  }
#if defined(MINI_VLLM_EMU_TSAN)
  const int pools = grid.x * grid.y * grid.z > 1 ? 2 : 1;
  for (int k = 0; k < pools; ++k) {
    while (g_tsan_pool[k].size() < threads) {
      Fiber scratch;
      map_stack(scratch);
      g_tsan_pool[k].push_back({__tsan_create_fiber(0), scratch.stack, scratch.stack_bytes});
    }
  }
  unsigned long long block_number = 0;
#endif
#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_release(&g_tsan_launch_start);  // the host's writes so far happen before the kernel
  std::vector<char*> sync_objects;
#endif

  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        g_block_idx = {bx, by, bz};
#if defined(MINI_VLLM_EMU_TSAN)
        {
          NotAnAccess quiet;
          g_block.sync = static_cast<char*>(malloc(1 + 32));
        }
        sync_objects.push_back(g_block.sync);
#endif
#if defined(MINI_VLLM_EMU_TSAN)
        const auto& pool = g_tsan_pool[block_number++ % 2];
#endif
        for (Fiber& f : g_fibers) {
#if defined(MINI_VLLM_EMU_TSAN)
          f.tsan_fiber = pool[f.tid].tsan_fiber;
          f.stack = pool[f.tid].stack;
          f.stack_bytes = pool[f.tid].stack_bytes;
          __tsan_set_fiber_name(
              f.tsan_fiber, (thread_name(f) + format(" of block (%u,%u,%u)", bx, by, bz)).c_str());
#endif
          f.state = State::kRunnable;
          reset_context(f);
        }
        // Sweep, match, repeat until every thread has left the kernel.
        while (true) {
          for (Fiber& f : g_fibers) {
            if (f.state == State::kRunnable) switch_to_fiber(f);
          }
          bool all_done = true;
          for (const Fiber& f : g_fibers) all_done = all_done && f.state == State::kDone;
          if (all_done) break;
          if (!resolve_warps()) resolve_barrier();
        }
        free_block_memory();
      }
    }
  }

#if defined(MINI_VLLM_EMU_TSAN)
  __tsan_acquire(&g_tsan_launch_end);  // the kernel's writes happen before what the host does next
  {
    NotAnAccess quiet;
    for (char* s : sync_objects) free(s);
  }
  g_block.sync = nullptr;
#endif
#if !defined(MINI_VLLM_EMU_TSAN)
  for (Fiber& f : g_fibers) unmap_stack(f);
#endif
  g_fibers.clear();
  g_launch = nullptr;
  return cudaSuccess;
}

}  // namespace mini_vllm_emu

// ---- host runtime API ---------------------------------------------------------------------------

using mini_vllm_emu::g_last_error;

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorNotSupported: return "operation not supported";
  }
  return "unknown error";
}

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
  }
  return "cudaErrorUnknown";
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = g_last_error;
  g_last_error = cudaSuccess;
  return err;
}
cudaError_t cudaPeekAtLastError() { return g_last_error; }
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return g_last_error = cudaErrorInvalidValue;
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : (g_last_error = cudaErrorInvalidValue);
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr || device != 0) return g_last_error = cudaErrorInvalidValue;
  const auto& d = mini_vllm_emu::device();
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = mini_vllm_emu::kDefaultSmem; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = d.num_sms; break;
    case cudaDevAttrComputeCapabilityMajor: *value = d.cc_major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = d.cc_minor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = d.smem_per_sm; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = d.smem_optin; break;
    default: return g_last_error = cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes != 0 && (dst == nullptr || src == nullptr)) return g_last_error = cudaErrorInvalidValue;
  memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (bytes != 0 && dst == nullptr) return g_last_error = cudaErrorInvalidValue;
  memset(dst, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  return cudaMemset(dst, value, bytes);
}
