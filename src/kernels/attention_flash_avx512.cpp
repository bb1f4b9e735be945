// The AVX-512 copy of the flash kernels, float only (attention_flash_isa.hpp).
// Compiled with the build's flags like every file; its own code, and only
// that, is compiled for AVX-512 F, VL, BW and DQ (attention_flash_simd.hpp
// says why not the whole file), and attention_flash.cpp runs it only on CPUs
// that have all four.
#define LAGA_FLASH_NS flash_avx512
#define LAGA_FLASH_AVX512
#include "kernels/attention_flash_impl.inc"
