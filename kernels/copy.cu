// Block copies and conversions for libncclreshard: local copies (source view -> destination
// view), packs (source view -> staging) and unpacks (staging -> destination view), all driven
// by the same `StridedCopy` descriptors the host executor runs (src/plan/program.rs), and the
// conversions of tensors that arrive in another dtype (`StridedConvert`, docs/quantization.md),
// all encoded by src/gpu/descriptors.rs. docs/executor.md ("The kernel") derives the speed of
// each path.
//
// Self-contained on purpose: compiled by NVRTC at first use with only
// `--gpu-architecture=sm_XX -std=c++17`, no system, libc++ or CUDA toolkit headers. The CPU
// emulator (emu/) compiles this same file for the host, so it uses only plain C++, the CUDA
// built-ins threadIdx, blockIdx, blockDim and gridDim, and __funnelshift_r, and no shared
// memory, barriers or warp shuffles: the emulator runs a block's threads one after another.
// No thread therefore ever reads what another thread of the same launch wrote; conversions that
// need a block's amax run as several launches (partial amaxes, reductions, scales, values)
// that the stream orders.
//
// Speed comes from bytes in flight (Little's law): HBM answers a load after about a
// microsecond, so a GPU copying at ~2 TB/s needs ~2 MB of loads outstanding. Every path here
// issues NCCL_RESHARD_SLOTS independent 16-byte loads per thread before it stores any of them
// (64 bytes in flight per thread), with adjacent lanes on adjacent 16-byte words so each warp
// instruction touches whole 32-byte sectors.
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define NCCL_RESHARD_MAX_COPY_DIMS 8
#define NCCL_RESHARD_MAX_BASES 384
#define NCCL_RESHARD_THREADS 256
// Launches are persistent grids of at most a few blocks per SM (src/gpu/call.rs); the launch
// bound guarantees two of them fit on an SM (at most 128 registers per thread).
#define NCCL_RESHARD_MIN_BLOCKS 2
// Independent 16-byte units each thread loads before it stores: 64 bytes in flight.
#define NCCL_RESHARD_SLOTS 4
// Lanes that share a row (or a row piece) at most: a warp.
#define NCCL_RESHARD_MAX_GROUP 32
// Partial amaxes one thread reduces into one (a reduction pass's fan-in).
#define NCCL_RESHARD_FANIN 64

// Every global-memory access goes through these two, so that the emulator can check each one
// against its device allocations and the access's alignment (it defines them before including
// this file); on a GPU they are the pointer itself.
#ifndef NCCL_RESHARD_READ
#define NCCL_RESHARD_READ(p) (p)
#define NCCL_RESHARD_WRITE(p) (p)
#endif

// What a descriptor does (CopyDesc.kind).
#define NCCL_RESHARD_COPY 0
// Conversions: partial amaxes, their reduction (one level), each block's scale, the values.
#define NCCL_RESHARD_CONVERT_AMAX 1
#define NCCL_RESHARD_CONVERT_SCALE 2
#define NCCL_RESHARD_CONVERT_VALUES 3
#define NCCL_RESHARD_CONVERT_REDUCE 4

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

// CopyDesc.row_dim when no outer dim varies inside a block (its rows: one), or several do.
#define NCCL_RESHARD_ROWS_ONE 0xfffffffeu
#define NCCL_RESHARD_ROWS_GENERAL 0xffffffffu

// One strided block copy: `chunk_bytes` contiguous bytes at every point of the `ndims`-dim
// grid (outermost first), from bases[src_base] + src_offset to bases[dst_base] + dst_offset.
//
// Or one pass (kind != NCCL_RESHARD_COPY) of a conversion of a box of `ndims` tensor dims:
// `count[k]` elements along dim k, `src_stride`/`dst_stride` bytes apart, in `blocks`
// quantization blocks of `block[k]` elements whose scales are `scale_stride[k]` bytes apart
// from bases[scale_base] + scale_offset. A block's rows are its index points along the outer
// dims; a strip is 16 bytes of source (4 or 8 elements) of one row inside one block. The
// amax and values passes share their items: item i of block b covers `item_strips` strips
// (strip groups of `strip_groups` apart) of `item_rows` consecutive rows, in `row_chunks`
// row chunks; each amax item writes one partial, `partials` (= row_chunks x strip_groups) per
// block, in the scratch at bases[work_base] + partials_offset. Reduction passes fold
// NCCL_RESHARD_FANIN partials into one, level by level (`level`: the one a pass writes), until
// at most NCCL_RESHARD_FANIN are left per block; the scale pass folds those and writes each
// block's divisor (divisors_offset) and its stored scale.
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
  u64 blocks;
  u64 partials;
  u64 strip_groups;
  u64 row_chunks;
  u32 item_rows;
  u32 item_strips;
  // The one outer dim whose index varies inside a block, or NCCL_RESHARD_ROWS_*.
  u32 row_dim;
  u32 level;
  u32 scale_base;
  u32 work_base;
  u32 arith;
  u32 reserved;
};

