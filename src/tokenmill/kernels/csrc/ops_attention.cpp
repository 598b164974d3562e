// Paged attention over the KV blocks in place: decode (one query row per sequence, long
// contexts split and merged) and prefill chunks, both as the prefill kernel's work items.
#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {

// Tokens per split of a long context: enough work per item that the merge stays cheap.
constexpr int64_t kMinSplitTokens = 256;
// Tokens per split where the KV heads alone would leave a thread idle: one stream's decode
// over SmolLM2's 3 KV heads on 2 threads ran one thread's 2 heads while the other's 1 was
// done, and over Gemma 3's single KV head on one thread while the other waited.
constexpr int64_t kMinSplitTokensFew = 64;

// The fields decode and prefill attention share, after the checks they share (`op` names
// the caller in the errors): q [rows, Hq, D] over the [blocks, block_size, Hkv, D] caches
// through the long block tables and lengths, and kv_scales as floats. The caller keeps
// those tensors alive and sets out, query_start and the work items.
PrefillArgs paged_args(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                       const at::Tensor& scales, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), op, ": q [rows, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": K and V caches [blocks, block_size, Hkv, D], contiguous, one dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, op,
              ": head shapes do not match the cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == lens.numel(), op,
              ": one block table row per sequence");
  TORCH_CHECK(scales.numel() == 2, op, ": kv_scales holds [k_scale, v_scale]");
  PrefillArgs a{};
  a.q = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.context_lens = lens.data_ptr<int64_t>();
  a.Hq = q.size(1);
  a.Hkv = k_cache.size(2);
  a.D = q.size(2);
  a.block_size = k_cache.size(1);
  a.ldq = q.stride(0);
  a.ldbt = block_tables.size(1);
  a.window = window;
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  a.k_scale = scales.data_ptr<float>()[0];
  a.v_scale = scales.data_ptr<float>()[1];
  a.q_fmt = act_fmt(q);
  a.kv_fmt = fmt_of(k_cache);
  return a;
}

// Decode's work items across the threads, claimed one at a time as parallel_chunks does, but
// each thread claims its next item before it runs the current one, so that the current one's
// last key tile asks for the next one's first (PrefillArgs::next_item): items are a few
// tiles each at short contexts, and their first tiles had no one to ask for them.
void decode_items(const KernelTable& k, const PrefillArgs& p, int64_t items) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), items);
  if (tasks <= 1 || at::in_parallel_region()) {
    if (items > 0) k.prefill_attention(p, 0, items);  // the range prefetches item to item itself
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    PrefillArgs own = p;
    for (int64_t cur = next.fetch_add(1, std::memory_order_relaxed); cur < items;) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      own.next_item = after < items ? after : -1;
      k.prefill_attention(own, cur, cur + 1);
      cur = after;
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const at::Tensor& kv_scales, double softcap) {
  at::Tensor bt = block_tables.to(at::kLong).contiguous();
  at::Tensor cl = context_lens.to(at::kLong).contiguous();
  at::Tensor sc = kv_scales.to(at::kFloat).contiguous();
  PrefillArgs p = paged_args("decode_attention", q, k_cache, v_cache, bt, cl, scale, window, sc, softcap);
  const int64_t B = q.size(0), Hq = p.Hq, D = p.D, bs = p.block_size;
  TORCH_CHECK(cl.numel() == B, "decode_attention: one context length per query row");
  const int64_t* lens = p.context_lens;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= p.ldbt * bs, "decode_attention: context length ", lens[b],
                " outside the block table");
  // Work items: whole sequences, or, when there are fewer sequences than ~4 per thread,
  // splits of the long ones (whole blocks, >= kMinSplitTokens each) merged afterwards.
  // Still fewer than 2 items per thread (one short sequence: one stream's decode), each
  // (sequence, split) goes one KV head per item, and where the (sequence, KV head) pairs
  // alone are fewer than 2 per thread, each sequence is split at least `need` ways (down
  // to kMinSplitTokensFew tokens), so that every thread has work and the items divide evenly.
  const int64_t threads = at::get_num_threads();
  const int64_t want = B >= 4 * threads ? 1 : (4 * threads + B - 1) / B;
  const int64_t head_items = B * p.Hkv;
  const int64_t need = head_items >= 2 * threads ? 1 : (2 * threads + head_items - 1) / head_items;
  std::vector<int64_t> ranges, seq_slots(B + 1, 0), starts(B + 1);  // ranges: [lo, hi) per slot
  ranges.reserve(2 * B * std::max(want, need));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    const int64_t L = lens[b] - start;
    const int64_t few = std::min<int64_t>(need, L / kMinSplitTokensFew);
    const int64_t splits = std::max<int64_t>(1, std::max(std::min<int64_t>(want, L / kMinSplitTokens), few));
    const int64_t per = (L + splits - 1) / splits;
    const int64_t step = std::max<int64_t>(bs, (per + bs - 1) / bs * bs);  // whole blocks
    for (int64_t t = start / bs * bs; t < lens[b]; t += step)
      ranges.insert(ranges.end(), {std::max(t, start), std::min(t + step, lens[b])});
    seq_slots[b + 1] = static_cast<int64_t>(ranges.size()) / 2;
    starts[b + 1] = b + 1;
  }
  const int64_t slots = seq_slots[B];
  const int64_t heads_per_item = slots < 2 * threads ? 1 : p.Hkv;
  std::vector<int64_t> triples, item_range, item_slot;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = seq_slots[b]; s < seq_slots[b + 1]; ++s)
      for (int64_t h = 0; h < p.Hkv; h += heads_per_item) {
        triples.insert(triples.end(), {b, h, 0});  // one query row, heads [h, h + heads_per_item)
        item_range.insert(item_range.end(), {ranges[2 * s], ranges[2 * s + 1]});
        item_slot.push_back(s);
      }
  const int64_t items = static_cast<int64_t>(item_slot.size());
  at::Tensor out = at::empty({B, Hq * D}, q.options());
  at::Tensor partial, partial_ml;
  if (slots > B) {
    partial = at::empty({slots, Hq, D}, q.options().dtype(at::kFloat));
    partial_ml = at::empty({slots, Hq, 2}, q.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
    p.partial_ml = partial_ml.data_ptr<float>();
  }
  // The prefill kernel with one query row per sequence per item: keys in tiles across
  // blocks (one softmax update per tile), bf16 dot products on AVX-512.
  p.query_start = starts.data();
  p.out = out.data_ptr();
  p.items = triples.data();
  p.rows_per_item = 1;
  p.heads_per_item = heads_per_item;
  p.key_tile = kDecodeKeyTile;
  p.item_keys = item_range.data();
  p.item_slot = item_slot.data();
  const KernelTable& k = kernels();
  decode_items(k, p, items);
  if (slots > B) {
    const AttnArgs m{p.out, Hq, D, p.q_fmt, p.partial, p.partial_ml, seq_slots.data()};
    parallel_chunks(B, 1, [&](int64_t b0, int64_t b1) { k.attention_merge(m, b0, b1); });
  }
  return out;
}

