/* transport: runs whole reshards from ncclReshardPlanGetTransfers alone, as a third-party
 * transport (NIXL, RDMA writes, ...) would, with memcpy between host buffers instead of NCCL and
 * GPUs.
 *
 * For each case it creates every rank's plan in one process and gives each rank a host
 * sendbuff and recvbuff holding its views of every tensor (at per-rank offsets, with gaps, some
 * views strided). Then it executes the transfer lists round by round, as the header's
 * execution rule allows: a rank starts the transfers of round r once its receives of earlier
 * rounds are done. Local copies run first (round 0). Each send packs its bytes into a message
 * read from the view its srcView names: the source view, or the destination view for a
 * forward (relays). The message goes to the peer, whose matching receive (the next one from
 * that sender in that round, with the same fields) unpacks it into its destination view.
 * Finally every byte of every recvbuff is checked: each destination element holds its value,
 * and every other byte (gaps between views, padding of strided views) is untouched.
 *
 * Cases: a groupable plan, a staged plan of several rounds with colocated ranks, and two auto
 * plans with ranksPerNode whose data is relayed over several rounds. Prints one line per case
 * and "transport: OK", exit 0; anything wrong is printed and the exit status is 1. */
#include "common.h"

#include <inttypes.h>
#include <stdint.h>
#include <string.h>

#define MAX_RANKS 16
#define MAX_TENSORS 3
#define VIEW_GAP 13 /* bytes between views in a buffer, to catch writes past a view */

/* One rank's view of one tensor: local shape, element strides, and the global index of each
 * local position per dim (from ncclReshardLocalShape's runs). */
typedef struct {
  int present;
  int64_t local[NCCL_RESHARD_MAX_DIMS];
  int64_t strides[NCCL_RESHARD_MAX_DIMS];
  int64_t* globalOf[NCCL_RESHARD_MAX_DIMS];
  size_t extent; /* bytes from the first element to one past the last */
} View;

typedef struct {
  View src[MAX_TENSORS], dst[MAX_TENSORS];
  size_t srcOffset[MAX_TENSORS], dstOffset[MAX_TENSORS];
  unsigned char* sendbuff;
  unsigned char* recvbuff;
  size_t sendBytes, recvBytes;
  ncclReshardTransfer_t* transfers;
  int count;
} Rank;

/* A message in flight from one rank to another: the send it came from and its bytes. */
typedef struct Message {
  const ncclReshardTransfer_t* send;
  unsigned char* bytes;
  struct Message* next;
} Message;

static int failures = 0;

#define FAIL(...)                     \
  do {                                \
    fprintf(stderr, "transport: ");   \
    fprintf(stderr, __VA_ARGS__);     \
    fprintf(stderr, "\n");            \
    failures++;                       \
  } while (0)

static void* checkedAlloc(size_t bytes) {
  void* p = calloc(bytes > 0 ? bytes : 1, 1);
  if (p == NULL) {
    fprintf(stderr, "transport: out of memory\n");
    exit(EXIT_FAILURE);
  }
  return p;
}

/* The byte b of element `global` (row-major linear index) of tensor t: a hash, so a misplaced
 * element almost never matches by chance. */
static unsigned char elementByte(int t, uint64_t global, int b) {
  uint64_t z = global ^ ((uint64_t)t << 56) ^ 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (unsigned char)(z >> (8 * b));
}

/* What a byte outside every element holds before and after. */
static unsigned char sentinel(int rank, size_t offset) {
  return (unsigned char)(0xa5u ^ (unsigned)(offset * 31u) ^ (unsigned)(rank * 7u));
}

static int inMesh(const ncclReshardLayout_t* l, int rank) {
  int64_t size = 1;
  for (int a = 0; a < l->meshNdim; a++) size *= l->meshShape[a];
  return rank >= l->firstRank && rank < l->firstRank + size;
}

