// What one core issues per cycle, for the 256-bit (AVX2) operations of the int8 kernels: the facts behind the
// "where the cycles go" notes in benchmarks/RESULTS.md (issue 34). Prints the clock (from a chain of scalar adds,
// one cycle each), then cycles per operation of one kind with no dependencies between operations, of two kinds
// interleaved, of vector loads, of Adam's divider work (sqrt and two divides per vector), and the operations per
// cycle that chains of dependent operations reach as the chains get longer (32 operations per iteration, the
// iterations independent, as the kernels' vectors are).
// Build and run (x86-64 with AVX2 and FMA):
//   g++ -O2 -mavx2 -mfma benchmarks/native/vector_issue_probe.cpp -o /tmp/vector_issue_probe && /tmp/vector_issue_probe
#include <chrono>
#include <cstdio>

namespace {

double seconds_of(void (*body)(long), long n) {
  const auto t0 = std::chrono::steady_clock::now();
  body(n);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Best of 5 runs of n iterations, in seconds per iteration.
double per_iteration(void (*body)(long), long n) {
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double s = seconds_of(body, n) / static_cast<double>(n);
    best = s < best ? s : best;
  }
  return best;
}

void scalar_adds(long n) {  // 4 dependent adds per iteration: 4 cycles
  long a = 1;
  const long b = 3;
  for (long i = 0; i < n; ++i) __asm__ volatile("add %1,%0\n\tadd %1,%0\n\tadd %1,%0\n\tadd %1,%0" : "+r"(a) : "r"(b));
}

alignas(64) float table[64];

#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11", "xmm12", "xmm13", "memory"
// 8 operations of one form, each writing a register that no operation reads (ymm8, ymm9 are the sources)
#define OPS8(op)                                                                                                    \
  op " %%ymm8, %%ymm9, %%ymm0\n\t" op " %%ymm8, %%ymm9, %%ymm1\n\t" op " %%ymm8, %%ymm9, %%ymm2\n\t" op            \
     " %%ymm8, %%ymm9, %%ymm3\n\t" op " %%ymm8, %%ymm9, %%ymm4\n\t" op " %%ymm8, %%ymm9, %%ymm5\n\t" op            \
     " %%ymm8, %%ymm9, %%ymm6\n\t" op " %%ymm8, %%ymm9, %%ymm7\n\t"
#define UNARY8(op)                                                                                                  \
  op " %%ymm9, %%ymm0\n\t" op " %%ymm9, %%ymm1\n\t" op " %%ymm9, %%ymm2\n\t" op " %%ymm9, %%ymm3\n\t" op            \
     " %%ymm9, %%ymm4\n\t" op " %%ymm9, %%ymm5\n\t" op " %%ymm9, %%ymm6\n\t" op " %%ymm9, %%ymm7\n\t"
#define SHIFT8(op)                                                                                                  \
  op " $3, %%ymm9, %%ymm0\n\t" op " $3, %%ymm9, %%ymm1\n\t" op " $3, %%ymm9, %%ymm2\n\t" op " $3, %%ymm9, %%ymm3\n\t" \
  op " $3, %%ymm9, %%ymm4\n\t" op " $3, %%ymm9, %%ymm5\n\t" op " $3, %%ymm9, %%ymm6\n\t" op " $3, %%ymm9, %%ymm7\n\t"
#define LOADS8                                                                                                      \
  "vmovaps (%0), %%ymm0\n\tvmovaps 32(%0), %%ymm1\n\tvmovaps 64(%0), %%ymm2\n\tvmovaps 96(%0), %%ymm3\n\t"          \
  "vmovaps 128(%0), %%ymm4\n\tvmovaps 160(%0), %%ymm5\n\tvmovaps 192(%0), %%ymm6\n\tvmovaps 224(%0), %%ymm7\n\t"
#define DIVIDER "vsqrtps %%ymm9, %%ymm10\n\tvdivps %%ymm8, %%ymm9, %%ymm11\n\tvdivps %%ymm9, %%ymm8, %%ymm12\n\t"
// chains: a multiply then an integer add on one register, again and again (4 cycles per pair on Zen 5: 3 + 2, less
// a cycle of bypass?); the chains of one iteration are written one after another, as a kernel's vectors are
#define LINK(r) "vmulps %%ymm8, " r ", " r "\n\tvpaddd %%ymm14, " r ", " r "\n\t"
#define LINK4(r) LINK(r) LINK(r)
#define LINK8(r) LINK4(r) LINK4(r)
#define LINK16(r) LINK8(r) LINK8(r)
#define ZERO(r) "vpxor " r ", " r ", " r "\n\t"  // starts a chain afresh: the iterations are independent
#define ZERO4 ZERO("%%ymm0") ZERO("%%ymm1") ZERO("%%ymm2") ZERO("%%ymm3")

#define BODY(name, text)                                                                                            \
  void name(long n) {                                                                                               \
    for (long i = 0; i < n; ++i) __asm__ volatile(text ::"r"(table) : CLOBBERS);                                   \
  }
BODY(mul, OPS8("vmulps"))
BODY(add, OPS8("vaddps"))
BODY(fma, OPS8("vfmadd231ps"))
BODY(perm, OPS8("vpermps"))
BODY(pshufb, OPS8("vpshufb"))
BODY(paddd, OPS8("vpaddd"))
BODY(pminsd, OPS8("vpminsd"))
BODY(cvt, UNARY8("vcvtps2dq"))
BODY(shift, SHIFT8("vpsrld"))
BODY(perm_mul, OPS8("vpermps") OPS8("vmulps"))
BODY(perm_add, OPS8("vpermps") OPS8("vaddps"))
BODY(perm_pshufb, OPS8("vpermps") OPS8("vpshufb"))
BODY(perm_pminsd, OPS8("vpermps") OPS8("vpminsd"))
BODY(mul_add, OPS8("vmulps") OPS8("vaddps"))
BODY(four_kinds, OPS8("vpermps") OPS8("vmulps") OPS8("vaddps") OPS8("vpaddd"))
BODY(loads, LOADS8)
BODY(loads_paddd, LOADS8 OPS8("vpaddd"))
BODY(divider, DIVIDER)
BODY(divider_four_kinds, DIVIDER OPS8("vpermps") OPS8("vmulps") OPS8("vaddps") OPS8("vpaddd"))
BODY(chains_4, ZERO4 ZERO("%%ymm4") ZERO("%%ymm5") ZERO("%%ymm6") ZERO("%%ymm7") LINK4("%%ymm0") LINK4("%%ymm1")
                   LINK4("%%ymm2") LINK4("%%ymm3") LINK4("%%ymm4") LINK4("%%ymm5") LINK4("%%ymm6") LINK4("%%ymm7"))
BODY(chains_8, ZERO4 LINK8("%%ymm0") LINK8("%%ymm1") LINK8("%%ymm2") LINK8("%%ymm3"))
BODY(chains_16, ZERO4 LINK16("%%ymm0") LINK16("%%ymm1"))
BODY(chains_32, ZERO4 LINK16("%%ymm0") LINK16("%%ymm0"))

}  // namespace

