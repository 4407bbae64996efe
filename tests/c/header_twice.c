/* Including the header twice is harmless (include guard). */
#include <ncclReshard.h>
#include <ncclReshard.h>

int nr_header_twice_version(void) { return NCCL_RESHARD_VERSION_CODE; }