/* Steps a row-major multi-index below `limit`; returns 0 after the last. */
static int nextIndex(int64_t* index, const int64_t* limit, int n) {
  for (int d = n - 1; d >= 0; d--) {
    if (++index[d] < limit[d]) return 1;
    index[d] = 0;
  }
  return 0;
}

static void makeView(const ncclReshardTensor_t* t, const ncclReshardLayout_t* l, int rank,
                     View* v) {
  memset(v, 0, sizeof *v);
  if (!inMesh(l, rank)) return;
  v->present = 1;
  int runsPerDim[NCCL_RESHARD_MAX_DIMS];
  NCCLCHECK(ncclReshardLocalShape(l, t->ndim, t->shape, rank, v->local, NULL, 0, runsPerDim));
  int total = 0;
  for (int d = 0; d < t->ndim; d++) total += runsPerDim[d];
  int64_t* runs = checkedAlloc(2 * (size_t)total * sizeof *runs);
  if (total > 0) {
    NCCLCHECK(ncclReshardLocalShape(l, t->ndim, t->shape, rank, v->local, runs, total, runsPerDim));
  }
  const int64_t* run = runs;
  int empty = 0;
  for (int d = 0; d < t->ndim; d++) {
    v->globalOf[d] = checkedAlloc((size_t)v->local[d] * sizeof(int64_t));
    int64_t at = 0;
    for (int k = 0; k < runsPerDim[d]; k++, run += 2) {
      for (int64_t i = run[0]; i < run[1]; i++) v->globalOf[d][at++] = i;
    }
    if (v->local[d] == 0) empty = 1;
  }
  free(runs);
  int64_t step = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    v->strides[d] = l->strides != NULL ? l->strides[d] : step;
    step *= v->local[d];
  }
  int64_t last = 0;
  for (int d = 0; d < t->ndim; d++) last += (v->local[d] - 1) * v->strides[d];
  v->extent = empty ? 0 : (size_t)(last + 1) * dtypeSize(t->dtype);
}

static void freeView(const ncclReshardTensor_t* t, View* v) {
  for (int d = 0; d < t->ndim; d++) free(v->globalOf[d]);
}

/* Writes every element of view `v` of tensor `ti` into `base` (the view's first byte). */
static void writeElements(const ncclReshardTensor_t* t, int ti, const View* v, unsigned char* base) {
  if (!v->present || v->extent == 0) return;
  size_t es = dtypeSize(t->dtype);
  int64_t globalStride[NCCL_RESHARD_MAX_DIMS], pos[NCCL_RESHARD_MAX_DIMS] = {0};
  int64_t step = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    globalStride[d] = step;
    step *= t->shape[d];
  }
  do {
    int64_t offset = 0, global = 0;
    for (int d = 0; d < t->ndim; d++) {
      offset += pos[d] * v->strides[d];
      global += v->globalOf[d][pos[d]] * globalStride[d];
    }
    for (size_t b = 0; b < es; b++) {
      base[(size_t)offset * es + b] = elementByte(ti, (uint64_t)global, (int)b);
    }
  } while (nextIndex(pos, v->local, t->ndim));
}

/* What `walk` does with each chunk of a transfer's grid: its offset in the sender's view, in
 * the receiver's view and in the message. */
typedef void (*ChunkFn)(const ncclReshardTransfer_t* t, size_t src, size_t dst, size_t wire,
                        unsigned char* view, unsigned char* message);

static void packChunk(const ncclReshardTransfer_t* t, size_t src, size_t dst, size_t wire,
                      unsigned char* view, unsigned char* message) {
  (void)dst;
  memcpy(message + wire, view + src, (size_t)t->chunkBytes);
}

static void unpackChunk(const ncclReshardTransfer_t* t, size_t src, size_t dst, size_t wire,
                        unsigned char* view, unsigned char* message) {
  (void)src;
  memcpy(view + dst, message + wire, (size_t)t->chunkBytes);
}