// A slice of one descriptor's bytes, in its linear order (chunk by chunk). A tile either lies
// inside one chunk or covers whole chunks. For a conversion pass, `bytes` items from item
// `start`.
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

__device__ __forceinline__ u64 min64(u64 a, u64 b) { return a < b ? a : b; }

__device__ __forceinline__ uint4 load16(u64 address) {
  return *NCCL_RESHARD_READ(reinterpret_cast<const uint4*>(address));
}

__device__ __forceinline__ void store16(u64 address, uint4 v) {
  *NCCL_RESHARD_WRITE(reinterpret_cast<uint4*>(address)) = v;
}

// `width` (1, 2, 4 or 8) bytes at an address aligned to `width`, zero-extended.
__device__ __forceinline__ u64 load_width(u64 address, u32 width) {
  switch (width) {
    case 8:
      return *NCCL_RESHARD_READ(reinterpret_cast<const u64*>(address));
    case 4:
      return *NCCL_RESHARD_READ(reinterpret_cast<const u32*>(address));
    case 2:
      return *NCCL_RESHARD_READ(reinterpret_cast<const u16*>(address));
    default:
      return *NCCL_RESHARD_READ(reinterpret_cast<const u8*>(address));
  }
}

__device__ __forceinline__ void store_width(u64 address, u32 width, u64 v) {
  switch (width) {
    case 8:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u64*>(address)) = v;
      break;
    case 4:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u32*>(address)) = (u32)v;
      break;
    case 2:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u16*>(address)) = (u16)v;
      break;
    default:
      *NCCL_RESHARD_WRITE(reinterpret_cast<u8*>(address)) = (u8)v;
      break;
  }
}

