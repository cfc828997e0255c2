// The smaller-state kernels (Adam with bf16 / int8 moments, Lion with fp32 / bf16 / int8 moments): every SIMD
// level and thread count gives the scalar level's bits (odd lengths, partial blocks, low-precision grads and
// param_out, NaN/inf grads), the int8 maps hold their promises, and bad arguments throw.
#include <cfloat>
#include <cmath>
#include <stdexcept>

#include "adam/adam.h"
#include "adam/quant.h"
#include "adam/quant_search.h"
#include "helpers.h"

using namespace swapio::adam;

namespace {

struct Run {
  std::vector<float> p;
  std::vector<uint8_t> m, v;       // raw moment bytes
  std::vector<float> ms, vs;       // int8 scales
  std::vector<uint16_t> out;
  int64_t nonfinite = 0;
};

int64_t state_bytes(StateType s) { return s == StateType::kF32 ? 4 : (s == StateType::kBF16 ? 2 : 1); }

Run run(bool lion, StateType st, Capability cap, int64_t n, DType gdt, int threads, bool specials) {
  auto bytes = t::pattern(static_cast<size_t>(n) * 4, static_cast<uint32_t>(n) + 7);
  Run r;
  r.p.resize(n);
  r.m.assign(n * state_bytes(st), 0);
  r.v.assign(n * state_bytes(st), 0);
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  r.ms.assign(blocks, 0.0f);
  r.vs.assign(blocks, 0.0f);
  if (st == StateType::kInt8 && n < 255) std::fill(r.m.begin(), r.m.end(), static_cast<uint8_t>(signed_map().zero));
  if (st == StateType::kInt8 && n >= 255) {  // every code of both maps, and blocks of scales 0, inf and NaN
    auto codes = t::pattern(static_cast<size_t>(n) * 2, static_cast<uint32_t>(n) + 11);
    std::copy(codes.begin(), codes.begin() + n, r.m.begin());
    std::copy(codes.begin() + n, codes.end(), r.v.begin());
    for (int64_t b = 0; b < blocks; b++) r.ms[b] = r.vs[b] = 1e-3f * static_cast<float>(b % 5 + 1);
    if (blocks >= 4) r.ms[1] = 0.0f, r.vs[1] = INFINITY, r.ms[2] = NAN, r.vs[3] = 0.0f;
  }
  r.out.resize(n);
  std::vector<float> g32(n);
  std::vector<uint16_t> g16(n);
  for (int64_t i = 0; i < n; i++) {
    r.p[i] = (bytes[4 * i] - 128) / 64.0f;
    g32[i] = (bytes[4 * i + 1] - 128) / 512.0f * (bytes[4 * i + 3] % 7 == 0 ? 1e-4f : 1.0f);
    g16[i] = static_cast<uint16_t>(0x3c00 + (bytes[4 * i + 2] & 0x3ff) - 0x200);
  }
  if (specials && n > 40) {
    g32[3] = NAN;
    g32[n / 2] = INFINITY;
    g32[n - 2] = -INFINITY;
    g32[n / 3] = 3e38f;  // finite, but g * g overflows: m finite beside v = inf
    g16[5] = 0x7FC0;  // NaN in bf16; in fp16 a NaN too (exponent all ones)
  }
  const void* grad = gdt == DType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
  StateOptions o;
  o.state = st;
  o.seed = 0x1234567890ull;
  o.index_base = 1000;
  for (int64_t step = 1; step <= 3; step++) {
    MomentBuf m{r.m.data(), r.ms.data()}, v{r.v.data(), r.vs.data()};
    if (lion) {
      LionHyper h;
      h.step = step;
      h.lr = 1e-2;
      h.weight_decay = 0.1;
      r.nonfinite += lion_step(r.p.data(), grad, gdt, m, n, h, r.out.data(), DType::kBF16, o, threads, cap);
    } else {
      AdamHyper h;
      h.step = step;
      h.lr = 1e-2;
      h.weight_decay = 0.01;
      h.adamw = step != 2;  // one L2 step
      r.nonfinite += adam_step_state(r.p.data(), grad, gdt, m, v, n, h, r.out.data(), DType::kBF16, o, threads, cap);
    }
  }
  return r;
}

bool same(const Run& a, const Run& b) {
  return std::memcmp(a.p.data(), b.p.data(), a.p.size() * 4) == 0 && a.m == b.m && a.v == b.v &&
         std::memcmp(a.ms.data(), b.ms.data(), a.ms.size() * 4) == 0 &&
         std::memcmp(a.vs.data(), b.vs.data(), a.vs.size() * 4) == 0 && a.out == b.out && a.nonfinite == b.nonfinite;
}

// Both searches of quant_search.h against counting midpoints: the bucket lookup everywhere, the arithmetic one
// wherever it does not defer to the bucket lookup (it must defer only rarely), on every float in [0, 1] with a
// stride, and around every midpoint.
void check_map(const QuantMap& q) {
  auto brute = [&](float y) {
    int k = 0;
    while (k < q.max_k && q.mid[k] < y) k++;
    return k;
  };
  int64_t tried = 0, deferred = 0, deferred8 = 0;
  auto check = [&](float y) {
    bool defer = false, defer8 = false;
    const int quick = quick_code(q, y, &defer), quick8 = quick_code8(q, y, &defer8), k = brute(y);
    CHECK(exact_k(q, y) == k);
    CHECK(defer || quick == q.zero + k);
    CHECK(defer8 || quick8 == q.zero + k);
    tried++;
    deferred += defer;
    deferred8 += defer8;
  };
  for (uint32_t u = 0; u <= 0x3F800000u; u += 997) {
    float y;
    std::memcpy(&y, &u, 4);
    check(y);
  }
  CHECK(deferred * 500 < tried && deferred8 * 500 < tried);
  // the SIMD kernels do not clamp y to 1: every y in [1, 2) must give the code of 1 (or defer)
  for (uint32_t u = 0x3F800000u; u < 0x40000000u; u += 7919) {
    float y;
    std::memcpy(&y, &u, 4);
    bool defer = false, defer8 = false;
    const int quick = quick_code(q, y, &defer), quick8 = quick_code8(q, y, &defer8);
    CHECK((defer || quick == q.zero + q.max_k) && (defer8 || quick8 == q.zero + q.max_k));
  }
  // the AVX2 decode's arithmetic gives every code's value, bit for bit
  for (int c = 0; c < 256; c++) {
    const float d = decode8(q, c);
    CHECK(std::memcmp(&d, &q.code[c], 4) == 0);
  }
  for (int k = 0; k < q.max_k; k++) {
    for (float y : {std::nextafter(q.mid[k], 0.0f), q.mid[k], std::nextafter(q.mid[k], 2.0f)}) check(y);
  }
  CHECK(q.code[q.zero] == 0.0f && q.code[q.zero + q.max_k] == 1.0f);
  for (int c = 1; c < 256; c++) CHECK(q.code[c - 1] < q.code[c]);
}

}  // namespace

