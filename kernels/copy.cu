// Block copies and conversions for libncclreshard: local copies (source view -> destination
// view), packs (source view -> staging) and unpacks (staging -> destination view), all driven
// by the same `StridedCopy` descriptors the host executor runs (src/plan/program.rs), and the
// conversions of tensors that arrive in another dtype (`StridedConvert`, docs/quantization.md),
// all encoded by src/gpu/descriptors.rs.
//
// Self-contained on purpose: compiled by NVRTC at first use with only
// `--gpu-architecture=sm_XX -std=c++17`, no system, libc++ or CUDA toolkit headers. The CPU
// emulator (emu/) compiles this same file for the host, so it uses only plain C++ and the CUDA
// built-ins threadIdx, blockIdx and blockDim, and no shared memory or barriers: the emulator runs
// a block's threads one after another. Conversions that need a block's amax therefore run as
// three launches of this kernel (per-segment amaxes, per-block scales, the values), each thread
// on its own items, and the stream orders them.
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

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

// What a descriptor does (CopyDesc.kind).
#define NCCL_RESHARD_COPY 0
// Conversions: each segment's amax, each block's scale, each element's value.
#define NCCL_RESHARD_CONVERT_AMAX 1
#define NCCL_RESHARD_CONVERT_SCALE 2
#define NCCL_RESHARD_CONVERT_VALUES 3

// Element types in CopyDesc.arith: ncclDataType_t codes.
#define NCCL_RESHARD_FLOAT16 6
#define NCCL_RESHARD_FLOAT32 7
#define NCCL_RESHARD_BFLOAT16 9
#define NCCL_RESHARD_FLOAT8E4M3 10
#define NCCL_RESHARD_FLOAT8E5M2 11
// CopyDesc.arith: source type (bits 0-7), destination type (8-15) and these flags.
#define NCCL_RESHARD_ARITH_SCALED (1u << 16)
#define NCCL_RESHARD_ARITH_E8M0 (1u << 17)
#define NCCL_RESHARD_ARITH_INVERSE (1u << 18)

