// kernels/copy.cu compiled for the host, and a launcher that runs one of its kernels block by
// block, thread by thread. The launcher unpacks cuLaunchKernel's `kernelParams` from the
// kernels' own parameter types, so their signature is written only in copy.cu.
#include "cuda_host.h"

#include "../../kernels/copy.cu"

#include <type_traits>
#include <utility>

namespace {

typedef decltype(&ncclReshardCopyKernel) KernelPtr;
// One parameter layout serves both kernels.
static_assert(std::is_same<KernelPtr, decltype(&ncclReshardConvertKernel)>::value,
              "the copy and conversion kernels take the same parameters");

template <typename... Args>
constexpr size_t paramCount(void (*)(Args...)) {
  return sizeof...(Args);
}

template <typename... Args>
void paramLayout(void (*)(Args...), size_t* sizes, size_t* aligns) {
  const size_t s[] = {sizeof(Args)...};
  const size_t a[] = {alignof(Args)...};
  for (size_t i = 0; i < sizeof...(Args); ++i) {
    sizes[i] = s[i];
    aligns[i] = a[i];
  }
}

template <typename... Args, size_t... I>
void invoke(void (*kernel)(Args...), const void* const* params, std::index_sequence<I...>) {
  kernel(*static_cast<const Args*>(params[I])...);
}

template <typename... Args>
void invoke(void (*kernel)(Args...), const void* const* params) {
  invoke(kernel, params, std::index_sequence_for<Args...>{});
}

}  // namespace

// The number of parameters of the kernels; fills sizes[i] and aligns[i] for the first
// `max` of them.
extern "C" size_t ncclReshardEmuCopyKernelParams(size_t* sizes, size_t* aligns, size_t max) {
  constexpr size_t n = paramCount(&ncclReshardCopyKernel);
  if (max >= n) paramLayout(&ncclReshardCopyKernel, sizes, aligns);
  return n;
}

// The block and thread the calling host thread is running (for fault reports): blockIdx x, y,
// z, then threadIdx x, y, z.
extern "C" void ncclReshardEmuCopyKernelPosition(unsigned* out) {
  out[0] = blockIdx.x;
  out[1] = blockIdx.y;
  out[2] = blockIdx.z;
  out[3] = threadIdx.x;
  out[4] = threadIdx.y;
  out[5] = threadIdx.z;
}

// Runs kernel `which` (0: ncclReshardCopyKernel, 1: ncclReshardConvertKernel): every block of
// the grid and every thread of each block, in order. `params[i]` points at the value of
// parameter i. `block_done` is called after each block (progress for the watchdog). Returns 0,
// or 1 when `access` refused an access (the kernel stopped there).
extern "C" int ncclReshardEmuCopyKernelRun(int which, const void* const* params, const unsigned* grid,
                                           const unsigned* block, ncclReshardEmuAccessFn access,
                                           void (*block_done)(void)) {
  const KernelPtr kernel = which == 0 ? &ncclReshardCopyKernel : &ncclReshardConvertKernel;
  ncclReshardEmuAccess = access;
  gridDim = dim3{grid[0], grid[1], grid[2]};
  blockDim = dim3{block[0], block[1], block[2]};
  if (setjmp(ncclReshardEmuFault) != 0) return 1;
  for (unsigned bz = 0; bz < grid[2]; ++bz)
    for (unsigned by = 0; by < grid[1]; ++by)
      for (unsigned bx = 0; bx < grid[0]; ++bx) {
        blockIdx = uint3{bx, by, bz};
        for (unsigned tz = 0; tz < block[2]; ++tz)
          for (unsigned ty = 0; ty < block[1]; ++ty)
            for (unsigned tx = 0; tx < block[0]; ++tx) {
              threadIdx = uint3{tx, ty, tz};
              invoke(kernel, params);
            }
        block_done();
      }
  return 0;
}
