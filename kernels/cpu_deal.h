// Work items dealt to ATen's threads one at a time from a shared counter (kvloom's decode, prefill and GEMM
// kernels). A thread the OS preempts (a serving host runs its HTTP server, router and client on the same
// cores) holds up only the item it has, where a fixed split would make every other thread wait at the end
// of the call for its whole share; and items ordered costliest first end on cheap ones.
#pragma once
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>

namespace {

// run_item(n, state) for n in [0, items), each on some thread; state = make_state(), once a thread (its
// scratch memory)
template <typename MakeState, typename RunItem>
void deal_items(int64_t items, MakeState&& make_state, RunItem&& run_item) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t n; (n = next.fetch_add(1, std::memory_order_relaxed)) < items;) run_item(n, state);
  });
}

}  // namespace
