// IEEE half and bfloat16 conversions: the one definition in kernels/half.h, shared with the
// CUDA kernels so that host and device round alike.
#ifndef KVTIER_SERVER_COMMON_FP16_H_
#define KVTIER_SERVER_COMMON_FP16_H_

#include "kernels/half.h"

#endif  // KVTIER_SERVER_COMMON_FP16_H_