// Prefill chunks over the paged cache: sequence b's queries are q rows [query_start[b],
// query_start[b+1]), its last positions; they attend its first context_lens[b] tokens,
// causally. Work items (sequence, KV head, tile of query rows), ordered so that a
// contiguous share of them (OpenMP's static split) mixes early and late, cheap and dear,
// tiles of the causal triangle.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& context_lens,
                                   const at::Tensor& query_start, double scale, int64_t window,
                                   const at::Tensor& kv_scales, double softcap) {
  at::Tensor bt = block_tables.to(at::kLong).contiguous();
  at::Tensor cl = context_lens.to(at::kLong).contiguous();
  at::Tensor qs = query_start.to(at::kLong).contiguous();
  at::Tensor sc = kv_scales.to(at::kFloat).contiguous();
  PrefillArgs a = paged_args("prefill_attention", q, k_cache, v_cache, bt, cl, scale, window, sc, softcap);
  const int64_t N = q.size(0), B = cl.numel(), bs = a.block_size;
  TORCH_CHECK(qs.numel() == B + 1, "prefill_attention: one query range per sequence");
  const int64_t *lens = a.context_lens, *starts = qs.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[B] == N, "prefill_attention: query_start must run from 0 to ", N);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = starts[b + 1] - starts[b];
    TORCH_CHECK(n >= 0 && n <= lens[b] && lens[b] <= a.ldbt * bs, "prefill_attention: sequence ", b, " has ", n,
                " queries for a context of ", lens[b], " in ", a.ldbt, " blocks");
  }
  // AMX-BF16 tiles for bf16 queries over a bf16 cache, where granted.
  a.amx = amx_bf16_active() && a.q_fmt == BF16 && a.kv_fmt == BF16;
  const int64_t Hkv = a.Hkv, G = a.Hq / Hkv;
  const int64_t rows = a.amx ? prefill_rows_per_item_amx(G) : prefill_rows_per_item(G);
  std::vector<int64_t> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tiles = (starts[b + 1] - starts[b] + rows - 1) / rows;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t i = 0; i < tiles; ++i) {
        // Tiles in the order 0, last, 1, last - 1, ...: any contiguous run is balanced.
        const int64_t tile = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
        items.insert(items.end(), {b, h, tile * rows});
      }
  }
  at::Tensor out = at::empty({N, a.Hq * a.D}, q.options());
  a.query_start = starts;
  a.out = out.data_ptr();
  a.items = items.data();
  a.rows_per_item = rows;
  a.heads_per_item = 1;
  a.key_tile = a.amx ? kAmxPrefillKeyTile : kPrefillKeyTile;
  a.one_pass_softmax = true;
  const KernelTable& k = kernels();
  const int64_t count = static_cast<int64_t>(items.size()) / 3;
  parallel_chunks(count, 1, [&](int64_t i0, int64_t i1) { k.prefill_attention(a, i0, i1); });
  return out;
}

}  // namespace tokenmill
