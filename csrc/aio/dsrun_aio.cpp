// dsrun_aio.cpp: asynchronous tensor <-> file I/O for NVMe offload.
//
// An AioHandle owns `intra_op_parallelism` worker threads. Each read or write is split into that many
// contiguous slices (block-aligned), one per worker, so a single large request uses every worker. A worker
// moves its slice in `block_size` chunks with one of two engines:
//   - libaio (when built with -DDSRUN_HAVE_LIBAIO): up to `queue_depth` chunks in flight per worker;
//     `single_submit` submits them one io_submit() at a time instead of in a batch; `overlap_events`
//     refills the queue as each completion arrives instead of draining the whole batch first;
//   - threads: plain pread()/pwrite() of each chunk.
// O_DIRECT is used for the block-aligned part of a slice when the buffer and offset are 4096-aligned and the
// filesystem accepts it (tmpfs does not: then buffered I/O); the unaligned tail of the last slice always uses
// buffered I/O, so any byte length round-trips exactly. Errors carry errno text and the file name, and are
// raised from wait() (or the sync call).
//
// A write may also go to a descriptor the caller opened (DeepSpeed's `async_pwrite(buffer, fd, file_offset)`,
// which its FastFileWriter uses): the bytes land at [file_offset, file_offset + nbytes) of that file, which is
// neither truncated nor reopened. When the descriptor has O_DIRECT, the offset, the length and the buffer must
// be 4096-aligned (the kernel refuses anything else), which `get_alignment()` bytes per request guarantee.
#include <torch/extension.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef DSRUN_HAVE_LIBAIO
#include <libaio.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace dsrun {

constexpr int64_t kAlign = 4096;

std::string errno_text(const std::string& what, const std::string& file, int err) {
    return what + " '" + file + "': " + std::strerror(err);
}

// One user request (a whole tensor to or from one file).
struct Request {
    at::Tensor buffer;  // kept alive until the request completes
    std::string file;
    int fd = -1;               // >= 0: write to this caller-owned descriptor instead of opening `file`
    bool fd_direct = false;    // that descriptor has O_DIRECT
    int64_t file_offset = 0;   // where the buffer's first byte goes in the file (descriptor writes)
    bool read = false;
    int64_t nbytes = 0;
    std::atomic<int> remaining{0};
    std::mutex mutex;
    std::string error;
    void fail(const std::string& message) {
        std::lock_guard<std::mutex> lock(mutex);
        if (error.empty()) error = message;
    }
};

class Fd {
  public:
    Fd(const std::string& file, int flags) : fd_(::open(file.c_str(), flags | O_CLOEXEC, 0644)) {}
    ~Fd() { if (fd_ >= 0) ::close(fd_); }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    int get() const { return fd_; }

  private:
    int fd_;
};

// Buffered (or O_DIRECT) blocking I/O of [offset, offset + len) in chunks; returns "" or an error message.
std::string blocking_io(int fd, bool read, char* buf, int64_t offset, int64_t len, int64_t chunk,
                        const std::string& file) {
    int64_t done = 0;
    while (done < len) {
        const size_t want = static_cast<size_t>(std::min(chunk, len - done));
        ssize_t n = read ? ::pread(fd, buf + done, want, offset + done) : ::pwrite(fd, buf + done, want, offset + done);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno_text(read ? "read from" : "write to", file, errno);
        }
        if (n == 0) return "unexpected end of file reading '" + file + "'";
        done += n;
    }
    return "";
}

#ifdef DSRUN_HAVE_LIBAIO
// One libaio context per worker thread, kept for the thread's life: io_destroy waits for an RCU grace period
// (tens of milliseconds on a busy VM), which made every request of a swap-sized tensor that slow.
struct ThreadAioContext {
    io_context_t ctx = nullptr;
    int depth = 0;
    ~ThreadAioContext() { if (ctx != nullptr) io_destroy(ctx); }
};

