/* Calls every entry point of ncclReshard.h from C, good and bad input, and checks results,
 * error codes, error messages and that outputs stay untouched on error. Exit 0 = pass. */
#include <ncclReshard.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
      failures++;                                                                \
    }                                                                            \
  } while (0)

/* Expects `call` to return `code` with a last-error message containing `needle`. */
#define EXPECT_ERROR(call, code, needle)                                                   \
  do {                                                                                     \
    ncclResult_t r_ = (call);                                                              \
    const char* msg_ = ncclReshardGetLastError();                                          \
    if (r_ != (code) || strstr(msg_, (needle)) == NULL) {                                  \
      fprintf(stderr, "%s:%d: %s returned %d \"%s\"; expected %d with \"%s\"\n", __FILE__, \
              __LINE__, #call, (int)r_, msg_, (int)(code), (needle));                     \
      failures++;                                                                          \
    }                                                                                      \
  } while (0)

#define OK(call)                                                                           \
  do {                                                                                     \
    ncclResult_t r_ = (call);                                                              \
    if (r_ != ncclSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,           \
              ncclReshardGetErrorString(r_), ncclReshardGetLastError());                   \
      failures++;                                                                          \
    }                                                                                      \
  } while (0)

/* A 64 x 32 bfloat16 tensor: TP2 on dim 1 over ranks 0,1 -> one replica on rank 2. */
static ncclReshardLayout_t src_layout(void) {
  ncclReshardLayout_t l = NCCL_RESHARD_LAYOUT_INITIALIZER;
  l.meshNdim = 1;
  l.meshShape[0] = 2;
  l.firstRank = 0;
  l.placements[0].kind = ncclReshardShard;
  l.placements[0].dim = 1;
  return l;
}

static ncclReshardLayout_t dst_layout(void) {
  static const int ranks[1] = {2};
  ncclReshardLayout_t l = NCCL_RESHARD_LAYOUT_INITIALIZER;
  l.meshNdim = 1;
  l.meshShape[0] = 1;
  l.ranks = ranks;
  l.placements[0].kind = ncclReshardReplicate;
  return l;
}

static ncclReshardTensor_t tensor(const ncclReshardLayout_t* src, const ncclReshardLayout_t* dst) {
  ncclReshardTensor_t t = NCCL_RESHARD_TENSOR_INITIALIZER;
  t.ndim = 2;
  t.shape[0] = 64;
  t.shape[1] = 32;
  t.dtype = ncclBfloat16;
  t.src = src;
  t.dst = dst;
  t.name = "model.layers.0.self_attn.o_proj.weight";
  return t;
}

static void test_version_and_strings(void) {
  int version = -1;
  OK(ncclReshardGetVersion(&version));
  CHECK(version == NCCL_RESHARD_VERSION_CODE);
  EXPECT_ERROR(ncclReshardGetVersion(NULL), ncclInvalidArgument, "version is NULL");
  for (int r = 0; r <= 8; r++) CHECK(ncclReshardGetErrorString((ncclResult_t)r) != NULL);
  CHECK(strcmp(ncclReshardGetErrorString(ncclSuccess), "no error") == 0);
  CHECK(ncclReshardGetLastError() != NULL);
}

