// Who may join a replay across processes (docs/distributed.md, "Who may
// join"): before any tensor is exchanged every process proves on the
// rendezvous store that it holds the run's secret (replay/step/ranks/run_secret.h), and
// rank 0 names the processes it admitted in a list tagged with it. A process
// without the secret can connect to the store but cannot take a rank, and
// the run's own keys live under a prefix only holders of the secret can
// compute.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace c10d {
class Store;
}  // namespace c10d

namespace nanreplay {

struct Member {
  std::string host;
  double memory_bytes = 0;
};

struct Admission {
  std::vector<Member> members;  // in rank order
  std::string key_prefix;       // "nanreplay/<32 hex digits>/": the run's own keys
};

struct AdmissionRequest {
  std::string secret;
  int rank = 0;
  int world_size = 1;
  Member self;
  std::chrono::milliseconds timeout{0};
  std::string self_name;  // "rank 1 (host-b)", for the lines that name this process
  std::string rendezvous;  // "127.0.0.1:29500"
  // A refused claim, as a line for stderr (the run goes on without it).
  std::function<void(const std::string&)> warn;
};

// Every process: returns once rank 0 admitted all of them. PeerError (exit
// 3) when the rendezvous does not prove it holds the secret (a stranger
// wrote it, or this process holds another secret), another process was
// admitted in this one's place, or a rank never proves it in time.
Admission admit(c10d::Store& store, const AdmissionRequest& request);

// The tag a value of the run's key `key` carries (HMAC-SHA256 under the
// secret, bound to the key): `tagged` prepends it, `untagged` checks and
// strips it (false: a value somebody without the secret wrote).
std::string tagged(const std::string& secret, const std::string& key, const std::string& value);
bool untagged(const std::string& secret, const std::string& key, const std::string& value, std::string& text);

}  // namespace nanreplay
