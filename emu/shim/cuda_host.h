// The CUDA built-ins kernels/copy.cu uses, for running it on the host (emu/src/kernel.rs).
//
// A block's threads run one after another on one host thread, so only what is valid under that
// schedule is defined: no __syncthreads, no __shared__, no atomics, no warp intrinsics (the
// funnel shift is a plain per-thread instruction). A kernel
// that starts using any of them fails to compile here, which is the point: the emulator's serial
// execution would no longer be a faithful one.
#ifndef NCCL_RESHARD_EMU_CUDA_HOST_H_
#define NCCL_RESHARD_EMU_CUDA_HOST_H_

#include <csetjmp>
#include <cstddef>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
// Launch bounds are read from the module image (EIATTR_MAX_THREADS / .maxntid), as the driver does.
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

struct uint3 {
  unsigned int x, y, z;
};

typedef uint3 dim3;

// Set by the launcher before each thread of each block runs.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// The emulator's memory check: returns the host address of `bytes` bytes at device address
// `addr` (read: write == 0), or NULL when the access is illegal and the emulator is set to
// report errors instead of aborting. `align` is the access's natural alignment (a GPU faults
// with "misaligned address" on an access that is not aligned to it).
typedef void* (*ncclReshardEmuAccessFn)(unsigned long long addr, size_t bytes, size_t align,
                                        int write);

inline thread_local ncclReshardEmuAccessFn ncclReshardEmuAccess = nullptr;
// Where an illegal access in NCCL_RESHARD_EMU_ON_ERROR=return mode unwinds to: the kernel's
// frames hold only trivially destructible values, so leaving them with longjmp is well defined.
inline thread_local jmp_buf ncclReshardEmuFault;

template <typename T>
inline T* ncclReshardEmuTranslate(T* p, int write) {
  void* host = ncclReshardEmuAccess(reinterpret_cast<unsigned long long>(p), sizeof(T),
                                    alignof(T), write);
  if (host == nullptr) longjmp(ncclReshardEmuFault, 1);
  return static_cast<T*>(host);
}

// CUDA's funnel shift: the low 32 bits of hi:lo shifted right by `shift` mod 32 (SHF.R.WRAP).
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int shift) {
  return (unsigned int)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}

#define NCCL_RESHARD_READ(p) ncclReshardEmuTranslate((p), 0)
#define NCCL_RESHARD_WRITE(p) ncclReshardEmuTranslate((p), 1)

#endif  // NCCL_RESHARD_EMU_CUDA_HOST_H_
