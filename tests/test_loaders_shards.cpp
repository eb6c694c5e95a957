// Tests for loaders/bundle/token_shards.cpp: uint16 and uint32 shards concatenated
// into one stream, samples straddling shards, SHA-256 checks, and shards that
// are missing, mis-sized or outside the bundle (InputError naming shard + key).
#include <catch2/catch.hpp>

#include "tests/loader_test_support.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "loaders/base/error.h"
#include "loaders/bundle/manifest.h"
#include "loaders/bundle/token_shards.h"

namespace {

namespace fs = std::filesystem;
using nanreplay::InputError;
using nanreplay::ShardSpec;
using nanreplay::TokenDtype;

using nanreplay_test::kManifestLabel;
using nanreplay_test::MessageMentions;
using nanreplay_test::TempDir;


template <typename Token>
void write_tokens(const fs::path& path, const std::vector<Token>& tokens) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * sizeof(Token)));
}

ShardSpec shard(const std::string& path, TokenDtype dtype, int64_t tokens) {
  ShardSpec spec;
  spec.path = path;
  spec.dtype = dtype;
  spec.tokens = tokens;
  return spec;
}

// A bundle with data/a.bin (5 uint16 tokens) and data/b.bin (4 uint32 tokens).
struct TwoShardBundle {
  TempDir dir;
  std::vector<uint16_t> first = {1, 2, 300, 65535, 5};
  std::vector<uint32_t> second = {70000, 7, 4000000000u, 9};
  std::vector<ShardSpec> specs = {shard("data/a.bin", TokenDtype::kUint16, 5),
                                  shard("data/b.bin", TokenDtype::kUint32, 4)};
  TwoShardBundle() {
    write_tokens(dir / "data/a.bin", first);
    write_tokens(dir / "data/b.bin", second);
  }
};

}  // namespace

TEST_CASE("token_shards: shards concatenate into one stream", "[loaders][shards]") {
  TwoShardBundle bundle;
  const nanreplay::TokenStream stream(bundle.dir.path(), bundle.specs, kManifestLabel);
  REQUIRE(stream.num_shards() == 2);
  CHECK(stream.total_tokens() == 9);
  CHECK(stream.spec(1).path == "data/b.bin");
  CHECK(stream.mapping(0).size() == 10);
  CHECK(stream.mapping(1).size() == 16);

  const std::vector<uint32_t> expected = {1, 2, 300, 65535, 5, 70000, 7, 4000000000u, 9};
  for (int64_t i = 0; i < 9; ++i) {
    CAPTURE(i);
    CHECK(stream.token(i) == expected[static_cast<size_t>(i)]);
  }
  CHECK(stream.locate(0).shard == 0);
  CHECK(stream.locate(4).shard == 0);
  CHECK(stream.locate(4).offset == 4);
  CHECK(stream.locate(5).shard == 1);
  CHECK(stream.locate(5).offset == 0);
  CHECK(stream.locate(8).offset == 3);

  std::vector<int64_t> window(4);
  stream.read(3, 4, window.data());
  CHECK(window == std::vector<int64_t>{65535, 5, 70000, 7});
  stream.read(9, 0, window.data());  // an empty read at the end is fine
}

TEST_CASE("token_shards: samples overlap by one token and may straddle shards",
          "[loaders][shards]") {
  TwoShardBundle bundle;
  const nanreplay::TokenStream stream(bundle.dir.path(), bundle.specs, kManifestLabel);
  // (9 - 1) / 3 = 2 samples: tokens [0, 4) and [3, 7).
  CHECK(stream.num_samples(3) == 2);
  CHECK(stream.num_samples(8) == 1);
  CHECK(stream.num_samples(9) == 0);
  CHECK(stream.sample_tokens(0, 3) == std::vector<int64_t>{1, 2, 300, 65535});
  CHECK(stream.sample_tokens(1, 3) == std::vector<int64_t>{65535, 5, 70000, 7});
  CHECK(stream.sample_tokens(0, 8).size() == 9);
}

TEST_CASE("token_shards: reads outside the stream are programmer errors", "[loaders][shards]") {
  TwoShardBundle bundle;
  const nanreplay::TokenStream stream(bundle.dir.path(), bundle.specs, kManifestLabel);
  std::vector<int64_t> out(16);
  CHECK_THROWS_AS(stream.token(-1), std::out_of_range);
  CHECK_THROWS_AS(stream.token(9), std::out_of_range);
  CHECK_THROWS_AS(stream.locate(9), std::out_of_range);
  CHECK_THROWS_AS(stream.read(6, 4, out.data()), std::out_of_range);
  CHECK_THROWS_AS(stream.read(-1, 2, out.data()), std::out_of_range);
  CHECK_THROWS_AS(stream.read(2, -1, out.data()), std::out_of_range);
  CHECK_THROWS_AS(stream.read(1, INT64_MAX, out.data()), std::out_of_range);
  CHECK_THROWS_AS(stream.sample_tokens(2, 3), std::out_of_range);
  CHECK_THROWS_AS(stream.sample_tokens(-1, 3), std::out_of_range);
  CHECK_THROWS_AS(stream.num_samples(0), std::invalid_argument);
}

