// Prefetching the next stretch of a stream a few cache lines at each step of the current one's work.
// The hardware prefetcher follows a stream only while it is read; where a kernel reads in bursts
// (a paged KV block, a weight panel) with arithmetic between them, each burst would start by waiting
// on memory. Issued all at once, the prefetches filled the core's miss buffers and stalled it, so
// they are spread: aim() at the next stretch (null: none) with the number of steps the current work
// takes, then step() once a step.
#pragma once

#include <algorithm>
#include <cstdint>

namespace conveyor_prefetch {

// kLocality: __builtin_prefetch's, 3 into L1 (a KV block read once), 2 into L2 (a weight panel
// larger than L1, unpacked from there).
template <int kLocality>
struct SpreadPrefetcher {
  const char *next = nullptr, *end = nullptr;
  int64_t lines_per_step = 0;

  void aim(const void* stretch, int64_t bytes, int64_t steps) {
    next = static_cast<const char*>(stretch);
    end = stretch ? next + bytes : nullptr;
    lines_per_step = (bytes / 64 + steps - 1) / std::max<int64_t>(1, steps);
  }
  void step() {
    for (int64_t i = 0; i < lines_per_step && next < end; ++i, next += 64) __builtin_prefetch(next, 0, kLocality);
  }
};

}  // namespace conveyor_prefetch