static void test_plan_lifecycle(void) {
  ncclReshardLayout_t src = src_layout(), dst = dst_layout();
  ncclReshardTensor_t t = tensor(&src, &dst);
  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  CHECK(config.mode == NCCL_RESHARD_UNDEF_INT); /* unset: the library's default */
  CHECK(config.magic == 0x52455348 && config.version == NCCL_RESHARD_VERSION(NCCL_RESHARD_MAJOR, NCCL_RESHARD_MINOR, NCCL_RESHARD_PATCH));
  {
    /* Unset tunables resolve to the library's defaults: auto mode. */
    ncclReshardPlan_t unset = NULL;
    ncclReshardPlanInfo_t info = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
    OK(ncclReshardPlanCreate(&unset, 1, &t, 0, &config));
    OK(ncclReshardPlanGetInfo(unset, &info));
    CHECK(info.mode == ncclReshardModeAuto && info.groupable == 0);
    CHECK(info.version == NCCL_RESHARD_VERSION_CODE);
    OK(ncclReshardPlanDestroy(unset));
  }
  config.mode = ncclReshardModeGroupable;
  unsigned long long fingerprints[3];
  for (int rank = 0; rank < 3; rank++) {
    ncclReshardPlan_t plan = NULL;
    OK(ncclReshardPlanCreate(&plan, 1, &t, rank, &config));
    CHECK(plan != NULL);
    ncclReshardPlanInfo_t info = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
    OK(ncclReshardPlanGetInfo(plan, &info));
    CHECK(info.size == sizeof(ncclReshardPlanInfo_t));
    CHECK(info.rank == rank);
    CHECK(info.ntensors == 1);
    CHECK(info.mode == ncclReshardModeGroupable);
    CHECK(info.groupable == 1);
    fingerprints[rank] = (unsigned long long)info.fingerprint;
    if (rank < 2) {
      CHECK(info.bytesSent == 64 * 16 * 2);
      CHECK(info.messagesSent == 64); /* one per destination row in groupable mode */
      CHECK(info.bytesReceived == 0);
      CHECK(info.peers == 1);
      CHECK(info.sendBytes == 64 * 16 * 2);
      CHECK(info.recvBytes == 0);
    } else {
      CHECK(info.bytesReceived == 64 * 32 * 2);
      CHECK(info.messagesReceived == 128);
      CHECK(info.peers == 2);
      CHECK(info.recvBytes == 64 * 32 * 2);
    }

    int count = -1;
    OK(ncclReshardPlanGetTransfers(plan, NULL, 0, &count));
    CHECK(count == 1 || count == 2);
    ncclReshardTransfer_t transfers[4];
    for (int i = 0; i < 4; i++) {
      ncclReshardTransfer_t init = NCCL_RESHARD_TRANSFER_INITIALIZER;
      transfers[i] = init;
    }
    int written = -1;
    OK(ncclReshardPlanGetTransfers(plan, transfers, 4, &written));
    CHECK(written == count);
    unsigned long long bytes = 0;
    for (int i = 0; i < written; i++) {
      CHECK(transfers[i].size == sizeof(ncclReshardTransfer_t));
      CHECK(transfers[i].ndim == 2);
      CHECK(transfers[i].tensor == 0);
      CHECK(transfers[i].globalCount[0] == 64 && transfers[i].globalCount[1] == 16);
      CHECK(transfers[i].kind == (rank < 2 ? ncclReshardTransferSend : ncclReshardTransferRecv));
      CHECK(transfers[i].peer == (rank < 2 ? 2 : (int)transfers[i].globalStart[1] / 16));
      /* Groupable: one round, every block whole, read from the source view. */
      CHECK(transfers[i].round == 0);
      CHECK(transfers[i].srcView == ncclReshardViewSource);
      CHECK(transfers[i].blockOffset == 0 && transfers[i].blockBytes == transfers[i].bytes);
      bytes += transfers[i].bytes;
    }
    /* A caller built against the 0.1 header (no round, srcView, blockOffset, blockBytes) gets
     * structs of its own size, nothing past them. */
    const size_t oldSize = offsetof(ncclReshardTransfer_t, round);
    union {
      ncclReshardTransfer_t aligned;
      unsigned char bytes[4 * sizeof(ncclReshardTransfer_t)];
    } oldArray;
    unsigned char* old = oldArray.bytes;
    memset(old, 0xee, sizeof oldArray.bytes);
    memcpy(old, &oldSize, sizeof oldSize);
    written = -1;
    OK(ncclReshardPlanGetTransfers(plan, &oldArray.aligned, 4, &written));
    CHECK(written == count);
    for (int i = 0; i < written; i++) {
      ncclReshardTransfer_t t;
      memset(&t, 0, sizeof t);
      memcpy(&t, old + (size_t)i * oldSize, oldSize);
      CHECK(t.size == oldSize && t.bytes == transfers[i].bytes && t.peer == transfers[i].peer);
      CHECK(t.srcOffset == transfers[i].srcOffset && t.dstOffset == transfers[i].dstOffset);
    }
    CHECK(old[(size_t)written * oldSize] == 0xee);
    CHECK(bytes == (rank < 2 ? 64 * 16 * 2 : 64 * 32 * 2));
    if (rank == 2) {
      int small = -1;
      EXPECT_ERROR(ncclReshardPlanGetTransfers(plan, transfers, 1, &small), ncclInvalidArgument,
                   "capacity is 1");
      CHECK(small == -1);
    }
    EXPECT_ERROR(ncclReshardPlanGetTransfers(plan, NULL, 0, NULL), ncclInvalidArgument,
                 "count is NULL");

    /* Execution: argument checks come first; the GPU executor is a later issue. */
    if (rank < 2) {
      EXPECT_ERROR(ncclReshard(NULL, NULL, plan, NULL, NULL), ncclInvalidArgument, "sendbuff is NULL");
    } else {
      EXPECT_ERROR(ncclReshard(NULL, NULL, plan, NULL, NULL), ncclInvalidArgument, "recvbuff is NULL");
      static char recv[64 * 32 * 2];
      EXPECT_ERROR(ncclReshard(NULL, recv, plan, NULL, NULL), ncclInvalidArgument, "comm is NULL");
      void* recvs[1] = {recv};
      EXPECT_ERROR(ncclReshardMulti(NULL, NULL, plan, NULL, NULL), ncclInvalidArgument, "recvbuffs");
      EXPECT_ERROR(ncclReshardMulti(NULL, (void* const*)recvs, plan, NULL, NULL), ncclInvalidArgument,
                   "comm is NULL");
      /* Without a CUDA driver the call fails cleanly (never crashes) and says what is missing. */
      void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (libcuda == NULL) {
        EXPECT_ERROR(ncclReshard(NULL, recv, plan, (ncclComm_t)(void*)recv, NULL), ncclSystemError,
                     "CUDA driver (libcuda.so.1) was not found");
      } else {
        dlclose(libcuda);
      }
    }
    OK(ncclReshardPlanDestroy(plan));
  }
  CHECK(fingerprints[0] == fingerprints[1] && fingerprints[1] == fingerprints[2]);

  /* A rank outside both meshes gets an empty plan and may call with NULL everything. */
  ncclReshardPlan_t idle = NULL;
  OK(ncclReshardPlanCreate(&idle, 1, &t, 7, NULL));
  OK(ncclReshard(NULL, NULL, idle, NULL, NULL));
  OK(ncclReshardMulti(NULL, NULL, idle, NULL, NULL));
  OK(ncclReshardPlanDestroy(idle));
  OK(ncclReshardPlanDestroy(NULL));
}