/* Packs (`f` = packChunk, `view` the sender's view) or unpacks (`f` = unpackChunk, `view` the
 * receiver's destination view) one transfer, chunk by chunk in grid order, after checking that
 * its bytes stay inside the view (`extent` bytes). Returns 0, having copied nothing, when they
 * do not. */
static int walk(const ncclReshardTransfer_t* t, ChunkFn f, unsigned char* view, size_t extent,
                unsigned char* message) {
  int sending = f == packChunk;
  uint64_t reach = (sending ? t->srcOffset : t->dstOffset) + t->chunkBytes;
  uint64_t total = t->chunkBytes;
  for (int k = 0; k < t->copyNdim; k++) {
    reach += (uint64_t)(t->count[k] - 1) * (uint64_t)(sending ? t->srcStride[k] : t->dstStride[k]);
    total *= (uint64_t)t->count[k];
  }
  if (reach > extent || total != t->bytes) {
    FAIL("a transfer of tensor %d (%" PRIu64 " bytes) reaches byte %" PRIu64
         " of a %zu-byte view or its grid has %" PRIu64 " bytes",
         t->tensor, t->bytes, reach, extent, total);
    return 0;
  }
  int64_t index[NCCL_RESHARD_MAX_DIMS] = {0};
  size_t wire = 0;
  do {
    int64_t src = (int64_t)t->srcOffset, dst = (int64_t)t->dstOffset;
    for (int k = 0; k < t->copyNdim; k++) {
      src += index[k] * t->srcStride[k];
      dst += index[k] * t->dstStride[k];
    }
    f(t, (size_t)src, (size_t)dst, wire, view, message);
    wire += (size_t)t->chunkBytes;
  } while (nextIndex(index, t->count, t->copyNdim));
  return 1;
}

/* The view a sender's transfer reads, and its extent. */
static unsigned char* senderView(Rank* r, const ncclReshardTransfer_t* t, size_t* extent) {
  if (t->srcView == ncclReshardViewDestination) {
    *extent = r->dst[t->tensor].extent;
    return r->recvbuff + r->dstOffset[t->tensor];
  }
  *extent = r->src[t->tensor].extent;
  return r->sendbuff + r->srcOffset[t->tensor];
}

/* True when a send and a receive describe the same bytes (all fields but kind and peer). */
static int sameTransfer(const ncclReshardTransfer_t* a, const ncclReshardTransfer_t* b) {
  if (a->tensor != b->tensor || a->ndim != b->ndim || a->round != b->round ||
      a->srcView != b->srcView || a->srcOffset != b->srcOffset || a->dstOffset != b->dstOffset ||
      a->chunkBytes != b->chunkBytes || a->copyNdim != b->copyNdim || a->bytes != b->bytes ||
      a->blockOffset != b->blockOffset || a->blockBytes != b->blockBytes) {
    return 0;
  }
  for (int d = 0; d < a->ndim; d++) {
    if (a->globalStart[d] != b->globalStart[d] || a->globalCount[d] != b->globalCount[d]) return 0;
  }
  for (int k = 0; k < a->copyNdim; k++) {
    if (a->count[k] != b->count[k] || a->srcStride[k] != b->srcStride[k] ||
        a->dstStride[k] != b->dstStride[k]) {
      return 0;
    }
  }
  return 1;
}

/* Per (sender, receiver): messages sent and not yet received, oldest first. */
static Message* queueHead[MAX_RANKS][MAX_RANKS];
static Message* queueTail[MAX_RANKS][MAX_RANKS];

static void post(int from, int to, const ncclReshardTransfer_t* send, unsigned char* bytes) {
  Message* m = checkedAlloc(sizeof *m);
  m->send = send;
  m->bytes = bytes;
  if (queueTail[from][to] != NULL) {
    queueTail[from][to]->next = m;
  } else {
    queueHead[from][to] = m;
  }
  queueTail[from][to] = m;
}

