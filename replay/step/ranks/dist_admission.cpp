// Admission to a replay across processes; see dist_admission.h.
//
// On the store, under public names (nanreplay/admit/...):
//   challenge        tag("challenge", N0) N0: rank 0's fresh 16-byte nonce
//   <r>/claims       a counter: each claimant of rank r takes a slot of its own
//   <r>/<slot>       tag("claim", N0, r, body) body; body = Nr, memory, host
//   list             tag("list", N0, bodies) bodies: whom rank 0 admitted
// Tags are HMAC-SHA256 under the secret; every tag covers N0, so nothing
// from another run verifies. A claimant finds its own nonce at its rank in
// the list, or another process took its place.
#include "replay/step/ranks/dist_admission.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "loaders/base/error.h"
#include "replay/step/ranks/distributed.h"
#include "replay/step/ranks/run_secret.h"

namespace nanreplay {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kNonceBytes = 16;
constexpr size_t kLongestClaim = 1024;  // a stranger's value is refused unread past this
constexpr int64_t kMostClaimsRead = 64;  // per rank: a flood of claims is not read for ever
constexpr const char* kAdmitPrefix = "nanreplay/admit/";


std::string admit_key(const std::string& what) { return kAdmitPrefix + what; }
std::string claim_key(int rank, int64_t slot) { return admit_key(std::to_string(rank) + "/" + std::to_string(slot)); }

std::string seconds_text(std::chrono::milliseconds timeout) {
  return std::to_string((timeout.count() + 500) / 1000) + " s";
}

// A claim's body: the claimant's nonce, memory limit and host, one line.
std::string claim_body(const std::string& nonce, const Member& member) {
  std::ostringstream out;
  out.precision(17);
  out << to_hex(nonce) << '\t' << member.memory_bytes << '\t' << member.host;
  return out.str();
}

bool parse_body(const std::string& body, std::string& nonce, Member& member) {
  const size_t first = body.find('\t');
  const size_t second = first == std::string::npos ? first : body.find('\t', first + 1);
  if (second == std::string::npos) return false;
  nonce = from_hex(body.substr(0, first));
  try {
    member.memory_bytes = std::stod(body.substr(first + 1, second - first - 1));
  } catch (const std::exception&) {
    return false;
  }
  member.host = body.substr(second + 1);
  return nonce.size() == kNonceBytes;
}

std::string with_tag(const std::string& secret, const std::string& label, const std::string& body) {
  return hmac_sha256(secret, label + '\0' + body) + body;
}

// The body of `value` when its tag verifies under `label`.
bool verified(const std::string& secret, const std::string& label, const std::string& value, std::string& body) {
  if (value.size() < kHmacTagBytes) return false;
  body = value.substr(kHmacTagBytes);
  return same_tag(value.substr(0, kHmacTagBytes), hmac_sha256(secret, label + '\0' + body));
}

std::string claim_label(const std::string& challenge, int rank) {
  return "claim\t" + challenge + "\t" + std::to_string(rank);
}

// Rank 0: reads the claims for every other rank until each has one that
// verifies; a claim that does not is refused and said on stderr. (A process
// with another secret never claims: the challenge does not verify for it.)
std::vector<Member> collect_claims(c10d::Store& store, const AdmissionRequest& request, const std::string& challenge,
                                   const std::string& own_body, std::vector<std::string>& bodies) {
  const int n = request.world_size;
  std::vector<Member> members(static_cast<size_t>(n));
  members[0] = request.self;
  bodies.assign(static_cast<size_t>(n), "");
  bodies[0] = own_body;
  std::vector<std::set<int64_t>> read(static_cast<size_t>(n));
  std::vector<int> refused(static_cast<size_t>(n), 0);
  const auto deadline = Clock::now() + request.timeout;
  for (int waiting = n - 1; waiting > 0;) {
    for (int r = 1; r < n; ++r) {
      if (!bodies[static_cast<size_t>(r)].empty()) continue;
      const int64_t claims = std::min(store.add(admit_key(std::to_string(r) + "/claims"), 0), kMostClaimsRead);
      for (int64_t slot = 1; slot <= claims && bodies[static_cast<size_t>(r)].empty(); ++slot) {
        if (read[static_cast<size_t>(r)].count(slot) || !store.check({claim_key(r, slot)})) continue;
        read[static_cast<size_t>(r)].insert(slot);
        const std::string value = as_string(store.get(claim_key(r, slot)));
        std::string body, nonce;
        Member member;
        if (value.size() <= kLongestClaim && verified(request.secret, claim_label(challenge, r), value, body) &&
            parse_body(body, nonce, member)) {
          bodies[static_cast<size_t>(r)] = body;
          members[static_cast<size_t>(r)] = member;
          --waiting;
          continue;
        }
        ++refused[static_cast<size_t>(r)];
        Member said;
        parse_body(value.size() > kHmacTagBytes ? value.substr(kHmacTagBytes, 256) : "", nonce, said);
        request.warn("warning: " + request.self_name + ": refused a process claiming rank " + std::to_string(r) +
                     (said.host.empty() ? "" : " from host '" + printable(said.host.substr(0, 64)) + "'") +
                     ": it does not prove it holds this run's secret (a stranger, or a host with another "
                     "--secret-file)");
      }
    }
    if (waiting == 0) break;
    if (Clock::now() > deadline) {
      for (int r = 1; r < n; ++r) {
        if (!bodies[static_cast<size_t>(r)].empty()) continue;
        throw PeerError(request.self_name + ": no process proved it may be rank " + std::to_string(r) + " within " +
                        seconds_text(request.timeout) + " (--dist-timeout)" +
                        (refused[static_cast<size_t>(r)] > 0
                             ? "; refused " + std::to_string(refused[static_cast<size_t>(r)]) +
                                   " claim(s) without this run's secret"
                             : ""));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return members;
}

// Any other rank: claims its rank and waits for rank 0's list.
std::string await_list(c10d::Store& store, const AdmissionRequest& request, const std::string& claim) {
  const std::string claims = admit_key(std::to_string(request.rank) + "/claims");
  const std::string mine = claim_key(request.rank, store.add(claims, 1));
  store.set(mine, as_bytes(claim));
  const auto deadline = Clock::now() + request.timeout;
  while (!store.check({admit_key("list")})) {
    if (Clock::now() > deadline) {
      throw PeerError(request.self_name + ": rank 0 at " + request.rendezvous + " did not admit the processes within " +
                      seconds_text(request.timeout) + " (--dist-timeout)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return as_string(store.get(admit_key("list")));
}

std::string challenge_of(c10d::Store& store, const AdmissionRequest& request) {
  if (request.rank == 0) {
    const std::string nonce = new_run_secret().substr(0, kNonceBytes);
    store.set(admit_key("challenge"), as_bytes(with_tag(request.secret, "challenge", nonce)));
    return nonce;
  }
  const std::string value = as_string(store.get(admit_key("challenge")));
  std::string nonce;
  if (value.size() > kHmacTagBytes + kNonceBytes || !verified(request.secret, "challenge", value, nonce) ||
      nonce.size() != kNonceBytes) {
    throw PeerError(request.self_name + ": the rendezvous at " + request.rendezvous +
                    " does not prove it holds this run's secret (a stranger serves or wrote it, or the hosts "
                    "hold different secrets)");
  }
  return nonce;
}

}  // namespace

Admission admit(c10d::Store& store, const AdmissionRequest& request) {
  const std::string challenge = challenge_of(store, request);
  const std::string own_nonce = new_run_secret().substr(0, kNonceBytes);
  const std::string own_body = claim_body(own_nonce, request.self);
  const std::string list_label = "list\t" + challenge;
  Admission admission;
  std::string list;
  if (request.rank == 0) {
    std::vector<std::string> bodies;
    admission.members = collect_claims(store, request, challenge, own_body, bodies);
    for (const std::string& body : bodies) list += body + "\n";
    store.set(admit_key("list"), as_bytes(with_tag(request.secret, list_label, list)));
  } else {
    const std::string value =
        await_list(store, request, with_tag(request.secret, claim_label(challenge, request.rank), own_body));
    if (!verified(request.secret, list_label, value, list)) {
      throw PeerError(request.self_name + ": the list of admitted processes at " + request.rendezvous +
                      " does not carry this run's tag: a process without the secret wrote it");
    }
    std::istringstream lines(list);
    for (std::string line; std::getline(lines, line);) {
      std::string nonce;
      Member member;
      if (!parse_body(line, nonce, member)) break;
      if (static_cast<int>(admission.members.size()) == request.rank && !same_tag(nonce, own_nonce)) {
        throw PeerError(request.self_name + ": rank 0 admitted another process as rank " +
                        std::to_string(request.rank) + " (from host '" + printable(member.host) + "')");
      }
      admission.members.push_back(member);
    }
    if (static_cast<int>(admission.members.size()) != request.world_size) {
      throw PeerError(request.self_name + ": the list of admitted processes at " + request.rendezvous +
                      " names " + std::to_string(admission.members.size()) + " processes, not " +
                      std::to_string(request.world_size));
    }
  }
  admission.key_prefix = "nanreplay/" + to_hex(hmac_sha256(request.secret, "keys\t" + challenge)).substr(0, 32) + "/";
  return admission;
}

std::string tagged(const std::string& secret, const std::string& key, const std::string& value) {
  return with_tag(secret, "value\t" + key, value);
}

bool untagged(const std::string& secret, const std::string& key, const std::string& value, std::string& text) {
  return verified(secret, "value\t" + key, value, text);
}

}  // namespace nanreplay
