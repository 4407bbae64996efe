/* routing: which bytes a trainer -> inference weight refit moves, computed on any machine (no
 * GPU, no NCCL communicator: plans are built locally and read back as data).
 *
 * One decoder layer of a Llama-3-8B-like model (hidden 4096, intermediate 14336, 32 query and
 * 8 KV heads of 128, bfloat16, Hugging Face tensor names) moves from a Megatron-style trainer,
 * mesh [dp=2, tp=4] on ranks 0..7, to a vLLM-style inference engine, TP2 x DP2 = mesh
 * [dp=2, tp=2] on ranks 8..11. Both sides place weights [Replicate, Shard(d)]: q/k/v, gate and
 * up projections are column-parallel (Shard(0) of the [out, in] weight), o_proj and down_proj
 * row-parallel (Shard(1)), the layernorms replicated. Nodes hold 8 GPUs, so the trainer is on
 * node 0 and the inference engine on node 1.
 *
 * For every rank it builds the plan of all tensors, prints what the rank sends and receives, and
 * checks that the plans agree: equal fingerprints, bytes sent == bytes received, and every
 * inference rank receiving exactly the bytes of its destination views. Exit 0 when they do,
 * 1 otherwise. Ranges are printed half-open: rows a..b are a, a+1, ..., b-1. */
#include "common.h"

#include <inttypes.h>
#include <string.h>

#define NRANKS 12
#define TRAINER_RANKS 8 /* ranks 0..7; the inference ranks are 8..11 */
#define NTENSORS 9
#define HIDDEN 4096
#define INTERMEDIATE 14336
#define KV_DIM (8 * 128)
#define TRANSFERS_SHOWN 4

enum Parallel { COLUMN, ROW, REPLICATED };

static const struct {
  const char* name;
  int ndim;
  int64_t shape[2];
  enum Parallel parallel;
} kTensors[NTENSORS] = {
    {"model.layers.0.input_layernorm.weight", 1, {HIDDEN, 0}, REPLICATED},
    {"model.layers.0.self_attn.q_proj.weight", 2, {HIDDEN, HIDDEN}, COLUMN},
    {"model.layers.0.self_attn.k_proj.weight", 2, {KV_DIM, HIDDEN}, COLUMN},
    {"model.layers.0.self_attn.v_proj.weight", 2, {KV_DIM, HIDDEN}, COLUMN},
    {"model.layers.0.self_attn.o_proj.weight", 2, {HIDDEN, HIDDEN}, ROW},
    {"model.layers.0.post_attention_layernorm.weight", 1, {HIDDEN, 0}, REPLICATED},
    {"model.layers.0.mlp.gate_proj.weight", 2, {INTERMEDIATE, HIDDEN}, COLUMN},
    {"model.layers.0.mlp.up_proj.weight", 2, {INTERMEDIATE, HIDDEN}, COLUMN},
    {"model.layers.0.mlp.down_proj.weight", 2, {HIDDEN, INTERMEDIATE}, ROW},
};

static const ncclDataType_t kDtype = ncclBfloat16;

/* Prints one transfer as "rank R sends <tensor> rows a..b cols c..d (N bytes) to rank P". */
static void printTransfer(int rank, const ncclReshardTransfer_t* t) {
  char box[96];
  const int64_t* s = t->globalStart;
  const int64_t* n = t->globalCount;
  if (t->ndim == 1) {
    snprintf(box, sizeof box, "elements %" PRId64 "..%" PRId64, s[0], s[0] + n[0]);
  } else {
    snprintf(box, sizeof box, "rows %" PRId64 "..%" PRId64 " cols %" PRId64 "..%" PRId64, s[0],
             s[0] + n[0], s[1], s[1] + n[1]);
  }
  const char* name = kTensors[t->tensor].name;
  switch (t->kind) {
    case ncclReshardTransferSend:
      printf("    rank %d sends %s %s (%" PRIu64 " bytes) to rank %d\n", rank, name, box, t->bytes,
             t->peer);
      break;
    case ncclReshardTransferRecv:
      printf("    rank %d receives %s %s (%" PRIu64 " bytes) from rank %d\n", rank, name, box,
             t->bytes, t->peer);
      break;
    default:
      printf("    rank %d copies %s %s (%" PRIu64 " bytes) locally\n", rank, name, box, t->bytes);
      break;
  }
}

/* Bytes of `rank`'s view of tensor `t` under `layout`, which must have the rank in its mesh. */
static uint64_t viewBytes(const ncclReshardTensor_t* t, const ncclReshardLayout_t* layout,
                          int rank) {
  int64_t local[NCCL_RESHARD_MAX_DIMS];
  NCCLCHECK(ncclReshardLocalShape(layout, t->ndim, t->shape, rank, local, NULL, 0, NULL));
  uint64_t bytes = dtypeSize(t->dtype);
  for (int d = 0; d < t->ndim; d++) bytes *= (uint64_t)local[d];
  return bytes;
}

