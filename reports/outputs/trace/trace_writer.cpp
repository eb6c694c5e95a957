// Writes trace.h5 (layout in trace_writer.h and docs/trace-format.md) with
// the HDF5 C API, on disk as the replay goes, through the latching file
// driver (trace_file_driver.h): an I/O error never reaches HDF5, it is
// reported here as OutputError and the file removed. HDF5 never prints: its
// errors become exceptions. Serial HDF5 is not thread-safe: one trace written
// or read at a time per process.
#include "reports/outputs/trace/trace_writer.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <optional>
#include <stdexcept>
#include <utility>

#include "loaders/base/error.h"
#include "loaders/base/sha256.h"
#include "reports/outputs/trace/trace_file_driver.h"
#include "reports/outputs/trace/trace_integrity.h"
#include "reports/outputs/trace/trace_layout.h"

namespace nanreplay {
namespace {

using namespace trace_layout;

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// Fixed-length, null-padded ASCII of `width` bytes (HDF5 rejects width 0).
Handle string_type(size_t width, const std::string& path) {
  Handle type = checked(H5Tcopy(H5T_C_S1), H5Tclose, path, "string type");
  checked(H5Tset_size(type.get(), std::max<size_t>(width, 1)), path, "string type");
  checked(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), path, "string type");
  checked(H5Tset_cset(type.get(), H5T_CSET_ASCII), path, "string type");
  return type;
}

// One column: a 1-D dataset of unlimited length, chunked and compressed,
// that rows are appended to.
class AppendableColumn {
 public:
  AppendableColumn(hid_t group, const std::string& where, const char* name, hid_t stored, hid_t in_memory,
                   size_t element_size, const std::string& path)
      : where_(where + "/" + name), in_memory_(in_memory), path_(path) {
    const hsize_t empty[1] = {0};
    const hsize_t unlimited[1] = {H5S_UNLIMITED};
    Handle space = checked(H5Screate_simple(1, empty, unlimited), H5Sclose, path_, where_);
    Handle properties = checked(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, path_, where_);
    const hsize_t chunk[1] = {std::max<hsize_t>(1, kChunkBytes / element_size)};
    checked(H5Pset_chunk(properties.get(), 1, chunk), path_, where_);
    // Shuffle + deflate are built into every HDF5, so h5dump and h5py read them.
    if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) {
      checked(H5Pset_shuffle(properties.get()), path_, where_);
      checked(H5Pset_deflate(properties.get(), 1), path_, where_);
    }
    dataset_ = checked(H5Dcreate2(group, name, stored, space.get(), H5P_DEFAULT, properties.get(), H5P_DEFAULT),
                       H5Dclose, path_, where_);
  }

  void append(const void* data, hsize_t rows) {
    if (rows == 0) return;
    const hsize_t size[1] = {length_ + rows};
    checked(H5Dset_extent(dataset_.get(), size), path_, where_);
    Handle file_space = checked(H5Dget_space(dataset_.get()), H5Sclose, path_, where_);
    const hsize_t start[1] = {length_};
    const hsize_t count[1] = {rows};
    checked(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), path_, where_);
    Handle memory_space = checked(H5Screate_simple(1, count, nullptr), H5Sclose, path_, where_);
    checked(H5Dwrite(dataset_.get(), in_memory_, memory_space.get(), file_space.get(), H5P_DEFAULT, data), path_,
            where_);
    length_ += rows;
  }

  void close() {
    if (!dataset_.close()) fail_write(path_, "closing " + where_);
  }

 private:
  std::string where_;
  hid_t in_memory_;
  const std::string& path_;
  Handle dataset_;
  hsize_t length_ = 0;
};

