// Who may join a replay across processes (replay/step/ranks/dist_admission.h,
// replay/step/ranks/run_secret.h), on an in-memory store with one thread per process.
// Through the CLI and a real TCPStore: tests/py/test_distributed_security.py.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "loaders/base/error.h"
#include "replay/step/ranks/dist_admission.h"
#include "replay/step/ranks/distributed.h"
#include "replay/step/ranks/run_secret.h"

#include "tests/catch/catch_after_glog.h"

using namespace nanreplay;

namespace {

struct Warnings {
  std::mutex mutex;
  std::vector<std::string> lines;
};

AdmissionRequest request_for(int rank, const std::string& secret, Warnings& warnings) {
  AdmissionRequest request;
  request.secret = secret;
  request.rank = rank;
  request.world_size = 2;
  request.self = Member{"host-" + std::to_string(rank), 1000.0 * (rank + 1)};
  request.timeout = std::chrono::milliseconds(3000);
  request.self_name = "rank " + std::to_string(rank);
  request.rendezvous = "test store";
  request.warn = [&warnings](const std::string& line) {
    const std::lock_guard<std::mutex> lock(warnings.mutex);
    warnings.lines.push_back(line);
  };
  return request;
}

std::vector<uint8_t> bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

}  // namespace

TEST_CASE("two processes with the same secret are admitted and share a key prefix", "[distributed][admission]") {
  const auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string secret = new_run_secret();
  Warnings warnings;
  auto one = std::async(std::launch::async, [&] { return admit(*store, request_for(1, secret, warnings)); });
  const Admission zero = admit(*store, request_for(0, secret, warnings));
  const Admission other = one.get();
  REQUIRE(zero.members.size() == 2);
  REQUIRE(other.members.size() == 2);
  CHECK(zero.members[1].host == "host-1");
  CHECK(other.members[0].host == "host-0");
  CHECK(other.members[1].memory_bytes == 2000.0);
  CHECK(zero.key_prefix == other.key_prefix);
  CHECK(zero.key_prefix.find(to_hex(secret)) == std::string::npos);
  CHECK(warnings.lines.empty());
}

TEST_CASE("a claim without the secret is refused and named; the real process is admitted after it",
          "[distributed][admission]") {
  const auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string secret = new_run_secret();
  Warnings warnings;
  // The stranger claims rank 1 first, with a well-formed body and a tag of its own.
  store->add("nanreplay/admit/1/claims", 1);
  store->set("nanreplay/admit/1/1", bytes(std::string(32, 'x') + std::string(32, '0') + "\t1\tforger"));
  auto one = std::async(std::launch::async, [&] { return admit(*store, request_for(1, secret, warnings)); });
  const Admission zero = admit(*store, request_for(0, secret, warnings));
  CHECK(one.get().key_prefix == zero.key_prefix);
  CHECK(zero.members[1].host == "host-1");
  REQUIRE(warnings.lines.size() == 1);
  CHECK_THAT(warnings.lines[0], Catch::Contains("refused a process claiming rank 1 from host 'forger'"));
}

TEST_CASE("a process with another secret refuses the rendezvous; rank 0 names the rank nobody proved",
          "[distributed][admission]") {
  const auto store = c10::make_intrusive<c10d::HashStore>();
  Warnings warnings;
  AdmissionRequest stranger = request_for(1, new_run_secret(), warnings);
  AdmissionRequest zero = request_for(0, new_run_secret(), warnings);
  zero.timeout = std::chrono::milliseconds(300);
  auto one = std::async(std::launch::async, [&] { return admit(*store, stranger); });
  CHECK_THROWS_WITH(admit(*store, zero), Catch::Contains("no process proved it may be rank 1"));
  CHECK_THROWS_WITH(one.get(), Catch::Contains("does not prove it holds this run's secret"));
}

TEST_CASE("a tagged value verifies only under its key and secret", "[distributed][admission]") {
  const std::string secret = new_run_secret();
  const std::string value = tagged(secret, "p/end", "3\tline");
  std::string text;
  CHECK(untagged(secret, "p/end", value, text));
  CHECK(text == "3\tline");
  CHECK_FALSE(untagged(secret, "p/other", value, text));
  CHECK_FALSE(untagged(new_run_secret(), "p/end", value, text));
  CHECK_FALSE(untagged(secret, "p/end", "3\tforged", text));
}

TEST_CASE("a secret file must be private, and long enough", "[distributed][admission]") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "nanreplay-secret-test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "secret").string();
  std::ofstream(path) << "a secret of this test, long enough\n";
  ::chmod(path.c_str(), 0600);
  CHECK(read_secret_file(path) == "a secret of this test, long enough");
  ::chmod(path.c_str(), 0640);
  CHECK_THROWS_WITH(read_secret_file(path), Catch::Contains("chmod 600"));
  std::ofstream(path) << "short";
  ::chmod(path.c_str(), 0600);
  CHECK_THROWS_WITH(read_secret_file(path), Catch::Contains("shorter than 16 bytes"));
  CHECK_THROWS_AS(read_secret_file((dir / "missing").string()), UsageError);
  std::filesystem::remove_all(dir);
}