// The 16 bytes starting `delta` (1-15) bytes into the 32 bytes lo:hi (little-endian: lo holds
// the lower addresses). A source misaligned against its destination is read as aligned words
// and shifted into place, so every load and store stays 16 bytes wide: one funnel shift
// (SHF) per output word, the word pair picked at compile time in each case.
__device__ __forceinline__ uint4 shift_bytes(uint4 lo, uint4 hi, u32 delta) {
  const u32 s = (delta & 3) * 8;
  uint4 o;
  switch (delta >> 2) {
    case 0:
      o.x = __funnelshift_r(lo.x, lo.y, s);
      o.y = __funnelshift_r(lo.y, lo.z, s);
      o.z = __funnelshift_r(lo.z, lo.w, s);
      o.w = __funnelshift_r(lo.w, hi.x, s);
      break;
    case 1:
      o.x = __funnelshift_r(lo.y, lo.z, s);
      o.y = __funnelshift_r(lo.z, lo.w, s);
      o.z = __funnelshift_r(lo.w, hi.x, s);
      o.w = __funnelshift_r(hi.x, hi.y, s);
      break;
    case 2:
      o.x = __funnelshift_r(lo.z, lo.w, s);
      o.y = __funnelshift_r(lo.w, hi.x, s);
      o.z = __funnelshift_r(hi.x, hi.y, s);
      o.w = __funnelshift_r(hi.y, hi.z, s);
      break;
    default:
      o.x = __funnelshift_r(lo.w, hi.x, s);
      o.y = __funnelshift_r(hi.x, hi.y, s);
      o.z = __funnelshift_r(hi.y, hi.z, s);
      o.w = __funnelshift_r(hi.z, hi.w, s);
      break;
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// Copies.
//
// A tile is a set of rows: its whole chunks, or (a chunk longer than a tile) one range inside
// a chunk. Each row is cut at the 16-byte boundaries of its destination into units; every
// unit whose destination is whole and whose aligned source words lie inside the row is
// "interior" and moves as one 16-byte store of one (source aligned like the destination) or
// two (misaligned: shift_bytes) 16-byte loads. The rest of the row, at most 32 bytes at each
// end, is its "edge": elements of the widest width (1-8 bytes) that the row's source,
// destination and length allow. Nothing outside the row is ever read or written.
//
// The path is chosen per row, not per tile: a row's alignment never slows another row down.
// A group of g lanes (g = the row's units rounded up to a power of two, at most a warp) works
// on a piece of g interior units of a row, one unit per lane, and takes NCCL_RESHARD_SLOTS
// consecutive pieces at a time (pieces of one long row, or several short rows: 64-byte rows
// are four lanes and four rows per group). So every lane has four 16-byte units in flight,
// and each warp instruction stores g x 16 contiguous bytes per group: whole sectors, which HBM
// writes without reading them first.

// Where a row starts: its chunk, that chunk's index along the innermost dim, and the absolute
// addresses of the row's first source and destination bytes.
struct RowAt {
  u64 chunk;
  u64 inner;
  u64 src;
  u64 dst;
};

// 64-bit divisions, one per dim: once per group and tile, and where stepping leaves a row of
// the innermost dim. `src0`/`dst0`: where chunk 0's row starts.
__device__ __forceinline__ void seek_chunk(const CopyDesc& d, u64 chunk, u64 src0, u64 dst0,
                                           RowAt* at) {
  u64 rest = chunk;
  u64 inner = 0;
  for (int k = (int)d.ndims - 1; k >= 0; --k) {
    const u64 n = d.count[k];
    const u64 i = rest % n;
    rest /= n;
    src0 += i * d.src_stride[k];
    dst0 += i * d.dst_stride[k];
    if (k == (int)d.ndims - 1) inner = i;
  }
  at->chunk = chunk;
  at->inner = inner;
  at->src = src0;
  at->dst = dst0;
}

// What one lane has in flight for one piece of a row: an interior unit's one or two source
// words and an edge element, and where they go (offsets from the row's first destination
// byte). Four of these live in registers at once, so they are kept small.
struct Pending {
  uint4 lo;
  uint4 hi;
  u64 D;
  u32 edge;     // the edge element's offset + 1 (0: none)
  u32 unit;     // the interior unit's offset + 1 (0: none)
  u32 ev;       // the edge element's value
  u32 shape;    // bits 0-7: the unit's source misalignment (0: one word); 8-15: edge width
};

// Edge elements are at most 4 bytes wide: a 4-byte register per element in flight.
#define NCCL_RESHARD_EDGE_WIDTH 4

// Issues lane `lane`'s loads for piece `piece` of the row at S/D (absolute addresses of its
// first byte, `len` bytes) cut into pieces of g units, and returns what the stores need.
//
// Unit k covers destination [D - r + 16k, +16), r = D mod 16; its source words start at
// S - r - delta + 16k, delta = (S - D) mod 16 (aligned). Interior units, k_lo <= k < k_hi,
// have a whole destination and source words inside the row. The rest, `head` bytes before
// them and `tail` after (each at most 32), or the whole row when it has no interior unit,
// are edge elements of the widest width (at most 4) that divides the row's ends; lane l of
// piece p takes element p * g + l. Elements past pieces * g (rows of a few narrow elements
// only) are copied here, one at a time, by the last piece's lanes.
__device__ __forceinline__ Pending issue_piece(u64 S, u64 D, u32 len, u32 piece, u32 pieces,
                                               u32 g, u32 lane) {
  Pending p;
  p.D = D;
  const u32 r = (u32)(D & 15);
  const u32 delta = (u32)((S - D) & 15);
  const u32 span = len + r;
  const u32 k_lo = (r + delta + 15) >> 4;
  const u32 top = (span + delta) >> 4;
  const u32 k_hi = delta ? (top ? top - 1 : 0) : (span >> 4);
  const bool interior = k_hi > k_lo;
  const u32 k = k_lo + piece * g + lane;
  p.unit = 0;
  p.hi.x = p.hi.y = p.hi.z = p.hi.w = 0;
  if (interior && k < k_hi) {
    // k >= k_lo >= 1 whenever r + delta > 0: the offsets are not negative.
    p.unit = 16 * k - r + 1;
    const u64 word = S + (16 * k - r) - delta;
    p.lo = load16(word);
    if (delta) p.hi = load16(word + 16);
  }
  const u32 head = interior ? 16 * k_lo - r : len;
  const u32 tail = interior ? span - 16 * k_hi : 0;
  const u64 low = S | D | len | NCCL_RESHARD_EDGE_WIDTH;
  const u32 w = (u32)(low & (~low + 1));
  const u32 elements = (head + tail) / w;
  const u32 e = piece * g + lane;
  p.shape = delta | w << 8;
  p.edge = 0;
  p.ev = 0;
  if (e < elements) {
    const u32 o = e * w < head ? e * w : len - tail + (e * w - head);
    p.edge = o + 1;
    p.ev = (u32)load_width(S + o, w);
  }
  if (piece + 1 == pieces) {
    for (u32 x = pieces * g + lane; x < elements; x += g) {
      const u32 o = x * w < head ? x * w : len - tail + (x * w - head);
      store_width(D + o, w, load_width(S + o, w));
    }
  }
  return p;
}

__device__ __forceinline__ void finish_piece(const Pending& p) {
  if (p.edge) store_width(p.D + (p.edge - 1), p.shape >> 8, p.ev);
  if (p.unit) {
    const u32 delta = p.shape & 0xff;
    store16(p.D + (p.unit - 1), delta ? shift_bytes(p.lo, p.hi, delta) : p.lo);
  }
}

__device__ __forceinline__ void copy_tile(const CopyDesc& d, u64 src_base, u64 dst_base,
                                          const Tile& tile) {
  const u64 c0 = tile.start / d.chunk_bytes;
  const bool inside = c0 == (tile.start + tile.bytes - 1) / d.chunk_bytes;
  // src/gpu/descriptors.rs cuts tiles at most TILE_BYTES (64 KiB) long: rows, lengths,
  // pieces and items fit 32 bits.
  const u32 len = (u32)(inside ? tile.bytes : d.chunk_bytes);
  const u64 lead = inside ? tile.start - c0 * d.chunk_bytes : 0;
  const u32 rows = (u32)(inside ? 1 : tile.bytes / d.chunk_bytes);
  const u64 src0 = src_base + d.src_offset + lead;
  const u64 dst0 = dst_base + d.dst_offset + lead;

  RowAt at;
  seek_chunk(d, c0, src0, dst0, &at);
  // A run inside one chunk whose ends and length are 16-byte aligned (contiguous copies, long
  // rows): every lane of the block takes every blockDim.x-th unit, NCCL_RESHARD_SLOTS loads in
  // flight before its stores, and no per-unit edge or shift arithmetic (the kernel before 0.5,
  // which copied this way, reached 0.92 of cudaMemcpy on an H200; the general path below 0.84).
  if (inside && ((at.src | at.dst | len) & 15) == 0) {
    const u32 n = len >> 4;
    const u32 step = blockDim.x;
    for (u32 k0 = threadIdx.x; k0 < n; k0 += step * NCCL_RESHARD_SLOTS) {
      uint4 v[NCCL_RESHARD_SLOTS];
#pragma unroll
      for (int j = 0; j < NCCL_RESHARD_SLOTS; ++j) {
        const u32 k = k0 + (u32)j * step;
        if (k < n) v[j] = load16(at.src + 16ull * k);
      }
#pragma unroll
      for (int j = 0; j < NCCL_RESHARD_SLOTS; ++j) {
        const u32 k = k0 + (u32)j * step;
        if (k < n) store16(at.dst + 16ull * k, v[j]);
      }
    }
    return;
  }
  // The most units a row's destination touches: ceil((len + r) / 16), r its misalignment,
  // which is the same for every row when every destination stride is a multiple of 16.
  u64 strides = 0;
  for (u32 k = 0; k < d.ndims; ++k) strides |= d.dst_stride[k];
  const u32 r_max = (rows == 1 || (strides & 15) == 0) ? (u32)(at.dst & 15) : 15;
  const u32 units = (len + r_max + 15) >> 4;
  u32 g = 1;
  while (g < units && g < NCCL_RESHARD_MAX_GROUP) g <<= 1;
  const u32 pieces = (units + g - 1) / g;
  const u32 items = rows * pieces;
  const u32 groups = blockDim.x / g;
  const u32 group = threadIdx.x / g;
  const u32 lane = threadIdx.x % g;
  if (group >= groups) return;

  // The group's position: item `item` = piece `piece` of row `row` (at `at`). Rows only move
  // forward, by adding strides along the innermost dim while that stays in its row.
  u32 item = group * NCCL_RESHARD_SLOTS;
  if (item >= items) return;
  u32 piece = item;
  const int in = (int)d.ndims - 1;
  for (;;) {
    const u32 forward = piece / pieces;
    piece -= forward * pieces;
    if (forward) {
      if (at.inner + forward < d.count[in]) {
        at.chunk += forward;
        at.inner += forward;
        at.src += forward * d.src_stride[in];
        at.dst += forward * d.dst_stride[in];
      } else {
        seek_chunk(d, at.chunk + forward, src0, dst0, &at);
      }
    }
    Pending p[NCCL_RESHARD_SLOTS];
#pragma unroll
    for (int j = 0; j < NCCL_RESHARD_SLOTS; ++j) {
      p[j].unit = 0;
      p[j].edge = 0;
      if (item + j < items) {
        p[j] = issue_piece(at.src, at.dst, len, piece, pieces, g, lane);
        if (++piece == pieces && item + j + 1 < items) {
          piece = 0;
          if (at.inner + 1 < d.count[in]) {
            ++at.chunk;
            ++at.inner;
            at.src += d.src_stride[in];
            at.dst += d.dst_stride[in];
          } else {
            seek_chunk(d, at.chunk + 1, src0, dst0, &at);
          }
        }
      }
    }
    // Every slot's loads were issued before any of these stores waits for its data.
#pragma unroll
    for (int j = 0; j < NCCL_RESHARD_SLOTS; ++j) finish_piece(p[j]);
    item += groups * NCCL_RESHARD_SLOTS;
    if (item >= items) break;
    piece += groups * NCCL_RESHARD_SLOTS - NCCL_RESHARD_SLOTS;
  }
}

// ---------------------------------------------------------------------------------------------
// Conversions: the arithmetic of src/quant (docs/quantization.md). Every narrowing conversion
// rounds to nearest even; FP8 saturates at its largest finite value, bfloat16 and float16
// overflow to infinity; NaN becomes the format's canonical NaN. GPUs convert with the
// hardware's paired cvt (FP8 from sm_89, bfloat16 and float16 from sm_80), both halves of
// each; elsewhere (and in the emulator, which compiles this file for the host) the exact
// software path below, which the emulated tests check against the host executor.

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

__device__ __forceinline__ u32 type_size(u32 type) {
  return type == NCCL_RESHARD_FLOAT32 ? 4
         : (type == NCCL_RESHARD_FLOAT8E4M3 || type == NCCL_RESHARD_FLOAT8E5M2) ? 1
                                                                                 : 2;
}

// Two values as two destination elements, `a` at the lower address: one FP8 pair (16 bits)
// or one pair of 16-bit elements (32 bits). The hardware's cvt writes its first operand to
// the upper half; NaNs are set to the canonical NaN afterwards (cvt's own NaN has other bits).
__device__ __forceinline__ u32 convert_pair(float a, float b, u32 type) {
  u32 pair;
  switch (type) {
    case NCCL_RESHARD_FLOAT8E4M3:
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    {
      u16 h;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(b), "f"(a));
      pair = h;
      if (a != a) pair = (pair & 0xff00u) | 0x7fu;
      if (b != b) pair = (pair & 0x00ffu) | 0x7f00u;
    }
#else
      pair = encode_narrow(a, 8, 3, 7, 0x7e, 0x7e, 0x7f) |
             encode_narrow(b, 8, 3, 7, 0x7e, 0x7e, 0x7f) << 8;
#endif
      return pair;
    case NCCL_RESHARD_FLOAT8E5M2:
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    {
      u16 h;
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(b), "f"(a));
      pair = h;
      if (a != a) pair = (pair & 0xff00u) | 0x7fu;
      if (b != b) pair = (pair & 0x00ffu) | 0x7f00u;
    }
#else
      pair = encode_narrow(a, 8, 2, 15, 0x7b, 0x7b, 0x7f) |
             encode_narrow(b, 8, 2, 15, 0x7b, 0x7b, 0x7f) << 8;
#endif
      return pair;
    case NCCL_RESHARD_BFLOAT16:
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(b), "f"(a));
      if (a != a) pair = (pair & 0xffff0000u) | 0x7fc0u;
      if (b != b) pair = (pair & 0x0000ffffu) | 0x7fc00000u;
#else
      pair = encode_narrow(a, 16, 7, 127, 0x7f7f, 0x7f80, 0x7fc0) |
             encode_narrow(b, 16, 7, 127, 0x7f7f, 0x7f80, 0x7fc0) << 16;
#endif
      return pair;
    default:
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(b), "f"(a));
      if (a != a) pair = (pair & 0xffff0000u) | 0x7e00u;
      if (b != b) pair = (pair & 0x0000ffffu) | 0x7e000000u;