static void test_bad_descriptors(void) {
  ncclReshardLayout_t src = src_layout(), dst = dst_layout();
  ncclReshardTensor_t t = tensor(&src, &dst);
  ncclReshardPlan_t untouched = (ncclReshardPlan_t)(void*)&t; /* sentinel, never dereferenced */
  ncclReshardPlan_t plan = untouched;

  EXPECT_ERROR(ncclReshardPlanCreate(NULL, 1, &t, 0, NULL), ncclInvalidArgument, "plan is NULL");
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 0, &t, 0, NULL), ncclInvalidArgument, "ntensors is 0");
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, NULL, 0, NULL), ncclInvalidArgument, "tensors is NULL");
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, -1, NULL), ncclInvalidArgument, "rank is -1");

  ncclReshardTensor_t bad = t;
  bad.dtype = (ncclDataType_t)42;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "tensors[0].dtype is 42");
  bad = t;
  bad.ndim = 9;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "tensors[0].ndim is 9");
  bad = t;
  bad.shape[1] = -5;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "tensors[0].shape[1] is -5");
  bad = t;
  bad.size = 8;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "tensors[0].size is 8");
  bad = t;
  bad.src = NULL;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "tensors[0].src is NULL");

  ncclReshardLayout_t l = src_layout();
  bad = t;
  bad.src = &l;
  l.placements[0].dim = 2;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument,
               "tensors[0]: src: placements[0] = Shard(2) shards dim 2 but the tensor has 2 dims");
  l = src_layout();
  l.placements[0].kind = 7;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument,
               "tensors[0].src->placements[0].kind is 7");
  l = src_layout();
  l.placements[0].kind = ncclReshardStridedShard;
  l.placements[0].splitFactor = 0;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "splitFactor is 0");
  l = src_layout();
  l.meshShape[0] = 0;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "size 0");
  l = src_layout();
  l.meshNdim = 0;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "meshNdim is 0");
  int dup[2] = {3, 3};
  l = src_layout();
  l.ranks = dup;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "rank 3 appears twice");
  int64_t overlapping[2] = {1, 1};
  l = src_layout();
  l.strides = overlapping;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "overlap");
  bad = t;
  bad.shape[0] = (int64_t)1 << 40;
  bad.shape[1] = (int64_t)1 << 40;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument, "overflows");

  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.magic = 0;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument, "config.magic");
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = 9;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument, "config.mode is 9");
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.ranksPerNode = -2;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument, "config.ranksPerNode is -2");
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.rounds = -1;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument, "config.rounds is -1");
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.rounds = 100000;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument, "config.rounds is 100000");
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.relay = 2;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument, "config.relay is 2");
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.senderBarrier = 2;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument,
               "config.senderBarrier is 2");
  /* A struct from a newer header than the library is refused; an unset dtype has no default. */
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.version = NCCL_RESHARD_VERSION_CODE + 100;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument,
               "config.version is");
  bad = t;
  bad.version = NCCL_RESHARD_VERSION_CODE + 1;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument,
               "tensors[0].version is");
  bad = t;
  bad.dtype = (ncclDataType_t)NCCL_RESHARD_UNDEF_INT;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &bad, 0, NULL), ncclInvalidArgument,
               "tensors[0].dtype is not set");
  /* A staging bound is checked when the plan is created (a call refused on one rank after its
   * peers posted their messages would leave them waiting): TP2 -> TP1 staged needs 8 KiB on
   * the receiver. */
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = ncclReshardModeStaged;
  config.maxStagingBytes = 1024;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 2, &config), ncclInvalidUsage,
               "bytes of staging on rank 2");
  /* A config from a 0.1 header (no rounds/relay) is still accepted, with their defaults. */
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.size = offsetof(ncclReshardConfig_t, rounds);
  config.rounds = -1; /* past the caller's size: never read */
  ncclReshardPlan_t old_header_plan = NULL;
  OK(ncclReshardPlanCreate(&old_header_plan, 1, &t, 0, &config));
  OK(ncclReshardPlanDestroy(old_header_plan));

  /* Two tensors in one buffer at the same offset would alias in ncclReshard, which refuses the
   * call before touching the GPU on the rank that has them; ncclReshardMulti ignores the
   * offsets, so the plan itself is fine. */
  ncclReshardTensor_t two[2] = {t, t};
  ncclReshardPlan_t aliased = NULL;
  OK(ncclReshardPlanCreate(&aliased, 2, two, 2, NULL));
  EXPECT_ERROR(ncclReshard(NULL, (void*)0x1000, aliased, NULL, NULL), ncclInvalidArgument,
               "overlaps the view of tensors[0]");
  OK(ncclReshardPlanDestroy(aliased));
  two[1].dstOffset = 64 * 32 * 2;
  ncclReshardPlan_t ok = NULL;
  OK(ncclReshardPlanCreate(&ok, 2, two, 2, NULL));
  OK(ncclReshardPlanDestroy(ok));

  CHECK(plan == untouched);
  EXPECT_ERROR(ncclReshardPlanGetInfo(NULL, NULL), ncclInvalidArgument, "plan is NULL");
}

