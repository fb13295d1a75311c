// Python's switch for the kernels' own thread pool (cpu_deal.h): on with n >= 1 threads, off (ATen's
// OpenMP team) at 0. kernels/item_pool.py decides when.
#include <torch/library.h>

#include "cpu_deal.h"

namespace {

void set_pool_threads(int64_t threads) { ItemPool::get().set_threads(static_cast<int>(threads)); }

int64_t pool_threads() { return ItemPool::get().threads(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("set_pool_threads(int threads) -> ()", &set_pool_threads);
  m.def("pool_threads() -> int", &pool_threads);
}
