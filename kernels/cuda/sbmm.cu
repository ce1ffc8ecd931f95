// SBMM over stacks in the mma layout (deltazip/kernels/mma_layout.py): y[r] (+)= x[r] @ W[slot(r)]^T.
//
// Host side: deltazip/kernels/cuda_sbmm.py (plans, launch, split-K workspace); compiled at first use
// by NVRTC (deltazip/kernels/cuda_rtc.py) with these macros:
//   BITS    code width: 2, 3, 4 or 8 (3: two bit planes per tile, the low two bits as the 2-bit layout
//           and the high bit as a 1-bit one; see mma_layout.py)
//   BF16    activations bf16 (else fp16)
//   ASYM    explicit fp16 zero points per group (else 2**(BITS-1))
//   GK16    16-column mma steps per quantization group when a group is narrower than a 128-column tile
//           (1, 2 or 4); 8 when a group spans whole tiles (2**group_shift of them, or the whole row)
//   GDIV    (only for groups of whole tiles that are not a power of two of them, e.g. 384 columns) the
//           kernel's group_shift argument holds the tiles per group, divided by rather than shifted
//   RB      64-row weight blocks per CTA (1 or 2): 4 / MT warps each
//   STAGES  depth of the cp.async pipeline (>= 2)
//   KT      128-column K tiles per pipeline stage (1 or 2: 2 halves the loop's fixed work per weight)
//   MT      16-row weight tiles per warp (1 or 2, 2 at 2 and 4 bits): each activation fragment a warp
//           reads from shared memory feeds MT tiles' MMAs (4 RB / MT warps per CTA)
//   KCOLS   (only when in_features is not a multiple of 128) in_features, a multiple of 8: the layout pads
//           the last K tile (code 0; groups narrower than a tile past the row scale 0) and the kernel
//           zero-fills the activations from column KCOLS on, so the padding adds exactly 0
//   SP24    (only for the compact 2:4 layout, deltazip/kernels/mma_sparse.py; 3, 4 and 8 bits, groups of 32
//           columns or more) the two kept codes of every four columns and their positions: the sparse MMA
//           (mma.sp m16n8k32) multiplies them, reading bits / 2 + 1 bits per weight instead of bits
//   STREAMK (the stream-k preview) one wave of persistent CTAs shares the (row tile, 64-row block, K stage)
//           work evenly: each CTA takes a contiguous run of stages, which may cut units anywhere; a unit
//           cut between CTAs is summed through the split-K workspace by its last CTA to finish
//   PDL     (the pdl preview, sm_90+) launched as a programmatic dependent: the CTAs are resident and
//           wait in griddepcontrol.wait for the previous kernel's results, so the launch and the CTAs'
//           start overlap that kernel's tail; the kernel lets its own dependents launch at once
//   EVICT   (the evict-first preview) the weight copies carry an L2 evict-first policy: the codes are read
//           once per step, and the activations and outputs that other kernels read next stay in L2
// No CUDA header is included (NVRTC needs none): every fp16/bf16 operation is inline PTX.
//
// Why it is shaped like this (docs/kernels.md has the measurements):
// - weights are the A operand of mma.sync m16n8k16 ("swap AB": y^T = W x^T), so 16 output features per
//   warp and up to 16 activation rows per tile (two n8 tiles) share every weight byte;
// - the mma layout stores each thread's codes contiguously, so a stage of one 64x128 tile is one
//   contiguous 1024*BITS-byte copy (16-byte cp.async, coalesced), read back by each thread as its own
//   16-byte (8 at 2 bits) vector: no bank conflict, no shuffle;
// - scales (and zero points) of a tile travel in the same stage as its codes, and so do the tile's
//   activations (its own rows of 16 x 128 columns; rows past the tile's count are not copied), read
//   into mma B fragments by ldmatrix from rows padded to 272 bytes (8 rows at distinct banks);
// - shared memory, not DRAM, can bound the loop: every warp reads the stage's activations again (4 warps
//   x 8 k16 steps x 512 bytes of x4 ldmatrix = 16 KiB per 64-row block and stage, against 1 KiB x BITS
//   of codes); at 2 bits that outlasts the stage's share of an H100's DRAM time. So a stage's compute
//   is built twice in the loop: tiles of more than 8 rows use x4 ldmatrix and two n8 MMAs per k16 step,
//   tiles of 8 rows or fewer (most decode tiles) x2 and one, half the reads;
// - a CTA reads its tile's slot, first row and row count at once, then its row indices and whether the
//   stack holds the slot at once, and sends the first stages' weight copies before the barrier that
//   shares the rows: two rounds of global reads before the weights stream;
// - codes are dequantized in registers straight into the A fragment: one LOP3 turns two codes into
//   two fp16 (bf16) numbers 1024 + q (128 + q), one packed subtract makes them the exact integers q - z;
//   the fp32 group scale multiplies each group's fp32 partial product, so the result is the reference's
//   up to fp32 summation order;
// - split-K partials are reduced in the kernel: each split stores its fp32 partials in its own
//   workspace slice, the last CTA of a tile (a per-tile counter) sums them in split order, writes the
//   output and resets the counter, so a call is one launch and a CUDA graph can replay it.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define NWARPS (4 * RB / MT)
#define NTHREADS (32 * NWARPS)
#define BM 16                          // activation rows per tile