int main() {
  // operands 1.0 (ymm8, ymm9) and 0 (ymm14): the chains stay at 0, nothing meets a denormal's or a NaN's slow path
  __asm__ volatile("vpcmpeqd %%ymm9, %%ymm9, %%ymm9\n\tvpslld $25, %%ymm9, %%ymm9\n\tvpsrld $2, %%ymm9, %%ymm9\n\t"
                   "vmovaps %%ymm9, %%ymm8\n\tvpxor %%ymm14, %%ymm14, %%ymm14" ::: "xmm8", "xmm9", "xmm14");
  const long n = 10000000;
  const double hz = 4.0 / per_iteration(scalar_adds, 4 * n);
  std::printf("clock %.2f GHz (4 dependent scalar adds per iteration)\n", hz * 1e-9);
  struct Row {
    const char* name;
    void (*body)(long);
    int ops;
  };
  const Row rows[] = {
      {"vmulps", mul, 8}, {"vaddps", add, 8}, {"vfmadd231ps", fma, 8}, {"vpermps", perm, 8}, {"vpshufb", pshufb, 8},
      {"vpaddd", paddd, 8}, {"vpminsd", pminsd, 8}, {"vcvtps2dq", cvt, 8}, {"vpsrld (immediate)", shift, 8},
      {"vpermps + vmulps", perm_mul, 16}, {"vpermps + vaddps", perm_add, 16}, {"vpermps + vpshufb", perm_pshufb, 16},
      {"vpermps + vpminsd", perm_pminsd, 16}, {"vmulps + vaddps", mul_add, 16},
      {"vpermps + vmulps + vaddps + vpaddd", four_kinds, 32}, {"vmovaps loads", loads, 8},
      {"vmovaps loads + vpaddd", loads_paddd, 16},
  };
  std::printf("\n%-38s %s\n", "independent operations", "cycles per operation (operations per cycle)");
  for (const Row& r : rows) {
    const double c = per_iteration(r.body, n) * hz / r.ops;
    std::printf("%-38s %.2f (%.2f)\n", r.name, c, 1.0 / c);
  }
  std::printf("\n%-38s %.2f cycles\n", "vsqrtps + 2 vdivps (Adam, per vector)", per_iteration(divider, n) * hz);
  std::printf("%-38s %.2f cycles\n", "the same + the 32 operations above", per_iteration(divider_four_kinds, n) * hz);
  const Row chains[] = {{"8 chains of 4", chains_4, 32}, {"4 chains of 8", chains_8, 32},
                        {"2 chains of 16", chains_16, 32}, {"1 chain of 32", chains_32, 32}};
  std::printf("\n%-38s %s\n", "32 dependent operations per iteration", "operations per cycle");
  for (const Row& r : chains) std::printf("%-38s %.2f\n", r.name, r.ops / (per_iteration(r.body, n / 2) * hz));
  return 0;
}
