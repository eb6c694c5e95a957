// Shared by the loader tests: a matcher for InputError messages (every
// fragment must appear: file, key, what was wrong) and a scratch directory.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "loaders/base/error.h"

namespace nanreplay_test {

// The label the loader tests parse a manifest under (error messages name it).
inline constexpr const char* kManifestLabel = "bundle/manifest.json";

// Matches an InputError whose message contains every fragment.
class MessageMentions : public Catch::MatcherBase<nanreplay::InputError> {
 public:
  MessageMentions(std::vector<std::string> fragments) : fragments_(std::move(fragments)) {}
  bool match(const nanreplay::InputError& error) const override {
    message_ = error.what();
    for (const std::string& fragment : fragments_) {
      if (message_.find(fragment) == std::string::npos) return false;
    }
    return true;
  }
  std::string describe() const override {
    std::string text = "mentions";
    for (const std::string& fragment : fragments_) text += " '" + fragment + "'";
    return text + " (message: " + message_ + ")";
  }

 private:
  std::vector<std::string> fragments_;
  mutable std::string message_;
};

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "loaders") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("nanreplay_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace nanreplay_test

#define REQUIRE_INPUT_ERROR(expr, ...) \
  REQUIRE_THROWS_MATCHES(expr, nanreplay::InputError, nanreplay_test::MessageMentions({__VA_ARGS__}))