static void test_local_shape(void) {
  /* 10 rows on a 2x2 mesh [Shard(0), Shard(0)]: 3, 2, 3, 2 rows (torch's nested chunking). */
  ncclReshardLayout_t l = NCCL_RESHARD_LAYOUT_INITIALIZER;
  l.meshNdim = 2;
  l.meshShape[0] = 2;
  l.meshShape[1] = 2;
  l.placements[0].kind = ncclReshardShard;
  l.placements[1].kind = ncclReshardShard;
  int64_t shape[2] = {10, 4};
  const int64_t want_rows[4] = {3, 2, 3, 2};
  const int64_t want_start[4] = {0, 3, 5, 8};
  for (int rank = 0; rank < 4; rank++) {
    int64_t local[2] = {-1, -1};
    int per_dim[2] = {-1, -1};
    int64_t runs[8];
    OK(ncclReshardLocalShape(&l, 2, shape, rank, local, NULL, 0, per_dim));
    CHECK(local[0] == want_rows[rank] && local[1] == 4);
    CHECK(per_dim[0] == 1 && per_dim[1] == 1);
    OK(ncclReshardLocalShape(&l, 2, shape, rank, local, runs, 4, per_dim));
    CHECK(runs[0] == want_start[rank] && runs[1] == want_start[rank] + want_rows[rank]);
    CHECK(runs[2] == 0 && runs[3] == 4);
  }
  /* FSDP2 + TP: [StridedShard(0, 2), Shard(0)] on 8 rows gives rank 1 rows 4-5. */
  l.placements[0].kind = ncclReshardStridedShard;
  l.placements[0].splitFactor = 2;
  int64_t rows8[1] = {8};
  int64_t local = -1, runs[2] = {-1, -1};
  int per_dim = -1;
  OK(ncclReshardLocalShape(&l, 1, rows8, 1, &local, runs, 1, &per_dim));
  CHECK(local == 2 && per_dim == 1 && runs[0] == 4 && runs[1] == 6);
  /* Rank 0 of [StridedShard(0,2)] alone on a 1-axis mesh holds two runs. */
  l.meshNdim = 1;
  OK(ncclReshardLocalShape(&l, 1, rows8, 0, &local, NULL, 0, &per_dim));
  CHECK(local == 4 && per_dim == 2);
  int64_t untouched[2] = {-7, -7};
  EXPECT_ERROR(ncclReshardLocalShape(&l, 1, rows8, 0, &local, untouched, 1, &per_dim), ncclInvalidArgument,
               "runsCapacity is 1");
  CHECK(untouched[0] == -7 && untouched[1] == -7);
  EXPECT_ERROR(ncclReshardLocalShape(&l, 1, rows8, 5, &local, NULL, 0, NULL), ncclInvalidArgument,
               "rank 5 is not in the layout's mesh");
  EXPECT_ERROR(ncclReshardLocalShape(NULL, 1, rows8, 0, &local, NULL, 0, NULL), ncclInvalidArgument, "NULL");
}