// One strided block copy: `chunk_bytes` contiguous bytes at every point of the `ndims`-dim
// grid (outermost first), from bases[src_base] + src_offset to bases[dst_base] + dst_offset.
//
// Or one conversion (kind != NCCL_RESHARD_COPY) of a box of `ndims` tensor dims: `count[k]`
// elements along dim k, `src_stride`/`dst_stride` bytes apart, in blocks of `block[k]`
// elements whose scales are `scale_stride[k]` bytes apart from bases[scale_base] +
// scale_offset. A segment is a run of at most `segment` elements along the innermost dim
// inside one block (`segments_per_row` per row of the box); the scratch at bases[work_base]
// holds one float per segment (its amax) from partials_offset and one per block (its
// divisor) from divisors_offset.
struct CopyDesc {
  u64 src_offset;
  u64 dst_offset;
  u64 chunk_bytes;
  u32 src_base;
  u32 dst_base;
  u32 ndims;
  u32 kind;
  u64 count[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 src_stride[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 dst_stride[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 block[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 scale_stride[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 scale_offset;
  u64 partials_offset;
  u64 divisors_offset;
  u64 segments_per_row;
  u64 segment;
  u32 scale_base;
  u32 work_base;
  u32 arith;
  u32 reserved;
};

// A slice of one descriptor's bytes, in its linear order (chunk by chunk). A tile either lies
// inside one chunk or covers whole chunks; one thread block copies one tile. For a conversion,
// `bytes` items (segments or blocks) from item `start`, one per thread at a time.
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


// ---------------------------------------------------------------------------------------------
// Conversions: the arithmetic of src/quant (docs/quantization.md), element by element. Every
// narrowing conversion rounds to nearest even; FP8 saturates at its largest finite value,
// bfloat16 and float16 overflow to infinity; NaN becomes the format's canonical NaN. On sm_89
// and newer the FP8 conversions use the hardware's cvt.rn.satfinite; elsewhere (and in the
// emulator, which compiles this file for the host) the exact software path below.

__device__ __forceinline__ u32 bits_of(float x) {
  union {
    float f;
    u32 u;
  } v;
  v.f = x;
  return v.u;
}

__device__ __forceinline__ float float_of(u32 bits) {
  union {
    float f;
    u32 u;
  } v;
  v.u = bits;
  return v.f;
}

// `m >> shift` rounded to nearest, ties to even (shift >= 1).
__device__ __forceinline__ u64 shift_round_even(u64 m, u32 shift) {
  if (shift >= 63) return 0;
  const u64 kept = m >> shift;
  const u64 rest = m & ((1ull << shift) - 1);
  const u64 half = 1ull << (shift - 1);
  return (rest > half || (rest == half && (kept & 1))) ? kept + 1 : kept;
}

// `x` in a float format of `width` bits with `mantissa` mantissa bits and exponent `bias`:
// round to nearest even, then magnitudes past `max_finite` become `overflow`; NaN is `nan`.
__device__ __forceinline__ u32 encode_narrow(float x, u32 width, u32 mantissa, int bias,
                                             u32 max_finite, u32 overflow, u32 nan) {
  if (x != x) return nan;
  const u32 bits = bits_of(x);
  const u32 sign = (bits >> 31) << (width - 1);
  const u32 magnitude = bits & 0x7fffffffu;
  if (magnitude == 0x7f800000u) return sign | overflow;
  u64 m;
  int exponent;
  int leading;
  if (magnitude >= 0x00800000u) {
    m = (magnitude & 0x007fffffu) | 0x00800000u;
    exponent = (int)(magnitude >> 23) - 150;
    leading = exponent + 23;
  } else {
    m = magnitude;
    exponent = -149;
    if (m == 0) return sign;
    int top = 0;
    while ((m >> (top + 1)) != 0) ++top;
    leading = exponent + top;
  }
  const int smallest_normal = 1 - bias;
  const int result_exponent = leading > smallest_normal ? leading : smallest_normal;
  const int unit = result_exponent - (int)mantissa;
  const u64 rounded = shift_round_even(m, (u32)(unit - exponent));
  const u64 code = ((u64)(result_exponent + bias - 1) << mantissa) + rounded;
  return sign | (code > max_finite ? overflow : (u32)code);
}

__device__ __forceinline__ u32 to_bf16(float x) {
  return encode_narrow(x, 16, 7, 127, 0x7f7f, 0x7f80, 0x7fc0);
}

__device__ __forceinline__ u32 to_f16(float x) {
  return encode_narrow(x, 16, 10, 15, 0x7bff, 0x7c00, 0x7e00);
}

__device__ __forceinline__ u32 to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (x != x) return 0x7f;
  u16 pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  return pair & 0xff;
#else
  return encode_narrow(x, 8, 3, 7, 0x7e, 0x7e, 0x7f);
#endif
}

__device__ __forceinline__ u32 to_e5m2(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (x != x) return 0x7f;
  u16 pair;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  return pair & 0xff;
#else
  return encode_narrow(x, 8, 2, 15, 0x7b, 0x7b, 0x7f);
#endif
}

__device__ __forceinline__ float from_f16(u32 h) {
  const u32 sign = (h & 0x8000u) << 16;
  const u32 exponent = (h >> 10) & 0x1f;
  u32 m = h & 0x3ff;
  if (exponent == 31) return float_of(sign | 0x7f800000u | (m << 13));
  if (exponent != 0) return float_of(sign | ((exponent + 112) << 23) | (m << 13));
  if (m == 0) return float_of(sign);
  // Subnormal: m · 2^-24, normalised.
  int e = 113;
  while ((m & 0x400) == 0) {
    m <<= 1;
    --e;
  }
  return float_of(sign | ((u32)e << 23) | ((m & 0x3ff) << 13));
}

__device__ __forceinline__ float load_element(const char* p, u32 type) {
  if (type == NCCL_RESHARD_FLOAT32) return float_of(*NCCL_RESHARD_READ(reinterpret_cast<const u32*>(p)));
  const u32 h = *NCCL_RESHARD_READ(reinterpret_cast<const u16*>(p));
  return type == NCCL_RESHARD_BFLOAT16 ? float_of(h << 16) : from_f16(h);
}

__device__ __forceinline__ void store_element(char* p, u32 type, float y) {
  switch (type) {
    case NCCL_RESHARD_BFLOAT16:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u16*>(p)) = (u16)to_bf16(y);
      break;
    case NCCL_RESHARD_FLOAT16:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u16*>(p)) = (u16)to_f16(y);
      break;
    case NCCL_RESHARD_FLOAT8E4M3:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u8*>(p)) = (u8)to_e4m3(y);
      break;
    default:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u8*>(p)) = (u8)to_e5m2(y);
      break;
  }
}

