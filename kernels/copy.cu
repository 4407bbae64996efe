// Block copies for libncclreshard: local copies (source view -> destination view), packs
// (source view -> staging) and unpacks (staging -> destination view), all driven by the same
// `Copy` descriptors the host executor runs (src/plan/program.rs), encoded by
// src/exec/cuda/descriptors.rs.
//
// Self-contained on purpose: compiled by NVRTC at first use with only
// `--gpu-architecture=sm_XX -std=c++17`, no system, libc++ or CUDA toolkit headers. The CPU
// emulator (emu/) compiles this same file for the host, so it uses only plain C++ and the CUDA
// built-ins threadIdx, blockIdx and blockDim, and no shared memory or barriers: the emulator runs
// a block's threads one after another.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define NCCL_RESHARD_MAX_COPY_DIMS 8
#define NCCL_RESHARD_MAX_BASES 384
#define NCCL_RESHARD_THREADS 256
// Units (loads) each thread keeps in flight: enough independent 16-byte loads to cover HBM
// latency with 256 threads per block.
#define NCCL_RESHARD_UNROLL 4

// Every global-memory access goes through these two, so that the emulator can check each one
// against its device allocations (it defines them before including this file); on a GPU they
// are the pointer itself.
#ifndef NCCL_RESHARD_READ
#define NCCL_RESHARD_READ(p) (p)
#define NCCL_RESHARD_WRITE(p) (p)
#endif

