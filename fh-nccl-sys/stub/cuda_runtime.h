/* Stub for bindgen (cargo xtask nccl-bindings): what nccl.h needs from the real header. */
#include <stddef.h>
typedef struct CUstream_st *cudaStream_t;
#define CUDART_VERSION 0
