// swapio._C: raw pointers and sizes in, Python exceptions out. No torch here: the Python layer passes
// tensor.data_ptr() and keeps the tensor alive until the request is done.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>

#include "python/bind_adam.h"
#include "common/errors.h"
#include "io/engine.h"
#include "io/file.h"
#include "io/copy.h"
#include "io/handle.h"
#include "io/worker.h"
#include "mem/access.h"
#include "mem/pinned.h"

namespace py = pybind11;
using namespace swapio;

namespace {

// IoError -> OSError(errno, message, path) with an extra `offset` attribute. (pybind11 alone would
// raise RuntimeError.)
void raise_os_error(const IoError& e) {
  py::object path = e.path().empty() ? py::object(py::none()) : py::object(py::str(e.path()));
  std::string msg = e.what();
  if (!e.path().empty()) msg += " (offset " + std::to_string(e.offset()) + ")";
  py::object exc = py::reinterpret_steal<py::object>(
      PyObject_CallFunction(PyExc_OSError, "isO", e.err(), msg.c_str(), path.ptr()));
  if (!exc) return;  // the Python error from the call stays set
  exc.attr("offset") = e.offset();
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

io::Op parse_op(const std::string& op) {
  if (op == "read") return io::Op::read;
  if (op == "write") return io::Op::write;
  throw ArgError("op must be 'read' or 'write'");
}

io::DirectMode parse_direct(py::object direct) {
  if (direct.is_none()) return io::DirectMode::automatic;
  return direct.cast<bool>() ? io::DirectMode::on : io::DirectMode::off;
}

// A page-locked block exposed through the buffer protocol, so torch.frombuffer can wrap it without a copy.
// `on_free` (if set) runs just before the memory goes: the Python layer unregisters it (from CUDA too) there.
struct PinnedBuffer {
  mem::PinnedBlock block;
  py::object on_free = py::none();
  ~PinnedBuffer() {
    if (!on_free.is_none()) release();
    mem::pinned_free(block);
  }
  // A Ctrl-C that lands in the hook (Python, between its bytecodes) would leave the block registered after its
  // memory went: the hook runs again, and the KeyboardInterrupt, which a destructor cannot raise, is delivered
  // right after it (as a Ctrl-C that arrived then).
  void release() {
    bool interrupted = false;
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        on_free(reinterpret_cast<uintptr_t>(block.ptr));
        break;
      } catch (py::error_already_set& e) {
        if (attempt == 0 && e.matches(PyExc_KeyboardInterrupt)) {
          interrupted = true;
          continue;
        }
        e.discard_as_unraisable("swapio pinned buffer release");
        break;
      }
    }
    if (interrupted) PyErr_SetInterrupt();
  }
};

// Waits with the GIL released, in slices, taking it back between them to run signal handlers: Ctrl-C
// raises KeyboardInterrupt here. The request keeps running (and the Python future keeps its memory), so an
// interrupted wait can be waited again. Negative timeout: no limit.
bool wait_interruptibly(io::Request& r, double timeout_s) {
  constexpr double kSlice = 0.05;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    double slice = kSlice;
    if (timeout_s >= 0) {
      const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      slice = std::max(0.0, std::min(kSlice, left));
    }
    bool done;
    {
      py::gil_scoped_release nogil;
      done = r.wait_for(slice);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (timeout_s >= 0 && slice < kSlice) return false;
  }
}

py::dict probe_file(const std::string& path) {
  py::dict out;
  io::OpenFile f(path, io::Op::read, io::DirectMode::automatic);
  out["direct"] = f.direct();
  const io::Alignment a = f.direct() ? f.alignment() : io::Alignment{};
  out["mem_align"] = a.mem;
  out["offset_align"] = a.offset;
  out["alignment_from_statx"] = a.from_statx;
  return out;
}

py::dict engine_status() {
  py::dict out;
  for (const io::EngineOps* ops : io::all_engines()) {
    int rc = io::probe_engine(*ops);
    out[ops->name] = rc == 0 ? std::string("ok") : std::string(std::strerror(-rc));
  }
  return out;
}

