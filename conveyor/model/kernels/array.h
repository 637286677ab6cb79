// What the kernels need around their loops, without torch: an n-dimensional array (a numpy array
// handed in, or a buffer a kernel allocates), argument checks that raise RuntimeError, OpenMP's
// intra-op threads, and pybind11's conversions to and from numpy.
//
// The kernels run with the GIL released, so nothing here creates, copies (with a reference count)
// or destroys a Python object once a call's arguments are read: an input array is held by a
// borrowed pointer (pybind11 keeps the call's arguments alive until its result is converted), an
// output is a plain 64-byte-aligned C++ buffer, and only the conversion of the result, with the GIL
// held again, wraps a buffer into a numpy array that owns it (through a capsule) or a view of an
// input into a numpy view whose base is that input.
#pragma once

#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace conveyor_array {
class Array;
}  // namespace conveyor_array
template <>
struct pybind11::detail::type_caster<conveyor_array::Array>;

namespace conveyor_array {

// The element types the kernels read and write; kOther stands for any other numpy dtype, which the
// kernels' checks then refuse with their own messages.
enum class DType : int8_t { kFloat32, kFloat16, kFloat64, kInt64, kInt32, kInt8, kUInt8, kOther };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kFloat64: return "float64";
    case DType::kInt64: return "int64";
    case DType::kInt32: return "int32";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kOther: break;
  }
  return "another dtype";
}

inline int64_t itemsize_of(DType t) {
  switch (t) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat16: return 2;
    case DType::kFloat64: case DType::kInt64: return 8;
    case DType::kInt8: case DType::kUInt8: return 1;
    case DType::kOther: break;
  }
  return 0;
}

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::kFloat32; }
template <>
constexpr DType dtype_of<double>() { return DType::kFloat64; }
template <>
constexpr DType dtype_of<int64_t>() { return DType::kInt64; }
template <>
constexpr DType dtype_of<int32_t>() { return DType::kInt32; }
template <>
constexpr DType dtype_of<int8_t>() { return DType::kInt8; }
template <>
constexpr DType dtype_of<uint8_t>() { return DType::kUInt8; }

namespace detail {

inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& out, const T& part, const Rest&... rest) {
  out << part;
  append(out, rest...);
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  append(message, parts...);
  throw std::runtime_error(message.str());  // pybind11 raises it as RuntimeError
}

}  // namespace detail

}  // namespace conveyor_array

// CHECK(condition, message parts...): raises RuntimeError with the parts streamed one after another.
#define CHECK(condition, ...)                                                         \
  do {                                                                                \
    if (__builtin_expect(!(condition), 0)) ::conveyor_array::detail::fail(__VA_ARGS__); \
  } while (0)

namespace conveyor_array {

constexpr int kMaxDims = 8;

// An array's shape or strides (strides in elements, as the kernels index).
struct Dims {
  int64_t values[kMaxDims] = {};
  int count = 0;

