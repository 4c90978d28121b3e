// Scalar math shared by the CPU and CUDA kernels: the divergences' f* and f*', the clipping rule,
// the simplex projection and the m x m part of gram_step.  Everything here is inline and compiles
// for the host and, under nvcc, for the device, so both backends run the same formulas.
//
// The formulas mirror drmoo_kernels/divergences.py and drmoo_kernels/reference.py operation by
// operation (same clamps, same log-sum-exp / sigmoid forms), because the compiled backends are
// tested for parity against that reference.
#pragma once

// torch/headeronly: usable by the stable-ABI CPU and CUDA builds alike.
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DRMOO_HD __host__ __device__ __forceinline__
#else
#define DRMOO_HD inline
#endif

namespace drmoo {

// Divergence codes, as in drmoo_kernels.divergences.Divergence.code.
enum DivergenceCode : int64_t { kChi2 = 0, kKL = 1, kCVaRSmooth = 2, kCressieRead = 3 };

// Storage dtypes a value can be rounded to (see round_to); the kernels keep eta and w in float64
// work buffers and round each update the way the reference's in-place op on the real dtype does.
enum StorageCode : int { kStoreFloat = 0, kStoreDouble = 1, kStoreHalf = 2, kStoreBFloat16 = 3 };

// Overloads so that templated code picks the float or double libm function on host and device.
DRMOO_HD float d_exp(float x) { return expf(x); }
DRMOO_HD double d_exp(double x) { return exp(x); }
DRMOO_HD float d_expm1(float x) { return expm1f(x); }
DRMOO_HD double d_expm1(double x) { return expm1(x); }
DRMOO_HD float d_log1p(float x) { return log1pf(x); }
DRMOO_HD double d_log1p(double x) { return log1p(x); }
DRMOO_HD float d_sqrt(float x) { return sqrtf(x); }
DRMOO_HD double d_sqrt(double x) { return sqrt(x); }
DRMOO_HD float d_pow(float x, float y) { return powf(x, y); }
DRMOO_HD double d_pow(double x, double y) { return pow(x, y); }
DRMOO_HD float d_abs(float x) { return fabsf(x); }
DRMOO_HD double d_abs(double x) { return fabs(x); }
template <typename T>
DRMOO_HD bool d_isfinite(T x) {
  // x - x is 0 for finite x and NaN for +-Inf/NaN; avoids relying on std::isfinite in device code.
  return (x - x) == (x - x);
}

// clamp(x, min=0) that lets NaN through, like torch.clamp.
template <typename T>
DRMOO_HD T relu_keep_nan(T x) {
  return x < T(0) ? T(0) : x;
}

// torch's pow(tensor, scalar) takes exact shortcuts for a few exponents; follow them so that e.g.
// cressie_read(2) squares exactly like the reference.
template <typename T>
DRMOO_HD T pow_scalar(T base, T exponent) {
  if (exponent == T(1)) return base;
  if (exponent == T(2)) return base * base;
  if (exponent == T(3)) return base * base * base;
  if (exponent == T(0.5)) return d_sqrt(base);
  return d_pow(base, exponent);
}

// One divergence with its constants precomputed on the host in float64 and then rounded to T,
// which is what happens to the Python float constants in the reference's tensor expressions.
template <typename T>
struct Divergence {
  int64_t code;
  T c0;  // cvar: log1p(-alpha)     cressie: k - 1
  T c1;  // cvar: log(alpha)        cressie: k / (k - 1)
  T c2;  // cvar: log(a / (1 - a))  cressie: 1 / (k - 1)
  T c3;  // cvar: alpha             cressie: k
};

template <typename T>
inline Divergence<T> make_divergence(int64_t code, double param) {
  Divergence<T> d{code, T(0), T(0), T(0), T(0)};
  if (code == kCVaRSmooth) {
    d.c0 = static_cast<T>(std::log1p(-param));
    d.c1 = static_cast<T>(std::log(param));
    d.c2 = static_cast<T>(std::log(param / (1.0 - param)));
    d.c3 = static_cast<T>(param);
  } else if (code == kCressieRead) {
    d.c0 = static_cast<T>(param - 1.0);
    d.c1 = static_cast<T>(param / (param - 1.0));
    d.c2 = static_cast<T>(1.0 / (param - 1.0));
    d.c3 = static_cast<T>(param);
  }
  return d;
}

// f*(u), without cancellation near u = 0 where it vanishes (divergences.py says why: the objective is
// lam * f*(u), and "something near 1, minus 1" lost all of u's digits at a large lam).  Each comparison is
// false for NaN, which therefore flows through unchanged.
template <typename T>
DRMOO_HD T conj(const Divergence<T>& d, T u) {
  switch (d.code) {
    case kChi2: {
      // 0.25 (u + 2)^2 - 1 = u (1 + u / 4) for u >= -2, and -1 below.
      const T v = u < T(-2) ? T(-2) : u;
      return v * (T(1) + T(0.25) * v);
    }
    case kKL:
      return d_expm1(u);
    case kCVaRSmooth: {
      if (d_abs(u) <= T(1)) {  // divergences.CVAR_NEAR_U: log1p(alpha expm1(u)) / alpha, 1 + that > 0.36
        return d_log1p(d.c3 * d_expm1(u)) / d.c3;
      }
      // logaddexp(log1p(-alpha), u + log(alpha)) / alpha, the overflow-free form of the reference.
      const T a = d.c0;
      const T b = u + d.c1;
      const T hi = a < b ? b : a;
      return (hi + d_log1p(d_exp(-d_abs(a - b)))) / d.c3;
    }
    default: {  // kCressieRead: expm1(k/(k-1) log1p((k-1) u)) / k; (k-1) u = -1 gives -inf, then -1/k
      const T scaled = d.c0 * u;
      const T x = scaled < T(-1) ? T(-1) : scaled;
      return d_expm1(d.c1 * d_log1p(x)) / d.c3;
    }
  }
}

// f*'(u) >= 0, the worst-case density ratio.
template <typename T>
DRMOO_HD T conj_grad(const Divergence<T>& d, T u) {
  switch (d.code) {
    case kChi2:
      return T(0.5) * relu_keep_nan(u + T(2));
    case kKL:
      return d_exp(u);
    case kCVaRSmooth: {
      // sigmoid(u + log(alpha / (1 - alpha))) / alpha
      const T x = u + d.c2;
      return (T(1) / (T(1) + d_exp(-x))) / d.c3;
    }
    default: {  // kCressieRead
      const T base = relu_keep_nan(d.c0 * u + T(1));
      return pow_scalar(base, d.c2);
    }
  }
}

// min(cap, budget / norm), and cap where the norm vanishes (reference.clip_factor).
template <typename T>
DRMOO_HD T clip_factor(T cap, T budget, T norm) {
  if (!(norm > T(0))) return cap;
  const T ratio = budget / norm;
  return ratio > cap ? cap : ratio;
}

// Round a float64 value to a storage dtype and back, so a work buffer holds exactly what the
// tensor of that dtype would.
DRMOO_HD double round_to(int code, double x) {
  switch (code) {
    case kStoreFloat:
      return static_cast<double>(static_cast<float>(x));
    case kStoreHalf:
      return static_cast<double>(static_cast<float>(c10::Half(static_cast<float>(x))));
    case kStoreBFloat16:
      return static_cast<double>(static_cast<float>(c10::BFloat16(static_cast<float>(x))));
    default:
      return x;
  }
}

// Euclidean projection of v[0..m) onto the probability simplex, in place (reference.project_simplex):
// shift by the maximum, sort descending, threshold from the largest k with k*u_k - S_k + 1 > 0.
// `scratch` holds m doubles.  Insertion sort: m is the number of tasks, a few dozen at most.
DRMOO_HD void project_simplex_inplace(int64_t m, double* v, double* scratch) {
  double top = v[0];
  for (int64_t i = 1; i < m; ++i) top = v[i] > top ? v[i] : top;
  for (int64_t i = 0; i < m; ++i) {
    v[i] -= top;
    const double x = v[i];
    int64_t j = i;
    while (j > 0 && scratch[j - 1] < x) {
      scratch[j] = scratch[j - 1];
      --j;
    }
    scratch[j] = x;
  }
  double cumulative = 0.0, threshold_sum = 0.0;
  int64_t k_best = 1;
  for (int64_t k = 1; k <= m; ++k) {
    cumulative += scratch[k - 1];
    if (static_cast<double>(k) * scratch[k - 1] - cumulative + 1.0 > 0.0) {
      k_best = k;
      threshold_sum = cumulative;
    }
  }
  const double threshold = (threshold_sum - 1.0) / static_cast<double>(k_best);
  for (int64_t i = 0; i < m; ++i) {
    v[i] = relu_keep_nan(v[i] - threshold);
  }
}

// Outputs of the m x m part of gram_step.
struct GramStepResult {
  bool finite;
  double d_norm;  // NaN when the Gram is not finite
  double alpha;   // 0 when the Gram is not finite
};

// Alg. 2 steps 4-5 on the m x m Gram: ||d|| = sqrt(w^T G w), alpha = min(c1, c2/||d||), and
// w <- Pi(w - beta (alpha G w + mu z^2 w + rho w)), all in float64 (reference.gram_step).
//   G: m*m values (rounded to the Gram's dtype), read through `gram_at(i, j)`;
//   w: in/out, float64 work copy of the preference; left untouched when G is not finite;
//   z: m values; scratch: 2*m doubles.
template <typename GramAt>
DRMOO_HD GramStepResult gram_step_small(int64_t m, GramAt gram_at, double* w, const double* z, double mu,
                                        double c1, double c2, double beta, double rho, double* scratch) {
  GramStepResult r{true, 0.0, 0.0};
  for (int64_t i = 0; i < m * m; ++i) {
    if (!d_isfinite(gram_at(i / m, i % m))) r.finite = false;
  }
  if (!r.finite) {
    r.d_norm = NAN;
    return r;
  }
  double* gram_w = scratch;
  double quad = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < m; ++j) s += gram_at(i, j) * w[j];
    gram_w[i] = s;
    quad += w[i] * s;
  }
  r.d_norm = d_sqrt(quad < 0.0 ? 0.0 : quad);  // a NaN stays NaN (as the reference's clamp keeps it)
  r.alpha = clip_factor(c1, c2, r.d_norm);
  for (int64_t i = 0; i < m; ++i) {
    const double pref_grad = r.alpha * gram_w[i] + mu * (z[i] * z[i]) * w[i] + rho * w[i];
    w[i] = w[i] - beta * pref_grad;
  }
  project_simplex_inplace(m, w, scratch + m);
  return r;
}

// Upper-triangle pair index p -> (i, j), i <= j, row by row: (0,0) (0,1) .. (0,m-1) (1,1) ..
DRMOO_HD void pair_from_index(int64_t m, int64_t p, int64_t* i_out, int64_t* j_out) {
  int64_t i = 0;
  while (p >= m - i) {
    p -= m - i;
    ++i;
  }
  *i_out = i;
  *j_out = i + p;
}

}  // namespace drmoo