py::tuple engine_names(const std::vector<const io::EngineOps*>& engines) {
  py::tuple out(engines.size());
  for (size_t i = 0; i < engines.size(); i++) out[i] = py::str(engines[i]->name);
  return out;
}

// The engines with a trait of io/engine.h's EngineOps (sync, moves_data).
std::vector<const io::EngineOps*> engines_where(bool io::EngineOps::*trait) {
  std::vector<const io::EngineOps*> out;
  for (const io::EngineOps* ops : io::all_engines())
    if (ops->*trait) out.push_back(ops);
  return out;
}

// What engine="auto" opens here: the SWAPIO_ENGINE override, else the first usable engine in auto order.
py::object auto_engine() {
  const std::string wanted = io::resolve_engine_request("auto");
  if (wanted != "auto") return py::str(wanted);
  for (const io::EngineOps* ops : io::auto_engine_order())
    if (io::probe_engine(*ops) == 0) return py::str(ops->name);
  return py::none();
}

py::bytes random_offsets(uint64_t seed, int64_t count, int64_t span, int64_t block) {
  if (count < 0 || block <= 0 || span < block) throw ArgError("random_offsets needs count >= 0, 0 < block <= span");
  std::vector<int64_t> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; i++) out[static_cast<size_t>(i)] = io::random_piece_offset(seed, i, span, block);
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "swapio native core: async O_DIRECT I/O engines, pinned memory, CPU Adam";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      raise_os_error(e);
    } catch (const ArgError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<io::Request, std::shared_ptr<io::Request>>(m, "Request")
      .def("wait", [](io::Request& r, std::optional<double> timeout) {
            double t = timeout ? std::max(0.0, *timeout) : -1.0;
            if (t > 1e9) t = -1.0;  // beyond any real wait: no limit (as Request::wait_for)
            return wait_interruptibly(r, t);
          }, py::arg("timeout") = py::none(), "Waits until done or timeout (seconds); True when done.")
      .def("done", &io::Request::done)
      .def("result", [](io::Request& r) {
            wait_interruptibly(r, -1.0);
            py::gil_scoped_release nogil;
            return r.result();
          }, "Waits; returns bytes moved or raises OSError.")
      .def("latencies_ns", [](io::Request& r) {
            std::vector<uint64_t> lat;
            {
              py::gil_scoped_release nogil;
              lat = r.latencies_ns();
            }
            return py::bytes(reinterpret_cast<const char*>(lat.data()), lat.size() * sizeof(uint64_t));
          }, "Per-piece completion latencies (uint64 ns, native byte order) when recorded.")
      .def_property_readonly("fell_back", &io::Request::fell_back)
      .def_property_readonly("length", &io::Request::length);

  py::class_<io::Handle>(m, "Handle")
      .def(py::init([](int64_t block_size, int64_t queue_depth, int64_t threads, std::string engine,
                       py::object direct, int64_t submit_batch) {
             io::HandleOptions o;
             o.block_size = block_size;
             o.queue_depth = queue_depth;
             o.threads = threads;
             o.engine = std::move(engine);
             o.direct = parse_direct(direct);
             o.submit_batch = submit_batch;
             return std::make_unique<io::Handle>(std::move(o));
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"), py::arg("engine"),
           py::arg("direct"), py::arg("submit_batch") = 1)
      .def("submit", [](io::Handle& h, const std::string& op, uintptr_t buf, int64_t length,
                        const std::string& path, int64_t offset, bool record_latency,
                        std::optional<std::tuple<uint64_t, uint64_t, uint64_t>> expect, bool staged) {
             io::Op o = parse_op(op);
             std::optional<io::FileIdentity> identity;
             if (expect) identity = io::FileIdentity{std::get<0>(*expect), std::get<1>(*expect), std::get<2>(*expect)};
             py::gil_scoped_release nogil;
             return h.submit(o, buf, length, path, offset, record_latency, identity, staged);
           }, py::arg("op"), py::arg("buf"), py::arg("length"), py::arg("path"), py::arg("offset"),
           py::arg("record_latency") = false, py::arg("expect") = py::none(), py::arg("staged") = false)
      .def("submit_random", [](io::Handle& h, const std::string& op, uintptr_t buf, int64_t buf_len,
                               const std::string& path, int64_t span, int64_t count, uint64_t seed,
                               bool record_latency) {
             io::Op o = parse_op(op);
             py::gil_scoped_release nogil;
             return h.submit_random(o, buf, buf_len, path, span, count, seed, record_latency);
           }, py::arg("op"), py::arg("buf"), py::arg("buf_len"), py::arg("path"), py::arg("span"),
           py::arg("count"), py::arg("seed") = 0, py::arg("record_latency") = false)
      .def("close", &io::Handle::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("engine", &io::Handle::engine)
      .def_property_readonly("closed", &io::Handle::closed);

  py::class_<PinnedBuffer>(m, "PinnedBuffer", py::buffer_protocol())
      .def(py::init([](size_t nbytes, bool lock) {
             auto b = std::make_unique<PinnedBuffer>();
             b->block = mem::pinned_alloc(nbytes, lock);
             return b;
           }), py::arg("nbytes"), py::arg("lock") = true)
      .def_buffer([](PinnedBuffer& b) {
        return py::buffer_info(b.block.ptr, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.block.size)}, {1});
      })
      .def_property_readonly("ptr", [](const PinnedBuffer& b) { return reinterpret_cast<uintptr_t>(b.block.ptr); })
      .def_property_readonly("nbytes", [](const PinnedBuffer& b) { return b.block.size; })
      .def_property_readonly("locked", [](const PinnedBuffer& b) { return b.block.locked; })
      .def_property_readonly("lock_errno", [](const PinnedBuffer& b) { return b.block.lock_errno; })
      .def_readwrite("on_free", &PinnedBuffer::on_free);

  m.def("probe_file", &probe_file, py::arg("path"),
        "O_DIRECT support and alignment for an existing file.");
  m.def("copy_bytes", [](uintptr_t dst, uintptr_t src, size_t n) {
        if (n && (!dst || !src)) throw ArgError("copy_bytes: null pointer");
        py::gil_scoped_release nogil;
        io::copy_streaming(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      }, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "Copies nbytes between two non-overlapping memory ranges with streaming stores, without the GIL (for big "
      "copies whose destination is not read again soon: the checkpoint capture). Pointers are not checked.");
  m.def("file_birth_ns", [](int fd) { return io::birth_ns(fd); }, py::arg("fd"),
        "The birth time (statx btime) of an open file in ns since the epoch, 0 where the file system keeps none.");
  m.def("writable", [](uintptr_t p, size_t n) {
        return mem::check_access(reinterpret_cast<const void*>(p), n, mem::Access::write) == 0;
      }, py::arg("ptr"), py::arg("nbytes"),
      "Whether every byte of [ptr, ptr + nbytes) is mapped writable, asked of the kernel without touching it.");
  m.def("held_bytes", [] {
        py::dict out;
        out["pinned"] = mem::pinned_bytes_mapped();
        out["bounce"] = io::bounce_bytes_held();
        return out;
      }, "Bytes of pinned blocks not yet freed, and of bounce buffers held by live handles' workers.");
  m.def("engine_status", &engine_status, "'ok' or the reason, for each engine on this kernel.");
  m.def("auto_engine", &auto_engine, "The engine engine=\"auto\" opens here (None if none is usable).");
  m.def("random_offsets", &random_offsets, py::arg("seed"), py::arg("count"), py::arg("span"), py::arg("block"),
        "File offsets (int64, native byte order) of the pieces Handle.submit_random(seed, count) visits.");
  // The registry the Python layer reads instead of restating it.
  m.attr("ENGINES") = engine_names(io::all_engines());
  m.attr("AUTO_ENGINE_ORDER") = engine_names(io::auto_engine_order());
  m.attr("SYNC_ENGINES") = engine_names(engines_where(&io::EngineOps::sync));  // threads are their parallelism
  m.attr("DATA_ENGINES") = engine_names(engines_where(&io::EngineOps::moves_data));  // all but null
  m.attr("MAX_BLOCK_SIZE") = io::kMaxBlockSize;
  m.attr("MAX_QUEUE_DEPTH") = io::kMaxQueueDepth;
  m.attr("MAX_THREADS") = io::kMaxThreads;

  swapio::bind_adam(m);
}