#else
      pair = encode_narrow(a, 16, 10, 15, 0x7bff, 0x7c00, 0x7e00) |
             encode_narrow(b, 16, 10, 15, 0x7bff, 0x7c00, 0x7e00) << 16;
#endif
      return pair;
  }
}

// A 16-bit source element as FP32, exactly.
__device__ __forceinline__ float widen(u32 h, u32 type) {
  if (type == NCCL_RESHARD_BFLOAT16) return float_of(h << 16);
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
  return f;
#else
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
#endif
}

__device__ __forceinline__ float load_element(u64 address, u32 type) {
  if (type == NCCL_RESHARD_FLOAT32)
    return float_of(*NCCL_RESHARD_READ(reinterpret_cast<const u32*>(address)));
  return widen(*NCCL_RESHARD_READ(reinterpret_cast<const u16*>(address)), type);
}

__device__ __forceinline__ void store_element(u64 address, u32 type, float y) {
  const u32 code = convert_pair(y, 0.0f, type);
  if (type_size(type) == 1) {
    *NCCL_RESHARD_WRITE(reinterpret_cast<u8*>(address)) = (u8)code;
  } else {
    *NCCL_RESHARD_WRITE(reinterpret_cast<u16*>(address)) = (u16)code;
  }
}

// The 16 source bytes of a strip as FP32 values (4 floats or 8 16-bit elements).
template <int N>
__device__ __forceinline__ void unpack_strip(uint4 v, u32 type, float* x) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
  if (N == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = float_of(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = widen(w[i] & 0xffffu, type);
      x[2 * i + 1] = widen(w[i] >> 16, type);
    }
  }
}

