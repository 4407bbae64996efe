/* refit: a real weight refit on every GPU of this node, one process, one NCCL rank per GPU.
 *
 * Two float32 weights of an MLP block (hidden 1024, intermediate 2816) start in a Megatron-style
 * tensor-parallel layout over all n GPUs: gate_proj column-parallel (Shard(0) of the [out, in]
 * weight), down_proj row-parallel (Shard(1)). They move to another layout on the same n GPUs
 * (colocated trainer and inference): gate_proj Shard(1), down_proj Shard(0); on one GPU, where
 * both are the whole tensor, the destination is Replicate. Every element starts as its global
 * row-major index, so each destination element can be checked against the index it must hold.
 *
 * The plans are groupable, so all ranks' ncclReshard calls go into one ncclGroupStart/End.
 * Exit 0 when every destination element is right, 1 on a mismatch or error, 77 when there is no
 * CUDA GPU (the ctest "skipped" code). */
#include "common.h"

#include <inttypes.h>
#include <string.h>

#define NTENSORS 2
#define MISMATCHES_SHOWN 5

/* Every global index must be exact in float32 (below 2^24). */
static const struct {
  const char* name;
  int64_t shape[2];
  int srcDim; /* the tensor-parallel dim on the source side; the destination uses the other */
} kTensors[NTENSORS] = {
    {"model.layers.0.mlp.gate_proj.weight", {2816, 1024}, 0},
    {"model.layers.0.mlp.down_proj.weight", {1024, 2816}, 1},
};

/* One rank's view of a 2-D tensor: dense row-major, `bytes` long at `offset` in the rank's
 * buffer; its element (i, j) is the global element (index[0][i], index[1][j]). */
typedef struct {
  int64_t local[2];
  int64_t* index[2];
  size_t offset;
  size_t bytes;
} View;

static void* allocOrDie(size_t bytes) {
  void* p = malloc(bytes > 0 ? bytes : 1);
  if (p == NULL) {
    fprintf(stderr, "refit: out of host memory (%zu bytes)\n", bytes);
    exit(EXIT_FAILURE);
  }
  return p;
}

/* Fills `v` with `rank`'s view of tensor `t` under `layout`, from the library's index runs. */
static void viewOf(const ncclReshardLayout_t* layout, int t, int rank, View* v) {
  const int64_t* shape = kTensors[t].shape;
  int runsPerDim[2];
  NCCLCHECK(ncclReshardLocalShape(layout, 2, shape, rank, v->local, NULL, 0, runsPerDim));
  int nruns = runsPerDim[0] + runsPerDim[1];
  int64_t* runs = allocOrDie(2 * (size_t)nruns * sizeof *runs);
  NCCLCHECK(ncclReshardLocalShape(layout, 2, shape, rank, v->local, runs, nruns, runsPerDim));
  const int64_t* run = runs;
  for (int d = 0; d < 2; d++) {
    v->index[d] = allocOrDie((size_t)v->local[d] * sizeof(int64_t));
    int64_t i = 0;
    for (int k = 0; k < runsPerDim[d]; k++, run += 2) {
      for (int64_t g = run[0]; g < run[1]; g++) v->index[d][i++] = g;
    }
    if (i != v->local[d]) {
      fprintf(stderr,
              "refit: rank %d, %s dim %d: runs cover %" PRId64 " indices, local shape %" PRId64
              "\n",
              rank, kTensors[t].name, d, i, v->local[d]);
      exit(EXIT_FAILURE);
    }
  }
  free(runs);
  v->bytes = (size_t)(v->local[0] * v->local[1]) * sizeof(float);
}

static float globalIndex(int t, const View* v, int64_t i, int64_t j) {
  return (float)(v->index[0][i] * kTensors[t].shape[1] + v->index[1][j]);
}

/* Lays the views out one after another (256-byte aligned) and returns the buffer's size. */
static size_t packViews(View* views) {
  size_t end = 0;
  for (int t = 0; t < NTENSORS; t++) {
    views[t].offset = (end + 255) / 256 * 256;
    end = views[t].offset + views[t].bytes;
  }
  return end;
}

