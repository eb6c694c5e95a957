// Writes trace.h5 (layout in trace_writer.h and docs/trace-format.md) with
// the HDF5 C API. HDF5 only ever works on memory (its core driver): the file
// image is built in memory and written to disk by us, so a full disk is one
// checked write(), not an error inside HDF5. HDF5 never prints: its errors
// become exceptions. Serial HDF5 is not thread-safe: one write_trace or
// read_trace at a time per process.
#include "reports/trace_writer.h"

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

#include "loaders/error.h"
#include "reports/trace_integrity.h"
#include "reports/trace_layout.h"

namespace nanreplay {
namespace {

using namespace trace_layout;

// --- Writing -------------------------------------------------------------

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

class TraceFileWriter {
 public:
  TraceFileWriter(std::string display_path, hid_t file)
      : path_(std::move(display_path)), file_(file) {}

  void write_string_attribute(const char* name, const std::string& value) {
    Handle type = string_type(value.size(), path_);
    Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, path_, "attribute space");
    Handle attribute =
        checked(H5Acreate2(file_, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
                H5Aclose, path_, std::string("attribute ") + name);
    std::string padded = value;
    padded.resize(std::max<size_t>(value.size(), 1), '\0');
    checked(H5Awrite(attribute.get(), type.get(), padded.data()), path_,
            std::string("attribute ") + name);
  }

  void write_int_attribute(const char* name, int value) {
    Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, path_, "attribute space");
    Handle attribute =
        checked(H5Acreate2(file_, name, H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                H5Aclose, path_, std::string("attribute ") + name);
    checked(H5Awrite(attribute.get(), H5T_NATIVE_INT, &value), path_,
            std::string("attribute ") + name);
  }

  Handle create_group(const char* name) {
    return checked(H5Gcreate2(file_, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, path_,
                   std::string("group /") + name);
  }

  template <class Row, size_t N>
  void write_columns(hid_t group, const std::string& group_name, const std::vector<Row>& rows,
                     const IntegerColumn<Row> (&columns)[N]) {
    std::vector<int64_t> values(rows.size());
    for (const IntegerColumn<Row>& column : columns) {
      for (size_t i = 0; i < rows.size(); ++i) values[i] = column.get(rows[i]);
      // HDF5 narrows the int64 buffer to the column's stored width.
      write_dataset(group, group_name, column.name, file_type(column.storage), H5T_NATIVE_INT64,
                    sizeof(int64_t), rows.size(), values.data());
    }
  }

  template <class Row, size_t N>
  void write_columns(hid_t group, const std::string& group_name, const std::vector<Row>& rows,
                     const RealColumn<Row> (&columns)[N]) {
    std::vector<double> values(rows.size());
    for (const RealColumn<Row>& column : columns) {
      for (size_t i = 0; i < rows.size(); ++i) values[i] = column.get(rows[i]);
      write_dataset(group, group_name, column.name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                    sizeof(double), rows.size(), values.data());
    }
  }

  template <class Row, size_t N>
  void write_columns(hid_t group, const std::string& group_name, const std::vector<Row>& rows,
                     const TextColumn<Row> (&columns)[N]) {
    for (const TextColumn<Row>& column : columns) {
      std::vector<std::string> texts(rows.size());
      size_t width = 1;
      for (size_t i = 0; i < rows.size(); ++i) {
        texts[i] = column.get(rows[i]);
        width = std::max(width, texts[i].size());
      }
      std::vector<char> packed(rows.size() * width, '\0');
      for (size_t i = 0; i < rows.size(); ++i) {
        std::memcpy(packed.data() + i * width, texts[i].data(), texts[i].size());
      }
      Handle type = string_type(width, path_);
      write_dataset(group, group_name, column.name, type.get(), type.get(), width, rows.size(),
                    packed.data());
    }
  }

 private:
  void write_dataset(hid_t group, const std::string& group_name, const char* name, hid_t stored,
                     hid_t in_memory, size_t element_size, size_t length, const void* data) {
    const std::string where = "dataset /" + group_name + "/" + name;
    const hsize_t dims[1] = {length};
    Handle space = checked(H5Screate_simple(1, dims, nullptr), H5Sclose, path_, where);
    Handle properties = checked(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, path_, where);
    if (length >= kChunkThreshold) {
      const hsize_t chunk[1] = {
          std::min<hsize_t>(length, std::max<hsize_t>(1, kChunkBytes / element_size))};
      checked(H5Pset_chunk(properties.get(), 1, chunk), path_, where);
      // Shuffle + deflate are built into every HDF5, so h5dump and h5py read them.
      if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) {
        checked(H5Pset_shuffle(properties.get()), path_, where);
        checked(H5Pset_deflate(properties.get(), 1), path_, where);
      }
    }
    Handle dataset = checked(
        H5Dcreate2(group, name, stored, space.get(), H5P_DEFAULT, properties.get(), H5P_DEFAULT),
        H5Dclose, path_, where);
    if (length > 0) {
      checked(H5Dwrite(dataset.get(), in_memory, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), path_,
              where);
    }
  }

