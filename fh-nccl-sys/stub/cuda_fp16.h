/* Stub for bindgen (cargo xtask nccl-bindings): nccl.h includes it but uses none of it. */