#ifndef SP24
#define SP24 0
#endif
#define XS (128 * KT + 8)              // halves per staged activation row (+8: ldmatrix rows on distinct banks)
#if SP24 && BITS == 3
#define RUN 2                          // the low-bit plane's word of each row half (one 8-byte load)
#define HV 1
#define PPW 8                          // all 8 pairs of a row half in one low-plane word
#define NWA 1
#elif SP24
#define RUN 4                          // a thread's words of a tile (both row halves) in runs of four
#define HV (BITS / 4)
#define PPW (16 / BITS)
#define NWA (BITS / 2)                 // words of a row half: 8 pairs (two per k32 step)
#elif BITS == 3
#define RUN 2                          // the 2-bit plane's two words of a thread-row (one 8-byte load)
#define HV 1
#define PPW 8                          // pairs per 2-bit-plane word (the 1-bit plane's word holds all 16)
#define NWA 2                          // words of a thread-row that the pair loop walks
#else
#define RUN (BITS < 4 ? BITS : 4)      // words of one thread-row stored together (one vector load)
#define HV (BITS / RUN)
#define PPW (16 / BITS)                // pairs of codes per word
#define NWA BITS
#endif
#if SP24
#define TILE_WORDS (128 * BITS + 256)  // one 64 x 128 tile: the kept codes, then the mma.sp metadata
#else
#define TILE_WORDS (256 * BITS)        // one 64 x 128 tile
#endif
#define TILE_PIECES (TILE_WORDS / 4)   // its 16-byte pieces
#define SG (GK16 < 8 ? 8 / GK16 : 1)   // quantization groups in one tile
#define W_BYTES (RB * KT * TILE_WORDS * 4)  // [rb][u]: a block's KT tiles are contiguous in memory too
#define S_HALVES (RB * KT * SG * 64)          // [rb][u][group][64 rows]
#define Z_HALVES (ASYM ? S_HALVES : 0)
#define X_HALVES (BM * XS)
#define STAGE_BYTES (W_BYTES + (S_HALVES + Z_HALVES + X_HALVES) * 2)
// CTAs per SM the register budget is cut for: what the pipeline's shared memory allows (SMEM_SM bytes per
// SM, 1 KiB of it reserved per CTA: the same count as cuda_sbmm.ctas_per_sm, so that the occupancy the
// tuner's model assumes is the one the compiler's register budget guarantees),
// at most 4 of 8 warps (RB 2) or 6 of 4 warps, fewer at 8 bits (more registers per code word); with two
// tiles per warp (twice the accumulators and codes per thread) 128 registers: 4 CTAs of 4 warps, 8 of 2;
// groups narrower than a tile (a flush, and with zero points a load, every few k16 steps) need a few
// more: 3 CTAs of 8 warps, and with groups of 32 columns or fewer 5 of 4 warps; two tiles per warp with
// such groups over 128; groups of 16 columns (a flush every mma step) 2 CTAs of 8 warps or of two-tile
// warps, 4 of 4 warps or of 2 two-tile warps (the offline test compiles every launch config and finds
// no spill)
#ifndef SMEM_SM
#define SMEM_SM 233472                 // an H100/H200's 228 KiB
#endif
#define SMEM_CTAS (SMEM_SM / (STAGES * STAGE_BYTES + 1024))
#define REG_CTAS (GK16 == 1 ? (RB == 2 ? 2 : 4) \
                  : MT == 2 ? (RB == 2 ? (GK16 < 4 ? 3 : 4) : (GK16 < 4 ? 6 : 8)) \
                  : RB == 2 ? (BITS == 8 || GK16 < 8 ? 3 : 4) : (BITS == 8 || GK16 < 4 ? 5 : 6))
#define MIN_CTAS (SMEM_CTAS < 1 ? 1 : (SMEM_CTAS < REG_CTAS ? SMEM_CTAS : REG_CTAS))
#if BF16 && BITS < 8
#define MAGIC 0x43004300u              // bf16 128.0 twice: OR-ing q < 128 into the mantissa gives 128 + q
#define MANT 7                         // mantissa bits of the magic number's dtype
#define MVAL 128
#else
#define MAGIC 0x64006400u              // fp16 1024.0 twice: 1024 + q for q < 1024
#define MANT 10
#define MVAL 1024
#endif

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void cp16(u32 dst, const void* src, int bytes) {
  // bytes 0 zero-fills the 16 destination bytes (rows past the tile's end, blocks past the matrix)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
#ifndef EVICT
#define EVICT 0
#endif
#if EVICT
// The weights' copies: cp16 with an L2 evict-first cache policy (policy: createpolicy's 64-bit value).
__device__ __forceinline__ void cp16_hint(u32 dst, const void* src, int bytes, unsigned long long policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(bytes),
               "l"(policy));
}
#define CP16W(dst, src, bytes) cp16_hint(dst, src, bytes, wpolicy)
#else
#define CP16W(dst, src, bytes) cp16(dst, src, bytes)
#endif
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ float h2f(u16 v) {
  float f;
  asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
  return f;
}

// Pair j of a thread-row word sits at bit BITS * j of each 16-bit half. Dequantizing it takes one LOP3
// that ORs the two codes into the mantissas of MAGIC, in place when they fit below the mantissa's top
// (`place` = their bit offset, the word shifted by whole bytes only), else shifted down to bit 0 first;
// then one packed FMA: (MVAL + q * 2^place) * 2^-place - (MVAL * 2^-place + z) = q - z, exact.
__device__ __host__ constexpr int pair_off(int j) { return (BITS * j) % 8; }
__device__ __host__ constexpr bool pair_shifted(int j) { return pair_off(j) + BITS > MANT; }
__device__ __host__ constexpr int pair_place(int j) { return pair_shifted(j) ? 0 : pair_off(j); }
__device__ __host__ constexpr u32 pow2_neg(int p) {  // 2^-p in both halves
  return (BF16 && BITS < 8 ? 0x3F80u - ((u32)p << 7) : 0x3C00u - ((u32)p << 10)) * 0x10001u;
}

// -(v) in both halves, for an integer 0 < v < 2048 (fp16) or < 256 (bf16): exact in either.
__device__ __forceinline__ u32 neg_int2(int v) {
  const int e = 31 - __clz(v);
#if BF16 && BITS < 8
  const u32 h = 0x8000u | ((u32)(e + 127) << 7) | (((u32)v << (7 - e)) & 0x7Fu);
#else
  const u32 h = 0x8000u | ((u32)(e + 15) << 10) | (((u32)v << (10 - e)) & 0x3FFu);
#endif
  return h * 0x10001u;
}

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {  // (a & b) | c
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
#if BF16 && BITS < 8
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
  return d;
}