TEST_CASE("token_shards: a shard whose size disagrees with tokens names both",
          "[loaders][shards]") {
  TwoShardBundle bundle;
  SECTION("shorter than declared") {
    bundle.specs[1].tokens = 5;
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        "data/b.bin: data.shards[1].tokens",
                        "bundle/manifest.json says 5 tokens (20 bytes of uint32)",
                        "the file holds 16 bytes");
  }
  SECTION("longer than declared") {
    bundle.specs[0].tokens = 4;
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        "data/a.bin: data.shards[0].tokens", "4 tokens (8 bytes of uint16)",
                        "holds 10 bytes");
  }
  SECTION("the wrong width") {
    bundle.specs[0].dtype = TokenDtype::kUint32;
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        "data/a.bin", "data.shards[0].tokens", "20 bytes of uint32");
  }
  SECTION("a half token") {
    std::ofstream(bundle.dir / "data/a.bin", std::ios::app) << 'x';
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        "data/a.bin", "data.shards[0].tokens", "holds 11 bytes");
  }
  SECTION("a token count whose byte size overflows") {
    bundle.specs[0].tokens = INT64_MAX;
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        "data/a.bin", "data.shards[0].tokens");
  }
}

TEST_CASE("token_shards: missing or unreadable shards name the shard", "[loaders][shards]") {
  TwoShardBundle bundle;
  bundle.specs.push_back(shard("data/c.bin", TokenDtype::kUint16, 3));
  REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                      "data/c.bin", "cannot open");
  bundle.specs.back().path = "data";
  REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                      "data", "directory");
}

TEST_CASE("token_shards: shard paths must stay inside the bundle", "[loaders][shards]") {
  TwoShardBundle bundle;
  TempDir outside;
  write_tokens(outside / "secret.bin", std::vector<uint16_t>{1, 2, 3});

  SECTION("a '..' component") {
    bundle.specs[1] = shard("data/../../" + outside.path().filename().string() + "/secret.bin",
                            TokenDtype::kUint16, 3);
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        kManifestLabel, "data.shards[1].path", "'..'");
  }
  SECTION("an absolute path") {
    bundle.specs[0] = shard((outside / "secret.bin").string(), TokenDtype::kUint16, 3);
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        kManifestLabel, "data.shards[0].path", "absolute");
  }
  SECTION("a symlink pointing outside") {
    fs::create_symlink(outside / "secret.bin", bundle.dir / "data/link.bin");
    bundle.specs[1] = shard("data/link.bin", TokenDtype::kUint16, 3);
    REQUIRE_INPUT_ERROR(nanreplay::TokenStream(bundle.dir.path(), bundle.specs, kManifestLabel),
                        kManifestLabel, "data.shards[1].path", "escapes the bundle");
  }
  SECTION("a symlink that stays inside is followed") {
    fs::create_symlink("a.bin", bundle.dir / "data/alias.bin");
    bundle.specs[1] = shard("data/alias.bin", TokenDtype::kUint16, 5);
    const nanreplay::TokenStream stream(bundle.dir.path(), bundle.specs, kManifestLabel);
    CHECK(stream.total_tokens() == 10);
    CHECK(stream.token(8) == 65535);
  }
}

TEST_CASE("token_shards: checksums are verified, mismatches reported", "[loaders][shards]") {
  CHECK(nanreplay::sha256_hex(reinterpret_cast<const uint8_t*>("abc"), 3) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(nanreplay::sha256_hex(nullptr, 0) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");

  TwoShardBundle bundle;
  const std::string good_a = nanreplay::sha256_hex(
      reinterpret_cast<const uint8_t*>(bundle.first.data()), bundle.first.size() * 2);
  bundle.specs[0].sha256 = good_a;
  {
    const nanreplay::TokenStream stream(bundle.dir.path(), bundle.specs, kManifestLabel);
    CHECK(stream.verify_checksums().empty());
  }
  const std::string wrong(64, '0');
  bundle.specs[1].sha256 = wrong;
  const nanreplay::TokenStream stream(bundle.dir.path(), bundle.specs, kManifestLabel);
  const std::vector<nanreplay::ChecksumMismatch> mismatches = stream.verify_checksums();
  REQUIRE(mismatches.size() == 1);
  CHECK(mismatches[0].shard == "data/b.bin");
  CHECK(mismatches[0].expected == wrong);
  CHECK(mismatches[0].actual ==
        nanreplay::sha256_hex(reinterpret_cast<const uint8_t*>(bundle.second.data()), 16));
}