// The largest magnitude of a whole strip and `amax`, NaN ignored (IEEE maxNum, as fmaxf).
__device__ __forceinline__ float strip_amax(uint4 v, u32 type, float amax) {
  float x[8];
  int n = 8;
  if (type == NCCL_RESHARD_FLOAT32) {
    unpack_strip<4>(v, type, x);
    n = 4;
  } else {
    unpack_strip<8>(v, type, x);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < n) {
      const float m = float_of(bits_of(x[i]) & 0x7fffffffu);
      if (m > amax) amax = m;
    }
  }
  return amax;
}

// A whole strip of N elements converted (x / divisor when scaled) and stored with one store
// of N destination elements: 4 or 8 bytes of FP8, 8 or 16 bytes of 16-bit elements.
template <int N>
__device__ __forceinline__ void convert_strip(uint4 v, u32 src_type, u32 dst_type, bool scaled,
                                              float divisor, u64 dst) {
  float x[N];
  unpack_strip<N>(v, src_type, x);
  if (scaled) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = x[i] / divisor;
  }
  u32 w[4] = {0, 0, 0, 0};
  const bool narrow = type_size(dst_type) == 1;
#pragma unroll
  for (int q = 0; q < N / 2; ++q) {
    const u32 pair = convert_pair(x[2 * q], x[2 * q + 1], dst_type);
    if (narrow) {
      w[q / 2] |= pair << (16 * (q % 2));
    } else {
      w[q] = pair;
    }
  }
  const int bytes = narrow ? N : 2 * N;
  if (bytes == 16) {
    uint4 o;
    o.x = w[0];
    o.y = w[1];
    o.z = w[2];
    o.w = w[3];
    store16(dst, o);
  } else if (bytes == 8) {
    *NCCL_RESHARD_WRITE(reinterpret_cast<u64*>(dst)) = (u64)w[0] | (u64)w[1] << 32;
  } else {
    *NCCL_RESHARD_WRITE(reinterpret_cast<u32*>(dst)) = w[0];
  }
}

