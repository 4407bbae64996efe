/* The NCCL test doubles' group depth where NCCL keeps it: a hidden thread-local int named
 * ncclGroupDepth, absent from the dynamic symbol table but named in the library's symbol table,
 * so libncclreshard finds it in the emulator and the loopback stand-in as it does in NVIDIA's
 * builds (src/transport/nccl/group_depth.rs). */
__attribute__((visibility("hidden"))) __thread int ncclGroupDepth = 0;

int* ncclReshardEmuGroupDepth(void) { return &ncclGroupDepth; }
