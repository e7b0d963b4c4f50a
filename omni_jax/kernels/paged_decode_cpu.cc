// Paged decode attention for XLA's CPU backend, as a typed FFI custom call.
//
// Why a kernel: the portable jnp path gathers every row's pages into a fresh buffer, then
// reads that copy twice (scores, then values), and XLA's CPU gather of small scattered pages
// is slow, so decode attention was bound by that copy. This kernel reads each row's K and V
// pages in place, once, and does the softmax
// in between, the same arithmetic as the jnp path in the same order (scores = (q . k) * scale,
// max-subtracted exp, divide by the sum, then the weighted sum of V), so results agree to
// float32 rounding.
//
// Layout (omni_jax/models/attention.py): q [B, H, D]; k, v [KVH, pages, page_size, D]; tables
// [B, P]; context_lens [B]. Query head h reads KV head h / (H / KVH). Row b attends to its
// keys [max(0, len - window), len); a row with no context (a padding row) gets zeros.
//
// Work is (row, KV head) items handed out by an atomic counter to the calling thread and to
// tasks on XLA's intra-op thread pool. The caller waits only for items already claimed, so a
// pool task that starts late finds nothing left and returns: no deadlock when every pool
// thread is busy, and the buffers are never touched after the call returns.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* tables;
  const int32_t* lens;
  float* out;
  int64_t batch, heads, kv_heads, head_dim, num_pages, page_size, table_width;
  float scale;
  int64_t window;  // 0: no window
};

// 16 float lanes, lowered by the compiler to whatever SIMD the machine has (one AVX-512
// register, two AVX2 ones, four NEON ones).
using Vec = float __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int kMaxHeads = 4;  // query heads per pass: 4 x 4 accumulators fit 32 registers
constexpr int kMaxVecs = 4;   // head_dim lanes per pass: 64 floats

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The sum of the lanes as a tree of halves; a loop over lanes compiles to sixteen dependent
// scalar adds, which made the scores the kernel's slowest part.
inline float Sum(Vec v) {
  using Half = float __attribute__((vector_size(32)));
  using Quarter = float __attribute__((vector_size(16)));
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const Half h = lo + hi;
  Quarter a, b;
  std::memcpy(&a, &h, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof a, sizeof b);
  const Quarter r = a + b;
  return (r[0] + r[2]) + (r[1] + r[3]);
}

// Rows of one KV head in one row's pages, by position; a page one page ahead is prefetched,
// because a KV page (4 KB at page_size 16, head_dim 64) ends where the hardware prefetcher
// stops. The prefetch goes to L2 (locality 2, prefetcht1) rather than L1, which holds fewer
// misses in flight.
struct Keys {
  const float* head;
  const int32_t* table;
  int64_t page_size, num_pages, head_dim, first, len;

  int64_t count() const { return len - first; }

  const float* Row(int64_t pos) const {
    const int64_t page = std::clamp<int64_t>(table[pos / page_size], 0, num_pages - 1);
    return head + (page * page_size + pos % page_size) * head_dim;
  }

  // Lanes [offset, offset + NV * 16) of the i-th key, prefetching the key a page later.
  template <int NV>
  __attribute__((always_inline)) void Read(int64_t i, int64_t offset, Vec (&out)[NV]) const {
    const int64_t pos = first + i;
    if (pos + page_size < len) {
      const float* ahead = Row(pos + page_size) + offset;
      for (int64_t x = 0; x < NV * kLanes; x += 64 / sizeof(float)) __builtin_prefetch(ahead + x, 0, 2);
    }
    const float* row = Row(pos) + offset;
    for (int c = 0; c < NV; ++c) out[c] = Load(row + c * kLanes);
  }
};

// scores[j][i] += q_j . k_i over lanes [offset, offset + NV * 16) of head_dim, for NH heads
// held in registers across all keys.
template <int NH, int NV>
struct Score {
  static void Run(const float* q, int64_t d, const Keys& keys, int64_t offset, float* scores) {
    Vec qv[NH][NV];
    for (int j = 0; j < NH; ++j)
      for (int c = 0; c < NV; ++c) qv[j][c] = Load(q + j * d + offset + c * kLanes);
    const int64_t n = keys.count();
    for (int64_t i = 0; i < n; ++i) {
      Vec kv[NV];
      keys.Read(i, offset, kv);
      for (int j = 0; j < NH; ++j) {
        Vec acc = qv[j][0] * kv[0];
        for (int c = 1; c < NV; ++c) acc += qv[j][c] * kv[c];
        scores[j * n + i] += Sum(acc);
      }
    }
  }
};

