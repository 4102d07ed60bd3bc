/* The one place a C kernel's instruction set family is chosen: the kernels include this header and are written
 * once over its primitives (isa_scalar.h lists them with their definitions), not over #if branches of their own.
 *
 * Family, from the compiler's target (kernels/_cbuild.py's level flags):
 *   ISA_NEON    aarch64 (every aarch64 CPU has NEON): isa_neon.h; with __ARM_FEATURE_DOTPROD (the
 *               armv8.2-a-dotprod level) its byte dot products use vdotq_s32, else widening multiplies.
 *   ISA_X86     x86-64 with SSSE3 + SSE4.1 (x86-64-v2 and up): isa_x86.h (SSSE3, AVX2, AVX-512 inside).
 *   ISA_SCALAR  anything else (the x86-64 baseline, or -DLLMSYS_NO_NEON on aarch64: the build a NEON build is
 *               measured and checked against): isa_scalar.h's plain C.
 *
 * Why one header per family and one #if here: every family must give the bits of the scalar definitions
 * (integer sums are exact in any order; float sums follow the fixed lane order written in isa_scalar.h,
 * built with -ffp-contract=off), so a kernel needs no per-ISA arithmetic of its own, and a new family is one
 * new header checked against isa_scalar.h (tests/isa_prims.c under qemu).
 */
#ifndef LLMSYS_ISA_H
#define LLMSYS_ISA_H

#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(LLMSYS_NO_NEON)
#define ISA_NEON 1
#elif defined(__x86_64__) && defined(__SSSE3__) && defined(__SSE4_1__)
#define ISA_X86 1
#else
#define ISA_SCALAR 1
#endif

#include "isa_scalar.h" /* the definitions (isa_ref_*), and the scalar family's primitives */
#if defined(ISA_NEON)
#include "isa_neon.h"
#elif defined(ISA_X86)
#include "isa_x86.h"
#endif

#endif