// Where one quantization block of a box lies: the offsets of its first element from the bases,
// its rows (index points of the outer dims; edge blocks have fewer) and its width along the
// innermost dim. Blocks are numbered row-major, the innermost dim fastest.
struct BlockAt {
  u64 src;
  u64 dst;
  u64 rows;
  u64 width;
};

__device__ __forceinline__ u64 blocks_along(const CopyDesc& d, int k) {
  return (d.count[k] + d.block[k] - 1) / d.block[k];
}

__device__ __forceinline__ BlockAt block_at(const CopyDesc& d, u64 b) {
  const int last = (int)d.ndims - 1;
  BlockAt at;
  at.src = d.src_offset;
  at.dst = d.dst_offset;
  at.rows = 1;
  at.width = 0;
  u64 rest = b;
  for (int k = last; k >= 0; --k) {
    const u64 n = blocks_along(d, k);
    const u64 lo = (rest % n) * d.block[k];
    rest /= n;
    const u64 extent = min64(d.block[k], d.count[k] - lo);
    at.src += lo * d.src_stride[k];
    at.dst += lo * d.dst_stride[k];
    if (k == last) {
      at.width = extent;
    } else {
      at.rows *= extent;
    }
  }
  return at;
}

// Offsets of row `h` of block `b` from the block's first element. The encoder merges dims so
// that most blocks vary along one outer dim (row_dim); other boxes pay divisions per row.
__device__ __forceinline__ void row_offsets(const CopyDesc& d, u64 b, u64 h, u64* src, u64* dst) {
  if (d.row_dim == NCCL_RESHARD_ROWS_ONE) {
    *src = 0;
    *dst = 0;
    return;
  }
  if (d.row_dim != NCCL_RESHARD_ROWS_GENERAL) {
    *src = h * d.src_stride[d.row_dim];
    *dst = h * d.dst_stride[d.row_dim];
    return;
  }
  const int last = (int)d.ndims - 1;
  u64 s = 0, t = 0, rest = b;
  for (int k = last; k >= 0; --k) {
    const u64 n = blocks_along(d, k);
    const u64 lo = (rest % n) * d.block[k];
    rest /= n;
    if (k == last) continue;
    const u64 extent = min64(d.block[k], d.count[k] - lo);
    const u64 i = h % extent;
    h /= extent;
    s += i * d.src_stride[k];
    t += i * d.dst_stride[k];
  }
  *src = s;
  *dst = t;
}