// The columns of one table (probes or steps), created empty.
template <class Row>
class AppendableTable {
 public:
  AppendableTable(hid_t file, const char* group_name, const std::string& path)
      : path_(path),
        where_(std::string("dataset /") + group_name),
        group_(checked(H5Gcreate2(file, group_name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, path,
                       std::string("group /") + group_name)) {}

  template <size_t N>
  AppendableTable& with(const IntegerColumn<Row> (&columns)[N]) {
    for (const IntegerColumn<Row>& column : columns) {
      integer_getters_.push_back(column.get);
      // HDF5 narrows the int64 buffer to the column's stored width.
      integers_.emplace_back(group_.get(), where_, column.name, file_type(column.storage), H5T_NATIVE_INT64,
                             sizeof(int64_t), path_);
    }
    return *this;
  }

  template <size_t N>
  AppendableTable& with(const RealColumn<Row> (&columns)[N]) {
    for (const RealColumn<Row>& column : columns) {
      real_getters_.push_back(column.get);
      reals_.emplace_back(group_.get(), where_, column.name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, sizeof(double),
                          path_);
    }
    return *this;
  }

  // Each column as wide as its longest value among `first_rows`, and at
  // least its table width.
  template <size_t N>
  AppendableTable& with(const TextColumn<Row> (&columns)[N], const std::vector<Row>& first_rows) {
    for (const TextColumn<Row>& column : columns) {
      size_t width = column.width;
      for (const Row& row : first_rows) width = std::max(width, column.get(row).size());
      text_columns_.push_back({column.name, width, column.get});
      text_types_.push_back(string_type(width, path_));
      texts_.emplace_back(group_.get(), where_, column.name, text_types_.back().get(), text_types_.back().get(),
                          width, path_);
    }
    return *this;
  }

  void append(const std::vector<Row>& rows) {
    std::vector<int64_t> integers(rows.size());
    for (size_t c = 0; c < integers_.size(); ++c) {
      for (size_t i = 0; i < rows.size(); ++i) integers[i] = integer_getters_[c](rows[i]);
      integers_[c].append(integers.data(), rows.size());
    }
    std::vector<double> reals(rows.size());
    for (size_t c = 0; c < reals_.size(); ++c) {
      for (size_t i = 0; i < rows.size(); ++i) reals[i] = real_getters_[c](rows[i]);
      reals_[c].append(reals.data(), rows.size());
    }
    for (size_t c = 0; c < texts_.size(); ++c) {
      const TextInfo& column = text_columns_[c];
      std::vector<char> packed(rows.size() * column.width, '\0');
      for (size_t i = 0; i < rows.size(); ++i) {
        const std::string text = column.get(rows[i]);
        if (text.size() > column.width) {
          throw std::runtime_error("cannot write trace " + path_ + ": a value of column " + column.name +
                                   " is longer than its " + std::to_string(column.width) + " bytes: " +
                                   printable(text.substr(0, 64)) + "...");
        }
        std::memcpy(packed.data() + i * column.width, text.data(), text.size());
      }
      texts_[c].append(packed.data(), rows.size());
    }
  }

  void close() {
    for (AppendableColumn& column : integers_) column.close();
    for (AppendableColumn& column : reals_) column.close();
    for (AppendableColumn& column : texts_) column.close();
    text_types_.clear();
    if (!group_.close()) fail_write(path_, "closing a group");
  }

 private:
  struct TextInfo {
    const char* name;
    size_t width;
    std::string (*get)(const Row&);
  };
  const std::string& path_;
  std::string where_;
  Handle group_;
  std::vector<int64_t (*)(const Row&)> integer_getters_;
  std::vector<double (*)(const Row&)> real_getters_;
  std::vector<TextInfo> text_columns_;
  std::vector<Handle> text_types_;
  std::vector<AppendableColumn> integers_, reals_, texts_;
};

void write_string_attribute(hid_t file, const std::string& path, const char* name, const std::string& value) {
  Handle type = string_type(value.size(), path);
  Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, path, "attribute space");
  Handle attribute = checked(H5Acreate2(file, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
                             path, std::string("attribute ") + name);
  std::string padded = value;
  padded.resize(std::max<size_t>(value.size(), 1), '\0');
  checked(H5Awrite(attribute.get(), type.get(), padded.data()), path, std::string("attribute ") + name);
}

void write_int_attribute(hid_t file, const std::string& path, const char* name, int value) {
  Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, path, "attribute space");
  Handle attribute = checked(H5Acreate2(file, name, H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                             H5Aclose, path, std::string("attribute ") + name);
  checked(H5Awrite(attribute.get(), H5T_NATIVE_INT, &value), path, std::string("attribute ") + name);
}

void write_header(hid_t file, const std::string& path, const TraceHeader& header) {
  write_string_attribute(file, path, "format", kFormatName);
  write_int_attribute(file, path, "format_version", kFormatVersion);
  for (const HeaderAttribute& attribute : kHeaderAttributes) {
    write_string_attribute(file, path, attribute.name, header.*attribute.field);
  }
  write_string_attribute(file, path, "created_utc", utc_timestamp());
  std::string extra_names;
  for (const auto& [name, value] : header.extra) {
    write_string_attribute(file, path, name.c_str(), value);
    extra_names += (extra_names.empty() ? "" : "\n") + name;
  }
  if (!header.extra.empty()) write_string_attribute(file, path, kExtraAttributesName, extra_names);
}

void check_extra_attribute_names(const TraceHeader& header) {
  for (const auto& entry : header.extra) {
    if (reserved_attribute_names().count(entry.first) != 0 || entry.first.empty() ||
        entry.first.find('\n') != std::string::npos) {
      throw std::invalid_argument("trace: extra attribute name '" + entry.first + "' is reserved or invalid");
    }
  }
}

// Reads the file after its first 512 bytes back, hashes it and writes the
// integrity block in front, flushed to disk. Returns an error text or "".
std::string seal_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return errno_text();
  std::string error;
  Sha256 sha;
  std::vector<uint8_t> block(size_t{1} << 20);
  uint64_t length = 0;
  for (off_t at = kTraceIntegrityBlockBytes;;) {
    const ssize_t n = ::pread(fd, block.data(), block.size(), at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = errno_text();
    if (n <= 0) break;
    sha.update(block.data(), static_cast<size_t>(n));
    length += static_cast<uint64_t>(n);
    at += n;
  }
  if (error.empty()) {
    const std::string integrity = trace_integrity_block(length, sha.hex_digest());
    if (::pwrite(fd, integrity.data(), integrity.size(), 0) != static_cast<ssize_t>(integrity.size())) {
      error = errno != 0 ? errno_text() : "short write";
    } else if (::fsync(fd) != 0) {
      error = errno_text();
    }
  }
  if (::close(fd) != 0 && error.empty()) error = errno_text();
  return error;
}

}  // namespace