// Pair j (0 <= j < PPW) of word w, zero point z: the exact pair (q - z) in the mma dtype.
template <int J>
__device__ __forceinline__ u32 dequant_pair(u32 w, int z) {
  const u32 v = w >> (8 * ((BITS * J) / 8) + (pair_shifted(J) ? pair_off(J) : 0));
  const u32 t = lop3_and_or(v, (((1u << BITS) - 1u) << pair_place(J)) * 0x10001u, MAGIC);
  u32 d = hfma2(t, pow2_neg(pair_place(J)), neg_int2((MVAL >> pair_place(J)) + z));
#if BF16 && BITS == 8  // 8-bit codes under bf16: the fp16 integer |q - z| <= 255 converts to bf16 exactly
  float lo, hi;
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(d));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// The PPW pairs of one word.
template <int J = 0>
__device__ __forceinline__ void dequant_word(u32 w, const int* z, u32* out) {
  out[J] = dequant_pair<J>(w, z[J]);
  if constexpr (J + 1 < PPW) dequant_word<J + 1>(w, z, out);
}

#if BITS == 3
// Pair j (0..15) of a 3-bit thread-row: its low two bits at bit 2 (j % 8) of each half of 2-bit-plane word
// wa (word j / 8), its high bit at bit j of each half of the 1-bit-plane word wb. One LOP3 places the low
// bits under MAGIC, a second ORs the high bit in at bit 2, one packed FMA makes (q - z), exact.
__device__ __forceinline__ u32 dequant_pair3(u32 wa, u32 wb, int j, int z) {
  const u32 lo = lop3_and_or(wa >> (2 * (j % 8)), 0x00030003u, MAGIC);
  const u32 hb = j >= 2 ? wb >> (j - 2) : wb << (2 - j);
  return hfma2(lop3_and_or(hb, 0x00040004u, lo), pow2_neg(0), neg_int2(MVAL + z));
}

// The 8 pairs of 2-bit-plane word iw (pairs 8 iw .. 8 iw + 7 of the thread-row).
__device__ __forceinline__ void dequant_word3(u32 wa, u32 wb, int iw, const int* z, u32* out) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) out[jj] = dequant_pair3(wa, wb, 8 * iw + jj, z[jj]);
}
#endif

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
#endif
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#if SP24
// The sparse MMA: A is 16 x 32 with two of every four columns kept (a0..a3 the kept values' dense
// m16n8k16 fragment), e the positions (metadata) that lanes 2F and 2F + 1 of each four supply.
template <int F>
__device__ __forceinline__ void mma_sp(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, u32 b2, u32 b3,
                                       u32 e) {
#if BF16
  asm("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;\n"
#else
  asm("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;\n"
#endif
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(b2), "r"(b3), "r"(e), "n"(F));
}
#endif

__device__ __forceinline__ float to_f32(u16 v) {
#if BF16
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(((u32)v) << 16));
  return f;
#else
  return h2f(v);
#endif
}

__device__ __forceinline__ u16 from_f32(float f) {
  u16 r;
#if BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
  return r;
}

__device__ __forceinline__ float lds_h2f(u32 addr) {  // an fp16 in shared memory, as fp32
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return h2f(v);
}

__device__ __forceinline__ int zero_of(u32 addr) { return (int)lds_h2f(addr); }  // fp16 integer zero point

// Zero points of the PPW pairs of word iw of both row halves (the warp tile's scales at su): pair j covers
// k16 step j / PPS of the tile (PPS pairs per step: 2 for the dense MMA, 1 for the sparse one).
template <int PPS>
__device__ __forceinline__ void word_zeros(u32 su, int iw, int (*z)[PPW]) {
#pragma unroll
  for (int pj = 0; pj < PPW; ++pj) {
#if ASYM
    const int g = GK16 < 8 ? ((iw * PPW + pj) / PPS) / GK16 : 0;
    z[0][pj] = zero_of(su + (S_HALVES + g * 64) * 2);
    z[1][pj] = zero_of(su + (S_HALVES + g * 64 + 8) * 2);
#else
    z[0][pj] = z[1][pj] = 1 << (BITS - 1);
#endif
  }
}

// acc += cg * scale (rows l and l + 8 of the warp's 16: scales at addr and addr + 16), then cg = 0.
__device__ __forceinline__ void flush(float (*acc)[4], float (*cg)[4], u32 addr) {
  const float s0 = lds_h2f(addr), s1 = lds_h2f(addr + 16);
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    acc[t][0] += cg[t][0] * s0; acc[t][1] += cg[t][1] * s0;
    acc[t][2] += cg[t][2] * s1; acc[t][3] += cg[t][3] * s1;
    cg[t][0] = cg[t][1] = cg[t][2] = cg[t][3] = 0.f;
  }
}

// Args (all strides in elements):
//   x [n_rows, K] (row stride sx), y [n_rows, out_f] (row stride sy);
//   plan int32: perm[n_rows] ++ tile_slot[n_tiles] ++ tile_start[n_tiles] ++ tile_end[n_tiles];
//   present uint8 [num_slots + 1] indexed by slot + 1 (0: the stack holds nothing for that slot);
//   qw int32 [D, slot_words]; scales, zeros fp16 [D, G, outp] (slot stride slot_sz);
//   ws fp32 [parts, n_rows, out_f] (K cut between CTAs only) and counters int32 [n_tiles * grid_x], zero
//   on entry and on exit (the last CTA of each unit resets its counter).
#ifndef PDL
#define PDL 0
#endif
#ifndef STREAMK
#define STREAMK 0
#endif
#if PDL
// Everything the kernel reads may come from the kernel before it: it waits for that one first. The
// kernels after it wait the same way, so they may launch now and sit resident until this one ends.
#define PDL_WAIT()                                             \
  do {                                                         \
    asm volatile("griddepcontrol.wait;" ::: "memory");         \
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
  } while (0)
