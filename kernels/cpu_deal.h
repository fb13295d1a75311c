// Work items dealt to threads one at a time from a shared counter (kvloom's decode, prefill, GEMM and fused
// kernels). A thread the OS preempts (a serving host runs its HTTP server, router and client on the same
// cores) holds up only the item it has, where a fixed split would make every other thread wait at the end
// of the call for its whole share; and items ordered costliest first end on cheap ones.
//
// Two ways to run them. ATen's OpenMP team: every call ends at a barrier that every thread of the team
// must reach, so a thread descheduled before it took any item still holds the call up until the OS runs it
// again. Or kvloom's own pool (`ItemPool`, on once `set_pool_threads(n)` asked for it, with torch's own
// threads at one): a call is over when its items are, and a worker that wakes up late finds it over and
// goes back to waiting, so the threads left running do the preempted one's share.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <utility>

namespace kvloom_cpu {  // named, not anonymous: one pool for every kernel library of the process

class ItemPool {
 public:
  using Runner = int64_t (*)(void* call, uint32_t generation, int64_t first_item);

  // the one pool of the process: inline functions' statics are unique across the kernels' shared objects
  // (GNU unique symbols), and it is never destroyed, so a worker never outlives it
  static ItemPool& get();

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  // n threads run the calls (the caller and n - 1 workers); 0: the pool is off, calls go to ATen's team
  void set_threads(int n) {
    std::lock_guard lock(owner_);
    if (n == threads()) return;
    stop_workers();
    threads_.store(std::max(n, 0));
  }

  // The next item of call `generation`, or -1 once that call has no more (or is over).
  int64_t claim(uint32_t generation) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(s >> 32) != generation) return -1;
      const int64_t next = static_cast<int64_t>(s & 0xffffffffu);
      if (next >= calls_[generation & 1].items.load(std::memory_order_relaxed)) return -1;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return next;
    }
  }

  // Runs `items` items through runner(call, generation, first) on the pool's threads and this one; false
  // (nothing run) where the pool is off or another thread's call holds it.
  bool run(int64_t items, Runner runner, void* call) {
    if (threads() < 2 || items < 2 || items >= (int64_t{1} << 32)) return false;
    std::unique_lock lock(owner_, std::try_to_lock);
    if (!lock) return false;
    start_workers();
    const uint32_t generation = publish(items, runner, call);
    const int64_t first = claim(generation);
    if (first >= 0) done_.fetch_add(runner(call, generation, first), std::memory_order_acq_rel);
    for (int spins = 0; done_.load(std::memory_order_acquire) < items; ++spins) {
      if (spins < 2048) _mm_pause();
      else sched_yield();  // the worker holding the last item was preempted: let the OS run it here
    }
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    return true;
  }

  void fail(std::exception_ptr error) {
    std::lock_guard lock(error_lock_);
    if (!error_) error_ = error;
  }

 private:
  struct Call {
    std::atomic<int64_t> items{0};
    std::atomic<Runner> runner{nullptr};
    std::atomic<void*> call{nullptr};
  };
  static constexpr auto SPIN = std::chrono::milliseconds(2);  // a worker's wait before it sleeps (cf. GOMP_SPINCOUNT)

  ItemPool() {
    pthread_atfork(nullptr, nullptr, [] { get().forked(); });
  }

  // the next generation's call, then the generation itself (its item counter at 0); wakes sleeping workers
  uint32_t publish(int64_t items, Runner runner, void* call) {
    const uint32_t generation = static_cast<uint32_t>(state_.load(std::memory_order_relaxed) >> 32) + 1;
    Call& c = calls_[generation & 1];
    c.items.store(items, std::memory_order_relaxed);
    c.runner.store(runner, std::memory_order_relaxed);
    c.call.store(call, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(generation) << 32, std::memory_order_release);
    state_.notify_all();
    return generation;
  }

  void forked() {  // the child has none of the parent's workers
    alive_.store(0);
    started_ = 0;
    new (&owner_) std::mutex();
  }

  void start_workers() {
    for (; started_ < threads() - 1; ++started_) {
      pthread_t thread;  // named like the engine thread that starts it
      alive_.fetch_add(1);
      if (pthread_create(&thread, nullptr, [](void*) -> void* { get().work(); return nullptr; }, nullptr)) {
        alive_.fetch_sub(1);
        break;
      }
      pthread_detach(thread);
    }
  }

  void stop_workers() {
    stop_.store(true);
    publish(0, nullptr, nullptr);  // a call with no items: wakes every worker
    while (alive_.load() > 0) sched_yield();
    stop_.store(false);
    started_ = 0;
  }

  void work() {
    uint32_t seen = static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32);
    while (!stop_.load(std::memory_order_acquire)) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(s >> 32) == seen) {
        wait_from(s, seen);
        continue;
      }
      seen = static_cast<uint32_t>(s >> 32);
      const int64_t first = claim(seen);
      if (first < 0) continue;  // over before this worker got there
      const Call& c = calls_[seen & 1];  // valid: the call cannot end while this worker holds an item of it
      done_.fetch_add(c.runner.load(std::memory_order_relaxed)(c.call.load(std::memory_order_relaxed), seen, first),
                      std::memory_order_acq_rel);
    }
    alive_.fetch_sub(1);
  }

  // spin (a call usually follows within microseconds in a step), then sleep until the state changes
  void wait_from(uint64_t s, uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + SPIN;
    for (int spins = 1;; ++spins) {
      _mm_pause();
      if (static_cast<uint32_t>(state_.load(std::memory_order_relaxed) >> 32) != seen) return;
      if (spins % 256 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    state_.wait(s, std::memory_order_acquire);
  }

  std::atomic<uint64_t> state_{0};  // the current call's generation (high 32 bits), its next item (low 32)
  Call calls_[2];                   // by generation parity: a late reader of the previous one reads it whole
  std::atomic<int64_t> done_{0};    // items finished in the current call
  std::atomic<int> alive_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> threads_{0};
  int started_ = 0;
  std::mutex owner_;  // one caller at a time; another thread's call runs on ATen's team meanwhile
  std::mutex error_lock_;
  std::exception_ptr error_;
};

inline ItemPool& ItemPool::get() {
  static ItemPool* pool = new ItemPool();
  return *pool;
}

}  // namespace kvloom_cpu

