// ops.cu: every engine op besides the batch-1 GEMV (gemv.cu), for the CUDA and HIP backends.
//
// Each kernel mirrors one `Backend` op of crates/ds4-engine/src/backend.rs and the CPU
// reference in crates/ds4-cpu (the scalar math of crates/ds4-engine/src/numerics.rs), in the
// same operation order where that order decides rounding (RMS sums in double, RoPE angles as
// an f32 product with cos/sin in double, the Sinkhorn iteration, top-k tie rules). Host code
// (crates/ds4-gpu/src/backend) checks every shape and range before a launch; kernels still
// never read or write outside what they are given. Inputs that only the device can see to be
// bad (a token id outside the table, an expert id outside the tensor) set a bit in the fault
// word and produce NaN, and the host reports the fault at its next synchronisation.
//
// All kernels use 1-D blocks and static shared memory only.
//
// This file is the ops module: the one program (NVRTC, hiprtc, the CPU emulation) made of
// the files below, in this order. Each file also compiles alone; what several of them use
// lives in ds4_ops.h.
#include "ds4_port.h"
#include "ds4_iq2xxs_tables.h"
#include "ds4_quant.h"
#include "ds4_ops.h"

#include "dequant.cu"
#include "norm_rope.cu"
#include "hc.cu"
#include "compressor.cu"
#include "indexer.cu"
#include "attention.cu"
#include "moe.cu"
#include "sampling.cu"
#include "prefill_mma.cu"
