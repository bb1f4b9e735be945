// The AVX2+FMA copy of the flash kernels (float and double): the one every
// CPU this project builds for runs (attention_flash_isa.hpp).
#define LAGA_FLASH_NS flash_avx2
#include "kernels/attention_flash_impl.inc"