static Message* take(int from, int to) {
  Message* m = queueHead[from][to];
  if (m != NULL) {
    queueHead[from][to] = m->next;
    if (queueHead[from][to] == NULL) queueTail[from][to] = NULL;
  }
  return m;
}

typedef struct {
  int sends, locals, forwards, pieces;
  uint64_t bytes;
} Tally;

/* Runs one round on every rank: local copies (round 0 only), then every send (packed into a
 * message to its peer), then every receive (unpacked from the next message of that sender).
 * By now every receive of the earlier rounds has completed on every rank. */
static void runRound(Rank* ranks, int nranks, int round, Tally* tally) {
  for (int r = 0; r < nranks; r++) {
    for (int i = 0; i < ranks[r].count; i++) {
      const ncclReshardTransfer_t* t = &ranks[r].transfers[i];
      if (t->round != round || t->kind != ncclReshardTransferLocal) continue;
      if (t->round != 0 || t->srcView != ncclReshardViewSource) {
        FAIL("rank %d: a local copy in round %d reading view %d", r, t->round, t->srcView);
        continue;
      }
      unsigned char* message = checkedAlloc((size_t)t->bytes);
      size_t extent;
      unsigned char* from = senderView(&ranks[r], t, &extent);
      if (walk(t, packChunk, from, extent, message)) {
        walk(t, unpackChunk, ranks[r].recvbuff + ranks[r].dstOffset[t->tensor],
             ranks[r].dst[t->tensor].extent, message);
      }
      free(message);
      tally->bytes += t->bytes;
      tally->locals++;
    }
  }
  for (int r = 0; r < nranks; r++) {
    for (int i = 0; i < ranks[r].count; i++) {
      const ncclReshardTransfer_t* t = &ranks[r].transfers[i];
      if (t->round != round || t->kind != ncclReshardTransferSend) continue;
      if (t->peer < 0 || t->peer >= nranks) {
        FAIL("rank %d sends to rank %d", r, t->peer);
        continue;
      }
      unsigned char* message = checkedAlloc((size_t)t->bytes);
      size_t extent;
      unsigned char* from = senderView(&ranks[r], t, &extent);
      walk(t, packChunk, from, extent, message);
      post(r, t->peer, t, message);
      tally->bytes += t->bytes;
      tally->sends++;
      if (t->srcView == ncclReshardViewDestination) tally->forwards++;
      if (t->bytes < t->blockBytes) tally->pieces++;
    }
  }
  for (int r = 0; r < nranks; r++) {
    for (int i = 0; i < ranks[r].count; i++) {
      const ncclReshardTransfer_t* t = &ranks[r].transfers[i];
      if (t->round != round || t->kind != ncclReshardTransferRecv) continue;
      Message* m = t->peer >= 0 && t->peer < nranks ? take(t->peer, r) : NULL;
      if (m == NULL) {
        FAIL("rank %d: no send from rank %d matches its receive of round %d", r, t->peer, round);
        continue;
      }
      if (!sameTransfer(m->send, t)) {
        FAIL("rank %d: its receive from rank %d in round %d differs from the send", r, t->peer,
             round);
      } else {
        walk(t, unpackChunk, ranks[r].recvbuff + ranks[r].dstOffset[t->tensor],
             ranks[r].dst[t->tensor].extent, m->bytes);
      }
      free(m->bytes);
      free(m);
    }
  }
  for (int from = 0; from < nranks; from++) {
    for (int to = 0; to < nranks; to++) {
      Message* m;
      while ((m = take(from, to)) != NULL) {
        FAIL("round %d: rank %d sent rank %d a message it does not receive", round, from, to);
        free(m->bytes);
        free(m);
      }
    }
  }
}

/* Plans, executes and verifies one case. `expectForwards` / `expectRounds`: the case must
 * relay data / take several rounds (else it would not test what it says). */