int main() {
  CHECK(quant_maps_valid());
  check_map(signed_map());
  check_map(unsigned_map());
  CHECK(signed_map().zero == 127 && signed_map().code[0] > -1.0f && unsigned_map().code[0] == 0.0f);

  CapabilityInfo info = adam_capability_info();
  for (bool lion : {false, true}) {
    for (StateType st : {StateType::kF32, StateType::kBF16, StateType::kInt8}) {
      for (int64_t n : {1, 15, 17, 255, 257, 1023, 300007}) {
        for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
          const bool specials = gdt != DType::kF16 && (n == 1023 || n == 300007);  // the latter's in whole blocks
          Run ref = run(lion, st, Capability::kScalar, n, gdt, 1, specials);
          if (st == StateType::kInt8 && specials) CHECK(ref.nonfinite > 0);
          for (Capability cap : info.supported) {
            for (int threads : {1, 2}) CHECK(same(run(lion, st, cap, n, gdt, threads, specials), ref));
          }
        }
      }
    }
  }

  // fp32 state through the state entry is the fp32 Adam kernel, bit for bit
  {
    const int64_t n = 4099;
    auto bytes = t::pattern(n * 2, 3);
    std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
    for (int64_t i = 0; i < n; i++) p[i] = (bytes[2 * i] - 128) / 64.0f, g[i] = (bytes[2 * i + 1] - 128) / 512.0f;
    std::vector<float> p2 = p, m2 = m, v2 = v;
    AdamHyper h;
    h.weight_decay = 0.01;
    for (int64_t s = 1; s <= 3; s++) {
      h.step = s;
      adam_step(p.data(), g.data(), DType::kF32, m.data(), v.data(), nullptr, n, h, nullptr, DType::kNone, 1);
      adam_step_state(p2.data(), g.data(), DType::kF32, MomentBuf{m2.data()}, MomentBuf{v2.data()}, n, h, nullptr,
                      DType::kNone, StateOptions{}, 1);
    }
    CHECK(p == p2 && m == m2 && v == v2);
  }

  // bad arguments throw
  float x = 0;
  uint8_t c = 0;
  AdamHyper ams;
  ams.amsgrad = true;
  StateOptions i8;
  i8.state = StateType::kInt8;
  int refused = 0;
  try {
    adam_step_state(&x, &x, DType::kF32, MomentBuf{&x}, MomentBuf{&x}, 1, ams, nullptr, DType::kNone, StateOptions{}, 1);
  } catch (const std::invalid_argument&) {
    refused++;
  }
  try {  // int8 without scales
    lion_step(&x, &x, DType::kF32, MomentBuf{&c}, 1, LionHyper{}, nullptr, DType::kNone, i8, 1);
  } catch (const std::invalid_argument&) {
    refused++;
  }
  try {
    StateOptions bad;
    bad.state = static_cast<StateType>(7);
    lion_step(&x, &x, DType::kF32, MomentBuf{&x}, 1, LionHyper{}, nullptr, DType::kNone, bad, 1);
  } catch (const std::invalid_argument&) {
    refused++;
  }
  CHECK(refused == 3);
  return t::kPass;
}