// One strided block copy: `chunk_bytes` contiguous bytes at every point of the `ndims`-dim
// grid (outermost first), from bases[src_base] + src_offset to bases[dst_base] + dst_offset.
struct CopyDesc {
  u64 src_offset;
  u64 dst_offset;
  u64 chunk_bytes;
  u32 src_base;
  u32 dst_base;
  u32 ndims;
  u32 reserved;
  u64 count[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 src_stride[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 dst_stride[NCCL_RESHARD_MAX_COPY_DIMS];
};

// A slice of one descriptor's bytes, in its linear order (chunk by chunk). A tile either lies
// inside one chunk or covers whole chunks; one thread block copies one tile.
struct Tile {
  u64 start;
  u64 bytes;
  u32 desc;
  u32 reserved;
};

// Base pointers of one launch, passed by value so a call only changes kernel arguments.
struct Bases {
  u64 ptr[NCCL_RESHARD_MAX_BASES];
};

// Byte offsets (source, destination) of chunk number `chunk` of a descriptor, and the chunk's
// coordinate along the innermost dim. 64-bit divisions, one per dim: done once per chunk
// group, not per unit.
__device__ __forceinline__ void chunk_offsets(const CopyDesc& d, u64 chunk, u64* src, u64* dst,
                                              u64* inner) {
  u64 s = d.src_offset;
  u64 t = d.dst_offset;
  *inner = 0;
  for (int k = (int)d.ndims - 1; k >= 0; --k) {
    const u64 n = d.count[k];
    const u64 i = chunk % n;
    chunk /= n;
    s += i * d.src_stride[k];
    t += i * d.dst_stride[k];
    if (k == (int)d.ndims - 1) *inner = i;
  }
  *src = s;
  *dst = t;
}

// A tile inside one chunk: one contiguous run on both sides, NCCL_RESHARD_UNROLL loads in
// flight per thread.
template <typename T>
__device__ __forceinline__ void copy_run(const char* src, char* dst, u64 bytes) {
  const T* from = reinterpret_cast<const T*>(src);
  T* to = reinterpret_cast<T*>(dst);
  const u64 units = bytes / sizeof(T);
  const u64 step = (u64)blockDim.x * NCCL_RESHARD_UNROLL;
  u64 u = threadIdx.x;
  for (; u + (NCCL_RESHARD_UNROLL - 1) * blockDim.x < units; u += step) {
    T v[NCCL_RESHARD_UNROLL];
#pragma unroll
    for (int j = 0; j < NCCL_RESHARD_UNROLL; ++j) v[j] = *NCCL_RESHARD_READ(from + u + j * blockDim.x);
#pragma unroll
    for (int j = 0; j < NCCL_RESHARD_UNROLL; ++j) *NCCL_RESHARD_WRITE(to + u + j * blockDim.x) = v[j];
  }
  for (; u < units; u += blockDim.x) *NCCL_RESHARD_WRITE(to + u) = *NCCL_RESHARD_READ(from + u);
}

// A tile of whole chunks. The block's threads form groups of `g` lanes (a power of two: the
// chunk's units rounded up, at most the block); group j copies chunks j, j + G, j + 2G, …
// (G groups), NCCL_RESHARD_UNROLL chunks at a time. A group finds its next chunk by adding
// strides along the innermost dim and divides only when it crosses a row of that dim.
template <typename T>
__device__ __forceinline__ void copy_chunks(const CopyDesc& d, const char* src, char* dst,
                                            u64 first, u32 chunks) {
  const u32 per_chunk = (u32)(d.chunk_bytes / sizeof(T));
  u32 g = 1;
  while (g < per_chunk && g < blockDim.x) g <<= 1;
  const u32 groups = blockDim.x / g;
  const u32 group = threadIdx.x / g;
  const u32 lane = threadIdx.x % g;
  const int in = (int)d.ndims - 1;
  const u64 in_count = d.count[in];
  const u64 step_src = (u64)groups * d.src_stride[in];
  const u64 step_dst = (u64)groups * d.dst_stride[in];

  u64 s[NCCL_RESHARD_UNROLL], t[NCCL_RESHARD_UNROLL];
  u64 inner = 0;
  u32 k = group;
  if (k < chunks) chunk_offsets(d, first + k, &s[0], &t[0], &inner);
  while (k < chunks) {
    // Offsets of this round's chunks k, k + G, …: the first is known, the others follow.
    int have = 1;
    for (int j = 1; j < NCCL_RESHARD_UNROLL; ++j) {
      if (k + (u32)j * groups >= chunks) break;
      if (inner + groups < in_count) {
        s[j] = s[j - 1] + step_src;
        t[j] = t[j - 1] + step_dst;
        inner += groups;
      } else {
        chunk_offsets(d, first + k + (u64)j * groups, &s[j], &t[j], &inner);
      }
      have = j + 1;
    }
    for (u32 u = lane; u < per_chunk; u += g) {
      T v[NCCL_RESHARD_UNROLL];
#pragma unroll
      for (int j = 0; j < NCCL_RESHARD_UNROLL; ++j)
        if (j < have) v[j] = *NCCL_RESHARD_READ(reinterpret_cast<const T*>(src + s[j]) + u);
#pragma unroll
      for (int j = 0; j < NCCL_RESHARD_UNROLL; ++j)
        if (j < have) *NCCL_RESHARD_WRITE(reinterpret_cast<T*>(dst + t[j]) + u) = v[j];
    }
    const u32 next = k + (u32)have * groups;
    if (next >= chunks) break;
    if (inner + groups < in_count) {
      s[0] = s[have - 1] + step_src;
      t[0] = t[have - 1] + step_dst;
      inner += groups;
    } else {
      chunk_offsets(d, first + next, &s[0], &t[0], &inner);
    }
    k = next;
  }
}

template <typename T>
__device__ __forceinline__ void copy_tile(const CopyDesc& d, const char* src, char* dst,
                                          const Tile& tile) {
  const u64 chunk = tile.start / d.chunk_bytes;
  if (chunk == (tile.start + tile.bytes - 1) / d.chunk_bytes) {
    u64 s, t, inner;
    chunk_offsets(d, chunk, &s, &t, &inner);
    const u64 within = tile.start - chunk * d.chunk_bytes;
    copy_run<T>(src + s + within, dst + t + within, tile.bytes);
  } else {
    // The encoder cuts such tiles at chunk boundaries, at most 256 KiB long: the chunk count
    // fits 32 bits.
    copy_chunks<T>(d, src, dst, chunk, (u32)(tile.bytes / d.chunk_bytes));
  }
}

extern "C" __global__ void __launch_bounds__(NCCL_RESHARD_THREADS)
ncclReshardCopyKernel(const CopyDesc* __restrict__ descs, const Tile* __restrict__ tiles,
                      u64 first_tile, Bases bases) {
  const Tile tile = *NCCL_RESHARD_READ(tiles + first_tile + blockIdx.x);
  const CopyDesc& d = *NCCL_RESHARD_READ(descs + tile.desc);
  const char* src = reinterpret_cast<const char*>(bases.ptr[d.src_base]);
  char* dst = reinterpret_cast<char*>(bases.ptr[d.dst_base]);
  // The widest access every address of this tile allows.
  u64 align = bases.ptr[d.src_base] | bases.ptr[d.dst_base] | d.src_offset | d.dst_offset |
              d.chunk_bytes | tile.start | tile.bytes;
  for (u32 k = 0; k < d.ndims; ++k) align |= d.src_stride[k] | d.dst_stride[k];
  if ((align & 15) == 0) {
    copy_tile<uint4>(d, src, dst, tile);
  } else if ((align & 7) == 0) {
    copy_tile<u64>(d, src, dst, tile);
  } else if ((align & 3) == 0) {
    copy_tile<u32>(d, src, dst, tile);
  } else if ((align & 1) == 0) {
    copy_tile<u16>(d, src, dst, tile);
  } else {
    copy_tile<unsigned char>(d, src, dst, tile);
  }
}