static void runCase(const char* name, int ntensors, ncclReshardTensor_t* tensors,
                    const ncclReshardConfig_t* config, int nranks, int expectForwards,
                    int expectRounds) {
  int failuresBefore = failures;
  Rank* ranks = checkedAlloc((size_t)nranks * sizeof *ranks);
  for (int r = 0; r < nranks; r++) {
    Rank* rank = &ranks[r];
    /* Views one after another, VIEW_GAP bytes apart (and after a first gap). */
    size_t srcAt = VIEW_GAP, dstAt = VIEW_GAP;
    for (int t = 0; t < ntensors; t++) {
      makeView(&tensors[t], tensors[t].src, r, &rank->src[t]);
      makeView(&tensors[t], tensors[t].dst, r, &rank->dst[t]);
      rank->srcOffset[t] = srcAt;
      rank->dstOffset[t] = dstAt;
      srcAt += rank->src[t].extent + VIEW_GAP;
      dstAt += rank->dst[t].extent + VIEW_GAP;
      tensors[t].srcOffset = rank->srcOffset[t];
      tensors[t].dstOffset = rank->dstOffset[t];
    }
    rank->sendBytes = srcAt;
    rank->recvBytes = dstAt;
    rank->sendbuff = checkedAlloc(srcAt);
    rank->recvbuff = checkedAlloc(dstAt);
    for (size_t o = 0; o < srcAt; o++) rank->sendbuff[o] = sentinel(r, o);
    for (size_t o = 0; o < dstAt; o++) rank->recvbuff[o] = sentinel(r, o);
    for (int t = 0; t < ntensors; t++) {
      writeElements(&tensors[t], t, &rank->src[t], rank->sendbuff + rank->srcOffset[t]);
    }

    ncclReshardPlan_t plan;
    NCCLCHECK(ncclReshardPlanCreate(&plan, ntensors, tensors, r, config));
    NCCLCHECK(ncclReshardPlanGetTransfers(plan, NULL, 0, &rank->count));
    rank->transfers = checkedAlloc((size_t)rank->count * sizeof *rank->transfers);
    const ncclReshardTransfer_t init = NCCL_RESHARD_TRANSFER_INITIALIZER;
    for (int i = 0; i < rank->count; i++) rank->transfers[i] = init;
    NCCLCHECK(ncclReshardPlanGetTransfers(plan, rank->transfers, rank->count, &rank->count));
    NCCLCHECK(ncclReshardPlanDestroy(plan));
  }

  Tally tally = {0, 0, 0, 0, 0};
  int lastRound = 0;
  for (int r = 0; r < nranks; r++) {
    for (int i = 0; i < ranks[r].count; i++) {
      const ncclReshardTransfer_t* t = &ranks[r].transfers[i];
      if (t->round > lastRound) lastRound = t->round;
      if (i > 0 && t->round < ranks[r].transfers[i - 1].round) {
        FAIL("rank %d: transfers are not listed by round", r);
      }
    }
  }
  for (int round = 0; round <= lastRound; round++) runRound(ranks, nranks, round, &tally);

  /* Every recvbuff byte: element values inside the views, sentinels everywhere else. */
  uint64_t checked = 0;
  for (int r = 0; r < nranks; r++) {
    unsigned char* want = checkedAlloc(ranks[r].recvBytes);
    for (size_t o = 0; o < ranks[r].recvBytes; o++) want[o] = sentinel(r, o);
    for (int t = 0; t < ntensors; t++) {
      writeElements(&tensors[t], t, &ranks[r].dst[t], want + ranks[r].dstOffset[t]);
    }
    for (size_t o = 0; o < ranks[r].recvBytes; o++) {
      if (ranks[r].recvbuff[o] != want[o]) {
        FAIL("%s: rank %d recvbuff byte %zu is %02x, expected %02x", name, r, o,
             ranks[r].recvbuff[o], want[o]);
        break;
      }
    }
    checked += ranks[r].recvBytes;
    free(want);
  }
  if (expectForwards && tally.forwards == 0) FAIL("%s: no transfer forwards relayed data", name);
  if (expectRounds && lastRound == 0) FAIL("%s: everything ran in round 0", name);

  printf("%s: %d ranks, rounds 0..%d, %d sends (%d forwards, %d pieces of cut blocks) + %d local "
         "copies, %" PRIu64 " bytes; %" PRIu64 " recvbuff bytes checked: %s\n",
         name, nranks, lastRound, tally.sends, tally.forwards, tally.pieces, tally.locals,
         tally.bytes, checked, failures == failuresBefore ? "OK" : "FAILED");

  for (int r = 0; r < nranks; r++) {
    for (int t = 0; t < ntensors; t++) {
      freeView(&tensors[t], &ranks[r].src[t]);
      freeView(&tensors[t], &ranks[r].dst[t]);
    }
    free(ranks[r].sendbuff);
    free(ranks[r].recvbuff);
    free(ranks[r].transfers);
  }
  free(ranks);
}