  Dims() = default;
  Dims(std::initializer_list<int64_t> list) {
    CHECK(list.size() <= kMaxDims, "arrays of more than ", kMaxDims, " dimensions are not supported");
    for (const int64_t v : list) values[count++] = v;
  }
  int size() const { return count; }
  int64_t operator[](int i) const { return values[i]; }
  int64_t& operator[](int i) { return values[i]; }
  const int64_t* begin() const { return values; }
  const int64_t* end() const { return values + count; }
  bool operator==(const Dims& other) const { return count == other.count && std::equal(begin(), end(), other.begin()); }
  bool operator!=(const Dims& other) const { return !(*this == other); }
};

namespace detail {

constexpr size_t kAlignment = 64;

// `bytes` of fresh memory (at least one cache line, so no array's data pointer is null), aligned
// to a cache line, freed when the last array holding it goes.
inline std::shared_ptr<void> allocate(int64_t bytes) {
  const size_t size = (static_cast<size_t>(std::max<int64_t>(bytes, 1)) + kAlignment - 1) / kAlignment * kAlignment;
  void* memory = std::aligned_alloc(kAlignment, size);
  if (memory == nullptr) throw std::bad_alloc();
  return std::shared_ptr<void>(memory, std::free);
}

inline Dims contiguous_strides(const Dims& shape) {
  Dims strides;
  strides.count = shape.count;
  int64_t step = 1;
  for (int d = shape.count - 1; d >= 0; --d) {
    strides[d] = step;
    step *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

}  // namespace detail

class Array;
inline Array empty(const Dims& shape, DType dtype);

// An n-dimensional strided array: a numpy array passed in (borrowed: `base_` is that array, which
// outlives the call) or a buffer allocated here (`buffer_`, shared by every array over it).
class Array {
 public:
  Array() = default;

  DType dtype() const { return dtype_; }
  int64_t dim() const { return shape_.count; }
  const Dims& sizes() const { return shape_; }
  const Dims& strides() const { return strides_; }
  int64_t size(int64_t d) const { return shape_[checked_dim(d)]; }
  int64_t stride(int64_t d) const { return strides_[checked_dim(d)]; }
  int64_t itemsize() const { return itemsize_; }
  bool writeable() const { return writeable_; }

  int64_t numel() const {
    int64_t n = 1;
    for (const int64_t s : shape_) n *= s;
    return n;
  }

  // As torch defines it: row-major with no gaps; dimensions of size 1 may have any stride, and an
  // array without elements is contiguous.
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expected = 1;
    for (int d = shape_.count - 1; d >= 0; --d) {
      if (shape_[d] == 1) continue;
      if (strides_[d] != expected) return false;
      expected *= shape_[d];
    }
    return true;
  }

  void* data_ptr() const { return data_; }

  template <class T>
  T* data_ptr() const {
    CHECK(dtype_ == dtype_of<T>(), "expected an array of ", dtype_name(dtype_of<T>()), " but found ", dtype_name(dtype_));
    return static_cast<T*>(data_);
  }

  // This array when it is contiguous, else a contiguous copy.
  Array contiguous() const {
    if (is_contiguous()) return *this;
    Array copy = empty(shape_, dtype_);
    copy_elements(*this, copy);
    return copy;
  }

  // Elements [start, start + length) of dimension d, sharing this array's memory.
  Array narrow(int64_t d, int64_t start, int64_t length) const {
    const int axis = checked_dim(d);
    CHECK(start >= 0 && length >= 0 && start + length <= shape_[axis], "narrow: [", start, ", ", start + length,
          ") is out of dimension ", d, " of size ", shape_[axis]);
    Array part = *this;
    part.data_ = static_cast<char*>(data_) + start * strides_[axis] * itemsize_;
    part.shape_[axis] = length;
    return part;
  }

  // The same elements in another shape, sharing this array's memory where its strides allow it
  // (torch's rule for view: dimensions are split or merged only where they lie evenly in memory).
  Array view(std::initializer_list<int64_t> shape) const {
    const Dims new_shape(shape);
    int64_t count = 1;
    for (const int64_t s : new_shape) count *= s;
    CHECK(count == numel(), "view: ", numel(), " elements do not fit the shape asked for");
    Array viewed = *this;
    viewed.shape_ = new_shape;
    CHECK(view_strides(new_shape, viewed.strides_), "view: the shape asked for does not match the array's strides");
    return viewed;
  }

  // The values converted to `target` (this array itself when it is of that type already);
  // conversions between the integer types, float32 and float64, as static_cast converts.
  Array to(DType target) const {
    if (target == dtype_) return *this;
    Array converted = empty(shape_, target);
    const Array source = contiguous();
    const int64_t n = numel();
    bool done = false;
    visit_numeric(source.dtype_, [&](auto from_tag) {
      using From = decltype(from_tag);
      visit_numeric(target, [&](auto to_tag) {
        using To = decltype(to_tag);
        const From* from = static_cast<const From*>(source.data_);
        To* to = static_cast<To*>(converted.data_);
        for (int64_t i = 0; i < n; ++i) to[i] = static_cast<To>(from[i]);
        done = true;
      });
    });
    CHECK(done, "to: no conversion from ", dtype_name(dtype_), " to ", dtype_name(target));
    return converted;
  }

 private:
  friend Array empty(const Dims& shape, DType dtype);
  friend struct py::detail::type_caster<Array>;

  int checked_dim(int64_t d) const {
    const int64_t axis = d < 0 ? d + shape_.count : d;
    CHECK(axis >= 0 && axis < shape_.count, "dimension ", d, " is out of range for an array of ", shape_.count,
          " dimensions");
    return static_cast<int>(axis);
  }

  template <class F>
  static void visit_numeric(DType t, F&& f) {
    switch (t) {
      case DType::kFloat32: f(float{}); break;
      case DType::kFloat64: f(double{}); break;
      case DType::kInt64: f(int64_t{}); break;
      case DType::kInt32: f(int32_t{}); break;
      case DType::kInt8: f(int8_t{}); break;
      case DType::kUInt8: f(uint8_t{}); break;
      case DType::kFloat16: case DType::kOther: break;
    }
  }

  // Element by element, in row-major order, from any strides into a contiguous array of one type.
  static void copy_elements(const Array& from, Array& to) {
    const int64_t n = from.numel(), size = from.itemsize_;
    int64_t index[kMaxDims] = {};
    char* out = static_cast<char*>(to.data_);
    for (int64_t i = 0; i < n; ++i) {
      const char* in = static_cast<const char*>(from.data_);
      for (int d = 0; d < from.shape_.count; ++d) in += index[d] * from.strides_[d] * size;
      std::memcpy(out + i * size, in, static_cast<size_t>(size));
      for (int d = from.shape_.count - 1; d >= 0 && ++index[d] == from.shape_[d]; --d) index[d] = 0;
    }
  }

  // torch's computeStride: the strides of `new_shape` over this array's memory, false where some
  // dimension of it would have to span memory that is not evenly strided.
  bool view_strides(const Dims& new_shape, Dims& new_strides) const {
    new_strides.count = new_shape.count;
    if (numel() == 0 || shape_.count == 0) {
      new_strides = detail::contiguous_strides(new_shape);
      return true;
    }
    int view_d = new_shape.count - 1;
    int64_t chunk_base_stride = strides_[shape_.count - 1], tensor_numel = 1, view_numel = 1;
    for (int tensor_d = shape_.count - 1; tensor_d >= 0; --tensor_d) {
      tensor_numel *= shape_[tensor_d];
      if (tensor_d == 0 ||
          (shape_[tensor_d - 1] != 1 && strides_[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
        while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
          new_strides[view_d] = view_numel * chunk_base_stride;
          view_numel *= new_shape[view_d];
          --view_d;
        }
        if (view_numel != tensor_numel) return false;
        if (tensor_d > 0) {
          chunk_base_stride = strides_[tensor_d - 1];
          tensor_numel = 1;
          view_numel = 1;
        }
      }
    }
    return view_d == -1;
  }

  void* data_ = nullptr;
  DType dtype_ = DType::kOther;
  int64_t itemsize_ = 0;
  Dims shape_, strides_;
  bool writeable_ = true;
  std::shared_ptr<void> buffer_;  // memory allocated here, or null
  PyObject* base_ = nullptr;      // the numpy array passed in that this one lies in (borrowed), or null
};

// A new contiguous array; its elements are whatever the memory held.
inline Array empty(const Dims& shape, DType dtype) {
  CHECK(dtype != DType::kOther, "empty: no array of another dtype");
  Array a;
  a.dtype_ = dtype;
  a.itemsize_ = itemsize_of(dtype);
  a.shape_ = shape;
  a.strides_ = detail::contiguous_strides(shape);
  for (const int64_t s : shape) CHECK(s >= 0, "empty: negative size ", s);
  a.buffer_ = detail::allocate(a.numel() * a.itemsize_);
  a.data_ = a.buffer_.get();
  return a;
}

inline Array zeros(const Dims& shape, DType dtype) {
  Array a = empty(shape, dtype);
  std::memset(a.data_ptr(), 0, static_cast<size_t>(a.numel() * a.itemsize()));
  return a;
}

// A new contiguous array of `like`'s shape and type.
inline Array empty_like(const Array& like) { return empty(like.sizes(), like.dtype()); }

// --- Intra-op threads: OpenMP's, handed out as torch's OpenMP backend of at::parallel_for hands
// them out, so that results that depend on where a range is cut (sums per thread, slices of a
// context) come out as they did with torch.
namespace detail {

inline int& thread_num() {
  thread_local int num = 0;
  return num;
}
inline bool& in_parallel() {
  thread_local bool inside = false;
  return inside;
}

// While a part of a range runs: its thread's number (get_thread_num) and that it is inside
// parallel_for (a nested parallel_for then runs on its caller's thread).
class PartGuard {
 public:
  explicit PartGuard(int num) : saved_num_(thread_num()), saved_inside_(in_parallel()) {
    thread_num() = num;
    in_parallel() = true;
  }
  ~PartGuard() {
    thread_num() = saved_num_;
    in_parallel() = saved_inside_;
  }
  PartGuard(const PartGuard&) = delete;
  PartGuard& operator=(const PartGuard&) = delete;

 private:
  int saved_num_;
  bool saved_inside_;
};

// The thread count set by set_num_threads (0: OpenMP's own default). OpenMP keeps the count per
// calling thread, so each thread that calls a kernel applies the latest one before its next region.
inline std::atomic<int>& requested_threads() {
  static std::atomic<int> requested{0};
  return requested;
}

inline void apply_thread_count() {
  thread_local int applied = 0;
  const int requested = requested_threads().load(std::memory_order_relaxed);
  if (requested > 0 && requested != applied) {
    omp_set_num_threads(requested);
    applied = requested;
  }
}

inline int64_t divup(int64_t x, int64_t y) { return (x + y - 1) / y; }

}  // namespace detail

inline void set_num_threads(int n) {
  CHECK(n > 0, "set_num_threads: expected a positive number of threads, not ", n);
  detail::requested_threads().store(n, std::memory_order_relaxed);
  detail::apply_thread_count();
}

inline int get_num_threads() {
  detail::apply_thread_count();
  return omp_get_max_threads();
}

// The number of the thread running the current part of a parallel_for (0 outside one).
inline int get_thread_num() { return detail::thread_num(); }

inline bool in_parallel_region() { return detail::in_parallel() || omp_in_parallel(); }

// f(part_begin, part_end) over [begin, end) cut into one part per thread, each at least
// `grain_size` long: torch's invoke_parallel for OpenMP, cut for cut (as many threads as there
// are grains, up to the thread count; parts of divup(end - begin, threads) elements). One part,
// on the calling thread, where the range is no longer than a grain or inside another parallel_for.
// An exception thrown by a part is raised once every part has ended.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain_size, const F& f) {
  if (begin >= end) return;
  const int64_t numiter = end - begin;
  const bool use_parallel = numiter > grain_size && numiter > 1 && !in_parallel_region() && get_num_threads() > 1;
  if (!use_parallel) {
    detail::PartGuard guard(0);
    f(begin, end);
    return;
  }
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
#pragma omp parallel
  {
    int64_t num_threads = omp_get_num_threads();
    if (grain_size > 0) num_threads = std::min(num_threads, detail::divup(numiter, grain_size));
    const int64_t tid = omp_get_thread_num();
    const int64_t chunk_size = detail::divup(numiter, num_threads);
    const int64_t begin_tid = begin + tid * chunk_size;
    if (begin_tid < end) {
      try {
        detail::PartGuard guard(static_cast<int>(tid));
        f(begin_tid, std::min(end, chunk_size + begin_tid));
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// set_num_threads and get_num_threads for a module's Python side.
inline void def_thread_functions(py::module_& m) {
  m.def("set_num_threads", &set_num_threads,
        "the number of OpenMP threads the kernels use, from now on and on every calling thread", py::arg("n"));
  m.def("get_num_threads", &get_num_threads, "the number of OpenMP threads a kernel called now uses");
}

}  // namespace conveyor_array

// numpy arrays in and out of the kernels' functions.
namespace pybind11::detail {

template <>
struct type_caster<conveyor_array::Array> {
  PYBIND11_TYPE_CASTER(conveyor_array::Array, const_name("numpy.ndarray"));

  // Any numpy array (any dtype: the kernels check theirs), held by a borrowed pointer.
  bool load(handle source, bool) {
    using conveyor_array::DType;
    auto& api = npy_api::get();
    if (!api.PyArray_Check_(source.ptr())) return false;
    const PyArray_Proxy* array = array_proxy(source.ptr());  // numpy's own struct, read directly: no Python calls
    const auto descr = reinterpret_borrow<pybind11::dtype>(array->descr);
    const int64_t size = descr.itemsize();
    const char kind = descr.kind();
    DType type = DType::kOther;
    if (descr.byteorder() != '>' && !descr.has_fields()) {
      if (kind == 'f') type = size == 4 ? DType::kFloat32 : size == 2 ? DType::kFloat16 : size == 8 ? DType::kFloat64 : DType::kOther;
      else if (kind == 'i') type = size == 8 ? DType::kInt64 : size == 4 ? DType::kInt32 : size == 1 ? DType::kInt8 : DType::kOther;
      else if (kind == 'u' && size == 1) type = DType::kUInt8;
    }
    if (array->nd > conveyor_array::kMaxDims) return false;
    conveyor_array::Array a;
    a.data_ = array->data;
    a.dtype_ = type;
    a.itemsize_ = size;
    a.shape_.count = a.strides_.count = array->nd;
    for (int d = 0; d < array->nd; ++d) {
      a.shape_[d] = array->dimensions[d];
      if (size > 0 && array->strides[d] % size != 0) return false;  // not a whole number of elements apart
      a.strides_[d] = size > 0 ? array->strides[d] / size : 0;
    }
    a.writeable_ = (array->flags & npy_api::NPY_ARRAY_WRITEABLE_) != 0;
    a.base_ = source.ptr();
    value = std::move(a);
    return true;
  }

  static handle cast(const conveyor_array::Array& a, return_value_policy, handle) {
    std::vector<ssize_t> shape(a.shape_.begin(), a.shape_.end()), strides;
    for (const int64_t s : a.strides_) strides.push_back(static_cast<ssize_t>(s * a.itemsize_));
    if (a.base_ != nullptr) {  // an input, or a view of one
      const auto base = reinterpret_borrow<pybind11::array>(a.base_);
      const bool whole = a.data_ == base.data() && base.ndim() == a.shape_.count &&
                         std::equal(shape.begin(), shape.end(), base.shape()) &&
                         std::equal(strides.begin(), strides.end(), base.strides());
      if (whole) return base.inc_ref();
      return pybind11::array(base.dtype(), std::move(shape), std::move(strides), a.data_, base).release();
    }
    // A buffer allocated by the kernel: the numpy array owns a reference to it.
    auto* owner = new std::shared_ptr<void>(a.buffer_);
    capsule keeper(owner, [](void* p) { delete static_cast<std::shared_ptr<void>*>(p); });
    return pybind11::array(numpy_dtype(a.dtype_), std::move(shape), std::move(strides), a.data_, keeper).release();
  }

 private:
  static pybind11::dtype numpy_dtype(conveyor_array::DType t) {
    using conveyor_array::DType;
    constexpr int kNumpyHalf = 23;  // NPY_HALF
    switch (t) {
      case DType::kFloat32: return pybind11::dtype::of<float>();
      case DType::kFloat16: return pybind11::dtype(kNumpyHalf);
      case DType::kFloat64: return pybind11::dtype::of<double>();
      case DType::kInt64: return pybind11::dtype::of<int64_t>();
      case DType::kInt32: return pybind11::dtype::of<int32_t>();
      case DType::kInt8: return pybind11::dtype::of<int8_t>();
      case DType::kUInt8: return pybind11::dtype::of<uint8_t>();
      case DType::kOther: break;
    }
    pybind11_fail("an array allocated here has a dtype numpy is not told about");
  }
};

}  // namespace pybind11::detail