static void test_nccl_library(void) {
  const char* path = "untouched";
  int version = -1;
  EXPECT_ERROR(ncclReshardGetNcclLibrary(NULL, &version), ncclInvalidArgument, "path is NULL");
  EXPECT_ERROR(ncclReshardGetNcclLibrary(&path, NULL), ncclInvalidArgument, "ncclVersion is NULL");
  ncclResult_t r = ncclReshardGetNcclLibrary(&path, &version);
  if (r == ncclSuccess) {
    /* An NCCL on the loader path: the file that defines its functions and its version. */
    CHECK(path != NULL && strstr(path, "nccl") != NULL && version >= 21800);
    const char* again = NULL;
    OK(ncclReshardGetNcclLibrary(&again, &version));
    CHECK(again == path); /* chosen once per process */
  } else {
    /* No NCCL in the process nor on the loader path: an error naming what was tried, and
     * nothing written. */
    CHECK(r == ncclSystemError);
    CHECK(strstr(ncclReshardGetLastError(), "libnccl.so.2") != NULL);
    CHECK(strcmp(path, "untouched") == 0 && version == -1);
  }
}

/* Survivors' plans, holes and deadlines in the descriptors; the communicator functions'
 * checks before they reach NCCL. */
static void test_failures(void) {
  ncclReshardPlan_t plan = NULL;
  ncclReshardLayout_t src = src_layout();
  ncclReshardLayout_t dst = dst_layout();
  ncclReshardTensor_t t = tensor(&src, &dst);
  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.timeoutMs = -5;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument,
               "config.timeoutMs is -5");
  /* Rank 1 (half of the source, no replica) is gone: every survivor refuses alike. */
  static const int failed[1] = {1};
  config = (ncclReshardConfig_t)NCCL_RESHARD_CONFIG_INITIALIZER;
  config.failedRanks = failed;
  config.failedRankCount = 1;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidUsage,
               "no surviving rank holds");
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 1, &config), ncclInvalidUsage,
               "no surviving rank holds");
  CHECK(plan == NULL);
  static const int twice[2] = {1, 1};
  config.failedRanks = twice;
  config.failedRankCount = 2;
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &t, 0, &config), ncclInvalidArgument,
               "config.failedRanks names rank 1 twice");
  /* The receiver (rank 2) is gone: rank 2 is now nobody, ranks 0 and 1 send nothing. */
  static const int receiver[1] = {2};
  config.failedRanks = receiver;
  config.failedRankCount = 1;
  config.timeoutMs = 1000;
  OK(ncclReshardPlanCreate(&plan, 1, &t, 0, &config));
  ncclReshardPlanInfo_t info = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
  OK(ncclReshardPlanGetInfo(plan, &info));
  CHECK(info.peers == 0 && info.bytesSent == 0);
  OK(ncclReshardPlanDestroy(plan));
  /* A hole in a rank table: RANK_NONE is a gone position, other negatives are refused. */
  static const int holes[2] = {NCCL_RESHARD_RANK_NONE, 3};
  ncclReshardLayout_t replicated = dst_layout();
  replicated.meshShape[0] = 2;
  replicated.ranks = holes;
  ncclReshardTensor_t h = tensor(&src, &replicated);
  plan = NULL;
  OK(ncclReshardPlanCreate(&plan, 1, &h, 3, NULL));
  OK(ncclReshardPlanDestroy(plan));
  static const int bad_ranks[2] = {-2, 3};
  replicated.ranks = bad_ranks;
  h = tensor(&src, &replicated);
  EXPECT_ERROR(ncclReshardPlanCreate(&plan, 1, &h, 3, NULL), ncclInvalidArgument,
               "tensors[0].dst->ranks[0] is -2");
  /* The communicator functions check their arguments before NCCL. */
  ncclResult_t status = ncclInProgress;
  EXPECT_ERROR(ncclReshardCommGetStatus(NULL, &status), ncclInvalidArgument, "comm is NULL");
  CHECK(status == ncclInProgress);
  int fake = 0;
  EXPECT_ERROR(ncclReshardCommGetStatus((ncclComm_t)(void*)&fake, NULL), ncclInvalidArgument,
               "status is NULL");
  /* No call with a deadline ever ran on it: nothing pending, nothing failed. */
  OK(ncclReshardCommGetStatus((ncclComm_t)(void*)&fake, &status));
  CHECK(status == ncclSuccess);
  OK(ncclReshardCommWait((ncclComm_t)(void*)&fake));
  EXPECT_ERROR(ncclReshardCommWait(NULL), ncclInvalidArgument, "comm is NULL");
  EXPECT_ERROR(ncclReshardCommRevoke(NULL), ncclInvalidArgument, "comm is NULL");
  ncclComm_t newcomm = (ncclComm_t)(void*)&fake;
  EXPECT_ERROR(ncclReshardCommShrink(NULL, failed, 1, &newcomm, NULL, 1), ncclInvalidArgument,
               "comm is NULL");
  EXPECT_ERROR(ncclReshardCommShrink((ncclComm_t)(void*)&fake, failed, 1, NULL, NULL, 1),
               ncclInvalidArgument, "newcomm is NULL");
  EXPECT_ERROR(ncclReshardCommShrink((ncclComm_t)(void*)&fake, failed, -1, &newcomm, NULL, 1),
               ncclInvalidArgument, "excludeRanksCount is -1");
  EXPECT_ERROR(ncclReshardCommShrink((ncclComm_t)(void*)&fake, failed, 1, &newcomm, NULL, 2),
               ncclInvalidArgument, "shrinkFlags is 2");
  /* NCCL refuses a shrink that excludes no rank; the library says so first. */
  EXPECT_ERROR(ncclReshardCommShrink((ncclComm_t)(void*)&fake, NULL, 0, &newcomm, NULL, 1),
               ncclInvalidArgument, "excludeRanksCount is 0");
  CHECK(newcomm == (ncclComm_t)(void*)&fake);
  ncclUniqueId id;
  EXPECT_ERROR(ncclReshardCommGetUniqueId((ncclComm_t)(void*)&fake, NULL), ncclInvalidArgument,
               "uniqueId is NULL");
  EXPECT_ERROR(ncclReshardCommGetUniqueId(NULL, &id), ncclInvalidArgument, "comm is NULL");
  EXPECT_ERROR(ncclReshardCommGrow(NULL, 4, &id, 2, NULL, NULL), ncclInvalidArgument,
               "newcomm is NULL");
}

static void* other_thread(void* arg) {
  (void)arg;
  /* The last error is per thread: this thread has had no failure. */
  return (void*)(strlen(ncclReshardGetLastError()) == 0 ? (void*)1 : NULL);
}

static void test_thread_local_error(void) {
  EXPECT_ERROR(ncclReshardGetVersion(NULL), ncclInvalidArgument, "version is NULL");
  pthread_t thread;
  void* result = NULL;
  CHECK(pthread_create(&thread, NULL, other_thread, NULL) == 0);
  CHECK(pthread_join(thread, &result) == 0);
  CHECK(result == (void*)1);
}

int main(void) {
  test_version_and_strings();
  test_plan_lifecycle();
  test_bad_descriptors();
  test_local_shape();
  test_nccl_library();
  test_failures();
  test_thread_local_error();
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("api_test: all checks passed\n");
  return 0;
}