static ncclReshardTensor_t tensor2(int64_t rows, int64_t cols, ncclDataType_t dtype,
                                   const ncclReshardLayout_t* src, const ncclReshardLayout_t* dst) {
  ncclReshardTensor_t t = NCCL_RESHARD_TENSOR_INITIALIZER;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.dtype = dtype;
  t.src = src;
  t.dst = dst;
  return t;
}

/* Groupable: TP2 -> TP1 of a [64, 48] weight (each destination row interleaves both sources)
 * into the left half of a padded [64, 96] buffer, a column-major source view, and a vector. */
static void groupableCase(void) {
  const int64_t two[1] = {2}, one[1] = {1};
  static const int64_t padded[2] = {96, 1}, columnMajor[2] = {1, 16};
  ncclReshardLayout_t tp2 = meshLayout(1, two, 0, (ncclReshardPlacement_t[]){shard(1)});
  ncclReshardLayout_t rows = meshLayout(1, two, 0, (ncclReshardPlacement_t[]){shard(0)});
  rows.strides = columnMajor;
  ncclReshardLayout_t both = meshLayout(1, two, 0, (ncclReshardPlacement_t[]){replicate()});
  ncclReshardLayout_t tp1 = meshLayout(1, one, 2, (ncclReshardPlacement_t[]){replicate()});
  ncclReshardLayout_t tp1Padded = tp1;
  tp1Padded.strides = padded;
  ncclReshardTensor_t tensors[3];
  tensors[0] = tensor2(64, 48, ncclBfloat16, &tp2, &tp1Padded);
  tensors[1] = tensor2(32, 40, ncclFloat32, &rows, &tp1);
  tensors[2] = tensor2(1, 48, ncclFloat32, &both, &tp1);
  tensors[2].ndim = 1;
  tensors[2].shape[0] = 48;
  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = ncclReshardModeGroupable;
  runCase("groupable, TP2 -> TP1, strided views", 3, tensors, &config, 3, 0, 0);
}

/* Staged, 3 rounds: three tensors among four ranks that hold both sides (local copies), with
 * padded destination views; small chunks cut blocks at byte positions. */