  std::string path_;
  hid_t file_;
};

void write_trace_file(const std::string& path, hid_t file, const TraceHeader& header,
                      const std::vector<ProbeRecord>& probes,
                      const std::vector<TraceStepRow>& steps) {
  TraceFileWriter writer(path, file);
  writer.write_string_attribute("format", kFormatName);
  writer.write_int_attribute("format_version", kFormatVersion);
  for (const HeaderAttribute& attribute : kHeaderAttributes) {
    writer.write_string_attribute(attribute.name, header.*attribute.field);
  }
  writer.write_string_attribute("created_utc", utc_timestamp());
  std::string extra_names;
  for (const auto& [name, value] : header.extra) {
    writer.write_string_attribute(name.c_str(), value);
    extra_names += (extra_names.empty() ? "" : "\n") + name;
  }
  if (!header.extra.empty()) writer.write_string_attribute(kExtraAttributesName, extra_names);

  Handle probe_group = writer.create_group(kProbesGroup);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeIntegerColumns);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeRealColumns);
  writer.write_columns(probe_group.get(), kProbesGroup, probes, kProbeTextColumns);

  Handle step_group = writer.create_group(kStepsGroup);
  writer.write_columns(step_group.get(), kStepsGroup, steps, kStepIntegerColumns);
  writer.write_columns(step_group.get(), kStepsGroup, steps, kStepRealColumns);
}

// --- Reading -------------------------------------------------------------

// Reads a verified file image. Every attribute is opened by name, checked to
// be one value of the expected class before it is read; every column is
// checked for rank, type, filters and size before a byte of it is decoded.
std::vector<uint8_t> build_trace_image(const std::string& label, const TraceHeader& header,
                                       const std::vector<ProbeRecord>& probes,
                                       const std::vector<TraceStepRow>& steps) {
  Handle access = checked(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, label, "file access list");
  checked(H5Pset_fapl_core(access.get(), kImageIncrement, /*backing_store=*/false), label, "file access list");
  // Closing the file closes whatever is still open in it: no error path leaves it held.
  checked(H5Pset_fclose_degree(access.get(), H5F_CLOSE_STRONG), label, "file access list");
  Handle creation = checked(H5Pcreate(H5P_FILE_CREATE), H5Pclose, label, "file creation list");
  checked(H5Pset_userblock(creation.get(), kTraceIntegrityBlockBytes), label, "file creation list");
  static std::atomic<unsigned> images{0};
  const std::string name = "nanreplay-trace-image-" + std::to_string(images++);
  Handle file = checked(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, creation.get(), access.get()), H5Fclose, label,
                        "creating the file in memory");
  write_trace_file(label, file.get(), header, probes, steps);
  checked(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), label, "flushing the file");
  const ssize_t size = H5Fget_file_image(file.get(), nullptr, 0);
  if (size <= 0) fail_write(label, "reading back the file image");
  std::vector<uint8_t> image(kTraceIntegrityBlockBytes + static_cast<size_t>(size));
  if (H5Fget_file_image(file.get(), image.data() + kTraceIntegrityBlockBytes, static_cast<size_t>(size)) != size) {
    fail_write(label, "reading back the file image");
  }
  if (!file.close()) fail_write(label, "closing the file");
  static const uint8_t kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  const auto signature_at = [&](size_t offset) {
    return image.size() >= offset + 8 && std::memcmp(image.data() + offset, kSignature, 8) == 0;
  };
  if (!signature_at(kTraceIntegrityBlockBytes)) {
    if (!signature_at(2 * kTraceIntegrityBlockBytes)) fail_write(label, "unexpected file image layout");
    image.erase(image.begin(), image.begin() + kTraceIntegrityBlockBytes);  // it held the userblock
  }
  seal_trace_image(image);
  return image;
}

// Writes `bytes` under a temporary name beside `path`, flushed to disk, and
// renames it into place: `path` is whole or absent. OutputError on failure.
void write_file_whole(const std::string& path, const std::string& label, const std::vector<uint8_t>& bytes) {
  std::string temporary = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temporary.data());
  if (fd < 0) throw OutputError(label, "cannot write trace: " + errno_text());
  const auto fail = [&](const std::string& reason) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw OutputError(label, "cannot write trace: " + reason);
  };
  if (::fchmod(fd, 0644) != 0) fail(errno_text());
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? errno_text() : "nothing written");
    written += static_cast<size_t>(n);
  }
  // A full disk or a quota often shows only here (delayed allocation, NFS).
  if (::fsync(fd) != 0) fail(errno_text());
  if (::close(fd) != 0) {
    const std::string reason = errno_text();
    ::unlink(temporary.c_str());
    throw OutputError(label, "cannot write trace: " + reason);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = errno_text();
    ::unlink(temporary.c_str());
    throw OutputError(label, "cannot write trace: renaming " + temporary + " into place failed: " + reason);
  }
}

// A regular file, read whole. O_NONBLOCK: opening a FIFO must not wait for a writer.

}  // namespace

void write_trace(const std::string& path, const TraceHeader& header, const std::vector<ProbeRecord>& probes,
                 const std::vector<TraceStepRow>& steps, const std::string& label) {
  for (const auto& entry : header.extra) {
    if (reserved_attribute_names().count(entry.first) != 0 || entry.first.empty() ||
        entry.first.find('\n') != std::string::npos) {
      throw std::invalid_argument("write_trace: extra attribute name '" + entry.first + "' is reserved or invalid");
    }
  }
  silence_hdf5();
  const std::string shown = label.empty() ? path : label;
  write_file_whole(path, shown, build_trace_image(shown, header, probes, steps));
}

}  // namespace nanreplay
