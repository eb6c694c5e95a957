// Reads trace.h5 back: the file is read whole, its integrity block
// (trace_integrity.h) checked, and only then does HDF5 parse the bytes, from
// memory, in a child process (trace_parse_isolation.h); every type, shape and
// size is checked before anything is read.
#include "reports/outputs/trace/trace_writer.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "loaders/base/error.h"
#include "reports/outputs/trace/trace_integrity.h"
#include "reports/outputs/trace/trace_layout.h"
#include "reports/outputs/trace/trace_parse_isolation.h"

namespace nanreplay {
namespace {

using namespace trace_layout;

class TraceFileReader {
 public:
  TraceFileReader(std::string path, hid_t file, size_t file_size)
      : path_(std::move(path)), file_(file), file_size_(file_size) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    const std::string detail = take_hdf5_error();
    throw InputError(path_, key, what + (detail.empty() ? "" : " (HDF5: " + detail + ")"));
  }

  bool has_attribute(const char* name) const { return H5Aexists(file_, name) > 0; }

  std::string read_string_attribute(const char* name) const {
    const Handle attribute = open_scalar_attribute(name);
    Handle type(H5Aget_type(attribute.get()), H5Tclose);
    if (type.get() < 0) fail(name, "unreadable attribute");
    if (H5Tget_class(type.get()) != H5T_STRING) fail(name, "attribute is not a string");
    if (H5Tis_variable_str(type.get()) > 0) {  // as h5py writes a Python str
      Handle memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
      if (memory_type.get() < 0 || H5Tset_size(memory_type.get(), H5T_VARIABLE) < 0) {
        fail(name, "cannot build a string type");
      }
      char* text = nullptr;
      if (H5Aread(attribute.get(), memory_type.get(), &text) < 0) fail(name, "unreadable attribute");
      std::string value = text != nullptr ? std::string(text, strnlen(text, kMaxStringWidth)) : "";
      H5free_memory(text);
      return value;
    }
    const size_t width = H5Tget_size(type.get());
    if (width == 0 || width > kMaxStringWidth) fail(name, "attribute has an implausible width");
    Handle memory_type = string_memory_type(width);
    std::vector<char> buffer(width, '\0');
    if (H5Aread(attribute.get(), memory_type.get(), buffer.data()) < 0) fail(name, "unreadable attribute");
    return std::string(buffer.data(), strnlen(buffer.data(), width));
  }

  int64_t read_integer_attribute(const char* name) const {
    const Handle attribute = open_scalar_attribute(name);
    Handle type(H5Aget_type(attribute.get()), H5Tclose);
    if (type.get() < 0) fail(name, "unreadable attribute");
    if (H5Tget_class(type.get()) != H5T_INTEGER) fail(name, "attribute is not an integer");
    int64_t value = 0;
    if (H5Aread(attribute.get(), H5T_NATIVE_INT64, &value) < 0) fail(name, "unreadable attribute");
    return value;
  }

  // TraceHeader::extra, by the names the writer listed.
  std::map<std::string, std::string> read_extra_attributes() const {
    std::map<std::string, std::string> extra;
    if (!has_attribute(kExtraAttributesName)) return extra;
    std::istringstream names(read_string_attribute(kExtraAttributesName));
    for (std::string name; std::getline(names, name);) {
      if (name.empty() || reserved_attribute_names().count(name) != 0) {
        fail(kExtraAttributesName, "lists the invalid name '" + name + "'");
      }
      extra[name] = read_string_attribute(name.c_str());
    }
    return extra;
  }

  bool has_column(const std::string& group, const char* name) const {
    const std::string key = "/" + group + "/" + name;
    return H5Lexists(file_, group.c_str(), H5P_DEFAULT) > 0 && H5Lexists(file_, key.c_str(), H5P_DEFAULT) > 0;
  }