#endif
#define SBMM_ARGS                                                                                            \
  const u16 *__restrict__ x, int sx, u16 *__restrict__ y, int sy, const int *__restrict__ plan, int n_rows,  \
      int n_tiles, const unsigned char *__restrict__ present, const u32 *__restrict__ qw, i64 slot_words,   \
      const u16 *__restrict__ scales, const u16 *__restrict__ zeros, i64 slot_sz, int out_f, int outp,      \
      int k_tiles, int group_shift
#define SBMM_PASS x, sx, y, sy, plan, n_rows, n_tiles, present, qw, slot_words, scales, zeros, slot_sz, out_f, outp, \
                  k_tiles, group_shift

#if STREAMK
// One unit of work of a stream-K CTA: K tiles kt0 .. kt1 - 1 of the 64-row blocks RB bx .. RB bx + RB - 1 of
// row tile `tile`, part `part` of the `parts` that cover the unit's K tiles (their partials summed by the
// last to finish; parts 1: the output written at once); grid_x: blocks of RB 64-row blocks per row tile.
// (The classic build below is the same body as the kernel itself, indexed by the CTA's position: written
// once, it compiles to the validated kernel's exact SASS.)
__device__ __forceinline__ void sbmm_unit(SBMM_ARGS, int acc_into, float* __restrict__ ws, int* __restrict__ counters,
                                          int bx, int tile_, int kt0_, int kt1_, int part_, int parts_, int grid_x) {
#define UNIT_TILE tile_
#define UNIT_BX bx
#define UNIT_KT0 kt0_
#define UNIT_KT1 kt1_
#define UNIT_PART part_
#define UNIT_PARTS parts_
#define UNIT_GRID_X grid_x
#else
// Grid: (grid_x = ceil(outp / (64 RB)), n_tiles, splits); split z covers K tiles z tiles_per_split ..
// (z + 1) tiles_per_split - 1.
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS) dz_sbmm(SBMM_ARGS, int tiles_per_split, int acc_into,
                                                                        float* __restrict__ ws, int* __restrict__ counters) {
#if PDL
  PDL_WAIT();
#endif
#define UNIT_TILE blockIdx.y
#define UNIT_BX blockIdx.x
#define UNIT_KT0 blockIdx.z * tiles_per_split
#define UNIT_KT1 imin(k_tiles, kt0 + tiles_per_split)
#define UNIT_PART blockIdx.z
#define UNIT_PARTS (int)gridDim.z
#define UNIT_GRID_X gridDim.x
#endif
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int xrow[BM];
  __shared__ int last;
  const int tile = UNIT_TILE, tid = threadIdx.x;
  // The tile's slot, first row and row count are read together, then whether the stack holds the slot
  // and the tile's row indices, together: two dependent global reads before the weights stream, where
  // reading each after the other took four (each an L2 or DRAM round trip at the start of every CTA).
  const int slot = plan[n_rows + tile];
  const int start = plan[n_rows + n_tiles + tile];
  const int cnt = imin(plan[n_rows + 2 * n_tiles + tile] - start, BM);
  // (an empty tile exits too: a condition on all three keeps the compiler from sinking two of the
  // reads below the branch, which would chain them again)
  if (slot < 0 || cnt <= 0) return;  // the whole CTA: no barrier has been reached
  const int my_row = tid < cnt ? plan[start + tid] : 0;
  if (!present[slot + 1]) return;
  const int lane = tid & 31, warp = tid >> 5;
  const int rb = (warp * MT) >> 2, wi = (warp * MT) & 3;  // the warp's block and first 16-row tile in it
  const int nb0 = UNIT_BX * RB, nblocks = outp >> 6;
  const bool active = nb0 + rb < nblocks;
  const int kt0 = UNIT_KT0, kt1 = UNIT_KT1;
#ifdef GDIV
#define TILE_GROUP(t) ((t) / group_shift)                   // group_shift: tiles per group
#define GROUP_ENDS(t) (((t) + 1) % group_shift == 0)
#else
  const int group_mask = (1 << group_shift) - 1;  // K tiles per group: a power of two (or the whole row)
#define TILE_GROUP(t) ((t) >> group_shift)
#define GROUP_ENDS(t) ((((t) + 1) & group_mask) == 0)
#endif

  // Copy sources of this thread, advanced KT K tiles per load (a piece outside the matrix or past the
  // tile's rows stays put and is zero-filled), and their offsets inside a stage.
  constexpr int WTOTAL = RB * KT * TILE_PIECES;               // pieces of 16 bytes per stage
  constexpr int WP = (WTOTAL + NTHREADS - 1) / NTHREADS;      // per thread (3 bits: the last round partial)
  // Piece i = tid + j * NTHREADS lands at stage byte 16 i; its source is one 32-bit word offset from
  // the slot's first K tile of this split (fewer registers than a pointer per piece).
  const u32* wbase = qw + slot * slot_words + (i64)kt0 * TILE_WORDS;
  u32 woff[WP];
  u32 wok = 0;
#pragma unroll
  for (int j = 0; j < WP; ++j) {
    const int i = tid + j * NTHREADS, r = i / (KT * TILE_PIECES), p = i % (KT * TILE_PIECES);
    woff[j] = (u32)((nb0 + r) * k_tiles * TILE_WORDS + p * 4);
    wok |= ((WP * NTHREADS == WTOTAL || i < WTOTAL) && nb0 + r < nblocks ? 1u : 0u) << j;
  }
  // 64 scales (128 bytes, 8 pieces) per block, tile and group: RB * KT * SG * 8 <= NTHREADS
  const bool sload = tid < RB * KT * SG * 8;
  const int s_r = tid / (KT * SG * 8), s_u = (tid / (SG * 8)) % KT, s_g = (tid / 8) % SG, s_p = tid % 8;
  const bool s_ok = sload && nb0 + s_r < nblocks;
  const i64 s_off = s_ok ? slot * slot_sz + (i64)(nb0 + s_r) * 64 + s_p * 8 + (GK16 < 8 ? (i64)s_g * outp : 0) : 0;
  const u32 s_dst = W_BYTES + (((s_r * KT + s_u) * SG + s_g) * 64 + s_p * 8) * 2;
  const u32 sbase = smem_u32(smem), send = sbase + STAGES * STAGE_BYTES;
#if EVICT
  unsigned long long wpolicy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(wpolicy));
