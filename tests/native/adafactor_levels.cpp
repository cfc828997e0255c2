// The Adafactor step gives bit-identical results at every SIMD level the CPU has and at any thread count (factored
// shapes with every tail length and several 64-row blocks, vectors, bf16/fp16 grads, low-precision param_out,
// maximize, weight decay), and bad arguments throw instead of aborting.
#include <stdexcept>

#include "adam/adafactor.h"
#include "adam/adam.h"
#include "helpers.h"

using namespace swapio::adam;

struct State {
  std::vector<float> p, row, col, var;
  std::vector<uint16_t> out;
};

static State run(Capability cap, int64_t b, int64_t r, int64_t c, bool factored, DType gdt, int threads) {
  const int64_t n = b * r * c;
  auto bytes = t::pattern(static_cast<size_t>(n) * 4, static_cast<uint32_t>(n + factored));
  State s{std::vector<float>(n), std::vector<float>(b * r), std::vector<float>(b * c), std::vector<float>(n),
          std::vector<uint16_t>(n)};
  std::vector<float> g32(n);
  std::vector<uint16_t> g16(n);
  for (int64_t i = 0; i < n; i++) {
    s.p[i] = (bytes[4 * i] - 128) / 64.0f;
    g32[i] = (bytes[4 * i + 1] - 128) / 512.0f;
    g16[i] = static_cast<uint16_t>(0x3c00 + (bytes[4 * i + 2] & 0x3ff) - 0x200);  // finite bf16/fp16 values
  }
  const void* grad = gdt == DType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
  for (int64_t step = 1; step <= 3; step++) {
    AdafactorHyper h;
    h.step = step;
    h.weight_decay = 0.01;
    h.maximize = step == 2;
    adafactor_step(s.p.data(), grad, gdt, s.row.data(), s.col.data(), s.var.data(), n, factored, b, r, c, h,
                   s.out.data(), DType::kBF16, threads, cap);
  }
  return s;
}

static bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

int main() {
  CapabilityInfo info = adam_capability_info();
  struct Shape { int64_t b, r, c; bool factored; };
  for (Shape sh : {Shape{1, 1, 1, false}, Shape{1, 1, 300007, false}, Shape{1, 33, 45, true},
                   Shape{1, 130, 17, true}, Shape{3, 70, 1001, true}, Shape{2, 1, 31, true}}) {
    for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
      State ref = run(Capability::kScalar, sh.b, sh.r, sh.c, sh.factored, gdt, 1);
      for (Capability cap : info.supported) {
        for (int threads : {1, 2, 3}) {
          State got = run(cap, sh.b, sh.r, sh.c, sh.factored, gdt, threads);
          CHECK(same(got.p, ref.p));
          CHECK(same(got.row, ref.row) && same(got.col, ref.col) && same(got.var, ref.var));
          CHECK(got.out == ref.out);
        }
      }
    }
  }
  float x = 0;
  int refused = 0;
  AdafactorHyper bad_step;
  bad_step.step = 0;
  AdafactorHyper bad_d;
  bad_d.d = 0.5;
  try {
    adafactor_step(&x, &x, DType::kF32, nullptr, nullptr, &x, 1, false, 1, 1, 1, bad_step, nullptr, DType::kNone, 1);
  } catch (const std::invalid_argument&) {
    refused++;
  }
  try {
    adafactor_step(&x, &x, DType::kF32, nullptr, nullptr, &x, 1, false, 1, 1, 1, bad_d, nullptr, DType::kNone, 1);
  } catch (const std::invalid_argument&) {
    refused++;
  }
  try {  // factored, but b * r * c != n
    adafactor_step(&x, &x, DType::kF32, &x, &x, nullptr, 1, true, 1, 2, 2, AdafactorHyper{}, nullptr, DType::kNone, 1);
  } catch (const std::invalid_argument&) {
    refused++;
  }
  CHECK(refused == 3);
  return t::kPass;
}