  // Opens /group/name as a 1-D dataset; its length must equal `expected`
  // (pass -1 to accept any and learn it).
  Handle open_column(const std::string& group, const char* name, int64_t& expected) const {
    const std::string key = "/" + group + "/" + name;
    if (H5Lexists(file_, group.c_str(), H5P_DEFAULT) <= 0 ||
        H5Lexists(file_, key.c_str(), H5P_DEFAULT) <= 0) {
      fail(key, "missing dataset; " + regenerate_hint());
    }
    Handle dataset(H5Dopen2(file_, key.c_str(), H5P_DEFAULT), H5Dclose);
    if (dataset.get() < 0) fail(key, "expected a readable dataset");
    Handle space(H5Dget_space(dataset.get()), H5Sclose);
    hsize_t dims[1] = {0};
    if (space.get() < 0 || H5Sget_simple_extent_type(space.get()) != H5S_SIMPLE ||
        H5Sget_simple_extent_ndims(space.get()) != 1 ||
        H5Sget_simple_extent_dims(space.get(), dims, nullptr) != 1) {
      fail(key, "expected a 1-D dataset");
    }
    if (expected >= 0 && dims[0] != static_cast<hsize_t>(expected)) {
      fail(key, "has " + std::to_string(dims[0]) + " rows, other columns have " + std::to_string(expected));
    }
    require_known_filters(dataset, key);
    require_small_chunks(dataset, key);
    // Every row of a table costs at least `row_bytes` decoded bytes over its
    // columns: more rows than the file's size allows cannot be real, and are
    // refused before rows are allocated for them.
    const uint64_t row_bytes = group == kProbesGroup ? kMinProbeRowBytes : kMinStepRowBytes;
    if (dims[0] > file_size_ * kMaxExpansion / row_bytes) {
      fail(key, "claims " + std::to_string(dims[0]) + " rows, more than a file of " + std::to_string(file_size_) +
                    " bytes can hold");
    }
    expected = static_cast<int64_t>(dims[0]);
    return dataset;
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const IntegerColumn<Row> (&columns)[N]) const {
    std::vector<int64_t> values(rows.size());
    for (const IntegerColumn<Row>& column : columns) {
      if (column.optional && !has_column(group, column.name)) continue;
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      require_type(dataset, group, column.name, file_type(column.storage));
      read_all(dataset, group, column.name, H5T_NATIVE_INT64, values.data(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) column.set(rows[i], values[i]);
    }
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const RealColumn<Row> (&columns)[N]) const {
    std::vector<double> values(rows.size());
    for (const RealColumn<Row>& column : columns) {
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      require_type(dataset, group, column.name, H5T_IEEE_F64LE);
      read_all(dataset, group, column.name, H5T_NATIVE_DOUBLE, values.data(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) column.set(rows[i], values[i]);
    }
  }

  template <class Row, size_t N>
  void read_columns(const std::string& group, std::vector<Row>& rows,
                    const TextColumn<Row> (&columns)[N]) const {
    for (const TextColumn<Row>& column : columns) {
      const std::string key = "/" + group + "/" + column.name;
      int64_t length = int64_t(rows.size());
      Handle dataset = open_column(group, column.name, length);
      Handle type(H5Dget_type(dataset.get()), H5Tclose);
      if (type.get() < 0 || H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) != 0) {
        fail(key, "expected a fixed-length string dataset");
      }
      const size_t width = H5Tget_size(type.get());
      if (width == 0 || width > kMaxStringWidth ||
          static_cast<uint64_t>(width) * rows.size() > file_size_ * kMaxExpansion) {
        fail(key, "has an implausible string width " + std::to_string(width));
      }
      Handle memory_type = string_memory_type(width);
      std::vector<char> packed(rows.size() * width + 1, '\0');
      read_all(dataset, group, column.name, memory_type.get(), packed.data(), rows.size());
      for (size_t i = 0; i < rows.size(); ++i) {
        const char* text = packed.data() + i * width;
        const std::string value(text, strnlen(text, width));
        if (!column.set(rows[i], value)) {
          fail(key, "row " + std::to_string(i) + ": invalid value '" + value + "'");
        }
      }
    }
  }

  static std::string regenerate_hint() {
    return "the file is not a complete nanreplay trace; regenerate it with `nanreplay run`";
  }

 private:
  // One value of any type: reading a larger dataspace into one value's buffer would overrun it.
  Handle open_scalar_attribute(const char* name) const {
    if (!has_attribute(name)) fail(name, "missing root attribute; " + regenerate_hint());
    Handle attribute(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    if (attribute.get() < 0) fail(name, "unreadable attribute");
    Handle space(H5Aget_space(attribute.get()), H5Sclose);
    if (space.get() < 0 || H5Sget_simple_extent_npoints(space.get()) != 1) {
      fail(name, "expected a single value");
    }
    return attribute;
  }

  Handle string_memory_type(size_t width) const {
    Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    if (type.get() < 0 || H5Tset_size(type.get(), std::max<size_t>(width, 1)) < 0 ||
        H5Tset_strpad(type.get(), H5T_STR_NULLPAD) < 0) {
      fail("", "cannot build a string type");
    }
    return type;
  }

  // Exactly the stored type the writer uses: no conversion from exotic types.
  void require_type(const Handle& dataset, const std::string& group, const char* name, hid_t wanted) const {
    Handle type(H5Dget_type(dataset.get()), H5Tclose);
    if (type.get() < 0 || H5Tequal(type.get(), wanted) <= 0) {
      fail("/" + group + "/" + name, "expected the column type nanreplay writes (see docs/trace-format.md)");
    }
  }

  // A chunk is decompressed whole: its size is bounded like everything else.
  void require_small_chunks(const Handle& dataset, const std::string& key) const {
    Handle properties(H5Dget_create_plist(dataset.get()), H5Pclose);
    if (properties.get() < 0) fail(key, "unreadable dataset properties");
    if (H5Pget_layout(properties.get()) != H5D_CHUNKED) return;
    hsize_t chunk[1] = {0};
    Handle type(H5Dget_type(dataset.get()), H5Tclose);
    const size_t element = type.get() >= 0 ? H5Tget_size(type.get()) : 0;
    if (H5Pget_chunk(properties.get(), 1, chunk) != 1 || element == 0 || chunk[0] == 0 ||
        chunk[0] > kMaxChunkBytes / element) {
      fail(key, "has a chunk layout nanreplay never writes");
    }
  }

  // Only the filters the writer uses (shuffle, deflate), both built into HDF5.
  void require_known_filters(const Handle& dataset, const std::string& key) const {
    Handle properties(H5Dget_create_plist(dataset.get()), H5Pclose);
    if (properties.get() < 0) fail(key, "unreadable dataset properties");
    const int count = H5Pget_nfilters(properties.get());
    if (count < 0) fail(key, "unreadable dataset filters");
    for (int i = 0; i < count; ++i) {
      unsigned flags = 0;
      size_t values = 0;
      unsigned config = 0;
      const H5Z_filter_t filter =
          H5Pget_filter2(properties.get(), static_cast<unsigned>(i), &flags, &values, nullptr, 0, nullptr, &config);
      if (filter != H5Z_FILTER_DEFLATE && filter != H5Z_FILTER_SHUFFLE) {
        fail(key, "uses HDF5 filter " + std::to_string(filter) + ", which nanreplay never writes");
      }
    }
  }

  void read_all(const Handle& dataset, const std::string& group, const char* name,
                hid_t memory_type, void* out, size_t length) const {
    if (length == 0) return;
    if (H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0) {
      fail("/" + group + "/" + name, "unreadable dataset");
    }
  }

  std::string path_;
  hid_t file_;
  uint64_t file_size_;
};

TraceContents read_trace_file(const TraceFileReader& reader) {
  const std::string format = reader.read_string_attribute("format");
  if (format != kFormatName) {
    reader.fail("format",
                "is '" + format + "', expected '" + kFormatName + "': not a nanreplay trace");
  }
  const int64_t version = reader.read_integer_attribute("format_version");
  if (version != kFormatVersion) {
    reader.fail("format_version",
                "is " + std::to_string(version) + "; this nanreplay reads " +
                    std::to_string(kFormatVersion) +
                    " (regenerate the trace with this version's `nanreplay run`)");
  }
  TraceContents contents;
  for (const HeaderAttribute& attribute : kHeaderAttributes) {
    contents.header.*attribute.field = reader.read_string_attribute(attribute.name);
  }
  contents.header.extra = reader.read_extra_attributes();

  int64_t probe_count = -1;
  reader.open_column(kProbesGroup, kProbeIntegerColumns[0].name, probe_count);
  contents.probes.resize(size_t(probe_count));
  reader.read_columns(kProbesGroup, contents.probes, kProbeIntegerColumns);
  reader.read_columns(kProbesGroup, contents.probes, kProbeRealColumns);
  reader.read_columns(kProbesGroup, contents.probes, kProbeTextColumns);

  int64_t step_count = -1;
  reader.open_column(kStepsGroup, kStepIntegerColumns[0].name, step_count);
  contents.steps.resize(size_t(step_count));
  reader.read_columns(kStepsGroup, contents.steps, kStepIntegerColumns);
  reader.read_columns(kStepsGroup, contents.steps, kStepRealColumns);
  return contents;
}

// --- Files ---------------------------------------------------------------

// HDF5's core driver on the caller's buffer, read-only and without a copy:
// the file image callbacks hand HDF5 the buffer itself wherever it would copy
// it, and never free it (what H5LTopen_file_image does, without the HL
// library and its per-call leak in HDF5 1.10). HDF5 parses exactly the bytes
// that were verified.
struct BorrowedImage {
  const uint8_t* bytes;
  size_t size;
};

void* borrowed_malloc(size_t size, H5FD_file_image_op_t, void* image) {
  auto* borrowed = static_cast<BorrowedImage*>(image);
  return size == borrowed->size ? const_cast<uint8_t*>(borrowed->bytes) : nullptr;
}
void* borrowed_memcpy(void* dest, const void* src, size_t size, H5FD_file_image_op_t, void* image) {
  const auto* borrowed = static_cast<const BorrowedImage*>(image);
  // Every copy HDF5 asks for is of the buffer onto itself.
  return dest == borrowed->bytes && src == borrowed->bytes && size == borrowed->size ? dest : nullptr;
}
void* borrowed_realloc(void*, size_t, H5FD_file_image_op_t, void*) { return nullptr; }  // read-only
herr_t borrowed_free(void*, H5FD_file_image_op_t, void*) { return 0; }
void* borrowed_udata_copy(void* image) { return image; }
herr_t borrowed_udata_free(void*) { return 0; }

Handle open_borrowed_image(BorrowedImage& image) {
  Handle access(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5FD_file_image_callbacks_t callbacks = {borrowed_malloc, borrowed_memcpy, borrowed_realloc, borrowed_free,
                                           borrowed_udata_copy, borrowed_udata_free, &image};
  if (access.get() < 0 || H5Pset_fapl_core(access.get(), kImageIncrement, /*backing_store=*/false) < 0 ||
      H5Pset_fclose_degree(access.get(), H5F_CLOSE_STRONG) < 0 ||
      H5Pset_file_image_callbacks(access.get(), &callbacks) < 0 ||
      H5Pset_file_image(access.get(), const_cast<uint8_t*>(image.bytes), image.size) < 0) {
    return Handle();
  }
  static std::atomic<unsigned> images{0};
  const std::string name = "nanreplay-trace-read-" + std::to_string(images++);
  return Handle(H5Fopen(name.c_str(), H5F_ACC_RDONLY, access.get()), H5Fclose);
}


// The whole file in memory (HDF5's core driver, nothing on disk), with room
// for the integrity block before it. HDF5 1.10 returns the image from its base
// address, after the userblock; a version that includes the userblock is
// recognised by where the signature lies.
std::vector<uint8_t> read_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw InputError(path, "", "cannot open trace: " + errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw InputError(path, "", "cannot open trace: " + errno_text());
  if (S_ISDIR(info.st_mode)) throw InputError(path, "", "is a directory; expected a trace.h5 written by `nanreplay run`");
  if (!S_ISREG(info.st_mode)) {
    throw InputError(path, "", "is not a regular file (a FIFO, socket or device); expected a trace.h5 written by "
                               "`nanreplay run`");
  }
  std::vector<uint8_t> bytes;
  try {
    bytes.resize(static_cast<size_t>(info.st_size));
  } catch (const std::bad_alloc&) {
    throw InputError(path, "", "is " + std::to_string(info.st_size) + " bytes, too large to read into memory");
  }
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw InputError(path, "", "cannot read trace: " + errno_text());
    if (n == 0) throw InputError(path, "", "changed while being read (it shrank)");
    got += static_cast<size_t>(n);
  }
  return bytes;
}

// Runs in the child of parse_trace_in_child: HDF5 sees only verified bytes.
TraceContents parse_verified_image(const uint8_t* bytes, size_t size, const std::string& label) {
  silence_hdf5();
  BorrowedImage image{bytes, size};
  Handle file = open_borrowed_image(image);
  if (file.get() < 0) {
    const std::string detail = take_hdf5_error();
    throw InputError(label, "",
                     "not an HDF5 file (or a damaged one); expected a trace.h5 written by `nanreplay run`" +
                         (detail.empty() ? "" : " (HDF5: " + detail + ")"));
  }
  return read_trace_file(TraceFileReader(label, file.get(), size));
}

}  // namespace

TraceContents read_trace_image(const uint8_t* bytes, size_t size, const std::string& label) {
  verify_trace_image(bytes, size, label);
  return parse_trace_in_child(label, [&] { return parse_verified_image(bytes, size, label); });
}

TraceContents read_trace(const std::string& path) {
  const std::vector<uint8_t> bytes = read_regular_file(path);
  return read_trace_image(bytes.data(), bytes.size(), path);
}

}  // namespace nanreplay