#endif
  auto load_w = [&](int kt, u32 st) {  // codes and scales of K tiles kt .. kt + KT - 1 into stage `st`
#pragma unroll
    for (int j = 0; j < WP; ++j) {
      const bool ok = (wok >> j) & 1u;
      // (a piece past the stage's weights, only at 3 bits, is not copied: its bytes are the scales')
      if (WP * NTHREADS == WTOTAL || tid + j * NTHREADS < WTOTAL)
        CP16W(st + 16 * (tid + j * NTHREADS), ok ? wbase + woff[j] + (u32)(kt - kt0) * TILE_WORDS : qw, ok ? 16 : 0);
    }
    if (sload) {
      const int t = kt + s_u;
      const i64 off = s_off + (GK16 < 8 ? (i64)t * SG * outp : (i64)TILE_GROUP(t) * outp);
      CP16W(st + s_dst, s_ok ? (const void*)(scales + off) : (const void*)scales, s_ok ? 16 : 0);
#if ASYM
      CP16W(st + s_dst + S_HALVES * 2, s_ok ? (const void*)(zeros + off) : (const void*)zeros, s_ok ? 16 : 0);
#endif
    }
  };
  const int ns = (kt1 - kt0) / KT;  // stages to compute (the host makes every split a multiple of KT)
  // The weights of the first STAGES - 1 stages go out before the row indices are shared (they depend on
  // the slot only); each stage's activations follow once they are. Commit groups: the first holds those
  // weights and stage 0's activations, each later prologue group one stage's activations, so waiting
  // for group `it` still means stage `it` has landed.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < ns) load_w(kt0 + s * KT, sbase + s * STAGE_BYTES);
  if (tid < BM) xrow[tid] = my_row;
  __syncthreads();

  constexpr int XP = (BM * 16 * KT) / NTHREADS;  // activation pieces per thread: 16 KT per row
  const u16* xsrc[XP];
  u32 xdst[XP];
  int xstep[XP];
#ifdef KCOLS
  int xcol[XP];  // the piece's first column
#endif
#pragma unroll
  for (int j = 0; j < XP; ++j) {
    const int i = tid + j * NTHREADS, r = i / (16 * KT), p = i % (16 * KT);
    xsrc[j] = r < cnt ? x + (i64)xrow[r] * sx + kt0 * 128 + p * 8 : x;
    xstep[j] = r < cnt ? 128 * KT : 0;
    xdst[j] = W_BYTES + (S_HALVES + Z_HALVES + r * XS + p * 8) * 2;
#ifdef KCOLS
    xcol[j] = kt0 * 128 + p * 8;
#endif
  }
  // Only the tile's own rows are copied: rows past `cnt` keep whatever the stage held, which reaches only
  // the mma columns of rows past `cnt`, never stored (each output column reads its own activation row).
  // Zero-filling them cost shared-memory bandwidth: 16 rows staged where decode tiles have 1 to 8.
  auto load_x = [&](u32 st) {  // the next K tiles' activations into stage `st`
#pragma unroll
    for (int j = 0; j < XP; ++j) {
#ifdef KCOLS
      // past the row (the padded last K tile): zero-filled, never read, so its codes add exactly 0
      const bool in_row = xcol[j] < KCOLS;
      if (xstep[j]) cp16(st + xdst[j], in_row ? (const void*)xsrc[j] : (const void*)x, in_row ? 16 : 0);
      xcol[j] += 128 * KT;
#else
      if (xstep[j]) cp16(st + xdst[j], xsrc[j], 16);
#endif
      xsrc[j] += xstep[j];
    }
  };

  float acc[MT][2][4], cg[MT][2][4];  // per weight tile and n8 tile of activation rows
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][t][c] = cg[m][t][c] = 0.f;
  const int row = 16 * wi + (lane >> 2);  // the thread's first weight row in its 64-row block (tile m: + 16 m)
  const bool two = cnt > 8;                // second n8 tile of activation rows in use
  // Offsets inside a stage of what this thread reads: its words, its rows' scales, its ldmatrix row
  // (weight tile m of the warp: words + m * 32 * RUN * 4 bytes, scales + 32 bytes).
  const u32 w_rd = rb * KT * TILE_WORDS * 4 + (wi * 32 * RUN + lane * RUN) * 4;
#if BITS == 3
  // the 1-bit plane's word (compact: after the 256 words of the low-bit plane, both row halves in one)
  const u32 wb_rd = rb * KT * TILE_WORDS * 4 + (SP24 ? 1024 : 2048) + (wi * 32 + lane) * 4;
#endif
  const u32 sc_rd = W_BYTES + (rb * KT * SG * 64 + row) * 2;
#if SP24
  // the thread's metadata words; its ldmatrix row: row lane % 8 at k offset 8 (lane / 8) (x4: a k32 step)
  const u32 e_rd = rb * KT * TILE_WORDS * 4 + 128 * BITS * 4 + (wi * 32 + lane) * 8;
  const u32 x_rd = W_BYTES + (S_HALVES + Z_HALVES + (lane & 7) * XS + 8 * (lane >> 3)) * 2;
