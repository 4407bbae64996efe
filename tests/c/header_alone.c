/* The header compiles on its own (it includes what it needs) as C11. */
#include <ncclReshard.h>

ncclReshardLayout_t nr_layout_alone = NCCL_RESHARD_LAYOUT_INITIALIZER;
ncclReshardTensor_t nr_tensor_alone = NCCL_RESHARD_TENSOR_INITIALIZER;
ncclReshardConfig_t nr_config_alone = NCCL_RESHARD_CONFIG_INITIALIZER;
ncclReshardPlanInfo_t nr_info_alone = NCCL_RESHARD_PLAN_INFO_INITIALIZER;
ncclReshardTransfer_t nr_transfer_alone = NCCL_RESHARD_TRANSFER_INITIALIZER;