// out_j[offset, offset + NV * 16) = sum_i probs[j][i] * v_i, accumulated in registers.
template <int NH, int NV>
struct Value {
  static void Run(const float* probs, const Keys& values, int64_t offset, float* out, int64_t d) {
    Vec acc[NH][NV] = {};
    const int64_t n = values.count();
    for (int64_t i = 0; i < n; ++i) {
      Vec vv[NV];
      values.Read(i, offset, vv);
      for (int j = 0; j < NH; ++j)
        for (int c = 0; c < NV; ++c) acc[j][c] += probs[j * n + i] * vv[c];
    }
    for (int j = 0; j < NH; ++j)
      for (int c = 0; c < NV; ++c) std::memcpy(out + j * d + offset + c * kLanes, &acc[j][c], sizeof(Vec));
  }
};

// Op<nh, nv>::Run(args...) for runtime nh <= kMaxHeads, nv <= kMaxVecs.
template <template <int, int> class Op, int NH = 1, int NV = 1, typename... A>
void Dispatch(int nh, int nv, A&&... args) {
  if constexpr (NH <= kMaxHeads && NV <= kMaxVecs) {
    if (nh != NH) return Dispatch<Op, NH + 1, NV>(nh, nv, args...);
    if (nv != NV) return Dispatch<Op, NH, NV + 1>(nh, nv, args...);
    Op<NH, NV>::Run(args...);
  }
}

// One row's query group against one KV head, in passes of up to four heads.
void AttendOne(const Problem& p, int64_t b, int64_t kh, std::vector<float>& scores) {
  const int64_t d = p.head_dim, g = p.heads / p.kv_heads, s = p.page_size;
  const float* q = p.q + (b * p.heads + kh * g) * d;
  float* out = p.out + (b * p.heads + kh * g) * d;
  const int64_t len = std::min<int64_t>(p.lens[b], p.table_width * s);
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, len - p.window) : 0;
  if (len <= first) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  const int32_t* table = p.tables + b * p.table_width;
  const int64_t head_size = p.num_pages * s * d;
  const Keys keys{p.k + kh * head_size, table, s, p.num_pages, d, first, len};
  const Keys values{p.v + kh * head_size, table, s, p.num_pages, d, first, len};
  const int64_t n = keys.count();
  for (int64_t h0 = 0; h0 < g; h0 += kMaxHeads) {
    const int nh = static_cast<int>(std::min<int64_t>(kMaxHeads, g - h0));
    scores.assign(nh * n, 0.0f);
    for (int64_t off = 0; off < d; off += kMaxVecs * kLanes) {
      const int nv = static_cast<int>(std::min<int64_t>(kMaxVecs, (d - off) / kLanes));
      Dispatch<Score>(nh, nv, q + h0 * d, d, keys, off, scores.data());
    }
    for (int64_t j = 0; j < nh; ++j) {
      float* sj = scores.data() + j * n;
      for (int64_t i = 0; i < n; ++i) sj[i] *= p.scale;
      float m = sj[0];
      for (int64_t i = 1; i < n; ++i) m = std::max(m, sj[i]);
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        sj[i] = std::exp(sj[i] - m);
        sum += sj[i];
      }
      for (int64_t i = 0; i < n; ++i) sj[i] /= sum;
    }
    for (int64_t off = 0; off < d; off += kMaxVecs * kLanes) {
      const int nv = static_cast<int>(std::min<int64_t>(kMaxVecs, (d - off) / kLanes));
      Dispatch<Value>(nh, nv, scores.data(), values, off, out + h0 * d, d);
    }
  }
}

struct Work {
  explicit Work(Problem problem) : p(problem), items(problem.batch * problem.kv_heads) {}
  Problem p;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    std::vector<float> scores;
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      AttendOne(p, i / p.kv_heads, i % p.kv_heads, scores);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables,
                       ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> out, float scale,
                       int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      lens.element_count() != static_cast<size_t>(qd[0]) || td[0] != qd[0] || kd[3] != qd[2] ||
      qd[1] % kd[0] != 0) {
    return ffi::Error::InvalidArgument("paged decode: inconsistent shapes");
  }
  if (qd[2] % kLanes != 0) {
    return ffi::Error::InvalidArgument("paged decode: head_dim must be a multiple of 16");
  }
  Problem p{q.typed_data(), k.typed_data(), v.typed_data(), tables.typed_data(),
            lens.typed_data(), out->typed_data(), qd[0], qd[1], kd[0], qd[2], kd[1], kd[2],
            td[1], scale, window};
  auto work = std::make_shared<Work>(p);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->items) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([work] { work->Drain(); });
  }
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OmniJaxPagedDecodeF32, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