std::string libaio_io(int fd, bool read, char* buf, int64_t offset, int64_t len, int64_t chunk, int queue_depth,
                      bool single_submit, bool overlap_events, const std::string& file) {
    thread_local ThreadAioContext context;
    int rc = 0;
    if (context.ctx == nullptr || context.depth < queue_depth) {
        if (context.ctx != nullptr) io_destroy(context.ctx);
        context.ctx = nullptr;
        context.depth = 0;
        rc = io_setup(queue_depth, &context.ctx);
        if (rc < 0) {
            context.ctx = nullptr;
            return errno_text("io_setup for", file, -rc);
        }
        context.depth = queue_depth;
    }
    io_context_t ctx = context.ctx;
    std::vector<iocb> cbs(queue_depth);
    std::vector<iocb*> free_cbs;
    for (auto& cb : cbs) free_cbs.push_back(&cb);
    std::vector<io_event> events(queue_depth);
    std::string error;
    int64_t next = 0;  // next byte to submit
    int inflight = 0;
    while ((next < len || inflight > 0) && error.empty()) {
        // Submit as many chunks as there are free slots (all of them when not overlapping).
        std::vector<iocb*> batch;
        while (next < len && !free_cbs.empty()) {
            iocb* cb = free_cbs.back();
            free_cbs.pop_back();
            const size_t n = static_cast<size_t>(std::min(chunk, len - next));
            if (read) io_prep_pread(cb, fd, buf + next, n, offset + next);
            else io_prep_pwrite(cb, fd, buf + next, n, offset + next);
            cb->data = reinterpret_cast<void*>(static_cast<intptr_t>(n));
            batch.push_back(cb);
            next += static_cast<int64_t>(n);
        }
        size_t submitted = 0;
        while (submitted < batch.size() && error.empty()) {
            const long count = single_submit ? 1 : static_cast<long>(batch.size() - submitted);
            rc = io_submit(ctx, count, batch.data() + submitted);
            if (rc == -EAGAIN || rc == -EINTR) continue;
            if (rc < 0) { error = errno_text("io_submit for", file, -rc); break; }
            submitted += static_cast<size_t>(rc);
            inflight += rc;
        }
        if (!error.empty() || inflight == 0) break;
        // overlap_events: take whatever completed (at least one) and refill; otherwise drain the batch.
        const int min_nr = overlap_events ? 1 : inflight;
        int got = io_getevents(ctx, min_nr, queue_depth, events.data(), nullptr);
        if (got == -EINTR) continue;
        if (got < 0) { error = errno_text("io_getevents for", file, -got); break; }
        for (int e = 0; e < got; ++e) {
            iocb* cb = events[e].obj;
            const long res = static_cast<long>(events[e].res);
            const long expected = static_cast<long>(reinterpret_cast<intptr_t>(cb->data));
            if (res < 0) error = errno_text(read ? "read from" : "write to", file, static_cast<int>(-res));
            else if (res != expected) error = "short " + std::string(read ? "read from '" : "write to '") + file + "'";
            free_cbs.push_back(cb);
            --inflight;
        }
    }
    // Never leave requests in flight on a buffer we are about to give back.
    while (inflight > 0) {
        int got = io_getevents(ctx, 1, queue_depth, events.data(), nullptr);
        if (got < 0 && got != -EINTR) break;
        if (got > 0) inflight -= got;
    }
    return error;
}
#endif