static void stagedCase(void) {
  const int64_t four[1] = {4}, twoByTwo[2] = {2, 2}, two[1] = {2};
  static const int64_t padded16[2] = {16, 1}, padded20[2] = {20, 1};
  ncclReshardLayout_t aSrc =
      meshLayout(2, twoByTwo, 0, (ncclReshardPlacement_t[]){replicate(), shard(0)});
  ncclReshardLayout_t aDst = meshLayout(1, four, 0, (ncclReshardPlacement_t[]){shard(1)});
  aDst.strides = padded16;
  ncclReshardLayout_t bSrc = meshLayout(1, four, 0, (ncclReshardPlacement_t[]){shard(0)});
  ncclReshardLayout_t bDst =
      meshLayout(2, twoByTwo, 0, (ncclReshardPlacement_t[]){shard(1), replicate()});
  bDst.strides = padded20;
  ncclReshardLayout_t cSrc = meshLayout(1, two, 2, (ncclReshardPlacement_t[]){shard(0)});
  ncclReshardLayout_t cDst = meshLayout(1, four, 0, (ncclReshardPlacement_t[]){replicate()});
  ncclReshardTensor_t tensors[3];
  tensors[0] = tensor2(64, 32, ncclFloat16, &aSrc, &aDst);
  tensors[1] = tensor2(33, 17, ncclInt8, &bSrc, &bDst);
  tensors[2] = tensor2(128, 1, ncclFloat64, &cSrc, &cDst);
  tensors[2].ndim = 1;
  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = ncclReshardModeStaged;
  config.rounds = 3;
  config.splitMinBytes = 16;
  runCase("staged, 3 rounds, colocated, strided views", 3, tensors, &config, 4, 0, 1);
}

/* Auto mode with a topology (relays on by default) and `rounds` rounds of chunks of at least
 * `splitMinBytes`. */
static ncclReshardConfig_t relayConfig(int ranksPerNode, int rounds, size_t splitMinBytes) {
  ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
  config.mode = ncclReshardModeAuto;
  config.ranksPerNode = ranksPerNode;
  config.rounds = rounds;
  config.splitMinBytes = splitMinBytes;
  return config;
}

/* Auto, relayed: TP2 on ranks 0-1 -> TP2 x DP4 on ranks 8-15 with 4 ranks per node, so each
 * destination node holds two replicas of each shard: data crosses to one of them and is
 * forwarded to the other in the next round. The second weight lands in half of a fused view. */
static void relayedCase(void) {
  const int64_t two[1] = {2}, dp4tp2[2] = {4, 2};
  static const int64_t fused[2] = {128, 1};
  ncclReshardLayout_t tp2 = meshLayout(1, two, 0, (ncclReshardPlacement_t[]){shard(1)});
  ncclReshardLayout_t infer =
      meshLayout(2, dp4tp2, 8, (ncclReshardPlacement_t[]){replicate(), shard(0)});
  ncclReshardLayout_t inferFused = infer;
  inferFused.strides = fused;
  ncclReshardTensor_t tensors[2];
  tensors[0] = tensor2(96, 64, ncclBfloat16, &tp2, &infer);
  tensors[1] = tensor2(96, 64, ncclBfloat16, &tp2, &inferFused);
  ncclReshardConfig_t config = relayConfig(4, 3, 64);
  runCase("auto, relayed, TP2 -> TP2xDP4, 4 per node, 3 rounds", 2, tensors, &config, 16, 1, 1);
}

/* Auto, relayed on one node: TP1 on rank 0 -> DP8 on ranks 8-15 (one node of 8), into the
 * left half of a fused [40, 48] buffer, over 4 rounds. */
static void relayedFusedCase(void) {
  const int64_t one[1] = {1}, eight[1] = {8};
  static const int64_t fused[2] = {48, 1};
  ncclReshardLayout_t tp1 = meshLayout(1, one, 0, (ncclReshardPlacement_t[]){replicate()});
  ncclReshardLayout_t dp8 = meshLayout(1, eight, 8, (ncclReshardPlacement_t[]){replicate()});
  dp8.strides = fused;
  ncclReshardTensor_t tensors[1];
  tensors[0] = tensor2(40, 24, ncclFloat32, &tp1, &dp8);
  ncclReshardConfig_t config = relayConfig(8, 4, 32);
  runCase("auto, relayed, TP1 -> DP8 fused view, 4 rounds", 1, tensors, &config, 16, 1, 1);
}

int main(void) {
  groupableCase();
  stagedCase();
  relayedCase();
  relayedFusedCase();
  if (failures > 0) {
    printf("transport: FAILED (%d checks)\n", failures);
    return EXIT_FAILURE;
  }
  printf("transport: OK\n");
  return EXIT_SUCCESS;
}