int main(void) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    printf("refit: no CUDA GPU found (%s); nothing to run\n",
           err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 77;
  }

  const int64_t mesh[1] = {n};
  ncclReshardLayout_t src[NTENSORS], dst[NTENSORS];
  for (int t = 0; t < NTENSORS; t++) {
    int d = kTensors[t].srcDim;
    src[t] = meshLayout(1, mesh, 0, (ncclReshardPlacement_t[]){shard(d)});
    dst[t] = meshLayout(1, mesh, 0, (ncclReshardPlacement_t[]){n > 1 ? shard(1 - d) : replicate()});
  }
  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = ncclReshardModeGroupable;
  config.ranksPerNode = n;

  ncclComm_t* comms = allocOrDie((size_t)n * sizeof *comms);
  cudaStream_t* streams = allocOrDie((size_t)n * sizeof *streams);
  ncclReshardPlan_t* plans = allocOrDie((size_t)n * sizeof *plans);
  void** sendbuffs = allocOrDie((size_t)n * sizeof *sendbuffs);
  void** recvbuffs = allocOrDie((size_t)n * sizeof *recvbuffs);
  View(*srcViews)[NTENSORS] = allocOrDie((size_t)n * sizeof *srcViews);
  View(*dstViews)[NTENSORS] = allocOrDie((size_t)n * sizeof *dstViews);
  size_t* recvSize = allocOrDie((size_t)n * sizeof *recvSize);

  NCCLCHECK(ncclCommInitAll(comms, n, NULL));

  uint64_t bytesSent = 0, bytesCopied = 0;
  for (int r = 0; r < n; r++) {
    CUDACHECK(cudaSetDevice(r));
    CUDACHECK(cudaStreamCreate(&streams[r]));

    for (int t = 0; t < NTENSORS; t++) {
      viewOf(&src[t], t, r, &srcViews[r][t]);
      viewOf(&dst[t], t, r, &dstViews[r][t]);
    }
    size_t sendSize = packViews(srcViews[r]);
    recvSize[r] = packViews(dstViews[r]);

    /* Sources hold their global indices; destinations start as zeros. */
    unsigned char* host = allocOrDie(sendSize);
    for (int t = 0; t < NTENSORS; t++) {
      const View* v = &srcViews[r][t];
      float* view = (float*)(host + v->offset);
      for (int64_t i = 0; i < v->local[0]; i++) {
        for (int64_t j = 0; j < v->local[1]; j++) {
          view[i * v->local[1] + j] = globalIndex(t, v, i, j);
        }
      }
    }
    CUDACHECK(cudaMalloc(&sendbuffs[r], sendSize));
    CUDACHECK(cudaMemcpy(sendbuffs[r], host, sendSize, cudaMemcpyHostToDevice));
    free(host);
    CUDACHECK(cudaMalloc(&recvbuffs[r], recvSize[r]));
    CUDACHECK(cudaMemset(recvbuffs[r], 0, recvSize[r]));

    ncclReshardTensor_t tensors[NTENSORS];
    for (int t = 0; t < NTENSORS; t++) {
      ncclReshardTensor_t d = NCCL_RESHARD_TENSOR_INITIALIZER;
      d.ndim = 2;
      memcpy(d.shape, kTensors[t].shape, sizeof kTensors[t].shape);
      d.dtype = ncclFloat32;
      d.src = &src[t];
      d.dst = &dst[t];
      d.srcOffset = srcViews[r][t].offset;
      d.dstOffset = dstViews[r][t].offset;
      d.name = kTensors[t].name;
      tensors[t] = d;
    }
    NCCLCHECK(ncclReshardPlanCreate(&plans[r], NTENSORS, tensors, r, &config));
    ncclReshardPlanInfo_t info = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
    NCCLCHECK(ncclReshardPlanGetInfo(plans[r], &info));
    if (!info.groupable) {
      fprintf(stderr, "refit: rank %d's plan is not groupable in groupable mode\n", r);
      return EXIT_FAILURE;
    }
    bytesSent += info.bytesSent;
    bytesCopied += info.bytesCopied;
  }

  /* The streams are blocking, so they wait for the cudaMemset on the legacy default stream. */
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < n; r++) {
    CUDACHECK(cudaSetDevice(r));
    NCCLCHECK(ncclReshard(sendbuffs[r], recvbuffs[r], plans[r], comms[r], streams[r]));
  }
  NCCLCHECK(ncclGroupEnd());
  for (int r = 0; r < n; r++) {
    CUDACHECK(cudaSetDevice(r));
    CUDACHECK(cudaStreamSynchronize(streams[r]));
  }

  int64_t mismatches = 0;
  for (int r = 0; r < n; r++) {
    unsigned char* host = allocOrDie(recvSize[r]);
    CUDACHECK(cudaSetDevice(r));
    CUDACHECK(cudaMemcpy(host, recvbuffs[r], recvSize[r], cudaMemcpyDeviceToHost));
    for (int t = 0; t < NTENSORS; t++) {
      const View* v = &dstViews[r][t];
      const float* view = (const float*)(host + v->offset);
      for (int64_t i = 0; i < v->local[0]; i++) {
        for (int64_t j = 0; j < v->local[1]; j++) {
          float got = view[i * v->local[1] + j], want = globalIndex(t, v, i, j);
          if (got == want) continue;
          if (mismatches++ < MISMATCHES_SHOWN)
            fprintf(stderr, "refit: rank %d %s[%" PRId64 ", %" PRId64 "] = %.1f, expected %.1f\n",
                    r, kTensors[t].name, v->index[0][i], v->index[1][j], (double)got,
                    (double)want);
        }
      }
    }
    free(host);
  }

  for (int r = 0; r < n; r++) {
    CUDACHECK(cudaSetDevice(r));
    NCCLCHECK(ncclReshardPlanDestroy(plans[r]));
    CUDACHECK(cudaFree(sendbuffs[r]));
    CUDACHECK(cudaFree(recvbuffs[r]));
    CUDACHECK(cudaStreamDestroy(streams[r]));
    NCCLCHECK(ncclCommDestroy(comms[r]));
    for (int t = 0; t < NTENSORS; t++) {
      for (int d = 0; d < 2; d++) {
        free(srcViews[r][t].index[d]);
        free(dstViews[r][t].index[d]);
      }
    }
  }
  free(comms), free(streams), free(plans), free(sendbuffs), free(recvbuffs);
  free(srcViews), free(dstViews), free(recvSize);

  if (mismatches > 0) {
    printf("refit: FAILED: %" PRId64 " destination elements wrong\n", mismatches);
    return EXIT_FAILURE;
  }
  printf("refit: OK: %d tensors on %d GPU%s, %" PRIu64 " bytes sent over NCCL, %" PRIu64
         " bytes copied locally\n",
         NTENSORS, n, n > 1 ? "s" : "", bytesSent, bytesCopied);
  return EXIT_SUCCESS;
}