class AioHandle {
  public:
    AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
              int64_t intra_op_parallelism, const std::string& engine, bool use_o_direct)
        : block_size_(block_size), queue_depth_(queue_depth), single_submit_(single_submit),
          overlap_events_(overlap_events), threads_(intra_op_parallelism), use_o_direct_(use_o_direct) {
        TORCH_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
        TORCH_CHECK(queue_depth > 0, "queue_depth must be positive, got ", queue_depth);
        TORCH_CHECK(intra_op_parallelism > 0, "thread_count (intra_op_parallelism) must be positive, got ",
                    intra_op_parallelism);
#ifdef DSRUN_HAVE_LIBAIO
        const bool have_libaio = true;
#else
        const bool have_libaio = false;
#endif
        if (engine == "auto") engine_ = have_libaio ? "libaio" : "threads";
        else if (engine == "threads" || (engine == "libaio" && have_libaio)) engine_ = engine;
        else TORCH_CHECK(false, "aio engine '", engine, "' is not available; this build has: ",
                         have_libaio ? "libaio, threads" : "threads (install libaio-dev and rebuild for libaio)");
        for (int64_t i = 0; i < threads_; ++i) workers_.emplace_back([this] { work(); });
    }

    ~AioHandle() {
        try { wait(); } catch (...) {}
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        task_cv_.notify_all();
        for (auto& w : workers_) w.join();
    }

    int64_t async_pread(const at::Tensor& buffer, const std::string& file) { submit(buffer, file, true); return 0; }
    int64_t async_pwrite(const at::Tensor& buffer, const std::string& file) { submit(buffer, file, false); return 0; }

    int64_t sync_pread(const at::Tensor& buffer, const std::string& file) {
        auto req = submit(buffer, file, true);
        finish(req);
        return 1;
    }
    int64_t sync_pwrite(const at::Tensor& buffer, const std::string& file) {
        auto req = submit(buffer, file, false);
        finish(req);
        return 1;
    }

    // Writes into a descriptor the caller opened and closes, at `file_offset` (no truncation).
    int64_t async_pwrite_fd(const at::Tensor& buffer, int64_t fd, int64_t file_offset) {
        submit_fd(buffer, fd, file_offset);
        return 0;
    }
    int64_t sync_pwrite_fd(const at::Tensor& buffer, int64_t fd, int64_t file_offset) {
        auto req = submit_fd(buffer, fd, file_offset);
        finish(req);
        return 1;
    }

    // The byte multiple a descriptor write's length must have so that every worker's slice is O_DIRECT-aligned.
    int64_t alignment() const { return threads_ * kAlign; }

    // Wait for every submitted request; returns how many completed. Raises the first error, if any.
    int64_t wait() {
        std::vector<std::shared_ptr<Request>> reqs;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            reqs.swap(pending_);
        }
        std::string first_error;
        for (auto& r : reqs) {
            std::string e = await(r);
            if (first_error.empty()) first_error = e;
        }
        if (!first_error.empty()) throw std::runtime_error(first_error);
        return static_cast<int64_t>(reqs.size());
    }

    int64_t pending() {
        std::lock_guard<std::mutex> lock(mutex_);
        return static_cast<int64_t>(pending_.size());
    }

    int64_t block_size() const { return block_size_; }
    int64_t queue_depth() const { return queue_depth_; }
    bool single_submit() const { return single_submit_; }
    bool overlap_events() const { return overlap_events_; }
    int64_t intra_op_parallelism() const { return threads_; }
    std::string engine() const { return engine_; }
    bool use_o_direct() const { return use_o_direct_; }
    int64_t direct_bytes() const { return direct_bytes_.load(); }

  private:
    std::shared_ptr<Request> submit_fd(const at::Tensor& buffer, int64_t fd, int64_t file_offset) {
        TORCH_CHECK(buffer.device().is_cpu(), "aio buffers must be CPU tensors");
        TORCH_CHECK(buffer.is_contiguous(), "aio buffers must be contiguous");
        TORCH_CHECK(fd >= 0, "async_pwrite: invalid file descriptor ", fd);
        TORCH_CHECK(file_offset >= 0, "async_pwrite: file_offset must be >= 0, got ", file_offset);
        const int flags = ::fcntl(static_cast<int>(fd), F_GETFL);
        if (flags < 0) throw std::runtime_error(errno_text("cannot use descriptor", std::to_string(fd), errno));
        auto req = std::make_shared<Request>();
        req->buffer = buffer;
        req->file = "fd " + std::to_string(fd);
        req->fd = static_cast<int>(fd);
        req->fd_direct = (flags & O_DIRECT) != 0;
        req->file_offset = file_offset;
        req->nbytes = static_cast<int64_t>(buffer.numel()) * static_cast<int64_t>(buffer.element_size());
        if (req->fd_direct) {
            const bool aligned = reinterpret_cast<uintptr_t>(buffer.data_ptr()) % kAlign == 0 &&
                                 file_offset % kAlign == 0 && req->nbytes % alignment() == 0;
            TORCH_CHECK(aligned, "async_pwrite to an O_DIRECT descriptor needs a 4096-aligned buffer and offset and a ",
                        "length that is a multiple of get_alignment() (", alignment(), "); got offset ", file_offset,
                        " and ", req->nbytes, " bytes");
        }
        enqueue(req);
        return req;
    }

    std::shared_ptr<Request> submit(const at::Tensor& buffer, const std::string& file, bool read) {
        TORCH_CHECK(buffer.device().is_cpu(), "aio buffers must be CPU tensors");
        TORCH_CHECK(buffer.is_contiguous(), "aio buffers must be contiguous");
        auto req = std::make_shared<Request>();
        req->buffer = buffer;
        req->file = file;
        req->read = read;
        req->nbytes = static_cast<int64_t>(buffer.numel()) * static_cast<int64_t>(buffer.element_size());
        if (read) {
            struct stat st;
            if (::stat(file.c_str(), &st) != 0) throw std::runtime_error(errno_text("cannot read", file, errno));
            if (st.st_size < req->nbytes)
                throw std::runtime_error("'" + file + "' holds " + std::to_string(st.st_size) +
                                         " bytes but the buffer needs " + std::to_string(req->nbytes));
        } else {
            // Create and size the file once, before the slices are written in parallel.
            Fd fd(file, O_WRONLY | O_CREAT);
            if (fd.get() < 0) throw std::runtime_error(errno_text("cannot create", file, errno));
            // Size the file up front: direct AIO writes that extend a file serialise on the inode (measured
            // 3-5x slower). No O_TRUNC: rewriting a swap file of the same size reuses its blocks.
            if (::ftruncate(fd.get(), req->nbytes) != 0) throw std::runtime_error(errno_text("cannot size", file, errno));
        }
        enqueue(req);
        return req;
    }

    // Split a request into one slice per worker and queue them.
    void enqueue(const std::shared_ptr<Request>& req) {
        // Slices: block-aligned so every slice but the last is O_DIRECT-eligible.
        const int64_t per = std::max<int64_t>(kAlign, ((req->nbytes + threads_ - 1) / threads_ + kAlign - 1) / kAlign * kAlign);
        std::vector<std::pair<int64_t, int64_t>> slices;
        for (int64_t off = 0; off < req->nbytes; off += per) slices.emplace_back(off, std::min(per, req->nbytes - off));
        req->remaining = static_cast<int>(slices.size());
        {
            std::lock_guard<std::mutex> lock(mutex_);
            pending_.push_back(req);
            for (auto& s : slices) tasks_.push_back([this, req, s] { run_slice(*req, s.first, s.second); });
        }
        task_cv_.notify_all();
    }

    void finish(const std::shared_ptr<Request>& req) {
        std::string error = await(req);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            pending_.erase(std::remove(pending_.begin(), pending_.end(), req), pending_.end());
        }
        if (!error.empty()) throw std::runtime_error(error);
    }

    std::string await(const std::shared_ptr<Request>& req) {
        std::unique_lock<std::mutex> lock(mutex_);
        done_cv_.wait(lock, [&] { return req->remaining.load() == 0; });
        std::lock_guard<std::mutex> rlock(req->mutex);
        req->buffer = at::Tensor();
        return req->error;
    }

    void run_slice(Request& req, int64_t offset, int64_t len) {
        char* buf = static_cast<char*>(req.buffer.data_ptr()) + offset;
        if (req.fd >= 0) {
            std::string error = move(req.fd, false, buf, req.file_offset + offset, len, req.file);
            if (error.empty() && req.fd_direct) direct_bytes_ += len;
            if (!error.empty()) req.fail(error);
            {
                std::lock_guard<std::mutex> lock(mutex_);
                req.remaining.fetch_sub(1);
            }
            done_cv_.notify_all();
            return;
        }
        const int rw = req.read ? O_RDONLY : O_WRONLY;
        const bool aligned = reinterpret_cast<uintptr_t>(buf) % kAlign == 0 && offset % kAlign == 0;
        const int64_t direct_len = (use_o_direct_ && aligned) ? len / kAlign * kAlign : 0;
        std::string error;
        int64_t done = 0;
        if (direct_len > 0) {
            Fd fd(req.file, rw | O_DIRECT);
            if (fd.get() >= 0) {
                error = move(fd.get(), req.read, buf, offset, direct_len, req.file);
                done = direct_len;
                if (error.empty()) direct_bytes_ += direct_len;
            } else if (errno != EINVAL) {
                error = errno_text("cannot open", req.file, errno);
            }  // EINVAL: the filesystem refuses O_DIRECT; do it all buffered below
        }
        if (error.empty() && done < len) {
            Fd fd(req.file, rw);
            if (fd.get() < 0) error = errno_text("cannot open", req.file, errno);
            else error = move(fd.get(), req.read, buf + done, offset + done, len - done, req.file);
        }
        if (!error.empty()) req.fail(error);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            req.remaining.fetch_sub(1);
        }
        done_cv_.notify_all();
    }

    std::string move(int fd, bool read, char* buf, int64_t offset, int64_t len, const std::string& file) {
#ifdef DSRUN_HAVE_LIBAIO
        if (engine_ == "libaio")
            return libaio_io(fd, read, buf, offset, len, block_size_, static_cast<int>(queue_depth_), single_submit_,
                             overlap_events_, file);
#endif
        return blocking_io(fd, read, buf, offset, len, block_size_, file);
    }

    void work() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                task_cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
                if (tasks_.empty()) return;  // stopping and nothing left
                task = std::move(tasks_.front());
                tasks_.pop_front();
            }
            task();
        }
    }

    int64_t block_size_, queue_depth_;
    bool single_submit_, overlap_events_;
    int64_t threads_;
    bool use_o_direct_;
    std::string engine_;
    std::mutex mutex_;
    std::condition_variable task_cv_, done_cv_;
    std::deque<std::function<void()>> tasks_;
    std::vector<std::shared_ptr<Request>> pending_;
    std::vector<std::thread> workers_;
    bool stopping_ = false;
    std::atomic<int64_t> direct_bytes_{0};  // bytes moved with O_DIRECT, for tests and tuning
};

