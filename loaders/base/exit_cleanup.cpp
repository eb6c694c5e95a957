// See exit_cleanup.h.
#include "loaders/base/exit_cleanup.h"

#include <map>
#include <mutex>
#include <system_error>

namespace nanreplay {

namespace {

std::mutex g_mutex;
long g_next_id = 0;
struct Registered {
  std::filesystem::path path;
  bool only_if_empty;
};
std::map<long, Registered>& registered() {
  static auto* paths = new std::map<long, Registered>;  // never destroyed: used until _exit
  return *paths;
}

}  // namespace

ExitCleanup::ExitCleanup(std::filesystem::path path, bool only_if_empty) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  id_ = g_next_id++;
  registered().emplace(id_, Registered{std::move(path), only_if_empty});
}

ExitCleanup::~ExitCleanup() { dismiss(); }

void ExitCleanup::dismiss() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  registered().erase(id_);
}

void remove_for_exit() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  for (auto it = registered().rbegin(); it != registered().rend(); ++it) {
    std::error_code ignored;
    if (it->second.only_if_empty) {
      std::filesystem::remove(it->second.path, ignored);  // a non-empty directory stays
    } else {
      std::filesystem::remove_all(it->second.path, ignored);
    }
  }
  registered().clear();
}

}  // namespace nanreplay