#else
  const u32 x_rd = W_BYTES + (S_HALVES + Z_HALVES + ((lane & 7) + 8 * (lane >> 4)) * XS + 8 * ((lane >> 3) & 1)) * 2;
#endif

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ns) load_x(sbase + s * STAGE_BYTES);
    cp_commit();
  }
  // The compute of one stage, built twice: for tiles of more than 8 rows (x4 ldmatrix, two n8 MMAs per
  // k16 step) and for the rest (x2, one); the loop picks one per stage with a uniform branch (a copy of
  // the whole loop per case made the compiler spill a pointer into the loop).
  auto compute = [&](const bool TWO, const u32 rd, const int it) {  // inlined at both calls, TWO constant
#pragma unroll
    for (int u = 0; u < KT; ++u) {
      const u32 wu = rd + w_rd + u * TILE_WORDS * 4, su = rd + sc_rd + u * SG * 128, xu = rd + x_rd + u * 256;
#if SP24
      // compact 2:4: a thread's BITS code words of the tile (row half rr's at rr * NWA) and its two
      // metadata words (word mw: k32 step 2 mw + F for lanes 2F, 2F + 1 of each four)
      u32 w[MT][BITS], e[MT][2];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#if BITS == 3  // the low-bit plane's word of each row half, then the high-bit plane's word of both
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(w[m][0]), "=r"(w[m][1]) : "r"(wu + m * 256));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[m][2]) : "r"(rd + wb_rd + u * TILE_WORDS * 4 + m * 128));
#else
#pragma unroll
        for (int hv = 0; hv < HV; ++hv)
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(w[m][hv * 4]), "=r"(w[m][hv * 4 + 1]), "=r"(w[m][hv * 4 + 2]), "=r"(w[m][hv * 4 + 3])
                       : "r"(wu + m * 512 + hv * 2048));
#endif
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];"
                     : "=r"(e[m][0]), "=r"(e[m][1]) : "r"(rd + e_rd + u * TILE_WORDS * 4 + m * 256));
      }
#pragma unroll
      for (int iw = 0; iw < NWA; ++iw) {  // word iw of each row half: pairs iw * PPW ..., k32 steps iw * PPW / 2 ...
        u32 a[MT][2][PPW];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          int z[2][PPW];
          word_zeros<1>(su + m * 32, iw, z);  // pair j covers k16 step j of the tile
#if BITS == 3  // row half rr's high bits at bit 8 rr + j of the high-plane word
#pragma unroll
          for (int pj = 0; pj < 8; ++pj) {
            a[m][0][pj] = dequant_pair3(w[m][0], w[m][2], pj, z[0][pj]);
            a[m][1][pj] = dequant_pair3(w[m][1], w[m][2], pj + 8, z[1][pj]);
          }
#else
          dequant_word(w[m][iw], z[0], a[m][0]);
          dequant_word(w[m][NWA + iw], z[1], a[m][1]);
#endif
        }
#pragma unroll
        for (int sp = 0; sp < PPW / 2; ++sp) {
          const int s = iw * PPW / 2 + sp;  // k32 step: activation columns 32 s .. 32 s + 31 of the tile
          u32 b0, b1, b2, b3, b4 = 0u, b5 = 0u, b6 = 0u, b7 = 0u;
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                       : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(xu + s * 64));
          if (TWO)
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                         : "=r"(b4), "=r"(b5), "=r"(b6), "=r"(b7) : "r"(xu + s * 64 + 16 * XS));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            const u32 a0 = a[m][0][2 * sp], a1 = a[m][1][2 * sp], a2 = a[m][0][2 * sp + 1], a3 = a[m][1][2 * sp + 1];
            if (s & 1) {
              mma_sp<1>(cg[m][0], a0, a1, a2, a3, b0, b1, b2, b3, e[m][s >> 1]);
              if (TWO) mma_sp<1>(cg[m][1], a0, a1, a2, a3, b4, b5, b6, b7, e[m][s >> 1]);
            } else {
              mma_sp<0>(cg[m][0], a0, a1, a2, a3, b0, b1, b2, b3, e[m][s >> 1]);
              if (TWO) mma_sp<0>(cg[m][1], a0, a1, a2, a3, b4, b5, b6, b7, e[m][s >> 1]);
            }
            if (GK16 < 8 && (2 * s + 2) % GK16 == 0) flush(acc[m], cg[m], su + m * 32 + ((2 * s + 1) / GK16) * 128);
          }
        }
      }
#else
      u32 w[MT][2][BITS];
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
#pragma unroll
          for (int hv = 0; hv < HV; ++hv) {
            const u32 p = wu + m * 32 * RUN * 4 + (hv * 2 + rr) * 4 * 32 * RUN * 4;
#if RUN == 4
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(w[m][rr][hv * 4]), "=r"(w[m][rr][hv * 4 + 1]), "=r"(w[m][rr][hv * 4 + 2]),
                           "=r"(w[m][rr][hv * 4 + 3])
                         : "r"(p));
#else
            asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(w[m][rr][0]), "=r"(w[m][rr][1]) : "r"(p));
#endif
#if BITS == 3
            asm volatile("ld.shared.u32 %0, [%1];"
                         : "=r"(w[m][rr][2]) : "r"(rd + wb_rd + u * TILE_WORDS * 4 + m * 128 + rr * 512));
#endif
          }
#pragma unroll
      for (int iw = 0; iw < NWA; ++iw) {  // word iw holds the pairs of mma steps iw * PPW / 2 ...
        u32 a[MT][2][PPW];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          int z[2][PPW];
          word_zeros<2>(su + m * 32, iw, z);
#if BITS == 3
          dequant_word3(w[m][0][iw], w[m][0][2], iw, z[0], a[m][0]);
          dequant_word3(w[m][1][iw], w[m][1][2], iw, z[1], a[m][1]);
#else
          dequant_word(w[m][0][iw], z[0], a[m][0]);
          dequant_word(w[m][1][iw], z[1], a[m][1]);
#endif
        }
