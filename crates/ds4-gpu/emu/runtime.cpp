// The CPU emulation's runtime (crates/ds4-gpu/src/emu.rs): runs one kernel launch block by
// block; each GPU thread of a block is a fiber (ucontext) on the calling thread, switched at
// every barrier (started with makecontext, then switched with _setjmp/_longjmp, which skip
// swapcontext's signal-mask system calls), so __syncthreads and warp exchanges behave as on a
// GPU: a barrier waits for
// every thread of the block (or warp) that has not returned. A barrier some threads can
// never reach (divergent __syncthreads, a warp half at another barrier) is reported as a
// deadlock instead of hanging. Launches are serialised process-wide (one block's __shared__
// statics at a time).
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <mutex>
#include <string>
#include <vector>

#include "ds4_port.h"

ds4emu_dim3 blockIdx, blockDim, gridDim;

namespace {

enum State { RUN, AT_BLOCK, AT_WARP, DONE };

struct Fiber {
    ucontext_t ctx;  // for the first entry only
    jmp_buf jb;      // where the fiber resumes
    bool started;
    ds4emu_fiber_id id;
    State state;
};

const int kMaxThreads = 1024;
const size_t kStack = 256 * 1024;
const int kSlotFloats = 8;  // per lane, for shuffles and the emulated mma

struct Runner {
    std::vector<Fiber> fibers = std::vector<Fiber>(kMaxThreads);
    std::vector<char*> stacks;
    ucontext_t main;
    jmp_buf main_jb;
    int cur = 0;
    int n = 0;
    float slots[kMaxThreads / 32][32 * kSlotFloats];
    int (*thunk)(void**, int) = nullptr;
    void** params = nullptr;
    int n_params = 0;

    Runner() {
        for (int i = 0; i < kMaxThreads; i++) {
            void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            stacks.push_back(p == MAP_FAILED ? nullptr : (char*)p);
        }
    }
};

Runner* R = nullptr;
std::mutex M;

void fiber_main(int i) {
    R->thunk(R->params, R->n_params);
    R->fibers[i].state = DONE;
    _longjmp(R->main_jb, 1);
}

void yield(State s) {
    Fiber& f = R->fibers[R->cur];
    f.state = s;
    if (!_setjmp(f.jb)) _longjmp(R->main_jb, 1);
}

void resume(int i) {
    Fiber& f = R->fibers[i];
    R->cur = i;
    if (_setjmp(R->main_jb)) return;  // the fiber yielded or finished
    if (f.started) _longjmp(f.jb, 1);
    f.started = true;
    swapcontext(&R->main, &f.ctx);
}

// Runs the current block to completion; false on a deadlock.
bool run_block(std::string& err) {
    const int n = R->n;
    for (int i = 0; i < n; i++) {
        Fiber& f = R->fibers[i];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = R->stacks[i];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;  // fibers leave by _longjmp
        makecontext(&f.ctx, (void (*)())fiber_main, 1, i);
        f.id.tid = {(unsigned)(i % blockDim.x), (unsigned)((i / blockDim.x) % blockDim.y),
                    (unsigned)(i / (blockDim.x * blockDim.y))};
        f.id.lane = i % 32;
        f.id.warp = i / 32;
        f.state = RUN;
        f.started = false;
    }
    for (;;) {
        for (int i = 0; i < n; i++) {
            if (R->fibers[i].state == RUN) resume(i);
        }
        int alive = 0, at_block = 0;
        for (int i = 0; i < n; i++) {
            alive += R->fibers[i].state != DONE;
            at_block += R->fibers[i].state == AT_BLOCK;
        }
        if (alive == 0) return true;
        bool moved = false;
        if (at_block == alive) {
            for (int i = 0; i < n; i++)
                if (R->fibers[i].state == AT_BLOCK) R->fibers[i].state = RUN;
            moved = true;
        }
        for (int w = 0; w * 32 < n; w++) {
            int live = 0, waiting = 0;
            for (int i = w * 32; i < n && i < w * 32 + 32; i++) {
                live += R->fibers[i].state != DONE;
                waiting += R->fibers[i].state == AT_WARP;
            }
            if (live > 0 && waiting == live) {
                for (int i = w * 32; i < n && i < w * 32 + 32; i++)
                    if (R->fibers[i].state == AT_WARP) R->fibers[i].state = RUN;
                moved = true;
            }
        }
        if (!moved) {
            err = "deadlock: threads wait at barriers the others never reach (block " +
                  std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                  std::to_string(blockIdx.z) + ")";
            return false;
        }
    }
}

}  // namespace

extern "C" const ds4emu_fiber_id* ds4emu_self() { return &R->fibers[R->cur].id; }
extern "C" void ds4emu_block_barrier() { yield(AT_BLOCK); }
extern "C" void ds4emu_warp_barrier() { yield(AT_WARP); }
extern "C" float* ds4emu_warp_slots(int n) {
    (void)n;
    return R->slots[R->fibers[R->cur].id.warp];
}

// Runs `thunk` (a kernel with its parameters unpacked) over the grid. Returns 0, or writes
// a message into err (err_len bytes) and returns non-zero.
extern "C" int ds4emu_run(int (*thunk)(void**, int), void** params, int n_params, unsigned gx, unsigned gy,
                          unsigned gz, unsigned bx, char* err, int err_len) {
    std::lock_guard<std::mutex> lock(M);
    auto fail = [&](const std::string& m) {
        snprintf(err, (size_t)err_len, "%s", m.c_str());
        return 1;
    };
    if (!R) R = new Runner();
    if (bx == 0 || bx > (unsigned)kMaxThreads) return fail("block of " + std::to_string(bx) + " threads");
    for (int i = 0; i < (int)bx; i++)
        if (!R->stacks[i]) return fail("no memory for fiber stacks");
    if (thunk(params, -n_params) != 0) return fail("parameter count");
    R->thunk = thunk;
    R->params = params;
    R->n_params = n_params;
    R->n = (int)bx;
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx = {x, y, z};
                std::string e;
                if (!run_block(e)) return fail(e);
            }
    return 0;
}
