/* What every example shares, nccl-tests style: error-checking macros that print file:line and
 * the error text and exit, and small helpers that fill an ncclReshardLayout_t. */
#ifndef NCCL_RESHARD_EXAMPLES_COMMON_H_
#define NCCL_RESHARD_EXAMPLES_COMMON_H_

#include <ncclReshard.h>

#include <stdio.h>
#include <stdlib.h>

/* For every call returning ncclResult_t, NCCL's and ncclReshard's alike. The library's detail
 * (ncclReshardGetLastError) names the bad field or the underlying CUDA/NCCL error; it is empty
 * when the failing call was NCCL's own. The examples exit at the first failure, so it is never
 * left over from an earlier one. */
#define NCCLCHECK(cmd)                                                                     \
  do {                                                                                     \
    ncclResult_t r_ = (cmd);                                                               \
    if (r_ != ncclSuccess) {                                                               \
      const char* detail_ = ncclReshardGetLastError();                                     \
      fprintf(stderr, "%s:%d: %s failed: %s%s%s\n", __FILE__, __LINE__, #cmd,              \
              ncclReshardGetErrorString(r_), detail_[0] != '\0' ? ": " : "", detail_);     \
      exit(EXIT_FAILURE);                                                                  \
    }                                                                                      \
  } while (0)

/* For every call returning cudaError_t. */
#define CUDACHECK(cmd)                                                                     \
  do {                                                                                     \
    cudaError_t e_ = (cmd);                                                                \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #cmd,                  \
              cudaGetErrorString(e_));                                                     \
      exit(EXIT_FAILURE);                                                                  \
    }                                                                                      \
  } while (0)

static inline ncclReshardPlacement_t replicate(void) {
  ncclReshardPlacement_t p = {ncclReshardReplicate, 0, 0};
  return p;
}

static inline ncclReshardPlacement_t shard(int dim) {
  ncclReshardPlacement_t p = {ncclReshardShard, dim, 0};
  return p;
}

/* A mesh of `ndim` axes (row-major, last axis fastest) over the contiguous ranks firstRank,
 * firstRank + 1, …, with one placement per axis. */
static inline ncclReshardLayout_t meshLayout(int ndim, const int64_t* meshShape, int firstRank,
                                             const ncclReshardPlacement_t* placements) {
  ncclReshardLayout_t l = NCCL_RESHARD_LAYOUT_INITIALIZER;
  l.meshNdim = ndim;
  l.firstRank = firstRank;
  for (int a = 0; a < ndim; a++) {
    l.meshShape[a] = meshShape[a];
    l.placements[a] = placements[a];
  }
  return l;
}

/* The same mesh over an explicit row-major rank table; `ranks` is read by
 * ncclReshardPlanCreate and ncclReshardLocalShape, so it must outlive the layout's use there. */
static inline ncclReshardLayout_t meshLayoutRanks(int ndim, const int64_t* meshShape,
                                                  const int* ranks,
                                                  const ncclReshardPlacement_t* placements) {
  ncclReshardLayout_t l = meshLayout(ndim, meshShape, 0, placements);
  l.ranks = ranks;
  return l;
}

/* Bytes per element of the NCCL dtypes the examples use (0 for any other). */
static inline size_t dtypeSize(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

#endif /* NCCL_RESHARD_EXAMPLES_COMMON_H_ */