namespace {

using kvloom_cpu::ItemPool;

// The threads a call is dealt to (to size its items).
inline int64_t deal_threads() {
  const int pool = ItemPool::get().threads();
  return pool ? pool : at::get_num_threads();
}

// run_item(n, state) for n in [0, items), each on some thread; state = make_state(), once a thread (its
// scratch memory)
template <typename MakeState, typename RunItem>
void deal_items(int64_t items, MakeState&& make_state, RunItem&& run_item) {
  if (items <= 0) return;
  auto work = [&](uint32_t generation, int64_t first) -> int64_t {  // items this thread took
    int64_t took = 0, n = first;
    try {
      auto state = make_state();
      for (; n >= 0; n = ItemPool::get().claim(generation), ++took) run_item(n, state);
    } catch (...) {  // raised again on the calling thread; the failed item and the rest are taken, not run
      ItemPool::get().fail(std::current_exception());
      for (; n >= 0; n = ItemPool::get().claim(generation)) ++took;
    }
    return took;
  };
  using Work = decltype(work);
  const ItemPool::Runner runner = [](void* call, uint32_t generation, int64_t first) {
    return (*static_cast<Work*>(call))(generation, first);
  };
  if (ItemPool::get().run(items, runner, &work)) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t n; (n = next.fetch_add(1, std::memory_order_relaxed)) < items;) run_item(n, state);
  });
}

// f(begin, end) over [begin, end) in chunks of at least `grain`, a few per thread (ATen's parallel_for's
// contract, dealt as items)
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, F&& f) {
  const int64_t n = end - begin, threads = deal_threads();
  if (n <= 0) return;
  int64_t chunks = std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, 4 * threads);
  if (chunks > threads) chunks -= chunks % threads;  // whole rounds: no thread left with the last odd one
  deal_items(chunks, [] { return 0; }, [&](int64_t c, int) { f(begin + n * c / chunks, begin + n * (c + 1) / chunks); });
}

}  // namespace