int main(void) {
  /* Trainer: Megatron [dp=2, tp=4] on ranks 0..7; inference: vLLM TP2 x DP2 on ranks 8..11. */
  const int64_t trainMesh[2] = {2, 4};
  const int64_t inferMesh[2] = {2, 2};
  const int inferFirst = TRAINER_RANKS;
  ncclReshardLayout_t train[3], infer[3];
  train[COLUMN] = meshLayout(2, trainMesh, 0, (ncclReshardPlacement_t[]){replicate(), shard(0)});
  train[ROW] = meshLayout(2, trainMesh, 0, (ncclReshardPlacement_t[]){replicate(), shard(1)});
  train[REPLICATED] =
      meshLayout(2, trainMesh, 0, (ncclReshardPlacement_t[]){replicate(), replicate()});
  infer[COLUMN] = meshLayout(2, inferMesh, inferFirst, (ncclReshardPlacement_t[]){replicate(), shard(0)});
  infer[ROW] = meshLayout(2, inferMesh, inferFirst, (ncclReshardPlacement_t[]){replicate(), shard(1)});
  infer[REPLICATED] =
      meshLayout(2, inferMesh, inferFirst, (ncclReshardPlacement_t[]){replicate(), replicate()});

  ncclReshardTensor_t tensors[NTENSORS];
  for (int i = 0; i < NTENSORS; i++) {
    ncclReshardTensor_t t = NCCL_RESHARD_TENSOR_INITIALIZER;
    t.ndim = kTensors[i].ndim;
    memcpy(t.shape, kTensors[i].shape, sizeof kTensors[i].shape);
    t.dtype = kDtype;
    t.src = &train[kTensors[i].parallel];
    t.dst = &infer[kTensors[i].parallel];
    t.name = kTensors[i].name;
    tensors[i] = t;
  }

  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = ncclReshardModeAuto;
  config.ranksPerNode = 8; /* the trainer fills node 0, the inference engine half of node 1 */

  printf("refit of %d tensors (bfloat16): trainer [dp=2, tp=4] on ranks 0..7 -> inference "
         "[dp=2, tp=2] on ranks 8..11, 8 ranks per node, mode auto\n",
         NTENSORS);

  int failures = 0;
  uint64_t totalSent = 0, totalReceived = 0, totalCopied = 0, fingerprint = 0;
  int64_t totalMessages = 0, sendTransfers = 0, recvTransfers = 0;
  for (int rank = 0; rank < NRANKS; rank++) {
    /* This rank's views sit one after another in its source and destination buffers. */
    uint64_t srcView[NTENSORS], dstView[NTENSORS], srcEnd = 0, dstEnd = 0;
    for (int i = 0; i < NTENSORS; i++) {
      srcView[i] = rank < TRAINER_RANKS ? viewBytes(&tensors[i], tensors[i].src, rank) : 0;
      dstView[i] = rank >= TRAINER_RANKS ? viewBytes(&tensors[i], tensors[i].dst, rank) : 0;
      tensors[i].srcOffset = srcEnd;
      tensors[i].dstOffset = dstEnd;
      srcEnd += srcView[i];
      dstEnd += dstView[i];
    }

    ncclReshardPlan_t plan;
    NCCLCHECK(ncclReshardPlanCreate(&plan, NTENSORS, tensors, rank, &config));
    ncclReshardPlanInfo_t info = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
    NCCLCHECK(ncclReshardPlanGetInfo(plan, &info));

    int count = 0;
    NCCLCHECK(ncclReshardPlanGetTransfers(plan, NULL, 0, &count));
    ncclReshardTransfer_t* transfers = NULL;
    if (count > 0) {
      transfers = malloc((size_t)count * sizeof *transfers);
      if (transfers == NULL) {
        fprintf(stderr, "routing: out of memory\n");
        return EXIT_FAILURE;
      }
      const ncclReshardTransfer_t init = NCCL_RESHARD_TRANSFER_INITIALIZER;
      for (int i = 0; i < count; i++) transfers[i] = init;
      NCCLCHECK(ncclReshardPlanGetTransfers(plan, transfers, count, &count));
    }

    /* Tally the transfers, to check them against the info below. */
    uint64_t byKind[3] = {0, 0, 0};
    uint64_t recvByTensor[NTENSORS] = {0};
    for (int i = 0; i < count; i++) {
      if (transfers[i].kind < 0 || transfers[i].kind > 2 || transfers[i].tensor < 0 ||
          transfers[i].tensor >= NTENSORS) {
        fprintf(stderr, "rank %d: transfer %d has kind %d, tensor %d\n", rank, i,
                transfers[i].kind, transfers[i].tensor);
        return EXIT_FAILURE;
      }
      byKind[transfers[i].kind] += transfers[i].bytes;
      if (transfers[i].kind == ncclReshardTransferSend) sendTransfers++;
      if (transfers[i].kind == ncclReshardTransferRecv) {
        recvTransfers++;
        recvByTensor[transfers[i].tensor] += transfers[i].bytes;
      }
    }
    printf("\nrank %2d (%s): sends %" PRIu64 " bytes in %" PRId64 " messages, receives %" PRIu64
           " bytes in %" PRId64 " messages, copies %" PRIu64 " bytes; %d peers, %s, %d transfers\n",
           rank, rank < TRAINER_RANKS ? "trainer" : "inference", info.bytesSent, info.messagesSent,
           info.bytesReceived, info.messagesReceived, info.bytesCopied, info.peers,
           info.groupable ? "groupable" : "not groupable", count);
    for (int i = 0; i < count && i < TRANSFERS_SHOWN; i++) printTransfer(rank, &transfers[i]);
    if (count > TRANSFERS_SHOWN) printf("    ... and %d more transfers\n", count - TRANSFERS_SHOWN);

    /* The transfer list adds up to the info, kind by kind. */
    if (byKind[ncclReshardTransferSend] != info.bytesSent ||
        byKind[ncclReshardTransferRecv] != info.bytesReceived ||
        byKind[ncclReshardTransferLocal] != info.bytesCopied) {
      fprintf(stderr,
              "rank %d: transfers add up to %" PRIu64 " sent / %" PRIu64 " received / %" PRIu64
              " copied bytes, the info says %" PRIu64 " / %" PRIu64 " / %" PRIu64 "\n",
              rank, byKind[0], byKind[1], byKind[2], info.bytesSent, info.bytesReceived,
              info.bytesCopied);
      failures++;
    }

    /* An inference rank receives exactly its destination views, tensor by tensor, and a trainer
     * rank nothing (the meshes are disjoint, so nothing is copied locally either); the plan
     * addresses exactly the views. */
    for (int i = 0; i < NTENSORS; i++) {
      if (recvByTensor[i] != dstView[i]) {
        fprintf(stderr,
                "rank %d: receives %" PRIu64 " bytes of %s; its destination view has %" PRIu64 "\n",
                rank, recvByTensor[i], kTensors[i].name, dstView[i]);
        failures++;
      }
    }
    if (info.bytesReceived != dstEnd || info.bytesCopied != 0 || info.recvBytes != dstEnd ||
        info.sendBytes != srcEnd) {
      fprintf(stderr, "rank %d: receives %" PRIu64 " bytes, copies %" PRIu64 ", addresses %" PRIu64
              " source and %" PRIu64 " destination bytes; its views have %" PRIu64 " source and %"
              PRIu64 " destination bytes\n", rank, info.bytesReceived, info.bytesCopied,
              info.sendBytes, info.recvBytes, srcEnd, dstEnd);
      failures++;
    }

    if (rank == 0) fingerprint = info.fingerprint;
    if (info.fingerprint != fingerprint) {
      fprintf(stderr,
              "rank %d: plan fingerprint %016" PRIx64 " differs from rank 0's %016" PRIx64 "\n",
              rank, info.fingerprint, fingerprint);
      failures++;
    }
    totalSent += info.bytesSent;
    totalReceived += info.bytesReceived;
    totalCopied += info.bytesCopied;
    totalMessages += info.messagesSent;

    free(transfers);
    NCCLCHECK(ncclReshardPlanDestroy(plan));
  }

  if (totalSent != totalReceived) {
    fprintf(stderr, "ranks send %" PRIu64 " bytes in all but receive %" PRIu64 "\n", totalSent,
            totalReceived);
    failures++;
  }
  if (sendTransfers != recvTransfers) {
    fprintf(stderr, "ranks list %" PRId64 " send transfers but %" PRId64 " receive transfers\n",
            sendTransfers, recvTransfers);
    failures++;
  }

  printf("\ntotal: %" PRIu64 " bytes sent = %" PRIu64 " bytes received in %" PRId64
         " messages (%" PRId64 " transfers), %" PRIu64
         " copied locally; plan fingerprint %016" PRIx64 " on all %d ranks\n",
         totalSent, totalReceived, totalMessages, sendTransfers, totalCopied, fingerprint, NRANKS);
  if (failures > 0) {
    printf("routing: FAILED (%d checks)\n", failures);
    return EXIT_FAILURE;
  }
  printf("routing: OK\n");
  return EXIT_SUCCESS;
}