#pragma unroll
        for (int sp = 0; sp < PPW / 2; ++sp) {
          const int s = iw * PPW / 2 + sp;
          // 8 rows or fewer (most decode tiles): only the first n8 tile's two matrices, half the
          // shared-memory reads; at 2 bits the x4 loads of 4 warps read 8x the stage's weight bytes
          u32 b0, b1, b2 = 0u, b3 = 0u;
          if (TWO)
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                         : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(xu + s * 32));
          else
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                         : "=r"(b0), "=r"(b1) : "r"(xu + s * 32));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma(cg[m][0], a[m][0][2 * sp], a[m][1][2 * sp], a[m][0][2 * sp + 1], a[m][1][2 * sp + 1], b0, b1);
            if (TWO) mma(cg[m][1], a[m][0][2 * sp], a[m][1][2 * sp], a[m][0][2 * sp + 1], a[m][1][2 * sp + 1], b2, b3);
            if (GK16 < 8 && (s + 1) % GK16 == 0) flush(acc[m], cg[m], su + m * 32 + (s / GK16) * 128);
          }
        }
      }
#endif
      if (GK16 == 8) {
        const int kt = kt0 + it * KT + u;
        if (GROUP_ENDS(kt) || kt + 1 == kt1)
#pragma unroll
          for (int m = 0; m < MT; ++m) flush(acc[m], cg[m], su + m * 32);
      }
    }
  };
  u32 wr = sbase + (STAGES - 1) * STAGE_BYTES;  // stage the next load writes
  u32 rd = sbase;                               // stage the compute reads
  for (int it = 0; it < ns; ++it) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // stage `it` landed for every thread; the stage computed last is free again
    if (it + STAGES - 1 < ns) {
      load_w(kt0 + (it + STAGES - 1) * KT, wr);
      load_x(wr);
    }
    cp_commit();
    wr += STAGE_BYTES;
    if (wr == send) wr = sbase;
    if (active) {
      if (two)
        compute(true, rd, it);
      else
        compute(false, rd, it);
    }
    rd += STAGE_BYTES;
    if (rd == send) rd = sbase;
  }
  cp_wait<0>();

  // Epilogue: c0, c1 are weight row `row` (+ 16 mt) for activation rows 8t + 2q + {0, 1}; c2, c3 row + 8.
  const int mrow = (nb0 + rb) * 64 + row, q2 = 2 * (lane & 3);
  if (UNIT_PARTS == 1) {
    if (!active) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = 8 * t + q2 + (c & 1), m = mrow + 16 * mt + 8 * (c >> 1);
          if (n < cnt && m < out_f) {
            u16* p = y + (i64)xrow[n] * sy + m;
            *p = from_f32(acc_into ? acc[mt][t][c] + to_f32(*p) : acc[mt][t][c]);
          }
        }
    return;
  }
  // Split K: each split stores its partials in its own workspace slice (plain stores, no atomics: their
  // cost grew with rows x outputs x splits); the last CTA of the tile to finish sums the slices in split
  // order (run-to-run identical) and writes the output.
  const i64 slice = (i64)n_rows * out_f;
  if (active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = 8 * t + q2 + (c & 1), m = mrow + 16 * mt + 8 * (c >> 1);
          if (n < cnt && m < out_f)
            asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(ws + UNIT_PART * slice + (i64)xrow[n] * out_f + m),
                         "f"(acc[mt][t][c]) : "memory");
        }
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  __syncthreads();
  int* counter = counters + tile * UNIT_GRID_X + UNIT_BX;
  if (tid == 0) {
    int prev;
    asm volatile("atom.global.acq_rel.gpu.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
    last = prev == UNIT_PARTS - 1;
  }
  __syncthreads();
  if (!last) return;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  if (active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = 8 * t + q2 + (c & 1), m = mrow + 16 * mt + 8 * (c >> 1);
          if (n < cnt && m < out_f) {
            const float* wp = ws + (i64)xrow[n] * out_f + m;
            float v = 0.f;
            for (int z = 0; z < UNIT_PARTS; ++z) {
              float part;
              asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(part) : "l"(wp + z * slice) : "memory");
              v += part;
            }
            u16* p = y + (i64)xrow[n] * sy + m;
            *p = from_f32(acc_into ? v + to_f32(*p) : v);
          }
        }
  }
  if (tid == 0) *counter = 0;
}

#if STREAMK
// Grid: (the CTAs of one wave, 1, 1); tiles_per_split is not read.
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS) dz_sbmm(SBMM_ARGS, int tiles_per_split, int acc_into,
                                                                        float* __restrict__ ws, int* __restrict__ counters) {
#if PDL
  PDL_WAIT();
#endif
  // The units (row tile, block) in tile-major order, each of ks stages of KT K tiles: CTA c takes stages
  // [c T / C, (c + 1) T / C) of the T in all, so every CTA streams the same number of weight bytes, give or
  // take one stage. Stage i belongs to CTA ((i + 1) C - 1) / T: a unit's parts are the CTAs from that
  // of its first stage to that of its last, numbered from 0 in that order (tests/kernels/test_launch_options.py
  // runs this arithmetic, transcribed, and the reduction on CPU).
  const int grid_x = ((outp >> 6) + RB - 1) / RB, ks = k_tiles / KT, ctas = gridDim.x, c = blockIdx.x;
  const int total = grid_x * n_tiles * ks;  // < 2^31 (the host checks); its products with ctas are not
  const int e = (int)((i64)(c + 1) * total / ctas);
  for (int s = (int)((i64)c * total / ctas); s < e;) {
    const int u = s / ks, k0 = s - u * ks, k1 = imin(ks, k0 + (e - s));
    const int first = (int)((((i64)u * ks + 1) * ctas - 1) / total), lastc = (int)(((i64)(u + 1) * ks * ctas - 1) / total);
    sbmm_unit(SBMM_PASS, acc_into, ws, counters, u % grid_x, u / grid_x, k0 * KT, k1 * KT, c - first, lastc - first + 1,
              grid_x);
    s += k1 - k0;
    __syncthreads();  // the next unit's prologue writes the stages and row ids this one read
  }
}
#endif

