// Elementwise math the kernels share, written so the compiler vectorizes it (libm's expf is a
// scalar call per element).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace conveyor {

// exp(x), x clamped to [-87, 88] (fp32's finite range): 2^(x log2 e) = 2^n * 2^f with f in
// [-0.5, 0.5], 2^f by its degree-7 Taylor polynomial (relative error ~1e-8, below fp32 rounding).
inline float fast_exp(float x) {
  const float t = std::min(std::max(x, -87.f), 88.f) * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.6931471805599453f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace conveyor
