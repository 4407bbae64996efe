// The header compiles on its own as C++17, with the initialisers, and declares C linkage.
#include <ncclReshard.h>

namespace {
ncclReshardLayout_t layout = NCCL_RESHARD_LAYOUT_INITIALIZER;
ncclReshardTensor_t tensor = NCCL_RESHARD_TENSOR_INITIALIZER;
ncclReshardConfig_t config = NCCL_RESHARD_CONFIG_INITIALIZER;
ncclReshardPlanInfo_t info = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
ncclReshardTransfer_t transfer = NCCL_RESHARD_TRANSFER_INITIALIZER;
}  // namespace

extern "C" int nr_header_cxx_sizes() {
  ncclResult_t (*create)(ncclReshardPlan_t*, int, const ncclReshardTensor_t*, int,
                         const ncclReshardConfig_t*) = ncclReshardPlanCreate;
  (void)create;
  return static_cast<int>(layout.size + tensor.size + config.size + info.size + transfer.size);
}
