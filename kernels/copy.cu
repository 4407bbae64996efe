// Block copies for libncclreshard: local copies (source view -> destination view), packs
// (source view -> staging) and unpacks (staging -> destination view), all driven by the same
// `Copy` descriptors the host executor runs (src/plan/program.rs), encoded by
// src/exec/cuda/descriptors.rs.
//
// Self-contained on purpose: compiled by NVRTC at first use with only
// `--gpu-architecture=sm_XX -std=c++17`, no system, libc++ or CUDA toolkit headers.

typedef unsigned long long u64;
typedef unsigned int u32;

#define NCCL_RESHARD_MAX_COPY_DIMS 8
#define NCCL_RESHARD_MAX_BASES 384
#define NCCL_RESHARD_THREADS 256

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

// Byte offsets (source, destination) of chunk number `chunk` of a descriptor.
__device__ __forceinline__ void chunk_offsets(const CopyDesc& d, u64 chunk, u64* src, u64* dst) {
  u64 s = d.src_offset;
  u64 t = d.dst_offset;
  for (int k = (int)d.ndims - 1; k >= 0; --k) {
    const u64 n = d.count[k];
    const u64 i = chunk % n;
    chunk /= n;
    s += i * d.src_stride[k];
    t += i * d.dst_stride[k];
  }
  *src = s;
  *dst = t;
}

template <typename T>
__device__ __forceinline__ void copy_tile(const CopyDesc& d, const char* src, char* dst,
                                          u64 start, u64 bytes) {
  const u64 units = bytes / sizeof(T);
  if (start / d.chunk_bytes == (start + bytes - 1) / d.chunk_bytes) {
    // The tile lies inside one chunk: one contiguous run on both sides.
    u64 s, t;
    const u64 chunk = start / d.chunk_bytes;
    chunk_offsets(d, chunk, &s, &t);
    const u64 within = start - chunk * d.chunk_bytes;
    const T* from = reinterpret_cast<const T*>(src + s + within);
    T* to = reinterpret_cast<T*>(dst + t + within);
    for (u64 u = threadIdx.x; u < units; u += blockDim.x) to[u] = from[u];
    return;
  }
  // The tile covers whole chunks: each unit finds its chunk.
  const u64 per_chunk = d.chunk_bytes / sizeof(T);
  const u64 first = start / d.chunk_bytes;
  for (u64 u = threadIdx.x; u < units; u += blockDim.x) {
    const u64 chunk = first + u / per_chunk;
    const u64 within = (u % per_chunk) * sizeof(T);
    u64 s, t;
    chunk_offsets(d, chunk, &s, &t);
    *reinterpret_cast<T*>(dst + t + within) = *reinterpret_cast<const T*>(src + s + within);
  }
}

extern "C" __global__ void __launch_bounds__(NCCL_RESHARD_THREADS)
ncclReshardCopyKernel(const CopyDesc* __restrict__ descs, const Tile* __restrict__ tiles,
                      u64 first_tile, Bases bases) {
  const Tile tile = tiles[first_tile + blockIdx.x];
  const CopyDesc& d = descs[tile.desc];
  const char* src = reinterpret_cast<const char*>(bases.ptr[d.src_base]);
  char* dst = reinterpret_cast<char*>(bases.ptr[d.dst_base]);
  // The widest access every address of this tile allows.
  u64 align = bases.ptr[d.src_base] | bases.ptr[d.dst_base] | d.src_offset | d.dst_offset |
              d.chunk_bytes | tile.start | tile.bytes;
  for (u32 k = 0; k < d.ndims; ++k) align |= d.src_stride[k] | d.dst_stride[k];
  if ((align & 15) == 0) {
    copy_tile<uint4>(d, src, dst, tile.start, tile.bytes);
  } else if ((align & 7) == 0) {
    copy_tile<u64>(d, src, dst, tile.start, tile.bytes);
  } else if ((align & 3) == 0) {
    copy_tile<u32>(d, src, dst, tile.start, tile.bytes);
  } else {
    copy_tile<unsigned char>(d, src, dst, tile.start, tile.bytes);
  }
}
