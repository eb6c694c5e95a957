// Tests for loaders/bundle/bundle_paths.cpp and loaders/base/mapped_file.cpp: what may
// name a file inside a bundle (relative, no "..", no symlink escaping the
// root) and how bundle files are mapped (read-only, empty, directory, missing).
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loaders/bundle/bundle_paths.h"
#include "loaders/base/error.h"
#include "loaders/base/glob_match.h"
#include "loaders/base/mapped_file.h"

namespace {

namespace fs = std::filesystem;
using nanreplay::InputError;
using nanreplay::glob_match;

using nanreplay_test::kManifestLabel;
using nanreplay_test::MessageMentions;
using nanreplay_test::TempDir;

const char* const kKey = "steps[0].dir";

void touch(const fs::path& path, const std::string& contents = "") {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << contents;
}

fs::path resolve(const fs::path& root, const std::string& relative) {
  return nanreplay::resolve_in_bundle(root, relative, kManifestLabel, kKey);
}

}  // namespace

TEST_CASE("bundle_paths: relative paths resolve under the canonical root", "[loaders][paths]") {
  TempDir bundle;
  touch(bundle / "steps/100/state.json");
  const fs::path root = fs::canonical(bundle.path());
  CHECK(resolve(bundle.path(), "steps/100/state.json") == root / "steps/100/state.json");
  CHECK(resolve(bundle.path(), "./steps//100/./state.json") == root / "steps/100/state.json");
  // Existence is not checked here; a name that merely starts with dots is fine.
  CHECK(resolve(bundle.path(), "steps/101/state.json") == root / "steps/101/state.json");
  CHECK(resolve(bundle.path(), "..data/x.bin") == root / "..data/x.bin");
  CHECK(resolve(bundle.path(), "steps/...") == root / "steps/...");
  // The root reached through a symlink still counts as the bundle.
  TempDir elsewhere;
  fs::create_directory_symlink(bundle.path(), elsewhere / "bundle-link");
  CHECK(resolve(elsewhere / "bundle-link", "steps/100/state.json") ==
        root / "steps/100/state.json");
}

TEST_CASE("bundle_paths: paths are checked as text first", "[loaders][paths]") {
  TempDir bundle;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "got \"\""},
      {"/etc/passwd", "absolute"},
      {"//etc/passwd", "absolute"},
      {"..", "'..'"},
      {"../outside", "'..'"},
      {"steps/../../outside", "'..'"},
      {"steps/../steps/100", "'..'"},  // even when it would stay inside
      {"steps/..", "'..'"},
      {std::string("steps\0/x", 8), "NUL"},
  };
  for (const auto& [relative, why] : bad) {
    CAPTURE(relative);
    REQUIRE_INPUT_ERROR(resolve(bundle.path(), relative), "bundle/manifest.json: steps[0].dir",
                        why);
    REQUIRE_INPUT_ERROR(nanreplay::check_bundle_relative_path(relative, kManifestLabel, kKey),
                        kManifestLabel, kKey, why);
  }
  CHECK_NOTHROW(nanreplay::check_bundle_relative_path("data/shard_000.bin", kManifestLabel, kKey));
}