// The amax and values passes: item `item` covers `item_strips` strips (strip_groups apart)
// of `item_rows` rows of one block. Adjacent items are adjacent strips of the same rows, so
// adjacent threads read adjacent 16-byte words; each thread keeps four strips in flight.
// Strips that are whole and 16-byte aligned (with their destination aligned to its size) take
// the vector path; any other strip (a box whose innermost stride is not the element size, a
// block width that is no multiple of the strip, odd offsets) is converted element by element.
__device__ __forceinline__ void convert_strips(const CopyDesc& d, const Bases& bases, u64 item) {
  const u32 src_type = d.arith & 0xff;
  const u32 dst_type = (d.arith >> 8) & 0xff;
  const bool values = d.kind == NCCL_RESHARD_CONVERT_VALUES;
  const bool scaled = (d.arith & NCCL_RESHARD_ARITH_SCALED) != 0;
  const u64 src_base = bases.ptr[d.src_base];
  const u64 dst_base = bases.ptr[d.dst_base];
  const u64 work = bases.ptr[d.work_base];
  const int last = (int)d.ndims - 1;
  const u64 ss = type_size(src_type);
  const u64 ds = type_size(dst_type);
  const u64 per = 16 / ss;  // elements per strip
  const u64 out = per * ds;  // destination bytes per strip

  const u64 b = item / d.partials;
  const u64 i = item - b * d.partials;
  const u64 rho = i / d.strip_groups;
  const u64 gamma = i - rho * d.strip_groups;
  const BlockAt at = block_at(d, b);
  const u64 h0 = rho * d.item_rows;
  const u64 h1 = min64(h0 + d.item_rows, at.rows);
  const u64 k_strips = d.item_strips;
  const u64 pairs = h1 > h0 ? (h1 - h0) * k_strips : 0;

  bool vector = d.src_stride[last] == ss && d.dst_stride[last] == ds &&
                ((src_base + at.src + gamma * 16) & 15) == 0 &&
                ((dst_base + at.dst + gamma * out) & (out - 1)) == 0;
  for (int k = 0; k < last; ++k) {
    const bool varies = d.row_dim == NCCL_RESHARD_ROWS_GENERAL || d.row_dim == (u32)k;
    if (varies && ((d.src_stride[k] & 15) != 0 || (d.dst_stride[k] & (out - 1)) != 0))
      vector = false;
  }
  const float divisor =
      values && scaled
          ? *NCCL_RESHARD_READ(reinterpret_cast<const float*>(work + d.divisors_offset) + b)
          : 1.0f;

  float amax = 0.0f;
  // The next (row, strip) pair: pair q is row h0 + q / k_strips, strip q % k_strips, kept as
  // counters (a 64-bit division per strip costs more than the strip's bytes).
  u64 next_row = h0;
  u64 next_strip = 0;
  for (u64 p = 0; p < pairs; p += NCCL_RESHARD_SLOTS) {
    uint4 v[NCCL_RESHARD_SLOTS];
    u64 src[NCCL_RESHARD_SLOTS], dst[NCCL_RESHARD_SLOTS], n[NCCL_RESHARD_SLOTS];
    bool whole[NCCL_RESHARD_SLOTS];
#pragma unroll
    for (int j = 0; j < NCCL_RESHARD_SLOTS; ++j) {
      n[j] = 0;
      whole[j] = false;
      if (p + j < pairs) {
        const u64 h = next_row;
        const u64 strip = gamma + next_strip * d.strip_groups;
        if (++next_strip == k_strips) {
          next_strip = 0;
          ++next_row;
        }
        const u64 first = strip * per;
        if (first < at.width) {
          u64 rs, rt;
          row_offsets(d, b, h, &rs, &rt);
          n[j] = min64(per, at.width - first);
          src[j] = src_base + at.src + rs + first * d.src_stride[last];
          dst[j] = dst_base + at.dst + rt + first * d.dst_stride[last];
          whole[j] = vector && n[j] == per;
          if (whole[j]) v[j] = load16(src[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NCCL_RESHARD_SLOTS; ++j) {
      if (n[j] == 0) continue;
      if (!whole[j]) {
        // Element by element (a strip that is partial, strided or misaligned).
        for (u64 e = 0; e < n[j]; ++e) {
          const float x = load_element(src[j] + e * d.src_stride[last], src_type);
          if (values) {
            store_element(dst[j] + e * d.dst_stride[last], dst_type, scaled ? x / divisor : x);
          } else {
            const float m = float_of(bits_of(x) & 0x7fffffffu);
            if (m > amax) amax = m;  // NaN never compares greater: ignored, as fmaxf does
          }
        }
      } else if (!values) {
        amax = strip_amax(v[j], src_type, amax);
      } else if (ss == 4) {
        convert_strip<4>(v[j], src_type, dst_type, scaled, divisor, dst[j]);
      } else {
        convert_strip<8>(v[j], src_type, dst_type, scaled, divisor, dst[j]);
      }
    }
  }
  if (!values) {
    *NCCL_RESHARD_WRITE(reinterpret_cast<float*>(work + d.partials_offset) + item) = amax;
  }
}

// Level `level` of a conversion's partials: how many per block and where they start in the
// scratch (level 0: the amax items'; each level folds NCCL_RESHARD_FANIN of the one below).
__device__ __forceinline__ void partials_level(const CopyDesc& d, u32 level, u64* per_block,
                                               u64* offset) {
  u64 p = d.partials;
  u64 o = d.partials_offset;
  for (u32 l = 0; l < level; ++l) {
    o = (o + 4 * d.blocks * p + 15) & ~(u64)15;
    p = (p + NCCL_RESHARD_FANIN - 1) / NCCL_RESHARD_FANIN;
  }
  *per_block = p;
  *offset = o;
}

// The largest of `n` partial amaxes at `address` (non-negative, never NaN): 16-byte loads,
// four in flight, where the address allows.
__device__ __forceinline__ float fold_partials(u64 address, u64 n) {
  float m = 0.0f;
  u64 i = 0;
  if ((address & 15) == 0) {
    for (; i + 16 <= n; i += 16) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = load16(address + 4 * i + 16 * u);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float f[4] = {float_of(v[u].x), float_of(v[u].y), float_of(v[u].z),
                            float_of(v[u].w)};
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (f[c] > m) m = f[c];
      }
    }
    for (; i + 4 <= n; i += 4) {
      const uint4 v = load16(address + 4 * i);
      const float f[4] = {float_of(v.x), float_of(v.y), float_of(v.z), float_of(v.w)};
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (f[c] > m) m = f[c];
    }
  }
  for (; i < n; ++i) {
    const float f = *NCCL_RESHARD_READ(reinterpret_cast<const float*>(address) + i);
    if (f > m) m = f;
  }
  return m;
}

// One item of a reduction pass: NCCL_RESHARD_FANIN partials of one block of the level below
// folded into one of level `d.level`.
__device__ __forceinline__ void convert_reduce(const CopyDesc& d, const Bases& bases, u64 item) {
  const u64 work = bases.ptr[d.work_base];
  u64 below, below_at, per, at;
  partials_level(d, d.level - 1, &below, &below_at);
  partials_level(d, d.level, &per, &at);
  const u64 b = item / per;
  const u64 i = item - b * per;
  const u64 first = i * NCCL_RESHARD_FANIN;
  const u64 n = min64(NCCL_RESHARD_FANIN, below - first);
  const float m = fold_partials(work + below_at + 4 * (b * below + first), n);
  *NCCL_RESHARD_WRITE(reinterpret_cast<float*>(work + at) + item) = m;
}

// Each block's scale from its last level of partials: s = max(amax, 1e-4) / fmax, rounded up
// to a power of two for E8M0; its divisor to the scratch, its stored form to the scale output.
__device__ __forceinline__ void convert_scale(const CopyDesc& d, const Bases& bases, u64 b) {
  const u64 work = bases.ptr[d.work_base];
  const u64 scales = bases.ptr[d.scale_base];
  u32 level = 0;
  u64 per, at;
  partials_level(d, 0, &per, &at);
  while (per > NCCL_RESHARD_FANIN) partials_level(d, ++level, &per, &at);
  const float amax = fold_partials(work + at + 4 * b * per, per);

  const int last = (int)d.ndims - 1;
  u64 where = d.scale_offset;
  u64 rest = b;
  for (int k = last; k >= 0; --k) {
    const u64 n = blocks_along(d, k);
    where += (rest % n) * d.scale_stride[k];
    rest /= n;
  }
  const u32 dst_type = (d.arith >> 8) & 0xff;
  const float fmax = dst_type == NCCL_RESHARD_FLOAT8E4M3 ? 448.0f : 57344.0f;
  const float s = (amax > 1e-4f ? amax : 1e-4f) / fmax;
  float divisor = s;
  if (d.arith & NCCL_RESHARD_ARITH_E8M0) {
    u32 stored = 0xff;
    if (bits_of(s) < 0x7f800000u) {
      const u32 exponent = (bits_of(s) >> 23) + ((bits_of(s) & 0x007fffffu) != 0 ? 1u : 0u);
      divisor = float_of(exponent << 23);
      stored = (d.arith & NCCL_RESHARD_ARITH_INVERSE) ? 254 - exponent : exponent;
    }
    *NCCL_RESHARD_WRITE(reinterpret_cast<u8*>(scales + where)) = (u8)stored;
  } else {
    const float stored = (d.arith & NCCL_RESHARD_ARITH_INVERSE) ? 1.0f / s : s;
    *NCCL_RESHARD_WRITE(reinterpret_cast<u32*>(scales + where)) = bits_of(stored);
  }
  *NCCL_RESHARD_WRITE(reinterpret_cast<float*>(work + d.divisors_offset) + b) = divisor;
}

__device__ __forceinline__ void convert_tile(const CopyDesc& d, const Bases& bases,
                                             const Tile& tile) {
  for (u64 item = tile.start + threadIdx.x; item < tile.start + tile.bytes; item += blockDim.x) {
    if (d.kind == NCCL_RESHARD_CONVERT_SCALE) {
      convert_scale(d, bases, item);
    } else if (d.kind == NCCL_RESHARD_CONVERT_REDUCE) {
      convert_reduce(d, bases, item);
    } else {
      convert_strips(d, bases, item);
    }
  }
}

// Two kernels of one signature, so that each is compiled for its own register needs: the
// copies' (every pack, unpack and local copy) and the conversions'. Both are persistent grids:
// src/gpu/call.rs launches at most a few blocks per SM, and each block walks the launch's
// tiles grid-stride, so a launch never queues more blocks than stay resident and never fills
// the GPU with blocks beside NCCL's kernels (docs/executor.md).
extern "C" __global__ void __launch_bounds__(NCCL_RESHARD_THREADS, NCCL_RESHARD_MIN_BLOCKS)
ncclReshardCopyKernel(const CopyDesc* __restrict__ descs, const Tile* __restrict__ tiles,
                      u64 first_tile, u64 tile_count, Bases bases) {
  for (u64 t = blockIdx.x; t < tile_count; t += gridDim.x) {
    const Tile tile = *NCCL_RESHARD_READ(tiles + first_tile + t);
    const CopyDesc& d = *NCCL_RESHARD_READ(descs + tile.desc);
    copy_tile(d, bases.ptr[d.src_base], bases.ptr[d.dst_base], tile);
  }
}

extern "C" __global__ void __launch_bounds__(NCCL_RESHARD_THREADS, NCCL_RESHARD_MIN_BLOCKS)
ncclReshardConvertKernel(const CopyDesc* __restrict__ descs, const Tile* __restrict__ tiles,
                         u64 first_tile, u64 tile_count, Bases bases) {
  for (u64 t = blockIdx.x; t < tile_count; t += gridDim.x) {
    const Tile tile = *NCCL_RESHARD_READ(tiles + first_tile + t);
    convert_tile(*NCCL_RESHARD_READ(descs + tile.desc), bases, tile);
  }
}