// One segment of a conversion box: its byte offsets on both sides, its length in elements,
// and the dense index of the block it lies in (row-major over the box's blocks).
struct Segment {
  u64 src;
  u64 dst;
  u64 length;
  u64 block;
};

__device__ __forceinline__ u64 blocks_along(const CopyDesc& d, int k) {
  return (d.count[k] + d.block[k] - 1) / d.block[k];
}

__device__ __forceinline__ Segment segment_at(const CopyDesc& d, u64 index) {
  const int last = (int)d.ndims - 1;
  const u64 per_block = (d.block[last] + d.segment - 1) / d.segment;
  u64 row = index / d.segments_per_row;
  const u64 j = index % d.segments_per_row;
  const u64 column_block = j / per_block;
  const u64 start = column_block * d.block[last] + (j % per_block) * d.segment;
  u64 end = start + d.segment;
  const u64 block_end = (column_block + 1) * d.block[last];
  if (end > block_end) end = block_end;
  if (end > d.count[last]) end = d.count[last];
  Segment s;
  s.length = end > start ? end - start : 0;
  s.src = d.src_offset + start * d.src_stride[last];
  s.dst = d.dst_offset + start * d.dst_stride[last];
  // The row's index along the outer dims, innermost first; the block index is built from the
  // outermost dim in, so collect it as place values.
  u64 block = column_block;
  u64 place = blocks_along(d, last);
  for (int k = last - 1; k >= 0; --k) {
    const u64 i = row % d.count[k];
    row /= d.count[k];
    s.src += i * d.src_stride[k];
    s.dst += i * d.dst_stride[k];
    block += (i / d.block[k]) * place;
    place *= blocks_along(d, k);
  }
  s.block = block;
  return s;
}

// Each segment's largest magnitude, NaN ignored (IEEE maxNum, as fmaxf).
__device__ __forceinline__ void convert_amax(const CopyDesc& d, const char* src, char* work,
                                             u64 index) {
  const Segment s = segment_at(d, index);
  const u32 type = d.arith & 0xff;
  const u64 step = d.src_stride[d.ndims - 1];
  float amax = 0.0f;
  for (u64 c = 0; c < s.length; ++c) {
    const float v = float_of(bits_of(load_element(src + s.src + c * step, type)) & 0x7fffffffu);
    if (v > amax) amax = v;
  }
  *NCCL_RESHARD_WRITE(reinterpret_cast<float*>(work + d.partials_offset) + index) = amax;
}