// The open HDF5 file and its probe table.
struct TraceStream::File {
  explicit File(const std::string& file_path) : path(file_path) {
    silence_hdf5();
    access = Handle(latching_file_access(latch), H5Pclose);
    checked(H5Pset_fclose_degree(access.get(), H5F_CLOSE_STRONG), path, "file access list");
    Handle creation = checked(H5Pcreate(H5P_FILE_CREATE), H5Pclose, path, "file creation list");
    checked(H5Pset_userblock(creation.get(), kTraceIntegrityBlockBytes), path, "file creation list");
    file = Handle(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, creation.get(), access.get()), H5Fclose);
    if (file.get() < 0) {
      if (latch.open_error_number == 0) fail_write(path, "creating the file");
      take_hdf5_error();
      latch.error_number = latch.open_error_number;
      latch.during = "creating the file";
    }
  }

  // Created with the first records, which fix the widths of its text columns.
  AppendableTable<ProbeRecord>& probe_table(const std::vector<ProbeRecord>& first_records) {
    if (!probes) {
      probes.emplace(file.get(), kProbesGroup, path);
      probes->with(kProbeIntegerColumns).with(kProbeRealColumns).with(kProbeTextColumns, first_records);
    }
    return *probes;
  }

  std::string path;
  TraceFileLatch latch;  // before the handles: it outlives the file
  Handle access;
  Handle file;
  std::optional<AppendableTable<ProbeRecord>> probes;
  uint64_t records = 0;
};

TraceStream::TraceStream(std::string path, std::string label)
    : path_(std::move(path)), label_(label.empty() ? path_ : std::move(label)) {
  try {
    file_ = std::make_unique<File>(path_);
    guarded([] {});
  } catch (...) {
    file_.reset();
    ::unlink(path_.c_str());
    throw;
  }
}

TraceStream::~TraceStream() {
  if (finished_) return;
  file_.reset();  // closes whatever is open; errors no longer matter
  ::unlink(path_.c_str());
}

// Runs `work`; an I/O failure the driver latched, during it or before, is
// OutputError naming the file whatever HDF5 made of it.
template <class Work>
void TraceStream::guarded(Work&& work) {
  try {
    if (!file_->latch.failed()) work();
  } catch (const std::runtime_error&) {
    if (!file_->latch.failed()) throw;
  }
  if (file_->latch.failed()) throw OutputError(label_, "cannot write trace: " + file_->latch.text());
}

void TraceStream::append(const std::vector<ProbeRecord>& records) {
  if (finished_) throw std::logic_error("TraceStream::append after finish");
  guarded([&] {
    if (records.empty()) return;
    file_->probe_table(records).append(records);
    file_->records += records.size();
  });
}

void TraceStream::finish(const TraceHeader& header, const std::vector<TraceStepRow>& steps) {
  if (finished_) throw std::logic_error("TraceStream::finish twice");
  check_extra_attribute_names(header);
  guarded([&] {
    File& f = *file_;
    f.probe_table({}).close();
    f.probes.reset();
    write_header(f.file.get(), f.path, header);
    AppendableTable<TraceStepRow> table(f.file.get(), kStepsGroup, f.path);
    table.with(kStepIntegerColumns).with(kStepRealColumns).append(steps);
    table.close();
    if (!f.file.close()) fail_write(f.path, "closing the file");
  });
  const std::string error = seal_file(path_);
  if (!error.empty()) throw OutputError(label_, "cannot write trace: " + error);
  finished_ = true;
}

uint64_t TraceStream::records_written() const { return file_ ? file_->records : 0; }

void write_trace(const std::string& path, const TraceHeader& header, const std::vector<ProbeRecord>& probes,
                 const std::vector<TraceStepRow>& steps, const std::string& label) {
  check_extra_attribute_names(header);
  const std::string shown = label.empty() ? path : label;
  std::string temporary = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temporary.data());
  if (fd < 0) throw OutputError(shown, "cannot write trace: " + errno_text());
  const bool readable = ::fchmod(fd, 0644) == 0;  // mkstemp's 0600 would survive HDF5's truncating open
  const std::string reason = readable ? "" : errno_text();
  ::close(fd);
  if (!readable) {
    ::unlink(temporary.c_str());
    throw OutputError(shown, "cannot write trace: " + reason);
  }
  {
    TraceStream stream(temporary, shown);
    stream.append(probes);
    stream.finish(header, steps);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = errno_text();
    ::unlink(temporary.c_str());
    throw OutputError(shown, "cannot write trace: renaming " + temporary + " into place failed: " + reason);
  }
}

}  // namespace nanreplay