TEST_CASE("bundle_paths: symlinks may not lead outside the bundle", "[loaders][paths]") {
  TempDir bundle;
  TempDir outside;
  touch(outside / "secret.bin", "x");
  touch(bundle / "data/inside.bin", "y");

  fs::create_symlink(outside / "secret.bin", bundle / "data/file-link.bin");
  REQUIRE_INPUT_ERROR(resolve(bundle.path(), "data/file-link.bin"), kManifestLabel, kKey,
                      "escapes the bundle", "secret.bin");

  fs::create_directory_symlink(outside.path(), bundle / "steps");
  REQUIRE_INPUT_ERROR(resolve(bundle.path(), "steps/secret.bin"), kManifestLabel, kKey,
                      "escapes the bundle");
  REQUIRE_INPUT_ERROR(resolve(bundle.path(), "steps/not-there-yet.json"), kManifestLabel, kKey,
                      "escapes the bundle");

  // A link named like the bundle but beside it is still outside (prefix trap).
  const fs::path sibling = bundle.path().string() + "-sibling";
  fs::create_directories(sibling);
  touch(sibling / "x.bin");
  fs::create_symlink(sibling / "x.bin", bundle / "data/sibling.bin");
  REQUIRE_INPUT_ERROR(resolve(bundle.path(), "data/sibling.bin"), kManifestLabel, kKey,
                      "escapes the bundle");
  fs::remove_all(sibling);

  fs::create_symlink("inside.bin", bundle / "data/alias.bin");
  CHECK(resolve(bundle.path(), "data/alias.bin") ==
        fs::canonical(bundle.path()) / "data/inside.bin");
}

TEST_CASE("bundle_paths: a missing bundle root is an input error", "[loaders][paths]") {
  TempDir parent;
  REQUIRE_INPUT_ERROR(resolve(parent / "no-such-bundle", "manifest.json"), "no-such-bundle",
                      "bundle directory");
}

TEST_CASE("mapped_file: maps a whole file read-only", "[loaders][paths]") {
  TempDir dir;
  touch(dir / "data.bin", "hello bundle");
  nanreplay::MappedFile map((dir / "data.bin").string(), "data.bin");
  REQUIRE(map.size() == 12);
  CHECK(std::memcmp(map.data(), "hello bundle", 12) == 0);
  CHECK(map.label() == "data.bin");

  nanreplay::MappedFile moved(std::move(map));
  CHECK(moved.size() == 12);
  CHECK(map.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  CHECK(map.size() == 0);
  nanreplay::MappedFile assigned;
  assigned = std::move(moved);
  CHECK(std::memcmp(assigned.data(), "hello", 5) == 0);
}

TEST_CASE("mapped_file: an empty file maps to nothing", "[loaders][paths]") {
  TempDir dir;
  touch(dir / "empty.bin");
  const nanreplay::MappedFile map((dir / "empty.bin").string(), "empty.bin");
  CHECK(map.size() == 0);
  CHECK(map.data() == nullptr);
}

TEST_CASE("mapped_file: what cannot be mapped is a clean input error", "[loaders][paths]") {
  TempDir dir;
  REQUIRE_INPUT_ERROR(nanreplay::MappedFile((dir / "absent.bin").string(), "steps/1/absent.bin"),
                      "steps/1/absent.bin: cannot open", "No such file");
  REQUIRE_INPUT_ERROR(nanreplay::MappedFile(dir.path().string(), "steps/1"),
                      "steps/1: cannot open", "directory");
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  REQUIRE_INPUT_ERROR(nanreplay::MappedFile((dir / "fifo").string(), "fifo"), "fifo: cannot open",
                      "regular file");
}

TEST_CASE("glob_match is fnmatch's * and ? over whole names", "[loaders][glob]") {
  CHECK(glob_match("*.bias", "model.layers.0.self_attn.q_proj.bias"));
  CHECK_FALSE(glob_match("*.bias", "model.layers.0.self_attn.q_proj.bias.extra"));
  CHECK(glob_match("model.layers.?.mlp.*", "model.layers.3.mlp.up_proj.weight"));
  CHECK_FALSE(glob_match("model.layers.?.mlp.*", "model.layers.13.mlp.up_proj.weight"));
  CHECK(glob_match("*", ""));
  CHECK(glob_match("**a*b", "xxaxxb"));
  CHECK_FALSE(glob_match("a*b", "a"));
  CHECK(glob_match("layers.1.attn.*", "layers.1.attn.scores"));
  // Many stars over a long name that does not match: no exponential backtracking.
  CHECK_FALSE(glob_match("*a*a*a*a*a*a*a*a*b", std::string(4000, 'a')));
}