// The scale and zero point of scale-table entry gp (group, row of a slot).
__device__ __forceinline__ void scale_zero(const u16* __restrict__ scales, const u16* __restrict__ zeros, i64 gp,
                                           float& s, float& z) {
  s = h2f(scales[gp]);
#if ASYM
  z = h2f(zeros[gp]);
#else
  z = (float)(1 << (BITS - 1));
#endif
}

// Dense delta of one slot: out [out_f, K] (row stride so) = scale * (q - z), in the activation dtype.
// Grid (outp / 64, k_tiles), 128 threads: each thread its fragment elements of one 64 x 128 tile.
extern "C" __global__ void __launch_bounds__(128) dz_dequant(
    const u32* __restrict__ qw, const u16* __restrict__ scales, const u16* __restrict__ zeros, int slot,
    i64 slot_words, i64 slot_sz, int out_f, int outp, int k_tiles, int group, u16* __restrict__ out, int so) {
  const int nb = blockIdx.x, kt = blockIdx.y, tid = threadIdx.x, lane = tid & 31, wi = tid >> 5;
  const u32* wq = qw + slot * slot_words + ((i64)nb * k_tiles + kt) * TILE_WORDS;
#if SP24
  // Compact 2:4: the thread writes the four columns of each of its groups, the two kept values at their
  // positions (the metadata word of lane 2 (s % 2) + h of its four, module docstring of mma_sparse.py)
  // and 0 at the other two.
  u32 w[BITS];
#if BITS == 3  // the low-bit plane's words of the two row halves, then the high-bit plane's word
  w[0] = wq[(wi * 32 + lane) * 2];
  w[1] = wq[(wi * 32 + lane) * 2 + 1];
  w[2] = wq[256 + wi * 32 + lane];
#else
#pragma unroll
  for (int iw = 0; iw < BITS; ++iw) w[iw] = wq[(((iw / 4) * 4 + wi) * 32 + lane) * 4 + iw % 4];
#endif
  const int q = lane & 3;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int m = nb * 64 + 16 * wi + 8 * rr + (lane >> 2);
    if (m >= out_f) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // pair j = 2 s + h: the group of columns 32 s + 16 h + 4 q .. + 3
      const int sj = j >> 1, h = j & 1, col = kt * 128 + 32 * sj + 16 * h + 4 * q;
#ifdef KCOLS
      if (col >= KCOLS) continue;  // the padded last K tile (KCOLS is a multiple of 8: whole groups)
#endif
      const u32 meta = wq[128 * BITS + (wi * 32 + (lane & ~3) + 2 * (sj & 1) + h) * 2 + (sj >> 1)] >> (16 * rr + 4 * q);
      float sc, z;
      scale_zero(scales, zeros, slot * slot_sz + (i64)(col / group) * outp + m, sc, z);
#if BITS == 3
      const u32 v = ((w[rr] >> (2 * j)) & 0x00030003u) | (((w[2] >> (8 * rr + j)) & 0x00010001u) << 2), mask = 7u;
#else
      const u32 v = w[rr * NWA + j / PPW] >> (BITS * (j % PPW)), mask = (1u << BITS) - 1u;
#endif
      const float v0 = ((float)(v & mask) - z) * sc, v1 = ((float)((v >> 16) & mask) - z) * sc;
      const u32 p0 = meta & 3u, p1 = (meta >> 2) & 3u;
      u16 hv[4];  // selects, not an indexed array (which would live in local memory)
#pragma unroll
      for (int c = 0; c < 4; ++c) hv[c] = from_f32(p0 == (u32)c ? v0 : p1 == (u32)c ? v1 : 0.f);
      u32* o = (u32*)(out + (i64)m * so + col);
      o[0] = (u32)hv[0] | ((u32)hv[1] << 16);
      o[1] = (u32)hv[2] | ((u32)hv[3] << 16);
    }
  }
#else
  u32 w[2][BITS];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
#pragma unroll
    for (int iw = 0; iw < NWA; ++iw)
      w[rr][iw] = wq[(((iw / RUN) * 2 + rr) * 4 + wi) * 32 * RUN + lane * RUN + iw % RUN];
#if BITS == 3
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) w[rr][2] = wq[512 + (rr * 4 + wi) * 32 + lane];  // the 1-bit plane
#endif
  const int q2 = 2 * (lane & 3);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int m = nb * 64 + 16 * wi + 8 * rr + (lane >> 2);
    if (m >= out_f) continue;
#pragma unroll
    for (int j = 0; j < 16; ++j) {  // pair j = 2 * step + h: columns 16 * step + 8 * h + q2 + {0, 1}
      const int col = kt * 128 + 16 * (j >> 1) + 8 * (j & 1) + q2;
#ifdef KCOLS
      if (col >= KCOLS) continue;  // the padded last K tile: out holds in_features columns
#endif
      float s, z;
      scale_zero(scales, zeros, slot * slot_sz + (i64)(col / group) * outp + m, s, z);
#if BITS == 3
      const u32 v = ((w[rr][j / 8] >> (2 * (j % 8))) & 0x00030003u) | (((w[rr][2] >> j) & 0x00010001u) << 2);
      const u32 mask = 7u;
#else
      const u32 v = w[rr][j / PPW] >> (BITS * (j % PPW));
      const u32 mask = (1u << BITS) - 1u;
#endif
      const float lo = ((float)(v & mask) - z) * s;
      const float hi = ((float)((v >> 16) & mask) - z) * s;
      *(u32*)(out + (i64)m * so + col) = (u32)from_f32(lo) | ((u32)from_f32(hi) << 16);
    }
  }
#endif
}
