// Every SIMD level the CPU has gives bit-identical results to the scalar kernel (odd lengths, bf16/fp16
// grads, low-precision param_out, the thread pool), and bad arguments throw instead of aborting.
#include <stdexcept>

#include "adam/adam.h"
#include "helpers.h"

using namespace swapio::adam;

struct State {
  std::vector<float> p, m, v;
  std::vector<uint16_t> out;
};

static State run(Capability cap, int64_t n, DType gdt, int threads) {
  auto bytes = t::pattern(static_cast<size_t>(n) * 16, static_cast<uint32_t>(n));
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<uint16_t>(n)};
  std::vector<float> g32(n);
  std::vector<uint16_t> g16(n);
  for (int64_t i = 0; i < n; i++) {
    s.p[i] = (bytes[4 * i] - 128) / 64.0f;
    g32[i] = (bytes[4 * i + 1] - 128) / 512.0f;
    g16[i] = static_cast<uint16_t>(0x3c00 + (bytes[4 * i + 2] & 0x3ff) - 0x200);  // finite bf16/fp16 values
  }
  const void* grad = gdt == DType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
  for (int64_t step = 1; step <= 3; step++) {
    AdamHyper h;
    h.step = step;
    h.lr = 1e-2;
    h.weight_decay = 0.01;
    adam_step(s.p.data(), grad, gdt, s.m.data(), s.v.data(), nullptr, n, h, s.out.data(), DType::kBF16, threads,
              cap);
  }
  return s;
}

int main() {
  CapabilityInfo info = adam_capability_info();
  for (int64_t n : {1, 15, 17, 1023, 300007}) {
    for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
      State ref = run(Capability::kScalar, n, gdt, 1);
      for (Capability cap : info.supported) {
        State got = run(cap, n, gdt, 2);
        CHECK(std::memcmp(got.p.data(), ref.p.data(), n * sizeof(float)) == 0);
        CHECK(std::memcmp(got.m.data(), ref.m.data(), n * sizeof(float)) == 0);
        CHECK(std::memcmp(got.v.data(), ref.v.data(), n * sizeof(float)) == 0);
        CHECK(got.out == ref.out);
      }
    }
  }
  float x = 0;
  AdamHyper h;
  h.amsgrad = true;  // without a max_exp_avg_sq buffer
  bool refused = false;
  try {
    adam_step(&x, &x, DType::kF32, &x, &x, nullptr, 1, h, nullptr, DType::kNone, 1);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  CHECK(refused);
  return t::kPass;
}