// Each block's scale from its segments' amaxes: s = max(amax, 1e-4) / fmax, rounded up to a
// power of two for E8M0; its divisor to the scratch, its stored form to the scale output.
__device__ __forceinline__ void convert_scale(const CopyDesc& d, char* scales, char* work,
                                              u64 index) {
  const int last = (int)d.ndims - 1;
  const u64 per_block = (d.block[last] + d.segment - 1) / d.segment;
  // The block's coordinates, innermost first.
  u64 coord[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 rest = index;
  for (int k = last; k >= 0; --k) {
    const u64 n = blocks_along(d, k);
    coord[k] = rest % n;
    rest /= n;
  }
  // Walk the block's rows (outer dims) and, in each, its segments.
  u64 first_row = 0;
  u64 row_place = 1;
  u64 rows_in[NCCL_RESHARD_MAX_COPY_DIMS];
  u64 row_stride[NCCL_RESHARD_MAX_COPY_DIMS];
  for (int k = last - 1; k >= 0; --k) {
    const u64 lo = coord[k] * d.block[k];
    u64 hi = lo + d.block[k];
    if (hi > d.count[k]) hi = d.count[k];
    rows_in[k] = hi - lo;
    row_stride[k] = row_place;
    first_row += lo * row_place;
    row_place *= d.count[k];
  }
  const float* partials = reinterpret_cast<const float*>(work + d.partials_offset);
  const u64 first_segment = coord[last] * per_block;
  u64 at[NCCL_RESHARD_MAX_COPY_DIMS];
  for (int k = 0; k < last; ++k) at[k] = 0;
  float amax = 0.0f;
  for (;;) {
    u64 row = first_row;
    for (int k = 0; k < last; ++k) row += at[k] * row_stride[k];
    for (u64 j = 0; j < per_block && first_segment + j < d.segments_per_row; ++j) {
      const float v = *NCCL_RESHARD_READ(partials + row * d.segments_per_row + first_segment + j);
      if (v > amax) amax = v;
    }
    int k = last - 1;
    for (; k >= 0; --k) {
      if (++at[k] < rows_in[k]) break;
      at[k] = 0;
    }
    if (k < 0) break;
  }
  const u32 dst_type = (d.arith >> 8) & 0xff;
  const float fmax = dst_type == NCCL_RESHARD_FLOAT8E4M3 ? 448.0f : 57344.0f;
  const float s = (amax > 1e-4f ? amax : 1e-4f) / fmax;
  float divisor = s;
  u64 where = d.scale_offset;
  for (int k = 0; k <= last; ++k) where += coord[k] * d.scale_stride[k];
  if (d.arith & NCCL_RESHARD_ARITH_E8M0) {
    u32 stored = 0xff;
    if (bits_of(s) >= 0x7f800000u) {
      divisor = s;
    } else {
      const u32 exponent = (bits_of(s) >> 23) + ((bits_of(s) & 0x007fffffu) != 0 ? 1u : 0u);
      divisor = float_of(exponent << 23);
      stored = (d.arith & NCCL_RESHARD_ARITH_INVERSE) ? 254 - exponent : exponent;
    }
    *NCCL_RESHARD_WRITE(reinterpret_cast<u8*>(scales + where)) = (u8)stored;
  } else {
    const float stored = (d.arith & NCCL_RESHARD_ARITH_INVERSE) ? 1.0f / s : s;
    *NCCL_RESHARD_WRITE(reinterpret_cast<u32*>(scales + where)) = bits_of(stored);
  }
  *NCCL_RESHARD_WRITE(reinterpret_cast<float*>(work + d.divisors_offset) + index) = divisor;
}

// Each segment's elements: x / divisor (scaled) or x, converted.
__device__ __forceinline__ void convert_values(const CopyDesc& d, const char* src, char* dst,
                                               const char* work, u64 index) {
  const Segment s = segment_at(d, index);
  const u32 src_type = d.arith & 0xff;
  const u32 dst_type = (d.arith >> 8) & 0xff;
  const bool scaled = (d.arith & NCCL_RESHARD_ARITH_SCALED) != 0;
  const float divisor =
      scaled ? *NCCL_RESHARD_READ(reinterpret_cast<const float*>(work + d.divisors_offset) + s.block)
             : 1.0f;
  const u64 src_step = d.src_stride[d.ndims - 1];
  const u64 dst_step = d.dst_stride[d.ndims - 1];
  for (u64 c = 0; c < s.length; ++c) {
    const float x = load_element(src + s.src + c * src_step, src_type);
    store_element(dst + s.dst + c * dst_step, dst_type, scaled ? x / divisor : x);
  }
}

__device__ __forceinline__ void convert_tile(const CopyDesc& d, const Bases& bases,
                                             const Tile& tile) {
  const char* src = reinterpret_cast<const char*>(bases.ptr[d.src_base]);
  char* dst = reinterpret_cast<char*>(bases.ptr[d.dst_base]);
  char* scales = reinterpret_cast<char*>(bases.ptr[d.scale_base]);
  char* work = reinterpret_cast<char*>(bases.ptr[d.work_base]);
  for (u64 item = tile.start + threadIdx.x; item < tile.start + tile.bytes; item += blockDim.x) {
    if (d.kind == NCCL_RESHARD_CONVERT_AMAX) {
      convert_amax(d, src, work, item);
    } else if (d.kind == NCCL_RESHARD_CONVERT_SCALE) {
      convert_scale(d, scales, work, item);
    } else {
      convert_values(d, src, dst, work, item);
    }
  }
}

extern "C" __global__ void __launch_bounds__(NCCL_RESHARD_THREADS)
ncclReshardCopyKernel(const CopyDesc* __restrict__ descs, const Tile* __restrict__ tiles,
                      u64 first_tile, Bases bases) {
  const Tile tile = *NCCL_RESHARD_READ(tiles + first_tile + blockIdx.x);
  const CopyDesc& d = *NCCL_RESHARD_READ(descs + tile.desc);
  if (d.kind != NCCL_RESHARD_COPY) {
    convert_tile(d, bases, tile);
    return;
  }
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
