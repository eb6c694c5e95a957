// MappedFile when the file changes under the mapping: a read past the end of
// a file that shrank reads zeros (any thread) instead of killing the process
// with SIGBUS, and throw_if_mapped_file_changed names the file; a SIGBUS
// outside every mapping still ends the process; changes that never fault
// (rewritten, replaced, removed, grown) are seen too.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/base/mapped_file.h"
#include "tests/cli_harness.h"

#if defined(__SANITIZE_ADDRESS__)
#define NANREPLAY_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NANREPLAY_TEST_UNDER_ASAN 1
#endif
#endif
#ifndef NANREPLAY_TEST_UNDER_ASAN
#define NANREPLAY_TEST_UNDER_ASAN 0
#endif

namespace {

namespace fs = std::filesystem;
using nanreplay::InputError;
using nanreplay::MappedFile;
using nanreplay_test::ScratchDir;

const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

void write_pages(const fs::path& path, size_t pages, char fill) {
  std::ofstream(path, std::ios::binary) << std::string(pages * kPage, fill);
}

std::string poll_message() {
  try {
    nanreplay::throw_if_mapped_file_changed();
  } catch (const InputError& error) {
    return error.what();
  }
  return "";
}

uint8_t read_byte(const MappedFile& map, size_t offset) {
  return *static_cast<const volatile uint8_t*>(map.data() + offset);
}

}  // namespace

TEST_CASE("a mapped file that shrinks reads zeros past its new end and is named as changed", "[loaders][mapped]") {
  ScratchDir scratch("mapped-shrink");
  const fs::path path = scratch / "shard.bin";
  write_pages(path, 4, '\xab');
  const MappedFile map(path.string(), "data/shard.bin");
  CHECK(read_byte(map, 3 * kPage) == 0xab);
  CHECK(poll_message().empty());

  fs::resize_file(path, kPage);
  CHECK(read_byte(map, 0) == 0xab);          // still in the file
  CHECK(read_byte(map, 2 * kPage + 5) == 0);  // would have been SIGBUS
  CHECK(read_byte(map, 3 * kPage) == 0);
  const std::string message = poll_message();
  CHECK(message.rfind("data/shard.bin: changed while being read: a read past its end failed", 0) == 0);
  CHECK(message.find('\n') == std::string::npos);
  CHECK_FALSE(map.change().empty());
}

TEST_CASE("a fault in another thread is absorbed the same way", "[loaders][mapped]") {
  ScratchDir scratch("mapped-thread");
  const fs::path path = scratch / "model.safetensors";
  write_pages(path, 8, '\x11');
  const MappedFile map(path.string(), "steps/101/model.safetensors");
  ::truncate(path.c_str(), 0);
  std::atomic<unsigned> sum{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      for (size_t page = static_cast<size_t>(t); page < 8; page += 4) sum += read_byte(map, page * kPage);
    });
  }
  for (std::thread& reader : readers) reader.join();
  CHECK(sum == 0);
  CHECK(poll_message().find("steps/101/model.safetensors: changed while being read") == 0);
}

TEST_CASE("changes that never fault are seen by the poll: rewritten, grown, replaced, removed", "[loaders][mapped]") {
  ScratchDir scratch("mapped-changes");
  const fs::path path = scratch / "state.bin";
  write_pages(path, 2, 'x');
  SECTION("rewritten in place") {
    const MappedFile map(path.string(), "f");
    const timespec later[2] = {{0, UTIME_OMIT}, {1, 0}};
    REQUIRE(::utimensat(AT_FDCWD, path.c_str(), later, 0) == 0);
    CHECK(poll_message().find("f: changed while being read: it was rewritten") == 0);
  }
  SECTION("grown") {
    const MappedFile map(path.string(), "f");
    fs::resize_file(path, 3 * kPage);
    CHECK(poll_message().find("f: changed while being read: it is now") == 0);
  }
  SECTION("replaced") {
    const MappedFile map(path.string(), "f");
    write_pages(scratch / "other", 2, 'y');
    fs::rename(scratch / "other", path);
    CHECK(poll_message().find("f: changed while being read: it was replaced") == 0);
  }
  SECTION("removed") {
    const MappedFile map(path.string(), "f");
    fs::remove(path);
    CHECK(poll_message().find("f: changed while being read: it was removed") == 0);
  }
  SECTION("closed mappings are no longer watched") {
    { const MappedFile map(path.string(), "f"); }
    fs::remove(path);
    CHECK(poll_message().empty());
  }
}

TEST_CASE("many live mappings are all watched", "[loaders][mapped]") {
  ScratchDir scratch("mapped-many");
  std::vector<MappedFile> maps;
  for (int i = 0; i < 600; ++i) {  // more than one chunk of the registry
    const fs::path path = scratch / ("s" + std::to_string(i));
    write_pages(path, 1, 'z');
    maps.emplace_back(path.string(), "s" + std::to_string(i));
  }
  ::truncate((scratch / "s555").c_str(), 0);
  CHECK(read_byte(maps[555], 10) == 0);
  CHECK(poll_message().find("s555: changed while being read") == 0);
}

TEST_CASE("a SIGBUS outside every mapping still ends the process", "[loaders][mapped]") {
  ScratchDir scratch("mapped-foreign");
  const fs::path path = scratch / "foreign.bin";
  write_pages(path, 2, 'q');
  { const MappedFile installs_the_handler((scratch / "foreign.bin").string(), "x"); }
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  void* raw = ::mmap(nullptr, 2 * kPage, PROT_READ, MAP_PRIVATE, fd, 0);  // not a MappedFile
  REQUIRE(raw != MAP_FAILED);
  ::close(fd);
  REQUIRE(::truncate(path.c_str(), 0) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const volatile uint8_t* bytes = static_cast<const uint8_t*>(raw);
    _exit(bytes[kPage] == 0 ? 0 : 1);  // must not get here
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  ::munmap(raw, 2 * kPage);
  if (NANREPLAY_TEST_UNDER_ASAN) {
    CHECK_FALSE((WIFEXITED(status) && WEXITSTATUS(status) == 0));  // AddressSanitizer reports it, then exits
  } else {
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGBUS);
  }
}
