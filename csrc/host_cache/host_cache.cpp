// host_cache.cpp: a capped cache of large host blocks for torch's CPU allocator.
//
// ZeRO-3 on the CPU allocates and frees the same large temporaries for every module of every step (gathered
// parameters, the collectives' flat copies, autograd's full weight gradients). With glibc's mmap threshold pinned
// at 1 MiB each is a fresh mapping that the kernel faults in and zeroes page by page; served from glibc's heap
// instead, their freed pages stay resident (fragmentation), about a whole gathered model per rank.
//
// This allocator sits in front of torch's CPU allocator. Requests of at least `min_bytes` are rounded up to a
// page and, when freed, kept in a free list per rounded size while the cache holds at most `cap_bytes`; the next
// request of that size takes the block back (no fault, no zeroing: torch.empty's memory is uninitialised anyway).
// A free that would take the cache past its cap returns the block to the OS. Smaller requests go to the
// allocator that was installed before. `release()` empties the cache. Thread-safe (autograd's and the process
// group's threads allocate too). Allocations and frees are reported to torch.profiler as torch's own allocator
// reports them (the size asked for).
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <iterator>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;

struct HostCache final : public c10::Allocator {
  c10::Allocator* base = nullptr;
  size_t min_bytes = 1 << 20;
  size_t cap_bytes = 0;
  mutable std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;  // rounded size -> cached blocks
  std::unordered_map<void*, size_t> live;                       // our blocks in use -> rounded size
  size_t cached = 0, hits = 0, misses = 0, returned = 0, live_bytes = 0, peak_cached = 0;

  static void Delete(void* ptr);

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < min_bytes || cap_bytes == 0) {
      return base->allocate(nbytes);
    }
    const size_t size = (nbytes + kPage - 1) / kPage * kPage;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = free_blocks.find(size);
      if (it != free_blocks.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        cached -= size;
        ++hits;
      } else {
        ++misses;
      }
    }
    if (ptr == nullptr) {
      ptr = c10::alloc_cpu(size);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      live.emplace(ptr, size);
      live_bytes += size;
    }
    c10::profiledCPUMemoryReporter().New(ptr, nbytes);  // torch.profiler's memory events, as torch's allocator
    return {ptr, ptr, &HostCache::Delete, c10::Device(c10::DeviceType::CPU)};
  }

  // true when `ptr` was ours (now cached or returned)
  bool give_back(void* ptr) {
    size_t size;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = live.find(ptr);
      if (it == live.end()) {
        return false;
      }
      c10::profiledCPUMemoryReporter().Delete(ptr);
      size = it->second;
      live.erase(it);
      live_bytes -= size;
      if (cached + size <= cap_bytes) {
        free_blocks[size].push_back(ptr);
        cached += size;
        peak_cached = std::max(peak_cached, cached);
        return true;
      }
      ++returned;
    }
    c10::free_cpu(ptr);
    return true;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::Delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // return cached blocks to the OS until the cache holds at most `limit` bytes
  void shrink_to(size_t limit) {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = free_blocks.begin(); it != free_blocks.end() && cached > limit;) {
        while (!it->second.empty() && cached > limit) {
          blocks.push_back(it->second.back());
          it->second.pop_back();
          cached -= it->first;
        }
        it = it->second.empty() ? free_blocks.erase(it) : std::next(it);
      }
    }
    for (void* p : blocks) {
      c10::free_cpu(p);
    }
  }
};

HostCache g_cache;
bool g_installed = false;

void HostCache::Delete(void* ptr) {
  if (!g_cache.give_back(ptr)) {
    // a small block of the allocator installed before: its raw deleter frees it
    g_cache.base->raw_deleter()(ptr);
  }
}

// Put the cache in front of torch's CPU allocator (once per process) or change its cap and threshold; a lower cap
// returns the blocks above it to the OS at once (0: the cache is empty and every request passes through).
void install(int64_t cap_bytes, int64_t min_bytes) {
  TORCH_CHECK(cap_bytes >= 0 && min_bytes > 0, "host_cache.install: cap_bytes >= 0 and min_bytes > 0");
  {
    std::lock_guard<std::mutex> lock(g_cache.mu);
    if (!g_installed) {
      g_cache.base = c10::GetCPUAllocator();
      TORCH_CHECK(g_cache.base->raw_deleter() != nullptr, "host_cache: torch's CPU allocator has no raw deleter");
      c10::SetCPUAllocator(&g_cache, /*priority=*/100);
      g_installed = true;
    }
    g_cache.cap_bytes = static_cast<size_t>(cap_bytes);
    g_cache.min_bytes = static_cast<size_t>(min_bytes);
  }
  g_cache.shrink_to(static_cast<size_t>(cap_bytes));
}

std::unordered_map<std::string, int64_t> stats() {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  return {{"installed", g_installed},
          {"cap_bytes", static_cast<int64_t>(g_cache.cap_bytes)},
          {"min_bytes", static_cast<int64_t>(g_cache.min_bytes)},
          {"cached_bytes", static_cast<int64_t>(g_cache.cached)},
          {"peak_cached_bytes", static_cast<int64_t>(g_cache.peak_cached)},
          {"live_bytes", static_cast<int64_t>(g_cache.live_bytes)},
          {"hits", static_cast<int64_t>(g_cache.hits)},
          {"misses", static_cast<int64_t>(g_cache.misses)},
          {"returned", static_cast<int64_t>(g_cache.returned)}};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "put the capped cache in front of torch's CPU allocator", py::arg("cap_bytes"),
        py::arg("min_bytes"));
  m.def("release", []() { g_cache.shrink_to(0); }, "return every cached block to the OS (the cap stays)");
  m.def("stats", &stats);
}
