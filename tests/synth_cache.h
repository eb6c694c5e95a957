// A cache of `nanreplay synth` outputs shared by the test processes of one CLI
// binary. Each Catch2 case runs in its own process and most start by writing a
// preset's bundle; synth itself takes milliseconds, but every exec of the CLI
// pays LibTorch's start (~0.8 s of CPU here), which summed over the suite was
// minutes of CI. The first `synth PRESET DIR` of a binary runs the CLI into the
// cache; later ones copy that tree and replay its stdout/stderr with the
// directory's name swapped in. Only the plain form is cached: no environment
// prefix, a new target directory, and flags that name no file. The key holds
// the binary's contents, so a rebuilt CLI never reads an older binary's
// bundles. NANREPLAY_TEST_SYNTH_CACHE=0 turns it off.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "loaders/base/sha256.h"

namespace nanreplay_test {

namespace synth_cache {

namespace fs = std::filesystem;

// SHA-256 of the bytes of `path` (a few MiB: milliseconds). Python's tests
// (tests/py/synth_cache.py) compute the same names with hashlib and share the cache.
inline std::string file_digest(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  nanreplay::Sha256 hash;
  std::vector<char> block(1 << 16);
  while (in.read(block.data(), static_cast<std::streamsize>(block.size())) || in.gcount() > 0) {
    hash.update(reinterpret_cast<const uint8_t*>(block.data()), static_cast<size_t>(in.gcount()));
  }
  return hash.hex_digest();
}

inline bool enabled() {
  const char* flag = std::getenv("NANREPLAY_TEST_SYNTH_CACHE");
  return flag == nullptr || std::string(flag) != "0";
}

// The flags whose values are plain numbers or JSON, not files the key would miss.
inline bool cacheable_flags(const std::vector<std::string>& args) {
  for (size_t i = 3; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") continue;
    if ((a == "--checkpoint-every" || a == "--steps" || a == "--lr") && i + 1 < args.size()) {
      ++i;
      continue;
    }
    return false;
  }
  return true;
}

// The target directory of a cacheable `synth PRESET DIR [flags]`, or nothing.
inline std::optional<fs::path> cacheable_target(const std::vector<std::string>& args, const std::string& env) {
  if (!enabled() || !env.empty() || args.size() < 3 || args[0] != "synth") return std::nullopt;
  if (args[1].empty() || args[1][0] == '-' || args[2].empty() || args[2][0] == '-') return std::nullopt;
  if (!cacheable_flags(args)) return std::nullopt;
  std::error_code ec;
  const fs::path target = fs::absolute(args[2], ec);
  if (ec || fs::exists(target, ec) || ec || !fs::is_directory(target.parent_path(), ec)) return std::nullopt;
  // Inside a bundle synth refuses to write; the cache's own folder would not be.
  for (fs::path dir = target.parent_path(); dir.has_relative_path(); dir = dir.parent_path()) {
    if (fs::exists(dir / "manifest.json", ec)) return std::nullopt;
  }
  return fs::path(args[2]);
}

inline const std::string kDirMark = "\x01" "DIR" "\x01";

inline std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  if (from.empty()) return text;
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

// Binaries' cache folders untouched for two hours are left over from earlier builds.
inline void prune_stale(const fs::path& root, const fs::path& keep) {
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path() == keep) continue;
    const auto age = now - fs::last_write_time(it->path(), ec);
    if (!ec && age > std::chrono::hours(2)) fs::remove_all(it->path(), ec);
  }
}

// The folder of this CLI binary's cached bundles, created and marked as in use.
// The folder of one binary's bundles under one OpenMP thread count: synth's
// training sums in another order with another count, so its logged losses and
// checkpoints differ in the last bits (tests/py/synth_cache.py names it alike).
inline fs::path binary_folder(const std::string& cli) {
  static const std::string digest = file_digest(cli);
  const char* threads = std::getenv("OMP_NUM_THREADS");
  std::string suffix = threads != nullptr ? "-omp" : "";
  for (const char* c = threads; c != nullptr && *c != '\0'; ++c) {
    if ((*c >= '0' && *c <= '9') || *c == ',') suffix += *c;  // a name part, whatever the variable holds
  }
  const fs::path root = fs::temp_directory_path() / ("nanreplay-test-synth-" + std::to_string(getuid()));
  const fs::path folder = root / (digest + suffix);
  std::error_code ec;
  if (!fs::exists(folder, ec)) {
    fs::create_directories(folder, ec);
    prune_stale(root, folder);
  }
  fs::last_write_time(folder, fs::file_time_type::clock::now(), ec);
  return folder;
}

// The arguments but the target directory, each ended by a NUL.
inline std::string key_of(const std::vector<std::string>& args) {
  std::string joined;
  for (size_t i = 0; i < args.size(); ++i) {
    if (i != 2) joined += args[i] + '\0';
  }
  return nanreplay::sha256_hex(reinterpret_cast<const uint8_t*>(joined.data()), joined.size()).substr(0, 32);
}

}  // namespace synth_cache

}  // namespace nanreplay_test