// A page-aligned CPU tensor (eligible for O_DIRECT), freed when the tensor is.
at::Tensor aligned_tensor(int64_t num_elem, const at::Tensor& example) {
    TORCH_CHECK(num_elem >= 0, "num_elem must be >= 0");
    const size_t bytes = std::max<size_t>(1, static_cast<size_t>(num_elem) * example.element_size());
    void* ptr = nullptr;
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    TORCH_CHECK(posix_memalign(&ptr, kAlign, rounded) == 0, "cannot allocate ", rounded, " aligned bytes");
    return torch::from_blob(ptr, {num_elem}, [](void* p) { std::free(p); },
                            torch::TensorOptions().dtype(example.dtype()).device(torch::kCPU));
}

bool have_libaio() {
#ifdef DSRUN_HAVE_LIBAIO
    return true;
#else
    return false;
#endif
}

}  // namespace dsrun

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using dsrun::AioHandle;
    namespace py = pybind11;
    auto release = py::call_guard<py::gil_scoped_release>();
    py::class_<AioHandle>(m, "AioHandle")
        .def(py::init<int64_t, int64_t, bool, bool, int64_t, const std::string&, bool>(), py::arg("block_size"),
             py::arg("queue_depth"), py::arg("single_submit"), py::arg("overlap_events"),
             py::arg("intra_op_parallelism"), py::arg("engine"), py::arg("use_o_direct"))
        .def("async_pread", &AioHandle::async_pread, release)
        .def("async_pwrite", &AioHandle::async_pwrite, release)
        .def("sync_pread", &AioHandle::sync_pread, release)
        .def("sync_pwrite", &AioHandle::sync_pwrite, release)
        .def("async_pwrite_fd", &AioHandle::async_pwrite_fd, release, py::arg("buffer"), py::arg("fd"),
             py::arg("file_offset"))
        .def("sync_pwrite_fd", &AioHandle::sync_pwrite_fd, release, py::arg("buffer"), py::arg("fd"),
             py::arg("file_offset"))
        .def("get_alignment", &AioHandle::alignment)
        .def("wait", &AioHandle::wait, release)
        .def("pending", &AioHandle::pending)
        .def("get_block_size", &AioHandle::block_size)
        .def("get_queue_depth", &AioHandle::queue_depth)
        .def("get_single_submit", &AioHandle::single_submit)
        .def("get_overlap_events", &AioHandle::overlap_events)
        .def("get_intra_op_parallelism", &AioHandle::intra_op_parallelism)
        .def("get_engine", &AioHandle::engine)
        .def("get_use_o_direct", &AioHandle::use_o_direct)
        .def("get_direct_bytes", &AioHandle::direct_bytes);
    m.def("aligned_tensor", &dsrun::aligned_tensor, py::arg("num_elem"), py::arg("example"));
    m.def("have_libaio", &dsrun::have_libaio);
}
